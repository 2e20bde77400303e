"""A robot's multi-turn conversations with and without the prompt cache (runtime/prompt_cache.py), side by side.

Each conversation is a system prompt and ``--turns`` user requests of one held-out workload, sent as a chat: goal
k carries the whole conversation so far (every earlier request and the answer the node gave) and the next
request, as a Generate goal with ``messages`` does. The same conversations run on one controller with
``prompt_cache`` on and off, alternating which goes first, greedy, so every answer must be the same text; the
bundled zoo, MemSpec, the draft cache kept between goals (a robot's setting, not the paper's per-prompt reset).
Reported per turn: the time before the first generated token (setup + prefill), the prompt tokens the prefill
encoded, the tokens and time of the first draft's catch-up at its first proposal (decoding, after the first
token: the drafts' KV caches are kept too), end-to-end tokens per second; medians and the pooled ratio of on
against off.

    .venv/bin/python scripts/prompt_cache_bench.py --conversations 8 --json docs/results/prompt-cache.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from memspec_ros.runtime.chat import prompt_ids
from memspec_ros.runtime.controller import RuntimeConfig, load_runtime

ROOT = Path(__file__).resolve().parents[1]
SYSTEM = "You are the voice of a service robot. Answer helpfully and briefly."


def requests(workloads: Path, per_conversation: int, conversations: int) -> list[list[str]]:
    """``conversations`` lists of ``per_conversation`` requests, each list from one workload, workloads in turn."""
    names = ["general", "code", "math", "law", "medical"]
    rows = {n: [json.loads(line)["prompt"] for line in (workloads / f"{n}.jsonl").read_text().splitlines()]
            for n in names}
    out = []
    for c in range(conversations):
        pool = rows[names[c % len(names)]]
        start = (c // len(names)) * per_conversation
        out.append(pool[start : start + per_conversation])
    return out


def converse(controller, tokenizer, turns: list[str], new_tokens: int) -> list[dict]:
    messages: list[tuple[str, str]] = [("system", SYSTEM)]
    out = []
    for text in turns:
        messages.append(("user", text))
        ids = prompt_ids(tokenizer, "", messages)
        t0 = time.perf_counter()
        result = controller.generate(ids, max_new_tokens=new_tokens)
        wall = time.perf_counter() - t0
        s = result.stats
        first = next((it for it in s.iterations if it.catchup_tokens), None)  # the first draft's first proposal
        out.append({"prompt_tokens": len(ids), "reused": s.reused_prompt_tokens,
                    "draft_catchup_tokens": first.catchup_tokens if first else 0,
                    "draft_catchup_seconds": first.catchup_seconds if first else 0.0,
                    "first_token_seconds": s.setup_seconds + s.prefill_seconds, "prefill_seconds": s.prefill_seconds,
                    "wall_seconds": wall, "tokens": len(result.token_ids), "text": result.text})
        messages.append(("assistant", result.text))
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--conversations", type=int, default=8)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--quantization", default="int4")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--json", type=Path, default=None)
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    controller = load_runtime(RuntimeConfig(policy="memspec", adaptive_gamma=True, context_lookup=True),
                              str(ROOT / "models/registry.yaml"), predictor_path=str(ROOT / "models/predictor"),
                              quantization=a.quantization, dtype="fp32")
    print(f"prompt cache refused: {controller.prompt_cache_refused or 'no'}", flush=True)
    convs = requests(ROOT / "models/workloads", a.turns, a.conversations)
    controller.generate(prompt_ids(controller.tokenizer, "Hello!", [], system_prompt=SYSTEM), max_new_tokens=8)
    runs: dict[str, list[list[dict]]] = {"on": [], "off": []}
    for i, turns in enumerate(convs):
        for setting in (("on", "off") if i % 2 == 0 else ("off", "on")):
            controller.reconfigure(prompt_cache=setting == "on")
            runs[setting].append(converse(controller, controller.tokenizer, turns, a.max_new_tokens))
        same = [t["text"] for t in runs["on"][-1]] == [t["text"] for t in runs["off"][-1]]
        print(f"conversation {i + 1}/{len(convs)}: identical {same}", flush=True)
    per_turn = []
    for k in range(a.turns):
        on = [c[k] for c in runs["on"]]
        off = [c[k] for c in runs["off"]]
        row = {"turn": k + 1,
               "prompt_tokens_median": statistics.median(t["prompt_tokens"] for t in on),
               "reused_median": statistics.median(t["reused"] for t in on),
               "first_token_ms_median_on": 1000 * statistics.median(t["first_token_seconds"] for t in on),
               "first_token_ms_median_off": 1000 * statistics.median(t["first_token_seconds"] for t in off),
               "first_token_ratio_pooled": sum(t["first_token_seconds"] for t in off)
               / sum(t["first_token_seconds"] for t in on),
               "draft_catchup_tokens_median_on": statistics.median(t["draft_catchup_tokens"] for t in on),
               "draft_catchup_tokens_median_off": statistics.median(t["draft_catchup_tokens"] for t in off),
               "draft_catchup_ms_median_on": 1000 * statistics.median(t["draft_catchup_seconds"] for t in on),
               "draft_catchup_ms_median_off": 1000 * statistics.median(t["draft_catchup_seconds"] for t in off),
               "end_to_end_ratio_pooled": (sum(t["tokens"] for t in on) / sum(t["wall_seconds"] for t in on))
               / (sum(t["tokens"] for t in off) / sum(t["wall_seconds"] for t in off))}
        per_turn.append(row)
        print(f"turn {k + 1}: prompt {row['prompt_tokens_median']:.0f} tokens (reused {row['reused_median']:.0f}),"
              f" first token {row['first_token_ms_median_off']:.1f} -> {row['first_token_ms_median_on']:.1f} ms"
              f" median, {row['first_token_ratio_pooled']:.2f}x pooled; the first draft's catch-up"
              f" {row['draft_catchup_tokens_median_off']:.0f} -> {row['draft_catchup_tokens_median_on']:.0f} tokens,"
              f" {row['draft_catchup_ms_median_off']:.1f} -> {row['draft_catchup_ms_median_on']:.1f} ms; end to end"
              f" {row['end_to_end_ratio_pooled']:.3f}x", flush=True)
    identical = all([t["text"] for t in x] == [t["text"] for t in y] for x, y in zip(runs["on"], runs["off"],
                                                                                       strict=True))
    print(f"outputs identical: {identical}")
    if a.json:
        a.json.write_text(json.dumps({"config": vars(a) | {"json": str(a.json)}, "system_prompt": SYSTEM,
                                      "refused": controller.prompt_cache_refused, "identical": identical,
                                      "per_turn": per_turn}, indent=1) + "\n")
    controller.close()


if __name__ == "__main__":
    main()
