"""GPTQ INT4 from the command line: quantize a model directory, or run the end-to-end self-check.

    python -m memspec_ros.zoo.gptq_cli quantize SRC OUT --calibration FILE.jsonl
    python -m memspec_ros.zoo.gptq_cli selftest --workdir DIR   # what the test suite runs (in .venv-gptq)

The library (quantize_gptq, prepare_for_engine) is runtime/gptq.py; quantizing the bundled target on the
zoo's training requests is ``memspec-zoo gptq`` (zoo/gptq_target.py).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from ..argtypes import group_size
from ..runtime.gptq import prepare_for_engine, quantize_gptq
from ..runtime.models import ModelSpec, load_model, parameter_bytes, read_config
from ..runtime.speculative import generate
from ..testing.tiny_models import TINY_TEXT, save_model_dir, tiny_llama, tiny_tokenizer


def selftest(workdir: Path) -> dict:
    """Build a tiny Llama, quantize it to INT4 on the CPU, run it through the engine.

    The engine must reproduce the quantized target's own greedy output exactly, with
    a full-precision draft proposing tokens: with fp32 activations as load_model gives it
    (against transformers' generate), and with bf16 activations after prepare_for_engine
    (against the engine's own target-alone decoding).
    """
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
    # row-consistent for the engine by load_model itself (prepare_for_engine; calling it again changes nothing)
    target16 = load_model(ModelSpec(str(q_dir), dtype="bf16", quantization="gptq"))
    prepared = target16.prepared
    bf16_again = prepare_for_engine(target16.model)
    alone16 = generate(target16.model, prompt, None, max_new_tokens=48).generated_ids
    bf16 = {"prepared": prepared, "prepared_by_load_model": prepared is not None and target.prepared is not None,
            "idempotent": bf16_again == prepared, "gammas": {}}
    for gamma in (1, 3, 5):
        session = generate(target16.model, prompt, draft.model, gamma=gamma, max_new_tokens=48)
        bf16["gammas"][gamma] = {"identical": session.generated_ids == alone16,
                                 "proposed": sum(it.proposed for it in session.stats.iterations)}
    bf16["identical"] = all(r["identical"] for r in bf16["gammas"].values()) and bf16["idempotent"]
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
    parser = argparse.ArgumentParser(prog="python -m memspec_ros.zoo.gptq_cli", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    q = sub.add_parser("quantize", help="quantize a model directory to GPTQ INT4")
    q.add_argument("src")
    q.add_argument("out")
    q.add_argument("--calibration", required=True, help="JSONL with a 'prompt' or 'text' field per line")
    q.add_argument("--bits", type=int, choices=(2, 3, 4, 8), default=4, help="GPTQ bits (default 4)")
    q.add_argument("--group-size", type=group_size, default=32,
                   help="input columns per scale, or -1 for one group per row (default 32)")
    s = sub.add_parser("selftest", help="quantize a tiny model and check the engine is lossless on it")
    s.add_argument("--workdir", required=True)
    args = parser.parse_args(argv)
    if args.command == "quantize":
        src, out = Path(args.src).resolve(), Path(args.out).resolve()
        if out.is_relative_to(src):  # the checkpoint would be written over (or into) its own source
            parser.error(f"OUT {args.out} is SRC {args.src} or inside it: name a new folder")
        if out.exists() and (not out.is_dir() or any(out.iterdir())):  # GPT-QModel writes over what is there
            parser.error(f"OUT {args.out} already exists and is not an empty folder: name a new folder")
        from memspec_ros.runtime.jsonl import WorkloadFileError, read_jsonl

        def has_text(row: dict) -> str | None:  # a chat row ({"messages"}) became "" and then "no calibration text"
            return None if isinstance(row.get("text") or row.get("prompt"), str) else 'needs a "text" or "prompt"'

        try:
            rows = read_jsonl(args.calibration, row_check=has_text)
        except (OSError, WorkloadFileError) as exc:
            parser.error(f"--calibration: {exc}")
        quantize_gptq(args.src, args.out, [r.get("text") or r["prompt"] for r in rows], args.bits, args.group_size)
        return 0
    report = selftest(Path(args.workdir))
    print("SELFTEST " + json.dumps(report))
    return 0 if report["identical"] else 1


if __name__ == "__main__":
    sys.exit(main())
