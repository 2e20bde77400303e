"""How the bundled predictor ranks held-out requests alone, after an earlier turn of another domain, and under a
robot's system prompt (README, "The bundled predictor in conversations").

The requests are the first ``--per-domain`` of each of the zoo's held-out domain workloads (code, math, law,
medical, general); the earlier turns are training requests of another domain with the target's own answers (the
datastore's), drawn seeded. Each conversation is sent through the chat template as the node sends it, the
target runs over it once (the prefill the target-hidden encoder records), and the engine ranks at the first
scheduling point, where only the prompt half of the features is seen. Printed per condition: how often the
first-ranked draft is the one ranked first for the request alone, and how often it is the request's own
domain's draft (which draft is truly best for a request is not known here: that is the training report's
held-out score, "after an earlier turn").

    python scripts/predictor_conversations.py [--predictor models/predictor/target-hidden] [--per-domain 12]
"""

from __future__ import annotations

import argparse
import json
import random

import torch

from memspec_ros.runtime.chat import prompt_ids
from memspec_ros.runtime.datastore import read_answers
from memspec_ros.runtime.models import ModelSpec, load_model, load_tokenizer
from memspec_ros.runtime.predictor import PredictionContext, PredictionEngine
from memspec_ros.runtime.registry import DraftRegistry

DOMAINS = ("code", "math", "law", "medical", "general")
ROBOT_SYSTEM = ("You are the voice of a warehouse robot. Answer briefly and safely; never move the arm unless asked."
                " Report battery level when asked. Speak plainly.")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--predictor", default="models/predictor/target-hidden")
    p.add_argument("--per-domain", type=int, default=12)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    torch.set_num_threads(1)
    registry = DraftRegistry.from_yaml("models/registry.yaml", validate=False)
    tok = load_tokenizer(registry.target_path)
    target = load_model(ModelSpec(str(registry.target_path))).model
    engine = PredictionEngine.load(args.predictor, target=target, tokenizer=tok)
    rows = [json.loads(line) for line in open("models/workloads/train_requests.jsonl")]
    stored, _ = read_answers("models/datastore.safetensors")
    answered = [(row, answer) for row, answer in zip(rows, stored, strict=False) if len(answer) > 60]
    rng = random.Random(args.seed)

    def earlier_turn(not_domain: str) -> list[tuple[str, str]]:
        while True:
            row, answer = answered[rng.randrange(len(answered))]
            if row["domain"] != not_domain:  # a withheld answer is empty: left out above
                return [("user", row["messages"][0]["content"]),
                        ("assistant", tok.decode(answer.tolist(), skip_special_tokens=True))]

    def first(messages: list[tuple[str, str]], system: str = "") -> str:
        ids = prompt_ids(tok, "", messages, system_prompt=system)
        engine.begin(ids)
        with torch.inference_mode():
            target(input_ids=torch.tensor([ids]), use_cache=False)
        drafts = engine.config.drafts
        return engine.rank(PredictionContext(ids, [], 0, drafts, {d: d for d in drafts}, 1))[0][0]

    counts = {c: {"same": 0, "own": 0} for c in ("alone", "after a turn", "system prompt")}
    n = 0
    for domain in DOMAINS:
        with open(f"models/workloads/{domain}.jsonl") as handle:
            requests = [json.loads(line)["prompt"] for line, _ in zip(handle, range(args.per_domain), strict=False)]
        for request in requests:
            alone = first([("user", request)])
            ranked = {"alone": alone, "after a turn": first([*earlier_turn(domain), ("user", request)]),
                      "system prompt": first([("user", request)], system=ROBOT_SYSTEM)}
            for condition, top in ranked.items():
                counts[condition]["same"] += top == alone
                counts[condition]["own"] += top == domain
            n += 1
    print(f"{args.predictor}: {n} held-out requests (W = {engine.config.prompt_tokens}, 0: whole prompt)")
    for condition, c in counts.items():
        print(f"  {condition:<14} first as alone {c['same'] / n:6.1%}   own domain's draft first {c['own'] / n:6.1%}")
    engine.close()


if __name__ == "__main__":
    main()
