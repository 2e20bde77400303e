"""Model loading: local safetensors directories, specific errors that name the fix."""

from __future__ import annotations

import json

import pytest
import torch
from row_checks import target_alone

from memspec_ros.runtime.forward_paths import cpu_has_bf16
from memspec_ros.runtime.models import (
    ModelDirectoryError,
    ModelSpec,
    QuantizationBackendError,
    TokenizerMismatchError,
    UnsupportedArchitectureError,
    check_draft_compatible,
    check_shared_tokenizer,
    gptq_backend_available,
    load_model,
    load_tokenizer,
)
from memspec_ros.runtime.speculative import generate
from memspec_ros.testing.tiny_models import save_model_dir, tiny_llama, tiny_tokenizer


@pytest.fixture(scope="module")
def tokenizer():
    return tiny_tokenizer()


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory, tokenizer):
    root = tmp_path_factory.mktemp("models")
    target = save_model_dir(tiny_llama(vocab_size=len(tokenizer), seed=0), tokenizer, root / "target")
    draft = save_model_dir(
        tiny_llama(vocab_size=len(tokenizer), layers=1, hidden=32, seed=1), tokenizer, root / "draft"
    )
    return target, draft


def test_loads_and_generates_in_every_dtype(model_dirs):
    target_dir, draft_dir = model_dirs
    # fp16 is transformers' own cast; bf16 is the bf16 forward path: bf16 linear weights, the rest fp32
    from memspec_ros.runtime.forward_paths import cpu_has_bf16

    cases = [("fp32", torch.float32), ("fp16", torch.float16)] + ([("bf16", torch.bfloat16)] if cpu_has_bf16() else [])
    for dtype, weight_dtype in cases:
        target = load_model(ModelSpec(str(target_dir), dtype=dtype))
        assert target.model.model.layers[0].mlp.up_proj.weight.dtype == weight_dtype
        assert target.forward_path == dtype
        assert not any(p.requires_grad for p in target.model.parameters())
        tensors = [*target.model.parameters(), *target.model.buffers()]  # buffers: rotary tables, packed weights
        assert target.size_bytes == sum(t.numel() * t.element_size() for t in tensors)
    target = load_model(ModelSpec(str(target_dir)))
    draft = load_model(ModelSpec(str(draft_dir)))
    check_draft_compatible(target.vocab_size, draft)
    check_shared_tokenizer(target_dir, draft_dir)
    session = generate(target.model, [1, 4, 9], draft.model, gamma=3, max_new_tokens=16)
    assert session.generated_ids == target_alone(target.model, [1, 4, 9], 16)


def test_missing_directory(tmp_path):
    with pytest.raises(ModelDirectoryError, match="does not exist"):
        load_model(ModelSpec(str(tmp_path / "nope")))


def test_a_path_to_a_file_or_a_missing_folder_says_which_and_how_it_resolved(tmp_path, model_dirs, monkeypatch):
    """A path to the model's weights file exists: it is not 'missing', it is a file; a missing relative path names
    the directory it resolved from, a registry entry's (resolved from the registry file's folder) says so."""
    from memspec_ros.runtime.registry import DraftRegistry

    weights = model_dirs[0] / "model.safetensors"
    with pytest.raises(ModelDirectoryError, match=rf"is a file, not a model directory.*perhaps '{model_dirs[0]}'"):
        load_model(ModelSpec(str(weights)))
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ModelDirectoryError, match=rf"does not exist.*current directory, '{tmp_path}'"):
        load_model(ModelSpec("nope"))
    (tmp_path / "registry.yaml").write_text("drafts:\n  - {name: d, path: drafts/d}\n")
    with pytest.raises(ModelDirectoryError, match=r"drafts/d' does not exist.*resolves from that file's folder"):
        DraftRegistry.from_yaml(tmp_path / "registry.yaml")


def test_the_storage_tier_names_an_architecture_it_cannot_build(tmp_path, model_dirs):
    """As load_model does: a t5 draft through DraftStorage is an UnsupportedArchitectureError naming model_type,
    not 'could not build the model ... <class T5Config>'."""
    from memspec_ros.runtime.storage import MEDIA, DraftStorage

    odd = _copy(model_dirs[1], tmp_path / "t5")
    config = json.loads((odd / "config.json").read_text())
    config["model_type"] = "t5"
    (odd / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnsupportedArchitectureError, match="model_type 't5'"):
        DraftStorage(MEDIA["local"]).load(ModelSpec(str(odd)))


def test_missing_config(tmp_path):
    with pytest.raises(ModelDirectoryError, match="config.json is missing"):
        load_model(ModelSpec(str(tmp_path)))


def test_corrupt_config(tmp_path, model_dirs):
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ModelDirectoryError, match="not valid JSON"):
        load_model(ModelSpec(str(tmp_path)))


def test_a_config_that_is_json_but_no_object_is_refused(tmp_path):
    """Valid JSON of another shape (a list) passed the JSON check and ended the load in an AttributeError."""
    (tmp_path / "config.json").write_text("[]")
    with pytest.raises(ModelDirectoryError, match="holds a JSON list"):
        load_model(ModelSpec(str(tmp_path)))


def _copy(src, dst):
    import shutil

    shutil.copytree(src, dst)
    return dst


def test_corrupt_weights(tmp_path, model_dirs):
    broken = _copy(model_dirs[0], tmp_path / "broken")
    (broken / "model.safetensors").write_bytes(b"\x00\x01garbage")
    with pytest.raises(ModelDirectoryError, match="model.safetensors is not a readable safetensors file"):
        load_model(ModelSpec(str(broken)))


@pytest.mark.parametrize("drop", ["lm_head.weight", "model.layers.1.mlp.up_proj.weight"])
def test_a_checkpoint_lacking_a_tensor_its_config_needs_is_refused(tmp_path, tokenizer, drop):
    """transformers would initialise the missing tensor at random and only log it: both loaders (the directory's
    and the storage tier's, from the read bytes) refuse, naming the tensor. A complete untied checkpoint and a tied
    one (no lm_head.weight saved) load."""
    from safetensors.torch import load_file, save_file
    from transformers import LlamaForCausalLM

    from memspec_ros.runtime.storage import MEDIA, DraftStorage

    untied = tiny_llama(vocab_size=len(tokenizer), seed=2)  # tie_word_embeddings false: lm_head is its own tensor
    folder = save_model_dir(untied, tokenizer, tmp_path / "untied")
    weights = load_file(str(folder / "model.safetensors"))
    assert drop in weights and "lm_head.weight" in weights
    loaded = load_model(ModelSpec(str(folder))).model  # every tensor the file's, none made up
    assert all(torch.equal(loaded.state_dict()[k], v) for k, v in weights.items())
    untied.config.tie_word_embeddings = True  # as SmolLM2 (and its GGUF conversion): lm_head is the embedding
    tied = save_model_dir(LlamaForCausalLM(untied.config), tokenizer, tmp_path / "tied")
    assert "lm_head.weight" not in load_file(str(tied / "model.safetensors"))
    for loaded in (load_model(ModelSpec(str(tied))), DraftStorage(MEDIA["local"]).load(ModelSpec(str(tied)))):
        model = loaded.model
        assert torch.equal(model.lm_head.weight, model.get_input_embeddings().weight)  # the head is the embedding
    save_file({k: v for k, v in weights.items() if k != drop}, str(folder / "model.safetensors"),
              metadata={"format": "pt"})
    with pytest.raises(ModelDirectoryError, match=rf"lack 1 tensor.*: {drop.replace('.', '[.]')}[.] .*randomly"):
        load_model(ModelSpec(str(folder)))
    with pytest.raises(ModelDirectoryError, match=rf"lack 1 tensor.*: {drop.replace('.', '[.]')}[.] "):
        DraftStorage(MEDIA["local"]).load(ModelSpec(str(folder)))


@pytest.mark.parametrize("key,value,error", [
    ("num_hidden_layers", 10**8, "num_hidden_layers 100000000, but the weights hold 2 layers"),
    ("intermediate_size", 2 * 10**6, r"larger than its weights hold: model[.]layers[.]0[.]mlp[.]\w+_proj[.]weight"),
    ("vocab_size", 10**7, r"larger than its weights hold: model[.]embed_tokens[.]weight \[10000000, "),
])
def test_a_config_larger_than_its_weights_is_refused_before_anything_is_built(tmp_path, model_dirs, monkeypatch,
                                                                              key, value, error):
    """transformers would build the config's model and fill what the weights lack at random: gigabytes (or an
    out-of-memory kill) before the load report. Both loaders refuse from the headers alone: no model is built."""
    from transformers import AutoModelForCausalLM

    from memspec_ros.runtime import storage
    from memspec_ros.runtime.storage import MEDIA, DraftStorage

    big = _copy(model_dirs[0], tmp_path / "big")
    config = json.loads((big / "config.json").read_text())
    config[key] = value
    (big / "config.json").write_text(json.dumps(config))

    def no_build(*args, **kwargs):
        raise AssertionError("a model was built")

    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", no_build)
    monkeypatch.setattr(storage, "build_model", no_build)
    for load in (load_model, DraftStorage(MEDIA["local"]).load):
        with pytest.raises(ModelDirectoryError, match=error):
            load(ModelSpec(str(big)))


def test_pickled_weights_are_never_loaded(tmp_path, model_dirs):
    pickled = _copy(model_dirs[0], tmp_path / "pickled")
    (pickled / "model.safetensors").unlink()
    (pickled / "pytorch_model.bin").write_bytes(b"would be unpickled")
    with pytest.raises(ModelDirectoryError, match="pickled weights .*pytorch_model.bin.*save_pretrained"):
        load_model(ModelSpec(str(pickled)))


def test_unsupported_architecture(tmp_path, model_dirs):
    odd = _copy(model_dirs[0], tmp_path / "odd")
    config = json.loads((odd / "config.json").read_text())
    config["model_type"] = "resnet"  # a vision model: not a causal LM
    (odd / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnsupportedArchitectureError, match="model_type .resnet."):
        load_model(ModelSpec(str(odd)))


def test_tokenizer_mismatch(tmp_path, model_dirs):
    other = tiny_tokenizer(vocab_size=280)
    stranger = save_model_dir(tiny_llama(vocab_size=len(other), seed=3), other, tmp_path / "stranger")
    with pytest.raises(TokenizerMismatchError, match="different tokenizer"):
        check_shared_tokenizer(model_dirs[0], stranger)
    with pytest.raises(TokenizerMismatchError, match="vocab_size"):
        check_draft_compatible(load_model(ModelSpec(str(model_dirs[0]))).vocab_size,
                               load_model(ModelSpec(str(stranger))))


def test_missing_tokenizer(tmp_path, model_dirs):
    bare = tmp_path / "bare"
    bare.mkdir()
    with pytest.raises(ModelDirectoryError, match="no tokenizer files"):
        load_tokenizer(bare)


def test_gptq_requested_for_a_plain_checkpoint(model_dirs):
    with pytest.raises(QuantizationBackendError, match="no GPTQ quantization_config"):
        load_model(ModelSpec(str(model_dirs[0]), quantization="gptq"))


@pytest.mark.parametrize("method", ["awq", "bitsandbytes"])
def test_a_checkpoint_quantized_otherwise_than_gptq_is_refused_with_the_reason(tmp_path, model_dirs, method):
    """Any other quantization_config was labelled gptq (and ran through its preparation), or raised a bare
    ImportError for a backend this engine does not use."""
    fake = _copy(model_dirs[0], tmp_path / method)
    config = json.loads((fake / "config.json").read_text())
    config["quantization_config"] = {"quant_method": method, "bits": 4}
    (fake / "config.json").write_text(json.dumps(config))
    with pytest.raises(QuantizationBackendError, match=f"quantized with '{method}', which this engine does not run"):
        load_model(ModelSpec(str(fake)))


@pytest.mark.skipif(gptq_backend_available(), reason="only meaningful without the GPTQ backend")
def test_gptq_checkpoint_without_backend(tmp_path, model_dirs):
    fake = _copy(model_dirs[0], tmp_path / "gptq")
    config = json.loads((fake / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "gptq", "bits": 4, "group_size": 32}
    (fake / "config.json").write_text(json.dumps(config))
    with pytest.raises(QuantizationBackendError, match="GPT-QModel backend is not installed"):
        load_model(ModelSpec(str(fake), quantization="gptq"))


def test_bad_dtype_and_device(model_dirs):
    with pytest.raises(ValueError, match="unknown dtype"):
        load_model(ModelSpec(str(model_dirs[0]), dtype="int3"))
    with pytest.raises(ValueError, match="unsupported device"):
        load_model(ModelSpec(str(model_dirs[0]), device="tpu"))


@pytest.mark.parametrize("dtype", ["fp32", "bf16"] if cpu_has_bf16() else ["fp32"])  # bf16: its CPU path needs it
def test_a_gpt2_target_scores_a_verifys_rows_as_one_token_steps(tmp_path, dtype):
    """GPT-2's linears are transformers' Conv1D (addmm), which the row-exact preparation did not probe: a 5-row
    verify differed from five one-token steps (4 of 4 seeds), though the error text names gpt2 as supported."""
    from row_checks import assert_verify_rows_equal_steps
    from transformers import GPT2Config, GPT2LMHeadModel

    from memspec_ros.runtime.loader import check_target_rows

    torch.manual_seed(0)
    config = GPT2Config(vocab_size=300, n_embd=128, n_layer=2, n_head=4, n_positions=256)
    path = save_model_dir(GPT2LMHeadModel(config), tiny_tokenizer(300), tmp_path / "gpt2")
    loaded = load_model(ModelSpec(str(path), dtype=dtype))
    # whether a Conv1D's rows differ together is the CPU's BLAS's matter (listed in rows_one_by_one where they do);
    # that the verify's rows then equal one-token steps is the property, on every CPU
    assert_verify_rows_equal_steps(loaded.model, 300)
    check_target_rows(loaded)  # as a target: accepted


def test_a_mixture_of_experts_target_whose_rows_differ_is_refused_as_a_target_not_as_a_draft(tmp_path,
                                                                                              monkeypatch):
    """A MoE layer batches the tokens routed to each expert: a verify's rows differed from one-token steps (4 of 4
    seeds on a tiny Mixtral) and a target's speculative output could part from its own greedy output."""
    from transformers import MixtralConfig, MixtralForCausalLM

    from memspec_ros.runtime.loader import check_target_rows
    from memspec_ros.runtime.row_exact import verify_gap

    torch.manual_seed(0)
    config = MixtralConfig(vocab_size=300, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2,
                           max_position_embeddings=256)
    path = save_model_dir(MixtralForCausalLM(config), tiny_tokenizer(300), tmp_path / "mixtral")
    loaded = load_model(ModelSpec(str(path)))  # as a draft: its numbers never decide the output
    from memspec_ros.runtime import row_exact

    # the gap is the machine's kernels' (2e-7 on the AVX512 and AVX2 builds tried): whatever it is, the refusal
    # follows it exactly
    gap = verify_gap(loaded.model, 300)
    if gap != 0.0:
        with pytest.raises(UnsupportedArchitectureError, match="verify rows differ from its one-token steps"):
            check_target_rows(loaded)
    else:
        check_target_rows(loaded)
    monkeypatch.setattr(row_exact, "verify_gap", lambda model, vocab, lean=None: 2e-7)
    with pytest.raises(UnsupportedArchitectureError, match="by 2e-07 .a mixtral model"):
        check_target_rows(loaded)


def test_a_lean_target_off_the_cpu_is_checked_through_its_lean_forward(model_dirs, monkeypatch):
    """The lean forward is row-exact by construction on the CPU, so a lean target was never checked; on a GPU its
    kernels (an RMSNorm reduction, a matmul) may sum a verify's rows differently, and nothing caught it. Off the
    CPU (here: the check told so) its verify is compared with one-token steps through the lean forward."""
    from memspec_ros.runtime import loader as loader_module
    from memspec_ros.runtime import row_exact
    from memspec_ros.runtime.draft_forward import LeanLlamaForward, lean_forward_for
    from memspec_ros.runtime.loader import check_target_rows

    loaded = load_model(ModelSpec(str(model_dirs[0])))
    assert loaded.prepared is None  # a lean target
    # the check itself, through the lean forward: on the CPU a verify's rows are the steps' bit for bit
    assert row_exact.verify_gap(loaded.model, loaded.vocab_size, lean=lean_forward_for(loaded.model)) == 0.0
    seen = []
    monkeypatch.setattr(row_exact, "verify_gap", lambda model, vocab, lean=None: seen.append(lean) or 3e-7)
    check_target_rows(loaded)  # on the CPU: by construction, not probed
    assert seen == []
    monkeypatch.setattr(loader_module, "on_cpu", lambda model: False)
    with pytest.raises(UnsupportedArchitectureError, match="by 3e-07 .on cpu, whose kernels sum a row"):
        check_target_rows(loaded)
    assert len(seen) == 1 and isinstance(seen[0], LeanLlamaForward)


def test_a_model_that_keeps_its_context_outside_the_kv_cache_is_refused(tmp_path):
    """transformers' Mamba keeps its state in cache_params and ignores the KV cache the engine hands every model:
    it loaded, and each forward saw only the tokens of its own call (logits 1.18 off a whole forward), silently.
    A transformer decoder on transformers' forward (Qwen2 here) still loads."""
    from transformers import MambaConfig, MambaForCausalLM

    torch.manual_seed(0)
    config = MambaConfig(vocab_size=300, hidden_size=64, state_size=8, num_hidden_layers=2, expand=2, conv_kernel=4)
    path = save_model_dir(MambaForCausalLM(config), tiny_tokenizer(300), tmp_path / "mamba")
    with pytest.raises(UnsupportedArchitectureError, match="does not keep its context in the KV cache|cached prefix"):
        load_model(ModelSpec(str(path)))


def test_a_target_on_transformers_forward_scores_a_verifys_rows_as_one_token_steps(tmp_path):
    """A Qwen2 target (not the lean Llama forward: transformers' own, batched matmuls and SDPA) loaded as a plain
    model scored a 5-row verify with other last digits than five one-token steps, and in bf16 the engine's greedy
    output then differed from the target's own on 5 of 20 prompts. load_model now makes it row-exact."""
    from row_checks import assert_verify_rows_equal_steps
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from memspec_ros.runtime.draft_forward import lean_forward_for

    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=300, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                         tie_word_embeddings=False)
    path = save_model_dir(Qwen2ForCausalLM(config), tiny_tokenizer(300), tmp_path / "qwen2")
    loaded = load_model(ModelSpec(str(path)))
    model = loaded.model
    assert lean_forward_for(model) is None and loaded.prepared is not None
    assert_verify_rows_equal_steps(model, 300)


@pytest.mark.parametrize(("key", "value", "reason"), [
    ("quantization_config", "gptq", "quantization_config is a str, not an object"),
    ("num_hidden_layers", "two", "could not load the model in .*num_hidden_layers"),
])
def test_a_config_value_of_the_wrong_type_is_named_not_raised_raw(tmp_path, model_dirs, key, value, reason):
    """A string where an object or a number belongs ended the load in a bare AttributeError or TypeError."""
    broken = _copy(model_dirs[0], tmp_path / "broken")
    config = json.loads((broken / "config.json").read_text())
    config[key] = value
    (broken / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelDirectoryError, match=reason):
        load_model(ModelSpec(str(broken)))


def test_a_gguf_conversions_load_error_says_it_is_a_conversion_to_redo(tmp_path, model_dirs, monkeypatch):
    """A GGUF is loaded through its cached conversion: an error there gave the folder's advice (restore the
    checkpoint, fix config.json) for a folder the user never made."""
    from memspec_ros.runtime import model_source

    cached = _copy(model_dirs[0], tmp_path / "conversion")
    (cached / "config.json").write_text("{not json")
    monkeypatch.setattr(model_source, "resolve_model_path", lambda path: cached)
    with pytest.raises(ModelDirectoryError, match=r"not valid JSON.*cached conversion of /robot/model.gguf: delete"):
        load_model(ModelSpec("/robot/model.gguf"))


def test_a_bad_spec_or_config_is_refused_before_any_file_is_read_or_converted(monkeypatch, tmp_path):
    """A GGUF file was converted (minutes and gigabytes for a large model) before the spec's dtype was refused;
    load_runtime loaded the target and the predictor before refusing a capacity of 0; a draft device this machine
    lacks failed every load on the loader thread, retried, while every goal ran on the target alone."""
    from memspec_ros.runtime import model_source
    from memspec_ros.runtime.cache import registry_loader
    from memspec_ros.runtime.controller import RuntimeConfig, load_runtime
    from memspec_ros.runtime.models import ModelLoadError, ModelSpec, load_model
    from memspec_ros.runtime.registry import DraftRegistry

    def no_read(*args, **kwargs):
        raise AssertionError("a model file was read before the request was checked")

    monkeypatch.setattr(model_source, "resolve_model_path", no_read)
    monkeypatch.setattr("memspec_ros.runtime.loader.load_models", no_read)
    with pytest.raises(ValueError, match="unknown dtype 'fp64'"):
        load_model(ModelSpec(str(tmp_path / "x.gguf"), dtype="fp64"))
    with pytest.raises(ValueError, match="capacity"):
        load_runtime(RuntimeConfig(capacity=0), str(tmp_path / "registry.yaml"))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # this machine's GPU or none: the same test
    with pytest.raises(ModelLoadError, match="CUDA is not available"):
        registry_loader(DraftRegistry([], validate=False), device="cuda:0")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(ModelLoadError, match="1 CUDA device"):  # found once every weight had been read
        registry_loader(DraftRegistry([], validate=False), device="cuda:1")


def test_a_draft_form_the_storage_loader_cannot_build_is_refused_when_the_loader_is_made():
    """registry_loader took dtype 'auto' (or 'gptq') beside a storage tier, which build_model refuses: every draft
    load then failed, retried every 30 s. And draft_dtype compared case-sensitively: 'AUTO' reached the drafts."""
    from memspec_ros.runtime.cache import registry_loader
    from memspec_ros.runtime.loader import draft_dtype
    from memspec_ros.runtime.registry import DraftRegistry

    empty = DraftRegistry([], validate=False)
    for dtype, quantization in (("auto", "none"), ("fp32", "auto"), ("fp32", "gptq")):
        with pytest.raises(ValueError, match="drafts read through a storage tier are built as"):
            registry_loader(empty, dtype=dtype, quantization=quantization, storage="emmc")
        registry_loader(empty, dtype=dtype, quantization=quantization)  # load_model takes them
    registry_loader(empty, dtype="fp32", quantization="int4", storage="emmc")
    assert draft_dtype("AUTO") == draft_dtype("auto") == "fp32" and draft_dtype("bf16") == "bf16"


def test_a_model_spec_refuses_a_field_of_the_wrong_type_at_once(tmp_path):
    """trust_remote_code="false" (a YAML or command line slip) is truthy: a model's own code would have been allowed
    to run. dtype None failed deep in the load, and gamma 0 with dtype auto only after the weights had loaded."""
    with pytest.raises(TypeError, match="trust_remote_code must be True or False, got 'false'"):
        ModelSpec("x", trust_remote_code="false")
    with pytest.raises(TypeError, match="dtype must be a string, got None"):
        ModelSpec("x", dtype=None)
    for gamma in (0, 9, 2.0):
        with pytest.raises(ValueError, match="gamma must be an integer in"):
            ModelSpec("x", dtype="auto", gamma=gamma)
    assert ModelSpec(tmp_path).path == str(tmp_path)  # a pathlib.Path names its path
