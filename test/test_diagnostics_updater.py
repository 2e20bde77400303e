# ruff: noqa: E402 - the ROS imports follow require_ros()
"""memspec_ros.ros.diagnostics against diagnostic_updater's behaviour (ros/diagnostics, ros2-jazzy):
DiagnosticStatusWrapper.mergeSummary, the Updater's "Node starting up" and "No message was set",
diagnostic_updater.use_fqn, force_update, and config/diagnostic_analyzers.yaml as
diagnostic_aggregator's GenericAnalyzer reads it. No models are loaded here.

The package is not among the pip-installed ROS packages (and not in CI), so the node's path through the
real Updater (UpstreamUpdater, taken where ``diagnostic_updater`` imports, as on apt ROS) runs here on
UpstreamStub, written from that Updater's source: what these tests show is the adapter against that
reading of its API, not against the package itself."""

from __future__ import annotations

import sys
import types
from pathlib import Path

import pytest
import yaml
from ros_helpers import require_ros

require_ros()

from builtin_interfaces.msg import Time
from diagnostic_msgs.msg import DiagnosticArray, DiagnosticStatus, KeyValue
from rclpy.parameter import Parameter

from memspec_interfaces.msg import DraftState
from memspec_ros.ros import params as P
from memspec_ros.ros.diagnostics import (
    ERROR,
    NO_MESSAGE,
    OK,
    PERIOD_PARAM,
    STARTING_UP,
    TASKS,
    USE_FQN_PARAM,
    WARN,
    Status,
    Updater,
    UpstreamUpdater,
    cache_state_msg,
)
from memspec_ros.runtime.stats import CacheStats

FIRST, SECOND = "first text", "second text"

# (level set by summary, level merged, expected level, expected message): mergeSummary's rule is that
# two OK or two not-OK texts are joined with "; ", and when only one is not OK its text alone stays.
MERGE_CASES = [
    (OK, OK, OK, f"{FIRST}; {SECOND}"),
    (OK, WARN, WARN, SECOND),
    (OK, ERROR, ERROR, SECOND),
    (WARN, OK, WARN, FIRST),
    (WARN, WARN, WARN, f"{FIRST}; {SECOND}"),
    (WARN, ERROR, ERROR, f"{FIRST}; {SECOND}"),
    (ERROR, WARN, ERROR, f"{FIRST}; {SECOND}"),
    (ERROR, OK, ERROR, FIRST),
]


LEVEL_NAMES = {OK: "OK", WARN: "WARN", ERROR: "ERROR"}


@pytest.mark.parametrize(("first", "merged", "level", "message"), MERGE_CASES,
                         ids=[f"{LEVEL_NAMES[a]}-then-{LEVEL_NAMES[b]}" for a, b, _, _ in MERGE_CASES])
def test_merge_follows_merge_summary(first, merged, level, message):
    s = Status()
    s.summary(first, FIRST)
    s.merge(merged, SECOND)
    assert (s.level, s.message) == (level, message)


def test_merge_onto_an_empty_text_adds_no_separator():
    s = Status()
    s.summary(OK, "")
    s.merge(OK, SECOND)
    assert (s.level, s.message) == (OK, SECOND)


def test_a_status_no_task_set_is_an_error():
    s = Status()
    assert (s.level, s.message) == (ERROR, NO_MESSAGE)
    s.merge(WARN, SECOND)  # both not OK: joined, as the real wrapper does with its preset status
    assert (s.level, s.message) == (ERROR, f"{NO_MESSAGE}; {SECOND}")


# -- the Updater ---------------------------------------------------------------------------------

LONG_PERIOD = 3600.0  # no timer tick during a test: what is published comes from construction or force_update


class Recorder:
    """Stands in for the updater's /diagnostics publisher: a subscriber cannot see what is published in the
    constructor, before discovery has matched it."""

    def __init__(self) -> None:
        self.arrays: list[DiagnosticArray] = []

    def publish(self, msg: DiagnosticArray) -> None:
        self.arrays.append(msg)

    def summaries(self, index: int) -> list[tuple[str, bytes, str]]:
        return [(s.name, s.level, s.message) for s in self.arrays[index].status]


def recorded(node) -> Recorder:
    recorder = Recorder()
    node.create_publisher = lambda *args, **kwargs: recorder
    return recorder


def _ok(s: Status) -> None:
    s.summary(OK, "fine")
    s.add("answer", 42)


def _unset(s: Status) -> None:
    s.add("touched", "values only")


def _broken(s: Status) -> None:
    raise RuntimeError("boom")


def updater_node(make_node, **overrides):
    params = [Parameter(PERIOD_PARAM, value=LONG_PERIOD)] + [Parameter(k, value=v) for k, v in overrides.items()]
    return make_node("diag_test", namespace="/robot", parameter_overrides=params)


def test_each_task_publishes_node_starting_up_at_once(make_node):
    node = updater_node(make_node)
    recorder = recorded(node)
    Updater(node, [("a", _ok), ("b", _unset)], hardware_id="hw")
    # one array per added task, as the real Updater's addedTaskCallback publishes, before any period
    assert [recorder.summaries(i) for i in range(len(recorder.arrays))] == [
        [("diag_test: a", OK, STARTING_UP)], [("diag_test: b", OK, STARTING_UP)]]
    assert all(a.status[0].hardware_id == "hw" for a in recorder.arrays)


def test_force_update_publishes_every_task_now(make_node):
    node = updater_node(make_node)
    recorder = recorded(node)
    updater = Updater(node, [("a", _ok), ("unset", _unset), ("broken", _broken)], hardware_id="hw")
    starting = len(recorder.arrays)
    updater.force_update()
    assert len(recorder.arrays) == starting + 1
    assert recorder.summaries(-1) == [
        ("diag_test: a", OK, "fine"),
        ("diag_test: unset", ERROR, NO_MESSAGE),  # no task set it: the real Updater's preset
        ("diag_test: broken", ERROR, "diagnostic task failed: RuntimeError: boom"),  # deliberate: not raised
    ]
    assert [(kv.key, kv.value) for kv in recorder.arrays[-1].status[0].values] == [("answer", "42")]
    assert recorder.arrays[-1].header.stamp.sec > 0


def test_use_fqn_names_the_statuses_with_the_fully_qualified_node_name(make_node):
    node = updater_node(make_node, **{USE_FQN_PARAM: True})
    updater = Updater(node, [("a", _ok)])
    assert [s.name for s in updater.collect()] == ["/robot/diag_test: a"]
    assert P.BY_NAME[USE_FQN_PARAM].default is False  # the real Updater's default: the plain name


def test_the_updater_declares_its_parameters_from_the_table(make_node):
    node = make_node("diag_plain")
    recorded(node)
    updater = Updater(node, [("a", _ok)])
    assert node.get_parameter(PERIOD_PARAM).value == P.BY_NAME[PERIOD_PARAM].default
    assert (
        node.describe_parameter(PERIOD_PARAM).floating_point_range[0].from_value
        == P.BY_NAME[PERIOD_PARAM].float_range[0]
    )
    assert node.get_parameter(USE_FQN_PARAM).value is False
    assert [s.name for s in updater.collect()] == ["diag_plain: a"]
    updater.set_period(0.5)
    assert updater.timer.timer_period_ns == int(0.5 * 1e9)
    assert list(node.timers) == [updater.timer]  # the old timer is gone


def test_declare_all_leaves_the_period_to_the_updater(make_node):
    """The real Python Updater declares diagnostic_updater.period unconditionally: declaring it first
    raised ParameterAlreadyDeclaredException."""
    node = make_node("diag_declared")
    P.declare_all(node)
    assert not node.has_parameter(PERIOD_PARAM) and node.has_parameter(USE_FQN_PARAM)
    UpstreamStub(node)  # the real Updater's parameter handling on a node with the table declared
    assert node.get_parameter(PERIOD_PARAM).value == P.BY_NAME[PERIOD_PARAM].default


# -- the node on diagnostic_updater's Updater (UpstreamStub) ---------------------------------------------------

class WrapperStub(DiagnosticStatus):
    """diagnostic_updater.DiagnosticStatusWrapper's summary() and add(), as the adapter uses them."""

    def summary(self, level: bytes, message: str) -> None:
        self.level, self.message = level, message

    def add(self, key: str, value: str) -> None:
        self.values.append(KeyValue(key=key, value=value))


class UpstreamStub:
    """diagnostic_updater.Updater (ros2-jazzy) as far as the node relies on it, from reading its source:
    it declares diagnostic_updater.period without looking, reads use_fqn when declared, publishes "Node
    starting up" for each task as it is added, hands each task a wrapper preset to ERROR "No message was
    set" and publishes the one returned; its period setter starts a new timer and only resets the old."""

    instances: list[UpstreamStub] = []

    def __init__(self, node, period: float = 1.0) -> None:
        self.node = node
        self.timer = node.create_timer(node.declare_parameter(PERIOD_PARAM, period).value, self.update)
        use_fqn = (node.get_parameter(USE_FQN_PARAM).value if node.has_parameter(USE_FQN_PARAM)
                   else node.declare_parameter(USE_FQN_PARAM, False).value)
        # the public attribute (from diagnostic_updater 3.2), built as ros2-jazzy builds it: "//name" in the root
        # namespace; the statuses are named from it when published
        self.node_name = "/".join([node.get_namespace(), node.get_name()]) if use_fqn else node.get_name()
        self.publisher = node.create_publisher(DiagnosticArray, "/diagnostics", 1)
        self.hwid = ""
        self.tasks: list = []
        self.published: list[list[DiagnosticStatus]] = []
        UpstreamStub.instances.append(self)

    def setHardwareID(self, hwid: str) -> None:  # noqa: N802 - the real API's name
        self.hwid = hwid

    def add(self, name: str, fn) -> None:
        self.tasks.append((name, fn))
        self.published.append([DiagnosticStatus(level=OK, name=f"{self._node_name()}: {name}", message=STARTING_UP)])

    def _node_name(self) -> str:
        return getattr(self, "node_name", self.node.get_name())  # before 3.2: the plain name

    def update(self) -> None:
        out = []
        for name, fn in self.tasks:
            stat = fn(WrapperStub(level=ERROR, name=name, message=NO_MESSAGE, hardware_id=self.hwid))
            stat.name = f"{self._node_name()}: {stat.name}"
            out.append(stat)
        self.published.append(out)

    def force_update(self) -> None:
        self.update()

    @property
    def period(self) -> float:
        return self.timer.timer_period_ns / 1e9

    @period.setter
    def period(self, seconds: float) -> None:
        self.timer.reset()
        self.timer = self.node.create_timer(seconds, self.update)


@pytest.fixture
def upstream(monkeypatch):
    module = types.ModuleType("diagnostic_updater")
    module.Updater = UpstreamStub
    module.DiagnosticStatusWrapper = WrapperStub
    monkeypatch.setitem(sys.modules, "diagnostic_updater", module)
    UpstreamStub.instances.clear()
    yield UpstreamStub.instances
    UpstreamStub.instances.clear()


def test_the_node_runs_its_tasks_on_diagnostic_updaters_updater_where_it_imports(make_node, upstream):
    from memspec_ros.ros.node import MemSpecNode

    node = make_node("memspec", node_class=MemSpecNode)  # no ParameterAlreadyDeclaredException
    assert isinstance(node._diagnostics, UpstreamUpdater)
    [real] = upstream
    assert [[(s.name, s.message) for s in array] for array in real.published] == [
        [(f"memspec: {task}", STARTING_UP)] for task in ("target model", "draft cache", "throughput", "predictor")]
    assert real.hwid  # the host name (deliberate difference)
    # the period the real Updater declares bare is described as every other parameter is (ros2 param describe)
    [period] = node.describe_parameters([PERIOD_PARAM])
    assert period.description and "applies: at once" in period.additional_constraints
    assert period.floating_point_range and period.floating_point_range[0].from_value > 0
    node._diagnostics.force_update()
    by_name = {s.name: s for s in real.published[-1]}
    target = by_name["memspec: target model"]
    assert (target.level, target.message) == (OK, "unconfigured: no model loaded")
    assert {kv.key: kv.value for kv in target.values}["lifecycle state"] == "unconfigured"
    assert [s.name for s in node._diagnostics.collect()] == list(by_name)
    # its timer runs in the node's reentrant group, not the default one the lifecycle services hold during a
    # long configure or a deactivate's wait (there /diagnostics would stall until shown STALE)
    group = node._cache_timer.callback_group
    assert real.timer.callback_group is group and len([t for t in node.timers if t.callback == real.update]) == 1
    # a live period change replaces the real updater's timer (its setter alone leaves the old one firing)
    old = real.timer
    assert node.set_parameters([Parameter(PERIOD_PARAM, value=0.5)])[0].successful
    assert real.timer is not old and old not in list(node.timers)
    assert real.timer.timer_period_ns == int(0.5 * 1e9) and real.timer.callback_group is group
    assert len([t for t in node.timers if t.callback == real.update]) == 1


def test_an_integer_period_override_starts_the_node_on_diagnostic_updaters_updater(make_node, upstream):
    """`-p diagnostic_updater.period:=2` (or `period: 2` in a params file) is an INTEGER override; the real
    Updater declares the period as a double itself, so rclpy raised InvalidParameterTypeException and the node
    did not start on apt ROS (the pip wheels' own updater took it as 2.0)."""
    from memspec_ros.ros.node import MemSpecNode

    node = make_node("memspec_int", node_class=MemSpecNode, parameter_overrides=[Parameter(PERIOD_PARAM, value=2)])
    assert isinstance(node._diagnostics, UpstreamUpdater)
    assert node.get_parameter(PERIOD_PARAM).value == 2.0 and upstream[0].period == 2.0


@pytest.mark.parametrize("namespace", ["/", "/robot"])
def test_use_fqn_on_the_upstream_updater_names_statuses_with_one_slash(make_node, upstream, namespace):
    """Upstream joins namespace and name with "/": in the root namespace, the launch default, its statuses were
    named "//memspec_fqn: ...", which an aggregator rule for "/memspec_fqn:" never matched."""
    from memspec_ros.ros.node import MemSpecNode

    node = make_node("memspec_fqn", namespace=namespace, node_class=MemSpecNode,
                     parameter_overrides=[Parameter(USE_FQN_PARAM, value=True)])
    assert isinstance(node._diagnostics, UpstreamUpdater)
    upstream[0].update()
    expected = "/memspec_fqn" if namespace == "/" else "/robot/memspec_fqn"
    assert node._diagnostics.node_name == expected
    assert {s.name.split(": ")[0] for s in upstream[0].published[-1]} == {expected}


def test_an_updater_from_before_use_fqn_is_named_by_the_node(make_node, upstream, monkeypatch):
    """diagnostic_updater before 3.2 (older Humble installs) has no node_name: the node's name stands in."""
    from memspec_ros.ros.node import MemSpecNode

    init = UpstreamStub.__init__

    def without_node_name(self, node, period=1.0):
        init(self, node, period)
        del self.node_name

    monkeypatch.setattr(UpstreamStub, "__init__", without_node_name)
    node = make_node("memspec_old", node_class=MemSpecNode)
    assert isinstance(node._diagnostics, UpstreamUpdater)
    assert node._diagnostics.node_name == "memspec_old"


# -- ~/cache_state ---------------------------------------------------------------------------------

def test_cache_state_bytes_resident_counts_loaded_drafts_only():
    """bytes_resident was filled from bytes_reserved, which also counts loads in flight."""
    entries = [types.SimpleNamespace(name=n, domain=n, size_bytes=size) for n, size in (("code", 80), ("math", 10))]
    snap = CacheStats(capacity=2, resident=["code"], loading=["math"], bytes_resident=80, bytes_reserved=90)
    msg = cache_state_msg(snap, entries, {}, Time())
    assert msg.bytes_resident == 80
    assert [d.state for d in msg.drafts] == [DraftState.RESIDENT, DraftState.LOADING]


# -- config/diagnostic_analyzers.yaml, as diagnostic_aggregator's GenericAnalyzer reads it ----------

ANALYZERS = Path(__file__).resolve().parents[1] / "config" / "diagnostic_analyzers.yaml"


def _aggregated_name(base: str, path: str, status_name: str, chaff: list[str]) -> str:
    """The name GenericAnalyzer (ros2-jazzy) gives a matched status: "/" in it shown as " ", put under the
    analyzer's path, then each remove_prefix dropped after the last "/" with a following ":" and spaces."""
    name = f"/{base}/{path}/{status_name.replace('/', ' ')}"
    for prefix in chaff:
        head, tail = name[:name.rindex("/") + 1], name[name.rindex("/") + 1:]
        if prefix and tail.startswith(prefix):
            tail = tail[len(prefix):]
        tail = tail.removeprefix(":").lstrip(" ")
        name = head + tail
    return name


def test_the_analyzer_groups_every_task_under_memspec():
    from memspec_ros.ros.node import NODE_NAME

    config = yaml.safe_load(ANALYZERS.read_text())["analyzers"]["ros__parameters"]
    analyzer = config["memspec"]
    names = [f"{NODE_NAME}: {task}" for task in TASKS]  # what the node publishes (use_fqn false)
    assert all(any(n.startswith(s) for s in analyzer["startswith"]) for n in names)
    assert analyzer["expected"] == names
    # expected checks nothing on Jazzy (ros/diagnostics#656): the count of items does
    assert analyzer["num_items"] == len(TASKS)
    assert [_aggregated_name(config["path"], analyzer["path"], n, analyzer["remove_prefix"]) for n in names] == [
        f"/Robot/MemSpec/{task}" for task in TASKS]
    # an entry goes STALE after `timeout` seconds without an update
    assert analyzer["timeout"] > P.BY_NAME[PERIOD_PARAM].default


def test_the_windows_figures_are_its_goals_own():
    """The window joined its goals' iterations and counted a switch between the last draft of one goal and the
    first of the next (no draft is active between goals); its time to first token left out the policy's start."""
    from memspec_ros.ros.diagnostics import Status, ThroughputWindow, fill_throughput_status
    from memspec_ros.runtime.stats import GenerationStats, IterationStats

    window = ThroughputWindow(8)
    for draft in ("code", "math"):
        stats = GenerationStats(prompt_tokens=4, completion_tokens=9, prefill_seconds=0.2, start_seconds=0.2,
                                decode_seconds=1.0)
        stats.iterations = [IterationStats(draft, 4, 3, 4, 0.01, 0.02) for _ in range(2)]
        window.add(stats)
    view = window.view()
    assert view.goals == view.measured_goals == 2 and view.finished_goals == 0
    assert view.draft_switches == 0 and view.combined.time_to_first_token == pytest.approx(0.8)
    status = Status()
    fill_throughput_status(status, view.combined, view.goals, 2, 0.5, 2, view.draft_switches)
    assert dict(status.values)["draft switches"] == "0"
    unmeasured = Status()
    fill_throughput_status(unmeasured, None, 0, 0, 0.5, 3)
    assert "no measured goal yet (3 finished" in unmeasured.message
    # a parameter batch refused after the window's setter ran sets the old size back: no goal is lost by it
    window.resize(1)
    assert window.view().goals == 1
    window.resize(8)
    assert window.view().goals == 2
    window.resize(1)
    window.add(stats)  # a goal that finishes under the smaller size: the window is that size from then on
    window.resize(8)
    assert window.view().goals == 1
