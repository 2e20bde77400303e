"""What a policy decides at a scheduling point (:class:`Choice`), and carrying it out (:func:`carry_out`).

A policy (runtime/policies.py) owns its behaviour: its Choice names the draft it prefers, whether
decoding blocks until that draft is resident, what the cache does meanwhile, and in which order to
fall back while the preferred draft is not resident. :func:`carry_out` does just that, the same way
for every policy, on the real draft cache (runtime/controller.py) and on the simulator's cache in
virtual time (runtime/simulator.py); it returns a :class:`Resolution`: what runs next, and why.

Cache actions:

* ``none``: the cache is left as it is; the ranking's scores only steer which draft a blocking load
  evicts (General/Oracle-Static, MAB-Sync).
* ``request``: load the preferred draft in the background, evicting the lowest-scored other draft
  (MAB-Async, Prediction-Only).
* ``prefetch``: hand the whole ranking to the cache (Algorithm 2: W = top-K), which loads and evicts
  in the background (MemSpec, Oracle-next-interval, Oracle-Dynamic's prefetches).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from .cache import Ranking

CACHE_NONE, CACHE_REQUEST, CACHE_PREFETCH = "none", "request", "prefetch"
CACHE_ACTIONS = (CACHE_NONE, CACHE_REQUEST, CACHE_PREFETCH)


@dataclass(frozen=True)
class Choice:
    """A policy's decision at one scheduling point."""

    preferred: str  # "" = no draft (plain target decoding)
    block: bool = True  # wait until ``preferred`` is resident before decoding on
    fallback: tuple[str, ...] = ()  # what runs while ``preferred`` is not resident, first resident one wins
    cache_action: str = CACHE_NONE  # one of CACHE_ACTIONS
    ranking: list[tuple[str, float]] | None = None  # best first: the cache's scores (eviction) and prefetch order

    def __post_init__(self) -> None:
        if self.cache_action not in CACHE_ACTIONS:
            raise ValueError(f"cache_action must be one of {', '.join(CACHE_ACTIONS)}, got {self.cache_action!r}")


@dataclass(frozen=True)
class Resolution:
    """What a carried-out Choice runs: ``draft`` ("" = the target alone) and its ``model`` (the cache's handle),
    the ``preferred`` draft, whether ``draft`` is a ``fallback`` for it, and the seconds a blocking load ``waited``."""

    draft: str
    model: Any
    preferred: str
    fallback: bool
    waited: float


class ChoiceCache(Protocol):
    """What :func:`carry_out` needs of a draft cache (runtime/cache.py's DraftCacheManager, simulator.py's SimCache)."""

    def resident(self) -> list[str]: ...

    def is_resident(self, name: str) -> bool: ...

    def is_available(self, name: str) -> bool: ...

    def get(self, name: str, count: bool = True) -> Any: ...

    def set_scores(self, ranking: Ranking) -> None: ...

    def set_active(self, name: str) -> None: ...

    def update(self, ranking: Ranking, active: str | None = None) -> list[str]: ...

    def request(self, name: str, active: str | None = None, supersede: bool = True) -> bool: ...

    def failed(self) -> dict: ...

    def room_beside(self, current: str, name: str) -> bool: ...


def carry_out(choice: Choice, cache: ChoiceCache, *, wait: Callable[[str], float], current: str = "",
              first: bool = False) -> Resolution:
    """Do what ``choice`` says on ``cache`` and pick the draft that runs until the next scheduling point.

    ``current``: the draft that ran the last interval ("" none). What the cache action keeps from eviction is the
    draft that will run next (the preferred one if resident, else the first resident fallback), whichever ran
    before. ``wait(name)``: block until ``name`` is resident and return the seconds waited (also when its load
    failed: the cache records the failure and decoding goes on without it).

    In order: the ranking's scores (unless the cache action is a prefetch, which sets them itself); the
    blocking load, with no draft active so the idle current one may make room; the cache action; then the
    preferred draft if resident, else the first resident draft of ``choice.fallback``, else any other resident
    draft (by name), else the target alone. Nothing here waits but the blocking load, and a generation's
    non-blocking ``first`` choice whose draft the cache has no room to load beside the resident draft kept
    running meanwhile. Only the first: later in a generation ``current`` is "" too where the target decoded
    alone (its draft removed, failed or evicted by a smaller K), and a non-blocking policy must not wait there.
    """
    preferred, waited = choice.preferred, 0.0
    warm_start = first and not current and not choice.block and bool(preferred)
    if warm_start:
        # a generation's first choice on a warm cache: the resident draft it runs meanwhile is kept like an active
        # one, so the prefetch below cannot evict it
        current = next((n for n in (preferred, *choice.fallback) if n and cache.is_resident(n)), "")
    blocking = bool(preferred) and choice.block and not cache.is_resident(preferred)
    if choice.ranking and (choice.cache_action != CACHE_PREFETCH or blocking):
        # on-demand loads evict the policy's lowest-scored draft; so does a blocking load before a prefetch (which
        # sets the scores itself, but only after the load: the last goal's scores chose its victim)
        cache.set_scores(choice.ranking)
    # the cache's hit rate counts ONE lookup per scheduling point, of the preferred draft: a blocking wait counts
    # it (a miss where it loads), so the get after it does not, and the fallback gets never do (a point that had
    # to load read as a miss and a hit, so a run that loaded at every point showed a 50% hit rate)
    counted = False
    if blocking:
        cache.set_active("")  # the idle current draft may be evicted to make room
        waited, counted = wait(preferred), True
    # kept through the cache action: the draft that will run until the next point (the choice if resident, else its
    # first resident fallback, as picked below), not the one that ran the last interval. Protecting that one evicted
    # a better resident draft and then ran it (K 2, {C, D} resident, D ran, ranking A B C D: loading A evicted C, and
    # D, ranked fourth, ran the interval)
    resident = cache.resident()
    runner = next((n for n in (preferred, *choice.fallback, *sorted(resident)) if n and n in resident), None)
    if choice.cache_action == CACHE_PREFETCH and choice.ranking is not None:
        cache.update(choice.ranking, active=runner)
    elif choice.cache_action == CACHE_REQUEST and preferred and not cache.is_available(preferred):
        cache.request(preferred, active=runner)
    if (warm_start and not cache.is_available(preferred) and preferred not in cache.failed()
            and not (current and cache.room_beside(current, preferred))):
        # the cache can never hold the chosen draft beside the one kept running (K = 1, or a byte budget that holds
        # one of them): that one would run the whole generation, so wait for the choice, as on a cold cache. Where
        # room will come (a load the last goal left in flight fills the slot until it lands, when it may be
        # evicted), the resident draft runs and a later point loads the choice: waiting evicted the draft that
        # could run and sat out the other load too. A draft that just failed is not retried here (its back-off).
        cache.set_active("")
        waited, counted = wait(preferred), True
    if not preferred:
        cache.set_active("")
        return Resolution("", None, "", False, waited)
    model = cache.get(preferred, count=not counted)
    if model is not None:
        cache.set_active(preferred)
        return Resolution(preferred, model, preferred, False, waited)
    # else the first resident fallback, else any other resident draft; nothing resident: the target decodes alone
    others = [n for n in (*choice.fallback, *sorted(cache.resident())) if n != preferred]
    name, model = run_first_resident(cache, others)
    return Resolution(name, model, preferred, True, waited)


def run_first_resident(cache: ChoiceCache, names: Sequence[str]) -> tuple[str, Any]:
    """Make the first of ``names`` that is resident the active draft (its lookup not counted as the point's):
    (name, model), or ("", None) with no draft active where none is."""
    for name in names:
        model = cache.get(name, count=False) if name and cache.is_resident(name) else None
        if model is not None:
            cache.set_active(name)
            return name, model
    cache.set_active("")
    return "", None
