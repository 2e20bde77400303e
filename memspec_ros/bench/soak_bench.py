"""`memspec-bench soak`: memspec_node under sustained load, with nothing lost and nothing growing.

The node runs in this process (MemSpecNode, configured and activated, spun by a MultiThreadedExecutor as
`memspec_node` spins it); the client is a process of its own, as a robot's is, and drives three phases
through the Generate action over DDS on loopback:

    sequential   N goals one after another (after a warm-up whose end is the memory baseline)
    bursts       a long goal runs; 20 goal requests are sent at once against a queue of 4: exactly 4 are
                 accepted, every request is answered; the long goal is cancelled, the 4 run
    cancel storm queue + 1 long goals accepted, then every one cancelled at once; repeated

Checked and reported:
* every accepted goal ends in a terminal state and its result reaches the client (``goals_lost``); every
  goal request is answered (``requests_unanswered``);
* the draft cache's limits hold at every instant: an invariant monitor on DraftCacheManager.on_change (run
  under the cache's lock at each state change) checks resident + loading <= K and bytes reserved <= the
  byte budget (set to hold fewer drafts than K, so that it binds) (``budget_violations``);
* resident memory of the node's process from the end of the warm-up to the end (``rss_growth``);
* goal-acceptance latency: the node's goal callback (measured in the server) and the client's round trip
  (request sent to answer received), p50 / p99.

``--long`` is the README's run (1,000 sequential goals, 10 bursts, 20 storm rounds on the bundled zoo);
the default is the CI size the tests run on the tiny zoo.
"""

from __future__ import annotations

import gc
import json
import math
import os
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path

SUCCEEDED, CANCELED, ABORTED = 4, 5, 6  # action_msgs/GoalStatus
TERMINAL = {SUCCEEDED: "succeeded", CANCELED: "canceled", ABORTED: "aborted"}
ANSWER_SECONDS = 30.0  # a goal request or a cancel without an answer after this long counts as unanswered
RESULT_SECONDS = 600.0  # an accepted goal without its result after this long counts as lost
RSS_GROWTH_LIMIT = 0.05  # the bound on resident memory growth after warm-up (checked in --long)
ACCEPT_P99_LIMIT = 0.050  # the bound on goal-acceptance latency (p99)


@dataclass
class SoakConfig:
    goals: int = 200  # sequential goals after the warm-up
    warmup: int = 20
    bursts: int = 3
    burst_size: int = 20
    queue: int = 4  # action.max_queued_goals
    storm_rounds: int = 5
    max_new_tokens: int = 8  # per sequential / burst goal
    long_tokens: int = 3000  # the goal a burst or a storm round runs against (cancelled, never finished)
    threads: int = 1
    policy: str = "memspec"
    capacity: int = 3  # K
    interval: int = 2  # N: scheduling points often, so that prefetches and evictions happen
    budget_drafts: float = 2.5  # byte budget = this many of the largest draft: fewer than K fit, it binds
    storage: str = "local"  # cache.storage: the medium every draft load reads through (recorded with the config)


CI = SoakConfig()
LONG = SoakConfig(goals=1000, warmup=50, bursts=10, storm_rounds=20)


def own_threads() -> Counter:
    """This process's threads by name, rclpy's executor pools (bounded by their size, started lazily) and the
    soak's own sampler left out."""
    return Counter(t.name for t in threading.enumerate()
                   if not t.name.startswith(("ThreadPoolExecutor", "memspec-soak-rss")))


def rss_bytes(pid: int | str = "self") -> int:
    with open(f"/proc/{pid}/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def percentile(values: list[float], q: float) -> float:
    """The q-quantile by the nearest-rank method (p99 of 100 values is the 99th smallest)."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered), max(1, math.ceil(q * len(ordered)))) - 1]


class InvariantMonitor:
    """DraftCacheManager.on_change: the cache's limits at every state change (under the cache's lock)."""

    def __init__(self, capacity: int, budget_bytes: int) -> None:
        self.capacity, self.budget_bytes = capacity, budget_bytes
        self.checks = 0
        self.violations: list[str] = []
        self.max_reserved = 0
        self.max_slots = 0

    def __call__(self, snap) -> None:
        self.checks += 1
        slots = len(snap.resident) + len(snap.loading)
        self.max_slots = max(self.max_slots, slots)
        self.max_reserved = max(self.max_reserved, snap.bytes_reserved)
        if slots > self.capacity:
            self.violations.append(f"{slots} drafts resident or loading with K={self.capacity}")
        if self.budget_bytes and snap.bytes_reserved > self.budget_bytes:
            self.violations.append(f"{snap.bytes_reserved} B reserved over the {self.budget_bytes} B budget")


def soak_prompts(zoo: Path, count: int = 40) -> list[str]:
    from .action_bench import domain_prompts

    workloads = zoo / "workloads"
    if not workloads.is_dir():
        workloads = Path(__file__).resolve().parents[2] / "models" / "workloads"
    return domain_prompts(workloads, count)


def largest_draft_in_memory(node) -> int:
    """The most bytes a draft occupies once loaded (each loaded once, outside the cache): its file size can be
    half of it (fp16 weights on storage, fp32 in memory), and the budget must bind on what the cache accounts."""
    cache, names = node.loaded.controller.cache, node.loaded.registry.names()
    return max((int(cache.loader(name).size_bytes) for name in names), default=0)


def run_soak(zoo: Path | None, config: SoakConfig = CI, *, domain_id: int | None = None,
             progress=None) -> dict:
    """The soak on ``zoo`` (None or no registry: a generated tiny zoo); returns the figures (see the module)."""
    from ..ros.demo import isolated_domain
    from ..testing.tiny_zoo import build_tiny_zoo

    note = ""
    with tempfile.TemporaryDirectory(prefix="memspec_soak_zoo_") as scratch:  # a generated zoo goes with it
        if zoo is None or not (zoo / "registry.yaml").is_file():
            note = f"no zoo at {zoo}: generated tiny zoo"
            zoo = build_tiny_zoo(Path(scratch), hidden=64, layers=2, draft_layers=2)
        with isolated_domain(domain_id):  # read by rclpy.init and the client process
            result = _soak(zoo, config, progress)
    result.update(zoo=str(zoo), note=note, config=asdict(config))
    return result


def _soak(zoo: Path, config: SoakConfig, progress) -> dict:
    import rclpy
    from rclpy.context import Context
    from rclpy.executors import MultiThreadedExecutor
    from rclpy.parameter import Parameter

    from ..ros.node import EXECUTOR_THREADS, MemSpecNode

    overrides = {"drafts.registry_file": str(zoo / "registry.yaml"), "model.threads": config.threads,
                 "memspec.policy": config.policy, "memspec.capacity": config.capacity,
                 "memspec.interval": config.interval, "action.max_queued_goals": config.queue,
                 "generation.max_new_tokens": config.max_new_tokens, "cache.storage": config.storage}
    context = Context()
    rclpy.init(context=context)
    node = MemSpecNode("memspec_soak", context=context,
                       parameter_overrides=[Parameter(k, value=v) for k, v in overrides.items()])
    callback_seconds: list[float] = []
    on_goal = node._on_goal  # the goal callback, timed in the server as the tests time it

    def timed_on_goal(request):
        t0 = time.perf_counter()
        try:
            return on_goal(request)
        finally:
            callback_seconds.append(time.perf_counter() - t0)

    node._action_server.register_goal_callback(timed_on_goal)
    executor = MultiThreadedExecutor(num_threads=EXECUTOR_THREADS, context=context)
    executor.add_node(node)
    spinner = threading.Thread(target=executor.spin, daemon=True)
    spinner.start()
    client = None
    samples: list[tuple[float, int]] = []
    stop_sampling = threading.Event()
    try:
        if node.trigger_configure().name != "SUCCESS" or node.trigger_activate().name != "SUCCESS":
            raise RuntimeError(f"the node did not configure/activate: {node.configure_error}")
        cache = node.loaded.controller.cache
        budget = int(config.budget_drafts * largest_draft_in_memory(node))
        result = node.set_parameters([Parameter("memspec.budget_bytes", value=budget)])[0]
        if not result.successful:
            raise RuntimeError(f"memspec.budget_bytes {budget} refused: {result.reason}")
        monitor = InvariantMonitor(config.capacity, budget)
        cache.on_change = monitor

        def sample() -> None:
            while not stop_sampling.wait(0.5):
                samples.append((time.monotonic(), rss_bytes()))

        sampler = threading.Thread(target=sample, name="memspec-soak-rss", daemon=True)
        sampler.start()
        plan = {"config": asdict(config), "prompts": soak_prompts(zoo), "action": "/memspec_soak/generate"}
        client = subprocess.Popen([sys.executable, "-m", "memspec_ros.bench.soak_bench", json.dumps(plan)],
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1)
        rss_warm = warm_at = threads_warm = None
        done: dict = {}
        for line in client.stdout:
            message = json.loads(line)
            if message["phase"] == "warm":  # the baselines: after the warm-up, garbage collected
                gc.collect()
                rss_warm, warm_at, threads_warm = rss_bytes(), time.monotonic(), own_threads()
                callback_seconds.clear()
                client.stdin.write("go\n")  # the client waits: a goal sent during gc.collect() would wait for it
                client.stdin.flush()
            elif message["phase"] == "goal" and progress is not None:
                progress.update(1)
            elif message["phase"] == "done":
                done = message
        if client.wait(timeout=60) != 0 or not done:
            raise RuntimeError(f"the soak client failed (exit {client.returncode})")
        deadline = time.monotonic() + 60.0
        while node._runner.counts() != (False, 0) and time.monotonic() < deadline:
            time.sleep(0.05)
        cache.drain()
        gc.collect()
        rss_end = rss_bytes()
        stop_sampling.set()
        sampler.join(5.0)
        threads_end = own_threads()
        last_rejection = node.last_rejection
        handles_held = len(node._action_server._goal_handles)  # rclpy keeps a finished goal result_timeout (900 s)
        after_warm = [rss for t, rss in samples if warm_at is not None and t >= warm_at]
    finally:
        stop_sampling.set()
        if client is not None and client.poll() is None:
            client.kill()
            client.wait(timeout=10)
        executor.shutdown(timeout_sec=5.0)
        spinner.join(5.0)  # out of rcl before the node it spins is destroyed
        node.destroy_node()
        rclpy.try_shutdown(context=context)
    figures = _figures(done, monitor, budget, callback_seconds, rss_warm, rss_end, after_warm, threads_warm,
                       threads_end, config.queue)
    figures["last_rejection"] = last_rejection
    figures["goal_handles_held_by_rclpy"] = handles_held
    return figures


def _figures(done: dict, monitor: InvariantMonitor, budget: int, callback_seconds: list[float], rss_warm: int,
             rss_end: int, after_warm: list[int], threads_warm: Counter, threads_end: Counter, queue: int) -> dict:
    client_latency = done["accept_latencies"]
    figures = {
        "goals_sent": done["sent"],
        "goals_accepted": done["accepted"],
        "goals_rejected": done["rejected"],  # by the queue's bound; a busy node's retried rejections apart:
        "goal_retries_rejected": done.get("retried", 0),
        "terminal": done["terminal"],
        "goals_lost": done["lost"],
        "requests_unanswered": done["unanswered"],
        "bursts_accepted": done["bursts_accepted"],
        "budget_bytes": budget,
        "invariant_checks": monitor.checks,
        "budget_violations": len(monitor.violations),
        "violations": monitor.violations[:10],
        "max_bytes_reserved": monitor.max_reserved,
        "max_drafts_in_memory": monitor.max_slots,
        "rss_warm_mb": rss_warm / 1e6,
        "rss_end_mb": rss_end / 1e6,
        "rss_peak_after_warm_mb": max(after_warm, default=rss_end) / 1e6,
        "rss_growth": (rss_end - rss_warm) / rss_warm,
        "threads_warm": dict(threads_warm),
        "threads_end": dict(threads_end),
        # by name, the threads more at the end than after the warm-up: a leak. Fewer is none (a thread another
        # part of the process started, ending meanwhile, failed an equality in a test run)
        "threads_grown": dict(threads_end - threads_warm),
        "goal_callback_ms": _latency_ms(callback_seconds),
        "accept_round_trip_ms": _latency_ms(client_latency),
        "accept_round_trip_ms_by_phase": {p: _latency_ms(v) for p, v in done["phase_latencies"].items()},
        "seconds": done["seconds"],
    }
    figures["ok"] = (figures["goals_lost"] == 0 and figures["requests_unanswered"] == 0
                     # a goal that ended in an error is a failure the soak is there to find, lost or not
                     and not done["terminal"].get("aborted")
                     and figures["budget_violations"] == 0 and not figures["threads_grown"]
                     # each burst against a running goal: exactly the queue's room accepted, the rest rejected
                     and all(n == queue for n in figures["bursts_accepted"])
                     and figures["goal_callback_ms"]["p99"] < 1e3 * ACCEPT_P99_LIMIT)
    return figures


def _latency_ms(seconds: list[float]) -> dict:
    return {"p50": 1e3 * percentile(seconds, 0.50), "p99": 1e3 * percentile(seconds, 0.99),
            "max": 1e3 * max(seconds, default=float("nan")), "n": len(seconds)}


# -- the client process -----------------------------------------------------------------------------

class _Client:
    """The soak's action client: its executor spins on a thread of its own, requests go out from the caller."""

    def __init__(self, action: str) -> None:
        import rclpy
        from rclpy.executors import MultiThreadedExecutor
        from rclpy.qos import QoSProfile

        from memspec_interfaces.action import Generate

        from ..ros.action_client import SafeActionClient

        rclpy.init()
        self.Generate = Generate
        self.node = rclpy.create_node("memspec_soak_client")
        deep = QoSProfile(depth=100)  # only the server's queues are under test
        self.action = SafeActionClient(self.node, Generate, action, goal_service_qos_profile=deep,
                                       result_service_qos_profile=deep, cancel_service_qos_profile=deep)
        self.executor = MultiThreadedExecutor(num_threads=2)
        self.executor.add_node(self.node)
        self.spinner = threading.Thread(target=self.executor.spin, daemon=True)
        self.spinner.start()
        self.latencies: list[float] = []
        self.phase_latencies: dict[str, list[float]] = {}
        self.phase = "warm-up"
        self.outcomes: Counter = Counter()
        self.sent = self.answered = self.accepted = 0
        self.retried = 0  # rejections of running()'s own retries: the node still ending a goal, not a queue test
        self.lost = self.unanswered = 0  # never reset: a lost goal or an unanswered request is a failure anywhere
        self.feedback: dict[bytes, int] = {}

    def close(self) -> None:
        """Stop spinning before anything is destroyed (a spin left inside rcl at exit aborted the process)."""
        import rclpy

        self.executor.shutdown(timeout_sec=5.0)
        self.spinner.join(5.0)
        self.action.destroy()
        self.node.destroy_node()
        rclpy.try_shutdown()

    @staticmethod
    def wait(futures: list, seconds: float) -> None:
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline and not all(f.done() for f in futures):
            time.sleep(0.001)

    def send(self, prompts: list[str], max_new_tokens: int) -> list:
        """Goal requests sent at once; the handles of the accepted ones (latencies and counts recorded)."""
        goals = [self.Generate.Goal(prompt=p, max_new_tokens=max_new_tokens, temperature=0.0) for p in prompts]
        started, futures = [], []
        for goal in goals:
            started.append(time.perf_counter())
            futures.append(self.action.send_goal_async(goal, feedback_callback=self._on_feedback))
        answered_at: dict[int, float] = {}
        deadline = time.monotonic() + ANSWER_SECONDS
        while len(answered_at) < len(futures) and time.monotonic() < deadline:
            for i, future in enumerate(futures):
                if i not in answered_at and future.done():
                    answered_at[i] = time.perf_counter()
            time.sleep(0.0002)
        self.sent += len(futures)
        self.answered += len(answered_at)
        handles = []
        for i, future in enumerate(futures):
            if i not in answered_at:
                self.unanswered += 1
                continue
            self.latencies.append(answered_at[i] - started[i])
            self.phase_latencies.setdefault(self.phase, []).append(answered_at[i] - started[i])
            handle = future.result()
            if handle.accepted:
                self.accepted += 1
                handles.append(handle)
        return handles

    def _on_feedback(self, message) -> None:
        key = bytes(message.goal_id.uuid)
        self.feedback[key] = self.feedback.get(key, 0) + 1

    def finish(self, handles: list, cancel: bool = False) -> None:
        """Cancel (if asked) and collect the results of accepted goals: each must end in a terminal state."""
        if cancel:
            cancels = [h.cancel_goal_async() for h in handles]
            self.wait(cancels, ANSWER_SECONDS)
            self.unanswered += sum(not c.done() for c in cancels)
        results = [h.get_result_async() for h in handles]
        self.wait(results, RESULT_SECONDS)
        for future in results:
            status = future.result().status if future.done() else None
            if status in TERMINAL:
                self.outcomes[TERMINAL[status]] += 1
            else:
                self.lost += 1

    def running(self, prompt: str, long_tokens: int):
        """A long goal, accepted and decoding (its first feedback came). The goals before it have their results,
        but the node may still be ending the last one: a rejection (queue full) is retried."""
        deadline = time.monotonic() + ANSWER_SECONDS
        rejected_before = self.answered - self.accepted
        handles = self.send([prompt], long_tokens)
        while not handles and time.monotonic() < deadline:
            time.sleep(0.05)
            handles = self.send([prompt], long_tokens)
        self.retried += self.answered - self.accepted - rejected_before
        if not handles:
            raise RuntimeError("the long goal of a burst or storm round was never accepted")
        handle = handles[0]
        key = bytes(handle.goal_id.uuid)
        deadline = time.monotonic() + ANSWER_SECONDS
        while self.feedback.get(key, 0) < 1 and time.monotonic() < deadline:
            time.sleep(0.005)
        return handle


def client_main(plan: dict) -> int:
    config = SoakConfig(**plan["config"])
    prompts = plan["prompts"]
    client = _Client(plan["action"])

    def say(**message) -> None:
        print(json.dumps(message), flush=True)

    deadline = time.monotonic() + ANSWER_SECONDS
    while not client.action.server_is_ready() and time.monotonic() < deadline:
        time.sleep(0.05)
    t0 = time.monotonic()
    for i in range(config.warmup):
        client.finish(client.send([prompts[i % len(prompts)]], config.max_new_tokens))
    client.latencies.clear()  # latencies and counts from here on
    client.phase_latencies.clear()
    client.outcomes.clear()
    client.sent = client.answered = client.accepted = 0
    say(phase="warm")
    sys.stdin.readline()  # until the node's process has taken its baselines
    client.phase = "sequential"
    for i in range(config.goals):
        client.finish(client.send([prompts[i % len(prompts)]], config.max_new_tokens))
        say(phase="goal", n=i)
    bursts_accepted = []
    client.phase = "bursts"
    for b in range(config.bursts):
        long = client.running(prompts[b % len(prompts)], config.long_tokens)
        burst = client.send([prompts[(b + k) % len(prompts)] for k in range(config.burst_size)],
                            config.max_new_tokens)
        bursts_accepted.append(len(burst))
        client.finish([long], cancel=True)
        client.finish(burst)
    client.phase = "cancel storm"
    for r in range(config.storm_rounds):
        first = client.running(prompts[r % len(prompts)], config.long_tokens)
        queued = client.send([prompts[(r + k) % len(prompts)] for k in range(config.queue)], config.long_tokens)
        client.finish([first, *queued], cancel=True)
    say(phase="done", sent=client.sent, accepted=client.accepted,
        rejected=client.answered - client.accepted - client.retried, retried=client.retried,
        terminal=dict(client.outcomes), lost=client.lost, unanswered=client.unanswered,
        bursts_accepted=bursts_accepted, accept_latencies=client.latencies,
        phase_latencies=client.phase_latencies, seconds=time.monotonic() - t0)
    client.close()
    return 0


def summary(result: dict) -> str:
    cb, rt = result["goal_callback_ms"], result["accept_round_trip_ms"]
    return (f"goals sent {result['goals_sent']}, accepted {result['goals_accepted']}, rejected"
            f" {result['goals_rejected']}; terminal {result['terminal']}; lost {result['goals_lost']}, unanswered"
            f" {result['requests_unanswered']}; bursts accepted {result['bursts_accepted']}\n"
            f"cache invariants: {result['invariant_checks']} checks, {result['budget_violations']} violations"
            f" (budget {result['budget_bytes']} B, most reserved {result['max_bytes_reserved']} B, most drafts in"
            f" memory {result['max_drafts_in_memory']})\n"
            f"RSS {result['rss_warm_mb']:.1f} MB after warm-up -> {result['rss_end_mb']:.1f} MB at the end"
            f" ({100 * result['rss_growth']:+.2f} %, peak {result['rss_peak_after_warm_mb']:.1f} MB); threads"
            f" {sum(result['threads_warm'].values())} -> {sum(result['threads_end'].values())}"
            f" (executor pools aside)\n"
            f"goal acceptance: goal callback p50 {cb['p50']:.2f} ms / p99 {cb['p99']:.2f} ms (max {cb['max']:.1f});"
            f" client round trip p50 {rt['p50']:.2f} ms / p99 {rt['p99']:.2f} ms (max {rt['max']:.1f});"
            f" {result['seconds']:.0f} s\n"
            "client round trip by phase: " + "; ".join(
                f"{phase} p50 {v['p50']:.2f} / p99 {v['p99']:.2f} ms" for phase, v in
                result["accept_round_trip_ms_by_phase"].items()))


if __name__ == "__main__":
    sys.exit(client_main(json.loads(sys.argv[1])))
