"""`memspec_node`: the MemSpec generation server as a ROS 2 lifecycle node.

    unconfigured --configure--> inactive --activate--> active
    configure   validate parameters; load tokenizer, target, predictor and the draft registry
                (drafts stay on storage: the cache loads them); FAILURE + logged reason on error
    activate    goals are accepted; ~/cache_state and ~/generation_stats publish
    deactivate  the running goal ends ABORTED with its partial text, queued goals too; new goals
                are rejected
    cleanup / shutdown / error   every model is freed (parameter bytes back to 0)
    SIGINT / SIGTERM   like deactivate, the goals end ABORTED and their results are sent; then the node goes

The action server ``~/generate`` exists in every lifecycle state, from the node's construction to
destroy_node, so that a goal sent to an unconfigured, inactive or finalized node is rejected at once
with a logged reason. Its goal callback only checks (state, prompt / messages / raw, the length in
characters before any tokenizing, context length, queue room) and builds the prompt's token ids
(runtime/chat.py: the chat template when the target's tokenizer has one, else plain text) and answers
at once; accepted goals wait in a bounded FIFO and one worker thread runs them one at a time through RuntimeController.generate, so the
executor's threads stay free for lifecycle, parameter and diagnostics services. Cancellation is
accepted and honoured at the next draft-and-verify iteration with the partial text.
"""

from __future__ import annotations

import gc
import math
import signal
import threading
import time
import weakref
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import rclpy
from rcl_interfaces.msg import SetParametersResult
from rclpy.action import ActionServer, CancelResponse, GoalResponse
from rclpy.callback_groups import ReentrantCallbackGroup
from rclpy.executors import ExternalShutdownException, MultiThreadedExecutor
from rclpy.lifecycle import LifecycleNode, LifecycleState, TransitionCallbackReturn
from rclpy.qos import DurabilityPolicy, HistoryPolicy, QoSProfile, ReliabilityPolicy
from rclpy.signals import SignalHandlerOptions
from rclpy.task import Future

from memspec_interfaces.action import Generate
from memspec_interfaces.msg import CacheState
from memspec_interfaces.msg import GenerationStats as GenerationStatsMsg

from ..runtime.chat import ChatError, check_request, has_chat_template, max_token_chars, prompt_ids
from ..runtime.stats import GenerationStats
from . import params as P
from .diagnostics import (
    ERROR,
    LATCHED,
    OK,
    PERIOD_PARAM,
    TASK_CACHE,
    TASK_PREDICTOR,
    TASK_TARGET,
    TASK_THROUGHPUT,
    Status,
    ThroughputWindow,
    cache_state_key,
    cache_state_msg,
    fill_cache_status,
    fill_throughput_status,
    generation_stats_msg,
    make_updater,
)

NODE_NAME = "memspec"
ACTION_NAME = "~/generate"
CACHE_POLL_SECONDS = 0.1  # ~/cache_state "on change": the cache is polled this often (off the decode thread)
DEACTIVATE_WAIT_SECONDS = 30.0
# Before the action server goes (SIGINT/SIGTERM, destroy_node): how long ended goals may take to hand
# rclpy their results, then how long the executor gets to send them to the clients that asked for them
# (rclpy sends a result from an executor task of its own, after the execute callback returned).
RESULTS_OUT_SECONDS = 5.0
RESULT_SEND_SECONDS = 0.5
# The action's goal, cancel and result services: rclpy's default keeps 10 requests, so a burst of goals
# sent at once lost the rest unanswered (their clients waited forever). 100 holds any realistic burst
# between two takes of the executor while bounding what a flood of large prompts can hold in memory.
ACTION_SERVICE_QOS = QoSProfile(history=HistoryPolicy.KEEP_LAST, depth=100, reliability=ReliabilityPolicy.RELIABLE,
                                durability=DurabilityPolicy.VOLATILE)


class RecordingRanker:
    """Passes the predictor through and keeps its latest scores for ~/cache_state."""

    def __init__(self, inner) -> None:
        self.inner = inner
        self.latest: dict[str, float] = {}

    def begin(self, prompt_ids, prompt_text: str = "") -> None:
        self.inner.begin(prompt_ids, prompt_text)

    def rank(self, context):
        ranking = self.inner.rank(context)
        self.latest = {name: float(score) for name, score in ranking}
        return ranking

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


@dataclass
class Job:
    """One accepted goal, from the FIFO to its result."""

    goal_handle: Any
    prompt_ids: list[int]
    accepted_at: float = field(default_factory=time.perf_counter)
    abort_reason: str | None = None  # set by deactivate/shutdown: end with the partial text
    cancelled_in_queue: bool = False  # cancelled before it ran: _execute marks it CANCELED
    answered: threading.Event = field(default_factory=threading.Event)  # _execute handed rclpy the result
    result: Generate.Result | None = None
    done: threading.Event = field(default_factory=threading.Event)


@dataclass
class Loaded:
    """What configure loaded; dropped as a whole by cleanup."""

    paths: P.ModelPaths
    tokenizer: Any
    target: Any  # LoadedModel
    registry: Any  # DraftRegistry
    predictor: RecordingRanker | None
    controller: Any  # RuntimeController
    max_positions: int
    max_token_chars: int  # the most characters one token stands for (runtime/chat.py): the goal pre-check


class MemSpecNode(LifecycleNode):
    def __init__(self, node_name: str = NODE_NAME, **kwargs) -> None:
        super().__init__(node_name, **kwargs)
        P.declare_all(self)
        self.add_on_set_parameters_callback(self._on_set_parameters)
        self._guard_change_state()
        self._group = ReentrantCallbackGroup()
        self._loaded: Loaded | None = None
        self._active = False
        self._configure_error = ""
        self._last_goal_error = ""
        self._cache_pub = None
        self._stats_pub = None
        self._last_cache_key: tuple | None = None
        self._last_cache_publish = 0.0
        # the goal FIFO and its worker
        self._cv = threading.Condition()
        self._queue: deque[Job] = deque()
        self._running: Job | None = None
        self._outstanding = 0  # accepted goals not finished (queued + running)
        self._pending_ids: dict[int, list[int]] = {}  # prompt ids from the goal callback, by request object
        self.goals_rejected = 0
        self.last_rejection = ""  # the reason of the latest rejected goal (also on /diagnostics)
        self._cache_baseline = None  # cache counters at activation: CacheState counts since then
        self._stopping = False
        self._closing = ""  # why the node takes no more goals before it goes (close_goals)
        self._worker = threading.Thread(target=self._work, name="memspec-generation", daemon=True)
        self._worker.start()
        # diagnostics (published in every lifecycle state, like diagnostic_updater; the updater declares
        # diagnostic_updater.period, so P.values() works only from here on)
        self._window = ThroughputWindow(self.get_parameter("diagnostics.window_goals").value)
        self._diagnostics = None  # its declaring the period passes through _on_set_parameters before it exists
        self._diagnostics = make_updater(self, [
            (TASK_TARGET, self._fill_target),
            (TASK_CACHE, self._fill_cache),
            (TASK_THROUGHPUT, self._fill_throughput),
            (TASK_PREDICTOR, self._fill_predictor),
        ], self.get_parameter("diagnostics.hardware_id").value, callback_group=self._group)
        self._cache_timer = self.create_timer(CACHE_POLL_SECONDS, self._poll_cache, callback_group=self._group)
        self._action_server = ActionServer(
            self, Generate, ACTION_NAME,
            execute_callback=self._execute,
            goal_callback=self._on_goal,
            handle_accepted_callback=self._on_accepted,
            cancel_callback=self._on_cancel,
            callback_group=self._group,
            goal_service_qos_profile=ACTION_SERVICE_QOS,
            result_service_qos_profile=ACTION_SERVICE_QOS,
            cancel_service_qos_profile=ACTION_SERVICE_QOS,
        )

    # -- lifecycle --------------------------------------------------------------------------
    def on_configure(self, state: LifecycleState) -> TransitionCallbackReturn:
        t0 = time.perf_counter()
        try:
            self._loaded = self._load()
        except Exception as exc:  # every load error becomes a failed transition with its reason
            self._release()
            self._configure_error = f"{type(exc).__name__}: {exc}"
            self.get_logger().error(f"configure failed, staying unconfigured: {self._configure_error}")
            return TransitionCallbackReturn.FAILURE
        self._configure_error = ""
        self._cache_pub = self.create_lifecycle_publisher(CacheState, "~/cache_state", LATCHED)
        self._stats_pub = self.create_lifecycle_publisher(GenerationStatsMsg, "~/generation_stats", 10)
        lo = self._loaded
        self.get_logger().info(
            f"configured in {time.perf_counter() - t0:.1f} s: target {lo.paths.target}"
            f" ({lo.target.size_bytes / 1e6:.1f} MB), drafts {', '.join(lo.registry.names()) or 'none'},"
            f" predictor {lo.paths.predictor or 'none'}, policy {lo.controller.config.policy},"
            f" chat template {'yes' if has_chat_template(lo.tokenizer) else 'no (prompts are continued as text)'},"
            f" end token ids {lo.controller.eos_token_ids or 'none'}"
        )
        return TransitionCallbackReturn.SUCCESS

    def on_activate(self, state: LifecycleState) -> TransitionCallbackReturn:
        self._window.clear()
        self._window.total_goals = 0
        self._last_cache_key = None
        self._cache_baseline = self._loaded.controller.cache.snapshot() if self._loaded is not None else None
        self._active = True
        result = super().on_activate(state)  # enables the lifecycle publishers
        self.get_logger().info("active: accepting goals on ~/generate")
        return result

    def on_deactivate(self, state: LifecycleState) -> TransitionCallbackReturn:
        self._active = False
        self._end_goals("the node was deactivated during the goal")
        self.get_logger().info("inactive: new goals are rejected")
        return super().on_deactivate(state)

    def on_cleanup(self, state: LifecycleState) -> TransitionCallbackReturn:
        self._release()
        self.get_logger().info("cleaned up: every model freed")
        return TransitionCallbackReturn.SUCCESS

    def on_shutdown(self, state: LifecycleState) -> TransitionCallbackReturn:
        self._active = False
        self._end_goals("the node is shutting down")
        self._release()
        return TransitionCallbackReturn.SUCCESS

    def on_error(self, state: LifecycleState) -> TransitionCallbackReturn:
        self._active = False
        self._end_goals("the node hit an error")
        self._release()
        self.get_logger().error("error processed: models freed, back to unconfigured")
        return TransitionCallbackReturn.SUCCESS

    def _guard_change_state(self) -> None:
        """rclpy raises out of the ChangeState service for a transition the current state does not
        have (``ros2 lifecycle set /memspec cleanup`` while active), which would end the node: answer
        success=False with a log line instead, as rclcpp does."""
        service = getattr(self, "_service_change_state", None)
        if service is None:
            return
        handler = service.callback

        def guarded(request, response):
            try:
                return handler(request, response)
            except Exception as exc:
                self.get_logger().warning(
                    f"transition {request.transition.label or request.transition.id} refused in state"
                    f" {self.lifecycle_state}: {exc}")
                response.success = False
                return response

        service.callback = guarded

    @property
    def lifecycle_state(self) -> str:
        return self._state_machine.current_state[1]

    # -- loading and freeing ----------------------------------------------------------------
    def _load(self) -> Loaded:
        import torch

        from ..runtime.chat import end_token_ids
        from ..runtime.controller import RuntimeConfig, RuntimeController
        from ..runtime.models import ModelSpec, load_model, load_tokenizer, tokenizer_fingerprint
        from ..runtime.predictor import PredictionEngine

        v = P.values(self)
        for name in P.BY_NAME:
            reason = P.check_value(name, v[name])
            if reason:
                raise ValueError(reason)
        paths = P.resolve_paths(v)
        if v["model.threads"]:
            torch.set_num_threads(v["model.threads"])
        tokenizer = load_tokenizer(paths.tokenizer)
        target = load_model(ModelSpec(paths.target, v["model.dtype"], v["model.device"], v["model.quantization"],
                                      gamma=v["memspec.gamma"]))
        registry = self._build_registry(v, paths, tokenizer_fingerprint(tokenizer))
        predictor = None
        if paths.predictor:
            predictor = RecordingRanker(PredictionEngine.load(paths.predictor, target=target.model, tokenizer=tokenizer))
        config = RuntimeConfig(**{field_: v[name] for name, field_ in P.RUNTIME_FIELDS.items()})
        # an instruct model ends its turn with a token its generation_config lists (SmolLM2: <|im_end|>)
        controller = RuntimeController(config, target.model, tokenizer, registry, predictor,
                                       max_positions=target.max_positions,
                                       draft_dtype="fp32" if v["model.dtype"] == "auto" else v["model.dtype"],
                                       device=v["model.device"], eos_token_ids=end_token_ids(tokenizer, target.model))
        return Loaded(paths, tokenizer, target, registry, predictor, controller, target.max_positions,
                      max_token_chars(tokenizer))

    @staticmethod
    def _build_registry(v: dict, paths: P.ModelPaths, fingerprint: str):
        from ..runtime.registry import DraftRegistry

        names = P.non_empty(v["drafts.names"])
        if names:
            return DraftRegistry.from_lists(names, P.non_empty(v["drafts.paths"]), P.non_empty(v["drafts.domains"]),
                                            target_fingerprint=fingerprint)
        return DraftRegistry.from_yaml(v["drafts.registry_file"] or paths.registry_file, target_fingerprint=fingerprint)

    def _release(self) -> None:
        """Free every model: the controller (its cache and loader thread), drafts, target, predictor."""
        for pub in (self._cache_pub, self._stats_pub):
            if pub is not None:
                self.destroy_lifecycle_publisher(pub)
        self._cache_pub = self._stats_pub = None
        loaded, self._loaded = self._loaded, None
        if loaded is not None:
            try:
                loaded.controller.cache.reset()  # evicts resident drafts, waits for loads in flight
                loaded.controller.close()
            except Exception as exc:
                self.get_logger().warning(f"closing the runtime: {exc}")
            encoder = getattr(getattr(loaded.predictor, "inner", None), "encoder", None)
            if hasattr(encoder, "close"):
                encoder.close()  # the target-hidden encoder's forward hook holds the target
            del loaded
        gc.collect()

    def loaded_parameter_bytes(self) -> int:
        """Bytes of weights the node holds now (target, resident drafts, predictor head); 0 after cleanup."""
        from ..runtime.models import parameter_bytes

        lo = self._loaded
        if lo is None:
            return 0
        total = parameter_bytes(lo.target.model)
        for name in lo.controller.cache.resident():
            model = lo.controller.cache.get(name)
            if model is not None:
                total += parameter_bytes(model.model)
        head = getattr(getattr(lo.predictor, "inner", None), "head", None)
        if head is not None:
            total += parameter_bytes(head)
        return total

    def model_refs(self) -> list[weakref.ref]:
        """Weak references to every loaded module (tests check they die after cleanup)."""
        lo = self._loaded
        if lo is None:
            return []
        refs = [weakref.ref(lo.target.model)]
        refs += [weakref.ref(m.model) for n in lo.controller.cache.resident() if (m := lo.controller.cache.get(n))]
        return refs

    # -- parameters ---------------------------------------------------------------------------
    def _on_set_parameters(self, changed) -> SetParametersResult:
        """Validate everything first; apply only if all is valid (nothing changes otherwise)."""
        new = {p.name: P._plain(p.value) for p in changed}
        for name, value in new.items():
            reason = P.check_value(name, value)
            if reason:
                return self._reject_params(reason)
        lo = self._loaded
        at_configure = [n for n in new if n in P.BY_NAME and P.BY_NAME[n].when == P.AT_CONFIGURE]
        if at_configure and lo is not None:
            return self._reject_params(
                f"{', '.join(at_configure)} can change only while unconfigured (the models are loaded, state"
                f" {self.lifecycle_state}): deactivate and cleanup, set it, then configure again"
            )
        registry = None
        if lo is not None and any(n in P.REGISTRY_PARAMS for n in new):
            v = {**P.values(self), **new}
            try:
                from ..runtime.models import tokenizer_fingerprint

                registry = self._build_registry(v, lo.paths, tokenizer_fingerprint(lo.tokenizer))
            except Exception as exc:
                return self._reject_params(f"draft registry not changed: {exc}")
        runtime = {P.RUNTIME_FIELDS[n]: v for n, v in new.items() if n in P.RUNTIME_FIELDS}
        if lo is not None and runtime:
            try:
                lo.controller.reconfigure(**runtime)  # at the next scheduling point if a goal runs
            except Exception as exc:  # ValueError / PolicyError naming the field; nothing changed
                return self._reject_params(str(exc))
        if registry is not None:
            with self._cv:  # the worker cannot start a goal meanwhile
                idle = self._running is None
                self._apply_registry(lo.registry, registry, lo.controller.cache if idle else None)
            lo.controller.cache.clear_failed()  # a draft that failed is tried again (its files may be fixed)
        if PERIOD_PARAM in new and self._diagnostics is not None:
            self._diagnostics.set_period(new[PERIOD_PARAM])
        if "diagnostics.window_goals" in new:
            self._window.resize(new["diagnostics.window_goals"])
        if runtime or registry is not None:
            self.get_logger().info(f"parameters set: {', '.join(f'{k}={v!r}' for k, v in new.items())}"
                                   + (" (applied at the next scheduling point)" if self._running else ""))
        return SetParametersResult(successful=True)

    def _reject_params(self, reason: str) -> SetParametersResult:
        self.get_logger().warning(f"parameter change rejected: {reason}")
        return SetParametersResult(successful=False, reason=reason)

    @staticmethod
    def _apply_registry(live, wanted, cache) -> None:
        """Make the live registry equal to ``wanted``; a running goal sees it at its next scheduling point.

        With no goal running (``cache`` given), removed drafts also leave the cache now: the runtime
        syncs its cache with the registry only at the scheduling points of a running goal."""
        want = {e.name: e for e in wanted.entries()}
        for entry in live.entries():
            if entry.name not in want or want[entry.name] != entry:
                live.remove(entry.name)
                if cache is not None:
                    cache.remove(entry.name)
        for name, entry in want.items():
            if name not in live:
                live.add(entry)

    # -- the action server ------------------------------------------------------------------
    def _goal_rejection(self, goal: Generate.Goal) -> tuple[str, list[int]]:
        """('' , prompt ids) to accept, else (reason, [])."""
        lo = self._loaded
        if self._closing:
            return f"{self._closing}: no new goals", []
        if not self._active or lo is None:
            state = self.lifecycle_state
            todo = {"unconfigured": "configure and activate it", "inactive": "activate it",
                    "finalized": "start the node again"}.get(state, "wait for its transition and activate it")
            return f"the node is not active (state {state}): {todo} first", []
        messages = [(m.role, m.content) for m in goal.messages]
        reason = check_request(goal.prompt, messages, goal.raw, has_chat_template(lo.tokenizer))
        if reason:  # cheap checks first: roles, emptiness, raw with messages, messages without a template
            return reason, []
        if not math.isfinite(goal.temperature) or not (math.isfinite(goal.top_p) and goal.top_p <= 1.0):
            return f"temperature {goal.temperature} / top_p {goal.top_p} out of range (top_p must be <= 1)", []
        limit = self.get_parameter("generation.max_prompt_tokens").value
        if lo.max_positions:
            limit = min(limit, lo.max_positions - 1)
        # before any tokenization (a 1 MB prompt took 0.5 s and 350 MB to tokenize): a text longer than
        # limit * the most characters one token stands for can never fit in limit tokens
        chars = len(goal.prompt) + sum(len(content) for _, content in messages)
        if chars > limit * lo.max_token_chars:
            what = "the messages have" if messages else "the prompt has"
            return (f"{what} {chars} characters, more than the limit of {limit} tokens can hold (at most"
                    f" {lo.max_token_chars} characters per token for this tokenizer; generation.max_prompt_tokens"
                    " / the target's context)"), []
        try:
            ids = prompt_ids(lo.tokenizer, goal.prompt, messages, goal.raw,
                             self.get_parameter("generation.system_prompt").value)
        except ChatError as exc:  # the chat template failed (a sandbox refusal included)
            return str(exc), []
        except Exception as exc:  # never let a tokenizer error escape the goal callback
            return f"the prompt could not be tokenized: {type(exc).__name__}: {exc}", []
        if len(ids) > limit:
            return (f"the prompt has {len(ids)} tokens, more than the limit of {limit}"
                    " (generation.max_prompt_tokens / the target's context)"), []
        new_tokens = goal.max_new_tokens or self.get_parameter("generation.max_new_tokens").value
        if lo.max_positions and len(ids) + new_tokens > lo.max_positions:
            return (f"prompt ({len(ids)} tokens) + max_new_tokens ({new_tokens}) exceeds the target's context of"
                    f" {lo.max_positions} tokens: shorten the prompt or ask for fewer tokens"), []
        limit = 1 + self.get_parameter("action.max_queued_goals").value
        with self._cv:
            if self._outstanding >= limit:
                return (f"the goal queue is full ({self._outstanding - (1 if self._running else 0)} waiting,"
                        f" action.max_queued_goals {limit - 1}): retry later"), []
            self._outstanding += 1  # reserved now, so that concurrent goal callbacks see it
        return "", ids

    def _on_goal(self, goal: Generate.Goal) -> GoalResponse:
        reason, ids = self._goal_rejection(goal)
        if reason:
            self.goals_rejected += 1
            self.last_rejection = reason
            self.get_logger().warning(f"goal rejected: {reason}")
            return GoalResponse.REJECT
        with self._cv:
            self._pending_ids[id(goal)] = ids  # rclpy hands this same request object to _on_accepted
        return GoalResponse.ACCEPT

    def _on_accepted(self, goal_handle) -> None:
        with self._cv:
            ids = self._pending_ids.pop(id(goal_handle.request), [])
            self._queue.append(Job(goal_handle, ids))
            self._cv.notify_all()

    def _on_cancel(self, goal_handle) -> CancelResponse:
        """Accept every cancel (rclpy's default rejects). The running goal stops at its next iteration
        boundary with the partial text; a queued goal leaves the queue now, so its slot is free at once,
        and ends CANCELED without waiting for the running goal."""
        with self._cv:
            job = next((j for j in self._queue if j.goal_handle is goal_handle), None)
            if job is not None:
                self._queue.remove(job)
                self._outstanding -= 1
        if job is not None:
            job.cancelled_in_queue = True
            job.result = Generate.Result(prompt_tokens=len(job.prompt_ids),
                                         finish_reason=Generate.Result.FINISH_CANCELLED)
            self._publish_stats(job, None, job.result.finish_reason, "")
            job.done.set()
            goal_handle._memspec_job = job
            # _execute's return value becomes the result rclpy sends; no EXECUTING state for a goal that never ran
            self._action_server.notify_execute(goal_handle, self._execute)
        return CancelResponse.ACCEPT

    def _execute(self, goal_handle) -> Generate.Result:
        """Runs on an executor thread only to hand the worker's result to rclpy; never generates."""
        job = goal_handle._memspec_job
        job.done.wait()
        if job.cancelled_in_queue:
            # rclpy marks the goal CANCELING once _on_cancel has returned, maybe after this thread got here
            deadline = time.monotonic() + 5.0
            while not goal_handle.is_cancel_requested and time.monotonic() < deadline:
                time.sleep(0.001)
            if goal_handle.is_cancel_requested:
                goal_handle.canceled()
            else:
                goal_handle.abort()
        job.answered.set()  # rclpy sets the result as this returns, then sends it from an executor task
        return job.result

    # -- the worker -----------------------------------------------------------------------
    def _work(self) -> None:
        while True:
            with self._cv:
                while not self._queue and not self._stopping:
                    self._cv.wait()
                if self._stopping and not self._queue:
                    return
                job = self._queue.popleft()
                self._running = job
            try:
                self._run(job)
            except Exception as exc:  # never let the worker die
                self.get_logger().error(f"goal failed unexpectedly: {type(exc).__name__}: {exc}")
                if job.result is None:
                    job.result = Generate.Result(finish_reason=Generate.Result.FINISH_ERROR, error_message=str(exc))
                    try:
                        job.goal_handle.abort()
                    except Exception:
                        pass
                job.done.set()
            finally:
                with self._cv:
                    self._running = None
                    self._outstanding -= 1
                    self._cv.notify_all()

    def _run(self, job: Job) -> None:
        gh = job.goal_handle
        gh._memspec_job = job
        gh.execute(self._execute)  # EXECUTING (unless cancel came first); _execute waits for job.done
        lo = self._loaded
        goal = gh.request
        result = Generate.Result(prompt_tokens=len(job.prompt_ids))
        stats: GenerationStats | None = None
        error = ""
        if job.abort_reason or lo is None:
            error = job.abort_reason or "the node was cleaned up before the goal started"
            result.finish_reason = Generate.Result.FINISH_ERROR
        elif gh.is_cancel_requested:
            result.finish_reason = Generate.Result.FINISH_CANCELLED
        else:
            stream = _FeedbackStream(gh, lo.controller.cache,
                                     self.get_parameter("action.feedback_period").value)
            try:
                out = lo.controller.generate(
                    job.prompt_ids,
                    goal.max_new_tokens or self.get_parameter("generation.max_new_tokens").value,
                    self._sampling(goal), list(goal.stop), stream.on_chunk,
                    lambda: job.abort_reason is not None or gh.is_cancel_requested,
                )
                stream.close()
                stats = out.stats
                result.text, result.finish_reason = ros_text(out.text), out.finish_reason
                _fill_result(result, stats)
                if job.abort_reason is not None:
                    error = job.abort_reason
                    result.finish_reason = Generate.Result.FINISH_ERROR
            except Exception as exc:  # a failed goal is ABORTED with the reason, never a traceback
                stream.close()
                error = f"{type(exc).__name__}: {exc}"
                result.finish_reason = Generate.Result.FINISH_ERROR
                result.text = ros_text(stream.text)
                self._last_goal_error = error
                self.get_logger().error(f"goal aborted: {error}")
        result.error_message = error
        if result.finish_reason == Generate.Result.FINISH_ERROR:
            gh.abort()
        elif result.finish_reason == Generate.Result.FINISH_CANCELLED:
            gh.canceled()
        else:
            gh.succeed()
            self._last_goal_error = ""
        if stats is not None:
            self._window.add(stats)
        self._publish_stats(job, stats, result.finish_reason, error)
        job.result = result
        job.done.set()

    def _publish_stats(self, job: Job, stats: GenerationStats | None, finish_reason: str, error: str) -> None:
        """One ~/generation_stats message per finished goal."""
        if self._stats_pub is not None:
            self._stats_pub.publish(generation_stats_msg(stats or GenerationStats(prompt_tokens=len(job.prompt_ids)),
                                                         job.goal_handle.goal_id, finish_reason, error,
                                                         self.get_clock().now().to_msg()))

    def _sampling(self, goal: Generate.Goal):
        from ..runtime.speculative import SamplingConfig

        temperature = goal.temperature if goal.temperature >= 0.0 else self.get_parameter("generation.temperature").value
        top_p = goal.top_p if goal.top_p > 0.0 else self.get_parameter("generation.top_p").value
        seed = goal.seed if goal.seed >= 0 else self.get_parameter("generation.seed").value
        return SamplingConfig(float(temperature), float(top_p), int(seed) if seed >= 0 else None)

    def _end_goals(self, reason: str) -> list[Job]:
        """End the running goal (at its next iteration) and every queued one, ABORTED with ``reason``;
        returns them once the worker is done with them."""
        ended: dict[int, Job] = {}
        with self._cv:
            deadline = time.monotonic() + DEACTIVATE_WAIT_SECONDS
            while True:
                for job in ([self._running] if self._running else []) + list(self._queue):  # and any accepted meanwhile
                    job.abort_reason = reason
                    ended[id(job)] = job
                if self._outstanding <= 0 or time.monotonic() >= deadline:
                    return list(ended.values())
                self._cv.wait(timeout=0.1)

    def close_goals(self, reason: str) -> None:
        """Take no more goals, end the running and queued ones ABORTED with ``reason`` and wait until their
        results are out, so that the action server can go (SIGINT/SIGTERM in main(), destroy_node).

        The executor must still spin: rclpy sends each result from an executor task after _execute
        returned it (a server destroyed or an executor shut down earlier lost them)."""
        self._closing = reason
        self._active = False
        jobs = self._end_goals(reason)
        deadline = time.monotonic() + RESULTS_OUT_SECONDS
        for job in jobs:
            job.answered.wait(max(0.0, deadline - time.monotonic()))
        if jobs:
            time.sleep(RESULT_SEND_SECONDS)  # the executor sends the results to the clients that asked

    def stop_worker(self) -> None:
        with self._cv:
            self._stopping = True
            self._cv.notify_all()
        self._worker.join(timeout=5.0)

    def destroy_node(self) -> None:
        self.close_goals(self._closing or "the node is being destroyed")
        self.stop_worker()
        self._release()
        self._action_server.destroy()
        super().destroy_node()

    # -- periodic publications ----------------------------------------------------------------
    def _poll_cache(self) -> None:
        lo = self._loaded
        if lo is None or not self._active or self._cache_pub is None:
            return
        snap = self._cache_snapshot(lo)
        key = cache_state_key(snap)
        now = time.monotonic()
        period = self.get_parameter("diagnostics.cache_state_period").value
        if key == self._last_cache_key and now - self._last_cache_publish < period:
            return
        self._last_cache_key, self._last_cache_publish = key, now
        scores = lo.predictor.latest if lo.predictor is not None else {}
        self._cache_pub.publish(cache_state_msg(snap, lo.registry.entries(), scores, self.get_clock().now().to_msg()))

    def _cache_snapshot(self, lo: Loaded):
        """The cache now, counters since activation (as CacheState documents)."""
        snap = lo.controller.cache.snapshot()
        baseline = self._cache_baseline
        return snap.since(baseline) if baseline is not None and self._active else snap

    # -- diagnostic tasks ---------------------------------------------------------------------
    def _fill_target(self, s: Status) -> None:
        s.add("lifecycle state", self.lifecycle_state)
        with self._cv:
            running, queued = self._running is not None, len(self._queue)
        s.add("goal running", running)
        s.add("goals queued", queued)
        s.add("goals rejected", self.goals_rejected)
        s.add("last rejection", self.last_rejection or "none")
        lo = self._loaded
        if self._configure_error:
            s.summary(ERROR, f"configure failed: {self._configure_error}")
            return
        if lo is None:
            s.summary(OK, "unconfigured: no model loaded")
            return
        spec = lo.target.spec
        s.add("path", spec.path)
        s.add("dtype", spec.dtype)
        s.add("device", spec.device)
        s.add("quantization", spec.quantization)
        s.add("forward path", lo.target.forward_path)
        if lo.target.path_choice is not None:  # auto: what was measured at configure
            for timing in lo.target.path_choice.timings:
                s.add(f"auto {timing.path} ms (1 / gamma+1 tokens)", f"{timing.one_token_ms:.2f} / {timing.verify_ms:.2f}")
        s.add("parameter bytes", lo.target.size_bytes)
        s.add("context tokens", lo.max_positions)
        s.add("chat template", has_chat_template(lo.tokenizer))
        s.add("end token ids", lo.controller.eos_token_ids or "none")
        s.summary(OK, f"loaded ({self.lifecycle_state})")
        if self._last_goal_error:
            s.merge(ERROR, f"the last goal failed: {self._last_goal_error}")

    def _fill_cache(self, s: Status) -> None:
        lo = self._loaded
        snap = self._cache_snapshot(lo) if lo is not None else None
        names = lo.registry.names() if lo is not None else []
        window = self._window.combined() if len(self._window) else None
        fill_cache_status(s, snap, window, names)
        if lo is not None:
            s.add("policy", lo.controller.config.policy)

    def _fill_throughput(self, s: Status) -> None:
        goals = len(self._window)
        fill_throughput_status(s, self._window.combined() if goals else None, goals, self._window.total_goals,
                               self.get_parameter("diagnostics.fallback_warn_fraction").value)

    def _fill_predictor(self, s: Status) -> None:
        lo = self._loaded
        if lo is None:
            s.summary(OK, "unconfigured")
            return
        policy = lo.controller.config.policy
        s.add("policy", policy)
        if lo.predictor is None:
            s.summary(OK, f"no predictor (policy {policy} needs none)")
            return
        engine = lo.predictor.inner
        head = getattr(engine, "head", None)
        s.add("path", lo.paths.predictor)
        if head is not None:
            s.add("encoder", head.config.encoder)
            s.add("input", head.config.input)
            s.add("classes", head.config.drafts)
            for key, value in sorted(head.config.metrics.items()):
                s.add(f"trained {key}", value)
        calls, seconds = getattr(engine, "calls", 0), getattr(engine, "seconds", 0.0)
        s.add("calls", calls)
        s.add("mean seconds per call", seconds / calls if calls else 0.0)
        s.add("latest ranking", [f"{n}={v:.3f}" for n, v in sorted(lo.predictor.latest.items(), key=lambda kv: -kv[1])]
              or "none yet")
        s.summary(OK, f"{calls} rankings")


def ros_text(text: str) -> str:
    """ROS strings cannot carry NUL (the C layer would cut the text there): drop it."""
    return text.replace("\x00", "") if "\x00" in text else text


def _fill_result(result: Generate.Result, stats: GenerationStats) -> None:
    result.prompt_tokens = int(stats.prompt_tokens)
    result.completion_tokens = int(stats.completion_tokens)
    result.tokens_per_second = float(stats.tokens_per_second)
    result.time_to_first_token = float(stats.time_to_first_token)
    result.mean_accepted_tokens = float(stats.mean_accepted)
    result.drafts_used = list(stats.drafts_used)
    result.draft_switches = int(stats.draft_switches)


class _FeedbackStream:
    """Feedback per committed chunk, published off the decode thread, at most one per ``period`` s.

    ``on_chunk`` (the decode thread) only appends under a lock; a per-goal thread publishes what has
    accumulated (chunks batch up while it publishes or while ``period`` throttles), so DDS writes
    never sit between two draft-and-verify iterations. ``close`` publishes the rest, in order,
    before the goal's result is sent.
    """

    def __init__(self, goal_handle, cache, period: float) -> None:
        self.goal_handle, self.cache, self.period = goal_handle, cache, period
        self._cv = threading.Condition()
        self._chunks: list[str] = []  # the whole text so far (for an aborted goal's partial result)
        self._pending: list[str] = []
        self._tokens = 0
        self._first = 0.0
        self._latest = 0.0
        self._closed = False
        self._thread = threading.Thread(target=self._loop, name="memspec-feedback", daemon=True)
        self._thread.start()

    @property
    def text(self) -> str:
        with self._cv:
            return "".join(self._chunks)

    def on_chunk(self, delta: str, token_ids: list[int]) -> None:
        now = time.perf_counter()
        with self._cv:
            if not self._tokens:
                self._first = now  # the first token comes from prefill; throughput counts the ones after it
            self._tokens += len(token_ids)
            self._latest = now
            self._chunks.append(delta)
            self._pending.append(delta)
            if len(self._pending) == 1:
                self._cv.notify()  # wake the publisher only when it waits for text (no wake-up per chunk)

    def close(self) -> None:
        with self._cv:
            self._closed = True
            self._cv.notify()
        self._thread.join(timeout=10.0)

    def _loop(self) -> None:
        last = 0.0
        while True:
            with self._cv:
                while not self._pending and not self._closed:
                    self._cv.wait()
                if not self._pending and self._closed:
                    return
                deadline = last + self.period
                while not self._closed and (remaining := deadline - time.perf_counter()) > 0:
                    self._cv.wait(timeout=remaining)  # throttled: later chunks join this message
                delta, self._pending = "".join(self._pending), []
                tokens, elapsed = self._tokens, self._latest - self._first
            try:
                self.goal_handle.publish_feedback(Generate.Feedback(
                    delta_text=ros_text(delta), tokens_so_far=tokens,
                    tokens_per_second=(tokens - 1) / elapsed if elapsed > 0 and tokens > 1 else 0.0,
                    active_draft=self.cache.active,
                ))
            except Exception:  # the goal ended under us (shutdown): feedback is best effort
                return
            last = time.perf_counter()


def _quiet_libraries() -> None:
    """No progress bars or library warnings on the robot's terminal: the node logs what matters."""
    try:
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
        hf_logging.set_verbosity_error()
    except ImportError:
        pass


def main(args: list[str] | None = None) -> None:
    _quiet_libraries()
    # SIGINT/SIGTERM are ours, not rclpy's: its handler shuts the context down at once, so the results of
    # the goals still running or queued were never sent. Ours ends those goals and lets the executor send
    # their results (close_goals, on a thread of its own while the executor spins), then the node goes.
    rclpy.init(args=args, signal_handler_options=SignalHandlerOptions.NO)
    node = MemSpecNode()
    executor = MultiThreadedExecutor(num_threads=4)
    executor.add_node(node)
    closing = threading.Event()
    closed = Future()

    def close(reason: str) -> None:
        try:
            node.close_goals(reason)
        finally:
            closed.set_result(True)  # wakes the executor: main() goes on to destroy the node

    def on_signal(signum, _frame) -> None:
        if closing.is_set():
            raise KeyboardInterrupt  # a second signal: stop without waiting for the results
        closing.set()
        reason = f"the node is shutting down ({signal.Signals(signum).name})"
        node.get_logger().info(f"{reason}: ending the goals and sending their results")
        threading.Thread(target=close, args=(reason,), name="memspec-close", daemon=True).start()

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    try:
        while rclpy.ok() and not closed.done():
            try:
                executor.spin_until_future_complete(closed)
            except (KeyboardInterrupt, ExternalShutdownException):
                break
            except Exception as exc:  # a failing callback is logged, never the end of the node
                node.get_logger().error(f"a callback failed: {type(exc).__name__}: {exc}")
    finally:
        executor.shutdown(timeout_sec=1.0)
        node.destroy_node()
        rclpy.try_shutdown()


if __name__ == "__main__":
    main()
