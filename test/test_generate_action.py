# ruff: noqa: E402 - the ROS imports follow require_ros(), which skips or fails with a clear message
"""The generated interfaces work for real: Generate goal -> feedback -> result through an rclpy
ActionServer and ActionClient over DDS on loopback, cancel and reject paths, and the messages.

The server here is a stand-in that echoes the prompt word by word; it exercises exactly the
pattern the real node uses (reentrant callback group, MultiThreadedExecutor, a goal callback
that answers at once, a cancel callback that accepts).
"""

from __future__ import annotations

import math
import time

import pytest
from ros_helpers import require_ros, spin_until, spin_until_complete, wait_until

require_ros()

from action_msgs.msg import GoalStatus
from rclpy.action import ActionClient, ActionServer, CancelResponse, GoalResponse
from rclpy.callback_groups import ReentrantCallbackGroup
from rclpy.qos import QoSDurabilityPolicy, QoSProfile
from unique_identifier_msgs.msg import UUID

from memspec_interfaces.action import Generate
from memspec_interfaces.msg import CacheState, ChatMessage, DraftState, GenerationStats

ACTION = "generate"
FEEDBACK_TOPIC = f"/{ACTION}/_action/feedback"  # where rcl_action publishes a goal's feedback
TIMEOUT = 15.0


class EchoGenerator:
    """An action server that 'generates' the prompt's words back, one feedback per word."""

    def __init__(self, node, seconds_per_word: float = 0.0, client_received=None):
        self.node = node
        self.seconds_per_word = seconds_per_word
        self.client_received = client_received
        self.goals: list[Generate.Goal] = []
        self.server = ActionServer(
            node,
            Generate,
            ACTION,
            execute_callback=self.execute,
            goal_callback=self.on_goal,
            cancel_callback=lambda _request: CancelResponse.ACCEPT,
            callback_group=ReentrantCallbackGroup(),
        )

    def on_goal(self, goal: Generate.Goal) -> GoalResponse:
        return GoalResponse.ACCEPT if goal.prompt else GoalResponse.REJECT

    def execute(self, goal_handle) -> Generate.Result:
        goal = goal_handle.request
        self.goals.append(goal)
        # Feedback is best effort: wait until the client's feedback subscription has matched
        # (discovery runs in the background) so that the test may count the messages.
        wait_until(lambda: self.node.count_subscribers(FEEDBACK_TOPIC) > 0, TIMEOUT, "feedback subscriber")
        started = time.monotonic()
        result = Generate.Result(prompt_tokens=len(goal.prompt.split()), drafts_used=["general", "code"])
        for count, word in enumerate(goal.prompt.split(), start=1):
            if goal_handle.is_cancel_requested:
                result.finish_reason = Generate.Result.FINISH_CANCELLED
                goal_handle.canceled()
                return result
            result.text += word + " "
            result.completion_tokens = count
            goal_handle.publish_feedback(
                Generate.Feedback(
                    delta_text=word + " ",
                    tokens_so_far=count,
                    tokens_per_second=count / max(time.monotonic() - started, 1e-6),
                    active_draft="code" if count > 1 else "general",
                )
            )
            time.sleep(self.seconds_per_word)
        if self.client_received is not None:
            # rclpy's ActionClient drops feedback that it takes after the goal's result, and
            # feedback and result travel on different topics. A real server cannot wait for
            # this (clients treat the result as authoritative); the test server does, so that
            # the test can check every feedback message.
            count = result.completion_tokens
            wait_until(lambda: self.client_received() >= count, TIMEOUT, "the client to take every feedback")
        result.finish_reason = Generate.Result.FINISH_LENGTH
        result.tokens_per_second = result.completion_tokens / max(time.monotonic() - started, 1e-6)
        result.time_to_first_token = 0.001
        result.mean_accepted_tokens = 2.5
        result.draft_switches = 1
        goal_handle.succeed()
        return result


@pytest.fixture
def pair(make_node, executor):
    """(server, client) on two nodes in one MultiThreadedExecutor, the client connected."""

    def build(seconds_per_word: float = 0.0, client_received=None):
        server = EchoGenerator(make_node("echo_generator"), seconds_per_word, client_received)
        client_node = make_node("generate_client")
        client = ActionClient(client_node, Generate, ACTION)
        executor.add_node(server.node)
        executor.add_node(client_node)
        spin_until(executor, client.server_is_ready, TIMEOUT, "the Generate action server")
        return server, client

    return build


def test_goal_defaults_are_the_documented_node_default_sentinels():
    goal = Generate.Goal(prompt="hi")
    assert goal.max_new_tokens == 0
    assert goal.temperature < 0.0
    assert goal.top_p <= 0.0
    assert goal.seed == -1
    assert list(goal.stop) == []
    assert list(goal.messages) == [] and goal.raw is False  # prompt only; chat template when the model has one
    assert (ChatMessage.ROLE_SYSTEM, ChatMessage.ROLE_USER, ChatMessage.ROLE_ASSISTANT) == (
        "system",
        "user",
        "assistant",
    )
    constants = {
        Generate.Result.FINISH_STOP: "stop",
        Generate.Result.FINISH_LENGTH: "length",
        Generate.Result.FINISH_EOS: "eos",
        Generate.Result.FINISH_CANCELLED: "cancelled",
        Generate.Result.FINISH_ERROR: "error",
    }
    assert all(value == expected for value, expected in constants.items())


def test_goal_feedback_result_round_trip_over_dds(pair, executor):
    feedback: list[Generate.Feedback] = []
    server, client = pair(client_received=lambda: len(feedback))
    prompt = "draft and verify four tokens"
    messages = [ChatMessage(role="system", content="Be brief."), ChatMessage(role="user", content="Hi")]
    goal = Generate.Goal(prompt=prompt, max_new_tokens=16, stop=["\n\n", "###"], temperature=0.0, top_p=0.9, seed=7,
                         messages=messages, raw=True)

    handle = spin_until_complete(
        executor, client.send_goal_async(goal, feedback_callback=lambda msg: feedback.append(msg.feedback)),
        TIMEOUT, "goal acceptance",
    )
    assert handle.accepted
    response = spin_until_complete(executor, handle.get_result_async(), TIMEOUT, "the result")
    words = prompt.split()

    assert response.status == GoalStatus.STATUS_SUCCEEDED
    result = response.result
    assert result.text == prompt + " "
    assert result.finish_reason == Generate.Result.FINISH_LENGTH
    assert result.error_message == ""
    assert (result.prompt_tokens, result.completion_tokens) == (len(words), len(words))
    assert result.tokens_per_second > 0.0
    assert result.mean_accepted_tokens == pytest.approx(2.5)
    assert list(result.drafts_used) == ["general", "code"]
    assert result.draft_switches == 1

    assert "".join(f.delta_text for f in feedback) == result.text
    assert [f.tokens_so_far for f in feedback] == list(range(1, len(words) + 1))
    assert [f.active_draft for f in feedback] == ["general"] + ["code"] * (len(words) - 1)

    received = server.goals[0]  # the goal crossed DDS unchanged
    assert received.prompt == prompt
    assert (received.max_new_tokens, received.seed) == (16, 7)
    assert list(received.stop) == ["\n\n", "###"]
    assert [(m.role, m.content) for m in received.messages] == [("system", "Be brief."), ("user", "Hi")]
    assert received.raw is True
    assert received.temperature == 0.0
    assert received.top_p == pytest.approx(0.9)


def test_cancel_returns_partial_text(pair, executor):
    _server, client = pair(seconds_per_word=0.05)
    prompt = " ".join(f"w{i}" for i in range(200))
    feedback: list[Generate.Feedback] = []
    handle = spin_until_complete(
        executor,
        client.send_goal_async(Generate.Goal(prompt=prompt), feedback_callback=lambda m: feedback.append(m.feedback)),
        TIMEOUT, "goal acceptance",
    )
    spin_until(executor, lambda: len(feedback) >= 2, TIMEOUT, "the first feedback")
    cancel = spin_until_complete(executor, handle.cancel_goal_async(), TIMEOUT, "the cancel response")
    assert len(cancel.goals_canceling) == 1
    response = spin_until_complete(executor, handle.get_result_async(), TIMEOUT, "the result")

    assert response.status == GoalStatus.STATUS_CANCELED
    assert response.result.finish_reason == Generate.Result.FINISH_CANCELLED
    assert response.result.text and prompt.startswith(response.result.text)
    assert response.result.completion_tokens < 200


def test_invalid_goal_is_rejected_and_never_executed(pair, executor):
    server, client = pair()
    handle = spin_until_complete(executor, client.send_goal_async(Generate.Goal(prompt="")), TIMEOUT, "goal response")
    assert not handle.accepted and server.goals == []


def test_cache_state_and_generation_stats_cross_dds(make_node, executor):
    publisher_node, subscriber_node = make_node("cache_state_publisher"), make_node("cache_state_listener")
    latched = QoSProfile(depth=1, durability=QoSDurabilityPolicy.TRANSIENT_LOCAL)
    received: dict[str, object] = {}
    subscriber_node.create_subscription(CacheState, "cache_state", lambda m: received.setdefault("cache", m), latched)
    subscriber_node.create_subscription(
        GenerationStats, "generation_stats", lambda m: received.setdefault("stats", m), latched
    )
    executor.add_node(subscriber_node)

    drafts = [
        DraftState(name="code", domain="code", state=DraftState.RESIDENT, is_active=True, in_working_set=True,
                   score=0.8, size_bytes=4_000_000),
        DraftState(name="law", domain="law", state=DraftState.LOADING, in_working_set=True, score=0.5,
                   size_bytes=4_000_000),
        DraftState(name="math", domain="math", state=DraftState.FAILED, score=math.nan, size_bytes=4_000_000,
                   error="weights unreadable: restore models/math"),
    ]
    cache = CacheState(capacity=2, budget_bytes=8_000_000, bytes_resident=8_000_000, active_draft="code",
                       drafts=drafts, hits=10, misses=2, loads=3, evictions=1, wasted_prefetches=1, load_seconds=0.25)
    cache.header.stamp = publisher_node.get_clock().now().to_msg()
    stats = GenerationStats(goal_id=UUID(uuid=list(range(16))), finish_reason="eos", completion_tokens=12,
                            drafts_used=["code"], policy="memspec", iterations=5, decode_seconds=0.1)
    publisher_node.create_publisher(CacheState, "cache_state", latched).publish(cache)
    publisher_node.create_publisher(GenerationStats, "generation_stats", latched).publish(stats)

    spin_until(executor, lambda: len(received) == 2, TIMEOUT, "CacheState and GenerationStats")
    got = received["cache"]
    assert [d.state for d in got.drafts] == [DraftState.RESIDENT, DraftState.LOADING, DraftState.FAILED]
    assert [d.name for d in got.drafts if d.is_active] == [got.active_draft] == ["code"]
    assert math.isnan(got.drafts[2].score) and got.drafts[2].error
    assert (got.capacity, got.hits, got.misses, got.wasted_prefetches) == (2, 10, 2, 1)
    assert got.header.stamp == cache.header.stamp
    assert list(received["stats"].goal_id.uuid) == list(range(16))
    assert DraftState().state == DraftState.IN_STORAGE  # the zero value means "not loaded"
