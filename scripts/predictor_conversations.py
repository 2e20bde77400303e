"""How the bundled predictor ranks one code request alone, after an earlier turn of another domain, and after a
robot's system prompt (README, "Known limit of the bundled predictor: conversations").

The request is the first of the zoo's held-out code workload; the earlier turns are training requests of law,
medical and math with the target's own answers (the datastore's). Each conversation is sent through the chat
template as the node sends it, the target runs over it once (the prefill the target-hidden encoder records), and
the engine ranks at the first scheduling point, where only the prompt half of the features is seen.

    python scripts/predictor_conversations.py
"""

from __future__ import annotations

import json

import torch

from memspec_ros.runtime.chat import prompt_ids
from memspec_ros.runtime.datastore import read_answers
from memspec_ros.runtime.models import ModelSpec, load_model, load_tokenizer
from memspec_ros.runtime.predictor import PredictionContext, PredictionEngine
from memspec_ros.runtime.registry import DraftRegistry

ROBOT_SYSTEM = ("You are the voice of a warehouse robot. Answer briefly and safely; never move the arm unless asked."
                " Report battery level when asked. Speak plainly.")


def main() -> None:
    torch.set_num_threads(1)
    registry = DraftRegistry.from_yaml("models/registry.yaml", validate=False)
    tok = load_tokenizer(registry.target_path)
    target = load_model(ModelSpec(str(registry.target_path))).model
    engine = PredictionEngine.load("models/predictor/target-hidden", target=target, tokenizer=tok)
    rows = [json.loads(line) for line in open("models/workloads/train_requests.jsonl")]
    stored, _ = read_answers("models/datastore.safetensors")

    def earlier_turn(domain: str) -> tuple[str, str]:
        for row, answer in zip(rows, stored, strict=False):
            if row["domain"] == domain and len(answer) > 60:  # a withheld answer is empty
                return row["messages"][0]["content"], tok.decode(answer.tolist(), skip_special_tokens=True)
        raise SystemExit(f"no {domain} training request with an answer in the datastore")

    def rank(messages: list[tuple[str, str]], system: str = "") -> tuple[int, list[tuple[str, float]]]:
        ids = prompt_ids(tok, "", messages, system_prompt=system)
        engine.begin(ids)
        with torch.inference_mode():
            target(input_ids=torch.tensor([ids]), use_cache=False)
        drafts = engine.config.drafts
        ranking = engine.rank(PredictionContext(ids, [], 0, drafts, {d: d for d in drafts}, 1))
        return len(ids), [(name, round(score, 3)) for name, score in ranking[:3]]

    code = json.loads(open("models/workloads/code.jsonl").readline())["prompt"]
    print("code request alone:", rank([("user", code)]))
    for domain in ("law", "medical", "math"):
        question, answer = earlier_turn(domain)
        print(f"after a {domain} turn:", rank([("user", question), ("assistant", answer), ("user", code)]))
    print("after a robot system prompt:", rank([("user", code)], system=ROBOT_SYSTEM))
    engine.close()


if __name__ == "__main__":
    main()
