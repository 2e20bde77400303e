# ruff: noqa: E402 - the ROS imports follow require_ros()
"""memspec_node's parameters through rcl_interfaces services (set, reject with a reason, live
changes reaching a running goal) and its diagnostics: /diagnostics on diagnostic_updater's
contract, ~/cache_state for late joiners, WARN and ERROR levels."""

from __future__ import annotations

import shutil
import threading
import time

import pytest
from node_helpers import active_harness, goal, tiny_zoo
from ros_helpers import require_ros, wait_until

require_ros()

from action_msgs.msg import GoalStatus
from diagnostic_msgs.msg import DiagnosticArray

from memspec_interfaces.msg import CacheState, DraftState
from memspec_ros.ros.diagnostics import (
    ERROR,
    LATCHED,
    OK,
    TASKS,
    WARN,
    Status,
    fill_cache_status,
    fill_throughput_status,
)
from memspec_ros.runtime.stats import CacheStats, GenerationStats, IterationStats

LONG = 3000


@pytest.fixture(scope="module")
def h():
    with active_harness() as harness:
        yield harness


def registry_file_params():
    return {"drafts.names": [""], "drafts.paths": [""], "drafts.domains": [""]}


# -- parameters -------------------------------------------------------------------------------

def test_valid_values_apply_and_invalid_ones_are_rejected_with_a_reason(h):
    [ok] = h.set_params(**{"memspec.capacity": 1})
    assert ok.successful
    assert h.get_param("memspec.capacity") == 1
    assert h.node.loaded.controller.config.capacity == 1
    try:
        for name, value, words in [
            ("memspec.capacity", 0, "memspec.capacity"),
            ("memspec.policy", "bogus", "memspec.policy must be one of"),
            ("memspec.policy", "oracle-dynamic", "memspec.policy must be one of"),
            ("generation.top_p", 0.0, "top_p"),
            ("diagnostic_updater.period", 0.0, "diagnostic_updater.period"),
            ("model.target_path", "/elsewhere", "state active): deactivate and cleanup, set it, then configure"),
            ("predictor.path", "none", "only while unconfigured"),
        ]:
            [result] = h.set_params(**{name: value})
            assert not result.successful, name
            assert words in result.reason, (name, result.reason)
        [wrong_type] = h.set_params(**{"memspec.gamma": "four"})
        assert not wrong_type.successful
        assert h.get_param("memspec.capacity") == 1 and h.get_param("memspec.policy") == "memspec"
        assert h.node.loaded.controller.config.capacity == 1
        assert h.node.loaded.controller.config.gamma == 4
        # a registry that cannot be built is rejected as a whole, nothing changes
        result = h.set_params_atomically(**{"drafts.names": ["x"], "drafts.paths": ["/nonexistent/x"],
                                            "drafts.domains": ["code"]})
        assert not result.successful and "/nonexistent/x" in result.reason
        assert h.node.loaded.registry.names() == ["general", "code", "math"]
    finally:
        h.set_params(**{"memspec.capacity": 2})


def test_gamma_and_registry_changes_reach_a_running_goal(h):
    feedback = []
    handle, _ = h.send(goal(max_new_tokens=LONG), feedback)
    assert handle.accepted
    wait_until(lambda: len(feedback) >= 3, 30.0, "feedback")
    general = str(tiny_zoo() / "drafts" / "general")
    [ok] = h.set_params(**{"memspec.gamma": 2})
    assert ok.successful
    result = h.set_params_atomically(**{"drafts.names": ["general"], "drafts.paths": [general],
                                        "drafts.domains": ["general"]})
    assert result.successful, result.reason
    count = len(feedback)
    wait_until(lambda: len(feedback) >= count + 10, 30.0, "feedback after the change")
    h.wait(handle.cancel_goal_async(), 10.0, "cancel")
    assert h.result(handle, 30.0).status == GoalStatus.STATUS_CANCELED
    try:
        with h.node._window._lock:
            stats = h.node._window._goals[-1]
        its = stats.speculative_iterations
        assert its[0].proposed == 4  # before the change
        assert all(it.proposed <= 2 for it in its[-5:])  # gamma 2 from a scheduling point on
        assert all(it.draft == "general" for it in its[-5:])  # the registry now has only general
        assert h.node.loaded.registry.names() == ["general"]
        assert set(h.node.loaded.controller.cache.resident()) <= {"general"}
    finally:
        assert h.set_params_atomically(**registry_file_params()).successful
        h.set_params(**{"memspec.gamma": 4})
    assert h.node.loaded.registry.names() == ["general", "code", "math"]


def test_a_registry_set_while_idle_checks_the_drafts_files_as_the_next_goal_starts(h, monkeypatch):
    """The parameter callback stat'ed every resident draft's files itself, holding the goal runner's lock that every
    goal callback and the diagnostics wait for (a hang on failing storage stalled them): it is left to the next
    goal's start, on that goal's thread."""
    cache = h.node.loaded.controller.cache
    checked: list[str] = []
    real = cache.evict_changed
    monkeypatch.setattr(cache, "evict_changed", lambda: checked.append(threading.current_thread().name) or real())
    assert h.set_params_atomically(**registry_file_params()).successful  # set again, the same registry
    assert checked == []  # not in the callback
    handle, _ = h.send(goal(max_new_tokens=4))
    assert h.result(handle).status == GoalStatus.STATUS_SUCCEEDED
    assert len(checked) == 1  # as that goal started


def test_drafts_removed_while_idle_take_their_kept_kv_caches_with_them(h, monkeypatch):
    """The prompt cache keeps each draft's KV cache of the last goals for the next turn: a registry change while
    idle evicted the removed drafts, but their KV caches stayed until a goal came (held, no longer counted).
    (PromptCache.forget_drafts itself: test_prompt_cache.)"""
    prompt_cache = h.node.loaded.controller.prompt_cache
    forgotten: list[list[str]] = []
    real = prompt_cache.forget_drafts
    monkeypatch.setattr(prompt_cache, "forget_drafts", lambda names: forgotten.append(sorted(names)) or real(names))
    general = str(tiny_zoo() / "drafts" / "general")
    try:
        result = h.set_params_atomically(**{"drafts.names": ["general"], "drafts.paths": [general],
                                            "drafts.domains": ["general"]})
        assert result.successful, result.reason
        assert forgotten == [["code", "math"]]
    finally:
        assert h.set_params_atomically(**registry_file_params()).successful


def test_a_gamma_other_than_the_predictors_labels_warns(h):
    """The head's labels name the draft that accepted most at the gamma they were measured at; memspec.gamma set to
    another ranked on without a word (/diagnostics showed the head's gamma only as a value)."""
    import dataclasses

    head = h.node.loaded.predictor.engine.head
    saved = head.config

    def predictor_status():
        return {s.name: s for s in h.node._diagnostics.collect()}["memspec: predictor"]

    try:
        head.config = dataclasses.replace(saved, gamma=h.get_param("memspec.gamma"))
        assert predictor_status().level == OK
        assert h.set_params(**{"memspec.gamma": 3})[0].successful
        head.config = dataclasses.replace(saved, gamma=4)
        status = predictor_status()
        assert status.level == WARN and "memspec.gamma is 3, but the predictor's labels were measured at gamma 4" \
            in status.message, status.message
        assert "memspec-train-predictor --gamma 3" in status.message
    finally:
        head.config = saved
        assert h.set_params(**{"memspec.gamma": 4})[0].successful
    assert predictor_status().level == OK


def test_a_draft_the_predictor_cannot_score_is_named_on_diagnostics(h):
    """A registered draft the head has no class for (by name or domain) ties at the unknown score, so a ranking
    policy never ranks it first: it was accepted without a word while another draft of the registry was scored."""
    drafts = tiny_zoo() / "drafts"

    def predictor_status():
        return {s.name: s for s in h.node._diagnostics.collect()}["memspec: predictor"]

    assert predictor_status().level == OK
    try:
        result = h.set_params_atomically(**{
            "drafts.names": ["general", "code", "math", "robotics"],
            "drafts.paths": [str(drafts / n) for n in ("general", "code", "math", "general")],
            "drafts.domains": ["general", "code", "math", "robotics"]})
        assert result.successful, result.reason
        status = predictor_status()
        assert status.level == WARN and "no class for robotics" in status.message, status.message
        assert {kv.key: kv.value for kv in status.values}["drafts it cannot score"] == "robotics"
    finally:
        assert h.set_params_atomically(**registry_file_params()).successful
    assert predictor_status().level == OK


def test_a_configure_time_parameter_set_to_its_own_value_is_no_change(h):
    """`ros2 param dump` then `ros2 param load` on an active node sets every parameter: each configure-time one was
    refused ("can change only while unconfigured") although its value did not change."""
    names = ("model.target_path", "model.quantization", "predictor.path", "cache.storage", "drafts.quantization")
    current = {n: h.get_param(n) for n in names}
    results = h.set_params(**current)
    assert all(r.successful for r in results), [r.reason for r in results]
    [changed] = h.set_params(**{"model.quantization": "int8" if current["model.quantization"] != "int8" else "none"})
    assert not changed.successful and "only while unconfigured" in changed.reason
    assert {n: h.get_param(n) for n in names} == current


def test_a_general_draft_the_same_change_brings_is_taken_with_it(h):
    """One atomic change that adds a draft and makes it general-static's: the controller checked the policy against
    the registry in use, which the same change replaces, and refused a change whose end state is valid."""
    drafts = tiny_zoo() / "drafts"
    names = ["general", "code", "math", "plain"]
    try:
        result = h.set_params_atomically(**{
            "drafts.names": names, "drafts.paths": [str(drafts / n) for n in ("general", "code", "math", "general")],
            "drafts.domains": ["general", "code", "math", "general"], "memspec.policy": "general-static",
            "memspec.general_draft": "plain"})
        assert result.successful, result.reason
        assert h.node.loaded.registry.names() == names
        assert h.node.loaded.controller.next_config.general_draft == "plain"
        # a general draft the registry lacks is still refused (by the node; the controller's own refusal:
        # test_runtime_controller)
        [refused] = h.set_params(**{"memspec.general_draft": "genral"})
        assert not refused.successful and "'genral' is not in the draft registry" in refused.reason
    finally:
        assert h.set_params_atomically(**{"memspec.policy": "memspec", "memspec.general_draft": "general",
                                          **registry_file_params()}).successful
    assert h.node.loaded.registry.names() == ["general", "code", "math"]


# -- diagnostics --------------------------------------------------------------------------------

def test_diagnostics_follow_the_diagnostic_updater_contract(h):
    arrays: list[DiagnosticArray] = []
    sub = h.client.create_subscription(DiagnosticArray, "/diagnostics", arrays.append, 10)
    try:
        handle, _ = h.send(goal(max_new_tokens=32))
        assert h.result(handle).status == GoalStatus.STATUS_SUCCEEDED
        assert h.set_params(**{"diagnostic_updater.period": 0.2})[0].successful
        arrays.clear()
        # the period changed at once: the updater's timer runs at it (asserted on the timer, not on when a loaded
        # machine's executor served its ticks: a late tick and the catch-up after it made the gaps anything)
        updater = h.node._diagnostics
        timer = getattr(updater, "upstream", updater).timer
        assert timer.timer_period_ns == int(0.2 * 1e9) and not timer.is_canceled()
        wait_until(lambda: len(arrays) >= 1, 15.0, "a /diagnostics message")
        array = arrays[-1]
        assert array.header.stamp.sec > 0
        names = [s.name for s in array.status]
        assert names == [f"memspec: {task}" for task in TASKS]
        for status in array.status:
            assert isinstance(status.level, bytes) and status.level in (OK, WARN, ERROR)
            assert status.hardware_id
            assert all(isinstance(kv.key, str) and isinstance(kv.value, str) for kv in status.values)
        by_name = {s.name: {kv.key: kv.value for kv in s.values} for s in array.status}
        throughput = by_name["memspec: throughput"]
        assert float(throughput["tokens per second"]) > 0
        for key in ("mean accepted tokens", "fallback fraction", "prediction overhead", "goals in window",
                    "goals finished since activation", "goals measured since activation"):
            assert key in throughput
        cache = by_name["memspec: draft cache"]
        for key in ("resident", "loading", "failed", "capacity (K)", "bytes resident", "budget bytes", "hits",
                    "misses", "loads", "evictions", "wasted prefetches"):
            assert key in cache
        assert cache["capacity (K)"] == "2"
        predictor = by_name["memspec: predictor"]
        assert predictor["encoder"] == "target-hidden" and predictor["recent tokens (T)"] == "32"
        assert predictor["prompt positions (W)"] == "whole prompt"  # the tiny zoo's head: HeadConfig's default 0
        assert predictor["labels at gamma"].startswith("not recorded")  # so is its gamma
        assert by_name["memspec: target model"]["lifecycle state"] == "active"
        assert by_name["memspec: target model"]["node"] == "/memspec"  # whose rejections (memspec_client --chat)
    finally:
        h.set_params(**{"diagnostic_updater.period": 1.0})
        h.client.destroy_subscription(sub)


def test_cache_state_reaches_a_late_joiner(h):
    handle, _ = h.send(goal(max_new_tokens=32))
    assert h.result(handle).status == GoalStatus.STATUS_SUCCEEDED
    time.sleep(0.3)
    got: list[CacheState] = []
    sub = h.client.create_subscription(CacheState, "/memspec/cache_state", got.append, LATCHED)
    try:
        wait_until(lambda: got, 10.0, "a CacheState for the late joiner")
        msg = got[0]
        assert [d.name for d in msg.drafts] == ["general", "code", "math"]
        assert [d.domain for d in msg.drafts] == ["general", "code", "math"]
        assert msg.capacity == 2
        held = [d for d in msg.drafts if d.state in (DraftState.RESIDENT, DraftState.LOADING)]
        assert 1 <= len(held) <= 2
        # size_bytes is the registry's estimate (file sizes); bytes_resident what the loaded drafts occupy
        # (a prefetch still loading is reserved, not resident)
        resident = [d for d in msg.drafts if d.state == DraftState.RESIDENT]
        assert msg.bytes_resident == pytest.approx(sum(d.size_bytes for d in resident), rel=0.05)
        assert msg.hits + msg.misses > 0 and msg.loads >= 1
        active = [d.name for d in msg.drafts if d.is_active]
        assert active == ([msg.active_draft] if msg.active_draft else [])
        assert any(d.in_working_set for d in msg.drafts)
        assert all(d.score == d.score for d in msg.drafts)  # ranked: no NaN left
    finally:
        h.client.destroy_subscription(sub)


def test_a_draft_that_fails_to_load_is_an_error_and_the_goal_still_succeeds(h, tmp_path):
    broken = tmp_path / "broken"
    shutil.copytree(tiny_zoo() / "drafts" / "general", broken)
    (broken / "model.safetensors").write_bytes(b"\x00garbage, not safetensors")
    result = h.set_params_atomically(**{"drafts.names": ["broken"], "drafts.paths": [str(broken)],
                                        "drafts.domains": ["general"], "memspec.policy": "general-static",
                                        "memspec.general_draft": "broken"})
    assert result.successful, result.reason
    try:
        handle, _ = h.send(goal(max_new_tokens=8))
        response = h.result(handle)
        assert response.status == GoalStatus.STATUS_SUCCEEDED  # the target decodes alone
        assert list(response.result.drafts_used) == []
        statuses = {s.name: s for s in h.node._diagnostics.collect()}
        cache = statuses["memspec: draft cache"]
        assert cache.level == ERROR and "broken" in cache.message
        got: list[CacheState] = []
        sub = h.client.create_subscription(CacheState, "/memspec/cache_state", got.append, LATCHED)
        wait_until(lambda: got and got[-1].drafts and got[-1].drafts[0].state == DraftState.FAILED, 10.0,
                   "a FAILED draft in cache_state")
        assert got[-1].drafts[0].error
        h.client.destroy_subscription(sub)
    finally:
        assert h.set_params_atomically(**registry_file_params(), **{"memspec.policy": "memspec",
                                                                  "memspec.general_draft": "general"}).successful
        h.node.loaded.controller.cache.clear_failed()


def test_a_registry_file_that_brings_another_target_or_predictor_is_refused_at_run_time(h, tmp_path):
    """drafts.registry_file set to another zoo's registry swapped the drafts and kept the target and predictor
    configure had loaded from the first zoo, silently. A registry file that would bring other ones is refused with
    what to do; another registry beside the same target and predictor is taken."""
    from memspec_ros.testing.tiny_zoo import build_tiny_zoo

    zoo = tiny_zoo()
    other = build_tiny_zoo(tmp_path / "other", hidden=64, layers=2, draft_layers=2)  # same tokenizer, own target
    before = h.get_param("drafts.registry_file")
    [result] = h.set_params(**{"drafts.registry_file": str(other / "registry.yaml")})
    assert not result.successful
    assert "model.target_path" in result.reason and "predictor.path" in result.reason
    assert "cleanup" in result.reason and "configure" in result.reason
    assert h.get_param("drafts.registry_file") == before and h.node.loaded.registry.names() == ["general", "code",
                                                                                                   "math"]
    subset = zoo / "registry-general-code.yaml"  # beside the zoo's own: the same target and predictor
    subset.write_text("\n".join(line for line in (zoo / "registry.yaml").read_text().splitlines()
                                if "math" not in line) + "\n")
    try:
        [result] = h.set_params(**{"drafts.registry_file": str(subset)})
        assert result.successful, result.reason
        assert h.node.loaded.registry.names() == ["general", "code"]
    finally:
        [result] = h.set_params(**{"drafts.registry_file": before})
        assert result.successful, result.reason
        subset.unlink()


def test_same_path_sees_a_folder_of_links_to_the_same_files_as_that_folder(tmp_path):
    """A colcon --symlink-install share folder is a real folder holding a link per file: the same predictor."""
    from memspec_ros.ros.params import same_path

    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "head.json").write_text("{}")
    (tmp_path / "links").mkdir()
    (tmp_path / "links" / "head.json").symlink_to(tmp_path / "src" / "head.json")
    (tmp_path / "copy").mkdir()
    (tmp_path / "copy" / "head.json").write_text("{}")
    assert same_path(str(tmp_path / "src"), str(tmp_path / "links"))
    assert same_path(str(tmp_path / "src"), str(tmp_path / "src" / ".." / "src"))
    assert not same_path(str(tmp_path / "src"), str(tmp_path / "copy"))  # equal text, other files
    assert not same_path(str(tmp_path / "src"), "") and same_path("pkg:p/f.gguf", "pkg:p/f.gguf")


def test_a_failed_draft_is_tried_again_once_its_cause_is_gone(h, tmp_path):
    """A draft marked failed stayed failed, and /diagnostics in ERROR, after its cause was gone. Now a
    budget change retries the drafts that did not fit (the reason names memspec.budget_bytes), and
    setting the registry again retries one whose file was damaged and is restored."""
    def cache_status():
        return {s.name: s for s in h.node._diagnostics.collect()}["memspec: draft cache"]

    def run_goal():
        handle, _ = h.send(goal(max_new_tokens=8))
        response = h.result(handle)
        assert response.status == GoalStatus.STATUS_SUCCEEDED
        return list(response.result.drafts_used)

    assert h.set_params(**{"memspec.budget_bytes": 1})[0].successful
    try:
        assert run_goal() == []  # no draft fits: the target decodes alone
        status = cache_status()
        assert status.level == ERROR and "memspec.budget_bytes" in status.message, status.message
    finally:
        assert h.set_params(**{"memspec.budget_bytes": 0})[0].successful
    status = cache_status()
    assert status.level != ERROR and not h.node.loaded.controller.cache.failed(), status.message
    assert run_goal()  # the drafts load again
    assert cache_status().level != ERROR

    damaged = tmp_path / "damaged"
    shutil.copytree(tiny_zoo() / "drafts" / "general", damaged)
    good = (damaged / "model.safetensors").read_bytes()
    (damaged / "model.safetensors").write_bytes(bytes(len(good)))  # zeros of the same size: the same registry entry
    registry = {"drafts.names": ["damaged"], "drafts.paths": [str(damaged)], "drafts.domains": ["general"]}
    assert h.set_params_atomically(**registry, **{"memspec.policy": "general-static",
                                                  "memspec.general_draft": "damaged"}).successful
    try:
        assert run_goal() == []
        assert cache_status().level == ERROR and "damaged" in cache_status().message
        (damaged / "model.safetensors").write_bytes(good)  # the file is restored ...
        assert h.set_params_atomically(**registry).successful  # ... and the registry set again
        assert cache_status().level != ERROR
        assert run_goal() == ["damaged"]
        assert cache_status().level != ERROR
    finally:
        assert h.set_params_atomically(**registry_file_params(), **{"memspec.policy": "memspec",
                                                                  "memspec.general_draft": "general"}).successful


# -- levels, without DDS ------------------------------------------------------------------------

def _stats(fallback: bool) -> GenerationStats:
    its = [IterationStats("code", 4, 2, 3, 0.001, 0.002, preferred="math", fallback=fallback) for _ in range(4)]
    return GenerationStats(completion_tokens=12, decode_seconds=0.01, iterations=its, cache=CacheStats())


def test_every_declared_range_is_what_the_node_accepts():
    """A parameter's descriptor (what `ros2 param describe` shows and rclpy enforces) and the node's own check agree
    at both edges: generation.top_p declared [0, 1] and refused 0 ("must be in (0, 1]"). ROS ranges are closed, so
    its range starts at the smallest positive double and its description says (0, 1]."""
    import math

    from memspec_ros.ros import params as P

    for p in P.PARAMS:
        d = p.descriptor()
        # a range past 32 bits is stated, not declared: rqt_reconfigure's Qt slider raised OverflowError on it
        assert all(-P.QT_INT - 1 <= r.from_value and r.to_value <= P.QT_INT for r in d.integer_range), p.name
        if p.int_range and not d.integer_range:
            assert f"range: [{p.int_range[0]}, {p.int_range[1]}]" in d.additional_constraints, p.name
        for rng in d.integer_range:
            assert P.check_value(p.name, rng.from_value) == "" and P.check_value(p.name, rng.to_value) == "", p.name
            assert P.check_value(p.name, rng.from_value - 1) and P.check_value(p.name, rng.to_value + 1), p.name
        for rng in d.floating_point_range:
            assert P.check_value(p.name, rng.from_value) == "" and P.check_value(p.name, rng.to_value) == "", p.name
            below, above = math.nextafter(rng.from_value, -math.inf), math.nextafter(rng.to_value, math.inf)
            assert P.check_value(p.name, below) and P.check_value(p.name, above), p.name
    top_p = P.BY_NAME["generation.top_p"].descriptor()
    assert top_p.floating_point_range[0].from_value > 0.0 and "(0, 1]" in top_p.description
    for bad in (0.0, 1.5, math.nan):  # the node's own message, not the range's [5e-324, 1.0]
        assert "(0, 1]" in P.check_value("generation.top_p", bad) and "e-324" not in P.check_value(
            "generation.top_p", bad)


def test_each_descriptor_says_when_its_change_lands():
    """`ros2 param describe` said "applies: at once" for generation.* (taken when a goal is accepted) and
    action.max_goal_seconds (read when a goal starts), and "scheduling point" for the memspec.* settings a goal's
    session is built with, which a running goal never sees."""
    from memspec_ros.ros import params as P

    def applies(name: str) -> str:
        return P.BY_NAME[name].descriptor().additional_constraints.rsplit("applies: ", 1)[1]

    assert all(applies(p.name) == P.AT_ACCEPTANCE for p in P.PARAMS if p.name.startswith("generation."))
    assert applies("action.max_goal_seconds") == applies("action.feedback_period") == P.AT_GOAL_START
    for name in ("adaptive_gamma", "confidence_stop", "context_lookup", "remember_answers",
                 "reset_cache_per_generation", "wait_for_initial_draft"):
        assert applies(f"memspec.{name}") == P.AT_NEXT_GOAL, name
    assert applies("memspec.capacity") == applies("memspec.gamma") == P.AT_SCHEDULING_POINT
    # a read-only one is set at start only; "at once" (hardware_id, use_fqn) or "configure" (allowed_roots)
    # contradicted its read_only
    assert all((applies(p.name) == P.AT_START) == p.read_only for p in P.PARAMS), \
        [p.name for p in P.PARAMS if (applies(p.name) == P.AT_START) != p.read_only]


def test_fallback_above_the_threshold_warns():
    s = Status()
    fill_throughput_status(s, _stats(fallback=True), 1, 1, fallback_warn=0.2, finished_goals=1)
    assert s.level == WARN and "fallback" in s.message
    assert ("dropped draft tokens", "0") in s.values  # the confidence stop's drops are reported (none here)
    s = Status()
    fill_throughput_status(s, _stats(fallback=False), 1, 1, fallback_warn=0.2, finished_goals=1)
    assert s.level == OK


def test_wasted_prefetches_warn_and_failed_drafts_are_errors():
    window = _stats(False)
    window.cache.wasted_prefetches = 2
    s = Status()
    fill_cache_status(s, CacheStats(capacity=2, resident=["code"]), window, ["code", "math"])
    assert s.level == WARN and "evicted unused" in s.message
    s = Status()
    fill_cache_status(s, CacheStats(capacity=2, failed={"math": "OSError: unreadable"}), window, ["code", "math"])
    assert s.level == ERROR and "math" in s.message
    # no lookup yet (just activated): not a 0.0 hit rate, which reads as every lookup missed
    s = Status()
    fill_cache_status(s, CacheStats(capacity=2), None, ["code"])
    assert ("hit rate", "n/a (no lookup yet)") in s.values
    s = Status()
    fill_cache_status(s, CacheStats(capacity=2, hits=3, misses=1), None, ["code"])
    assert ("hit rate", "0.75") in s.values


def test_a_node_configured_from_draft_lists_goes_back_to_the_registry_file_it_would_have_resolved(monkeypatch):
    """drafts.registry_file empty means the bundled zoo's registry.yaml at configure; setting drafts.names back
    to [''] on a node configured from the lists looked for a registry at '' and was refused."""
    import rclpy
    from node_helpers import Harness, node_overrides
    from rclpy.context import Context

    from memspec_ros.runtime.loader import registry_target

    zoo = tiny_zoo()
    monkeypatch.setenv("MEMSPEC_ZOO_DIR", str(zoo))  # the "bundled" zoo of this test
    lists = {"drafts.registry_file": "", "drafts.names": ["general"], "drafts.paths": [str(zoo / "drafts" / "general")],
             "drafts.domains": ["general"], "model.target_path": registry_target(zoo / "registry.yaml"),
             "memspec.policy": "general-static"}
    context = Context()
    rclpy.init(context=context)
    harness = Harness(context, name="memspec_lists", overrides=node_overrides(zoo, **lists))  # beside h's node
    try:
        harness.activate()
        assert harness.node.loaded.registry.names() == ["general"]
        result = harness.set_params_atomically(**registry_file_params())
        assert result.successful, result.reason
        assert harness.node.loaded.registry.names() == ["general", "code", "math"]
    finally:
        harness.close()
        rclpy.try_shutdown(context=context)


def test_an_empty_list_given_for_a_string_array_parameter_means_its_documented_default():
    """`names: []` in a params file (or `-p drafts.names:=[]`) reaches rclpy without an element type, and the
    parameter was declared unset: drafts.paths broke the constructor, the others failed configure with
    ParameterUninitializedException, which names no fix. The descriptions offer [] as meaning what [''] means."""
    import rclpy
    from rclpy.context import Context

    from memspec_ros.ros.node import MemSpecNode

    names = ("model.allowed_roots", "drafts.names", "drafts.paths", "drafts.domains")
    context = Context()
    rclpy.init(context=context, args=["memspec", "--ros-args", *[a for n in names for a in ("-p", f"{n}:=[]")]])
    node = MemSpecNode("memspec_empty_lists", context=context)
    try:
        assert {n: list(node.get_parameter(n).value) for n in names} == {n: [""] for n in names}
    finally:
        node.destroy_node()
        rclpy.try_shutdown(context=context)


def test_an_integer_given_for_a_double_parameter_is_taken_as_that_number():
    """`ucb_c: 2` in a params file or `-p diagnostic_updater.period:=2` raised InvalidParameterTypeException out
    of the node's constructor, a traceback for a value that means exactly 2.0."""
    import rclpy
    from rclpy.context import Context

    from memspec_ros.ros import params as P
    from memspec_ros.ros.node import MemSpecNode

    doubles = [p.name for p in P.PARAMS if type(p.default) is float]
    assert {"memspec.ucb_c", "diagnostic_updater.period"} <= set(doubles)
    context = Context()
    rclpy.init(context=context, args=["memspec", "--ros-args", "-p", "memspec.ucb_c:=3",
                                      "-p", "diagnostic_updater.period:=2"])
    node = MemSpecNode("memspec_int_doubles", context=context)
    try:
        values = {n: node.get_parameter(n).value for n in ("memspec.ucb_c", "diagnostic_updater.period")}
        assert values == {"memspec.ucb_c": 3.0, "diagnostic_updater.period": 2.0}
        assert all(type(v) is float for v in values.values())
        # at run time too (`ros2 param set /memspec generation.temperature 0`, the parameter service's path): rclpy
        # refused it as the wrong type before the node's callback saw it
        if hasattr(node, "add_pre_set_parameters_callback"):
            from rclpy.parameter import Parameter

            result = node.set_parameters_atomically([Parameter("generation.temperature", Parameter.Type.INTEGER, 0),
                                                     Parameter("memspec.ucb_c", Parameter.Type.INTEGER, 5)])
            assert result.successful, result.reason
            values = {n: node.get_parameter(n).value for n in ("generation.temperature", "memspec.ucb_c")}
            assert values == {"generation.temperature": 0.0, "memspec.ucb_c": 5.0}
            assert all(type(v) is float for v in values.values())
            # an integer parameter keeps its integer, and a range is still the descriptor's to check
            kept = node.set_parameters_atomically([Parameter("memspec.gamma", Parameter.Type.INTEGER, 3)])
            assert kept.successful and type(node.get_parameter("memspec.gamma").value) is int
            refused = node.set_parameters_atomically([Parameter("memspec.ucb_c", Parameter.Type.INTEGER, -1)])
            assert not refused.successful and node.get_parameter("memspec.ucb_c").value == 5.0
    finally:
        node.destroy_node()
        rclpy.try_shutdown(context=context)


@pytest.mark.parametrize("override, says", [("memspec.capacity:=0", "memspec.capacity"),
                                            ("memspec.overlap_prediction:=maybe", "memspec.overlap_prediction")])
def test_a_start_up_override_the_node_cannot_take_ends_it_with_one_line(override, says):
    """Such an override (out of range, another type) ended the node's process with a traceback."""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-m", "memspec_ros.ros.node", "--ros-args", "-r", "__node:=memspec_bad",
                          "-p", override], capture_output=True, text=True, timeout=120)
    assert out.returncode == 2, out.stderr[-2000:]
    assert "a start-up parameter was refused" in out.stderr and says in out.stderr, out.stderr[-2000:]
    assert "Traceback" not in out.stderr + out.stdout, out.stderr[-2000:]


def test_cache_state_follows_a_registry_change_at_once(h):
    """~/cache_state lists the registry's drafts, but its 'changed' key left the registry out: a draft added or
    removed at run time showed (latched, to late joiners too) only after diagnostics.cache_state_period."""
    zoo = tiny_zoo()
    subset = zoo / "registry-general-code-state.yaml"
    subset.write_text("\n".join(line for line in (zoo / "registry.yaml").read_text().splitlines()
                                if "math" not in line) + "\n")
    before = h.get_param("drafts.registry_file")
    period = h.get_param("diagnostics.cache_state_period")
    got: list[CacheState] = []
    sub = h.client.create_subscription(CacheState, "/memspec/cache_state", got.append, LATCHED)
    try:
        wait_until(lambda: got, 10.0, "the latched cache state")
        assert h.set_params(**{"diagnostics.cache_state_period": 3600.0})[0].successful
        time.sleep(1.5)  # past one publication at the old period, if one was due
        [result] = h.set_params(**{"drafts.registry_file": str(subset)})
        assert result.successful, result.reason
        wait_until(lambda: sorted(d.name for d in got[-1].drafts) == ["code", "general"], 10.0,
                   "a cache state listing the new registry's drafts")
    finally:
        h.client.destroy_subscription(sub)
        assert h.set_params(**{"drafts.registry_file": before})[0].successful
        assert h.set_params(**{"diagnostics.cache_state_period": period})[0].successful
        subset.unlink()


def test_a_setter_that_raises_answers_the_parameter_call_with_the_reason(h, monkeypatch):
    """An exception while a checked change was applied escaped the on-set callback: rclpy's parameter service
    catches none, so `ros2 param set` and rqt_reconfigure got no answer at all (an old diagnostic_updater's period
    setter raises AttributeError)."""
    def broken(value):
        raise AttributeError("'Node' object has no attribute 'creat_timer'")

    monkeypatch.setitem(h.node._params._setters, "diagnostics.window_goals", broken)
    before = h.get_param("diagnostics.window_goals")
    [result] = h.set_params(**{"diagnostics.window_goals": before + 1})
    assert not result.successful and "applying it failed (AttributeError" in result.reason
    assert h.get_param("diagnostics.window_goals") == before


def test_a_change_that_fails_while_applied_leaves_the_runtime_on_the_values_the_parameters_show(h, monkeypatch):
    """The controller took memspec.* before the other steps of the same change ran: when a later one raised, the
    change was answered "failed" and `ros2 param get` showed the old K while the controller ran the new one (and a
    setter that had run kept its new value). Every step before the failure is now undone."""
    controller = h.node.loaded.controller
    window = h.node._window
    capacity, goals = controller.next_config.capacity, h.get_param("diagnostics.window_goals")

    def broken(wanted):  # the registry swap, the last step, after the setters and the controller
        raise OSError("the drafts' folder went away")

    monkeypatch.setattr(h.node.loaded.registry, "replace_with", broken)
    result = h.set_params_atomically(**registry_file_params(), **{"memspec.capacity": capacity + 1,
                                                                   "diagnostics.window_goals": goals + 1})
    assert not result.successful and "applying it failed (OSError" in result.reason and "undone" in result.reason
    assert controller.next_config.capacity == controller.config.capacity == capacity
    assert h.get_param("memspec.capacity") == capacity and h.get_param("diagnostics.window_goals") == goals
    assert window._size == goals  # the setter given its old value back


def test_a_change_whose_undo_fails_is_a_warning_on_diagnostics_until_the_next_configure(h, monkeypatch):
    """An undo that failed left the runtime on the new value and the parameter on the old one, said only in the log:
    /diagnostics stayed OK. The target model's status warns of it, until a configure loads the models anew."""
    from lifecycle_msgs.msg import Transition

    controller = h.node.loaded.controller
    capacity = controller.next_config.capacity
    apply = controller._apply
    calls = []

    def undo_breaks(config):
        calls.append(config)
        if len(calls) > 1:  # the controller putting its settings back after the swap failed
            raise RuntimeError("the cache would not shrink back")
        return apply(config)

    def broken(wanted):  # the swap fails after the settings were applied, so they are put back
        raise OSError("the drafts' folder went away")

    monkeypatch.setattr(controller, "_apply", undo_breaks)
    monkeypatch.setattr(h.node.loaded.registry, "replace_with", broken)
    try:
        result = h.set_params_atomically(**registry_file_params(), **{"memspec.capacity": capacity + 1})
        assert not result.successful and len(calls) == 2
        status = {s.name: s for s in h.node._diagnostics.collect()}["memspec: target model"]
        assert status.level == WARN and "memspec.capacity could not be put back" in status.message, status.message
        assert controller.next_config.capacity == capacity + 1  # the runtime on the new K, the parameter the old
        # the operator sets the parameter's own value again to repair it: applied, not taken for no change; the
        # warning goes with the mismatch, and other unchanged values stay no change (a dumped file loads)
        monkeypatch.setattr(controller, "_apply", apply)
        assert h.set_params(**{"memspec.capacity": capacity})[0].successful
        assert controller.next_config.capacity == capacity
        status = {s.name: s for s in h.node._diagnostics.collect()}["memspec: target model"]
        assert status.level == OK and not h.node.mismatched_params, status.message
    finally:  # the module's node: loaded anew, whatever failed above
        monkeypatch.undo()
        if h.node.lifecycle_state == "active":
            h.transition(Transition.TRANSITION_DEACTIVATE)
        if h.node.lifecycle_state == "inactive":
            h.transition(Transition.TRANSITION_CLEANUP)
        h.transition(Transition.TRANSITION_CONFIGURE)
        h.transition(Transition.TRANSITION_ACTIVATE)
    assert h.node.lifecycle_state == "active"
    status = {s.name: s for s in h.node._diagnostics.collect()}["memspec: target model"]
    assert status.level == OK, status.message
