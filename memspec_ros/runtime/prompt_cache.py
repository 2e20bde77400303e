"""The target's and drafts' KV caches kept from one generation for later ones, for a prompt that starts the same way.

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
whole conversation again at its first proposal (the fourth turn of a chat with the bundled zoo: 19.7 -> 4.7 ms,
median; scripts/prompt_cache_bench.py, docs/results/prompt-cache.json).
A draft only proposes, and the target verifies every token, so a draft's reused KV cannot change an output
whatever its forward's rounding. With the target-hidden predictor, the target's hidden rows of the kept
positions are kept too (2.3 KB per token for the bundled target), so the prompt features need no pass of their own.

A robot rarely holds one conversation: a behaviour tree calls the model for several skills, each with its own
fixed system prompt, and several people talk to it. So the caches of the last goals are kept within a byte budget
(``RuntimeConfig.prompt_cache_bytes``, oldest dropped first; the last goal's is always kept), and a goal takes
the one that shares the longest prefix with its prompt: the caches themselves if it continues that conversation
(their tokens all begin its prompt), else a copy of the shared part (the system prompt another conversation
shares, an edited turn), so the conversation stays for its own next turn (a copy of a 400-token prefix is 18 MB
of memory copied, against a prefill of those tokens). Each holds the KV cache a generation of that length
uses anyway (the bundled target: 46,080 bytes per token of buffer, which grows by doubling); ``clear`` frees
them all, and dropping any hands the freed pages back to the system (kv_cache.release_freed_memory).
"""

from __future__ import annotations

import weakref
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch

from .draft_forward import lean_forward_for, observers_paused
from .kv_cache import buffer_bytes, copy_prefix, release_freed_memory
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
    with observers_paused(model):  # made-up tokens: not rows for a target-hidden predictor
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


def _prefix(kv: KVState, length: int, move: bool) -> KVState:
    """``kv`` cropped to ``length`` (``move``: it is handed over) or a copy of its first ``length`` positions."""
    if move:
        kv.crop_to(length)
        return kv
    copy = KVState()
    copy.cache, copy.length = copy_prefix(kv.cache, length), length
    return copy


@dataclass
class Reuse:
    """What a generation takes from the cache: the target's KV cache of the prompt's first tokens (None: feed
    the whole prompt), by draft name a draft's model with its KV cache of (a part of) those tokens, and the
    target's hidden rows of those tokens where the predictor kept them (its prompt features need no pass)."""

    target: KVState | None = None
    drafts: dict[str, tuple[torch.nn.Module, KVState]] = field(default_factory=dict)
    hidden_rows: torch.Tensor | None = None
    moved: bool = False  # taken out of the cache (its own conversation), not copied: the cache holds it no more


@dataclass
class _Entry:
    tokens: list[int]
    kv: KVState
    # name -> (the draft model, by weak reference, and its KV cache): an evicted draft is not kept alive here, and
    # its cache goes at the next keep or trim
    drafts: dict[str, tuple[weakref.ref, KVState]]
    hidden_rows: torch.Tensor | None
    prompt_length: int = 0  # the tokens of the goal's prompt (the rest: its answer); 0: unknown

    @property
    def bytes(self) -> int:
        rows = self.hidden_rows.nbytes if self.hidden_rows is not None else 0
        drafts = sum(buffer_bytes(kv.cache) for ref, kv in self.drafts.values() if ref() is not None)
        return buffer_bytes(self.kv.cache) + drafts + rows


def _covers(new: _Entry, old: _Entry) -> bool:
    """Whether ``new`` serves every prompt at least as well as ``old``: it holds ``old``'s tokens as a prefix, and
    every draft cache ``old`` holds, as far as ``old`` holds it."""
    if len(old.tokens) > len(new.tokens) or common_prefix(old.tokens, new.tokens) < len(old.tokens):
        return False
    for name, (ref, kv) in old.drafts.items():
        mine = new.drafts.get(name)
        if ref() is not None and (mine is None or mine[0]() is not ref() or mine[1].length < kv.length):
            return False
    if old.hidden_rows is not None and (new.hidden_rows is None or new.hidden_rows.shape[0] < old.hidden_rows.shape[0]):
        return False
    return True


class PromptCache:
    """The KV caches of the last goals (target's, drafts') and the tokens they hold; a generation takes the one
    that shares the most with its prompt and hands its own back.

    ``budget_bytes``: the older goals' caches are kept while all of them together hold at most this many bytes
    (oldest dropped first); the last goal's is always kept. 0: only the last goal's (one conversation)."""

    def __init__(self, budget_bytes: int = 0) -> None:
        if budget_bytes < 0:
            raise ValueError(f"the prompt cache's budget must be >= 0 bytes, got {budget_bytes}")
        self.budget_bytes = budget_bytes
        self._entries: list[_Entry] = []  # oldest first

    # The reads below may come from another thread (the node's diagnostics): each works on a copy of the list.
    @property
    def conversations(self) -> int:
        """Goals whose caches are held (each a conversation a later goal may continue)."""
        return len(self._entries)

    @property
    def tokens(self) -> int:
        """Tokens held for the last goal (0: empty)."""
        entries = list(self._entries)
        return len(entries[-1].tokens) if entries else 0

    @property
    def drafts(self) -> dict[str, int]:
        """The drafts whose KV caches are held for the last goal, and the tokens each holds."""
        entries = list(self._entries)
        return {name: kv.length for name, (ref, kv) in entries[-1].drafts.items() if ref() is not None} if entries \
            else {}

    @property
    def bytes(self) -> int:
        """The memory the held caches take (buffers' capacity)."""
        return sum(entry.bytes for entry in list(self._entries))

    def set_budget(self, budget_bytes: int) -> None:
        """A new budget for the older goals' caches; a smaller one drops the oldest now."""
        if budget_bytes < 0:
            raise ValueError(f"the prompt cache's budget must be >= 0 bytes, got {budget_bytes}")
        self.budget_bytes = budget_bytes
        self.trim()

    def _drop_dead_drafts(self, entries: list[_Entry]) -> bool:
        """Drop the caches of drafts no longer alive (an evicted draft's cache serves no prompt, yet held memory
        that ``bytes`` no longer counted); whether any went."""
        dropped = False
        for entry in entries:
            if any(ref() is None for ref, _ in entry.drafts.values()):
                entry.drafts = {n: (ref, kv) for n, (ref, kv) in entry.drafts.items() if ref() is not None}
                dropped = True
        return dropped

    def forget_drafts(self, names: Sequence[str]) -> None:
        """Drop every kept cache of the drafts ``names`` (removed from the registry, or their files replaced): a
        weak reference dies only once nothing else holds the model, and until a goal came their caches stayed, held
        and no longer counted, for as long as the node sat idle."""
        names = set(names)
        for entry in self._entries:
            if names & set(entry.drafts):
                entry.drafts = {n: pair for n, pair in entry.drafts.items() if n not in names}
        self.trim()

    def trim(self) -> None:
        """Drop the caches of drafts no longer alive, then the oldest goals' past the budget."""
        entries = list(self._entries)
        dropped = self._drop_dead_drafts(entries)
        total = sum(entry.bytes for entry in entries)
        while len(entries) > 1 and (not self.budget_bytes or total > self.budget_bytes):
            total -= entries.pop(0).bytes
            dropped = True
        self._entries = entries
        if dropped:
            release_freed_memory()  # their buffers' pages go back to the system (kv_cache.release_freed_memory)

    def _longest_shared(self, prompt_ids: Sequence[int]):
        """(the kept goal sharing the longest prefix with ``prompt_ids``, the latest of equals, or None; the tokens
        shared, leaving one to feed)."""
        best, shared = None, 0
        for entry in self._entries:
            n = min(common_prefix(entry.tokens, prompt_ids), len(prompt_ids) - 1)
            if n >= shared and n > 0:
                best, shared = entry, n
        return best, shared

    def take(self, prompt_ids: Sequence[int]) -> Reuse:
        """The caches of the goal that shares the longest prefix with ``prompt_ids`` (the latest of equals), cropped
        to it, leaving at least one prompt token to feed; nothing when none shares a token. The generation owns
        what it takes until ``keep`` hands its own back; with no budget for older goals, the cache is empty
        afterwards."""
        # the caches of drafts evicted since the last goal go now, not only at the next keep: held through this
        # goal, they took memory that ``bytes`` (and ~/diagnostics) no longer counted
        swept = self._drop_dead_drafts(self._entries)
        best, shared = self._longest_shared(prompt_ids)
        # a goal that continues a kept conversation takes its caches (they grow on with it, and are kept again
        # after it); one that only shares a part of them (another conversation with the same system prompt, a
        # repeated or edited turn) gets copies of that part, and the conversation stays for its own next turn
        move = best is not None and (not self.budget_bytes or shared == len(best.tokens))
        if not self.budget_bytes:
            swept |= any(e is not best for e in self._entries)
            self._entries = []  # the others' caches, no longer referenced, are freed here
        elif move:
            self._entries = [e for e in self._entries if e is not best]
        if swept:  # and their pages handed back, as trim and clear hand theirs
            release_freed_memory()
        if best is None:
            return Reuse()
        reuse = Reuse(target=_prefix(best.kv, shared, move), moved=move)
        for name, (ref, draft_kv) in best.drafts.items():
            model = ref()
            if model is not None and min(draft_kv.length, shared) > 0:
                reuse.drafts[name] = (model, _prefix(draft_kv, min(draft_kv.length, shared), move))
        if best.hidden_rows is not None and best.hidden_rows.shape[0] >= shared:
            rows = best.hidden_rows[:shared]
            reuse.hidden_rows = rows if move else rows.clone()
        return reuse

    def keep(self, tokens: Sequence[int], kv: KVState,
             drafts: Mapping[str, tuple[torch.nn.Module, KVState]] | None = None,
             hidden_rows: torch.Tensor | None = None, prompt_length: int = 0) -> None:
        """Hold ``kv`` (and the ``drafts``' KV caches, and the target's ``hidden_rows`` of those positions) with the
        ``tokens`` it was fed (a finished generation's: the newest is not fed yet). A generation that ended inside
        an accepted run (end token, stop string, length) fed accepted tokens it then dropped: their positions are
        cropped. Older goals' caches then go, oldest first, until the budget holds."""
        kv.crop_to(len(tokens))
        kept: dict[str, tuple[weakref.ref, KVState]] = {}
        for name, (model, draft_kv) in (drafts or {}).items():
            draft_kv.crop_to(kv.length)  # a draft's cache is a prefix of the target's tokens
            if draft_kv.length > 0:
                kept[name] = (weakref.ref(model), draft_kv)
        if hidden_rows is not None and hidden_rows.shape[0] != kv.length:
            # a copy: a slice would keep the longer tensor alive, its bytes uncounted
            hidden_rows = hidden_rows[: kv.length].clone() if hidden_rows.shape[0] > kv.length else None
        entry = _Entry(list(tokens[: kv.length]), kv, kept, hidden_rows, min(prompt_length, kv.length))
        # an older goal's caches that this one holds all of (a repeated or continued prompt that took copies: the
        # same tokens, the same drafts) serve no prompt better: dropped, not kept twice in the budget. So is one
        # whose whole prompt this goal's holds: its conversation went on along this goal's tokens, which parted
        # inside its answer (re-sent otherwise: a stop string, the template), and every turn would otherwise keep
        # a stale copy beside the new one. Dropped here, once this goal succeeded: take() copied from it, so a
        # goal that fails leaves it whole
        others = [e for e in self._entries
                  if not _covers(entry, e) and not 0 < e.prompt_length <= common_prefix(e.tokens, entry.tokens)]
        dropped = len(self._entries) - len(others)
        self._entries = [*others, entry]
        if dropped:
            release_freed_memory()
        self.trim()

    def clear(self) -> None:
        held, self._entries = self._entries, []
        if held:
            del held
            release_freed_memory()
