"""Shared pieces of the memspec_node tests: a tiny zoo on disk and a harness that runs the node
in-process in its own MultiThreadedExecutor thread, driven from a client node only through the
node's ROS interfaces (lifecycle_msgs services, rcl_interfaces SetParameters, the Generate action,
topics), over DDS on loopback.

Importing this module never imports rclpy (tests call require_ros() first).
"""

from __future__ import annotations

import atexit
import shutil
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from ros_helpers import wait_until

TIMEOUT = 30.0
_ZOO: Path | None = None
_ZOO_LOCK = threading.Lock()


def _scratch_zoo_dir(prefix: str) -> Path:
    """A folder for one process's tiny zoo, removed when the process exits (each test process left its zoos in
    /tmp: hundreds of MB after a few runs on a persistent CI runner)."""
    path = Path(tempfile.mkdtemp(prefix=prefix))
    atexit.register(shutil.rmtree, path, ignore_errors=True)
    return path

# A test's long goal (thousands of tokens on the tiny zoo, ended by a cancel, a deactivate or a timeout) must still
# run while the test checks what it does beside it. Its length alone made that a speed: a CPU twice as fast
# finished it first. Each of its iterations is paced instead (conftest.py, for the test_node_* modules), so it lasts
# at least PACE_SECONDS per iteration on any machine (a slower one only makes it longer); short goals are not
# touched. test_soak.py paces the soak's long goals the same way; `memspec-bench soak` itself is never paced.
PACED_FROM = 1000  # new tokens
PACE_SECONDS = 0.01


def paced_step(step):
    """SpeculativeSession.step, paced for long goals."""

    def paced(self, *args, **kwargs):
        if self.max_new_tokens >= PACED_FROM:
            time.sleep(PACE_SECONDS)
        return step(self, *args, **kwargs)

    return paced


def pace_long_goals(monkeypatch) -> None:
    from memspec_ros.runtime.speculative import SpeculativeSession

    monkeypatch.setattr(SpeculativeSession, "step", paced_step(SpeculativeSession.step))


def tiny_zoo() -> Path:
    """Built once per test process (about 2 s): target 64x2, drafts general/code/math, a predictor."""
    global _ZOO
    with _ZOO_LOCK:
        if _ZOO is None:
            from memspec_ros.testing.tiny_zoo import build_tiny_zoo

            _ZOO = build_tiny_zoo(_scratch_zoo_dir("memspec_test_zoo_"), hidden=64, layers=2,
                                  draft_layers=2)
        return _ZOO


_CHAT_ZOO: Path | None = None


def tiny_chat_zoo() -> Path:
    """Like tiny_zoo(), with an instruct model's tokenizer: a ChatML-like chat template, <|im_start|> and
    <|im_end|>, and <|im_end|> as the target's generation_config eos_token_id (the tokenizer has no eos)."""
    global _CHAT_ZOO
    with _ZOO_LOCK:
        if _CHAT_ZOO is None:
            from memspec_ros.testing.tiny_zoo import build_tiny_zoo

            _CHAT_ZOO = build_tiny_zoo(_scratch_zoo_dir("memspec_test_chat_zoo_"), hidden=64, layers=2,
                                       draft_layers=2, chat=True)
        return _CHAT_ZOO


# The tests' baseline: every iteration runs the scheduled draft at a fixed gamma, so what a test asserts about drafts,
# switches and fallbacks does not hinge on adaptive gamma skipping a tiny random draft that never pays, or on copies
# taking iterations from it. The node's own defaults (drafts int4, adaptive gamma, context lookup) have their own
# test (test_node_forward_paths.py) and are what test_node_process.py runs.
TEST_BASELINE = {"drafts.quantization": "none", "memspec.adaptive_gamma": False, "memspec.context_lookup": False}


def node_overrides(zoo: Path, baseline: bool = True, **extra) -> dict:
    """The zoo and one thread, plus TEST_BASELINE unless ``baseline`` is false (the node's declared defaults)."""
    values = {"drafts.registry_file": str(zoo / "registry.yaml"), "model.threads": 1,
              **(TEST_BASELINE if baseline else {})}
    values.update(extra)
    return values


class Harness:
    """The node under test plus a client node, both spinning in one background executor thread."""

    def __init__(self, context, name: str = "memspec", overrides: dict | None = None) -> None:
        import rclpy
        import torch
        from rcl_interfaces.srv import GetParameters, SetParameters
        from rclpy.executors import MultiThreadedExecutor
        from rclpy.parameter import Parameter

        from memspec_interfaces.action import Generate
        from memspec_ros.ros.action_client import SafeActionClient
        from memspec_ros.ros.lifecycle_client import LifecycleClient
        from memspec_ros.ros.node import MemSpecNode

        self._torch_threads = torch.get_num_threads()  # model.threads changes it process-wide: restored in close()
        self.name = name
        params = [Parameter(k, value=v) for k, v in (overrides or {}).items()]
        self.node = MemSpecNode(name, context=context, parameter_overrides=params)
        self.client = rclpy.create_node(f"{name}_test_client", context=context)
        # watch the goal callback on the server side (the node's action server exists from its construction): its
        # time, printed by tests (the latency bound is `memspec-bench soak`'s verdict, not a unit test's), and
        # whether a goal was running both when it began and when it answered: an answer that waited for the
        # running generation could not have come while it still ran
        self.goal_callback_seconds: list[float] = []
        self.goal_callback_beside_a_goal: list[bool] = []
        on_goal, runner = self.node._on_goal, self.node._runner

        def timed_on_goal(request):
            t0 = time.perf_counter()
            running = runner.counts()[0]
            try:
                return on_goal(request)
            finally:
                self.goal_callback_seconds.append(time.perf_counter() - t0)
                self.goal_callback_beside_a_goal.append(running and runner.counts()[0])

        self.node._action_server.register_goal_callback(timed_on_goal)
        self.executor = MultiThreadedExecutor(num_threads=4, context=context)
        self.executor.add_node(self.node)
        self.executor.add_node(self.client)
        self._thread = threading.Thread(target=self.executor.spin, daemon=True)
        self._thread.start()
        self.action = SafeActionClient(self.client, Generate, f"/{name}/generate")  # ros2/rclpy#1123
        self.lifecycle = LifecycleClient(self.client, f"/{name}", time.sleep)  # the executor thread spins
        self.set_params_client = self.client.create_client(SetParameters, f"/{name}/set_parameters")
        self.get_params_client = self.client.create_client(GetParameters, f"/{name}/get_parameters")

    # -- plumbing ------------------------------------------------------------------------------
    @staticmethod
    def wait(future, timeout: float = TIMEOUT, what: str = "the future"):
        wait_until(future.done, timeout, what)
        return future.result()

    def call(self, client, request, timeout: float = TIMEOUT):
        wait_until(client.service_is_ready, timeout, f"service {client.srv_name}")
        return self.wait(client.call_async(request), timeout, f"the answer of {client.srv_name}")

    # -- lifecycle -----------------------------------------------------------------------------
    def transition(self, transition_id: int, timeout: float = 60.0) -> bool:
        return self.lifecycle.change_state(transition_id, timeout)

    def state(self) -> str:
        return self.lifecycle.state(TIMEOUT)

    def activate(self) -> None:
        from lifecycle_msgs.msg import Transition

        assert self.transition(Transition.TRANSITION_CONFIGURE), "configure failed"
        assert self.transition(Transition.TRANSITION_ACTIVATE), "activate failed"

    # -- parameters ----------------------------------------------------------------------------
    def set_params(self, **values):
        from rcl_interfaces.srv import SetParameters
        from rclpy.parameter import Parameter

        request = SetParameters.Request(
            parameters=[Parameter(k, value=v).to_parameter_msg() for k, v in values.items()]
        )
        return self.call(self.set_params_client, request).results

    def set_params_atomically(self, **values):
        from rcl_interfaces.srv import SetParametersAtomically
        from rclpy.parameter import Parameter

        client = self.client.create_client(SetParametersAtomically, f"/{self.name}/set_parameters_atomically")
        try:
            request = SetParametersAtomically.Request(
                parameters=[Parameter(k, value=v).to_parameter_msg() for k, v in values.items()])
            return self.call(client, request).result
        finally:
            self.client.destroy_client(client)

    def get_param(self, name: str):
        from rcl_interfaces.srv import GetParameters
        from rclpy.parameter import parameter_value_to_python

        values = self.call(self.get_params_client, GetParameters.Request(names=[name])).values
        return parameter_value_to_python(values[0])

    # -- the action ----------------------------------------------------------------------------
    def send(self, goal, feedback: list | None = None):
        """Send a goal; returns (goal handle, seconds until the accept/reject answer)."""
        wait_until(self.action.server_is_ready, TIMEOUT, "the Generate action server")
        t0 = time.perf_counter()
        future = self.action.send_goal_async(
            goal, feedback_callback=(lambda m: feedback.append(m.feedback)) if feedback is not None else None)
        handle = self.wait(future, TIMEOUT, "the goal response")
        return handle, time.perf_counter() - t0

    def result(self, handle, timeout: float = 120.0):
        return self.wait(handle.get_result_async(), timeout, "the goal result")

    def close(self) -> None:
        import torch

        self.executor.shutdown(timeout_sec=5.0)
        self.node.destroy_node()
        self.client.destroy_node()
        torch.set_num_threads(self._torch_threads)


@contextmanager
def active_harness(zoo: Path | None = None, **kwargs) -> Iterator[Harness]:
    """A node on the tiny zoo (or ``zoo``), activated in its own rclpy context; torn down afterwards."""
    import rclpy
    from rclpy.context import Context

    context = Context()
    rclpy.init(context=context)
    harness = Harness(context, overrides=node_overrides(zoo or tiny_zoo()), **kwargs)
    harness.activate()
    try:
        yield harness
    finally:
        harness.close()
        rclpy.try_shutdown(context=context)


def goal(prompt: str = "def add(a, b):", max_new_tokens: int = 24, **kwargs):
    from memspec_interfaces.action import Generate

    return Generate.Goal(prompt=prompt, max_new_tokens=max_new_tokens, temperature=0.0, **kwargs)


@contextmanager
def prompt_tokenizations() -> Iterator[list[int]]:
    """The goal callback's prompt tokenizations (goal_runner.prompt_ids calls) while the block runs: a prompt too
    long to take is to be refused by its character count, before any tokenizer work."""
    from memspec_ros.ros import goal_runner

    calls: list[int] = []
    real = goal_runner.prompt_ids

    def counted(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    goal_runner.prompt_ids = counted
    try:
        yield calls
    finally:
        goal_runner.prompt_ids = real
