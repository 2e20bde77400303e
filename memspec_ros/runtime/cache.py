"""The Draft Model Cache Manager (the paper's Algorithm 2).

Only K drafts fit in fast memory. The cache keeps the resident set G, derives the
target working set W = top-K of the latest ranking, evicts the lowest-scored
resident drafts outside W (never the active one) and prefetches the missing
members of W on ONE background loader thread, so decoding never waits for
storage. Beyond the paper, drafts of different sizes share an optional byte
budget; a load reserves its bytes *before* it starts, so the count and the byte
budget hold at every instant, loads in flight included. (What a reservation holds is the
loaded draft's size. While a draft is built, the loader thread briefly also holds what it
read: the file's bytes through a storage tier, runtime/storage.py, or the file's tensors
before a forward path converts them. That transient is not counted.)

A failed load marks that draft failed (with its error) and is skipped by later
updates; decoding continues on whatever is resident (or the target alone). A failure is
not forever: a budget change forgets every failure, clear_failed() forgets them on demand
(the node calls it when the draft registry is set), and after ``retry_seconds`` a failed
draft is viable again, so a file restored meanwhile loads at the next prefetch.

All state changes happen under one lock. Evictions happen only on the caller's
thread (update/request/remove/reconfigure), so the ``on_evict`` callbacks (the
controller drops the evicted draft's KV cache there) run on the decode thread.

A load in flight cannot be interrupted. When it is no longer wanted (a smaller K or budget,
reset) it is marked for dropping and keeps its reservation until the loader ends, so no new
load starts while its memory is still in use; wanted again before it ends, it is kept instead,
if there is room. A draft removed (its registry entry may come back naming other files) or
failed in use has its load detached from the name instead: still reserved until it ends, but
never kept, so a later request loads anew. So, at every instant and with
any thread calling: the drafts that can become resident (resident + loads not marked) fit K and
the budget in force, and everything in memory, marked loads included, fit the limits that were
in force when each load started.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent import futures
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch

from .forward_paths import PATHS
from .models import (
    LoadedModel,
    ModelSpec,
    check_draft_compatible,
    forward_path_for,
    load_model,
    parameter_bytes,
    resolve_device,
    resolve_dtype,
)
from .registry import UnknownDraftError
from .stats import CacheStats
from .storage import weights_identity

Loader = Callable[[str], LoadedModel]
Ranking = Sequence[str] | Sequence[tuple[str, float]] | Mapping[str, float]
RETRY_SECONDS = 30.0  # back-off before a failed draft is tried again
STOP_POLL_SECONDS = 0.05  # how often a blocking wait_for asks whether to give up (a cancelled goal)
# close() waits this long for a load still reading: a draft's read takes well under a second from any of the storage
# presets (runtime/storage.py); one that outlasts this is hung on failing storage, and the node's cleanup goes on
CLOSE_WAIT_SECONDS = 30.0

log = logging.getLogger(__name__)


def _without_frames(error: BaseException) -> BaseException:
    """``error`` with no traceback, along its whole chain (an error raised while handling another, itself a wrapped
    one, kept the deeper frames): a remembered failure must not keep the frames that hold a draft's model."""
    seen: set[int] = set()
    pending: list[BaseException | None] = [error]
    while pending:
        exc = pending.pop()
        if exc is not None and id(exc) not in seen:
            seen.add(id(exc))
            exc.__traceback__ = None
            pending += [exc.__cause__, exc.__context__]
    return error


class DraftLoadError(RuntimeError):
    """A draft could not be made resident; the message carries the loader's error.

    ``waited``: the seconds :meth:`DraftCacheManager.wait_for` blocked before the failure (also counted in the
    cache's ``wait_seconds``), so a caller's accounting charges them as a load wait, like a wait that succeeded.
    """

    def __init__(self, message: str, *, waited: float = 0.0) -> None:
        super().__init__(message)
        self.waited = waited


class DraftTooLargeError(DraftLoadError):
    """A draft does not fit the byte budget even with every other draft evicted."""


@dataclass
class _Slot:
    """One draft known to the cache: resident (model set), loading (future set) or failed."""

    name: str
    reserved_bytes: int
    model: LoadedModel | None = None
    future: Future | None = None
    error: BaseException | None = None
    used: bool = False  # ran at least once since it became resident (for wasted-prefetch counting)
    discard: bool = False  # no longer wanted while in flight: drop it when the load completes (unless wanted again)
    failed_at: float = 0.0  # time.monotonic() of the failure (for the retry back-off)
    files: tuple = ()  # its weights files when it was loaded (storage.weights_identity), to tell a changed file
    recheck: bool = False  # evict_changed ran while it was in flight: it lands only if its files are unchanged


class _RoomHeld(Exception):
    """No load could start, only because loads in flight hold the room (wait for them, then ask again)."""

    def __init__(self, pending: list[Future], names: list[str]):
        super().__init__(", ".join(names))
        self.futures, self.names = pending, names


def _wait_futures(pending: Sequence[Future], deadline: float, stop: Callable[[], bool] | None) -> bool:
    """Wait until every future in ``pending`` is done (True), the ``deadline`` (perf_counter) passes or ``stop()``
    is true (polled every STOP_POLL_SECONDS): False then. futures.wait never raises: a failed load is _load's to
    record, and its slot says what happened."""
    while True:
        pending = [f for f in pending if not f.done()]
        if not pending:
            return True
        left = deadline - time.perf_counter()
        if left <= 0 or (stop is not None and stop()):
            return False
        step = min(left, STOP_POLL_SECONDS if stop is not None else math.inf)
        futures.wait(pending, timeout=None if step == math.inf else step)  # an infinite timeout overflows a lock's


def _deadline(timeout: float | None) -> float:
    """The perf_counter time ``timeout`` seconds from now (None: never)."""
    return math.inf if timeout is None else time.perf_counter() + timeout


def normalise_ranking(ranking: Ranking) -> list[tuple[str, float]]:
    """(name, score) best first from a list of names, (name, score) pairs or a mapping."""
    if isinstance(ranking, Mapping):
        pairs = [(str(k), float(v)) for k, v in ranking.items()]
    else:
        items = list(ranking)
        if items and isinstance(items[0], tuple):
            pairs = [(str(n), float(s)) for n, s in items]  # type: ignore[misc]
        else:
            n = len(items)
            pairs = [(str(name), float(n - i)) for i, name in enumerate(items)]  # type: ignore[arg-type]
    best: dict[str, float] = {}
    for name, score in pairs:
        if math.isnan(score):
            raise ValueError(f"ranking score of {name!r} is NaN")
        # a name ranked twice is one draft: twice in W it took two of the K slots and loaded once
        best[name] = max(score, best.get(name, score))
    return sorted(best.items(), key=lambda p: -p[1])


class DraftCacheManager:
    """Resident set G (capacity K, optional byte budget) with asynchronous prefetch."""

    def __init__(
        self,
        capacity: int,
        loader: Loader,
        *,
        budget_bytes: int = 0,
        size_of: Callable[[str], int] | None = None,
        on_change: Callable[[CacheStats], None] | None = None,
        retry_seconds: float = RETRY_SECONDS,
    ) -> None:
        """``loader(name)`` loads a draft into fast memory (runs on the loader thread);
        ``size_of(name)`` estimates its bytes for the reservation made before the load;
        ``on_change`` sees a snapshot after every state change (tests check invariants there);
        ``retry_seconds``: a failed draft is viable again (failed(), update()) after this long."""
        _check_capacity(capacity, budget_bytes)
        if isinstance(retry_seconds, bool) or not isinstance(retry_seconds, (int, float)) or not (
                0 <= retry_seconds < float("inf")):  # NaN: a failure was never forgotten
            raise ValueError(f"retry_seconds must be a finite number >= 0, got {retry_seconds!r}")
        self.capacity = capacity
        self.budget_bytes = budget_bytes
        self.retry_seconds = retry_seconds
        self.loader = loader
        self.size_of = size_of or (lambda name: 0)
        self.on_change = on_change
        self.on_evict: list[Callable[[str], None]] = []
        # (name, the path a landing load read) -> whether that path is still the name's: one that is not was read
        # while the name's entry pointed elsewhere (changed and changed back before any sync saw the load), and is
        # dropped instead of running other weights under the name (None: every load is kept)
        self.source_current: Callable[[str, str], bool] | None = None
        self._closed_whole = False  # what close() found, once it has: nothing left reading
        self._lock = threading.RLock()
        self._slots: dict[str, _Slot] = {}
        # loads in flight of a draft removed or failed meanwhile: out of ``_slots`` (so its name can load anew, or stay
        # failed), their bytes still reserved until the loader ends and drops them
        self._detached: list[_Slot] = []
        # loads a reset gave up waiting for (its timeout passed): a read hung on failing storage, not waited for by
        # any later reset (each goal's start waited the whole timeout again for the same read, which holds the one
        # loader thread whatever a reset does); forgotten once done
        self._given_up: set[Future] = set()
        self._scores: dict[str, float] = {}
        self._working_set: list[str] = []
        self._active = ""
        self._counters = CacheStats()
        self._rechecks = 0  # evict_changed calls that marked loads in flight (under the lock): see _load
        # bytes each draft occupied when last loaded (estimates can be low, or far high: fp32 files run as int4), with
        # the source and files identity they were measured on (files replaced in place are measured anew)
        self._measured: dict[str, tuple[int, str, object]] = {}
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="memspec-draft-loader")
        self._closed = False

    # -- queries (non-blocking) ---------------------------------------------------
    def resident(self) -> list[str]:
        """G: drafts loaded and runnable now."""
        with self._lock:
            return [n for n, s in self._slots.items() if s.model is not None]

    def loading(self) -> list[str]:
        with self._lock:
            return [n for n, s in self._slots.items() if s.future is not None and s.model is None and s.error is None]

    def failed(self) -> dict[str, BaseException]:
        """Drafts whose load failed less than ``retry_seconds`` ago (older failures are forgotten here)."""
        with self._lock:
            self._forget_failures(older_than=self.retry_seconds)
            return {n: s.error for n, s in self._slots.items() if s.error is not None}

    def is_resident(self, name: str) -> bool:
        with self._lock:
            slot = self._slots.get(name)
            return slot is not None and slot.model is not None

    def is_available(self, name: str) -> bool:
        """Resident or on its way (a later get() may hit); not a load marked to be dropped when it lands (a K
        shrink, a removal): a caller that wants it must request() it, which keeps it."""
        with self._lock:
            slot = self._slots.get(name)
            return slot is not None and slot.error is None and not slot.discard

    def room_beside(self, current: str, name: str) -> bool:
        """Whether K and the byte budget could hold ``name`` beside ``current`` once nothing else is in the way
        (other drafts evicted, loads in flight landed): False where one of the two must go for the other."""
        with self._lock:
            if self.capacity < 2:
                return False
            if not self.budget_bytes:
                return True
            slot = self._slots.get(current)
            held = slot.reserved_bytes if slot is not None and slot.error is None else 0
            try:
                size = self._size_needed(name)
            except Exception:  # unreadable: the load fails as it would have (carry_out does not wait for it)
                return True
            return held + size <= self.budget_bytes

    @property
    def active(self) -> str:
        return self._active

    @property
    def working_set(self) -> list[str]:
        with self._lock:
            return list(self._working_set)

    def peek(self, name: str) -> LoadedModel | None:
        """The resident draft or None, for an observer (memory totals, tests): no hit counted, not marked as used
        (a prefetch only looked at is still wasted)."""
        with self._lock:
            slot = self._slots.get(name)
            return slot.model if slot is not None else None

    def get(self, name: str, count: bool = True) -> LoadedModel | None:
        """The resident draft, or None right away if it is not resident (``count``: a hit or miss of the hit
        rate; choice.carry_out counts one lookup per scheduling point)."""
        with self._lock:
            slot = self._slots.get(name)
            if slot is not None and slot.model is not None:
                self._counters.hits += count
                slot.used = True
                return slot.model
            self._counters.misses += count
            return None

    def set_scores(self, ranking: Ranking) -> None:
        """Record a policy's scores without changing W: on-demand loads then evict the lowest-scored draft."""
        with self._lock:
            self._scores = dict(normalise_ranking(ranking))

    def set_active(self, name: str) -> None:
        """The draft decoding now: never evicted while active."""
        with self._lock:
            self._active = name
            self._changed()

    # -- Algorithm 2 ----------------------------------------------------------------
    def update(self, ranking: Ranking, active: str | None = None) -> list[str]:
        """Align G with W = top-K of ``ranking``: evict, then prefetch asynchronously. Never blocks.

        Drafts that failed less than ``retry_seconds`` ago and names not in ``ranking`` are skipped. Returns W.
        """
        pairs = normalise_ranking(ranking)  # a bad ranking (NaN) is refused before anything changes
        with self._lock:
            self._forget_failures(older_than=self.retry_seconds)
            if active is not None:
                self._active = active
            self._scores = dict(pairs)
            viable = [n for n, _ in pairs if not (n in self._slots and self._slots[n].error is not None)]
            self._working_set = viable[: self.capacity]
            # a prefetch still queued for a draft that left W never runs: on the one loader thread it delayed the
            # new top-K's loads and held a slot meanwhile (K >= 3, where the ranking's tail changes)
            self._drop_queued(keep=set(self._working_set))
            for name in self._working_set:
                slot = self._slots.get(name)
                if slot is None:
                    self._make_room_and_load(name, protect=set(self._working_set))
                elif slot.discard:
                    self._keep(slot, protect=set(self._working_set))  # dropped, and wanted again
                # else: resident or being prefetched
            self._changed()
            return list(self._working_set)

    def request(self, name: str, active: str | None = None, supersede: bool = True) -> bool:
        """Start loading one draft (bandits and on-demand policies), evicting the lowest-scored
        resident draft other than ``name`` and the active one. Returns False if no room could be made, or if the
        draft failed less than ``retry_seconds`` ago (clear_failed() or a budget change lets it be tried at once).
        ``supersede``: a load still queued for another draft (an earlier request the policy has changed its mind
        about) never runs, as update() drops those outside W; wait_for's own request keeps them."""
        with self._lock:
            if active is not None:
                self._active = active
            if supersede and self._drop_queued(keep={name}):  # on_change sees every state change, a return below
                self._changed()  # included
            slot = self._slots.get(name)
            if slot is not None and slot.error is None:
                if not slot.discard:
                    return True
                kept = self._keep(slot, protect={name})
                self._changed()  # _keep may have evicted drafts (on_change sees every state change)
                return kept
            if slot is not None:  # failed before: tried again once its back-off is over (README: 30 s), as update()
                # does; a policy that requests (MAB-Async, Prediction-Only) re-read a broken draft from slow storage
                # at every scheduling point, and a blocking one stalled for it each time
                if time.monotonic() - slot.failed_at < self.retry_seconds:
                    return False
                del self._slots[name]
            started = self._make_room_and_load(name, protect={name})
            self._changed()
            return started

    def wait_for(self, name: str, timeout: float | None = None,
                 stop: Callable[[], bool] | None = None) -> tuple[LoadedModel, float]:
        """Block until ``name`` is resident (loading it if needed). Returns (model, seconds waited).

        For the policies that stall for their choice (MAB-Sync, a generation's first draft on a cold cache); MemSpec
        never calls it during decoding.
        Raises DraftLoadError if the load fails or no room can be made, or once ``stop()`` is true (polled every
        STOP_POLL_SECONDS: a cancelled goal does not sit out a load from slow storage; the load goes on). A load
        dropped without an error while waited for (its files changed as it read them, or it landed larger than its
        reservation) is started again, once.
        """
        t0 = time.perf_counter()
        with self._lock:
            slot = self._slots.get(name)
            if slot is not None and slot.model is not None:
                self._counters.hits += 1
                slot.used = True
                return slot.model, 0.0
            self._counters.misses += 1
        deadline = _deadline(timeout)
        for again in (False, True):
            try:
                waited_for = self._start_for_wait_when_room(name, deadline, stop)
            except DraftLoadError as exc:  # refused: on a retry, the first wait's time is still this wait's
                waited = time.perf_counter() - t0
                with self._lock:
                    self._counters.wait_seconds += waited
                raise DraftLoadError(str(exc), waited=waited) from exc.__cause__
            waited_for, future = waited_for if waited_for is not None else (None, None)
            stopped = (future is not None and not _wait_futures([future], deadline, stop) and not future.done()
                       and stop is not None and stop())
            with self._lock:
                waited = time.perf_counter() - t0
                slot = self._slots.get(name)
                if slot is not None and slot.model is not None:
                    self._counters.wait_seconds += waited
                    slot.used = True
                    return slot.model, waited
                # dropped with no error and not on purpose (removed from the registry, or K shrank: those mark it)
                dropped = (slot is None and future is not None and future.done() and not self._closed
                           and not waited_for.discard)
                if dropped and not again and time.perf_counter() < deadline and not stopped:
                    continue  # dropped without an error: load it again
                self._counters.wait_seconds += waited
                if stopped:
                    raise DraftLoadError(f"the wait for draft {name!r} was given up (its load goes on)", waited=waited)
                error = slot.error if slot is not None else None
                if error is not None:
                    raise DraftLoadError(f"draft {name!r} did not become resident: {error}", waited=waited) from error
                landed = future is not None and future.done()
                why = ("the draft cache was closed" if self._closed else
                       "its load was dropped twice (its files changed while it was read, or the cache changed)"
                       if dropped else
                       "its load was dropped (the draft was removed, or K or the budget shrank)" if landed else
                       f"it was not resident after {waited:.1f} s (the wait's timeout)")
                raise DraftLoadError(f"draft {name!r} did not become resident: {why}", waited=waited)
        raise AssertionError("unreachable")  # the loop returns or raises

    def _start_for_wait_when_room(self, name: str, deadline: float, stop: Callable[[], bool] | None
                                  ) -> tuple[_Slot, Future | None] | None:
        """_start_for_wait, waiting first for loads in flight where they are what holds the room (K loads already
        reading, or loads being dropped still reserving their bytes: refused at once, a goal whose first wait came
        just after another goal's was given up decoded without its draft, and then ran on the draft that landed)."""
        ended: list[Future] = []
        while True:
            try:
                return self._start_for_wait(name)
            except _RoomHeld as held:
                done = all(f.done() for f in held.futures)
                if done and held.futures == ended:  # (no state where this can be is known: a slot left "loading"
                    # with its load ended would hold the room for good, and this loop would spin past its deadline)
                    raise DraftLoadError(f"draft {name!r} cannot be loaded: loads that ended still hold the"
                                         f" cache's room ({', '.join(held.names)})") from None
                ended = held.futures if done else []
                if not _wait_futures(held.futures, deadline, stop):
                    given_up = stop is not None and stop()
                    raise DraftLoadError(
                        f"draft {name!r} cannot be loaded yet: the cache's room (K={self.capacity}, budget="
                        f"{self.budget_bytes} B) is held by loads in flight ({', '.join(held.names)}), and the wait"
                        f" {'was given up' if given_up else 'timed out'} before they ended") from None

    def _start_for_wait(self, name: str) -> tuple[_Slot, Future | None] | None:
        """wait_for's load: the slot of the one in flight for ``name``, or of a new one, with its future read under
        the lock (None: resident already; DraftLoadError where none can start; _RoomHeld where only loads in flight
        hold the room). Read after the lock, a load dropped meanwhile had no future left (the drop clears it), so
        wait_for took it for one still running and gave up without its one retry."""
        with self._lock:
            slot = self._slots.get(name)
            if slot is not None and slot.model is not None:
                return None
            if slot is None or slot.error is not None or slot.discard:
                if not self.request(name, supersede=False):
                    # the reason the load was refused: a draft too large for the budget, or a size that could not
                    # be read, is recorded on its slot; "no draft it may evict" hid those and sent the user to K
                    refused = self._slots.get(name)
                    if refused is not None and refused.error is not None:
                        raise DraftLoadError(str(refused.error)) from refused.error
                    if self._closed:
                        raise DraftLoadError(f"draft {name!r} cannot be loaded: the draft cache is closed")
                    holding = self._in_flight()
                    if holding:  # they land (evictable) or drop (freeing their room): then it may start
                        raise _RoomHeld([s.future for s in holding], [s.name for s in holding])
                    raise DraftLoadError(
                        f"draft {name!r} cannot be loaded: the cache (K={self.capacity}, budget={self.budget_bytes} B)"
                        " has no draft it may evict"
                    )
                slot = self._slots[name]
            self._put_first(slot)
            return slot, slot.future

    def _put_first(self, wanted: _Slot) -> None:
        """Move ``wanted``'s queued load ahead of the other queued ones: the decode thread blocks on it, and it
        waited behind loads the last goal had left queued (prefetches, which are not dropped: Oracle-Dynamic
        planned them). The others are cancelled before the loader takes them and submitted again, behind it; a
        load already reading is left to finish. Called holding the lock."""
        if wanted.future is None or wanted.future.running() or wanted.future.done():
            return
        ahead = [s for s in self._slots.values()
                 if s is not wanted and s.model is None and s.future is not None and s.future.cancel()]
        for slot in ahead:
            try:
                slot.future = self._pool.submit(self._load, slot)
            except RuntimeError:  # the pool refuses new work (the interpreter is exiting): no load, no slot
                slot.future = None
                del self._slots[slot.name]
                self._changed()

    # -- explicit residency changes ---------------------------------------------------
    def remove(self, name: str) -> None:
        """Forget a draft (removed from the registry), even the active one; a load in flight is discarded."""
        with self._lock:
            slot = self._slots.get(name)
            if slot is not None and slot.model is None and slot.future is not None and slot.error is None:
                self._detach(slot)  # its bytes stay reserved until the loader finishes; a new entry loads anew
            elif slot is not None:
                self._evict(name)
            # what is known of the name goes with it, resident or not: a draft evicted earlier and now replaced
            # kept its old measured size, so the new, smaller files were refused as too large for the budget
            if self._active == name:
                self._active = ""
            self._scores.pop(name, None)
            self._measured.pop(name, None)  # another model may come under this name: its size is learnt anew
            self._working_set = [n for n in self._working_set if n != name]
            self._changed()

    def fail(self, name: str, error: BaseException) -> None:
        """Take a draft out of service after it failed in use (its forward raised, its logits were not finite):
        evicted now (``on_evict`` runs), then failed with ``error`` as a failed load is, so it is skipped until
        the retry back-off, a budget change or clear_failed()."""
        with self._lock:
            slot = self._slots.get(name)
            if slot is not None and slot.future is not None and slot.model is None and slot.error is None:
                self._detach(slot)  # a reload in flight: dropped when it lands, its bytes reserved until then
            elif slot is not None:
                self._evict(name)
            self._slots[name] = failed = _Slot(name, 0)
            self._fail(failed, error, "failed in use", counter="use_failures")
            if self._active == name:
                self._active = ""
            self._working_set = [n for n in self._working_set if n != name]
            self._changed()

    def clear_failed(self, name: str | None = None) -> None:
        """Let a failed draft (every one when ``name`` is None) be tried again (after fixing its files)."""
        with self._lock:
            self._forget_failures(name=name)
            self._changed()

    def evict_changed(self) -> list[str]:
        """Evict the resident drafts whose weights files changed since they were loaded (an operator restored or
        replaced them): the next prefetch reads the files as they are now. A load in flight is checked the same
        way when it lands, and dropped if its files changed. Returns the names evicted. Call it with no generation
        running (the node does when the draft registry is set): ``on_evict`` runs on this thread."""
        with self._lock:
            resident = [(n, s.model.source or s.model.spec.path, s.files, s) for n, s in self._slots.items()
                        if s.model is not None]
            measured = [(n, source, files) for n, (_, source, files) in self._measured.items() if source]
            self._rechecks += 1
            for slot in self._slots.values():
                if slot.future is not None and slot.model is None:
                    slot.recheck = True  # it may have read the files before they changed: checked when it lands
        changed = {name: slot for name, path, files, slot in resident if weights_identity(path) != files}
        # a draft not resident now whose files were replaced in place (a re-export under the same names): its
        # measured size is the old files' (refused up front on it, or reserving too little)
        remeasure = [name for name, path, files in measured if weights_identity(path) != files]
        evicted = []
        with self._lock:
            for name in remeasure:
                self._measured.pop(name, None)
            for name, checked in changed.items():
                current = self._slots.get(name)
                if current is not None and current is not checked:  # evicted and loaded again meanwhile: that
                    continue  # load read the files as they are now (evicting it threw a fresh draft away)
                self._measured.pop(name, None)  # other files: their size is learnt anew
                if current is not None:
                    self._evict(name)
                    evicted.append(name)
                    if self._active == name:
                        self._active = ""
            if evicted:
                self._changed()
        return evicted

    def reconfigure(self, capacity: int | None = None, budget_bytes: int | None = None) -> None:
        """Change K and/or the byte budget; shrinking evicts the lowest-scored non-active drafts now.

        Loads already in flight are not interrupted; if they no longer fit they are dropped when they complete.
        A new budget forgets every failure: a draft that did not fit may fit now, and is tried again.
        """
        capacity = self.capacity if capacity is None else capacity
        budget_bytes = self.budget_bytes if budget_bytes is None else budget_bytes
        _check_capacity(capacity, budget_bytes)
        with self._lock:
            if budget_bytes != self.budget_bytes:
                self._forget_failures()
            self.capacity, self.budget_bytes = capacity, budget_bytes
            # resident drafts and loads in flight weighed together, lowest score first (a load wins a tie: it is
            # not in memory yet): dropping every load first lost the best-ranked draft being prefetched while a
            # worse resident one stayed
            score = self._score_of
            while not self._live_fit(0, 0):
                load = min((s for s in self._live() if s.model is None), key=lambda s: score(s.name), default=None)
                victim = self._victim(protect=set())
                if load is not None and (victim is None or score(load.name) <= score(victim)):
                    load.discard = True
                    if self._cancel_queued(load):
                        del self._slots[load.name]
                elif victim is not None:
                    self._evict(victim)
                else:
                    break
            self._working_set = self._working_set[:capacity]
            self._changed()

    def reset(self, stop: Callable[[], bool] | None = None, timeout: float | None = None) -> bool:
        """Empty the cache (the paper resets runtime state per prompt); waits for loads in flight, so the next
        prompt's first load does not queue behind this one's. Returns False where a load is left reading (the wait
        ended early, or an earlier reset gave up on it: see ``_given_up``).

        The wait ends once ``stop()`` is true (polled every STOP_POLL_SECONDS: a goal cancelled as it starts) or
        after ``timeout`` seconds (a read hung on failing storage must not hang the node's cleanup). A load still in
        flight then, or one another thread starts meanwhile, is marked for dropping, not forgotten: it keeps its
        reservation until the loader ends."""
        in_flight = self._stop_queued()
        # (without a timeout, a wait for everything: the benches' untimed resets, which must leave no read running)
        waited = [f for f in in_flight if timeout is None or f not in self._given_up]
        finished = _wait_futures(waited, _deadline(timeout), stop)
        timed_out = not finished and not (stop is not None and stop())
        with self._lock:
            self._given_up = {f for f in (*self._given_up, *(waited if timed_out else ())) if not f.done()}
            finished = finished and len(waited) == len(in_flight)
            for name in list(self._slots):
                slot = self._slots[name]
                if slot.model is not None:
                    self._evict(name)
                elif slot.error is None and slot.future is not None and not self._cancel_queued(slot):
                    slot.discard = True  # started after the wait above: still in memory until it ends
                else:
                    del self._slots[name]
            self._active, self._scores, self._working_set = "", {}, []
            self._changed()
        return finished

    def close(self, timeout: float = CLOSE_WAIT_SECONDS) -> bool:
        """Stop loading: queued loads never run, the one reading is waited for up to ``timeout`` s, then left to
        end on its own thread (dropped when it lands; the interpreter still joins that thread as the process
        exits). The resident drafts are let go: a closed cache held them (their memory) for as long as its owner
        lived. Returns False where it was still reading."""
        with self._lock:
            closed_before, self._closed = self._closed, True
        if closed_before:  # (its owner's close after a caller's): the pool was shut down; a second shutdown joined a
            return self._closed_whole  # load left reading, blocking until the failing storage answered
        # a load left reading on its thread holds this cache; through these callbacks the cache held its owner's
        # controller, and with it the target, the predictor and the registry: a node cleaned up over failing storage
        # kept a whole target in memory per configure. No-ops, not None: the thread may be about to call one
        self.size_of = lambda name: 0
        self.source_current = lambda name, source: True
        self.on_change = None
        self.on_evict.clear()
        finished = _wait_futures(self._stop_queued(), _deadline(timeout), None)
        if not finished:
            log.warning("a draft load was still reading after %.0f s as the draft cache closed: left to end on its"
                        " own thread (is the drafts' storage failing?)", timeout)
        self._pool.shutdown(wait=finished, cancel_futures=True)
        self._closed_whole = finished
        with self._lock:
            for slot in self._slots.values():
                slot.model = None
            self._slots.clear()
            self._active, self._scores, self._working_set = "", {}, []
        return finished

    def drain(self, timeout: float | None = None) -> bool:
        """Wait for every load in flight (tests, benchmarks and shutdown): False where ``timeout`` s (for them
        all) ran out first. Until none is left: a blocking wait on another thread may requeue a load (_put_first),
        whose old future is done, cancelled, while the load itself is still to run."""
        deadline = _deadline(timeout)
        while True:
            with self._lock:
                pending = [s.future for s in (*self._slots.values(), *self._detached)
                           if s.future is not None and not s.future.done()]
            if not pending:
                return True
            if not _wait_futures(pending, deadline, None):
                return False

    # -- diagnostics --------------------------------------------------------------------
    def snapshot(self) -> CacheStats:
        with self._lock:
            return self._snapshot()

    def _snapshot(self) -> CacheStats:
        c = self._counters
        resident = [n for n, s in self._slots.items() if s.model is not None]
        return CacheStats(
            capacity=self.capacity,
            budget_bytes=self.budget_bytes,
            resident=resident,
            loading=[n for n, s in self._slots.items() if s.model is None and s.error is None],
            failed={n: f"{type(s.error).__name__}: {s.error}" for n, s in self._slots.items() if s.error is not None},
            working_set=list(self._working_set),
            active=self._active,
            # a resident slot's reservation is its measured in-memory size (set when its load finished)
            bytes_resident=sum(self._slots[n].reserved_bytes for n in resident),
            bytes_reserved=self._reserved(),
            hits=c.hits,
            misses=c.misses,
            loads=c.loads,
            load_failures=c.load_failures,
            use_failures=c.use_failures,
            dropped_loads=c.dropped_loads,
            load_seconds=c.load_seconds,
            wait_seconds=c.wait_seconds,
            evictions=c.evictions,
            wasted_prefetches=c.wasted_prefetches,
        )

    # -- internals (lock held) ------------------------------------------------------------
    def _count(self) -> int:
        """Slots that occupy memory: resident plus loads in flight (being dropped included)."""
        return sum(1 for s in self._slots.values() if s.error is None) + len(self._detached)

    def _reserved(self) -> int:
        return (sum(s.reserved_bytes for s in self._slots.values() if s.error is None)
                + sum(s.reserved_bytes for s in self._detached))

    def _detach(self, slot: _Slot) -> None:
        """Take a load in flight out of ``_slots`` for good: it is dropped when it lands (a later load of the name
        is another slot, so the old files' model never lands under it); one still queued never runs."""
        slot.discard = True
        del self._slots[slot.name]
        if not self._cancel_queued(slot):
            self._detached.append(slot)

    def _stop_queued(self) -> list[Future]:
        """Cancel every load the loader has not started (their slots go); the futures of those running."""
        with self._lock:
            for name, slot in list(self._slots.items()):
                if slot.model is None and slot.error is None and self._cancel_queued(slot):
                    del self._slots[name]
            self._detached = [s for s in self._detached if s.future is not None and not self._cancel_queued(s)]
            return [s.future for s in self._in_flight()]

    @staticmethod
    def _cancel_queued(slot: _Slot) -> bool:
        """Cancel ``slot``'s load if the loader has not started it (queued behind another): True if so. A load
        already unwanted otherwise ran in full on the one loader thread, holding its reservation, before the
        wanted one behind it could start."""
        if slot.future is not None and slot.future.cancel():
            slot.future, slot.discard = None, True  # a wait_for on it reads "dropped on purpose", not "load it again"
            return True
        return False

    def _drop_queued(self, keep: set[str]) -> bool:
        """Cancel the loads still queued (not yet reading) for drafts outside ``keep``; whether any was."""
        dropped = [name for name, slot in self._slots.items()
                   if name not in keep and slot.model is None and self._cancel_queued(slot)]
        for name in dropped:
            del self._slots[name]
        return bool(dropped)

    def _in_flight(self) -> list[_Slot]:
        return [s for s in (*self._slots.values(), *self._detached) if s.future is not None and s.model is None]

    def _fits(self, extra: int) -> bool:
        return not self.budget_bytes or self._reserved() + extra <= self.budget_bytes

    def _live(self) -> list[_Slot]:
        """Slots that can become (or are) resident: not failed, not marked for dropping."""
        return [s for s in self._slots.values() if s.error is None and not s.discard]

    def _live_fit(self, count: int, size: int) -> bool:
        """Would the live slots plus ``count`` more drafts of ``size`` bytes fit K and the budget?"""
        live = self._live()
        return len(live) + count <= self.capacity and (
            not self.budget_bytes or sum(s.reserved_bytes for s in live) + size <= self.budget_bytes)

    def _keep(self, slot: _Slot, protect: set[str]) -> bool:
        """A load marked for dropping is wanted again: keep it if the live drafts leave room (evicting
        the lowest-scored resident drafts outside ``protect`` as for a new load). Its bytes are still
        reserved, so nothing is loaded twice and the memory in use does not grow."""
        if self.budget_bytes and slot.reserved_bytes > self.budget_bytes:
            return False  # larger than the whole budget now: let it drop
        live = self._live()
        held = sum(s.reserved_bytes for s in live)
        victims = self._victims_until(
            lambda n, freed: len(live) - n + 1 <= self.capacity and (
                not self.budget_bytes or held - freed + slot.reserved_bytes <= self.budget_bytes),
            protect | {slot.name})
        if victims is None:
            return False
        for victim in victims:
            self._evict(victim)
        slot.discard = False
        return True

    def _victims_until(self, fits: Callable[[int, int], bool], protect: set[str]) -> list[str] | None:
        """The lowest-scored resident drafts (Algorithm 2's order, outside ``protect`` and the active draft) whose
        eviction makes ``fits(drafts evicted, bytes freed)`` true; None where evicting every one that may go would
        not, and then none goes: evicting one by one and giving up at the end lost drafts for a load that never
        started (room held by loads in flight is no resident draft's to give)."""
        chosen: list[str] = []
        freed = 0
        while not fits(len(chosen), freed):
            victim = self._victim(protect | set(chosen))
            if victim is None:
                return None
            chosen.append(victim)
            freed += self._slots[victim].reserved_bytes
        return chosen

    def _forget_failures(self, name: str | None = None, older_than: float = 0.0) -> None:
        """Drop failed slots (``name``'s only, if given; failed at least ``older_than`` s ago): tried again later."""
        now = time.monotonic()
        for n in [name] if name else list(self._slots):
            slot = self._slots.get(n)
            if slot is not None and slot.error is not None and now - slot.failed_at >= older_than:
                del self._slots[n]

    def _fail(self, slot: _Slot, error: BaseException, what: str = "failed to load",
              counter: str = "load_failures") -> None:
        """Every failed draft ends here: recorded on the slot (CacheStats.failed), counted (``counter``, on
        /diagnostics) and logged."""
        # kept without the tracebacks they came with: their frames hold the draft's model (a failure in use) or a
        # half-loaded one, which would stay in memory while the failure is remembered; the log gets text for the same
        # reason. (_load raises it again for its future: that puts back only _load's own frame, which holds the
        # manager and the slot, no model)
        slot.error, slot.future, slot.failed_at = _without_frames(error), None, time.monotonic()
        setattr(self._counters, counter, getattr(self._counters, counter) + 1)
        log.warning("draft %r %s (retried after %.0f s): %s: %s", slot.name, what, self.retry_seconds,
                    type(error).__name__, str(error))

    def _victim(self, protect: set[str]) -> str | None:
        """Lowest-scored resident draft outside ``protect`` and the active draft (Algorithm 2, line 6)."""
        candidates = [
            n for n, s in self._slots.items() if s.model is not None and n not in protect and n != self._active
        ]
        if not candidates:
            return None
        return min(candidates, key=self._score_of)

    def _score_of(self, name: str) -> float:
        """The policy's last score for ``name``; unscored drafts go first."""
        return self._scores.get(name, float("-inf"))

    def _size_needed(self, name: str) -> int:
        """The bytes a load of ``name`` reserves: what its last load occupied (the model as this cache holds it: int4
        drafts from fp32 files take a fraction of their files), else its estimate (size_of: the registry's
        size_bytes, by default its files' size) but at most the budget. Refused on an estimate, such a draft never
        ran; with the whole budget reserved its load measures it (_load refuses it then if it really is larger, and
        later loads are refused up front on that measurement)."""
        measured = self._measured.get(name)
        if measured is not None:
            return measured[0]
        estimate = max(0, int(self.size_of(name)))
        return min(estimate, self.budget_bytes) if self.budget_bytes else estimate

    def _make_room_and_load(self, name: str, protect: set[str]) -> bool:
        if self._closed:  # its loader pool is gone: a slot reserved now would stay "loading" for good
            return False
        try:
            size = self._size_needed(name)
        except Exception as exc:  # on the decode thread: a size that cannot be read fails the draft, not the goal
            self._slots[name] = slot = _Slot(name, 0)
            self._fail(slot, DraftLoadError(f"draft {name!r}: its size could not be read ({type(exc).__name__}:"
                                            f" {exc})"))
            return False
        if self.budget_bytes and size > self.budget_bytes:  # measured (_size_needed): it does not fit
            self._slots[name] = slot = _Slot(name, 0)
            self._fail(slot, DraftTooLargeError(
                f"draft {name!r} needs {size} B but the draft memory budget is {self.budget_bytes} B:"
                " raise memspec.budget_bytes or remove the draft"))
            return False
        count, reserved = self._count(), self._reserved()
        victims = self._victims_until(
            lambda n, freed: count - n < self.capacity and (
                not self.budget_bytes or reserved - freed + size <= self.budget_bytes), protect)
        if victims is None:
            # Algorithm 2, lines 7-8: nothing may be evicted, skip this prefetch. (An estimate over the budget,
            # capped at it, loads only alone, so the drafts in memory never exceed the budget while it is
            # measured; loading it into the room beside drafts that may not go put K drafts in memory over it)
            return False
        for victim in victims:
            self._evict(victim)
        slot = _Slot(name, size)
        self._slots[name] = slot  # reserved before the load starts
        try:
            slot.future = self._pool.submit(self._load, slot)
        except RuntimeError:  # the pool refuses new work (the interpreter is exiting): no load, no slot
            del self._slots[name]
            return False
        return True

    def _evict(self, name: str) -> None:
        slot = self._slots.pop(name)
        was_resident = slot.model is not None
        slot.model = None  # drop the reference: the memory goes back
        if was_resident:
            self._counters.evictions += 1
            if not slot.used:
                self._counters.wasted_prefetches += 1
            for callback in list(self.on_evict):
                try:
                    callback(name)
                except Exception:  # one observer's failure must not leave the cache half changed (an eviction loop
                    # cut short kept drafts its K or budget no longer holds, and a load for which room was made
                    # never started)
                    log.exception("an on_evict callback failed for draft %r (the eviction stands)", name)

    def _load(self, slot: _Slot) -> None:
        """Runs on the loader thread: storage -> fast memory, then publish under the lock. A failure is raised from
        here, not re-raised where it was caught: on Python 3.10 a bare ``raise`` put back the traceback that _fail
        had cleared, and its frames (the loader's) held the failed draft's model in memory, outside K and the
        budget, while the failure was remembered."""
        error = self._load_or_error(slot)
        if error is not None:
            raise error  # the future carries it; whoever waits on it reads the slot

    def _load_or_error(self, slot: _Slot) -> Exception | None:
        t0 = time.perf_counter()
        try:
            loaded = self.loader(slot.name)
            elapsed = time.perf_counter() - t0
            # the files as they were before the read (registry_loader records it); a loader that does not: as they
            # are. In the try: a loader handing back no model failed like one that raised, where the slot stayed
            # "loading" for good (holding its room, and reset() could not clear a future already done)
            source = loaded.source or loaded.spec.path  # what ``files`` is the identity of
            files = loaded.files or weights_identity(source)
            # before the lock: a change of entry after this check finds the model resident at the next sync
            current = self.source_current is None or not loaded.source or self.source_current(slot.name, source)
            # a marked load's files are statted here, not under the lock (the decode thread's next get/resident
            # would wait on failing storage, which evict_changed keeps its own stats out of the lock for); taken
            # again under it only if another evict_changed marked loads since
            rechecks = self._rechecks
            now = weights_identity(source) if slot.recheck else None
        except UnknownDraftError as exc:  # its registry entry went before the load began: the next sync removes it
            with self._lock:
                slot.discard = True  # on purpose: a wait for it ends saying the draft was removed, no retry
                self._drop(slot)
            return _without_frames(exc)
        except BaseException as exc:  # any loader failure must not reach the decode thread
            with self._lock:
                self._loader_failed(slot, exc)
            # SystemExit, KeyboardInterrupt: not returned, the future would hand them to a waiting decode thread
            return _without_frames(exc) if isinstance(exc, Exception) else None
        with self._lock:
            try:
                if slot.recheck and (now is None or self._rechecks != rechecks):
                    now = weights_identity(source)
                self._publish(slot, loaded, elapsed, source, files, current and (now is None or now == files))
            except Exception as exc:  # a slot left "loading" with its future done held its room for good
                self._loader_failed(slot, exc)
                return _without_frames(exc)
        return None

    def _drop(self, slot: _Slot) -> None:
        """A load that is not wanted as it ends: out of the cache, counted as dropped, not as failed."""
        if self._slots.get(slot.name) is slot:
            del self._slots[slot.name]
        self._detached = [s for s in self._detached if s is not slot]
        slot.future = None
        self._counters.dropped_loads += 1
        self._changed_logged()

    def _loader_failed(self, slot: _Slot, exc: BaseException) -> None:
        """A load that raised, in the loader or as it was published: failed, and out of the room it held."""
        error = exc if isinstance(exc, Exception) else DraftLoadError(f"the loader raised {type(exc).__name__}: {exc}")
        slot.model = None
        if slot.discard or any(s is slot for s in self._detached):
            # unwanted by now (K shrank, a reset timed out) or removed (its registry entry gone): no failure is
            # kept for it (no back-off: its slot goes), so it is counted as the dropped load it is
            slot.error, slot.future = error, None
            self._counters.dropped_loads += 1
            log.info("draft %r's load failed after it was no longer wanted: %s: %s", slot.name,
                     type(error).__name__, error)
        else:
            self._fail(slot, error)
        if slot.discard and self._slots.get(slot.name) is slot:
            del self._slots[slot.name]
        self._detached = [s for s in self._detached if s is not slot]
        self._changed_logged()  # on_change itself may have failed the publish: the state above stands

    def _publish(self, slot: _Slot, loaded: LoadedModel, elapsed: float, source: str, files, current: bool) -> None:
        """The loader's result under the lock: resident, or dropped (unwanted by now, or stale)."""
        # ``current`` is False also for a load marked ``recheck`` whose files changed (_load: evict_changed sets the
        # mark under the lock, so it either saw this load resident and checks it there, or marked it before _load
        # read the mark or counted the marks)
        stale = not current
        if self._slots.get(slot.name) is not slot or slot.discard or stale or self._closed:
            if stale:
                self._measured.pop(slot.name, None)  # other files under the name: their size is learnt anew
            self._drop(slot)  # removed, over capacity, or its files changed while in flight
            return
        actual = int(getattr(loaded, "size_bytes", 0) or 0)
        if actual > 0:
            # later loads of it reserve this much: refused once at most
            self._measured[slot.name] = (actual, source, files)
        if actual > slot.reserved_bytes:
            others = self._reserved() - slot.reserved_bytes
            if self.budget_bytes and actual > self.budget_bytes:
                self._fail(slot, DraftTooLargeError(
                    f"draft {slot.name!r} occupies {actual} B in memory, more than the {slot.reserved_bytes} B"
                    f" reserved and the whole {self.budget_bytes} B budget (memspec.budget_bytes): raise the"
                    " budget or remove the draft"))
                self._changed_logged()
                return
            if self.budget_bytes and others + actual > self.budget_bytes:
                # it fits the budget alone, not beside the others: not a failure. Dropped now; the next load
                # of it reserves the size just measured, so it evicts what it needs (a registry whose
                # size_bytes is the file's, of fp16 weights run in fp32, reserves half of what they take)
                log.info("draft %r occupies %d B in memory, more than the %d B reserved: dropped, and loaded at"
                         " that size when next wanted (set its size_bytes in the registry)", slot.name, actual,
                         slot.reserved_bytes)
                del self._slots[slot.name]
                slot.future = None
                self._counters.dropped_loads += 1
                self._changed_logged()
                return
        if actual > 0:
            slot.reserved_bytes = actual  # account what it really occupies from now on
        slot.model, slot.files = loaded, files
        self._counters.loads += 1
        self._counters.load_seconds += elapsed  # the loads counted in ``loads``: load_seconds / loads is their mean
        self._changed_logged()

    def _changed(self) -> None:
        callback = self.on_change  # read once: close() may clear it meanwhile
        if callback is not None:
            callback(self._snapshot())

    def _changed_logged(self) -> None:
        """_changed for the loader thread's publish: the load's outcome is settled by then, so a callback that
        raises is logged, not taken for the load's failure (counted twice, the draft failed for it)."""
        try:
            self._changed()
        except Exception:
            log.exception("the draft cache's change callback raised")


def _check_capacity(capacity: int, budget_bytes: int) -> None:
    if not isinstance(capacity, int) or isinstance(capacity, bool) or capacity < 1:  # True is an int to Python
        raise ValueError(f"cache capacity K must be an integer >= 1 (drafts resident at once), got {capacity!r}")
    # NaN passed every check and then loaded nothing, silently (every comparison with it is false); True was 1 B
    if not isinstance(budget_bytes, int) or isinstance(budget_bytes, bool) or budget_bytes < 0:
        raise ValueError(f"cache budget_bytes must be an integer >= 0 (0 = no byte budget), got {budget_bytes!r}")


# -- the storage -> fast memory loader ----------------------------------------------------

def move_tensors(model: torch.nn.Module, move: Callable[[torch.Tensor], torch.Tensor]) -> torch.nn.Module:
    """Replace every parameter and buffer of ``model`` by ``move`` of it, in place, once per tensor: a tensor two
    modules share (tied input and output embeddings, the bundled drafts') stays one tensor. Moved module by
    module, the tied embedding became two copies on the device, half again a draft's memory uncounted."""
    moved: dict[int, torch.Tensor] = {}  # id of the original tensor -> its moved copy (the originals stay alive)
    originals = []
    for module in model.modules():
        for table, as_param in ((module._parameters, True), (module._buffers, False)):
            for key, tensor in list(table.items()):
                if tensor is None:
                    continue
                if id(tensor) not in moved:
                    originals.append(tensor)
                    data = move(tensor.data if as_param else tensor)
                    moved[id(tensor)] = torch.nn.Parameter(data, requires_grad=False) if as_param else data
                table[key] = moved[id(tensor)]
    return model


def to_device_via_pinned(model: torch.nn.Module, device: torch.device) -> torch.nn.Module:
    """Copy a CPU model to CUDA through pinned host memory on a side stream.

    Pinned (page-locked) buffers let the copy run as DMA without staging, and a
    separate stream keeps it from serialising behind the decode thread's kernels
    on the default stream (SpecExec does the same for offloaded weights).
    """
    if device.type != "cuda":
        return model.to(device)
    stream = torch.cuda.Stream(device=device)
    with torch.cuda.stream(stream):
        move_tensors(model, lambda t: t.pin_memory().to(device, non_blocking=True))
    stream.synchronize()  # the model is complete before it is published as resident
    return model


def draft_spec(path: str, dtype: str = "fp32", quantization: str = "none") -> ModelSpec:
    """How the draft cache loads a registered draft (registry_loader builds it on the CPU, then moves it): a bench
    that times draft loads loads them this way too."""
    return ModelSpec(path=path, dtype=dtype, device="cpu", quantization=quantization)


def build_dtype(dtype: str, quantization: str, device: str) -> str:
    """The dtype a draft is built in on the CPU before it moves to ``device``: the CPU's bf16 path (its kernels, and
    the CPU instruction sets it requires) is for drafts that run on the CPU, so one bound for a GPU is built in fp32
    and cast on the way, as transformers casts a target there (every draft load failed on a CPU without bf16)."""
    if torch.device(device).type != "cpu" and quantization == "none" and dtype == "bf16":
        return "fp32"
    return dtype


def registry_loader(registry, dtype: str = "fp32", device: str = "cpu", storage=None,
                    quantization: str = "none", target_vocab_size: int = 0) -> Loader:
    """A loader for :class:`DraftCacheManager`: reads the registry entry's safetensors into fast memory.

    ``storage`` (a medium name, StorageMedium or DraftStorage; runtime/storage.py): read the weights cold
    through that storage tier; None: load_model as it is. ``quantization``: the drafts' forward path
    (none, int8, int4: runtime/forward_paths.py). ``target_vocab_size`` (0: unchecked): the target's logit width;
    a draft of another width fails to load (models.check_draft_compatible)."""
    from .draft_forward import lean_forward_for
    from .storage import draft_storage

    if quantization in ("int8", "int4"):  # their own weight format, made from fp32: a bf16 target's dtype cannot apply
        dtype = "fp32"
    if torch.device(device).type != "cpu" and quantization != "none":
        # drafts are built on the CPU and moved: the engine's CPU kernels would then read device memory as host memory
        raise ValueError(f"draft quantization {quantization!r} runs on the engine's CPU kernels: drafts on {device}"
                         " need quantization 'none'")
    built = build_dtype(dtype, quantization, device)
    path = forward_path_for(draft_spec("", built, quantization))  # a contradiction fails here, not at every load
    resolve_device(device)  # a device this machine lacks failed every load, retried, and goals ran on the target
    reader = draft_storage(storage)
    if reader is not None and path not in (*PATHS, "fp16"):  # so does a form the storage loader cannot build
        raise ValueError(f"drafts read through a storage tier are built as fp32, bf16, fp16, int8 or int4: dtype"
                         f" {dtype!r} with quantization {quantization!r} asks for {path!r}; name one of those")

    def load(name: str) -> LoadedModel:
        entry = registry.get(name)
        files = weights_identity(entry.path)  # before the read: a file replaced meanwhile shows as changed later
        spec = draft_spec(entry.path, built, quantization)
        loaded = reader.load(spec, name) if reader is not None else load_model(spec)
        if target_vocab_size:
            check_draft_compatible(target_vocab_size, loaded, name)
        target = torch.device(device)
        if target.type == "cuda":
            if built != dtype:  # cast as it moves; its memory is the cast model's (the fp32 one's was counted)
                loaded.model.to(resolve_dtype(dtype))
                loaded.size_bytes = parameter_bytes(loaded.model)
            loaded.model = to_device_via_pinned(loaded.model, target)
            loaded.spec = ModelSpec(path=entry.path, dtype=dtype, device=device, quantization=quantization)
        # the engine's forward for it (fused linears, the one-call kernels: runtime/draft_forward.py) is built here,
        # on the loader thread, not by the decode thread at the draft's first iteration (1-5 ms there)
        lean_forward_for(loaded.model)
        loaded.files, loaded.source = files, entry.path
        return loaded

    return load
