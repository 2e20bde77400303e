"""The datastore: the target's past answers, searched by context lookup beside the text itself.

Context lookup (runtime/lookup.py) copies from the prompt and the answer so far. Answers also repeat
*other* answers: the same request phrasings, the same explanations of a licence clause, the same code
idioms. Replayed over the real zoo's 600 held-out answers under the int4 target's measured forward
times, a lookup that also searches the target's own answers to the 2,176 training requests (which the
held-out requests are not among) copies in 61% of the iterations instead of 23%, and copies alone reach
1.43x the target alone instead of 1.25x (scripts/lookup_acceptance.py --corpus train,
docs/results/lookup-acceptance-corpus.json; in the engine, 1.39-1.44x: memspec-bench llamacpp).
REST (He et al., 2023) calls this retrieval; the copies are verified like any draft's, so the output
stays the target's own.

Why not the context's dictionaries: 212 k tokens of answers as Python tuples per n-gram would take
hundreds of MB. Here the answers are one int array, and per n-gram length one sorted array of 64-bit
n-gram keys with, per key, the position right after the occurrence to copy from: about 16 bytes per token
per length, built with a few numpy sorts, searched with one binary search per length. Keys are hashes,
so a hit is confirmed against the tokens themselves before anything is copied. Where an n-gram
occurred several times, the copy follows the continuation most of its occurrences share (as REST
ranks by frequency), not merely the latest.

On disk (``memspec-zoo build --stages datastore``): a safetensors file with ``tokens`` (the answers
concatenated, uint16 when the vocabulary fits) and ``offsets`` (answer boundaries), and the tokenizer's
fingerprint in its metadata, so a datastore made for another vocabulary is refused instead of
proposing nonsense.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .atomic_write import written_aside
from .lookup import LookupConfig

FORMAT = "memspec-datastore/1"
# past answers are searched from 3 tokens up to 6: a 2-token match there is too often another answer's
# phrase (replayed in one-off variants of scripts/lookup_acceptance.py: 1.39x the target alone from 3
# tokens on, 1.36x from 2; 1.40x up to 6 tokens against 4)
DATASTORE_NGRAMS = LookupConfig(min_ngram=3, max_ngram=6)
SEPARATOR = -1  # between answers: no token id, so no n-gram and no copy spans two answers
_MULTIPLIER_INT = 0x9E3779B97F4A7C15  # odd: the key's polynomial is a bijection per position
_MULTIPLIER = np.uint64(_MULTIPLIER_INT)
_MASK = 2**64 - 1


class DatastoreError(ValueError):
    """A datastore file that cannot be used: missing, malformed, or made for another tokenizer."""


def _keys(tokens: np.ndarray, n: int) -> np.ndarray:
    """The 64-bit key of every n-gram of ``tokens`` (int64), in order of its start (wrapping arithmetic)."""
    count = len(tokens) - n + 1
    keys = np.zeros(max(count, 0), dtype=np.uint64)
    for j in range(n):
        keys = keys * _MULTIPLIER + tokens[j : j + count].astype(np.uint64)
    return keys


def _key(ngram: Sequence[int]) -> int:
    """:func:`_keys` of one n-gram in plain integers: a lookup on the decode loop costs no numpy calls."""
    key = 0
    for token in ngram:
        key = (key * _MULTIPLIER_INT + token) & _MASK
    return key


def _frequency(keys: np.ndarray) -> np.ndarray:
    """For each key, how many times it occurs in ``keys``."""
    _, inverse, counts = np.unique(keys, return_inverse=True, return_counts=True)
    return counts[inverse]


@dataclass(frozen=True)
class _Table:
    keys: np.ndarray  # uint64, sorted, unique
    after: np.ndarray  # int64: for each key, the position right after the occurrence to copy from


class Datastore:
    """Answers indexed for suffix lookup: :meth:`find` where an n-gram that another token followed within
    the same answer occurred (of its occurrences, the one whose continuation the most share),
    :meth:`continuation` the tokens after it."""

    def __init__(self, answers: Iterable[Sequence[int]], config: LookupConfig | None = None,
                 fingerprint: str = "") -> None:
        self.config = config = config or DATASTORE_NGRAMS
        self.fingerprint = fingerprint
        parts, self.answers = [], 0
        for answer in answers:
            given = np.asarray(answer)
            if given.size and given.dtype.kind not in "iu":  # int64 would truncate 1.7 to 1 and take True as 1
                raise DatastoreError(f"datastore answer {self.answers} holds {given.dtype} values, not token ids")
            ids = given.astype(np.int64).reshape(-1)
            if (ids < 0).any():  # -1 too: it is the separator, and would split the answer in two when saved
                raise DatastoreError(f"datastore answer {self.answers} holds a negative token id")
            parts += [ids, np.array([SEPARATOR], dtype=np.int64)]
            self.answers += 1
        self.tokens = np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)
        self.max_token = int(self.tokens.max()) if len(self.tokens) else -1  # a target needs a row for it
        self._tables = {n: self._table(n) for n in range(config.min_ngram, config.max_ngram + 1)}

    def _table(self, n: int) -> _Table:
        tokens = self.tokens
        if len(tokens) <= n:
            return _Table(np.zeros(0, dtype=np.uint64), np.zeros(0, dtype=np.int64))
        # an n-gram starting at i counts when tokens[i : i + n + 1] hold no separator: n tokens of one
        # answer, and a token of the same answer after them to copy
        separators = np.concatenate([[0], np.cumsum(tokens == SEPARATOR)])
        starts = np.arange(len(tokens) - n)
        valid = separators[starts + n + 1] == separators[starts]
        starts = starts[valid]
        keys, after = _keys(tokens, n)[starts], starts + n
        # which occurrence to copy from: the one whose next token most occurrences share, then whose next
        # two tokens, then the latest (replayed: 1.43x the target alone against 1.40x for the latest alone)
        next_one = _frequency(_keys(tokens, n + 1)[starts])
        padded = np.concatenate([tokens, [SEPARATOR]])
        two_valid = padded[after + 1] != SEPARATOR
        next_two = np.zeros(len(starts), dtype=np.int64)
        next_two[two_valid] = _frequency(_keys(padded, n + 2)[starts[two_valid]])
        order = np.lexsort((after, next_two, next_one, keys))  # the last of each key is the one to copy
        keys, after = keys[order], after[order]
        last = np.ones(len(keys), dtype=bool)
        last[:-1] = keys[1:] != keys[:-1]
        return _Table(keys[last], after[last])

    def check_vocab(self, vocab_size: int, where: str = "the datastore") -> None:
        """DatastoreError unless every id held is one of a target's ``vocab_size`` tokens: a copied id past its
        embedding would fail the target's verify and end the goal."""
        if vocab_size and self.max_token >= vocab_size:  # max_token: the largest id held, -1 when empty
            raise DatastoreError(f"{where} holds token id {self.max_token}, past the target's {vocab_size} tokens:"
                                 " it was made for another model; rebuild it with memspec-zoo build --stages"
                                 " datastore for this target")

    def find(self, suffix: Sequence[int]) -> int | None:
        """The position right after the chosen occurrence of ``suffix`` (an indexed length): of those
        followed by a token of the same answer, the one whose next token most of them share, then whose
        next two, then the latest; None when there is none."""
        table = self._tables.get(len(suffix))
        if table is None or not len(table.keys):
            return None
        key = np.uint64(_key(suffix))
        i = int(table.keys.searchsorted(key))
        if i == len(table.keys) or table.keys[i] != key:
            return None
        at = int(table.after[i])
        # keys are hashes: a different n-gram with the same key is a miss, never a wrong copy's source
        return at if self.tokens[at - len(suffix) : at].tolist() == list(suffix) else None

    def propose(self, context: Sequence[int], limit: int) -> tuple[list[int], int]:
        """Up to ``limit`` tokens that followed the longest suffix of ``context`` found here, and that
        suffix's length (no tokens and 0 when none is)."""
        for n in range(self.config.max_ngram, self.config.min_ngram - 1, -1):
            if len(context) >= n:
                at = self.find(context[len(context) - n :])
                if at is not None:
                    return self.continuation(at, limit), n
        return [], 0

    def continuation(self, at: int, limit: int) -> list[int]:
        """Up to ``limit`` tokens from ``at``, stopping at the end of that answer."""
        window = self.tokens[at : at + limit]
        ends = np.flatnonzero(window == SEPARATOR)
        return window[: ends[0] if len(ends) else len(window)].tolist()

    @property
    def token_count(self) -> int:
        return int((self.tokens != SEPARATOR).sum())

    def save(self, path: str | Path, **metadata: str) -> None:
        """``tokens`` + ``offsets`` as safetensors, with the tokenizer fingerprint and ``metadata``."""
        from safetensors.numpy import save_file

        flat = self.tokens[self.tokens != SEPARATOR]
        lengths = np.diff(np.concatenate([[-1], np.flatnonzero(self.tokens == SEPARATOR)])) - 1
        offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
        dtype = np.uint16 if (not len(flat) or flat.max() <= np.iinfo(np.uint16).max) else np.int32
        own = {"format": FORMAT, "tokenizer_fingerprint": self.fingerprint, "answers": str(self.answers)}
        clash = sorted(set(own) & set(metadata))
        if clash:  # a caller's value would replace the file's own: a format load refuses, a wrong count
            raise ValueError(f"datastore metadata {', '.join(clash)} is the file's own; name it otherwise")
        # written aside and renamed: a cut rebuild must leave the datastore the node reads, not half of a new one
        with written_aside(path, suffix=".partial", sync=True) as tmp:
            save_file({"tokens": flat.astype(dtype), "offsets": offsets}, str(tmp),
                      metadata={**own, **{k: str(v) for k, v in metadata.items()}})

    @classmethod
    def load(cls, path: str | Path, config: LookupConfig | None = None,
             fingerprint: str | None = None) -> Datastore:
        """Read a file :meth:`save` wrote; with ``fingerprint``, refuse one made for another tokenizer; refuse one
        whose indexing would take more memory than this machine has free."""
        check_fits_in_memory(path)
        answers, meta = read_answers(path, fingerprint)
        return cls(answers, config, meta.get("tokenizer_fingerprint", ""))


# measured with tracemalloc while indexing 2 M tokens of random ids (every n-gram distinct, so the tables are as large
# as they get): 192 bytes per token at the peak of building the four n-gram tables, 71 held once built; a file holds
# 2 bytes per token (uint16), 1 for a crafted uint8 one
INDEX_PEAK_BYTES_PER_TOKEN = 200


def available_memory_bytes() -> int | None:
    """The memory this machine has free (Linux's MemAvailable), None where that is unknown."""
    try:
        with open("/proc/meminfo", encoding="ascii") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def check_fits_in_memory(path: str | Path) -> None:
    """A datastore takes about 100x its file's size in memory while it is indexed: a large (or crafted) file ran the
    node out of memory at configure. Its token count is read from the header alone, before anything is read."""
    from safetensors import safe_open

    try:
        with safe_open(str(path), "np") as f:
            tokens = int(np.prod(f.get_slice("tokens").get_shape()))
    except Exception:  # not a datastore at all: read_answers says what is wrong with it
        return
    need, free = tokens * INDEX_PEAK_BYTES_PER_TOKEN, available_memory_bytes()
    if free is not None and need > free:
        raise DatastoreError(f"{path} holds {tokens:,} tokens: indexing them takes up to {need / 1e9:.1f} GB, more"
                             f" than the {free / 1e9:.1f} GB this machine has free. Use a smaller datastore"
                             " (memspec-zoo build --stages datastore) or none")


def read_answers(path: str | Path, fingerprint: str | None = None) -> tuple[list[np.ndarray], dict[str, str]]:
    """The answers (int64 token arrays, in the order saved) and metadata of a file :meth:`Datastore.save`
    wrote, checked; with ``fingerprint``, refuse one made for another tokenizer."""
    from safetensors import SafetensorError, safe_open

    path = Path(path)
    if not path.is_file():
        raise DatastoreError(f"no datastore file at {path} (memspec-zoo build --stages datastore writes one)")
    try:
        with safe_open(str(path), "np") as f:
            meta = f.metadata() or {}
            tokens, offsets = f.get_tensor("tokens"), f.get_tensor("offsets")
    except (SafetensorError, OSError, KeyError) as exc:
        raise DatastoreError(f"{path} is not a datastore (safetensors with tokens and offsets): {exc}") from exc
    if meta.get("format") != FORMAT:
        raise DatastoreError(f"{path} is not a {FORMAT} file (metadata format {meta.get('format')!r})")
    if fingerprint is not None and meta.get("tokenizer_fingerprint") != fingerprint:
        raise DatastoreError(f"{path} was made with another tokenizer than the target's (fingerprint"
                             f" {meta.get('tokenizer_fingerprint')!r}, target {fingerprint!r}): rebuild it"
                             " with memspec-zoo build --stages datastore for this target")
    if tokens.ndim != 1 or not np.issubdtype(tokens.dtype, np.integer):
        raise DatastoreError(f"{path}: its tokens are {tokens.ndim}-d {tokens.dtype}, not one row of integer ids")
    if offsets.ndim != 1 or not np.issubdtype(offsets.dtype, np.integer) or len(offsets) < 1 or offsets[0] != 0 \
            or offsets[-1] != len(tokens) or (np.diff(offsets.astype(np.int64)) < 0).any():  # (uint64 wraps)
        raise DatastoreError(f"{path}: offsets do not split its {len(tokens)} tokens into answers")
    tokens = tokens.astype(np.int64)
    if (tokens < 0).any():  # a corrupt file: a negative id (-1 would split an answer) is no token
        raise DatastoreError(f"{path} holds a negative token id: not a datastore this code wrote")
    return [tokens[a:b] for a, b in zip(offsets[:-1], offsets[1:], strict=True)], meta
