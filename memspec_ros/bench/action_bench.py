"""`memspec-bench action`: what the ROS action path costs over calling the runtime directly.

One process, one set of models: a MemSpecNode (configured and activated through its lifecycle,
spun by a MultiThreadedExecutor like `memspec_node`) serves Generate goals from an ActionClient
over DDS on loopback; the direct path calls the same node's RuntimeController.generate with the
same prompt. The two paths alternate prompt by prompt (and which goes first alternates per run),
so drift on a shared machine hits both alike. The draft cache is reset per generation (the paper's
protocol), so both paths start from the same cache state.

Reported, medians over prompts x runs:
* steady-state tokens/s (GenerationStats.tokens_per_second: decoding only; the action path pays
  its feedback publishing, cancel checks and executor threads here);
* end-to-end tokens/s as the caller sees it (completion tokens over the wall time from sending the
  goal to holding the result, vs. from calling generate to its return).
The claim to check: action / direct >= 0.97.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from ..runtime.stats import paired_ratio, ratio


def domain_prompts(workloads: Path, count: int) -> list[str]:
    """Round-robin over the domain workloads (first prompts of each): the held-out requests, never the training ones
    (train*.jsonl, policy_bench.workloads_in), and not the mixed workload (the engine bench's round robin takes it
    too: these benches measure the ROS path's cost per goal, for which one domain's prompts do as well as two)."""
    from ..zoo.workloads import prompt_problem, read_jsonl
    from .policy_bench import workloads_in

    files = [workloads / f"{name}.jsonl" for name in workloads_in(workloads) if name != "mixed"]
    # these benches send a goal's prompt field, not chat messages
    per_file = [[r["prompt"] for r in read_jsonl(f, count, prompt_problem)] for f in files]
    prompts, i = [], 0
    while len(prompts) < count and any(i < len(p) for p in per_file):
        prompts += [p[i] for p in per_file if i < len(p)]
        i += 1
    return prompts[:count] or ["def fibonacci(n):\n"]


def node_parameter_range(name: str):
    """ros.params.node_range for the bench's command line (this bench may import the ROS layer; its parser may
    not): the node parameter's range is read when the option is."""

    def parse(text: str):
        try:
            from ..ros.params import node_range
        except ImportError as exc:  # argparse turns only these into a usage error, not a traceback
            raise argparse.ArgumentTypeError(f"needs ROS 2 (its Python packages: {exc})") from None
        return node_range(name)(text)

    parse.__name__ = f"{name} (the node's range)"
    return parse


def run_action_bench(zoo: Path | None, *, prompts: int = 10, runs: int = 3, max_new_tokens: int = 128,
                     threads: int = 1, feedback_period: float = 0.1, policy: str = "memspec",
                     predictor: str = "", domain_id: int | None = None, storage: str = "local",
                     progress=None) -> dict:
    """Goals through the action server beside the same requests as direct runtime calls, interleaved, on one node
    whose drafts are read through ``storage`` (cache.storage; both paths load through it alike)."""

    from ..ros.demo import isolated_domain
    from ..testing.tiny_zoo import build_tiny_zoo

    note = ""
    with tempfile.TemporaryDirectory(prefix="memspec_bench_zoo_") as scratch:  # a generated zoo goes with it
        if zoo is None or not (zoo / "registry.yaml").is_file():
            note = f"no zoo at {zoo}: generated tiny zoo (random 256x6 target, 1-layer drafts)"
            zoo = build_tiny_zoo(Path(scratch))
        texts = domain_prompts(Path(__file__).resolve().parents[2] / "models" / "workloads"
                               if not (zoo / "workloads").is_dir() else zoo / "workloads", prompts)
        with isolated_domain(domain_id):  # read by rclpy.init and the client process
            rows, ran = _pairs(zoo, texts, runs, max_new_tokens, threads, feedback_period, policy, predictor,
                               storage, progress)
    if ran["policy"] != policy:  # the node fell back (no predictor for a ranking policy): said, and recorded
        note = "; ".join(filter(None, [note, f"policy {policy} asked, the node ran {ran['policy']}"
                                             f" ({ran['predictor_note'] or 'no reason given'})"]))

    def med(path: str, key: str) -> float:
        # a one-token goal has no decode rate (0): its pair is left out on both sides, as paired_ratio leaves it
        # out (filtered side by side, the two medians could be over different pairs, and their ratio compare them)
        values = [r[path][key] for r in rows if key != "tps" or (r["action"]["tps"] > 0 and r["direct"]["tps"] > 0)]
        return statistics.median(values) if values else 0.0

    result = {
        "zoo": str(zoo), "note": note, "prompts": len(texts), "runs": runs, "max_new_tokens": max_new_tokens,
        "threads": threads, "policy": ran["policy"], "policy_asked": policy, "feedback_period": feedback_period,
        "action_tokens_per_second_median": med("action", "tps"),
        "direct_tokens_per_second_median": med("direct", "tps"),
        "action_end_to_end_tokens_per_second_median": med("action", "e2e"),
        "direct_end_to_end_tokens_per_second_median": med("direct", "e2e"),
        "outputs_identical": all(r["action"]["text"] == r["direct"]["text"] for r in rows),
        "storage": ran["storage"],
    }
    # a goal of one token has no steady state (decode tokens/s 0 on both paths): no ratio (null), not a crash
    result["per_pair_steady_state_ratio_median"] = paired_ratio([r["action"]["tps"] for r in rows],
                                                                [r["direct"]["tps"] for r in rows])
    result["ratio_steady_state"] = ratio(result["action_tokens_per_second_median"],
                                          result["direct_tokens_per_second_median"])
    result["ratio_end_to_end"] = ratio(result["action_end_to_end_tokens_per_second_median"],
                                        result["direct_end_to_end_tokens_per_second_median"])
    result["rows"] = [{"run": r["run"], "prompt": r["prompt"],
                       **{f"{p}_{k}": r[p][k] for p in ("action", "direct") for k in ("tps", "e2e", "tokens")}}
                      for r in rows]
    return result


def storage_record(medium: str, before, after, stats: list) -> dict:
    """The medium the node read its drafts through and its loads between two cache snapshots: how many, their mean
    time (pooled over the loads: the node's storage keeps no per-draft record) and that over one speculative
    iteration of the direct runs (``stats``), by storage.load_to_iteration. The iteration is the mean of the
    iterations as they ran (IterationStats.iteration_seconds: draft + verify, at whatever number of tokens each
    proposed), where the policy bench prices a full one from its cost model (gamma draft tokens + a gamma verify)
    and the engine bench from its loop's mean forwards: the three agree where every iteration proposes gamma."""
    from ..runtime.storage import MEDIA, load_to_iteration

    loads = after.loads - before.loads
    mean = (after.load_seconds - before.load_seconds) / loads if loads else 0.0
    iterations = [it for s in stats for it in s.speculative_iterations]
    iteration = sum(it.iteration_seconds for it in iterations) / len(iterations) if iterations else 0.0
    return {"medium": medium, "emulated": MEDIA[medium].emulated, "loads": loads, "mean_load_seconds": mean,
            "iteration_seconds": iteration,
            "load_to_iteration": load_to_iteration({"pooled": mean}, iteration) if loads else None}


def _pairs(zoo: Path, texts: list[str], runs: int, max_new_tokens: int, threads: int, feedback_period: float,
           policy: str, predictor: str, storage: str, progress) -> tuple[list[dict], dict]:
    """The interleaved (action, direct) pairs, with the node and the client process up for their duration, the
    policy the node ran (with why, where it is not the one asked for) and its draft loads (:func:`storage_record`)."""
    import rclpy
    from rclpy.context import Context
    from rclpy.executors import MultiThreadedExecutor
    from rclpy.parameter import Parameter

    from ..ros.node import EXECUTOR_THREADS, MemSpecNode
    from ..runtime.chat import prompt_ids
    from ..runtime.speculative import SamplingConfig

    context = Context()
    rclpy.init(context=context)
    overrides = {"drafts.registry_file": str(zoo / "registry.yaml"), "model.threads": threads,
                 "memspec.reset_cache_per_generation": True, "memspec.policy": policy,
                 # both paths run each prompt in turn: the second would reuse the first's KV (runtime/prompt_cache)
                 "memspec.prompt_cache": False,
                 "action.feedback_period": feedback_period, "generation.max_prompt_tokens": 4000,
                 "cache.storage": storage}
    if predictor:
        overrides["predictor.path"] = predictor
    node = MemSpecNode("memspec_bench", context=context,
                       parameter_overrides=[Parameter(k, value=v) for k, v in overrides.items()])
    executor = MultiThreadedExecutor(num_threads=EXECUTOR_THREADS, context=context)  # as memspec_node's main()
    executor.add_node(node)
    spinner = threading.Thread(target=executor.spin, daemon=True)
    spinner.start()
    client = None
    rows = []
    try:
        if node.trigger_configure().name != "SUCCESS" or node.trigger_activate().name != "SUCCESS":
            raise RuntimeError(f"the node did not configure/activate: {node.configure_error}")
        controller = node.loaded.controller
        ran = {"policy": controller.config.policy, "predictor_note": node.loaded.predictor_note}
        # the action client is its own process, as a robot's client is: its feedback handling and
        # executor are not charged to the server's process
        client = subprocess.Popen([sys.executable, "-m", "memspec_ros.bench.action_bench", "/memspec_bench/generate"],
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1)
        first = client.stdout.readline()
        if not first or json.loads(first).get("ready") is not True:
            raise RuntimeError("the bench client did not find the action server")

        def via_action(prompt: str) -> dict:
            client.stdin.write(json.dumps({"prompt": prompt, "max_new_tokens": max_new_tokens}) + "\n")
            client.stdin.flush()
            line = client.stdout.readline()
            if not line:
                raise RuntimeError("the bench client process ended")
            got = json.loads(line)
            if "error" in got:
                raise RuntimeError(f"{got['error']}: {node.last_rejection}")
            return {"tps": got["tps"], "e2e": got["tokens"] / got["wall"], "tokens": got["tokens"], "text": got["text"]}

        system_prompt = node.get_parameter("generation.system_prompt").value

        def direct(prompt: str) -> dict:
            t0 = time.perf_counter()
            # the token ids the goal callback makes of a prompt-only goal (chat template and system prompt
            # where the tokenizer has one), so both sides decode the same request to the same end of turn
            ids = prompt_ids(node.loaded.tokenizer, prompt, system_prompt=system_prompt)
            out = controller.generate(ids, max_new_tokens, SamplingConfig())
            wall = time.perf_counter() - t0
            decoded.append(out.stats)
            return {"tps": out.stats.tokens_per_second, "e2e": out.stats.completion_tokens / wall,
                    "tokens": out.stats.completion_tokens, "text": out.text.replace("\x00", "")}

        decoded: list = []  # the direct runs' statistics: one speculative iteration's time
        via_action(texts[0])  # warm-up (first-touch allocations, DDS discovery of the result service)
        direct(texts[0])
        controller.cache.drain()  # a prefetch the warm-up started lands before the count begins
        before = controller.cache.snapshot()  # the loads of the timed pairs only
        for run in range(runs):
            for i, prompt in enumerate(texts):
                order = (via_action, direct) if (run + i) % 2 == 0 else (direct, via_action)
                got = {fn.__name__: fn(prompt) for fn in order}
                rows.append({"run": run, "prompt": i, "action": got["via_action"], "direct": got["direct"]})
                if progress is not None:
                    progress.update(1)
        controller.cache.drain()  # the last pair's prefetch counted with the pairs
        ran["storage"] = storage_record(storage, before, controller.cache.snapshot(), decoded[1:])
    finally:
        if client is not None:
            client.stdin.close()
            try:
                client.wait(timeout=10)
            except subprocess.TimeoutExpired:
                client.kill()
        executor.shutdown(timeout_sec=5.0)
        spinner.join(5.0)  # out of rcl before the node it spins is destroyed
        node.destroy_node()
        rclpy.try_shutdown(context=context)
    return rows, ran


def client_main(action_name: str) -> int:
    """The bench's action client process: one JSON request per stdin line, one JSON answer per line."""
    import rclpy
    from action_msgs.msg import GoalStatus
    from rclpy.action import ActionClient
    from rclpy.executors import SingleThreadedExecutor

    from memspec_interfaces.action import Generate

    rclpy.init()
    node = rclpy.create_node("memspec_bench_client")
    executor = SingleThreadedExecutor()
    executor.add_node(node)
    client = ActionClient(node, Generate, action_name)

    def spin_until(future) -> None:
        while not future.done():
            executor.spin_once(timeout_sec=1.0)

    ready = client.wait_for_server(timeout_sec=30.0)
    print(json.dumps({"ready": ready}), flush=True)
    for line in sys.stdin:
        request = json.loads(line)
        t0 = time.perf_counter()
        goal_future = client.send_goal_async(
            Generate.Goal(prompt=request["prompt"], max_new_tokens=request["max_new_tokens"], temperature=0.0),
            feedback_callback=lambda _msg: None)
        spin_until(goal_future)
        handle = goal_future.result()
        if not handle.accepted:
            print(json.dumps({"error": "goal rejected"}), flush=True)
            continue
        result_future = handle.get_result_async()
        spin_until(result_future)
        wall = time.perf_counter() - t0
        response = result_future.result()
        if response.status != GoalStatus.STATUS_SUCCEEDED:
            print(json.dumps({"error": f"goal ended with status {response.status}"}), flush=True)
            continue
        r = response.result
        print(json.dumps({"tps": r.tokens_per_second, "tokens": r.completion_tokens, "text": r.text, "wall": wall}),
              flush=True)
    node.destroy_node()
    rclpy.try_shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(client_main(sys.argv[1]))
