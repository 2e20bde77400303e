"""The acceptance matrix of a chat zoo, from the target's stored answers to the held-out requests.

Same definitions and JSON keys as :mod:`.acceptance` (its docstring defines
them); the continuation of each request is the target's greedy answer as the
teacher stored it (chat template applied, up to the end-of-turn token or
``max_new_tokens``), and each draft's agreement comes from one teacher-forced
forward over request + answer.  For greedy decoding this is exactly the
engine's acceptance: a draft that agrees with the answer on the next k tokens
proposes exactly those tokens.

Workloads are the zoo's held-out ones by default; ``--workloads-dir`` takes any
folder of ``<name>.jsonl`` files ({"domain", "prompt"} rows or chat rows with
"messages"), each file one workload named by its file (:func:`workload_rows`); the
target's answers to them are made once and kept under a key of their content
(:func:`answers_cache_dir`). The domain figures (oracle-static gain, domain gains)
then cover every workload but ``mixed``, and the dynamic figures need a ``mixed``
file (null without one).
"""

from __future__ import annotations

import hashlib
import json
import time
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from statistics import mean

import torch

from .acceptance import dynamic_walk, plot_matrix, repeated_ngram_fraction, static_score
from .chat_drafts import answer_agreement
from .corpora import DOMAINS, WORKLOADS
from .teacher import Answer
from .workloads import read_jsonl, request_problem


def _gain(value: float, base: float) -> float | None:
    """value / base - 1; None where the base accepts nothing (no ratio to report)."""
    return value / base - 1 if base > 0 else None


def chat_row(row: dict, domain: str) -> dict:
    """A workload row as a chat row of ``domain``: a prompt row becomes one user turn."""
    return {**row, "domain": domain, "messages": row.get("messages") or [{"role": "user", "content": row["prompt"]}]}


def trained_material(zoo: Path) -> set[str]:
    """What the training requests a zoo's build answered ask about (chat_workloads.request_material): a held-out
    request with any of it was, in effect, trained on (the committed zoo split its workloads by source: 44 of its
    600 held-out requests ask what a training request asked)."""
    from .chat_workloads import request_material

    built = json.loads((Path(zoo) / "build_config.json").read_text(encoding="utf-8"))
    lines = (Path(zoo) / "workloads" / "train_requests.jsonl").read_text(encoding="utf-8").splitlines()
    lines = lines[: built.get("teacher_train_requests") or None]
    return set().union(*(request_material(json.loads(line)["prompt"]) for line in lines))


def heldout_rows(zoo: Path) -> list[dict]:
    """The zoo's held-out requests as chat rows, in the order ``memspec-zoo acceptance`` answers them (WORKLOADS,
    then each file's rows); a {"prompt"} row is one user turn and keeps its own domain where it names one."""
    from .corpora import WORKLOADS
    from .workloads import read_jsonl, request_problem

    return [chat_row(row, row.get("domain") or w) for w in WORKLOADS
            for row in read_jsonl(Path(zoo) / "workloads" / f"{w}.jsonl", row_check=request_problem)]


def clean_heldout_answers(zoo: Path, answers: list, tokenizer) -> tuple[list, dict[str, int]]:
    """The stored answers to the zoo's held-out requests (``memspec-zoo acceptance --answers``, made in the
    workload files' order) less those to requests the build trained on (:func:`trained_material`), and how many
    were dropped per workload. Each answer is paired with its request by position and checked by its prompt ids."""
    from .chat_workloads import request_material
    from .teacher import chat_prompt_ids

    seen = trained_material(zoo)
    rows = heldout_rows(zoo)
    if len(answers) > len(rows):
        raise ValueError(f"{len(answers)} held-out answers for the {len(rows)} held-out requests of {zoo}")
    kept, dropped = [], {}
    for answer, row in zip(answers, rows, strict=False):
        if list(answer.prompt_ids) != chat_prompt_ids(tokenizer, row["messages"]):
            raise ValueError(f"a held-out answer ({row['domain']}) is not to the request in its place in {zoo}'s"
                             " workloads: these answers were made for other requests")
        if request_material(row["prompt"]) & seen:
            dropped[row["domain"]] = dropped.get(row["domain"], 0) + 1
        else:
            kept.append(answer)
    return kept, dropped


def workload_rows(folder: Path, per_workload: int) -> dict[str, list[dict]]:
    """The first ``per_workload`` rows of every <name>.jsonl in ``folder`` (train* skipped), as chat rows
    whose ``domain`` is the workload (the file's name): a prompt row becomes one user turn."""
    out: dict[str, list[dict]] = {}
    for path in sorted(Path(folder).glob("*.jsonl")):
        if path.stem.startswith("train"):
            continue
        rows = [chat_row(row, path.stem) for row in read_jsonl(path, per_workload, request_problem)]
        if rows:
            out[path.stem] = rows
    if not out:
        raise ValueError(f"no workload rows in {folder} (<name>.jsonl files with prompt or messages rows)")
    return out


def answers_cache_dir(rows: dict[str, list[dict]], max_new_tokens: int, target_digest: str) -> Path:
    """Where the target's answers to these rows are kept: a folder keyed by the rows, the budget and the target by
    content (model_source.answers_identity: keyed by its path, a re-released target of the same name found the old
    one's answers, which the stored digest then refused, naming a cache folder the user never chose)."""
    key = hashlib.sha256(json.dumps([rows, max_new_tokens, target_digest], sort_keys=True).encode()).hexdigest()[:16]
    from memspec_ros.runtime.model_source import cache_root

    return cache_root() / "answers" / key  # as every cache of the package ($MEMSPEC_CACHE_DIR overrides)


def first_per_domain(rows: Sequence[dict], per_domain: int) -> list[dict]:
    """The first ``per_domain`` rows of each ``domain``, in order: the requests :func:`chat_acceptance` scores."""
    taken: Counter[str] = Counter()
    out = []
    for row in rows:
        if taken[row["domain"]] < per_domain:
            taken[row["domain"]] += 1
            out.append(row)
    return out


def chat_acceptance(drafts: dict[str, torch.nn.Module], answers: Sequence[Answer], gamma: int = 4,
                    interval: int = 4, per_workload: int = 100, workloads: Sequence[str] = WORKLOADS) -> dict:
    """The matrix and the oracle gains over ``answers`` grouped by their ``domain`` (= workload)."""
    from tqdm import tqdm

    by_workload: dict[str, list[Answer]] = {w: [] for w in workloads}
    for a in answers:
        if a.domain in by_workload and len(by_workload[a.domain]) < per_workload:
            by_workload[a.domain].append(a)
    missing = [w for w, rows in by_workload.items() if not rows]
    if missing:
        raise ValueError(f"no held-out answers for workload(s) {', '.join(missing)}")
    # the domain drafts in the corpora's order, then any other draft the registry lists (e.g. one distilled on
    # every domain beside a general-purpose `general`): each is a candidate for the oracles
    names = [d for d in DOMAINS if d in drafts] + [d for d in drafts if d not in DOMAINS]
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
            # every workload's hindsight walk, not mixed's alone: what picking the best draft per interval gains on
            # a workload that does not change domain is the part of mixed's gain that is not about switching domain
            rec["dynamic"], rec["dynamic_choices"] = dynamic_walk(agreement, gamma, interval)
            per_prompt[w].append(rec)
    empty = [w for w, recs in per_prompt.items() if not recs]
    if empty:
        raise ValueError(f"no answers of two or more tokens for workload(s) {', '.join(empty)}")
    return {
        "config": {"gamma": gamma, "interval": interval, "per_workload": per_workload, "workloads": list(workloads),
                   "continuations": "the target's stored greedy chat answers (teacher)"},
        "definitions": __doc__,
        **acceptance_summary(per_prompt, names, list(workloads), gamma),
        "wall_seconds": round(time.time() - t0, 1),
        "per_prompt": per_prompt,
    }


def acceptance_summary(per_prompt: dict[str, list[dict]], names: list[str], workloads: list[str],
                       gamma: int) -> dict:
    """The matrix, the oracle gains and the workloads' statistics from per-prompt records (chat_acceptance's
    ``per_prompt``; each workload's records may be any subset of its prompts, mixed's with their dynamic walk)."""
    domains = [w for w in workloads if w != "mixed"] if list(workloads) != list(WORKLOADS) else list(DOMAINS)
    matrix = {d: {w: mean(r["accepted_per_iteration"][d] for r in per_prompt[w]) for w in workloads} for d in names}
    # the best of ``names`` (a summary over some of the records' drafts took the best of all of them)
    best_static = {w: mean(max(r["accepted_per_iteration"][d] for d in names) for r in per_prompt[w])
                   for w in workloads}
    static_gain = {w: _gain(best_static[w], matrix["general"][w]) for w in domains}
    # the records' hindsight walks chose among every draft they were made with: over fewer ``names`` they are
    # not the dynamic oracle of those (it gained from drafts the static one was denied), so no dynamic figure then
    walked = {d for w in workloads for r in per_prompt[w] for d in r["accepted_per_iteration"]}
    same = walked == set(names)
    dyn_mixed = mean(r["dynamic"] for r in per_prompt["mixed"]) if "mixed" in per_prompt and same else None
    dynamic = {w: _gain(mean(r["dynamic"] for r in per_prompt[w]), best_static[w]) for w in workloads
               if same and per_prompt[w] and all("dynamic" in r for r in per_prompt[w])}
    return {
        "matrix": matrix,
        "best_fixed_per_prompt": best_static,
        "oracle_static_gain_by_workload": static_gain,
        # None where no domain workload was scored (a folder holding mixed.jsonl alone)
        "oracle_static_gain": mean(static_gain.values()) if static_gain and all(
            g is not None for g in static_gain.values()) else None,
        "oracle_dynamic_mixed": dyn_mixed,
        "oracle_dynamic_gain_mixed": _gain(dyn_mixed, best_static["mixed"]) if dyn_mixed is not None else None,
        # the same hindsight walk on every workload (records made before session 44 have it on mixed only)
        "oracle_dynamic_gain_by_workload": dynamic,
        "domain_gain_over_general": {d: {w: _gain(matrix[d][w], matrix["general"][w]) for w in domains}
                                     for d in names if d != "general"},
        "gain_ceiling_over_general": {w: _gain(gamma, matrix["general"][w]) for w in workloads},
        "repeated_4gram_fraction": {w: mean(r["repeated_4gram"] for r in per_prompt[w]) for w in workloads},
        "mean_generated_tokens": {w: mean(r["tokens"] for r in per_prompt[w]) for w in workloads},
    }


def write_acceptance(result: dict, out_json: Path, plot_path: Path | None = None) -> None:
    from memspec_ros.runtime.atomic_write import write_text_atomic

    out_json.parent.mkdir(parents=True, exist_ok=True)
    write_text_atomic(out_json, json.dumps(result, indent=1))  # models/acceptance.json: a cut write left half
    if plot_path is None:
        return
    plot_path.parent.mkdir(parents=True, exist_ok=True)
    if set(result["config"].get("workloads", WORKLOADS)) == set(WORKLOADS):
        plot_matrix(result, plot_path)
    else:
        _plot_workloads(result, plot_path)


def _plot_workloads(result: dict, path: Path) -> None:
    """The matrix over a workload folder's own workloads (columns in their order)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    matrix, workloads = result["matrix"], result["config"]["workloads"]
    drafts = list(matrix)
    data = [[matrix[d][w] for w in workloads] for d in drafts]
    fig, ax = plt.subplots(figsize=(1.6 + 1.1 * len(workloads), 4.5))
    im = ax.imshow(data, cmap="viridis", aspect="auto")
    ax.set_xticks(range(len(workloads)), workloads, rotation=30, ha="right")
    ax.set_yticks(range(len(drafts)), drafts)
    ax.set_xlabel("workload")
    ax.set_ylabel("draft")
    top = max(map(max, data)) if data else 0.0
    for i in range(len(drafts)):
        for j in range(len(workloads)):
            ax.text(
                j,
                i,
                f"{data[i][j]:.2f}",
                ha="center",
                va="center",
                color="white" if data[i][j] < top * 0.6 else "black",
            )
    fig.colorbar(im, ax=ax, label="mean accepted tokens / iteration")
    ax.set_title(f"Acceptance (greedy, gamma={result['config']['gamma']})", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
