"""Session-wide test setup shared by every test in test/.

At import (before any test module runs rclpy.init) the session claims a ROS_DOMAIN_ID of its own
and keeps DDS discovery on localhost: see ros_helpers.py. Fixtures for ROS tests:

    rclpy_context  a fresh rclpy Context, initialised for one test and shut down after it;
                   pass it on (Node(..., context=ctx), executors take context= too)
    make_node      factory: make_node("name", node_class=Node, **kwargs) -> node in that
                   context, destroyed after the test
    executor       a MultiThreadedExecutor in that context (what the real node uses), shut
                   down after the test; spin it with ros_helpers.spin_until_complete/spin_until

Tests that need ROS call ros_helpers.require_ros() at module level: without a sourced ROS
environment they are skipped, except under `make test` / CI (MEMSPEC_TEST_STRICT=1) where
that is a failure. Nothing here imports rclpy unless a ROS fixture is used.

Strict mode (MEMSPEC_TEST_STRICT=1) fails every skip, not only require_ros()'s: a
pytest.importorskip of a package `make setup` installs, a zoo that is not built, a missing compiler
are setup faults, not reasons to pass quietly. A skip whose reason names a fact about the machine
that no setup changes stays a skip (STRICT_ALLOWED_SKIPS: no CUDA device, /tmp on a RAM filesystem,
no mincore, the GPTQ backend installed in the main environment).
"""

from __future__ import annotations

import os

# The test models are tiny: one torch thread runs them fastest, and on a busy 2-core machine
# spinning OpenMP waits made two-thread runs up to 40x slower. Set before any test imports torch, and set whatever
# the environment says (a CI image that exports OMP_NUM_THREADS for its own jobs would otherwise run every test with
# that many threads); MEMSPEC_TEST_OMP_THREADS chooses another count on purpose.
os.environ["OMP_NUM_THREADS"] = os.environ.get("MEMSPEC_TEST_OMP_THREADS", "1")
os.environ["OMP_WAIT_POLICY"] = "PASSIVE"

import atexit  # noqa: E402
import shutil  # noqa: E402
import tempfile  # noqa: E402


def _noexec(path: str) -> bool:
    try:
        return bool(os.statvfs(path).f_flag & os.ST_NOEXEC)
    except OSError:
        return False


# A runner whose temporary folder is mounted noexec (a hardened CI image's /tmp): tests run scripts (a fake
# compiler, a fake llama.cpp) and dlopen kernel libraries built in their temporary folders, which failed there with
# EACCES and "failed to map segment". This session's temporary files go to a folder beside the tests instead (set
# before anything asks for the temporary folder; the node processes the tests start inherit it).
if _noexec(tempfile.gettempdir()):
    # the ROS domain locks stay in the shared temporary folder: in a folder of this session's own, two sessions on
    # the host (or their demos' children) no longer excluded each other (ros_env.LOCK_DIR_ENV)
    os.environ.setdefault("MEMSPEC_DOMAIN_LOCK_DIR", tempfile.gettempdir())
    os.environ["TMPDIR"] = tempfile.mkdtemp(prefix=".tmp-", dir=os.path.dirname(os.path.abspath(__file__)))
    tempfile.tempdir = None
    atexit.register(shutil.rmtree, os.environ["TMPDIR"], ignore_errors=True)

# The tests build their zoos and broken drafts in the system temp directory: allow it as a root of the node's
# path parameters (model.allowed_roots' default; test_security checks the confinement with roots of its own).

# added to the user's own roots (a value set for running the node replaced it, and every test zoo was refused)
os.environ["MEMSPEC_ALLOWED_ROOTS"] = os.pathsep.join(
    [p for p in os.environ.get("MEMSPEC_ALLOWED_ROOTS", "").split(os.pathsep) if p] + [tempfile.gettempdir()])

# Drafts loaded through the storage tier keep their runtime forms (runtime/storage.py): the tests' are forms of
# temporary zoos, kept in a folder of this session's (the node processes the tests start inherit it), not the
# user's cache, and removed at the end.
if "MEMSPEC_RUNTIME_FORMS_DIR" not in os.environ:
    os.environ["MEMSPEC_RUNTIME_FORMS_DIR"] = tempfile.mkdtemp(prefix="memspec-runtime-forms-")
    atexit.register(shutil.rmtree, os.environ["MEMSPEC_RUNTIME_FORMS_DIR"], ignore_errors=True)

import pytest  # noqa: E402
from ros_helpers import claim_ros_domain_id, isolate_ros_environment, require_ros  # noqa: E402

ROS_DOMAIN_ID = claim_ros_domain_id()
isolate_ros_environment(ROS_DOMAIN_ID)


def pytest_report_header(config):
    return f"ROS_DOMAIN_ID={ROS_DOMAIN_ID} (claimed for this session), discovery LOCALHOST"


# -- strict mode: a skip is a failure, unless the machine cannot run the test ---------------------
STRICT_ENV = "MEMSPEC_TEST_STRICT"
STRICT_ALLOWED_SKIPS = (
    "needs CUDA",  # test_runtime_cache: the pinned-memory copy to a CUDA device
    "a RAM filesystem has no disk",  # test_storage: pages of tmpfs cannot be dropped
    "this filesystem keeps its pages",  # test_storage: posix_fadvise(DONTNEED) is advice (ZFS, FUSE, 9p)
    "mincore is not available",  # test_storage: no page-cache residency query on this OS
    "only meaningful without the GPTQ backend",  # test_models: the backend is installed here
    "turned off (MEMSPEC_GPTQ=0)",  # test_gptq: make test's documented opt-out of .venv-gptq
    "built without OpenMP here",  # test_cpu_kernels: a compiler without OpenMP builds single-threaded kernels
)


def _strict() -> bool:
    return os.environ.get(STRICT_ENV) == "1"


def _skip_reason(report) -> str:
    longrepr = report.longrepr
    if isinstance(longrepr, tuple) and len(longrepr) == 3:
        return str(longrepr[2]).removeprefix("Skipped: ")
    return str(longrepr)


def _fail_strict_skip(report, what: str) -> None:
    if not (_strict() and report.skipped) or hasattr(report, "wasxfail"):
        return
    reason = _skip_reason(report)
    if any(allowed in reason for allowed in STRICT_ALLOWED_SKIPS):
        return
    report.outcome = "failed"
    report.longrepr = (f"{what} was skipped under {STRICT_ENV}=1, where a skip is a failure: {reason}\n"
                       "(install what is missing: make setup; a skip for a machine fact goes in"
                       " conftest.STRICT_ALLOWED_SKIPS)")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    _fail_strict_skip(outcome.get_result(), item.nodeid)


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector):
    outcome = yield
    _fail_strict_skip(outcome.get_result(), collector.nodeid or "a module")  # module-level importorskip


@pytest.fixture(scope="session")
def ros_domain_id() -> int:
    return ROS_DOMAIN_ID


@pytest.fixture
def rclpy_context():
    require_ros()
    import rclpy
    from rclpy.context import Context

    context = Context()
    rclpy.init(context=context)
    try:
        yield context
    finally:
        rclpy.try_shutdown(context=context)


@pytest.fixture
def make_node(rclpy_context):
    from rclpy.node import Node

    nodes = []

    def factory(name: str, node_class=Node, **kwargs):
        node = node_class(name, context=rclpy_context, **kwargs)
        nodes.append(node)
        return node

    yield factory
    for node in reversed(nodes):
        node.destroy_node()


@pytest.fixture
def executor(rclpy_context):
    from rclpy.executors import MultiThreadedExecutor

    executor = MultiThreadedExecutor(num_threads=4, context=rclpy_context)
    try:
        yield executor
    finally:
        executor.shutdown(timeout_sec=5.0)


@pytest.fixture(scope="module")
def target():
    """The tiny target the engine and controller tests share (drafts are made from it per module)."""
    from memspec_ros.testing.tiny_models import tiny_llama

    return tiny_llama(layers=2, hidden=64, seed=0)


@pytest.fixture(scope="module")
def pair():
    """A tiny target and a slightly noisy copy of it as a draft (context lookup and datastore tests)."""
    from memspec_ros.testing.tiny_models import noisy_copy, tiny_llama

    target = tiny_llama(vocab_size=24, seed=3)
    return target, noisy_copy(target, 0.03, seed=4)


def patch_forward_times(monkeypatch, time_forward) -> None:
    """Adaptive gamma's forward timings from ``time_forward(model, tokens, vocab)`` (ms): a draft's one-token
    forward and the target's cost curve (1..n tokens) alike."""
    from memspec_ros.runtime import gamma_choice

    monkeypatch.setattr(gamma_choice, "time_forward", lambda model, tokens, vocab, lean=True:
                        time_forward(model, tokens, vocab))
    monkeypatch.setattr(gamma_choice, "forward_cost_curve",
                        lambda model, n, vocab: [time_forward(model, k, vocab) for k in range(1, n + 1)])


def fix_adaptive_costs(monkeypatch, time_forward, draft_ms: float) -> None:
    """Adaptive gamma decides from measured forward times (``time_forward(model, tokens, vocab)`` in ms) and from
    what drafting is observed to cost: both fixed here (``draft_ms`` a draft forward), so no choice depends on
    this machine's timing."""
    from memspec_ros.runtime import gamma_choice

    patch_forward_times(monkeypatch, time_forward)
    monkeypatch.setattr(gamma_choice, "_TARGET_COSTS", gamma_choice.weakref.WeakKeyDictionary())
    monkeypatch.setattr(gamma_choice, "_DRAFT_COSTS", gamma_choice.weakref.WeakKeyDictionary())
    observe_cost = gamma_choice.GammaChooser.observe_cost
    monkeypatch.setattr(gamma_choice.GammaChooser, "observe_cost",
                        lambda self, name, forwards, ms: observe_cost(self, name, forwards, draft_ms * forwards))


@pytest.fixture
def fixed_costs(monkeypatch):
    """A draft token as dear as a verify row (11 ms), so whether a copy or the draft proposes does not depend on
    this machine's timing."""
    fix_adaptive_costs(monkeypatch, lambda model, k, vocab: 10.0 + k, 11.0)


@pytest.fixture(autouse=True)
def _paced_long_goals(request, monkeypatch):
    """The node tests' long goals last at least a pace per iteration on any machine (node_helpers.PACED_FROM)."""
    if request.module.__name__.startswith("test_node_"):
        from node_helpers import pace_long_goals

        pace_long_goals(monkeypatch)


@pytest.fixture(autouse=True)
def _torch_threads_restored():
    """Each test leaves torch's thread count as it found it: one that set it (some run small models on one thread)
    changed every test after it, so a test's speed, and any figure it timed, depended on which files ran first."""
    import torch

    threads = torch.get_num_threads()
    yield
    if torch.get_num_threads() != threads:
        torch.set_num_threads(threads)


@pytest.fixture
def one_thread():
    """Small models on a shared 2-core machine: threads only contend (restored after the test)."""
    import torch

    torch.set_num_threads(1)


@pytest.fixture
def clock_jump(monkeypatch):
    """``clock_jump(seconds)``: time.perf_counter (what the runtime's stopwatches read) jumps ahead by ``seconds``.
    A test stands for a slow step (a disk, a timing run) with a jump of a minute instead of a real sleep of half a
    second: a check that the step's time is kept out of a figure then has a minute of margin, where a loaded CI
    machine's stall of half a second failed it, and the test takes no wall time for it."""
    import time

    real, offset = time.perf_counter, [0.0]
    monkeypatch.setattr(time, "perf_counter", lambda: real() + offset[0])

    def jump(seconds: float) -> None:
        offset[0] += seconds

    return jump
