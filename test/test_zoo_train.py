"""Training the zoo: the compiled training step is the eager one, faster, or the eager one itself."""

from __future__ import annotations

import shutil
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from memspec_ros.testing.tiny_models import tiny_llama
from memspec_ros.zoo.train import TokenStreams, TrainConfig, train


def _data() -> TokenStreams:
    gen = torch.Generator().manual_seed(2)
    return TokenStreams({"code": torch.randint(3, 64, (600,), generator=gen, dtype=torch.int32)}, {"code": 1.0}, seed=0)


def _run(tmp_path, name: str, compile: bool, logs: list[str]):
    model = tiny_llama(layers=1, hidden=32, seed=5, init_range=0.02).requires_grad_(True)
    cfg = TrainConfig(max_steps=4, max_minutes=1e6, batch_size=2, seq_len=32, lr=5e-3, warmup_steps=1, compile=compile)
    meta = train(model, _data(), cfg, tmp_path / name, log=logs.append)
    return model, meta


@pytest.mark.skipif(shutil.which("g++") is None and shutil.which("c++") is None,
                    reason="torch.compile on CPU needs a C++ compiler")
def test_compiled_training_computes_what_eager_training_does(tmp_path):
    from torch._dynamo.utils import counters

    eager, eager_meta = _run(tmp_path, "eager", False, [])
    counters.clear()
    logs: list[str] = []
    compiled, meta = _run(tmp_path, "compiled", True, logs)
    assert not any("torch.compile failed" in m for m in logs), logs
    assert counters["stats"]["unique_graphs"] >= 1  # the step ran through compiled graphs
    assert meta["final_loss"] == pytest.approx(eager_meta["final_loss"], rel=1e-4)
    for (n, a), (_, b) in zip(eager.state_dict().items(), compiled.state_dict().items(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-5, msg=n)
    # checkpoints and saved weights are the plain model's: no "_orig_mod." prefixes
    assert all(not k.startswith("_orig_mod") for k in compiled.state_dict())


def test_a_step_that_cannot_compile_trains_eagerly_and_says_so(tmp_path, monkeypatch):
    def no_compiler(model):
        def fail(*args, **kwargs):
            raise RuntimeError("InvalidCxxCompiler: No working C++ compiler found\nmore detail")
        return fail

    eager, eager_meta = _run(tmp_path, "eager", False, [])
    monkeypatch.setattr(torch, "compile", no_compiler)
    logs: list[str] = []
    fallback, meta = _run(tmp_path, "fallback", True, logs)
    assert [m for m in logs if "torch.compile failed" in m] == [
        "train: torch.compile failed (RuntimeError:"
        " InvalidCxxCompiler: No working C++ compiler found); training eagerly"
    ]
    assert meta["step"] == 4 and meta["final_loss"] == eager_meta["final_loss"]
    for (n, a), (_, b) in zip(eager.state_dict().items(), fallback.state_dict().items(), strict=True):
        assert torch.equal(a, b), n


# the training loop's clock in the tests that use _SlowData (the slow_clock fixture): only its batches move it
_CLOCK = SimpleNamespace(now=1.0e9)


@pytest.fixture
def slow_clock(monkeypatch):
    """train()'s time.time() reads _CLOCK: a minutes cap then holds the same steps on any machine (with real time
    and batches that slept 0.1 s, a stall of a loaded runner cut runs short of the steps the tests count on)."""
    from memspec_ros.zoo import train as train_module

    monkeypatch.setattr(train_module, "time", SimpleNamespace(time=lambda: _CLOCK.now))
    return _CLOCK


class _SlowData(TokenStreams):
    """Batches that take 0.1 s each on the slow_clock, so a few seconds' cap holds far fewer steps than the budget."""

    def batch(self, batch_size: int, seq_len: int) -> torch.Tensor:
        _CLOCK.now += 0.1
        return super().batch(batch_size, seq_len)


@pytest.mark.parametrize("max_steps", [1000, TrainConfig.max_steps])
def test_a_step_budget_cut_short_by_the_minutes_cap_is_said(tmp_path, max_steps, slow_clock):
    """A step budget the minutes cannot hold ends early and the log says so; with the default max_steps the
    minutes are the budget, and nothing is said."""
    data = _data()
    slow = _SlowData(data.streams, {"code": 1.0}, seed=0)
    model = tiny_llama(layers=1, hidden=32, seed=5, init_range=0.02).requires_grad_(True)
    cfg = TrainConfig(max_steps=max_steps, max_minutes=0.05, batch_size=2, seq_len=32, lr=5e-3, warmup_steps=1)
    logs: list[str] = []
    meta = train(model, slow, cfg, tmp_path / "run", log=logs.append)
    assert meta["step"] < 40  # 3 s of 0.1 s batches
    capped = [m for m in logs if "cap allows" in m]
    if max_steps == TrainConfig.max_steps:
        assert capped == []
    else:
        assert len(capped) == 1 and f"of the {max_steps} steps" in capped[0]


def test_a_run_the_minutes_cut_short_is_not_taken_as_done_for_a_larger_cap(tmp_path, slow_clock):
    """The time cap is no part of a run's identity, so a run it cut short was "already trained" for a rebuild with
    more minutes, which shipped the short run under the larger cap's record. The same cap still finds it done."""
    data = _data()
    slow = _SlowData(data.streams, {"code": 1.0}, seed=0)
    model = tiny_llama(layers=1, hidden=32, seed=5, init_range=0.02).requires_grad_(True)
    cfg = TrainConfig(max_steps=1000, max_minutes=0.02, batch_size=2, seq_len=32, lr=5e-3, warmup_steps=1)
    meta = train(model, slow, cfg, tmp_path / "run", log=lambda m: None)
    assert meta["step"] < 1000 and meta["cut_at_minutes"] == 0.02
    assert train(model, slow, cfg, tmp_path / "run", log=lambda m: None)["step"] == meta["step"]
    with pytest.raises(ValueError, match=r"at its 0.02-minute cap; 0.5 minutes would train it further"):
        train(model, slow, replace(cfg, max_minutes=0.5), tmp_path / "run", log=lambda m: None)
    from memspec_ros.zoo.chat_build import _check_cached

    final = tmp_path / "final"  # a build's cached draft: its train_meta.json is this meta
    final.mkdir()
    (final / "train_meta.json").write_text(__import__("json").dumps(meta))
    _check_cached("code", final, meta["identity"], cfg)
    with pytest.raises(ValueError, match="would train it further"):
        _check_cached("code", final, meta["identity"], replace(cfg, max_minutes=0.5))
    whole = train(model, _data(), replace(cfg, max_steps=3, max_minutes=1e6), tmp_path / "steps", log=lambda m: None)
    assert "cut_at_minutes" not in whole  # ended by its steps: any cap finds it done


def test_an_unfinished_run_whose_schedule_the_minutes_fitted_is_not_resumed_under_a_larger_cap(tmp_path,
                                                                                                  slow_clock):
    """Its cosine horizon was fitted to the old minutes: resumed with more, it went on to the old horizon and
    stopped there, short of what the new cap allows."""
    class SlowInterrupted(_Interrupted, _SlowData):
        """Slow batches, and Ctrl-C when batch ``after`` + 1 is asked for."""

    data = _data()
    model = tiny_llama(layers=1, hidden=32, seed=5, init_range=0.02).requires_grad_(True)
    cfg = TrainConfig(max_steps=1000, max_minutes=0.05, batch_size=2, seq_len=32, lr=5e-3, warmup_steps=1,
                      checkpoint_every=7)
    with pytest.raises(KeyboardInterrupt):
        train(model, SlowInterrupted(data.streams, {"code": 1.0}, seed=0, after=8), cfg, tmp_path / "run",
              log=lambda m: None)
    with pytest.raises(ValueError, match="fitted its schedule to .* for a 0.05-minute cap"):
        train(model, _SlowData(data.streams, {"code": 1.0}, seed=0), replace(cfg, max_minutes=1.0),
              tmp_path / "run", log=lambda m: None)


class _Interrupted(TokenStreams):
    """Stops the run (as Ctrl-C would) when the batch after ``after`` is asked for."""

    def __init__(self, *args, after: int, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.after, self.served = after, 0

    def batch(self, batch_size: int, seq_len: int) -> torch.Tensor:
        if self.served == self.after:
            raise KeyboardInterrupt
        self.served += 1
        return super().batch(batch_size, seq_len)


def _interrupted_run(run: Path):
    """(data, config, model) of a 20-step run interrupted after its checkpoint at step 2, in ``run``."""
    data = _data()
    cfg = TrainConfig(max_steps=20, max_minutes=1e6, batch_size=2, seq_len=32, lr=5e-3, warmup_steps=1,
                      checkpoint_every=2)
    model = tiny_llama(layers=1, hidden=32, seed=5, init_range=0.02).requires_grad_(True)
    with pytest.raises(KeyboardInterrupt):
        train(model, _Interrupted(data.streams, {"code": 1.0}, seed=0, after=3), cfg, run)
    return data, cfg, model


def test_a_resumed_run_keeps_the_new_step_budget_and_ends_even_without_a_step(tmp_path):
    """A run interrupted after its checkpoint resumes under the budget it is given now (it kept the old one), and a
    resume whose minutes are already spent ends with its checkpoint instead of failing to log a loss it never had."""
    data, cfg, model = _interrupted_run(tmp_path / "run")
    logs: list[str] = []
    meta = train(model, data, replace(cfg, max_steps=4), tmp_path / "run", log=logs.append)
    assert meta["done"] and meta["step"] == 4  # the new budget, not the checkpoint's 20
    data, cfg, model = _interrupted_run(tmp_path / "spent")
    meta = train(model, data, replace(cfg, max_minutes=0.0), tmp_path / "spent", log=logs.append)
    # no step this run: it logs the checkpoint's running loss (it once failed to format a loss it never had)
    assert meta["done"] and meta["step"] == 2 and logs[-1].startswith("train: 2 steps") and "loss" in logs[-1]


def test_a_resumed_run_with_a_higher_budget_or_other_settings_is_refused(tmp_path):
    """Resumed with more steps, a run stopped at its old horizon and recorded the new budget; with another rate it
    went on with the old optimiser state and recorded the new rate. Both are refused, naming the change."""
    data, cfg, model = _interrupted_run(tmp_path / "run")
    with pytest.raises(ValueError, match=r"other settings \(max_steps 20 -> 30\)"):
        train(model, data, replace(cfg, max_steps=30), tmp_path / "run")
    # below the step it reached (2): it was marked done at step 2, recorded as a 1-step run
    with pytest.raises(ValueError, match=r"other settings \(max_steps 20 -> 1\)"):
        train(model, data, replace(cfg, max_steps=1), tmp_path / "run")
    with pytest.raises(ValueError, match=r"other settings \(lr 0.005 -> 0.001\)"):
        train(model, data, replace(cfg, lr=1e-3), tmp_path / "run")
    train(model, data, replace(cfg, max_steps=4), tmp_path / "done", identity={"data": "a"})
    with pytest.raises(ValueError, match=r"other settings \(data a -> b\)"):  # what the caller says decides it
        train(model, data, replace(cfg, max_steps=4), tmp_path / "done", identity={"data": "b"})


def test_an_atomic_text_write_syncs_under_a_name_of_its_own_and_keeps_the_file_readable(tmp_path, monkeypatch):
    """Two writers shared one temporary name (one could rename the other's half-written file into place), nothing
    was synced before the rename, and a failed write left its temporary file."""
    import os
    import stat

    from memspec_ros.runtime.atomic_write import write_text_atomic

    path = tmp_path / "registry.yaml"
    synced, made = [], []
    real_fsync = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (synced.append(os.readlink(f"/proc/self/fd/{fd}")), real_fsync(fd))[1])
    real_replace = os.replace
    monkeypatch.setattr(os, "replace", lambda src, dst: (made.append(str(src)), real_replace(src, dst))[1])
    write_text_atomic(path, "one")
    write_text_atomic(path, "two")
    assert path.read_text() == "two" and len(synced) == 4
    # each write: its temporary file before the rename, then the folder, whose entry the rename is
    assert [Path(p).name.startswith(".registry.yaml.") for p in synced] == [True, False, True, False]
    assert synced[1] == synced[3] == str(tmp_path)
    assert len(set(made)) == 2 and all(Path(m).name.startswith(".registry.yaml.") for m in made)
    assert stat.S_IMODE(path.stat().st_mode) == 0o644
    monkeypatch.setattr(os, "replace", lambda src, dst: (_ for _ in ()).throw(OSError("No space left on device")))
    with pytest.raises(OSError, match="No space"):
        write_text_atomic(path, "three")
    assert path.read_text() == "two" and [p.name for p in tmp_path.iterdir()] == ["registry.yaml"]


def test_a_resumed_run_ends_with_the_loss_of_the_run_it_continues(tmp_path):
    """The running loss restarted from one batch after a resume, so a resumed run reported another final loss than
    the same run uninterrupted (its weights, data and optimiser state the same)."""
    data, cfg, model = _interrupted_run(tmp_path / "resumed")
    resumed = train(model, data, replace(cfg, max_steps=4), tmp_path / "resumed")
    straight = train(tiny_llama(layers=1, hidden=32, seed=5, init_range=0.02).requires_grad_(True), _data(),
                     replace(cfg, max_steps=4), tmp_path / "straight")
    assert resumed["step"] == straight["step"] == 4
    assert resumed["final_loss"] == pytest.approx(straight["final_loss"], rel=1e-5)


def test_a_run_checkpointed_before_its_horizon_was_fitted_fits_it_after_the_resume(tmp_path, slow_clock):
    """With a warm-up longer than the checkpoint interval, the checkpoint held the unfitted horizon (the step
    budget) and a resumed run never fitted it: its rate stayed near the peak until the minutes ran out."""
    data = _data()
    cfg = TrainConfig(max_minutes=0.05, batch_size=2, seq_len=32, lr=5e-3, warmup_steps=8, checkpoint_every=4)
    model = tiny_llama(layers=1, hidden=32, seed=5, init_range=0.02).requires_grad_(True)
    with pytest.raises(KeyboardInterrupt):
        train(model, _Interrupted(data.streams, {"code": 1.0}, seed=0, after=5), cfg, tmp_path / "run")
    logs: list[str] = []
    meta = train(model, _SlowData(data.streams, {"code": 1.0}, seed=0), cfg, tmp_path / "run", log=logs.append)
    assert any("cosine horizon" in m for m in logs) and meta["total"] < TrainConfig.max_steps


def test_files_a_resumed_build_takes_for_finished_work_are_on_disk_before_their_final_name(tmp_path, monkeypatch):
    """Teacher shards, drafts' final folders and the datastore were renamed into place unsynced: after a power cut
    the final name could hold an empty file, which a resumed build takes for finished work and then fails on."""
    import os

    from memspec_ros.runtime import atomic_write
    from memspec_ros.runtime.atomic_write import publish_dir
    from memspec_ros.runtime.datastore import Datastore
    from memspec_ros.zoo.teacher import Answer, save_shard

    synced: list[str] = []
    fsync = os.fsync

    def recorded(fd):
        synced.append(os.readlink(f"/proc/self/fd/{fd}"))
        return fsync(fd)

    monkeypatch.setattr(atomic_write.os, "fsync", recorded)
    answer = Answer([1, 2], [3, 4], torch.zeros((2, 1), dtype=torch.int32), torch.zeros((2, 1), dtype=torch.float16))
    save_shard(tmp_path / "train-00000.safetensors", [answer], {"split": "train"})
    # the temporary file before its rename, then the folder, whose entry the rename is
    assert len(synced) == 2 and ".tmp" in synced[0] and synced[1] == str(tmp_path)
    Datastore([[1, 2, 3, 4]]).save(tmp_path / "datastore.safetensors")
    assert synced[-2].endswith(".partial") and synced[-1] == str(tmp_path)
    synced.clear()

    def write(folder):
        (folder / "model.safetensors").write_bytes(b"weights")
        (folder / "sub").mkdir()
        (folder / "sub" / "meta.json").write_text("{}")

    publish_dir(tmp_path / "final", write)
    staged = tmp_path / "final.partial"
    assert set(synced[:-1]) == {str(staged / "model.safetensors"), str(staged / "sub" / "meta.json"),
                                str(staged / "sub"), str(staged)}  # the files and the folders' entries
    assert synced[-1] == str(tmp_path)  # after the rename

    def failing(folder):
        (folder / "half").write_bytes(b"x")
        raise OSError("No space left on device")

    with pytest.raises(OSError, match="No space"):
        publish_dir(tmp_path / "other", failing)
    assert not (tmp_path / "other.partial").exists() and not (tmp_path / "other").exists()
    # a folder that cannot be opened to sync (mode 0333, a FUSE daemon without fsync) fails no write that is in place
    import errno

    def refused(*args, **kwargs):
        raise PermissionError(errno.EACCES, "Permission denied")

    monkeypatch.setattr(atomic_write.os, "open", refused)
    atomic_write.sync_dir(tmp_path)


def test_a_published_folder_replaces_the_old_one_whole_never_half_deleted(tmp_path, monkeypatch):
    """publish_dir removed an existing folder in place before renaming the new one on: a crash while rmtree ran left
    the folder with some of its files gone (and a reader such as the node loading a predictor head saw it so)."""
    import shutil

    from memspec_ros.runtime.atomic_write import publish_dir

    final = tmp_path / "head"
    final.mkdir()
    names = {"config.json", "weights.safetensors"}
    for name in names:
        (final / name).write_text("old")

    def cut(path, *args, **kwargs):  # a removal cut short after its first file (a kill, a power cut)
        next(Path(path).iterdir()).unlink()
        raise KeyboardInterrupt

    def write(folder):
        for name in names:
            (folder / name).write_text("new")

    with monkeypatch.context() as patched, pytest.raises(KeyboardInterrupt):
        patched.setattr(shutil, "rmtree", cut)
        publish_dir(final, write)
    assert {p.name: p.read_text() for p in final.iterdir()} == dict.fromkeys(names, "new")  # whole, and the new one
    publish_dir(final, write)  # the next publish clears what the cut one left
    assert sorted(p.name for p in tmp_path.iterdir()) == ["head"]
    # cut between its two renames: the old folder aside, none in place; the next publish puts it back first, so
    # that one failing too leaves the old folder, not none
    final.rename(tmp_path / "head.old")

    def failing(folder):
        raise OSError("No space left on device")

    with pytest.raises(OSError, match="No space"):
        publish_dir(final, failing)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["head"]
    assert {p.name: p.read_text() for p in final.iterdir()} == dict.fromkeys(names, "new")
