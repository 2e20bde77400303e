"""Which draft MemSpec runs on each held-out request, against that request's best draft.

Replays MemSpec (the bundled predictor, a committed `make bench` run's costs) over the target's stored answers to
the zoo's held-out requests, as scripts/simulate_heldout.py does, and per workload counts the draft that ran most
of each request's drafted iterations against the draft that accepts most over the whole answer (E[A], gamma of the
run), with both drafts' E[A] gain over ``general``:

    .venv/bin/python scripts/heldout_choices.py --answers artifacts/heldout_answers \\
        --json docs/results/heldout-choices.json
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from simulate_heldout import ROOT, committed_costs, held_out_traces  # noqa: E402

from memspec_ros.bench.policy_bench import BenchRun, PolicyBenchConfig  # noqa: E402
from memspec_ros.runtime.loader import find_predictor, load_models  # noqa: E402
from memspec_ros.runtime.predictor import PredictionEngine  # noqa: E402
from memspec_ros.runtime.simulator import Simulator, replay_predictor  # noqa: E402
from memspec_ros.zoo.acceptance import static_score  # noqa: E402
from memspec_ros.zoo.chat_acceptance import clean_heldout_answers  # noqa: E402
from memspec_ros.zoo.teacher import load_answers  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--answers", type=Path, required=True, help="the held-out answers (memspec-zoo acceptance)")
    p.add_argument("--run", default="docs/results/int4", help="the committed `make bench` run whose costs to use")
    p.add_argument("--json", type=Path, required=True)
    a = p.parse_args()
    torch.set_num_threads(2)
    models = load_models(ROOT / "models" / "registry.yaml")
    predictor = PredictionEngine.load(find_predictor(ROOT / "models" / "predictor"), target=models.target.model,
                                      tokenizer=models.tokenizer)
    # the requests the build trained on (by material) are no held-out requests: left out
    answers, dropped = clean_heldout_answers(ROOT / "models", load_answers(a.answers, "heldout"), models.tokenizer)
    traces = held_out_traces(models, answers, 100)
    costs, schedule, cfg = committed_costs(ROOT / a.run)
    workloads = list(dict.fromkeys(t.workload for t in traces))
    bench_cfg = PolicyBenchConfig(policies=("memspec",), workloads=workloads, capacity=cfg["capacity"],
                                  interval=cfg["interval"], gamma=cfg["gamma"], recent_tokens=cfg["recent_tokens"],
                                  max_new_tokens=cfg["max_new_tokens"])
    bench = BenchRun(result={}, cfg=bench_cfg, traces=traces, costs=costs, schedule_costs=schedule,
                     predictor=replay_predictor(predictor, traces),
                     domains={e.name: e.domain for e in models.registry.entries()}, registry=models.registry, runs=[])
    sim = Simulator(bench.costs, bench.sim_config(), bench.domains, list(bench.domains))
    rows: dict[str, list[tuple[str, str, float, float]]] = collections.defaultdict(list)
    for t in traces:
        stats = sim.generate(bench.policy("memspec", bench.sim_config()), t)
        ran = collections.Counter(it.draft for it in stats.iterations if it.proposed)
        main_draft = ran.most_common(1)[0][0] if ran else "general"
        score = {d: static_score(agreement, cfg["gamma"])[0] for d, agreement in t.agreement.items()}
        top = max(score.values())
        tied = [d for d in score if score[d] == top]  # a tie is counted as one, not given to the registry's first
        base = score["general"]
        rows[t.workload].append((main_draft, tied, score.get(main_draft, base) / base - 1 if base else 0.0,
                                 top / base - 1 if base else 0.0))
    report = {"what": __doc__.split("\n\n")[0], "costs_from": a.run, "gamma": cfg["gamma"],
              "left_out_as_trained_on": dropped, "workloads": {}}
    for w, r in rows.items():
        report["workloads"][w] = {
            "requests": len(r),
            "memspec_main_draft": dict(collections.Counter(m for m, _, _, _ in r)),
            "best_draft": dict(collections.Counter(b[0] if len(b) == 1 else "tie" for _, b, _, _ in r)),
            "main_draft_is_best": sum(m in b for m, b, _, _ in r),
            # mean over the requests of (accepted per iteration / general's) - 1, as "gain over general" elsewhere
            "mean_relative_gain_over_general": {"memspec_main_draft": round(sum(x for *_, x, _ in r) / len(r), 4),
                                                "best_draft": round(sum(y for *_, y in r) / len(r), 4)},
        }
        print(w, json.dumps(report["workloads"][w]), flush=True)
    models.close()
    a.json.write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
