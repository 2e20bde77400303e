# ruff: noqa: E402 - the ROS imports follow require_ros()
"""memspec_node's lifecycle through the real lifecycle_msgs services (what `ros2 lifecycle set`
and the launch file use): every transition, a failed configure, on_error, and memory returned."""

from __future__ import annotations

import gc
import shutil

import pytest
import yaml
from node_helpers import Harness, goal, node_overrides, tiny_zoo
from ros_helpers import require_ros, wait_until

require_ros()

from action_msgs.msg import GoalStatus
from lifecycle_msgs.msg import Transition
from rclpy.lifecycle import TransitionCallbackReturn

from memspec_interfaces.action import Generate
from memspec_ros.ros.diagnostics import ERROR, OK, WARN


@pytest.fixture
def harness(rclpy_context):
    made = []

    def build(**overrides):
        h = Harness(rclpy_context, overrides=node_overrides(tiny_zoo(), **overrides))
        made.append(h)
        return h

    yield build
    for h in made:
        h.close()


def test_every_transition_through_the_services_and_cleanup_frees_the_models(harness, monkeypatch):
    from memspec_ros.runtime import kv_cache

    trims = []  # the heap's freed pages handed back to the system as the models go
    monkeypatch.setattr(kv_cache, "release_freed_memory", lambda: trims.append(1) or True)
    h = harness()
    assert h.state() == "unconfigured"
    assert h.node.loaded_parameter_bytes() == 0

    assert h.transition(Transition.TRANSITION_CONFIGURE)
    assert h.state() == "inactive"
    loaded = h.node.loaded_parameter_bytes()
    assert loaded > 0

    assert h.transition(Transition.TRANSITION_ACTIVATE)
    assert h.state() == "active"
    # a transition the state does not have is refused (rclpy alone would raise out of the service)
    assert not h.transition(Transition.TRANSITION_CLEANUP)
    assert h.state() == "active"
    handle, _ = h.send(goal(max_new_tokens=16))
    assert handle.accepted
    response = h.result(handle)
    assert response.status == GoalStatus.STATUS_SUCCEEDED
    assert h.node.loaded_parameter_bytes() > loaded  # drafts became resident
    refs = h.node.model_refs()
    assert len(refs) >= 2

    assert h.transition(Transition.TRANSITION_DEACTIVATE)
    assert h.state() == "inactive"
    trims.clear()
    assert h.transition(Transition.TRANSITION_CLEANUP)
    assert h.state() == "unconfigured"
    assert h.node.loaded_parameter_bytes() == 0 and trims
    del response, handle
    gc.collect()
    assert all(ref() is None for ref in refs), "a model survived cleanup"

    # configure again after cleanup, then shut down from active
    assert h.transition(Transition.TRANSITION_CONFIGURE)
    assert h.transition(Transition.TRANSITION_ACTIVATE)
    assert h.transition(Transition.TRANSITION_ACTIVE_SHUTDOWN)
    assert h.state() == "finalized"
    assert h.node.loaded_parameter_bytes() == 0


def test_a_goal_is_rejected_at_once_with_the_reason_in_every_state_but_active(harness):
    """The action server exists in every lifecycle state: a goal to an unconfigured, inactive or
    finalized node is rejected at once with a logged reason (before, nobody answered it)."""
    h = harness()

    def rejected_in(state: str, words: str) -> None:
        assert h.state() == state
        handle, _ = h.send(goal(max_new_tokens=4))
        assert not handle.accepted, state
        assert f"state {state}" in h.node.last_rejection and words in h.node.last_rejection, h.node.last_rejection

    rejected_in("unconfigured", "configure and activate")
    assert h.transition(Transition.TRANSITION_CONFIGURE)
    rejected_in("inactive", "activate")
    assert h.transition(Transition.TRANSITION_ACTIVATE)
    handle, _ = h.send(goal(max_new_tokens=4))
    assert h.result(handle).status == GoalStatus.STATUS_SUCCEEDED
    assert h.transition(Transition.TRANSITION_DEACTIVATE)
    rejected_in("inactive", "activate")
    assert h.transition(Transition.TRANSITION_CLEANUP)
    rejected_in("unconfigured", "configure and activate")
    assert h.transition(Transition.TRANSITION_UNCONFIGURED_SHUTDOWN)
    rejected_in("finalized", "start the node again")
    assert h.node.goals_rejected == 5


def test_shutdown_during_a_goal_sends_the_results_of_the_running_and_the_queued_goal(harness):
    """The shutdown transition while a goal runs and another waits: both end ABORTED (the running one
    with its partial text) and the client receives both results (before, the action server was gone
    before rclpy sent them)."""
    h = harness()
    h.activate()
    feedback = []
    running, _ = h.send(goal(max_new_tokens=3000), feedback)
    wait_until(lambda: len(feedback) >= 2, 30.0, "the running goal's feedback")
    queued, _ = h.send(goal(max_new_tokens=8))
    assert running.accepted and queued.accepted
    results = [handle.get_result_async() for handle in (running, queued)]
    assert h.transition(Transition.TRANSITION_ACTIVE_SHUTDOWN)
    assert h.state() == "finalized"
    ran, waited = (h.wait(r, 10.0, "a result after shutdown") for r in results)
    for response in (ran, waited):
        assert response.status == GoalStatus.STATUS_ABORTED
        assert response.result.finish_reason == Generate.Result.FINISH_ERROR
        assert "shutting down" in response.result.error_message, response.result.error_message
    assert ran.result.text and 0 < ran.result.completion_tokens < 3000
    assert waited.result.completion_tokens == 0


def _deactivate_into_error(h, monkeypatch) -> None:
    """A deactivate that raises (its first end_goals): the node goes through on_error, which ends the goals and
    releases the models, back to unconfigured."""
    end_goals, calls = h.node._runner.end_goals, []

    def fails_once(*args, **kwargs):
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("simulated failure while deactivating")
        return end_goals(*args, **kwargs)

    monkeypatch.setattr(h.node._runner, "end_goals", fails_once)
    assert not h.transition(Transition.TRANSITION_DEACTIVATE)
    assert h.state() == "unconfigured"


@pytest.mark.parametrize("transition", ["shutdown", "error"])
def test_shutdown_and_error_free_the_models_only_once_the_running_goal_has_ended(harness, monkeypatch, transition):
    """shutdown and error must succeed, but a goal told to end may not reach its next iteration within the wait (a
    long prefill on a loaded machine, here a generate call deaf to the abort): the models were freed under it (cache
    reset, controller closed) while it still ran. Now the transition succeeds and they are freed when it ends."""
    import threading

    from memspec_ros.ros import goal_runner
    from memspec_ros.ros import node as node_module

    monkeypatch.setattr(goal_runner, "DEACTIVATE_WAIT_SECONDS", 0.5)
    monkeypatch.setattr(node_module, "DEACTIVATE_WAIT_SECONDS", 0.5)
    h = harness()
    h.activate()
    controller = h.node.loaded.controller
    generate, entered, release, ended = controller.generate, threading.Event(), threading.Event(), threading.Event()
    freed: list[tuple[str, bool]] = []  # (what, whether the goal's generate had returned)

    def blocking_generate(*args, **kwargs):
        entered.set()
        release.wait(30.0)  # deaf to the abort until released
        try:
            return generate(*args, **kwargs)
        finally:
            ended.set()

    freeing = threading.Event()  # the cache reset (the first step of freeing) waits for it

    def recording(what, call):
        def wrapped(*args, **kwargs):
            freed.append((what, ended.is_set()))
            if what == "cache reset":
                freeing.wait(30.0)
            return call(*args, **kwargs)
        return wrapped

    monkeypatch.setattr(controller, "generate", blocking_generate)
    monkeypatch.setattr(controller.cache, "reset", recording("cache reset", controller.cache.reset))
    monkeypatch.setattr(controller, "close", recording("controller closed", controller.close))
    handle, _ = h.send(goal(max_new_tokens=4))
    assert handle.accepted and entered.wait(10.0)
    try:
        if transition == "shutdown":
            assert h.transition(Transition.TRANSITION_ACTIVE_SHUTDOWN)
            assert h.state() == "finalized"
        else:  # an exception in deactivate: on_error ends the goals and frees the models
            _deactivate_into_error(h, monkeypatch)
            # the diagnostics said "the models were freed ... configure it again", which configure then refused
            status = {s.name: s for s in h.node._diagnostics.collect()}["memspec: target model"]
            assert status.level == ERROR and "freed once the goal still running ends" in status.message
            # configure would load a second target and drafts beside the ones the goal still holds: refused
            assert not h.transition(Transition.TRANSITION_CONFIGURE) and h.state() == "unconfigured"
        assert h.node.loaded is None and h.node.loaded_parameter_bytes() == 0  # the node holds none of them now
        assert freed == [], "models freed under a goal that still runs"
    finally:
        release.set()
    try:
        wait_until(lambda: len(freed) == 1, 30.0, "the models' freeing to start after the goal ended")
        if transition == "error":  # the goal is over but its models are still being freed: configure is refused
            assert not h.transition(Transition.TRANSITION_CONFIGURE) and h.state() == "unconfigured"
        # the result goes out while the models are still being freed (it waited for their release, up to the
        # draft cache's 30 s bound on a hung read)
        response = h.result(handle, 30.0)
        assert response.status == GoalStatus.STATUS_ABORTED and len(freed) == 1
    finally:
        freeing.set()
    wait_until(lambda: len(freed) == 2, 10.0, "the models freed after the goal ended")
    assert freed == [("cache reset", True), ("controller closed", True)]
    if transition == "error":  # the goal over and its models freed, configure loads again
        assert h.transition(Transition.TRANSITION_CONFIGURE) and h.state() == "inactive"


def test_configure_with_a_bad_path_fails_and_stays_unconfigured(harness):
    h = harness(**{"model.target_path": "/nonexistent/target"})
    assert not h.transition(Transition.TRANSITION_CONFIGURE)
    assert h.state() == "unconfigured"
    # rcl's ~/transition_event names the states (its transition field empty): the lifecycle client tells a configure
    # that started and failed (its reply lost) from a lost request by this event
    from memspec_ros.ros.lifecycle_client import _STARTED_IN

    wait_until(lambda: any((was, now) == ("unconfigured", _STARTED_IN[Transition.TRANSITION_CONFIGURE])
                           for _, was, now in h.lifecycle._events), 10.0, "the configure's start event")
    status = {s.name: s for s in h.node._diagnostics.collect()}["memspec: target model"]
    assert status.level == ERROR
    assert "/nonexistent/target" in status.message and "configure failed" in status.message
    # fixing the parameter (allowed while unconfigured) makes configure succeed
    results = h.set_params(**{"model.target_path": str(tiny_zoo() / "target")})
    assert results[0].successful, results[0].reason
    assert h.transition(Transition.TRANSITION_CONFIGURE)
    assert h.state() == "inactive"
    # configured: the refusal's advice is the transitions this state allows (inactive refuses deactivate)
    [refused] = h.set_params(**{"model.target_path": "/elsewhere"})
    assert not refused.successful
    assert "state inactive): cleanup, set it, then configure again" in refused.reason, refused.reason


def test_defaults_that_would_refuse_every_goal_fail_configure(harness):
    """A params file setting generation.max_new_tokens past the target's context configured, and every goal
    relying on the default was then refused; configure fails with the reason instead."""
    h = harness(**{"generation.max_new_tokens": 4096})  # the tiny zoo's target: 4096 positions
    assert not h.transition(Transition.TRANSITION_CONFIGURE)
    assert h.state() == "unconfigured"
    status = {s.name: s for s in h.node._diagnostics.collect()}["memspec: target model"]
    assert "generation.max_new_tokens 4096 leaves no room for a prompt" in status.message, status.message
    assert h.set_params(**{"generation.max_new_tokens": 128})[0].successful
    assert h.transition(Transition.TRANSITION_CONFIGURE)


def test_a_parameter_stored_as_configure_reads_fails_that_configure(harness):
    """on_set releases the transition lock as it returns and rclpy stores the value after: a set racing a configure
    landed after the configure read the old value, and the node ran the old model while the parameter showed the
    new. The race is made here by storing a value the way rclpy does, just after configure read them."""
    from rclpy.parameter import Parameter

    h = harness()
    handler = h.node._params
    read = handler.checked_values

    def racing():
        values = read()
        h.node._parameters["memspec.gamma"] = Parameter("memspec.gamma", value=3)
        # read per goal: a value stored now is the one the goals use, no reason to fail the configure
        h.node._parameters["generation.system_prompt"] = Parameter("generation.system_prompt", value="Be brief.")
        return values

    handler.checked_values = racing
    assert not h.transition(Transition.TRANSITION_CONFIGURE)
    assert h.state() == "unconfigured" and h.node.loaded is None
    assert h.node._configure_error.endswith(
        "memspec.gamma changed as configure read the parameters: configure again to load what they say now")
    handler.checked_values = read
    assert h.transition(Transition.TRANSITION_CONFIGURE) and h.state() == "inactive"  # what they say now
    assert h.node.loaded.controller.config.gamma == 3


def test_a_node_shut_down_after_a_failed_configure_says_finalized(harness):
    """/diagnostics kept saying "configure failed" (ERROR) for a node shut down since: it is finalized (WARN)."""
    h = harness(**{"model.target_path": "/nonexistent/target"})
    assert not h.transition(Transition.TRANSITION_CONFIGURE)
    assert h.transition(Transition.TRANSITION_UNCONFIGURED_SHUTDOWN) and h.state() == "finalized"
    status = {s.name: s for s in h.node._diagnostics.collect()}["memspec: target model"]
    assert status.level == WARN and "finalized" in status.message, status.message


@pytest.mark.parametrize("bad", [{"memspec.recent_tokens": 16},  # not the predictor's T (32)
                                 {"memspec.policy": "general-static", "memspec.general_draft": "no-such-draft"}])
def test_a_configure_failing_after_the_predictor_loaded_frees_the_target(harness, monkeypatch, bad):
    """The target-hidden predictor registers with a module-level table of observers whose entry kept the target
    alive; a configure failing after it loaded never closed it: every such failed configure kept a target in
    memory for good (an edge device runs out after a few typos)."""
    import weakref

    from memspec_ros.runtime import draft_forward, loader

    targets = []
    load_models = loader.load_models

    def recording(*args, **kwargs):
        models = load_models(*args, **kwargs)
        targets.append(weakref.ref(models.target.model))
        return models

    monkeypatch.setattr(loader, "load_models", recording)
    h = harness(**bad)
    observed = len(draft_forward._OBSERVERS)
    for _ in range(2):
        assert not h.transition(Transition.TRANSITION_CONFIGURE)
    assert h.state() == "unconfigured" and len(targets) == 2
    gc.collect()
    assert [ref() for ref in targets] == [None, None], "a failed configure kept its target"
    assert len(draft_forward._OBSERVERS) == observed
    h.set_params(**{"memspec.recent_tokens": 32, "memspec.general_draft": "general"})
    assert h.transition(Transition.TRANSITION_CONFIGURE)  # and the node still configures once it is fixed


@pytest.mark.parametrize("predictor", ["none", "missing", "corrupt"])
def test_a_policy_without_its_predictor_runs_general_static_with_a_warning(harness, tmp_path, predictor):
    """A missing predictor (predictor.path 'none', a directory that is gone, or files that do not load) is
    not a failed configure: memspec runs as general-static, /diagnostics says why (WARN), goals succeed,
    and memspec.policy cannot be set back to a predictor policy until a predictor is configured."""

    path = {"none": "none", "missing": str(tmp_path / "gone"), "corrupt": str(tmp_path / "corrupt")}[predictor]
    if predictor == "corrupt":
        shutil.copytree(tiny_zoo() / "predictor", tmp_path / "corrupt")
        for head in (tmp_path / "corrupt").rglob("*.safetensors"):
            head.write_bytes(b"not safetensors")
    h = harness(**{"predictor.path": path, "memspec.policy": "memspec"})
    h.activate()
    assert h.node.loaded.controller.config.policy == "general-static"
    status = {s.name: s for s in h.node._diagnostics.collect()}["memspec: predictor"]
    assert status.level == WARN, status.message
    assert "runs as general-static" in status.message and "needs a trained predictor" in status.message
    if predictor == "none":
        assert "predictor.path is 'none'" in status.message
    else:
        assert "failed to load" in status.message and path in status.message
    handle, _ = h.send(goal(max_new_tokens=8))
    response = h.result(handle)
    assert response.status == GoalStatus.STATUS_SUCCEEDED and list(response.result.drafts_used) == ["general"]
    # set again as it is (`ros2 param load` of a dumped file): no change, neither refused nor applied (the whole
    # file failed)
    [again] = h.set_params(**{"memspec.policy": "memspec"})
    assert again.successful and h.node.loaded.controller.config.policy == "general-static"
    if predictor == "none":  # the general draft's checks hold for the policy that runs, not the parameter's
        [refused] = h.set_params(**{"memspec.general_draft": "no-such-draft"})
        assert not refused.successful and "not in the draft registry" in refused.reason
        assert h.get_param("memspec.general_draft") == "general"
    # changed to it from another policy: refused
    assert h.set_params(**{"memspec.policy": "mab-async"})[0].successful
    [refused] = h.set_params(**{"memspec.policy": "memspec"})
    assert not refused.successful and "needs a trained predictor" in refused.reason
    assert h.node.loaded.controller.config.policy == "mab-async"
    # the operator then asks for a policy that needs no predictor: nothing is wrong any more (it stayed WARN)
    for policy in ("mab-async", "general-static"):
        [result] = h.set_params(**{"memspec.policy": policy})
        assert result.successful, result.reason
        status = {s.name: s for s in h.node._diagnostics.collect()}["memspec: predictor"]
        assert status.level == OK and f"policy {policy} needs none" in status.message, (policy, status.message)


def test_no_predictor_and_no_general_draft_fails_configure_saying_why_general_static_runs(harness):
    """With no predictor, memspec falls back to general-static, which needs memspec.general_draft: configure failed
    naming general-static alone, a policy the operator never chose, and the missing predictor only went to a log
    line never reached."""
    h = harness(**{"predictor.path": "none", "memspec.policy": "memspec", "memspec.general_draft": "no-such-draft"})
    assert not h.transition(Transition.TRANSITION_CONFIGURE)
    assert h.state() == "unconfigured"
    status = {s.name: s for s in h.node._diagnostics.collect()}["memspec: target model"]
    for part in ("predictor.path is 'none'", "memspec.policy memspec runs as general-static", "which cannot run",
                 "'no-such-draft' is not in the draft registry", "configure a predictor (predictor.path)"):
        assert part in status.message, (part, status.message)


def test_predictor_path_may_name_the_folder_the_trainer_wrote(harness, tmp_path):
    """memspec-train-predictor --out DIR writes its heads to DIR/<encoder>/; predictor.path:=DIR (what the trainer
    printed and the parameter's help names) was 'no trained predictor', and memspec ran as general-static. It is
    looked for in DIR's encoder subfolders, as an empty predictor.path looks beside the registry."""
    shutil.copytree(tiny_zoo() / "predictor", tmp_path / "trained" / "target-hidden")
    h = harness(**{"predictor.path": str(tmp_path / "trained"), "memspec.policy": "memspec"})
    h.activate()
    assert h.node.loaded.controller.config.policy == "memspec"
    status = {s.name: s for s in h.node._diagnostics.collect()}["memspec: predictor"]
    assert status.level == OK, status.message


def test_a_node_whose_predictor_failed_to_load_takes_a_registry_without_one(harness, tmp_path):
    """A predictor found beside the registry that failed to load left its path in the node's loaded paths: a later
    swap to a registry folder without a predictor was refused as one that 'brings predictor.path none', though the
    node ran without a predictor and stays so."""
    broken, plain = tmp_path / "broken", tmp_path / "plain"
    shutil.copytree(tiny_zoo(), broken)
    for head in (broken / "predictor").rglob("*.safetensors"):
        head.write_bytes(b"not safetensors")
    shutil.copytree(tiny_zoo(), plain)
    shutil.rmtree(plain / "predictor")
    registry = yaml.safe_load((plain / "registry.yaml").read_text())
    registry["target"] = str(broken / "target")  # the loaded target: only the drafts change
    (plain / "registry.yaml").write_text(yaml.safe_dump(registry))
    h = harness(**{"drafts.registry_file": str(broken / "registry.yaml"), "predictor.path": ""})
    h.activate()
    assert h.node.loaded.predictor is None and h.node.loaded.paths.predictor  # found, not loaded
    [result] = h.set_params(**{"drafts.registry_file": str(plain / "registry.yaml")})
    assert result.successful, result.reason
    assert h.node.loaded.predictor is None


def test_an_exception_in_a_transition_goes_through_on_error_back_to_unconfigured(harness, monkeypatch):
    h = harness()
    assert h.transition(Transition.TRANSITION_CONFIGURE)

    def boom(*_args):
        raise RuntimeError("simulated failure while activating")

    monkeypatch.setattr(h.node._window, "clear", boom)
    assert not h.transition(Transition.TRANSITION_ACTIVATE)
    assert h.state() == "unconfigured"  # on_error freed everything and recovered
    assert h.node.loaded_parameter_bytes() == 0
    # rclpy swallows the exception: the node keeps it, and /diagnostics says ERROR with the cause (it said OK,
    # "unconfigured: no model loaded") until configure succeeds again
    status = {s.name: s for s in h.node._diagnostics.collect()}["memspec: target model"]
    assert status.level == ERROR, status.message
    assert "activate raised RuntimeError: simulated failure while activating" in status.message
    assert h.node.on_error(None) == TransitionCallbackReturn.SUCCESS
    monkeypatch.undo()
    assert h.transition(Transition.TRANSITION_CONFIGURE)
    status = {s.name: s for s in h.node._diagnostics.collect()}["memspec: target model"]
    assert status.level == OK and h.node.transition_error == "", status.message
    # a node shut down never serves again: not OK either
    assert h.transition(Transition.TRANSITION_INACTIVE_SHUTDOWN) and h.state() == "finalized"
    status = {s.name: s for s in h.node._diagnostics.collect()}["memspec: target model"]
    assert status.level == WARN and "finalized" in status.message, status.message


def test_goals_run_with_model_threads_and_zero_restores_torchs_own_count(harness):
    """torch's thread count is OpenMP's, per thread: a goal runs on an executor thread that may have run torch
    before, so it takes model.threads itself; and 0 ("leave torch's default") after another value gives back the
    count torch had before the node set one, not the last one."""
    import torch

    before = torch.get_num_threads()
    h = harness(**{"model.threads": before + 1})
    h.activate()
    seen: list[int] = []

    def run_goal() -> None:
        controller = h.node.loaded.controller
        generate = controller.generate

        def recording(*args, **kwargs):
            seen.append(torch.get_num_threads())
            return generate(*args, **kwargs)

        controller.generate = recording
        handle, _ = h.send(goal(max_new_tokens=4))
        assert h.result(handle).status == GoalStatus.STATUS_SUCCEEDED

    run_goal()
    for tid in (Transition.TRANSITION_DEACTIVATE, Transition.TRANSITION_CLEANUP):
        assert h.transition(tid)
    assert all(r.successful for r in h.set_params(**{"model.threads": 0}))
    h.activate()
    run_goal()
    assert seen == [before + 1, before]


def test_going_after_a_second_signal_waits_for_no_goal(rclpy_context):
    """main() on a second SIGINT/SIGTERM: the node goes at once (ros2 launch escalates to SIGKILL if it lingers),
    even with a goal that has not reached its next iteration; the goal is still told to end."""
    import threading
    import time

    h = Harness(rclpy_context, overrides=node_overrides(tiny_zoo()))
    release = threading.Event()
    try:
        h.activate()
        controller = h.node.loaded.controller
        generate, entered = controller.generate, threading.Event()

        def blocking_generate(*args, **kwargs):
            entered.set()
            release.wait(60.0)  # deaf to the abort until released
            return generate(*args, **kwargs)

        controller.generate = blocking_generate
        handle, _ = h.send(goal(max_new_tokens=4))
        assert handle.accepted and entered.wait(10.0)
        h.node.abandon_results()
        job = h.node._runner._running
        t0 = time.monotonic()
    finally:
        h.close()
        release.set()
    assert time.monotonic() - t0 < 15.0  # executor shutdown's 5 s at most, not the goal's 30 s wait
    assert job.abort_reason and "second signal" in job.abort_reason


def test_the_cache_counters_stay_since_the_last_activation_while_inactive(harness):
    """/diagnostics and ~/cache_state count since activation; once deactivated they jumped back to the counts since
    configure, every earlier activation's included."""
    h = harness()
    h.activate()
    for _ in range(2):
        assert h.result(h.send(goal(max_new_tokens=8))[0]).status == GoalStatus.STATUS_SUCCEEDED
    assert h.transition(Transition.TRANSITION_DEACTIVATE) and h.transition(Transition.TRANSITION_ACTIVATE)
    assert h.result(h.send(goal(max_new_tokens=8))[0]).status == GoalStatus.STATUS_SUCCEEDED
    active = h.node.cache_snapshot(h.node.loaded)
    total = h.node.loaded.controller.cache.snapshot()
    assert active.hits + active.misses < total.hits + total.misses  # the first activation's are left out
    assert h.transition(Transition.TRANSITION_DEACTIVATE)
    assert h.node.loaded_parameter_bytes() > 0 and h.node.model_refs()  # observers: they count no hit
    inactive = h.node.cache_snapshot(h.node.loaded)
    assert (inactive.hits, inactive.misses, inactive.loads) == (active.hits, active.misses, active.loads)


def test_activate_waits_for_a_goal_deaf_to_the_deactivate(harness, monkeypatch):
    """A goal that had not reached its next iteration when deactivate gave up waiting went on running; activating
    again put its figures into the new activation's window and ~/generation_stats. Refused until it ends."""
    h = harness()
    assert h.transition(Transition.TRANSITION_CONFIGURE)
    monkeypatch.setattr(h.node._runner, "counts", lambda: (1, 0))
    assert not h.transition(Transition.TRANSITION_ACTIVATE)
    assert h.state() == "inactive"
    monkeypatch.undo()
    assert h.transition(Transition.TRANSITION_ACTIVATE) and h.state() == "active"


def test_cleanup_and_configure_forget_the_freed_models_goal_figures(harness, monkeypatch):
    """After a failed goal, deactivate, cleanup and configure: /diagnostics kept the old models' "the last goal
    failed" ERROR on the new, inactive node, and while unconfigured the throughput task still showed the freed
    models' tok/s."""
    from memspec_ros.ros.diagnostics import NodeTasks, run_task

    h = harness()
    h.activate()
    ok, _ = h.send(goal(max_new_tokens=4))
    assert h.result(ok, 30.0).status == GoalStatus.STATUS_SUCCEEDED
    monkeypatch.setattr(h.node.loaded.controller, "generate",
                        lambda *a, **k: (_ for _ in ()).throw(MemoryError("out of memory (simulated)")))
    failed, _ = h.send(goal(max_new_tokens=4))
    assert h.result(failed, 30.0).status == GoalStatus.STATUS_ABORTED
    monkeypatch.undo()
    tasks = NodeTasks(h.node, h.node._runner, h.node._window)
    assert "tok/s" in run_task(tasks.fill_throughput).message
    assert h.transition(Transition.TRANSITION_DEACTIVATE) and h.transition(Transition.TRANSITION_CLEANUP)
    assert run_task(tasks.fill_throughput).message == "no finished goal yet"
    assert h.transition(Transition.TRANSITION_CONFIGURE) and h.state() == "inactive"
    status = run_task(tasks.fill_target)
    assert "failed" not in status.message and status.level == OK


def _held_load(h, monkeypatch):
    """(gate, entered): the node's configure loads its models only once ``gate`` is set; ``entered`` is set when it
    has started loading."""
    import threading

    gate, entered = threading.Event(), threading.Event()
    load = h.node._load

    def slow_load():
        entered.set()
        gate.wait(30.0)
        return load()

    monkeypatch.setattr(h.node, "_load", slow_load)
    return gate, entered


def test_parameters_are_answered_during_a_configure_and_changes_refused_until_it_ends(harness, monkeypatch):
    """The lifecycle services shared rclpy's default callback group with the parameter services: while configure
    loaded the models (minutes for a large target), `ros2 param get`, rqt_reconfigure and a lifecycle manager's
    get_state got no answer. They are answered now; a change waits for no transition, it is refused with the reason."""
    import threading

    h = harness()
    gate, entered = _held_load(h, monkeypatch)
    done = []
    threading.Thread(target=lambda: done.append(h.transition(Transition.TRANSITION_CONFIGURE)), daemon=True).start()
    try:
        assert entered.wait(30.0)
        assert h.state() == "configuring"  # get_state answered under the configure (a lifecycle manager's probe)
        gamma = h.get_param("memspec.gamma")  # and the parameters
        other = 3 if gamma != 3 else 2
        [refused] = h.set_params(**{"memspec.gamma": other})
        assert not refused.successful and "a lifecycle transition is in progress" in refused.reason
        assert h.get_param("memspec.gamma") == gamma  # nothing changed
    finally:
        gate.set()
    wait_until(lambda: done, 60.0, "the configure")
    assert done == [True] and h.state() == "inactive"
    assert h.set_params(**{"memspec.gamma": other})[0].successful  # once it has ended


def test_diagnostics_say_configuring_while_a_retry_loads_the_models(harness, monkeypatch):
    """While a configure retried after a failed one loaded the models (minutes on a large target), /diagnostics said
    ERROR "configure failed: <the earlier reason>"; during a first configure, OK "unconfigured: no model loaded"."""
    import threading

    from memspec_ros.ros.diagnostics import NodeTasks, run_task

    h = harness()
    tasks = NodeTasks(h.node, h.node._runner, h.node._window)
    h.node._configure_error = "ModelDirectoryError: the earlier attempt's (test)"
    assert run_task(tasks.fill_target).level == ERROR  # until the retry starts
    gate, entered = _held_load(h, monkeypatch)
    done = []
    threading.Thread(target=lambda: done.append(h.transition(Transition.TRANSITION_CONFIGURE)), daemon=True).start()
    try:
        assert entered.wait(30.0)
        status = run_task(tasks.fill_target)
        assert (status.level, status.message) == (OK, "configuring: loading the models")
        assert dict(status.values)["last configure error"] == "ModelDirectoryError: the earlier attempt's (test)"
        for task in (tasks.fill_cache, tasks.fill_predictor):  # they said "not configured" / "unconfigured"
            assert run_task(task).message == "configuring: loading the models", task
    finally:
        gate.set()
    wait_until(lambda: done, 60.0, "the configure")
    status = run_task(tasks.fill_target)
    assert done == [True] and status.level == OK and status.message.startswith("loaded")


def test_a_parameter_change_is_refused_while_on_error_frees_the_models(harness, monkeypatch):
    """on_error ran outside the transition lock: a parameter change taken while it ended the goals and freed the
    models was applied to a controller being torn down. It is refused with the reason, as during every transition."""
    import threading

    h = harness()
    assert h.transition(Transition.TRANSITION_CONFIGURE)

    def boom(*_args):
        raise RuntimeError("simulated failure while activating")

    monkeypatch.setattr(h.node._window, "clear", boom)
    gate, entered = threading.Event(), threading.Event()
    end_goals = h.node._end_goals

    def held_end_goals(reason):
        entered.set()
        gate.wait(30.0)
        return end_goals(reason)

    monkeypatch.setattr(h.node, "_end_goals", held_end_goals)
    done = []
    threading.Thread(target=lambda: done.append(h.transition(Transition.TRANSITION_ACTIVATE)), daemon=True).start()
    try:
        assert entered.wait(30.0), "on_error did not run"
        gamma = h.get_param("memspec.gamma")
        other = 3 if gamma != 3 else 2
        [refused] = h.set_params(**{"memspec.gamma": other})
        assert not refused.successful and "a lifecycle transition is in progress" in refused.reason
        assert h.get_param("memspec.gamma") == gamma
    finally:
        gate.set()
    wait_until(lambda: done, 60.0, "the activate's error processing")
    assert done == [False] and h.state() == "unconfigured"
    assert h.set_params(**{"memspec.gamma": other})[0].successful  # once it has ended


def test_destroying_the_node_waits_for_a_configure_in_progress(harness, monkeypatch):
    """SIGINT during a slow configure: main() closed the goals and destroyed the node at once, while on_configure
    still loaded models on an executor thread; it then created its publishers on the destroyed node and on_error
    ran on a dead state machine. destroy_node now waits for the transition, which sees the node is going and fails
    with that reason, freeing what it loaded."""
    import threading
    import time

    h = harness()
    gate, entered = _held_load(h, monkeypatch)
    threading.Thread(target=lambda: h.transition(Transition.TRANSITION_CONFIGURE, timeout=5.0), daemon=True).start()
    assert entered.wait(30.0)
    h.node.close_goals("the node is shutting down (SIGINT)")  # what main()'s signal handler does first
    destroyed, waiting = threading.Event(), threading.Event()
    wait = h.node._wait_for_transition

    def observed_wait():
        waiting.set()
        return wait()

    monkeypatch.setattr(h.node, "_wait_for_transition", observed_wait)
    threading.Thread(target=lambda: (h.node.destroy_node(), destroyed.set()), daemon=True).start()
    assert waiting.wait(30.0), "destroy_node did not wait for the transition"
    # the configure holds the transition until the gate opens: however slow the machine, destroy is still waiting
    time.sleep(0.2)
    assert not destroyed.is_set(), "the node was destroyed under the configure"
    gate.set()
    assert destroyed.wait(30.0)
    assert "shutting down (SIGINT) while configure loaded the models" in h.node.configure_error
    assert h.node.loaded is None
    h.node.destroy_node = lambda: None  # destroyed above: the harness's close must not destroy it again


def test_destroying_an_active_node_takes_the_shutdown_transition(harness, monkeypatch):
    """SIGINT, SIGTERM or a destroy freed the models but never took the lifecycle's shutdown transition: no
    TransitionEvent to finalized, which launch's OnStateTransition handlers and lifecycle managers wait for."""
    from lifecycle_msgs.msg import TransitionEvent

    h = harness()
    h.activate()
    topic = f"/{h.name}/transition_event"
    events = []
    h.client.create_subscription(TransitionEvent, topic, events.append, 10)
    wait_until(lambda: h.client.count_publishers(topic) > 0, 30.0, "the transition event publisher")
    released = []
    release = h.node._release_after_goal
    monkeypatch.setattr(h.node, "_release_after_goal", lambda: (released.append(1), release())[1])
    # the goals are ended (and waited for, up to DEACTIVATE_WAIT_SECONDS) once: on_shutdown waited a second time
    ended = []
    end_goals = h.node._runner.end_goals
    monkeypatch.setattr(h.node._runner, "end_goals", lambda reason: (ended.append(reason), end_goals(reason))[1])
    machine = h.node._state_machine
    h.node.destroy_node()
    assert machine.current_state[1] == "finalized" and len(released) == 2  # destroy's own, then on_shutdown's
    assert len(ended) == 1, ended
    wait_until(lambda: any(e.goal_state.label == "finalized" for e in events), 30.0, "the event to finalized")
    h.node.destroy_node = lambda: None  # destroyed above: the harness's close must not destroy it again


def test_a_second_signal_while_destroy_waits_for_a_transition_stops_the_wait(harness):
    """main()'s handler for a second SIGINT sets _hurry and raises KeyboardInterrupt on the main thread, the one
    waiting in destroy_node for the transition: the exception left destroy_node before its quick-exit branch (and
    main()'s rclpy shutdown). The wait ends, returning False, so that branch runs."""
    import signal
    import threading

    h = harness()
    held, release = threading.Event(), threading.Event()

    def transition():
        with h.node._transitioning:
            held.set()
            release.wait(30.0)

    worker = threading.Thread(target=transition, daemon=True)
    worker.start()
    assert held.wait(10.0)

    def second_signal(signum, frame):
        h.node.abandon_results()
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGALRM, second_signal)
    try:
        signal.setitimer(signal.ITIMER_REAL, 0.3)
        assert h.node._wait_for_transition() is False
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
        release.set()
        worker.join(10.0)


def test_an_activate_after_the_goal_runner_closed_for_a_shutdown_is_refused(harness):
    """close() (a signal's shutdown) refuses goals for good, but an activate that came in meanwhile put the models
    back in the runner: a late accepted callback then started a goal during the shutdown."""
    h = harness()
    assert h.transition(Transition.TRANSITION_CONFIGURE)
    resets = []  # a refused activate left /diagnostics' goal figures wiped
    h.node._window.reset_counts = lambda: resets.append("goal counts")
    h.node._runner.close("the node is shutting down (test)", 0.5)
    assert not h.transition(Transition.TRANSITION_ACTIVATE)
    assert h.state() == "inactive" and h.node._runner._loaded is None and resets == []
    del h.node._window.reset_counts


def test_a_second_signals_destruction_goes_on_when_the_goals_cannot_be_ended(harness, monkeypatch):
    """After a second signal the executor is shut down before the node is destroyed: ending a queued goal then
    raised (its end is an executor task), and the action server, the node and rclpy's context were never shut."""
    h = harness()
    destroyed = []

    def executor_gone(*args, **kwargs):
        raise AttributeError("'NoneType' object has no attribute 'trigger'")

    monkeypatch.setattr(h.node._runner, "end_goals", executor_gone)
    monkeypatch.setattr(h.node._runner, "destroy", lambda: destroyed.append("action server"))
    # recorded, not done: the harness's executor still spins this node, and its teardown destroys it for real
    monkeypatch.setattr(type(h.node).__mro__[1], "destroy_node", lambda node: destroyed.append("node"))
    h.node._hurry = True
    h.node._destroy()
    assert destroyed == ["action server", "node"]
    h.node._hurry = False
    monkeypatch.undo()  # before the harness closes the node for real


def _deaf_goals(harness, monkeypatch):
    """(h, controller, entered, release): an active node whose goals do not hear an end request until ``release``
    is set (a long prefill), ``entered`` set as one starts; transitions wait 0.5 s for a goal to end."""
    import threading

    from memspec_ros.ros import goal_runner
    from memspec_ros.ros import node as node_module

    monkeypatch.setattr(goal_runner, "DEACTIVATE_WAIT_SECONDS", 0.5)
    monkeypatch.setattr(node_module, "DEACTIVATE_WAIT_SECONDS", 0.5)
    h = harness()
    h.activate()
    controller = h.node.loaded.controller
    generate, entered, release = controller.generate, threading.Event(), threading.Event()

    def deaf_generate(*args, **kwargs):
        entered.set()
        release.wait(30.0)
        return generate(*args, **kwargs)

    monkeypatch.setattr(controller, "generate", deaf_generate)
    return h, controller, entered, release


def test_models_are_freed_after_an_error_even_where_no_thread_can_be_started(harness, monkeypatch):
    """The release after a goal runs on a thread of its own; a failed start left the runner counting a release that
    never ran: configure refused for good and the models held."""
    import threading

    from memspec_ros.ros import goal_runner

    h, controller, entered, release = _deaf_goals(harness, monkeypatch)

    class NoThread(threading.Thread):
        def start(self):
            if self.name == "memspec-free-models":
                raise RuntimeError("can't start new thread")
            super().start()

    handle, _ = h.send(goal(max_new_tokens=4))
    assert handle.accepted and entered.wait(10.0)
    _deactivate_into_error(h, monkeypatch)
    real_thread = threading.Thread
    monkeypatch.setattr(goal_runner.threading, "Thread", NoThread)  # the threading module: every caller's
    release.set()
    assert h.result(handle, 30.0).status == GoalStatus.STATUS_ABORTED
    wait_until(lambda: not h.node._runner.models_in_use(), 30.0, "the models freed without a thread")
    monkeypatch.setattr(goal_runner.threading, "Thread", real_thread)
    assert h.transition(Transition.TRANSITION_CONFIGURE) and h.state() == "inactive"


def test_an_inactive_nodes_latched_cache_state_says_no_draft_runs(harness):
    """~/cache_state is latched: a subscriber that came while the node was inactive got the last sample from before
    the deactivate, a draft running in it."""
    from memspec_interfaces.msg import CacheState
    from memspec_ros.ros.diagnostics import LATCHED

    h = harness()
    h.activate()
    assert h.result(h.send(goal(max_new_tokens=8))[0]).status == GoalStatus.STATUS_SUCCEEDED
    h.node.loaded.controller.cache.set_active("general")  # a draft running, as during a goal
    seen: list[CacheState] = []
    watch = h.client.create_subscription(CacheState, "/memspec/cache_state", seen.append, LATCHED)
    wait_until(lambda: seen and seen[-1].active_draft == "general", 10.0, "a CacheState with general running")
    h.client.destroy_subscription(watch)
    assert h.transition(Transition.TRANSITION_DEACTIVATE)
    got: list[CacheState] = []
    sub = h.client.create_subscription(CacheState, "/memspec/cache_state", got.append, LATCHED)
    try:
        wait_until(lambda: got, 10.0, "the latched CacheState")
        assert got[-1].active_draft == "" and not any(d.is_active for d in got[-1].drafts)
    finally:
        h.client.destroy_subscription(sub)


def test_a_goal_its_client_cancelled_ends_canceled_though_a_deactivate_came_before_its_next_iteration(harness,
                                                                                                       monkeypatch):
    """The client's cancel was accepted (CANCELING); a deactivate then ended the goal ABORTED with "the node was
    deactivated", telling the client its cancel had not counted."""
    h, _, entered, release = _deaf_goals(harness, monkeypatch)  # a long prefill: no iteration checks the cancel
    handle, _ = h.send(goal(max_new_tokens=64))
    assert handle.accepted and entered.wait(10.0)
    try:
        assert len(h.wait(handle.cancel_goal_async(), 10.0, "the cancel response").goals_canceling) == 1
        assert h.transition(Transition.TRANSITION_DEACTIVATE)
    finally:
        release.set()
    response = h.result(handle)
    assert response.status == GoalStatus.STATUS_CANCELED, (response.status, response.result.error_message)
    assert response.result.finish_reason == "cancelled"


def test_a_finished_goals_result_is_kept_for_action_result_keep_seconds(harness):
    """rclpy keeps every finished goal (its request and its result text) for 900 s: a node answering many goals held
    them all. action.result_keep_seconds sets how long; past it the server lets the finished goal go."""
    h = harness(**{"action.result_keep_seconds": 10})
    assert h.transition(Transition.TRANSITION_CONFIGURE) and h.transition(Transition.TRANSITION_ACTIVATE)
    handle, _ = h.send(goal(max_new_tokens=4))
    assert h.result(handle).status == GoalStatus.STATUS_SUCCEEDED
    server = h.node._action_server
    wait_until(lambda: not server._goal_handles, 40.0, "the finished goal let go after 10 s")
