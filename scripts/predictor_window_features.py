"""Which prompt positions should the predictor's prompt half pool, and should it train on conversations?
(session 35: the measurement behind ``memspec-train-predictor --prompt-tokens 16 --conversation-training``)

The bundled predictor's 900 training prompts (the datastore's answers, the same seeded subset and held-out
split as ``memspec-train-predictor --answers models/datastore.safetensors --max-prompts 900``) are traced once;
each prompt's target-hidden features are pooled over the prompt's last W positions, W in WS (0: the whole
prompt), three ways: the request alone, after an earlier turn of another domain (another training request and
the target's answer to it), and under one of three robot system prompts. Labels: the request alone's (its
stored greedy answer). Writes artifacts/predictor-window-feats.safetensors and .json (about 20 min on 2 CPU
threads; no pickle: the project loads nothing by unpickling); then

    python scripts/predictor_window_heads.py

trains a head per W, on single requests only or on all three forms, and prints held-out top-1 (all contexts /
the first scheduling point, where only the prompt half is seen): docs/results/predictor-window.txt."""
import json
import random
import sys
import time

import torch
from safetensors.torch import save_file

from memspec_ros.runtime.chat import prompt_ids
from memspec_ros.runtime.datastore import read_answers
from memspec_ros.runtime.models import ModelSpec, load_model, load_tokenizer
from memspec_ros.runtime.predictor import pooled_hidden_features
from memspec_ros.runtime.registry import DraftRegistry
from memspec_ros.zoo.predictor_training import split_prompts, traces_from_answers
from memspec_ros.zoo.teacher import Answer

torch.set_num_threads(2)
WS = [0, 8, 16, 32, 64]
SYSTEMS = [
    "You are the voice of a warehouse robot. Answer briefly and safely; never move the arm unless asked."
    " Report battery level when asked. Speak plainly.",
    "You are a helpful assistant on a service robot in a hospital lobby. Be concise.",
    "You are RoboHelper, an assistant running on an autonomous mobile robot. Keep answers short and accurate.",
]
reg = DraftRegistry.from_yaml("models/registry.yaml", validate=False)
tok = load_tokenizer(reg.target_path)
target = load_model(ModelSpec(str(reg.target_path))).model
drafts = {e.name: load_model(ModelSpec(e.path)).model for e in reg.entries()}
rows = [json.loads(line) for line in open("models/workloads/train_requests.jsonl")]
stored, _ = read_answers("models/datastore.safetensors")
pairs = [(r, t.tolist()) for r, t in zip(rows, stored, strict=False) if len(t)]
keep = sorted(random.Random(0).sample(range(len(pairs)), 900))
pairs = [pairs[i] for i in keep]
answers = [Answer(prompt_ids(tok, "", [(m["role"], m["content"]) for m in r["messages"]]), ids,
                  torch.tensor(ids, dtype=torch.int32)[:, None], torch.zeros((len(ids), 1), dtype=torch.float16),
                  r["domain"]) for r, ids in pairs]
t0 = time.time()
traces = traces_from_answers(drafts, answers, 4, 4, progress=True, horizon=0)
print("traces", time.time() - t0, file=sys.stderr)
# traces_from_answers skips answers < 2 tokens; map back
by_prompt = {}
for a, (r, ids) in zip(answers, pairs, strict=True):
    by_prompt.setdefault(tuple(a.prompt_ids), (r, ids))
names = list(drafts)
prompts = [t.prompt_ids for t in traces]
held = split_prompts(prompts, 0.2, 0)
rng = random.Random(1)
decoder = target.model


out = {"labels": [], "prompt": [], "heldout": [], "domain": [], "plen": [], "req_len": []}
for variant in ("alone", "turn", "system"):
    out[variant] = {W: [] for W in WS}
t0 = time.time()
with torch.inference_mode():
    for i, tr in enumerate(traces):
        r, ids = by_prompt[tuple(tr.prompt_ids)]
        q = r["messages"][0]["content"]
        # an earlier turn of another domain
        while True:
            r2, ids2 = pairs[rng.randrange(len(pairs))]
            if r2["domain"] != r["domain"]:
                break
        a2 = tok.decode(ids2, skip_special_tokens=True)
        conv = {"alone": tr.prompt_ids,
                "turn": prompt_ids(tok, "", [("user", r2["messages"][0]["content"]), ("assistant", a2), ("user", q)]),
                "system": prompt_ids(tok, "", [("user", q)], system_prompt=SYSTEMS[rng.randrange(len(SYSTEMS))])}
        for variant, pids in conv.items():
            fed = torch.tensor([pids + tr.continuation])
            hidden = decoder(input_ids=fed, use_cache=False).last_hidden_state[0].float()
            for ctx in tr.contexts:
                gen = ctx.position if ctx.interval > 0 else 0
                for W in WS:
                    out[variant][W].append(pooled_hidden_features(hidden, len(pids), gen, 32, W))
        for ctx in tr.contexts:
            out["labels"].append(names.index(ctx.label))
            out["prompt"].append(i)
            out["heldout"].append(i in held)
            out["domain"].append(r["domain"])
            out["plen"].append(len(tr.prompt_ids))
        if i % 50 == 0:
            print(i, time.time() - t0, file=sys.stderr, flush=True)
# the features as safetensors ("<variant>/<W>"), the labels and lists as JSON
tensors = {f"{variant}/{W}": torch.stack(v).contiguous() for variant in ("alone", "turn", "system")
           for W, v in out[variant].items()}
save_file(tensors, "artifacts/predictor-window-feats.safetensors")
with open("artifacts/predictor-window-feats.json", "w") as f:
    json.dump({k: out[k] for k in ("labels", "prompt", "heldout", "domain", "plen")} | {"names": names}, f)
print("done", time.time() - t0, file=sys.stderr)
