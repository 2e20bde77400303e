"""Diagnostics on diagnostic_updater's contract, and the node's typed status messages.

Where the real diagnostic_updater imports (apt ROS) the node's tasks run on its ``Updater``
(:class:`UpstreamUpdater`); ROS from PyPI wheels has no such package, so :class:`Updater` here
publishes what the real Python ``Updater`` publishes: a ``DiagnosticArray`` on the absolute topic
``/diagnostics`` (depth 1), one OK "Node starting up" status per task as it is added, then one
``DiagnosticStatus`` per task named ``"<node name>: <task>"`` every ``diagnostic_updater.period``
seconds (the fully qualified name with ``diagnostic_updater.use_fqn``), each starting at ERROR "No
message was set", ``hardware_id`` set, string ``KeyValue`` pairs and byte levels.
diagnostic_aggregator and rqt_robot_monitor on a robot treat the node like any other
(config/diagnostic_analyzers.yaml groups its entries). Deliberate differences, in both updaters:
``hardware_id`` defaults to the host name, a period change applies at once, and a task that raises
is published as ERROR instead of stopping the update.

The updater, not params.py, declares ``diagnostic_updater.period``: the real Python Updater declares
it unconditionally and would raise ParameterAlreadyDeclaredException on a node that had.

Every figure comes from memspec_ros.runtime.stats: the throughput window is one
``GenerationStats`` built from the window's goals (their iterations and decode times), so
tokens/s, mean accepted tokens, fallback fraction and prediction overhead keep their single
definition.
"""

from __future__ import annotations

import functools
import math
import socket
import threading
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from diagnostic_msgs.msg import DiagnosticArray, DiagnosticStatus, KeyValue
from rclpy.qos import QoSDurabilityPolicy, QoSProfile

from memspec_interfaces.msg import CacheState, DraftState
from memspec_interfaces.msg import GenerationStats as GenerationStatsMsg

from ..runtime.chat import has_chat_template
from ..runtime.draft_forward import decoder_summary
from ..runtime.policies import RANKING_POLICIES
from ..runtime.predictor import unscored_drafts
from ..runtime.stats import CacheStats, GenerationStats
from . import params as P

OK, WARN, ERROR, STALE = DiagnosticStatus.OK, DiagnosticStatus.WARN, DiagnosticStatus.ERROR, DiagnosticStatus.STALE
DIAGNOSTICS_TOPIC = "/diagnostics"  # absolute: never namespaced (diagnostic_updater's rule)
PERIOD_PARAM = "diagnostic_updater.period"
USE_FQN_PARAM = "diagnostic_updater.use_fqn"
TASK_TARGET = "target model"
TASK_CACHE = "draft cache"
TASK_THROUGHPUT = "throughput"
TASK_PREDICTOR = "predictor"
TASKS = (TASK_TARGET, TASK_CACHE, TASK_THROUGHPUT, TASK_PREDICTOR)
# diagnostic_updater's texts: a status no task has set yet, and what each task shows when it is added
NO_MESSAGE = "No message was set"
STARTING_UP = "Node starting up"

# ~/cache_state: late joiners get the current state at once.
LATCHED = QoSProfile(depth=1, durability=QoSDurabilityPolicy.TRANSIENT_LOCAL)


@dataclass
class Status:
    """One task's status under construction (diagnostic_updater's DiagnosticStatusWrapper).

    It starts as the real Updater hands a task its status: ERROR "No message was set", so a task that
    forgets its summary shows up instead of passing for OK.
    """

    level: bytes = ERROR
    message: str = NO_MESSAGE
    values: list[tuple[str, str]] = field(default_factory=list)

    def summary(self, level: bytes, message: str) -> None:
        self.level, self.message = level, message

    def merge(self, level: bytes, message: str) -> None:
        """DiagnosticStatusWrapper.mergeSummary: the level becomes the higher of the two. When both levels
        are OK, or both are not, the texts are joined with "; " (the new one alone if the old is empty);
        when only one is not OK, its text alone is kept (an OK text never hides a problem's)."""
        if (level > OK) == (self.level > OK):
            self.message = f"{self.message}; {message}" if self.message else message
        elif level > self.level:
            self.message = message
        self.level = max(self.level, level)

    def add(self, key: str, value) -> None:
        if isinstance(value, float):
            text = f"{value:.4g}" if math.isfinite(value) else str(value)
        elif isinstance(value, (list, tuple)):
            text = ", ".join(str(v) for v in value)
        else:
            text = str(value)
        self.values.append((key, text))


class ThroughputWindow:
    """The last ``size`` finished goals, combined into one GenerationStats on demand."""

    def __init__(self, size: int) -> None:
        self._lock = threading.Lock()
        self._size = size
        self._goals: deque[GenerationStats] = deque()  # at most ``size`` once a goal is added
        self.measured_goals = 0  # goals whose timings entered the window since activation
        self.finished_goals = 0  # every goal answered since activation: cancelled, aborted and unrun ones too

    def count_finished(self) -> None:
        with self._lock:
            self.finished_goals += 1

    def reset_counts(self) -> None:
        with self._lock:
            self.measured_goals = self.finished_goals = 0

    def resize(self, size: int) -> None:
        """Goals beyond ``size`` go at the next add, not now (an idle node frees them with its next goal): a
        parameter batch refused after this setter ran sets the old size back at once (param_handler's undo), and
        shrinking here had dropped the older goals for good."""
        with self._lock:
            self._size = size

    def add(self, stats: GenerationStats) -> None:
        with self._lock:
            self._goals.append(stats)
            while len(self._goals) > self._size:
                self._goals.popleft()
            self.measured_goals += 1

    def clear(self) -> None:
        with self._lock:
            self._goals.clear()

    def view(self) -> WindowView:
        """The window's figures from one look at it (read one by one, a goal finishing in between made the goal
        count, the combined figures and the switches describe different sets of goals). Its goals combined into
        one GenerationStats, whose properties are the window's figures, draft switches aside: those are summed
        within each goal, as the joined iterations would also count the last draft of one goal against the first
        of the next, and no draft is active between goals."""
        with self._lock:
            goals, measured, finished = list(self._goals)[-self._size:], self.measured_goals, self.finished_goals
        combined = GenerationStats.combined(goals) if goals else None
        return WindowView(len(goals), combined, sum(g.draft_switches for g in goals), measured, finished)


@dataclass(frozen=True)
class WindowView:
    """ThroughputWindow's figures at one moment."""

    goals: int
    combined: GenerationStats | None  # None: no goal in the window
    draft_switches: int
    measured_goals: int
    finished_goals: int


Task = Callable[[Status], None]


def run_task(fill: Task) -> Status:
    """The status ``fill`` leaves, starting from the real Updater's preset (ERROR "No message was set")."""
    status = Status()
    try:
        fill(status)
    except Exception as exc:  # deliberate: the real Updater lets it escape into the executor; here one broken
        # task shows as ERROR and the others still publish
        status = Status(ERROR, f"diagnostic task failed: {type(exc).__name__}: {exc}")
    return status


def _updater_parameter(node, name: str) -> Any:
    """A diagnostic_updater.* parameter's value: read if declared already, else declared from params.py's
    table (as the C++ Updater does; this keeps the table's description and range)."""
    if node.has_parameter(name):
        return node.get_parameter(name).value
    return P.declare(node, P.BY_NAME[name])


class _TaskList:
    """The named tasks and how one becomes a DiagnosticStatus (shared by both updaters below)."""

    def __init__(self, node, hardware_id: str) -> None:
        self.node = node
        # deliberate: the real Updater leaves it empty and logs a warning; the host name is what a robot's
        # monitor needs to tell two machines' nodes apart
        self.hardware_id = hardware_id or socket.gethostname() or "none"
        self.node_name = node.get_name()
        self.tasks: list[tuple[str, Task]] = []
        self._lock = threading.Lock()  # the timer may fire on another executor thread while tasks are added

    def collect(self) -> list[DiagnosticStatus]:
        """Every task's status now, as it would be published (names, hardware_id, string values)."""
        with self._lock:
            tasks = list(self.tasks)
        return [self.status_msg(name, run_task(fill)) for name, fill in tasks]

    def status_msg(self, task: str, status: Status) -> DiagnosticStatus:
        return DiagnosticStatus(
            level=bytes([status.level]) if isinstance(status.level, int) else status.level,
            name=f"{self.node_name}: {task}",
            message=status.message,
            hardware_id=self.hardware_id,
            values=[KeyValue(key=k, value=v) for k, v in status.values],
        )


class Updater(_TaskList):
    """diagnostic_updater.Updater for the node's tasks, where that package is not installed.

    As the real one: a ``DiagnosticArray`` with one "Node starting up" OK status per task as it is added,
    then every task's status each ``diagnostic_updater.period`` seconds (and on ``force_update()``), names
    prefixed with the node's name (fully qualified when ``diagnostic_updater.use_fqn``). It declares both
    parameters itself unless the node has (the real Python Updater always declares the period).
    """

    def __init__(self, node, tasks: Sequence[tuple[str, Task]] = (), hardware_id: str = "",
                 callback_group=None) -> None:
        super().__init__(node, hardware_id)
        self.publisher = node.create_publisher(DiagnosticArray, DIAGNOSTICS_TOPIC, 1)
        if _updater_parameter(node, USE_FQN_PARAM):
            self.node_name = node.get_fully_qualified_name()  # "/ns/name", as the C++ Updater names it
        self._callback_group = callback_group
        self.timer = node.create_timer(_updater_parameter(node, PERIOD_PARAM), self.update,
                                       callback_group=callback_group)
        for name, fill in tasks:
            self.add(name, fill)

    def add(self, name: str, fill: Task) -> None:
        """Add a task; its "Node starting up" status goes out at once, before the first period."""
        with self._lock:
            self.tasks.append((name, fill))
        self._publish([self.status_msg(name, Status(OK, STARTING_UP))])

    def update(self) -> None:
        self._publish(self.collect())

    def force_update(self) -> None:
        """Publish every task's status now, between periods."""
        self.update()

    def set_period(self, seconds: float) -> None:
        """Deliberate: the real Updater reads its period once; here a parameter change applies at once."""
        self.node.destroy_timer(self.timer)
        self.timer = self.node.create_timer(seconds, self.update, callback_group=self._callback_group)

    def destroy(self) -> None:
        self.node.destroy_timer(self.timer)
        self.node.destroy_publisher(self.publisher)

    def _publish(self, statuses: list[DiagnosticStatus]) -> None:
        msg = DiagnosticArray(status=statuses)
        msg.header.stamp = self.node.get_clock().now().to_msg()
        self.publisher.publish(msg)


def _filled(fill: Task, stat):
    """A task for the real Updater: it hands a DiagnosticStatusWrapper preset to ERROR "No message was set"
    and publishes the one returned."""
    status = run_task(fill)
    stat.summary(status.level, status.message)
    for key, value in status.values:
        stat.add(key, value)
    return stat


class UpstreamUpdater(_TaskList):
    """The node's tasks on the real diagnostic_updater.Updater (apt ROS), keeping this module's deliberate
    differences (hardware_id, live period, a failing task as ERROR)."""

    def __init__(self, upstream_cls: type, node, tasks: Sequence[tuple[str, Task]] = (),
                 hardware_id: str = "", callback_group=None) -> None:
        super().__init__(node, hardware_id)
        # it declares diagnostic_updater.period (params.py leaves that to the updater) and reads use_fqn
        P.take_int_override_as_double(node, P.BY_NAME[PERIOD_PARAM])
        self.upstream = upstream_cls(node, period=P.BY_NAME[PERIOD_PARAM].default)
        # upstream declares the period with a bare default: `ros2 param describe` and rqt_reconfigure then show no
        # description, range or "applies" line, which every other parameter of the node has
        node.set_descriptor(PERIOD_PARAM, P.BY_NAME[PERIOD_PARAM].descriptor())
        self.upstream.setHardwareID(self.hardware_id)
        # node_name came with use_fqn (diagnostic_updater 3.2, 2024); before it the plain node name is used
        if node.has_parameter(USE_FQN_PARAM) and node.get_parameter(USE_FQN_PARAM).value:
            if hasattr(self.upstream, "node_name"):
                # upstream joins namespace and name with "/": "//memspec: ..." in the root namespace (the launch
                # default), which an aggregator rule for "/memspec:" never matched; named as the C++ Updater names it
                self.upstream.node_name = node.get_fully_qualified_name()
            else:
                node.get_logger().warning(f"{USE_FQN_PARAM} is ignored: this diagnostic_updater predates it (3.2),"
                                          " so the statuses are named by the plain node name")
        self.node_name = getattr(self.upstream, "node_name", self.node_name)
        self._group = callback_group
        self._regroup_timer()
        for name, fill in tasks:
            self.add(name, fill)

    def _regroup_timer(self) -> None:
        """The upstream timer, made again in ``callback_group``: upstream creates it in the node's default
        mutually exclusive group, which the lifecycle and parameter services share, so a long configure or a
        deactivate's wait for a goal would hold /diagnostics back until the aggregator shows it STALE."""
        if self._group is None:
            return
        ungrouped = self.upstream.timer
        self.upstream.timer = self.node.create_timer(self.upstream.period, self.upstream.update,
                                                     callback_group=self._group)
        self.node.destroy_timer(ungrouped)

    def add(self, name: str, fill: Task) -> None:
        with self._lock:
            self.tasks.append((name, fill))
        self.upstream.add(name, functools.partial(_filled, fill))  # publishes "Node starting up"

    def update(self) -> None:
        self.upstream.update()

    def force_update(self) -> None:
        self.upstream.force_update()

    def set_period(self, seconds: float) -> None:
        old = self.upstream.timer
        self.upstream.period = seconds  # its setter starts a new timer but only resets the old one ...
        self.node.destroy_timer(old)  # ... which would go on firing
        self._regroup_timer()

    def destroy(self) -> None:
        self.node.destroy_timer(self.upstream.timer)
        self.node.destroy_publisher(self.upstream.publisher)


def make_updater(node, tasks: Sequence[tuple[str, Task]], hardware_id: str = "",
                 callback_group=None) -> Updater | UpstreamUpdater:
    """The real diagnostic_updater where it imports (apt ROS), else this module's :class:`Updater`."""
    try:
        from diagnostic_updater import Updater as upstream_cls
    except ImportError:  # ROS from PyPI wheels has no diagnostic_updater
        return Updater(node, tasks, hardware_id, callback_group)
    return UpstreamUpdater(upstream_cls, node, tasks, hardware_id, callback_group)


# -- the tasks' contents (pure functions of runtime state, tested without DDS) --------------------

def fill_cache_status(status: Status, snap: CacheStats | None, window: GenerationStats | None,
                      registry_names: Sequence[str]) -> None:
    if snap is None:
        status.summary(OK, "no draft cache (node not configured)")
        return
    status.add("resident", snap.resident or "none")
    status.add("loading", snap.loading or "none")
    status.add("failed", sorted(snap.failed) or "none")
    status.add("in storage", [n for n in registry_names if n not in snap.resident and n not in snap.loading
                               and n not in snap.failed] or "none")
    status.add("active", snap.active or "none")
    status.add("working set", snap.working_set or "none")
    status.add("capacity (K)", snap.capacity)
    status.add("bytes resident", snap.bytes_resident)
    status.add("bytes reserved", snap.bytes_reserved)
    status.add("budget bytes", snap.budget_bytes if snap.budget_bytes else "0 (no byte budget)")
    for key in ("hits", "misses", "loads", "load_failures", "use_failures", "dropped_loads", "evictions",
                "wasted_prefetches"):
        status.add(key.replace("_", " "), getattr(snap, key))
    # with no lookup yet, 0.0 read as every lookup missed
    status.add("hit rate", snap.hit_rate if snap.hits + snap.misses else "n/a (no lookup yet)")
    status.add("load seconds", snap.load_seconds)
    status.summary(OK, f"{len(snap.resident)}/{snap.capacity} drafts resident")
    wasted = window.cache.wasted_prefetches if window is not None and window.cache is not None else 0
    status.add("wasted prefetches (window)", wasted)
    if wasted:
        status.merge(WARN, f"{wasted} prefetched draft(s) evicted unused in the recent goals")
    for name, why in sorted(snap.failed.items()):
        status.merge(ERROR, f"draft {name!r} failed (out of service until retried): {why}")


def fill_throughput_status(status: Status, window: GenerationStats | None, goals: int, measured_goals: int,
                           fallback_warn: float, finished_goals: int, draft_switches: int | None = None) -> None:
    """``finished_goals``: every goal answered since activation; ``measured_goals``: those whose timings the
    throughput figures count (a goal cancelled or ended before it ran, or one that failed, has none);
    ``draft_switches``: the window's, summed per goal (None: counted over ``window``'s iterations)."""
    status.add("goals in window", goals)
    status.add("goals finished since activation", finished_goals)
    status.add("goals measured since activation", measured_goals)
    if window is None or goals == 0:
        status.summary(OK, f"no measured goal yet ({finished_goals} finished, none with timings)" if finished_goals
                       else "no finished goal yet")
        return
    status.add("tokens per second", window.tokens_per_second)
    status.add("mean accepted tokens", window.mean_accepted)
    status.add("acceptance rate", window.acceptance_rate)
    status.add("fallback fraction", window.fallback_fraction)
    status.add("prediction overhead", window.prediction_overhead)
    status.add("load wait fraction", window.load_wait_fraction)
    status.add("completion tokens", window.completion_tokens)
    status.add("decode seconds", window.decode_seconds)
    status.add("draft switches", window.draft_switches if draft_switches is None else draft_switches)
    status.add("copied iterations", window.copied_iterations)
    status.add("dropped draft tokens", window.dropped_proposals)
    status.summary(OK, f"{window.tokens_per_second:.1f} tok/s, E[A] {window.mean_accepted:.2f}")
    if window.fallback_fraction > fallback_warn:
        status.merge(WARN, f"fallback fraction {window.fallback_fraction:.2f} > {fallback_warn:.2f}:"
                           " the preferred draft is often not resident (raise K or the budget)")


# -- the node's tasks --------------------------------------------------------------------------------

class NodeTasks:
    """memspec_node's four tasks (target model, draft cache, throughput, predictor) for ``make_updater``.

    They read the node (``lifecycle_state``, ``loaded``: what configure loaded or None, ``configure_error``,
    ``transition_error``,
    ``cache_snapshot``), its goal runner (``counts``, rejections, the last goal's error) and its throughput
    window of finished goals.
    """

    def __init__(self, node, runner, window: ThroughputWindow) -> None:
        self.node, self.runner, self.window = node, runner, window

    def items(self) -> list[tuple[str, Task]]:
        return [(TASK_TARGET, self.fill_target), (TASK_CACHE, self.fill_cache),
                (TASK_THROUGHPUT, self.fill_throughput), (TASK_PREDICTOR, self.fill_predictor)]

    def fill_target(self, s: Status) -> None:
        state = self.node.lifecycle_state
        s.add("lifecycle state", state)
        running, queued = self.runner.counts()
        s.add("goal running", running)
        s.add("goals queued", queued)
        rejected, last = self.runner.rejections()
        s.add("goals rejected", rejected)
        s.add("last rejection", last or "none")
        # whose rejections: without diagnostic_updater.use_fqn the status name is the bare node name, the same for
        # /robot1/memspec and /robot2/memspec on one domain (memspec_client --chat reads the reason by this)
        s.add("node", self.node.get_fully_qualified_name())
        lo = self.node.loaded
        if state == "finalized":  # shut down, it can never serve again: first, whatever failed before the shutdown
            s.summary(WARN, "finalized (shut down): no model loaded and no goal served; restart the node to serve")
            return
        if self._configuring(s):  # loading the models (minutes on a large target): an earlier attempt's failure is
            # not the state (the summary said ERROR for the whole retry), nor "no model loaded"
            if self.node.configure_error:
                s.add("last configure error", self.node.configure_error)
            return
        if self.node.configure_error:
            s.summary(ERROR, f"configure failed: {self.node.configure_error}")
            return
        if self.node.transition_error and lo is None:  # until configure succeeds again
            # a goal told to end may not have reached its next iteration: its models are freed when it does, and
            # configure is refused until then (node.py, _release_after_goal)
            if not self.runner.models_in_use():
                freed = "the models were freed"
            else:  # the goal, or the release on its own thread after it (goal_runner._free_after)
                freed = ("the models are freed once the goal still running ends" if self.runner.counts()[0]
                         else "the models are being freed") + " (configure is refused until then)"
            s.summary(ERROR, f"{self.node.transition_error}; {freed} and the node went back to unconfigured:"
                             " configure it again")
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
        if lo.target.path_choice is not None:  # auto: what was measured at configure, at that configure's gamma
            choice = lo.target.path_choice  # (memspec.gamma changed since keeps the path: chosen at configure)
            for timing in choice.timings:
                s.add(f"auto {timing.path} ms (1 / {choice.gamma + 1} tokens, gamma {choice.gamma} at configure)",
                      f"{timing.one_token_ms:.2f} / {timing.verify_ms:.2f}")
        if lo.target.path_report is not None:  # fp32; q8_0 on GGUF's Q8_0 grid; fp16 where fp16 holds it
            s.add("embedding", lo.target.path_report.embedding)
            s.add("cpu kernels", lo.target.path_report.kernels)
        s.add("decoder", decoder_summary(lo.target.model))
        s.add("parameter bytes", lo.target.size_bytes)
        s.add("context tokens", lo.max_positions)
        s.add("chat template", has_chat_template(lo.tokenizer))
        s.add("end token ids", lo.controller.eos_token_ids or "none")
        store = lo.controller.datastore
        s.add("datastore", f"{lo.paths.datastore}: {store.answers} answers, {store.token_count} tokens"
              + ("" if lo.controller.config.context_lookup else " (unused: memspec.context_lookup is off)")
              if store is not None else "none")
        s.add("remembered answers", lo.controller.remembered_answers)
        s.add("prompt cache", _prompt_cache_status(lo.controller))
        s.summary(OK, f"loaded ({state})")
        if self.node.parameter_mismatch:
            s.merge(WARN, f"a parameter change went part of the way: {self.node.parameter_mismatch}")
        if self.runner.last_error:
            s.merge(ERROR, f"the last goal failed: {self.runner.last_error}")

    def _configuring(self, s: Status) -> bool:
        """While a configure loads the models: said so (the tasks said "not configured" / "unconfigured")."""
        if self.node.lifecycle_state != "configuring":
            return False
        s.summary(OK, "configuring: loading the models")
        return True

    def fill_cache(self, s: Status) -> None:
        if self._configuring(s):
            return
        lo = self.node.loaded
        snap = self.node.cache_snapshot(lo) if lo is not None else None
        names = lo.registry.names() if lo is not None else []
        fill_cache_status(s, snap, self.window.view().combined, names)
        if lo is not None:
            s.add("policy", lo.controller.config.policy)

    def fill_throughput(self, s: Status) -> None:
        w = self.window.view()
        fill_throughput_status(s, w.combined, w.goals, w.measured_goals,
                               self.node.get_parameter("diagnostics.fallback_warn_fraction").value, w.finished_goals,
                               w.draft_switches)

    def fill_predictor(self, s: Status) -> None:
        if self._configuring(s):
            return
        lo = self.node.loaded
        if lo is None:
            s.summary(OK, "unconfigured")
            return
        policy = lo.controller.config.policy
        s.add("policy", policy)
        if lo.predictor_note:  # none found, or it failed to load: what runs instead
            s.add("problem", lo.predictor_note)
        if lo.predictor is None:
            # the policy asked for (memspec.policy), not the one running: a predictor policy falls back to
            # general-static, and only while one is asked for is the missing predictor a problem
            wanted = self.node.get_parameter("memspec.policy").value
            if lo.predictor_note and wanted in RANKING_POLICIES:
                s.summary(WARN, lo.predictor_note)
            else:
                s.summary(OK, f"no predictor (policy {policy} needs none)")
            return
        engine = lo.predictor.engine
        config = engine.config
        s.add("path", lo.paths.predictor)
        s.add("encoder", config.encoder)
        s.add("input", config.input)
        s.add("recent tokens (T)", config.recent_tokens)
        # which prompt positions the prompt half pools: 0 is the whole prompt (heads trained before session 35),
        # which a system prompt or earlier turns outweigh
        s.add("prompt positions (W)", config.prompt_tokens or "whole prompt")
        s.add("labels at interval (N)", config.interval)
        s.add("labels at gamma", config.gamma or "not recorded (a head saved before it was)")
        s.add("classes", config.drafts)
        for key, value in sorted(config.metrics.items()):
            s.add(f"trained {key}", value)
        calls, seconds = engine.calls, engine.seconds
        s.add("calls", calls)
        s.add("mean seconds per call", seconds / calls if calls else 0.0)
        s.add("failed rankings", lo.predictor.failures)
        s.add("latest ranking", [f"{n}={v:.3f}" for n, v in sorted(lo.predictor.latest.items(), key=lambda kv: -kv[1])]
              or "none yet")
        s.summary(OK, f"{calls} rankings")
        ranking = policy in RANKING_POLICIES
        unscored = unscored_drafts(config.drafts, {e.name: e.domain for e in lo.registry.entries()})
        if unscored:
            s.add("drafts it cannot score", unscored)
            if ranking:
                s.merge(WARN, f"the predictor has no class for {', '.join(unscored)} (by name or domain): a ranking"
                              " policy ranks them below every draft it scores; train the predictor for them"
                              " (memspec-train-predictor) or give each a domain it ranks")
        gamma = lo.controller.config.gamma
        if config.gamma and gamma != config.gamma and ranking:
            # its labels name the draft that accepted most at its gamma: drafts this close in acceptance can rank
            # in another order at another gamma, and nothing else would say the head was not made for this one
            s.merge(WARN, f"memspec.gamma is {gamma}, but the predictor's labels were measured at gamma"
                          f" {config.gamma}: its ranking may not name the best draft at {gamma}; set memspec.gamma"
                          f" {config.gamma} or retrain it (memspec-train-predictor --gamma {gamma})")
        if lo.predictor.failures:
            s.merge(WARN, f"{lo.predictor.failures} rankings failed, the last: {lo.predictor.last_error}")


# -- typed messages ------------------------------------------------------------------------------

def cache_state_msg(snap: CacheStats, entries: Sequence, scores: dict[str, float], stamp) -> CacheState:
    """CacheState from a cache snapshot, the registry entries (in order) and the latest scores."""
    msg = CacheState(capacity=int(snap.capacity), budget_bytes=int(snap.budget_bytes),
                     bytes_resident=int(snap.bytes_resident), active_draft=snap.active,
                     hits=int(snap.hits), misses=int(snap.misses), loads=int(snap.loads),
                     evictions=int(snap.evictions), wasted_prefetches=int(snap.wasted_prefetches),
                     load_seconds=float(snap.load_seconds))
    msg.header.stamp = stamp
    for e in entries:
        if e.name in snap.failed:
            state = DraftState.FAILED
        elif e.name in snap.resident:
            state = DraftState.RESIDENT
        elif e.name in snap.loading:
            state = DraftState.LOADING
        else:
            state = DraftState.IN_STORAGE
        msg.drafts.append(DraftState(
            name=e.name, domain=e.domain, state=state, is_active=(e.name == snap.active and bool(snap.active)),
            in_working_set=e.name in snap.working_set, score=float(scores.get(e.name, math.nan)),
            size_bytes=int(e.size_bytes), error=snap.failed.get(e.name, ""),
        ))
    return msg


def cache_state_key(snap: CacheStats) -> tuple:
    """What 'the cache changed' means for ~/cache_state (not the counters, which change every lookup)."""
    return (tuple(snap.resident), tuple(snap.loading), tuple(sorted(snap.failed)), tuple(snap.working_set),
            snap.active, snap.capacity, snap.budget_bytes)


def stats_fields(stats: GenerationStats, time_to_first_token: float | None = None) -> dict[str, Any]:
    """The fields a Generate result and a GenerationStats message share, filled from one GenerationStats;
    ``time_to_first_token`` from the goal's acceptance (the goal runner's), else the generation's own."""
    ttft = stats.time_to_first_token if time_to_first_token is None else time_to_first_token
    return {
        "prompt_tokens": int(stats.prompt_tokens), "reused_prompt_tokens": int(stats.reused_prompt_tokens),
        "completion_tokens": int(stats.completion_tokens),
        "tokens_per_second": float(stats.tokens_per_second), "time_to_first_token": float(ttft),
        "mean_accepted_tokens": float(stats.mean_accepted), "drafts_used": list(stats.drafts_used),
        "draft_switches": int(stats.draft_switches), "copied_iterations": int(stats.copied_iterations),
    }


def generation_stats_msg(stats: GenerationStats, goal_id, finish_reason: str, error_message: str,
                         stamp, time_to_first_token: float | None = None) -> GenerationStatsMsg:
    msg = GenerationStatsMsg(
        goal_id=goal_id, finish_reason=finish_reason, error_message=error_message,
        **stats_fields(stats, time_to_first_token),
        policy=stats.policy, iterations=len(stats.iterations), prefill_seconds=float(stats.prefill_seconds),
        decode_seconds=float(stats.decode_seconds),
    )
    msg.header.stamp = stamp
    return msg


def _prompt_cache_status(controller) -> str:
    """What the prompt cache holds for the next goal (runtime/prompt_cache.py), or why it is off."""
    if controller.prompt_cache_refused:
        return f"off: {controller.prompt_cache_refused}"
    if not controller.config.prompt_cache:
        return "off (memspec.prompt_cache)"
    cache = controller.prompt_cache
    drafts = ", ".join(f"{name} {tokens}" for name, tokens in sorted(cache.drafts.items()))
    return (f"{cache.tokens} tokens of the last goal" + (f"; drafts' tokens: {drafts}" if drafts else "")
            + f"; goals held: {cache.conversations}, {cache.bytes / 1e6:.1f} MB"
              f" (memspec.prompt_cache_bytes {controller.config.prompt_cache_bytes})")

