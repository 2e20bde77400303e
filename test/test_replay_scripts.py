"""The replay scripts' own rules (scripts/ is not a package: imported by path)."""

from __future__ import annotations

import importlib.util
import random
from pathlib import Path

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"


def script(name: str):
    spec = importlib.util.spec_from_file_location(name, SCRIPTS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_previous_intervals_rule_reads_no_token_after_the_current_position():
    """previous_interval_walk scored each draft by walking N iterations from the previous interval's start, which
    runs past the current position into tokens not generated yet: the published 'previous_intervals_best' column
    was partly a look-ahead rule. Every choice must be the same whatever the agreements after its position are."""
    replay = script("simulate_heldout")
    rng = random.Random(0)
    checked = 0
    for trial in range(60):
        length = rng.randint(12, 60)
        agreement = {d: [rng.random() < p for _ in range(length)]
                     for d, p in (("general", 0.5), ("b", rng.random()), ("c", rng.random()))}
        gamma, interval = rng.choice((2, 4)), rng.choice((1, 2, 4))
        choices, _ = replay.previous_interval_choices(agreement, gamma, interval, "general")
        for position, draft in choices:
            other_future = {d: a[:position] + [rng.random() < 0.5 for _ in range(length - position)]
                            for d, a in agreement.items()}
            again = dict(replay.previous_interval_choices(other_future, gamma, interval, "general")[0])
            assert again[position] == draft, (trial, position)
            checked += 1
    assert checked > 100


def test_the_previous_intervals_rule_follows_a_draft_that_did_better_on_the_past():
    """Scored by the tokens its walk covered up to the current position, every draft covered at most what the
    running one did: the rule never left its start (5,935 choices over random traces, none but 'general')."""
    replay = script("simulate_heldout")
    rng = random.Random(1)
    length = 200
    agreement = {"general": [rng.random() < 0.3 for _ in range(length)],
                 "good": [rng.random() < 0.95 for _ in range(length)]}
    choices, accepted = replay.previous_interval_choices(agreement, 4, 4, "general")
    assert choices[0][1] == "general" and choices[1][1] == "good"  # one interval of evidence is enough here
    assert sum(draft == "good" for _, draft in choices) > 0.8 * len(choices)
    assert replay.previous_interval_walk(agreement, 4, 4, "general") > 2.0


def test_the_replay_summary_says_n_a_over_a_zero_rate_instead_of_dividing_by_it():
    """A workload at 0 tok/s (every generation failed) raised ZeroDivisionError in summary() after the whole
    replay; its ratios are None (figures.ratio), as the bench's own figures give them."""
    from memspec_ros.runtime.stats import GenerationStats, GenerationTotals, IterationStats

    replay = script("simulate_heldout")
    workloads = ["code", "math", "law", "medical", "general"]
    policies = ["memspec", replay.COST_AWARE, "mab-async", "general-static"]

    def totals(tokens: int) -> GenerationTotals:
        t = GenerationTotals()
        iterations = [IterationStats("general", 4, tokens - 1, tokens, 0.1, 0.2)] if tokens else []
        t.add(GenerationStats(prompt_tokens=4, completion_tokens=tokens + 1, decode_seconds=1.0, prefill_seconds=0.1,
                              iterations=iterations))
        return t

    table = {p: {w: totals(0 if (p == "mab-async" and w == "law") else 10) for w in workloads} for p in policies}
    out = replay.summary(table, policies, workloads)
    assert out["ratios"]["memspec_vs_mab-async"]["paper_metric"] is None  # the GMEAN over a zero rate is 0
    assert out["ratios"]["memspec_vs_general-static"]["paper_metric"] == 1.0
    assert out["worst_workload_vs_mab_async"]["memspec"] is None


def test_the_measurement_scripts_refuse_bad_options_before_loading_a_model():
    """Each of these was found after minutes of work (a model loaded, a path scored, every goal run) or not at all:
    a zero step or count, an unknown forward path or medium, a verify time of 0 (ZeroDivisionError) and options
    that need --verify-ms, which were ignored without it."""
    import subprocess
    import sys

    cases = [("path_quality", ["--answers", "/nonexistent", "--greedy-every", "0"], "argument --greedy-every:"),
             ("path_quality", ["--answers", "/nonexistent", "--paths", "none,typo"], "unknown typo"),
             ("prompt_cache_memory", ["--goals", "20"], "argument --goals:"),
             ("warm_start", ["--storage", "typo"], "argument --storage:"),
             ("prompt_cache_bench", ["--interleave", "0"], "argument --interleave:"),
             ("lookup_acceptance", ["/nonexistent", "--verify-ms", "0,1,2,3,4"], "0.0 is not in"),
             ("lookup_acceptance", ["/nonexistent", "--remember"], "need --verify-ms"),
             ("lookup_acceptance", ["/nonexistent", "--verify-ms", "1,2"], "needs 5 times")]
    for name, argv, said in cases:
        done = subprocess.run([sys.executable, str(SCRIPTS / f"{name}.py"), *argv], capture_output=True, text=True,
                              timeout=120)
        assert done.returncode == 2 and said in done.stderr, (name, argv, done.stderr[-500:])


def test_warm_start_runs_without_json(monkeypatch):
    """--json's default went through its type (argtypes.output_file), which refuses an empty name: the script
    failed at its parser unless --json was given, as README's command does not."""
    import pytest

    warm_start = script("warm_start")

    def reached(*args, **kwargs):
        raise SystemExit("past the parser")

    monkeypatch.setattr(warm_start, "load_models", reached)
    with pytest.raises(SystemExit, match="past the parser"):
        warm_start.main(["--prompts", "16"])

