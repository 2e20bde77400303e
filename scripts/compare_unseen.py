"""Per-policy GMEANs and the goal ratios of a policies run, beside the held-out run's (issue 17).

    python scripts/compare_unseen.py [--unseen docs/results/fp32/policies-unseen.json]
        [--heldout docs/results/fp32/policies.json] [--goals docs/results/fp32/goals.json]

GMEAN over code, math, law, medical, general (the goals' workloads) of each policy's paper metric
(``tokens_per_second``) and end-to-end tokens per second, from both ``memspec-bench policies``
JSONs; then MemSpec over General-Static, MAB-Async and Oracle-Dynamic, and MemSpec's fallback
share. The policies JSON keeps a per-workload mean of each generation's fallback share, not the
pooled count ``goals.json`` reports, so the fallback row gives that mean for both runs and
``goals.json``'s pooled value beside it.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOMAINS = ("code", "math", "law", "medical", "general")
GS, MAB, OD, MS = "general-static", "mab-async", "oracle-dynamic", "memspec"


def gmean(xs: list[float]) -> float:
    return math.exp(sum(math.log(x) for x in xs) / len(xs))


def summary(result: dict) -> dict:
    table = result["workloads"]
    domains = [w for w in DOMAINS if w in table]

    def g(p: str, key: str) -> float:
        return gmean([table[w][p][key] for w in domains])

    pol = result["config"]["policies"]
    out = {"domains": domains, "prompts": result["config"]["prompts"],
           "tps": {p: g(p, "tokens_per_second") for p in pol},
           "e2e": {p: g(p, "end_to_end_tokens_per_second") for p in pol}}
    out["ratios"] = {
        "MemSpec / General-Static (paper's metric)": out["tps"][MS] / out["tps"][GS],
        "MemSpec / General-Static (end to end)": out["e2e"][MS] / out["e2e"][GS],
        "MemSpec / MAB-Async (paper's metric)": out["tps"][MS] / out["tps"][MAB],
        "MemSpec / MAB-Async (end to end)": out["e2e"][MS] / out["e2e"][MAB],
        "MemSpec / Oracle-Dynamic (paper's metric)": out["tps"][MS] / out["tps"][OD],
        "Oracle-Dynamic / General-Static (paper's metric)": out["tps"][OD] / out["tps"][GS],
        "MemSpec / MAB-Async on the worst workload": min(
            table[w][MS]["tokens_per_second"] / table[w][MAB]["tokens_per_second"] for w in domains),
        "MemSpec fallback (mean per-generation share)": sum(
            table[w][MS]["fallback_fraction"] for w in domains) / len(domains),
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
        fmt = (lambda x: f"{100 * x:.1f}%") if pct else (lambda x: f"{x:.3f}")
        gk = "MemSpec fallback (share of speculative iterations)" if pct else k
        gv = goals.get(gk)
        print(f"| {k} | {fmt(v)} | {fmt(ho['ratios'][k])} | {fmt(gv) if gv is not None else '-'}"
              f"{' (pooled)' if pct and gv is not None else ''} |")


if __name__ == "__main__":
    main()
