"""The paper's evaluation (its section 4) from one command: `memspec-bench paper` (`make bench`).

One timed policy bench (runtime/controller.py, real runs) on the zoo's default workloads gives the
headline figures 6-9 and the goals; the trace-driven simulator (runtime/simulator.py), validated
against those same runs, gives the sweeps (figures 10-12, the storage media). Every item is a JSON
file and a PNG in ``out``; :func:`write_readme` gathers them into docs/results/README.md.

Items (the paper's numbering):

* fig6   normalized throughput per workload and GMEAN: General-Static, Oracle-Static, MAB-Async,
         Oracle-Dynamic, MemSpec (+ memspec-cost-aware)                                  real runs
* fig7   decode time breakdown, MAB-Async vs MemSpec (+ cost-aware)                      real runs
* fig8_9 General-Static, Prediction-Only, MemSpec (+ cost-aware): throughput and breakdown real runs
* fig10  scheduling interval N in 2, 4, 8, 16                                            simulator
* fig11  output length 64, 128, 256                                                      simulator
* fig12  resident capacity K in 2, 3, 4 (MAB-Async, MemSpec, cost-aware)                 simulator
* mab_c  MAB-Async's exploration coefficient c in 0.1, 0.5, 1, 2, 3 (the paper swept
         these and kept 2.0, which the real runs use)                                    simulator
* table2 predictor quality (top-1 / top-2 by input), from the predictor's training report
* storage end-to-end latency per storage medium (drafts loaded through each, measured)  simulator
* recent (beyond the paper, only when the live predictor's recent half is dead) the predicted
         policies with live recent features                                              simulator
* goals  issue 17's goals against the real runs (and the noise-free replay of the same runs)

Every figure names its storage medium and says it is emulated where it is.
"""

from __future__ import annotations

import json
import operator
import os
import statistics
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict
from pathlib import Path

from ..runtime.atomic_write import write_result_text
from ..runtime.policies import COST_AWARE
from ..runtime.simulator import CostModel
from ..runtime.stats import EXEC_PARTS, GenerationStats, GenerationTotals, ratio
from ..runtime.storage import MEDIA, DraftStorage, load_to_iteration, storage_medium
from .policy_bench import (
    BenchRun,
    PolicyBenchConfig,
    collect_policy_bench,
    domain_workloads,
    gmean,
    plot_policy_bench,
    pooled_shares,
    prompts_label,
    share,
    timed_loads,
    validation_gate,
    validation_table,
)

GS, OS, MAB, PO, OD, MS, CA = ("general-static", "oracle-static", "mab-async", "prediction-only", "oracle-dynamic",
                               "memspec", COST_AWARE)
REAL_POLICIES = (GS, OS, MAB, PO, OD, MS, CA)
SWEEP_POLICIES = (GS, MAB, OD, MS, CA)
PAPER_UCB_C = (0.1, 0.5, 1.0, 2.0, 3.0)  # the exploration coefficients the paper evaluated (its Section 4.1)
MEDIA_ORDER = ("local", "nvme", "emmc", "sd")
PAPER_LOAD_ITERATIONS = 2.7  # the paper's Jetson: a draft load over one speculative iteration
LABELS = {GS: "General-Static", OS: "Oracle-Static", MAB: "MAB-Async", PO: "Prediction-Only", OD: "Oracle-Dynamic",
          MS: "MemSpec", CA: "MemSpec cost-aware"}
COLORS = {GS: "#9e9e9e", OS: "#6a8caf", MAB: "#e39b3b", PO: "#b07cc6", OD: "#3b7d3b", MS: "#c0392b", CA: "#7f1d1d"}
BEGIN, END = "<!-- paper-evaluation:begin (memspec-bench paper writes this part) -->", "<!-- paper-evaluation:end -->"


# -- what the real runs say ------------------------------------------------------------------------------

def medium_note(medium: str) -> str:
    m = MEDIA[medium]
    return f"storage: {medium}" + (" (emulated)" if m.emulated else " (this machine's disk, not emulated)")


def policy_summary(runs: Sequence[tuple[str, str, tuple, GenerationStats]], policy: str,
                   workloads: Sequence[str]) -> dict:
    """Pooled over a policy's runs on ``workloads``: execution parts, fallback and prediction shares, E[A]."""
    parts = dict.fromkeys(EXEC_PARTS, 0.0)
    totals = GenerationTotals()  # the pooled shares, as the policy bench's rows report them
    for p, w, _, stats in runs:
        if p != policy or w not in workloads:
            continue
        for k, v in stats.execution_parts().items():
            parts[k] += v
        totals.add(stats)
    decode, e2e = totals.decode_seconds, totals.end_to_end_seconds
    fallback, prediction = pooled_shares(totals)  # None where there is none: the goals' rows are not met on it
    return {
        "execution_seconds": parts,
        "decode_seconds": decode,
        "end_to_end_seconds": e2e,
        "fallback_fraction_of_iterations": fallback,
        "prediction_share_of_decode": prediction,
        # the scheduling points' prediction on the decode thread (the first choice's, in setup, is not in it)
        "decode_prediction_share_of_end_to_end": totals.breakdown["prediction"] / e2e if e2e else None,
        "mean_accepted": totals.mean_accepted,
    }


def _or_na(value: float | None, spec: str, missing: str = "a zero baseline") -> str:
    """``value`` as the README prints it, or "n/a (``missing``)" where it is undefined (None)."""
    return f"n/a ({missing})" if value is None else format(value, spec)


def _x(value: float | None) -> str:
    """A ratio; "n/a" where :func:`ratio` had a zero base."""
    return _or_na(value, ".3f")


def _loads(value: float | None) -> str:
    """A load in speculative iterations; "n/a" where no iteration time was measured (storage.load_to_iteration)."""
    return _or_na(value, ".2f", "no iteration timed")


def load_sentence(storage: dict) -> str:
    """A policy bench's draft load in words: timed alone (what every model charges) and within its timed runs."""
    alone = ("" if "modelled_load_seconds" not in storage else
             f"{storage['modelled_load_seconds'] * 1000:.0f} ms alone"
             f" = {_loads(storage['modelled_load_to_iteration'])} speculative iterations (what Oracle-Dynamic's plan,"
             " the simulator and the storage item charge); ")
    return (f"a draft load took {alone}{storage['load_seconds'] * 1000:.0f} ms ="
            f" {_loads(storage['load_to_iteration'])} iterations within the timed runs, beside decoding (one"
            f" iteration {storage['iteration_seconds'] * 1000:.1f} ms)")


def _times(value: float | None) -> str:
    return _or_na(value, ".3f") + ("" if value is None else "x")


def normalized(table: dict, policies: Sequence[str], workloads: Sequence[str], key: str, base: str = GS) -> dict:
    """Per workload, each policy's ``key`` over the base policy's; GMEAN over ``workloads``."""
    out = {w: {p: table[w][p][key] / table[w][base][key] for p in policies if table[w][base][key] > 0}
           for w in table}
    # a workload without its base ratio makes the GMEAN 0, as gmean's own rule: never one over fewer workloads
    out["GMEAN"] = {p: gmean([out[w][p] if p in out[w] else 0.0 for w in workloads]) for p in policies}
    return out


def simulated_table(totals: dict) -> dict:
    """{workload: {policy: {tokens_per_second, end_to_end_tokens_per_second}}} from simulated totals."""
    table: dict = {}
    for p, per_workload in totals.items():
        for w, t in per_workload.items():
            table.setdefault(w, {})[p] = {"tokens_per_second": t.tokens_per_second,
                                          "end_to_end_tokens_per_second": t.end_to_end_tokens_per_second,
                                          "end_to_end_seconds_per_generation": t.end_to_end_seconds / max(
                                              1, t.generations)}
    return table


# -- the items -------------------------------------------------------------------------------------------

def replay_table(result: dict) -> dict | None:
    """The real runs replayed at constant machine speed (the validation's pooled replay), as a result table."""
    pooled = (result.get("simulator_validation") or {}).get("pooled")
    if not pooled:
        return None
    return {w: {p: {"tokens_per_second": r["workloads"][w]["simulated_tokens_per_second"],
                    "end_to_end_tokens_per_second": r["workloads"][w]["simulated_end_to_end"]}
                for p, r in pooled["policies"].items()} for w in result["workloads"]}


def figure6(bench: BenchRun, medium: str) -> dict:
    result = bench.result
    policies = [p for p in (GS, OS, MAB, OD, MS, CA) if p in result["config"]["policies"]]
    workloads = list(result["workloads"])
    domains = domain_workloads(workloads)
    replay = replay_table(result)
    return {
        "item": "fig6", "source": "real runs", "medium": medium,
        "title": "Normalized steady-state throughput (the paper's metric) per workload, GMEAN over "
                 + ", ".join(domains),
        "policies": policies, "workloads": workloads, "gmean_over": domains,
        "normalized_tokens_per_second": normalized(result["workloads"], policies, domains, "tokens_per_second"),
        "normalized_end_to_end": normalized(result["workloads"], policies, domains, "end_to_end_tokens_per_second"),
        "tokens_per_second": {w: {p: result["workloads"][w][p]["tokens_per_second"] for p in policies}
                              for w in workloads},
        "prompts_per_workload": result["config"]["prompts"],
        # the same runs replayed by the validated simulator at constant machine speed (a cross-check)
        "replay_normalized_tokens_per_second": None if replay is None else normalized(
            replay, policies, domains, "tokens_per_second"),
    }


def breakdown_relative_to(summaries: dict[str, dict], base_policy: str) -> dict[str, dict[str, float | None]]:
    """Each policy's decode-time parts over ``base_policy``'s whole decode time (figures 7 and 9); None where that
    is 0 (every generation of it ended at the prefill) or the policy was not run, as :func:`ratio` has it."""
    base = summaries[base_policy]["decode_seconds"] if base_policy in summaries else 0.0
    return {p: {k: ratio(v, base) for k, v in s["execution_seconds"].items()} for p, s in summaries.items()}


def figure7(bench: BenchRun, medium: str) -> dict:
    workloads = domain_workloads(list(bench.result["workloads"]))
    policies = [p for p in (MAB, MS, CA) if p in bench.result["config"]["policies"]]
    summaries = {p: policy_summary(bench.runs, p, workloads) for p in policies}
    return {
        "item": "fig7", "source": "real runs", "medium": medium,
        "title": "Decode time breakdown relative to MAB-Async's decode time (same prompts)",
        "policies": policies, "workloads": workloads, "parts": list(EXEC_PARTS),
        "normalized_to_mab_async": breakdown_relative_to(summaries, MAB),
        "summaries": summaries,
    }


def figure8_9(bench: BenchRun, medium: str) -> dict:
    result = bench.result
    policies = [p for p in (GS, PO, MS, CA) if p in result["config"]["policies"]]
    workloads = domain_workloads(list(result["workloads"]))
    summaries = {p: policy_summary(bench.runs, p, workloads) for p in policies}
    return {
        "item": "fig8_9", "source": "real runs", "medium": medium,
        "title": "Component analysis: throughput normalized to General-Static (fig. 8) and decode time breakdown"
                 " relative to General-Static's (fig. 9)",
        "policies": policies, "workloads": workloads, "parts": list(EXEC_PARTS),
        "normalized_tokens_per_second": normalized(result["workloads"], policies, workloads,
                                                   "tokens_per_second")["GMEAN"],
        "breakdown_normalized_to_general_static": breakdown_relative_to(summaries, GS),
        "summaries": summaries,
    }


def sweep(bench: BenchRun, name: str, values: Sequence[int], field_name: str, policies: Sequence[str],
          medium: str, title: str) -> dict:
    workloads = domain_workloads(sorted({t.workload for t in bench.traces}))
    # a setting the controller refuses for a ranking policy (a head trained for another N) is not published
    refused = {str(v): r for v in values if (r := bench.refusal(policies, **{field_name: v}))}
    values = [v for v in values if str(v) not in refused]
    if refused:
        title += f" ({field_name} {', '.join(refused)} left out: the controller refuses them with this predictor)"
    rows = {}
    for value in values:
        table = simulated_table(bench.simulate(policies, **{field_name: value}))
        rows[str(value)] = {
            "normalized_tokens_per_second": normalized(table, policies, workloads, "tokens_per_second")["GMEAN"],
            "tokens_per_second": {p: gmean([table[w][p]["tokens_per_second"] for w in workloads]) for p in policies},
            "end_to_end_tokens_per_second": {p: gmean([table[w][p]["end_to_end_tokens_per_second"]
                                                       for w in workloads]) for p in policies},
        }
    return {"item": name, "source": "simulator", "medium": medium, "title": title, "parameter": field_name,
            "values": list(values), "policies": list(policies), "gmean_over": workloads, "rows": rows,
            "refused": refused}


def storage_item(bench: BenchRun, media_loads: dict[str, dict[str, float]]) -> dict:
    workloads = domain_workloads(sorted({t.workload for t in bench.traces}))
    rows = {}
    for medium, loads in media_loads.items():
        costs = bench.costs.with_loads(loads, medium)
        table = simulated_table(bench.simulate(SWEEP_POLICIES, costs=costs))
        rows[medium] = {
            "emulated": MEDIA[medium].emulated,
            "load_seconds_per_draft": statistics.fmean(loads.values()),
            "load_to_iteration": load_to_iteration(loads, bench.costs.iteration_seconds(bench.cfg.gamma)),
            # a GMEAN as the item's gmean_over says (an arithmetic mean was labelled one)
            "end_to_end_seconds_per_generation": {
                p: gmean([table[w][p]["end_to_end_seconds_per_generation"] for w in workloads])
                for p in SWEEP_POLICIES},
            "end_to_end_tokens_per_second": {p: gmean([table[w][p]["end_to_end_tokens_per_second"]
                                                       for w in workloads]) for p in SWEEP_POLICIES},
        }
    measured = bench.result["storage"]["medium"]
    return {"item": "storage", "source": "simulator (load times measured through each medium)",
            "title": "End-to-end latency per generation per storage medium (prefill and the first draft load"
                     " included)", "media": list(media_loads), "policies": list(SWEEP_POLICIES),
            "gmean_over": workloads, "rows": rows,
            "measured_medium": measured,
            "measured_end_to_end_seconds_per_generation": measured_seconds_per_generation(
                bench.runs, workloads, [p for p in SWEEP_POLICIES if p in bench.result["config"]["policies"]])}


def measured_seconds_per_generation(runs, workloads: list[str], policies: list[str]) -> dict[str, float]:
    """Per policy, the timed runs' end-to-end seconds per generation as the simulated figures beside them are
    averaged: a GMEAN over the workloads of each workload's mean (every workload weighs the same, whatever its
    number of prompts). ``runs``: (policy, workload, prompt, GenerationStats) of every timed generation."""
    return {p: gmean([statistics.fmean([s.end_to_end_seconds for q, v, _, s in runs if q == p and v == w])
                      for w in workloads]) for p in policies}


def predictor_report(predictor_dir: Path) -> Path:
    """The training report of the predictor the runs used (memspec-train-predictor writes it beside the encoder
    folders: ``<out>/report.json``, ``predictor_dir`` being ``<out>`` or ``<out>/<encoder>``)."""
    from ..runtime.loader import find_predictor

    head = Path(find_predictor(predictor_dir) or predictor_dir)
    for candidate in (head / "report.json", head.parent / "report.json"):
        if candidate.is_file():
            return candidate
    return head.parent / "report.json"  # none: table2 says so by its empty rows


def table2(report_path: Path) -> dict:
    report = json.loads(report_path.read_text(encoding="utf-8")) if report_path.is_file() else {}
    rows = {}
    for encoder, inputs in report.get("encoders", {}).items():
        for name in ("prompt", "recent", "prompt+recent"):
            if name in inputs:
                rows.setdefault(encoder, {})[name] = {"top1": inputs[name]["top1"], "top2": inputs[name]["top2"],
                                                      "contexts": inputs[name].get("contexts")}
    # the same held-out requests as the latest turn after an earlier one (memspec-train-predictor's conversation
    # forms; a report from before them has none)
    after_turn = {encoder: {name: {"top1": r["top1"], "top2": r["top2"]} for name, r in inputs.items()}
                  for encoder, inputs in report.get("conversations", {}).get("encoders", {}).items()}
    shown = Path(*report_path.parts[-3:]) if len(report_path.parts) >= 3 else report_path
    # what a label is decides what the accuracy means (1: the paper's next interval; 0: the rest of the output;
    # a report from before the option had 1)
    horizon = report.get("label_horizon_intervals", 1) if report else None
    # every figure names its storage medium: this one read none (accuracy, not a timed run)
    return {"item": "table2", "source": f"{shown} (the predictor's held-out training contexts; reused)",
            "medium": "storage: none (the predictor's accuracy: nothing is loaded or timed)",
            "title": "Predictor quality: top-1 accuracy and top-2 recall by input", "rows": rows,
            "majority_top1": report.get("majority_top1"), "heldout_prompts": report.get("heldout_prompts"),
            "label_horizon_intervals": horizon, "label_rule": report.get("label_rule") if report else None,
            "after_an_earlier_turn": after_turn,
            "prompt_tokens": report.get("prompt_tokens", 0) if report else None,
            "trained_on_conversations": report.get("conversations", {}).get("trained_on")}


def recent_whatif(bench: BenchRun, medium: str) -> dict | None:
    """The predicted policies with the recent half of the features live, replayed (when the live one is dead)."""
    live = (bench.result.get("predictor") or {}).get("recent_features_live")
    encoder = getattr(bench.predictor, "encoder", None)
    if live is not False or encoder is None or not hasattr(encoder, "recent"):
        return None
    policies = [GS, PO, MS, CA]
    workloads = domain_workloads(sorted({t.workload for t in bench.traces}))
    rows = {}
    for label, recent in (("as run (recent half zero)", False), ("recent tokens live", True)):
        encoder.recent = recent
        table = simulated_table(bench.simulate(policies))
        rows[label] = normalized(table, policies, workloads, "tokens_per_second")["GMEAN"]
    encoder.recent = False
    return {"item": "recent", "source": "simulator", "medium": medium,
            "title": "Predicted policies if the target-hidden predictor saw the recent tokens (normalized to"
                     " General-Static, GMEAN)", "policies": policies, "gmean_over": workloads, "rows": rows}


COMPARISONS = {">=": operator.ge, ">": operator.gt, "<=": operator.le}  # a goal row's check, as its page prints it


def goals(bench: BenchRun, fig6: dict) -> dict:
    """Issue 17's goals on the real runs: measured value, goal, met, and the gap."""
    result = bench.result
    domains = fig6["gmean_over"]
    table = result["workloads"]

    def g(policy: str, key: str = "tokens_per_second", tab: dict = table) -> float:
        return gmean([tab[w][policy][key] for w in domains])

    ms = policy_summary(bench.runs, MS, domains)
    rows = []

    def add(name: str, value: float | None, goal: float, compare: str = ">=") -> None:
        # None: a ratio over a zero rate (a baseline that committed nothing), which no goal passes. ">": the goal says
        # "above" (strictly), and the page prints the comparison it was checked with
        met = value is not None and COMPARISONS[compare](value, goal)
        rows.append({"goal": name, "measured": value, "target": goal, "met": met, "compare": compare,
                     "gap": None if value is None else (value - goal) if not met else 0.0})

    add("MemSpec / Oracle-Dynamic (paper's metric)", ratio(g(MS), g(OD)), 0.95)
    add("MemSpec / MAB-Async (paper's metric)", ratio(g(MS), g(MAB)), 1.3)
    per_workload = [ratio(table[w][MS]["tokens_per_second"], table[w][MAB]["tokens_per_second"]) for w in domains]
    worst = None if None in per_workload else min(per_workload)  # a zero MAB-Async rate was inf: "met"
    add("MemSpec / MAB-Async on the worst workload", worst, 1.0, ">")
    add("MemSpec / General-Static (paper's metric)", ratio(g(MS), g(GS)), 1.3)
    e2e = "end_to_end_tokens_per_second"
    add("MemSpec / General-Static (end to end)", ratio(g(MS, e2e), g(GS, e2e)), 1.2)
    add("MemSpec / MAB-Async (end to end)", ratio(g(MS, e2e), g(MAB, e2e)), 1.2)
    add("MemSpec fallback (share of speculative iterations)", ms["fallback_fraction_of_iterations"], 0.055, "<=")
    add("MemSpec prediction overhead (share of decode time)", ms["prediction_share_of_decode"], 0.04, "<=")
    cost_aware = {}
    if CA in result["config"]["policies"]:
        ca = policy_summary(bench.runs, CA, domains)
        cost_aware = {"vs_oracle_dynamic": ratio(g(CA), g(OD)), "vs_mab_async": ratio(g(CA), g(MAB)),
                      "vs_general_static": ratio(g(CA), g(GS)), "vs_memspec": ratio(g(CA), g(MS)),
                      "end_to_end_vs_general_static": ratio(g(CA, e2e), g(GS, e2e)),
                      "end_to_end_vs_mab_async": ratio(g(CA, e2e), g(MAB, e2e)),
                      "fallback_fraction_of_iterations": ca["fallback_fraction_of_iterations"],
                      "prediction_share_of_decode": ca["prediction_share_of_decode"]}
    # what bounds the goals on this zoo, measured
    storage = result["storage"]
    headroom = {"oracle_dynamic_vs_general_static": ratio(g(OD), g(GS)),
                "oracle_static_vs_general_static": ratio(g(OS), g(GS)),
                # what the schedule, the simulator and the storage item charge (a run from before: its runs' loads)
                "load_to_iteration": storage.get("modelled_load_to_iteration", storage.get("load_to_iteration")),
                "mean_accepted": {p: policy_summary(bench.runs, p, domains)["mean_accepted"]
                                  for p in result["config"]["policies"]},
                "predictor_recent_features_live": (result.get("predictor") or {}).get("recent_features_live")}
    replay = None
    sim = replay_table(result)  # the validation's pooled replay, as figure 6 shows it
    if sim is not None:
        replay = {"memspec_vs_oracle_dynamic": ratio(g(MS, tab=sim), g(OD, tab=sim)),
                  "memspec_vs_mab_async": ratio(g(MS, tab=sim), g(MAB, tab=sim)),
                  "memspec_vs_general_static": ratio(g(MS, tab=sim), g(GS, tab=sim)),
                  "end_to_end_memspec_vs_general_static": ratio(g(MS, e2e, sim), g(GS, e2e, sim)),
                  "end_to_end_memspec_vs_mab_async": ratio(g(MS, e2e, sim), g(MAB, e2e, sim)),
                  "oracle_dynamic_vs_general_static": ratio(g(OD, tab=sim), g(GS, tab=sim))}
    return {"item": "goals", "source": "real runs", "gmean_over": domains, "rows": rows, "cost_aware": cost_aware,
            "headroom": headroom, "noise_free_replay": replay}


# -- plots -----------------------------------------------------------------------------------------------

def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _bars(ax, groups: Sequence[str], series: dict[str, Sequence[float]], ylabel: str) -> None:
    width = 0.8 / max(1, len(series))
    for j, (p, values) in enumerate(series.items()):
        ax.bar([g + j * width for g in range(len(groups))], values, width, label=LABELS.get(p, p),
               color=COLORS.get(p))
    ax.set_xticks([g + 0.4 - width / 2 for g in range(len(groups))], groups)
    ax.set_ylabel(ylabel)
    ax.axhline(1.0, color="black", lw=0.6, ls=":")
    ax.legend(ncol=3, fontsize=7)


def _stacked(ax, policies: Sequence[str], parts: Sequence[str], values: dict[str, dict[str, float | None]],
             ylabel: str) -> None:
    bottom = [0.0] * len(policies)
    colors = {"desired": "#2e7d32", "fallback": "#ef6c00", "target_only": "#9e9e9e", "prediction": "#6a1b9a",
              "load_wait": "#c62828", "other": "#cfd8dc"}
    if any(values[p][part] is None for p in policies for part in parts):  # a zero baseline: nothing to draw
        ax.text(0.5, 0.5, "n/a: the baseline policy was not run, or decoded nothing", ha="center", va="center",
                transform=ax.transAxes)
        ax.set_ylabel(ylabel)
        return
    for part in parts:
        heights = [values[p][part] for p in policies]
        ax.bar([LABELS.get(p, p) for p in policies], heights, bottom=bottom, label=part.replace("_", " "),
               color=colors.get(part))
        bottom = [b + h for b, h in zip(bottom, heights, strict=True)]
    ax.set_ylabel(ylabel)
    ax.legend(fontsize=7, ncol=3)


def _title(item: dict, extra: str = "") -> str:
    return f"{item['title']}\n[{item['source']}; {medium_note(item['medium'])}{extra}]"


def plot(item: dict, path: Path, context: str) -> None:
    """One PNG per item; ``context`` (K, N, tokens, prompts) goes under every title."""
    plt = _plt()
    kind = item["item"]
    if kind == "fig6":
        panels = [("normalized_tokens_per_second", "real, paper's metric"),
                  ("normalized_end_to_end", "real, end to end"),
                  ("replay_normalized_tokens_per_second", "replay at constant speed, paper's metric")]
        panels = [pl for pl in panels if item.get(pl[0])]
        fig, axes = plt.subplots(len(panels), 1, figsize=(11, 3.6 * len(panels)))
        groups = item["workloads"] + ["GMEAN"]
        for ax, (key, label) in zip(axes, panels, strict=True):
            data = item[key]
            _bars(ax, groups, {p: [data[g].get(p, 0.0) for g in groups] for p in item["policies"]},
                  "throughput / General-Static")
            ax.set_title(label, fontsize=8)
        fig.suptitle(_title(item, "; " + context), fontsize=8)
    elif kind in ("fig7", "fig8_9"):
        if kind == "fig8_9":
            fig, axes = plt.subplots(1, 2, figsize=(12, 4.2))
            norm = item["normalized_tokens_per_second"]
            axes[0].bar([LABELS[p] for p in item["policies"]], [norm[p] for p in item["policies"]],
                        color=[COLORS[p] for p in item["policies"]])
            axes[0].axhline(1.0, color="black", lw=0.6, ls=":")
            axes[0].set_ylabel("throughput / General-Static (GMEAN)")
            ax, values = axes[1], item["breakdown_normalized_to_general_static"]
            ylabel = "decode time / General-Static's"
        else:
            fig, ax = plt.subplots(figsize=(7, 4.2))
            values, ylabel = item["normalized_to_mab_async"], "decode time / MAB-Async's"
        _stacked(ax, item["policies"], item["parts"], values, ylabel)
        fig.suptitle(_title(item, "; " + context), fontsize=8)
    elif kind in ("fig10", "fig11", "fig12", "mab_c"):
        fig, ax = plt.subplots(figsize=(7.5, 4.2))
        groups = [str(v) for v in item["values"]]
        shown = [p for p in item["policies"] if p != GS]
        _bars(ax, groups, {p: [item["rows"][g]["normalized_tokens_per_second"][p] for g in groups] for p in shown},
              "throughput / General-Static (GMEAN)")
        ax.set_xlabel(item["parameter"])
        fig.suptitle(_title(item, "; " + context), fontsize=8)
    elif kind == "storage":
        fig, ax = plt.subplots(figsize=(8, 4.2))
        media = item["media"]
        _bars(ax, [f"{m}{' (emul.)' if item['rows'][m]['emulated'] else ''}" for m in media],
              {p: [item["rows"][m]["end_to_end_seconds_per_generation"][p] for m in media] for p in item["policies"]},
              "end-to-end seconds per generation")
        ax.lines[0].set_visible(False)
        fig.suptitle(f"{item['title']}\n[{item['source']};\neMMC, SD and NVMe are emulated media; {context}]",
                     fontsize=8)
    elif kind == "recent":
        fig, ax = plt.subplots(figsize=(7, 4.2))
        labels = list(item["rows"])
        _bars(ax, labels, {p: [item["rows"][r][p] for r in labels] for p in item["policies"] if p != GS},
              "throughput / General-Static (GMEAN)")
        fig.suptitle(_title(item, "; " + context), fontsize=8)
    elif kind == "table2":
        fig, ax = plt.subplots(figsize=(7, 1.2 + 0.3 * sum(len(v) for v in item["rows"].values())))
        ax.axis("off")
        after = item.get("after_an_earlier_turn") or {}
        cells = [[enc, name, f"{r['top1']:.1%}", f"{r['top2']:.1%}",
                  f"{after[enc][name]['top1']:.1%}" if name in after.get(enc, {}) else "n/a"]
                 for enc, rows in item["rows"].items() for name, r in rows.items()]
        if cells:
            ax.table(cellText=cells, colLabels=["encoder", "input", "top-1 acc.", "top-2 recall",
                                                "top-1 after a turn"], loc="center")
        ax.set_title(f"{item['title']}\n[{item['source']}; {item.get('medium', 'storage: none')}]", fontsize=8)
    else:
        return
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# -- the harness -----------------------------------------------------------------------------------------

def measure_media(bench: BenchRun, media: Sequence[str]) -> dict[str, dict[str, float]]:
    """Each draft loaded once through each medium (cold, paced), as the timed runs' cache loads it
    (policy_bench.timed_loads, as Oracle-Dynamic's costs are measured): the load times the storage sweep uses. The
    bench's own medium keeps the loads measured before its runs, which its cost model, Oracle-Dynamic's plan and the
    validated simulator charge: a second sample of one figure gave the page two load costs for one medium, and a
    storage row that was not the validated configuration."""
    return {medium: dict(bench.costs.load_seconds) if medium == bench.costs.medium else
            timed_loads(bench.registry, DraftStorage(storage_medium(medium)), **bench.loader_options)
            for medium in media}


def run_paper(zoo: Path, out: Path, *, prompts: int = 2, storage: str = "emmc", threads: int = 1,
              predictor_dir: Path | None = None, workloads: Sequence[str] | None = None,
              workloads_dir: Path | None = None, quantization: str = "none", draft_quantization: str = "none",
              progress=None, log: Callable[[str], None] = print) -> dict:
    """The whole evaluation; writes every item's JSON and PNG into ``out`` and returns the index."""
    from ..runtime.loader import find_predictor

    predictor_dir = predictor_dir or zoo / "predictor"  # its target-hidden head first, then minilm
    if not find_predictor(predictor_dir):  # the figures compare MemSpec: say so now, not after the timed runs
        raise FileNotFoundError(f"no trained predictor in {predictor_dir}: the paper's evaluation runs MemSpec and"
                                " Prediction-Only, which need one (memspec-zoo build trains it, or give"
                                " --predictor)")
    t0 = time.perf_counter()
    out.mkdir(parents=True, exist_ok=True)
    # everything is written into a folder beside the results and moved in at the end: a failure or Ctrl-C after the
    # real runs (media, sweeps, plots) left a new policies.json beside the old figures, and --render-only then
    # showed the two runs on one page. What was made stays there, named in the error.
    stage = Path(tempfile.mkdtemp(prefix=".paper-run-", dir=out))
    try:
        index, items, result = _evaluate(zoo, stage, t0, prompts=prompts, storage=storage, threads=threads,
                                         predictor_dir=predictor_dir, workloads=workloads,
                                         workloads_dir=workloads_dir, quantization=quantization,
                                         draft_quantization=draft_quantization, progress=progress, log=log)
    except BaseException:
        kept = sorted(f.name for f in stage.iterdir())
        log(f"the evaluation stopped before publishing: {out} is unchanged"
            + (f"; what it had made ({', '.join(kept)}) is in {stage}" if kept else ""))
        if not kept:
            stage.rmdir()
        raise
    for made in stage.iterdir():
        os.replace(made, out / made.name)
    stage.rmdir()
    write_readme(out, items, result, index)
    return index


def _evaluate(zoo: Path, stage: Path, t0: float, *, prompts: int, storage: str, threads: int, predictor_dir: Path,
              workloads: Sequence[str] | None, workloads_dir: Path | None, quantization: str,
              draft_quantization: str, progress, log: Callable[[str], None]) -> tuple[dict, dict, dict]:
    """run_paper's runs and items, written into ``stage``: (the index, the items by name, the real runs' result)."""
    out = stage
    cfg = PolicyBenchConfig(policies=REAL_POLICIES, prompts=prompts, storage=storage, threads=threads,
                            trace_tokens=256, quantization=quantization, draft_quantization=draft_quantization,
                            workloads_dir=str(workloads_dir or ""),
                            **({"workloads": tuple(workloads)} if workloads else {}))
    bench = collect_policy_bench(zoo, cfg, predictor_dir, progress)
    real_seconds = time.perf_counter() - t0
    result = bench.result
    (out / "policies.json").write_text(json.dumps(result, indent=2) + "\n")
    plot_policy_bench(result, out / "policies.png")
    log(validation_table(result["simulator_validation"]))
    t1 = time.perf_counter()
    media = measure_media(bench, MEDIA_ORDER)
    context = (f"K={cfg.capacity}, N={cfg.interval}, gamma={cfg.gamma}, {cfg.max_new_tokens} tokens,"
               f" {prompts_label(result['config'])}, {Path(result['config']['zoo']).name}/ zoo")
    fig6 = figure6(bench, storage)
    items = [fig6, figure7(bench, storage), figure8_9(bench, storage),
             sweep(bench, "fig10", (2, 4, 8, 16), "interval", SWEEP_POLICIES, storage,
                   "Sensitivity to the scheduling interval N (normalized to General-Static at the same N)"),
             sweep(bench, "fig11", (64, 128, 256), "max_new_tokens", SWEEP_POLICIES, storage,
                   "Sensitivity to the output length (normalized to General-Static at the same length)"),
             sweep(bench, "fig12", (2, 3, 4), "capacity", (GS, MAB, MS, CA, OD), storage,
                   "Sensitivity to the resident capacity K (normalized to General-Static)"),
             # the paper swept MAB-Async's c over these and kept its best, 2.0, which the real runs use: whether
             # 2.0 is the best here too (the reward, accepted tokens per iteration, spans 0..gamma), or a handicap
             sweep(bench, "mab_c", PAPER_UCB_C, "ucb_c", (GS, MAB), storage,
                   "MAB-Async's exploration coefficient c, as the paper swept it (the real runs use 2.0;"
                   " normalized to General-Static)"),
             table2(predictor_report(predictor_dir)),
             storage_item(bench, media)]
    whatif = recent_whatif(bench, storage)
    if whatif is not None:
        items.append(whatif)
    items.append(goals(bench, fig6))
    for item in items:
        item.setdefault("context", context)
        (out / f"{item['item']}.json").write_text(json.dumps(item, indent=2) + "\n")
        plot(item, out / f"{item['item']}.png", context)
    index = {"items": [i["item"] for i in items], "real_seconds": real_seconds,
             "simulated_seconds": time.perf_counter() - t1, "wall_seconds": time.perf_counter() - t0,
             # the bench's own config: it takes the predictor's window T, which may not be the default
             "config": asdict(bench.cfg) | {"policies": list(cfg.policies), "workloads": list(cfg.workloads)},
             "validation": {**validation_gate(result["simulator_validation"]),
                            "tolerance": result["simulator_validation"]["tolerance"],
                            "speed_matched_max_abs_error_end_to_end":
                                result["simulator_validation"]["max_abs_error_end_to_end"]},
             "lossless": result["lossless"], "cost_model": CostModel.to_json(bench.costs)}
    (out / "paper.json").write_text(json.dumps(index, indent=2) + "\n")
    return index, {i["item"]: i for i in items}, result


# -- the results page ------------------------------------------------------------------------------------

def _pct(x: float | None) -> str:
    return share(x, signed=True)


def rerender(out: Path) -> None:
    """Redraw the PNGs and regenerate the README part from the items already in ``out`` (no runs)."""
    missing = [name for name in ("paper.json", "policies.json") if not (out / name).is_file()]
    if missing:
        raise FileNotFoundError(f"{out}: no {' or '.join(missing)}; --render-only redraws what `memspec-bench paper`"
                                " wrote there (run it first, or give its --out)")
    index = json.loads((out / "paper.json").read_text(encoding="utf-8"))
    items = {name: json.loads((out / f"{name}.json").read_text(encoding="utf-8")) for name in index["items"]}
    for name, item in items.items():
        plot(item, out / f"{name}.png", item.get("context", ""))
    write_readme(out, items, json.loads((out / "policies.json").read_text(encoding="utf-8")), index)


def write_readme(out: Path, items: dict, result: dict, index: dict) -> None:
    """Replace the generated part of ``out``/README.md (between the markers) with the items."""
    readme = out / "README.md"
    text = readme.read_text(encoding="utf-8") if readme.is_file() else "# Results\n"
    body = render(items, result, index, out)
    if BEGIN in text and END in text:
        text = text[: text.index(BEGIN)] + body + text[text.index(END) + len(END):]
    else:
        text = text.rstrip() + "\n\n" + body + "\n"
    write_result_text(readme, text)  # its hand-written parts are never left half-written


def _path_name(quantization: str) -> str:
    return "fp32" if quantization == "none" else quantization


def _lossless_line(result: dict) -> str:
    """Whether every timed output equalled the target's own greedy output (the engine's forward, no draft)."""
    broken = sorted({f"{p} on {w}" for w, row in result["workloads"].items() for p, r in row.items()
                     if not r["lossless"]})
    if not broken:
        return ("Lossless: every timed output equals the target's own greedy output on this forward path (the"
                " engine's forward, one token per step, no draft): **yes**.")
    return ("Lossless: **NO**: some outputs differ from the target's own greedy output on this forward path ("
            + ", ".join(broken) + "); the ratios below compare runs of different texts.")


def _zoo_name(zoo: str) -> str:
    """The zoo the runs used, as the results page names it: the bundled one (this repository's models/) or its
    folder."""
    bundled = Path(__file__).resolve().parents[2] / "models"
    return "Bundled zoo (`models/`)" if Path(zoo).resolve() == bundled else f"Zoo `{zoo}`"


def render_validation(v: dict) -> list[str]:
    """The results page's simulator validation: its table and the largest errors (n/a where undefined)."""
    held = v.get("held_out") or {}
    matched = v.get("held_out_speed_matched") or {}
    gate = validation_gate(v)
    lines = ["", "### Simulator validation", "",
              f"Every timed generation replayed on its prompt's trace with the same policy object and a cost model"
              f" fitted to these runs; GMEAN over {', '.join(v.get('gmean_over') or [])} on both sides (held out: over"
              f" {', '.join(held.get('gmean_over') or []) or 'none'}, the workloads with a second prompt); tolerance"
              f" {v['tolerance']:.0%} end to end. **Held out** (the gate where a workload has a second prompt; else the"
              " pooled replay is, in sample) fits the cost model on each workload's even-numbered prompts only and"
              " replays the others at the fitted speed against their own measurements: no figure of a checked run"
              " enters its replay. Speed-matched scales each replay's"
              " compute times by the machine speed measured in that generation (its target verify time over the"
              " model's), so the verify time, most of decoding, agrees by construction: it shows what the model"
              " gets wrong besides this machine's drift. Pooled replays every run at the fitted speed, in sample.", "",
              "| policy | e2e real | e2e sim (speed-matched) | error | decode real | decode sim | error |"
              " pooled e2e error | held-out e2e error | held-out speed-matched |",
              "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for p, r in v["policies"].items():
        pooled = v["pooled"]["policies"][p]["error_end_to_end"]
        held_error = held.get("policies", {}).get(p, {}).get("error_end_to_end")
        matched_error = matched.get("policies", {}).get(p, {}).get("error_end_to_end")
        lines.append(f"| {p} | {r['measured_end_to_end']:.2f} | {r['simulated_end_to_end']:.2f} |"
                     f" {_pct(r['error_end_to_end'])} | {r['measured_tokens_per_second']:.2f} |"
                     f" {r['simulated_tokens_per_second']:.2f} | {_pct(r['error_tokens_per_second'])} |"
                     f" {_pct(pooled)} | {_pct(held_error)} | {_pct(matched_error)} |")
    lines += ["", f"Gate ({gate['kind']}): largest end-to-end error {share(gate['max_abs_error_end_to_end'])}"
              f" ({'within' if gate['within_tolerance'] else 'OUTSIDE'} the tolerance). Largest speed-matched:"
              f" {share(v['max_abs_error_end_to_end'])}; pooled: {share(v['pooled']['max_abs_error_end_to_end'])}"
              + (f"; held out: {share(held['max_abs_error_end_to_end'])}" if held else "")
              + (f"; held out speed-matched: {share(matched['max_abs_error_end_to_end'])}" if matched else "")
              + ".", ""]
    return lines


def render(items: dict, result: dict, index: dict, out_dir: Path) -> str:
    cfg = result["config"]
    storage = result["storage"]
    v = result["simulator_validation"]
    g = items["goals"]
    lines = [BEGIN, "", "## The paper's evaluation (`make bench`)", "",
             f"Generated by `memspec-bench paper` in {index['wall_seconds'] / 60:.1f} min on this machine"
             f" ({index['real_seconds'] / 60:.1f} min of real runs, {index['simulated_seconds']:.0f} s of"
             f" simulation and media measurements). {_zoo_name(result['config']['zoo'])}, target forward path"
             f" {_path_name(cfg.get('quantization', 'none'))},"
             f" drafts {_path_name(cfg.get('draft_quantization', 'none'))}; "
             f"K = {cfg['capacity']}, N = {cfg['interval']}, gamma = {cfg['gamma']}, {cfg['max_new_tokens']} new"
             f" tokens, greedy, {prompts_label(cfg, 'prompts per workload')} ({', '.join(cfg['workloads'])}), every"
             f" policy on every prompt, interleaved. Storage: **{storage['medium']}"
             f"{' (emulated)' if storage['emulated'] else ''}**: {load_sentence(storage)}.", "",
             _lossless_line(result), "",
             "Which numbers are real and which simulated:", "",
             "| item | source |", "|---|---|"]
    for name, item in items.items():
        png = f" / `{name}.png`" if (out_dir / f"{name}.png").is_file() else ""
        lines.append(f"| `{name}.json`{png} | {item['source']} |")
    lines += ["", "### Goals (issue 17) on the real runs", "",
              f"GMEAN over {', '.join(g['gmean_over'])}; the paper's metric unless it says end to end.", "",
              "| goal | measured | target | met | gap |", "|---|---:|---:|---|---:|"]
    for r in g["rows"]:
        percent = "share" in r["goal"]
        fmt = (lambda x: "n/a" if x is None else f"{x:.1%}") if percent else (
            lambda x: "n/a (a zero baseline)" if x is None else f"{x:.3f}")
        # a goals.json written before rows said it: its worst-workload row was checked as above 1 (1 + 1e-9)
        compare = r.get("compare", "<=" if percent else ">" if "worst" in r["goal"] else ">=")
        lines.append(f"| {r['goal']} | {fmt(r['measured'])} | {compare} {fmt(r['target'])}"
                     f" | {'yes' if r['met'] else 'no'} | {'' if r['met'] else fmt(r['gap'])} |")
    h = g["headroom"]
    od_gs = h["oracle_dynamic_vs_general_static"]
    # the DP is optimal in its own cost model only: a real policy beats it where the model prices a mechanism
    # above its cost (a queued load, a partial catch-up on returning to a resident draft; runtime/oracle.py)
    bound = (" The DP schedule is the best one in its cost model, which prices some loads and catch-ups above what"
             " a policy pays, so it is the headroom, not a strict bound"
             + (": MemSpec >= 1.3x General-Static would need a zoo whose drafts differ far more."
                if od_gs is not None and od_gs < 1.3 else "."))
    lines += ["", "What bounds them on this zoo (measured in the same runs):", "",
              f"- Headroom: Oracle-Dynamic, the best schedule under the same K and costs, reaches"
              f" {_times(od_gs)} General-Static and Oracle-Static"
              f" {_times(h['oracle_static_vs_general_static'])}.{bound}",
              f"- A draft load costs {_loads(h['load_to_iteration'])} speculative iterations here"
              + ("" if h["load_to_iteration"] is None else
                 f", {'more' if h['load_to_iteration'] > PAPER_LOAD_ITERATIONS else 'fewer'} than on the paper's"
                 f" Jetson ({PAPER_LOAD_ITERATIONS})")
              + ": a policy that waits for a load loses that many iterations, one that"
              " works around it runs a resident draft meanwhile (Figure 7 splits the time). Beyond that, what"
              " separates the policies is which drafts they run (E[A] below): MAB-Async tries every draft and runs"
              " the previous arm while its choice loads.",
              "- Mean accepted draft tokens per iteration (E[A]): " + ", ".join(
                  f"{LABELS.get(p, p)} {a:.2f}" for p, a in h["mean_accepted"].items()) + "."]
    setup = index.get("cost_model", {}).get("setup_seconds", {})
    if setup.get(MS) is not None and setup.get(GS) is not None:
        lines.append(f"- End to end, MemSpec's setup besides the first draft load (its policy's start and first"
                     f" ranking) takes {1e3 * setup[MS]:.2f} ms per generation against General-Static's"
                     f" {1e3 * setup[GS]:.2f} ms.")
    ms = items["fig7"]["summaries"].get(MS) if "fig7" in items else None
    if ms is not None:
        waited = ms["execution_seconds"]["load_wait"]
        lines.append(("- Within decoding MemSpec never waited for a load (measured: 0 s; the first draft of a prompt,"
                      " on the cold cache each prompt starts with here, is waited for before decoding and counted end"
                      " to end)" if waited == 0 else
                      f"- **Within decoding MemSpec waited {waited * 1000:.0f} ms for loads in all** (its design says"
                      " it never does: see the per-iteration load_wait_seconds)")
                     + ": when the ranking's top draft is not resident it runs the best resident draft until the next"
                     f" scheduling point (N = {cfg['interval']} iterations; a load takes"
                     f" {_loads(h['load_to_iteration'])}): {share(ms['fallback_fraction_of_iterations'])} of its"
                     " speculative iterations ran on a fallback draft.")
    if h.get("predictor_recent_features_live") is False:
        lines.append("- **The live target-hidden predictor ranks from the prompt alone**: its forward hook on the"
                     " target's decoder never fires during decoding (the engine's lean target forward bypasses"
                     " module hooks), so the recent-token half of its features stays zero and every interval gets"
                     " the prompt's ranking. The simulator replays it as it ran; `recent.json` shows what live"
                     " recent features would change.")
    if g.get("noise_free_replay"):
        r = g["noise_free_replay"]
        lines.append(f"- The same runs replayed at constant machine speed (pooled cost model; this machine's speed"
                     f" varied {v['machine_speed']['min']:.2f}x-{v['machine_speed']['max']:.2f}x between"
                     f" generations): MemSpec / Oracle-Dynamic {_x(r['memspec_vs_oracle_dynamic'])}, / MAB-Async"
                     f" {_x(r['memspec_vs_mab_async'])}, / General-Static {_x(r['memspec_vs_general_static'])};"
                     f" end to end / General-Static {_x(r['end_to_end_memspec_vs_general_static'])}, / MAB-Async"
                     f" {_x(r['end_to_end_memspec_vs_mab_async'])}.")
    if g.get("cost_aware"):
        c = g["cost_aware"]
        lines.append(f"- memspec-cost-aware: / Oracle-Dynamic {_x(c['vs_oracle_dynamic'])}, / MAB-Async"
                     f" {_x(c['vs_mab_async'])}, / General-Static {_x(c['vs_general_static'])}, / MemSpec"
                     f" {_x(c['vs_memspec'])}; end to end / General-Static {_x(c['end_to_end_vs_general_static'])};"
                     f" fallback {share(c['fallback_fraction_of_iterations'])}, prediction"
                     f" {share(c['prediction_share_of_decode'])} of decode time.")
    lines += render_validation(v)
    captions = {
        "fig6": "Figure 6: normalized throughput per workload and GMEAN",
        "fig7": "Figure 7: decode time breakdown, MAB-Async vs MemSpec",
        "fig8_9": "Figures 8-9: component analysis",
        "fig10": "Figure 10: scheduling interval N",
        "fig11": "Figure 11: output length",
        "fig12": "Figure 12: resident capacity K",
        "mab_c": "MAB-Async's exploration coefficient c (the paper's sweep)",
        "table2": "Table 2: predictor quality",
        "storage": "End-to-end latency per storage medium",
        "recent": "Beyond the paper: the predictor with live recent features",
    }
    for name, caption in captions.items():
        if name in items:
            lines += [f"### {caption}", "", f"Source: {items[name]['source']}. Data: `{name}.json`.", "",
                      f"![{caption}]({name}.png)", ""]
            lines += _summary_line(name, items[name])
    lines.append(END)
    return "\n".join(lines)


def _summary_line(name: str, item: dict) -> list[str]:
    if name == "fig6":
        lines = []
        for key, label in (("normalized_tokens_per_second", "real, paper's metric"),
                           ("normalized_end_to_end", "real, end to end"),
                           ("replay_normalized_tokens_per_second", "replayed at constant machine speed")):
            if item.get(key):
                gm = item[key]["GMEAN"]
                lines.append(f"- GMEAN normalized throughput ({label}): "
                             + ", ".join(f"{LABELS[p]} {gm[p]:.3f}" for p in item["policies"]) + ".")
        return lines + [""]
    if name in ("fig7", "fig8_9"):
        return ["Fallback (share of speculative iterations) and prediction (share of decode time): " + ", ".join(
            f"{LABELS[p]} {share(s['fallback_fraction_of_iterations'])} / {share(s['prediction_share_of_decode'])}"
            for p, s in item["summaries"].items()) + ".", ""]
    if name in ("fig10", "fig11", "fig12", "mab_c"):
        return ["| " + item["parameter"] + " | " + " | ".join(LABELS[p] for p in item["policies"] if p != GS) + " |",
                "|---|" + "---:|" * (len(item["policies"]) - 1)] + [
            f"| {value} | " + " | ".join(f"{item['rows'][str(value)]['normalized_tokens_per_second'][p]:.3f}"
                                         for p in item["policies"] if p != GS) + " |" for value in item["values"]
        ] + [""]
    if name == "storage":
        return ["| medium | load (ms) | loads / iteration | " + " | ".join(LABELS[p] for p in item["policies"])
                + " |", "|---|---:|---:|" + "---:|" * len(item["policies"])] + [
            f"| {m}{' (emulated)' if r['emulated'] else ''} | {r['load_seconds_per_draft'] * 1000:.0f} |"
            f" {_loads(r['load_to_iteration'])} | " + " | ".join(f"{r['end_to_end_seconds_per_generation'][p]:.2f} s"
                                                          for p in item["policies"]) + " |"
            for m, r in item["rows"].items()] + [""]
    if name == "table2":
        horizon = item.get("label_horizon_intervals")
        label = (("the draft that accepts most over the rest of the output" if item.get("label_rule") else
                  "each request's best draft over its whole output, for every context of the request (a head"
                  " trained before the rest-of-the-output labels were fixed)") if horizon == 0 else
                 f"the draft best over the next {horizon} interval(s)" if horizon else "unknown")
        window = item.get("prompt_tokens")
        pooled = ("the whole prompt (MiniLM: its last 256 tokens' text)" if window == 0 else
                  f"the prompt's last {window} positions (MiniLM: their text, the same whatever came before)"
                  if window else "unknown")
        trained = {True: " The head trained on such conversations too.", False: " The head did not train on"
                   " conversations."}.get(item.get("trained_on_conversations"), "")
        after = item.get("after_an_earlier_turn") or {}

        def turn(enc: str, inp: str) -> str:
            r = after.get(enc, {}).get(inp)
            return f"{r['top1']:.1%} | {r['top2']:.1%}" if r else "n/a | n/a"

        return [f"Labels: {label} (`memspec-train-predictor --label-horizon`). The prompt half pools {pooled}"
                " (`--prompt-tokens`). After an earlier turn: the same held-out requests as the latest turn after"
                f" another request and the target's answer (n/a: not scored).{trained}", "",
                "| encoder | input | top-1 | top-2 | after an earlier turn: top-1 | top-2 |",
                "|---|---|---:|---:|---:|---:|"] + [
            f"| {enc} | {inp} | {r['top1']:.1%} | {r['top2']:.1%} | {turn(enc, inp)} |"
            for enc, rows in item["rows"].items() for inp, r in rows.items()] + [""]
    if name == "recent":
        return ["| features | " + " | ".join(LABELS[p] for p in item["policies"]) + " |",
                "|---|" + "---:|" * len(item["policies"])] + [
            f"| {label} | " + " | ".join(f"{row[p]:.3f}" for p in item["policies"]) + " |"
            for label, row in item["rows"].items()] + [""]
    return []

