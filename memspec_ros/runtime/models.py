"""Loading the target, the drafts and their shared tokenizer from local directories.

Every model is a Hugging Face-format directory (``config.json``, safetensors
weights, tokenizer files). Weights are read from safetensors only: a pickled
checkpoint can run arbitrary code, so a directory that only has ``*.bin`` files
is refused with the command that converts it. Nothing is ever downloaded.

GPTQ INT4 targets (the paper's targets are GPTQ INT4 LLaMA-2 7B / Qwen2.5 7B)
load through GPT-QModel, the maintained GPTQ backend: auto-gptq is archived and
transformers 5 only loads GPTQ checkpoints through ``gptqmodel``.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import math
import os
import re
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from .draft_forward import context_positions, unsupported_reason
from .forward_paths import MAX_VERIFY_ROWS, PATHS, PathReport, apply_path
from .path_choice import PathChoice, choose_path

DTYPES: dict[str, torch.dtype] = {
    "fp32": torch.float32,
    "float32": torch.float32,
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
    "fp16": torch.float16,
    "float16": torch.float16,
}
AUTO = "auto"  # measure the candidate forward paths at load time and keep the fastest
DTYPE_CHOICES = ("fp32", "bf16", "fp16", AUTO)
# none: the dtype's weights; int8 / int4: runtime/forward_paths.py; gptq: a GPT-QModel checkpoint
QUANTIZATIONS = ("none", "int8", "int4", "gptq", AUTO)


class ModelLoadError(RuntimeError):
    """A model or tokenizer could not be loaded; the message names the file and the fix."""


class ModelDirectoryError(ModelLoadError):
    """The directory is missing, incomplete or holds corrupt files."""


class TokenizerMismatchError(ModelLoadError):
    """A draft does not share the target's tokenizer (the paper requires one vocabulary)."""


class UnsupportedArchitectureError(ModelLoadError):
    """The config names an architecture transformers cannot build as a causal LM."""


class QuantizationBackendError(ModelLoadError):
    """GPTQ was requested but its backend is missing or the checkpoint is not GPTQ."""


@dataclass(frozen=True)
class ModelSpec:
    """Where a model lives and how to place it in memory."""

    path: str
    dtype: str = "fp32"  # fp32 | bf16 | fp16 | auto
    device: str = "cpu"
    quantization: str = "none"  # none | int8 | int4 | gptq | auto
    trust_remote_code: bool = False
    gamma: int = 4  # auto measures a forward of 1 and of gamma + 1 tokens (a verify)

    def __post_init__(self) -> None:
        """Each field of its type, said at once: ``trust_remote_code="false"`` (a YAML or command line slip) is
        truthy and would have run a model's own code; ``dtype=None`` failed deep in the load, and a ``gamma`` 0 with
        dtype auto only after the weights had loaded."""
        if isinstance(self.path, os.PathLike):  # a pathlib.Path: the path it names
            object.__setattr__(self, "path", os.fspath(self.path))
        if type(self.trust_remote_code) is not bool:
            raise TypeError(f"ModelSpec.trust_remote_code must be True or False, got {self.trust_remote_code!r}")
        for name in ("path", "dtype", "device", "quantization"):
            value = getattr(self, name)
            if not isinstance(value, str):
                raise TypeError(f"ModelSpec.{name} must be a string, got {value!r}")
        if type(self.gamma) is not int or not 1 <= self.gamma <= MAX_VERIFY_ROWS - 1:
            raise ValueError(f"ModelSpec.gamma must be an integer in [1, {MAX_VERIFY_ROWS - 1}] (the verify rows the"
                             f" forward paths check), got {self.gamma!r}")


@dataclass
class LoadedModel:
    """A model in fast memory, with what the cache manager needs to account for it."""

    model: torch.nn.Module
    spec: ModelSpec
    size_bytes: int
    vocab_size: int
    max_positions: int
    forward_path: str = ""  # fp32 | bf16 | int8 | int4 (runtime/forward_paths.py), gptq, or the HF dtype
    path_choice: PathChoice | None = None  # the measurements behind an auto choice
    prepared: dict | None = None  # what runtime/row_exact.py:prepare_for_engine did to a model on transformers' forward
    path_report: PathReport | None = None  # what runtime/forward_paths.py:apply_path converted
    files: tuple = ()  # its weights files before they were read (storage.weights_identity): tells a changed file
    source: str = ""  # the path ``files`` is of, when not spec.path (a GGUF file or pkg: resource, converted)


def _asked(spec: ModelSpec) -> str:
    """The setting that asked for a CPU forward path, as the user wrote it (dtype auto chooses one too)."""
    return "dtype 'auto'" if spec.dtype.lower() == AUTO else f"quantization {spec.quantization!r}"


def forward_path_for(spec: ModelSpec) -> str:
    """The forward path a spec asks for ('auto' when it must be measured); raises on a contradiction."""
    dtype, quantization = spec.dtype.lower(), spec.quantization
    if quantization not in QUANTIZATIONS:
        raise ValueError(f"unknown quantization {quantization!r}: use one of {', '.join(QUANTIZATIONS)}")
    if dtype not in DTYPES and dtype != AUTO:
        raise ValueError(f"unknown dtype {spec.dtype!r}: use one of {', '.join(DTYPE_CHOICES)}")
    if AUTO in (dtype, quantization):
        if quantization not in (AUTO, "none") or dtype not in (AUTO, "fp32"):
            raise ValueError(
                f"dtype {spec.dtype!r} with quantization {quantization!r}: 'auto' chooses both, set the other"
                " to its default (dtype fp32, quantization none) or to auto"
            )
        return AUTO
    if quantization in ("int8", "int4"):
        if DTYPES[dtype] != torch.float32:
            raise ValueError(
                f"quantization {quantization!r} keeps its own weight format: set dtype fp32 (got {spec.dtype!r})"
            )
        return quantization
    if quantization == "gptq":
        return "gptq"
    return {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}[DTYPES[dtype]]


def resolve_dtype(name: str) -> torch.dtype:
    try:
        return DTYPES[name.lower()]
    except KeyError:
        raise ValueError(f"unknown dtype {name!r}: use one of fp32, bf16, fp16") from None


def resolve_device(name: str) -> torch.device:
    try:
        device = torch.device(name)
    except RuntimeError:
        raise ValueError(f"unsupported device {name!r}: use 'cpu' or 'cuda[:N]'") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ModelLoadError(f"device {name!r} requested but CUDA is not available here: use device 'cpu'")
    if device.type == "cuda" and device.index is not None and device.index >= torch.cuda.device_count():
        # else found by model.to(device) once every weight had been read ("invalid device ordinal")
        raise ModelLoadError(f"device {name!r}: this machine has {torch.cuda.device_count()} CUDA device(s),"
                             f" numbered from 0")
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"unsupported device {name!r}: use 'cpu' or 'cuda[:N]'")
    return device


def read_config(path: str | Path) -> dict[str, Any]:
    """Check the directory and return its parsed ``config.json``."""
    root = Path(path)
    if root.exists() and not root.is_dir():
        # a path to one of its files (model.safetensors, config.json) rather than the folder that holds them
        raise ModelDirectoryError(
            f"model path {str(root)!r} is a file, not a model directory: give the folder that holds config.json and"
            f" the *.safetensors weights (here perhaps {str(root.parent)!r})"
        )
    if not root.is_dir():
        # registry entries arrive resolved from their registry file's folder, parameters as given: say which
        hint = (f"a relative path resolves from the current directory, {str(Path.cwd())!r}"
                if not root.is_absolute() else "a relative path in a registry file resolves from that file's folder,"
                " so an entry's path arrives here absolute")
        raise ModelDirectoryError(f"model directory {str(root)!r} does not exist: check the path ({hint})")
    config_file = root / "config.json"
    if not config_file.is_file():
        raise ModelDirectoryError(
            f"{config_file} is missing: {root} is not a Hugging Face model directory (save it with save_pretrained)"
        )
    try:
        config = json.loads(config_file.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ModelDirectoryError(
            f"{config_file} is not valid JSON ({exc}): restore the file from the original model"
        ) from exc
    if not isinstance(config, dict):  # every reader calls .get on it: a list ended the load in an AttributeError
        raise ModelDirectoryError(f"{config_file} holds a JSON {type(config).__name__}, not the object of a model"
                                  " config: restore the file from the original model")
    return config


def safetensors_files(path: str | Path) -> list[Path]:
    """The weight files of a directory, those transformers reads: model.safetensors, else the shards its index
    names, else every *.safetensors; refuses pickled checkpoints, an index naming anything else, corrupt headers."""
    from safetensors import safe_open

    root = Path(path)
    files = sorted(root.glob("*.safetensors"))
    if not files:
        pickled = sorted(p.name for p in root.glob("*.bin")) + sorted(p.name for p in root.glob("*.pt"))
        hint = (
            f" It has pickled weights ({', '.join(pickled)}), which are never loaded because unpickling runs code:"
            " convert them once, where you trust the file, with model.save_pretrained(dir, safe_serialization=True)."
            if pickled
            else ""
        )
        raise ModelDirectoryError(f"no *.safetensors weights in {root}.{hint}")
    shards = _check_shard_index(root)
    if (root / "model.safetensors").is_file():
        files = [root / "model.safetensors"]
    elif shards:
        files = [root / shard for shard in shards]  # a stray file beside them would overwrite their tensors
    for file in files:
        try:
            with safe_open(str(file), framework="pt") as handle:
                handle.keys()
        except Exception as exc:  # safetensors raises its own error types for bad headers
            raise ModelDirectoryError(
                f"{file} is not a readable safetensors file ({exc}): the download or copy is corrupt, restore it"
            ) from exc
    return files


def _check_shard_index(root: Path) -> list[str]:
    """A sharded checkpoint's index names the files transformers reads, whatever else the folder holds: each must be
    a safetensors file in this folder. Any other name would be loaded with torch.load (an unpickler, if a restricted
    one), and a name with a path in it reads outside the folder (and model.allowed_roots)."""
    named: list[str] = []
    for index in sorted(root.glob("*.safetensors.index.json")):  # (a .bin index: transformers ignores it here)
        try:
            shards = set(json.loads(index.read_text(encoding="utf-8")).get("weight_map", {}).values())
        except (json.JSONDecodeError, UnicodeDecodeError, AttributeError) as exc:
            raise ModelDirectoryError(f"{index} is not a valid shard index ({exc}): restore it from the original"
                                      " model") from exc
        for shard in sorted(map(str, shards)):
            if Path(shard).name != shard or shard in ("", ".", ".."):
                raise ModelDirectoryError(f"{index} names the shard {shard!r}, a path, not a file of {root}: refused")
            if not shard.endswith(".safetensors"):
                raise ModelDirectoryError(
                    f"{index} names the shard {shard!r}, which is not safetensors: pickled weights are never loaded"
                    " (unpickling runs code); convert the checkpoint where you trust it, with"
                    " model.save_pretrained(dir, safe_serialization=True)")
            if not (root / shard).is_file():
                raise ModelDirectoryError(f"{index} names the shard {shard!r}, missing from {root}: the download or"
                                          " copy is incomplete, restore it")
            named.append(shard)
    return sorted(set(named))


def _checkpoint_shapes(files: list[Path]) -> dict[str, tuple[int, ...]]:
    """Every tensor's shape, from the safetensors headers alone (no tensor is read)."""
    from safetensors import safe_open

    shapes: dict[str, tuple[int, ...]] = {}
    for file in files:
        with safe_open(str(file), framework="pt") as handle:
            for name in handle.keys():
                shapes[name] = tuple(handle.get_slice(name).get_shape())
    return shapes


_LAYER_INDEX = re.compile(r"\.(?:layers|h|blocks)\.(\d+)\.")


def check_sizes_fit_weights(spec: ModelSpec, config: dict[str, Any], files: list[Path]) -> None:
    """Refuse a config.json that describes a larger model than its weights hold, before anything is allocated.
    transformers builds the model the config describes and initialises at random whatever the checkpoint lacks or
    holds at another size, so a config with a huge width or layer count beside small weights allocated gigabytes
    (or ran out of memory) before ``check_loading_info`` could refuse the load. The config's model is built on the
    meta device (no storage) and its parameter count compared with the checkpoint's; a layer count beyond the
    checkpoint's layers is refused first, as building a million layers even on meta takes hours. ``config``: the
    folder's config.json as the caller read it. A quantized checkpoint is not checked: its tensors are packed."""
    from transformers import AutoConfig, AutoModelForCausalLM

    if config.get("quantization_config"):
        return
    check_architecture(config, spec.path, spec.trust_remote_code)  # (a t5 or vision config: named as such)
    shapes = _checkpoint_shapes(files)
    last = max((int(m.group(1)) for m in map(_LAYER_INDEX.search, shapes) if m), default=None)  # a layer's index
    layers = config.get("num_hidden_layers")
    if last is not None and isinstance(layers, int) and layers > last + 1:
        raise ModelDirectoryError(
            f"{spec.path}/config.json has num_hidden_layers {layers}, but the weights hold {last + 1} layers:"
            " restore the complete checkpoint, or fix config.json if it describes another model")
    try:
        built = AutoConfig.from_pretrained(spec.path, local_files_only=True,
                                           trust_remote_code=spec.trust_remote_code)
        # dtype given: from_config otherwise sets the config's (a draft's float16) as torch's default dtype for the
        # whole process while it builds, and a load runs on the loader thread beside the decode thread
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(built, trust_remote_code=spec.trust_remote_code,
                                                     dtype=torch.float32)
    except ImportError as exc:  # a backend the model needs, as load_model says it
        raise QuantizationBackendError(f"could not load the model in {spec.path}: {exc}") from exc
    except Exception as exc:  # the same config fails from_pretrained: refused there with the folder's advice
        raise ModelDirectoryError(f"could not load the model in {spec.path}: {type(exc).__name__}: {exc}") from exc
    needed = {name: tuple(p.shape) for name, p in model.named_parameters()}  # a tied embedding and head: once
    larger = [f"{name} {list(shape)} (the weights: {list(shapes[name])})" for name, shape in needed.items()
              if name in shapes and math.prod(shape) > math.prod(shapes[name])]
    if larger:
        raise ModelDirectoryError(
            f"{spec.path}/config.json makes tensors larger than its weights hold: {first_names(larger, 3)}. They"
            " would be allocated and initialised at random: fix config.json (hidden_size, intermediate_size,"
            " vocab_size...) or restore the checkpoint it came with")
    missing = sorted(name for name in needed if name not in shapes)
    # names may differ where transformers renames a checkpoint's keys as it loads: then only the counts are compared
    if missing and sum(map(math.prod, needed.values())) > sum(map(math.prod, shapes.values())):
        raise lacking_tensors(missing, spec.path)


def check_architecture(config: dict[str, Any], path: str, trust_remote_code: bool) -> None:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    model_type = config.get("model_type")
    if model_type in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        return
    if trust_remote_code and config.get("auto_map"):
        return
    raise UnsupportedArchitectureError(
        f"{path}/config.json has model_type {model_type!r}, which transformers cannot build as a causal LM"
        " (supported: llama, qwen2, mistral, gpt2, ... any AutoModelForCausalLM type)."
        + (" It ships custom code: set trust_remote_code only if you trust it." if config.get("auto_map") else "")
    )


def gptq_backend_available() -> bool:
    return importlib.util.find_spec("gptqmodel") is not None


def _check_quantization(config: dict[str, Any], spec: ModelSpec) -> None:
    if spec.quantization not in QUANTIZATIONS:
        raise ValueError(f"unknown quantization {spec.quantization!r}: use one of {', '.join(QUANTIZATIONS)}")
    quantization = config.get("quantization_config") or {}
    if not isinstance(quantization, dict):
        raise ModelDirectoryError(f"{spec.path}/config.json: quantization_config is a {type(quantization).__name__},"
                                  " not an object: fix or remove it")
    method = quantization.get("quant_method")
    if spec.quantization == "gptq" and method != "gptq":
        raise QuantizationBackendError(
            f"quantization 'gptq' requested but {spec.path}/config.json has no GPTQ quantization_config"
            f" (found {method!r}): point to a GPTQ checkpoint or set quantization to 'none'"
        )
    if method is not None and method != "gptq":  # the engine runs GPTQ checkpoints and its own CPU paths only
        raise QuantizationBackendError(
            f"{spec.path} is quantized with {method!r}, which this engine does not run: use the unquantized"
            " checkpoint (quantization int8/int4 gives the CPU kernels' compact weights) or a GPTQ one")
    if method == "gptq" and not gptq_backend_available():
        raise QuantizationBackendError(
            f"{spec.path} is a GPTQ checkpoint but the GPT-QModel backend is not installed:"
            " `pip install -r requirements-gptq.txt`"
            " (gptqmodel; auto-gptq is archived and unsupported by transformers 5)"
        )


def first_names(names: list[str], shown: int = 8) -> str:
    """'a, b, c and 5 more': a long list of tensor names in an error message."""
    return ", ".join(names[:shown]) + (f" and {len(names) - shown} more" if len(names) > shown else "")


def lacking_tensors(missing: list[str], path: str | Path) -> ModelDirectoryError:
    return ModelDirectoryError(
        f"the weights in {path} lack {len(missing)} tensor(s) that {path}/config.json needs: {first_names(missing)}."
        " They would be randomly initialised: restore the complete checkpoint, or fix config.json if it describes"
        " another model (a checkpoint without lm_head.weight needs tie_word_embeddings true)")


def check_loading_info(info: dict[str, Any], path: str | Path) -> None:
    """Refuse a load that left parameters out of the checkpoint: transformers initialises a tensor the config
    expects and the weights lack (``lm_head.weight`` with tie_word_embeddings false, a layer's weight) at random and
    only logs a LOAD REPORT, so an incomplete or mismatched checkpoint would run as a model of noise. Tied weights
    and non-persistent buffers (rotary inv_freq) are not in ``missing_keys``; tensors the config does not use
    (``unexpected_keys``, such as an older checkpoint's saved inv_freq) are harmless and allowed."""
    missing = sorted(str(k) for k in info.get("missing_keys") or ())
    errors = [str(e) for e in info.get("error_msgs") or ()]
    if missing:
        raise lacking_tensors(missing, path)
    if errors:
        raise ModelDirectoryError(f"the weights in {path} could not be loaded into the model: {'; '.join(errors)}")


def parameter_bytes(model: torch.nn.Module) -> int:
    """Bytes of weights a model occupies (parameters and buffers such as packed INT4 tensors)."""
    tensors = list(model.parameters()) + list(model.buffers())
    return sum(t.numel() * t.element_size() for t in tensors)


def check_spec(spec: ModelSpec) -> None:
    """Refuse what can be refused before a file is converted or loaded: the dtype / quantization pair, the device,
    and a folder that is missing, a file, or holds no config.json (a GGUF file or pkg: resource is checked when it
    is resolved)."""
    from .model_source import is_model_source

    forward_path_for(spec)
    resolve_device(spec.device)
    if not is_model_source(str(spec.path)):
        read_config(spec.path)


def load_model(spec: ModelSpec) -> LoadedModel:
    """Load one causal LM from a local directory (or a GGUF file, through its cached conversion) into eval mode,
    gradients off."""
    from .model_source import is_model_source, resolve_model_path

    spec = replace(spec, path=str(spec.path))  # a pathlib.Path too
    if is_model_source(spec.path):  # a GGUF file or pkg:... resource: its cached safetensors directory
        check_spec(spec)  # a bad dtype or device was refused only after minutes converting the file
        source = spec.path
        spec = replace(spec, path=str(resolve_model_path(spec.path)))
        try:
            return _load_directory(spec)
        except ModelDirectoryError as exc:  # its advice (restore the checkpoint, fix config.json) is for the folder
            raise type(exc)(f"{exc} [this folder is the cached conversion of {source}: delete it to convert the"
                            " file again]") from exc
    return _load_directory(spec)


def _load_directory(spec: ModelSpec) -> LoadedModel:
    from transformers import AutoModelForCausalLM

    from .draft_vocab import wrap_if_reduced

    config = read_config(spec.path)
    check_architecture(config, spec.path, spec.trust_remote_code)
    _check_quantization(config, spec)
    files = safetensors_files(spec.path)
    check_sizes_fit_weights(spec, config, files)
    path = forward_path_for(spec)
    device = resolve_device(spec.device)
    if config.get("quantization_config"):
        if path in (*PATHS[2:], AUTO):
            raise ValueError(f"{spec.path} is already quantized ({config['quantization_config'].get('quant_method')}):"
                             f" {_asked(spec)} cannot apply to it, use quantization 'none' or 'gptq' (dtype not"
                             " auto)")
        path = "gptq"
    # the CPU forward paths start from fp32 weights; GPUs, fp16 and GPTQ keep transformers' own cast
    cpu_path = device.type == "cpu" and path in (*PATHS, AUTO)
    if not cpu_path and path in (*PATHS[2:], AUTO):
        raise ValueError(f"{_asked(spec)} uses CPU kernels: on {device} use quantization none (dtype not auto)")
    dtype = torch.float32 if cpu_path else resolve_dtype(spec.dtype)
    kwargs: dict[str, Any] = dict(
        dtype=dtype,
        use_safetensors=True,
        local_files_only=True,
        trust_remote_code=spec.trust_remote_code,
    )
    if config.get("quantization_config"):
        kwargs["device_map"] = str(device)
    try:
        model, info = AutoModelForCausalLM.from_pretrained(spec.path, output_loading_info=True, **kwargs)
    except ImportError as exc:  # a backend the checkpoint needs (GPTQ's optimum, say) that is not installed
        raise QuantizationBackendError(f"could not load the model in {spec.path}: {exc}") from exc
    # besides damaged files: a config.json whose values have the wrong type or lack a key the model reads raises
    # TypeError, KeyError, AttributeError or huggingface_hub's own validation error, all this folder's to fix
    except MemoryError:  # not the folder's fault
        raise
    except Exception as exc:
        raise ModelDirectoryError(f"could not load the model in {spec.path}: {type(exc).__name__}: {exc}") from exc
    check_loading_info(info, spec.path)
    if "device_map" not in kwargs:
        model = model.to(device)
    model.eval()
    model.requires_grad_(False)
    choice = None
    if path == AUTO:
        choice = choose_path(model, spec.gamma)
        path = choice.path
    path_report = apply_path(model, path) if cpu_path else None
    prepared = prepare_off_lean_forward(model, path, spec.path)
    model, vocab_size = wrap_if_reduced(model, spec.path)  # a reduced-vocabulary draft speaks target ids
    return LoadedModel(
        model=model,
        spec=spec,
        size_bytes=parameter_bytes(model),
        vocab_size=vocab_size,
        max_positions=context_positions(model.config),
        forward_path=path,
        path_choice=choice,
        prepared=prepared,
        path_report=path_report,
    )


def prepare_off_lean_forward(model: torch.nn.Module, forward_path: str, where: str) -> dict | None:
    """For a model that runs on transformers' forward, not the engine's lean Llama forward: make its verify rows
    exact (what was done) and refuse one that keeps its context outside the KV cache; None for the lean forward.

    GPT-QModel's kernels, a plain head and transformers' attention over a cached prefix compute a verify's rows
    otherwise than one-token steps: without this a bf16 GPTQ target's speculative output differed from its own
    greedy output on 8 of 12 prompts (docs/results/gptq-smollm2.json), a bf16 Qwen2 one on 5 of 20. Drafts take
    it too (storage.build_model): a recurrent draft otherwise loaded and proposed from a forgotten prefix."""
    if forward_path != "gptq" and not unsupported_reason(model):
        return None
    from .row_exact import prepare_for_engine

    prepared = prepare_for_engine(model)
    check_incremental_forward(model, where)
    return prepared


def check_incremental_forward(model: torch.nn.Module, path: str) -> None:
    """UnsupportedArchitectureError unless a forward over a cached prefix gives the logits one forward over the whole
    sequence gives. The engine feeds every model that way (runtime/speculative.py's forward_once): a recurrent or
    hybrid model keeps its state elsewhere than the KV cache it is handed (transformers' Mamba ignores it and saw
    only the tokens of each call, silently; LFM2 raised at its first forward). The engine's own lean forward
    (Llama-like decoders) needs no such check."""
    from .speculative import KVState, forward_once

    vocab = max(int(getattr(model.config, "vocab_size", 0) or 0), 1)
    device = next(model.parameters()).device
    ids = [t % vocab for t in (1, 2, 3, 4, 5)]
    try:
        with torch.inference_mode():
            whole = forward_once(model, ids, KVState(), 1, device)[-1]
            cached = KVState()
            forward_once(model, ids[:4], cached, 1, device)
            stepped = forward_once(model, ids[4:], cached, 1, device)[-1]
    except Exception as exc:
        raise UnsupportedArchitectureError(
            f"{path}: a forward over a cached prefix failed ({type(exc).__name__}: {exc}); the engine feeds every"
            " model so (a recurrent or hybrid model's state is not a KV cache): use a transformer decoder") from exc
    # the same numbers up to the order of sums (bf16 weights: about 1e-2 of the largest logit); a model that
    # forgets its prefix is off by the logits' own size
    gap = float((whole - stepped).abs().max())
    if not gap <= 0.05 * (float(whole.abs().max()) + 1.0):
        raise UnsupportedArchitectureError(
            f"{path}: its logits after a cached prefix differ from one forward over the same tokens (by {gap:.3g}):"
            f" the model ({model.config.model_type}) does not keep its context in the KV cache the engine hands it"
            " (a recurrent or hybrid model); use a transformer decoder")


def load_tokenizer(path: str | Path):
    """The tokenizer stored beside a model (no network, no remote code)."""
    from transformers import AutoTokenizer

    from .model_source import is_model_source, resolve_model_path

    root = resolve_model_path(path) if is_model_source(str(path)) else Path(path)
    if not any((root / name).is_file() for name in ("tokenizer.json", "tokenizer.model", "vocab.json")):
        raise ModelDirectoryError(
            f"no tokenizer files (tokenizer.json, tokenizer.model or vocab.json) in {root}:"
            " copy the target's tokenizer there"
        )
    try:
        # trust_remote_code False, not left to transformers: with an auto_map it asked on stdin, and a "y" typed
        # into a command line tool ran the folder's code
        return AutoTokenizer.from_pretrained(str(root), local_files_only=True, trust_remote_code=False)
    except MemoryError:  # not the folder's fault
        raise
    except ImportError as exc:  # a package the tokenizer needs (sentencepiece, protobuf for a tokenizer.model alone)
        raise ModelDirectoryError(f"the tokenizer in {root} needs a package that is not installed: {exc}") from exc
    except Exception as exc:  # a damaged tokenizer.json raises KeyError, or tokenizers' bare Exception
        raise ModelDirectoryError(f"the tokenizer in {root} could not be loaded ({type(exc).__name__}: {exc}):"
                                  " restore its tokenizer files from the original model") from exc


def tokenizer_fingerprint(tokenizer) -> str:
    """A hash of the vocabulary (every token and its id, added tokens included): equal fingerprints mean
    interchangeable token ids. Not the special tokens' roles: those say which id ends a turn, not what an id is,
    and converters name them differently (transformers 5.17 and 5.23 make the same ids from the bundled GGUF
    with other eos/pad names, and a datastore built under one was refused under the other)."""
    vocab = sorted(tokenizer.get_vocab().items(), key=lambda item: item[1])
    return hashlib.sha256(json.dumps(vocab, ensure_ascii=False).encode()).hexdigest()


def check_shared_tokenizer(target_path: str | Path, draft_path: str | Path,
                           target_fingerprint: str | None = None) -> None:
    """Refuse a draft whose tokenizer differs from the target's (token ids must mean the same)."""
    if target_fingerprint is None:
        target_fingerprint = tokenizer_fingerprint(load_tokenizer(target_path))
    draft_fingerprint = tokenizer_fingerprint(load_tokenizer(draft_path))
    if draft_fingerprint != target_fingerprint:
        raise TokenizerMismatchError(
            f"the draft in {draft_path} has a different tokenizer from the target in {target_path}:"
            " speculative decoding needs one shared vocabulary; train or distill the draft with the target's tokenizer"
        )


def scored_width(path: str | Path, config: dict[str, Any] | None = None) -> int:
    """The token ids the model in ``path`` scores, from its files alone (no weights read; ``config``: its
    config.json, where the caller read it already): its vocab_size, or a reduced-vocabulary draft's target
    vocabulary (draft_vocab.json), as a load would find it."""
    from .draft_vocab import VOCAB_FILE, read_vocab_map

    rows = (read_config(path) if config is None else config).get("vocab_size") or 0
    if isinstance(rows, bool) or not isinstance(rows, int):  # a list or a float escaped int() naming no file
        raise ModelDirectoryError(f"{Path(path) / 'config.json'}: vocab_size must be a whole number, not"
                                  f" {str(rows)[:40]}")
    if (Path(path) / VOCAB_FILE).is_file():
        return read_vocab_map(path, rows)[1]  # DraftVocabError (a ValueError) for a malformed map
    return rows


def check_draft_compatible(target_vocab_size: int, draft: LoadedModel, name: str = "") -> None:
    """Logit widths must match so that draft and target probabilities line up token by token (a reduced-vocabulary
    draft's are its rows mapped back to target ids). The registry compares tokenizers; a draft of the same tokenizer
    but another width (a sibling model with padded rows) would fail in the first sampled rejection, or propose ids
    the target has no row for."""
    if draft.vocab_size != target_vocab_size:
        raise width_mismatch(name, draft.spec.path, draft.vocab_size, target_vocab_size)


def width_mismatch(name: str, path: str | Path, width: int, target_width: int) -> TokenizerMismatchError:
    """The error for a draft that scores ``width`` token ids where the target scores ``target_width``."""
    return TokenizerMismatchError(
        f"draft {name or str(path)!r} ({path}) scores {width} token ids, the target {target_width} (vocab_size):"
        " they cannot share token ids (a reduced-vocabulary draft's draft_vocab.json must name the target's"
        " vocabulary size)")
