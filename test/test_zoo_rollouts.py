"""On-policy distillation data and training (``memspec_ros/zoo/rollouts.py``, ``train.py``) on tiny models."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from row_checks import assert_greedy_up_to_a_tie, assert_top_k_up_to_a_tie
from safetensors.torch import load_file, save_file

from memspec_ros.testing.tiny_models import tiny_llama
from memspec_ros.zoo.rollouts import IGNORE, RolloutConfig, RolloutStreams, make_rollouts, topk_kl
from memspec_ros.zoo.train import TrainConfig, train


@pytest.fixture(scope="module")
def rollouts(tmp_path_factory, target):
    gen = torch.Generator().manual_seed(3)
    streams = {"code": torch.randint(3, 64, (400,), generator=gen, dtype=torch.int32),
               "law": torch.randint(3, 64, (300,), generator=gen, dtype=torch.int32)}
    cfg = RolloutConfig(
        sequences_per_source=10, min_prompt_tokens=4, max_prompt_tokens=9, new_tokens=12, batch_size=4, top_k=5
    )
    path = tmp_path_factory.mktemp("rollouts") / "rollouts.safetensors"
    summary = make_rollouts(target, streams, cfg, path, log=lambda m: None)
    return streams, cfg, path, summary


def i_row(batch: torch.Tensor, row: torch.Tensor) -> int:
    return next(i for i in range(len(batch)) if torch.equal(batch[i], row))


def _windows_of(stream: torch.Tensor, w: torch.Tensor) -> bool:
    return any(torch.equal(stream[i : i + len(w)], w) for i in range(len(stream) - len(w) + 1))


def assert_greedy_continuation(target, row: torch.Tensor, plen: int) -> torch.Tensor:
    """``row`` past its first ``plen`` tokens is ``target``'s greedy continuation, checked against one unpadded
    forward up to a near-tie that a batched generation may split the other way (row_checks); its log-probs."""
    with torch.no_grad():
        logp = torch.log_softmax(target(input_ids=row[None]).logits[0, :-1], -1)
    assert_greedy_up_to_a_tie(row[plen:].tolist(), logp[plen - 1:], 1e-4 * float(logp.abs().max()))
    return logp


def test_rollouts_are_the_targets_own_greedy_continuations_of_training_windows(rollouts, target):
    streams, cfg, path, summary = rollouts
    tensors = load_file(str(path))
    for name, stream in streams.items():
        keys = sorted(k for k in tensors if k.startswith(f"{name}.") and k.endswith(".ids"))
        assert sum(len(tensors[k]) for k in keys) == cfg.sequences_per_source == summary["sources"][name]["sequences"]
        agree = total = 0
        for k in keys:
            ids, labels = tensors[k].long(), tensors[k.replace(".ids", ".labels")].long()
            plen = ids.shape[1] - cfg.new_tokens
            assert cfg.min_prompt_tokens <= plen <= cfg.max_prompt_tokens
            assert labels.shape == (ids.shape[0], ids.shape[1] - 1)
            for row, lab in zip(ids, labels, strict=True):
                prompt = row[:plen]
                assert _windows_of(stream.long(), prompt)  # a window of the training stream
                # the batched generation is the target's greedy continuation, and each label its choice given the
                # prefix, the soft labels its top-k log-probabilities: checked against one unpadded forward, up to
                # a near-tie that the batch's other order of sums may split the other way (row_checks)
                logp = assert_greedy_continuation(target, row, plen)
                assert_greedy_up_to_a_tie(lab.tolist(), logp, 1e-4 * float(logp.abs().max()))
                i = i_row(ids, row)
                assert_top_k_up_to_a_tie(tensors[k.replace(".ids", ".top_ids")][i],
                                         tensors[k.replace(".ids", ".top_logp")][i], logp, 2e-2)  # stored in fp16
                agree += int((lab[plen - 1:] == row[plen:]).sum())
                total += cfg.new_tokens
        # the continuation's tokens and the full forward's labels agree but for such ties, and the figure says how
        # often they do
        assert summary["sources"][name]["label_agreement"] == agree / total


def test_rollout_batches_pad_with_ignored_labels_and_name_missing_sources(rollouts):
    _, _, path, _ = rollouts
    data = RolloutStreams(path, {"code": 1.0, "law": 1.0}, seed=0)
    stored = {tuple(r[0].tolist()): r for src in data.seqs.values() for r in src}
    x, y, tid, tlp = data.batch(8, 1000)
    assert y.shape == (8, x.shape[1] - 1) and tid.shape == tlp.shape == (8, x.shape[1] - 1, 5)
    for row, lab, ti, tl in zip(x, y, tid, tlp, strict=True):
        n = int((lab != IGNORE).sum()) + 1  # real tokens in this row
        _, labels, top_ids, top_logp = stored[tuple(row[:n].tolist())]
        assert torch.equal(labels.long(), lab[: n - 1]) and torch.equal(top_ids.long(), ti[: n - 1])
        assert torch.equal(top_logp.float(), tl[: n - 1])
        assert (row[n:] == 0).all() and (lab[n - 1 :] == IGNORE).all()
    x, y, tid, _ = data.batch(4, 10)  # seq_len caps the width
    assert x.shape[1] == 10 and y.shape[1] == 9 and tid.shape[1] == 9
    with pytest.raises(ValueError, match=r"no rollouts for \['math'\]"):
        RolloutStreams(path, {"code": 1.0, "math": 0.5}, seed=0)
    hard_only = {k: v for k, v in load_file(str(path)).items() if not k.endswith(("top_ids", "top_logp"))}
    save_file(hard_only, str(path.with_name("old.safetensors")))
    with pytest.raises(ValueError, match="no soft labels .* rerun the rollouts stage"):
        RolloutStreams(path.with_name("old.safetensors"), {"code": 1.0}, seed=0)


def test_topk_kl_is_the_kl_on_the_coarsened_distribution():
    gen = torch.Generator().manual_seed(0)
    t_logits, s_logits = torch.randn(2, 3, 11, generator=gen) * 2, torch.randn(2, 3, 11, generator=gen)
    logp = torch.log_softmax(t_logits, -1)
    top = logp.topk(4, -1)
    labels = torch.tensor([[1, 2, IGNORE], [3, IGNORE, IGNORE]])
    got = topk_kl(s_logits, labels, top.indices, top.values)
    # by hand: the 4 top tokens kept, the other 7 merged into one outcome, on the 3 labelled positions
    logq = torch.log_softmax(s_logits, -1)
    kls = []
    for b, t in [(0, 0), (0, 1), (1, 0)]:
        keep = top.indices[b, t]
        rest = torch.ones(11, dtype=torch.bool)
        rest[keep] = False
        p = torch.cat([logp[b, t, keep].exp(), logp[b, t, rest].exp().sum()[None]])
        q = torch.cat([logq[b, t, keep].exp(), logq[b, t, rest].exp().sum()[None]])
        kls.append((p * (p.log() - q.log())).sum())
    torch.testing.assert_close(got, torch.stack(kls).mean(), atol=1e-5, rtol=1e-4)
    assert topk_kl(t_logits, labels, top.indices, top.values) < 1e-5  # the target itself: zero


def _student():
    return tiny_llama(layers=1, hidden=32, seed=5, init_range=0.02).requires_grad_(True)


def _agreement(model, data: RolloutStreams) -> float:
    hit = n = 0
    with torch.no_grad():
        for src in data.seqs.values():
            for ids, labels, _, _ in src:
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
    assert {tuple(r[0].tolist()) for r in train_.seqs["code"]}.isdisjoint(
        {tuple(r[0].tolist()) for r in val.seqs["code"]}
    )
    # the labels are the target's own argmax: it agrees everywhere, a fresh model does not
    assert every.agreement(target) == 1.0
    student = _student()
    assert every.agreement(student) == pytest.approx(_agreement(student, every))
    with pytest.raises(ValueError, match="split must be"):
        RolloutStreams(path, {"code": 1.0}, seed=0, split="test")
    # one rollout a source: all of it validation, and a batch of the empty train split failed in torch.randint
    with pytest.raises(ValueError, match="no train rollouts for code .* at least 2"):
        RolloutStreams(path, {"code": 1.0}, seed=0, split="train", val_every=1)


def test_training_on_rollouts_learns_the_targets_argmax(rollouts, tmp_path):
    _, _, path, _ = rollouts
    student = _student()
    data = RolloutStreams(path, {"code": 1.0, "law": 1.0}, seed=1)
    before = _agreement(student, data)
    cfg = TrainConfig(
        max_steps=80, max_minutes=1e6, batch_size=8, seq_len=64, lr=1e-2, warmup_steps=5, checkpoint_every=1000
    )
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
    cfg = TrainConfig(
        max_steps=8,
        max_minutes=1e6,
        batch_size=4,
        seq_len=64,
        lr=5e-3,
        warmup_steps=2,
        checkpoint_every=3,
        validate_every=2,
    )
    val = RolloutStreams(path, {"code": 1.0}, seed=0, split="val")

    def fresh():
        return _student(), RolloutStreams(path, {"code": 1.0, "law": 1.0}, seed=1)

    straight, data = fresh()
    straight_meta = train(straight, data, cfg, tmp_path / "a", log=lambda m: None, validate=val.agreement)

    resumed, data = fresh()
    with pytest.raises(_Interrupt):
        train(
            resumed, _StopAfter(data, 7), cfg, tmp_path / "b", log=lambda m: None, validate=val.agreement
        )  # checkpoint: step 6
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

    cfg = TrainConfig(
        max_steps=10, max_minutes=1e6, batch_size=4, seq_len=64, lr=5e-3, warmup_steps=2, validate_every=2
    )
    meta = train(
        student, RolloutStreams(path, {"code": 1.0}, seed=1), cfg, tmp_path / "c", log=lambda m: None, validate=validate
    )
    assert meta["best_step"] == 4 and [v[0] for v in meta["validation"]] == [2, 4, 6, 8, 10]
    for n, p in student.named_parameters():
        assert torch.equal(p, snapshots[1][n]), n
    assert not all(torch.equal(p, snapshots[-1][n]) for n, p in student.named_parameters())


def test_validate_start_keeps_the_starting_point_when_training_only_hurts(rollouts, tmp_path):
    _, _, path, _ = rollouts
    student = _student()
    start = {n: p.detach().clone() for n, p in student.named_parameters()}
    scores = iter([0.9, 0.5, 0.4, 0.3])  # the start (step 0) scores best

    cfg = TrainConfig(max_steps=6, max_minutes=1e6, batch_size=4, seq_len=64, lr=5e-3, warmup_steps=2, validate_every=2,
                      validate_start=True)
    meta = train(student, RolloutStreams(path, {"code": 1.0}, seed=1), cfg, tmp_path / "c", log=lambda m: None,
                 validate=lambda model: next(scores))
    assert [v[0] for v in meta["validation"]] == [0, 2, 4, 6] and meta["best_step"] == 0
    assert all(torch.equal(p, start[n]) for n, p in student.named_parameters())


class _DiesOnSource:
    """A target that raises once it is asked to continue a prompt from ``stream`` (a build killed mid-source)."""

    def __init__(self, target, stream: torch.Tensor):
        self.target, self.stream = target, stream.long()

    def eval(self):
        return self

    def __call__(self, input_ids, **kw):
        if input_ids.shape[1] > 1 and _windows_of(self.stream, input_ids[0]):
            raise _Interrupt
        return self.target(input_ids=input_ids, **kw)


def test_interrupted_rollouts_resume_at_the_unfinished_source_and_write_the_same_file(rollouts, target, tmp_path):
    streams, cfg, path, _ = rollouts
    out = tmp_path / "r.safetensors"
    with pytest.raises(_Interrupt):
        make_rollouts(_DiesOnSource(target, streams["law"]), streams, cfg, out, log=lambda m: None)
    assert (tmp_path / "r.safetensors.parts" / "code.safetensors").exists() and not out.exists()
    logs = []
    make_rollouts(target, streams, cfg, out, log=logs.append)
    assert any("code cached" in m for m in logs) and not any("law cached" in m for m in logs)
    a, b = load_file(str(path)), load_file(str(out))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert not (tmp_path / "r.safetensors.parts").exists()
    # a changed configuration cannot reuse parts made with another one
    with pytest.raises(_Interrupt):
        make_rollouts(_DiesOnSource(target, streams["law"]), streams, cfg, out, log=lambda m: None)
    with pytest.raises(ValueError, match="delete .*parts to start over"):
        make_rollouts(target, streams, RolloutConfig(**{**cfg.__dict__, "new_tokens": 5}), out, log=lambda m: None)


def test_domain_rollouts_stage_adds_other_windows_that_only_the_domain_drafts_see(target, tmp_path):
    """``domain_rollouts`` continues more prompts of the four domains (another seed, so other
    windows); ``RolloutStreams`` joins both files per source, and the general draft's file is unchanged."""
    from memspec_ros.zoo.build import BuildConfig, ZooBuild

    gen = torch.Generator().manual_seed(5)
    names = ("general", "code", "math", "law", "medical", "mixed")
    streams = {n: torch.randint(3, 64, (200,), generator=gen, dtype=torch.int32) for n in names}
    work = tmp_path / "work"
    (work / "data").mkdir(parents=True)
    save_file(streams, str(work / "data" / "train.safetensors"))
    target.save_pretrained(str(work / "hf" / "target"), safe_serialization=True)
    shared = RolloutConfig(
        sequences_per_source=6, min_prompt_tokens=4, max_prompt_tokens=6, new_tokens=5, batch_size=3, top_k=4
    )
    # the shared recipe: its general draft learns the shared rollouts of every source, general's among them
    cfg = BuildConfig(
        work_dir=work,
        out_dir=tmp_path / "models",
        threads=1,
        rollouts=shared,
        domain_rollouts_per_source=16,
        draft_recipe="shared",
    )
    threads = torch.get_num_threads()
    build = ZooBuild(cfg)  # sets torch's threads process-wide: restored below
    try:
        _check_domain_rollouts(build, streams, shared, target, work)
    finally:
        torch.set_num_threads(threads)


def _check_domain_rollouts(build, streams, shared, target, work) -> None:
    from memspec_ros.zoo.build import BuildConfig, ZooBuild

    with pytest.raises(FileNotFoundError, match="run the domain_rollouts stage first"):
        build.domains()
    build.rollouts()
    build.domain_rollouts()
    extra = load_file(str(build.domain_rollouts_path))
    assert {k.split(".")[0] for k in extra} == {"code", "math", "law", "medical"}  # not general, not mixed
    both = RolloutStreams([build.rollouts_path, build.domain_rollouts_path], {"code": 1.0, "general": 1.0}, seed=0)
    first = RolloutStreams(build.rollouts_path, {"code": 1.0, "general": 1.0}, seed=0)
    assert len(both.seqs["code"]) == 16 and len(both.seqs["general"]) == 6  # 6 shared + 10 more for the domain
    for a, b in zip(first.seqs["code"], both.seqs["code"][:6], strict=True):  # the shared ones come first, unchanged
        assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))
    prompts = lambda rows: {tuple(r[0][:4].tolist()) for r in rows}  # noqa: E731
    assert prompts(both.seqs["code"][6:]) - prompts(first.seqs["code"])  # new windows, not a replay
    for ids, *_ in both.seqs["code"][6:]:
        plen = len(ids) - shared.new_tokens
        assert _windows_of(streams["code"].long(), ids[:plen].long())  # training windows only
        assert_greedy_continuation(target, ids.long(), plen)
    assert (
        len(
            RolloutStreams([build.rollouts_path, build.domain_rollouts_path], {"code": 1.0}, 0, split="val").seqs[
                "code"
            ]
        )
        == 2
    )
    build.domain_rollouts()  # cached: unchanged
    assert load_file(str(build.domain_rollouts_path)).keys() == extra.keys()
    too_few = r"domain rollouts per source \(4\) must be at least the rollouts per source \(6\)"
    with pytest.raises(ValueError, match=too_few):
        ZooBuild(BuildConfig(work_dir=work, threads=1, rollouts=shared, domain_rollouts_per_source=4)).domain_rollouts()


def test_a_rollouts_file_cut_mid_write_is_not_left_to_be_taken_as_done(rollouts, target, tmp_path, monkeypatch):
    """The final file was written in place: a crash mid-write left a truncated rollouts.safetensors, which the
    next build took for a finished stage."""
    from memspec_ros.zoo import rollouts as ro

    streams, cfg, _, _ = rollouts
    real = ro.save_file

    def cut_final(tensors, filename, *args, **kwargs):
        if ".rollouts.safetensors" in filename:  # the final write, not a source's part
            Path(filename).write_bytes(b"half a file")
            raise OSError("No space left on device")
        return real(tensors, filename, *args, **kwargs)

    monkeypatch.setattr(ro, "save_file", cut_final)
    out = tmp_path / "rollouts.safetensors"
    with pytest.raises(OSError, match="No space"):
        make_rollouts(target, streams, cfg, out, log=lambda m: None)
    assert not out.exists()
    monkeypatch.setattr(ro, "save_file", real)
    make_rollouts(target, streams, cfg, out, log=lambda m: None)  # the parts kept: rebuilt from them
    assert out.is_file()
