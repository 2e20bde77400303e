"""A bundled draft as a full-vocabulary llama GGUF, so llama.cpp can run it as a speculative draft.

The bundled drafts are Hugging Face Llama directories with a reduced vocabulary
(``runtime/draft_vocab.py``): ``V_d`` rows for the target ids a domain uses plus one
input row shared by every other id. llama.cpp's speculative example wants a draft
that speaks the target's whole vocabulary with the target's tokenizer, so this
module writes one, with the same function of target ids the engine runs:

- ``token_embd`` (49,152 rows for SmolLM2): the draft's row of each target id; an
  id outside the subset gets the shared "every other id" row, exactly as
  ``DraftVocab.inputs`` maps inputs.
- ``output``: the draft's head row for each in-subset id. The engine gives ids
  outside the subset a logit of ``-inf``; a GGUF llama head has no bias, so the
  closest linear stand-in is a zero row (logit exactly 0). Such an id wins the
  draft's argmax only when all ``V_d`` subset logits are negative at once; the
  function ``outside_wins`` measures how often that happens (scripts/check_draft_gguf.py
  runs it over held-out chat prompts and the draft's continuations). A zero row also
  keeps ties deterministic, unlike a random or a negated-mean row whose sign
  depends on the hidden state.
- tokenizer metadata (``tokenizer.ggml.*``, ``tokenizer.chat_template``) copied
  from the target GGUF, so llama-speculative-simple finds the vocabularies identical.
- attention Q/K rows permuted from Hugging Face's rotate-half RoPE layout (the two
  halves of a head rotate together) to llama.cpp's, which rotates adjacent pairs.

Weights keep the draft's precision as f16 (1-D norms as f32, as llama.cpp expects).

    memspec-zoo draft-gguf --draft models/drafts/general --out artifacts/drafts-gguf/general.gguf
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import numpy as np

from ..runtime.draft_vocab import VOCAB_FILE, read_vocab_map

CONVERTER_VERSION = 1  # part of the cache key: bump when the written file changes
_COPIED_PREFIXES = ("tokenizer.ggml.", "tokenizer.chat_template")
_LAYER_TENSORS = {  # Hugging Face name inside model.layers.<i>. -> GGUF name inside blk.<i>.
    "input_layernorm.weight": "attn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}


class DraftGGUFError(ValueError):
    """The draft cannot be written as a llama GGUF for this target."""


def rope_rows_to_gguf(weight: np.ndarray, heads: int) -> np.ndarray:
    """Q/K projection rows from Hugging Face's layout to llama.cpp's.

    Per head, Hugging Face rotates row ``j`` with row ``j + d/2`` (rotate_half);
    llama.cpp's llama RoPE rotates rows ``2j`` and ``2j + 1``. New row ``2j + i`` is old
    row ``i*d/2 + j``: view each head as (2, d/2) and transpose it."""
    rows = weight.shape[0]
    if rows % (2 * heads):
        raise DraftGGUFError(f"{rows} projection rows do not split into {heads} heads of even width")
    half = rows // heads // 2
    return weight.reshape(heads, 2, half, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def draft_digest(draft_dir: str | Path, target_gguf: str | Path | None = None) -> str:
    """sha256 of what the GGUF is made from: the draft's files, the target file's identity, the converter."""
    h = hashlib.sha256(f"draft-gguf v{CONVERTER_VERSION}\n".encode())
    root = Path(draft_dir)
    for name in ("config.json", VOCAB_FILE, *sorted(p.name for p in root.glob("*.safetensors"))):
        file = root / name
        if file.is_file():
            h.update(name.encode() + b"\0")
            with file.open("rb") as f:
                for block in iter(lambda: f.read(1 << 20), b""):
                    h.update(block)
    if target_gguf is not None:
        # the target by content: its tokenizer metadata goes into the export, and a re-release of the same name and
        # size (a corrected special-token id) reused an export llama.cpp then refused beside the new target
        from memspec_ros.runtime.model_source import cached_digest

        h.update(f"target {cached_digest(Path(target_gguf))}".encode())
    return h.hexdigest()


def _read_draft(draft_dir: Path) -> tuple[dict, dict[str, np.ndarray]]:
    from safetensors.numpy import load_file

    config = json.loads((draft_dir / "config.json").read_text(encoding="utf-8"))
    arch = (config.get("architectures") or [""])[0]
    if config.get("model_type") != "llama" and arch != "LlamaForCausalLM":
        raise DraftGGUFError(f"{draft_dir}: a Llama draft is needed (model_type {config.get('model_type')!r})")
    tensors: dict[str, np.ndarray] = {}
    from ..runtime.models import ModelDirectoryError, safetensors_files

    try:  # the files the engine loads (model.safetensors, else its index's shards): a stray older shard beside them
        files = safetensors_files(draft_dir)  # went into the GGUF, and llama.cpp ran other weights than the engine
    except ModelDirectoryError as exc:
        raise DraftGGUFError(f"{draft_dir}: {exc}") from exc
    for file in files:
        tensors.update(load_file(str(file)))
    return config, tensors


def _rope_theta(config: dict) -> float:
    rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
    kind = rope.get("rope_type", rope.get("type", "default")) if isinstance(rope, dict) else "default"
    if kind not in ("default", None):
        raise DraftGGUFError(f"RoPE scaling {kind!r} is not supported by this converter")
    return float(rope.get("rope_theta", config.get("rope_theta", 10000.0)) if isinstance(rope, dict)
                 else config.get("rope_theta", 10000.0))


def _target_tokenizer_fields(target_gguf: Path) -> tuple[list[tuple[str, object, list]], int]:
    """(key, value, value types) of the target's tokenizer fields, and its vocabulary size."""
    from gguf import GGUFReader

    reader = GGUFReader(str(target_gguf))
    fields = [(k, f.contents(), list(f.types)) for k, f in reader.fields.items() if k.startswith(_COPIED_PREFIXES)]
    tokens = reader.fields.get("tokenizer.ggml.tokens")
    if tokens is None:
        raise DraftGGUFError(f"{target_gguf} has no tokenizer.ggml.tokens: not a target GGUF with a vocabulary")
    return fields, len(tokens.data)


def full_vocab_tables(config: dict, tensors: dict[str, np.ndarray], draft_dir: Path,
                      target_vocab: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(input embedding, output head, in-subset mask), each over every target id."""
    embed = tensors["model.embed_tokens.weight"]
    head = tensors.get("lm_head.weight")
    if head is None:
        if not config.get("tie_word_embeddings", True):
            raise DraftGGUFError(f"{draft_dir}: no lm_head.weight and tie_word_embeddings is false")
        head = embed
    rows = embed.shape[0]
    if (draft_dir / VOCAB_FILE).is_file():
        ids, size = read_vocab_map(draft_dir, rows)
        if size != target_vocab:
            raise DraftGGUFError(f"{draft_dir / VOCAB_FILE} is for a {size}-token target; the target GGUF has"
                                 f" {target_vocab} tokens")
        to_draft = np.full(target_vocab, rows - 1, dtype=np.int64)  # the shared row of every other id
        to_draft[np.asarray(ids, dtype=np.int64)] = np.arange(len(ids))
        inside = np.zeros(target_vocab, dtype=bool)
        inside[np.asarray(ids, dtype=np.int64)] = True
    else:  # an ordinary full-vocabulary draft: rows are target ids already
        if rows != target_vocab:
            raise DraftGGUFError(f"{draft_dir}: {rows} vocabulary rows and no {VOCAB_FILE}, but the target has"
                                 f" {target_vocab} tokens")
        to_draft = np.arange(rows)
        inside = np.ones(rows, dtype=bool)
    token_embd = embed[to_draft]
    output = np.zeros((target_vocab, head.shape[1]), dtype=head.dtype)
    output[inside] = head[to_draft[inside]]  # out of the subset: zero rows (see the module docstring)
    return token_embd, output, inside


def export_draft_gguf(draft_dir: str | Path, target_gguf: str | Path, out: str | Path) -> Path:
    """Write ``draft_dir`` as a full-vocabulary llama GGUF speaking ``target_gguf``'s tokenizer; returns ``out``."""
    from gguf import GGUFValueType, GGUFWriter, LlamaFileType

    draft_dir, target_gguf, out = Path(draft_dir), Path(target_gguf), Path(out)
    # the output replaced its own input without a word: the target model (--out naming the --target file), or a
    # file of the draft being read
    if out.is_dir():
        raise DraftGGUFError(f"{out} is a folder: name the GGUF file to write")
    if out.resolve() == target_gguf.resolve():
        raise DraftGGUFError(f"{out} is the target GGUF itself: name another file to write the draft to")
    if out.resolve().is_relative_to(draft_dir.resolve()):
        raise DraftGGUFError(f"{out} is inside the draft's folder {draft_dir}: write the GGUF elsewhere")
    config, tensors = _read_draft(draft_dir)
    fields, target_vocab = _target_tokenizer_fields(target_gguf)
    token_embd, output, _ = full_vocab_tables(config, tensors, draft_dir, target_vocab)

    hidden = int(config["hidden_size"])
    heads = int(config["num_attention_heads"])
    kv_heads = int(config.get("num_key_value_heads") or heads)
    head_dim = int(config.get("head_dim") or hidden // heads)
    layers = int(config["num_hidden_layers"])
    if config.get("attention_bias") or config.get("mlp_bias"):
        raise DraftGGUFError(f"{draft_dir}: biases in attention or MLP are not supported by this converter")

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    writer = GGUFWriter(str(tmp), "llama")
    writer.add_name(f"memspec draft {draft_dir.name} (full vocabulary)")
    writer.add_context_length(int(config.get("max_position_embeddings") or 2048))
    writer.add_embedding_length(hidden)
    writer.add_block_count(layers)
    writer.add_feed_forward_length(int(config["intermediate_size"]))
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_dimension_count(head_dim)
    writer.add_rope_freq_base(_rope_theta(config))
    writer.add_layer_norm_rms_eps(float(config.get("rms_norm_eps", 1e-6)))
    writer.add_vocab_size(target_vocab)
    writer.add_file_type(LlamaFileType.MOSTLY_F16)
    for key, value, types in fields:
        main = GGUFValueType(types[0])
        sub = GGUFValueType(types[-1]) if main == GGUFValueType.ARRAY else None
        writer.add_key_value(key, value, main, sub)

    def matrix(a: np.ndarray) -> np.ndarray:
        return np.ascontiguousarray(a, dtype=np.float16)

    def vector(a: np.ndarray) -> np.ndarray:
        return np.ascontiguousarray(a, dtype=np.float32)

    writer.add_tensor("token_embd.weight", matrix(token_embd))
    for i in range(layers):
        for hf, name in _LAYER_TENSORS.items():
            key = f"model.layers.{i}.{hf}"
            if key not in tensors:
                raise DraftGGUFError(f"{draft_dir}: {key} is missing")
            w = tensors[key]
            if name == "attn_q.weight":
                w = rope_rows_to_gguf(w, heads)
            elif name == "attn_k.weight":
                w = rope_rows_to_gguf(w, kv_heads)
            writer.add_tensor(f"blk.{i}.{name}", vector(w) if w.ndim == 1 else matrix(w))
    writer.add_tensor("output_norm.weight", vector(tensors["model.norm.weight"]))
    writer.add_tensor("output.weight", matrix(output))
    try:
        try:
            writer.write_header_to_file()
            writer.write_kv_data_to_file()
            writer.write_tensors_to_file()
        finally:
            writer.close()
        with open(tmp, "rb") as handle:  # on disk before the name that marks it whole
            os.fsync(handle.fileno())
        tmp.replace(out)
    finally:  # a failed write (a full disk) left a cut .tmp<pid> beside the cache's exports
        tmp.unlink(missing_ok=True)
    return out


def default_cache_dir() -> Path:
    """artifacts/drafts-gguf in a source checkout, else the package's cache folder's drafts-gguf
    ($MEMSPEC_CACHE_DIR, else $XDG_CACHE_HOME/memspec_ros)."""
    from memspec_ros.runtime.model_source import cache_root

    artifacts = Path(__file__).resolve().parents[2] / "artifacts"
    if artifacts.is_dir() and os.access(artifacts, os.W_OK):
        return artifacts / "drafts-gguf"
    return cache_root() / "drafts-gguf"


def cached_draft_gguf(draft_dir: str | Path, target_gguf: str | Path, cache_dir: str | Path | None = None) -> Path:
    """The draft's GGUF for this target, exported once and kept under a name keyed by the draft's digest."""
    draft_dir = Path(draft_dir)
    root = Path(cache_dir) if cache_dir else default_cache_dir()
    out = root / f"{draft_dir.name}-{draft_digest(draft_dir, target_gguf)[:16]}.gguf"
    if not out.is_file():
        export_draft_gguf(draft_dir, target_gguf, out)
    return out


def outside_wins(draft, token_ids: list[list[int]]) -> tuple[int, int, float]:
    """(positions where a zero head row would beat every subset logit, positions, the smallest largest
    subset logit seen), teacher-forced over ``token_ids``.

    ``draft`` is the engine's draft (target-width logits, ``-inf`` outside the subset);
    the exported head gives ids outside it a logit of 0, so they win exactly where the
    largest subset logit is negative."""
    import torch

    wins = total = 0
    lowest = float("inf")
    with torch.inference_mode():
        for ids in token_ids:
            best = draft(torch.tensor([ids])).logits[0].max(-1).values
            wins += int((best < 0).sum())
            total += best.numel()
            lowest = min(lowest, float(best.min()))
    return wins, total, lowest


def main_cli(a) -> int:
    """``memspec-zoo draft-gguf``."""
    from ..runtime.model_source import require_package, source_path
    from ..runtime.models import ModelLoadError

    target = a.target
    try:
        require_package("gguf", "to read the target's tokenizer and write the draft")  # not a traceback deep inside
        target_path = source_path(target)
        out = export_draft_gguf(a.draft, target_path, a.out)
    # ValueError: a target that is no GGUF file (gguf's "GGUF magic invalid"), a bad draft_vocab.json
    except (DraftGGUFError, OSError, KeyError, ValueError, ModelLoadError) as exc:
        raise SystemExit(f"memspec-zoo draft-gguf: {exc}") from None
    print(f"wrote {out} ({out.stat().st_size / 1e6:.1f} MB) from {a.draft}, tokenizer of {target_path}")
    return 0
