"""One loader (runtime/loader.py) and one source for each limit: what the node, the benches and load_runtime share."""

from __future__ import annotations

import pytest

from memspec_ros.runtime.controller import LIMITS, RuntimeConfig
from memspec_ros.runtime.loader import DraftLists, find_predictor, load_models, open_registry, registry_target
from memspec_ros.testing.tiny_zoo import build_tiny_zoo


@pytest.fixture(scope="module")
def zoo(tmp_path_factory):
    return build_tiny_zoo(tmp_path_factory.mktemp("zoo"), hidden=64, layers=2)


def test_the_node_parameters_declare_the_runtime_limits():
    from memspec_ros.ros import params as P

    for name, field_ in P.RUNTIME_FIELDS.items():
        p = P.BY_NAME[name]
        if field_ in LIMITS:
            assert (p.int_range or p.float_range) == LIMITS[field_], name
            lo, hi = LIMITS[field_]
            assert P.check_value(name, hi) == "" and P.check_value(name, type(hi)(hi + 1))  # the edge, one past it
            with pytest.raises(ValueError, match=field_):
                RuntimeConfig(**{field_: type(hi)(hi + 1)}).validate()
        else:
            assert p.int_range is None and p.float_range is None, name
    assert set(LIMITS) <= set(P.RUNTIME_FIELDS.values())


def test_load_models_reads_the_registry_target_and_runs_a_controller(zoo):
    assert registry_target(zoo / "registry.yaml") == str((zoo / "target").resolve())
    assert find_predictor(zoo / "predictor") == str(zoo / "predictor") and find_predictor(zoo / "none") == ""
    models = load_models(zoo / "registry.yaml", predictor_path=find_predictor(zoo / "predictor"), dtype="auto",
                         quantization="none")
    assert models.registry.names() == ["general", "code", "math"] and models.predictor is not None
    assert models.draft_dtype == "fp32"  # drafts keep fp32 when the target's dtype is auto
    controller = models.controller(RuntimeConfig(policy="memspec"))
    try:
        assert controller.predictor is models.predictor and controller.max_positions == models.target.max_positions
        assert len(controller.generate([1, 5, 7], 6).token_ids) == 6
    finally:
        controller.close()
        models.close()


def test_draft_lists_replace_the_registry_file_and_are_checked(zoo):
    lists = DraftLists(["code"], [str(zoo / "drafts" / "code")])
    assert open_registry(zoo / "registry.yaml", lists).names() == ["code"]
    with pytest.raises(ValueError, match="names"):
        open_registry(None, DraftLists(["a", "b"], ["x"]), validate=False)


def test_the_node_takes_the_target_from_the_registry_file(zoo, tmp_path):
    from memspec_ros.ros import params as P

    v = {p.name: p.default for p in P.PARAMS} | {"drafts.registry_file": str(zoo / "registry.yaml")}
    paths = P.resolve_paths(v)
    assert paths.target == registry_target(zoo / "registry.yaml") and paths.predictor == str(zoo / "predictor")
    bare = tmp_path / "registry.yaml"
    bare.write_text("drafts:\n  - {name: code, path: drafts/code}\n")
    with pytest.raises(ValueError, match="names no target"):
        P.resolve_paths(v | {"drafts.registry_file": str(bare)})


def test_a_tokenizer_with_more_ids_than_the_target_has_rows_is_refused_at_load(zoo, tmp_path):
    """A 300-id tokenizer over a 64-row target configured and then failed every goal holding an id past 63; it is
    refused at load, naming both paths. The zoo's own tokenizer (as many ids as the target's rows) loads."""
    from memspec_ros.runtime.models import TokenizerMismatchError
    from memspec_ros.testing.tiny_models import save_model_dir, tiny_llama, tiny_tokenizer

    tok = tiny_tokenizer()
    assert len(tok) > 64
    small = save_model_dir(tiny_llama(vocab_size=64, hidden=32, layers=1), tok, tmp_path / "small")
    with pytest.raises(TokenizerMismatchError, match=rf"tokenizer in {small} has {len(tok)} token ids but the target"
                                                     rf" in {small} reads only 64 \(its input embedding rows\):"
                                                     " the folder's own"):
        load_models(drafts=DraftLists([], []), target_path=small)
    elsewhere = save_model_dir(tiny_llama(vocab_size=len(tok), hidden=32, layers=1), tok, tmp_path / "other")
    with pytest.raises(TokenizerMismatchError, match=rf"tokenizer in {elsewhere} has .* not the same model's"):
        load_models(drafts=DraftLists([], []), target_path=small, tokenizer_path=elsewhere)
    models = load_models(drafts=DraftLists([], []), target_path=zoo / "target")
    assert len(models.tokenizer) <= models.target.model.get_input_embeddings().num_embeddings


def test_the_target_folder_and_settings_are_checked_before_its_tokenizer(tmp_path, monkeypatch):
    """A missing target folder, a path to one of its files, or a dtype/quantization pair it cannot run were reported as
    the tokenizer's ("no tokenizer files ... copy the target's tokenizer there"), and a GGUF target was converted
    (minutes) before the pair was refused: each is refused first, by what is wrong."""
    from memspec_ros.runtime import model_source
    from memspec_ros.runtime.models import ModelDirectoryError

    none = DraftLists([], [])
    with pytest.raises(ModelDirectoryError, match="does not exist"):
        load_models(drafts=none, target_path=tmp_path / "nowhere")
    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(ModelDirectoryError, match="is a file, not a model directory"):
        load_models(drafts=none, target_path=tmp_path / "model.safetensors")

    def no_conversion(path):
        raise AssertionError(f"{path} converted before its settings were checked")

    monkeypatch.setattr(model_source, "resolve_model_path", no_conversion)
    with pytest.raises(ValueError, match="keeps its own weight format"):
        load_models(drafts=none, target_path=tmp_path / "target.gguf", dtype="bf16", quantization="int4")


def test_a_damaged_tokenizer_is_refused_naming_its_folder(zoo, tmp_path):
    """tokenizer.json without its added_tokens raised a bare KeyError('added_tokens') that named no file."""
    import json
    import shutil

    from memspec_ros.runtime.models import ModelDirectoryError, load_tokenizer

    copy = shutil.copytree(zoo / "target", tmp_path / "target")
    data = json.loads((copy / "tokenizer.json").read_text())
    del data["added_tokens"]
    (copy / "tokenizer.json").write_text(json.dumps(data))
    with pytest.raises(ModelDirectoryError, match=rf"the tokenizer in {copy} could not be loaded \(KeyError"):
        load_tokenizer(copy)


def test_a_tokenizer_missing_a_package_says_so(zoo, monkeypatch):
    """Every failure was "restore its tokenizer files", also where a package was missing (sentencepiece or protobuf
    for a folder with a tokenizer.model alone)."""
    import transformers

    from memspec_ros.runtime.models import ModelDirectoryError, load_tokenizer

    def needs_sentencepiece(*args, **kwargs):
        raise ImportError("requires the SentencePiece library but it was not found in your environment")

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", needs_sentencepiece)
    with pytest.raises(ModelDirectoryError, match="needs a package that is not installed: requires the SentencePiece"):
        load_tokenizer(zoo / "target")
