"""Heads per prompt window W over scripts/predictor_window_features.py's features; output as in
docs/results/predictor-window.txt ("alone 85.0/84.1": held-out top-1 over all contexts / first points)."""
import json

import torch
from safetensors.torch import load_file

from memspec_ros.runtime.predictor import HeadConfig
from memspec_ros.zoo.predictor_training import TrainConfig, evaluate, train_head

torch.set_num_threads(1)
# safetensors and JSON: nothing is unpickled
with open("artifacts/predictor-window-feats.json") as f:
    d = json.load(f)
for key, tensor in load_file("artifacts/predictor-window-feats.safetensors").items():
    variant, window = key.split("/")
    d.setdefault(variant, {})[int(window)] = tensor
y = torch.tensor(d["labels"])
held = torch.tensor(d["heldout"])
first = torch.zeros(len(y), dtype=torch.bool)  # a prompt's first context: the first scheduling point
prev = None
for i, p in enumerate(d["prompt"]):
    first[i] = p != prev
    prev = p
variants = ("alone", "turn", "system")
for W in d["alone"]:
    for aug in (False, True):  # train on single requests only, or on all three forms
        tr = [d["alone"][W][~held]]
        ty = [y[~held]]
        if aug:
            for v in ("turn", "system"):
                tr.append(d[v][W][~held])
                ty.append(y[~held])
        X, Y = torch.cat(tr), torch.cat(ty)
        cfg = HeadConfig(encoder="target-hidden", drafts=d["names"], in_dim=X.shape[1])
        head = train_head(X, Y, cfg, TrainConfig(), progress=False)
        res = []
        for v in variants:
            a = evaluate(head, d[v][W][held], y[held])["top1"]
            f = evaluate(head, d[v][W][held & first], y[held & first])["top1"]
            res.append(f"{v} {100*a:5.1f}/{100*f:5.1f}")
        print(f"W={W:3d} aug={int(aug)}  " + "  ".join(res), flush=True)
