"""A behaviour-tree client for memspec_node with py_trees: one action behaviour, one example tree.

:class:`Generate` is the py_trees counterpart of a BehaviorTree.ROS2 ``RosActionNode``: it sends a
Generate goal on its first tick and returns RUNNING until the result, then

* SUCCESS   the goal SUCCEEDED; ``result`` holds the Generate.Result (text and statistics) and the
            text is written to the blackboard key ``result_key``;
* FAILURE   ``prompt_key`` holds no text on the blackboard (nothing is sent), the server is missing
            (``server_timeout``), the goal was not answered within ``server_timeout``
            of sending it (a lost request or reply: as BehaviorTree.ROS2's SEND_GOAL_TIMEOUT), the server
            went away while the goal ran (gone for ``server_timeout``), no result came within
            ``result_timeout`` (0: no limit; the goal is then cancelled), or the goal was REJECTED (node not
            active, empty or too long prompt, bad messages, queue full), ABORTED (``error_message``) or
            CANCELED; ``outcome`` and ``feedback_message`` say which.

A BT only needs ``prompt`` (or ``prompt_key``): the node sends it to an instruct model as one user
turn. ``messages`` ((role, content) pairs; then no prompt) and ``raw`` are passed on as the goal's
fields of the same names. A behaviour whose every goal the node would reject (whatever
``runtime.chat.check_request`` refuses: no prompt, prompt_key or messages, raw with messages, a bad role or a
misplaced system message, a conversation not ending on a user turn; a NUL in its text; max_new_tokens outside
uint32) raises ValueError when it is built.

When a parent preempts it (``terminate(INVALID)`` while RUNNING) the goal is cancelled, and the
node answers with the partial text. The behaviour never spins: like py_trees_ros, whoever ticks
the tree also spins the ROS node (an executor thread, or spin_once between ticks).

    python -m memspec_ros.ros.bt_example "def add(a, b):" --node /memspec

Ctrl-C, SIGTERM and SIGHUP preempt the tree (:func:`preempt`): the goal in flight is cancelled before the example
exits (status 130, 143, 129), so it does not run on to max_new_tokens holding the node's one generation.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Sequence

import py_trees
from py_trees.common import Status

from ..runtime.chat import check_request
from .client import DEFAULT_NODE, UINT32_MAX, ResultWatch, nul_error

# the wait for the server, and for its answer to a goal: BehaviorTree.ROS2's 1 s default failed live nodes, since
# discovery of a fresh client can take seconds (a one-off timing this session: 1.7 s and 3.0 s in 7 starts);
# memspec_client waits 10 s too
SERVER_TIMEOUT = 10.0
CANCEL_WAIT_SECONDS = 5.0  # after Ctrl-C, for the goal's answer and the cancel's (as memspec_client)


class Generate(py_trees.behaviour.Behaviour):
    """Send a Generate goal; SUCCESS with the text, FAILURE on rejection, abort or cancellation."""

    def __init__(self, name: str, node, prompt: str = "", *, action_name: str = "memspec/generate",
                 prompt_key: str = "", result_key: str = "generated_text", max_new_tokens: int = 0,
                 messages: Sequence[tuple[str, str]] = (), raw: bool = False,
                 server_timeout: float = SERVER_TIMEOUT, result_timeout: float = 0.0) -> None:
        super().__init__(name)
        if messages and (prompt or prompt_key):  # refused here, not by the node at every tick
            raise ValueError(f"Generate {name!r}: give messages (the whole conversation, the last a user turn) or a"
                             " prompt / prompt_key (one user turn), not both")
        self.messages = [(str(role), str(content)) for role, content in messages]
        # what the node would reject in every goal, refused once here: an empty prompt went out at every tick, and
        # raw with messages, a bad role or a conversation not ending on the user's turn were rejected at every tick
        # with "see its log"; a max_new_tokens out of the goal's uint32 raised out of tree.tick(). (Whether the
        # model has a chat template is the node's to say.)
        if not 0 <= max_new_tokens <= UINT32_MAX:
            raise ValueError(f"Generate {name!r}: max_new_tokens {max_new_tokens} is outside 0..{UINT32_MAX} (0: the"
                             " node's generation.max_new_tokens)")
        reason = check_request("x" if prompt_key else prompt, self.messages, raw, templated=True)
        if reason:
            raise ValueError(f"Generate {name!r}: {reason}")
        texts = [("the prompt", "" if prompt_key else prompt)] + [
            (f"messages[{i}]", content) for i, (_, content) in enumerate(self.messages)]
        for what, text in texts:  # a NUL: the node would answer only the text before it (memspec_client refuses it)
            if why := nul_error(text):
                raise ValueError(f"Generate {name!r}: {what}: {why}")
        self.node = node
        self.prompt = prompt
        self.raw = raw
        self.prompt_key = prompt_key
        self.result_key = result_key
        self.action_name = action_name
        self.max_new_tokens = max_new_tokens
        self.server_timeout = server_timeout
        self.result_timeout = result_timeout
        self.client = None
        self.blackboard = self.attach_blackboard_client(name=name)
        self.blackboard.register_key(result_key, access=py_trees.common.Access.WRITE)
        if prompt_key:
            self.blackboard.register_key(prompt_key, access=py_trees.common.Access.READ)
        self._reset()

    def _reset(self) -> None:
        self.goal_future = None
        self.goal_handle = None
        self.result_future = None
        self.cancel_future = None  # the node's answer to the cancel of a preempted goal
        self._run = None  # the goal in flight's token (_send): its callbacks act on this behaviour only while current
        self.result = None
        # succeeded | rejected | aborted | canceled | no-server | no-prompt | send-goal-timeout | server-gone |
        # result-timeout
        self.outcome = ""
        self.streamed = ""
        self._started = 0.0
        self._sent = 0.0  # when the goal was sent, then when it was accepted
        self._watch = None  # the accepted goal's result (client.ResultWatch)

    def setup(self, **kwargs) -> None:
        from memspec_interfaces.action import Generate as GenerateAction

        from .action_client import SafeActionClient

        # the tree's node usually spins on another thread: rclpy's own client can lose the goal's answer
        self.client = SafeActionClient(self.node, GenerateAction, self.action_name)

    def initialise(self) -> None:
        self._reset()
        self._started = time.monotonic()
        self.feedback_message = "waiting for the server"

    def _prompt(self) -> str | None:
        """The prompt to send; None (with feedback_message saying why) when prompt_key holds no text."""
        if not self.prompt_key:
            return self.prompt
        try:
            prompt = self.blackboard.get(self.prompt_key)
        except KeyError:  # never written: raised out of tree.tick() instead of failing this behaviour
            self.feedback_message = f"the blackboard has no {self.prompt_key!r} (prompt_key): nothing to send"
            return None
        if not isinstance(prompt, str):
            self.feedback_message = (f"the blackboard's {self.prompt_key!r} (prompt_key) is a {type(prompt).__name__},"
                                     " not text: nothing to send")
            return None
        if not prompt.strip():  # the node rejects it: FAILURE with nothing sent, as the docstring says
            self.feedback_message = f"the blackboard's {self.prompt_key!r} (prompt_key) holds no text: nothing to send"
            return None
        if why := nul_error(prompt):  # the node would answer only the text before it
            self.feedback_message = f"the blackboard's {self.prompt_key!r} (prompt_key): {why}"
            return None
        return prompt

    def _send(self, prompt: str) -> None:
        from memspec_interfaces.action import Generate as GenerateAction
        from memspec_interfaces.msg import ChatMessage

        messages = [ChatMessage(role=role, content=content) for role, content in self.messages]
        goal = GenerateAction.Goal(prompt=prompt, messages=messages, raw=self.raw, max_new_tokens=self.max_new_tokens)
        run = self._run = object()  # this goal's: a preempted goal's late feedback must not write into the next run
        self.goal_future = self.client.send_goal_async(
            goal, feedback_callback=lambda msg: self._on_feedback(msg) if self._run is run else None)
        self._sent = time.monotonic()
        self.feedback_message = "goal sent"

    def _on_feedback(self, msg) -> None:
        self.streamed += msg.feedback.delta_text
        self.feedback_message = f"{msg.feedback.tokens_so_far} tokens ({msg.feedback.active_draft or 'target'})"

    def update(self) -> Status:
        from action_msgs.msg import GoalStatus

        if self.goal_future is None:
            if not self.client.server_is_ready():
                if time.monotonic() - self._started > self.server_timeout:
                    self.outcome = "no-server"
                    self.feedback_message = f"no action server at {self.action_name}"
                    return Status.FAILURE
                return Status.RUNNING
            prompt = self._prompt()
            if prompt is None:
                self.outcome = "no-prompt"
                return Status.FAILURE
            self._send(prompt)
        if self.goal_handle is None:
            if not self.goal_future.done():
                if time.monotonic() - self._sent > self.server_timeout:  # the request or its reply was lost
                    self.goal_future.add_done_callback(self._canceller())  # an answer after all: cancelled
                    self.outcome = "send-goal-timeout"
                    self.feedback_message = f"the node did not answer the goal within {self.server_timeout:g} s"
                    return Status.FAILURE
                return Status.RUNNING
            self.goal_handle = self.goal_future.result()
            if not self.goal_handle.accepted:
                self.outcome = "rejected"
                self.feedback_message = "goal rejected by the node (see its log / diagnostics)"
                return Status.FAILURE
            self._watch = ResultWatch(self.client, self.goal_handle, self.server_timeout)
            self.result_future = self._watch.future
            self._sent = time.monotonic()
        if not self.result_future.done():
            return self._waiting_for_result()
        response = self.result_future.result()
        self.result = response.result
        if response.status == GoalStatus.STATUS_SUCCEEDED:
            self.outcome = "succeeded"
            self.blackboard.set(self.result_key, self.result.text)
            self.feedback_message = f"{self.result.completion_tokens} tokens, {self.result.tokens_per_second:.0f} tok/s"
            return Status.SUCCESS
        if response.status == GoalStatus.STATUS_ABORTED:
            self.outcome = "aborted"
            self.feedback_message = f"goal aborted: {self.result.error_message}"
        elif response.status == GoalStatus.STATUS_UNKNOWN:  # the server answering does not know the goal
            self.outcome = "server-gone"
            self.feedback_message = (f"the action server at {self.action_name} no longer knows the goal (it was"
                                     " restarted): no result will come")
        else:
            self.outcome = "canceled"
            self.feedback_message = "goal cancelled"
        return Status.FAILURE

    def _waiting_for_result(self) -> Status:
        """RUNNING, or FAILURE once the server has been gone for ``server_timeout`` (the node died: no result will
        come) or ``result_timeout`` has passed (the goal is cancelled)."""
        there = self._watch.poll(self.server_timeout)  # asked again where a restarted server would leave it RUNNING
        self.result_future = self._watch.future
        if not there:
            self.outcome = "server-gone"
            self.feedback_message = f"the action server at {self.action_name} went away while the goal ran"
            return Status.FAILURE
        if self.result_timeout > 0 and time.monotonic() - self._sent > self.result_timeout:
            self.cancel_future = self.goal_handle.cancel_goal_async()  # it would hold the node's one generation
            self.outcome = "result-timeout"
            self.feedback_message = f"no result within {self.result_timeout:g} s: goal cancelled"
            return Status.FAILURE
        return Status.RUNNING

    def terminate(self, new_status: Status) -> None:
        """Preempted while RUNNING: cancel the goal (the node honours it at the next iteration), also one whose
        acceptance has not been seen yet: it is cancelled when the answer comes, else it would run to its end
        and hold the node's one generation."""
        if new_status != Status.INVALID or self.outcome:
            # a run that has ended keeps its outcome (a parent stops every child: a second cancel of a timed-out
            # goal, and "canceled" over "send-goal-timeout" or "server-gone"); what it left running is settled by
            # whoever ends the tree (settle()). Its outcome, not its status: py_trees sets the status after update()
            # returns, so a re-run interrupted in its first tick still reads the last run's
            return
        if self.goal_handle is None and self.goal_future is not None:
            self.goal_future.add_done_callback(self._canceller())  # runs at once if the answer is in
        elif self.goal_handle is not None and self.goal_handle.accepted \
                and self.result_future is not None and not self.result_future.done():
            self.cancel_future = self.goal_handle.cancel_goal_async()
        else:
            return
        self.outcome = "canceled"
        self.feedback_message = "preempted: goal cancelled"

    def _canceller(self):
        """A goal future's done callback that cancels the goal if it was accepted; the cancel's answer is this run's
        cancel_future only while this run is the behaviour's (a re-tick must not read an old goal's as its own)."""
        run = self._run

        def cancel_if_accepted(goal_future) -> None:
            handle = goal_future.result() if not goal_future.cancelled() else None
            if handle is not None and handle.accepted:
                future = handle.cancel_goal_async()
                if self._run is run:
                    self.cancel_future = future

        return cancel_if_accepted

    def goal_settled(self) -> bool:
        """Whether the node holds no goal of this behaviour's that nobody watches: none sent, rejected, ended, or
        its cancel answered (the node then ends it at its next iteration)."""
        if self.goal_future is None or self.outcome == "server-gone":  # (no node left to hold it)
            return True
        if not self.goal_future.done():
            return False
        handle = None if self.goal_future.cancelled() else self.goal_future.result()
        if handle is None or not handle.accepted:
            return True
        if self.result_future is not None and self.result_future.done():
            return True
        return self.cancel_future is not None and self.cancel_future.done()


def preempt(tree: py_trees.trees.BehaviourTree, spin_once, wait_seconds: float = CANCEL_WAIT_SECONDS) -> bool:
    """Stop ``tree`` as a parent preempting it would (Ctrl-C): every Generate cancels its goal, also one whose
    acceptance has not been seen yet; ``spin_once()`` is called until the node has answered those cancels, at most
    ``wait_seconds``. True if it has."""
    generates = [b for b in tree.root.iterate() if isinstance(b, Generate)]
    for behaviour in generates:  # also one interrupted inside its first tick, before it was marked RUNNING
        behaviour.stop(Status.INVALID)
    tree.root.stop(Status.INVALID)
    return settle(tree, spin_once, wait_seconds)


def settle(tree: py_trees.trees.BehaviourTree, spin_once, wait_seconds: float = CANCEL_WAIT_SECONDS) -> bool:
    """Spin until no Generate of ``tree`` leaves a goal behind on the node (goal_settled), at most ``wait_seconds``:
    a goal that failed by a timeout was cancelled by a callback or a request that only a spin delivers, and a
    program that ended at once left it running to max_new_tokens, holding the node's one generation. True if so."""
    generates = [b for b in tree.root.iterate() if isinstance(b, Generate)]
    deadline = time.monotonic() + wait_seconds
    while not all(b.goal_settled() for b in generates):
        if time.monotonic() > deadline:
            return False
        spin_once()
    return True


def create_example_tree(node, prompt: str, action_name: str = "memspec/generate",
                        **goal_fields) -> py_trees.trees.BehaviourTree:
    """answer = Selector[Generate(prompt), canned reply]: the robot always says something.
    ``goal_fields``: messages, raw, max_new_tokens, server_timeout, result_timeout for the Generate behaviour."""
    root = py_trees.composites.Selector("answer", memory=False)
    generate = Generate("generate", node, prompt, action_name=action_name, **goal_fields)
    canned = py_trees.behaviours.Success("canned reply")
    root.add_children([generate, canned])
    tree = py_trees.trees.BehaviourTree(root)
    tree.setup(timeout=5.0)
    return tree


def main(argv: list[str] | None = None) -> int:
    import argparse

    import rclpy
    from rclpy.executors import SingleThreadedExecutor
    from rclpy.signals import SignalHandlerOptions
    from rclpy.utilities import remove_ros_args

    from ..argtypes import message_text, non_negative_float, positive_float, prompt_text
    from .client import exit_code, for_terminal, node_name, signals_interrupt

    parser = argparse.ArgumentParser(prog="bt_example", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("prompt", type=prompt_text)
    parser.add_argument("--node", type=node_name, default=DEFAULT_NODE,
                        help=f"the node's name, in this node's namespace unless it starts with /"
                             f" (default {DEFAULT_NODE})")
    parser.add_argument("--system", metavar="TEXT", type=message_text,
                        help="system message before the prompt (chat-template models)")
    parser.add_argument("--raw", action="store_true", help="plain continuation, no chat template")
    parser.add_argument("--server-timeout", type=positive_float, default=SERVER_TIMEOUT, metavar="SECONDS",
                        help=f"wait for the server and for its answer to the goal (default {SERVER_TIMEOUT:g})")
    parser.add_argument("--result-timeout", type=non_negative_float, default=0.0, metavar="SECONDS",
                        help="cancel the goal and fail without a result by then (default 0: no limit)")
    # --ros-args (an enclave, remaps) are rclpy's, as for memspec_client
    full = sys.argv if argv is None else ["bt_example", *argv]
    args = parser.parse_args(remove_ros_args(full)[1:])
    if args.raw and args.system is not None:
        parser.error("--raw cannot take a --system message")
    fields = {"raw": args.raw, "server_timeout": args.server_timeout, "result_timeout": args.result_timeout}
    if args.system is not None:
        fields["messages"] = [("system", args.system), ("user", args.prompt)]
    # our Ctrl-C, not rclpy's handler (which shuts the context down before the goal could be cancelled)
    rclpy.init(args=full, signal_handler_options=SignalHandlerOptions.NO)
    node = rclpy.create_node(f"memspec_bt_example_{os.getpid()}")  # two at once: two names (ros2 node list)
    executor = SingleThreadedExecutor()
    executor.add_node(node)
    try:
        prompt = "" if args.system is not None else args.prompt
        tree = create_example_tree(node, prompt, args.node.rstrip("/") + "/generate", **fields)
        generate = tree.root.children[0]
        try:
            with signals_interrupt():  # SIGTERM, SIGHUP: as Ctrl-C, the goal is cancelled first
                while True:
                    tree.tick()
                    if tree.root.status != Status.RUNNING:
                        break
                    executor.spin_once(timeout_sec=0.05)
                # a goal accepted after its request timed out is cancelled here: interrupted meanwhile, the cancel
                # is still waited for below
                settled = settle(tree, lambda: executor.spin_once(timeout_sec=0.05))
        except KeyboardInterrupt as exc:
            print("\ninterrupted: cancelling the goal", file=sys.stderr)
            if not preempt(tree, lambda: executor.spin_once(timeout_sec=0.05)):
                print(f"the node did not answer the cancel within {CANCEL_WAIT_SECONDS:g} s", file=sys.stderr)
            return exit_code(exc)
        if not settled:
            print(f"the node did not answer within {CANCEL_WAIT_SECONDS:g} s: a goal of this run may still be"
                  " running on it (its answer to the goal, or to the cancel, never came)", file=sys.stderr)
        print(py_trees.display.unicode_tree(tree.root, show_status=True))
        print(f"generate: {generate.outcome or 'not run'} - {generate.feedback_message}")
        if generate.result is not None:
            print(for_terminal(sys.stdout, generate.result.text))
        return 0 if generate.outcome == "succeeded" else 1
    finally:
        executor.shutdown(timeout_sec=1.0)
        node.destroy_node()
        rclpy.try_shutdown()


if __name__ == "__main__":
    raise SystemExit(main())
