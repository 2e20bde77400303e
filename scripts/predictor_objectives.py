"""Is the ranking head the bottleneck? Its training objective and data, scored by the utility of its choices.

MemSpec runs 0.93x Oracle-Dynamic on the bundled zoo. This asks whether a better-trained head would close that:
over every training answer in the zoo's datastore (2,176; the bundled head trained on 720 of them), each
scheduling point of the trace walk (``memspec-train-predictor``'s, label horizon 0) gets every draft's accepted
tokens over the rest of the output, and heads are trained on the same frozen target-hidden features with

- ``hard``: cross-entropy on the best draft (the bundled head's objective);
- ``soft``: cross-entropy on softmax((u_d / u_max - 1) / tau), u_d a draft's accepted tokens over the rest, so
  near-ties share the label;
- ``expected``: maximise the expected utility of the softmax choice, sum_d p_d u_d / u_max;

on 720 training prompts (as bundled) or all of them (1,741), and scored on the held-out prompts' contexts (20%,
the same split as ``memspec-train-predictor``): top-1 against the hard label, and the accepted tokens of the
head's top choice over the rest of the output, against the best draft at each point (``rest_util``) and against
``general`` always (``rest_vs_general``; the per-point oracle's value is printed first).

    .venv/bin/python scripts/predictor_objectives.py --cache artifacts/predictor-traces   # ~35 min the first time
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]


def build(cache: Path, max_answers: int = 0) -> None:
    """Traces and target-hidden features over every datastore answer (a seeded random ``max_answers`` of them when
    set), written to ``cache`` (safetensors + JSON)."""
    from safetensors.torch import save_file

    from memspec_ros.runtime.models import ModelSpec, load_model, load_tokenizer
    from memspec_ros.runtime.oracle import interval_walk
    from memspec_ros.runtime.registry import DraftRegistry
    from memspec_ros.zoo.predictor_training import hidden_features, traces_from_answers
    from memspec_ros.zoo.teacher import datastore_answers

    registry = DraftRegistry.from_yaml(str(ROOT / "models/registry.yaml"), validate=False)
    target = load_model(ModelSpec(str(registry.target_path))).model
    drafts = {e.name: load_model(ModelSpec(e.path)).model for e in registry.entries()}
    names = list(drafts)
    answers = datastore_answers(ROOT / "models/datastore.safetensors", load_tokenizer(registry.target_path))
    if max_answers and max_answers < len(answers):  # the GPU-built zoo's 10,240: about 2.5 CPU-hours for all
        answers = random.Random(0).sample(answers, max_answers)
    traces = traces_from_answers(drafts, answers, 4, 4, horizon=0)
    feats = torch.stack(hidden_features(target, traces, 32))
    rows = [{"trace": i, "label": names.index(c.label),
             "rest": [sum(interval_walk(t.agreement[d], c.position, 4, len(t.continuation))[1]) for d in names]}
            for i, t in enumerate(traces) for c in t.contexts]
    cache.mkdir(parents=True, exist_ok=True)
    save_file({"features": feats.contiguous()}, str(cache / "features.safetensors"))
    (cache / "contexts.json").write_text(json.dumps({"drafts": names, "traces": len(traces), "rows": rows,
                                                      "max_answers": max_answers}))


def train_and_score(feats, names, rows, train: set[int], test: set[int], objective: str, tau: float) -> dict:
    """memspec-train-predictor's head, trainer and settings; only the targets (or, for ``expected``, the loss)
    differ."""
    from memspec_ros.runtime.predictor import HeadConfig, RankingHead, mask_input
    from memspec_ros.zoo.predictor_training import TrainConfig, evaluate, train_head

    trace = torch.tensor([r["trace"] for r in rows])
    label = torch.tensor([r["label"] for r in rows])
    rest = torch.tensor([r["rest"] for r in rows], dtype=torch.float32)
    tr = torch.tensor([t in train for t in trace.tolist()])
    te = torch.tensor([t in test for t in trace.tolist()])
    config = HeadConfig(encoder="target-hidden", drafts=names, in_dim=feats.shape[-1], hidden=128,
                        input="prompt+recent", recent_tokens=32, interval=4)
    cfg = TrainConfig()
    share = rest[tr] / rest[tr].max(-1, keepdim=True).values.clamp(min=1)
    if objective == "expected":  # no target to fit: maximise the softmax choice's expected share, same optimiser
        torch.manual_seed(cfg.seed)
        head = RankingHead(config)
        head.train()
        optim = torch.optim.AdamW(head.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
        x = mask_input(feats[tr], config.input)
        for _ in range(cfg.epochs):
            optim.zero_grad()
            (-(torch.softmax(head(x), -1) * share).sum(-1).mean()).backward()
            optim.step()
        head.eval()
    else:  # cross-entropy on class indices (hard) or on class probabilities (soft)
        targets = label[tr] if objective == "hard" else torch.softmax((share - 1) / tau, -1)
        head = train_head(feats[tr], targets, config, cfg, progress=False)
    with torch.no_grad():
        choice = head(mask_input(feats[te], config.input)).argmax(-1)
    got = rest[te][torch.arange(len(choice)), choice].sum()
    return {"top1": round(evaluate(head, feats[te], label[te])["top1"], 4),
            "rest_util": round(float(got / rest[te].max(-1).values.sum()), 4),
            "rest_vs_general": round(float(got / rest[te][:, names.index("general")].sum()), 4)}


def main() -> None:
    from safetensors.torch import load_file

    from memspec_ros.zoo.predictor_training import split_prompts

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cache", type=Path, default=ROOT / "artifacts/predictor-traces")
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--max-answers", type=int, default=0, help="a seeded random subset of the datastore (0: all)")
    a = p.parse_args()
    torch.set_num_threads(1)
    if not (a.cache / "contexts.json").is_file():
        build(a.cache, a.max_answers)
    feats = load_file(str(a.cache / "features.safetensors"))["features"]
    meta = json.loads((a.cache / "contexts.json").read_text())
    if meta.get("max_answers", 0) != a.max_answers:  # a rerun took the cached subset whatever it asked for
        raise SystemExit(f"{a.cache} holds traces of --max-answers {meta.get('max_answers', 0)}: pass that, or"
                         " another --cache")
    names, rows, n = meta["drafts"], meta["rows"], meta["traces"]
    held = split_prompts([[i] for i in range(n)], 0.2, 0)  # the traces' prompts are distinct: split by index
    train_all = set(range(n)) - held
    train_720 = set(random.Random(0).sample(sorted(train_all), min(720, len(train_all))))
    rest = torch.tensor([r["rest"] for r in rows if r["trace"] in held], dtype=torch.float32)
    g = names.index("general")
    out = {"heldout_prompts": len(held), "heldout_contexts": len(rest),
           "always": {d: round(float(rest[:, i].sum() / rest[:, g].sum()), 4) for i, d in enumerate(names)},
           "oracle_per_context_vs_general": round(float(rest.max(-1).values.sum() / rest[:, g].sum()), 4),
           "heads": []}
    print(json.dumps({k: v for k, v in out.items() if k != "heads"}))
    for objective, tau in (("hard", 0.0), ("soft", 0.02), ("soft", 0.05), ("soft", 0.1), ("expected", 0.0)):
        for train in (train_720, train_all):
            row = {"objective": objective, "tau": tau, "train_prompts": len(train)} | train_and_score(
                feats, names, rows, train, held, objective, tau)
            out["heads"].append(row)
            print(json.dumps(row), flush=True)
    if a.json:
        a.json.write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
