"""The draft registry: YAML and parameter lists, validation with specific errors, live add/remove."""

from __future__ import annotations

import pytest

from memspec_ros.runtime import draft_forward
from memspec_ros.runtime.cache import registry_loader
from memspec_ros.runtime.models import ModelDirectoryError, TokenizerMismatchError, tokenizer_fingerprint
from memspec_ros.runtime.registry import (
    MAX_REGISTRY_BYTES,
    DraftEntry,
    DraftRegistry,
    DuplicateDraftError,
    RegistryError,
    UnknownDraftError,
)
from memspec_ros.testing.tiny_models import save_model_dir, tiny_llama, tiny_tokenizer


@pytest.fixture(scope="module")
def zoo(tmp_path_factory):
    root = tmp_path_factory.mktemp("zoo")
    tok = tiny_tokenizer()
    save_model_dir(tiny_llama(layers=1, hidden=32, seed=0), tok, root / "target")
    for i, name in enumerate(["general", "code"]):
        save_model_dir(tiny_llama(layers=1, hidden=32, seed=i + 1), tok, root / "drafts" / name)
    save_model_dir(tiny_llama(layers=1, hidden=32, seed=9), tiny_tokenizer(vocab_size=280), root / "drafts" / "alien")
    (root / "registry.yaml").write_text(
        "target: {path: target}\n"
        "drafts:\n"
        "  - {name: general, path: drafts/general, domain: general}\n"
        "  - {name: code, path: drafts/code, domain: code}\n"
    )
    return root


def test_yaml_paths_relative_to_file_and_sizes(zoo):
    reg = DraftRegistry.from_yaml(zoo / "registry.yaml")
    assert reg.names() == ["general", "code"]
    entry = reg.get("code")
    assert entry.path == str((zoo / "drafts" / "code").resolve()) and entry.domain == "code"
    assert entry.size_bytes > 0  # estimated from the safetensors files before any load
    assert reg.target_path == str((zoo / "target").resolve())
    loaded = registry_loader(reg)("code")
    assert loaded.size_bytes > 0
    # the engine's forward for it was built by the loader (its thread), not left to the first decode iteration
    assert loaded.model in draft_forward._LEAN and draft_forward._LEAN[loaded.model] is not None


def test_yaml_mapping_form_and_errors(zoo, tmp_path):
    (tmp_path / "r.yaml").write_text(f"drafts:\n  general: {{path: {zoo}/drafts/general}}\n")
    assert DraftRegistry.from_yaml(tmp_path / "r.yaml").get("general").domain == "general"
    with pytest.raises(RegistryError, match="does not exist"):
        DraftRegistry.from_yaml(tmp_path / "missing.yaml")
    with pytest.raises(RegistryError, match="is a directory: name its registry file"):  # said "does not exist"
        DraftRegistry.from_yaml(tmp_path)
    (tmp_path / "bad.yaml").write_text("models: []\n")
    with pytest.raises(RegistryError, match="drafts"):
        DraftRegistry.from_yaml(tmp_path / "bad.yaml")
    (tmp_path / "noname.yaml").write_text("drafts:\n  - {path: x}\n")
    with pytest.raises(RegistryError, match="name"):
        DraftRegistry.from_yaml(tmp_path / "noname.yaml")


@pytest.mark.parametrize("text, match", [
    # a null field was the string 'None': a draft named None, a path <registry dir>/None, a domain 'None'
    ("drafts:\n  - {name: , path: drafts/code}\n", r"drafts\[0\] in .*r\.yaml: 'name' is None: give it a string"),
    ("drafts:\n  - {name: code, path: }\n", r"drafts\[0\] \('code'\) in .*r\.yaml: 'path' is None.*the field is empty"),
    ("drafts:\n  - {name: code, path: drafts/code, domain: }\n", r"drafts\[0\] \('code'\) in .*: 'domain' is None"),
    ("drafts:\n  code: \n", r"drafts\[0\] \('code'\) in .*: 'path' is None"),
    ("drafts:\n  - {name: code, path: ''}\n", r"'path' is empty"),
    ("drafts:\n  - {name: [a], path: drafts/code}\n", r"'name' is \['a'\]: give it a string"),
    # a mapping keeps the last of two equal keys: the first draft vanished, DuplicateDraftError never saw it
    ("drafts:\n  code: drafts/code\n  code: drafts/general\n", r"r\.yaml: line 3: the key 'code' appears twice"),
    ("drafts:\n  - {name: code, path: drafts/code, path: drafts/general}\n", r"line 2: the key 'path' appears twice"),
    # a bare int() ValueError
    ("drafts:\n  - {name: code, path: drafts/code, size_bytes: 7.6MB}\n",
     r"drafts\[0\] \('code'\) in .*r\.yaml: 'size_bytes' is '7.6MB': give a whole number of bytes"),
    ("drafts:\n  - {name: code, path: drafts/code, size_bytes: -5}\n", r"'size_bytes' is -5"),
    ("drafts:\n  - {name: code, path: drafts/code, size_bytes: 7.5}\n", r"'size_bytes' is 7.5"),
    # a typo past what ~/cache_state's uint64 holds: every cache_state message failed to build, 10 times a second
    ("drafts:\n  - {name: code, path: drafts/code, size_bytes: 9223372036854775808}\n",
     r"'size_bytes' is 9223372036854775808, more than any memory"),  # 2**63: one past an int64
    ("drafts:\n  - {name: code, path: drafts/code, size_bytes: '9223372036854775808'}\n",
     r"'size_bytes' is 9223372036854775808, more than any memory"),  # as text, read as the number
])
def test_a_malformed_registry_entry_is_refused_naming_the_file_and_field(zoo, text, match):
    (zoo / "r.yaml").write_text(text)
    try:
        with pytest.raises(RegistryError, match=match):
            DraftRegistry.from_yaml(zoo / "r.yaml", validate=False)
    finally:
        (zoo / "r.yaml").unlink()


@pytest.mark.parametrize("text, match", [
    ("aws_key: [AKIA_SECRET\n", r"r\.yaml is not valid YAML at line 2, column 1: fix the syntax$"),
    ("drafts:\n  - token=hf_SECRET\n", r"drafts\[0\] in .*r\.yaml needs at least 'name' and 'path' \(got a str\)$"),
    ("drafts:\n  - {name: code, token: hf_SECRET}\n", r"\(got keys name, token\)$"),
    # the mapping form's key is the name: an inner 'name' silently renamed the draft
    ("drafts:\n  code: {name: math, path: drafts/code}\n", r"drafts\.code in .*r\.yaml also names itself 'math'"),
    # ignored, these left configure saying "names no target: set model.target_path"
    ("target: 5\ndrafts:\n  - {name: code, path: drafts/code}\n", r"'target' in .*r\.yaml must be a path .*not a int"),
    ("target: {path: }\ndrafts:\n  - {name: code, path: drafts/code}\n", r"must be a path .*not an empty one"),
    ("target: {path: 5}\ndrafts:\n  - {name: code, path: drafts/code}\n", r"must be a path .*not a int"),
    ("target: {pth: t}\ndrafts:\n  - {name: code, path: drafts/code}\n", r"'target' in .*unknown key 'pth'"),
    ("drafts:\n  - {name: code, path: drafts/code}\n  - {name: code, path: drafts/general}\n",
     r"drafts\[1\] \('code'\) in .*r\.yaml has the name of drafts\[0\]"),
    ("target: ''\ndrafts:\n  - {name: code, path: drafts/code}\n", r"must be a path .*not an empty one"),
    # `target:` with nothing after it (YAML's null) was skipped like no key at all
    ("target:\ndrafts:\n  - {name: code, path: drafts/code}\n", r"'target' in .*r\.yaml is empty: write its path"),
])
def test_a_registry_error_says_where_without_echoing_the_files_text(zoo, text, match):
    """Registry errors reach whoever sets drafts.registry_file (the reply and the log): PyYAML's message and the
    entry's repr quoted the file, so naming a credentials file by mistake echoed its secrets."""
    (zoo / "r.yaml").write_text(text)
    try:
        with pytest.raises(RegistryError, match=match) as info:
            DraftRegistry.from_yaml(zoo / "r.yaml", validate=False)
    finally:
        (zoo / "r.yaml").unlink()
    assert "SECRET" not in str(info.value) and info.value.__cause__ is None


def test_well_formed_registry_fields_still_read(zoo):
    """What the checks keep: a quoted size, a null size (estimated), a numeric name, the domain defaulting."""
    (zoo / "r.yaml").write_text("drafts:\n  - {name: code, path: drafts/code, size_bytes: '123'}\n"
                                "  - {name: 7, path: drafts/general, size_bytes: }\n")
    try:
        reg = DraftRegistry.from_yaml(zoo / "r.yaml")
    finally:
        (zoo / "r.yaml").unlink()
    assert reg.get("code").size_bytes == 123 and reg.get("code").domain == "code"
    assert reg.get("7").size_bytes > 0 and reg.get("7").domain == "7"


def test_lists_from_ros_parameters(zoo):
    reg = DraftRegistry.from_lists(["g", "c"], ["drafts/general", "drafts/code"], ["general", "code"], base_dir=zoo)
    assert reg.get("c").domain == "code"
    with pytest.raises(RegistryError, match="one path per name"):
        DraftRegistry.from_lists(["g", "c"], ["drafts/general"], base_dir=zoo)
    with pytest.raises(RegistryError, match="domain"):
        DraftRegistry.from_lists(["g"], ["drafts/general"], ["a", "b"], base_dir=zoo)
    # a name listed twice: "already registered: remove it first" named no list to fix
    with pytest.raises(RegistryError, match="drafts.names lists 'g' twice"):
        DraftRegistry.from_lists(["g", "g"], ["drafts/general", "drafts/code"], base_dir=zoo)
    # an empty name or domain, which the YAML refuses, was taken from the parameters
    with pytest.raises(RegistryError, match=r"drafts.domains\[0\] \('g'\) is empty"):
        DraftRegistry.from_lists(["g"], ["drafts/general"], [""], base_dir=zoo)
    with pytest.raises(RegistryError, match=r"drafts.names\[1\] is empty"):
        DraftRegistry.from_lists(["g", " "], ["drafts/general", "drafts/code"], base_dir=zoo)


def test_a_registry_names_itself_when_it_is_not_utf8_and_expands_a_tilde(zoo, tmp_path, monkeypatch):
    """A Latin-1 registry failed with the codec's message alone, no file named; a path "~/x" was taken for a
    folder named "~" beside the registry."""
    (zoo / "r.yaml").write_bytes("drafts:\n  - {name: caf\u00e9, path: drafts/code}\n".encode("latin-1"))
    try:
        with pytest.raises(RegistryError, match=r"r\.yaml is not UTF-8 text \(byte 0xe9"):
            DraftRegistry.from_yaml(zoo / "r.yaml", validate=False)
    finally:
        (zoo / "r.yaml").unlink()
    monkeypatch.setenv("HOME", str(tmp_path))
    (zoo / "r.yaml").write_text("drafts:\n  - {name: code, path: ~/drafts/code}\n")
    try:
        reg = DraftRegistry.from_yaml(zoo / "r.yaml", validate=False)
    finally:
        (zoo / "r.yaml").unlink()
    assert reg.get("code").path == str((tmp_path / "drafts" / "code").resolve())
    from memspec_ros.runtime.model_source import relative_to

    # "~name" of no such user: the path as written (expanduser's bare RuntimeError named no file or entry)
    assert relative_to(zoo, "~no_such_user_x/d") == str((zoo / "~no_such_user_x" / "d").resolve())


def test_validation_errors_name_the_problem(zoo):
    fp = tokenizer_fingerprint(tiny_tokenizer())
    reg = DraftRegistry(target_fingerprint=fp)
    reg.add(DraftEntry("general", str(zoo / "drafts" / "general")))
    with pytest.raises(DuplicateDraftError, match="general"):
        reg.add(DraftEntry("general", str(zoo / "drafts" / "code")))
    with pytest.raises(ModelDirectoryError, match="does not exist"):
        reg.add(DraftEntry("ghost", str(zoo / "drafts" / "ghost")))
    with pytest.raises(TokenizerMismatchError, match="alien"):
        reg.add(DraftEntry("alien", str(zoo / "drafts" / "alien")))
    with pytest.raises(UnknownDraftError, match="ghost"):
        reg.remove("ghost")
    with pytest.raises(RegistryError, match="empty name"):
        reg.add(DraftEntry(" ", str(zoo / "drafts" / "code")))
    with pytest.raises(RegistryError, match="reserved for copies"):
        reg.add(DraftEntry("lookup", str(zoo / "drafts" / "code")))
    assert reg.names() == ["general"]  # failed adds changed nothing
    # the target's tokenizer is read from the registry's target when validating a YAML
    with_target = DraftRegistry.from_yaml(zoo / "registry.yaml")
    with pytest.raises(TokenizerMismatchError):
        with_target.add(DraftEntry("alien", str(zoo / "drafts" / "alien")))


def test_add_remove_bump_version(zoo):
    reg = DraftRegistry.from_yaml(zoo / "registry.yaml", validate=False)
    v = reg.version
    reg.remove("code")
    assert reg.version == v + 1 and "code" not in reg
    reg.add(DraftEntry("code", str(zoo / "drafts" / "code"), "code"))
    assert reg.version == v + 2 and len(reg) == 2 and [e.name for e in reg.by_domain("code")] == ["code"]


def test_a_registry_takes_another_checked_registrys_entries_in_one_step_without_reading_them(zoo, monkeypatch):
    """The node swaps its registry while goals are held back: the entries were checked when the new registry was
    built, so the swap reads no tokenizer (it read one per draft again, 2.4 s for the bundled zoo's five while
    every goal callback waited)."""
    from memspec_ros.runtime import registry as registry_module

    fingerprint = tokenizer_fingerprint(tiny_tokenizer())
    live = DraftRegistry.from_yaml(zoo / "registry.yaml", target_fingerprint=fingerprint)
    wanted = DraftRegistry([DraftEntry("code", str(zoo / "drafts" / "code"), "code")], target_fingerprint=fingerprint)
    version = live.version

    def no_reading(*args, **kwargs):
        raise AssertionError("the swap read a tokenizer")

    monkeypatch.setattr(registry_module, "load_tokenizer", no_reading)
    gone = live.replace_with(wanted)
    assert [e.name for e in gone] == ["general"] and live.names() == ["code"] and live.version == version + 1
    assert live.replace_with(wanted) == [] and live.version == version + 1  # the same set: no new version
    unchecked = DraftRegistry([DraftEntry("general", str(zoo / "drafts" / "general"), "general")], validate=False)
    with pytest.raises(ValueError, match="did not check its drafts"):
        live.replace_with(unchecked)
    assert live.names() == ["code"]


@pytest.fixture(autouse=True)
def _one_thread(one_thread):
    """Every test of this module on one thread (conftest.one_thread)."""


def test_a_resident_draft_whose_files_changed_is_evicted_on_request(zoo, tmp_path):
    """evict_changed (the node calls it when the registry is set): a draft read before its files were restored or
    replaced leaves memory, so the next prefetch reads the files as they are; unchanged drafts stay."""
    import os
    import shutil

    from memspec_ros.runtime.cache import DraftCacheManager

    for name in ("general", "code"):
        shutil.copytree(zoo / "drafts" / name, tmp_path / name)
    reg = DraftRegistry([DraftEntry(n, str(tmp_path / n), n, 0) for n in ("general", "code")])
    evicted: list[str] = []
    cache = DraftCacheManager(2, registry_loader(reg))
    cache.on_evict.append(evicted.append)
    try:
        for name in ("general", "code"):
            cache.request(name)
            cache.wait_for(name)
        assert cache.evict_changed() == [] and sorted(cache.resident()) == ["code", "general"]
        weights = tmp_path / "code" / "model.safetensors"
        weights.write_bytes(weights.read_bytes())  # the same bytes written again: a restore
        stat = weights.stat()
        os.utime(weights, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000_000))
        assert cache.evict_changed() == ["code"] and cache.resident() == ["general"] and evicted == ["code"]
        cache.request("code")  # read again: now it matches its files
        cache.wait_for("code")
        assert cache.evict_changed() == []
        shutil.rmtree(tmp_path / "general")  # gone from the disk: changed too
        assert cache.evict_changed() == ["general"]
    finally:
        cache.close()


def test_a_load_in_flight_when_files_change_is_dropped_when_it_lands(zoo, tmp_path):
    import os
    import shutil
    import threading

    from memspec_ros.runtime.cache import DraftCacheManager

    shutil.copytree(zoo / "drafts" / "code", tmp_path / "code")
    reg = DraftRegistry([DraftEntry("code", str(tmp_path / "code"), "code", 0)])
    read, release = threading.Event(), threading.Event()
    load = registry_loader(reg)

    def slow(name):
        loaded = load(name)  # the files as they were
        read.set()
        release.wait(10)
        return loaded

    cache = DraftCacheManager(1, slow)
    try:
        cache.request("code")
        assert read.wait(10)
        assert cache.evict_changed() == []  # nothing resident yet; the load is marked to be checked
        weights = tmp_path / "code" / "model.safetensors"
        stat = weights.stat()
        os.utime(weights, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000_000))
        release.set()
        cache.drain(10)
        assert cache.resident() == [] and cache.loading() == []
        cache.request("code")  # the next prefetch reads the files as they are now
        cache.wait_for("code")
        assert cache.resident() == ["code"]
    finally:
        release.set()
        cache.close()


def test_a_draft_of_the_same_tokenizer_but_another_logit_width_fails_to_load(zoo, tmp_path):
    """The registry checks tokenizers; a draft scoring more ids than the target (a sibling model with padded rows)
    would break the sampling rule's p - q, or propose ids the target has no row for. It fails to load with the
    reason, and the goal goes on without it: greedy output is still the target's."""
    from memspec_ros.runtime.controller import RuntimeConfig, RuntimeController
    from memspec_ros.runtime.models import ModelSpec, load_model
    from memspec_ros.runtime.oracle import target_greedy

    save_model_dir(tiny_llama(vocab_size=80, layers=1, hidden=32, seed=5), tiny_tokenizer(), tmp_path / "wide")
    reg = DraftRegistry([DraftEntry("wide", str(tmp_path / "wide"), "general", 0)])  # tokenizers match
    target = load_model(ModelSpec(str(zoo / "target"))).model
    assert target.config.vocab_size == 64
    with pytest.raises(TokenizerMismatchError, match="scores 80 token ids, the target 64"):
        registry_loader(reg, target_vocab_size=64)("wide")
    ctl = RuntimeController(RuntimeConfig(policy="general-static", general_draft="wide"), target, None, reg, None,
                            eos_token_ids=[])
    try:
        prompt = [1, 5, 7, 9]
        out = ctl.generate(prompt, 12)
        assert out.token_ids == target_greedy(target, prompt, 12)
        assert "scores 80 token ids" in str(ctl.cache.failed()["wide"])
    finally:
        ctl.close()


def test_a_registry_that_knows_the_targets_width_refuses_such_a_draft_when_it_is_registered(zoo, tmp_path):
    """Checked at configure (and at a run-time registry change) from the draft's files, not at each load, where it
    was taken out of service while the goals ran without it; a reduced-vocabulary draft's width is its map's
    target vocabulary. load_models hands the target's width in."""
    from memspec_ros.runtime.draft_vocab import write_vocab_map
    from memspec_ros.runtime.loader import load_models, open_registry

    save_model_dir(tiny_llama(vocab_size=80, layers=1, hidden=32, seed=5), tiny_tokenizer(), tmp_path / "wide")
    fingerprint = tokenizer_fingerprint(tiny_tokenizer())
    with pytest.raises(TokenizerMismatchError, match="draft 'wide' .* scores 80 token ids, the target 64"):
        DraftRegistry([DraftEntry("wide", str(tmp_path / "wide"), "general", 0)], target_fingerprint=fingerprint,
                      target_vocab_size=64)
    # 31 rows of a reduced-vocabulary draft (30 ids and the shared row), speaking a 64-id target: taken
    save_model_dir(tiny_llama(vocab_size=31, layers=1, hidden=32, seed=6), tiny_tokenizer(), tmp_path / "reduced")
    write_vocab_map(tmp_path / "reduced", list(range(30)), 64)
    DraftRegistry([DraftEntry("reduced", str(tmp_path / "reduced"), "general", 0)], target_fingerprint=fingerprint,
                  target_vocab_size=64)
    tok = tiny_tokenizer()  # a target whose rows fit its tokenizer, and a draft of 16 padded rows more
    save_model_dir(tiny_llama(vocab_size=len(tok), layers=1, hidden=32, seed=7), tok, tmp_path / "target")
    save_model_dir(tiny_llama(vocab_size=len(tok) + 16, layers=1, hidden=32, seed=8), tok, tmp_path / "padded")
    (tmp_path / "registry.yaml").write_text(f"target: {{path: {tmp_path / 'target'}}}\n"
                                            f"drafts:\n  - {{name: padded, path: {tmp_path / 'padded'}}}\n")
    with pytest.raises(TokenizerMismatchError, match=f"scores {len(tok) + 16} token ids, the target {len(tok)}"):
        load_models(tmp_path / "registry.yaml")
    open_registry(tmp_path / "registry.yaml", fingerprint=fingerprint)  # unchecked without the width


def test_a_gguf_draft_is_registered_sized_loaded_and_kept_until_its_file_changes(zoo, tmp_path, monkeypatch):
    """A draft path may name a GGUF file (as the target's may): the registry checks its conversion (config,
    safetensors, tokenizer) and reserves the converted weights' bytes, the cache loads it, and evict_changed judges
    the GGUF file, not the conversion (which it compared with the GGUF's identity, so it always looked changed)."""
    import os

    from memspec_ros.runtime import model_source
    from memspec_ros.runtime.cache import DraftCacheManager

    monkeypatch.setenv("MEMSPEC_CACHE_DIR", str(tmp_path / "cache"))
    tok = tiny_tokenizer()

    def fake_convert(path, out):  # transformers' GGUF conversion is tested on the bundled model
        save_model_dir(tiny_llama(layers=1, hidden=32, seed=4), tok, out)

    monkeypatch.setattr(model_source, "convert_gguf", fake_convert)
    gguf = tmp_path / "drafts" / "d.gguf"
    gguf.parent.mkdir()
    gguf.write_bytes(b"GGUF stand-in")
    (tmp_path / "registry.yaml").write_text("drafts:\n  - {name: d, path: drafts/d.gguf, domain: code}\n")
    reg = DraftRegistry.from_yaml(tmp_path / "registry.yaml",
                                  target_fingerprint=tokenizer_fingerprint(tiny_tokenizer()))
    entry = reg.get("d")
    assert entry.path == str(gguf.resolve()) and entry.size_bytes > 1000  # the converted weights, not 0
    cache = DraftCacheManager(1, registry_loader(reg))
    try:
        cache.request("d")
        cache.wait_for("d")
        assert cache.resident() == ["d"] and cache.evict_changed() == []
        stat = gguf.stat()
        os.utime(gguf, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000_000))
        assert cache.evict_changed() == ["d"]
    finally:
        cache.close()


def test_the_tokenizer_fingerprint_is_the_vocabulary_not_the_special_tokens_names():
    """Converters name the special tokens differently for the same ids (transformers 5.17 and 5.23 on the bundled
    GGUF): a datastore or draft made under one must not be refused under the other; another vocabulary must."""
    tok = tiny_tokenizer(chat=True)
    before = tokenizer_fingerprint(tok)
    tok.eos_token, tok.pad_token = "<|im_start|>", None
    assert tokenizer_fingerprint(tok) == before
    tok.add_tokens(["a-brand-new-token"])
    assert tokenizer_fingerprint(tok) != before


def test_quantized_drafts_load_in_fp32_and_are_refused_off_the_cpu(zoo):
    """A bf16 target's drafts on the default int4 path failed at every load on the loader thread (the node decoded
    with the target alone, the message naming the target's dtype), and on cuda the CPU kernels were handed device
    memory: both are settled when the loader is made."""
    reg = DraftRegistry.from_yaml(zoo / "registry.yaml")
    loaded = registry_loader(reg, "bf16", quantization="int4")("code")
    assert loaded.spec.quantization == "int4" and loaded.spec.dtype == "fp32"
    for quantization in ("int8", "int4", "auto"):
        with pytest.raises(ValueError, match="drafts on cuda need quantization 'none'"):
            registry_loader(reg, "fp32", "cuda", quantization=quantization)
    with pytest.raises(ValueError, match="unknown quantization 'int3'"):
        registry_loader(reg, quantization="int3")


def test_an_entry_made_in_code_gets_the_yamls_checks():
    """DraftRegistry.add took a negative size for "estimate", a size past any memory (which broke every
    ~/cache_state message), "7MB" as a bare TypeError, an empty domain, a name of 3.5 and a pathlib.Path with an
    AttributeError; from_lists took an empty path for the registry's own folder."""
    from pathlib import Path

    reg = DraftRegistry([], validate=False)
    for entry, said in ((DraftEntry("x", "/p", "x", -5), "size_bytes"),
                        (DraftEntry("x", "/p", "x", 2**70), "more than any memory"),
                        (DraftEntry("x", "/p", "x", "7MB"), "whole number of bytes"),
                        (DraftEntry("x", "/p", ""), "domain is empty"),
                        (DraftEntry(3.5, "/p"), "name is 3.5")):
        with pytest.raises(RegistryError, match=said):
            reg.add(entry)
    assert reg.names() == []
    assert reg.add(DraftEntry("x", Path("/p"), "x", 10)) == DraftEntry("x", "/p", "x", 10)
    with pytest.raises(RegistryError, match=r"drafts.paths\[1\] is empty"):
        DraftRegistry.from_lists(["a", "b"], ["/a", " "], validate=False)
    listed = DraftRegistry.from_lists(["a"], [Path("a")], base_dir="/zoo", validate=False)
    assert listed.get("a").path == str(Path("/zoo/a").resolve())


def test_an_entry_made_in_code_may_have_a_numpy_size_and_any_path_like():
    from pathlib import PurePosixPath

    import numpy as np

    from memspec_ros.runtime.registry import DraftEntry, DraftRegistry

    reg = DraftRegistry([], validate=False)
    assert reg.add(DraftEntry("x", PurePosixPath("/p"), "x", np.int64(10))) == DraftEntry("x", "/p", "x", 10)


def test_lists_given_as_one_string_are_refused_not_split_into_characters():
    """from_lists("code", "/p/c") made four drafts, c, o, d and e, at paths "/", "p", "/" and "c"."""
    from memspec_ros.runtime.registry import RegistryError

    for names, paths, domains in (("code", ["/p/c"], ()), (["code"], "/p/c", ()), (["code"], ["/p/c"], "code")):
        with pytest.raises(RegistryError, match="must be a list, got one str"):
            DraftRegistry.from_lists(names, paths, domains, validate=False)


def test_a_registry_file_that_would_expand_or_is_no_registry_is_refused_in_a_line(tmp_path):
    """Aliases nested a few levels deep (476 bytes) expanded to gigabytes, quoted whole in the error; a large file
    named by mistake (a tokenizer.json) was parsed for seconds in a parameter callback; a draft_vocab.json with
    target_vocab_size Infinity failed in a bare OverflowError naming no file."""
    from memspec_ros.runtime.draft_vocab import DraftVocabError, read_vocab_map

    levels = ["a0: &a0 [x, x, x, x, x, x, x, x, x]"] + [
        f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 9)}]" for i in range(1, 9)]
    bomb = tmp_path / "bomb.yaml"
    bomb.write_text("tokenizer:\n" + "".join(f"  {line}\n" for line in levels) + "drafts: [{name: *a8, path: x}]\n")
    with pytest.raises(RegistryError, match=r"line \d+: an alias \(\*name\)") as refused:
        DraftRegistry.from_yaml(bomb, validate=False)
    assert len(str(refused.value)) < 400
    big = tmp_path / "tokenizer.json"
    big.write_text("x" * (MAX_REGISTRY_BYTES + 1))
    with pytest.raises(RegistryError, match="more than a registry file's"):
        DraftRegistry.from_yaml(big, validate=False)
    long = tmp_path / "long.yaml"
    long.write_text("drafts: [{name: [" + "x" * 500 + "], path: p}]\n")
    with pytest.raises(RegistryError, match=r"is \['xxxx*\.\.\.: give it a string") as refused:
        DraftRegistry.from_yaml(long, validate=False)
    assert len(str(refused.value)) < 400  # the value cut to a line, not quoted whole
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "draft_vocab.json").write_text('{"target_vocab_size": Infinity, "target_ids": [1]}')
    with pytest.raises(DraftVocabError, match="draft_vocab.json is not a valid draft vocabulary.*whole number"):
        read_vocab_map(tmp_path / "d", 2)

