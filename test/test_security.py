"""Security: no pickle and no custom code on any load path, trust_remote_code out of every client's
reach, and model/registry paths confined to configured roots.

The malicious files here are real: unpickling the planted checkpoint creates a marker file (shown once
on purpose), and the planted custom modeling code creates one when imported. Every test then checks
that the marker never appears while the file is refused with a clear error."""

from __future__ import annotations

import ast
import json
import shutil
from pathlib import Path

import pytest
import torch
from ros_helpers import require_ros

from memspec_ros.runtime.cache import DraftCacheManager, registry_loader
from memspec_ros.runtime.controller import RuntimeConfig, RuntimeController
from memspec_ros.runtime.models import (
    ModelDirectoryError,
    ModelSpec,
    UnsupportedArchitectureError,
    load_model,
    load_tokenizer,
    tokenizer_fingerprint,
)
from memspec_ros.runtime.oracle import target_greedy
from memspec_ros.runtime.registry import DraftEntry, DraftRegistry
from memspec_ros.runtime.storage import MEDIA, DraftStorage
from memspec_ros.testing.tiny_models import noisy_copy, save_model_dir, tiny_llama, tiny_tokenizer

REPO = Path(__file__).resolve().parents[1]
PROMPT = [1, 5, 7, 9]


class Payload:
    """Unpickling this calls open(marker, "w"): the file appears exactly when the pickle runs."""

    def __init__(self, marker: Path) -> None:
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


def plant_pickle(path: Path, marker: Path) -> Path:
    torch.save({"model.embed_tokens.weight": Payload(marker)}, path)  # torch's own checkpoint format
    return path


@pytest.fixture(scope="module")
def zoo(tmp_path_factory):
    root = tmp_path_factory.mktemp("security_zoo")
    tok = tiny_tokenizer()
    target = tiny_llama(vocab_size=len(tok), seed=0)
    save_model_dir(target, tok, root / "target")
    save_model_dir(noisy_copy(target, 0.01, seed=1), tok, root / "good")
    return root, target, tok


def copy_draft(zoo, name: str) -> Path:
    root = zoo[0]
    return Path(shutil.copytree(root / "good", root / name, dirs_exist_ok=True))


def test_the_planted_pickle_really_runs_code_when_unpickled(tmp_path):
    """The payload is live: an unguarded torch.load runs it (this is what every loader must never do)."""
    marker = tmp_path / "probe-ran"
    path = plant_pickle(tmp_path / "probe.bin", marker)
    torch.load(path, weights_only=False)
    assert marker.exists()


def test_a_pickle_only_draft_is_refused_without_running_it(zoo, tmp_path):
    marker = tmp_path / "pickle-ran"
    draft = copy_draft(zoo, "pickle_only")
    (draft / "model.safetensors").unlink()
    plant_pickle(draft / "pytorch_model.bin", marker)
    with pytest.raises(ModelDirectoryError, match=r"pickled weights \(pytorch_model.bin\).*never loaded"):
        load_model(ModelSpec(str(draft)))
    with pytest.raises(ModelDirectoryError, match=r"pickled weights \(pytorch_model.bin\)"):
        DraftStorage(MEDIA["local"]).load(ModelSpec(str(draft)), "pickle_only")
    # as a draft: the registry refuses it when it is added (it has no safetensors weights)
    fingerprint = tokenizer_fingerprint(zoo[2])
    with pytest.raises(ModelDirectoryError, match="no \\*.safetensors weights"):
        DraftRegistry([DraftEntry("pickle_only", str(draft), "code")], target_fingerprint=fingerprint)
    assert not marker.exists()


def test_a_pickle_beside_the_safetensors_is_never_opened(zoo, tmp_path):
    marker = tmp_path / "pickle-ran"
    draft = copy_draft(zoo, "pickle_beside")
    plant_pickle(draft / "pytorch_model.bin", marker)
    assert load_model(ModelSpec(str(draft))).size_bytes > 0
    assert DraftStorage(MEDIA["local"]).load(ModelSpec(str(draft)), "pickle_beside").size_bytes > 0
    assert not marker.exists()


@pytest.mark.parametrize("storage", [None, "local"])
def test_a_pickle_renamed_to_safetensors_is_refused_as_a_draft_without_running_it(zoo, tmp_path, storage):
    """It passes the registry (its name looks right) and is refused where it is loaded: the draft is
    marked failed with the reason, decoding goes on losslessly without it, and the pickle never runs."""
    _, target, tok = zoo
    marker = tmp_path / "pickle-ran"
    draft = copy_draft(zoo, f"renamed_{storage}")
    plant_pickle(draft / "model.safetensors", marker)
    with pytest.raises(ModelDirectoryError, match="model.safetensors is not a readable safetensors file"):
        load_model(ModelSpec(str(draft)))
    registry = DraftRegistry([DraftEntry("evil", str(draft), "code")], target_fingerprint=tokenizer_fingerprint(tok))
    cache = DraftCacheManager(1, registry_loader(registry, storage=storage))
    ctl = RuntimeController(RuntimeConfig(policy="general-static", general_draft="evil", capacity=1), target, tok,
                            registry, cache=cache, eos_token_ids=[])
    try:
        result = ctl.generate(PROMPT, 12)
        assert result.token_ids == target_greedy(target, PROMPT, 12)
        assert result.stats.drafts_used == []
        assert "not a readable safetensors file" in result.stats.cache.failed["evil"]
    finally:
        ctl.close()
    assert not marker.exists()


# -- custom code ----------------------------------------------------------------------------------

EVIL_CODE = '''
from pathlib import Path
Path({marker!r}).write_text("custom code ran")
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast


class EvilConfig(LlamaConfig):
    model_type = "evil"


class EvilForCausalLM(LlamaForCausalLM):
    config_class = EvilConfig


class EvilTokenizer(PreTrainedTokenizerFast):
    pass
'''


def plant_custom_code(directory: Path, marker: Path, model_type: str) -> None:
    (directory / "modeling_evil.py").write_text(EVIL_CODE.format(marker=str(marker)))
    config = json.loads((directory / "config.json").read_text())
    config["model_type"] = model_type
    config["auto_map"] = {"AutoConfig": "modeling_evil.EvilConfig", "AutoModelForCausalLM": "modeling_evil.EvilForCausalLM"}
    (directory / "config.json").write_text(json.dumps(config))
    tok_config = json.loads((directory / "tokenizer_config.json").read_text())
    tok_config["auto_map"] = {"AutoTokenizer": [None, "modeling_evil.EvilTokenizer"]}
    tok_config["tokenizer_class"] = "EvilTokenizer"
    (directory / "tokenizer_config.json").write_text(json.dumps(tok_config))


def test_the_planted_code_really_runs_when_imported(zoo, tmp_path):
    import importlib.util

    marker = tmp_path / "probe-ran"
    draft = copy_draft(zoo, "custom_code_probe")
    plant_custom_code(draft, marker, "evil")
    spec = importlib.util.spec_from_file_location("modeling_evil_probe", draft / "modeling_evil.py")
    spec.loader.exec_module(importlib.util.module_from_spec(spec))
    assert marker.exists()


def test_a_model_needing_its_own_code_is_refused_without_running_it(zoo, tmp_path):
    marker = tmp_path / "custom-code-ran"
    draft = copy_draft(zoo, "custom_code")
    plant_custom_code(draft, marker, "evil")
    with pytest.raises(UnsupportedArchitectureError, match="ships custom code: set trust_remote_code only if you trust it"):
        load_model(ModelSpec(str(draft)))
    with pytest.raises(ModelDirectoryError, match="could not be loaded"):
        load_tokenizer(draft)
    assert not marker.exists()


def test_custom_code_beside_a_known_architecture_is_never_imported(zoo, tmp_path):
    """config.json names llama (a built-in class) and also maps the Auto classes to the directory's own
    code: the built-in class is used, the code is never imported."""
    marker = tmp_path / "custom-code-ran"
    draft = copy_draft(zoo, "custom_code_llama")
    plant_custom_code(draft, marker, "llama")
    try:
        load_model(ModelSpec(str(draft)))
    except ModelDirectoryError:
        pass  # refusing it is as good as ignoring the code; running it is not
    try:
        load_tokenizer(draft)
    except ModelDirectoryError:
        pass
    assert not marker.exists()


def test_trust_remote_code_is_off_and_out_of_every_client_s_reach():
    """Off by default; no goal field and no node parameter can turn it on; and no call in the package
    passes it as anything but False or a ModelSpec's own (default False) field."""
    require_ros()
    from memspec_interfaces.action import Generate
    from memspec_ros.ros import params as P

    assert ModelSpec("x").trust_remote_code is False
    goal_fields = " ".join(Generate.Goal.get_fields_and_field_types())
    assert not any(word in goal_fields for word in ("trust", "remote", "code")), goal_fields
    for p in P.PARAMS:
        if "trust" in p.name or "remote" in p.name:
            assert p.default is False and p.read_only, p
    offending = []
    for path in sorted((REPO / "memspec_ros").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Call):
                for kw in node.keywords:
                    if kw.arg != "trust_remote_code":
                        continue
                    value = kw.value
                    is_false = isinstance(value, ast.Constant) and value.value is False
                    is_spec_field = isinstance(value, ast.Attribute) and value.attr == "trust_remote_code"
                    if not (is_false or is_spec_field):
                        offending.append(f"{path.relative_to(REPO)}:{node.lineno}: trust_remote_code={ast.unparse(value)}")
    assert offending == []
    # and where a ModelSpec is built, trust_remote_code is never set
    for path in sorted((REPO / "memspec_ros").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Call) and getattr(node.func, "id", getattr(node.func, "attr", "")) in ("ModelSpec", "replace"):
                assert all(kw.arg != "trust_remote_code" for kw in node.keywords), f"{path}:{node.lineno}"
