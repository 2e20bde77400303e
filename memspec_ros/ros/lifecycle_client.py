"""Drive another node's lifecycle through its services, as `ros2 lifecycle set` does, but robust to
the DDS discovery race.

A ROS 2 client reports a service ready once *its* writer has matched the server's reader; the server
may not have matched the client yet. On Fast DDS a request (or the reply) sent in that window is
dropped and never resent. CI once saw what that looks like: a configure request unanswered for
180 s, after which the node answered GetState and shut down from a state the configure had
evidently never reached. GetState is idempotent, so it may
be retried freely; ChangeState is not, so this module
1. first gets one GetState answer (a round trip proves both sides have matched),
2. then sends ChangeState and, while waiting, asks GetState every few seconds: reaching the
   transition's goal state means it happened even if its reply was lost; still sitting in the start
   state long after sending means the request was lost, and it is sent once more, unless the node's
   ~/transition_event showed the transition start: then it ran and failed back to the start state, its
   reply lost, and a second request would run it again (a configure loading the models twice).
"""

from __future__ import annotations

import time
from collections.abc import Callable

# transition id -> (state it starts from, state it ends in), lifecycle_msgs/msg/Transition ids
_TRANSITIONS: dict[int, tuple[str, str]] = {
    1: ("unconfigured", "inactive"),  # configure
    2: ("inactive", "unconfigured"),  # cleanup
    3: ("inactive", "active"),  # activate
    4: ("active", "inactive"),  # deactivate
    5: ("unconfigured", "finalized"),  # unconfigured shutdown
    6: ("inactive", "finalized"),  # inactive shutdown
    7: ("active", "finalized"),  # active shutdown
}
# the state a transition passes through (lifecycle_msgs' intermediate states): rcl's ~/transition_event names
# states only (its ``transition`` field is left empty), so a transition that started is an event into this state
_STARTED_IN = {1: "configuring", 2: "cleaningup", 3: "activating", 4: "deactivating", 5: "shuttingdown",
               6: "shuttingdown", 7: "shuttingdown"}
STATE_RETRY_S = 2.0  # a GetState unanswered this long is asked again
POLL_S = 3.0  # GetState while a transition is under way
RESEND_AFTER_S = 10.0  # still in the start state this long after sending: the request was lost


class LifecycleClient:
    """ChangeState / GetState clients for the node named ``target`` (e.g. ``/memspec``).

    ``spin(seconds)`` lets callbacks run: ``executor.spin_once`` when the caller owns the executor,
    ``time.sleep`` when an executor already spins in another thread.
    """

    def __init__(self, node, target: str, spin: Callable[[float], None]) -> None:
        from lifecycle_msgs.msg import TransitionEvent
        from lifecycle_msgs.srv import ChangeState, GetState

        self._node = node
        self._spin = spin
        self.target = target.rstrip("/")
        self._change = node.create_client(ChangeState, f"{self.target}/change_state")
        self._get = node.create_client(GetState, f"{self.target}/get_state")
        # (when received, start state, goal state) of the node's transition events. A start event published before
        # this subscription matched is missed (the topic keeps nothing): the client then resends, as before
        self._events: list[tuple[float, str, str]] = []
        self._event_sub = node.create_subscription(
            TransitionEvent, f"{self.target}/transition_event",
            lambda event: self._events.append((time.monotonic(), event.start_state.label, event.goal_state.label)),
            10)
        self.lost_replies = 0  # transitions confirmed by GetState because their reply never came
        self.resent_requests = 0

    def destroy(self) -> None:
        self._node.destroy_client(self._change)
        self._node.destroy_client(self._get)
        self._node.destroy_subscription(self._event_sub)

    def _wait_ready(self, client, deadline: float) -> None:
        while not client.service_is_ready():
            if time.monotonic() > deadline:
                raise TimeoutError(f"service {client.srv_name} did not appear: is the node running, with this"
                                   " ROS_DOMAIN_ID?")
            self._spin(0.05)

    def state(self, timeout: float = 10.0) -> str:
        """The node's current state label; GetState is asked again whenever an answer is overdue."""
        from lifecycle_msgs.srv import GetState

        deadline = time.monotonic() + timeout
        self._wait_ready(self._get, deadline)
        while time.monotonic() < deadline:
            future = self._get.call_async(GetState.Request())
            retry_at = min(deadline, time.monotonic() + STATE_RETRY_S)
            while not future.done() and time.monotonic() < retry_at:
                self._spin(0.05)
            if future.done():
                return future.result().current_state.label
        raise TimeoutError(f"service {self._get.srv_name} did not answer within {timeout:g} s")

    def change_state(self, transition_id: int, timeout: float) -> bool:
        """Ask for a transition; True when the node reports it done (or reaches its goal state)."""
        from lifecycle_msgs.msg import Transition
        from lifecycle_msgs.srv import ChangeState, GetState

        if transition_id not in _TRANSITIONS:
            raise ValueError(f"unknown lifecycle transition id {transition_id}")
        start, goal = _TRANSITIONS[transition_id]
        deadline = time.monotonic() + timeout
        self._wait_ready(self._change, deadline)
        before = self.state(max(0.1, deadline - time.monotonic()))  # the handshake
        request = ChangeState.Request(transition=Transition(id=transition_id))
        sent_at = time.monotonic()  # before the request: its start event may arrive before call_async returns
        replies = [self._change.call_async(request)]
        poll = None
        poll_at = sent_at + POLL_S
        while time.monotonic() < deadline:
            if any(f.done() and f.result().success for f in replies):
                return True
            if all(f.done() for f in replies):
                return False
            now = time.monotonic()
            if poll is None and now >= poll_at:
                poll, poll_at = self._get.call_async(GetState.Request()), now + POLL_S
            if poll is not None and poll.done():
                label = poll.result().current_state.label
                poll = None
                if label == goal and before != goal:
                    self.lost_replies += 1
                    return True
                if label == start and len(replies) == 1 and now - sent_at > RESEND_AFTER_S:
                    if any(at >= sent_at and (was, now) == (start, _STARTED_IN[transition_id])
                           for at, was, now in self._events):
                        self.lost_replies += 1  # it started and failed back: its reply (False) was lost
                        return False
                    self.resent_requests += 1
                    replies.append(self._change.call_async(request))
            elif poll is not None and now >= poll_at:
                poll = None  # that GetState was lost too: ask again on the next turn
            self._spin(0.05)
        raise TimeoutError(f"service {self._change.srv_name} did not answer within {timeout:g} s"
                           f" (the node was {before} before the request)")
