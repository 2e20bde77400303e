"""A lean forward pass for Llama-architecture models (drafts and the target).

A draft proposes ``gamma`` tokens one forward at a time, and for the small
drafts MemSpec keeps resident most of a transformers forward is per-module
Python (hooks, keyword plumbing, output records, attention-interface lookup),
not arithmetic: on the bundled zoo's 2-layer draft a single-token forward
takes ~0.85 ms through ``model(...)`` and ~0.45 ms as the plain sequence of
tensor operations below. This module runs that sequence on the model's own
parameters and rotary-embedding module, writing keys and values into the
engine's preallocated KV cache, so nothing about the draft changes but its
speed.

The target runs it too (prefill, plain steps, verifies), with the forward
paths' compact linears (runtime/forward_paths.py) and q/k/v and gate/up fused
where the fused module provably equals its parts; rows fed after a cached
prefix attend one by one, so a verify's rows are computed exactly as one-token
decoding computes them. The tests check its logits against transformers' and
the engine's output against the target's own one-token greedy output on every
path.

Anything it does not reproduce exactly falls back to the transformers forward:
another architecture, quantized or otherwise non-``nn.Linear`` projections,
sliding-window attention, tensor-parallel pretraining splits.
"""

from __future__ import annotations

import inspect
import weakref
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from transformers.cache_utils import Cache

from . import cpu_kernels
from .draft_vocab import DraftVocab, ReducedVocabDraft
from .forward_paths import FAST_LINEARS, MAX_VERIFY_ROWS, blas_rows_exact, concat_linears, f32_kernel_linear
from .kv_cache import claimed_rows, is_preallocated

# what the lean path can call: plain linears and the forward paths' modules (runtime/forward_paths.py)
_LINEARS = (torch.nn.Linear, *FAST_LINEARS)


LENGTH_DEPENDENT_ROPE = ("dynamic", "longrope")


def rope_type(config) -> str:
    """The config's RoPE type (transformers 5's rope_parameters, or the older rope_scaling); 'default' if none."""
    for attr in ("rope_parameters", "rope_scaling"):
        params = getattr(config, attr, None)
        if isinstance(params, dict) and (params.get("rope_type") or params.get("type")):
            return str(params.get("rope_type") or params.get("type"))
    return "default"


def rope_length_limit(config) -> int:
    """Positions past which a length-dependent RoPE (LENGTH_DEPENDENT_ROPE) changes its frequencies: 0 for any other
    type. transformers picks them from a call's longest position, so a verify straddling the limit computes every row
    with the long frequencies where one-token decoding computed the rows before it with the short ones: past it, the
    engine would not be lossless (a review's finding, for a Phi-3-style longrope target on transformers' forward)."""
    if rope_type(config) not in LENGTH_DEPENDENT_ROPE:
        return 0
    params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    original = params.get("original_max_position_embeddings") or getattr(config, "original_max_position_embeddings",
                                                                         None)
    return int(original or getattr(config, "max_position_embeddings", 0) or 0)


def tightest(*limits: int) -> int:
    """The smallest of the limits that are set (0: none is)."""
    return min((n for n in limits if n > 0), default=0)


def context_positions(config) -> int:
    """The positions a target serves here: its max_position_embeddings, capped by rope_length_limit (0: none known)."""
    return tightest(int(getattr(config, "max_position_embeddings", 0) or 0), rope_length_limit(config))


def unsupported_reason(model: torch.nn.Module) -> str:
    """Why ``model`` cannot take the lean path ('' when it can)."""
    if isinstance(model, ReducedVocabDraft):
        model = model.inner
    config = getattr(model, "config", None)
    if config is None or getattr(config, "model_type", "") != "llama":
        return f"architecture {getattr(config, 'model_type', type(model).__name__)!r} is not 'llama'"
    if getattr(config, "pretraining_tp", 1) != 1:
        return "pretraining_tp > 1"
    if getattr(config, "sliding_window", None):
        return "sliding-window attention"
    rope = rope_type(config)
    if rope in LENGTH_DEPENDENT_ROPE:
        # the lean forward reads cos/sin from a table filled once for many positions (_rope_rows): these types
        # choose their frequencies from the longest position of a call, so the table's would differ from
        # transformers' (2.0 apart in cos at position 1100 in a review's check) and the call changes the module
        return f"RoPE type {rope!r} (its frequencies depend on the sequence length)"
    inner = getattr(model, "model", None)
    if inner is None or not hasattr(inner, "layers") or not hasattr(model, "lm_head"):
        return "not a LlamaForCausalLM layout (model.model.layers, lm_head)"
    for name, module in model.named_modules():
        if name and "proj" in name.rsplit(".", 1)[-1] and type(module) not in _LINEARS:
            return f"{name} is {type(module).__name__}, not nn.Linear or a forward-path linear (GPTQ?)"
    if type(model.lm_head) not in _LINEARS:
        return f"lm_head is {type(model.lm_head).__name__}"
    return ""


@dataclass(frozen=True)
class _Layer:
    attn_norm: torch.Tensor
    qkv: torch.nn.Module  # q, k and v projections side by side: one matmul instead of three
    o: torch.nn.Module
    mlp_norm: torch.Tensor
    gate_up: torch.nn.Module  # gate and up side by side
    down: torch.nn.Module


def _fused(parts: list[torch.nn.Module]) -> torch.nn.Module:
    """A layer's parts fused into one matmul: a forward path's modules, or plain fp32 linears on the f32 kernel
    (their weights fused in place, forward_paths.f32_kernel_linear). Plain linears with no kernel here are left
    as they are: fusing them for a BLAS sgemm would only change their sums' order."""
    fused = f32_kernel_linear(parts) if type(parts[0]) is torch.nn.Linear else concat_linears(parts)
    return fused if fused is not None else _Side(parts)


def _single(layer: torch.nn.Module) -> torch.nn.Module:
    """One linear as the lean forward runs it: a plain fp32 one on the f32 kernel where it applies."""
    return (f32_kernel_linear([layer]) or layer) if type(layer) is torch.nn.Linear else layer


class _Side(torch.nn.Module):
    """Unfused parts computed one after another and concatenated along the last dimension."""

    def __init__(self, parts: list[torch.nn.Module]) -> None:
        super().__init__()
        self.parts = torch.nn.ModuleList(parts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([_linear(p, x) for p in self.parts], dim=-1)


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # as LlamaRMSNorm: the statistic in fp32, the weight applied in the input dtype
    # a verify's rows one at a time on a GPU: its reduction splits a row's sum among threads by how many rows come
    # together, so a row's statistic (and the logits after it) differed in the last bits from a one-token step's.
    # The CPU reduces each row alone, in one order whatever the row count (its decode loop pays the device check only)
    if x.device.type != "cpu" and 1 < (rows := x.numel() // x.shape[-1]) <= MAX_VERIFY_ROWS:
        flat = x.reshape(rows, x.shape[-1])
        return torch.cat([_rms_norm(flat[i : i + 1], weight, eps) for i in range(rows)]).reshape(x.shape)
    dtype = x.dtype
    x = x.float()
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x.to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _is_silu(act: torch.nn.Module) -> bool:
    # torch's module, or transformers' SiLUActivation (a module calling F.silu)
    return isinstance(act, torch.nn.SiLU) or type(act).__name__ == "SiLUActivation"


def _linear(layer: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    # F.linear directly skips nn.Module.__call__'s hook machinery on the hot path
    if type(layer) is torch.nn.Linear:
        rows = x.numel() // x.shape[-1]
        if 1 < rows <= MAX_VERIFY_ROWS and not blas_rows_exact(layer):
            # a verify's rows one at a time, each the very call a one-token step makes (a BLAS sgemm sums a row
            # differently beside others, so greedy output could part from the target's own at a near-tie)
            flat = x.reshape(rows, x.shape[-1])
            out = torch.cat([F.linear(flat[i : i + 1], layer.weight, layer.bias) for i in range(rows)])
            return out.reshape(*x.shape[:-1], out.shape[-1])
        return F.linear(x, layer.weight, layer.bias)
    return layer(x)


class LeanLlamaForward:
    """``forward(ids, cache, start, keep)``: logits of the last ``keep`` positions, cache updated in place."""

    def __init__(self, model: torch.nn.Module) -> None:
        reason = unsupported_reason(model)
        if reason:
            raise ValueError(f"the lean draft forward does not support this model: {reason}")
        # a reduced-vocabulary draft: map target ids in and scatter its logits back out
        self.vocab: DraftVocab | None = model.vocab if isinstance(model, ReducedVocabDraft) else None
        model = model.inner if isinstance(model, ReducedVocabDraft) else model
        # weakly: this object is the value of _LEAN, a WeakKeyDictionary keyed by the model, and a strong
        # reference back would keep every model that ever ran (each evicted draft, a cleaned-up target) alive
        self._model = weakref.ref(model)
        config = model.config
        inner = model.model
        self.heads = config.num_attention_heads
        self.kv_heads = config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        self.eps = config.rms_norm_eps
        self.embed = inner.embed_tokens  # an nn.Embedding, or forward_paths.Q8Embedding / F16Embedding
        self.device = inner.norm.weight.device
        self.rotary = inner.rotary_emb  # the model's own module: every RoPE variant it supports
        self.norm = inner.norm.weight
        self.lm_head = _single(model.lm_head)
        self.act = inner.layers[0].mlp.act_fn
        self.q_width = self.heads * self.head_dim
        self.kv_width = self.kv_heads * self.head_dim
        self.layers = [
            _Layer(layer.input_layernorm.weight,
                   _fused([layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj]),
                   _single(layer.self_attn.o_proj), layer.post_attention_layernorm.weight,
                   _fused([layer.mlp.gate_proj, layer.mlp.up_proj]), _single(layer.mlp.down_proj))
            for layer in inner.layers
        ]
        self.intermediate = inner.layers[0].mlp.gate_proj.out_features
        # the whole decoder in one C call where every linear runs on the engine's kernels (runtime/cpu_kernels.py)
        built = (cpu_kernels.Decoder.build(self.layers, (config.hidden_size, self.heads, self.kv_heads,
                                                         self.head_dim, self.intermediate), self.eps)
                 if _is_silu(self.act) else f"activation {type(self.act).__name__}, not SiLU")
        self.decoder = built if isinstance(built, cpu_kernels.Decoder) else None
        self.decoder_reason = "" if self.decoder else built
        self._rope: tuple[torch.Tensor, torch.Tensor] | None = None  # the decoder's cos/sin table (_rope_rows)
        # the whole forward in one C call (cpu_kernels.Step) where the embedding and the head qualify too
        step = (cpu_kernels.Step.build(self.decoder, self.embed, self.norm, self.lm_head,
                                       self.vocab.target_ids if self.vocab is not None else None,
                                       self.vocab.target_vocab_size if self.vocab is not None
                                       else model.lm_head.out_features)
                if self.decoder is not None else "no decoder kernel")
        self.step = step if isinstance(step, cpu_kernels.Step) else None
        self.step_reason = "" if self.step else step
        # target id -> draft row, as a list: a Python lookup costs no tensor dispatch
        self._to_draft = self.vocab.to_draft.tolist() if self.vocab is not None and self.step else None
        self._likes: dict[int, torch.Tensor] = {}  # the KV claim's shape template per row count (_like)
        # RMSNorm weights it holds (the model's own Parameters, whatever form its linears and embedding took), and
        # where they are: a cast, a move or share_memory() gives these Parameters new memory (moved())
        self._watched = (self.layers[0].attn_norm, self.layers[-1].mlp_norm, self.norm)
        self._placed = self._placement()

    def _placement(self) -> tuple[int, ...]:
        return tuple(t.data_ptr() for t in self._watched)

    def moved(self) -> bool:
        """Whether the model's tensors moved since this forward was built (its C forward names the old memory)."""
        return self._placement() != self._placed


    def _rope_rows(self, x: torch.Tensor, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin [end - start, head_dim] of positions start..end-1, from a table the model's rotary module
        filled once (each entry is one product and a cos/sin, so a table row equals the module's own output for
        that position). It spares the decoder kernel the module's small matmul, whose BLAS threads would spin
        on the cores the kernel's threads run on."""
        if self._rope is None or self._rope[0].shape[0] < end:
            capacity = max(256, 2 * end)
            cos, sin = self.rotary(x, torch.arange(capacity, device=x.device)[None])
            self._rope = (cos[0].float().contiguous(), sin[0].float().contiguous())
        return self._rope[0][start:end], self._rope[1][start:end]

    def _like(self, n: int) -> torch.Tensor:
        """An [1, kv_heads, n, head_dim] fp32 tensor: what kv_cache.claim_rows reads a claim's shape from."""
        like = self._likes.get(n)
        if like is None:
            # fp32 explicitly: torch's default dtype is process-wide, and another thread's model load may change it
            like = torch.empty(1, self.kv_heads, n, self.head_dim, dtype=torch.float32, device=self.device)
            if n <= 16:  # a step's or a verify's row count: kept, so a forward allocates no template
                self._likes[n] = like
        return like

    def _stepped(self, ids: Sequence[int], cache: Cache, start: int, keep: int) -> torch.Tensor:
        """The forward as one C call (cpu_kernels.Step): what __call__ computes, bar the final RMSNorm's and the
        embedding lookup's order of operations, with two tensor allocations instead of ~25 dispatches."""
        rows = list(ids)
        # checked before the cache is claimed, as the embedding lookup checks them first on the other paths
        bound = len(self._to_draft) if self._to_draft is not None else self.step.rows
        if not rows or min(rows) < 0 or max(rows) >= bound:
            raise IndexError(f"token ids must lie in [0, {bound}), got {rows[:8]}{'...' if len(rows) > 8 else ''}")
        if self._to_draft is not None:
            rows = [self._to_draft[i] for i in rows]
        n, end = len(rows), start + len(rows)
        like = self._like(n)
        with claimed_rows(cache, len(self.layers), like, start) as buffers:
            if self._rope is None or self._rope[0].shape[0] < end:
                self._rope_rows(like, start, end)  # the table covers every fed position
            observers = observed(self._model())
            normed = torch.empty(n, self.step.decoder.dim, dtype=torch.float32) if observers else None
            logits = self.step(rows, start, self._rope, keep, buffers, normed)
        for observe in observers:
            observe(normed, start)
        return logits

    def __call__(self, ids: Sequence[int], cache: Cache, start: int, keep: int) -> torch.Tensor:
        if self.step is not None and self.decoder is not None and is_preallocated(cache):  # no decoder: no step
            return self._stepped(ids, cache, start, keep)
        n, end = len(ids), start + len(ids)
        tokens = torch.tensor([list(ids)], device=self.device)
        x = self.embed(tokens if self.vocab is None else self.vocab.inputs(tokens))
        if self.decoder is not None and x.dtype == torch.float32 and is_preallocated(cache):
            like = x.new_empty(1, self.kv_heads, n, self.head_dim)
            rows = x[0].contiguous()
            cos, sin = self._rope_rows(x, start, end)
            with claimed_rows(cache, len(self.layers), like, start) as buffers:
                self.decoder(rows, start, cos, sin, buffers)
            return self._head(rows[None], start, keep)
        positions = torch.arange(start, end, device=x.device)[None]
        cos, sin = self.rotary(x, positions)
        cos, sin = cos[:, None], sin[:, None]
        # several new tokens (a catch-up after a switch) attend causally to each other
        # A prefill attends causally in one call. Rows fed after a cached prefix (a verify, a catch-up)
        # attend one by one, each to exactly its own prefix: the very call one-token decoding makes, so
        # a verify's rows equal one-token steps bit for bit (a masked batched call sums differently).
        mask = torch.ones(n, end, dtype=torch.bool, device=x.device).tril(start) if n > 1 and start == 0 else None
        rowwise = n > 1 and start > 0
        gqa = self.heads != self.kv_heads
        for index, layer in enumerate(self.layers):
            h = _rms_norm(x, layer.attn_norm, self.eps)
            q, k, v = _linear(layer.qkv, h).split((self.q_width, self.kv_width, self.kv_width), dim=-1)
            q = q.reshape(1, n, self.heads, self.head_dim).transpose(1, 2)
            k = k.reshape(1, n, self.kv_heads, self.head_dim).transpose(1, 2)
            v = v.reshape(1, n, self.kv_heads, self.head_dim).transpose(1, 2)
            q = q * cos + _rotate_half(q) * sin
            k = k * cos + _rotate_half(k) * sin
            keys, values = cache.update(k, v, index)
            if rowwise:
                attn = torch.cat([F.scaled_dot_product_attention(q[:, :, i : i + 1], keys[:, :, : start + i + 1],
                                                                 values[:, :, : start + i + 1], enable_gqa=gqa)
                                  for i in range(n)], dim=2)
            else:
                attn = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, enable_gqa=gqa)
            x = x + _linear(layer.o, attn.transpose(1, 2).reshape(1, n, self.heads * self.head_dim))
            h = _rms_norm(x, layer.mlp_norm, self.eps)
            gate, up = _linear(layer.gate_up, h).split(self.intermediate, dim=-1)
            x = x + _linear(layer.down, self.act(gate) * up)
        return self._head(x, start, keep)

    def _head(self, x: torch.Tensor, start: int, keep: int) -> torch.Tensor:
        """The decoder's output rows ``x`` [1, n, hidden]: observers, final norm, and the last ``keep`` logits."""
        observers = observed(self._model())
        if observers:  # what a forward hook on the decoder would see: every fed row, final-normed
            hidden = _rms_norm(x, self.norm, self.eps)[0]
            for observe in observers:
                observe(hidden, start)
        x = _rms_norm(x[:, -keep:], self.norm, self.eps)
        logits = _linear(self.lm_head, x)[0].float()
        return logits if self.vocab is None else self.vocab.logits(logits)


_LEAN: weakref.WeakKeyDictionary[torch.nn.Module, LeanLlamaForward | None] = weakref.WeakKeyDictionary()


HiddenObserver = Callable[[torch.Tensor, int], None]  # (final-normed hidden rows [n, d], first position)
# a bound method is kept as a weakref.WeakMethod: its object (a predictor's encoder) holds the model, and held
# strongly as this table's value it would keep its own key, the model, alive for good if never removed
_OBSERVERS: weakref.WeakKeyDictionary[torch.nn.Module, list[Callable[[], HiddenObserver | None]]] = \
    weakref.WeakKeyDictionary()


class ObserverHandle:
    """``remove()`` stops the observer, as a torch hook handle does."""

    def __init__(self, model: torch.nn.Module, entry: Callable[[], HiddenObserver | None]) -> None:
        self._model, self._entry = weakref.ref(model), entry

    def remove(self) -> None:
        model = self._model()
        if model is not None and self._entry in _OBSERVERS.get(model, []):
            _OBSERVERS[model].remove(self._entry)


_PAUSED: weakref.WeakSet[torch.nn.Module] = weakref.WeakSet()  # models whose forwards no observer may see


@contextmanager
def observers_paused(model: torch.nn.Module) -> Iterator[None]:
    """No observer of ``model`` sees the forwards run inside (a timing run over made-up tokens in the middle of a
    generation would otherwise replace the rows a target-hidden predictor recorded). Not re-entrant per model."""
    _PAUSED.add(model)
    try:
        yield
    finally:
        _PAUSED.discard(model)


def observers_are_paused(model: torch.nn.Module) -> bool:
    """Whether ``model``'s forwards are hidden from its observers now (a torch hook of an observer asks too)."""
    return model in _PAUSED


def observed(model: torch.nn.Module | None) -> list[HiddenObserver]:
    """``model``'s observers, none while they are paused."""
    if model is None or observers_are_paused(model):
        return []
    found = [entry() for entry in _OBSERVERS.get(model, ())]
    return [observer for observer in found if observer is not None]  # None: its object is gone


def observe_hidden(model: torch.nn.Module, observer: HiddenObserver) -> ObserverHandle:
    """Call ``observer`` with the final hidden states of every row the lean forward feeds ``model``.

    The lean forward bypasses module hooks, so a reader of the target's hidden states (the
    target-hidden predictor) registers here as well as on the decoder's forward hook."""
    if inspect.ismethod(observer):
        entry = weakref.WeakMethod(observer)
    else:
        def entry(observer=observer):
            return observer
    _OBSERVERS.setdefault(model, []).append(entry)
    return ObserverHandle(model, entry)


def decoder_summary(model: torch.nn.Module) -> str:
    """How a forward runs the model's layers: one C call (runtime/cpu_kernels.py), the lean Python forward
    (and why not the C one), or transformers'."""
    lean = lean_forward_for(model)
    if lean is None:
        return f"transformers ({unsupported_reason(model)})"
    return "memspec kernel: one C call per forward" if lean.decoder else f"lean python ({lean.decoder_reason})"


def lean_forward_for(model: torch.nn.Module) -> LeanLlamaForward | None:
    """The model's lean forward, built once per model object, and again where the model's tensors moved since (a
    cast, a move, share_memory(): its C forward named the old memory); None when it must use transformers."""
    lean = _LEAN.get(model, False)
    if lean is False or (lean is not None and lean.moved()):  # three data_ptr reads: run at every proposal
        _LEAN[model] = lean = None if unsupported_reason(model) else LeanLlamaForward(model)
    return lean
