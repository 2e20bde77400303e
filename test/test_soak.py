# ruff: noqa: E402 - the ROS imports follow require_ros()
"""`memspec-bench soak` at CI size on the tiny zoo (bench/soak_bench.py; the README's figures are its --long
run on the bundled zoo): 200 sequential goals, 3 bursts of 20 goal requests against a queue of 4, 5 cancel-storm
rounds, the node in this process and its client in another. Nothing is lost, every request is answered, the
draft cache's byte budget holds at every state change and the node's threads are the ones it had after warm-up.
The goal callback's p99 latency (the issue's 50 ms) is printed and is the bench's verdict. Resident memory is
reported, and bounded only in the long run (5 % after warm-up): over a few seconds it measures the allocator,
not a leak.

A burst and a storm round each need their long goal still decoding when their requests arrive. On the tiny zoo its
3000 tokens take well under a second here, so a CPU a few times faster could finish it before the burst is answered
(the burst then finds a free queue and `ok` is false for a reason that is not the node's): these tests pace their
long goals (node_helpers.PACED_FROM), which only the long goals see. `memspec-bench soak` itself is never paced: its
latency verdict is about the decoder's contention at full speed."""

from __future__ import annotations

import json

import pytest
from node_helpers import pace_long_goals, tiny_zoo
from ros_helpers import require_ros

require_ros()

from memspec_ros.bench.soak_bench import ACCEPT_P99_LIMIT, CI, run_soak


@pytest.mark.timeout(300)
def test_the_soak_loses_nothing_and_keeps_the_budget(ros_domain_id, monkeypatch):
    import torch

    pace_long_goals(monkeypatch)
    threads = torch.get_num_threads()
    try:
        result = run_soak(tiny_zoo(), CI, domain_id=ros_domain_id)
    finally:
        torch.set_num_threads(threads)
    print(json.dumps({k: v for k, v in result.items() if k != "config"}, indent=1))
    assert result["goals_lost"] == 0 and result["requests_unanswered"] == 0
    assert sum(result["terminal"].values()) == result["goals_accepted"]  # every accepted goal ended, result received
    assert "aborted" not in result["terminal"]
    assert result["terminal"]["canceled"] >= CI.bursts + CI.storm_rounds * (CI.queue + 1)  # the cancels took
    assert result["bursts_accepted"] == [CI.queue] * CI.bursts  # exactly the queue's room, the rest rejected
    assert result["goals_rejected"] == CI.bursts * (CI.burst_size - CI.queue)
    assert "queue is full" in result["last_rejection"]
    # the monitor watched a budget that binds: fewer drafts than K ever fit, and it was never exceeded
    assert result["invariant_checks"] > CI.goals and result["budget_violations"] == 0, result["violations"]
    assert result["max_drafts_in_memory"] < CI.capacity and result["max_bytes_reserved"] <= result["budget_bytes"]
    assert result["threads_grown"] == {}, result["threads_end"]  # no thread more than after the warm-up
    # the goal callback's latency (p99 within the 50 ms) is the bench's verdict (`memspec-bench soak` exits 1
    # past it), not this test's: a wall-clock bound in a unit test measures the machine it runs on
    assert result["ok"] == (result["goal_callback_ms"]["p99"] < 1e3 * ACCEPT_P99_LIMIT)  # the rest of ok holds


@pytest.mark.timeout(300)
def test_the_soak_command(tmp_path, monkeypatch):
    from memspec_ros.bench.cli import main

    pace_long_goals(monkeypatch)
    out = tmp_path / "soak.json"
    # the node's drafts read through the medium asked for (its cache.storage), which the JSON's config records
    from memspec_ros.ros import node as node_module

    media = []

    real_init = node_module.MemSpecNode.__init__

    def recording_init(self, *args, parameter_overrides=(), **kwargs):
        media.extend(p.value for p in parameter_overrides if p.name == "cache.storage")
        real_init(self, *args, parameter_overrides=parameter_overrides, **kwargs)

    monkeypatch.setattr(node_module.MemSpecNode, "__init__", recording_init)
    code = main(["soak", "--zoo", "tiny", "--goals", "5", "--bursts", "1", "--storm-rounds", "1", "--storage", "nvme",
                 "--json", str(out)])
    result = json.loads(out.read_text())
    assert result["mode"] == "ci" and result["config"]["goals"] == 5 and result["goals_lost"] == 0
    assert result["config"]["storage"] == "nvme" and media == ["nvme"]
    # the exit status is the bench's verdict; with five goals its latency p99 is one callback's time, which a
    # loaded machine can push past the bound (51 ms once, with a training job beside the tests): the verdict's
    # timing part is the 200-goal test's above, this one checks the command
    assert code == (0 if result["ok"] else 1)
    assert result["requests_unanswered"] == 0 and result["budget_violations"] == 0


def test_the_long_soaks_json_verdict_is_its_exit_status(tmp_path, monkeypatch):
    """In --long the RSS growth bound was checked only for the exit status: the JSON said ok while the command
    exited 1."""
    from memspec_ros.bench import soak_bench
    from memspec_ros.bench.cli import main

    monkeypatch.setattr(soak_bench, "run_soak", lambda zoo, config, progress=None: {
        "ok": True, "rss_growth": 2 * soak_bench.RSS_GROWTH_LIMIT, "note": ""})
    monkeypatch.setattr(soak_bench, "summary", lambda result: "")
    out = tmp_path / "soak.json"
    assert main(["soak", "--zoo", "tiny", "--long", "--json", str(out)]) == 1
    result = json.loads(out.read_text())
    assert result["ok"] is False and result["memory_ok"] is False and result["mode"] == "long"
