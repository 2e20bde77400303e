"""The target's KV cache kept from one generation to the next, for a prompt that starts the same way.

A robot's conversation grows turn by turn: each goal sends the whole conversation (system prompt, the earlier
turns and their answers, the new request), so without this the target encodes the same leading tokens again at
every goal, and the prefill grows with the conversation. After a generation the controller keeps the target's KV
cache and the tokens it holds; the next generation reuses it up to the longest common prefix of those tokens and
its prompt (cropped there), and the prefill feeds only the rest. This is what llama.cpp's server calls prompt
caching.

Reuse changes no output where a row's keys and values do not depend on how many rows the forward that computed
them fed: then the reused KV cache is bit for bit what a fresh prefill computes. The engine's C decoder
(runtime/cpu_kernels.c) computes each row on its own, so there it holds (measured on the bundled target, fp32,
int8 and int4: logits and KV equal after splits at 1, 5, 17, 150 and 299 of a 300-token prompt). The lean Python
forward does not: its BLAS calls block by the number of rows and round differently (measured on a tiny model:
fp32 logits 1e-5 apart, int8 and int4 too), which could change a greedy token at a near-tie; transformers'
forward runs the same kind of calls and was not checked. So :func:`reuse_refused` allows reuse only for a target
whose forward is the C decoder *and* gives the same bits for a prompt fed whole or split (checked once per
model, on this CPU); elsewhere the controller encodes every prompt in full and says why.
``test_prompt_cache.py`` checks logits, KV and outputs against a fresh prefill.

The drafts' KV caches are kept too, each with the model that computed it, so a draft that ran in the last goal
and is still resident (the same model object: not evicted and reloaded, not replaced) does not catch up on the
whole conversation again at its first proposal (27-38 ms at the fourth turn of a chat with the bundled zoo).
A draft only proposes, and the target verifies every token, so a draft's reused KV cannot change an output
whatever its forward's rounding. The cache holds one
conversation: a prompt that shares nothing with it starts from nothing and replaces it. Its memory is the KV
cache a generation of that length uses anyway (the bundled target: 46 KB per token in fp32), kept between goals;
``clear`` frees it.
"""

from __future__ import annotations

import weakref
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch

from .draft_forward import lean_forward_for
from .speculative import KVState, forward_once

_REFUSED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> reuse_refused's answer


def reuse_refused(model: torch.nn.Module) -> str:
    """"" where reusing ``model``'s KV cache gives the bits of a fresh prefill; otherwise why not.

    Run once per model, before it serves a generation (its forwards reach the model's hidden-state observers)."""
    if model not in _REFUSED:
        lean = lean_forward_for(model)
        if lean is None or not lean.decoder:
            _REFUSED[model] = ("the target's forward is not the engine's C decoder, whose rows do not depend on the"
                               " rows fed beside them")
        else:
            _REFUSED[model] = _split_check(model, lean)
    return _REFUSED[model]


@torch.inference_mode()
def _split_check(model: torch.nn.Module, lean) -> str:
    """Feed 24 tokens whole and split three ways: the last logits must be the same bits."""
    vocab = int(model.config.vocab_size)
    ids = [(7 + 31 * i) % vocab for i in range(24)]
    whole = forward_once(model, ids, KVState(), 1, "cpu", lean)
    for split in (1, 5, 23):
        kv = KVState()
        forward_once(model, ids[:split], kv, 1, "cpu", lean)
        if not torch.equal(forward_once(model, ids[split:], kv, 1, "cpu", lean), whole):
            return f"on this CPU the target's logits after a split prefill ({split} + {24 - split} tokens) differ"
    return ""


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """The number of leading tokens ``a`` and ``b`` share."""
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


@dataclass
class Reuse:
    """What a generation takes from the cache: the target's KV cache of the prompt's first tokens (None: feed
    the whole prompt) and, by draft name, a draft's model with its KV cache of (a part of) those tokens."""

    target: KVState | None = None
    drafts: dict[str, tuple[torch.nn.Module, KVState]] = field(default_factory=dict)


class PromptCache:
    """The target's KV cache, the drafts', and the tokens they hold; a generation takes them and hands them back."""

    def __init__(self) -> None:
        self._tokens: list[int] = []
        self._kv: KVState | None = None
        # name -> (the draft model, by weak reference: an evicted draft is not kept alive here, its KV cache)
        self._drafts: dict[str, tuple[weakref.ref, KVState]] = {}

    @property
    def tokens(self) -> int:
        """Tokens held (0: empty)."""
        return len(self._tokens)

    @property
    def drafts(self) -> dict[str, int]:
        """The drafts whose KV caches are held, and the tokens each holds."""
        return {name: kv.length for name, (_, kv) in self._drafts.items()}

    def take(self, prompt_ids: Sequence[int]) -> Reuse:
        """The KV caches cropped to what ``prompt_ids`` shares with them, leaving at least one prompt token to
        feed; nothing when nothing is shared. Either way the cache is empty afterwards: the generation owns the
        KV caches until ``keep`` hands them back."""
        kv, tokens, drafts = self._kv, self._tokens, self._drafts
        self.clear()
        if kv is None:
            return Reuse()
        shared = min(common_prefix(tokens, prompt_ids), len(prompt_ids) - 1)
        if shared < 1:
            return Reuse()
        kv.crop_to(shared)
        reuse = Reuse(target=kv)
        for name, (ref, draft_kv) in drafts.items():
            model = ref()
            draft_kv.crop_to(shared)
            if model is not None and draft_kv.length > 0:
                reuse.drafts[name] = (model, draft_kv)
        return reuse

    def keep(self, tokens: Sequence[int], kv: KVState,
             drafts: Mapping[str, tuple[torch.nn.Module, KVState]] | None = None) -> None:
        """Hold ``kv`` (and the ``drafts``' KV caches) with the ``tokens`` it was fed (a finished generation's:
        the newest is not fed yet). A generation that ended inside an accepted run (end token, stop string,
        length) fed accepted tokens it then dropped: their positions are cropped."""
        kv.crop_to(len(tokens))
        self._tokens, self._kv = list(tokens[: kv.length]), kv
        self._drafts = {}
        for name, (model, draft_kv) in (drafts or {}).items():
            draft_kv.crop_to(kv.length)  # a draft's cache is a prefix of the target's tokens
            if draft_kv.length > 0:
                self._drafts[name] = (weakref.ref(model), draft_kv)

    def clear(self) -> None:
        self._tokens, self._kv, self._drafts = [], None, {}
