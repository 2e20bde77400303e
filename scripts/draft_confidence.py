"""Is a draft's own probability a usable chance of acceptance? The measurement behind the confidence stop
(runtime/gamma_choice.py: row_pays, draft_pays).

The int4 target answers held-out requests greedily (PER of each domain's workload, from OFFSET); then, at every
answer position, the domain's own draft (int4) proposes 4 tokens autoregressively from the prompt and the answer so
far, and each proposal's softmax probability and whether it is the target's token are recorded. Printed: first
proposals binned by probability against how often they matched (calibration), and the answers replayed under four
rules at this machine's costs (the target's 1..5-token forwards timed here, the draft's per-token cost as given):
a fixed gamma, the running-acceptance gamma alone (GammaChooser), and that gamma with the stop. Tokens per
millisecond, relative to the target alone, per domain and GMEAN.

    .venv/bin/python scripts/draft_confidence.py 6 10 0.2     # per domain, offset, draft ms per token in the loop
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import torch

from memspec_ros.runtime.chat import end_token_ids, prompt_ids
from memspec_ros.runtime.draft_forward import lean_forward_for
from memspec_ros.runtime.gamma_choice import ForwardCosts, GammaChooser, draft_pays, row_pays, target_costs
from memspec_ros.runtime.loader import load_models
from memspec_ros.runtime.models import ModelSpec, load_model
from memspec_ros.runtime.speculative import KVState, forward_once, generate

DOMAINS = ("code", "math", "law", "medical", "general")
GAMMA = 4
BINS = ((0.0, 0.2), (0.2, 0.4), (0.4, 0.6), (0.6, 0.8), (0.8, 0.9), (0.9, 1.01))


def proposals(target, draft, prompt: list[int], eos: list[int]) -> list[list[tuple[float, bool]]]:
    """Per answer position: the draft's GAMMA proposals from there as (probability, matched the answer)."""
    answer = generate(target, prompt, None, max_new_tokens=128, eos_token_ids=eos).generated_ids
    lean, kv, out = lean_forward_for(draft), KVState(), []
    context = prompt + answer
    with torch.inference_mode():
        for j in range(len(answer)):
            start = len(prompt) + j
            feed, row = context[kv.length : start], []
            for i in range(min(GAMMA, len(answer) - j)):
                probs = torch.softmax(forward_once(draft, feed, kv, 1, "cpu", lean)[-1].float(), -1)
                token = int(probs.argmax())
                row.append((float(probs[token]), token == answer[j + i]))
                feed = [token]
            kv.crop_to(start)
            out.append(row)
    return out


def replay(walks: list[list[list[tuple[float, bool]]]], costs: ForwardCosts, rule) -> float:
    """Tokens per ms over the walks (each iteration starts where the last one's committed tokens end)."""
    tokens = ms = 0.0
    for walk in walks:
        chooser, j = GammaChooser(GAMMA), 0
        while j < len(walk):
            proposed, forwards = rule(walk[j], chooser, costs)
            accepted = next((i for i, (_, ok) in enumerate(walk[j][:proposed]) if not ok), proposed)
            chooser.observe("d", proposed, accepted)
            tokens += accepted + 1
            ms += forwards * costs.draft_ms + costs.verify_ms[proposed]
            j += accepted + 1
    return tokens / ms


def fixed(gamma: int):
    return lambda row, chooser, costs: (min(gamma, len(row)),) * 2


def chosen(stop: bool):
    def rule(row, chooser, costs):
        gamma = min(chooser.choose(costs, "d"), len(row))
        if not stop:
            return gamma, gamma
        confidence, proposed, forwards = 1.0, 0, 0
        for k in range(1, gamma + 1):
            if k > 1 and not draft_pays(costs, k, confidence):
                break
            forwards += 1
            confidence *= row[k - 1][0]
            if not row_pays(costs, k, confidence):
                break
            proposed = k
        return proposed, forwards
    return rule


def main(per: int, offset: int, draft_ms: float) -> None:
    torch.set_num_threads(1)
    models = load_models(Path("models/registry.yaml"), quantization="int4", validate=False)
    target, tokenizer = models.target.model, models.tokenizer
    eos = end_token_ids(tokenizer, target)
    costs = ForwardCosts(verify_ms=target_costs(target, GAMMA), draft_ms=draft_ms)
    print("target forward ms, 1..5 tokens:", " ".join(f"{v:.2f}" for v in costs.verify_ms))
    walks = {}
    for domain in DOMAINS:
        draft = load_model(ModelSpec(models.registry.get(domain).path, quantization="int4")).model
        rows = [json.loads(line) for line in Path(f"models/workloads/{domain}.jsonl").read_text().splitlines()]
        walks[domain] = [proposals(target, draft, prompt_ids(tokenizer, r["prompt"]), eos)
                         for r in rows[offset : offset + per]]
    firsts = [row[0] for ws in walks.values() for w in ws for row in w if row]
    print(f"first proposals: {len(firsts)}")
    for lo, hi in BINS:
        hits = [ok for p, ok in firsts if lo <= p < hi]
        rate = sum(hits) / max(1, len(hits))
        print(f"  probability {lo:.1f}-{min(hi, 1.0):.1f}: {len(hits):5d} proposals, matched {rate:.3f}")
    rules = {**{f"gamma {g}": fixed(g) for g in (1, 2, 4)},
             "chosen gamma": chosen(False), "chosen + stop": chosen(True)}
    for name, rule in rules.items():
        ratios = {d: replay(ws, costs, rule) * costs.verify_ms[0] for d, ws in walks.items()}
        gmean = math.exp(sum(math.log(r) for r in ratios.values()) / len(ratios))
        print(f"{name:>14}: " + " ".join(f"{d} {r:.3f}" for d, r in ratios.items()) + f" | GMEAN {gmean:.3f}x alone")


if __name__ == "__main__":
    main(*(int(a) for a in sys.argv[1:3]), float(sys.argv[3]) if len(sys.argv) > 3 else 0.2)
