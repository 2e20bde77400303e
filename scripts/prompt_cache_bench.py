"""A robot's multi-turn conversations with and without the prompt cache (runtime/prompt_cache.py), side by side.

Each conversation is a system prompt and ``--turns`` user requests of one held-out workload, sent as a chat: goal
k carries the whole conversation so far (every earlier request and the answer the node gave) and the next
request, as a Generate goal with ``messages`` does. The same conversations run on one controller with
``prompt_cache`` on and off (``--against single``: on, but keeping only the last goal's caches), alternating which
goes first, greedy, so every answer must be the same text. ``--interleave G`` runs G conversations turn by turn in
round robin, as several people or a behaviour tree's skills alternating on one node; the
bundled zoo, MemSpec, the draft cache kept between goals (a robot's setting, not the paper's per-prompt reset).
Reported per turn: the time before the first generated token (setup + prefill), the prompt tokens the prefill
encoded, the tokens and time of the first draft's catch-up at its first proposal (decoding, after the first
token: the drafts' KV caches are kept too), end-to-end tokens per second; medians and the pooled ratio of on
against off.

    .venv/bin/python scripts/prompt_cache_bench.py --conversations 10 --json docs/results/prompt-cache.json
    .venv/bin/python scripts/prompt_cache_bench.py --conversations 9 --interleave 3 --against single \
        --json docs/results/prompt-cache-interleaved.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from memspec_ros.argtypes import output_file, positive_int
from memspec_ros.runtime.chat import prompt_ids
from memspec_ros.runtime.controller import RuntimeConfig, load_runtime
from memspec_ros.runtime.models import QUANTIZATIONS

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


def goal(controller, messages: list[tuple[str, str]], text: str, new_tokens: int) -> dict:
    """One turn of a conversation: ``text`` sent after ``messages`` (both extended with the turn and its answer)."""
    messages.append(("user", text))
    ids = prompt_ids(controller.tokenizer, "", messages)
    t0 = time.perf_counter()
    result = controller.generate(ids, max_new_tokens=new_tokens)
    wall = time.perf_counter() - t0
    s = result.stats
    first = next((it for it in s.iterations if it.catchup_tokens), None)  # the first draft's first proposal
    messages.append(("assistant", result.text))
    return {"prompt_tokens": len(ids), "reused": s.reused_prompt_tokens,
            "draft_catchup_tokens": first.catchup_tokens if first else 0,
            "draft_catchup_seconds": first.catchup_seconds if first else 0.0,
            "first_token_seconds": s.time_to_first_token, "prefill_seconds": s.prefill_seconds,
            "wall_seconds": wall, "tokens": len(result.token_ids), "text": result.text}


def converse(controller, group: list[list[str]], new_tokens: int) -> list[list[dict]]:
    """The conversations of ``group`` turn by turn in round robin (one conversation: its turns in order), as
    several people, or a behaviour tree's skills, alternate on one node. Per conversation, its turns' records."""
    histories: list[list[tuple[str, str]]] = [[("system", SYSTEM)] for _ in group]
    out: list[list[dict]] = [[] for _ in group]
    for k in range(max(len(turns) for turns in group)):
        for c, turns in enumerate(group):
            if k < len(turns):
                out[c].append(goal(controller, histories[c], turns[k], new_tokens))
    return out


SETTINGS = {"on": {"prompt_cache": True}, "off": {"prompt_cache": False},
            "single": {"prompt_cache": True, "prompt_cache_bytes": 0}}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--conversations", type=positive_int, default=8)
    p.add_argument("--turns", type=positive_int, default=4)
    p.add_argument("--interleave", type=positive_int, default=1,
                   help="conversations run turn by turn in round robin, this many at a time (1: one after another)")
    p.add_argument("--against", choices=("off", "single"), default="off",
                   help="the baseline: no prompt cache, or one that keeps only the last goal's (prompt_cache_bytes 0)")
    p.add_argument("--max-new-tokens", type=positive_int, default=64)
    p.add_argument("--quantization", choices=QUANTIZATIONS, default="int4")
    p.add_argument("--threads", type=positive_int, default=1)
    p.add_argument("--json", type=output_file, default=None)
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    controller = load_runtime(RuntimeConfig(policy="memspec", adaptive_gamma=True, context_lookup=True),
                              str(ROOT / "models/registry.yaml"), predictor_path=str(ROOT / "models/predictor"),
                              quantization=a.quantization, dtype="fp32")
    print(f"prompt cache refused: {controller.prompt_cache_refused or 'no'}", flush=True)
    convs = requests(ROOT / "models/workloads", a.turns, a.conversations)
    groups = [convs[i : i + a.interleave] for i in range(0, len(convs), a.interleave)]
    controller.generate(prompt_ids(controller.tokenizer, "Hello!", [], system_prompt=SYSTEM), max_new_tokens=8)
    base = a.against
    runs: dict[str, list[list[dict]]] = {"on": [], base: []}
    default_budget = controller.config.prompt_cache_bytes
    for i, group in enumerate(groups):
        for setting in (("on", base) if i % 2 == 0 else (base, "on")):
            controller.reconfigure(**({"prompt_cache_bytes": default_budget} | SETTINGS[setting]))
            controller.prompt_cache.clear()  # each setting starts from nothing
            runs[setting].extend(converse(controller, group, a.max_new_tokens))
        same = all([t["text"] for t in x] == [t["text"] for t in y]
                   for x, y in zip(runs["on"][-len(group):], runs[base][-len(group):], strict=True))
        print(f"group {i + 1}/{len(groups)} ({len(group)} conversations): identical {same}", flush=True)
    per_turn = []
    for k in range(a.turns):
        on = [c[k] for c in runs["on"]]
        off = [c[k] for c in runs[base]]
        row = {"turn": k + 1,
               "prompt_tokens_median": statistics.median(t["prompt_tokens"] for t in on),
               "reused_median": statistics.median(t["reused"] for t in on),
               f"reused_median_{base}": statistics.median(t["reused"] for t in off),
               "first_token_ms_median_on": 1000 * statistics.median(t["first_token_seconds"] for t in on),
               f"first_token_ms_median_{base}": 1000 * statistics.median(t["first_token_seconds"] for t in off),
               "first_token_ratio_pooled": sum(t["first_token_seconds"] for t in off)
               / sum(t["first_token_seconds"] for t in on),
               "draft_catchup_tokens_median_on": statistics.median(t["draft_catchup_tokens"] for t in on),
               f"draft_catchup_tokens_median_{base}": statistics.median(t["draft_catchup_tokens"] for t in off),
               "draft_catchup_ms_median_on": 1000 * statistics.median(t["draft_catchup_seconds"] for t in on),
               f"draft_catchup_ms_median_{base}": 1000 * statistics.median(t["draft_catchup_seconds"] for t in off),
               "end_to_end_ratio_pooled": (sum(t["tokens"] for t in on) / sum(t["wall_seconds"] for t in on))
               / (sum(t["tokens"] for t in off) / sum(t["wall_seconds"] for t in off))}
        per_turn.append(row)
        print(f"turn {k + 1}: prompt {row['prompt_tokens_median']:.0f} tokens"
              f" (reused {row[f'reused_median_{base}']:.0f} -> {row['reused_median']:.0f}),"
              f" first token {row[f'first_token_ms_median_{base}']:.1f} ->"
              f" {row['first_token_ms_median_on']:.1f} ms median, {row['first_token_ratio_pooled']:.2f}x pooled;"
              f" the first draft's catch-up {row[f'draft_catchup_tokens_median_{base}']:.0f} ->"
              f" {row['draft_catchup_tokens_median_on']:.0f} tokens, {row[f'draft_catchup_ms_median_{base}']:.1f} ->"
              f" {row['draft_catchup_ms_median_on']:.1f} ms; end to end {row['end_to_end_ratio_pooled']:.3f}x",
              flush=True)
    identical = all([t["text"] for t in x] == [t["text"] for t in y] for x, y in zip(runs["on"], runs[base],
                                                                                       strict=True))
    print(f"outputs identical: {identical}")
    if a.json:
        Path(a.json).parent.mkdir(parents=True, exist_ok=True)
        Path(a.json).write_text(json.dumps({"config": vars(a) | {"json": str(a.json)}, "system_prompt": SYSTEM,
                                      "prompt_cache_bytes": default_budget, "baseline": SETTINGS[base],
                                      "refused": controller.prompt_cache_refused, "identical": identical,
                                      "per_turn": per_turn}, indent=1) + "\n")
    controller.close()


if __name__ == "__main__":
    main()
