# ruff: noqa: E402 - the ROS imports follow require_ros()
"""The installed `memspec_node` executable with `--ros-args --params-file` (what `ros2 run` and the
launch file start), driven through its lifecycle services by `memspec_client`'s code path and the
real `memspec_client` command; SIGINT ends it cleanly. Also the launch file's structure."""

from __future__ import annotations

import ast
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from node_helpers import TIMEOUT, tiny_chat_zoo, tiny_zoo
from ros_helpers import require_ros, wait_until

require_ros()

import rclpy
from action_msgs.msg import GoalStatus
from lifecycle_msgs.msg import Transition
from rcl_interfaces.srv import GetParameters
from rclpy.context import Context
from rclpy.executors import SingleThreadedExecutor
from rclpy.parameter import parameter_value_to_python

from memspec_ros.ros import params as P
from memspec_ros.ros.client import format_result, send_goal
from memspec_ros.ros.lifecycle_client import LifecycleClient

REPO = Path(__file__).resolve().parents[1]
NAME = "memspec_proc"


def processes_matching(pattern: str) -> list[int]:
    """The pids whose command line matches ``pattern``, as ``pgrep -f`` (procps is not on every image)."""
    import re

    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            command = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:  # ended meanwhile
            continue
        if re.search(pattern, command):
            found.append(int(entry.name))
    return found


def executable(name: str) -> str:
    from ament_index_python.packages import get_package_prefix

    path = Path(get_package_prefix("memspec_ros")) / "lib" / "memspec_ros" / name
    assert os.access(path, os.X_OK), f"{path} missing: run make build"
    return str(path)


def params_file(tmp_path: Path) -> Path:
    """config/memspec.yaml with the tiny zoo and two changed values."""
    data = yaml.safe_load((REPO / "config" / "memspec.yaml").read_text())
    p = data["/**"]["ros__parameters"]
    p["drafts"]["registry_file"] = str(tiny_zoo() / "registry.yaml")
    p["model"]["threads"] = 1
    p["memspec"]["interval"] = 3
    p["generation"]["max_new_tokens"] = 12
    out = tmp_path / "memspec.yaml"
    out.write_text(yaml.safe_dump(data))
    return out


def call(executor, client, request, timeout=TIMEOUT):
    wait_until(lambda: (executor.spin_once(timeout_sec=0.05), client.service_is_ready())[1], timeout, client.srv_name)
    future = client.call_async(request)
    executor.spin_until_future_complete(future, timeout_sec=timeout)
    assert future.done(), f"{client.srv_name} did not answer"
    return future.result()



def client_side(name: str):
    """(context, node, executor): a client node in a context of its own, beside the node process under test."""
    context = Context()
    rclpy.init(context=context)
    node = rclpy.create_node(name, context=context)
    executor = SingleThreadedExecutor(context=context)
    executor.add_node(node)
    return context, node, executor


def _stop(proc, executor, node, context, failure: str, signalled: bool = False) -> str:
    """Tear down the client side, SIGINT the node process if it still runs and the test has not signalled it (a
    second signal would stop it at once, exit status 130); its output (fails if it hangs)."""
    executor.shutdown(timeout_sec=1.0)
    node.destroy_node()
    rclpy.try_shutdown(context=context)
    if proc.poll() is None and not signalled:
        os.killpg(proc.pid, signal.SIGINT)
    try:
        out, _ = proc.communicate(timeout=30)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail(f"memspec_node {failure}:\n{out}")
    return out


def test_config_file_declares_every_parameter_with_its_default():
    data = yaml.safe_load((REPO / "config" / "memspec.yaml").read_text())["/**"]["ros__parameters"]

    def flatten(d, prefix=""):
        for k, v in d.items():
            if isinstance(v, dict):
                yield from flatten(v, f"{prefix}{k}.")
            else:
                yield f"{prefix}{k}", v

    flat = dict(flatten(data))
    assert set(flat) == set(P.BY_NAME)
    for name, value in flat.items():
        assert value == P.BY_NAME[name].default, name
        assert P.check_value(name, value) == "", name


def test_launch_file_is_the_humble_and_jazzy_lifecycle_pattern():
    path = REPO / "launch" / "memspec.launch.py"
    tree = ast.parse(path.read_text())
    compile(tree, str(path), "exec")
    calls = {n.func.id if isinstance(n.func, ast.Name) else getattr(n.func, "attr", "") for n in ast.walk(tree)
             if isinstance(n, ast.Call)}
    assert {"LifecycleNode", "EmitEvent", "ChangeState", "RegisterEventHandler", "OnStateTransition",
            "DeclareLaunchArgument", "LaunchConfiguration"} <= calls
    keywords = {k.arg: k.value for n in ast.walk(tree) if isinstance(n, ast.Call) for k in n.keywords}
    assert isinstance(keywords["goal_state"], ast.Constant) and keywords["goal_state"].value == "inactive"
    # activate follows the first successful configure only: a later manual configure leaves the node inactive
    assert isinstance(keywords["handle_once"], ast.Constant) and keywords["handle_once"].value is True
    node_call = next(
        n for n in ast.walk(tree) if isinstance(n, ast.Call) and getattr(n.func, "id", "") == "LifecycleNode"
    )
    assert {"name", "namespace", "package", "executable", "parameters"} <= {k.arg for k in node_call.keywords}
    assert "autostart" not in keywords  # LifecycleNode's autostart= is Jazzy-only
    # the conventional arguments, autostart among them as a launch argument: both transitions are conditional on it
    declared = {n.args[0].value for n in ast.walk(tree) if isinstance(n, ast.Call)
                and getattr(n.func, "id", "") == "DeclareLaunchArgument"}
    assert declared == {"namespace", "node_name", "params_file", "autostart", "log_level", "node_sigterm_timeout"}
    # launch's SIGTERM after Ctrl-C waits longer than the node's own shutdown may take (5 s by default: less)
    from memspec_ros.ros.goal_runner import DEACTIVATE_WAIT_SECONDS
    from memspec_ros.ros.node import EXECUTOR_SHUTDOWN_SECONDS, RESULT_SEND_SECONDS, RESULTS_OUT_SECONDS

    assert "sigterm_timeout" in {k.arg for k in node_call.keywords}
    timeout = next(n.value for n in ast.walk(tree) if isinstance(n, ast.Assign)
                   and getattr(n.targets[0], "id", "") == "SIGTERM_TIMEOUT")
    assert float(timeout.value) > (DEACTIVATE_WAIT_SECONDS + RESULTS_OUT_SECONDS + RESULT_SEND_SECONDS
                                   + EXECUTOR_SHUTDOWN_SECONDS)
    conditional = [n for n in ast.walk(tree) if isinstance(n, ast.Call) and getattr(n.func, "id", "") in (
        "EmitEvent", "RegisterEventHandler") and any(k.arg == "condition" for k in n.keywords)]
    assert len(conditional) == 2  # the configure and the activate-when-inactive handler; the inner activate is not


@pytest.mark.timeout(240)
def test_the_node_executable_with_a_params_file(tmp_path):
    cmd = [
        executable("memspec_node"),
        # what launch/memspec.launch.py passes: its arguments first (log_level), then launch_ros's own section
        # (name, the params file); use_sim_time as a params file or command line sets it
        "--ros-args",
        "--log-level",
        "info",
        "--ros-args",
        "-r",
        f"__node:={NAME}",
        "--params-file",
        str(params_file(tmp_path)),
        "-p",
        "use_sim_time:=true",
    ]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    context, node, executor = client_side("process_test_client")
    try:
        lifecycle = LifecycleClient(node, f"/{NAME}", lambda seconds: executor.spin_once(timeout_sec=seconds))
        for tid in (Transition.TRANSITION_CONFIGURE, Transition.TRANSITION_ACTIVATE):
            assert lifecycle.change_state(tid, 120.0)
        get = node.create_client(GetParameters, f"/{NAME}/get_parameters")
        names = ["memspec.interval", "memspec.capacity", "use_sim_time"]
        values = call(executor, get, GetParameters.Request(names=names)).values
        assert [parameter_value_to_python(v) for v in values] == [3, 2, True]  # from the file; the rest defaults

        from memspec_interfaces.action import Generate

        sink = open(os.devnull, "w")
        outcome = send_goal(node, executor, Generate.Goal(prompt="def add(a, b):"), f"/{NAME}/generate",
                            server_timeout=TIMEOUT, out=sink, log=sink)
        assert outcome.ok, outcome.status
        assert outcome.result.completion_tokens == 12  # generation.max_new_tokens from the file
        assert "finish: length" in format_result(outcome.result)

        # the real client command: streamed text, then the statistics line
        client = subprocess.run([executable("memspec_client"), "The licensee may", "--node", f"/{NAME}",
                                 "--max-new-tokens", "8"], capture_output=True, text=True, timeout=120)
        assert client.returncode == 0, client.stderr
        assert "finish: length" in client.stdout and "generated 8 tok" in client.stdout
        missing = subprocess.run([executable("memspec_client"), "hi", "--node", "/nobody", "--timeout", "1"],
                                 capture_output=True, text=True, timeout=120)
        assert missing.returncode == 1 and "no Generate action server at /nobody/generate" in missing.stderr
    finally:
        out = _stop(proc, executor, node, context, "ignored SIGINT")
    sys.stdout.write(out[-2000:])
    assert proc.returncode == 0, out
    assert "Traceback" not in out
    assert "configured in" in out


@pytest.mark.timeout(240)
def test_memspec_client_killed_by_sigterm_cancels_its_goal_and_exits_143(tmp_path):
    """The real memspec_client command, sent SIGTERM while its goal streams (a CI job's timeout, systemd stopping
    it): it cancels the goal, prints the partial answer, and exits 128 + 15 (signals_interrupt; shown in-process
    only until now)."""
    import threading

    name = "memspec_client_sigterm"
    cmd = [sys.executable, str(Path(__file__).resolve().parent / "paced_node.py"), executable("memspec_node"),
           "--ros-args", "-r", f"__node:={name}", "--params-file", str(params_file(tmp_path))]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    context, node, executor = client_side("client_sigterm_test")
    client = None
    try:
        lifecycle = LifecycleClient(node, f"/{name}", lambda seconds: executor.spin_once(timeout_sec=seconds))
        for tid in (Transition.TRANSITION_CONFIGURE, Transition.TRANSITION_ACTIVATE):
            assert lifecycle.change_state(tid, 120.0)
        # paced (node_helpers.PACED_FROM): still generating when the signal comes, on any CPU
        client = subprocess.Popen([executable("memspec_client"), "def add(a, b):", "--node", f"/{name}",
                                   "--max-new-tokens", "3000"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                  text=True, start_new_session=True)
        streamed = threading.Event()
        chunks: list[str] = []

        def read_stdout():
            for chunk in iter(lambda: client.stdout.read(1), ""):
                chunks.append(chunk)
                streamed.set()

        reader = threading.Thread(target=read_stdout, daemon=True)
        reader.start()
        assert streamed.wait(120), "memspec_client streamed nothing"
        client.send_signal(signal.SIGTERM)
        err = client.stderr.read()
        client.wait(timeout=60)
        reader.join(10)
        out = "".join(chunks)
        assert client.returncode == 128 + signal.SIGTERM, (client.returncode, err)
        assert "interrupted: cancelling the goal" in err, err
        assert "finish: cancelled" in out and "Traceback" not in err, (out[-500:], err)
        # the node serves the next goal
        from memspec_interfaces.action import Generate

        sink = open(os.devnull, "w")
        outcome = send_goal(node, executor, Generate.Goal(prompt="def add(a, b):", max_new_tokens=4),
                            f"/{name}/generate", server_timeout=TIMEOUT, result_timeout=60.0, out=sink, log=sink)
        assert outcome.ok, outcome.status
    finally:
        if client is not None and client.poll() is None:
            client.kill()
        out = _stop(proc, executor, node, context, "ignored SIGINT")
    assert proc.returncode == 0, out[-3000:]
    assert "Traceback" not in out, out[-3000:]


@pytest.mark.timeout(240)
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_during_a_goal_ends_it_with_a_result_and_the_process_exits_cleanly(tmp_path, sig):
    """SIGINT or SIGTERM while a goal runs: the goal ends ABORTED with its partial text and the client
    receives that result before the node goes; exit status 0, no traceback or RCLError in the log
    (rclpy's own handler shut the context down first: "Failed to send result response", "feedback
    publisher is invalid", "'NoneType' object has no attribute 'trigger'")."""
    from rclpy.action import ActionClient

    from memspec_interfaces.action import Generate

    name = "memspec_sigint"
    cmd = [  # paced (paced_node.py): the goal must still run when the signal comes, on any CPU
        sys.executable,
        str(Path(__file__).resolve().parent / "paced_node.py"),
        executable("memspec_node"),
        "--ros-args",
        "-r",
        f"__node:={name}",
        "--params-file",
        str(params_file(tmp_path)),
    ]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    context, node, executor = client_side("sigint_test_client")

    def spin_until(condition, what, timeout=TIMEOUT):
        wait_until(lambda: (executor.spin_once(timeout_sec=0.05), condition())[1], timeout, what)

    signalled = False
    try:
        lifecycle = LifecycleClient(node, f"/{name}", lambda seconds: executor.spin_once(timeout_sec=seconds))
        for tid in (Transition.TRANSITION_CONFIGURE, Transition.TRANSITION_ACTIVATE):
            assert lifecycle.change_state(tid, 120.0)
        client = ActionClient(node, Generate, f"/{name}/generate")
        spin_until(client.server_is_ready, "the action server")
        feedback = []
        sent = client.send_goal_async(Generate.Goal(prompt="def add(a, b):", max_new_tokens=3000, temperature=0.0),
                                      feedback_callback=feedback.append)
        spin_until(sent.done, "the goal response")
        assert sent.result().accepted
        result = sent.result().get_result_async()
        spin_until(lambda: len(feedback) >= 2, "feedback")
        os.killpg(proc.pid, sig)
        signalled = True
        spin_until(result.done, f"the goal's result after {sig.name}")
        response = result.result()
        assert response.status == GoalStatus.STATUS_ABORTED, response.status
        assert response.result.finish_reason == Generate.Result.FINISH_ERROR
        assert sig.name in response.result.error_message, response.result.error_message
        assert response.result.text and 0 < response.result.completion_tokens < 3000
    finally:
        out = _stop(proc, executor, node, context, f"did not exit after {sig.name}", signalled)
    sys.stdout.write(out[-2000:])
    assert proc.returncode == 0, out
    for bad in ("Traceback", "RCLError", "Failed to send result", "has no attribute"):
        assert bad not in out, out


@pytest.mark.timeout(240)
@pytest.mark.parametrize("chat", [False, True], ids=["plain", "chat"])
def test_action_bench_runs_both_paths_with_identical_outputs(ros_domain_id, chat, tmp_path):
    """A smoke run of `memspec-bench action` (the speed claim lives in the benchmark, not here). With an
    instruct model's tokenizer the direct path must send what a goal sends (chat template, end of turn). The
    result names the policy the node ran: with a predictor that is not there it fell back to general-static,
    and the result said memspec."""
    import torch

    from memspec_ros.bench.action_bench import run_action_bench

    threads = torch.get_num_threads()
    try:
        result = run_action_bench(tiny_chat_zoo() if chat else tiny_zoo(), prompts=2, runs=1, max_new_tokens=8,
                                  domain_id=ros_domain_id, predictor="" if chat else str(tmp_path / "missing"))
    finally:
        torch.set_num_threads(threads)
    assert result["policy_asked"] == "memspec"
    if chat:
        assert result["policy"] == "memspec" and not result["note"]
    else:
        assert result["policy"] == "general-static" and "policy memspec asked, the node ran general-static" in (
            result["note"])
    assert result["outputs_identical"]
    assert len(result["rows"]) == 2
    assert all(0 < r["action_tokens"] == r["direct_tokens"] <= 8 for r in result["rows"])
    if not chat:
        assert all(r["action_tokens"] == 8 for r in result["rows"])
    assert result["ratio_steady_state"] > 0 and result["ratio_end_to_end"] > 0
    assert os.environ["ROS_DOMAIN_ID"] == str(ros_domain_id)


@pytest.mark.timeout(240)
@pytest.mark.parametrize("chat", [False, True], ids=["plain-zoo", "chat-zoo"])
def test_demo_runs_end_to_end_and_leaves_no_process(chat):
    """`make demo`'s script on the tiny zoo: exit 0, streamed text, statistics, diagnostics, clean stop; on a zoo
    whose target has a chat template, a follow-up turn carrying the first turn and its answer.

    The demo claims a domain of its own (as `make demo` does), not this session's: a node named
    /memspec that a test in this process left behind must not be able to answer for the demo's."""
    zoo = tiny_chat_zoo() if chat else tiny_zoo()
    env = {k: v for k, v in os.environ.items() if k != "MEMSPEC_DEMO_DOMAIN_ID"}
    # a shell's own ROS settings are not the demo's (its node and client run on a domain of their own, this host
    # only): an RMW the venv lacks failed rclpy.init, and a subnet-wide discovery range met another host's demo
    env |= {"RMW_IMPLEMENTATION": "rmw_not_installed_cpp", "ROS_AUTOMATIC_DISCOVERY_RANGE": "SUBNET"}
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "memspec_ros.ros.demo",
            "--zoo",
            str(zoo),
            "--max-new-tokens",
            "8",
            "--prompt",
            "def add(a, b):",
        ],
        capture_output=True,
        text=True,
        timeout=200,
        env=env,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    out = done.stdout
    for expected in ("configured in", "finish: length", "generated 8 tok", "/diagnostics snapshot",
                     "memspec: draft cache", "memspec: throughput", "node brought down to finalized",
                     "node process exited cleanly"):
        assert expected in out, expected
    assert "Traceback" not in out + done.stderr
    if chat:  # the follow-up turn: the first turn and its answer in the goal's messages, then the new one
        assert "the conversation goes on" in out and "(2 earlier turns with it)" in out
        assert out.count("finish: ") == 2, out
    else:
        assert "the model has no chat template: no follow-up turn" in out and out.count("finish: ") == 1
    import re

    from memspec_ros.ros.demo import DEMO_DOMAIN_IDS

    assert int(re.search(r"ROS_DOMAIN_ID (\d+)", out).group(1)) in DEMO_DOMAIN_IDS  # its own, not this session's
    # the node's log: a file made for it (mkstemp), not the predictable /tmp name by pid a planted link could redirect
    log = Path(re.search(r", log (\S+)\)", out).group(1))
    assert log.name.startswith("memspec_demo_node_")
    assert not re.fullmatch(r"memspec_demo_node_\d+\.log", log.name)
    assert not processes_matching(f"memspec_ros.ros.node.*{zoo}"), "the demo left a node process behind"


def _demo_process(zoo: Path, stderr=subprocess.STDOUT) -> subprocess.Popen:
    """`make demo`'s script on ``zoo`` (8 tokens), its output piped, on a demo domain of its own."""
    env = {k: v for k, v in os.environ.items() if k != "MEMSPEC_DEMO_DOMAIN_ID"}
    return subprocess.Popen([sys.executable, "-m", "memspec_ros.ros.demo", "--zoo", str(zoo), "--max-new-tokens",
                             "8", "--prompt", "def add(a, b):"], stdout=subprocess.PIPE, stderr=stderr, text=True,
                            env=env)


@pytest.mark.parametrize("moment", ["node process started", "configure"])
def test_a_demo_ended_by_sigterm_stops_its_node(moment):
    """The node runs in a session of its own, so a SIGTERM to the demo (a CI job's timeout) or a SIGHUP (its
    terminal closed) ended the demo and left the node running with its models, answering on the demo's domain.
    A SIGTERM that landed while the demo imported rclpy (a slow machine) surfaced as a failed step ("initialization
    failed") with the node's own interrupted import echoed as a traceback: it is a stop, whenever it lands."""
    zoo = tiny_zoo()
    demo = _demo_process(zoo)
    pattern = f"memspec_ros.ros.node.*{zoo}"
    seen = []
    try:
        deadline = time.monotonic() + 120
        while not processes_matching(pattern):  # the node is up
            assert demo.poll() is None and time.monotonic() < deadline, "the demo's node never started"
            time.sleep(0.1)
        if moment == "configure":  # the demo's client is up and the node is loading its models
            while "configure" not in (line := demo.stdout.readline()):
                assert line and time.monotonic() < deadline, "the demo never reached configure"
                seen.append(line)
        demo.send_signal(signal.SIGTERM)
        out, _ = demo.communicate(timeout=60)
    finally:
        if demo.poll() is None:
            demo.kill()
    out = "".join(seen) + out
    assert demo.returncode == 128 + signal.SIGTERM, out[-3000:]
    assert "stopped by SIGTERM" in out and "FAILED" not in out and "Traceback" not in out, out[-3000:]
    assert not processes_matching(pattern), "the demo left a node process behind"


def test_a_demo_whose_node_exits_at_start_says_so_at_once():
    """A node that refused its parameters and exited was waited for until the whole --timeout (180 s), and the demo
    then said its services never appeared. The demo watches the node's process while it waits."""
    zoo = tiny_zoo()
    env = {k: v for k, v in os.environ.items() if k != "MEMSPEC_DEMO_DOMAIN_ID"}
    t0 = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "memspec_ros.ros.demo", "--zoo", str(zoo), "--timeout", "150",
                           "--param", "memspec.capacity:=0"], capture_output=True, text=True, env=env, timeout=200)
    waited = time.monotonic() - t0
    assert done.returncode == 1, done.stdout[-3000:] + done.stderr[-3000:]
    assert "FAILED: memspec_node exited with status" in done.stdout and "did not appear" not in done.stdout
    assert waited < 150  # it did not sit out --timeout (the meaning, not a speed: the node exits at its parameters)
    assert not processes_matching(f"memspec_ros.ros.node.*{zoo}")


def test_a_demo_whose_output_is_gone_still_stops_its_node():
    """`make demo | tee log` and Ctrl-C: tee goes too, every print raised BrokenPipeError, the demo's shutdown
    raised out of its `finally` before it stopped the node, and the node (in a session of its own) ran on."""
    zoo = tiny_zoo()
    demo = _demo_process(zoo, stderr=subprocess.DEVNULL)
    pattern = f"memspec_ros.ros.node.*{zoo}"
    try:
        deadline = time.monotonic() + 120
        while "configure" not in (line := demo.stdout.readline()):
            assert line and time.monotonic() < deadline, "the demo never reached configure"
        demo.stdout.close()  # the reader is gone: the demo's next write breaks its pipe
        demo.send_signal(signal.SIGINT)
        demo.wait(timeout=90)
    finally:
        if demo.poll() is None:
            demo.kill()
    assert not processes_matching(pattern), "the demo left a node process behind"


def test_the_demo_fails_when_the_predictor_is_not_working():
    """The demo claims MemSpec ran: a predictor that did not load (its /diagnostics status WARN, the node then
    ranks nothing) passed it with exit 0."""
    from types import SimpleNamespace

    from diagnostic_msgs.msg import DiagnosticArray, DiagnosticStatus

    from memspec_ros.ros.demo import show_diagnostics

    def client(level: bytes):
        status = DiagnosticStatus(level=level, name="memspec: predictor", message="failed to load: bad head")
        return SimpleNamespace(diagnostics=[DiagnosticArray(status=[status])], spin_once=lambda seconds: None)

    fake = client(DiagnosticStatus.OK)
    fake.diagnostics_source = list(fake.diagnostics)
    fake.spin_once = lambda seconds: fake.diagnostics.extend(fake.diagnostics_source)
    show_diagnostics(fake, wait_seconds=1.0)
    broken = client(DiagnosticStatus.WARN)
    broken.diagnostics_source = list(broken.diagnostics)
    broken.spin_once = lambda seconds: broken.diagnostics.extend(broken.diagnostics_source)
    with pytest.raises(RuntimeError, match="predictor is not working: failed to load"):
        show_diagnostics(broken, wait_seconds=1.0)


def test_a_change_state_call_holds_the_transition_lock_over_rclpys_own_steps():
    """rclpy steps the lifecycle state machine before and after the transition's callback, and the node's transition
    lock covered the callback alone: destroy_node could take it in between (a failed configure still 'configuring',
    so no shutdown transition) or step the same state machine from another thread. The guarded ~/change_state
    callback holds it throughout, and an exception still answers success=False."""
    import threading
    from types import SimpleNamespace

    from memspec_ros.ros.rclpy_internals import guard_change_state

    lock = threading.RLock()
    seen = []

    def free_elsewhere() -> bool:  # whether another thread could take the lock now
        got = []
        t = threading.Thread(target=lambda: got.append(lock.acquire(blocking=False) and (lock.release() or True)))
        t.start()
        t.join()
        return got[0]

    def handler(request, response):  # rclpy's callback: its state-machine steps around the transition's own
        seen.append(free_elsewhere())
        with lock:  # the transition callback's (recorded), reentrant
            seen.append(free_elsewhere())
        seen.append(free_elsewhere())
        if request == "fail":
            raise RuntimeError("no such transition")
        response.success = True
        return response

    errors = []
    node = SimpleNamespace(_service_change_state=SimpleNamespace(callback=handler))
    assert guard_change_state(node, lambda request, exc: errors.append(str(exc)), lock)
    assert node._service_change_state.callback("ok", SimpleNamespace(success=False)).success
    assert seen == [False, False, False] and free_elsewhere()
    assert not node._service_change_state.callback("fail", SimpleNamespace(success=True)).success
    assert errors == ["no such transition"] and free_elsewhere()


def test_the_callbacks_in_flight_are_waited_for_before_the_node_is_destroyed():
    """rclpy's Executor.shutdown(timeout_sec) never waits for the callbacks still running (it sets its shutdown flag
    before testing it), so main() destroyed the node, freeing its models, under a diagnostics update still reading
    them. wait_for_callbacks waits on the executor's own count."""
    import threading

    from rclpy.context import Context
    from rclpy.executors import MultiThreadedExecutor

    from memspec_ros.ros.rclpy_internals import wait_for_callbacks

    context = Context()
    rclpy.init(context=context)
    node = rclpy.create_node("callbacks_probe", context=context)
    started, release = threading.Event(), threading.Event()

    def slow():
        started.set()
        release.wait(30.0)

    timer = node.create_timer(0.001, slow)
    executor = MultiThreadedExecutor(num_threads=2, context=context)
    executor.add_node(node)
    try:
        spinner = threading.Thread(target=lambda: executor.spin_once(timeout_sec=5.0), daemon=True)
        spinner.start()
        assert started.wait(10.0)
        timer.cancel()
        assert not wait_for_callbacks(executor, 0.2)  # still running
        release.set()
        assert wait_for_callbacks(executor, 10.0)
        spinner.join(10.0)
    finally:
        release.set()
        executor.shutdown(timeout_sec=1.0)
        node.destroy_node()
        rclpy.try_shutdown(context=context)


def test_the_nodes_spin_loop_leaves_nothing_on_its_future():
    """main() spun with spin_until_future_complete, to which rclpy's multi-threaded executor adds a done-callback at
    every wake-up, kept until the future completes: the node's memory grew for its whole life. serve() adds none."""
    import threading

    from rclpy.context import Context
    from rclpy.executors import MultiThreadedExecutor
    from rclpy.task import Future

    from memspec_ros.ros.node import serve

    context = Context()
    rclpy.init(context=context)
    node = rclpy.create_node("spin_probe", context=context)
    ticks = []
    closed = Future()

    def tick():  # ends the loop after 60 wake-ups, whatever the machine's speed (a fixed 0.5 s needed 11 of them)
        ticks.append(1)
        if len(ticks) == 60:
            closed.set_result(True)

    node.create_timer(0.001, tick)
    executor = MultiThreadedExecutor(num_threads=2, context=context)
    executor.add_node(node)
    failed = []
    node.create_timer(0.002, lambda: (_ for _ in ()).throw(RuntimeError("a failing callback")) if len(ticks) < 50
                      else None)
    safety = threading.Timer(60.0, lambda: closed.done() or closed.set_result(True))  # only if ticks never came
    safety.start()
    try:
        serve(executor, closed, type("Log", (), {"error": lambda self, text: failed.append(text)})())
        assert closed.done() and len(ticks) >= 60
        assert not getattr(closed, "_callbacks", []), "the loop left callbacks on its future"
        assert failed and "a failing callback" in failed[0]  # logged, and the loop went on
    finally:
        safety.cancel()
        executor.shutdown(timeout_sec=1.0)
        node.destroy_node()
        rclpy.try_shutdown(context=context)


def test_domain_locks_are_taken_in_the_folder_the_environment_names(tmp_path, monkeypatch):
    """A test session whose temporary folder moved (a noexec /tmp) keeps its domain locks where every other session
    on the host takes theirs: in a folder of its own, two sessions could claim one domain and answer each other."""
    from memspec_ros.ros import ros_env

    monkeypatch.setenv(ros_env.LOCK_DIR_ENV, str(tmp_path))
    monkeypatch.delenv("ROS_DOMAIN_ID", raising=False)
    claimed = ros_env.lock_domain_id([77])
    assert claimed is not None
    try:
        assert claimed[0] == 77 and (tmp_path / "memspec_ros_test_domain_77.lock").is_file()
        assert ros_env.lock_domain_id([77]) is None  # held: another session cannot take it
    finally:
        claimed[1].close()


def test_a_lock_file_another_user_owns_is_passed_over_not_a_crash(monkeypatch):
    """On a shared host the domain lock files may be another user's: opening one raised PermissionError outside the
    handled flock, which for the test helper aborted the session at collection."""
    import ros_helpers

    from memspec_ros.ros import demo, ros_env

    real_open = ros_env.open_lock  # (atomic_write.open_lock: never through a planted link)

    def refusing(domain: int):
        def opener(path, *args, **kwargs):
            if os.path.basename(str(path)) == f"memspec_ros_test_domain_{domain}.lock":
                raise PermissionError(13, "Permission denied", str(path))
            return real_open(path, *args, **kwargs)
        return opener

    monkeypatch.delenv("MEMSPEC_DEMO_DOMAIN_ID", raising=False)
    monkeypatch.delenv("MEMSPEC_TEST_ROS_DOMAIN_ID", raising=False)
    first = demo.DEMO_DOMAIN_IDS[0]
    monkeypatch.setattr(ros_env, "open_lock", refusing(first))  # where both claims open their lock files
    domain, handle = demo.claim_domain_id()
    handle.close()
    assert domain != first and domain in demo.DEMO_DOMAIN_IDS
    ids = ros_helpers.TEST_DOMAIN_IDS
    first = ids[os.getpid() % len(ids)]  # where the helper starts looking
    monkeypatch.setattr(ros_env, "open_lock", refusing(first))
    held = len(ros_helpers._held_domain_locks)
    domain = ros_helpers.claim_ros_domain_id()
    ros_helpers._held_domain_locks.pop(held).close()
    assert domain != first and domain in ids


def test_a_second_signal_stops_the_process_at_once_while_configure_still_loads(tmp_path):
    """A second SIGINT is the user's "stop now" (and ros2 launch's before its SIGKILL): the node abandoned its waits,
    but rclpy's executor never shuts its thread pool down and Python joins those threads at exit, so the process
    lived on until the configure still loading the models ended. It exits at once, with 128 + SIGINT."""
    import threading

    from lifecycle_msgs.srv import ChangeState

    name = "memspec_second_signal"
    cmd = [sys.executable, str(Path(__file__).resolve().parent / "paced_node.py"), executable("memspec_node"),
           "--ros-args", "-r", f"__node:={name}", "--params-file", str(params_file(tmp_path))]
    loading = 600.0  # the configure's load: far longer than anything this test waits for
    env = dict(os.environ, MEMSPEC_TEST_CONFIGURE_SECONDS=str(loading))
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
                            env=env)
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True)
    reader.start()
    context, node, executor = client_side("second_signal_test_client")
    try:
        change = node.create_client(ChangeState, f"/{name}/change_state")
        wait_until(lambda: (executor.spin_once(timeout_sec=0.05), change.service_is_ready())[1], TIMEOUT,
                   "the lifecycle service")
        change.call_async(ChangeState.Request(transition=Transition(id=Transition.TRANSITION_CONFIGURE)))
        wait_until(lambda: (executor.spin_once(timeout_sec=0.05), "paced_node: configure loading\n" in lines)[1],
                   TIMEOUT, "the configure's load to start")
        os.killpg(proc.pid, signal.SIGINT)
        wait_until(lambda: any("waiting for the lifecycle transition" in line for line in lines), TIMEOUT,
                   "the node to wait for the configure in progress")
        os.killpg(proc.pid, signal.SIGINT)
        try:
            proc.wait(timeout=loading / 4)
        except subprocess.TimeoutExpired:
            pytest.fail("the node lived on after a second SIGINT until the configure would end:\n" + "".join(lines))
    finally:
        executor.shutdown(timeout_sec=1.0)
        node.destroy_node()
        rclpy.try_shutdown(context=context)
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    reader.join(10.0)
    assert proc.returncode == 128 + signal.SIGINT, "".join(lines)
    assert "Traceback" not in "".join(lines), "".join(lines)
