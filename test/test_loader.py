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
                                                     rf" in {small} reads only 64"):
        load_models(drafts=DraftLists([], []), target_path=small)
    models = load_models(drafts=DraftLists([], []), target_path=zoo / "target")
    assert len(models.tokenizer) <= models.target.model.get_input_embeddings().num_embeddings
