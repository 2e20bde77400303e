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
from pathlib import Path

from .models import ModelSpec, load_model, load_tokenizer, parameter_bytes, read_config


def quantize_gptq(src: str | Path, out: str | Path, texts: list[str], bits: int = 4, group_size: int = 32) -> Path:
    """Quantize the model in ``src`` with calibration ``texts`` and save it (safetensors) to ``out``."""
    os.environ.setdefault("GPTQMODEL_CPU_WORKERS", str(max(1, min(2, os.cpu_count() or 1))))
    from .models import gptq_backend_available

    if not gptq_backend_available():
        raise SystemExit("GPT-QModel is not installed: `pip install -r requirements-gptq.txt` (needs torch >= 2.14.1)")
    from gptqmodel import GPTQModel, QuantizeConfig

    read_config(src)  # a clear error for a bad directory before gptqmodel's own
    tokenizer = load_tokenizer(src)
    calibration = [dict(tokenizer(text)) for text in texts if text.strip()]
    if not calibration:
        raise ValueError("no calibration text: give a few hundred tokens of representative text")
    model = GPTQModel.load(str(src), QuantizeConfig(bits=bits, group_size=group_size), device="cpu")
    model.quantize(calibration, batch_size=1)
    model.save(str(out))
    tokenizer.save_pretrained(str(out))
    return Path(out)


def selftest(workdir: Path) -> dict:
    """Build a tiny Llama, quantize it to INT4 on the CPU, run it through the engine.

    The engine must reproduce the quantized target's own greedy output exactly, with
    a full-precision draft proposing tokens.
    """
    import torch

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
    quantized_layers = sorted({type(m).__name__ for m in target.model.modules() if type(m).__module__.startswith("gptqmodel")})
    prompt = tokenizer("The patient presented with")["input_ids"]
    reference = target.model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=48,
                                      eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()
    results = {}
    for gamma in (1, 3, 5):
        session = generate(target.model, prompt, draft.model, gamma=gamma, max_new_tokens=48)
        iterations = session.stats.iterations
        results[gamma] = {"identical": session.generated_ids == reference, "mean_accepted": session.stats.mean_accepted,
                          "proposed": sum(it.proposed for it in iterations),
                          "accepted": sum(it.accepted for it in iterations)}
    quantization = read_config(q_dir)["quantization_config"]
    return {
        "quant_method": quantization["quant_method"],
        "bits": quantization["bits"],
        "quantized_layers": quantized_layers,
        "int4_bytes": target.size_bytes,
        "fp32_bytes": parameter_bytes(draft.model),
        "gammas": results,
        "identical": all(r["identical"] for r in results.values()),
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
