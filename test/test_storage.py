"""The storage tier: cold reads (page cache dropped), pacing as a lower bound, drafts built from the bytes.

No timing beyond lower bounds that hold by construction: a paced read of N bytes cannot end before
N / bandwidth + requests * latency has passed.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
import torch

from memspec_ros.runtime.cache import registry_loader
from memspec_ros.runtime.forward_paths import cpu_has_bf16
from memspec_ros.runtime.models import ModelSpec, load_model
from memspec_ros.runtime.registry import DraftRegistry
from memspec_ros.runtime.storage import (
    MEDIA,
    STORAGE_CHOICES,
    DraftStorage,
    StorageMedium,
    cached_fraction,
    drop_page_cache,
    read_cold,
    storage_medium,
)

BUNDLED_DRAFT = Path(__file__).resolve().parents[1] / "models" / "drafts" / "code"


def test_presets_are_the_edge_media_with_sourced_figures():
    assert STORAGE_CHOICES == ("local", "emmc", "sd", "nvme")
    assert not MEDIA["local"].emulated and MEDIA["local"].min_read_seconds(10**9) == 0.0
    for name in ("emmc", "sd", "nvme"):
        m = MEDIA[name]
        assert m.emulated and m.source and m.read_bytes_per_second > 0 and m.request_latency_seconds > 0
    # the order edge robots know: an SD card is slower than eMMC, which is slower than NVMe
    size = 8 * 10**6
    assert (
        MEDIA["sd"].min_read_seconds(size) > MEDIA["emmc"].min_read_seconds(size) > MEDIA["nvme"].min_read_seconds(size)
    )
    with pytest.raises(ValueError, match="local, emmc, sd, nvme"):
        storage_medium("floppy")
    # what a long read gets, reported beside the rated figure it falls short of (a request's latency each)
    for name in ("emmc", "sd", "nvme"):
        m, gb = MEDIA[name], 10**9
        described = m.describe()["effective_read_bytes_per_second"]
        assert described == pytest.approx(gb / m.min_read_seconds(gb), rel=1e-3) and described < m.read_bytes_per_second
    assert MEDIA["local"].describe()["effective_read_bytes_per_second"] == 0


def test_a_paced_read_returns_the_bytes_and_takes_at_least_bytes_over_bandwidth(tmp_path):
    data = os.urandom(600_000)
    path = tmp_path / "weights.bin"
    path.write_bytes(data)
    slow = StorageMedium("test", read_bytes_per_second=20e6, request_latency_seconds=1e-3, request_bytes=100_000)
    got, read = read_cold(path, slow)
    assert got == data
    assert read.nbytes == len(data) and read.requests == 6
    assert read.seconds >= len(data) / 20e6 + 6 * 1e-3  # 36 ms: the lower bound the pacing enforces
    assert slow.min_read_seconds(len(data)) == pytest.approx(len(data) / 20e6 + 6e-3)


DROPS_PAGES = ("ext2", "ext3", "ext4", "xfs", "btrfs", "overlay")  # disk filesystems that honour DONTNEED


def _filesystem(path: Path) -> str:
    best, kind = "", ""
    for line in Path("/proc/self/mounts").read_text().splitlines():
        _, mount, fstype, *_ = line.split()
        if path.resolve().is_relative_to(mount) and len(mount) > len(best):  # by path component: not /tmpfs for /tmp
            best, kind = mount, fstype
    return kind


@pytest.fixture
def disk_dir(tmp_path):
    """tmp_path, or where it is on a RAM filesystem (a runner's tmpfs /tmp), a folder beside the repository's files,
    removed afterwards: a cold read on tmpfs can only be skipped, and that skip would hide the drop on such runners."""
    if _filesystem(tmp_path) not in ("tmpfs", "ramfs"):
        yield tmp_path
        return
    import tempfile

    folder = Path(tempfile.mkdtemp(prefix=".storage-test-", dir=Path(__file__).resolve().parent))
    try:
        yield folder
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def test_a_cold_read_drops_the_file_from_the_page_cache_first(disk_dir):
    tmp_path = disk_dir
    path = tmp_path / "weights.bin"
    path.write_bytes(os.urandom(1 << 20))
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)  # clean pages only can be dropped
        os.read(fd, 1 << 20)
        before = cached_fraction(fd, 1 << 20)
        if before is None:
            pytest.skip("mincore is not available here")
        assert before == 1.0  # just read: every page cached
        if _filesystem(tmp_path) in ("tmpfs", "ramfs"):
            pytest.skip("a RAM filesystem has no disk to drop its pages to")
        drop_page_cache(fd)
        after = cached_fraction(fd, 1 << 20)
        if after != 0.0 and _filesystem(tmp_path) not in DROPS_PAGES:  # fadvise is advice: ZFS, FUSE, 9p may keep them
            pytest.skip(f"this filesystem keeps its pages ({_filesystem(tmp_path)})")
        assert after == 0.0
    finally:
        os.close(fd)
    _, read = read_cold(path, MEDIA["local"])
    assert read.cached_after_drop == 0.0  # what the bench records: this load really read the disk


def _same_model(a, b) -> None:
    sa, sb = a.model.state_dict(), b.model.state_dict()
    assert sa.keys() == sb.keys()
    for key in sa:
        assert torch.equal(sa[key], sb[key]), key
    assert (a.forward_path, a.size_bytes, a.vocab_size, a.max_positions) == (
        b.forward_path, b.size_bytes, b.vocab_size, b.max_positions)
    ids = torch.tensor([[1, 5, 9, 2, 7]])
    with torch.inference_mode():
        assert torch.equal(a.model(input_ids=ids).logits, b.model(input_ids=ids).logits)


@pytest.mark.parametrize("dtype", ["fp32"] + (["bf16"] if cpu_has_bf16() else []))
def test_a_draft_built_from_the_read_bytes_equals_load_model(tiny_zoo, dtype):
    spec = ModelSpec(str(tiny_zoo / "drafts" / "code"), dtype=dtype)
    storage = DraftStorage(MEDIA["local"])
    _same_model(storage.load(spec, "code"), load_model(spec))
    (record,) = storage.records
    assert (
        record.name == "code" and record.nbytes == (tiny_zoo / "drafts" / "code" / "model.safetensors").stat().st_size
    )


@pytest.mark.skipif(not BUNDLED_DRAFT.is_dir(), reason="the bundled zoo is not built")
def test_a_reduced_vocabulary_draft_built_from_bytes_equals_load_model(cache_root_in_tmp):
    spec = ModelSpec(str(BUNDLED_DRAFT))
    storage = DraftStorage(MEDIA["local"])
    _same_model(storage.load(spec, "code"), load_model(spec))
    # its runtime form: the fp16 file's weights, fp32 in memory, stored at fp16 again, and the reload equal
    _same_model(storage.load(spec, "code"), load_model(spec))
    (form,) = storage._forms.values()
    assert form.widened and form.file.stat().st_size < 1.1 * (BUNDLED_DRAFT / "model.safetensors").stat().st_size


@pytest.mark.parametrize("quantization", ["none", "int8", "int4"])
def test_a_reload_reads_the_runtime_form_and_builds_the_same_draft(tiny_zoo, quantization, cache_root_in_tmp,
                                                                   monkeypatch):
    """The first load builds the draft from its safetensors and writes its runtime form; a reload reads that file
    cold and fills a copy of the emptied model with its tensors: the same tensors (tied ones shared as before), the
    same logits, the same speculative output, and no quantization on the way."""
    from memspec_ros.runtime import forward_paths
    from memspec_ros.runtime.speculative import generate

    spec = ModelSpec(str(tiny_zoo / "drafts" / "code"), quantization=quantization)
    storage = DraftStorage(MEDIA["local"])
    first = storage.load(spec, "code")
    (form,) = storage._forms.values()
    assert form.file.is_file() and form.file.parent.parent == cache_root_in_tmp
    assert all(t is None for m in form.skeleton.modules() for t in (*m._parameters.values(), *m._buffers.values()))
    quantized = []
    monkeypatch.setattr(forward_paths, "apply_path", lambda *a, **k: quantized.append(a))
    again = storage.load(spec, "code")
    assert quantized == [] and again.model is not first.model
    _same_model(again, first)
    tied = [(n, t) for n, t in first.model.named_parameters(remove_duplicate=False)]
    shared = {n for n, t in tied if sum(t is u for _, u in tied) > 1}
    params = dict(again.model.named_parameters(remove_duplicate=False))
    assert all(sum(params[n] is params[m] for m in shared) == len(shared) for n in shared)
    first_record, again_record = storage.take_records()
    assert again_record.nbytes == form.file.stat().st_size
    assert first_record.nbytes == (tiny_zoo / "drafts" / "code" / "model.safetensors").stat().st_size
    target = load_model(ModelSpec(str(tiny_zoo / "target"), quantization=quantization)).model
    prompt = [1, 5, 9, 2, 7, 3]
    outputs = [generate(target, prompt, d.model, max_new_tokens=24, gamma=4).generated_ids for d in (first, again)]
    assert outputs[0] == outputs[1] == generate(target, prompt, max_new_tokens=24).generated_ids
    # weights files that changed since (a new version, a repair) are built from again, not served from the old form
    weights = tiny_zoo / "drafts" / "code" / "model.safetensors"
    os.utime(weights, ns=(weights.stat().st_atime_ns, weights.stat().st_mtime_ns + 1_000_000))
    storage.load(spec, "code")
    assert len(quantized) == 1
    # its form replaces the old version's, which would otherwise stay in the cache for good
    (newer,) = storage._forms.values()
    assert newer.file != form.file and newer.file.is_file() and not form.file.exists()
    assert sorted(p.name for p in form.file.parent.iterdir()) == [newer.file.name]


def test_a_form_written_by_other_runtime_code_is_not_read(tiny_zoo, cache_root_in_tmp, monkeypatch):
    """Two checkouts sharing a cache (a node, and a bench from a newer tree that packs int4 otherwise) wrote a
    draft's form under one name, and the check on reading it compares shapes and dtypes only: the node's next load
    handed the other code's packing to its kernels. The runtime's code is in the name: another tree's form is not
    read (the draft is built from its files), and each tree keeps its own."""
    from memspec_ros.runtime import storage as storage_module

    spec = ModelSpec(str(tiny_zoo / "drafts" / "code"), quantization="int4")
    first = DraftStorage(MEDIA["local"])
    first.load(spec, "code")
    (mine,) = first._forms.values()
    monkeypatch.setattr(storage_module, "_code_digest", lambda: "another-tree")
    other = DraftStorage(MEDIA["local"])
    built = []
    build = storage_module.build_model
    monkeypatch.setattr(storage_module, "build_model", lambda *a, **k: built.append(1) or build(*a, **k))
    other.load(spec, "code")
    (theirs,) = other._forms.values()
    assert built == [1] and theirs.file != mine.file and mine.file.is_file() and theirs.file.is_file()


def test_a_draft_loads_where_the_os_has_no_posix_fadvise(tiny_zoo, cache_root_in_tmp, monkeypatch, caplog):
    """macOS has no os.posix_fadvise: dropping the page cache before a read raised AttributeError, and every draft
    load failed. The read goes on (its record says how much came from memory), with one warning."""
    import logging

    from memspec_ros.runtime import storage as storage_module

    monkeypatch.delattr(os, "posix_fadvise")
    storage_module._warn_no_fadvise.cache_clear()
    with caplog.at_level(logging.WARNING, logger="memspec_ros.runtime.storage"):
        storage = DraftStorage(MEDIA["local"])
        for _ in range(2):
            assert storage.load(ModelSpec(str(tiny_zoo / "drafts" / "code")), "code").model is not None
    assert caplog.text.count("no posix_fadvise") == 1
    storage_module._warn_no_fadvise.cache_clear()


def test_a_first_loads_form_writing_is_recorded_apart_from_its_build(tiny_zoo, cache_root_in_tmp, monkeypatch,
                                                                     clock_jump):
    """A first load writes the runtime form the loads after it read; that was timed as the load's build, so a node's
    first load of each draft reported the write (and its fsync) as building the draft. It is recorded apart."""
    import time

    from memspec_ros.runtime import storage as storage_module

    built, real_build, real_keep = [], storage_module.build_model, DraftStorage._keep_form

    def build_model(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return real_build(*args, **kwargs)
        finally:
            built.append(time.perf_counter() - t0)

    def slow_keep(self, *args, **kwargs):
        clock_jump(60.0)  # a slow disk
        return real_keep(self, *args, **kwargs)

    monkeypatch.setattr(storage_module, "build_model", build_model)
    monkeypatch.setattr(DraftStorage, "_keep_form", slow_keep)
    storage = DraftStorage(MEDIA["local"])
    storage.load(ModelSpec(str(tiny_zoo / "drafts" / "code")), "code")
    storage.load(ModelSpec(str(tiny_zoo / "drafts" / "code")), "code")  # from the form: nothing written
    first, again = storage.take_records()
    assert first.form_seconds >= 60.0 and first.build_seconds < built[0] + 30.0  # the build alone, the write apart
    assert again.form_seconds == 0.0 and len(built) == 1
    summary = storage.summary([first, again], 0.01)["drafts"]["code"]
    assert summary["form_seconds"] == (first.form_seconds + again.form_seconds) / 2  # reported, apart from the load
    assert summary["load_seconds"] == (first.seconds + again.seconds) / 2


def test_writing_the_runtime_form_copies_no_weight(tiny_zoo, cache_root_in_tmp, monkeypatch):
    """The form's skeleton was a deep copy of the whole draft, weights included, then emptied: at a first load the
    draft was in memory twice (three times with the blob it was built from)."""
    copied = []

    def counting(kind):
        deepcopy = kind.__deepcopy__

        def counted(self, memo):
            copied.append(self.numel())
            return deepcopy(self, memo)

        monkeypatch.setattr(kind, "__deepcopy__", counted)

    counting(torch.Tensor)
    counting(torch.nn.Parameter)
    storage = DraftStorage(MEDIA["local"])
    loaded = storage.load(ModelSpec(str(tiny_zoo / "drafts" / "code")), "code")
    assert storage._forms  # the form was written (its skeleton made)
    assert sum(copied) < 0.01 * sum(t.numel() for t in loaded.model.state_dict().values())


def test_a_stale_form_that_cannot_be_removed_leaves_the_new_form_in_use(tiny_zoo, cache_root_in_tmp, monkeypatch):
    """Pruning an older form another user owns (a shared MEMSPEC_RUNTIME_FORMS_DIR with the sticky bit) raised
    PermissionError out of the load that had just written its own form: the form was never recorded, so every later
    load built the draft from its safetensors again and rewrote the form."""
    from pathlib import Path

    from memspec_ros.runtime import forward_paths

    spec = ModelSpec(str(tiny_zoo / "drafts" / "code"), quantization="int4")
    first = DraftStorage(MEDIA["local"])
    first.load(spec, "code")
    (old,) = first._forms.values()
    weights = tiny_zoo / "drafts" / "code" / "model.safetensors"
    os.utime(weights, ns=(weights.stat().st_atime_ns, weights.stat().st_mtime_ns + 1_000_000))  # a new version
    unlink = Path.unlink

    def not_ours(path, missing_ok=False):
        if path == old.file:
            raise PermissionError(f"[Errno 1] Operation not permitted: {path}")
        return unlink(path, missing_ok=missing_ok)

    monkeypatch.setattr(Path, "unlink", not_ours)
    storage = DraftStorage(MEDIA["local"])
    storage.load(spec, "code")  # builds and writes the new version's form; the old one cannot be removed
    built = []
    monkeypatch.setattr(forward_paths, "apply_path", lambda *a, **k: built.append(a))
    storage.load(spec, "code")
    assert built == [] and old.file.exists()  # read from the new form, the other user's left alone


def test_a_damaged_runtime_form_is_built_again_from_the_source(tiny_zoo, cache_root_in_tmp, caplog):
    """A form cut short after it was written (a full disk, another process) is not the draft: the load warns,
    builds the draft from its safetensors, and writes the form again. Its record counts the form's read too: that
    paced read was paid, and the load was recorded as the safetensors' read alone, faster than it was."""
    spec = ModelSpec(str(tiny_zoo / "drafts" / "code"), quantization="int4")
    storage = DraftStorage(MEDIA["local"])
    first = storage.load(spec, "code")
    (form,) = storage._forms.values()
    size = form.file.stat().st_size
    with open(form.file, "r+b") as handle:
        handle.truncate(size // 2)
    with caplog.at_level("WARNING", logger="memspec_ros.runtime.storage"):
        again = storage.load(spec, "code")
    _same_model(again, first)
    assert "code's runtime form" in caplog.text and "building it from its safetensors again" in caplog.text
    weights = (tiny_zoo / "drafts" / "code" / "model.safetensors").stat().st_size
    assert [r.nbytes for r in storage.take_records()] == [weights, size // 2 + weights]
    assert form.file.stat().st_size == size  # written again, and the next load reads it
    storage.load(spec, "code")
    assert [r.nbytes for r in storage.take_records()] == [size]


def test_a_runtime_form_whose_tensors_changed_is_built_again_not_handed_to_the_kernels(tiny_zoo, cache_root_in_tmp,
                                                                                        caplog):
    """A well-formed form file whose tensors were swapped for smaller ones (tampered with) was built as it was: the
    C kernels take a tensor's size on trust, read past its end, and one run corrupted the heap."""
    from safetensors.torch import load_file, save_file

    spec = ModelSpec(str(tiny_zoo / "drafts" / "code"), quantization="int4")
    storage = DraftStorage(MEDIA["local"])
    first = storage.load(spec, "code")
    (form,) = storage._forms.values()
    tensors = load_file(str(form.file))
    key = next(k for k, t in tensors.items() if t.dim() == 2 and t.shape[0] > 1)
    tensors[key] = tensors[key][:1].clone()  # one row left
    save_file(tensors, str(form.file))
    with caplog.at_level("WARNING", logger="memspec_ros.runtime.storage"):
        again = storage.load(spec, "code")
    _same_model(again, first)
    assert f"changed since this process wrote it ({key}" in caplog.text and "from its safetensors again" in caplog.text


def test_forms_of_drafts_whose_files_are_gone_are_removed(tmp_path, monkeypatch):
    """A draft deleted or moved (or a temporary zoo) leaves no form behind for good: the next form written removes
    every form whose weights files are gone. Files that are not forms this code wrote stay (the folder may be one
    the user pointed MEMSPEC_RUNTIME_FORMS_DIR at, holding their models), as do partial writes, but for one a
    killed process left an hour ago."""
    import time

    from safetensors.torch import save_file

    from memspec_ros.runtime import storage as storage_module
    from memspec_ros.testing.tiny_zoo import build_tiny_zoo

    forms = tmp_path / "forms"
    monkeypatch.setenv("MEMSPEC_RUNTIME_FORMS_DIR", str(forms))
    zoo = build_tiny_zoo(tmp_path / "zoo", hidden=32, layers=1, predictor=False)
    storage = DraftStorage(MEDIA["local"])
    for name in ("code", "math"):
        storage.load(ModelSpec(str(zoo / "drafts" / name)), name)
    code, math = (form.file for form in storage._forms.values())
    (forms / "stranger.safetensors").write_bytes(b"not a form")
    save_file({"w": torch.zeros(2)}, str(forms / "model.safetensors"))  # a user's model, no form metadata
    (forms / "tmpwriting.partial").write_bytes(b"another process's form, half written")
    (forms / "tmpkilled.partial").write_bytes(b"a form a killed process left")
    hour_ago = time.time() - 3700
    os.utime(forms / "tmpkilled.partial", (hour_ago, hour_ago))
    shutil.rmtree(zoo / "drafts" / "code")
    storage.load(ModelSpec(str(zoo / "drafts" / "general")), "general")
    (general,) = (form.file for form in storage._forms.values() if form.file not in (code, math))
    assert sorted(p.name for p in forms.iterdir()) == sorted(
        [math.name, general.name, "stranger.safetensors", "model.safetensors", "tmpwriting.partial"])
    # a form no process has written for a month (of a torch version or kernel build no longer in use: its draft's
    # files are still there) goes too, as the next form is written; a recent one and the user's files stay
    month_ago = time.time() - storage_module.UNUSED_FORM_SECONDS - 60
    os.utime(math, (month_ago, month_ago))
    os.utime(general, (month_ago, month_ago))
    storage.load(ModelSpec(str(zoo / "drafts" / "general")), "general")  # read from its form: marked used
    assert general.stat().st_mtime > month_ago + 60
    os.utime(forms / "model.safetensors", (month_ago, month_ago))
    DraftStorage(MEDIA["local"]).load(ModelSpec(str(zoo / "drafts" / "general")), "general")  # a new process's
    assert sorted(p.name for p in forms.iterdir()) == sorted(
        [general.name, "stranger.safetensors", "model.safetensors", "tmpwriting.partial"])


def test_a_cache_that_cannot_take_the_runtime_form_still_loads_the_draft(tiny_zoo, tmp_path, monkeypatch, caplog):
    """A full or read-only cache folder costs later loads their speed, never the load itself: each load builds the
    draft from its safetensors, and the warning names the folder and what to set."""
    blocked = tmp_path / "not-a-folder"
    blocked.write_text("a file where the cache folder would go")
    monkeypatch.setenv("MEMSPEC_RUNTIME_FORMS_DIR", str(blocked))
    spec = ModelSpec(str(tiny_zoo / "drafts" / "code"))
    storage = DraftStorage(MEDIA["local"])
    with caplog.at_level("WARNING", logger="memspec_ros.runtime.storage"):
        first, again = storage.load(spec, "code"), storage.load(spec, "code")
    assert storage._forms == {}
    _same_model(again, first)
    weights = (tiny_zoo / "drafts" / "code" / "model.safetensors").stat().st_size
    assert [r.nbytes for r in storage.take_records()] == [weights, weights]  # both read the source
    assert "code's runtime form" in caplog.text and "MEMSPEC_RUNTIME_FORMS_DIR" in caplog.text


def test_a_full_disk_while_keeping_the_runtime_form_still_loads_the_draft(tiny_zoo, tmp_path, monkeypatch):
    """safetensors reports a write's I/O error (a full disk) as its own SafetensorError, no OSError: the load that
    had built the draft failed, and every retry with it while the disk stayed full."""
    import safetensors.torch
    from safetensors import SafetensorError

    monkeypatch.setenv("MEMSPEC_RUNTIME_FORMS_DIR", str(tmp_path / "forms"))

    def full(*args, **kwargs):
        raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")

    writes = []
    monkeypatch.setattr(safetensors.torch, "save_file", lambda *a, **k: writes.append(1) or full())
    storage = DraftStorage(MEDIA["local"])
    assert storage.load(ModelSpec(str(tiny_zoo / "drafts" / "code")), "code").model is not None
    assert storage._forms == {} and not list((tmp_path / "forms").rglob("*.partial"))
    # the next loads do not write the whole form again until the disk refuses it (on the loader thread), for a while
    assert storage.load(ModelSpec(str(tiny_zoo / "drafts" / "code")), "code").model is not None
    assert writes == [1]


def test_damaged_bytes_or_a_bad_config_value_name_the_draft_folder(tiny_zoo, tmp_path):
    """Bytes that no longer parse (a shard rewritten after its header was checked) raised safetensors' own error
    without the folder, and a config.json value of the wrong type a raw TypeError; both name the folder and the
    error's type, as load_model does."""
    import json
    import shutil

    from memspec_ros.runtime.models import ModelDirectoryError
    from memspec_ros.runtime.storage import build_model

    draft = tmp_path / "code"
    shutil.copytree(tiny_zoo / "drafts" / "code", draft)
    with pytest.raises(ModelDirectoryError, match=rf"could not build the model in {draft} from its weights: \w+"):
        build_model(ModelSpec(str(draft)), [b"\x08\x00\x00\x00\x00\x00\x00\x00not json"])
    config = json.loads((draft / "config.json").read_text())
    config["num_attention_heads"] = "four"
    (draft / "config.json").write_text(json.dumps(config))
    blob = (draft / "model.safetensors").read_bytes()
    with pytest.raises(ModelDirectoryError, match=rf"could not build the model in {draft} from its weights: \w+Error"):
        build_model(ModelSpec(str(draft)), [blob])


def test_a_missing_draft_folder_or_a_file_is_named_as_such(tiny_zoo, tmp_path):
    """Through the storage a mistyped draft folder, or the path of its weights file, was "no *.safetensors weights
    in X", which sent the user looking for weights; load_model says what is wrong, and so does the storage now."""
    from memspec_ros.runtime.models import ModelDirectoryError

    storage = DraftStorage(MEDIA["local"])
    with pytest.raises(ModelDirectoryError, match="does not exist: check the path"):
        storage.load(ModelSpec(str(tmp_path / "no-such-draft")), "code")
    with pytest.raises(ModelDirectoryError, match="is a file, not a model directory"):
        storage.load(ModelSpec(str(tiny_zoo / "drafts" / "code" / "model.safetensors")), "code")


def test_a_cache_root_that_cannot_be_named_still_loads_the_draft(tiny_zoo, tmp_path, monkeypatch):
    """MEMSPEC_RUNTIME_FORMS_DIR=~nosuchuser/x (or no home directory): naming the form's file raised RuntimeError
    outside the guard, and a draft built fine failed to load, every time. It loads, without a form."""
    monkeypatch.setenv("MEMSPEC_RUNTIME_FORMS_DIR", "~memspec-no-such-user-x/forms")
    storage = DraftStorage(MEDIA["local"])
    assert storage.load(ModelSpec(str(tiny_zoo / "drafts" / "code")), "code").model is not None
    assert storage._forms == {}


def test_a_runtime_form_that_cannot_be_made_for_another_reason_still_loads_the_draft(tiny_zoo, tmp_path, monkeypatch,
                                                                                     caplog):
    """Only an OSError was caught: any other error making the form (a model the form cannot hold) failed a draft
    that was already built."""
    from memspec_ros.runtime import storage as storage_module

    monkeypatch.setenv("MEMSPEC_RUNTIME_FORMS_DIR", str(tmp_path / "forms"))

    def cannot(*args, **kwargs):
        raise ValueError("a tensor the form cannot hold")

    tried = []
    monkeypatch.setattr(storage_module.RuntimeForm, "write", lambda *a, **k: tried.append(1) or cannot())
    storage = DraftStorage(MEDIA["local"])
    assert storage.load(ModelSpec(str(tiny_zoo / "drafts" / "code")), "code").model is not None
    assert storage._forms == {} and "ValueError: a tensor the form cannot hold" in caplog.text
    assert storage.load(ModelSpec(str(tiny_zoo / "drafts" / "code")), "code").model is not None
    assert len(tried) == 1  # the same files fail the same way: not serialized again at every load


def test_a_draft_that_keeps_its_context_outside_the_kv_cache_is_refused_by_the_storage_loader(tmp_path):
    """The node loads drafts through the storage tier, which skipped load_model's check: a Mamba draft loaded and
    proposed tokens from a forgotten prefix (only speed lost, silently)."""
    from transformers import MambaConfig, MambaForCausalLM

    from memspec_ros.runtime.models import UnsupportedArchitectureError
    from memspec_ros.testing.tiny_models import save_model_dir, tiny_tokenizer

    torch.manual_seed(0)
    config = MambaConfig(vocab_size=300, hidden_size=64, state_size=8, num_hidden_layers=2, expand=2, conv_kernel=4)
    path = save_model_dir(MambaForCausalLM(config), tiny_tokenizer(300), tmp_path / "mamba")
    with pytest.raises(UnsupportedArchitectureError, match="does not keep its context in the KV cache|cached prefix"):
        DraftStorage(MEDIA["local"]).load(ModelSpec(str(path)), "mamba")


def test_the_registry_loader_reads_through_the_medium_and_records_each_load(tiny_zoo):
    registry = DraftRegistry.from_yaml(tiny_zoo / "registry.yaml", validate=False)
    medium = StorageMedium("test", read_bytes_per_second=50e6, request_latency_seconds=1e-4)
    storage = DraftStorage(medium)
    load = registry_loader(registry, storage=storage)
    for name in ("general", "math", "general"):
        assert load(name).model is not None
    records = storage.take_records()
    assert [r.name for r in records] == ["general", "math", "general"]  # every load is cold, repeats too
    assert all(r.read_seconds >= medium.min_read_seconds(r.nbytes) for r in records)
    summary = storage.summary(records, iteration_seconds=0.01)
    assert summary["medium"] == "test" and summary["drafts"]["general"]["loads"] == 2
    general = summary["drafts"]["general"]
    assert general["load_to_iteration"] == pytest.approx(general["load_seconds"] / 0.01)
    assert storage.take_records() == []


def test_a_load_in_iterations_weighs_every_draft_the_same_in_the_summary_and_the_figures():
    """The bench's summary averaged over load records (a draft loaded more often weighed more) and the storage figure
    over drafts: two definitions of one ratio (the two figures for a medium on the results page also differ by their
    load samples and iteration times, which no definition removes)."""
    from memspec_ros.runtime.storage import LoadRecord, load_to_iteration, mean_load_seconds

    records = [LoadRecord("general", 100, 1, 0.3, 0.0, None)] * 3 + [LoadRecord("math", 100, 1, 0.1, 0.0, None)]
    storage = DraftStorage(MEDIA["local"])
    summary = storage.summary(records, iteration_seconds=0.01)
    assert summary["load_seconds"] == pytest.approx(0.2)  # (0.3 + 0.1) / 2, not (3 * 0.3 + 0.1) / 4
    assert summary["load_to_iteration"] == pytest.approx(20.0) == load_to_iteration(mean_load_seconds(records), 0.01)
    assert load_to_iteration({}, 0.01) is None and load_to_iteration({"a": 1.0}, 0.0) is None


@pytest.fixture
def cache_root_in_tmp(tmp_path, monkeypatch):
    """The cache root in a temporary folder, with the runtime forms in their default place under it (the session
    keeps its own forms folder otherwise: conftest)."""
    monkeypatch.setenv("MEMSPEC_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("MEMSPEC_RUNTIME_FORMS_DIR")
    return tmp_path


@pytest.fixture(scope="module")
def tiny_zoo(tmp_path_factory):
    from memspec_ros.testing.tiny_zoo import build_tiny_zoo

    return build_tiny_zoo(tmp_path_factory.mktemp("zoo"), hidden=64, layers=2, predictor=False)


def test_steady_loads_time_what_a_running_node_reads_not_the_first_build(tiny_zoo):
    """A bench's load times (Oracle-Dynamic's costs, the storage sweep, the engine bench) are loads as the timed runs
    make them, in their forward path: after a draft's first load in the process built it, a load reads its runtime
    form. The first build is not among the records."""
    from memspec_ros.runtime.cache import draft_spec

    storage = DraftStorage(MEDIA["local"])
    spec = draft_spec(str(tiny_zoo / "drafts" / "code"), quantization="int8")
    storage.load(draft_spec(str(tiny_zoo / "drafts" / "math")), "math")  # an earlier record: not returned
    records = storage.steady_loads({"code": spec}, repeats=2)
    (form,) = (f for key, f in storage._forms.items() if key[0].endswith("code"))
    assert [r.name for r in records] == ["code", "code"]
    assert all(r.nbytes == form.file.stat().st_size for r in records)  # the int8 form read, not the safetensors
    weights = sum(f.stat().st_size for f in (tiny_zoo / "drafts" / "code").glob("*.safetensors"))
    assert form.file.stat().st_size < weights
    assert storage.take_records() == []


def test_an_edited_vocabulary_map_or_config_is_read_by_the_next_load(tmp_path):
    """The build reads config.json and a reduced draft's draft_vocab.json besides the weights: editing either (the
    weights untouched) builds the draft again, and the cache manager's change detection (weights_identity) sees it.
    Keyed on the safetensors alone, the runtime form kept the old id map and architecture."""
    import json

    from memspec_ros.runtime.draft_vocab import write_vocab_map
    from memspec_ros.runtime.storage import weights_identity
    from memspec_ros.testing.tiny_models import save_model_dir, tiny_llama, tiny_tokenizer

    rows = list(range(0, 60, 3))
    path = save_model_dir(tiny_llama(vocab_size=len(rows) + 1, hidden=32, layers=1, seed=4), tiny_tokenizer(),
                          tmp_path / "d")
    write_vocab_map(path, rows, 64)
    storage = DraftStorage(MEDIA["local"])
    spec = ModelSpec(str(path))
    assert storage.load(spec).model.vocab.target_ids.tolist() == rows
    before = weights_identity(path)
    write_vocab_map(path, [r + 1 for r in rows], 64)
    assert weights_identity(path) != before
    assert storage.load(spec).model.vocab.target_ids.tolist() == [r + 1 for r in rows]
    config = json.loads((path / "config.json").read_text())
    config["rms_norm_eps"] = 0.125
    (path / "config.json").write_text(json.dumps(config))
    assert storage.load(spec).model.config.rms_norm_eps == 0.125


def test_weights_replaced_at_the_same_size_and_modification_time_are_read_by_the_next_load(tmp_path):
    """Keyed on path, size and mtime, a weights file replaced by `cp -p` (same size, same mtime, other inode) kept
    the old weights' runtime form, and the cache manager's change detection saw no change."""
    import os
    import shutil

    import torch

    from memspec_ros.runtime.storage import weights_identity
    from memspec_ros.testing.tiny_models import save_model_dir, tiny_llama, tiny_tokenizer

    path = save_model_dir(tiny_llama(hidden=32, layers=1, seed=4), tiny_tokenizer(), tmp_path / "d")
    other = save_model_dir(tiny_llama(hidden=32, layers=1, seed=5), tiny_tokenizer(), tmp_path / "e")
    storage = DraftStorage(MEDIA["local"])
    spec = ModelSpec(str(path))
    ids = torch.tensor([[1, 2, 3]])
    first = storage.load(spec).model(ids).logits
    before = weights_identity(path)
    weights = path / "model.safetensors"
    stat = weights.stat()
    assert (other / "model.safetensors").stat().st_size == stat.st_size
    weights.unlink()
    shutil.copyfile(other / "model.safetensors", weights)
    os.utime(weights, ns=(stat.st_atime_ns, stat.st_mtime_ns))  # as cp -p keeps it
    assert weights_identity(path) != before
    again = storage.load(spec).model(ids).logits
    assert not torch.equal(again, first)
    assert torch.equal(again, storage.load(ModelSpec(str(other))).model(ids).logits)


def test_the_node_s_storage_keeps_no_records_while_a_bench_s_does(tiny_zoo):
    """registry_loader(storage="emmc") (the node's draft cache, memspec cache.storage) makes its DraftStorage with
    draft_storage: nothing reads its records, so it keeps none (one LoadRecord a load accumulated for as long as
    the node ran). A DraftStorage made by a bench records every load until take_records."""
    from memspec_ros.runtime.cache import draft_spec
    from memspec_ros.runtime.storage import draft_storage

    spec = draft_spec(str(tiny_zoo / "drafts" / "code"))
    node = draft_storage("local")
    bench = DraftStorage(MEDIA["local"])
    assert draft_storage(bench) is bench
    for _ in range(3):
        node.load(spec, "code")
        bench.load(spec, "code")
    assert node.records == [] and node.take_records() == []
    assert [r.name for r in bench.take_records()] == ["code"] * 3


@pytest.mark.parametrize("quantization_config, named", [("gptq", "a quantization_config"),
                                                        ({"quant_method": "awq"}, "'awq'")])
def test_a_quantized_draft_config_is_refused_by_name(tiny_zoo, tmp_path, quantization_config, named):
    """A quantization_config that is no object (a string) raised AttributeError inside the refusal's own message,
    and that became the draft's recorded failure."""
    import json
    import shutil

    from memspec_ros.runtime.storage import build_model

    draft = tmp_path / "draft"
    shutil.copytree(tiny_zoo / "drafts" / "code", draft)
    config = json.loads((draft / "config.json").read_text())
    (draft / "config.json").write_text(json.dumps(config | {"quantization_config": quantization_config}))
    with pytest.raises(ValueError, match=f"builds plain drafts .*, not {named}"):
        build_model(ModelSpec(str(draft)), [])
