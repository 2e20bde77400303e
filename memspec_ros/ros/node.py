"""`memspec_node`: the MemSpec generation server as a ROS 2 lifecycle node (lifecycle and wiring).

    unconfigured --configure--> inactive --activate--> active
    configure   validate parameters; load tokenizer, target, predictor and the draft registry
                (drafts stay on storage: the cache loads them); FAILURE + logged reason on error
    activate    goals are accepted; ~/cache_state and ~/generation_stats publish
    deactivate  the running goal ends ABORTED with its partial text, queued goals too; new goals
                are rejected
    cleanup / shutdown / error   every model is freed (parameter bytes back to 0); shutdown and error succeed
                even when a goal told to end has not ended yet, and its models are freed when it does
    SIGINT / SIGTERM   like deactivate, the goals end ABORTED and their results are sent; then the node goes

The parts it wires together:

    goal_runner.py     the action server ``~/generate`` (in every lifecycle state, from construction to
                       destroy_node, so a goal to an inactive node is rejected at once with the reason):
                       the checks, the FIFO, the one generation, cancellation, results
    param_handler.py   validation and live application of parameter changes
    diagnostics.py     the /diagnostics updater and its tasks, the ~/cache_state message
"""

from __future__ import annotations

import ctypes
import dataclasses
import functools
import gc
import logging
import os
import signal
import sys
import threading
import time
import traceback
import weakref
from dataclasses import dataclass
from typing import Any

import rclpy
from rclpy.callback_groups import MutuallyExclusiveCallbackGroup, ReentrantCallbackGroup
from rclpy.exceptions import ParameterException
from rclpy.executors import ExternalShutdownException, MultiThreadedExecutor
from rclpy.lifecycle import LifecycleNode, LifecycleNodeMixin, LifecycleState, TransitionCallbackReturn
from rclpy.node import Node
from rclpy.signals import SignalHandlerOptions
from rclpy.task import Future

from memspec_interfaces.msg import CacheState
from memspec_interfaces.msg import GenerationStats as GenerationStatsMsg

from ..runtime.chat import has_chat_template, max_token_chars
from ..runtime.policies import PolicyError
from . import params as P
from .diagnostics import (
    LATCHED,
    PERIOD_PARAM,
    NodeTasks,
    ThroughputWindow,
    cache_state_key,
    cache_state_msg,
    make_updater,
)
from .goal_runner import DEACTIVATE_WAIT_SECONDS, GoalRunner, publish_unless_destroyed
from .param_handler import ParameterHandler, length_refusal
from .rclpy_internals import (
    answer_lifecycle_queries_apart,
    guard_change_state,
    lifecycle_state_label,
    wait_for_callbacks,
)

NODE_NAME = "memspec"
# Before the action server goes (SIGINT/SIGTERM, destroy_node): how long ended goals may take to hand
# rclpy their results, then how long the executor gets to send them to the clients that asked for them
# (rclpy sends a result from an executor task of its own, after the execute callback returned).
RESULTS_OUT_SECONDS = 5.0
RESULT_SEND_SECONDS = 0.5
# Executor threads: the generation (the action's execute callback), goal/cancel callbacks beside it, timers.
EXECUTOR_THREADS = 4
EXECUTOR_SHUTDOWN_SECONDS = 1.0
SPIN_SECONDS = 0.1  # main() wakes this often to see whether a signal closed the goals


def recorded(transition):
    """A transition callback whose exception is logged and kept for /diagnostics before it propagates: rclpy then
    runs on_error, but swallows the exception itself, so its cause was nowhere to be seen."""
    step = transition.__name__.removeprefix("on_")

    @functools.wraps(transition)
    def run(node: MemSpecNode, state: LifecycleState) -> TransitionCallbackReturn:
        try:
            with node._transitioning:  # destroy_node waits for it (a configure loading models when SIGINT came)
                return transition(node, state)
        except Exception as exc:
            node._transition_error = f"{step} raised {type(exc).__name__}: {exc}"
            node.get_logger().error(f"{node._transition_error}\n{traceback.format_exc()}")
            raise
    return run


class RecordingRanker:
    """The node's predictor: passes rankings through, keeps the latest scores for ~/cache_state and counts
    failed rankings for /diagnostics (a background one is otherwise only logged by OverlappedPredictor)."""

    def __init__(self, engine) -> None:
        self.engine = engine  # the PredictionEngine
        self.latest: dict[str, float] = {}
        self.failures = 0
        self.last_error = ""

    @property
    def recent_tokens(self) -> int | None:
        """The engine's T, which the controller holds memspec.recent_tokens to."""
        return getattr(self.engine, "recent_tokens", None)

    @property
    def classes(self) -> tuple[str, ...] | None:
        """What the engine's head scores, which the controller checks the registry against."""
        return getattr(self.engine, "classes", None)

    @property
    def interval(self) -> int:
        """The N the engine's head was trained at, which the controller holds memspec.interval to when its labels
        are per interval (label_horizon > 0)."""
        return getattr(self.engine, "interval", 0)

    @property
    def label_horizon(self) -> int:
        return getattr(self.engine, "label_horizon", 0)

    def _guarded(self, call, *args):
        """``call(*args)``; if it raises, the failure is counted for /diagnostics and None returned: a broken
        predictor costs speed, never a goal."""
        try:
            return call(*args)
        except Exception as exc:
            self._failed(exc)
            return None

    def begin(self, prompt_ids) -> None:
        self._guarded(self.engine.begin, prompt_ids)  # failed: the rankings of this goal fall back (rank below)

    def prefix_rows(self, positions: int):
        # failed: nothing kept, and the prompt features of a goal continuing it take a target pass
        return self._guarded(self.engine.prefix_rows, positions)

    def reuse_rows(self, rows, positions=None) -> None:
        self._guarded(self.engine.reuse_rows, rows, positions)  # failed: the prompt features take a pass of the target

    def rank(self, context):
        """The predictor's ranking; if it raises, general-static's order (drafts of domain "general" first,
        then registry order), so that a broken predictor costs speed, never a goal."""
        try:
            return self.rank_or_raise(context)
        except Exception:
            self.latest = {}  # no ranking now: ~/cache_state must not show the last good one as current
            general = [d for d in context.candidates if context.domains.get(d) == "general"]
            order = general + [d for d in context.candidates if d not in general]
            return [(name, float(len(order) - i)) for i, name in enumerate(order)]

    def rank_or_raise(self, context):
        """The predictor's ranking, its failure counted (/diagnostics) and raised: what the overlapped predictor
        calls in the background, where a failure keeps the last good ranking (general-static's order in its place
        evicted a draft the good one had kept, and the next good ranking loaded it again)."""
        try:
            ranking = self.engine.rank(context)
        except Exception as exc:
            self._failed(exc)
            raise
        self.latest = {name: float(score) for name, score in ranking}
        return ranking

    def _failed(self, exc: Exception) -> None:
        self.failures += 1
        self.last_error = f"{type(exc).__name__}: {exc}"

    def parameter_bytes(self) -> int:
        return self.engine.parameter_bytes()

    def close(self) -> None:
        self.engine.close()


@dataclass
class Loaded:
    """What configure loaded; dropped as a whole by cleanup."""

    paths: P.ModelPaths
    tokenizer: Any
    fingerprint: str  # the target tokenizer's: drafts set later are checked against it
    target: Any  # LoadedModel
    registry: Any  # DraftRegistry
    predictor: RecordingRanker | None
    controller: Any  # RuntimeController
    max_positions: int
    max_token_chars: int  # the most characters one token stands for (runtime/chat.py): the goal pre-check
    predictor_note: str = ""  # why there is no predictor, or what runs instead (a WARN on /diagnostics)
    threads: int = 0  # torch's thread count for the goals (model.threads, or the count before the node set one)

    def summary(self) -> str:
        return (f"target {self.paths.target} ({self.target.size_bytes / 1e6:.1f} MB),"
                f" drafts {', '.join(self.registry.names()) or 'none'}, predictor {self.paths.predictor or 'none'},"
                f" policy {self.controller.config.policy}, chat template"
                f" {'yes' if has_chat_template(self.tokenizer) else 'no (prompts are continued as text)'},"
                f" end token ids {self.controller.eos_token_ids or 'none'}")


class MemSpecNode(LifecycleNode):
    def __init__(self, node_name: str = NODE_NAME, **kwargs) -> None:
        # LifecycleNode.__init__'s two steps, with the lifecycle services in a group of their own (it passes none): in
        # the default group, rclpy's parameter services' too, a configure loading the models or a deactivate waiting
        # for a goal left `ros2 param get` and rqt_reconfigure unanswered until it ended; and the read-only ones
        # (get_state, ...) apart from change_state, so a lifecycle manager's get_state is answered meanwhile
        communication = kwargs.pop("enable_communication_interface", True)
        Node.__init__(self, node_name, **kwargs)
        LifecycleNodeMixin.__init__(self, enable_communication_interface=communication,
                                    callback_group=MutuallyExclusiveCallbackGroup())
        answer_lifecycle_queries_apart(self, ReentrantCallbackGroup())
        P.declare_all(self)
        # held by a transition while it runs (the ~/change_state callback, rclpy's steps included, and recorded)
        self._transitioning = threading.RLock()
        self._guard_change_state()
        self._loaded: Loaded | None = None
        self._configure_error = ""
        self._transition_error = ""  # see transition_error
        self.parameter_mismatch = ""  # a parameter change that went part of the way (param_handler._mismatch)
        self.mismatched_params: set[str] = set()  # the memspec.* parameters whose runtime value is not theirs
        self._active = False
        self._cache_pub = self._stats_pub = None
        self._cache_baseline = None  # cache counters at activation: CacheState counts since then
        self._last_cache_key: tuple | None = None
        self._last_cache_publish = 0.0
        self._cache_publishing = threading.Lock()  # ~/cache_state's samples in order (_poll_cache, on_deactivate)
        self._window = ThroughputWindow(self.get_parameter("diagnostics.window_goals").value)
        self._default_threads = 0  # torch's thread count before a configure first set one: model.threads 0
        self._hurry = False  # abandon_results
        self._runner = GoalRunner(self, self._window, ReentrantCallbackGroup())  # the action's own group
        self._action_server, self._on_goal = self._runner.server, self._runner.on_goal
        self._params = ParameterHandler(self, lambda: self._loaded, self._runner, self._transitioning)
        # diagnostics publish in every lifecycle state, like diagnostic_updater; the updater declares
        # diagnostic_updater.period, so P.values() works only from here on
        group = ReentrantCallbackGroup()  # timers: never behind a goal callback
        self._diagnostics = make_updater(self, NodeTasks(self, self._runner, self._window).items(),
                                         self.get_parameter("diagnostics.hardware_id").value, callback_group=group)
        self._params.apply_at_once(PERIOD_PARAM, self._diagnostics.set_period)
        self._params.apply_at_once("diagnostics.window_goals", self._window.resize)
        self._cache_timer = self.create_timer(P.CACHE_POLL_SECONDS, self._poll_cache, callback_group=group)

    # -- lifecycle --------------------------------------------------------------------------
    @recorded
    def on_configure(self, state: LifecycleState) -> TransitionCallbackReturn:
        t0 = time.perf_counter()
        if self._runner.models_in_use():  # after error, a goal deaf to its end: its models are freed when it ends
            why = ("a goal from before the error still runs on the previous models, which are freed when it ends"
                   if self._runner.counts()[0] else "the previous models are still being freed")
            return self._configure_failed(RuntimeError(
                f"{why}: configure again then (two sets of models are never loaded at once)"))
        try:
            if self._runner.closing:  # a signal came before: loading the models (minutes) would only fail after
                raise RuntimeError(f"{self._runner.closing}: no configure")
            self._loaded = self._load()
            if self._runner.closing:  # a signal came while the models loaded: the node is going, not serving
                raise RuntimeError(f"{self._runner.closing} while configure loaded the models")
            changed = self._params.changed_since_configure_read()
            if changed:  # set as the configure began: what was loaded is not what the parameters say
                raise RuntimeError(f"{', '.join(changed)} changed as configure read the parameters: configure again"
                                   " to load what they say now")
        except Exception as exc:  # every load error becomes a failed transition with its reason
            return self._configure_failed(exc)
        self._configure_error = self._transition_error = ""
        self.parameter_mismatch = ""  # param_handler._mismatch: the models it concerned are gone
        self.mismatched_params = set()
        self._forget_goal_figures()  # an error or throughput from the models before is not these models' state
        self._cache_baseline = None  # the new cache's counters start at zero
        self._cache_pub = self.create_lifecycle_publisher(CacheState, "~/cache_state", LATCHED)
        self._stats_pub = self.create_lifecycle_publisher(GenerationStatsMsg, "~/generation_stats", 10)
        self.get_logger().info(f"configured in {time.perf_counter() - t0:.1f} s: {self._loaded.summary()}")
        return TransitionCallbackReturn.SUCCESS

    @recorded
    def on_activate(self, state: LifecycleState) -> TransitionCallbackReturn:
        if self._runner.counts()[0]:  # a goal deaf to the deactivate: its figures would land in this activation's
            self.get_logger().error("activate refused: a goal from before the deactivate still runs (it ends"
                                    " ABORTED at its next iteration): activate again once it has ended")
            return TransitionCallbackReturn.FAILURE
        if self._runner.closing:  # before the resets below: a refused activate keeps /diagnostics' figures
            return self._shutting_down_refusal()
        self._window.clear()
        self._window.reset_counts()
        self._last_cache_key, self._cache_baseline = None, self._loaded.controller.cache.snapshot()
        if self._loaded.predictor is not None:
            self._loaded.predictor.latest = {}  # ~/cache_state shows this activation's rankings only
            # so does the predictor's WARN: one transient failure held it until the next configure
            self._loaded.predictor.failures, self._loaded.predictor.last_error = 0, ""
            # and its calls and time beside the failures: counted since configure, they described another period
            engine = self._loaded.predictor.engine
            if hasattr(engine, "calls"):
                engine.calls, engine.seconds = 0, 0.0
        if not self._runner.open(self._loaded, self._stats_pub):  # a signal began closing since the check above
            return self._shutting_down_refusal()
        result = super().on_activate(state)  # enables the lifecycle publishers
        # after them: a cache poll before would record its key and have its message dropped; not on a node a
        # signal began closing meanwhile (close_goals set it False: it takes no goal again)
        self._active = not self._runner.closing
        self.get_logger().info("active: accepting goals on ~/generate")
        return result

    def _shutting_down_refusal(self) -> TransitionCallbackReturn:
        self.get_logger().error(f"activate refused: the node is shutting down ({self._runner.closing})")
        return TransitionCallbackReturn.FAILURE

    @recorded
    def on_deactivate(self, state: LifecycleState) -> TransitionCallbackReturn:
        self._end_goals("the node was deactivated during the goal")
        # ~/cache_state is latched (transient local): a subscriber that comes while the node is inactive gets its
        # last sample, which showed a draft running from before the deactivate; the last one says none runs. Also
        # where the goal outlasts the transition (a long prefill ends at its next iteration): the managed publisher
        # publishes nothing once inactive, so a sample showing its draft would stay, false, for the whole inactive
        # time, where this one is early by the seconds the goal still takes
        self._publish_cache_state(idle=True)
        self.get_logger().info("inactive: new goals are rejected")
        return super().on_deactivate(state)

    @recorded
    def on_cleanup(self, state: LifecycleState) -> TransitionCallbackReturn:
        # a goal told to end at deactivate may not have reached its next iteration yet (a long prefill on a
        # loaded machine): its models are not freed under it
        if not self._runner.wait_idle(DEACTIVATE_WAIT_SECONDS):
            self.get_logger().error(f"cleanup refused: a goal still runs {DEACTIVATE_WAIT_SECONDS:g} s after it was"
                                    " told to end (it ends ABORTED at its next iteration): try cleanup again")
            return TransitionCallbackReturn.FAILURE
        self._release()
        self._forget_goal_figures()  # /diagnostics showed the freed models' throughput and last error
        self.get_logger().info("cleaned up: every model freed")
        return TransitionCallbackReturn.SUCCESS

    def _forget_goal_figures(self) -> None:
        """The goals' figures on /diagnostics (throughput window, goal counts, the last goal's error) start anew."""
        self._window.clear()
        self._window.reset_counts()
        self._runner.last_error = ""

    @recorded
    def on_shutdown(self, state: LifecycleState) -> TransitionCallbackReturn:
        if not self._runner.closing:  # on the way out (destroy) close_goals ended them and waited already
            self._end_goals("the node is shutting down")
        self._release_after_goal()
        return TransitionCallbackReturn.SUCCESS

    def on_error(self, state: LifecycleState) -> TransitionCallbackReturn:
        with self._transitioning:  # (not @recorded: its own failure is rclpy's) parameter changes wait, as for the rest
            self._end_goals("the node hit an error")
            released = self._release_after_goal()
        freed = "models freed" if released else "models freed once the running goal ends"
        self.get_logger().error(f"error processed ({self._transition_error or 'no cause recorded'}): {freed}, back"
                                " to unconfigured")
        return TransitionCallbackReturn.SUCCESS

    def _configure_failed(self, exc: Exception) -> TransitionCallbackReturn:
        self._release()
        self._configure_error = f"{type(exc).__name__}: {exc}"
        self.get_logger().error(f"configure failed, staying unconfigured: {self._configure_error}")
        return TransitionCallbackReturn.FAILURE

    def _end_goals(self, reason: str) -> None:
        self._active = False
        if not self._runner.end_goals(reason):
            self.get_logger().warning(f"the running goal has not reached its next iteration {DEACTIVATE_WAIT_SECONDS:g}"
                                      " s after it was told to end; it ends ABORTED when it does")

    def close_goals(self, reason: str) -> None:
        """Take no more goals, end the running and queued ones ABORTED with ``reason`` and wait until their
        results are out, so that the action server can go (SIGINT/SIGTERM in main(), destroy_node).
        The executor must still spin: rclpy sends each result from an executor task of its own."""
        self._active = False
        if self._runner.close(reason, RESULTS_OUT_SECONDS):
            time.sleep(RESULT_SEND_SECONDS)  # the executor sends the results to the clients that asked

    def abandon_results(self) -> None:
        """From now on, going (destroy_node) waits neither for the running goal nor for results to reach their
        clients: a second SIGINT/SIGTERM, which ros2 launch escalates to SIGKILL if the node lingers."""
        self._hurry = True

    def _wait_for_transition(self) -> bool:
        """Wait until no transition callback runs (True, then holding the lock) or abandon_results() asks to hurry
        (False): a configure loading the models on an executor thread would otherwise go on with a destroyed node
        (its publishers refused, on_error run on a dead state machine)."""
        if self._transitioning.acquire(blocking=False):
            return True
        self.get_logger().info("waiting for the lifecycle transition in progress (configure loading the models) to"
                               " end; a second signal stops at once")
        try:
            while not self._hurry:
                if self._transitioning.acquire(timeout=0.1):
                    return True
        except KeyboardInterrupt:  # the second signal: main()'s handler set _hurry and raised it on this thread
            pass
        return False

    def destroy_node(self) -> None:
        held = not self._hurry and self._wait_for_transition()
        try:
            self._destroy()
        finally:
            if held:
                self._transitioning.release()

    def _destroy(self) -> None:
        if self._hurry:  # the goals are told to end; the process is going, so nothing is waited for or freed
            self._active = False
            try:
                self._runner.end_goals("the node was stopped (a second signal)", wait_seconds=0.0)
            except Exception as exc:  # a queued goal's end is a task of the executor, shut down by now: the rest of
                # the destruction (the action server, the node, rclpy's context) must still happen
                self.get_logger().warning(f"the queued goals could not be ended: {type(exc).__name__}: {exc}")
        else:
            if self._runner.closing:  # main()'s close already ended the goals and waited for their results
                self._active = False
            else:
                self.close_goals("the node is being destroyed")
            # freed now, or once a goal deaf to its end is done with them: never under it (as shutdown and error)
            self._release_after_goal()
            self._shutdown_transition()
        self._runner.destroy()
        super().destroy_node()

    def _shutdown_transition(self) -> None:
        """The lifecycle's shutdown transition on the way out (SIGINT, SIGTERM, a destroy), as rclcpp leaves it to the
        node's owner: its TransitionEvent to finalized is what launch's OnStateTransition handlers and lifecycle
        managers wait for (the goals are ended and the models freed already: on_shutdown finds nothing left)."""
        if self.lifecycle_state not in ("unconfigured", "inactive", "active"):
            return
        try:
            self.trigger_shutdown()
        except KeyboardInterrupt:  # a second signal while it ran: the rest of the teardown still runs, in a hurry
            self._hurry = True
        except Exception as exc:  # the context is already gone (rclpy's own signal handler): nothing to tell
            self.get_logger().warning(f"no shutdown transition on the way out: {type(exc).__name__}: {exc}")

    def _guard_change_state(self) -> None:
        """A transition the current state does not have (``ros2 lifecycle set /memspec cleanup`` while
        active) is refused with a log line, as rclcpp does, instead of ending the node."""

        def refused(request, exc: Exception) -> None:
            self.get_logger().warning(f"transition {request.transition.label or request.transition.id} refused in"
                                      f" state {self.lifecycle_state}: {exc}")

        # the transition lock over rclpy's state-machine steps too: destroy_node, which waits for it, found a configure
        # that had failed on the way out still "configuring" (no shutdown transition, so no TransitionEvent to
        # finalized for launch to see), or stepped the same state machine from another thread
        guard_change_state(self, refused, self._transitioning)

    # -- what the parts read ------------------------------------------------------------------
    @property
    def lifecycle_state(self) -> str:
        return lifecycle_state_label(self)

    @property
    def loaded(self) -> Loaded | None:
        return self._loaded

    @property
    def configure_error(self) -> str:
        return self._configure_error

    @property
    def transition_error(self) -> str:
        """The exception that last sent a transition through on_error ("" once configure succeeds again)."""
        return self._transition_error

    @property
    def goals_rejected(self) -> int:
        return self._runner.goals_rejected

    @property
    def last_rejection(self) -> str:
        return self._runner.last_rejection

    def cache_snapshot(self, lo: Loaded):
        """The cache now, counters since activation (as CacheState documents)."""
        snap = lo.controller.cache.snapshot()
        baseline = self._cache_baseline
        # since the last activation, inactive too (after a deactivate they jumped back to counts since configure);
        # configure's cache starts from zero, so none until its first activation
        return snap.since(baseline) if baseline is not None else snap

    # -- loading and freeing ----------------------------------------------------------------
    def _load(self) -> Loaded:
        import torch

        from ..runtime.loader import load_models

        v = self._params.checked_values()
        paths = P.resolve_paths(v)
        # the predictor and datastore found beside the registry (their parameters empty) are confined too
        reason = P.check_paths({"predictor.path": paths.predictor, "datastore.path": paths.datastore},
                               P.allowed_roots(self))
        if reason:
            raise ValueError(f"{reason} (found beside the draft registry)")
        # 0 restores the count torch had before this node set one, not one an earlier configure set
        self._default_threads = self._default_threads or torch.get_num_threads()
        threads = v["model.threads"] or self._default_threads
        torch.set_num_threads(threads)
        models = load_models(paths.registry_file or None, drafts=P.draft_lists(v), target_path=paths.target,
                             tokenizer_path=paths.tokenizer, dtype=v["model.dtype"], device=v["model.device"],
                             quantization=v["model.quantization"], gamma=v["memspec.gamma"],
                             datastore_path=paths.datastore or None)
        engine, missing = self._load_predictor(paths.predictor, v["predictor.path"], models)
        try:
            return self._load_controller(v, paths, models, engine, missing, threads)
        except BaseException:
            # the target-hidden engine hooks the target and registers in a module-level table of observers, whose
            # entry keeps the target alive: unclosed, every failed configure left a target in memory for good
            if engine is not None:
                engine.close()
            models.close()
            raise

    def _load_controller(self, v: dict[str, Any], paths, models, engine, missing: str, threads: int) -> Loaded:
        """configure's last step: the controller over the loaded models, with the predictor or its fallback."""
        note = missing if engine is None and paths.predictor else ""  # a predictor that failed to load
        predictor = RecordingRanker(engine) if engine is not None else None
        config = P.runtime_config(v)
        P.check_general_draft(config.policy, config.general_draft, models.registry.names())
        chars = max_token_chars(models.tokenizer)
        reason = length_refusal(v, models.tokenizer, models.target.max_positions, chars)
        if reason:  # a params file setting them together: every goal would be refused, configure fails instead
            raise ValueError(reason)
        options = {"draft_quantization": v["drafts.quantization"], "storage": v["cache.storage"]}
        try:
            controller = models.controller(config, predictor, **options)
        except PolicyError as exc:  # the policy needs a predictor and there is none: general-static, with a WARN
            if predictor is not None:
                raise
            note = f"{missing}: memspec.policy {config.policy} runs as {P.PREDICTOR_FALLBACK} ({exc})"
            try:
                P.check_general_draft(P.PREDICTOR_FALLBACK, config.general_draft, models.registry.names())
            except ValueError as refused:  # it named a policy the operator never chose: say why that one runs
                raise ValueError(f"{note}, which cannot run: {refused}; configure a predictor (predictor.path) or"
                                 " a memspec.general_draft the registry has") from None
            controller = models.controller(dataclasses.replace(config, policy=P.PREDICTOR_FALLBACK), **options)
        if note:
            self.get_logger().warning(note)
        return Loaded(paths, models.tokenizer, models.fingerprint, models.target, models.registry, predictor,
                      controller, models.target.max_positions, chars, note, threads)

    @staticmethod
    def _load_predictor(path: str, parameter: str, models) -> tuple[Any, str]:
        """The trained predictor at ``path``, or None and why not (missing or failing to load: not a failed
        configure, see _load)."""
        from ..runtime.predictor import PredictionEngine

        if not path:
            return None, ("no predictor (predictor.path is 'none')" if parameter == "none"
                          else "no trained predictor found beside the registry (predictor.path empty)")
        try:
            return PredictionEngine.load(path, target=models.target.model, tokenizer=models.tokenizer), ""
        except Exception as exc:
            return None, f"the predictor at {path} failed to load: {type(exc).__name__}: {exc}"

    def _release(self) -> None:
        """Free every model now (no goal runs: cleanup waited, configure and destroy_node ended them)."""
        self._free(self._take_loaded())

    def _release_after_goal(self) -> bool:
        """shutdown / error: the transition must succeed, but a goal told to end may not have reached its next
        iteration yet (cleanup refuses then): the node lets go of the models now and they are freed once that goal
        is done with them, never under it. True if freed now."""
        held = [self._take_loaded()]  # emptied by the release: its gc.collect() then finds the models unreferenced
        freed = self._runner.release_when_over(lambda: self._free(held.pop()))
        if not freed:
            self.get_logger().warning("a goal still runs: its models are freed when it ends")
        return freed

    def _take_loaded(self) -> Loaded | None:
        """What configure loaded, no longer the node's (nothing but a running goal reaches it after this)."""
        self._runner.drop_stats_publisher()  # before its destruction: a goal ending meanwhile publishes on neither
        for pub in (self._cache_pub, self._stats_pub):
            if pub is not None:
                self.destroy_lifecycle_publisher(pub)
        self._cache_pub = self._stats_pub = None
        loaded, self._loaded = self._loaded, None
        return loaded

    def _free(self, loaded: Loaded | None) -> None:
        """Free every model of ``loaded``: the controller (its cache and loader thread), drafts, target, predictor."""
        if loaded is not None:
            # each step on its own: one that raises (an eviction callback, say) must not leave the loader's and the
            # predictor's threads running, nor the target held by the predictor's hook
            steps = [
                # evicts resident drafts and marks loads in flight for dropping; close waits for those a bounded
                # time (cache.CLOSE_WAIT_SECONDS): a read hung on failing storage must not hang cleanup or shutdown
                lambda: loaded.controller.cache.reset(timeout=0.0),
                loaded.controller.close,
            ]
            if loaded.predictor is not None:
                steps.append(loaded.predictor.close)  # the target-hidden encoder's forward hook holds the target
            for step in steps:
                try:
                    step()
                except Exception as exc:
                    self.get_logger().warning(f"closing the runtime: {type(exc).__name__}: {exc}")
            del steps, loaded
            gc.collect()
            # the freed models' heap pages and a GPU's cached blocks go back to the system: cleaned up to hand its
            # memory to another part of the robot's stack, the node kept them (for a next configure that may never
            # come). Logged, not raised, as the steps above (a GPU left in a sticky error raises here)
            import torch

            from ..runtime.kv_cache import release_freed_memory

            try:
                release_freed_memory()
                if torch.cuda.is_initialized():
                    torch.cuda.empty_cache()
            except Exception as exc:
                self.get_logger().warning(f"handing the freed memory back: {type(exc).__name__}: {exc}")
        else:
            gc.collect()

    def loaded_parameter_bytes(self) -> int:
        """Bytes of weights the node holds now (target, resident drafts, predictor head); 0 after cleanup."""
        from ..runtime.models import parameter_bytes

        lo = self._loaded
        if lo is None:
            return 0
        total = parameter_bytes(lo.target.model)
        for name in lo.controller.cache.resident():
            model = lo.controller.cache.peek(name)  # an observer: no hit counted, no prefetch marked used
            if model is not None:
                total += parameter_bytes(model.model)
        if lo.predictor is not None:
            total += lo.predictor.parameter_bytes()
        return total

    def model_refs(self) -> list[weakref.ref]:
        """Weak references to every loaded module (tests check they die after cleanup)."""
        lo = self._loaded
        if lo is None:
            return []
        refs = [weakref.ref(lo.target.model)]
        refs += [weakref.ref(m.model) for n in lo.controller.cache.resident() if (m := lo.controller.cache.peek(n))]
        return refs

    # -- periodic publications ----------------------------------------------------------------
    def _poll_cache(self) -> None:
        self._publish_cache_state()

    def _publish_cache_state(self, idle: bool = False) -> None:
        """~/cache_state while active, when the cache changed or its period is over; ``idle``: now, with no draft
        running (the node going inactive). Under one lock, the activity checked inside it: the timer's group is
        reentrant, and a poll that saw the node active could publish a draft running after deactivate's sample."""
        with self._cache_publishing:
            if idle or self._active:
                self._publish_cache_state_locked(idle)

    def _publish_cache_state_locked(self, idle: bool) -> None:
        lo, pub = self._loaded, self._cache_pub  # read once: a transition may release them on another thread
        if lo is None or pub is None:
            return
        snap = self.cache_snapshot(lo)
        if idle:
            snap = dataclasses.replace(snap, active="")
        key = (cache_state_key(snap), lo.registry.version)  # the message lists the registry's drafts too
        now = time.monotonic()
        period = self.get_parameter("diagnostics.cache_state_period").value
        if not idle and key == self._last_cache_key and now - self._last_cache_publish < period:
            return
        self._last_cache_key, self._last_cache_publish = key, now
        scores = lo.predictor.latest if lo.predictor is not None else {}
        # (destroyed by a shutdown or an error since the check above: nothing to publish to)
        publish_unless_destroyed(pub, cache_state_msg(snap, lo.registry.entries(), scores,
                                                      self.get_clock().now().to_msg()), lambda: self._cache_pub is pub)


def _quiet_libraries() -> None:
    """No progress bars or library warnings on the robot's terminal: the node logs what matters."""
    try:
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
        hf_logging.set_verbosity_error()
    except ImportError:
        pass


def serve(executor, closed: Future, logger) -> None:
    """Spin until ``closed`` is done (a signal closed the goals) or the context ends; a failing callback is logged,
    never the end of the node. spin_once, not spin_until_future_complete: rclpy's multi-threaded executor adds a
    done-callback to the future at every wake-up, kept until it completes, which grew the node's memory for its
    whole life (tens of thousands of closures within seconds of a busy timer)."""
    while rclpy.ok(context=executor.context) and not closed.done():
        try:
            executor.spin_once(timeout_sec=SPIN_SECONDS)
        except (KeyboardInterrupt, ExternalShutdownException):
            break
        except Exception as exc:
            logger.error(f"a callback failed: {type(exc).__name__}: {exc}")


def main(args: list[str] | None = None) -> None:
    _quiet_libraries()
    # our SIGINT/SIGTERM handler, not rclpy's (which stops the context before the goals' results are sent)
    rclpy.init(args=args, signal_handler_options=SignalHandlerOptions.NO)
    try:
        node = MemSpecNode()
    except ParameterException as exc:  # a launch override of the wrong type or out of range: say which, no traceback
        print(f"memspec_node: a start-up parameter was refused: {exc}", file=sys.stderr)
        rclpy.try_shutdown()
        raise SystemExit(2) from None
    executor = MultiThreadedExecutor(num_threads=EXECUTOR_THREADS)
    executor.add_node(node)
    closing = threading.Event()
    closed = Future()
    second: list[int] = []  # the second signal's number: the process then leaves at once (_exit_at_once)
    done = threading.Event()  # main() has shut down: Python may be joining the executor's threads (a goal deaf to
    # its end), so a second signal then leaves at once itself (its KeyboardInterrupt would only end the join)

    def close(reason: str) -> None:
        try:
            node.close_goals(reason)
        finally:
            closed.set_result(True)  # wakes the executor: main() goes on to destroy the node

    def on_signal(signum, _frame) -> None:
        if closing.is_set():  # a second signal: stop without waiting for the results
            second.append(signum)
            if done.is_set():
                _exit_at_once(128 + signum)
            node.abandon_results()
            raise KeyboardInterrupt
        closing.set()
        reason = f"the node is shutting down ({signal.Signals(signum).name})"
        node.get_logger().info(f"{reason}: ending the goals and sending their results")
        threading.Thread(target=close, args=(reason,), name="memspec-close", daemon=True).start()

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    try:
        serve(executor, closed, node.get_logger())
    finally:
        try:
            try:
                # the callbacks still running (a diagnostics update, a service or timer callback) end before the node
                # is destroyed under them: rclpy's shutdown(timeout_sec) does not wait for them (wait_for_callbacks).
                # A goal's execute is no such callback (rclpy runs it as a task): release_when_over covers it
                wait_for_callbacks(executor, EXECUTOR_SHUTDOWN_SECONDS)
                executor.shutdown(timeout_sec=EXECUTOR_SHUTDOWN_SECONDS)
            except KeyboardInterrupt:  # the second signal landed here: the node is still destroyed, hurried
                pass
            try:
                node.destroy_node()
            finally:  # whatever the destruction raised, rclpy's context is shut down (the process exits cleanly)
                rclpy.try_shutdown()
        finally:
            done.set()
            if second:
                _exit_at_once(128 + second[0])


def _exit_at_once(status: int) -> None:
    """Leave now after a second signal. rclpy's MultiThreadedExecutor never shuts its thread pool down, and Python
    joins those threads at exit: a callback still running (configure loading the models, a deactivate waiting for a
    goal) kept the process alive until it ended, so the second Ctrl-C did not stop the node and launch had to
    SIGKILL it. Everything the node had to say is flushed first; 128 + the signal is a shell's status for it."""
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # closed or gone: nothing left to say there
            pass
    try:  # and C's buffers (rcutils logs through them; a pipe's stdout is fully buffered), which os._exit skips
        ctypes.CDLL(None).fflush(None)
    except (OSError, AttributeError):
        pass
    os._exit(status)


if __name__ == "__main__":
    main()
