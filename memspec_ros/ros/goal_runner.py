"""The goals of ``~/generate``: checked, queued, run one at a time, answered.

rclpy's pattern for queued goals (ros2/examples ``rclpy/actions/server_queue_goals.py``)::

    goal callback      checks only (node active, the request, its characters before any tokenizing,
                       its tokens, the context, room in the FIFO) and answers at once; an accepted
                       request reserves its place as a Job carrying the prompt's token ids
    accepted callback  the goal handle takes its Job: executed at once when no goal runs, else queued
    execute callback   an executor task: RuntimeController.generate on the checked token ids, feedback
                       published from that thread (throttled), the outcome mapped onto the goal's state,
                       its result and ~/generation_stats; then the next queued goal is executed
    cancel callback    accepts: the running goal stops at its next iteration with its partial text; a
                       queued goal leaves the FIFO at once (its slot free) and ends CANCELED, and so does one
                       cancelled before its accepted callback came (rclpy answers the goal request first)

So exactly one generation runs, on the executor thread of its execute callback; the executor's other
threads stay free for goal requests, lifecycle, parameter and diagnostics services.
"""

from __future__ import annotations

import functools
import math
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from rclpy.action import ActionServer, CancelResponse, GoalResponse
from rclpy.impl.implementation_singleton import rclpy_implementation as _rclpy
from rclpy.qos import DurabilityPolicy, HistoryPolicy, QoSProfile, ReliabilityPolicy

from memspec_interfaces.action import Generate

from ..runtime.chat import (
    SYSTEM,
    ChatError,
    check_request,
    has_chat_template,
    prompt_ids,
    stop_string_error,
    system_prompt_applies,
)
from ..runtime.speculative import input_rows
from ..runtime.stats import GenerationStats
from .diagnostics import ThroughputWindow, generation_stats_msg, stats_fields
from .goal_limits import LENGTH_LIMITS, MAX_STOP_CHARS, MAX_STOP_STRINGS, MAX_TEMPERATURE, MAX_TOP_P

RCLError = _rclpy.RCLError  # what rclpy raises for a goal state change its state machine refuses

ACTION_NAME = "~/generate"
DEACTIVATE_WAIT_SECONDS = 30.0  # how long ending the goals waits for the running one's next iteration
# goal/cancel/result services: rclpy's 10 drops a burst of goals unanswered; 100 holds one, memory bounded
ACTION_SERVICE_QOS = QoSProfile(history=HistoryPolicy.KEEP_LAST, depth=100, reliability=ReliabilityPolicy.RELIABLE,
                                durability=DurabilityPolicy.VOLATILE)
CANCELING_WAIT_SECONDS = 5.0  # rclpy marks a goal CANCELING only after the cancel callback returned
CANCELING_POLL_SECONDS = 0.001
# rclpy calls the accepted callback in the same task, milliseconds after the goal callback, unless sending the
# goal response failed (the client went away) or the goal handle could not be made (a duplicate goal id): then
# never. A reservation older than this is such an orphan and gives its place back.
RESERVATION_TIMEOUT_SECONDS = 10.0
NOT_ACTIVE_TODO = {"unconfigured": "configure and activate it", "inactive": "activate it",
                   "finalized": "start the node again"}
# A goal's bounds: goal_limits.py. Positive temperatures below GREEDY_BELOW decode greedily (softmax(logits / T) is
# the argmax's one-hot long before T reaches float32's smallest values, where it turns into NaN; vLLM draws the
# same line).
GREEDY_BELOW = 1e-5

ERROR = Generate.Result.FINISH_ERROR
CANCELLED = Generate.Result.FINISH_CANCELLED


# the longest rejection reason kept (the log line, /diagnostics' 'last rejection'): a reason quoting what a client
# sent is cut there
MAX_REASON_CHARS = 2000


@dataclass(eq=False)
class Job:
    """One accepted goal: reserved by the goal callback, given its handle by the accepted callback."""

    request: Generate.Goal
    prompt_ids: list[int]  # tokenized and checked once, in the goal callback
    # the goal's settings with the node's generation.* defaults as they were at acceptance: the context check
    # was made with them, and a queued goal runs with them whatever the defaults become while it waits
    max_new_tokens: int = 0
    sampling: Any = None  # runtime.speculative.SamplingConfig
    goal_handle: Any = None
    accepted_at: float = 0.0  # time.perf_counter() when the goal callback accepted it (time to first token, orphans)
    abort_reason: str | None = None  # the node is deactivating or going: end with the partial text
    cancel_requested: bool = False  # cancelled while reserved: the accepted callback ends it instead of queueing it
    # its result once built: at the end of a run (before its terminal state is set) or when it ended before it ran
    result: Generate.Result | None = None
    counted: bool = False  # counted among the finished goals (once per goal, whatever fails after)
    # called once the goal's execute callback is done with the models (release_when_over)
    when_over: list[Callable[[], None]] = field(default_factory=list)


def ros_text(text: str) -> str:
    """ROS strings cannot carry NUL (the C layer would cut the text there): drop it."""
    return text.replace("\x00", "") if "\x00" in text else text


def fill_result(result: Generate.Result, stats: GenerationStats, time_to_first_token: float | None = None) -> None:
    for name, value in stats_fields(stats, time_to_first_token).items():
        setattr(result, name, value)


def _use_threads(threads: int) -> None:
    """torch's thread count is OpenMP's, kept per thread: an executor thread that ran torch before a configure set
    model.threads would go on with its old count, and the kernels take the count from the calling thread."""
    import torch

    if threads and torch.get_num_threads() != threads:
        torch.set_num_threads(threads)


def settle(goal_handle, finish_reason: str) -> None:
    """The goal's terminal state for its finish reason."""
    if finish_reason == ERROR:
        goal_handle.abort()
    elif finish_reason == CANCELLED:
        goal_handle.canceled()
    else:
        goal_handle.succeed()


class FeedbackThrottle:
    """Feedback per committed chunk, published on the generation thread, at most one message per ``period`` s.

    Chunks that come sooner join the next message; ``flush`` publishes what is left before the result.
    A DDS write takes microseconds and happens at most once a period, so it stays off the hot path.
    """

    def __init__(self, goal_handle, cache, period: float, logger) -> None:
        self.goal_handle, self.cache, self.period, self.logger = goal_handle, cache, period, logger
        self._chunks: list[str] = []  # the whole text so far (an aborted goal's partial result)
        self._sent = 0  # chunks already published
        self._tokens = 0
        self.first_at = 0.0  # time.perf_counter() of the first token (the prefill's); 0 before it
        self._latest = 0.0
        self._decode_from, self._decode_base = 0.0, 0  # when decoding started, and the tokens before it
        self._last_publish = -math.inf
        self._broken = False
        # the draft decoding as the newest chunk came: the final flush, after generate() returned, found the
        # cache's active draft already cleared for the next goal and reported the target alone
        self._active = ""

    @property
    def text(self) -> str:
        return "".join(self._chunks)

    @property
    def tokens(self) -> int:
        """The tokens behind ``text``."""
        return self._tokens

    def on_decode_start(self) -> None:
        """Decoding starts (RuntimeController.generate): the running rate is timed from here, as the result's
        tokens_per_second is (the first token, the prefill's, and the first draft's choice and load before it
        are not decoding)."""
        self._decode_from, self._decode_base = time.perf_counter(), self._tokens

    def on_chunk(self, delta: str, token_ids: list[int]) -> None:
        now = time.perf_counter()
        if not self._tokens:
            self.first_at = now
        self._tokens += len(token_ids)
        self._latest = now
        self._chunks.append(delta)
        self._active = self.cache.active
        if now - self._last_publish >= self.period:
            self._publish(now)

    def flush(self) -> None:
        if self._sent < len(self._chunks):
            self._publish(time.perf_counter())

    def _publish(self, now: float) -> None:
        if self._broken:
            return
        delta, self._sent = "".join(self._chunks[self._sent:]), len(self._chunks)
        decoded, elapsed = self._tokens - self._decode_base, self._latest - self._decode_from
        try:
            self.goal_handle.publish_feedback(Generate.Feedback(
                delta_text=ros_text(delta), tokens_so_far=self._tokens,
                tokens_per_second=decoded / elapsed if self._decode_from and elapsed > 0 and decoded > 0 else 0.0,
                active_draft=self._active,
            ))
        except Exception as exc:  # the server went under us (shutdown): the result still goes out
            self._broken = True
            self.logger.warning(f"feedback stopped for this goal: {type(exc).__name__}: {exc}")
        self._last_publish = now


def publish_unless_destroyed(pub, msg, still_ours: Callable[[], bool]) -> bool:
    """``pub.publish(msg)``; False where that failed because the node destroyed ``pub`` meanwhile (a transition on
    another thread: ``still_ours()`` is False then), any other failure raised."""
    try:
        pub.publish(msg)
    except Exception:
        if still_ours():
            raise
        return False
    return True


def _with_system(system: str) -> str:
    """Where a length refusal counts the node's system prompt: say so (a long one fails every chat goal)."""
    return f" with generation.system_prompt's {len(system)} characters" if system else ""


def _ttft(job: Job, feedback: FeedbackThrottle) -> float | None:
    """From acceptance, queue wait included, to the first token (the prefill's), as Generate.action defines it;
    None before the first token."""
    return feedback.first_at - job.accepted_at if feedback.first_at and job.accepted_at else None


def partial_stats(job: Job, feedback: FeedbackThrottle, policy: str) -> GenerationStats:
    """What a generation that raised got done: its runtime statistics died with it, but the tokens behind its
    partial text were counted as they streamed (Generate.action: completion_tokens counts those behind ``text``),
    and ``policy`` ran it (GenerationStats.msg)."""
    return GenerationStats(prompt_tokens=len(job.prompt_ids), completion_tokens=feedback.tokens, policy=policy)


class GoalRunner:
    """The Generate action server, its FIFO of accepted goals and the one generation that runs.

    ``open`` (activate) hands it the loaded runtime: goals are accepted from then on. ``end_goals``
    (deactivate, shutdown, error) refuses new goals and ends the running and queued ones ABORTED with a
    reason; ``close`` (SIGINT/SIGTERM, destroy_node) does so for good and waits until their results are
    with rclpy.
    """

    def __init__(self, node, window: ThroughputWindow, callback_group) -> None:
        self._node = node
        self._window = window
        self._cv = threading.Condition()
        self._reserved: list[Job] = []  # accepted by the goal callback, waiting for their handles
        # the requests of orphans this runner ended through rclpy's stored handle (_live_reservations): an accepted
        # callback that still comes for one is ignored, not a second ending of the same goal (the last few kept)
        self._ended_orphans: deque = deque(maxlen=64)
        self._queue: deque[Job] = deque()
        self._running: Job | None = None
        self._unanswered = 0  # accepted goals whose result rclpy does not have yet
        self._freeing = 0  # goals over whose models are being freed now (release_when_over's calls still running)
        self._loaded = None  # the runtime while goals are accepted (open .. end_goals)
        self._stats_pub = None
        self._ended_with = ""  # why the goals were ended: for a goal accepted just before
        self._closing = ""  # why no goal is taken again (close)
        self.goals_rejected = 0
        self.last_rejection = ""  # the latest rejection's reason (also on /diagnostics)
        self.last_error = ""  # why the latest goal failed, '' once one succeeds
        self.server = ActionServer(
            node, Generate, ACTION_NAME,
            execute_callback=self.execute,
            goal_callback=self.on_goal,
            handle_accepted_callback=self.on_accepted,
            cancel_callback=self.on_cancel,
            callback_group=callback_group,
            goal_service_qos_profile=ACTION_SERVICE_QOS,
            result_service_qos_profile=ACTION_SERVICE_QOS,
            cancel_service_qos_profile=ACTION_SERVICE_QOS,
            result_timeout=self._param("action.result_keep_seconds"),
        )

    # -- what the node calls ----------------------------------------------------------------------
    def open(self, loaded, stats_pub) -> bool:
        """Take goals on ``loaded``; False (nothing changes) once the runner is closing: an activate that interleaves
        with a shutdown must not let a late accepted callback start a goal during it."""
        with self._cv:
            if self._closing:
                return False
            self._loaded, self._stats_pub = loaded, stats_pub
            self.last_error = ""  # a goal that failed before this activation is not its state (diagnostics)
            return True

    def end_goals(self, reason: str, wait_seconds: float | None = None) -> bool:
        """Refuse new goals; end the queued goals now and the running one at its next iteration, ABORTED
        with ``reason``; returns once the running goal is over, True, or after ``wait_seconds`` (default
        DEACTIVATE_WAIT_SECONDS), False (a goal that has not reached its next iteration yet: it still ends ABORTED
        when it does)."""
        with self._cv:
            self._loaded, self._ended_with = None, reason
            queued, self._queue = list(self._queue), deque()
            if self._running is not None:
                self._running.abort_reason = reason
        self._end_unrun_logged(queued, reason, "a queued goal")  # (the queue is emptied already)
        over = self.wait_idle(DEACTIVATE_WAIT_SECONDS if wait_seconds is None else wait_seconds)
        with self._cv:
            self._stats_pub = None
        return over

    def wait_idle(self, seconds: float) -> bool:
        """Wait up to ``seconds`` until no goal runs and none is between its two callbacks; True if so."""
        deadline = time.monotonic() + seconds
        with self._cv:
            # in steps: an orphaned reservation turns stale with time alone, with nothing to notify
            while self._running is not None or self._freeing or self._live_reservations():
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cv.wait(min(left, 1.0))
        return True

    def release_when_over(self, free: Callable[[], None]) -> bool:
        """``free()`` (the models' release) now if no goal runs, else once the running goal is done with the
        models; True if now. For after ``end_goals``: no other goal can start with the models it ended."""
        with self._cv:
            job = self._running
            if job is not None:
                job.when_over.append(free)
        if job is None:
            free()
        return job is None

    def close(self, reason: str, results_out_seconds: float) -> bool:
        """Take no goal again, end the goals (``end_goals``) and wait up to ``results_out_seconds`` until
        rclpy has their results; True if there were any. The executor must still spin: rclpy sends a
        result from a task of its own after the execute callback returned it."""
        self._closing = self._closing or reason
        with self._cv:
            had_goals = self._unanswered > 0
        self.end_goals(self._closing)
        with self._cv:
            self._cv.wait_for(lambda: self._unanswered <= 0, results_out_seconds)
        return had_goals

    @property
    def closing(self) -> str:
        """Why goals are no longer taken ("" while they are): close() has ended them for good."""
        return self._closing

    def counts(self) -> tuple[bool, int]:
        """(a goal runs, goals queued)."""
        with self._cv:
            return self._running is not None, len(self._queue)

    def rejections(self) -> tuple[int, str]:
        """The goals rejected so far and the latest one's reason, read together."""
        with self._cv:
            return self.goals_rejected, self.last_rejection

    def models_in_use(self) -> bool:
        """A goal runs, or the models of one that just ended are still being freed (release_when_over): new models
        loaded now would be a second set in memory."""
        with self._cv:
            return self._running is not None or self._freeing > 0

    @contextmanager
    def no_goal_starting(self) -> Iterator[None]:
        """Holds back the start of a goal."""
        with self._cv:
            yield

    def destroy(self) -> None:
        self.server.destroy()

    # -- goal callback: checks only -----------------------------------------------------------------
    def on_goal(self, goal: Generate.Goal) -> GoalResponse:
        reason = self._check(goal)
        if len(reason) > MAX_REASON_CHARS:  # it goes to the log, and onto every /diagnostics message until the next
            reason = reason[:MAX_REASON_CHARS] + f" ... ({len(reason)} characters in all)"
        if reason:
            with self._cv:  # goal callbacks run in a reentrant group: two rejections at once lost a count
                self.goals_rejected += 1
                # with its count (rejections()): /diagnostics published the new count beside the previous reason,
                # which memspec_client --chat took for its own
                self.last_rejection = reason
            self._node.get_logger().warning(f"goal rejected: {reason}")
            return GoalResponse.REJECT
        return GoalResponse.ACCEPT

    def _check(self, goal: Generate.Goal) -> str:
        """'' when accepted (its Job reserved), else the reason; cheap checks first."""
        lo = self._loaded
        if self._closing or lo is None:
            return self._not_taking()
        messages = [(m.role, m.content) for m in goal.messages]
        templated = has_chat_template(lo.tokenizer)
        reason = check_request(goal.prompt, messages, goal.raw, templated)
        if reason:  # roles, emptiness, raw with messages, messages without a template
            return reason
        if self._param("generation.system_prompt_fixed"):
            if messages and messages[0][0] == SYSTEM:  # (messages passed check_request: the model has a template)
                return ("messages[0] is a system message, and this node's system prompt is fixed"
                        " (generation.system_prompt_fixed is true): send the conversation without one")
            if goal.raw and templated:  # a raw prompt writes its own turns, a system turn too, never the node's
                return ("raw goals are refused while this node's system prompt is fixed"
                        " (generation.system_prompt_fixed is true): send the prompt as a chat goal")
        reason = self._settings_error(goal) or stop_string_error(goal.stop, lo.tokenizer, lo.controller.eos_token_ids)
        if reason:
            return reason
        limit = self._param("generation.max_prompt_tokens")
        if lo.max_positions:
            limit = min(limit, lo.max_positions - 1)
        system = self._param("generation.system_prompt")
        system = system if system_prompt_applies(lo.tokenizer, messages, goal.raw, system) else ""
        reason = self._characters_error(goal, messages, limit, lo.max_token_chars, system)
        if reason:
            return reason
        try:
            ids = prompt_ids(lo.tokenizer, goal.prompt, messages, goal.raw, system)
        except ChatError as exc:  # the chat template failed (a sandbox refusal included)
            return str(exc)
        except Exception as exc:  # never let a tokenizer error escape the goal callback
            return f"the prompt could not be tokenized: {type(exc).__name__}: {exc}"
        new_tokens = self._max_new_tokens(goal)
        return (self._tokens_error(ids, new_tokens, limit, lo.max_positions, system)
                or self._vocabulary_error(ids, input_rows(lo.target.model))
                or self._reserve(Job(goal, ids, new_tokens, self._sampling(goal)), lo))

    @staticmethod
    def _vocabulary_error(ids: list[int], rows: int) -> str:
        """A token id past the target's embedding (a tokenizer with more tokens than the model has rows): the
        runtime refuses it, which accepted the goal only to abort it; rejected here, as Generate.action promises."""
        bad = sorted({t for t in ids if not 0 <= t < rows}) if rows else []
        if not bad:
            return ""
        return (f"the prompt holds token id(s) {bad[:8]} outside the target's {rows} embedding rows: its tokenizer"
                " has tokens the model cannot take (a tokenizer and a model of different vocabularies?)")

    def _not_taking(self) -> str:
        """Why no goal is taken now (closing, or the node is not active)."""
        if self._closing:
            return f"{self._closing}: no new goals"
        state = self._node.lifecycle_state
        todo = NOT_ACTIVE_TODO.get(state, "wait for its transition and activate it")
        return f"the node is not active (state {state}): {todo} first"

    @staticmethod
    def _settings_error(goal: Generate.Goal) -> str:
        """Sampling values and stop strings out of their documented ranges (no tokenizer work)."""
        if not math.isfinite(goal.temperature) or goal.temperature > MAX_TEMPERATURE:
            return (f"temperature {goal.temperature} out of range: 0 (greedy), up to {MAX_TEMPERATURE:g}, or negative"
                    " for the node default")
        if math.isnan(goal.top_p) or goal.top_p > MAX_TOP_P:  # any negative, -inf too, means the node default
            return f"top_p {goal.top_p} out of range: (0, 1], or 0 / negative for the node default"
        if len(goal.stop) > MAX_STOP_STRINGS:  # every entry, the empty ones too: the bound on the callback's work
            return f"{len(goal.stop)} stop strings, more than the limit of {MAX_STOP_STRINGS}"
        longest = max((len(s) for s in goal.stop), default=0)
        if longest > MAX_STOP_CHARS:
            return f"a stop string has {longest} characters, more than the limit of {MAX_STOP_CHARS}"
        return ""

    @staticmethod
    def _characters_error(goal: Generate.Goal, messages: list, limit: int, max_token_chars: int,
                          system: str = "") -> str:
        """Before any tokenizing (a 1 MB prompt took 0.5 s and 350 MB to tokenize): a text longer than
        ``limit`` times the most characters one token stands for can never fit in ``limit`` tokens. ``system``:
        the generation.system_prompt this goal is rendered with (its characters count too)."""
        if len(messages) > limit:  # every turn takes tokens of the template's own: 80,000 one-character messages
            # passed the characters' bound, and rendered to 540,000 tokens before the token count refused them
            return (f"{len(messages)} messages, more than the limit of {limit} tokens can hold (every turn takes"
                    f" at least one; {LENGTH_LIMITS})")
        chars = len(goal.prompt) + sum(len(content) for _, content in messages) + len(system)
        if chars <= limit * max_token_chars:
            return ""
        what = "the messages have" if messages else "the prompt has"
        return (f"{what} {chars} characters{_with_system(system)}, more than the limit of {limit} tokens can hold"
                f" (at most {max_token_chars} characters per token for this tokenizer; {LENGTH_LIMITS})")

    @staticmethod
    def _tokens_error(ids: list[int], new_tokens: int, limit: int, max_positions: int, system: str = "") -> str:
        """The prompt's tokens against generation.max_prompt_tokens and, with the new tokens, the context."""
        if len(ids) > limit:
            return (f"the prompt has {len(ids)} tokens{_with_system(system)}, more than the limit of {limit}"
                    f" ({LENGTH_LIMITS})")
        if max_positions and len(ids) + new_tokens > max_positions:
            return (f"prompt ({len(ids)} tokens{_with_system(system)}) + max_new_tokens ({new_tokens}) exceeds the"
                    f" target's context of {max_positions} tokens: shorten the prompt or ask for fewer tokens"
                    f" ({LENGTH_LIMITS})")
        return ""

    def _reserve(self, job: Job, loaded) -> str:
        """A place for the goal now, so that concurrent goal callbacks see it; else why not. ``loaded``: the runtime
        the goal was checked against; if the goals were ended meanwhile (deactivate while this callback tokenized),
        the goal is rejected, not accepted to be aborted."""
        room = 1 + self._param("action.max_queued_goals")
        with self._cv:
            if self._loaded is not loaded or self._closing:
                return self._not_taking()
            self._live_reservations()
            taken = len(self._reserved) + len(self._queue) + (self._running is not None)
            if taken >= room:
                waiting = taken - (self._running is not None)
                return f"the goal queue is full ({waiting} waiting, action.max_queued_goals {room - 1}): retry later"
            job.accepted_at = time.perf_counter()
            self._reserved.append(job)
            self._unanswered += 1
        return ""

    def _live_reservations(self) -> list[Job]:
        """The reservations still waiting for their accepted callback; orphans (see RESERVATION_TIMEOUT_SECONDS)
        are dropped, so they hold no queue place and no deactivate waits for them. Called holding ``_cv``."""
        stale = time.perf_counter() - RESERVATION_TIMEOUT_SECONDS
        orphans = [job for job in self._reserved if job.accepted_at < stale]
        if orphans:
            self._reserved = [job for job in self._reserved if job.accepted_at >= stale]
            # rclpy made and stored the goal handle before its goal response failed: that goal stood ACCEPTED on
            # ~/generate/_action/status for the node's life, and a result request for it was never answered. It
            # is ended ABORTED (its result then counts it answered); one with no handle (its id taken) has none
            handles = list(getattr(self.server, "_goal_handles", {}).values())
            ended = []
            for job in orphans:
                job.goal_handle = next((h for h in handles if getattr(h, "request", None) is job.request), None)
                if job.goal_handle is None:
                    self._unanswered -= 1
                else:
                    ended.append(job)
                    self._ended_orphans.append(job.request)
            self._node.get_logger().warning(
                f"{len(orphans)} accepted goal(s) never reached the accepted callback within"
                f" {RESERVATION_TIMEOUT_SECONDS:g} s (rclpy could not send the goal response: the client went"
                " away, or the goal id was taken): their queue places are free again"
                + (f"; {len(ended)} of them ended ABORTED" if ended else ""))
            if ended:  # outside this lock, which the callers hold (ending takes rclpy's goal lock)
                threading.Thread(target=self._end_unrun_logged, name="memspec-end-orphans", args=(
                    ended, "rclpy could not send the goal response (the client went away before it)",
                    "an orphaned goal"),
                                 daemon=True).start()
        return self._reserved

    def _end_unrun_logged(self, jobs: list[Job], reason: str, what: str) -> None:
        """_end_unrun for each job, a failure logged (the jobs after it are still ended) and its answer no longer
        counted: it never comes (_answer), and close() waited its whole results_out_seconds for it, at every close
        after (the executor shut down before the node's destruction: rclpy's create_task raises then)."""
        for job in jobs:
            try:
                self._end_unrun(job, reason)
            except Exception as exc:
                self._node.get_logger().error(f"ending {what} failed: {type(exc).__name__}: {exc}")
                with self._cv:
                    self._unanswered -= 1
                    self._cv.notify_all()

    # -- accepted callback: queue the handle ----------------------------------------------------------
    def on_accepted(self, goal_handle) -> None:
        late = ""  # why the goal ends unrun although the node takes goals
        with self._cv:
            if any(r is goal_handle.request for r in self._ended_orphans):  # ended already, by its stored handle
                return
            # rclpy hands this callback the very request object the goal callback checked
            job = next((j for j in self._reserved if j.request is goal_handle.request), None)
            if job is None:  # so late that its reservation was dropped as an orphan: answered, never run
                job, late = Job(goal_handle.request, []), (
                    f"its accepted callback came more than {RESERVATION_TIMEOUT_SECONDS:g} s after the goal was"
                    " accepted (an overloaded executor?): send it again")
                self._unanswered += 1
            else:
                self._reserved.remove(job)
            job.goal_handle = goal_handle
            ended = bool(late) or self._loaded is None  # or the goals were ended between the two callbacks
            takes_place = not ended and not job.cancel_requested
            start = takes_place and self._running is None
            if start:
                self._running = job
            elif takes_place:
                self._queue.append(job)
            self._cv.notify_all()
        if job.cancel_requested:  # the client asked first: CANCELED, whatever else happened meanwhile
            self._end_unrun(job, "", cancelled=True)
        elif ended:
            self._end_unrun(job, late or self._ended_with)
        elif start:
            self._execute(goal_handle)

    # -- cancel callback --------------------------------------------------------------------------------
    def on_cancel(self, goal_handle) -> CancelResponse:
        """Accept every cancel (rclpy's default rejects). The running goal stops at its next iteration with
        the partial text; a queued goal leaves the FIFO now and ends CANCELED without waiting for it."""
        with self._cv:
            job = next((j for j in self._queue if j.goal_handle is goal_handle), None)
            if job is not None:
                self._queue.remove(job)
            else:
                self._mark_reserved_cancelled(goal_handle)
        if job is not None:
            self._end_unrun(job, "", cancelled=True)
        return CancelResponse.ACCEPT

    def _mark_reserved_cancelled(self, goal_handle) -> None:
        """rclpy sends the goal response and publishes the goal before it calls the accepted callback: a cancel taken
        in that gap finds the goal still reserved, neither queued nor running. Marked, it ends CANCELED in its
        accepted callback instead of being queued to hold a slot until the running goal ends. Called holding
        ``_cv``."""
        job = next((j for j in self._reserved if j.request is goal_handle.request), None)
        if job is not None:
            job.cancel_requested = True

    # -- execute callbacks ------------------------------------------------------------------------------
    def execute(self, goal_handle) -> Generate.Result:
        """The execute callback: the running goal's generation, on this executor thread; then the next goal."""
        job = self._running  # set when its handle was executed; only this callback clears it
        try:
            result = self._generate(job)
        except Exception as exc:  # a goal ends with a result, whatever happened
            error = f"{type(exc).__name__}: {exc}"
            self._node.get_logger().error(f"goal failed unexpectedly: {error}")
            self.last_error = error
            if job.result is None and not job.counted:  # it failed before its result: one stats message for it still
                try:
                    result = self._result(job, ERROR, error=error)
                except Exception:  # the publisher gone too: a result all the same (rclpy's, never a traceback)
                    result = Generate.Result(prompt_tokens=len(job.prompt_ids), finish_reason=ERROR,
                                             error_message=error)
            elif job.result is None:  # counted, then its message failed: the result alone
                result = Generate.Result(prompt_tokens=len(job.prompt_ids), finish_reason=ERROR, error_message=error)
            else:  # its result and statistics went out, then setting its terminal state failed: the text stays
                result = job.result
                result.finish_reason, result.error_message = ERROR, error
            if goal_handle.is_active:
                goal_handle.abort()
        finally:
            with self._cv:
                self._running = self._queue.popleft() if self._queue else None
                following = self._running
                when_over, job.when_over = job.when_over, []
                self._freeing += bool(when_over)  # in the same critical section: models_in_use() sees no gap
                self._unanswered -= 1
                self._cv.notify_all()
            if when_over:
                # on a thread of its own: the goal's result goes out now, not after the models' release (a draft
                # cache's close waits up to CLOSE_WAIT_SECONDS for a read hung on failing storage);
                # models_in_use() holds a configure back until it is done. Not a daemon: the interpreter waits
                # for it at exit, as it waited for this callback's thread, rather than cutting a release short
                try:
                    threading.Thread(target=self._free_after, args=(when_over,), name="memspec-free-models").start()
                except RuntimeError:  # no thread to be had: freed here, or _freeing would never come back down
                    self._free_after(when_over)
            if following is not None:
                self._execute(following.goal_handle)
        return result

    def _execute(self, goal_handle, callback=None) -> None:
        """``goal_handle.execute(callback)``, whatever a cancel does meanwhile: rclpy reads is_cancel_requested, then
        applies EXECUTE under the goal's lock, so a cancel accepted in between makes EXECUTE invalid from CANCELING
        and execute() raises (at the next queued goal's start it left the finished goal's result unsent and
        _running naming a goal never run: every later goal queued forever). Its execute callback is scheduled all
        the same; both callbacks handle a goal that is CANCELING."""
        try:
            goal_handle.execute(callback)
        except RCLError:
            if not goal_handle.is_cancel_requested:  # another refusal (a goal executed twice?): not this race
                raise
            self.server.notify_execute(goal_handle, callback)

    def _free_after(self, calls: list[Callable[[], None]]) -> None:
        """release_when_over's calls for a goal that has ended, then no longer counted as freeing."""
        try:
            self._run_when_over(calls)
        finally:
            with self._cv:
                self._freeing -= 1
                self._cv.notify_all()

    def _run_when_over(self, calls: list[Callable[[], None]]) -> None:
        """What waited for this goal to be done with the models (release_when_over); a failure is logged, never
        the end of the goals that follow."""
        for call in calls:
            try:
                call()
            except Exception as exc:
                self._node.get_logger().error(f"freeing the models after the goal: {type(exc).__name__}: {exc}")

    def _generate(self, job: Job) -> Generate.Result:
        lo, gh = self._loaded, job.goal_handle
        if gh.is_cancel_requested:  # first: the client's own cancel, accepted, is what it gets (not ABORTED)
            return self._end(job, CANCELLED)
        if job.abort_reason or lo is None:
            return self._end(job, ERROR, error=job.abort_reason or "the node was cleaned up before the goal started")
        feedback = FeedbackThrottle(gh, lo.controller.cache, self._param("action.feedback_period"),
                                    self._node.get_logger())
        goal = job.request
        _use_threads(lo.threads)
        # a client that went away is invisible to an action server: its goal would run to its budget holding the
        # node's one generation, unless the operator bounds how long a goal may run
        limit = self._param("action.max_goal_seconds")
        deadline = time.perf_counter() + limit if limit > 0 else math.inf
        try:
            out = lo.controller.generate(
                job.prompt_ids, job.max_new_tokens, job.sampling, list(goal.stop), feedback.on_chunk,
                lambda: job.abort_reason is not None or gh.is_cancel_requested or time.perf_counter() > deadline,
                feedback.on_decode_start,
            )
        except Exception as exc:  # a failed goal is ABORTED with the reason, never a traceback
            feedback.flush()
            error = self.last_error = f"{type(exc).__name__}: {exc}"
            self._node.get_logger().error(f"goal aborted: {error}")
            done = partial_stats(job, feedback, lo.controller.config.policy)
            return self._end(job, ERROR, feedback.text, done, error, _ttft(job, feedback), measured=False)
        feedback.flush()
        ttft = _ttft(job, feedback)
        if job.abort_reason is not None and out.finish_reason == CANCELLED and not gh.is_cancel_requested:
            # deactivate / shutdown cut it: the partial text, ABORTED (one that landed after the last iteration
            # leaves a finished answer, which is settled as what it is). A goal its client had cancelled ends
            # CANCELED, as Generate.action says: its cancel was accepted, and ABORTED told it the cancel did not count
            return self._end(job, ERROR, out.text, out.stats, job.abort_reason, ttft)
        if out.finish_reason == CANCELLED and not gh.is_cancel_requested and time.perf_counter() > deadline:
            return self._end(job, ERROR, out.text, out.stats, f"the goal ran past action.max_goal_seconds"
                             f" ({limit:g} s) and was ended with its partial text", ttft)
        return self._end(job, out.finish_reason, out.text, out.stats, ttft=ttft)

    def _end(self, job: Job, finish_reason: str, text: str = "", stats: GenerationStats | None = None,
             error: str = "", ttft: float | None = None, measured: bool = True) -> Generate.Result:
        """The outcome of a goal that ran: its terminal state, result, ~/generation_stats and throughput
        (``measured`` false: ``stats`` counts tokens but has no timings, so it stays out of the throughput window)."""
        result = job.result = self._result(job, finish_reason, text, stats, error, ttft)
        settle(job.goal_handle, finish_reason)
        if finish_reason not in (ERROR, CANCELLED):
            self.last_error = ""
        if stats is not None and measured:
            self._window.add(stats)
        return result

    def _result(self, job: Job, finish_reason: str, text: str = "", stats: GenerationStats | None = None,
                error: str = "", ttft: float | None = None, publish: bool = True) -> Generate.Result:
        """``ttft``: seconds from the goal's acceptance to its first token (None: the generation's own figure).
        ``publish`` false: ~/generation_stats is sent later (:meth:`_publish`), once the outcome is final."""
        result = Generate.Result(prompt_tokens=len(job.prompt_ids), text=ros_text(text), finish_reason=finish_reason,
                                 error_message=error)
        if stats is not None:
            fill_result(result, stats, ttft)
        self._window.count_finished()  # every ending path comes here, once per goal
        job.counted = True
        if publish:
            self._publish(job, result.finish_reason, result.error_message, stats, ttft)
        return result

    def _publish(self, job: Job, finish_reason: str, error: str, stats: GenerationStats | None = None,
                 ttft: float | None = None) -> None:
        """One ~/generation_stats message per finished goal, saying what its result says."""
        pub = self._stats_pub
        if pub is None:
            return
        msg = generation_stats_msg(stats or GenerationStats(prompt_tokens=len(job.prompt_ids)),
                                   job.goal_handle.goal_id, finish_reason, error, self._node.get_clock().now().to_msg(),
                                   ttft)
        # destroyed by a shutdown meanwhile: the goal's result (its text) still goes out
        if not publish_unless_destroyed(pub, msg, lambda: self._stats_pub is pub):
            self._node.get_logger().warning("~/generation_stats was destroyed as the goal ended: no message")

    def drop_stats_publisher(self) -> None:
        """No more ~/generation_stats messages: the node destroys the publisher after this."""
        with self._cv:
            self._stats_pub = None

    def _end_unrun(self, job: Job, reason: str, cancelled: bool = False) -> None:
        """A goal that ends before it ran (cancelled in the FIFO, or the goals ended): its result now, its
        slot free; rclpy gets the result from the execute callback ``_answer``."""
        job.abort_reason = reason or None
        # a cancelled one's result may still turn into an error (_answer): its message waits for the final word
        job.result = self._result(job, CANCELLED if cancelled else ERROR, error=reason, publish=not cancelled)
        if cancelled:  # no EXECUTING state for a goal that never ran
            self.server.notify_execute(job.goal_handle, functools.partial(self._answer, job))
        else:
            self._execute(job.goal_handle, functools.partial(self._answer, job))

    def _answer(self, job: Job, goal_handle) -> Generate.Result:
        """The execute callback of a goal that ended before it ran."""
        try:
            if job.result.finish_reason == CANCELLED:
                deadline = time.monotonic() + CANCELING_WAIT_SECONDS
                while not goal_handle.is_cancel_requested and time.monotonic() < deadline:
                    time.sleep(CANCELING_POLL_SECONDS)
                if goal_handle.is_cancel_requested:
                    settle(goal_handle, CANCELLED)
                else:  # ABORTED, so its result says error as Generate.action promises for that state
                    job.result.finish_reason = ERROR
                    job.result.error_message = (f"cancelled while queued, but rclpy did not mark the goal CANCELING"
                                                f" within {CANCELING_WAIT_SECONDS:g} s: ended ABORTED instead")
                    settle(goal_handle, ERROR)
                self._publish(job, job.result.finish_reason, job.result.error_message)
            else:
                settle(goal_handle, ERROR)
        finally:  # answered whatever raised above (a publisher gone at teardown): a deactivate waits on the count
            with self._cv:
                self._unanswered -= 1
                self._cv.notify_all()
        return job.result

    # -- per-goal settings ---------------------------------------------------------------------------
    def _param(self, name: str):
        return self._node.get_parameter(name).value

    def _max_new_tokens(self, goal: Generate.Goal) -> int:
        return goal.max_new_tokens or self._param("generation.max_new_tokens")

    def _sampling(self, goal: Generate.Goal):
        from ..runtime.speculative import SamplingConfig

        temperature = goal.temperature if goal.temperature >= 0.0 else self._param("generation.temperature")
        if temperature < GREEDY_BELOW:
            temperature = 0.0
        top_p = goal.top_p if goal.top_p > 0.0 else self._param("generation.top_p")
        seed = goal.seed if goal.seed >= 0 else self._param("generation.seed")
        return SamplingConfig(float(temperature), float(top_p), int(seed) if seed >= 0 else None)
