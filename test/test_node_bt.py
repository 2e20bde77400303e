# ruff: noqa: E402 - the ROS imports follow require_ros()
"""The py_trees client against the real node: success with the text on the blackboard, and
FAILURE for each way a goal can fail (rejected, aborted, cancelled by preemption, no server)."""

from __future__ import annotations

import re
import time

import pytest
from node_helpers import active_harness
from ros_helpers import require_ros, wait_until

require_ros()

import py_trees
from action_msgs.msg import GoalStatus
from lifecycle_msgs.msg import Transition
from py_trees.common import Status

from memspec_ros.ros.bt_example import Generate, create_example_tree


@pytest.fixture(scope="module")
def h():
    with active_harness(name="memspec_bt") as harness:
        yield harness


@pytest.fixture(autouse=True)
def clean_blackboard():
    py_trees.blackboard.Blackboard.enable_activity_stream(0)
    yield
    py_trees.blackboard.Blackboard.clear()


def behaviour(h, prompt="def add(a, b):", **kwargs) -> Generate:
    b = Generate("generate", h.client, prompt, action_name="/memspec_bt/generate", **kwargs)
    b.setup()
    return b


def tick_until_done(b, timeout=60.0) -> Status:
    deadline = time.monotonic() + timeout
    while True:
        b.tick_once()
        if b.status != Status.RUNNING:
            return b.status
        assert time.monotonic() < deadline, "behaviour still RUNNING"
        time.sleep(0.01)  # the harness spins the client node in its own thread


def test_success_writes_the_text_to_the_blackboard(h):
    b = behaviour(h, max_new_tokens=16)
    assert tick_until_done(b) == Status.SUCCESS
    assert b.outcome == "succeeded" and b.result.completion_tokens == 16
    assert py_trees.blackboard.Blackboard.get("/generated_text") == b.result.text


def test_rejection_is_a_failure(h):
    b = behaviour(h, prompt="", messages=[("user", "hi")])  # the tiny target has no chat template: rejected
    assert tick_until_done(b) == Status.FAILURE
    assert b.outcome == "rejected"


def test_abort_is_a_failure_with_the_reason(h):
    b = behaviour(h, max_new_tokens=3000)
    b.tick_once()
    wait_until(lambda: (b.tick_once(), b.streamed)[1], 30.0, "the goal to stream")
    assert h.transition(Transition.TRANSITION_DEACTIVATE)
    try:
        assert tick_until_done(b) == Status.FAILURE
        assert b.outcome == "aborted" and "deactivated" in b.feedback_message
        assert b.result.text  # the partial text
    finally:
        assert h.transition(Transition.TRANSITION_ACTIVATE)


def test_preemption_cancels_the_goal(h):
    b = behaviour(h, max_new_tokens=3000)
    wait_until(lambda: (b.tick_once(), b.streamed)[1], 30.0, "the goal to stream")
    b.stop(Status.INVALID)  # what a parent does when a higher-priority branch takes over
    assert b.outcome == "canceled"
    response = h.result(b.goal_handle, 30.0)
    assert response.status == GoalStatus.STATUS_CANCELED and response.result.text


def test_preemption_before_the_goal_is_seen_accepted_cancels_it_when_it_is(h):
    """Preempted in the tick that sent the goal: its acceptance is not in yet, and the goal, once accepted, would run
    to its end holding the node's one generation. It is cancelled when the answer comes."""
    import threading

    answer = threading.Event()
    server = h.node._action_server
    on_goal = server._goal_callback  # the harness's own (it times the node's goal callback): put back afterwards

    def held_on_goal(request):  # the node answers only once the behaviour has been preempted
        answer.wait(30.0)
        return on_goal(request)

    server.register_goal_callback(held_on_goal)
    try:
        b = behaviour(h, max_new_tokens=3000)
        b.tick_once()  # sends the goal; the answer comes on the harness's executor thread, once released
        assert b.goal_future is not None and not b.goal_future.done()
        b.stop(Status.INVALID)
        assert b.outcome == "canceled"
    finally:
        answer.set()
        server.register_goal_callback(on_goal)
    handle = h.wait(b.goal_future, 10.0, "the goal response")
    assert handle.accepted
    response = h.result(handle, 30.0)
    assert response.status == GoalStatus.STATUS_CANCELED
    assert response.result.completion_tokens < 3000


@pytest.mark.parametrize("how, code", [("ctrl-c", 130), ("sigterm", 143)])
def test_ctrl_c_in_the_example_cancels_the_goal_in_flight(h, monkeypatch, capsys, how, code):
    """bt_example's main() on Ctrl-C while its goal runs: the KeyboardInterrupt went straight out, nothing preempted
    the tree, and the accepted goal ran on to max_new_tokens holding the node's one generation. The interrupt is
    forced into the example's spin while the node runs the goal. SIGTERM (a `timeout`, a CI kill) ended the example
    at once, its goal running on: it cancels as Ctrl-C does, exit status 128 + 15."""
    import os
    import signal

    import rclpy.executors

    from memspec_ros.ros import bt_example, goal_runner

    settled = []
    settle = goal_runner.settle

    def recording_settle(goal_handle, finish_reason):
        settled.append(finish_reason)
        settle(goal_handle, finish_reason)

    class InterruptedWhileTheGoalRuns(rclpy.executors.SingleThreadedExecutor):
        interrupted = False

        def spin_once(self, timeout_sec=None):
            if not InterruptedWhileTheGoalRuns.interrupted and h.node._runner.counts()[0]:
                InterruptedWhileTheGoalRuns.interrupted = True
                if how == "sigterm":
                    os.kill(os.getpid(), signal.SIGTERM)  # its handler raises here, in this thread
                else:
                    raise KeyboardInterrupt
            super().spin_once(timeout_sec=timeout_sec)

    create_tree = bt_example.create_example_tree

    def patient_tree(*args, **kwargs):
        tree = create_tree(*args, **kwargs)
        tree.root.children[0].server_timeout = 30.0  # a fresh participant's discovery, on a busy machine
        return tree

    monkeypatch.setattr(goal_runner, "settle", recording_settle)
    monkeypatch.setattr(rclpy.executors, "SingleThreadedExecutor", InterruptedWhileTheGoalRuns)
    monkeypatch.setattr(bt_example, "create_example_tree", patient_tree)

    class NotHandled(Exception):
        pass

    def not_handled(signum, frame):  # where main() installed no handler: a failure, not the end of the test run
        raise NotHandled(signum)

    assert h.node._runner.wait_idle(10.0)
    before = signal.signal(signal.SIGTERM, not_handled)
    try:
        assert all(r.successful for r in h.set_params(**{"generation.max_new_tokens": 3000}))  # runs for seconds
        exit_code = bt_example.main(["def add(a, b):", "--node", "/memspec_bt", "--raw"])
    except KeyboardInterrupt:  # not pytest's to take: the session would end here
        pytest.fail("Ctrl-C went out of main() and left the goal running")
    finally:
        restored = signal.signal(signal.SIGTERM, before)  # first: nothing below may leave the test's handler
        h.set_params(**{"generation.max_new_tokens": 128})
    assert exit_code == code and InterruptedWhileTheGoalRuns.interrupted
    assert restored is not_handled  # main() put back the handler it found
    assert "interrupted: cancelling the goal" in capsys.readouterr().err
    assert h.node._runner.wait_idle(30.0)
    assert settled == [goal_runner.CANCELLED]  # not run on to its 3000 tokens


def test_missing_server_fails_after_the_timeout(h):
    b = Generate("generate", h.client, "hi", action_name="/nobody/generate", server_timeout=0.3)
    b.setup()
    assert tick_until_done(b, 5.0) == Status.FAILURE
    assert b.outcome == "no-server"


class _Handle:
    """A goal handle as SafeActionClient's future gives it: accepted, a result that never comes, a cancel."""

    def __init__(self):
        from rclpy.task import Future

        self.accepted, self.result_future, self.cancels = True, Future(), 0

    def get_result_async(self):
        return self.result_future

    def cancel_goal_async(self):
        from rclpy.task import Future

        self.cancels += 1
        return Future()


class _Client:
    """The action client a Generate holds, with a server whose presence and answers the test decides."""

    def __init__(self):
        from rclpy.task import Future

        self.ready, self.goal_future = True, Future()

    def server_is_ready(self):
        return self.ready

    def send_goal_async(self, goal, feedback_callback=None):
        self.feedback_callback = feedback_callback
        return self.goal_future


def _faked(client, **kwargs) -> Generate:
    b = Generate("generate", None, "hi", **kwargs)
    b.client = client  # setup() would make a real one
    return b


def test_a_goal_the_node_never_answers_fails_after_the_server_timeout_and_is_cancelled_if_it_lands():
    """Once sent, a goal whose acknowledgement was lost left the behaviour RUNNING for ever: the Selector never
    reached the canned reply (BehaviorTree.ROS2 fails with SEND_GOAL_TIMEOUT)."""
    client = _Client()
    b = _faked(client, server_timeout=0.2)
    assert tick_until_done(b, 5.0) == Status.FAILURE
    assert b.outcome == "send-goal-timeout" and "did not answer the goal within 0.2 s" in b.feedback_message
    late = _Handle()
    client.goal_future.set_result(late)  # the answer after all: that goal would hold the node's one generation
    assert late.cancels == 1


def test_a_goal_whose_server_went_away_fails_and_one_past_its_result_timeout_is_cancelled():
    """The node died mid-goal (no result will come): the behaviour stayed RUNNING for ever. A result timeout, when
    given, cancels the goal and fails."""
    client = _Client()
    handle = _Handle()
    client.goal_future.set_result(handle)
    b = _faked(client, server_timeout=0.2)
    b.tick_once()
    assert b.status == Status.RUNNING  # accepted, running
    client.ready = False
    assert tick_until_done(b, 5.0) == Status.FAILURE and b.outcome == "server-gone"
    client.ready = True
    b = _faked(client, server_timeout=0.2, result_timeout=0.3)
    assert tick_until_done(b, 5.0) == Status.FAILURE and b.outcome == "result-timeout"
    assert handle.cancels == 1 and "goal cancelled" in b.feedback_message
    b = _faked(client, server_timeout=0.2)  # no result timeout, the server there: it waits
    for _ in range(30):
        b.tick_once()
        time.sleep(0.01)
    assert b.status == Status.RUNNING and handle.cancels == 1


def test_a_server_that_restarted_mid_goal_is_asked_again_and_its_unknown_goal_fails_the_behaviour(monkeypatch):
    """The server went away and came back (respawned) within server_timeout: the result request went to the old
    one, the new one never got it, and with no result timeout the behaviour stayed RUNNING for ever. Asked again,
    a server that does not know the goal answers STATUS_UNKNOWN, which read as "canceled"."""
    from action_msgs.msg import GoalStatus

    from memspec_interfaces.action import Generate as GenerateAction

    client = _Client()
    handle = _Handle()
    asked = []
    handle.get_result_async = lambda: asked.append(1) or handle.result_future
    client.goal_future.set_result(handle)
    b = _faked(client, server_timeout=5.0)
    b.tick_once()
    assert b.status == Status.RUNNING and len(asked) == 1
    client.ready = False
    b.tick_once()
    client.ready = True  # back before server_timeout
    b.tick_once()
    assert len(asked) == 2  # asked the server that is there now
    # a respawn that never looked gone: asked again every server_timeout all the same (RESULT_ASKED_AGAIN_SECONDS
    # at the least, here made as short)
    from memspec_ros.ros import client as memspec_client

    monkeypatch.setattr(memspec_client, "RESULT_ASKED_AGAIN_SECONDS", 0.05)
    b.server_timeout = 0.05
    time.sleep(0.1)
    b.tick_once()
    assert len(asked) == 3
    response = GenerateAction.Impl.GetResultService.Response(status=GoalStatus.STATUS_UNKNOWN)
    handle.result_future.set_result(response)
    b.tick_once()
    assert b.status == Status.FAILURE and b.outcome == "server-gone"
    assert "no longer knows the goal" in b.feedback_message


def test_a_preempted_goals_late_feedback_and_cancel_do_not_write_into_the_next_run():
    """The feedback and cancel callbacks were bound to the behaviour itself: after a preemption and a re-tick, the
    cancelled goal's late feedback was appended to the new run's streamed text, and its cancel's answer became the
    new run's cancel_future (goal_settled then read the old goal's cancel as the new one's)."""
    import types

    from rclpy.task import Future

    client = _Client()
    first_goal = client.goal_future
    b = _faked(client, server_timeout=5.0)
    b.tick_once()  # sent, not yet seen accepted
    first_feedback = client.feedback_callback
    b.stop(Status.INVALID)  # preempted: its goal is cancelled once the answer comes
    client.goal_future = Future()
    b.tick_once()  # the next run sends its own goal
    assert b.goal_future is client.goal_future and b.status == Status.RUNNING
    first_feedback(types.SimpleNamespace(feedback=types.SimpleNamespace(delta_text="stale", tokens_so_far=1,
                                                                        active_draft="")))
    assert b.streamed == ""
    handle = _Handle()
    first_goal.set_result(handle)  # the first goal's answer after all: accepted
    assert handle.cancels == 1 and b.cancel_future is None  # cancelled, and not taken for the new run's cancel


def test_a_behaviour_that_failed_keeps_its_outcome_when_its_parent_stops_it():
    """A parent stops every child (Composite.stop(INVALID)): a Generate that had failed with send-goal-timeout or
    result-timeout cancelled its goal a second time and took "canceled" for its outcome, erasing the diagnosis."""
    client = _Client()
    b = _faked(client, server_timeout=0.2)
    assert tick_until_done(b, 5.0) == Status.FAILURE and b.outcome == "send-goal-timeout"
    b.stop(Status.INVALID)
    assert b.outcome == "send-goal-timeout"
    late = _Handle()
    client.goal_future.set_result(late)
    assert late.cancels == 1  # once, by the timeout's own callback
    client = _Client()
    handle = _Handle()
    client.goal_future.set_result(handle)
    b = _faked(client, server_timeout=5.0, result_timeout=0.2)
    assert tick_until_done(b, 5.0) == Status.FAILURE and b.outcome == "result-timeout"
    b.stop(Status.INVALID)
    assert b.outcome == "result-timeout" and handle.cancels == 1


def test_a_rerun_interrupted_in_its_first_tick_still_cancels_its_goal():
    """The guard that keeps a finished run's outcome read the status, which py_trees sets only after update()
    returns: a re-run of a behaviour that had failed, interrupted right after it sent its goal, read FAILURE and
    left the new goal uncancelled."""
    from rclpy.task import Future

    client = _Client()
    b = _faked(client, server_timeout=0.2)
    assert tick_until_done(b, 5.0) == Status.FAILURE and b.outcome == "send-goal-timeout"
    client.goal_future = Future()
    b.initialise()
    b.update()  # the re-run's first tick sends its goal; Ctrl-C lands before py_trees records RUNNING
    assert b.status == Status.FAILURE and b.goal_future is client.goal_future
    b.stop(Status.INVALID)
    handle = _Handle()
    client.goal_future.set_result(handle)  # accepted after all
    assert handle.cancels == 1


def test_a_tree_that_ended_on_a_timeout_is_settled_before_the_example_leaves():
    """The example returned as soon as the tree ended: the cancel of a goal that failed by a timeout went out with
    no spin to deliver its answer (or, for a goal never seen accepted, to run the callback that cancels it), so the
    goal ran on to max_new_tokens holding the node's one generation. settle() spins until it is answered."""
    from rclpy.task import Future

    from memspec_ros.ros.bt_example import settle

    client = _Client()
    handle = _Handle()
    cancel = Future()
    handle.cancel_goal_async = lambda: cancel
    client.goal_future.set_result(handle)
    b = _faked(client, server_timeout=5.0, result_timeout=0.2)
    tree = py_trees.trees.BehaviourTree(b)
    while tree.root.status != Status.FAILURE:
        tree.tick()
        time.sleep(0.01)
    spins = []

    def spin_once():  # the node answers the cancel on the third spin
        spins.append(1)
        if len(spins) == 3:
            cancel.set_result(object())

    assert not b.goal_settled()
    assert settle(tree, spin_once, 5.0) and len(spins) == 3 and b.goal_settled()
    # a server gone mid-goal holds nothing any more: no wait for a cancel never sent
    client = _Client()
    client.goal_future.set_result(_Handle())
    gone = _faked(client, server_timeout=0.1)
    gone.tick_once()
    client.ready = False
    assert tick_until_done(gone, 5.0) == Status.FAILURE and gone.outcome == "server-gone"
    assert settle(py_trees.trees.BehaviourTree(gone), lambda: pytest.fail("waited"), 5.0)


def test_the_example_refuses_a_bad_node_name_before_starting_ros(capsys):
    """A space in --node ended the example in a traceback from the action client, inside tree.setup()."""
    from memspec_ros.ros import bt_example

    with pytest.raises(SystemExit) as exit_info:
        bt_example.main(["hi", "--node", "/my node"])
    assert exit_info.value.code == 2 and "is no valid node name" in capsys.readouterr().err


def test_the_example_takes_ros_arguments_and_its_timeouts_as_flags(monkeypatch):
    """--ros-args (the README's enclave for the BT, a namespace remap) failed argparse with 'unrecognized
    arguments'; the server timeout (1 s, shorter than discovery can take) had no flag."""
    from memspec_ros.ros import bt_example

    seen = {}

    def stop_at_the_tree(node, prompt, action_name, **fields):
        seen.update(fields, action_name=action_name)
        raise SystemExit(0)

    monkeypatch.setattr(bt_example, "create_example_tree", stop_at_the_tree)
    with pytest.raises(SystemExit):
        bt_example.main(["hi", "--node", "/robot/memspec", "--server-timeout", "2.5", "--result-timeout", "60",
                         "--ros-args", "-r", "__ns:=/robot"])
    assert seen == {"raw": False, "server_timeout": 2.5, "result_timeout": 60.0,
                    "action_name": "/robot/memspec/generate"}
    assert bt_example.SERVER_TIMEOUT >= 5.0


def test_example_tree_falls_back_to_the_canned_reply(h):
    # rejected: messages, and the tiny target has no chat template
    tree = create_example_tree(h.client, "", action_name="/memspec_bt/generate", messages=[("user", "hi")])
    deadline = time.monotonic() + 10.0
    while True:
        tree.tick()
        if tree.root.status != Status.RUNNING or time.monotonic() > deadline:
            break
        time.sleep(0.01)
    assert tree.root.status == Status.SUCCESS
    assert tree.root.children[0].status == Status.FAILURE and tree.root.children[1].status == Status.SUCCESS


@pytest.mark.parametrize("value, says", [(None, "has no '/question'"), (42, "is a int, not text"),
                                         (" \n", "holds no text"), ("a\0b", "holds a NUL character at position 1")])
def test_a_prompt_key_without_text_fails_the_behaviour_not_the_tick(h, value, says):
    """A prompt_key never written raised KeyError out of tree.tick(), ending the robot's tree loop; one holding no
    text went out as the goal's prompt and broke the message; a blank one was sent, and rejected."""
    if value is not None:
        writer = py_trees.blackboard.Client(name="writer")
        writer.register_key("/question", access=py_trees.common.Access.WRITE)
        writer.set("/question", value)
    b = behaviour(h, prompt="", prompt_key="/question")
    assert tick_until_done(b) == Status.FAILURE
    assert b.outcome == "no-prompt" and says in b.feedback_message
    writer = py_trees.blackboard.Client(name="writer2")
    writer.register_key("/question", access=py_trees.common.Access.WRITE)
    writer.set("/question", "def add(a, b):")
    b = behaviour(h, prompt="", prompt_key="/question", max_new_tokens=4)
    assert tick_until_done(b) == Status.SUCCESS


@pytest.mark.parametrize("kwargs, words", [
    ({}, "the prompt is empty and there are no messages"),
    ({"prompt": " \n"}, "the prompt is only whitespace"),
    ({"messages": [("user", "hi")], "raw": True}, "raw is set but messages are given"),
    ({"messages": [("user", "hi"), ("assistant", "hello")]}, "the last message is from the assistant"),
    ({"messages": [("robot", "hi")]}, "unknown role 'robot'"),
    ({"prompt": "hi", "max_new_tokens": -1}, "max_new_tokens -1 is outside 0.."),
    ({"prompt": "hi", "max_new_tokens": 2**32}, "is outside 0..4294967295"),
    ({"prompt": "turn left\0 and stop"}, "the prompt: the text holds a NUL character at position 9"),
    ({"messages": [("user", "turn left\0 and stop")]}, "messages[0]: the text holds a NUL character at position 9"),
])
def test_a_behaviour_whose_every_goal_the_node_would_reject_is_refused_when_built(kwargs, words):
    """An empty prompt went out at every tick, a goal the node rejects at every tick said only "see its log", and a
    max_new_tokens out of uint32 raised out of tree.tick(): each is refused when the behaviour is built."""
    with pytest.raises(ValueError, match=re.escape(words)):
        Generate("generate", None, **kwargs)


def test_a_behaviour_with_a_prompt_key_is_built_before_its_prompt_is_written():
    b = Generate("generate", None, prompt_key="/later", max_new_tokens=4)
    assert b.prompt == "" and b.prompt_key == "/later"
    Generate("generate", None, prompt=" ", prompt_key="/later")  # prompt_key's text is sent: the prompt is unused


def test_a_behaviour_given_both_messages_and_a_prompt_is_refused_when_built():
    """Messages beside a prompt or prompt_key went out together in every goal, which the node always rejects."""
    for prompt, key in (("hi", ""), ("", "/question")):
        with pytest.raises(ValueError, match="give messages .* or a prompt / prompt_key .* not both"):
            Generate("generate", None, prompt, prompt_key=key, messages=[("user", "hello")])
