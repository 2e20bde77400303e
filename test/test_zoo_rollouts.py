"""On-policy distillation data and training (``memspec_ros/zoo/rollouts.py``, ``train.py``) on tiny models."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from memspec_ros.bench.tiny_models import tiny_llama
from memspec_ros.runtime.oracle import target_greedy
from memspec_ros.zoo.rollouts import IGNORE, RolloutConfig, RolloutStreams, make_rollouts
from memspec_ros.zoo.train import TrainConfig, train


@pytest.fixture(scope="module")
def rollouts(tmp_path_factory, target):
    gen = torch.Generator().manual_seed(3)
    streams = {"code": torch.randint(3, 64, (400,), generator=gen, dtype=torch.int32),
               "law": torch.randint(3, 64, (300,), generator=gen, dtype=torch.int32)}
    cfg = RolloutConfig(sequences_per_source=10, min_prompt_tokens=4, max_prompt_tokens=9, new_tokens=12, batch_size=4)
    path = tmp_path_factory.mktemp("rollouts") / "rollouts.safetensors"
    summary = make_rollouts(target, streams, cfg, path, log=lambda m: None)
    return streams, cfg, path, summary


def _windows_of(stream: torch.Tensor, w: torch.Tensor) -> bool:
    return any(torch.equal(stream[i : i + len(w)], w) for i in range(len(stream) - len(w) + 1))


def test_rollouts_are_the_targets_own_greedy_continuations_of_training_windows(rollouts, target):
    streams, cfg, path, summary = rollouts
    tensors = load_file(str(path))
    for name, stream in streams.items():
        keys = sorted(k for k in tensors if k.startswith(f"{name}.") and k.endswith(".ids"))
        assert sum(len(tensors[k]) for k in keys) == cfg.sequences_per_source == summary["sources"][name]["sequences"]
        for k in keys:
            ids, labels = tensors[k].long(), tensors[k.replace(".ids", ".labels")].long()
            plen = ids.shape[1] - cfg.new_tokens
            assert cfg.min_prompt_tokens <= plen <= cfg.max_prompt_tokens
            assert labels.shape == (ids.shape[0], ids.shape[1] - 1)
            for row, lab in zip(ids, labels, strict=True):
                prompt = row[:plen]
                assert _windows_of(stream.long(), prompt)  # a window of the training stream
                # batched generation = the per-prompt greedy loop the engine is checked against
                assert row[plen:].tolist() == target_greedy(target, prompt.tolist(), cfg.new_tokens)
                # each label is the target's argmax given the prefix
                with torch.no_grad():
                    full = target(input_ids=row[None]).logits[0, :-1].argmax(-1)
                assert torch.equal(lab, full)
        assert summary["sources"][name]["label_agreement"] == 1.0


def test_rollout_batches_pad_with_ignored_labels_and_name_missing_sources(rollouts):
    _, _, path, _ = rollouts
    data = RolloutStreams(path, {"code": 1.0, "law": 1.0}, seed=0)
    stored = {tuple(ids.tolist()): labels for src in data.seqs.values() for ids, labels in src}
    x, y = data.batch(8, 1000)
    assert y.shape == (8, x.shape[1] - 1)
    for row, lab in zip(x, y, strict=True):
        n = int((lab != IGNORE).sum()) + 1  # real tokens in this row
        assert torch.equal(stored[tuple(row[:n].tolist())].long(), lab[: n - 1])
        assert (row[n:] == 0).all() and (lab[n - 1 :] == IGNORE).all()
    x, y = data.batch(4, 10)  # seq_len caps the width
    assert x.shape[1] == 10 and y.shape[1] == 9
    with pytest.raises(ValueError, match=r"no rollouts for \['math'\]"):
        RolloutStreams(path, {"code": 1.0, "math": 0.5}, seed=0)


def _student():
    return tiny_llama(layers=1, hidden=32, seed=5, init_range=0.02).requires_grad_(True)


def _agreement(model, data: RolloutStreams) -> float:
    hit = n = 0
    with torch.no_grad():
        for src in data.seqs.values():
            for ids, labels in src:
                pred = model(input_ids=ids[None, :-1].long()).logits[0].argmax(-1)
                hit, n = hit + int((pred == labels.long()).sum()), n + len(labels)
    return hit / n


def test_validation_split_is_every_tenth_rollout_and_agreement_is_per_position(rollouts, target):
    _, _, path, _ = rollouts
    every = RolloutStreams(path, {"code": 1.0}, seed=0)
    train_, val = (RolloutStreams(path, {"code": 1.0}, seed=0, split=s) for s in ("train", "val"))
    rows = every.seqs["code"]
    assert [r[0].tolist() for r in val.seqs["code"]] == [r[0].tolist() for r in rows[::10]]
    assert len(train_.seqs["code"]) + len(val.seqs["code"]) == len(rows)
    assert {tuple(r[0].tolist()) for r in train_.seqs["code"]}.isdisjoint({tuple(r[0].tolist()) for r in val.seqs["code"]})
    # the labels are the target's own argmax: it agrees everywhere, a fresh model does not
    assert every.agreement(target) == 1.0
    student = _student()
    assert every.agreement(student) == pytest.approx(_agreement(student, every))
    with pytest.raises(ValueError, match="split must be"):
        RolloutStreams(path, {"code": 1.0}, seed=0, split="test")


def test_training_on_rollouts_learns_the_targets_argmax(rollouts, tmp_path):
    _, _, path, _ = rollouts
    student = _student()
    data = RolloutStreams(path, {"code": 1.0, "law": 1.0}, seed=1)
    before = _agreement(student, data)
    cfg = TrainConfig(max_steps=80, max_minutes=1e6, batch_size=8, seq_len=64, lr=1e-2, warmup_steps=5, checkpoint_every=1000)
    meta = train(student, data, cfg, tmp_path / "ckpt", log=lambda m: None)
    after = _agreement(student.eval(), data)
    assert meta["done"] and meta["step"] == 80
    assert after > before + 0.3, (before, after)


class _Interrupt(Exception):
    pass


class _StopAfter:
    """Rollout data that raises on batch ``n + 1``, like a build killed mid-training."""

    def __init__(self, inner: RolloutStreams, n: int):
        self.inner, self.n = inner, n

    def batch(self, *a):
        if self.n == 0:
            raise _Interrupt
        self.n -= 1
        return self.inner.batch(*a)

    def state(self):
        return self.inner.state()

    def load_state(self, s):
        self.inner.load_state(s)


def test_interrupted_training_resumes_to_the_same_weights(rollouts, tmp_path):
    _, _, path, _ = rollouts
    cfg = TrainConfig(max_steps=8, max_minutes=1e6, batch_size=4, seq_len=64, lr=5e-3, warmup_steps=2, checkpoint_every=3,
                      validate_every=2)
    val = RolloutStreams(path, {"code": 1.0}, seed=0, split="val")

    def fresh():
        return _student(), RolloutStreams(path, {"code": 1.0, "law": 1.0}, seed=1)

    straight, data = fresh()
    straight_meta = train(straight, data, cfg, tmp_path / "a", log=lambda m: None, validate=val.agreement)

    resumed, data = fresh()
    with pytest.raises(_Interrupt):
        train(resumed, _StopAfter(data, 7), cfg, tmp_path / "b", log=lambda m: None, validate=val.agreement)  # checkpoint: step 6
    resumed, data = fresh()
    meta = train(resumed, data, cfg, tmp_path / "b", log=lambda m: None, validate=val.agreement)
    assert meta["step"] == 8 and meta["validation"] == straight_meta["validation"]
    for (n, a), (_, b) in zip(straight.state_dict().items(), resumed.state_dict().items(), strict=True):
        assert torch.equal(a, b), n


def test_early_stopping_keeps_the_best_validated_parameters(rollouts, tmp_path):
    _, _, path, _ = rollouts
    student = _student()
    scores = iter([0.1, 0.5, 0.3, 0.2, 0.4])  # best at the 2nd validation (step 4)
    snapshots = []

    def validate(model):
        snapshots.append({n: p.detach().clone() for n, p in model.named_parameters()})
        return next(scores)

    cfg = TrainConfig(max_steps=10, max_minutes=1e6, batch_size=4, seq_len=64, lr=5e-3, warmup_steps=2, validate_every=2)
    meta = train(student, RolloutStreams(path, {"code": 1.0}, seed=1), cfg, tmp_path / "c", log=lambda m: None, validate=validate)
    assert meta["best_step"] == 4 and [v[0] for v in meta["validation"]] == [2, 4, 6, 8, 10]
    for n, p in student.named_parameters():
        assert torch.equal(p, snapshots[1][n]), n
    assert not all(torch.equal(p, snapshots[-1][n]) for n, p in student.named_parameters())
