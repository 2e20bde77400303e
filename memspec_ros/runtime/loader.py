"""Loading a runtime from files, in one place: tokenizer, target, draft registry, predictor, controller.

The node's configure, every benchmark and :func:`load_runtime` load through here, so a zoo directory
means the same everywhere: the registry file names the target (read by :class:`DraftRegistry` only),
drafts are checked against the target tokenizer's fingerprint, drafts keep fp32 when the target's
dtype is ``auto`` (the measured choice is the target's), and a generation ends at the ids
:func:`end_token_ids` gives.

    models = load_models("models/registry.yaml", predictor_path=find_predictor(Path("models/predictor")))
    controller = models.controller(RuntimeConfig(policy="memspec"))
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .chat import end_token_ids
from .controller import RuntimeConfig, RuntimeController
from .datastore import Datastore
from .models import (
    LoadedModel,
    ModelSpec,
    TokenizerMismatchError,
    UnsupportedArchitectureError,
    check_spec,
    load_model,
    load_tokenizer,
    tokenizer_fingerprint,
)
from .predictor import HEAD_CONFIG, PredictionEngine
from .registry import DraftRegistry
from .speculative import input_rows

# Where a zoo keeps its trained predictor heads, in order of preference: the folder itself, then its encoder
# subfolders (target-hidden first: it needs no encoder pass).
PREDICTOR_PREFERENCE = ("", "target-hidden", "minilm")
DATASTORE_FILE = "datastore.safetensors"  # a zoo's past answers for context lookup (memspec-zoo datastore)


@dataclass(frozen=True)
class DraftLists:
    """Drafts given as parallel lists (ROS parameters cannot hold a list of mappings)."""

    names: Sequence[str]
    paths: Sequence[str]
    domains: Sequence[str] = ()


def find_predictor(root: str | Path | None) -> str:
    """A trained head in ``root`` itself or in its encoder subfolders, else ''."""
    if not root:
        return ""
    for sub in PREDICTOR_PREFERENCE:
        candidate = Path(root) / sub if sub else Path(root)
        if (candidate / HEAD_CONFIG).is_file():
            return str(candidate)
    return ""


def find_datastore(folder: str | Path | None) -> str:
    """``folder``'s datastore file (past answers for context lookup) if it has one, else ''."""
    candidate = Path(folder) / DATASTORE_FILE if folder else None
    return str(candidate) if candidate is not None and candidate.is_file() else ""


def registry_target(registry_file: str | Path) -> str | None:
    """The target path a registry file names (resolved from the file's folder), or None."""
    return DraftRegistry.from_yaml(registry_file, validate=False).target_path


def draft_dtype(dtype: str) -> str:
    """Drafts load in the target's dtype, but fp32 under ``auto`` (the measured choice is the target's)."""
    return "fp32" if dtype.lower() == "auto" else dtype  # "AUTO" too: every other check lowercases it


def open_registry(registry_file: str | Path | None = None, drafts: DraftLists | None = None, *,
                  fingerprint: str | None = None, validate: bool = True, vocab_size: int = 0) -> DraftRegistry:
    """The draft registry from lists if given, else from the file; drafts checked against the target tokenizer's
    ``fingerprint`` and the ``vocab_size`` token ids the target scores (0: not checked)."""
    if drafts is not None:
        return DraftRegistry.from_lists(drafts.names, drafts.paths, drafts.domains, target_fingerprint=fingerprint,
                                        validate=validate, target_vocab_size=vocab_size)
    if registry_file is None:
        raise ValueError("no draft registry: give a registry file or draft lists")
    return DraftRegistry.from_yaml(registry_file, target_fingerprint=fingerprint, validate=validate,
                                   target_vocab_size=vocab_size)


@dataclass
class RuntimeModels:
    """What a runtime loads from files; ``controller()`` puts a RuntimeController on top."""

    tokenizer: Any
    target: LoadedModel
    registry: DraftRegistry
    fingerprint: str  # the target tokenizer's: drafts added later are checked against it
    predictor: PredictionEngine | None
    draft_dtype: str
    device: str
    datastore: Datastore | None = None  # past answers context lookup searches (runtime/datastore.py)

    @property
    def end_token_ids(self) -> list[int]:
        """The ids that end a generation (the tokenizer's eos and the target's generation_config ones)."""
        return end_token_ids(self.tokenizer, self.target.model)

    def controller(self, config: RuntimeConfig, predictor: Any = None, **kwargs) -> RuntimeController:
        """A controller over these models; ``predictor`` replaces the loaded one (e.g. a wrapper of it)."""
        ranker = predictor if predictor is not None else self.predictor
        options = dict(max_positions=self.target.max_positions, draft_dtype=self.draft_dtype, device=self.device,
                       eos_token_ids=self.end_token_ids, datastore=self.datastore)
        return RuntimeController(config, self.target.model, self.tokenizer, self.registry, ranker,
                                 **(options | kwargs))

    def close(self) -> None:
        """Release the predictor's hold on the target (the target-hidden encoder's forward hook)."""
        if self.predictor is not None:
            self.predictor.close()


def on_cpu(model) -> bool:
    return next(model.parameters()).device.type == "cpu"


def check_target_rows(target: LoadedModel) -> None:
    """UnsupportedArchitectureError for a target on transformers' forward whose verify rows still differ from its
    one-token steps after load_model made it row-exact (a mixture-of-experts layer): its speculative output could
    part from its own greedy output. The engine's lean and C forwards are row-exact by construction on the CPU; on
    another device the lean forward is checked too (its kernels are the device's). A draft's numbers never matter
    (only the target's decide the output)."""
    from .draft_forward import lean_forward_for
    from .row_exact import verify_gap

    if target.prepared is None and on_cpu(target.model):
        return
    lean = lean_forward_for(target.model) if target.prepared is None else None
    gap = verify_gap(target.model, target.vocab_size, lean=lean)
    if gap != 0.0:
        why = (f"a {target.model.config.model_type} model; a mixture-of-experts layer batches the tokens routed to"
               " each expert" if target.prepared is not None else
               f"on {target.spec.device}, whose kernels sum a row differently beside others")
        raise UnsupportedArchitectureError(
            f"{target.spec.path}: as a target its verify rows differ from its one-token steps by {gap:.3g} ({why}),"
            " so speculative decoding would not reproduce its own greedy output: use it as a draft, or a dense"
            " target on the CPU")


def check_tokenizer_fits(tokenizer: Any, target: LoadedModel, tokenizer_path: str | Path | None) -> None:
    """Refuse a tokenizer with more ids than the target has embedding rows: a prompt holding one of the extra ids
    fails at the target's embedding lookup, goal after goal, instead of at configure. (More rows than ids is fine:
    models pad their embedding; SmolLM2's tokenizer has 49,152 ids for its 49,152 rows.) ``tokenizer_path`` empty:
    the tokenizer is the target folder's own."""
    ids, rows = len(tokenizer), input_rows(target.model)
    if rows and ids > rows:
        where = tokenizer_path or target.spec.path
        fix = ("they are not the same model's; use the target's own tokenizer (model.tokenizer_path empty: the"
               " target's directory)" if tokenizer_path else
               "the folder's own tokenizer does not fit its weights (tokens added without resizing the embedding,"
               " say): resize the model's embedding to the tokenizer, or restore the tokenizer that came with it")
        raise TokenizerMismatchError(
            f"the tokenizer in {where} has {ids} token ids but the target in {target.spec.path} reads only"
            f" {rows} (its input embedding rows): {fix}")


def load_models(
    registry_file: str | Path | None = None,
    *,
    drafts: DraftLists | None = None,
    target_path: str | Path | None = None,
    tokenizer_path: str | Path | None = None,
    predictor_path: str | Path | None = None,
    dtype: str = "fp32",
    device: str = "cpu",
    quantization: str = "none",
    gamma: int = 4,
    validate: bool = True,
    datastore_path: str | Path | None = None,
) -> RuntimeModels:
    """Tokenizer, target, registry and predictor.

    The target is ``target_path``, else the one ``registry_file`` names; the tokenizer is
    ``tokenizer_path``, else the target's. The registry comes from ``drafts`` if given, else from
    ``registry_file``, each draft checked against the target's tokenizer (``validate=False``: not
    checked, for benchmarks that load only some drafts). ``predictor_path`` is a trained head
    directory (see :func:`find_predictor`); empty: no predictor. ``gamma`` is what ``quantization``
    ``auto`` times the verify forward with. ``datastore_path`` is a file of past answers made for this
    target's tokenizer (see :func:`find_datastore`); empty: none.
    """
    target_dir = target_path or (registry_target(registry_file) if registry_file is not None else None)
    if not target_dir:
        raise ValueError(f"{registry_file or 'the draft lists'} name no target and no target path was given:"
                         " set the target path (model.target_path)")
    spec = ModelSpec(str(target_dir), dtype, device, quantization, gamma=gamma)
    # the target's settings and folder first: the tokenizer's load converts a GGUF target (minutes) and would name
    # a missing folder's tokenizer rather than the folder
    check_spec(spec)
    tokenizer = load_tokenizer(tokenizer_path or target_dir)
    target = load_model(spec)
    check_tokenizer_fits(tokenizer, target, tokenizer_path)
    check_target_rows(target)
    fingerprint = tokenizer_fingerprint(tokenizer)
    registry = open_registry(registry_file, drafts, fingerprint=fingerprint if validate else None, validate=validate,
                             vocab_size=target.vocab_size if validate else 0)
    predictor = None
    if predictor_path:
        predictor = PredictionEngine.load(predictor_path, target=target.model, tokenizer=tokenizer)
    datastore = Datastore.load(datastore_path, fingerprint=fingerprint) if datastore_path else None
    return RuntimeModels(tokenizer, target, registry, fingerprint, predictor, draft_dtype(dtype), device, datastore)

