"""The seven policies replayed over the zoo's 600 held-out requests, with the costs `make bench` measured.

`make bench` times every policy on 2 prompts per workload: enough to validate the simulator against real
runs (docs/results/README.md, "Simulator validation"), too few for the ratios between policies, which move
by several percent from one prompt to the next. This replays the same policy objects
(runtime/simulator.py) over the target's stored greedy answers to all 100 held-out requests of each
workload (``memspec-zoo acceptance --answers DIR`` makes them) less the 44 that ask what a training request the
build answered asks (chat_acceptance.clean_heldout_answers), so each ratio rests on 75-99 prompts per workload at a
constant machine speed:

- traces: each draft's agreement with the answer (one teacher-forced forward, as
  ``memspec-zoo acceptance``) and the target's final hidden states over request + answer (what the
  target-hidden predictor pools; runtime/simulator.py's TraceHiddenEncoder);
- costs: the cost model a committed `make bench` run fitted to its timed generations (``cost_model`` in
  its paper.json), so each run's target path, drafts' path and storage medium come with it; Oracle-Dynamic
  plans with that same model (CostModel.schedule_costs: what the replay charges), not with the schedule
  costs the run's timed Oracle-Dynamic planned with;
- the bundled predictor, which never trained on these requests.

The answers are the fp32 target's (the teacher's); a committed run on the int4 path charges its own
times to them, so the replay with its costs is "these answers at that path's speed", not that path's
own greedy output. Drafts run in fp32 here, as in ``models/acceptance.json``.

    .venv/bin/python scripts/simulate_heldout.py --answers artifacts/heldout_answers \\
        --runs docs/results,docs/results/fp32,docs/results/int4 --json docs/results/simulated-heldout.json
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from memspec_ros.bench.figures import domain_workloads, policy_summary, simulated_table
from memspec_ros.bench.policy_bench import BenchRun, PolicyBenchConfig, gmean
from memspec_ros.runtime.loader import find_predictor, load_models
from memspec_ros.runtime.models import ModelSpec, load_model
from memspec_ros.runtime.oracle import ScheduleCosts
from memspec_ros.runtime.policies import COST_AWARE, PAPER_POLICIES
from memspec_ros.runtime.simulator import CostModel, PromptTrace, replay_predictor, target_hidden_states
from memspec_ros.runtime.stats import ratio, rounded
from memspec_ros.runtime.storage import load_to_iteration
from memspec_ros.zoo.chat_acceptance import clean_heldout_answers
from memspec_ros.zoo.chat_drafts import answer_agreement
from memspec_ros.zoo.teacher import load_answers

ROOT = Path(__file__).resolve().parents[1]
POLICIES = (*PAPER_POLICIES, COST_AWARE)


def log(msg: str) -> None:
    print(f"[simulate {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def committed_costs(run_dir: Path) -> tuple[CostModel, ScheduleCosts, dict]:
    """The cost model a committed `make bench` run fitted, the schedule costs Oracle-Dynamic plans with in a
    replay of it (that model's: what the replay charges, BenchRun.policy), and the run's settings."""
    paper = json.loads((run_dir / "paper.json").read_text())
    cm = dict(paper["cost_model"])
    cm["verify_seconds"] = {int(k): v for k, v in cm["verify_seconds"].items()}
    costs, cfg = CostModel(**cm), paper["config"]
    return costs, costs.schedule_costs(cfg["capacity"], cfg["gamma"]), cfg


def held_out_traces(models, answers, per_workload: int) -> list[PromptTrace]:
    from tqdm import tqdm

    drafts = {e.name: load_model(ModelSpec(str(e.path))).model for e in models.registry.entries()}
    ends = set(models.end_token_ids)
    count: dict[str, int] = {}
    traces = []
    for a in tqdm(answers, desc="traces", mininterval=10):
        if len(a.answer_ids) < 2 or count.get(a.domain, 0) >= per_workload:
            continue
        count[a.domain] = count.get(a.domain, 0) + 1
        trace = PromptTrace(a.domain, list(a.prompt_ids), list(a.answer_ids),
                            {d: answer_agreement(m, a) for d, m in drafts.items()}, eos=a.answer_ids[-1] in ends)
        trace.hidden = target_hidden_states(models.target.model, a.prompt_ids, a.answer_ids)
        traces.append(trace)
    return traces


def previous_interval_choices(agreement: dict[str, list[bool]], gamma: int, interval: int,
                              start: str) -> tuple[list[tuple[int, str]], list[int]]:
    """(each interval's start position and draft, accepted per iteration) when each interval runs the draft that
    would have accepted most per iteration over the previous interval's tokens, known in full for every draft (no
    costs, no residency). Each draft walks those tokens only (its agreement cut at the current position: the tokens
    after it are not generated yet), as many iterations as it needs; its score is its mean accepted per iteration
    there (the tokens it covers would not do: cut at the position, every draft covers at most what the running one
    did, so the rule never left its start)."""
    from memspec_ros.zoo.acceptance import interval_walk

    def past_rate(draft: str, previous: int, position: int) -> float:
        _, got = interval_walk(agreement[draft][:position], previous, gamma, position)
        return sum(got) / len(got) if got else 0.0

    length = len(next(iter(agreement.values())))
    position, accepted, previous, current, choices = 1, [], None, start, []
    while position < length:
        if previous is not None:  # ties keep the running draft
            current = max(agreement, key=lambda d: (past_rate(d, previous, position), d == current))
        choices.append((position, current))
        advance, got = interval_walk(agreement[current], position, gamma, interval)
        if not got:
            break
        accepted += got
        previous, position = position, position + advance
    return choices, accepted


def previous_interval_walk(agreement: dict[str, list[bool]], gamma: int, interval: int, start: str) -> float:
    """Accepted per iteration of previous_interval_choices: what any policy that reads the recent past could do at
    best with perfect feedback, against Oracle-Dynamic's knowledge of the next interval."""
    accepted = previous_interval_choices(agreement, gamma, interval, start)[1]
    return sum(accepted) / len(accepted) if accepted else 0.0


def hindsight(traces: list[PromptTrace], gamma: int, interval: int) -> dict:
    """Per workload, mean accepted per iteration: General-Static, the best draft per prompt (Oracle-Static),
    the best per interval (Oracle-Dynamic, no costs) and the previous interval's best (previous_interval_walk)."""
    from statistics import fmean

    from memspec_ros.zoo.acceptance import dynamic_walk, static_score

    rows: dict[str, dict[str, list[float]]] = {}
    for t in traces:
        static = {d: static_score(a, gamma)[0] for d, a in t.agreement.items()}
        r = rows.setdefault(t.workload, {"general": [], "best_per_prompt": [], "best_per_interval": [],
                                         "previous_intervals_best": []})
        r["general"].append(static["general"])
        r["best_per_prompt"].append(max(static.values()))
        r["best_per_interval"].append(dynamic_walk(t.agreement, gamma, interval)[0])
        r["previous_intervals_best"].append(previous_interval_walk(t.agreement, gamma, interval, "general"))
    return {w: {k: round(fmean(v), 4) for k, v in r.items()} for w, r in rows.items()}


def summary(totals: dict, policies: list[str], workloads: list[str]) -> dict:
    """Per workload (bench.figures.simulated_table) and GMEAN over the domain workloads: both metrics, the ratios."""
    domains = domain_workloads(workloads)
    table = simulated_table(totals)
    geo = {p: gmean([table[w][p]["tokens_per_second"] for w in domains]) for p in policies}
    geo_e2e = {p: gmean([table[w][p]["end_to_end_tokens_per_second"] for w in domains]) for p in policies}
    # figures.ratio: None over a zero rate (a workload at 0 tok/s raised ZeroDivisionError after the whole replay)
    ratios = {f"{mine}_vs_{p}": {"paper_metric": rounded(ratio(geo[mine], geo[p])),
                                 "end_to_end": rounded(ratio(geo_e2e[mine], geo_e2e[p]))}
              for mine in ("memspec", COST_AWARE) for p in policies if p != mine}
    per_workload = {mine: [ratio(table[w][mine]["tokens_per_second"], table[w]["mab-async"]["tokens_per_second"])
                           for w in domains] for mine in ("memspec", COST_AWARE)}
    worst = {mine: None if None in r else min(r) for mine, r in per_workload.items()}
    return {"workloads": table, "gmean_over": domains,
            "gmean_tokens_per_second": {p: round(v, 3) for p, v in geo.items()},
            "gmean_end_to_end_tokens_per_second": {p: round(v, 3) for p, v in geo_e2e.items()},
            "ratios": ratios, "worst_workload_vs_mab_async": {k: rounded(v) for k, v in worst.items()}}


def replay(bench: BenchRun, policies: list[str], workloads: list[str]) -> tuple[dict, dict]:
    """One replay of every policy on every trace: ({policy: {workload: GenerationTotals}}, and per policy over
    the domain workloads E[A] and the fallback share as the bench's figures define them
    (bench.figures.policy_summary), plus draft switches per generation)."""
    from memspec_ros.runtime.simulator import Simulator
    from memspec_ros.runtime.stats import GenerationTotals

    config = bench.sim_config()
    sim = Simulator(bench.costs, config, bench.domains, list(bench.domains))
    domains = domain_workloads(workloads)
    totals: dict = {p: {w: GenerationTotals() for w in workloads} for p in policies}
    runs = []
    for p in policies:
        for trace in bench.traces:
            stats = sim.generate(bench.policy(p, config), trace)
            totals[p][trace.workload].add(stats)
            runs.append((p, trace.workload, tuple(trace.prompt_ids), stats))
    shares = {}
    for p in policies:
        pooled = policy_summary(runs, p, domains)
        switches = [s.draft_switches for q, w, _, s in runs if q == p and w in domains]
        shares[p] = {"mean_accepted": round(pooled["mean_accepted"], 4),
                     "fallback_fraction": rounded(pooled["fallback_fraction_of_iterations"]),
                     "switches_per_generation": round(sum(switches) / max(1, len(switches)), 3)}
    return totals, shares


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", type=Path, default=ROOT / "models")
    p.add_argument("--answers", type=Path, required=True, help="the held-out answers (memspec-zoo acceptance)")
    p.add_argument("--predictor", default="", metavar="DIR[,DIR...]",
                   help="trained predictors to replay, each in every run (default: <models>/predictor)")
    p.add_argument("--runs", default="docs/results/fp32,docs/results/int4",
                   help="committed `make bench` output folders whose costs to replay with (comma-separated)")
    p.add_argument("--prompts-per-workload", type=int, default=100)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--json", type=Path, default=ROOT / "docs" / "results" / "simulated-heldout.json")
    a = p.parse_args()
    torch.set_num_threads(a.threads)

    from memspec_ros.runtime.predictor import PredictionEngine

    predictor_dirs = [Path(d) for d in a.predictor.split(",") if d] or [a.models / "predictor"]
    missing = [str(d) for d in predictor_dirs if not find_predictor(d)]
    if missing:
        raise SystemExit(f"no trained predictor under {', '.join(missing)}: memspec cannot be replayed")
    models = load_models(a.models / "registry.yaml")
    predictors = {str(d): PredictionEngine.load(find_predictor(d), target=models.target.model,
                                                tokenizer=models.tokenizer) for d in predictor_dirs}
    answers = load_answers(a.answers, "heldout")
    if not answers:
        raise SystemExit(f"no held-out answers in {a.answers} (memspec-zoo acceptance --answers DIR makes them)")
    # the requests the build trained on (by material) are no held-out requests: left out
    answers, dropped = clean_heldout_answers(a.models, answers, models.tokenizer)
    t0 = time.time()
    traces = held_out_traces(models, answers, a.prompts_per_workload)
    workloads = list(dict.fromkeys(t.workload for t in traces))
    log(f"{len(traces)} traces over {', '.join(workloads)} in {time.time() - t0:.0f} s")
    domains = {e.name: e.domain for e in models.registry.entries()}
    report = {"what": "the policies replayed over the zoo's held-out requests with committed make-bench costs",
              "command": "scripts/simulate_heldout.py " + " ".join(
                  f"--{k.replace('_', '-')} {v}" for k, v in vars(a).items() if k not in ("models", "json") and v),
              "prompts_by_workload": {w: sum(t.workload == w for t in traces) for w in workloads},
              "left_out_as_trained_on": dropped,
              "runs": {}}
    first = committed_costs(ROOT / a.runs.split(",")[0])[2]  # the first run's gamma and N (the committed: 4, 4)
    report["hindsight_mean_accepted"] = hindsight(traces, first["gamma"], first["interval"])
    for run_dir, (predictor_dir, predictor) in ((r, q) for r in a.runs.split(",") for q in predictors.items()):
        costs, schedule, cfg = committed_costs(ROOT / run_dir)
        # `make bench` times no mab-sync: its points run the same UCB code as mab-async's, so they cost the same
        costs = costs if "mab-sync" in costs.point_seconds else costs.standing_in("mab-sync", "mab-async")
        bench_cfg = PolicyBenchConfig(policies=POLICIES, workloads=workloads, capacity=cfg["capacity"],
                                      interval=cfg["interval"], gamma=cfg["gamma"],
                                      recent_tokens=cfg["recent_tokens"], max_new_tokens=cfg["max_new_tokens"])
        bench = BenchRun(result={}, cfg=bench_cfg, traces=traces, costs=costs, schedule_costs=schedule,
                         predictor=replay_predictor(predictor, traces), domains=domains,
                         registry=models.registry, runs=[])
        refused = bench.refusal(POLICIES)  # a head trained for another N or T: no node runs it at the run's
        if refused:
            raise SystemExit(f"{run_dir} with {predictor_dir}: the controller refuses {refused}")
        t1 = time.time()
        totals, shares = replay(bench, list(POLICIES), workloads)
        entry = summary(totals, list(POLICIES), workloads)
        entry["iterations"] = shares
        entry["costs_from"] = {"run": run_dir, "target_path": cfg.get("quantization") or "none",
                               "draft_path": cfg.get("draft_quantization") or "none", "medium": costs.medium,
                               "iteration_seconds": schedule.iteration_seconds,
                               "load_in_iterations": rounded(
                                   load_to_iteration(costs.load_seconds, schedule.iteration_seconds), 3)}
        entry["simulation_seconds"] = round(time.time() - t1, 1)
        entry["predictor"] = predictor_dir
        key = run_dir if len(predictors) == 1 else f"{run_dir} with {predictor_dir}"
        report["runs"][key] = entry
        r = {k: {m: "n/a" if v is None else f"{v:.3f}" for m, v in ms.items()} for k, ms in entry["ratios"].items()}
        log(f"{key}: memspec / oracle-dynamic {r['memspec_vs_oracle-dynamic']['paper_metric']}, "
            f"/ mab-async {r['memspec_vs_mab-async']['paper_metric']}, "
            f"/ general-static {r['memspec_vs_general-static']['paper_metric']} "
            f"(end to end {r['memspec_vs_general-static']['end_to_end']})")
    models.close()
    a.json.write_text(json.dumps(report, indent=1))
    log(f"wrote {a.json}")


if __name__ == "__main__":
    main()
