"""Interleaved A/B of weighing a copy against the draft (runtime/gamma_choice.py: GammaChooser.choose_copy), in one
process on the same prompts: adaptive gamma with context lookup and the zoo's datastore (the node's defaults), a
copy proposed only when its expected tokens per millisecond reach the draft's ("weigh", the engine's rule) against
a copy proposed whenever it beats a plain target step ("take"). Each domain's held-out requests run with that
domain's own draft, both arms back to back, the order alternating per request; decode tokens/s are summed over the
requests; the outputs must be identical (both are the target's own greedy output).

    python scripts/ab_copy_weighing.py --domains math,code,law,medical,general --prompts 24 \\
        --json docs/results/ab-copy-weighing.json

A one-off variant that kept one acceptance estimate per match length (a copy after a 4-token match stands more
often than after a 2-token one) was not better than the shared estimate: GMEAN 1.005x and 0.997x in two one-off
interleaved runs (per domain 0.963-1.043x), so it was not kept.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from memspec_ros.bench.cli import round_robin_prompts
from memspec_ros.bench.policy_bench import gmean
from memspec_ros.runtime import speculative as sp
from memspec_ros.runtime.datastore import Datastore
from memspec_ros.runtime.gamma_choice import GammaChooser
from memspec_ros.runtime.loader import find_datastore, load_models
from memspec_ros.runtime.lookup import LookupConfig
from memspec_ros.runtime.models import ModelSpec, load_model
from memspec_ros.runtime.stats import GenerationTotals, ratio

ARMS = ("weigh", "take")
WEIGH = GammaChooser.choose_copy


def _take(self, costs, name, limit, rival="", rival_costs=None):  # the copy against a plain step only
    return WEIGH(self, costs, name, limit)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--zoo", default="models")
    parser.add_argument("--domains", default="math,code,law,medical,general")
    parser.add_argument("--prompts", type=int, default=24, help="held-out requests per domain")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--json", default="")
    parser.add_argument("--work", default="artifacts/ab_copy_weighing", help="one-workload folders go here")
    args = parser.parse_args(argv)
    if args.prompts < 1:
        parser.error("--prompts must be at least 1")
    torch.set_num_threads(1)
    zoo = Path(args.zoo)
    models = load_models(zoo / "registry.yaml", quantization="int4", gamma=4, validate=False)
    tok, target = models.tokenizer, models.target.model
    store_path = find_datastore(zoo)
    if not store_path:
        parser.error(f"{zoo} has no datastore to copy from")
    store = Datastore.load(store_path)
    results: dict[str, dict] = {}
    try:
        for dom in args.domains.split(","):
            draft = load_model(ModelSpec(models.registry.get(dom).path, dtype=models.draft_dtype,
                                         quantization="int4")).model
            folder = Path(args.work) / dom
            folder.mkdir(parents=True, exist_ok=True)
            (folder / f"{dom}.jsonl").write_text((zoo / "workloads" / f"{dom}.jsonl").read_text())
            prompts = round_robin_prompts(tok, folder, args.prompts)

            def run(ids, arm, dom=dom, draft=draft):
                GammaChooser.choose_copy = _take if arm == "take" else WEIGH
                s = sp.generate(target, ids, draft, draft_name=dom, gamma=4, max_new_tokens=args.max_new_tokens,
                                adaptive_gamma=True, lookup=LookupConfig(), datastores=(store,),
                                eos_token_ids=[tok.eos_token_id])
                return s.generated_ids, s.stats

            for arm in ARMS:  # warm-up: the cost curves are timed at a model's first adaptive generation
                run(prompts[0], arm)
            totals = {a: GenerationTotals() for a in ARMS}  # pooled, as every figure (runtime/stats.py)
            identical = True
            for i, ids in enumerate(prompts):
                out = {}
                for arm in ARMS if i % 2 == 0 else ARMS[::-1]:
                    out[arm], stats = run(ids, arm)
                    totals[arm].add(stats)
                identical &= out["weigh"] == out["take"]
            row = {arm: {"decode_tps": totals[arm].tokens_per_second, "mean_accepted": totals[arm].mean_accepted}
                   for arm in ARMS}
            row["weigh_over_take"] = ratio(row["weigh"]["decode_tps"], row["take"]["decode_tps"])
            row["outputs_identical"] = identical
            results[dom] = row
            over = "n/a" if row["weigh_over_take"] is None else f"{row['weigh_over_take']:.3f}x"
            print(f"{dom}: weigh {row['weigh']['decode_tps']:.1f} tok/s, take {row['take']['decode_tps']:.1f} "
                  f"({over}), outputs identical: {identical}  {time.strftime('%T')}", flush=True)
    finally:
        GammaChooser.choose_copy = WEIGH
    ratios = [r["weigh_over_take"] for r in results.values()]
    summary = {"command": " ".join(sys.argv), "prompts_per_domain": args.prompts, "domains": results,
               "gmean_weigh_over_take": gmean([r or 0.0 for r in ratios])}
    print(f"GMEAN weigh / take: {summary['gmean_weigh_over_take']:.3f} (0: a zero rate)")
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=1) + "\n")
    return 0 if all(r["outputs_identical"] for r in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
