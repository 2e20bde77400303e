# ruff: noqa: E402 - the ROS imports follow require_ros()
"""Faults injected into a running memspec_node, driven over DDS (issue 18, point 2).

Each test injects one fault, checks that /diagnostics names it (ERROR or WARN with the cause), that the
goal meeting it ends as documented (greedy output still the target's own, or ABORTED with the reason),
removes the cause, and checks that later goals succeed and that nothing leaked: the node's own threads
are the ones it had before (the executor's pool is bounded by its size), every draft model that left the
cache is garbage (resident memory is not measured here: `memspec-bench soak --long` bounds its growth).

Faults already covered elsewhere and not repeated here: shutdown during a goal (test_node_lifecycle),
deactivate during a goal (test_node_action), SIGINT/SIGTERM during a goal (test_node_process), a draft
failing to load and tried again (test_node_params_diagnostics), a missing predictor (test_node_lifecycle);
the runtime's side of these faults is test_runtime_faults.py."""

from __future__ import annotations

import gc
import random
import shutil
import threading
import weakref
from collections import Counter
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
from node_helpers import Harness, active_harness, goal, node_overrides, tiny_zoo
from ros_helpers import require_ros, wait_until

require_ros()

import rclpy
from action_msgs.msg import GoalStatus
from lifecycle_msgs.msg import Transition
from rclpy.context import Context
from rclpy.executors import SingleThreadedExecutor

from memspec_interfaces.action import Generate
from memspec_ros.ros.action_client import SafeActionClient
from memspec_ros.ros.diagnostics import ERROR, OK, WARN
from memspec_ros.runtime import speculative
from memspec_ros.runtime.oracle import target_greedy

NEW = 24
EXECUTOR_POOL = "ThreadPoolExecutor"  # rclpy's MultiThreadedExecutor pool: grows lazily up to its num_threads
LOADER_THREAD = "memspec-draft-loader"  # one per draft cache (runtime/cache.py)


# -- the node and what it must not leak ---------------------------------------------------------------

def copy_of_the_tiny_zoo(base: Path) -> Path:
    return Path(shutil.copytree(tiny_zoo(), base / "zoo"))


@pytest.fixture(scope="module")
def zoo(tmp_path_factory):
    return copy_of_the_tiny_zoo(tmp_path_factory.mktemp("faults"))


@pytest.fixture(scope="module")
def h(zoo):
    with active_harness(zoo=zoo, name="memspec_faults") as harness:
        harness.calls = record(harness)
        run(harness)  # warm-up: drafts resident, executor threads started
        yield harness


def record(h) -> list[tuple[list[int], list[int]]]:
    """(prompt ids, output ids) of every generation of the node's controller, to check greedy losslessness."""
    controller = h.node.loaded.controller
    inner, calls = controller.generate, []

    def generate(prompt, *args, **kwargs):
        out = inner(prompt, *args, **kwargs)
        calls.append((list(prompt), list(out.token_ids)))
        return out

    controller.generate = generate
    return calls


def run(h, new: int = NEW, status=GoalStatus.STATUS_SUCCEEDED, **fields) -> Generate.Result:
    handle, _ = h.send(goal(max_new_tokens=new, **fields))
    assert handle.accepted, h.node.last_rejection
    response = h.result(handle)
    assert response.status == status, (response.status, response.result.error_message)
    return response.result


def assert_lossless(h) -> None:
    """Every generation recorded so far is the target's own greedy continuation."""
    target = h.node.loaded.target.model
    for prompt, out in h.calls:
        assert out == target_greedy(target, prompt, len(out)), "greedy output differs from the target's"
    h.calls.clear()


def status(h, task: str):
    return {s.name: s for s in h.node._diagnostics.collect()}[f"{h.name}: {task}"]


def reset_registry(h) -> None:
    """Set the registry again: what an operator does once a draft's files are fixed (failures forgotten)."""
    [ok] = h.set_params(**{"drafts.registry_file": h.get_param("drafts.registry_file")})
    assert ok.successful, ok.reason
    assert status(h, "draft cache").level != ERROR


def idle(h) -> None:
    """No goal running or queued, no draft load in flight."""
    wait_until(lambda: h.node._runner.counts() == (False, 0), 60.0, "the node to be idle")
    if h.node.loaded is not None:
        h.node.loaded.controller.cache.drain()


def resident_models(cache) -> list:
    """The modules of the resident drafts (a helper: a walrus in a comprehension would keep the last one alive
    in the caller's frame)."""
    models = [cache.peek(name) for name in cache.resident()]
    return [m.model for m in models if m is not None]


def own_threads() -> Counter:
    """Names of the process's threads, rclpy's executor pools left out (bounded by their size)."""
    return Counter(t.name for t in threading.enumerate() if not t.name.startswith(EXECUTOR_POOL))


@contextmanager
def no_leaks(h):
    """Around a fault and its recovery: the same threads before and after, every draft model loaded meanwhile
    that is not resident at the end garbage (weak references: what a leak is; the process's resident memory over
    one fault measured its allocator and test order, not a leak, and the soak bounds its growth over many goals)."""
    idle(h)
    gc.collect()
    threads = own_threads()
    loaded: list[weakref.ref] = []
    cache = h.node.loaded.controller.cache
    loader = cache.loader

    def recording_loader(name):
        model = loader(name)
        loaded.append(weakref.ref(model.model))
        return model

    cache.loader = recording_loader
    try:
        yield
    finally:
        cache.loader = loader
    idle(h)
    gc.collect()
    assert own_threads() == threads, (own_threads(), threads)
    pools = Counter(t.name.rsplit("_", 1)[0] for t in threading.enumerate() if t.name.startswith(EXECUTOR_POOL))
    assert all(n <= 4 for n in pools.values()), pools  # the harness's executor: num_threads=4
    resident = {id(model) for model in resident_models(cache)}
    assert all(ref() is None or id(ref()) in resident for ref in loaded), "a draft that left the cache is alive"



def fail_forward(monkeypatch, which, error: BaseException, times: int | None = None) -> None:
    """The engine's one forward raises ``error`` for the models ``which(model)`` selects (``times`` calls,
    None: every call): an out-of-memory error in the middle of decoding, as the engine meets it."""
    forward, left = speculative._forward, {"n": times}

    def failing(model, *args, **kwargs):
        if which(model) and (left["n"] is None or left["n"] > 0):
            if left["n"] is not None:
                left["n"] -= 1
            raise error
        return forward(model, *args, **kwargs)

    monkeypatch.setattr(speculative, "_forward", failing)


# -- draft files damaged between configure and use --------------------------------------------------------

def _damage(path: Path, how: str) -> None:
    data = path.read_bytes()
    if how == "deleted":
        path.unlink()
    elif how == "truncated":
        path.write_bytes(data[: len(data) // 2])
    elif how == "corrupted header":
        path.write_bytes(b"\xff" * 64 + data[64:])
    else:  # "corrupted weights": a valid header, every weight 0xff..ff (NaN in fp32 and fp16)
        header = 8 + int.from_bytes(data[:8], "little")
        path.write_bytes(data[:header] + b"\xff" * (len(data) - header))


@pytest.mark.parametrize("how, cause", [
    ("deleted", "no *.safetensors weights"), ("truncated", "safetensors"), ("corrupted header", "safetensors"),
    ("corrupted weights", "logits are not finite"),
])
def test_draft_files_damaged_between_configure_and_use(rclpy_context, tmp_path, how, cause):
    zoo = copy_of_the_tiny_zoo(tmp_path)
    node = Harness(rclpy_context, name="memspec_damaged", overrides=node_overrides(zoo))
    try:
        node.activate()  # configure reads the registry; no draft is loaded before the first goal
        node.calls = record(node)
        weights = {d.name: (d / "model.safetensors").read_bytes() for d in (zoo / "drafts").iterdir()}
        for name in weights:
            _damage(zoo / "drafts" / name / "model.safetensors", how)
        for _ in range(2):
            assert run(node).completion_tokens == NEW
        assert_lossless(node)
        message = status(node, "draft cache")
        assert message.level == ERROR and cause in message.message, message.message
        for name, data in weights.items():  # the files restored, the registry set again
            (zoo / "drafts" / name / "model.safetensors").write_bytes(data)
        reset_registry(node)
        used = {d for _ in range(3) for d in run(node).drafts_used}
        assert used, "the restored drafts serve again"
        assert_lossless(node)
        assert status(node, "draft cache").level != ERROR
    finally:
        node.close()


# -- faults on the loader thread, in forwards, in the predictor ------------------------------------------

@pytest.mark.parametrize("error", [RuntimeError("I/O error on the draft medium"), SystemExit(1)],
                         ids=lambda e: type(e).__name__)
def test_an_exception_on_the_loader_thread(h, error):
    with no_leaks(h):
        cache = h.node.loaded.controller.cache
        good = cache.loader

        def failing(name):
            raise error

        cache.reset()  # nothing resident: the next goal must load
        cache.loader = failing
        try:
            assert run(h).drafts_used == []
            assert_lossless(h)
            message = status(h, "draft cache")
            assert message.level == ERROR and type(error).__name__ in message.message, message.message
        finally:
            cache.loader = good
        reset_registry(h)
        assert all(run(h).completion_tokens == NEW for _ in range(3))
        assert_lossless(h)


def test_a_load_slower_than_a_whole_generation(h):
    """Every load after the first hangs until released: goals go on finishing on what is resident (memspec
    never waits for a prefetch), then the loads land."""
    with no_leaks(h):
        cache = h.node.loaded.controller.cache
        good, release, started = cache.loader, threading.Event(), []

        def slow(name):
            started.append(name)
            if len(started) > 1:
                release.wait(60.0)
            return good(name)

        assert all(r.successful for r in h.set_params(**{"memspec.capacity": 3, "memspec.interval": 1}))
        cache.reset()
        cache.loader = slow
        try:
            for _ in range(3):
                assert run(h).completion_tokens == NEW
            assert cache.loading(), "a prefetch should still be in flight"
            assert len(cache.resident()) == 1
            assert_lossless(h)
        finally:
            release.set()
            cache.drain()
            cache.loader = good
            assert all(r.successful for r in h.set_params(**{"memspec.capacity": 2, "memspec.interval": 4}))
        run(h)
        assert_lossless(h)


@pytest.mark.parametrize("error", [torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 1.50 GiB"),
                                   RuntimeError("DefaultCPUAllocator: can't allocate memory")],
                         ids=["cuda", "cpu"])
def test_out_of_memory_in_a_draft_forward_takes_the_draft_out_of_service(h, monkeypatch, error):
    with no_leaks(h):
        target = h.node.loaded.target.model
        with monkeypatch.context() as patch:
            fail_forward(patch, lambda m: m is not target, error)
            result = run(h)
            assert result.completion_tokens == NEW and list(result.drafts_used) == []
            assert_lossless(h)
            message = status(h, "draft cache")
            assert message.level == ERROR and "taken out of service" in message.message
            assert type(error).__name__ in message.message, message.message
        reset_registry(h)
        assert any(run(h).drafts_used for _ in range(3))
        assert_lossless(h)


def test_out_of_memory_in_the_target_aborts_that_goal_only(h, monkeypatch):
    with no_leaks(h):
        target = h.node.loaded.target.model
        with monkeypatch.context() as patch:
            fail_forward(patch, lambda m: m is target, torch.OutOfMemoryError("CUDA out of memory (target)"), times=1)
            result = run(h, status=GoalStatus.STATUS_ABORTED)
        assert result.finish_reason == Generate.Result.FINISH_ERROR and "OutOfMemoryError" in result.error_message
        message = status(h, "target model")
        assert message.level == ERROR and "the last goal failed: OutOfMemoryError" in message.message
        h.calls.clear()
        assert run(h).completion_tokens == NEW
        assert status(h, "target model").level == OK  # a goal succeeded: the error is history
        assert_lossless(h)


def test_a_predictor_that_raises_costs_speed_not_goals(h, monkeypatch):
    with no_leaks(h):
        ranker = h.node.loaded.predictor
        failures = ranker.failures
        with monkeypatch.context() as patch:
            patch.setattr(ranker.engine, "rank", lambda context: 1 / 0)
            result = run(h)
            assert result.completion_tokens == NEW and list(result.drafts_used)[:1] == ["general"]
        assert ranker.failures > failures
        message = status(h, "predictor")
        assert message.level == WARN and "ZeroDivisionError" in message.message, message.message
        run(h)
        assert_lossless(h)
        # a new activation starts with its own figures: the WARN held until the next configure
        try:
            assert h.transition(Transition.TRANSITION_DEACTIVATE) and h.transition(Transition.TRANSITION_ACTIVATE)
        finally:  # the module's later tests need the node active
            if h.node.lifecycle_state != "active":
                h.transition(Transition.TRANSITION_ACTIVATE)
        assert ranker.failures == 0 and status(h, "predictor").level == OK
        # its calls and mean time beside them count this activation too (they counted since configure)
        values = {kv.key: kv.value for kv in status(h, "predictor").values}
        assert ranker.engine.calls == 0 and values["calls"] == "0"


# -- the goal's surroundings: its client, the registry, the lifecycle -----------------------------------

def test_a_client_that_disappears_mid_goal(h):
    """The client's process goes (its context shut down) while its goal streams: the goal runs to its end
    with nobody to tell, and the node serves the next client."""
    with no_leaks(h):
        context = Context()
        rclpy.init(context=context)
        node = rclpy.create_node("vanishing_client", context=context)
        executor = SingleThreadedExecutor(context=context)
        executor.add_node(node)
        spinner = threading.Thread(target=executor.spin, daemon=True)
        spinner.start()
        client = SafeActionClient(node, Generate, "/memspec_faults/generate")
        feedback: list = []
        wait_until(client.server_is_ready, 30.0, "the action server")
        sent = client.send_goal_async(goal(max_new_tokens=3000), feedback_callback=feedback.append)
        wait_until(lambda: sent.done() and len(feedback) >= 2, 30.0, "the goal's feedback")
        executor.shutdown(timeout_sec=2.0)
        client.destroy()
        node.destroy_node()
        rclpy.try_shutdown(context=context)
        spinner.join(5.0)
        client = node = executor = sent = None  # the client's side is gone
        assert h.node._runner.counts()[0], "the goal ended before its client went: the scenario did not happen"
        idle(h)  # the orphaned goal ended
        assert all(run(h).completion_tokens == NEW for _ in range(2))
        assert_lossless(h)
        assert status(h, "target model").level == OK


def test_cache_remove_from_another_thread_mid_goal(h):
    with no_leaks(h):
        cache, stop, removed = h.node.loaded.controller.cache, threading.Event(), []

        def hammer():
            rng = random.Random(1)
            while not stop.is_set():
                name = rng.choice(["general", "code", "math"])
                cache.remove(name)
                removed.append(name)
                stop.wait(rng.uniform(0.0, 0.005))

        worker = threading.Thread(target=hammer, daemon=True)
        worker.start()
        try:
            for _ in range(3):
                assert run(h, new=200).completion_tokens == 200
        finally:
            stop.set()
            worker.join(10.0)
        assert removed
        assert_lossless(h)
        assert run(h).completion_tokens == NEW


def _held_prefetches(h) -> tuple[threading.Event, threading.Event]:
    """Loads after the first are held until ``release`` is set; ``started`` is set once one is held."""
    cache = h.node.loaded.controller.cache
    good, loads, started, release = cache.loader, [], threading.Event(), threading.Event()

    def held(name):
        loads.append(name)
        if len(loads) > 1:
            started.set()
            release.wait(60.0)
        return good(name)

    cache.loader = held
    return started, release


@pytest.mark.parametrize("during", ["generation", "prefetch"])
@pytest.mark.parametrize("transitions", [("deactivate", "cleanup"), ("shutdown",)], ids=lambda t: "+".join(t))
def test_lifecycle_transitions_during_a_generation_or_a_prefetch(rclpy_context, tmp_path, during, transitions):
    """Deactivate + cleanup, or shutdown, while a goal decodes or while a prefetch loads: the goal ends ABORTED
    with its partial text, the transitions complete (cleanup waits for the load in flight), every model and the
    loader thread are gone, and the node comes back (configure, activate) to serve goals."""
    ids = {"deactivate": Transition.TRANSITION_DEACTIVATE, "cleanup": Transition.TRANSITION_CLEANUP,
           "shutdown": Transition.TRANSITION_ACTIVE_SHUTDOWN}
    zoo = copy_of_the_tiny_zoo(tmp_path)
    node = Harness(rclpy_context, name="memspec_lifecycle_faults",
                   overrides=node_overrides(zoo, **{"memspec.capacity": 3, "memspec.interval": 1}))
    try:
        node.activate()
        node.calls = record(node)
        run(node)  # warm-up
        node.node.loaded.controller.cache.reset()
        gc.collect()
        threads = own_threads()
        prefetching, release = _held_prefetches(node)
        refs = [weakref.ref(node.node.loaded.target.model)]
        feedback: list = []
        handle, _ = node.send(goal(max_new_tokens=3000 if during == "generation" else 8), feedback)
        assert handle.accepted
        if during == "generation":
            wait_until(lambda: len(feedback) >= 2, 30.0, "the goal's feedback")
        else:
            assert node.result(handle).status == GoalStatus.STATUS_SUCCEEDED
            assert prefetching.wait(30.0) and node.node.loaded.controller.cache.loading()
        refs += [weakref.ref(model) for model in resident_models(node.node.loaded.controller.cache)]
        loaders = Counter(t.name for t in threading.enumerate() if t.name.startswith(LOADER_THREAD))
        assert loaders, "this node's loader thread runs"
        threading.Timer(1.0, release.set).start()  # the transitions begin with the load in flight; it lands later
        for transition in transitions:
            assert node.transition(ids[transition]), transition
        if during == "generation":
            response = node.result(handle, 30.0)
            assert response.status == GoalStatus.STATUS_ABORTED
            assert response.result.text and 0 < response.result.completion_tokens < 3000
        node.calls.clear()
        handle = response = None
        gc.collect()
        assert node.node.loaded is None and node.node.loaded_parameter_bytes() == 0
        assert all(ref() is None for ref in refs), "a model survived the transition"
        left = Counter(t.name for t in threading.enumerate() if t.name.startswith(LOADER_THREAD))
        assert sum(left.values()) == sum(loaders.values()) - 1, (left, loaders)  # this node's is gone
        if transitions == ("shutdown",):
            assert node.state() == "finalized"
            return
        node.activate()
        node.calls = record(node)
        assert all(run(node).completion_tokens == NEW for _ in range(2))
        assert_lossless(node)
        idle(node)
        gc.collect()
        assert own_threads() == threads, (own_threads(), threads)
    finally:
        node.close()


def test_a_goal_whose_cancel_lands_inside_rclpys_execute_still_gets_its_execute_callback():
    """rclpy's ServerGoalHandle.execute reads is_cancel_requested, then applies EXECUTE: a cancel accepted in
    between makes EXECUTE invalid from CANCELING and execute() raises. At the next queued goal's start that left the
    finished goal's result unsent and every later goal queued forever; the callback is scheduled all the same."""
    import types

    from memspec_ros.ros.goal_runner import GoalRunner, RCLError

    scheduled = []

    class CancelledMeanwhile:
        is_cancel_requested = True

        def execute(self, callback=None):
            raise RCLError("goal_handle attempted invalid transition from state CANCELING with event EXECUTE")

    server = types.SimpleNamespace(notify_execute=lambda handle, callback: scheduled.append((handle, callback)))
    runner = types.SimpleNamespace(server=server)
    handle, callback = CancelledMeanwhile(), object()
    GoalRunner._execute(runner, handle, callback)
    assert scheduled == [(handle, callback)]
    # a refusal with no cancel behind it is not this race: it is not hidden
    handle.is_cancel_requested = False
    with pytest.raises(RCLError):
        GoalRunner._execute(runner, handle, callback)
    assert len(scheduled) == 1
