"""The acceptance matrix of a chat zoo, from the target's stored answers to the held-out requests.

Same definitions and JSON keys as :mod:`.acceptance` (its docstring defines
them); the continuation of each request is the target's greedy answer as the
teacher stored it (chat template applied, up to the end-of-turn token or
``max_new_tokens``), and each draft's agreement comes from one teacher-forced
forward over request + answer.  For greedy decoding this is exactly the
engine's acceptance: a draft that agrees with the answer on the next k tokens
proposes exactly those tokens.
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from pathlib import Path
from statistics import mean

import torch

from .acceptance import dynamic_walk, plot_matrix, repeated_ngram_fraction, static_score
from .chat_drafts import answer_agreement
from .corpora import DOMAINS, WORKLOADS
from .teacher import Answer


def _gain(value: float, base: float) -> float | None:
    """value / base - 1; None where the base accepts nothing (no ratio to report)."""
    return value / base - 1 if base > 0 else None


def chat_acceptance(drafts: dict[str, torch.nn.Module], answers: Sequence[Answer], gamma: int = 4,
                    interval: int = 4, per_workload: int = 100) -> dict:
    """The matrix and the oracle gains over ``answers`` grouped by their ``domain`` (= workload)."""
    from tqdm import tqdm

    by_workload: dict[str, list[Answer]] = {w: [] for w in WORKLOADS}
    for a in answers:
        if a.domain in by_workload and len(by_workload[a.domain]) < per_workload:
            by_workload[a.domain].append(a)
    missing = [w for w, rows in by_workload.items() if not rows]
    if missing:
        raise ValueError(f"no held-out answers for workload(s) {', '.join(missing)}")
    names = [d for d in DOMAINS if d in drafts]
    if "general" not in names:
        raise ValueError("the zoo has no 'general' draft: the gains are measured against it")
    t0 = time.time()
    per_prompt: dict[str, list[dict]] = {}
    for w, rows in by_workload.items():
        per_prompt[w] = []
        for a in tqdm(rows, desc=f"acceptance {w}", mininterval=10):
            if len(a.answer_ids) < 2:
                continue
            agreement = {d: answer_agreement(drafts[d], a) for d in names}
            rec = {"tokens": len(a.answer_ids),
                   "accepted_per_iteration": {d: static_score(agreement[d], gamma)[0] for d in names},
                   "repeated_4gram": repeated_ngram_fraction(a.answer_ids)}
            if w == "mixed":
                rec["dynamic"], rec["dynamic_choices"] = dynamic_walk(agreement, gamma, interval)
            per_prompt[w].append(rec)
    matrix = {d: {w: mean(r["accepted_per_iteration"][d] for r in per_prompt[w]) for w in WORKLOADS} for d in names}
    best_static = {w: mean(max(r["accepted_per_iteration"].values()) for r in per_prompt[w]) for w in WORKLOADS}
    static_gain = {w: _gain(best_static[w], matrix["general"][w]) for w in DOMAINS}
    dyn_mixed = mean(r["dynamic"] for r in per_prompt["mixed"])
    return {
        "config": {"gamma": gamma, "interval": interval, "per_workload": per_workload,
                   "continuations": "the target's stored greedy chat answers (teacher)"},
        "definitions": __doc__,
        "matrix": matrix,
        "best_fixed_per_prompt": best_static,
        "oracle_static_gain_by_workload": static_gain,
        "oracle_static_gain": mean(g for g in static_gain.values() if g is not None) if all(
            g is not None for g in static_gain.values()) else None,
        "oracle_dynamic_mixed": dyn_mixed,
        "oracle_dynamic_gain_mixed": _gain(dyn_mixed, best_static["mixed"]),
        "domain_gain_over_general": {d: {w: _gain(matrix[d][w], matrix["general"][w]) for w in DOMAINS}
                                     for d in names if d != "general"},
        "gain_ceiling_over_general": {w: _gain(gamma, matrix["general"][w]) for w in WORKLOADS},
        "repeated_4gram_fraction": {w: mean(r["repeated_4gram"] for r in per_prompt[w]) for w in WORKLOADS},
        "mean_generated_tokens": {w: mean(r["tokens"] for r in per_prompt[w]) for w in WORKLOADS},
        "wall_seconds": round(time.time() - t0, 1),
        "per_prompt": per_prompt,
    }


def write_acceptance(result: dict, out_json: Path, plot_path: Path | None = None) -> None:
    out_json.parent.mkdir(parents=True, exist_ok=True)
    out_json.write_text(json.dumps(result, indent=1))
    if plot_path is not None:
        plot_matrix(result, plot_path)
