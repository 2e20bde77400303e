"""A goal's first draft on a warm cache: wait for the chosen draft, or run a resident one while it loads.

The node keeps its draft cache between goals. When a goal's predicted draft is not among the K resident
ones, Algorithm 3 taken literally (line 3, "load initial draft") waits for it before decoding; by default the
controller now waits only on a cold cache and otherwise decodes on the best resident draft while the chosen
one loads, as it does at every later scheduling point (runtime/policies.py, ``SchedulingPoint.initial_wait``).
This measures the two side by side in one process, as a robot's node would run them:

- two controllers over the same target, drafts and storage tier, MemSpec, K=2, N=4, gamma 4, greedy, 128 new
  tokens (the policy bench's settings) but with the cache kept between goals; one with
  ``wait_for_initial_draft=True`` (the old behaviour), one without;
- held-out requests taken in turn from each workload, so consecutive goals change domain (the case that
  matters), each sent to both controllers in alternating order;
- after every goal the cache's loads in flight finish before the next goal (the robot's idle gap between
  goals), so neither controller's prefetch runs beside the other's decoding.

Reported per variant: end-to-end and decode tokens/s (runtime/stats.py's two metrics, pooled over goals), the
setup time per goal (policy start, first ranking and any wait for the first draft), how many goals started
with their chosen draft not resident, and whether both wrote the same tokens (greedy: they must).

    .venv/bin/python scripts/warm_start.py --prompts 8 --json docs/results/warm-start.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

from memspec_ros.argtypes import output_file, positive_int
from memspec_ros.bench.policy_bench import workload_prompts
from memspec_ros.runtime.cache import registry_loader
from memspec_ros.runtime.controller import RuntimeConfig
from memspec_ros.runtime.loader import find_predictor, load_models
from memspec_ros.runtime.stats import GenerationTotals, ratio
from memspec_ros.runtime.storage import STORAGE_CHOICES, DraftStorage, storage_medium
from memspec_ros.zoo.corpora import WORKLOADS

VARIANTS = {"wait": True, "resident": False}  # name -> wait_for_initial_draft


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--zoo", default="models")
    parser.add_argument("--prompts", type=positive_int, default=8, help="per workload")
    parser.add_argument("--storage", choices=STORAGE_CHOICES, default="emmc")
    parser.add_argument("--quantization", default="int4", help="target and drafts (make bench's default)")
    parser.add_argument("--max-new-tokens", type=positive_int, default=128)
    parser.add_argument("--json", type=output_file, default=None)
    args = parser.parse_args(argv)

    torch.set_num_threads(1)
    zoo = Path(args.zoo)
    models = load_models(zoo / "registry.yaml", predictor_path=find_predictor(zoo / "predictor"),
                         quantization=args.quantization)
    per_workload = workload_prompts(zoo / "workloads", WORKLOADS, args.prompts, models.tokenizer)
    prompts = [per_workload[w][k] for k in range(args.prompts) for w in WORKLOADS if k < len(per_workload[w])]
    storage = DraftStorage(storage_medium(args.storage))
    loader = registry_loader(models.registry, storage=storage, quantization=args.quantization)
    for name in models.registry.names():  # every draft's first load (the build, then its runtime form) untimed
        loader(name)
    controllers = {
        name: models.controller(
            RuntimeConfig(policy="memspec", capacity=2, interval=4, gamma=4, wait_for_initial_draft=wait,
                          prompt_cache=False),
            loader=loader)
        for name, wait in VARIANTS.items()
    }
    totals = {name: GenerationTotals() for name in VARIANTS}
    setup: dict[str, list[float]] = {name: [] for name in VARIANTS}
    not_resident = dict.fromkeys(VARIANTS, 0)
    waited = dict.fromkeys(VARIANTS, 0.0)  # every blocking wait for a draft, the first one's included
    identical = True
    try:
        for ctl in controllers.values():  # warm: the first goal's cold load is not what is compared
            ctl.generate(prompts[0], 8)
            ctl.cache.drain()
        for i, ids in enumerate(prompts):
            order = list(VARIANTS) if i % 2 == 0 else list(reversed(VARIANTS))
            tokens = {}
            for name in order:
                ctl = controllers[name]
                result = ctl.generate(ids, args.max_new_tokens)
                ctl.cache.drain()
                s = result.stats
                totals[name].add(s)
                setup[name].append(s.setup_seconds)
                waited[name] += s.cache.wait_seconds
                first = s.iterations[0] if s.iterations else None
                if s.cache.wait_seconds > 0 or (first is not None and first.fallback):
                    not_resident[name] += 1
                tokens[name] = result.token_ids
            identical &= len({tuple(t) for t in tokens.values()}) == 1
            print(f"goal {i + 1}/{len(prompts)}: setup " + ", ".join(
                f"{n} {1000 * setup[n][-1]:.1f} ms" for n in VARIANTS), file=sys.stderr)
    finally:
        for ctl in controllers.values():
            ctl.close()
        models.close()

    rows = {name: {
        "wait_for_initial_draft": VARIANTS[name],
        "end_to_end_tokens_per_second": totals[name].end_to_end_tokens_per_second,
        "tokens_per_second": totals[name].tokens_per_second,
        "setup_ms_median": 1000 * statistics.median(setup[name]),
        "setup_ms_mean": 1000 * statistics.fmean(setup[name]),
        "goals_starting_without_their_draft": not_resident[name],
        "fallback_draft_seconds": totals[name].breakdown["fallback_draft"],
        "load_wait_seconds": waited[name],
    } for name in VARIANTS}
    out = {
        "config": {"storage": args.storage, "quantization": args.quantization, "policy": "memspec", "K": 2, "N": 4,
                   "gamma": 4, "max_new_tokens": args.max_new_tokens, "goals": len(prompts),
                   "order": "workloads in turn: " + ", ".join(WORKLOADS), "threads": 1},
        "variants": rows,
        "resident_vs_wait": {metric: ratio(rows["resident"][key], rows["wait"][key]) for metric, key in
                             (("end_to_end", "end_to_end_tokens_per_second"), ("decode", "tokens_per_second"))},
        "outputs_identical": identical,
    }
    print(json.dumps(out, indent=2))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(out, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
