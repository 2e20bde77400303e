"""Drafts of another kind: does a domain *datastore* beside each draft make the zoo's drafts differ?

Sessions 31-43 measured that drafts distilled from this target barely differ by domain (docs/results/README.md,
"Why the drafts barely differ"): a `general` draft that saw every domain's answers accepts about what each
domain draft does on its own domain. A datastore of past answers (runtime/datastore.py) is the opposite kind
of draft: it holds nothing but what it was given, so one built from one domain's answers copies well on that
domain only. This measures whether bundling one with each draft, at the same size for every bundle, yields the
heterogeneity MemSpec needs (issue 16: +40% per domain, ``oracle_static_gain`` >= 0.20):

- each domain's bundle: its draft + a datastore of ``budget`` tokens of that domain's training answers;
- the `general` bundle: the `general` draft + a datastore of ``budget`` tokens drawn from every domain's
  answers: the same memory, as the K slots of an edge device give every resident draft;
- scored, teacher-forced, on the zoo's held-out answers the build did not train on
  (``chat_acceptance.clean_heldout_answers``), in the engine's greedy walk at gamma 4.

Per position of an answer, what an iteration starting there accepts: the draft's run of agreeing tokens
(``oracle.accepted_at``); the copy's matched prefix (context + the bundle's datastore, ``lookup.NgramIndex`` as
the engine searches them); and two ways of combining them: ``copy_first`` (a copy when one matches, else the
draft: the engine without adaptive gamma) and ``best_of`` (the better of the two at every iteration: a bound on
any rule that chooses between them, the engine's weighing included). Each rule's per-prompt walk feeds
``chat_acceptance.acceptance_summary``, so the matrix and gains are the acceptance matrix's own definitions
(the mixed workload's dynamic walk picks the best bundle per ``interval`` iterations).

``--head-rows`` also reports, per reduced-vocabulary head size, the share of held-out answer tokens that a
head of the domain's most frequent tokens covers against one of every domain's: a draft can never propose a
token outside its head, so this bounds what smaller, per-domain heads could add.

    python scripts/domain_datastores.py --budgets 25000,99000,240000 --json docs/results/domain-datastores.json
"""

from __future__ import annotations

import argparse
import json
import random
import time
from collections import Counter
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np

from memspec_ros.runtime.datastore import Datastore
from memspec_ros.runtime.lookup import LookupConfig, NgramIndex
from memspec_ros.runtime.oracle import accepted_at
from memspec_ros.zoo.corpora import DOMAINS, WORKLOADS

RULES = ("draft", "store", "copy_first", "best_of")


def walk(accepted: Sequence[int], position: int = 1, iterations: int | None = None) -> tuple[int, list[int]]:
    """(tokens committed, accepted per iteration) walking ``accepted[p]`` (what an iteration starting after
    ``p`` committed tokens accepts) from ``position``; the prefill commits the first token, as in the engine."""
    start, got = position, []
    while position < len(accepted) and (iterations is None or len(got) < iterations):
        got.append(accepted[position])
        position += accepted[position] + 1
    return position - start, got


def mean_walk(accepted: Sequence[int]) -> float:
    got = walk(accepted)[1]
    return sum(got) / len(got) if got else 0.0


def dynamic_walk(accepted: dict[str, Sequence[int]], interval: int) -> float:
    """Accepted per iteration when the best bundle is chosen for every ``interval`` iterations with hindsight
    (the acceptance matrix's oracle_dynamic, without switch costs)."""
    length = len(next(iter(accepted.values())))
    position, got = 1, []
    while position < length:
        def score(name: str, at: int = position) -> float:
            acc = walk(accepted[name], at, interval)[1]
            return sum(acc) / len(acc) if acc else 0.0

        best = max(accepted, key=score)
        advance, acc = walk(accepted[best], position, interval)
        if not acc:
            break
        got += acc
        position += advance
    return sum(got) / len(got) if got else 0.0


def copy_accepted(prompt: Sequence[int], answer: Sequence[int], store: Datastore | None,
                  gamma: int) -> tuple[list[int], list[bool]]:
    """Per position: the tokens a copy from the context (and ``store``) would have stood, and whether one was
    proposed at all; teacher-forced, so the index holds the prompt and the answer up to that position."""
    index = NgramIndex(LookupConfig(), [store] if store is not None else [])
    index.extend(list(prompt) + list(answer[:1]))
    accepted, proposed = [0] * len(answer), [False] * len(answer)
    for p in range(1, len(answer)):
        tokens, _ = index.propose(min(gamma, len(answer) - p - 1))
        k = 0
        while k < len(tokens) and tokens[k] == answer[p + k]:
            k += 1
        accepted[p], proposed[p] = k, bool(tokens)
        index.extend(answer[p : p + 1])
    return accepted, proposed


def combine(draft: Sequence[int], copy: Sequence[int], proposed: Sequence[bool]) -> dict[str, list[int]]:
    """Per-position accepted tokens under each of RULES."""
    return {"draft": list(draft), "store": list(copy),
            "copy_first": [c if has else d for d, c, has in zip(draft, copy, proposed, strict=True)],
            "best_of": [max(d, c) for d, c in zip(draft, copy, strict=True)]}


def sample_budget(answers: Sequence[np.ndarray], budget: int, seed: int) -> list[np.ndarray]:
    """Whole answers, in a seeded order, until ``budget`` tokens are taken (the last one may pass it)."""
    order = list(range(len(answers)))
    random.Random(seed).shuffle(order)
    taken, tokens = [], 0
    for i in order:
        if tokens >= budget:
            break
        taken.append(answers[i])
        tokens += len(answers[i])
    return taken


def resident_bytes(store: Datastore) -> int:
    """What the datastore holds in memory once loaded: its tokens and every n-gram table."""
    return int(store.tokens.nbytes + sum(t.keys.nbytes + t.after.nbytes for t in store._tables.values()))


def training_answers(models: Path, tokenizer) -> dict[str, list[np.ndarray]]:
    """The zoo's datastore answers by the domain of the training request each answers (teacher.datastore_answers
    pairs them, its checks included; withheld rows are left out)."""
    from memspec_ros.zoo.teacher import datastore_answers

    by_domain: dict[str, list[np.ndarray]] = {}
    for answer in datastore_answers(models / "datastore.safetensors", tokenizer):
        by_domain.setdefault(answer.domain, []).append(np.asarray(answer.answer_ids))
    return by_domain


def bundle_stores(by_domain: dict[str, list[np.ndarray]], names: Sequence[str], budget: int,
                  seed: int = 0) -> dict[str, Datastore]:
    """One datastore of ``budget`` tokens per bundle: a domain's own answers, or for `general` every domain's."""
    every = [a for answers in by_domain.values() for a in answers]
    return {name: Datastore(sample_budget(every if name == "general" else by_domain[name], budget, seed))
            for name in names}


def head_coverage(by_domain: dict[str, list[np.ndarray]], held: dict[str, list], rows: Sequence[int],
                  gamma: int) -> dict:
    """Per head size: held-out tokens covered by the domain's own most frequent ``rows`` tokens against every
    domain's, and the acceptance ceiling either head leaves (a draft agreeing wherever its head can)."""
    counts = {d: Counter(int(t) for a in answers for t in a) for d, answers in by_domain.items()}
    union = sum(counts.values(), Counter())
    out = {}
    for r in rows:
        shared = {t for t, _ in union.most_common(r)}
        per = {}
        for w, answers in held.items():
            if w not in counts:
                continue
            own = {t for t, _ in counts[w].most_common(r)}
            tokens = [t for a in answers for t in a.answer_ids]
            per[w] = {
                "own_head_coverage": sum(t in own for t in tokens) / len(tokens),
                "every_domain_head_coverage": sum(t in shared for t in tokens) / len(tokens),
                "own_head_ceiling": float(np.mean([mean_walk([accepted_at([t in own for t in a.answer_ids], p, gamma)
                                                              for p in range(len(a.answer_ids))]) for a in answers])),
                "every_domain_head_ceiling": float(np.mean([mean_walk(
                    [accepted_at([t in shared for t in a.answer_ids], p, gamma) for p in range(len(a.answer_ids))])
                    for a in answers])),
            }
        out[str(r)] = per
    return out


def score(held: dict[str, list], names: Sequence[str], agreement: Callable, stores: dict[str, Datastore],
          gamma: int, interval: int) -> dict[str, dict[str, list[dict]]]:
    """Per rule, chat_acceptance's per-prompt records (accepted per iteration per bundle; mixed's dynamic walk)."""
    per_prompt: dict[str, dict[str, list[dict]]] = {rule: {w: [] for w in held} for rule in RULES}
    for w, answers in held.items():
        for a in answers:
            if len(a.answer_ids) < 2:
                continue
            positions = range(len(a.answer_ids))
            by_rule: dict[str, dict[str, list[int]]] = {rule: {} for rule in RULES}
            for name in names:
                agree = agreement(name, a)
                draft = [accepted_at(agree, p, gamma) for p in positions]
                copy, proposed = copy_accepted(a.prompt_ids, a.answer_ids, stores[name], gamma)
                for rule, accepted in combine(draft, copy, proposed).items():
                    by_rule[rule][name] = accepted
            for rule, accepted in by_rule.items():
                rec = {"tokens": len(a.answer_ids), "repeated_4gram": 0.0,
                       "accepted_per_iteration": {n: mean_walk(v) for n, v in accepted.items()}}
                if w == "mixed":
                    rec["dynamic"] = dynamic_walk(accepted, interval)
                per_prompt[rule][w].append(rec)
    return per_prompt


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", type=Path, default=Path("models"), help="the zoo (default models)")
    parser.add_argument("--answers", type=Path, default=Path("artifacts/heldout_answers"),
                        help="the target's stored held-out answers (memspec-zoo acceptance --answers)")
    parser.add_argument("--budgets", default="25000,99000,240000",
                        help="comma-separated datastore sizes in tokens, the same for every bundle")
    parser.add_argument("--per-workload", type=int, default=100)
    parser.add_argument("--gamma", type=int, default=4)
    parser.add_argument("--interval", type=int, default=4)
    parser.add_argument("--head-rows", default="512,1024,2048,8192")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", type=Path, help="write the figures here")
    args = parser.parse_args()
    budgets = [int(b) for b in args.budgets.split(",")]
    if not budgets or min(budgets) < 1:
        raise SystemExit("--budgets: positive token counts, comma-separated")
    if args.json and not args.json.parent.is_dir():
        raise SystemExit(f"--json: no folder {args.json.parent}")

    import torch

    from memspec_ros.runtime.models import ModelSpec, load_model, load_tokenizer
    from memspec_ros.runtime.registry import DraftRegistry
    from memspec_ros.zoo.chat_acceptance import acceptance_summary, clean_heldout_answers, heldout_rows
    from memspec_ros.zoo.chat_drafts import answer_agreement
    from memspec_ros.zoo.teacher import load_answers

    torch.set_num_threads(args.threads)
    registry = DraftRegistry.from_yaml(args.models / "registry.yaml", validate=False)
    tokenizer = load_tokenizer(registry.target_path)
    drafts = {e.name: load_model(ModelSpec(e.path)).model for e in registry.entries()}
    names = [d for d in DOMAINS if d in drafts]
    answers = load_answers(args.answers, "heldout")[: len(heldout_rows(args.models))]
    kept, dropped = clean_heldout_answers(args.models, answers, tokenizer)
    held = {w: [a for a in kept if a.domain == w][: args.per_workload] for w in WORKLOADS}
    agreements: dict[tuple[str, int], list[bool]] = {}

    def agreement(name: str, answer) -> list[bool]:  # the drafts' forwards once, whatever the budget
        key = (name, id(answer))
        if key not in agreements:
            agreements[key] = answer_agreement(drafts[name], answer)
        return agreements[key]

    by_domain = training_answers(args.models, tokenizer)
    result: dict = {"models": str(args.models), "gamma": args.gamma, "interval": args.interval,
                    "bundles": names, "per_workload": {w: len(v) for w, v in held.items()},
                    "dropped_trained_on": dropped, "rules": list(RULES), "budgets": {}}
    for budget in budgets:
        t0 = time.time()
        stores = bundle_stores(by_domain, names, budget)
        per_prompt = score(held, names, agreement, stores, args.gamma, args.interval)
        entry = {"store_tokens": {n: s.token_count for n, s in stores.items()},
                 "store_resident_mb": {n: round(resident_bytes(s) / 1e6, 2) for n, s in stores.items()}}
        for rule in RULES:
            summary = acceptance_summary(per_prompt[rule], names, list(WORKLOADS), args.gamma)
            entry[rule] = {k: summary[k] for k in ("matrix", "oracle_static_gain", "oracle_static_gain_by_workload",
                                                   "oracle_dynamic_gain_mixed")}
            entry[rule]["own_domain_gain"] = {d: summary["domain_gain_over_general"][d][d]
                                              for d in names if d != "general"}
        result["budgets"][str(budget)] = entry
        print(f"budget {budget} tokens ({time.time() - t0:.0f} s):", json.dumps(
            {rule: {"own_domain_gain": {d: round(g, 3) for d, g in entry[rule]["own_domain_gain"].items()},
                    "oracle_static_gain": round(entry[rule]["oracle_static_gain"] or 0.0, 3),
                    "oracle_dynamic_gain_mixed": round(entry[rule]["oracle_dynamic_gain_mixed"] or 0.0, 3)}
             for rule in RULES}), flush=True)
    result["head_coverage"] = head_coverage(by_domain, {w: held[w] for w in names}, [
        int(r) for r in args.head_rows.split(",")], args.gamma)
    text = json.dumps(result, indent=1)
    if args.json:
        args.json.write_text(text + "\n")
    print(json.dumps(result["head_coverage"], indent=1))


if __name__ == "__main__":
    main()
