"""`make demo`: the node on the bundled zoo, end to end, the way a robot uses it.

1. start ``memspec_node`` as its own process with config/memspec.yaml (on a ROS_DOMAIN_ID of its own);
2. bring it to active through the lifecycle services (ChangeState configure, then activate),
   exactly what ``ros2 lifecycle set`` or the launch file does;
3. send a real prompt through the Generate action, text streamed as feedback arrives, then the
   result's statistics (memspec_client's code path); with an instruct model, a follow-up turn of the same
   conversation (the node's prompt cache reuses the first turn's encoding);
4. print a snapshot of the node's /diagnostics;
5. deactivate, cleanup, shutdown, then stop the process (its whole process group).

Exit status 0 only if every step worked. Without a built zoo (models/registry.yaml) it says so and
runs on a generated tiny zoo instead, so the ROS path can still be seen (the text is then noise).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

from ..argtypes import positive_float, positive_int, prompt_text
from ..runtime.jsonl import WorkloadFileError, read_jsonl
from .ros_env import isolate_ros_environment, lock_domain_id

REPO = Path(__file__).resolve().parents[2]
NODE_NAME = "memspec"
DEFAULT_PROMPT = "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n"
LEVELS = {0: "OK", 1: "WARN", 2: "ERROR", 3: "STALE"}


def say(text: str) -> None:
    try:
        print(f"\033[1m[demo]\033[0m {text}", flush=True)
    except OSError:  # stdout gone (a pipe's reader ended, the terminal closed): the demo must still stop its node
        pass


DEMO_DOMAIN_IDS = range(215, 233)


def claim_domain_id() -> tuple[int, object]:
    """A ROS_DOMAIN_ID no other demo or test on this host holds (the lock is held until exit)."""
    if os.environ.get("MEMSPEC_DEMO_DOMAIN_ID"):
        return int(os.environ["MEMSPEC_DEMO_DOMAIN_ID"]), None
    # 215..232: the ids above Linux's ephemeral ports (DDS listens on 7400 + 250 x id and up; ids 102..214 land
    # in 32768..60999, where another program's outgoing port can take one); the test sessions hold 1..101
    claimed = lock_domain_id(DEMO_DOMAIN_IDS)
    if claimed is not None:
        return claimed
    raise RuntimeError(f"no free ROS_DOMAIN_ID in {DEMO_DOMAIN_IDS.start}..{DEMO_DOMAIN_IDS.stop - 1}: set"
                       " MEMSPEC_DEMO_DOMAIN_ID")


@contextlib.contextmanager
def isolated_domain(domain_id: int | None = None) -> Iterator[int]:
    """ROS_DOMAIN_ID set to ``domain_id`` (or a free one, :func:`claim_domain_id`) and discovery kept on this
    host, for rclpy.init in this process and the processes it starts; the environment is restored on exit."""
    lock = None
    if domain_id is None:
        domain_id, lock = claim_domain_id()
    saved = {k: os.environ.get(k) for k in ("ROS_DOMAIN_ID", "ROS_AUTOMATIC_DISCOVERY_RANGE")}
    os.environ["ROS_DOMAIN_ID"] = str(domain_id)
    os.environ.setdefault("ROS_AUTOMATIC_DISCOVERY_RANGE", "LOCALHOST")
    try:
        yield domain_id
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        if lock is not None:
            lock.close()


def _sendable(row: dict) -> str | None:
    if isinstance(row.get("prompt"), str) and row["prompt"]:
        return None
    return 'the demo sends a row\'s "prompt" and this one has none'


def demo_prompt(zoo: Path) -> str:
    """The first code prompt of the zoo's workloads (the zoo is trained on these domains)."""
    for name in ("code.jsonl", "mixed.jsonl"):
        path = zoo / "workloads" / name
        if path.is_file():
            try:
                rows = read_jsonl(path, limit=1, row_check=_sendable)
            except WorkloadFileError as exc:
                raise SystemExit(f"{exc}: fix it, or give --prompt") from None
            if rows:
                return rows[0]["prompt"]
    return DEFAULT_PROMPT


def start_node(params_file: Path, overrides: dict[str, str], log_path: Path) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "memspec_ros.ros.node", "--ros-args", "-r", f"__node:={NODE_NAME}",
           "--params-file", str(params_file)]
    for key, value in overrides.items():
        cmd += ["-p", f"{key}:={value}"]
    log = open(log_path, "w")
    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


STOP_WAITS = (15.0, 5.0, 5.0)  # seconds stop_process gives the node after its SIGINT, SIGTERM and SIGKILL


def stop_process(proc: subprocess.Popen) -> int | None:
    """SIGINT (the node shuts down cleanly), then SIGTERM, then SIGKILL to its process group."""
    for sig, wait in zip((signal.SIGINT, signal.SIGTERM, signal.SIGKILL), STOP_WAITS, strict=True):
        if proc.poll() is not None:
            break
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            break
        try:
            proc.wait(timeout=wait)
        except subprocess.TimeoutExpired:
            continue
    return proc.poll()


def print_diagnostics(array) -> None:
    for status in array.status:
        level = LEVELS.get(status.level[0] if isinstance(status.level, bytes) else status.level, "?")
        print(f"  [{level:5}] {status.name}: {status.message}  (hardware_id {status.hardware_id})")
        for kv in status.values:
            print(f"          {kv.key}: {kv.value}")


def choose_zoo(args) -> tuple[Path, dict[str, str], bool]:
    """The zoo (the bundled one, else a generated tiny zoo: True when generated) and the node's overrides."""
    from ..testing.tiny_zoo import build_tiny_zoo
    from .params import default_zoo_dir

    zoo = Path(args.zoo) if args.zoo else default_zoo_dir()
    generated = not (zoo / "registry.yaml").is_file()
    if generated and args.zoo:  # a zoo named and not there (a typo) is not replaced by noise
        raise SystemExit(f"--zoo {zoo}: no zoo there (registry.yaml missing): pass a built zoo's folder, or leave"
                         " --zoo out for the bundled one")
    params = {}  # checked before a zoo is generated: a malformed one left the generated zoo in /tmp
    for item in args.param or []:
        key, sep, value = item.partition(":=")
        if not sep:
            raise SystemExit(f"--param wants NAME:=VALUE, got {item!r}")
        params[key] = value
    if generated:
        tiny = Path(tempfile.mkdtemp(prefix="memspec_demo_zoo_"))
        say(f"no bundled zoo at {zoo} (build it with `memspec-zoo build --out {zoo}`): using a generated tiny zoo in"
            f" {tiny}; its text is noise, the ROS path is the real one")
        try:
            build_tiny_zoo(tiny, hidden=64, layers=2, draft_layers=2)
        except BaseException:  # a failure or a Ctrl-C while it is built: nothing half-made stays in /tmp
            shutil.rmtree(tiny, ignore_errors=True)
            raise
        zoo = tiny
    try:
        return zoo, _overrides(args, zoo, params), generated
    except BaseException:  # run() removes the generated zoo only once it has it
        if generated:
            shutil.rmtree(zoo, ignore_errors=True)
        raise


def _overrides(args, zoo: Path, params: dict[str, str]) -> dict[str, str]:
    from ..runtime.loader import find_predictor

    # the target as loaded by default, the node's own default: a quantized path answers in another arithmetic
    # (scripts/path_quality.py: on an AVX2 CPU int8 picked another token at 8% of answer positions, int4 at 4%)
    overrides = {"model.threads": str(args.threads), "drafts.registry_file": str(zoo / "registry.yaml"),
                 "model.quantization": args.quantization, "drafts.quantization": args.draft_quantization,
                 # gamma per iteration from measured costs: 46-49 against 43-46 tok/s fixed at 4 here
                 "memspec.adaptive_gamma": "true",
                 # proposals copied from the context where its last tokens recur, or else from the zoo's
                 # past answers (its datastore.safetensors, datastore.path's default): free, and lossless
                 "memspec.context_lookup": "true"}
    if not find_predictor(zoo / "predictor"):
        say(f"the zoo has no trained predictor ({zoo / 'predictor'}; train one with memspec-train-predictor):"
            " running policy general-static instead of memspec")
        overrides["memspec.policy"] = "general-static"
    return overrides | params


class NodeExited(RuntimeError):
    """The node's process ended while the demo waited on it."""


class Client:
    """The demo's own ROS node: a lifecycle client for the node and a /diagnostics subscription. ``proc``: the
    node's process, checked whenever the demo spins (a node that exited at start was waited for until the
    timeout, and the demo then said its services never appeared)."""

    def __init__(self, proc: subprocess.Popen | None = None, log_path: Path | None = None) -> None:
        import rclpy
        from diagnostic_msgs.msg import DiagnosticArray
        from rclpy.executors import SingleThreadedExecutor
        from rclpy.signals import SignalHandlerOptions

        from .lifecycle_client import LifecycleClient

        rclpy.init(signal_handler_options=SignalHandlerOptions.NO)
        self.node = rclpy.create_node("memspec_demo")
        self.executor = SingleThreadedExecutor()
        self.executor.add_node(self.node)
        self.diagnostics: list = []
        self.node.create_subscription(DiagnosticArray, "/diagnostics", self.diagnostics.append, 10)
        self.proc, self.log_path = proc, log_path
        self.lifecycle = LifecycleClient(self.node, f"/{NODE_NAME}", self.spin_once)

    def spin_once(self, seconds: float) -> None:
        if self.proc is not None and self.proc.poll() is not None:
            raise NodeExited(f"memspec_node exited with status {self.proc.returncode}: see {self.log_path}")
        self.executor.spin_once(timeout_sec=seconds)

    def close(self) -> None:
        import rclpy

        self.lifecycle.destroy()
        self.node.destroy_node()
        rclpy.try_shutdown()


def bring_up(client: Client, configure_timeout: float, log_path: Path) -> None:
    from lifecycle_msgs.msg import Transition

    say("configure (loads tokenizer, target, predictor and the draft registry)")
    t0 = time.monotonic()
    if not client.lifecycle.change_state(Transition.TRANSITION_CONFIGURE, configure_timeout):
        raise RuntimeError(f"configure failed: see {log_path}")
    say(f"configured in {time.monotonic() - t0:.1f} s; activate")
    if not client.lifecycle.change_state(Transition.TRANSITION_ACTIVATE, 30.0):
        raise RuntimeError(f"activate failed: see {log_path}")


FOLLOW_UP = "Thank you. Now say what it does in one sentence."


def generate(client: Client, prompt: str, max_new_tokens: int, history: list[tuple[str, str]] = ()):
    """One goal through the Generate action, its text streamed as feedback arrives, then its statistics; the
    goal's result. With ``history`` (earlier (role, text) turns), the goal is that conversation and then
    ``prompt``."""
    from memspec_interfaces.action import Generate
    from memspec_interfaces.msg import ChatMessage

    from .client import format_result, send_goal

    turns = [*history, ("user", prompt)] if history else []
    say(f"goal: {max_new_tokens} tokens after the prompt" + (f" ({len(history)} earlier turns with it)" if history
                                                              else "") + f"\n{'-' * 72}\n{prompt}\033[36m")
    goal = Generate.Goal(prompt="" if turns else prompt, max_new_tokens=max_new_tokens, temperature=0.0,
                         messages=[ChatMessage(role=role, content=text) for role, text in turns])
    outcome = send_goal(client.node, client.executor, goal, f"/{NODE_NAME}/generate", server_timeout=20.0)
    print("\033[0m" + "-" * 72)
    if outcome.result is None or not outcome.ok:
        raise RuntimeError(f"the goal did not succeed ({outcome.status})")
    say(format_result(outcome.result))
    say(f"{outcome.feedback_messages} feedback messages; goal answered in {outcome.goal_response_seconds * 1e3:.0f} ms")
    return outcome.result


def diagnostic_value(client: Client, key: str, wait_seconds: float = 5.0) -> str | None:
    """The latest value of ``key`` in the node's /diagnostics, None if none came within ``wait_seconds``."""
    deadline = time.monotonic() + wait_seconds
    while time.monotonic() < deadline:
        for array in reversed(client.diagnostics):
            for status in array.status:
                for kv in status.values:
                    if kv.key == key:
                        return kv.value
        client.spin_once(0.1)
    return None


def has_chat_template(client: Client, wait_seconds: float = 5.0) -> bool:
    """The node's /diagnostics "chat template" (the model takes a conversation)."""
    return diagnostic_value(client, "chat template", wait_seconds) == "True"


def show_diagnostics(client: Client, wait_seconds: float = 5.0) -> None:
    """Print a /diagnostics snapshot; a predictor that did not load (a WARN or ERROR status: the node then ranks
    nothing and runs general-static's choice) fails the demo, which claims MemSpec ran."""
    client.diagnostics.clear()
    deadline = time.monotonic() + wait_seconds
    while not client.diagnostics and time.monotonic() < deadline:
        client.spin_once(0.1)
    if not client.diagnostics:
        raise RuntimeError(f"no /diagnostics message within {wait_seconds:.0f} s")
    say("/diagnostics snapshot:")
    print_diagnostics(client.diagnostics[-1])
    for status in client.diagnostics[-1].status:
        level = status.level[0] if isinstance(status.level, bytes) else status.level
        if status.name.endswith(": predictor") and level != 0:  # 0: OK
            raise RuntimeError(f"the predictor is not working: {status.message}")


def bring_down(client: Client) -> None:
    """Down from wherever the node is: deactivate, cleanup, shutdown."""
    from lifecycle_msgs.msg import Transition

    steps = {"active": Transition.TRANSITION_DEACTIVATE, "inactive": Transition.TRANSITION_CLEANUP,
             "unconfigured": Transition.TRANSITION_UNCONFIGURED_SHUTDOWN}
    try:
        for _ in range(3):
            label = client.lifecycle.state(10.0)
            if label not in steps or not client.lifecycle.change_state(steps[label], 15.0):
                break
        say(f"node brought down to {client.lifecycle.state(10.0)}; stopping the process")
    except Exception as exc:
        say(f"could not bring the node down through its lifecycle ({exc}); stopping the process")


def report(failed: str, proc: subprocess.Popen, code: int | None, log_path: Path, stopped_by: int = 0) -> int:
    """Exit status 0 only if every step worked and the node process exited cleanly; 128 + the signal's number
    if a signal (``stopped_by``) ended the demo and its node stopped."""
    if proc.poll() is None:
        failed = failed or "the node process did not exit"
    elif stopped_by:  # the node was stopped wherever it was (even mid-import): its log is no failure of its own
        say(f"stopped by {signal.Signals(stopped_by).name}: the node was stopped (exit status {code}); its log:"
            f" {log_path}")
        return 128 + stopped_by
    elif code in (128 + signal.SIGTERM, -signal.SIGKILL) and not failed:  # stop_process had to escalate
        failed = (f"the node did not stop within {STOP_WAITS[0]:g} s of SIGINT; "
                  + ("a SIGTERM" if code > 0 else "SIGKILL") + f" stopped it (exit status {code}): see {log_path}")
    elif code not in (0, -signal.SIGINT) and not failed:
        failed = f"the node process exited with status {code}: see {log_path}"
    if failed:
        say(f"FAILED: {failed}")
        tail = log_path.read_text().splitlines()[-15:] if log_path.is_file() else []
        for line in tail:
            print(f"  node> {line}")
        return 1
    log_path.unlink(missing_ok=True)
    say("demo finished: node process exited cleanly")
    return 0


def run(args) -> int:
    zoo, overrides, generated = choose_zoo(args)
    try:
        return _run(args, zoo, overrides)
    finally:  # whatever ended the demo (a failed step, a signal, no free ROS domain): the generated zoo goes
        if generated:
            shutil.rmtree(zoo, ignore_errors=True)


def _run(args, zoo: Path, overrides: list[str]) -> int:
    # before the node: a workload file that cannot give a prompt was found only after configure (a first run's
    # minutes)
    prompt = args.prompt if args.prompt is not None else demo_prompt(zoo)
    domain, _lock = claim_domain_id()
    isolate_ros_environment(domain)  # its node and client on this host, whatever the shell's ROS settings
    # a name of its own (mkstemp: created exclusively, 0600): a predictable one in /tmp was opened with "w", so a
    # link planted under it by another user had the node's log written through it
    fd, name = tempfile.mkstemp(prefix="memspec_demo_node_", suffix=".log")
    os.close(fd)
    log_path = Path(name)
    say(f"starting memspec_node (zoo {zoo}, ROS_DOMAIN_ID {domain}, log {log_path})")
    # the node runs in its own session (a terminal's Ctrl-C reaches the demo only): a Ctrl-C, a SIGTERM (a CI
    # timeout) or a SIGHUP (the terminal closed) must end the demo through the `finally` below, or the node
    # outlives it. The signal is recorded, not only raised: one that lands inside a C extension's import (rclpy's)
    # surfaces as an ImportError, and must still read as "stopped", not as a failed step.
    received: list[int] = []
    shutting_down = False

    def on_signal(signum: int, _frame) -> None:
        if not received:
            received.append(signum)
            if not shutting_down:  # one that arrives during the node's shutdown must not cut it short
                raise SystemExit(128 + signum)

    previous: dict = {}
    proc: subprocess.Popen | None = None
    client = None
    failed, code = "", None
    try:  # the handlers are installed inside it: a signal from the first one on ends in the `finally` below
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            previous[sig] = signal.signal(sig, on_signal)
        proc = start_node(Path(args.params_file), overrides, log_path)
        client = Client(proc, log_path)
        bring_up(client, args.timeout, log_path)
        answer = generate(client, prompt, args.max_new_tokens).text
        if not answer.strip():
            say("the answer is empty: no follow-up turn (a conversation's turns must say something)")
        elif has_chat_template(client):  # the next turn of the conversation: the node reuses its encoding so far
            cache = diagnostic_value(client, "prompt cache") or ""
            cache_on = not cache.startswith("off")
            say("the conversation goes on: the goal carries the first turn and its answer, so the node's prompt cache"
                " encodes only the new turn" if cache_on else
                f"the conversation goes on: the goal carries the first turn and its answer (prompt cache {cache})")
            follow = generate(client, FOLLOW_UP, min(args.max_new_tokens, 64),
                              history=[("user", prompt), ("assistant", answer)])
            if cache_on and follow.reused_prompt_tokens == 0:  # what the line above said the node would do
                raise RuntimeError("the follow-up turn reused no prompt token: the node's prompt cache did not keep"
                                   " the first turn")
        else:
            say("the model has no chat template: no follow-up turn")
        show_diagnostics(client)
    except Exception as exc:  # a failed step: say which, then still shut down cleanly
        failed = str(exc)
    except SystemExit:
        if not received:
            raise
    finally:
        shutting_down = True
        try:
            if proc is not None and proc.poll() is None and client is not None:
                bring_down(client)
        except BaseException:  # whatever failed there (stdout gone, say), the node process must still be stopped
            pass
        try:
            if proc is not None:
                code = stop_process(proc)
        finally:
            try:
                if client is not None:
                    client.close()
            finally:
                for sig, handler in previous.items():
                    signal.signal(sig, handler)
    if proc is None:  # stopped or failed before the node process started: its empty log goes too
        log_path.unlink(missing_ok=True)
        if received:
            say(f"stopped by {signal.Signals(received[0]).name} before the node process started")
            return 128 + received[0]
        say(f"FAILED: the node process could not be started: {failed}")
        return 1
    return report(failed, proc, code, log_path, received[0] if received else 0)


def default_params_file() -> str:
    """config/memspec.yaml of this checkout, or of the installed package where the sources are not beside it (a
    colcon install without --symlink-install copies the module into site-packages, far from config/)."""
    here = REPO / "config" / "memspec.yaml"
    if here.is_file():
        return str(here)
    try:
        from ament_index_python.packages import PackageNotFoundError, get_package_share_directory
    except ImportError:  # no ROS environment sourced: the checkout's path, which --params-file's check then names
        return str(here)
    try:
        return str(Path(get_package_share_directory("memspec_ros")) / "config" / "memspec.yaml")
    except PackageNotFoundError:
        return str(here)


def _existing_file(text: str) -> str:
    if not Path(text).is_file():
        raise argparse.ArgumentTypeError(f"{text}: no such file")
    return text


def main(argv: list[str] | None = None) -> int:
    from .params import node_range

    parser = argparse.ArgumentParser(prog="python -m memspec_ros.ros.demo", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--zoo", help="zoo directory with registry.yaml (default: the bundled zoo)")
    parser.add_argument("--params-file", type=_existing_file, default=default_params_file(),
                        help="the node's parameters file (default config/memspec.yaml: the checkout's, else the"
                             " installed package's share/memspec_ros/config). The demo sets these over it:"
                             " model.threads, model.quantization, drafts.quantization and drafts.registry_file"
                             " (--threads, --quantization, --draft-quantization, --zoo), memspec.adaptive_gamma and"
                             " memspec.context_lookup (true), and memspec.policy where the zoo has no predictor;"
                             " set them with those flags or --param, which wins over both")
    parser.add_argument("--prompt", type=prompt_text, help="prompt (default: the zoo's first code workload prompt)")
    parser.add_argument("--max-new-tokens", type=positive_int, default=128)
    parser.add_argument("--threads", type=node_range("model.threads"), default=os.environ.get("MEMSPEC_THREADS", "1"),
                        help="torch CPU threads of the node (default 1: fastest on a busy 2-core machine)")
    parser.add_argument("--timeout", type=positive_float, default=180.0, help="seconds allowed for configure")
    # models.QUANTIZATIONS (its module imports torch, which this process does not need); a test keeps them equal
    parser.add_argument("--quantization", default="none", choices=("none", "int8", "int4", "gptq", "auto"),
                        help="model.quantization (default none, the node's: the target computes as loaded; auto: the"
                             " fastest CPU path timed at configure, int8/int4: faster, in another arithmetic)")
    parser.add_argument("--draft-quantization", default="int4", choices=("none", "int8", "int4"),
                        help="drafts.quantization (default int4: a third of fp32's cost per draft token here, the"
                             " same acceptance; output stays the target's)")
    parser.add_argument("--param", action="append", metavar="NAME:=VALUE",
                        help="extra node parameter (repeatable), e.g. --param memspec.capacity:=3")
    args = parser.parse_args(argv)
    try:
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
    except ImportError:
        pass
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
