"""`memspec_client`: send one Generate goal and stream the text as feedback arrives.

    memspec_client "def fibonacci(n):" --max-new-tokens 64
    echo "The licensee may" | memspec_client --node /robot/memspec
    memspec_client "Which cup is closer?" --system "You are the voice of a kitchen robot. Be brief."
    memspec_client --raw "Once upon a time"
    memspec_client --chat --system "You are the voice of a kitchen robot. Be brief."

With an instruct model (its tokenizer has a chat template) the node sends the prompt as one user
turn and the model answers it; --system sends a system message before it (both in the goal's
`messages`); --raw continues the text as is, without the template. --chat holds a conversation:
each line read (a prompt argument first) is the next user turn, each goal carries the whole
conversation so far, so the node's prompt cache encodes only the new turn; end it with Ctrl-D.
A turn the node rejects for its length (the reason it puts on /diagnostics) is sent again without the oldest
exchange (the system message stays), as often as there is one to drop: a conversation that outgrew
generation.max_prompt_tokens goes on. Rejected for another reason, the turn fails and the conversation is kept;
with no reason in time, exchanges are dropped anyway and put back if the turn is rejected even alone.

Like ``ros2 action send_goal --feedback``: the text is printed as it is generated, then the
result's statistics. Exit status: 0 succeeded, 1 rejected / aborted / no server, 2 usage,
130 interrupted by Ctrl-C, 143 by SIGTERM, 129 by SIGHUP, 141 when the output closed (`| head`): in
each case the goal is cancelled first.
"""

from __future__ import annotations

import argparse
import math
import os
import re
import signal
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

# a goal past the node's bounds was sent only to be rejected with a message that could not say which: the parser
# refuses it, naming the limit
from ..argtypes import message_text
from .goal_limits import MAX_STOP_CHARS, MAX_STOP_STRINGS, MAX_TEMPERATURE, MAX_TOP_P, is_length_rejection

# relative, as ROS names are by default: resolved in the client's namespace (the root one: /memspec), so a client
# started with `--ros-args -r __ns:=/robot1` finds /robot1/memspec without --node
DEFAULT_NODE = "memspec"
# The ranges of the Generate goal fields the numeric flags fill: outside them a value failed at serialization with
# a SystemError traceback, or wrapped silently (uint32 4294967296 became 0, the node's default), so argparse refuses
# it with the flag's name (exit status 2).
UINT32_MAX = 2**32 - 1
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
FLOAT32_MAX = 3.4028234663852886e38  # the largest finite float32: beyond it the field holds inf


@dataclass
class Outcome:
    status: str  # succeeded | canceled | aborted | rejected | no-server | server-gone | timeout | interrupted
    result: object | None = None
    streamed: str = ""
    feedback_messages: int = 0
    goal_response_seconds: float = 0.0
    lines: list[str] = field(default_factory=list)
    exit_code: int = 130  # interrupted: Interrupted.code (Ctrl-C 130, SIGTERM 143, SIGHUP 129, output closed 141)

    @property
    def ok(self) -> bool:
        return self.status == "succeeded"


class Interrupted(KeyboardInterrupt):
    """Ctrl-C, SIGTERM or SIGHUP, or the output closed: as Ctrl-C, the client cancels its goal before it exits,
    then exits with ``code``. A KeyboardInterrupt, so every path that cancels on Ctrl-C cancels on these too."""

    def __init__(self, code: int = 130) -> None:
        super().__init__()
        self.code = code


def exit_code(exc: BaseException) -> int:
    return getattr(exc, "code", 130)


@contextmanager
def signals_interrupt() -> Iterator[None]:
    """SIGTERM and SIGHUP raise :class:`Interrupted` (128 + the signal) while the block runs: they ended the client
    at once, and its goal ran on unwatched to max_new_tokens, holding the node's one generation (a `timeout`, a
    CI kill, a dropped ssh session). rclpy's own handlers are off (they shut the context down before a cancel)."""
    def raise_interrupted(signum: int, _frame) -> None:
        raise Interrupted(128 + signum)

    previous = {}
    try:
        for sig in (signal.SIGTERM, signal.SIGHUP):
            previous[sig] = signal.signal(sig, raise_interrupted)
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


# control characters but newline and tab (C0, DEL, C1): a model's text, which a prompt can steer, is not the
# terminal's to obey (an ESC or CSI sequence retitles the window, moves the cursor, writes to the clipboard); and the
# bidirectional controls and invisible characters (word joiners, tag characters), with which it could reorder or
# hide what the terminal shows; line and paragraph separators become newlines
_CONTROLS = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\u061c\u200e\u200f\u202a-\u202e\u2060-\u2064\u2066-\u2069"
                       "\U000e0000-\U000e007f]")
_LINE_SEPARATORS = str.maketrans({"\u2028": "\n", "\u2029": "\n"})


def for_terminal(out, text: str) -> str:
    """``text`` without control, bidirectional and invisible characters (line and paragraph separators as newlines)
    where ``out`` is a terminal (a pipe or file gets the text as it is)."""
    isatty = getattr(out, "isatty", None)
    return _CONTROLS.sub("", text.translate(_LINE_SEPARATORS)) if isatty is not None and isatty() else text


def _say(log, text: str) -> None:
    """A notice on ``log``; one that cannot be written (stderr is the closed pipe too: `2>&1 | head`) must not keep
    the client from cancelling its goal."""
    try:
        print(text, file=log)
    except OSError:
        pass


def write_or_interrupt(out, text: str) -> None:
    """Write (:func:`for_terminal`) and flush; a closed output (the reader of a pipe ended: `| head -n 3`) raises
    :class:`Interrupted` (141, as a shell reports SIGPIPE), so the goal nobody reads is cancelled. The standard
    output is pointed at the null device first: Python's flush at exit would fail on it again."""
    try:
        out.write(for_terminal(out, text))
        out.flush()
    except OSError:
        if out is sys.stdout:
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        raise Interrupted(128 + signal.SIGPIPE) from None


def write_after_answer(out, text: str) -> int:
    """A line after an answer (its statistics), flushed here; 0, or the exit status of an output that closed
    (Interrupted's 141). Unflushed, where the reader of a pipe ended at the answer (`memspec_client ... | grep -q
    Paris`), the line stayed in stdout's buffer and Python's flush at exit failed, printing "Exception ignored ...
    BrokenPipeError" and ending with status 120 (write_or_interrupt points stdout at the null device, so nothing fails
    at exit). A single goal is done then; --chat ends there, or its next turns are answered into the null device."""
    try:
        write_or_interrupt(out, text + "\n")
    except Interrupted as closed:
        return closed.code
    return 0


def format_result(result) -> str:
    """The statistics line printed after the text (every figure is the node's, from its runtime stats)."""
    drafts = ", ".join(result.drafts_used) or "none (target only)"
    line = (
        f"finish: {result.finish_reason} | prompt {result.prompt_tokens} tok"
        + (f" ({result.reused_prompt_tokens} reused)" if result.reused_prompt_tokens else "")
        + f" | generated {result.completion_tokens} tok"
        f" | {result.tokens_per_second:.1f} tok/s | time to first token {result.time_to_first_token:.3f} s"
        f" | mean accepted {result.mean_accepted_tokens:.2f} | drafts {drafts} | switches {result.draft_switches}"
        + (f" | copied iterations {result.copied_iterations}" if result.copied_iterations else "")
    )
    if result.error_message:
        line += f"\nerror: {result.error_message}"
    return line


RESULT_TIMEOUT = 900.0  # seconds for a goal's result before the client cancels it (--result-timeout; 0: none)
CANCEL_WAIT_SECONDS = 5.0  # for the answer to a cancel (and to a goal request interrupted before its answer)
# the least time between two result requests for one goal while its server is there (each stays pending until the
# goal ends, then all are answered with the whole result: a --timeout of 0.05 s asked 20 times a second)
RESULT_ASKED_AGAIN_SECONDS = 10.0


def _cancel(executor, handle, result_future) -> None:
    """Cancel an accepted goal and wait a little for its result (the node ends it at its next iteration)."""
    _spin_until(executor, handle.cancel_goal_async(), CANCEL_WAIT_SECONDS)
    _spin_until(executor, result_future, 2 * CANCEL_WAIT_SECONDS)


def _cancel_when_answered(executor, goal_future, log, note: str = "") -> None:
    """Giving up before the goal's answer came: the node may accept the goal all the same, and it must not run on
    unwatched holding the node's one generation. Wait a little for the answer and cancel the goal if accepted
    (``note`` printed then)."""
    _spin_until(executor, goal_future, CANCEL_WAIT_SECONDS)
    if goal_future.done() and goal_future.result().accepted:
        if note:
            _say(log, note)
        handle = goal_future.result()
        _cancel(executor, handle, handle.get_result_async())


def send_goal(node, executor, goal, action_name: str, *, server_timeout: float = 10.0,
              result_timeout: float = RESULT_TIMEOUT, out=sys.stdout, log=sys.stderr, stream: bool = True) -> Outcome:
    """Send ``goal`` and spin ``executor`` until the result (at most ``result_timeout`` seconds, 0: no limit; then
    the goal is cancelled); print streamed text to ``out``."""
    from action_msgs.msg import GoalStatus
    from rclpy.action import ActionClient

    from memspec_interfaces.action import Generate

    client = ActionClient(node, Generate, action_name)
    outcome = Outcome("timeout")
    try:
        deadline = time.monotonic() + server_timeout
        while not client.server_is_ready():
            if time.monotonic() > deadline:
                print(f"no Generate action server at {action_name} after {server_timeout:g} s: is memspec_node running"
                      " under that name? Check ROS_DOMAIN_ID too.", file=log)
                outcome.status = "no-server"
                return outcome
            executor.spin_once(timeout_sec=0.1)

        closed: list[bool] = []  # the output closed as the text streamed: nothing more is written to it

        def on_feedback(msg) -> None:
            outcome.feedback_messages += 1
            outcome.streamed += msg.feedback.delta_text
            if stream and not closed:
                try:
                    write_or_interrupt(out, msg.feedback.delta_text)
                except Interrupted:
                    closed.append(True)
                    raise

        t0 = time.monotonic()
        future = client.send_goal_async(goal, feedback_callback=on_feedback)
        try:
            _spin_until(executor, future, server_timeout)
        except KeyboardInterrupt as exc:
            _say(log, "\ninterrupted: cancelling the goal")
            _cancel_when_answered(executor, future, log)
            outcome.status, outcome.exit_code = "interrupted", exit_code(exc)
            return outcome
        outcome.goal_response_seconds = time.monotonic() - t0
        if not future.done():
            print(f"the server did not answer the goal request within {server_timeout:g} s", file=log)
            _cancel_when_answered(executor, future, log, "the goal was accepted late: cancelling the goal")
            return outcome
        handle = future.result()
        if not handle.accepted:
            print("goal REJECTED by the node: it is not active; the prompt is empty or longer than"
                  " generation.max_prompt_tokens; prompt + max_new_tokens exceed the target's context; messages to a"
                  " model without a chat template; a system message or a raw goal while"
                  " generation.system_prompt_fixed is true; temperature above"
                  f" {MAX_TEMPERATURE:g} or top_p above {MAX_TOP_P:g} (or not a number); more than"
                  f" {MAX_STOP_STRINGS} stop strings, one over {MAX_STOP_CHARS} characters or one holding a special"
                  " token inside other text; or the goal queue is full (the node's log and /diagnostics say which)",
                  file=log)
            outcome.status = "rejected"
            return outcome
        watch = ResultWatch(client, handle, server_timeout)
        given_up = ""  # the client ended the goal: "interrupted" (Ctrl-C) or "timeout"; its result is still shown
        there = True
        try:
            there = watch.wait(executor, result_timeout or math.inf)
        except KeyboardInterrupt as exc:
            _say(log, "\ninterrupted: cancelling the goal")
            _cancel(executor, handle, watch.future)  # waits for the partial answer
            given_up, outcome.exit_code = "interrupted", exit_code(exc)
        result_future = watch.future
        if not there and not given_up:
            print(f"the Generate action server at {action_name} went away while the goal ran (gone for"
                  f" {server_timeout:g} s, --timeout): no result will come", file=log)
            outcome.status = "server-gone"
            return outcome
        if not result_future.done() and not given_up:  # (interrupted: cancelled once already, said so)
            _say(log, f"no result after {result_timeout:g} s: cancelling the goal (--result-timeout)")
            _cancel(executor, handle, result_future)  # waits for the partial answer, printed below
            given_up = "timeout"
        outcome.status = given_up or outcome.status
        if not result_future.done():
            return outcome
        response = result_future.result()
        if response.status == GoalStatus.STATUS_UNKNOWN:
            # the server answering does not know the goal (it restarted, or expired the result): its empty result
            # is no answer, so nothing of it is printed as one
            print("the Generate action server no longer knows this goal (restarted, or the result expired): no"
                  " result", file=log)
            outcome.status = given_up or "server-gone"
            return outcome
        result = response.result
        outcome.result = result
        if stream and not closed:
            # feedback is best effort: print whatever the stream missed
            missed = (result.text[len(outcome.streamed):] if result.text.startswith(outcome.streamed) else
                      "\n[feedback incomplete; the full text]\n" + result.text)
            try:
                write_or_interrupt(out, missed + "\n")
            except Interrupted as exc:  # the goal has ended: nothing to cancel
                outcome.status, outcome.exit_code = "interrupted", exc.code
                return outcome
        names = {GoalStatus.STATUS_SUCCEEDED: "succeeded", GoalStatus.STATUS_CANCELED: "canceled",
                 GoalStatus.STATUS_ABORTED: "aborted"}
        outcome.status = given_up or names.get(response.status, f"status {response.status}")
        return outcome
    finally:
        client.destroy()


class ResultWatch:
    """The result of an accepted goal, as memspec_client and bt_example's Generate wait for it: asked again when the
    server comes back after it was gone, and every ``server_timeout`` (RESULT_ASKED_AGAIN_SECONDS at least: a
    restarted node never got the request sent to the one before, and one respawned before the dead one's endpoints
    expired never looked gone; one that does not know the goal answers at once, the one running it answers every
    request when the goal ends), and given up once the server has been gone for ``server_timeout`` (the node died:
    memspec_client waited out its whole --result-timeout, 900 s). A network that drops for that long ends the wait
    the same way: no cancel can reach the node then, and its goal runs on to its end."""

    def __init__(self, client, handle, server_timeout: float) -> None:
        self.client, self.handle, self.server_timeout = client, handle, server_timeout
        self.future = handle.get_result_async()
        self.asked = time.monotonic()
        self.gone_since: float | None = None

    def poll(self, server_timeout: float) -> bool:
        """One look at the server (asking again as above); False once it has been gone for ``server_timeout``."""
        now = time.monotonic()
        if self.client.server_is_ready():
            if self.gone_since is not None or now - self.asked > max(server_timeout, RESULT_ASKED_AGAIN_SECONDS):
                self.future = self.handle.get_result_async()  # the server there now answers this one
                self.asked = now
            self.gone_since = None
            return True
        if self.gone_since is None:
            self.gone_since = now
        return now - self.gone_since <= server_timeout

    def wait(self, executor, timeout: float) -> bool:
        """Spin until the result comes or ``timeout`` s pass; False as soon as the server has been gone too long."""
        deadline = time.monotonic() + timeout
        while not self.future.done() and time.monotonic() < deadline:
            executor.spin_once(timeout_sec=0.05)
            if not self.poll(self.server_timeout):
                return False
        return True


def _spin_until(executor, future, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not future.done() and time.monotonic() < deadline:
        executor.spin_once(timeout_sec=0.05)


def build_goal(args):
    """The goal: the prompt alone, or with --system a system message and the prompt as the user's."""
    from memspec_interfaces.msg import ChatMessage

    if args.system is not None:
        return goal_from_args(args, [ChatMessage(role=ChatMessage.ROLE_SYSTEM, content=args.system),
                                     ChatMessage(role=ChatMessage.ROLE_USER, content=args.prompt)])
    return goal_from_args(args)


def goal_from_args(args, messages=None):
    """A goal with the command line's settings: ``messages`` (a conversation), else the prompt as it is."""
    from memspec_interfaces.action import Generate

    return Generate.Goal(prompt="" if messages else args.prompt, messages=list(messages or []), raw=args.raw,
                         max_new_tokens=args.max_new_tokens, stop=args.stop or [], temperature=args.temperature,
                         top_p=args.top_p, seed=args.seed)


def _earlier_exchange(history: list) -> int | None:
    """The index of the oldest user turn that has its answer after it and is not the latest turn, or None."""
    from memspec_interfaces.msg import ChatMessage

    for i in range(len(history) - 2):
        if history[i].role == ChatMessage.ROLE_USER and history[i + 1].role == ChatMessage.ROLE_ASSISTANT:
            return i
    return None


# how long a rejected turn waits for the node's next /diagnostics (published every diagnostic_updater.period, 1 s by
# default; a subscription just made may first need its discovery): it returns as soon as the status comes
REASON_WAIT_SECONDS = 10.0


class RejectionReasons:
    """Why the node rejected a goal: an action's goal response carries no reason, the node's /diagnostics do (its
    target model status: 'goals rejected', 'last rejection'). ``mark()`` before sending, ``reason()`` after a
    rejection: the reason once the count has grown past the mark, None if no such status came in time."""

    def __init__(self, node, executor, node_path: str, wait_seconds: float = REASON_WAIT_SECONDS) -> None:
        from diagnostic_msgs.msg import DiagnosticArray

        self._executor, self._wait = executor, wait_seconds
        # '<node name>: <task>', or with diagnostic_updater.use_fqn '/<ns>/<name>: <task>' (the real updater's with
        # one more leading '/'): compared without the leading slashes. The bare name is the same for a node of that
        # name in any namespace, so its status counts only where its 'node' value is this node's path
        path = node_path.strip("/")
        # the node's full name as the 'node' value gives it: a relative --node resolves in this client's namespace
        # (the action's name does), where comparing '/memspec' with '/robot1/memspec' ignored the node's own status
        namespace = "" if node_path.startswith("/") else node.get_namespace().strip("/")
        self._node = "/" + "/".join(p for p in (namespace, path) if p)
        self._statuses = {f"{path.rsplit('/', 1)[-1]}: target model", f"{self._node.lstrip('/')}: target model"}
        self._latest: tuple[int, str] | None = None
        self._mark: int | None = None
        node.create_subscription(DiagnosticArray, "/diagnostics", self._on_diagnostics, 10)

    def _on_diagnostics(self, msg) -> None:
        for status in msg.status:
            values = {kv.key: kv.value for kv in status.values}
            if (status.name.lstrip("/") in self._statuses and values.get("goals rejected", "").isdigit()
                    and values.get("node", self._node) == self._node):  # (a node from before the key: by name)
                self._latest = (int(values["goals rejected"]), values.get("last rejection", ""))

    def mark(self) -> None:
        self._mark = self._latest[0] if self._latest is not None else None

    def reason(self) -> str | None:
        deadline = time.monotonic() + self._wait
        while time.monotonic() < deadline:
            latest = self._latest
            # no count seen before sending: the first status after the rejection names the latest one, this one
            if latest is not None and (self._mark is None or latest[0] > self._mark):
                # a goal's rejection carries no reason: the node's latest is read, which is another client's where
                # one was rejected after this goal
                others = latest[0] - self._mark - 1 if self._mark is not None else 0
                self._mark = latest[0]
                return latest[1] + (f" [{others} other goal(s) were rejected since this one was sent: this reason may"
                                    " be another client's]" if others else "")
            self._executor.spin_once(timeout_sec=0.1)
        return None


def chat(node, executor, args, lines, *, out=sys.stdout, log=sys.stderr, reasons=None) -> int:
    """--chat: each non-empty line of ``lines`` is a user turn of one conversation, sent with every turn before it
    and the node's answers. A turn that fails, or is answered with no text, is left out of the conversation. The
    exit status: 0 if every turn succeeded, 1 if one did not, Interrupted.code if interrupted. ``reasons``: a
    :class:`RejectionReasons` (None: every rejection's reason unknown)."""
    from memspec_interfaces.msg import ChatMessage

    history = [ChatMessage(role=ChatMessage.ROLE_SYSTEM, content=args.system)] if args.system is not None else []
    status = 0
    action = args.node.rstrip("/") + "/generate"
    for line in lines:
        text = line.strip()
        if not text:
            continue
        if why := nul_error(text):  # not sent: the node would answer only the part before the NUL
            print(f"(this turn is not sent: {why})", file=log)
            status = 1
            continue
        history.append(ChatMessage(role=ChatMessage.ROLE_USER, content=text))

        def send():
            if reasons is not None:
                reasons.mark()
            return send_goal(node, executor, goal_from_args(args, history), action, server_timeout=args.timeout,
                             result_timeout=args.result_timeout, out=out, log=log)

        outcome = send()
        kept = list(history)  # put back if the turn is rejected even alone: then length was not the cause
        told = False  # the rejection's reason printed
        while outcome.status == "rejected" and _earlier_exchange(history) is not None:
            why = reasons.reason() if reasons is not None else None
            if why is not None and not is_length_rejection(why):
                # a full queue or a node deactivated for a moment: a shorter conversation would not help, and one
                # taken once the cause cleared would have lost its exchanges for good
                print(f"(rejected: {why}; the conversation is kept)", file=log)
                told = True
                break
            # a conversation past generation.max_prompt_tokens had every later turn rejected: the oldest exchange
            # goes (the system message stays) and the turn is sent again, until none is left to drop
            first = _earlier_exchange(history)
            del history[first:first + 2]
            print("(the oldest exchange is left out of the conversation: " + (
                "it had grown too long for the node" if why is not None else
                "the node's reason was not on /diagnostics, so in case it had grown too long") +
                "; the turn is sent again)", file=log)
            outcome = send()
        if outcome.status == "rejected" and not told and reasons is not None:
            # the last send's reason (a first turn, or one rejected even alone), as a single goal prints it: --chat
            # showed only the list of every possible reason
            why = reasons.reason()
            print(f"(rejected: {why})" if why is not None else
                  "(rejected: the node's reason did not come on /diagnostics in time; its log says why)", file=log)
        if outcome.status == "rejected" and len(history) < len(kept):
            history[:] = kept
            print("(the turn was rejected even without the earlier exchanges, so their length was not the cause:"
                  " they are put back)", file=log)
        if outcome.result is not None and not args.quiet:
            if closed := write_after_answer(out, format_result(outcome.result)):
                return closed
        elif outcome.result is not None and not outcome.ok and outcome.result.error_message:
            print(f"(goal {outcome.status}: {outcome.result.error_message})", file=log)  # --quiet: still why
        if outcome.status == "interrupted":
            return outcome.exit_code
        if not outcome.ok:
            history.pop()  # the conversation goes on without the turn that got no answer
            status = 1
            if outcome.status in ("no-server", "timeout"):
                return status
        elif not outcome.result.text.strip():
            # the node refuses a conversation with an empty turn: this one would reject every turn after it
            history.pop()
            print("(the answer was empty: this turn is left out of the conversation)", file=log)
        else:
            history.append(ChatMessage(role=ChatMessage.ROLE_ASSISTANT, content=outcome.result.text))
    return status


def _chat_lines(first: str | None):
    """The prompt argument, then stdin line by line (a prompt shown when stdin is a terminal)."""
    if first is not None:
        yield first
    while True:
        if sys.stdin.isatty():
            print("> ", end="", file=sys.stderr, flush=True)
        line = sys.stdin.readline()
        if not line:
            return
        yield line


def _integer_in(low: int, high: int, field_type: str) -> Callable[[str], int]:
    """An argparse type: an integer the goal field of ``field_type`` holds."""
    def integer(text: str) -> int:
        value = int(text)  # ValueError: argparse's "invalid integer value"
        if not low <= value <= high:
            raise argparse.ArgumentTypeError(f"{value} is out of range: {low} to {high} (the goal's {field_type})")
        return value
    return integer


def _float32(text: str) -> float:
    """An argparse type: a finite number the goal's float32 field holds as it is (not turned into inf)."""
    value = float(text)
    if not (math.isfinite(value) and abs(value) <= FLOAT32_MAX):
        raise argparse.ArgumentTypeError(f"{text} is not a finite number within +-{FLOAT32_MAX:.7g} (the goal's"
                                         " float32)")
    return value


def _float32_at_most(limit: float, meaning: str) -> Callable[[str], float]:
    """An argparse type: a _float32 no greater than ``limit`` (the node's bound on the field; ``meaning`` says what
    the field's values mean)."""
    def parse(text: str) -> float:
        value = _float32(text)
        if value > limit:
            raise argparse.ArgumentTypeError(f"{text} is above the node's limit of {limit:g} ({meaning})")
        return value

    return parse


_temperature = _float32_at_most(MAX_TEMPERATURE, "0: greedy, negative: the node's generation.temperature")
_top_p = _float32_at_most(MAX_TOP_P, "top_p is a probability mass in (0, 1]; 0: the node's generation.top_p")


def _stop_string(text: str) -> str:
    """An argparse type: a stop string no longer than the node takes."""
    if len(text) > MAX_STOP_CHARS:
        raise argparse.ArgumentTypeError(f"a stop string of {len(text)} characters: the node's limit is"
                                         f" {MAX_STOP_CHARS}")
    return text


def _seconds(text: str) -> float:
    """An argparse type: a positive, finite number of seconds (NaN waited forever, 0 or less not at all)."""
    value = float(text)
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"{text} is not a positive number of seconds")
    return value


def _non_negative_seconds(text: str) -> float:
    """An argparse type: 0 (no limit) or a positive, finite number of seconds."""
    value = float(text)
    if not (math.isfinite(value) and value >= 0):
        raise argparse.ArgumentTypeError(f"{text} is not 0 or a positive number of seconds")
    return value


def node_name(text: str) -> str:
    """An argparse type: a node name whose action ``<name>/generate`` ROS can name (a space in it ended the client
    in a traceback from the action client)."""
    from rclpy.exceptions import InvalidTopicNameException
    from rclpy.validate_topic_name import validate_topic_name

    try:
        validate_topic_name(text.rstrip("/") + "/generate")
    except InvalidTopicNameException as exc:
        raise argparse.ArgumentTypeError(f"{text!r} is no valid node name ({str(exc).splitlines()[0]})") from None
    return text


def parse_args(argv: list[str] | None):
    parser = argparse.ArgumentParser(prog="memspec_client", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("prompt", nargs="?", help="the prompt (default: read stdin)")
    parser.add_argument("--node", type=node_name, default=DEFAULT_NODE,
                        help=f"the node's name, in this client's namespace unless it starts with /"
                             f" (default {DEFAULT_NODE})")
    parser.add_argument("--max-new-tokens", type=_integer_in(0, UINT32_MAX, "uint32"), default=0,
                        help="0: the node's generation.max_new_tokens")
    parser.add_argument("--temperature", type=_temperature, default=-1.0,
                        help=f"-1: the node's default; 0: greedy; at most {MAX_TEMPERATURE:g}")
    parser.add_argument("--top-p", type=_top_p, default=0.0, help="in (0, 1]; 0: the node's default")
    parser.add_argument("--seed", type=_integer_in(INT64_MIN, INT64_MAX, "int64"), default=-1,
                        help="-1: the node's default")
    parser.add_argument("--stop", action="append", type=_stop_string,
                        help=f"stop string (repeatable: at most {MAX_STOP_STRINGS}, each at most {MAX_STOP_CHARS}"
                             " characters)")
    parser.add_argument("--system", metavar="TEXT", type=message_text,
                        help="system message sent before the prompt (chat-template models; replaces the node's"
                             " generation.system_prompt for this goal, or is rejected where the node's"
                             " generation.system_prompt_fixed is true)")
    parser.add_argument("--raw", action="store_true",
                        help="plain continuation of the prompt, no chat template (not with --system)")
    parser.add_argument(
        "--timeout", type=_seconds, default=10.0,
        help="seconds to wait for the action server, and how long it may be gone while a goal runs before the client"
             " gives up on the result (default 10)"
    )
    parser.add_argument("--result-timeout", type=_non_negative_seconds, default=RESULT_TIMEOUT, metavar="SECONDS",
                        help=f"cancel the goal if its result has not come by then (default {RESULT_TIMEOUT:g};"
                             " 0: no limit)")
    parser.add_argument("--quiet", action="store_true", help="print only the text")
    parser.add_argument("--chat", action="store_true",
                        help="a conversation: each line on stdin is the next user turn (Ctrl-D ends it)")
    args = parser.parse_args(argv)
    if args.raw and args.system is not None:
        parser.error("--raw continues the prompt as plain text: it cannot take a --system message")
    if args.raw and args.chat:
        parser.error("--chat sends a conversation through the chat template: it cannot be --raw")
    if args.stop and len(args.stop) > MAX_STOP_STRINGS:
        parser.error(f"{len(args.stop)} --stop strings: the node takes at most {MAX_STOP_STRINGS}")
    return args


def nul_error(text: str) -> str:
    """Why ``text`` cannot be sent ('' if it can): a ROS string ends at its first NUL, so the node would get only
    the text before it (Generate.action), and answer that part as if it were the whole. (A command-line argument
    cannot hold one; stdin, and a behaviour tree's strings, can.)"""
    at = text.find("\x00")
    if at < 0:
        return ""
    return (f"the text holds a NUL character at position {at}: a ROS string ends there, so the node would get only"
            f" its first {at} characters; remove it")


def stdin_prompt(stdin) -> str | None:
    """The prompt piped on stdin, without the newline that echo and a heredoc end it with (it became part of the
    prompt: a user turn of "...\\n", or a raw continuation starting a new line); None on a terminal."""
    if stdin.isatty():
        return None
    return stdin.read().rstrip("\n")


def single(node, executor, args, *, out=sys.stdout, log=sys.stderr, reasons=None) -> int:
    """One goal from ``args``: its text streamed to ``out``, its statistics after it; the exit status. A rejection
    is followed by the node's reason, read from its /diagnostics by ``reasons`` (a :class:`RejectionReasons`,
    marked before the goal is sent): the goal's response carries none, and the client listed every possible one."""
    if reasons is not None:
        reasons.mark()
    outcome = send_goal(node, executor, build_goal(args), args.node.rstrip("/") + "/generate",
                        server_timeout=args.timeout, result_timeout=args.result_timeout, out=out, log=log)
    if outcome.status == "rejected" and reasons is not None:
        why = reasons.reason()
        print(f"the node's reason: {why}" if why is not None else
              "(the node's reason did not come on /diagnostics in time)", file=log)
    if outcome.result is not None and not args.quiet:
        write_after_answer(out, format_result(outcome.result))  # a closed output: the goal is done all the same
    if outcome.status == "interrupted":
        return outcome.exit_code
    if outcome.result is not None and outcome.status != "succeeded":
        # the node's reason (in the statistics line above, which --quiet leaves out) always goes to stderr
        error = outcome.result.error_message if args.quiet else ""
        print(f"goal {outcome.status}" + (f": {error}" if error else ""), file=log)
    return 0 if outcome.ok else 1


def main(argv: list[str] | None = None) -> int:
    from rclpy.utilities import remove_ros_args

    args = parse_args(remove_ros_args(sys.argv if argv is None else ["memspec_client", *argv])[1:])
    if args.prompt is None and not args.chat:
        args.prompt = stdin_prompt(sys.stdin)
        if args.prompt is None:
            print("memspec_client: give a prompt as an argument or on stdin", file=sys.stderr)
            return 2
    if not args.chat and not args.prompt.strip():  # the node rejects it: its answer came as eight possible reasons
        said = "empty" if not args.prompt else "only whitespace"
        print(f"memspec_client: the prompt is {said}: give some text as an argument or on stdin", file=sys.stderr)
        return 2
    if not args.chat and (why := nul_error(args.prompt)):
        print(f"memspec_client: {why}", file=sys.stderr)
        return 2
    import rclpy
    from rclpy.executors import SingleThreadedExecutor
    from rclpy.signals import SignalHandlerOptions

    rclpy.init(args=argv, signal_handler_options=SignalHandlerOptions.NO)  # Ctrl-C cancels the goal first
    node = rclpy.create_node(f"memspec_client_{os.getpid()}")  # two at once: two names (ros2 node list)
    executor = SingleThreadedExecutor()
    executor.add_node(node)
    try:
        with signals_interrupt():
            reasons = RejectionReasons(node, executor, args.node)
            if args.chat:
                return chat(node, executor, args, _chat_lines(args.prompt), reasons=reasons)
            return single(node, executor, args, reasons=reasons)
    except KeyboardInterrupt as exc:
        return exit_code(exc)
    finally:
        executor.shutdown(timeout_sec=1.0)
        node.destroy_node()
        rclpy.try_shutdown()


if __name__ == "__main__":
    sys.exit(main())
