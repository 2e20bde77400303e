"""Context lookup: draft tokens copied from the text itself, at no draft cost.

Answers repeat their own context: code reuses the prompt's identifiers, a legal answer quotes the clause
it explains, and a small model's answer repeats its own phrases. Where the last few committed tokens
occurred before, the tokens that followed them then are a proposal that costs no forward at all (Prompt
Lookup Decoding, Saxena 2023; LLMA, Yang et al. 2023). The target verifies it like any draft's, so the
output is the target's own either way.

Why the engine needs it: on an edge CPU the target's verify of γ + 1 rows costs 1.4-1.9x a one-token step
(the int4 kernel pays per row), and the bundled drafts accept ~0.76 tokens per iteration, so a model draft
barely pays for its verify. On the real zoo's held-out answers a match of at least two tokens exists in
24% of the iterations; after a 4-token match 2.82 of 4 copied tokens stand, after a 2-token one 1.34
(scripts/lookup_acceptance.py). It is not a draft in the cache's sense: it takes no memory, never loads,
and cannot be evicted, so it sits beside MemSpec's draft choice rather than in it.

A deterministic proposal is a draft whose distribution is one-hot on the proposed token, so sampling
accepts it by the standard rule (accept with probability p(x), else resample from p without x).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # runtime/datastore.py imports LookupConfig from here
    from .datastore import Datastore

LOOKUP_DRAFT = "lookup"  # IterationStats.draft of an iteration whose proposals were copied from the context
MAX_NGRAM_LIMIT = 8


@dataclass(frozen=True)
class LookupConfig:
    """Match the longest suffix of ``max_ngram`` down to ``min_ngram`` committed tokens seen before."""

    # one-token matches are common and poor: their first copy stood 22% of the time against 54% after two
    # tokens, and adding them replayed slower, 1.24x against 1.27x the target alone
    # (scripts/lookup_acceptance.py --min-ngram 1, docs/results/lookup-acceptance-min1.json)
    min_ngram: int = 2
    max_ngram: int = 4

    def __post_init__(self) -> None:
        if not 1 <= self.min_ngram <= self.max_ngram <= MAX_NGRAM_LIMIT:
            raise ValueError(
                f"context lookup needs 1 <= min_ngram <= max_ngram <= {MAX_NGRAM_LIMIT},"
                f" got min_ngram={self.min_ngram}, max_ngram={self.max_ngram}"
            )


class NgramIndex:
    """The committed tokens, and for each n-gram the position right after its latest occurrence that was
    followed by a token. Kept up to date token by token (a few dictionary writes each), so a proposal
    costs a few lookups however long the context grows.

    ``datastores`` (past answers, runtime/datastore.py) are searched only where the context has no match
    at all, each over its own n-gram lengths; the longest match wins, at equal length the earlier
    datastore's. The context's own matches are the more precise ones: replayed over the zoo's held-out
    answers, context first and past answers from 3 tokens on reached 1.40x the target alone, against
    1.34x for the longest match wherever it is (one-off variants of scripts/lookup_acceptance.py's replay)."""

    def __init__(self, config: LookupConfig = LookupConfig(), datastores: Sequence[Datastore] = ()) -> None:
        self.config = config
        self.datastores = tuple(datastores)
        self.tokens: list[int] = []
        self._after: dict[int, dict[tuple[int, ...], int]] = {
            n: {} for n in range(config.min_ngram, config.max_ngram + 1)
        }

    def extend(self, tokens: Sequence[int]) -> None:
        for token in tokens:
            at = len(self.tokens)
            # every n-gram ending just before ``at`` is now followed by a token: remember where it continues
            for n, after in self._after.items():
                if at >= n:
                    after[tuple(self.tokens[at - n : at])] = at
            self.tokens.append(int(token))

    def propose(self, limit: int) -> tuple[list[int], int]:
        """Up to ``limit`` tokens that followed the longest earlier occurrence of the context's suffix, and
        that suffix's length (0 and no tokens when nothing matches)."""
        if limit < 1:
            return [], 0
        end = len(self.tokens)
        for n in range(self.config.max_ngram, self.config.min_ngram - 1, -1):
            if end < n:
                continue
            at = self._after[n].get(tuple(self.tokens[end - n :]))
            if at is not None:
                return self.tokens[at : at + limit], n
        # the longest match among the datastores; at equal length the earlier datastore's
        best: tuple[list[int], int] = ([], 0)
        for datastore in self.datastores:
            found = datastore.propose(self.tokens, limit)
            if found[0] and found[1] > best[1]:
                best = found
        return best
