"""How far the zoo's held-out requests are from its training requests, beyond the split by source.

The workloads are split by source (a paragraph, a function, a problem, an ICD code) and training requests that ask
what a held-out request asks (``chat_workloads.request_material``) are dropped. This counts, per held-out workload,
the requests that still come from a file, module or ICD category some training request comes from, and those whose
material shares a run of ``--span`` words with a training request's material (near-copies: a licence clause in two
copyright files, ``ntpath.commonpath`` beside ``posixpath.commonpath``).

    python scripts/workload_overlap.py --json docs/results/workload-overlap.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from memspec_ros.zoo.chat_workloads import request_material
from memspec_ros.zoo.corpora import WORKLOADS


def source_group(source: str) -> str:
    """The file, module or ICD category a request's source names: ``code:ntpath.py:commonpath`` -> ``ntpath.py``,
    ``medical:L414`` -> ``L41``, ``law:/usr/share/doc/x/copyright#8`` -> the file."""
    domain, _, rest = source.partition(":")
    if domain == "code":
        return rest.split(":")[0]
    if domain == "medical":
        return rest[:3]
    return rest.split("#")[0]


def spans(text: str, words: int) -> set[str]:
    w = text.split()
    return {" ".join(w[i : i + words]) for i in range(len(w) - words + 1)}


def overlap(workloads: Path, train_rows: int, words: int) -> dict:
    built = json.loads((workloads.parent / "build_config.json").read_text()) if (
        workloads.parent / "build_config.json").is_file() else {}
    limit = train_rows or built.get("teacher_train_requests") or None
    lines = (workloads / "train_requests.jsonl").read_text().splitlines()[:limit]
    train = [json.loads(line) for line in lines if line.strip()]
    groups: dict[str, set[str]] = {}
    train_spans: set[str] = set()
    for row in train:
        groups.setdefault(row["domain"], set()).add(source_group(row["source"]))
        for material in request_material(row["prompt"]):
            train_spans |= spans(material, words)
    out = {"training_requests": len(train), "span_words": words, "workloads": {}}
    for w in WORKLOADS:
        rows = [json.loads(line) for line in (workloads / f"{w}.jsonl").read_text().splitlines() if line.strip()]
        near = sum(bool(set().union(*(spans(m, words) for m in request_material(r["prompt"]))) & train_spans)
                   for r in rows)
        entry = {"requests": len(rows), "material_shares_a_span": near}
        if w != "mixed":  # a mixed request's source names two
            entry["same_file_module_or_category"] = sum(source_group(r["source"]) in groups.get(w, set())
                                                        for r in rows)
        out["workloads"][w] = entry
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workloads", type=Path, default=Path("models/workloads"))
    parser.add_argument("--train-rows", type=int, default=0,
                        help="training requests counted (0: those the build answered, build_config.json)")
    parser.add_argument("--span", type=int, default=12, help="words in a shared run (default 12)")
    parser.add_argument("--json", type=Path, help="write the counts here")
    args = parser.parse_args()
    if args.json and not args.json.parent.is_dir():
        raise SystemExit(f"--json: no folder {args.json.parent}")
    result = overlap(args.workloads, args.train_rows, args.span)
    text = json.dumps(result, indent=1)
    if args.json:
        args.json.write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
