# ruff: noqa: E402 - the ROS imports follow require_ros()
"""LifecycleClient against a simulated lifecycle node whose DDS loses a request or a reply, the
discovery race CI hit: the transition must still be confirmed (or refused) exactly once."""

from __future__ import annotations

import pytest
from ros_helpers import require_ros

require_ros()  # the client builds lifecycle_msgs requests

from lifecycle_msgs.msg import Transition

from memspec_ros.ros import lifecycle_client as lc


class Future:
    def __init__(self) -> None:
        self._result = None

    def done(self) -> bool:
        return self._result is not None

    def result(self):
        return self._result


class FakeService:
    def __init__(self, name: str, handle) -> None:
        self.srv_name = name
        self.handle = handle
        self.pending: list[tuple[object, Future]] = []

    def service_is_ready(self) -> bool:
        return True

    def call_async(self, request) -> Future:
        future = Future()
        self.pending.append((request, future))
        return future


class FakeLifecycleNode:
    """A node in ``state``; ``drop_requests`` / ``drop_replies`` ChangeState messages vanish in DDS."""

    def __init__(self, state: str = "unconfigured", drop_requests: int = 0, drop_replies: int = 0,
                 drop_state_requests: int = 0, refuse: bool = False) -> None:
        self.state = state
        self.drop_requests, self.drop_replies, self.drop_state_requests = (
            drop_requests,
            drop_replies,
            drop_state_requests,
        )
        self.refuse = refuse
        self.transitions_run: list[int] = []
        self.services: dict[str, FakeService] = {}
        self.destroyed = 0
        self.event_callbacks: list = []  # ~/transition_event's subscribers
        self.subscriptions_destroyed = 0

    def create_client(self, srv_type, name: str) -> FakeService:
        service = FakeService(name, self._change if name.endswith("change_state") else self._get)
        self.services[name] = service
        return service

    def destroy_client(self, client) -> None:
        self.destroyed += 1

    def create_subscription(self, msg_type, name: str, callback, qos):
        assert name.endswith("/transition_event")
        self.event_callbacks.append(callback)
        return callback

    def destroy_subscription(self, subscription) -> None:
        self.subscriptions_destroyed += 1

    def spin(self, seconds: float) -> None:
        for service in self.services.values():
            pending, service.pending = service.pending, []
            for request, future in pending:
                service.handle(request, future)

    def _get(self, request, future: Future) -> None:
        if self.drop_state_requests:
            self.drop_state_requests -= 1
            return
        from lifecycle_msgs.srv import GetState

        response = GetState.Response()
        response.current_state.label = self.state
        future._result = response

    def _change(self, request, future: Future) -> None:
        from lifecycle_msgs.srv import ChangeState

        if self.drop_requests:
            self.drop_requests -= 1
            return
        start, goal = lc._TRANSITIONS[request.transition.id]
        ok = self.state == start and not self.refuse
        if self.state == start:  # the transition starts (and fails back to ``start`` when refused)
            from lifecycle_msgs.msg import State, TransitionEvent

            # as rcl publishes it: the states only, its ``transition`` field left empty
            event = TransitionEvent(start_state=State(label=start),
                                    goal_state=State(label=lc._STARTED_IN[request.transition.id]))
            for callback in self.event_callbacks:
                callback(event)
        if ok:
            self.state = goal
            self.transitions_run.append(request.transition.id)
        if self.drop_replies:
            self.drop_replies -= 1
            return
        future._result = ChangeState.Response(success=ok)


@pytest.fixture(autouse=True)
def fast_clock(monkeypatch):
    """Virtual time: every spin advances the clock by its timeout, so waits cost nothing."""
    clock = [1000.0]
    monkeypatch.setattr(lc.time, "monotonic", lambda: clock[0])
    return clock


def client_for(node: FakeLifecycleNode, clock) -> lc.LifecycleClient:
    def spin(seconds: float) -> None:
        clock[0] += seconds
        node.spin(seconds)

    return lc.LifecycleClient(node, "/memspec/", spin)


def test_plain_transition_and_state(fast_clock):
    node = FakeLifecycleNode()
    client = client_for(node, fast_clock)
    assert client.state() == "unconfigured"
    assert client.change_state(Transition.TRANSITION_CONFIGURE, 30.0)
    assert node.state == "inactive" and node.transitions_run == [1]
    assert (client.lost_replies, client.resent_requests) == (0, 0)
    assert set(node.services) == {"/memspec/change_state", "/memspec/get_state"}
    client.destroy()
    assert node.destroyed == 2 and node.subscriptions_destroyed == 1


def test_a_lost_reply_is_confirmed_by_get_state(fast_clock):
    node = FakeLifecycleNode(drop_replies=1)
    client = client_for(node, fast_clock)
    t0 = fast_clock[0]
    assert client.change_state(Transition.TRANSITION_CONFIGURE, 60.0)
    assert node.transitions_run == [1]  # ran once, not resent
    assert (client.lost_replies, client.resent_requests) == (1, 0)
    assert fast_clock[0] - t0 < lc.POLL_S + 1.0  # confirmed at the first poll, not at the timeout


def test_a_lost_request_is_sent_once_more(fast_clock):
    node = FakeLifecycleNode(drop_requests=1)
    client = client_for(node, fast_clock)
    assert client.change_state(Transition.TRANSITION_CONFIGURE, 60.0)
    assert node.transitions_run == [1]
    assert (client.lost_replies, client.resent_requests) == (0, 1)


def test_a_refused_transition_is_false_and_not_resent(fast_clock):
    node = FakeLifecycleNode(state="active")
    client = client_for(node, fast_clock)
    assert not client.change_state(Transition.TRANSITION_CLEANUP, 60.0)  # cleanup needs inactive
    assert node.state == "active" and node.transitions_run == []
    assert client.resent_requests == 0
    failing = FakeLifecycleNode(refuse=True)  # e.g. on_configure failed: back in unconfigured, success False
    assert not client_for(failing, fast_clock).change_state(Transition.TRANSITION_CONFIGURE, 60.0)


def test_lost_get_state_is_asked_again(fast_clock):
    node = FakeLifecycleNode(drop_state_requests=2)
    assert client_for(node, fast_clock).state(timeout=10.0) == "unconfigured"


def test_a_silent_node_times_out_with_the_service_name(fast_clock):
    node = FakeLifecycleNode(drop_requests=5)
    client = client_for(node, fast_clock)
    with pytest.raises(TimeoutError, match=r"/memspec/change_state did not answer within 30 s \(the node was"
                                           r" unconfigured"):
        client.change_state(Transition.TRANSITION_CONFIGURE, 30.0)
    assert client.resent_requests == 1  # one resend, never a storm
    with pytest.raises(ValueError, match="unknown lifecycle transition id 42"):
        client.change_state(42, 1.0)
    deaf = FakeLifecycleNode(drop_state_requests=100)
    with pytest.raises(TimeoutError, match="/memspec/get_state did not answer within 5 s"):
        client_for(deaf, fast_clock).state(timeout=5.0)


def test_a_failed_transition_whose_reply_was_lost_is_not_run_again(fast_clock):
    """The node ran the configure, it failed back to unconfigured, and its reply (success=False) was lost: the client
    took the unchanged state for a lost request and sent configure again, and the node loaded the models twice. The
    transition event says it started: the answer is False, with no second request."""
    node = FakeLifecycleNode(refuse=True, drop_replies=1)
    client = client_for(node, fast_clock)
    assert client.change_state(Transition.TRANSITION_CONFIGURE, 60.0) is False
    assert (client.lost_replies, client.resent_requests) == (1, 0)
    assert len(node.event_callbacks) == 1
