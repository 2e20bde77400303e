"""GPTQ INT4 quantization of a target through GPT-QModel, and an end-to-end self-check.

GPT-QModel is the maintained GPTQ backend (auto-gptq is archived; transformers 5
loads GPTQ checkpoints through gptqmodel only). It needs torch >= 2.14.1, so on
this project's dev machines it lives in its own environment (``.venv-gptq``,
from ``requirements-gptq.txt``); on a robot it is installed beside the node.

    python -m memspec_ros.runtime.gptq quantize SRC OUT --calibration FILE.jsonl
    python -m memspec_ros.runtime.gptq selftest --workdir DIR   # what the test suite runs
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path

import torch

from .models import ModelSpec, load_model, load_tokenizer, parameter_bytes, read_config


def quantize_gptq(src: str | Path, out: str | Path, texts: Sequence[str | Sequence[int]], bits: int = 4,
                  group_size: int = 32) -> Path:
    """Quantize the model in ``src`` with calibration ``texts`` and save it (safetensors) to ``out``.

    Each calibration item is a text (tokenized with the model's tokenizer) or a sequence of token
    ids used as it is (e.g. a chat request through the template followed by the model's answer).
    """
    os.environ.setdefault("GPTQMODEL_CPU_WORKERS", str(max(1, min(2, os.cpu_count() or 1))))
    from .models import gptq_backend_available

    if not gptq_backend_available():
        raise SystemExit("GPT-QModel is not installed: `pip install -r requirements-gptq.txt` (needs torch >= 2.14.1)")
    from gptqmodel import GPTQModel, QuantizeConfig

    read_config(src)  # a clear error for a bad directory before gptqmodel's own
    tokenizer = load_tokenizer(src)
    calibration = [dict(tokenizer(text)) if isinstance(text, str)
                   else {"input_ids": [int(t) for t in text], "attention_mask": [1] * len(text)}
                   for text in texts if (text.strip() if isinstance(text, str) else len(text))]
    if not calibration:
        raise ValueError("no calibration text: give a few hundred tokens of representative text")
    model = GPTQModel.load(str(src), QuantizeConfig(bits=bits, group_size=group_size), device="cpu")
    model.quantize(calibration, batch_size=1)
    model.save(str(out))
    tokenizer.save_pretrained(str(out))
    return Path(out)


MAX_VERIFY_ROWS = 9  # as runtime/forward_paths.py: a verify feeds gamma + 1 rows, gamma up to 8


def _gptq_linears(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    return [(n, m) for n, m in model.named_modules() if type(m).__module__.startswith("gptqmodel")
            and hasattr(m, "in_features") and hasattr(m, "out_features")]


def _one_row_at_a_time(module: torch.nn.Module) -> None:
    """Make ``module`` compute a call of 2..MAX_VERIFY_ROWS rows one row at a time (prefills stay batched)."""
    forward = module.forward

    def rowwise(x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1])
        if not 1 < rows.shape[0] <= MAX_VERIFY_ROWS:
            return forward(x)
        return torch.cat([forward(rows[i:i + 1]) for i in range(rows.shape[0])]).reshape(*x.shape[:-1], -1)

    module.forward = rowwise


def prepare_for_engine(model: torch.nn.Module) -> dict:
    """Make a loaded GPTQ model compute a verify's rows exactly as one-token steps, so that
    speculative decoding reproduces its own greedy output; returns what was done.

    The engine runs a GPTQ target through transformers' forward (its lean path takes plain linears
    only). Measured on SmolLM2-135M with bf16 activations (GPT-QModel's fused AVX512 kernel):
    transformers' SDPA attention over a cached prefix gives a 5-row verify other last digits than
    five one-row steps (29 of 36 probes), and the engine's output then differed from the target's
    own on 2 of 6 prompts; eager attention (q.k^T, fp32 softmax, .v as separate matmuls) matched in
    36 of 36 and on every prompt. So attention becomes eager. GPT-QModel's linears are probed per
    shape with 2..MAX_VERIFY_ROWS rows against one row at a time, and a shape whose kernel differs
    runs such calls row by row (the engine's forward paths do the same, runtime/forward_paths.py).
    """
    done = {"attention": getattr(model.config, "_attn_implementation", None), "rows_one_by_one": []}
    if done["attention"] != "eager":
        model.set_attn_implementation("eager")
        done["attention"] = "eager"
    dtype = next(model.parameters()).dtype
    if dtype not in (torch.float16, torch.bfloat16):
        dtype = torch.float32
    by_shape: dict[tuple, list[tuple[str, torch.nn.Module]]] = {}
    for name, module in _gptq_linears(model):
        by_shape.setdefault((type(module).__name__, module.in_features, module.out_features), []).append((name, module))
    with torch.inference_mode():
        for (_, n_in, _), modules in by_shape.items():
            probe = torch.randn(1, MAX_VERIFY_ROWS, n_in, generator=torch.Generator().manual_seed(1)).to(dtype)
            first = modules[0][1]
            alone = torch.cat([first(probe[:, i:i + 1]) for i in range(MAX_VERIFY_ROWS)], dim=1)
            if not all(torch.equal(first(probe[:, :m]), alone[:, :m]) for m in range(2, MAX_VERIFY_ROWS + 1)):
                for name, module in modules:
                    _one_row_at_a_time(module)
                    done["rows_one_by_one"].append(name)
    return done


def selftest(workdir: Path) -> dict:
    """Build a tiny Llama, quantize it to INT4 on the CPU, run it through the engine.

    The engine must reproduce the quantized target's own greedy output exactly, with
    a full-precision draft proposing tokens: with fp32 activations as load_model gives it
    (against transformers' generate), and with bf16 activations after prepare_for_engine
    (against the engine's own target-alone decoding).
    """
    from ..testing.tiny_models import TINY_TEXT, save_model_dir, tiny_llama, tiny_tokenizer
    from .speculative import generate

    torch.manual_seed(0)
    tokenizer = tiny_tokenizer()
    fp_dir = save_model_dir(tiny_llama(vocab_size=len(tokenizer), hidden=128, layers=2, seed=0, init_range=0.05),
                            tokenizer, workdir / "fp")
    q_dir = quantize_gptq(fp_dir, workdir / "int4", TINY_TEXT * 8)
    target = load_model(ModelSpec(str(q_dir), quantization="gptq"))
    draft = load_model(ModelSpec(str(fp_dir)))
    # layers GPT-QModel swapped in (e.g. TorchCpuAvx512Linear): proof the INT4 kernel really runs
    quantized_layers = sorted(
        {type(m).__name__ for m in target.model.modules() if type(m).__module__.startswith("gptqmodel")}
    )
    prompt = tokenizer("The patient presented with")["input_ids"]
    ids = torch.tensor([prompt])  # an explicit mask: generate() would mask prompt tokens equal to the pad id
    reference = target.model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=48,
                                      eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()
    results = {}
    for gamma in (1, 3, 5):
        session = generate(target.model, prompt, draft.model, gamma=gamma, max_new_tokens=48)
        iterations = session.stats.iterations
        results[gamma] = {"identical": session.generated_ids == reference, "mean_accepted": session.stats.mean_accepted,
                          "proposed": sum(it.proposed for it in iterations),
                          "accepted": sum(it.accepted for it in iterations)}
    # bf16 activations: GPT-QModel's fused CPU kernel (fp32 ones dequantize each call), made
    # row-consistent for the engine by prepare_for_engine
    target16 = load_model(ModelSpec(str(q_dir), dtype="bf16", quantization="gptq"))
    prepared = prepare_for_engine(target16.model)
    alone16 = generate(target16.model, prompt, None, max_new_tokens=48).generated_ids
    bf16 = {"prepared": prepared, "gammas": {}}
    for gamma in (1, 3, 5):
        session = generate(target16.model, prompt, draft.model, gamma=gamma, max_new_tokens=48)
        bf16["gammas"][gamma] = {"identical": session.generated_ids == alone16,
                                 "proposed": sum(it.proposed for it in session.stats.iterations)}
    bf16["identical"] = all(r["identical"] for r in bf16["gammas"].values())
    quantization = read_config(q_dir)["quantization_config"]
    return {
        "quant_method": quantization["quant_method"],
        "bits": quantization["bits"],
        "quantized_layers": quantized_layers,
        "int4_bytes": target.size_bytes,
        "fp32_bytes": parameter_bytes(draft.model),
        "gammas": results,
        "bf16": bf16,
        "identical": all(r["identical"] for r in results.values()) and bf16["identical"],
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m memspec_ros.runtime.gptq", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    q = sub.add_parser("quantize", help="quantize a model directory to GPTQ INT4")
    q.add_argument("src")
    q.add_argument("out")
    q.add_argument("--calibration", required=True, help="JSONL with a 'prompt' or 'text' field per line")
    q.add_argument("--bits", type=int, default=4)
    q.add_argument("--group-size", type=int, default=32)
    s = sub.add_parser("selftest", help="quantize a tiny model and check the engine is lossless on it")
    s.add_argument("--workdir", required=True)
    args = parser.parse_args(argv)
    if args.command == "quantize":
        lines = Path(args.calibration).read_text().splitlines()
        texts = [(rec.get("text") or rec.get("prompt") or "") for rec in map(json.loads, filter(str.strip, lines))]
        quantize_gptq(args.src, args.out, texts, args.bits, args.group_size)
        return 0
    report = selftest(Path(args.workdir))
    print("SELFTEST " + json.dumps(report))
    return 0 if report["identical"] else 1


if __name__ == "__main__":
    sys.exit(main())
