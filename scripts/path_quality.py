#!/usr/bin/env python
"""How much each CPU forward path changes the bundled target's answers on this machine.

The quantized paths (``model.quantization``: int8, int4) compute the target in another arithmetic:
weights on a coarser grid and activations rounded to int8 (int8: one
scale per row; int4: one per block of 32, as llama.cpp's Q8_1). Their greedy answers can differ
from the model's as loaded. This scores each path on the as-loaded (fp32) target's own greedy
answers to held-out requests, teacher-forced through the engine's forward:

- answer perplexity (the as-loaded model scores its own answers lowest);
- the share of answer positions where the path's argmax is the as-loaded answer's token;
- how many whole greedy answers the path reproduces token for token (a smaller sample).

    .venv/bin/python scripts/path_quality.py --answers artifacts/heldout_answers \\
        --json docs/results/path-quality-avx2.json

``--answers``: a folder of held-out answers (``memspec-zoo acceptance --answers DIR`` writes them).
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import time
from pathlib import Path

import torch

from memspec_ros.argtypes import name_list, output_file, positive_int
from memspec_ros.runtime import cpu_kernels
from memspec_ros.runtime.loader import load_models
from memspec_ros.runtime.models import QUANTIZATIONS
from memspec_ros.runtime.oracle import engine_continuation_logits
from memspec_ros.runtime.speculative import generate
from memspec_ros.zoo.teacher import load_answers

ROOT = Path(__file__).resolve().parents[1]


@torch.inference_mode()
def score(target, answers, greedy_every: int, end_ids) -> dict:
    nll = tokens = agree = 0
    for a in answers:
        logits = engine_continuation_logits(target, a.prompt_ids, a.answer_ids)
        want = torch.tensor(a.answer_ids)
        nll += float(-torch.log_softmax(logits, -1).gather(1, want[:, None]).sum())
        tokens += len(a.answer_ids)
        agree += int((logits.argmax(-1) == want).sum())
    regenerated = answers[::greedy_every]
    same = sum(generate(target, a.prompt_ids, None, max_new_tokens=len(a.answer_ids),
                        eos_token_ids=end_ids).generated_ids == a.answer_ids for a in regenerated)
    return {"answer_perplexity": math.exp(nll / tokens), "argmax_agreement": agree / tokens,
            "greedy_answers_identical": same, "greedy_answers_compared": len(regenerated), "tokens": tokens}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--answers", type=Path, required=True, help="held-out answers (memspec-zoo acceptance --answers)")
    p.add_argument("--registry", type=Path, default=ROOT / "models" / "registry.yaml")
    p.add_argument("--per-workload", type=positive_int, default=8, help="answers per workload (default 8)")
    p.add_argument("--greedy-every", type=positive_int, default=4,
                   help="regenerate every k-th answer whole (default 4)")
    p.add_argument("--paths", type=name_list, default="none,int8,int4")
    p.add_argument("--threads", type=positive_int, default=2)
    p.add_argument("--json", type=output_file)
    a = p.parse_args()
    if unknown := [q for q in a.paths if q not in QUANTIZATIONS]:  # found after the first path had been scored
        p.error(f"--paths: unknown {', '.join(unknown)}; use {', '.join(QUANTIZATIONS)}")
    torch.set_num_threads(a.threads)
    answers = load_answers(a.answers, "heldout")
    if not answers:
        raise SystemExit(f"no held-out answers in {a.answers} (memspec-zoo acceptance --answers DIR makes them)")
    by_domain: dict[str, list] = {}
    for ans in answers:
        by_domain.setdefault(ans.domain, []).append(ans)
    sample = [ans for d in sorted(by_domain) for ans in by_domain[d][: a.per_workload]]
    rows = {}
    for path in a.paths:
        t0 = time.perf_counter()
        models = load_models(a.registry, quantization=path)
        try:
            rows[path] = score(models.target.model, sample, a.greedy_every, models.end_token_ids)
        finally:
            models.close()
        r = rows[path]
        print(f"{path}: answer perplexity {r['answer_perplexity']:.4f}, argmax = the answer's token"
              f" {r['argmax_agreement']:.2%}, whole answers identical {r['greedy_answers_identical']}"
              f"/{r['greedy_answers_compared']} ({time.perf_counter() - t0:.0f} s)")
    base = rows.get("none")
    if base:
        for r in rows.values():
            r["perplexity_vs_as_loaded"] = r["answer_perplexity"] / base["answer_perplexity"] - 1
    out = {"what": __doc__.split("\n\n")[0], "command": "scripts/path_quality.py " + " ".join(
               f"--{k.replace('_', '-')} {v}" for k, v in vars(a).items() if v is not None and k != "json"),
           "machine": {"cpu": platform.processor() or platform.machine(), "kernels": str(cpu_kernels.status())},
           "answers": len(sample), "workloads": sorted(by_domain), "paths": rows}
    print(json.dumps(out["paths"], indent=2))  # before the write: a failed write loses no figure
    if a.json:
        Path(a.json).parent.mkdir(parents=True, exist_ok=True)
        Path(a.json).write_text(json.dumps(out, indent=2) + "\n")
        print(f"wrote {a.json}")


if __name__ == "__main__":
    main()
