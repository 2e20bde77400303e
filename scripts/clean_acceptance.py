"""The acceptance matrix without the held-out requests a zoo's drafts trained on (by material).

The committed zoo's workloads were split by source, so some held-out requests ask about the same paragraph, clause
or problem as a training request it answered (chat_workloads.request_material). This re-aggregates a committed
``memspec-zoo acceptance`` JSON (its per-prompt records, in the workload files' order) over the held-out requests
whose material no training request of the build asked, with the same definitions (chat_acceptance.acceptance_summary),
and beside it the same figures over every prompt (which must equal the committed ones) and over the contaminated ones.

    python scripts/clean_acceptance.py --zoo models --json docs/results/acceptance-clean-heldout.json \
        --write-workloads artifacts/clean-workloads    # the clean held-out requests, for --workloads-dir
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from memspec_ros.zoo.chat_acceptance import acceptance_summary, trained_material
from memspec_ros.zoo.chat_workloads import request_material


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--zoo", default="models")
    parser.add_argument("--acceptance", default="", help="default: <zoo>/acceptance.json")
    parser.add_argument("--json", default="")
    parser.add_argument("--write-workloads", default="", metavar="DIR",
                        help="also write each workload's clean held-out requests as DIR/<workload>.jsonl")
    args = parser.parse_args(argv)
    zoo = Path(args.zoo)
    result = json.loads(Path(args.acceptance or zoo / "acceptance.json").read_text())
    built = json.loads((zoo / "build_config.json").read_text())
    trained = built.get("teacher_train_requests") or None
    lines = (zoo / "workloads" / "train_requests.jsonl").read_text().splitlines()[:trained]
    seen = trained_material(zoo)
    workloads = result["config"]["workloads"]
    names = list(result["matrix"])
    gamma = result["config"]["gamma"]
    split: dict[str, dict[str, list[dict]]] = {"all": {}, "clean": {}, "contaminated": {}}
    counts = {}
    for w in workloads:
        rows = [json.loads(x) for x in (zoo / "workloads" / f"{w}.jsonl").read_text().splitlines() if x.strip()]
        records = result["per_prompt"][w]
        if len(records) != len(rows):
            parser.error(f"{w}: {len(records)} per-prompt records for {len(rows)} requests: cannot pair them")
        dirty = [bool(request_material(r["prompt"]) & seen) for r in rows]
        if args.write_workloads:
            folder = Path(args.write_workloads)
            folder.mkdir(parents=True, exist_ok=True)
            (folder / f"{w}.jsonl").write_text("".join(json.dumps(r, ensure_ascii=False) + "\n"
                                                       for r, d in zip(rows, dirty, strict=True) if not d))
        split["all"][w] = records
        split["clean"][w] = [rec for rec, d in zip(records, dirty, strict=True) if not d]
        split["contaminated"][w] = [rec for rec, d in zip(records, dirty, strict=True) if d]
        counts[w] = {"requests": len(rows), "contaminated": sum(dirty),
                     "contaminated_in_first_24": sum(dirty[:24])}
    summaries = {k: acceptance_summary(v, names, workloads, gamma) for k, v in split.items() if k != "contaminated"}
    contaminated = {w: {d: (sum(r["accepted_per_iteration"][d] for r in recs) / len(recs)) for d in names}
                    for w, recs in split["contaminated"].items() if recs}
    assert summaries["all"]["matrix"] == result["matrix"], "the records do not give the committed matrix"
    out = {"command": " ".join(sys.argv), "training_requests_seen": len(lines), "counts": counts,
           "clean": summaries["clean"], "all": {k: summaries["all"][k] for k in
                                                ("matrix", "oracle_static_gain", "oracle_dynamic_gain_mixed",
                                                 "domain_gain_over_general")},
           "contaminated_matrix": contaminated}
    for key in ("all", "clean"):
        s = summaries[key]
        gains = {d: round(100 * s["domain_gain_over_general"][d][d], 1) for d in names if d not in ("general",)
                 and d in s["domain_gain_over_general"] and d in s["domain_gain_over_general"][d]}
        print(f"{key}: general on its workloads "
              + ", ".join(f"{w} {s['matrix']['general'][w]:.3f}" for w in workloads)
              + f"; own-domain gain % {gains}; oracle_static_gain {s['oracle_static_gain']:.3f};"
              f" oracle_dynamic_gain_mixed {s['oracle_dynamic_gain_mixed']:.3f}")
    print("contaminated held-out requests:", {w: c["contaminated"] for w, c in counts.items()})
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
