# ruff: noqa: E402 - the ROS imports follow require_ros()
"""The Generate action server of memspec_node over DDS: feedback and results with statistics,
cancel mid-generation, every rejection path answered fast while a goal runs, deactivate during a
goal, and ~/generation_stats per finished goal."""

from __future__ import annotations

import io
import statistics
import time

import pytest
from node_helpers import active_harness, goal, prompt_tokenizations
from ros_helpers import require_ros, wait_until

require_ros()

from action_msgs.msg import GoalStatus
from lifecycle_msgs.msg import Transition
from rclpy.qos import QoSProfile

from memspec_interfaces.action import Generate
from memspec_interfaces.msg import GenerationStats
from memspec_ros.ros.action_client import SafeActionClient
from memspec_ros.ros.diagnostics import Status, fill_throughput_status

LONG = 3000  # tokens: a goal that runs for seconds (paced: node_helpers.PACED_FROM) until the test ends it


@pytest.fixture(scope="module")
def h():
    with active_harness() as harness:
        stats: list[GenerationStats] = []
        harness.client.create_subscription(GenerationStats, "/memspec/generation_stats", stats.append, 10)
        harness.stats = stats
        yield harness


def visible(text: str) -> str:
    """The random tiny models emit invalid UTF-8; the runtime's incremental decode may render those
    bytes with a different number of U+FFFD than the final decode, so compare without them."""
    return text.replace("\ufffd", "")


def start_long_goal(h, feedback):
    handle, _ = h.send(goal(max_new_tokens=LONG), feedback)
    assert handle.accepted
    wait_until(lambda: len(feedback) >= 2, 30.0, "the long goal's feedback")
    return handle


def test_goal_streams_feedback_and_the_result_carries_the_statistics(h):
    feedback: list[Generate.Feedback] = []
    handle, _ = h.send(goal(max_new_tokens=48), feedback)
    assert handle.accepted
    response = h.result(handle)
    result = response.result
    assert response.status == GoalStatus.STATUS_SUCCEEDED
    assert result.finish_reason == Generate.Result.FINISH_LENGTH
    assert result.error_message == ""
    assert result.completion_tokens == 48
    assert result.prompt_tokens > 0
    assert result.tokens_per_second > 0 and result.time_to_first_token > 0
    assert 0.0 <= result.mean_accepted_tokens <= 4.0
    assert set(result.drafts_used) <= {"general", "code", "math"} and result.drafts_used
    # feedback is best effort (rclpy drops feedback taken after the result): what came is a prefix
    assert feedback, "no feedback"
    assert visible(result.text).startswith(visible("".join(f.delta_text for f in feedback)))
    counts = [f.tokens_so_far for f in feedback]
    assert counts == sorted(counts) and counts[-1] <= 48
    assert all(f.active_draft in ("", "general", "code", "math") for f in feedback)
    # one GenerationStats per finished goal, with the result's numbers
    wait_until(
        lambda: any(bytes(s.goal_id.uuid) == bytes(handle.goal_id.uuid) for s in h.stats), 10.0, "generation_stats"
    )
    msg = next(s for s in h.stats if bytes(s.goal_id.uuid) == bytes(handle.goal_id.uuid))
    assert msg.completion_tokens == 48 and msg.finish_reason == "length"
    assert msg.tokens_per_second == pytest.approx(result.tokens_per_second)
    assert msg.policy == "memspec" and msg.iterations > 0 and msg.decode_seconds > 0


def test_a_goal_that_fails_before_its_result_still_gets_one_stats_message(h, monkeypatch):
    """An unexpected exception before the goal's result was built (its feedback set-up, its thread setting) ended it
    ABORTED, but no ~/generation_stats message went out and the finished-goal count missed it: one message per
    finished goal, as GenerationStats.msg promises."""
    from memspec_ros.ros import goal_runner

    def broken(*_args, **_kwargs):
        raise RuntimeError("the feedback could not be set up")

    monkeypatch.setattr(goal_runner, "FeedbackThrottle", broken)
    finished = h.node._window.finished_goals
    handle, _ = h.send(goal(max_new_tokens=8))
    assert handle.accepted
    response = h.result(handle)
    assert response.status == GoalStatus.STATUS_ABORTED
    assert response.result.finish_reason == Generate.Result.FINISH_ERROR
    assert "RuntimeError: the feedback could not be set up" in response.result.error_message
    wait_until(
        lambda: any(bytes(s.goal_id.uuid) == bytes(handle.goal_id.uuid) for s in h.stats), 10.0, "generation_stats"
    )
    msg = next(s for s in h.stats if bytes(s.goal_id.uuid) == bytes(handle.goal_id.uuid))
    assert msg.finish_reason == "error" and "could not be set up" in msg.error_message
    assert h.node._window.finished_goals == finished + 1  # counted once


def test_a_goal_whose_stats_message_fails_is_counted_once_and_still_answered(h, monkeypatch):
    """Publishing a goal's ~/generation_stats message raised after the goal had been counted finished: the execute
    callback's fallback built its result again and counted it a second time (the finished-goal count /diagnostics
    shows ran ahead of the goals answered)."""
    def broken(*_args, **_kwargs):
        raise RuntimeError("the stats publisher is gone")

    finished = h.node._window.finished_goals
    with monkeypatch.context() as patched:  # (undo() would also drop the autouse fixtures' patches)
        patched.setattr(h.node._runner._stats_pub, "publish", broken)
        handle, _ = h.send(goal(max_new_tokens=8))
        assert handle.accepted
        response = h.result(handle)
    assert response.status == GoalStatus.STATUS_ABORTED
    assert response.result.finish_reason == Generate.Result.FINISH_ERROR
    assert "the stats publisher is gone" in response.result.error_message
    assert h.node._window.finished_goals == finished + 1  # counted once
    handle, _ = h.send(goal(max_new_tokens=4))  # the node serves the next goal as usual
    assert h.result(handle).status == GoalStatus.STATUS_SUCCEEDED
    assert h.node._window.finished_goals == finished + 2


def test_goal_defaults_come_from_the_parameters(h):
    assert all(r.successful for r in h.set_params(**{"generation.max_new_tokens": 7}))
    try:
        handle, _ = h.send(Generate.Goal(prompt="The licensee may"))
        result = h.result(handle).result
        assert result.completion_tokens == 7
    finally:
        h.set_params(**{"generation.max_new_tokens": 128})


def test_a_sampled_goal_honours_its_temperature_and_seed(h):
    """A goal with temperature > 0 and a seed gives exactly what the runtime samples for those settings
    (the node's own controller, called directly with the same prompt ids), one seed gives one output, and
    other seeds other outputs; temperature 0 gives the greedy output. general-static runs one draft, so
    the same draws are made each time (see test_runtime_controller's one-seed test for why that matters)."""
    from memspec_ros.runtime.chat import prompt_ids
    from memspec_ros.runtime.speculative import SamplingConfig

    prompt, new = "The patient presented with", 24
    assert all(r.successful for r in h.set_params(**{"memspec.policy": "general-static"}))
    try:
        def run(temperature, seed=-1):
            handle, _ = h.send(Generate.Goal(prompt=prompt, max_new_tokens=new, temperature=temperature, seed=seed))
            response = h.result(handle)
            assert response.status == GoalStatus.STATUS_SUCCEEDED, response.result.error_message
            return response.result

        greedy = run(0.0)
        sampled = {seed: run(1.5, seed) for seed in (7, 8, 9)}
        assert run(1.5, 7).text == sampled[7].text  # one seed, one output
        assert len({r.text for r in sampled.values()}) > 1  # the seed reaches the sampler
        assert any(r.text != greedy.text for r in sampled.values())  # the temperature does too
        lo = h.node.loaded
        ids = prompt_ids(lo.tokenizer, prompt)

        def same(result, own) -> bool:  # a ROS string cannot carry NUL, which the random tiny models emit
            return result.text == own.text.replace("\x00", "") and result.completion_tokens == len(own.token_ids)

        assert same(greedy, lo.controller.generate(ids, new))
        for seed, result in sampled.items():
            assert same(
                result, lo.controller.generate(ids, new, SamplingConfig(temperature=1.5, top_p=1.0, seed=seed))
            ), seed
    finally:
        h.set_params(**{"memspec.policy": "memspec"})


def test_stop_string_ends_the_goal(h):
    handle, _ = h.send(goal(max_new_tokens=64))
    text = h.result(handle).result.text
    stop = text[10:12]
    handle, _ = h.send(goal(max_new_tokens=64, stop=[stop]))
    result = h.result(handle).result
    assert result.finish_reason == Generate.Result.FINISH_STOP
    assert stop not in result.text and text.startswith(result.text)


def test_cancel_mid_generation_returns_the_partial_text(h):
    feedback = []
    handle = start_long_goal(h, feedback)
    cancel = h.wait(handle.cancel_goal_async(), 10.0, "the cancel response")
    assert len(cancel.goals_canceling) == 1  # accepted (rclpy's default cancel callback rejects)
    response = h.result(handle, 30.0)
    assert response.status == GoalStatus.STATUS_CANCELED
    assert response.result.finish_reason == Generate.Result.FINISH_CANCELLED
    assert visible(response.result.text).startswith(visible("".join(f.delta_text for f in feedback)))
    assert 0 < response.result.completion_tokens < LONG


def test_every_rejection_is_answered_while_a_goal_runs(h):
    assert all(r.successful for r in h.set_params(**{"action.max_queued_goals": 1, "generation.max_prompt_tokens": 32}))
    try:
        running = start_long_goal(h, [])
        queued, _ = h.send(goal(max_new_tokens=8))
        assert queued.accepted  # one waiting place
        h.goal_callback_seconds.clear()
        h.goal_callback_beside_a_goal.clear()
        latencies = {}
        cases = {
            "queue full": goal(max_new_tokens=8),
            "empty prompt": goal(prompt=""),
            "prompt too long": goal(prompt="word " * 200),
            "over the context": goal(max_new_tokens=4096 - 3),
            "top_p out of range": goal(top_p=1.5),
        }
        reasons = {
            "queue full": "queue is full",
            "empty prompt": "empty",
            "prompt too long": "more than the limit of 32",
            "over the context": "exceeds the target's context",
            "top_p out of range": "top_p",
        }
        for label, request in cases.items():
            handle, seconds = h.send(request)
            assert not handle.accepted, label
            assert reasons[label] in h.node.last_rejection, (label, h.node.last_rejection)
            latencies[label] = seconds
        # every answer came while the long goal still ran: none waited for the generation (the answer's latency
        # is memspec-bench soak's verdict)
        assert h.goal_callback_beside_a_goal == [True] * len(cases)
        print(f"goal callback while a goal runs: median {statistics.median(h.goal_callback_seconds) * 1e3:.2f} ms,"
              f" max {max(h.goal_callback_seconds) * 1e3:.2f} ms; client round trip max"
              f" {max(latencies.values()) * 1e3:.1f} ms")
        # the queued goal runs after the running one; cancel both
        for handle in (queued, running):
            h.wait(handle.cancel_goal_async(), 10.0, "cancel")
        assert h.result(running, 30.0).status == GoalStatus.STATUS_CANCELED
        assert h.result(queued, 30.0).status == GoalStatus.STATUS_CANCELED
    finally:
        h.set_params(**{"action.max_queued_goals": 4, "generation.max_prompt_tokens": 1024})


def test_a_megabyte_prompt_is_rejected_before_it_is_tokenized(h):
    """A 1 MB prompt was tokenized whole in the goal callback before its length was checked (451 ms and
    350 MB of RSS); a character count that no max_prompt_tokens-token prompt can reach now rejects it first."""
    with prompt_tokenizations() as tokenized:
        handle, _ = h.send(goal(prompt="word " * 200_000))
        assert not handle.accepted and not tokenized
        handle, _ = h.send(goal(prompt="word " * 8, max_new_tokens=4))  # (the count sees a prompt that is taken)
        assert handle.accepted and tokenized
    assert "the prompt has 1000000 characters" in h.node.last_rejection, h.node.last_rejection
    assert "more than the limit of 1024" in h.node.last_rejection
    assert h.result(handle).status == GoalStatus.STATUS_SUCCEEDED


def test_a_rejection_quoting_what_a_client_sent_is_kept_short(h, monkeypatch):
    """A reason is logged and published on every /diagnostics message until the next rejection: one that quotes a
    client's megabyte (a role, say) is cut to its first MAX_REASON_CHARS characters, saying how long it was."""
    from memspec_ros.ros.goal_runner import MAX_REASON_CHARS

    monkeypatch.setattr(type(h.node._runner), "_check", lambda self, goal: "refused: " + "y" * 1_000_000)
    handle, _ = h.send(goal(max_new_tokens=4))
    assert not handle.accepted
    reason = h.node.last_rejection
    assert reason.startswith("refused: yyy") and reason.endswith(" ... (1000009 characters in all)")
    assert len(reason) < MAX_REASON_CHARS + 50


def test_a_burst_of_goal_requests_is_answered_in_full(h):
    """20 goal requests sent at once while a goal runs, against a queue of 2: the server's goal service
    holds the whole burst (with rclpy's default depth of 10 the rest went unanswered and their clients
    waited forever), so exactly 2 are accepted, the 18 others rejected, all answered in bounded time.
    The client gets a deep queue for its answers too, so that only the server's queue is under test."""
    burst, room = 20, 2
    deep = QoSProfile(depth=100)
    client = SafeActionClient(h.client, Generate, "/memspec/generate", goal_service_qos_profile=deep,
                          result_service_qos_profile=deep, cancel_service_qos_profile=deep)
    assert all(r.successful for r in h.set_params(**{"action.max_queued_goals": room}))
    try:
        # matched first: the long goal's few seconds had to cover the discovery, which takes seconds on a loaded machine
        wait_until(client.server_is_ready, 30.0, "the action server (burst client)")
        running = start_long_goal(h, [])
        futures = [client.send_goal_async(goal(max_new_tokens=8)) for _ in range(burst)]
        try:
            wait_until(lambda: all(f.done() for f in futures), 20.0, "answers to every goal request")
        except AssertionError:
            raise AssertionError(
                f"{sum(f.done() for f in futures)} of {burst} goal requests answered in 20 s"
            ) from None
        handles = [f.result() for f in futures]
        accepted = [g for g in handles if g.accepted]
        assert len(accepted) == room, [g.accepted for g in handles]
        assert "queue is full" in h.node.last_rejection
        for handle in [*accepted, running]:
            h.wait(handle.cancel_goal_async(), 10.0, "cancel")
        for handle in [*accepted, running]:
            assert h.wait(handle.get_result_async(), 30.0, "a result").status == GoalStatus.STATUS_CANCELED
    finally:
        h.set_params(**{"action.max_queued_goals": 4})
        client.destroy()


def test_cancelling_queued_goals_frees_their_slots_at_once(h):
    """Cancelled queued goals end CANCELED at once (result sent) while the running goal goes on, and
    their queue slots are free again: a new goal is accepted, not rejected as "queue full"."""
    assert all(r.successful for r in h.set_params(**{"action.max_queued_goals": 2}))
    try:
        feedback = []
        running, _ = h.send(goal(max_new_tokens=4000), feedback)  # longer than LONG: it must outlast the checks
        wait_until(lambda: len(feedback) >= 2, 30.0, "the long goal's feedback")
        queued = [h.send(goal(max_new_tokens=8))[0] for _ in range(2)]
        assert all(q.accepted for q in queued)
        full, _ = h.send(goal(max_new_tokens=8))
        assert not full.accepted and "queue is full" in h.node.last_rejection
        window = h.node._window
        finished, measured = window.finished_goals, window.measured_goals
        for handle in queued:
            assert len(h.wait(handle.cancel_goal_async(), 10.0, "the cancel response").goals_canceling) == 1
        for handle in queued:
            response = h.result(handle, 10.0)
            assert response.status == GoalStatus.STATUS_CANCELED
            assert response.result.finish_reason == Generate.Result.FINISH_CANCELLED
            assert response.result.completion_tokens == 0 and response.result.prompt_tokens > 0
        assert running.status == GoalStatus.STATUS_EXECUTING  # not waited for
        # /diagnostics counts them as finished goals, not as measured ones (it counted measured goals only, as
        # "goals since activation", so a dashboard showed fewer goals than ~/generation_stats had reported)
        assert (window.finished_goals, window.measured_goals) == (finished + 2, measured)
        status = Status()
        fill_throughput_status(status, None, 0, window.measured_goals, 0.2, window.finished_goals)
        assert ("goals finished since activation", str(finished + 2)) in status.values
        again = [h.send(goal(max_new_tokens=8))[0] for _ in range(2)]
        assert all(g.accepted for g in again), h.node.last_rejection
        for handle in (*again, running):
            h.wait(handle.cancel_goal_async(), 10.0, "cancel")
        for handle in (*again, running):
            assert h.result(handle, 30.0).status == GoalStatus.STATUS_CANCELED
    finally:
        h.set_params(**{"action.max_queued_goals": 4})


def test_a_goal_cancelled_before_its_accepted_callback_ends_at_once_and_frees_its_slot(h, monkeypatch):
    """rclpy sends the goal response and publishes the goal before it calls the accepted callback; a cancel taken in
    that gap found the goal still reserved, not queued: the cancel callback accepted it and did nothing, and the
    accepted callback then queued a goal already CANCELING, which held its queue slot until the running goal ended.
    Here the accepted callback is held until the cancel is answered, and the running goal until the test ends."""
    import threading

    runner = h.node._runner
    controller = h.node.loaded.controller
    generate, entered, hold = controller.generate, threading.Event(), threading.Event()

    def held_first(*args, **kwargs):
        if not entered.is_set():
            entered.set()
            hold.wait(60.0)  # the running goal holds the node until the test lets it go
        return generate(*args, **kwargs)

    answered = threading.Event()

    def delayed_on_accepted(goal_handle) -> None:
        answered.wait(30.0)  # the cancel lands between the goal response and this callback
        runner.on_accepted(goal_handle)

    monkeypatch.setattr(controller, "generate", held_first)
    assert all(r.successful for r in h.set_params(**{"action.max_queued_goals": 1}))
    running = None
    try:
        running, _ = h.send(goal(max_new_tokens=8))
        assert running.accepted and entered.wait(10.0)
        h.node._action_server.register_handle_accepted_callback(delayed_on_accepted)
        try:
            cancelled, _ = h.send(goal(max_new_tokens=8))
            assert cancelled.accepted
            cancel = h.wait(cancelled.cancel_goal_async(), 10.0, "the cancel response")
            assert len(cancel.goals_canceling) == 1
        finally:
            h.node._action_server.register_handle_accepted_callback(runner.on_accepted)
            answered.set()
        response = h.result(cancelled, 10.0)
        assert response.status == GoalStatus.STATUS_CANCELED
        assert response.result.finish_reason == Generate.Result.FINISH_CANCELLED
        assert response.result.completion_tokens == 0
        assert running.status == GoalStatus.STATUS_EXECUTING  # not waited for
        again, _ = h.send(goal(max_new_tokens=8))
        assert again.accepted, h.node.last_rejection  # its slot is free
        h.wait(again.cancel_goal_async(), 10.0, "cancel")
        assert h.result(again, 10.0).status == GoalStatus.STATUS_CANCELED
    finally:
        hold.set()
        h.set_params(**{"action.max_queued_goals": 4})
    assert h.result(running, 30.0).status == GoalStatus.STATUS_SUCCEEDED


def test_deactivate_during_a_goal_aborts_it_with_the_partial_text_and_rejects_new_goals(h):
    handle = start_long_goal(h, [])
    assert h.transition(Transition.TRANSITION_DEACTIVATE)
    response = h.result(handle, 30.0)
    assert response.status == GoalStatus.STATUS_ABORTED
    assert response.result.finish_reason == Generate.Result.FINISH_ERROR
    assert "deactivated" in response.result.error_message
    assert response.result.text and 0 < response.result.completion_tokens < LONG
    rejected, _ = h.send(goal())
    assert not rejected.accepted and "the node is not active" in h.node.last_rejection, h.node.last_rejection
    assert h.transition(Transition.TRANSITION_ACTIVATE)
    handle, _ = h.send(goal(max_new_tokens=4))
    assert h.result(handle).status == GoalStatus.STATUS_SUCCEEDED


# -- the goal runner's shape (ros/goal_runner.py) ---------------------------------------------------

def test_a_goal_is_tokenized_once_and_runs_on_one_executor_thread_with_no_thread_of_its_own(h, monkeypatch):
    """rclpy's queued-goals pattern: the generation runs in the execute callback on an executor thread and
    publishes its feedback from that thread; no worker, feedback or parked thread; the controller gets the
    token ids the goal callback tokenized and checked."""
    import threading

    from rclpy.action.server import ServerGoalHandle

    from memspec_ros.ros import goal_runner

    h.result(h.send(goal(max_new_tokens=4))[0])  # the executor's pool and the draft loader are started
    seen = {"tokenized": [], "generate": [], "feedback": set()}
    tokenize = goal_runner.prompt_ids

    def counting_prompt_ids(*args, **kwargs):
        ids = tokenize(*args, **kwargs)
        seen["tokenized"].append(ids)
        return ids

    controller = h.node.loaded.controller
    generate = controller.generate

    def recording_generate(prompt, *args, **kwargs):
        seen["generate"].append((prompt, threading.current_thread()))
        return generate(prompt, *args, **kwargs)

    publish = ServerGoalHandle.publish_feedback

    def recording_publish(self, feedback):
        seen["feedback"].add(threading.current_thread())
        return publish(self, feedback)

    monkeypatch.setattr(goal_runner, "prompt_ids", counting_prompt_ids)
    monkeypatch.setattr(controller, "generate", recording_generate)
    monkeypatch.setattr(ServerGoalHandle, "publish_feedback", recording_publish)
    before = set(threading.enumerate())
    handle = start_long_goal(h, [])
    during = set(threading.enumerate())
    h.wait(handle.cancel_goal_async(), 10.0, "cancel")
    assert h.result(handle, 30.0).status == GoalStatus.STATUS_CANCELED
    [(prompt, thread)] = seen["generate"]
    assert seen["tokenized"] == [prompt]  # once, and these very ids reach the controller
    assert seen["feedback"] == {thread}
    assert thread.name.startswith("ThreadPoolExecutor")  # an rclpy executor thread, not one of ours
    assert all(t.name.startswith("ThreadPoolExecutor") for t in during - before), during - before


def test_a_goal_that_never_reaches_its_accepted_callback_gives_its_queue_place_back(h, monkeypatch):
    """rclpy skips the accepted callback when it cannot send the goal response (the client went away) or make the
    goal handle (a goal id taken): the goal callback's reservation is then an orphan. It must not hold a queue
    place, nor make a deactivate wait for it, for longer than RESERVATION_TIMEOUT_SECONDS; an accepted callback
    that still comes after that ends its goal ABORTED with a result."""
    import time

    from unique_identifier_msgs.msg import UUID

    from memspec_ros.ros import goal_runner

    runner = h.node._runner
    assert all(r.successful for r in h.set_params(**{"action.max_queued_goals": 0}))
    try:
        orphan = goal(max_new_tokens=4)
        assert runner.on_goal(orphan) == goal_runner.GoalResponse.ACCEPT  # what rclpy runs first; then nothing
        refused, _ = h.send(goal(max_new_tokens=4))  # within the 10 s timeout however slow the machine
        assert not refused.accepted and "queue is full" in h.node.last_rejection  # the orphan holds the place
        # then the orphan is older than the timeout (moved on, not slept through: a fixed pause raced the send)
        monkeypatch.setattr(goal_runner, "RESERVATION_TIMEOUT_SECONDS", 1.0)
        with runner._cv:
            for job in runner._reserved:
                job.accepted_at -= 2.0
        accepted, _ = h.send(goal(max_new_tokens=4))
        assert accepted.accepted, h.node.last_rejection
        assert h.result(accepted).status == GoalStatus.STATUS_SUCCEEDED
        assert runner.wait_idle(0.5) and not runner._reserved

        class LateHandle:  # the orphan's accepted callback, coming after all
            request, outcome, goal_id = orphan, [], UUID()

            def execute(self, callback=None):
                self.result = callback(self)

            def abort(self):
                self.outcome.append("aborted")

        with runner._cv:
            unanswered = runner._unanswered
        late = LateHandle()
        runner.on_accepted(late)
        assert late.outcome == ["aborted"] and late.result.finish_reason == Generate.Result.FINISH_ERROR
        assert "accepted callback came" in late.result.error_message
        with runner._cv:
            assert runner._unanswered == unanswered
        assert runner.on_goal(goal(max_new_tokens=4)) == goal_runner.GoalResponse.ACCEPT  # another orphan
        t0 = time.monotonic()
        assert h.transition(Transition.TRANSITION_DEACTIVATE)
        assert time.monotonic() - t0 < goal_runner.DEACTIVATE_WAIT_SECONDS / 2  # not held by the orphan
        assert h.transition(Transition.TRANSITION_ACTIVATE)
    finally:
        h.set_params(**{"action.max_queued_goals": 4})


def test_a_goal_whose_response_could_not_be_sent_ends_aborted_not_accepted_for_good(h, monkeypatch):
    """rclpy makes and stores the goal handle before it sends the goal response; when that send fails (the client
    went away) it returns without the accepted callback. The orphan gave its queue place back, but its goal stood
    ACCEPTED on the status topic for the node's life, and a result request for its id was never answered."""
    import uuid

    from action_msgs.msg import GoalInfo
    from rclpy.action.server import ServerGoalHandle
    from rclpy.task import Future
    from unique_identifier_msgs.msg import UUID

    from memspec_ros.ros import goal_runner

    runner = h.node._runner
    server = runner.server
    internals = ("_lock", "_goal_handles", "_result_futures", "add_future")
    if not all(hasattr(server, name) for name in internals):  # rclpy's own, as Jazzy's 7.1 names them
        pytest.skip(f"this rclpy's ActionServer has not all of {', '.join(internals)}: the orphan is made by hand")
    request = goal(max_new_tokens=4)
    assert runner.on_goal(request) == goal_runner.GoalResponse.ACCEPT
    info = GoalInfo(goal_id=UUID(uuid=list(uuid.uuid4().bytes)), stamp=h.node.get_clock().now().to_msg())
    with server._lock:  # what rclpy does before the goal response (rclpy/action/server.py), which then fails
        handle = ServerGoalHandle(server, info, request)
    key = bytes(info.goal_id.uuid)
    server._goal_handles[key] = handle
    server._result_futures[key] = Future()
    server.add_future(server._result_futures[key])
    monkeypatch.setattr(goal_runner, "RESERVATION_TIMEOUT_SECONDS", 1.0)
    with runner._cv:
        for job in runner._reserved:
            job.accepted_at -= 2.0
    assert runner.wait_idle(5.0) and not runner._reserved
    wait_until(lambda: handle.status == GoalStatus.STATUS_ABORTED, 10.0, "the orphan's goal ended ABORTED")
    result = server._result_futures[key]
    wait_until(result.done, 10.0, "its result, for a client that asks")
    assert "could not send the goal response" in result.result().result.error_message
    wait_until(lambda: runner._unanswered == 0, 10.0, "no goal counted unanswered")
    runner.on_accepted(handle)  # its accepted callback, coming after all: the goal is not ended a second time
    assert runner._unanswered == 0 and handle.status == GoalStatus.STATUS_ABORTED
    monkeypatch.undo()  # the real timeout again: a loaded machine's accepted callback may take more than 1 s
    accepted, _ = h.send(goal(max_new_tokens=4))  # the node goes on
    assert h.result(accepted).status == GoalStatus.STATUS_SUCCEEDED


def test_cleanup_never_frees_the_models_under_a_goal_that_has_not_ended_yet(h, monkeypatch):
    """A goal told to end at deactivate ends at its next iteration; one that does not get there within the wait
    (a long prefill on a loaded machine, here a generate call that blocks) leaves deactivate done with a warning,
    and cleanup refused (FAILURE, still inactive) instead of freeing the models under it."""
    import threading

    from memspec_ros.ros import goal_runner
    from memspec_ros.ros import node as node_module

    monkeypatch.setattr(goal_runner, "DEACTIVATE_WAIT_SECONDS", 0.5)
    monkeypatch.setattr(node_module, "DEACTIVATE_WAIT_SECONDS", 0.5)
    controller = h.node.loaded.controller
    generate, entered, release = controller.generate, threading.Event(), threading.Event()

    def blocking_generate(*args, **kwargs):
        entered.set()
        release.wait(30.0)  # deaf to the abort until released
        return generate(*args, **kwargs)

    monkeypatch.setattr(controller, "generate", blocking_generate)
    handle, _ = h.send(goal(max_new_tokens=4))
    assert handle.accepted and entered.wait(10.0)
    try:
        assert h.transition(Transition.TRANSITION_DEACTIVATE)
        assert not h.transition(Transition.TRANSITION_CLEANUP)
        assert h.state() == "inactive" and h.node.loaded is not None
    finally:
        release.set()
    response = h.result(handle, 30.0)
    assert response.status == GoalStatus.STATUS_ABORTED and "deactivated" in response.result.error_message
    assert h.transition(Transition.TRANSITION_CLEANUP) and h.node.loaded is None
    assert h.transition(Transition.TRANSITION_CONFIGURE) and h.transition(Transition.TRANSITION_ACTIVATE)


@pytest.mark.parametrize("how", ["result timeout", "interrupted before the answer", "goal answer late",
                                 "interrupted while it runs", "output closed", "output and stderr closed"])
def test_memspec_client_never_leaves_a_goal_running_unwatched(h, how, monkeypatch):
    """memspec_client gives up on a goal (its result timeout passes, Ctrl-C lands while it waits for the goal's
    answer, the answer comes after --timeout, or its output closes as it streams: `| head -n 3`, where the write's
    BrokenPipeError went out with a traceback; with `2>&1`, stderr closed too, where the notice's write raised before
    the cancel): the goal is cancelled, not left to run to its end holding the node's one generation."""
    import io

    import rclpy
    from rclpy.executors import SingleThreadedExecutor

    from memspec_ros.ros import client

    class ClosesAfterOneWrite(io.StringIO):
        def write(self, text):
            if self.getvalue():
                raise BrokenPipeError(32, "Broken pipe")
            return super().write(text)

    class Closed(io.StringIO):
        def write(self, text):
            raise BrokenPipeError(32, "Broken pipe")

    closed = how.startswith("output")
    if how not in ("result timeout",) and not closed:
        spin_until, calls = client._spin_until, []

        def first_wait_gives_up(*args, **kwargs):
            calls.append(1)
            if how == "interrupted while it runs":  # the goal's answer comes; the cancel's answer, after the
                return spin_until(*args, **kwargs) if len(calls) == 1 else None  # Ctrl-C, does not (a busy node)
            if len(calls) == 1:  # the first wait: for the goal's answer, which has not come
                if how == "interrupted before the answer":
                    raise KeyboardInterrupt
                return None  # --timeout passed
            return spin_until(*args, **kwargs)

        monkeypatch.setattr(client, "_spin_until", first_wait_gives_up)
        if how == "interrupted while it runs":
            def interrupted(self, executor, timeout):  # Ctrl-C in the wait for the result
                raise KeyboardInterrupt

            monkeypatch.setattr(client.ResultWatch, "wait", interrupted)
    node = rclpy.create_node("memspec_client_gives_up", context=h.client.context)
    executor = SingleThreadedExecutor(context=h.client.context)
    executor.add_node(node)
    log = Closed() if how == "output and stderr closed" else io.StringIO()
    stats_before = len(h.stats)
    try:
        outcome = client.send_goal(node, executor, goal(max_new_tokens=LONG), "/memspec/generate",
                                   result_timeout=60.0 if closed else 1.0,
                                   out=ClosesAfterOneWrite() if closed else io.StringIO(), log=log)
    finally:
        executor.shutdown(timeout_sec=1.0)
        node.destroy_node()
    assert outcome.status == ("interrupted" if how.startswith("interrupted") or closed else "timeout")
    assert outcome.status != "interrupted" or outcome.exit_code == (141 if closed else 130)
    if how == "result timeout":  # the cancelled goal's partial answer is kept and shown (it was thrown away)
        assert outcome.result is not None and outcome.result.finish_reason == "cancelled"
    if not isinstance(log, Closed):
        # said once: after Ctrl-C it had also said "no result after 1 s" and cancelled (and waited) a second time
        assert log.getvalue().count("cancelling the goal") == 1, log.getvalue()
    wait_until(lambda: len(h.stats) > stats_before, 30.0, "the goal's end")
    assert h.stats[-1].finish_reason == "cancelled" and h.stats[-1].completion_tokens < LONG
    assert h.node._runner.wait_idle(10.0)


@pytest.mark.parametrize("flag, value", [
    ("--max-new-tokens", "-1"), ("--max-new-tokens", str(2**32)),  # uint32: a traceback, and a silent wrap to 0
    ("--seed", str(2**63)), ("--seed", str(-2**63 - 1)),  # int64
    ("--temperature", "1e39"), ("--top-p", "nan"), ("--temperature", "-inf"),  # float32, finite
    ("--timeout", "0"), ("--timeout", "nan"),  # seconds
    ("--result-timeout", "-1"), ("--result-timeout", "inf"),  # 0 (no limit) or seconds
])
def test_memspec_client_refuses_a_number_out_of_its_goal_fields_range(flag, value, capsys):
    """A numeric flag out of its Generate goal field's type failed at serialization with a SystemError traceback
    (exit status 1), or wrapped silently (--max-new-tokens 4294967296 became 0, the node's default): argparse now
    refuses it, usage status 2 and the flag named."""
    from rclpy.serialization import serialize_message

    from memspec_ros.ros.client import build_goal, parse_args

    with pytest.raises(SystemExit) as exit_info:
        parse_args(["hi", f"{flag}={value}"])
    assert exit_info.value.code == 2
    assert f"argument {flag}" in capsys.readouterr().err
    for edges in (["--max-new-tokens", str(2**32 - 1), "--seed", str(2**63 - 1), "--temperature", "100"],
                  ["--max-new-tokens", "0", f"--seed={-2**63}", "--top-p=-3.4e38", "--timeout", "0.5",
                   "--temperature=-3.4e38"]):
        assert serialize_message(build_goal(parse_args(["hi", *edges])))  # the edges are the fields' own


@pytest.mark.parametrize("args, named", [
    (["--temperature", "100.5"], "argument --temperature: 100.5 is above the node's limit of 100"),
    (["--top-p", "1.01"], "argument --top-p: 1.01 is above the node's limit of 1"),
    (["--stop", "x" * 1001], "argument --stop: a stop string of 1001 characters: the node's limit is 1000"),
    ([f"--stop=s{i}" for i in range(65)], "65 --stop strings: the node takes at most 64"),
])
def test_memspec_client_refuses_what_the_node_would_reject_naming_the_limit(args, named, capsys):
    """A temperature above 100, a top_p above 1, more than 64 stop strings or one over 1000 characters was sent, and
    the node's rejection came back as a message that listed some reasons and not these: the parser refuses them (usage
    status 2) with the node's own limit. At the limits the node's check takes the goal; past them it would not."""
    import memspec_ros.ros.client as client
    from memspec_ros.ros.goal_runner import GoalRunner

    with pytest.raises(SystemExit) as exit_info:
        client.parse_args(["hi", *args])
    assert exit_info.value.code == 2
    assert named in capsys.readouterr().err
    at_limits = client.build_goal(client.parse_args(
        ["hi", "--temperature", "100", "--top-p", "1", "--stop", "x" * 1000, *[f"--stop=s{i}" for i in range(63)]]))
    assert GoalRunner._settings_error(at_limits) == ""
    for past in ({"temperature": 100.5}, {"top_p": 1.01}, {"stop": ["x" * 1001]}, {"stop": ["s"] * 65}):
        goal = client.build_goal(client.parse_args(["hi"]))
        for name, value in past.items():
            setattr(goal, name, value)
        assert GoalRunner._settings_error(goal)  # the node rejects what the parser now refuses


def answering_client(handle):
    """An ActionClient stand-in whose server is ready and answers every goal with ``handle``."""
    from rclpy.task import Future

    class Answering:
        def __init__(self, *args):
            pass

        def server_is_ready(self):
            return True

        def send_goal_async(self, goal, feedback_callback=None):
            answer = Future()
            answer.set_result(handle)
            return answer

        def destroy(self):
            pass

    return Answering


def test_memspec_client_refuses_a_bad_node_name_and_a_blank_prompt_before_starting_ros(monkeypatch, capsys):
    """`--node 'bad name'` ended in a traceback from the action client; an empty or whitespace prompt was sent and
    the node's rejection came back as eight possible reasons."""
    import io

    import rclpy

    import memspec_ros.ros.client as client

    monkeypatch.setattr(rclpy, "init", lambda *a, **k: pytest.fail("ROS started for input refused locally"))
    with pytest.raises(SystemExit) as exit_info:
        client.parse_args(["hi", "--node", "bad name"])
    assert exit_info.value.code == 2 and "argument --node: 'bad name' is no valid node name" in capsys.readouterr().err
    assert client.parse_args(["hi", "--node", "/robot/memspec/"]).node == "/robot/memspec/"
    for argv, stdin, said in ((["", "--raw"], "", "the prompt is empty"),
                              ([], "  \n", "the prompt is only whitespace")):
        monkeypatch.setattr("sys.stdin", io.StringIO(stdin))
        assert client.main(argv) == 2
        assert said in capsys.readouterr().err


def test_memspec_client_result_timeout_is_a_flag_900_s_by_default_and_0_waits_without_limit(monkeypatch, capsys):
    """The 900 s limit on a goal's result was hard-coded and undocumented: --result-timeout sets it (in --help), 900 s
    by default, 0 for none; send_goal waits for the result that long."""
    import math

    import rclpy.action
    from rclpy.task import Future

    import memspec_ros.ros.client as client

    assert client.parse_args(["hi"]).result_timeout == 900.0
    assert client.parse_args(["hi", "--result-timeout", "0"]).result_timeout == 0.0
    with pytest.raises(SystemExit):
        client.parse_args(["--help"])
    assert "--result-timeout SECONDS" in capsys.readouterr().out

    result = Future()
    result.set_result(type("Response", (), {"status": GoalStatus.STATUS_SUCCEEDED,
                                            "result": Generate.Result(text="ok")})())
    waits = []
    monkeypatch.setattr(rclpy.action, "ActionClient", answering_client(
        type("Handle", (), {"accepted": True, "get_result_async": lambda self: result})()))
    monkeypatch.setattr(client, "_spin_until", lambda executor, future, timeout: waits.append(timeout))
    monkeypatch.setattr(client.ResultWatch, "wait", lambda self, executor, timeout: waits.append(timeout) or True)
    for given, waited in ((0.0, math.inf), (42.0, 42.0)):
        outcome = client.send_goal(None, None, Generate.Goal(prompt="hi"), "/memspec/generate", server_timeout=3.0,
                                   result_timeout=given, out=io.StringIO(), log=io.StringIO())
        assert outcome.ok and waits[-2:] == [3.0, waited]


def test_memspec_client_says_a_server_that_forgot_the_goal_instead_of_printing_status_0(monkeypatch):
    """A result answered with STATUS_UNKNOWN (the server restarted, or expired the result) came out as "goal status 0"
    after its empty result had been printed as the answer ("[feedback incomplete; the full text]" below the streamed
    part). It is said as such, its empty result is no result, and the exit status is 1."""
    import io

    import rclpy.action
    from rclpy.task import Future

    import memspec_ros.ros.client as client

    result = Future()
    result.set_result(type("Response", (), {"status": GoalStatus.STATUS_UNKNOWN, "result": Generate.Result()})())
    monkeypatch.setattr(rclpy.action, "ActionClient", answering_client(
        type("Handle", (), {"accepted": True, "get_result_async": lambda self: result})()))
    monkeypatch.setattr(client, "_spin_until", lambda executor, future, timeout: None)
    out, log = io.StringIO(), io.StringIO()
    outcome = client.send_goal(None, None, Generate.Goal(prompt="hi"), "/memspec/generate", out=out, log=log)
    assert outcome.status == "server-gone" and not outcome.ok and outcome.result is None
    assert "no longer knows this goal" in log.getvalue() and out.getvalue() == ""


def test_memspec_client_rejection_message_names_every_reason_with_the_nodes_limits(monkeypatch):
    """The message printed for a rejected goal named only some of the node's reasons; every one is named, with the
    node's limits (goal_runner.py)."""
    import io

    import rclpy.action

    from memspec_ros.ros.client import send_goal

    monkeypatch.setattr(rclpy.action, "ActionClient", answering_client(type("Handle", (), {"accepted": False})()))
    log = io.StringIO()
    executor = type("Executor", (), {"spin_once": lambda self, timeout_sec=None: None})()
    outcome = send_goal(None, executor, Generate.Goal(prompt="hi"), "/memspec/generate", out=io.StringIO(), log=log)
    assert outcome.status == "rejected"
    said = " ".join(log.getvalue().split())
    for reason in ("not active", "empty", "generation.max_prompt_tokens", "max_new_tokens exceed the target's context",
                   "without a chat template", "generation.system_prompt_fixed", "temperature above 100",
                   "top_p above 1", "more than 64 stop strings", "over 1000 characters", "special token",
                   "queue is full"):
        assert reason in said, reason


class _Handle:
    def __init__(self, fail: bool = False) -> None:
        self.sent: list[Generate.Feedback] = []
        self.fail = fail

    def publish_feedback(self, feedback) -> None:
        if self.fail:
            raise RuntimeError("the action server is gone")
        self.sent.append(feedback)


class _Logger:
    def __init__(self) -> None:
        self.warnings: list[str] = []

    def warning(self, text: str) -> None:
        self.warnings.append(text)


def test_feedback_is_throttled_on_the_calling_thread_and_flushed_in_order():
    from types import SimpleNamespace

    from memspec_ros.ros.goal_runner import FeedbackThrottle

    cache = SimpleNamespace(active="code")
    handle = _Handle()
    feedback = FeedbackThrottle(handle, cache, period=60.0, logger=_Logger())
    for delta in ("a", "b", "c"):
        feedback.on_chunk(delta, [1])
    assert [(f.delta_text, f.tokens_so_far, f.active_draft) for f in handle.sent] == [("a", 1, "code")]
    cache.active = ""  # generate() returned: the cache's active draft is cleared for the next goal
    feedback.flush()  # the rest, in one message, before the result
    assert [(f.delta_text, f.tokens_so_far) for f in handle.sent] == [("a", 1), ("bc", 3)]
    assert handle.sent[-1].active_draft == "code"  # the draft that made its chunks (it said "" after the goal)
    assert feedback.text == "abc"
    feedback.flush()
    assert len(handle.sent) == 2  # nothing left

    every = _Handle()
    unthrottled = FeedbackThrottle(every, cache, period=0.0, logger=_Logger())
    unthrottled.on_chunk("x", [1, 2])
    unthrottled.on_decode_start()
    unthrottled.on_chunk("y\x00", [1, 2])
    assert [(f.delta_text, f.tokens_so_far) for f in every.sent] == [("x", 2), ("y", 4)]
    assert every.sent[0].tokens_per_second == 0.0 and every.sent[-1].tokens_per_second > 0

    logger = _Logger()
    broken = FeedbackThrottle(_Handle(fail=True), cache, period=0.0, logger=logger)
    broken.on_chunk("a", [1])
    broken.on_chunk("b", [1])  # no exception into the decode loop; logged once
    assert len(logger.warnings) == 1 and "the action server is gone" in logger.warnings[0]
    assert broken.text == "ab"


def test_feedbacks_rate_is_timed_from_the_decode_start_as_the_results(monkeypatch):
    """The running rate counts the tokens after the decode start over the time since (the result's definition):
    timed from the first token, it took in the first draft's choice and load (a 0.5 s load: feedback 203 tok/s
    against the result's 465 in a reviewer's run)."""
    from types import SimpleNamespace

    from memspec_ros.ros import goal_runner

    clock = {"now": 10.0}
    monkeypatch.setattr(goal_runner.time, "perf_counter", lambda: clock["now"])
    handle = _Handle()
    feedback = goal_runner.FeedbackThrottle(handle, SimpleNamespace(active="code"), period=0.0, logger=_Logger())
    feedback.on_chunk("a", [1])  # the prefill's token at 10.0
    clock["now"] = 10.5  # the first draft's choice and load
    feedback.on_decode_start()
    for _ in range(4):  # four iterations of three tokens, 0.1 s each
        clock["now"] += 0.1
        feedback.on_chunk("bcd", [1, 1, 1])
    assert feedback.first_at == 10.0
    assert handle.sent[-1].tokens_per_second == pytest.approx(12 / 0.4)


def test_a_queued_goal_runs_with_the_defaults_it_was_checked_with(h):
    """A goal accepted with the node's default max_new_tokens, then the default raised past the context while it
    waited: it ran with the default of its acceptance (it ended ABORTED with a context error, and /diagnostics
    in ERROR)."""
    before = h.get_param("generation.max_new_tokens")
    feedback = []
    running = start_long_goal(h, feedback)
    queued, _ = h.send(Generate.Goal(prompt="hello"))  # max_new_tokens 0: the node's default, now
    assert queued.accepted
    try:
        assert all(r.successful for r in h.set_params(
            **{"generation.max_new_tokens": h.node.loaded.max_positions - 1}))
        h.wait(running.cancel_goal_async(), 10.0, "cancel")
        response = h.result(queued, 60.0)
        assert response.status == GoalStatus.STATUS_SUCCEEDED, response.result.error_message
        assert response.result.completion_tokens <= before
    finally:
        h.set_params(**{"generation.max_new_tokens": before})
    h.result(running, 30.0)


def test_time_to_first_token_counts_from_the_goals_acceptance(h, monkeypatch):
    """A goal that waited in the queue behind one that ran for a second reports that wait in its time to first
    token (it reported only its own prefill: 2 ms in a reviewer's run)."""
    import threading

    controller = h.node.loaded.controller
    generate, entered, released = controller.generate, threading.Event(), threading.Event()

    def slow_first(*args, **kwargs):
        if not entered.is_set():
            entered.set()
            released.wait(30.0)  # the running goal holds the node until the test lets it go
        return generate(*args, **kwargs)

    monkeypatch.setattr(controller, "generate", slow_first)
    first, _ = h.send(goal(max_new_tokens=4))
    try:
        assert first.accepted and entered.wait(10.0)
        queued, _ = h.send(goal(max_new_tokens=2))
        assert queued.accepted
        # held for 0.6 s after the queued goal's acceptance (a fixed hold from the first goal's start left less
        # than 0.5 s of it to the queued goal where its send took long)
        time.sleep(0.6)
    finally:
        released.set()
    assert h.result(first).status == GoalStatus.STATUS_SUCCEEDED
    result = h.result(queued).result
    assert result.time_to_first_token > 0.5


def test_the_target_models_error_is_cleared_by_a_new_activation(h, monkeypatch):
    """A failed goal's error stayed on /diagnostics (ERROR "the last goal failed") across deactivate and activate,
    with no goal run since."""
    from memspec_ros.ros.diagnostics import OK, NodeTasks, run_task

    def out_of_memory(*args, **kwargs):
        raise MemoryError("out of memory (simulated)")

    monkeypatch.setattr(h.node.loaded.controller, "generate", out_of_memory)
    handle, _ = h.send(goal(max_new_tokens=4))
    assert h.result(handle).status == GoalStatus.STATUS_ABORTED
    tasks = NodeTasks(h.node, h.node._runner, h.node._window)
    assert "the last goal failed" in run_task(tasks.fill_target).message
    monkeypatch.undo()
    assert h.transition(Transition.TRANSITION_DEACTIVATE) and h.transition(Transition.TRANSITION_ACTIVATE)
    status = run_task(tasks.fill_target)
    assert "failed" not in status.message and status.level == OK


def test_a_goal_whose_generation_raises_counts_the_tokens_behind_its_partial_text(h, monkeypatch):
    """A generation that raised after streaming text: the ABORTED result carried that text with completion_tokens 0
    and time_to_first_token 0 (its runtime statistics died with it), where Generate.action counts the tokens behind
    `text`; ~/generation_stats said the same."""
    def fails_after_a_chunk(prompt_ids, max_new_tokens, sampling, stop, on_chunk, *rest):
        on_chunk("partial text", [11, 12, 13])
        raise RuntimeError("device lost (simulated)")

    monkeypatch.setattr(h.node.loaded.controller, "generate", fails_after_a_chunk)
    stats_before = len(h.stats)
    handle, _ = h.send(goal(max_new_tokens=8))
    response = h.result(handle)
    assert response.status == GoalStatus.STATUS_ABORTED
    result = response.result
    assert result.finish_reason == Generate.Result.FINISH_ERROR and "device lost" in result.error_message
    assert result.text == "partial text" and result.completion_tokens == 3
    assert result.time_to_first_token > 0 and result.prompt_tokens > 0
    wait_until(lambda: len(h.stats) > stats_before, 10.0, "generation_stats")
    msg = h.stats[-1]
    assert bytes(msg.goal_id.uuid) == bytes(handle.goal_id.uuid)
    assert msg.completion_tokens == 3 and msg.time_to_first_token == pytest.approx(result.time_to_first_token)
    assert msg.policy == h.node.loaded.controller.config.policy  # "the policy that ran the goal" (it was "")


def test_a_goal_checked_while_the_node_deactivates_is_rejected_not_accepted(h, monkeypatch):
    """Deactivate landing while the goal callback tokenizes: the goal was ACCEPTED (its reservation came after
    deactivate had ended the goals) and then aborted, where an inactive node must reject."""
    from rclpy.action import GoalResponse

    from memspec_ros.ros import goal_runner

    runner = h.node._runner
    tokenize = goal_runner.prompt_ids
    ended = []

    def deactivate_meanwhile(*args, **kwargs):
        ended.append(runner.end_goals("the node was deactivated", wait_seconds=5.0))
        return tokenize(*args, **kwargs)

    loaded = runner._loaded
    monkeypatch.setattr(goal_runner, "prompt_ids", deactivate_meanwhile)
    try:
        assert runner.on_goal(goal(max_new_tokens=4)) == GoalResponse.REJECT
        assert ended == [True] and "not active" in runner.last_rejection and not runner._reserved
    finally:
        runner.open(loaded, h.node._stats_pub)  # as activate does


def test_a_goal_that_finished_before_a_deactivate_landed_is_settled_as_finished(h, monkeypatch):
    """Deactivate or shutdown landing after the goal's last iteration (its answer complete) turned the outcome into
    ABORTED, 'the node was deactivated during the goal', with the whole answer as its text."""
    controller = h.node.loaded.controller
    generate = controller.generate

    def deactivated_as_it_ends(*args, **kwargs):
        out = generate(*args, **kwargs)
        h.node._runner._running.abort_reason = "the node was deactivated during the goal"  # what end_goals sets
        return out

    monkeypatch.setattr(controller, "generate", deactivated_as_it_ends)
    handle, _ = h.send(goal(max_new_tokens=6))
    response = h.result(handle)
    assert response.status == GoalStatus.STATUS_SUCCEEDED, response.result.error_message
    assert response.result.finish_reason == "length" and response.result.error_message == ""


def test_a_goal_that_runs_past_max_goal_seconds_ends_aborted_with_its_text(h):
    """A client that went away is invisible to the action server: its goal ran to max_new_tokens holding the node's
    one generation. action.max_goal_seconds bounds it: ABORTED, the partial text and the reason; 0 is no limit."""
    assert h.set_params(**{"action.max_goal_seconds": 0.1})[0].successful
    try:
        handle, _ = h.send(goal(max_new_tokens=LONG))
        response = h.result(handle, 60.0)
        assert response.status == GoalStatus.STATUS_ABORTED, response.result.finish_reason
        result = response.result
        assert "ran past action.max_goal_seconds (0.1 s)" in result.error_message
        # its partial answer, cut short (none at all where the deadline passed before its prefill: a goal out of time
        # while it is prepared runs no prefill, and 0.1 s is little on a loaded machine)
        assert result.completion_tokens < LONG
    finally:
        assert h.set_params(**{"action.max_goal_seconds": 0.0})[0].successful
    handle, _ = h.send(goal(max_new_tokens=8))
    assert h.result(handle).status == GoalStatus.STATUS_SUCCEEDED
    refused = h.set_params(**{"action.max_goal_seconds": -1.0})[0]
    assert not refused.successful


def test_a_queued_goal_that_cannot_be_ended_is_not_waited_for(h, monkeypatch):
    """Ending a queued goal fails once the executor is shut down (rclpy's create_task raises), as a node destroyed
    after its executor's shutdown is: the goal's answer never comes, yet it stayed counted, and close() waited its
    whole results_out_seconds for it, then at every close after. A failure is logged and the goal no longer counted."""
    from memspec_ros.ros import goal_runner

    runner = h.node._runner

    def refused(job, reason):
        raise AttributeError("'NoneType' object has no attribute 'trigger'")  # rclpy's, after executor.shutdown()

    monkeypatch.setattr(runner, "_end_unrun", refused)
    job = goal_runner.Job(goal(max_new_tokens=4), [1, 2, 3], 4)
    with runner._cv:
        before = runner._unanswered
        runner._unanswered += 1
    runner._end_unrun_logged([job], "the node is shutting down", "a queued goal")
    with runner._cv:
        assert runner._unanswered == before  # what close() waits on


def test_a_queued_cancel_rclpy_never_marks_publishes_what_its_result_says(h, monkeypatch):
    """A goal cancelled in the queue had its ~/generation_stats sent at once, "cancelled"; when rclpy then never
    marked it CANCELING, its result became an ABORTED "error" and the message no longer matched it
    (GenerationStats.msg promises the same values). The message now waits for the final word."""
    from types import SimpleNamespace

    from unique_identifier_msgs.msg import UUID

    from memspec_ros.ros import goal_runner

    runner = h.node._runner
    monkeypatch.setattr(goal_runner, "CANCELING_WAIT_SECONDS", 0.05)
    outcome = []
    handle = SimpleNamespace(goal_id=UUID(uuid=list(range(16))), is_cancel_requested=False,
                             abort=lambda: outcome.append("aborted"), canceled=lambda: outcome.append("canceled"))
    job = goal_runner.Job(goal(max_new_tokens=4), [1, 2, 3], 4, goal_handle=handle)
    with runner._cv:
        runner._unanswered += 1
    job.result = runner._result(job, goal_runner.CANCELLED, error="cancelled while queued", publish=False)
    before = len(h.stats)
    result = runner._answer(job, handle)
    assert outcome == ["aborted"] and result.finish_reason == Generate.Result.FINISH_ERROR
    wait_until(lambda: len(h.stats) > before, 10.0, "its generation_stats")
    msg = h.stats[-1]
    assert bytes(msg.goal_id.uuid) == bytes(range(16))
    assert msg.finish_reason == result.finish_reason and msg.error_message == result.error_message
