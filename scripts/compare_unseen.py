"""Per-policy GMEANs and the goal ratios of a policies run, beside the held-out run's (issue 17).

    python scripts/compare_unseen.py [--unseen docs/results/fp32/policies-unseen.json]
        [--heldout docs/results/fp32/policies.json] [--goals docs/results/fp32/goals.json]

GMEAN over code, math, law, medical, general (the goals' workloads) of each policy's paper metric
(``tokens_per_second``) and end-to-end tokens per second, from both ``memspec-bench policies`` JSONs; then
MemSpec over General-Static, MAB-Async and Oracle-Dynamic, and MemSpec's fallback share: the mean over the
workloads of each workload's share as the policies JSON keeps it (pooled since 4 December; a JSON written
before averages its generations' shares), with ``goals.json``'s value pooled over all of them beside it. The
GMEAN and the ratios are the bench's own (``policy_bench.gmean``, ``figures.ratio``: 0 and n/a where a rate is
0).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from memspec_ros.bench.policy_bench import domain_workloads, gmean, share
from memspec_ros.runtime.stats import ratio

ROOT = Path(__file__).resolve().parents[1]
GS, MAB, OD, MS = "general-static", "mab-async", "oracle-dynamic", "memspec"


def summary(result: dict) -> dict:
    table = result["workloads"]
    domains = domain_workloads(list(table))

    def g(p: str, key: str) -> float:
        return gmean([table[w][p][key] for w in domains])

    pol = result["config"]["policies"]
    out = {"domains": domains, "prompts": result["config"]["prompts"],
           "tps": {p: g(p, "tokens_per_second") for p in pol},
           "e2e": {p: g(p, "end_to_end_tokens_per_second") for p in pol}}
    worst = [ratio(table[w][MS]["tokens_per_second"], table[w][MAB]["tokens_per_second"]) for w in domains]
    shares = [table[w][MS]["fallback_fraction"] for w in domains]  # None where nothing was drafted
    out["ratios"] = {
        "MemSpec / General-Static (paper's metric)": ratio(out["tps"][MS], out["tps"][GS]),
        "MemSpec / General-Static (end to end)": ratio(out["e2e"][MS], out["e2e"][GS]),
        "MemSpec / MAB-Async (paper's metric)": ratio(out["tps"][MS], out["tps"][MAB]),
        "MemSpec / MAB-Async (end to end)": ratio(out["e2e"][MS], out["e2e"][MAB]),
        "MemSpec / Oracle-Dynamic (paper's metric)": ratio(out["tps"][MS], out["tps"][OD]),
        "Oracle-Dynamic / General-Static (paper's metric)": ratio(out["tps"][OD], out["tps"][GS]),
        "MemSpec / MAB-Async on the worst workload": None if None in worst else min(worst),
        "MemSpec fallback (mean over the workloads of each one's share)": None if None in shares else sum(
            shares) / len(shares),
    }
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--unseen", type=Path, default=ROOT / "docs/results/fp32/policies-unseen.json")
    ap.add_argument("--heldout", type=Path, default=ROOT / "docs/results/fp32/policies.json")
    ap.add_argument("--goals", type=Path, default=ROOT / "docs/results/fp32/goals.json")
    a = ap.parse_args()
    un, ho = summary(json.loads(a.unseen.read_text())), summary(json.loads(a.heldout.read_text()))
    g = json.loads(a.goals.read_text())
    goals = {r["goal"]: r["measured"] for r in g["rows"]}
    goals["Oracle-Dynamic / General-Static (paper's metric)"] = g["headroom"]["oracle_dynamic_vs_general_static"]
    print(f"GMEAN over {', '.join(un['domains'])}; unseen: {un['prompts']} prompts/workload,"
          f" held-out: {ho['prompts']} prompts/workload\n")
    print("| policy | unseen paper metric (tok/s) | unseen end to end (tok/s) |"
          " held-out paper metric | held-out end to end |")
    print("|---|---:|---:|---:|---:|")
    for p in un["tps"]:
        h = (f"{ho['tps'][p]:.2f} | {ho['e2e'][p]:.2f}") if p in ho["tps"] else "- | -"
        print(f"| {p} | {un['tps'][p]:.2f} | {un['e2e'][p]:.2f} | {h} |")
    print("\n| ratio | unseen | held-out (same JSON fields) | held-out goals.json |")
    print("|---|---:|---:|---:|")
    for k, v in un["ratios"].items():
        pct = "fallback" in k
        fmt = share if pct else (lambda x: "n/a" if x is None else f"{x:.3f}")
        gk = "MemSpec fallback (share of speculative iterations)" if pct else k
        gv = goals.get(gk)
        print(f"| {k} | {fmt(v)} | {fmt(ho['ratios'][k])} | {fmt(gv) if gv is not None else '-'}"
              f"{' (pooled)' if pct and gv is not None else ''} |")


if __name__ == "__main__":
    main()
