"""Could a ranking that checks its choice against observed agreement pick each request's better draft?

Session 41 found that on the bundled zoo's held-out requests MemSpec's head routes by domain (the code draft on
96 of 100 code requests) while the domain draft is the request's best draft only about half the time, `general`
the other half (docs/results/heldout-choices.json). A rule that needs no head: every N iterations, run the
candidate draft that agreed most with the target over the tokens generated SO FAR (each resident draft's
agreement is what a catch-up forward over the committed tokens would measure). This walks each held-out answer
under such rules with the agreement of every draft known exactly over the past (no costs, no residency limit,
no noise: an upper bound for any rule of this kind) and compares accepted tokens per iteration with:

- `general` and the request's domain draft alone (what MemSpec's routing runs), and
- the best draft per request in hindsight (Oracle-Static), over all drafts and over {domain draft, general}.

Greedy gamma 4, N 4, as ``memspec-zoo acceptance``'s matrix (every draft teacher-forced on the target's answer),
over the held-out requests the build did not train on (chat_acceptance.clean_heldout_answers: 556 of 600).

    .venv/bin/python scripts/past_agreement.py --answers artifacts/heldout_answers \\
        --json docs/results/past-agreement.json
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path
from statistics import fmean

import torch

from memspec_ros.runtime.loader import load_models
from memspec_ros.runtime.models import ModelSpec, load_model
from memspec_ros.zoo.acceptance import interval_walk, static_score
from memspec_ros.zoo.chat_acceptance import clean_heldout_answers
from memspec_ros.zoo.chat_drafts import answer_agreement
from memspec_ros.zoo.teacher import load_answers

ROOT = Path(__file__).resolve().parents[1]
WINDOWS = (0, 64, 32)  # tokens of the past each rule scores over (0: every generated token)
MARGINS = (0.0, 0.05)  # agreement a candidate must exceed the running draft's by before a switch


def past_rate(agree: list[bool], position: int, window: int) -> float:
    """Share of the generated tokens before ``position`` (the last ``window`` of them; 0: all) the draft agreed on."""
    seen = agree[max(0, position - window) if window else 0:position]
    return sum(seen) / len(seen) if seen else 0.0


def past_agreement_walk(agreement: dict[str, list[bool]], start: str, candidates: list[str], gamma: int,
                        interval: int, window: int, margin: float) -> float:
    """Accepted per iteration when each interval runs the candidate with the highest past agreement (the running
    draft unless another exceeds it by ``margin``), starting on ``start``."""
    length = len(agreement[start])
    position, accepted, current = 1, [], start
    while position < length:
        rates = {d: past_rate(agreement[d], position, window) for d in candidates}
        best = max(candidates, key=lambda d: (rates[d], d == current))
        if rates[best] > rates[current] + margin:
            current = best
        advance, got = interval_walk(agreement[current], position, gamma, interval)
        if not got:
            break
        accepted += got
        position += advance
    return sum(accepted) / len(accepted) if accepted else 0.0


def rules(agreement: dict[str, list[bool]], routed: str, gamma: int, interval: int) -> dict[str, float]:
    static = {d: static_score(a, gamma)[0] for d, a in agreement.items()}
    pair = sorted({routed, "general"})
    out = {"general": static["general"], "routed": static[routed], "best_per_request": max(static.values()),
           "best_per_request_of_routed_and_general": max(static[d] for d in pair)}
    for window in WINDOWS:
        for margin in MARGINS:
            tag = f"window {window or 'all'}, margin {margin}"
            out[f"past best of routed and general ({tag})"] = past_agreement_walk(
                agreement, routed, pair, gamma, interval, window, margin)
            out[f"past best of all drafts ({tag})"] = past_agreement_walk(
                agreement, routed, list(agreement), gamma, interval, window, margin)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", type=Path, default=ROOT / "models")
    p.add_argument("--answers", type=Path, required=True, help="the held-out answers (memspec-zoo acceptance)")
    p.add_argument("--gamma", type=int, default=4)
    p.add_argument("--interval", type=int, default=4)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--json", type=Path, default=ROOT / "docs" / "results" / "past-agreement.json")
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    from tqdm import tqdm

    answers = load_answers(a.answers, "heldout")
    if not answers:
        raise SystemExit(f"no held-out answers in {a.answers} (memspec-zoo acceptance --answers DIR makes them)")
    models = load_models(a.models / "registry.yaml")
    # the requests the build trained on (by material) are no held-out requests: left out
    answers, dropped = clean_heldout_answers(a.models, answers, models.tokenizer)
    answers = [x for x in answers if len(x.answer_ids) >= 2]
    drafts = {e.name: load_model(ModelSpec(str(e.path))).model for e in models.registry.entries()}
    models.close()
    if "general" not in drafts:
        raise SystemExit(f"the zoo in {a.models} has no draft named 'general' to compare with")
    per_workload: dict[str, dict[str, list[float]]] = {}
    with torch.inference_mode():
        for x in tqdm(answers, desc="answers", mininterval=10):
            agreement = {d: answer_agreement(m, x) for d, m in drafts.items()}
            routed = x.domain if x.domain in drafts else "general"  # the head routes by domain (heldout-choices)
            for k, v in rules(agreement, routed, a.gamma, a.interval).items():
                per_workload.setdefault(x.domain, {}).setdefault(k, []).append(v)
    table = {w: {k: round(fmean(v), 4) for k, v in r.items()} for w, r in per_workload.items()}
    domains = [w for w in table if w != "mixed"]
    gmean = {k: round(math.exp(fmean(math.log(table[w][k]) for w in domains)), 4) for k in next(iter(table.values()))}
    report = {"what": "mean accepted tokens per iteration (greedy, teacher-forced) under rules that pick a draft by "
                      "its agreement over the generated tokens so far, known exactly for every draft",
              "command": f"scripts/past_agreement.py --answers {a.answers} --gamma {a.gamma} --interval {a.interval}",
              "answers_by_workload": {w: len(r["general"]) for w, r in per_workload.items()},
              "left_out_as_trained_on": dropped,
              "gmean_over": domains, "gmean": gmean, "workloads": table}
    a.json.write_text(json.dumps(report, indent=1) + "\n")
    width = max(map(len, gmean))
    print(f"{'rule':<{width}} " + " ".join(f"{w[:8]:>8}" for w in table) + "   GMEAN")
    for k in gmean:
        print(f"{k:<{width}} " + " ".join(f"{table[w][k]:8.3f}" for w in table) + f" {gmean[k]:7.3f}")
    print(f"wrote {a.json}")


if __name__ == "__main__":
    main()
