"""The speculative decoding engine: draft proposes, target verifies, KV caches roll back.

One :class:`SpeculativeSession` is one generation. Each :meth:`~SpeculativeSession.step`
is one iteration: the active draft proposes ``gamma`` tokens with its own KV
cache, the target scores all of them in a single forward pass with its KV cache,
the longest agreeing prefix plus one target token is committed, and both caches
are cropped back to the committed text (never recomputed from the start).

Cache invariant (for the target and for every draft that has run): the cache
holds a prefix of the committed tokens, and the tokens after that prefix are fed
at the start of the next forward. Normally that is the one token committed last;
after a draft switch it is everything the incoming draft has not seen yet, which
is the *catch-up* cost of switching that MemSpec manages.

Lossless by construction: greedy commits exactly the target's argmax tokens, and
sampling uses the speculative-sampling rule of Leviathan et al. / Chen et al.
(accept a draft token with probability min(1, p/q), otherwise resample from the
normalised max(p - q, 0)), which leaves the target's distribution unchanged.
"""

from __future__ import annotations

import logging
import math
import numbers
import time
import weakref
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from .chat import stop_string_error, stop_token_ids
from .datastore import Datastore
from .draft_forward import LeanLlamaForward, context_positions, lean_forward_for, rope_length_limit, tightest
from .forward_paths import MAX_VERIFY_ROWS
from .gamma_choice import ForwardCosts, GammaChooser, draft_pays, measure_costs, row_pays, target_costs
from .kv_cache import crop_layers, limit_rows, preallocated_cache
from .lookup import LOOKUP_DRAFT, LookupConfig, NgramIndex
from .stats import GenerationStats, IterationStats

log = logging.getLogger(__name__)

FINISH_LENGTH = "length"
FINISH_EOS = "eos"
FINISH_STOP = "stop"
FINISH_CANCELLED = "cancelled"

ChunkCallback = Callable[[str, list[int]], None]


class ContextLengthError(ValueError):
    """Prompt plus requested tokens do not fit the target's context window."""


class DraftFailure(RuntimeError):
    """A draft failed while proposing: its forward raised (out of memory, say) or its logits are not usable
    (NaN, +inf, no finite value). Nothing of the iteration was committed and the target's cache is untouched;
    the caller takes the draft out of service and runs the iteration without it."""

    def __init__(self, draft: str, why: str) -> None:
        super().__init__(f"draft {draft!r} taken out of service: {why}")
        self.draft = draft


# torch.Generator.manual_seed takes [-2**63, 2**64) and folds a negative seed onto 2**64 + seed: seeds are refused
# outside [0, 2**64), where each is one distinct generator state
SEED_LIMIT = 2**64


@dataclass(frozen=True)
class SamplingConfig:
    """temperature <= 0 means greedy; top_p in (0, 1]; seed None draws a random one, else an integer in
    [0, 2**64)."""

    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None

    def __post_init__(self) -> None:
        for name, value in (("temperature", self.temperature), ("top_p", self.top_p)):
            if not isinstance(value, numbers.Real) or isinstance(value, bool):  # "1" failed in a bare comparison
                raise TypeError(f"{name} must be a number, got {value!r}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not math.isfinite(self.temperature):
            raise ValueError(f"temperature must be a finite number (<= 0: greedy), got {self.temperature}")
        # checked here, not where the session seeds its generator: that is after a controller has already reset
        # its draft cache and taken the prompt cache's entry for the goal
        seed = self.seed
        if seed is not None and not (isinstance(seed, numbers.Integral) and not isinstance(seed, bool)
                                     and 0 <= seed < SEED_LIMIT):
            raise ValueError(f"seed must be None (a fresh random seed) or an integer in [0, 2**64), got {seed!r}")

    @property
    def greedy(self) -> bool:
        # below float32's smallest normal number, 1 / T overflows in float32: CUDA divides by a scalar as a * (1 / T),
        # so the argmax's 0 * inf gave NaN probabilities (and T rounding to 0, 0 / 0 on any device); such a
        # temperature samples the argmax anyway
        return self.temperature < torch.finfo(torch.float32).tiny


def warp_probs(logits: torch.Tensor, sampling: SamplingConfig) -> torch.Tensor:
    """Probabilities after temperature and nucleus (top-p) filtering, row-wise."""
    # shifted by the row's maximum first, so a tiny temperature gives 0 and -inf (the argmax), not inf - inf
    logits = logits.float()
    probs = torch.softmax((logits - logits.max(dim=-1, keepdim=True).values) / sampling.temperature, dim=-1)
    if sampling.top_p >= 1.0:
        return probs
    # stable: tokens tied at the cut-off are kept in id order, the same in a one-row step and a verify's rows
    sorted_probs, order = torch.sort(probs, dim=-1, descending=True, stable=True)
    # keep the smallest prefix whose mass reaches top_p (the first token always stays)
    outside = (torch.cumsum(sorted_probs, dim=-1) - sorted_probs) >= sampling.top_p
    sorted_probs = sorted_probs.masked_fill(outside, 0.0)
    filtered = torch.zeros_like(probs).scatter(-1, order, sorted_probs)
    return filtered / filtered.sum(dim=-1, keepdim=True)


def speculative_accept(
    p: torch.Tensor, q: torch.Tensor, proposals: Sequence[int], generator: torch.Generator
) -> tuple[int, int]:
    """The lossless acceptance rule for sampled drafts.

    ``p``: target probabilities, shape [len(proposals) + 1, V]; ``q``: draft
    probabilities the proposals were drawn from, shape [len(proposals), V].
    Returns (number accepted, the extra token drawn from the target side).
    """
    for j, token in enumerate(proposals):
        ratio = p[j, token] / q[j, token]
        # fp32 whatever the process-wide default dtype: transformers' from_pretrained sets it to 16 bits while a
        # draft loads on the loader thread, and a bf16 coin (989 distinct values in 20,000 draws, none above
        # 0.99609375) accepted every ratio above that
        if torch.rand((), generator=generator, device=p.device, dtype=torch.float32) < ratio:
            continue
        residual = torch.clamp(p[j] - q[j], min=0.0)
        if not residual.sum() > 0:  # p = q to rounding (a rejection then has a vanishing chance): p itself, but
            # never the token just rejected, which the residual always leaves out
            residual = p[j].clone()
            residual[token] = 0.0
            if not residual.sum() > 0:  # p held the rejected token alone: p is what is left
                residual = p[j]
        residual = residual / residual.sum()
        token = int(torch.multinomial(residual, 1, generator=generator))
        if not residual[token] > 0:  # a torch whose multinomial drew a zero-probability id (an old CUDA one had
            # that bug): the output would no longer be the target's distribution, so it fails loudly
            raise RuntimeError(f"torch.multinomial drew token {token}, whose probability is 0: upgrade torch")
        return j, token
    return len(proposals), int(torch.multinomial(p[len(proposals)], 1, generator=generator))


class KVState:
    """A model's KV cache and how many committed tokens it holds."""

    __slots__ = ("cache", "length")

    def __init__(self) -> None:
        self.cache = preallocated_cache()
        self.length = 0

    def crop_to(self, length: int) -> None:
        """At most ``length`` committed tokens, on every layer (also where a failed forward left some layers
        ahead of ``self.length``: the draft-failure path keeps its cache)."""
        self.length = min(length, self.length)
        crop_layers(self.cache, self.length)


def forward_once(model: torch.nn.Module, ids: Sequence[int], kv: KVState, keep: int, device: torch.device | str,
                 lean: LeanLlamaForward | None = None) -> torch.Tensor:
    """Feed ``ids`` after the cached prefix; return float logits of the last ``keep`` positions.

    The engine's one forward, public so that benchmarks and path timing measure exactly what it runs."""
    if lean is not None:
        logits = lean(ids, kv.cache, kv.length, keep)
        kv.length += len(ids)
        return logits
    inputs = torch.tensor([list(ids)], dtype=torch.long, device=device)
    out = model(input_ids=inputs, past_key_values=kv.cache, use_cache=True, logits_to_keep=keep)
    kv.length += len(ids)
    return out.logits[0].float()


_KVState, _forward = KVState, forward_once  # the engine's own names for them


def _draft_logits(draft_name: str, *forward_args) -> torch.Tensor:
    try:
        return _forward(*forward_args)
    except Exception as exc:
        raise DraftFailure(draft_name, f"its forward raised {type(exc).__name__}: {exc}") from exc


def _check_top(draft_name: str, top: float) -> None:
    """-inf is allowed in a draft's row (a reduced vocabulary's absent ids), so the test is the row's maximum:
    NaN, +inf and -inf (no finite value) there are all unusable."""
    if not math.isfinite(top):
        raise DraftFailure(draft_name, f"its logits are not finite (maximum {top})")


def _last_checked_row(draft_name: str, logits: torch.Tensor) -> torch.Tensor:
    row = logits[-1]
    _check_top(draft_name, float(row.max()))
    return row


def _checked_draft_row(draft_name: str, *forward_args) -> torch.Tensor:
    """The draft's last logits row (``forward_once(*forward_args)``), or DraftFailure."""
    return _last_checked_row(draft_name, _draft_logits(draft_name, *forward_args))


def _greedy_draft_token(draft_name: str, *forward_args, confidence: bool = False) -> tuple[int, float]:
    """What ``argmax_rows(_checked_draft_row(...))`` gives, from one numpy pass over the row and no tensor
    operation: each costs a cold dispatch in the loop (docs/results/measured-here.md: why the loop was slower than
    its forwards). The argmax's value is the row's maximum, NaN included (numpy's argmax, like torch's max, stops
    at the first NaN). With ``confidence``, also the token's softmax probability (else 1.0)."""
    logits = _draft_logits(draft_name, *forward_args)
    rows = _numpy_rows(logits)
    if rows is None:  # not a CPU fp32 row: torch's own max and argmax
        row = _last_checked_row(draft_name, logits)
        token = argmax_rows(row)
        return token, float(torch.softmax(row.float(), -1)[token]) if confidence else 1.0
    row = rows[-1]
    token = int(row.argmax())
    top = float(row[token])
    _check_top(draft_name, top)
    # a reduced vocabulary's absent ids are -inf, exp 0: the sum is over the draft's own ids
    return token, 1.0 / float(np.exp(row - top).sum()) if confidence else 1.0


@dataclass
class _Proposal:
    """A draft's proposed tokens, the distributions they were drawn from (sampling), and its cache."""

    tokens: list[int] = field(default_factory=list)
    probs: list[torch.Tensor] = field(default_factory=list)
    kv: _KVState | None = None
    copied: bool = False  # copied from the context (runtime/lookup.py): q is one-hot on each token
    seconds: float = 0.0  # a copy's: the lookup's own time, which stands in for a draft's


class _Stopwatch:
    """``with _Stopwatch() as w: ...`` then ``w.seconds``: the one timer of the hot path."""

    seconds = 0.0

    def __enter__(self) -> _Stopwatch:
        self._start = time.perf_counter()
        return self

    def __exit__(self, *exc) -> None:
        self.seconds = time.perf_counter() - self._start


class _TextStream:
    """Incremental detokenisation with stop strings; holds back half-decoded UTF-8.

    Only the tokens since the last clean character boundary are decoded each
    call (the windowed scheme of TGI/vLLM: decode ``ids[prefix:]`` and
    ``ids[prefix:read]`` and append the difference), so streaming costs the
    same per token however long the output grows, and tokenizers that drop a
    leading space at the start of a decode (SentencePiece) still join right.
    """

    def __init__(self, tokenizer, stop_strings: Sequence[str]) -> None:
        self.tokenizer = tokenizer
        self.stops = [s for s in stop_strings if s]
        self.text = ""
        self.emitted = 0
        self._prefix = 0  # ids[_prefix:_read] decode to the tail of ``text`` already appended
        self._read = 0
        self._settled = 0  # characters past that tail appended while a character after them was unfinished

    def _append_decoded(self, ids: list[int], final: bool) -> None:
        decode = self.tokenizer.decode
        done = decode(ids[self._prefix : self._read], skip_special_tokens=True)
        now = decode(ids[self._prefix :], skip_special_tokens=True)
        # an unfinished UTF-8 sequence decodes to U+FFFD: the window waits for its last byte (unless this is the
        # end). The characters before it are final (UTF-8 resynchronises), and go into the text at once: a stop
        # string ending in the token that also starts the unfinished character was found only tokens later
        complete = final or not now.endswith("\ufffd")
        new = now[len(done) :] if complete else now.rstrip("\ufffd")[len(done) :]
        if len(new) > self._settled:
            self.text += new[self._settled :]
        if not complete:
            self._settled = max(self._settled, len(new))
        elif len(now) > len(done):
            self._prefix, self._read, self._settled = self._read, len(ids), 0

    def update(self, ids: list[int], final: bool) -> tuple[str, bool]:
        """New text since the last call and whether a stop string ended it."""
        if self.tokenizer is None:
            return "", False
        self._append_decoded(ids, final)
        stopped = False
        if self.stops:
            start = max(0, self.emitted - max(len(s) for s in self.stops))
            hits = [i for i in (self.text.find(s, start) for s in self.stops) if i >= 0]
            if hits:
                self.text = self.text[: min(hits)]
                stopped = True
        end = len(self.text)
        if not (final or stopped):
            # a stop string may be forming at the end: do not stream its prefix yet. Each stop is matched against
            # the whole text's end and the longest hold kept (reduced stop by stop, a later stop was matched against
            # a tail the earlier ones had cut, and held back text that could begin none of them)
            end -= max((next((k for k in range(min(len(stop) - 1, end - self.emitted), 0, -1)
                              if self.text.endswith(stop[:k])), 0) for stop in self.stops), default=0)
        delta = self.text[self.emitted : end]
        self.emitted = max(self.emitted, end)
        return delta, stopped


def input_rows(model: torch.nn.Module) -> int:
    """The token ids a model's embedding takes (0..rows-1); 0 where it cannot tell."""
    embed = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    rows = getattr(embed, "num_embeddings", None)
    if rows is None and getattr(embed, "weight", None) is not None:  # an embedding module of another kind
        rows = embed.weight.shape[0]
    config = getattr(model, "config", None)
    return int(rows if rows is not None else getattr(config, "vocab_size", 0) or 0)


# config fields of rotary position encodings: a model with any of them has no table of positions to run out of
ROTARY_CONFIG_KEYS = ("rope_theta", "rope_parameters", "rope_scaling", "rotary_dim", "rotary_pct", "rotary_emb_base")


def served_positions(target: torch.nn.Module, max_positions: int | None) -> int:
    """The positions a generation on ``target`` may use: ``max_positions`` (None: the target's own context; a
    600-token prompt on a 512-position model generated garbage without a word), but never past a learned position
    table (GPT-2: a verify feeding a position beyond it raised IndexError mid-generation, a device assert on CUDA)
    nor past the length where a length-dependent RoPE changes its frequencies (draft_forward.rope_length_limit).
    The session and the controller (which checks a request before taking anything for it) both take this."""
    config = getattr(target, "config", None)
    return tightest(max_positions or context_positions(config), position_table_rows(target),
                    rope_length_limit(config))


def position_table_rows(model: torch.nn.Module) -> int:
    """The rows of a model's learned absolute-position table (GPT-2's n_positions, OPT's max_position_embeddings):
    the positions it cannot go past. 0 for a rotary model, whose positions have no table (past its trained length
    it proposes worse, which the verify judges)."""
    config = getattr(model, "config", None)
    if config is None or any(getattr(config, key, None) is not None for key in ROTARY_CONFIG_KEYS):
        return 0
    return int(getattr(config, "n_positions", None) or getattr(config, "max_position_embeddings", None) or 0)


_POSITION_ROWS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # draft -> position_table_rows, once


def draft_room(draft: torch.nn.Module, tokens: int) -> int:
    """How many tokens ``draft`` may propose after ``tokens`` committed ones without feeding a position its table
    lacks: proposal k is fed at position tokens + k - 1 (the last is not fed; one row is kept spare). A GPT-2 draft
    shorter than the target raised IndexError there, and was taken out of service for every later goal. Asked every
    iteration: the config is read once per draft."""
    rows = _POSITION_ROWS.get(draft)
    if rows is None:
        rows = _POSITION_ROWS[draft] = position_table_rows(draft)
    return rows - tokens if rows else 1 << 62


def is_whole(value) -> bool:
    """An integer and not a bool (True is an int to Python), numpy's included."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def check_generation(prompt_ids: Sequence[int], max_new_tokens: int, max_positions: int = 0,
                     stop_strings: Sequence[str] = (), tokenizer=None, vocab_size: int = 0,
                     end_ids: Sequence[int] = ()) -> None:
    """A generation's request against what a session can run: ValueError (ContextLengthError) with the reason.
    Callers that take state for the session (a reused prompt prefix) check first, so a refused request takes
    nothing. ``vocab_size``: the target's token ids (0: not checked)."""
    if not prompt_ids:
        raise ValueError("the prompt is empty: give at least one token")
    wrong = [t for t in prompt_ids if not is_whole(t)]
    if wrong:  # 3.7 was taken as 3, a bytes prompt as its byte values
        raise TypeError(f"prompt token ids must be integers, got {wrong[0]!r} ({type(wrong[0]).__name__})")
    if vocab_size:
        bad = [t for t in prompt_ids if not 0 <= t < vocab_size]
        if bad:
            raise ValueError(f"prompt token ids must lie in [0, {vocab_size}) (the target's vocabulary), got"
                             f" {bad[:8]}{'...' if len(bad) > 8 else ''}")
    if not is_whole(max_new_tokens) or max_new_tokens < 1:  # nan passed "< 1" and ran with no length limit
        raise ValueError(f"max_new_tokens must be an integer >= 1, got {max_new_tokens!r}")
    if max_positions and len(prompt_ids) + max_new_tokens > max_positions:
        raise ContextLengthError(
            f"prompt ({len(prompt_ids)} tokens) + max_new_tokens ({max_new_tokens}) exceeds the"
            f" target's context of {max_positions} tokens: shorten the prompt or ask for fewer tokens"
        )
    if isinstance(stop_strings, (str, bytes)):
        # a string is a sequence of strings too: taken as given, each of its characters would be a stop string
        # and "\n\nUser:" would end the output at its first newline, 's', 'e', ... silently
        raise TypeError(f"stop strings must be a list of strings, got one string {stop_strings!r}:"
                        f" pass [{stop_strings!r}]")
    wrong = [s for s in stop_strings if not isinstance(s, str)]
    if wrong:
        raise TypeError(f"stop strings must be strings, got {wrong[0]!r} ({type(wrong[0]).__name__})")
    if stop_strings and tokenizer is None:
        raise ValueError("stop strings need a tokenizer to decode the output")
    reason = stop_string_error(stop_strings, tokenizer, end_ids)
    if reason:
        raise ValueError(reason)


class SpeculativeSession:
    """One generation: prefill the target, then draft-and-verify iterations.

    The caller (the runtime controller, a benchmark or :func:`generate`) picks
    the draft for each iteration; the session keeps one KV cache per draft that
    has run so a draft that comes back only catches up on what it missed.
    """

    def __init__(
        self,
        target: torch.nn.Module,
        prompt_ids: Sequence[int],
        *,
        max_new_tokens: int = 128,
        gamma: int = 4,
        sampling: SamplingConfig = SamplingConfig(),
        eos_token_ids: Sequence[int] = (),
        stop_strings: Sequence[str] = (),
        tokenizer=None,
        on_chunk: ChunkCallback | None = None,
        max_positions: int = 0,
        lean_drafts: bool = True,
        lean_target: bool = True,
        adaptive_gamma: bool = False,
        confidence_stop: bool = True,
        lookup: LookupConfig | None = None,
        datastores: Sequence[Datastore] = (),
        prefix: KVState | None = None,
        draft_prefixes: Mapping[str, tuple[torch.nn.Module, KVState]] | None = None,
    ) -> None:
        max_positions = served_positions(target, max_positions)
        if not isinstance(stop_strings, (str, bytes)):  # a one-shot iterable was used up by the check below
            stop_strings = list(stop_strings)
        # as the controller takes them (a tensor's truth value raised "ambiguous", a dict of settings failed on .seed,
        # an end id given alone on "not iterable")
        if hasattr(prompt_ids, "tolist"):
            prompt_ids = prompt_ids.tolist()
        if not isinstance(sampling, SamplingConfig):
            raise TypeError(f"sampling must be a SamplingConfig, got {type(sampling).__name__}")
        if is_whole(eos_token_ids) or isinstance(eos_token_ids, (str, bytes)):
            raise TypeError(f"eos_token_ids must be a list of token ids, got {eos_token_ids!r}: pass"
                            f" [{eos_token_ids!r}]")
        eos_token_ids = list(eos_token_ids)
        wrong = [t for t in eos_token_ids if not is_whole(t)]
        if wrong:
            raise TypeError(f"end token ids must be integers, got {wrong[0]!r}")
        check_generation(prompt_ids, max_new_tokens, max_positions, stop_strings, tokenizer, input_rows(target),
                         eos_token_ids)
        if prefix is not None and not 0 < prefix.length < len(prompt_ids):
            # the prefill must feed at least one token: its logits give the first generated token
            raise ValueError(f"a reused prefix must hold 1 to {len(prompt_ids) - 1} of the prompt's"
                             f" {len(prompt_ids)} tokens, got {prefix.length}")
        self.target = target
        self.device = next(target.parameters()).device
        self.prompt_ids = list(prompt_ids)
        self.max_new_tokens = max_new_tokens
        self.sampling = sampling
        self.draft_failure = ""  # why generate() went on without its draft ('' if it never had to)
        self.eos_token_ids = frozenset(eos_token_ids)
        # stop strings that are one special token each: the text never shows them, so the session ends at the token
        self.stop_token_ids = frozenset(stop_token_ids(stop_strings, tokenizer)) - self.eos_token_ids
        self.on_chunk = on_chunk
        self.lean_drafts = lean_drafts  # drafts run runtime/draft_forward.py where it applies
        # the target too: prefill, plain steps and verifies all take the same path, so the verify of
        # gamma + 1 tokens and one-token decoding compute each row alike (tests compare both)
        self._target_lean = lean_forward_for(target) if lean_target else None
        self._gamma = 1
        self.gamma = gamma
        # adaptive: ``gamma`` is the most a draft may propose; each iteration picks 0..gamma from the
        # measured forward costs and the draft's running acceptance (runtime/gamma_choice.py)
        self._gamma_chooser = GammaChooser(gamma) if adaptive_gamma else None
        # with adaptive gamma, the draft also stops on its own confidence (gamma_choice.row_pays); off: it
        # proposes the gamma chosen for the iteration, for a draft whose probabilities are not calibrated
        self._confidence_stop = confidence_stop
        # context lookup: where the text's last tokens occurred before, copy what followed them as the
        # proposal (free); the draft proposes only where nothing worth copying matches.
        # Datastores (past answers, runtime/datastore.py) are searched where the context has no match
        if datastores and lookup is None:
            raise ValueError("a datastore is searched by context lookup: pass lookup=LookupConfig() with it")
        for store in datastores:
            store.check_vocab(input_rows(target))
        self._lookup = NgramIndex(lookup, datastores) if lookup is not None else None
        if self._lookup is not None:
            self._lookup.extend(self.prompt_ids)
        self.generator = torch.Generator(device=self.device)
        seed = int(sampling.seed) if sampling.seed is not None else int(torch.randint(0, 2**62, ()).item())
        self.generator.manual_seed(seed)
        self.tokens: list[int] = list(prompt_ids)  # committed: prompt + generated
        self.stats = GenerationStats(prompt_tokens=len(self.prompt_ids))
        self.finish_reason = ""
        self._text = _TextStream(tokenizer, stop_strings)
        # ``prefix``: the target's KV of this prompt's first tokens, kept from a generation before
        # (runtime/prompt_cache.py); the prefill feeds only the rest. Each row's keys and values do not depend
        # on how many rows a forward fed (the same property that makes a verify equal one-token steps)
        self._target_kv = prefix if prefix is not None else _KVState()
        self._reused = prefix.length if prefix is not None else 0
        self.stats.reused_prompt_tokens = self._reused
        self._draft_kv: dict[str, _KVState] = {}
        self._draft_model: dict[str, torch.nn.Module] = {}  # the model each of those KV caches belongs to
        # ``draft_prefixes``: drafts' KV caches of this prompt's first tokens, kept from the generation before
        # (runtime/prompt_cache.py) with the model that computed each; a draft takes its own only if it is still
        # that model (an evicted and reloaded draft, or a replaced file, is another object and catches up in full)
        self._draft_prefixes = dict(draft_prefixes or {})
        for name, (_, kv) in self._draft_prefixes.items():
            if not 0 < kv.length < len(self.prompt_ids):
                raise ValueError(f"draft {name!r}: a reused prefix must hold 1 to {len(self.prompt_ids) - 1} of"
                                 f" the prompt's {len(self.prompt_ids)} tokens, got {kv.length}")
        self._last_draft = ""
        # plain target steps (gamma 0) since the last proposal: the draft then feeds what it skipped in one forward,
        # a catch-up, not the cost of a proposed token (charged to it, adaptive gamma's probe every PROBE_EVERY
        # iterations raised the draft's per-token cost ~2.6x and kept it switched off)
        self._skipped_plain = False
        self._decode_started = 0.0

    # -- public state ---------------------------------------------------------
    @property
    def gamma(self) -> int:
        return self._gamma

    @gamma.setter
    def gamma(self, value: int) -> None:
        if not is_whole(value) or not 1 <= value <= MAX_VERIFY_ROWS - 1:  # 2.5 failed mid-goal, True meant 1
            # a verify of gamma + 1 rows must compute each row as a one-token step does; the forward paths check
            # their kernels for that up to MAX_VERIFY_ROWS rows, so a longer verify could change the output
            raise ValueError(f"gamma (draft tokens per iteration) must be an integer 1..{MAX_VERIFY_ROWS - 1},"
                             f" got {value!r}")
        self._gamma = value

    @property
    def generated_ids(self) -> list[int]:
        return self.tokens[len(self.prompt_ids) :]

    @property
    def text(self) -> str:
        return self._text.text

    @property
    def finished(self) -> bool:
        return bool(self.finish_reason)

    @property
    def adaptive_gamma(self) -> bool:
        """Whether this generation chooses gamma per iteration (fixed for its life)."""
        return self._gamma_chooser is not None

    @property
    def started(self) -> bool:
        return self._target_kv.length > self._reused

    @property
    def target_kv(self) -> KVState:
        """The target's KV cache: it holds ``tokens[:target_kv.length]`` (the newest token is not fed yet)."""
        return self._target_kv

    def cancel(self) -> None:
        """End the generation at the current iteration boundary; the output so far stays, and streams whole: the
        text held back as a stop string's possible start is the output's (it was in the result but never streamed,
        so the feedback joined differed from the result's text), flushed as an end by length flushes it."""
        if not self.finished:
            self._finish(FINISH_CANCELLED)
            piece, _ = self._text.update(self.generated_ids, final=True)
            if piece and self.on_chunk is not None:
                self.on_chunk(piece, [])

    @property
    def draft_kvs(self) -> dict[str, tuple[torch.nn.Module, KVState]]:
        """Each draft that ran and is still held, and each reused one that did not run this goal (a prefix of the
        prompt, still valid: a later goal that runs it again needs no catch-up over the conversation): its model
        and its KV cache (a prefix of ``tokens``)."""
        unused = {name: (model, kv) for name, (model, kv) in self._draft_prefixes.items() if name not in self._draft_kv}
        return unused | {name: (self._draft_model[name], kv) for name, kv in self._draft_kv.items()}

    def draft_context_lengths(self, models: Mapping[str, torch.nn.Module] | None = None) -> dict[str, int]:
        """Context tokens each draft's KV cache holds now: those that ran, and the prompt cache's reused prefixes
        of those that have not yet, which only the same model object takes (``models``: the drafts resident now by
        name; None: every prefix counts)."""
        lengths = {name: kv.length for name, (model, kv) in self._draft_prefixes.items()
                   if models is None or models.get(name) is model}
        return lengths | {name: kv.length for name, kv in self._draft_kv.items()}

    def drop_draft(self, name: str) -> None:
        """Forget a draft's KV cache (its model was evicted); it catches up if it returns."""
        self._draft_kv.pop(name, None)
        self._draft_model.pop(name, None)
        self._draft_prefixes.pop(name, None)

    # -- the algorithm: propose -> verify -> accept -> commit ---------------------
    def _choose(self, logits: torch.Tensor) -> tuple[int, torch.Tensor | None]:
        """One token from a row of logits, for draft and target alike: the argmax, or a draw from the
        warped distribution (returned too: the acceptance rule needs the draft's q)."""
        if self.sampling.greedy:
            return argmax_rows(logits), None
        probs = warp_probs(logits, self.sampling)
        return int(torch.multinomial(probs, 1, generator=self.generator)), probs

    @torch.inference_mode()
    def prefill(self) -> int:
        """Encode the prompt with the target and commit the first token."""
        if self.started:
            raise RuntimeError("prefill() was already called for this session")
        # the target's cache never holds more than the prompt and the answer but its last token (a verify feeds no
        # proposal past that): its buffers grow up to that, not past it. Set on a reused conversation's layers before
        # the prefill, on a fresh cache's (made by the prefill) after it
        most_rows = len(self.tokens) + self.max_new_tokens - 1
        limit_rows(self._target_kv.cache, most_rows)
        with _Stopwatch() as watch:
            logits = _forward(self.target, self.tokens[self._reused:], self._target_kv, 1, self.device,
                              self._target_lean)
            limit_rows(self._target_kv.cache, most_rows)
            token, _ = self._choose(logits[-1])
        self.stats.prefill_seconds = watch.seconds
        self._decode_started = time.perf_counter()
        self._commit([token])
        return token

    def restart_decode_clock(self) -> None:
        """Decoding time starts now: what ran after the prefill but before the first iteration (the first
        prediction and draft load) is setup, not decoding (runtime/stats.py: the paper's metric)."""
        if self.started and not self.generated_ids[1:]:
            self._decode_started = time.perf_counter()

    @torch.inference_mode()
    def step(self, draft_name: str = "", draft: torch.nn.Module | None = None) -> IterationStats:
        """One iteration with ``draft`` (None: a plain target step). Returns its statistics. On a session not yet
        started it prefills first; where that prefill ends the generation (one token allowed, or the first token
        ends it) no iteration runs and the statistics are empty (committed 0, not recorded), so ``while not
        finished: step()`` is a whole generation."""
        if not self.started:
            self.prefill()
            if self.finished:
                return IterationStats(draft="", proposed=0, accepted=0, committed=0, draft_seconds=0.0,
                                      verify_seconds=0.0)
        if self.finished:
            raise RuntimeError(f"the generation has finished ({self.finish_reason}); start a new session")
        remaining = self.max_new_tokens - len(self.generated_ids)
        proposal = self._copied_proposal(remaining - 1, draft_name, draft)
        if proposal.copied:  # the lookup's time stands in for the draft's
            draft_name = LOOKUP_DRAFT
            stats = IterationStats(draft=LOOKUP_DRAFT, proposed=0, accepted=0, committed=0,
                                   draft_seconds=proposal.seconds, verify_seconds=0.0)
        else:
            # no proposal past the tokens left less one (the target's own token follows), nor past a draft's table of
            # absolute positions; with no room the iteration is a plain step, and the draft's timing, probe and
            # failure are not spent on it
            room = remaining - 1 if draft is None else min(remaining - 1, draft_room(draft, len(self.tokens)))
            gamma, costs = self._gamma_for(draft_name, draft, room) if draft is not None and room > 0 else (0, None)
            gamma = min(gamma, room)
            stats = IterationStats(draft=draft_name if gamma > 0 else "", proposed=0, accepted=0, committed=0,
                                   draft_seconds=0.0, verify_seconds=0.0)
            proposal = self._propose(draft_name, draft, gamma, stats, costs) if gamma > 0 else _Proposal()
            self._skipped_plain = self._skipped_plain or gamma == 0
        try:
            with _Stopwatch() as watch:
                logits = self._verify(proposal.tokens)
                accepted, extra = self._accept(logits, proposal)
        except BaseException:
            # the draft's cache holds its proposals, none committed: back to a prefix of the text, as between
            # iterations (a caller that steps again had the draft fed nothing, and blamed for it). A failure inside
            # the target's forward on transformers' path may leave its layers' caches uneven: that session is done
            if proposal.kv is not None:
                proposal.kv.crop_to(min(proposal.kv.length, len(self.tokens) - 1))
            # the target's too: a verify that succeeded before the acceptance failed (NaN logits in the sampling)
            # left the proposals in its cache, and a step after that fed only the new ones behind them
            self._target_kv.crop_to(len(self.tokens) - 1)
            raise
        stats.verify_seconds = watch.seconds
        stats.proposed, stats.accepted = len(proposal.tokens), accepted
        if self._gamma_chooser is not None and (draft is not None or proposal.copied):
            self._gamma_chooser.observe(draft_name, len(proposal.tokens), accepted)
            if not proposal.copied:
                self._gamma_chooser.observe_cost(draft_name, stats.timed_draft_forwards,
                                                 1000.0 * stats.draft_seconds)
        stats.committed = self._commit_accepted(proposal, accepted, extra)
        # an end token, the length or a stop string inside the accepted run: the proposals after it stood but were
        # not committed (the target alone would never produce them), so they do not count as accepted
        stats.accepted = min(accepted, stats.committed)
        self.stats.iterations.append(stats)
        return stats

    def _propose(self, draft_name: str, draft: torch.nn.Module, gamma: int, stats: IterationStats,
                 costs: ForwardCosts | None = None) -> _Proposal:
        """The draft proposes up to ``gamma`` tokens, first catching up on what it has not seen. With ``costs``
        (adaptive gamma) it stops where its own confidence no longer pays for a verify row (gamma_choice.row_pays):
        greedy, the token that fails the test is dropped, its forward counted in ``stats.dropped``; sampled, the
        test is made before each draw (draft_pays) and a drawn token is always proposed (see below)."""
        kv = self._draft_kv.get(draft_name)
        if kv is not None and self._draft_model.get(draft_name) is not draft:  # another model under that name:
            # the cache is the other model's, and would be kept as this one's. (Adaptive gamma's estimates stay: a
            # name stands for its weights, and the cache loads an evicted draft again as a new object of the same)
            self.drop_draft(draft_name)
            kv = None
        # catching up: a switch, a draft whose cache was dropped (evicted, then loaded again), or the first proposal
        # after plain steps. (After copied iterations the draft's reading of the copies stays its cost: the copies
        # are weighed against it, runtime/gamma_choice.py)
        catching_up = kv is None or draft_name != self._last_draft or self._skipped_plain
        if kv is None:
            reused = self._draft_prefixes.pop(draft_name, None)
            kv = reused[1] if reused is not None and reused[0] is draft else _KVState()
            self._draft_kv[draft_name], self._draft_model[draft_name] = kv, draft
        proposal = _Proposal(kv=kv)
        feed = self.tokens[kv.length :]
        try:  # built at a draft's first proposal where its loader did not (out of memory fusing its weights, say)
            lean = lean_forward_for(draft) if self.lean_drafts else None
        except Exception as exc:  # the draft's failure, taken out of service, not the goal's
            raise DraftFailure(draft_name, f"its forward could not be built ({type(exc).__name__}: {exc})") from exc
        confidence = 1.0  # the draft's chance that every proposal so far is accepted
        try:
            for k in range(1, gamma + 1):
                if costs is not None and k > 1 and not draft_pays(costs, k, confidence):
                    break
                with _Stopwatch() as watch:
                    if self.sampling.greedy:
                        token, p = _greedy_draft_token(draft_name, draft, feed, kv, 1, self.device, lean,
                                                       confidence=costs is not None)
                        q = None
                    else:
                        token, q = self._choose(_checked_draft_row(draft_name, draft, feed, kv, 1, self.device, lean))
                        p = float(q[token])
                        if not p > 0:  # p/q would be inf: accepted whatever the target gives it (a sampler that
                            # drew a zero-weight id, as CUDA multinomial did in old torch releases)
                            raise DraftFailure(draft_name, f"it drew token {token}, to which its own distribution"
                                                           " gives probability 0")
                if catching_up and k == 1:
                    stats.catchup_tokens, stats.catchup_seconds = len(feed), watch.seconds
                else:
                    stats.draft_seconds += watch.seconds
                confidence *= p
                # greedy only: a sampled token dropped for its own probability would leave the proposals drawn from q
                # cut to its likelier tokens while the acceptance rule divides by q (biased output). Sampling keeps
                # every drawn token; the stop then comes before the next draw (draft_pays), decided by the past alone.
                if costs is not None and q is None and not row_pays(costs, k, confidence):
                    stats.dropped += 1
                    break
                proposal.tokens.append(token)
                if q is not None:
                    proposal.probs.append(q)
                feed = [token]
        except DraftFailure:  # its cache may hold its earlier proposals, never committed: keep a prefix of the text,
            # all but the newest token, as between iterations (the next proposal feeds at least that one: a cache
            # holding every committed token left it nothing to feed, and the draft failed again at its next step)
            kv.crop_to(min(kv.length, len(self.tokens) - 1))
            raise
        self._last_draft = draft_name
        self._skipped_plain = False
        return proposal

    def _copied_proposal(self, most: int, draft_name: str = "", draft: torch.nn.Module | None = None) -> _Proposal:
        """Tokens copied from the context or a datastore, up to ``most`` and gamma: none when nothing
        matches or, with adaptive gamma, when copying is not expected to beat a plain step, nor the draft.

        With adaptive gamma a copy is weighed against the draft that would run instead: both rates are expected
        committed tokens per millisecond from their running acceptance (gamma_choice), and the copy is proposed
        when its rate is at least the draft's, or every PROBE_EVERY declined copies, so its acceptance stays
        current. Taking every copy cost the strong math draft most of its gain (int4, 3 held-out requests:
        1.67x the target alone with the datastore's copies against 2.35x without, E[A] 1.71 against 2.73).
        Interleaved A/B, 24 held-out requests per domain (int4, 1 thread, scripts/ab_copy_weighing.py,
        docs/results/ab-copy-weighing.json): weighing against taking every copy worth a plain step decodes 1.114x on
        math, 1.007x law, 1.005x general, 0.997x medical, 0.967x code (GMEAN 1.017x)."""
        if self._lookup is None or most < 1:
            return _Proposal()
        t0 = time.perf_counter()
        tokens, _ = self._lookup.propose(min(self.gamma, most))
        seconds = time.perf_counter() - t0
        chooser = self._gamma_chooser
        if tokens and chooser is not None:
            # the rival's costs are not the lookup's time: a new draft's first call runs its one-off timing forwards
            rival = self._draft_costs(draft_name, draft) if draft is not None else None
            t0 = time.perf_counter()
            chooser.max_gamma = self.gamma
            free = ForwardCosts(verify_ms=target_costs(self.target, self.gamma), draft_ms=0.0)
            tokens = tokens[: chooser.choose_copy(free, LOOKUP_DRAFT, len(tokens), draft_name, rival)]
            seconds += time.perf_counter() - t0
        return _Proposal(tokens=tokens, copied=True, seconds=seconds) if tokens else _Proposal()

    def _draft_costs(self, draft_name: str, draft: torch.nn.Module) -> ForwardCosts | None:
        """The draft's costs as adaptive gamma sees them (measured, then observed); None when its timing fails
        (the copy is then weighed against a plain step only, and the draft's failure is _propose's to report)."""
        try:
            measured = measure_costs(self.target, draft, self.gamma, self.lean_drafts)
            return self._gamma_chooser.costs(measured, draft_name)
        except Exception:
            return None

    def _verify(self, proposals: list[int]) -> torch.Tensor:
        """The target scores the uncached committed tokens and every proposal in one forward."""
        feed = self.tokens[self._target_kv.length :] + proposals
        return _forward(self.target, feed, self._target_kv, len(proposals) + 1, self.device, self._target_lean)

    def _accept(self, logits: torch.Tensor, proposal: _Proposal) -> tuple[int, int]:
        """How many proposals stand, and the target's own next token (greedy match, or the sampling rule)."""
        if self.sampling.greedy:
            choices = argmax_rows(logits)
            accepted = 0
            while accepted < len(proposal.tokens) and proposal.tokens[accepted] == choices[accepted]:
                accepted += 1
            return accepted, choices[accepted]
        p = warp_probs(logits, self.sampling)
        if proposal.copied:
            q = torch.nn.functional.one_hot(torch.tensor(proposal.tokens, device=p.device), p.shape[-1]).to(p.dtype)
        else:
            q = torch.stack(proposal.probs) if proposal.probs else p[:0]
        return speculative_accept(p, q, proposal.tokens, self.generator)

    def _commit_accepted(self, proposal: _Proposal, accepted: int, extra: int) -> int:
        """Roll both caches back to the committed text (all but the newest token), then commit."""
        base = len(self.tokens)
        self._target_kv.crop_to(base + accepted)
        if proposal.kv is not None:
            # the proposal's own ``kv``: a drop_draft (an eviction) since the proposal may have dropped the dict entry
            proposal.kv.crop_to(base + accepted)
        return self._commit(proposal.tokens[:accepted] + [extra])

    def _gamma_for(self, draft_name: str, draft: torch.nn.Module,
                   room: int | None = None) -> tuple[int, ForwardCosts | None]:
        """This iteration's most proposals (up to ``room``), and the costs its draft stops by (None: a fixed gamma,
        no stop)."""
        if self._gamma_chooser is None:
            return self.gamma, None
        self._gamma_chooser.max_gamma = self.gamma  # a reconfigured gamma bounds the choice from now on
        target_costs(self.target, self.gamma)  # (cached) the target's own timing: its failure is the goal's
        try:  # the draft's timing forwards, at its first iteration: a failure there is the draft's, as in _propose
            measured = measure_costs(self.target, draft, self.gamma, self.lean_drafts)
        except Exception as exc:
            raise DraftFailure(draft_name, f"its forward raised {type(exc).__name__}: {exc}") from exc
        costs = self._gamma_chooser.costs(measured, draft_name)
        return self._gamma_chooser.choose(costs, draft_name, room), costs if self._confidence_stop else None

    def _commit(self, new_tokens: list[int]) -> int:
        """Append tokens up to EOS / max_new_tokens / a stop string, stream the text. With stop strings the text
        is looked at after every token, as one-token decoding commits them: the tokens after the one that completes
        a stop string are not committed, and the finish reason is the one the target alone would give."""
        committed, delta = 0, ""
        per_token = bool(self._text.stops) and self._text.tokenizer is not None
        for token in new_tokens:
            self.tokens.append(token)
            committed += 1
            eos = token in self.eos_token_ids
            stop_token = token in self.stop_token_ids
            at_end = eos or stop_token or len(self.generated_ids) >= self.max_new_tokens
            stopped = False
            if per_token or at_end or committed == len(new_tokens):
                piece, stopped = self._text.update(self.generated_ids, final=at_end)
                delta += piece
            # a stop string the last allowed token completes ends the text there: "stop", not "length" (a client
            # that asks again for more tokens on "length" would act on a cut that did not happen)
            if eos:
                self._finish(FINISH_EOS)
            elif stopped or stop_token:
                self._finish(FINISH_STOP)
            elif at_end:
                self._finish(FINISH_LENGTH)
            if self.finished:
                break
        if self._lookup is not None:
            self._lookup.extend(new_tokens[:committed])
        self.stats.completion_tokens = len(self.generated_ids)
        if self.on_chunk is not None:
            self.on_chunk(delta, new_tokens[:committed])
        return committed

    def _finish(self, reason: str) -> None:
        self.finish_reason = reason
        self.stats.finish_reason = reason
        if self._decode_started:
            self.stats.decode_seconds = time.perf_counter() - self._decode_started


def argmax_rows(logits: torch.Tensor):
    """The argmax of a row of logits (an int), or of each row (a list): the first on a tie, as torch's.

    On a CPU fp32 tensor numpy's vectorized argmax does it: torch's took 0.15 ms on one 49,152-wide row and
    0.8 ms on a 5-row verify (1 thread), 6% of an int4 verify and about a third of each reduced-vocabulary draft
    token's forward; numpy's takes 6 and 25 us, same indices (NaN, the largest for both, included). End to end
    the saving was within noise (int4, 6 prompts interleaved in one process: engine 1.008x, target alone 0.988x)."""
    rows = _numpy_rows(logits)
    return rows.argmax(-1).tolist() if rows is not None else logits.argmax(dim=-1).tolist()


def _numpy_rows(logits: torch.Tensor):
    """A CPU fp32 tensor's numpy view (no copy, and no detach dispatch where it needs none), else None."""
    if logits.device.type != "cpu" or logits.dtype != torch.float32:
        return None
    return (logits.detach() if logits.requires_grad else logits).numpy()


def logit_width(model: torch.nn.Module) -> int:
    """The token ids a causal LM scores (a reduced-vocabulary draft's: the target ids its rows map to; 0: unknown)."""
    vocab = getattr(model, "vocab", None)
    width = getattr(vocab, "target_vocab_size", None) or getattr(getattr(model, "config", None), "vocab_size", 0)
    return int(width or 0)


def check_draft_width(target: torch.nn.Module, draft: torch.nn.Module) -> None:
    """TypeError for a draft that is no model, ValueError for one that scores other token ids than the target: a
    wider one raised IndexError deep in torch, a narrower one was taken out of service at its first step and the
    generation went on with the target alone, said only in the log."""
    if not isinstance(draft, torch.nn.Module):
        raise TypeError(f"the draft must be a torch.nn.Module (a causal LM), got {type(draft).__name__}")
    want, got = logit_width(target), logit_width(draft)
    if want and got and want != got:
        raise ValueError(f"the draft scores {got} token ids and the target {want}: they must share token ids (a"
                         " reduced-vocabulary draft maps its rows to the target's vocabulary)")


def generate(
    target: torch.nn.Module,
    prompt_ids: Sequence[int],
    draft: torch.nn.Module | None = None,
    *,
    draft_name: str = "draft",
    **session_kwargs,
) -> SpeculativeSession:
    """Run one generation with a single draft (or none: plain autoregressive decoding). A draft that fails
    (DraftFailure: its forward raised, its logits unusable) is taken out of service as the controller takes it:
    the generation goes on with the target alone and keeps its tokens; the failure is logged."""
    if draft is not None:
        check_draft_width(target, draft)
    session = SpeculativeSession(target, prompt_ids, **session_kwargs)
    session.prefill()
    while not session.finished:
        try:
            session.step(draft_name, draft)
        except DraftFailure as exc:  # nothing of the iteration was committed: the next one runs without it
            log.warning("%s; the generation goes on with the target alone", exc)
            session.draft_failure, draft = str(exc), None
    return session
