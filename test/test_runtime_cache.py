"""The draft cache keeps |G| <= K and bytes <= budget at every instant, never evicts the active draft,
never blocks update(), and survives failing loads."""

from __future__ import annotations

import dataclasses
import random
import threading
import time

import pytest
import torch
from ros_helpers import wait_until

from memspec_ros.runtime.cache import DraftCacheManager, DraftLoadError, DraftTooLargeError, normalise_ranking
from memspec_ros.runtime.models import LoadedModel, ModelSpec
from memspec_ros.runtime.stats import CacheStats

# how long a gated load holds, or a test waits for a load to start, at most: a loaded CI machine can stall for
# seconds, and a gate that let go after 5 s landed a load a test still held to be in flight (only a failing test
# waits this long)
GATE_SECONDS = 60.0
NAMES = ["general", "code", "math", "law", "medical"]
SIZES = {"general": 300, "code": 200, "math": 200, "law": 100, "medical": 400}


def fake_loader(delay=0.0, fail=(), sizes=SIZES, jitter=None):
    def load(name: str) -> LoadedModel:
        time.sleep(delay if jitter is None else jitter.uniform(0, delay))
        if name in fail:
            raise OSError(f"disk error reading {name}")
        return LoadedModel(torch.nn.Linear(1, 1), ModelSpec(name), sizes.get(name, 0), 64, 512)

    return load


def gated_loader(gate: threading.Event, delay: float = 0.0, started: threading.Event | None = None):
    """fake_loader's loads, each held until ``gate`` is set (then ``delay`` s more): a load kept in flight. ``started``
    is set when a load begins: a test that acts on a load in flight waits for it (one still queued behind another is
    cancelled instead, another path)."""
    def load(name: str) -> LoadedModel:
        if started is not None:
            started.set()
        gate.wait(GATE_SECONDS)
        time.sleep(delay)
        return fake_loader()(name)

    return load


def held_on(held: str, gate: threading.Event, started: threading.Event, loaded: list[str]):
    """fake_loader's loads, recorded in ``loaded``; ``held``'s is held until ``gate`` is set (``started`` is set as it
    begins): the loads asked for meanwhile queue behind it on the one loader thread."""
    def load(name: str) -> LoadedModel:
        loaded.append(name)
        if name == held:
            started.set()
            gate.wait(GATE_SECONDS)
        return fake_loader()(name)

    return load


class Recorder:
    """Collects a snapshot at every state change (the cache calls it under its lock)."""

    def __init__(self) -> None:
        self.snaps: list[CacheStats] = []

    def __call__(self, snap: CacheStats) -> None:
        self.snaps.append(snap)


def check_invariants(snaps, capacity, budget, sizes=None):
    """|G| + loads <= K and reserved bytes <= budget in every snapshot; with ``sizes`` (what each draft
    really occupies), every load in flight has reserved its real size, not 0, before it started."""
    assert snaps, "the cache reported no state changes"
    for s in snaps:
        assert len(s.resident) + len(s.loading) <= capacity, s
        if budget:
            assert s.bytes_reserved <= budget, s
            assert s.bytes_resident <= s.bytes_reserved
        if sizes is not None:
            assert s.bytes_resident == sum(sizes[n] for n in s.resident), s
            assert s.bytes_reserved == sum(sizes[n] for n in s.resident + s.loading), s


@pytest.mark.parametrize("capacity,budget", [(1, 0), (2, 0), (3, 0), (2, 500), (3, 600), (5, 400)])
def test_random_rankings_keep_invariants_at_every_instant(capacity, budget):
    rng = random.Random(capacity * 1000 + budget)
    rec = Recorder()
    cache = DraftCacheManager(capacity, fake_loader(0.004, jitter=random.Random(1)), budget_bytes=budget,
                              size_of=SIZES.get, on_change=rec)
    evicted_while_active = []
    cache.on_evict.append(lambda n: evicted_while_active.append(n) if n == cache.active else None)
    active = ""
    for _ in range(60):
        ranking = rng.sample(NAMES, len(NAMES))
        # (that update() never waits for a load is shown with a gated loader below, not by a clock)
        w = cache.update([(n, rng.random()) for n in ranking], active=active or None)
        assert len(w) <= capacity
        resident = cache.resident()
        if resident and rng.random() < 0.7:
            active = rng.choice(resident)
            assert cache.get(active) is not None
            cache.set_active(active)
        time.sleep(rng.uniform(0, 0.006))
    cache.drain()
    check_invariants(rec.snaps, capacity, budget, SIZES)
    assert any(s.loading for s in rec.snaps), "no snapshot caught a load in flight"
    assert evicted_while_active == []
    snap = cache.snapshot()
    assert snap.loads >= 1 and snap.load_seconds > 0
    assert snap.evictions >= snap.wasted_prefetches
    cache.close()


def test_working_set_is_top_k_and_prefetch_is_asynchronous():
    gate = threading.Event()

    def slow(name):
        gate.wait(GATE_SECONDS)
        return fake_loader()(name)

    cache = DraftCacheManager(2, slow)
    assert cache.update(["math", "code", "law"]) == ["math", "code"]
    assert cache.resident() == [] and sorted(cache.loading()) == ["code", "math"]
    assert cache.get("math") is None  # non-blocking miss
    gate.set()
    cache.drain()
    assert sorted(cache.resident()) == ["code", "math"]
    snap = cache.snapshot()
    assert (snap.hits, snap.misses, snap.loads) == (0, 1, 2)
    cache.close()


def test_lowest_scored_outside_working_set_is_evicted_and_active_protected():
    cache = DraftCacheManager(2, fake_loader())
    cache.update({"general": 0.9, "code": 0.8})
    cache.drain()
    cache.set_active("code")
    # W = {math, law}: neither resident; general (outside W, not active) goes, code (active) stays
    cache.update({"math": 0.6, "law": 0.5, "general": 0.1, "code": 0.05}, active="code")
    cache.drain()
    assert sorted(cache.resident()) == ["code", "math"]
    snap = cache.snapshot()
    assert snap.evictions == 1 and snap.wasted_prefetches == 1  # general never ran
    cache.close()


def test_failed_load_marks_draft_failed_and_is_skipped(caplog):
    cache = DraftCacheManager(2, fake_loader(fail={"math"}))
    with caplog.at_level("WARNING", logger="memspec_ros.runtime.cache"):
        cache.update(["math", "code"])
        cache.drain()
    assert cache.resident() == ["code"]
    assert "math" in cache.failed() and "disk error" in str(cache.failed()["math"])
    assert cache.snapshot().load_failures == 1
    assert "'math' failed to load" in caplog.text and "disk error" in caplog.text  # logged, not swallowed
    # a later update skips the failed draft: W fills with the next viable ones
    assert cache.update(["math", "law", "code"]) == ["law", "code"]
    with pytest.raises(DraftLoadError, match="disk error"):
        cache.wait_for("math")
    cache.close()


def test_a_remembered_failure_holds_no_frame_of_its_whole_chain():
    """The failure is kept (its back-off) without tracebacks, whose frames hold the half-built model: only the error,
    its cause and its context were cleared, so a chain one deeper (an error raised while handling a wrapped one)
    kept that frame, and the model in it, while the node sat idle."""
    import gc
    import weakref

    half_built: list[weakref.ref] = []

    def load(name: str) -> LoadedModel:
        model = torch.nn.Linear(4, 4)
        half_built.append(weakref.ref(model))
        try:
            try:
                raise OSError("read error")  # the frame holding ``model`` is in every link's traceback
            except OSError as first:
                raise ValueError("bad header") from first
        except ValueError:
            raise RuntimeError(f"building {name} failed")  # noqa: B904 - its context: a chain three deep

    cache = DraftCacheManager(2, load)
    try:
        cache.update(["math"])
        cache.drain()
        assert "math" in cache.failed()
        gc.collect()
        assert half_built and half_built[0]() is None  # no frame of the chain holds the model
    finally:
        cache.close()


def test_a_budget_change_retries_the_drafts_that_did_not_fit():
    cache = DraftCacheManager(2, fake_loader(), budget_bytes=100, size_of=SIZES.get)
    cache.update(["medical", "law"])  # medical's estimate (400 B) is over the budget: its load measures it
    cache.drain()
    error = cache.failed()["medical"]
    assert isinstance(error, DraftTooLargeError) and "memspec.budget_bytes" in str(error)  # the node's parameter
    assert cache.update(["medical", "law"]) == ["law"]  # skipped while the budget is the same
    cache.drain()
    assert cache.resident() == ["law"]
    cache.reconfigure(budget_bytes=500)
    assert cache.failed() == {} and cache.snapshot().failed == {}  # diagnostics see no stale failure
    cache.update(["medical", "law"])
    cache.drain()
    assert sorted(cache.resident()) == ["law", "medical"]
    cache.close()


def test_a_failed_draft_is_retried_after_the_back_off(monkeypatch):
    """A load that failed (a damaged file) is tried again by a later update once retry_seconds have
    passed, not earlier, and the draft becomes resident once its cause is gone (the file restored).
    The clock is moved on, not slept through (a 0.3 s back-off could pass early on a loaded machine)."""
    from memspec_ros.runtime import cache as cache_module

    real, later = cache_module.time.monotonic, {"by": 0.0}
    monkeypatch.setattr(cache_module.time, "monotonic", lambda: real() + later["by"])
    broken = {"math"}
    attempts = []

    def load(name: str) -> LoadedModel:
        attempts.append(name)
        if name in broken:
            raise OSError(f"damaged file for {name}")
        return LoadedModel(torch.nn.Linear(1, 1), ModelSpec(name), 0, 64, 512)

    cache = DraftCacheManager(2, load, retry_seconds=30.0)
    cache.update(["math", "code"])
    cache.drain()
    assert "math" in cache.failed() and attempts.count("math") == 1
    cache.update(["math", "code"])
    cache.drain()
    assert "math" in cache.failed() and attempts.count("math") == 1  # within the back-off: skipped
    broken.clear()  # the file is restored
    later["by"] = 31.0
    assert "math" not in cache.failed()  # the back-off is over: viable again for the policy
    cache.update(["math", "code"])
    cache.drain()
    assert attempts.count("math") == 2 and sorted(cache.resident()) == ["code", "math"]
    assert cache.snapshot().failed == {}
    cache.close()


def test_request_and_wait_for_keep_a_failed_drafts_back_off(monkeypatch):
    """request() and wait_for() loaded a failed draft again at once: a policy that requests (MAB-Async,
    Prediction-Only) re-read a broken draft from slow storage at every scheduling point, and a blocking one stalled
    for it each time, though the README promises a 30 s back-off."""
    from memspec_ros.runtime import cache as cache_module

    real, later = cache_module.time.monotonic, {"by": 0.0}
    monkeypatch.setattr(cache_module.time, "monotonic", lambda: real() + later["by"])
    attempts = []

    def load(name: str) -> LoadedModel:
        attempts.append(name)
        raise OSError(f"damaged file for {name}")

    cache = DraftCacheManager(2, load, retry_seconds=30.0)
    assert cache.request("math")
    cache.drain()
    assert "math" in cache.failed() and attempts == ["math"]
    assert not cache.request("math")  # within the back-off: not loaded again
    with pytest.raises(DraftLoadError, match="damaged file for math"):
        cache.wait_for("math", timeout=5.0)
    assert attempts == ["math"]
    later["by"] = 31.0  # the back-off is over
    assert cache.request("math")
    cache.drain()
    assert attempts == ["math", "math"]
    cache.clear_failed("math")  # or at once, on demand (the registry set anew)
    with pytest.raises(DraftLoadError, match="damaged file for math"):
        cache.wait_for("math", timeout=5.0)
    assert attempts == ["math", "math", "math"]
    cache.close()


def test_byte_budget_reserves_before_load_and_refuses_oversized():
    cache = DraftCacheManager(3, fake_loader(0.01), budget_bytes=450, size_of=SIZES.get)
    cache.update({"general": 3, "code": 2, "law": 1})  # 300 + 200 > 450: code skipped, law fits
    snap = cache.snapshot()
    assert snap.bytes_reserved <= 450 and "code" not in snap.loading
    cache.drain()
    cache.update(["medical"])  # 400 B: evicts until it fits
    cache.drain()
    assert cache.snapshot().bytes_reserved <= 450
    small = DraftCacheManager(2, fake_loader(), budget_bytes=100, size_of=SIZES.get)
    small.update(["medical"])
    small.drain()
    assert isinstance(small.failed()["medical"], DraftTooLargeError)
    cache.close()
    small.close()


def test_a_draft_whose_estimate_is_over_the_budget_is_loaded_and_kept_if_it_fits_once_loaded():
    """The estimate (the registry's size_bytes, by default the files' size) refused a draft up front: fp32 files
    of 300 B loaded as int4 (the default drafts.quantization) take 80 B, but with a 100 B budget the draft was never
    loaded, so its real size was never learnt, and the node ran the target alone for good. Over the budget, an
    estimate reserves the whole budget and the load measures it; a measured size over the budget is refused up
    front, without a load."""
    loads, gate = [], threading.Event()
    real = {"code": 80, "law": 400, "math": 25, "medical": 50, "a": 30, "b": 30}

    def loader(name):
        loads.append(name)
        gate.wait(GATE_SECONDS)
        return fake_loader(sizes=real)(name)

    cache = DraftCacheManager(2, loader, budget_bytes=100, size_of=lambda name: 300)
    cache.update(["code"])
    assert cache.snapshot().bytes_reserved == 100  # the whole budget while it loads (held until measured)
    gate.set()
    cache.drain()
    assert cache.resident() == ["code"] and cache.failed() == {}
    assert cache.snapshot().bytes_reserved == cache.snapshot().bytes_resident == 80  # its real size from then on
    cache.update(["law"])  # really larger than the budget: refused once it is measured (code made room for its
    cache.drain()  # reservation, the whole budget: the price of learning its size, paid once)
    assert isinstance(cache.failed()["law"], DraftTooLargeError) and loads.count("law") == 1
    cache.reconfigure(budget_bytes=90)  # a budget change retries it: refused on its measured size, not loaded again
    cache.update(["law"])
    cache.drain()
    assert isinstance(cache.failed()["law"], DraftTooLargeError) and "needs 400 B" in str(cache.failed()["law"])
    assert loads.count("law") == 1
    cache.close()
    # beside drafts that may not be evicted (the active one, the working set) it waits: reserving only the room left
    # would put more drafts in memory than the budget holds while it is measured
    cache = DraftCacheManager(3, loader, budget_bytes=100, size_of=lambda name: 30 if name in ("a", "b") else 400)
    cache.update({"a": 3, "b": 2}, active="a")
    cache.drain()
    cache.set_active("a")
    cache.update({"math": 3, "a": 2, "b": 1}, active="a")  # K = 3: all three are W, none may go
    cache.drain()
    assert sorted(cache.resident()) == ["a", "b"] and "math" not in loads and not cache.failed()
    cache.set_active("")
    cache.update({"math": 3})  # a and b may go now: it loads alone, with the budget reserved
    cache.drain()
    assert cache.resident() == ["math"] and cache.snapshot().bytes_reserved == 25
    cache.close()


def test_a_load_larger_than_reserved_is_refused_when_it_breaks_the_budget():
    """The registry's size is only an estimate: the reservation is made from it before the load, and the
    cache checks the loaded draft's real size afterwards (the over-reservation branch). A draft that fits the
    budget alone but not beside the others is dropped, not failed, and loaded at its real size when next wanted
    (it was failed for the retry back-off, 30 s, though evicting one draft made room for it)."""
    claimed = {"general": 300, "code": 100, "law": 100, "math": 60, "medical": 100}
    real = {"general": 300, "code": 350, "law": 150, "math": 60, "medical": 600}
    rec = Recorder()
    cache = DraftCacheManager(3, fake_loader(sizes=real), budget_bytes=500, size_of=claimed.get, on_change=rec)
    cache.update(["general", "code"])  # reserves 300 + 100 = 400 <= 500
    assert cache.snapshot().bytes_reserved == 400
    cache.drain()
    # code really occupies 350: 300 + 350 > 500, so it is dropped, never resident, and not failed
    assert cache.resident() == ["general"] and cache.failed() == {} and not cache.is_available("code")
    assert cache.snapshot().load_failures == 0
    # wanted again, it reserves its real size: general (outside W) makes room
    cache.update(["code"])
    assert cache.snapshot().bytes_reserved == 350
    cache.drain()
    assert cache.resident() == ["code"] and cache.snapshot().bytes_resident == 350
    # larger than the whole budget once loaded: that is a failure, with the reason
    cache.update(["medical"])
    cache.drain()
    error = cache.failed()["medical"]
    assert isinstance(error, DraftTooLargeError)
    assert "600 B" in str(error) and "memspec.budget_bytes" in str(error)
    assert cache.snapshot().load_failures == 1
    # a draft larger than its estimate that still fits is accounted at its real size from then on
    cache.update(["general", "law"])  # reserves 300 + 100, occupies 300 + 150
    cache.drain()
    assert sorted(cache.resident()) == ["general", "law"]
    assert cache.snapshot().bytes_reserved == cache.snapshot().bytes_resident == 450
    # so a third draft claiming 60 B does not fit beside them (300 + 150 + 60 > 500): law (outside W) goes first
    cache.update({"general": 3, "math": 2}, active="general")
    cache.drain()
    assert sorted(cache.resident()) == ["general", "math"]
    assert all(s.bytes_resident <= s.bytes_reserved <= 500 for s in rec.snaps)
    cache.close()


def test_a_waited_for_load_dropped_without_an_error_is_loaded_again():
    """wait_for on a draft whose load was dropped without an error (it landed larger than its reservation beside
    a resident draft) raised "did not become resident: None"; the blocking policies then decoded without it. It
    is loaded again at its real size, evicting the idle draft, and the wait returns it."""
    claimed, real = {"general": 300, "code": 100}, {"general": 300, "code": 350}
    cache = DraftCacheManager(2, fake_loader(delay=0.01, sizes=real), budget_bytes=500, size_of=claimed.get)
    cache.update(["general"])
    cache.drain()
    model, _ = cache.wait_for("code", timeout=10.0)
    assert model is not None
    assert cache.resident() == ["code"] and cache.snapshot().load_failures == 0
    cache.close()


def test_a_waited_for_load_dropped_before_the_wait_looks_at_it_is_loaded_again():
    """wait_for read the load's future after the lock that started it: a load that landed larger than its
    reservation and was dropped in between had no future left, so the wait took it for one still running and
    failed ("not resident after 0.0 s (the wait's timeout)") instead of loading it again."""
    claimed, real = {"general": 300, "code": 100}, {"general": 300, "code": 350}
    cache = DraftCacheManager(2, fake_loader(sizes=real), budget_bytes=500, size_of=claimed.get)
    cache.update(["general"])
    cache.drain()
    start = cache._start_for_wait_when_room
    calls = []

    def start_then_land(*args):  # the loader thread ends (and the load is dropped) before wait_for goes on
        started = start(*args)
        calls.append(started)
        if len(calls) == 1:
            cache.drain()
        return started

    cache._start_for_wait_when_room = start_then_land
    model, _ = cache.wait_for("code", timeout=10.0)
    assert model is not None and len(calls) == 2  # dropped once, loaded again at its real size
    assert cache.resident() == ["code"]
    cache.close()


def test_a_bad_budget_or_retry_back_off_is_refused_with_the_reason():
    """budget_bytes NaN was taken and nothing ever loaded (every comparison with NaN is false), True was a 1-byte
    budget, a string a bare TypeError; retry_seconds NaN never forgot a failure."""
    for budget in (float("nan"), True, "500", None, 1.5, -1):
        with pytest.raises(ValueError, match="budget_bytes must be an integer >= 0"):
            DraftCacheManager(2, fake_loader(), budget_bytes=budget)
    cache = DraftCacheManager(2, fake_loader(), budget_bytes=500)
    with pytest.raises(ValueError, match="budget_bytes must be an integer >= 0"):
        cache.reconfigure(budget_bytes=float("nan"))
    assert cache.budget_bytes == 500
    cache.close()
    for retry in (float("nan"), float("inf"), -1.0, True, "30"):
        with pytest.raises(ValueError, match="retry_seconds must be a finite number >= 0"):
            DraftCacheManager(2, fake_loader(), retry_seconds=retry)


def test_a_warm_first_choice_does_not_wait_behind_the_last_goals_prefetch():
    """The last goal left a prefetch in flight, filling the second slot. The next goal's first choice (MemSpec: a
    draft not resident, the resident one second) waited for its draft: it evicted the resident draft it could
    have run and sat out the other load too. It runs the resident draft and loads its choice at a later point."""
    from memspec_ros.runtime.choice import CACHE_PREFETCH, Choice, carry_out

    gate = threading.Event()
    loads = {"general": fake_loader(), "math": gated_loader(gate), "code": fake_loader()}
    cache = DraftCacheManager(2, lambda name: loads[name](name))
    cache.update(["general"])
    cache.drain()
    cache.update({"general": 2, "math": 1}, active="general")  # the last goal's prefetch, held in flight
    cache.set_active("")
    assert cache.loading() == ["math"]
    ranking = [("code", 3.0), ("general", 2.0), ("math", 1.0)]
    choice = Choice("code", block=False, fallback=("code", "general", "math"), cache_action=CACHE_PREFETCH,
                    ranking=ranking)
    try:
        resolution = carry_out(choice, cache, wait=lambda name: pytest.fail(f"waited for {name}"), first=True)
        assert (resolution.draft, resolution.fallback, resolution.waited) == ("general", True, 0.0)
        assert cache.is_resident("general") and cache.snapshot().evictions == 0
    finally:
        gate.set()
        cache.close()


def test_a_blocking_wait_goes_ahead_of_the_loads_queued_before_it():
    """The decode thread blocked for its draft behind loads the last goal had left queued (a goal's cold start):
    the wanted load now goes first, and the ones it passed still load after it (prefetches Oracle-Dynamic planned
    are not dropped). A load already reading finishes first."""
    gate, started, loaded, polled = threading.Event(), threading.Event(), [], threading.Event()
    cache = DraftCacheManager(3, held_on("general", gate, started, loaded))
    try:
        cache.update({"general": 3.0, "code": 2.0, "law": 1.0})  # general reads (held); code, then law, queue
        assert started.wait(GATE_SECONDS)
        result: list = []
        waiter = threading.Thread(target=lambda: result.append(
            cache.wait_for("law", stop=lambda: polled.set() or False)))  # polled once it waits on its load
        waiter.start()
        assert polled.wait(GATE_SECONDS)
        gate.set()
        waiter.join(GATE_SECONDS)
        assert result and result[0][0].spec.path == "law"
        assert cache.drain(GATE_SECONDS)
        assert loaded == ["general", "law", "code"] and sorted(cache.resident()) == ["code", "general", "law"]
    finally:
        gate.set()
        cache.close()


def test_wait_for_blocks_and_records_wait():
    cache = DraftCacheManager(1, fake_loader(0.05))
    model, waited = cache.wait_for("code")
    assert model.spec.path == "code" and waited >= 0.04
    assert cache.snapshot().wait_seconds >= 0.04
    _, again = cache.wait_for("code")
    assert again == 0.0
    cache.close()


def test_remove_and_reconfigure():
    cache = DraftCacheManager(3, fake_loader())
    cache.update(["a", "b", "c"])
    cache.drain()
    cache.set_active("a")
    cache.remove("a")  # registry removal may take the active draft
    assert "a" not in cache.resident() and cache.active == ""
    cache.reconfigure(capacity=1)
    assert len(cache.resident()) == 1
    with pytest.raises(ValueError, match="capacity"):
        cache.reconfigure(capacity=0)
    with pytest.raises(ValueError, match="capacity"):
        DraftCacheManager(0, fake_loader())
    cache.close()


def test_a_removed_draft_that_was_not_resident_leaves_no_measured_size_behind():
    """Loaded once, evicted, then pointed at other files: remove() returned early for a name without a slot, so
    the new, smaller draft was refused as the old one's size ("needs 900 B ... raise memspec.budget_bytes")."""
    sizes = {"code": 900, "general": 100}
    cache = DraftCacheManager(1, fake_loader(sizes=sizes), budget_bytes=1000)
    cache.request("code")
    cache.drain()
    cache.request("general")  # K = 1: code is evicted
    cache.drain()
    assert cache.resident() == ["general"]
    cache.remove("code")  # the registry entry replaced by other files
    sizes["code"] = 100
    cache.reconfigure(budget_bytes=500)
    assert cache.request("code")
    cache.drain()
    assert cache.resident() == ["code"] and not cache.failed()
    cache.close()


@pytest.mark.parametrize("how", ["remove", "shrink", "fail", "reset"])
def test_a_queued_load_no_longer_wanted_never_runs(how):
    """A load removed (its entry changed), shrunk out (K lowered), failed or reset while still queued behind another
    ran in full on the one loader thread, holding its slot and bytes, before the load wanted next could start."""
    gate, loads = threading.Event(), []

    def load(name: str) -> LoadedModel:
        loads.append(name)
        gate.wait(GATE_SECONDS)
        return fake_loader()(name)

    cache = DraftCacheManager(2, load)
    cache.update({"a": 2, "b": 1})
    wait_until(lambda: loads == ["a"])  # a runs, b waits behind it
    assert cache.snapshot().loading == ["a", "b"]
    if how == "remove":
        cache.remove("b")
    elif how == "shrink":
        cache.reconfigure(capacity=1)  # b scores lower: it goes
    elif how == "fail":
        cache.fail("b", RuntimeError("taken out of service"))
    else:  # it waits for the load that runs, and empties the cache
        threading.Thread(target=lambda: (time.sleep(0.1), gate.set()), daemon=True).start()
        cache.reset()
        assert cache.snapshot().loading == [] and loads == ["a"]
        cache.update(["a"])  # (a was emptied with the rest)
    assert "b" not in cache.snapshot().loading
    gate.set()
    cache.drain()
    assert loads == ["a"] * (2 if how == "reset" else 1) and cache.resident() == ["a"]
    if how not in ("fail", "reset"):  # the name loads again when asked (a failed one after its back-off)
        assert cache.request("b")
        cache.drain()
        assert loads == ["a", "b"]
    cache.close()


def test_files_replaced_in_place_under_an_evicted_draft_are_measured_anew(tmp_path):
    """evict_changed forgot the measured size of resident drafts only: a draft evicted earlier whose files were
    replaced in place (a re-export under the same names, the registry entry unchanged) kept the old files' size,
    and was refused up front on it."""
    folders = {n: tmp_path / n for n in ("code", "general")}
    for folder in folders.values():
        folder.mkdir()
        (folder / "model.safetensors").write_bytes(b"x" * 10)
    sizes = {"code": 900, "general": 100}

    def loader(name):
        return LoadedModel(torch.nn.Linear(1, 1), ModelSpec(str(folders[name])), sizes[name], 64, 512)

    cache = DraftCacheManager(1, loader, budget_bytes=1000)
    cache.request("code")
    cache.drain()
    cache.request("general")  # K = 1: code is evicted, its 900 B remembered
    cache.drain()
    cache.reconfigure(budget_bytes=500)
    (folders["code"] / "model.safetensors").write_bytes(b"y" * 20)  # a smaller draft's files, in place
    sizes["code"] = 100
    assert cache.evict_changed() == []  # nothing resident changed
    cache.request("code")
    cache.drain()
    assert cache.resident() == ["code"] and not cache.failed()
    cache.close()


def test_the_load_of_a_draft_removed_while_it_runs_is_not_a_load_failure():
    """The registry loader looks the name up on the loader thread: a draft removed while its load waited failed
    there, and was counted and logged as a load failure (a WARNING for a deliberate removal)."""
    gate, started, names = threading.Event(), threading.Event(), {"a", "b"}

    def load(name: str) -> LoadedModel:
        if name == "b":
            started.set()
            gate.wait(GATE_SECONDS)
        if name not in names:
            raise KeyError(f"unknown draft {name!r}")
        return fake_loader()(name)

    cache = DraftCacheManager(2, load)
    cache.update(["b", "a"])
    assert started.wait(GATE_SECONDS)  # b's load runs (a queued one would be cancelled, never reaching the loader)
    names.discard("b")
    cache.remove("b")
    gate.set()
    cache.drain()
    snap = cache.snapshot()
    assert snap.load_failures == 0 and not snap.failed and snap.resident == ["a"]
    cache.close()


class Monitor:
    """White-box invariant monitor for concurrent use (the cache calls on_change under its lock).

    At every state change:
    - the drafts that can become resident (resident, and loads in flight not marked for dropping) fit K
      and the byte budget now in force;
    - a load just started fit together with everything still in memory, loads being dropped included;
    - every load on the loader thread still holds its reservation (it is in the cache's table), and no
      two loads of one draft are in flight at once.
    """

    def __init__(self, cache: DraftCacheManager) -> None:
        self.cache = cache
        self.violations: list[str] = []
        self.changes = 0
        self.running: dict[int, object] = {}  # id -> slot whose load runs on the loader thread now
        # loads whose outcome was settled under the lock (published, dropped or failed) before the loader wrapper
        # below returned: another thread may evict a published draft in that window, which leaves its slot with no
        # model, its future not done yet and out of the table, as a lost reservation would look (the cause of two
        # failures seen on loaded machines: a 5 ms pause after the load made it fail every run)
        self.settled: set[int] = set()
        self._seen: set[int] = set()
        load = cache._load
        for settle in ("_publish", "_drop", "_loader_failed"):  # each called under the lock, with the slot first
            setattr(cache, settle, self._settling(getattr(cache, settle)))

        def tracked(slot):  # cache._load, wrapped: submitted as self._load by the cache
            with cache._lock:
                self.running[id(slot)] = slot
            try:
                load(slot)
            finally:
                with cache._lock:
                    self.running.pop(id(slot), None)
                    self.settled.discard(id(slot))

        cache._load = tracked
        cache.on_change = self

    def _settling(self, settle):
        def settling(slot, *args, **kwargs):
            self.settled.add(id(slot))
            return settle(slot, *args, **kwargs)
        return settling

    def __call__(self, snap: CacheStats) -> None:
        c = self.cache
        self.changes += 1
        slots = list(c._slots.values())
        live = [s for s in slots if s.error is None and not s.discard]
        held = [s for s in slots if s.error is None] + list(c._detached)  # loads being dropped are still in memory
        slots += list(c._detached)
        if len(live) > c.capacity:
            self.violations.append(f"{len(live)} drafts live, K={c.capacity}: {snap}")
        if c.budget_bytes and sum(s.reserved_bytes for s in live) > c.budget_bytes:
            self.violations.append(f"live bytes over the budget {c.budget_bytes}: {snap}")
        new = [s for s in held if id(s) not in self._seen and s.model is None]
        self._seen.update(id(s) for s in slots)
        if new:
            if len(held) > c.capacity or (c.budget_bytes and sum(s.reserved_bytes for s in held) > c.budget_bytes):
                self.violations.append(f"load of {[s.name for s in new]} started beyond the limits: {snap}")
        # in flight: on the loader thread and not settled yet (published, dropped or failed)
        flying = [s for s in self.running.values()
                  if id(s) not in self.settled and s.future is not None and s.model is None and s.error is None]
        for slot in flying:
            if c._slots.get(slot.name) is not slot and not any(d is slot for d in c._detached):
                self.violations.append(f"load of {slot.name!r} in flight without its reservation: {snap}")
        # one load of a draft that can land: another may be in flight only to be dropped (removed or failed meanwhile)
        names = [s.name for s in flying if c._slots.get(s.name) is s]
        if len(names) != len(set(names)):
            self.violations.append(f"two loads of one draft in flight: {names}")


@pytest.mark.parametrize("seed", range(3))
def test_concurrent_reconfigure_remove_and_reset_while_loads_are_in_flight(seed):
    """A decode thread runs the controller's cache calls (update, get, set_active, wait_for) while another
    thread changes K and the budget, removes drafts (a registry change) and resets the cache, with loads
    of random duration in flight. The monitor checks the invariants at every change; afterwards nothing
    is stuck loading and every draft can still be made resident (none lost)."""
    rng, ros_rng = random.Random(seed), random.Random(seed + 100)
    cache = DraftCacheManager(3, fake_loader(0.008, jitter=random.Random(seed + 200)), budget_bytes=700,
                              size_of=SIZES.get)
    monitor = Monitor(cache)
    stop = threading.Event()
    errors: list[str] = []

    def decoder():
        active = ""
        try:
            while not stop.is_set():
                cache.update([(n, rng.random()) for n in NAMES], active=active or None)
                resident = cache.resident()
                active = rng.choice(resident) if resident else ""
                if active and cache.get(active) is not None:
                    cache.set_active(active)
                if rng.random() < 0.1:
                    try:
                        cache.wait_for(rng.choice(NAMES), timeout=5)
                    except DraftLoadError:
                        pass  # removed meanwhile, or no room beside the loads in flight: decoding goes on
                time.sleep(0.001)
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append(f"decode thread: {exc!r}")

    during_loads: dict[str, int] = {"remove": 0, "reconfigure": 0, "reset": 0}  # calls made with a load in flight

    def ros():
        try:
            while not stop.is_set():
                roll = ros_rng.random()
                action = "remove" if roll < 0.45 else "reconfigure" if roll < 0.9 else "reset"
                busy = bool(cache.loading())
                if action == "remove":
                    cache.remove(ros_rng.choice(NAMES))
                elif action == "reconfigure":
                    cache.reconfigure(capacity=ros_rng.randint(1, 4), budget_bytes=ros_rng.choice([0, 400, 700, 1000]))
                else:
                    cache.reset()
                during_loads[action] += busy
                time.sleep(ros_rng.uniform(0, 0.004))
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append(f"parameter thread: {exc!r}")

    threads = [threading.Thread(target=decoder), threading.Thread(target=ros)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 60.0  # until every call has met a load in flight (1 s sufficed on one machine)
    time.sleep(1.0)
    while not all(during_loads.values()) and time.monotonic() < deadline:
        time.sleep(0.05)
    stop.set()
    for t in threads:
        t.join(10)
    assert not any(t.is_alive() for t in threads), "a thread hung"
    cache.drain()
    assert errors == []
    assert all(during_loads.values()), f"each call must have met a load in flight: {during_loads}"
    assert monitor.violations == [], monitor.violations[:3]
    assert cache.loading() == [], "a load is stuck in flight"
    # none lost: with room for all, every draft becomes resident, each exactly once
    cache.reconfigure(capacity=len(NAMES), budget_bytes=0)
    assert cache.update(NAMES) == NAMES
    cache.drain()
    assert sorted(cache.resident()) == sorted(NAMES) and cache.failed() == {}
    snap = cache.snapshot()
    assert snap.bytes_resident == sum(SIZES.values())
    cache.close()


def test_a_draft_removed_and_wanted_again_while_its_load_runs_is_not_lost():
    """remove() while the draft loads drops that load; a registry that adds the draft back before the load ends
    gets it loaded anew (its entry may name other files now): update() keeps it in W and it becomes resident, and
    a blocking wait_for() returns it. The dropped load counts toward K until it ends."""
    gate, started = threading.Event(), threading.Event()
    cache = DraftCacheManager(2, gated_loader(gate, started=started), size_of=SIZES.get)
    cache.update(["math"])
    assert started.wait(GATE_SECONDS)
    cache.remove("math")
    assert cache.update(["math", "code"]) == ["math", "code"]
    assert cache.loading() == ["math"]  # anew; code waits for the dropped load's room
    gate.set()
    cache.drain()
    cache.update(["math", "code"])
    cache.drain()
    assert sorted(cache.resident()) == ["code", "math"]
    gate.clear()
    started.clear()
    cache.update(["law", "code"])  # evicts math, starts law
    assert started.wait(GATE_SECONDS)
    cache.remove("law")
    waiter = threading.Thread(target=lambda: gate.set() if not time.sleep(0.05) else None)
    waiter.start()
    model, _ = cache.wait_for("law", timeout=5)
    waiter.join()
    assert model.spec.path == "law" and cache.is_resident("law")
    cache.close()


def test_a_replaced_entry_never_gets_the_old_files_model():
    """The registry replaced a draft's entry (other files, same name) while the old entry's load was in flight:
    remove() only marked that load for dropping, the next update() took the mark back, and the old files' model
    became resident under the new entry."""
    gate, started = threading.Event(), threading.Event()
    paths = {"a": "/drafts/old_a"}

    def gated(name):
        path = paths[name]  # what the registry names when the load starts
        if path.endswith("old_a"):
            started.set()
            gate.wait(GATE_SECONDS)
        return LoadedModel(torch.nn.Linear(1, 1), ModelSpec(path), 100, 64, 512)

    cache = DraftCacheManager(2, gated, size_of=lambda name: 100)
    cache.update(["a"])
    assert started.wait(GATE_SECONDS)
    cache.remove("a")
    paths["a"] = "/drafts/new_a"
    cache.update(["a"])
    gate.set()
    cache.drain()
    assert cache.get("a").spec.path == "/drafts/new_a"
    cache.close()


def test_a_draft_that_fails_in_use_while_it_reloads_stays_failed():
    """fail() during a reload of the same draft: the failure was not recorded (the reload held the name), so the
    next update() kept the reload and the draft that had just failed became resident with no back-off."""
    gate, started = threading.Event(), threading.Event()
    cache = DraftCacheManager(2, gated_loader(gate, started=started), size_of=SIZES.get)
    cache.update(["math"])
    assert started.wait(GATE_SECONDS)
    cache.fail("math", RuntimeError("logits not finite"))
    assert "math" in cache.failed()
    cache.update(["math", "code"])
    gate.set()
    cache.drain()
    assert "math" not in cache.resident() and "math" in cache.failed()
    cache.close()


def test_a_name_ranked_twice_is_one_draft_and_a_nan_score_is_refused():
    """update(["a", "a", "b"]) with K=2 put "a" in W twice: a slot wasted, "b" never loaded."""
    cache = DraftCacheManager(2, fake_loader(), size_of=SIZES.get)
    assert cache.update(["math", "math", "code"]) == ["math", "code"]
    assert normalise_ranking([("math", 0.2), ("math", 0.9), ("code", 0.5)]) == [("math", 0.9), ("code", 0.5)]
    with pytest.raises(ValueError, match="score of 'code' is NaN"):
        cache.update({"code": float("nan")}, active="math")
    assert cache.snapshot().active != "math"  # refused, and nothing changed (the active draft was set first)
    cache.close()


def test_a_loader_that_hands_back_no_model_fails_the_draft_instead_of_holding_its_slot():
    """The loaded model's files were read after the loader's try: a loader returning None (a custom one) raised
    there, and the slot stayed "loading" for good, its room taken (K = 1: no other draft could ever load) and
    reset() unable to clear it."""
    cache = DraftCacheManager(1, lambda name: None if name == "bad" else fake_loader()(name))
    cache.update(["bad"])
    cache.drain()
    assert cache.loading() == [] and "bad" in cache.failed()
    assert cache.request("code") is True
    cache.drain()
    assert cache.resident() == ["code"]
    cache.close()


def test_a_smaller_k_counts_loads_being_dropped_once():
    """A load marked for dropping (its draft removed) still occupies memory until it ends, so no new load
    starts beside it beyond K; but it is going, so lowering K does not also evict a resident draft for it."""
    gate, started = threading.Event(), threading.Event()

    def gated(name):
        if name == "law":
            started.set()
            gate.wait(GATE_SECONDS)
        return fake_loader()(name)

    cache = DraftCacheManager(3, gated, size_of=SIZES.get)
    cache.update(["general", "code"])
    cache.drain()
    cache.set_active("general")
    cache.update({"general": 3, "code": 2, "law": 1}, active="general")
    assert started.wait(GATE_SECONDS)  # law in flight (a load still queued is cancelled instead)
    cache.remove("law")  # marked for dropping, its slot still taken
    cache.reconfigure(capacity=2)
    assert sorted(cache.resident()) == ["code", "general"]  # live drafts: 2 <= K, nothing evicted
    cache.update({"general": 3, "math": 2}, active="general")
    assert "math" not in cache.loading()  # 3 slots in memory (law still loading): no room for a new load
    gate.set()
    cache.drain()
    assert "law" not in cache.resident()
    cache.update({"general": 3, "math": 2}, active="general")
    cache.drain()
    assert sorted(cache.resident()) == ["general", "math"]
    cache.close()


def test_reset_while_another_thread_starts_a_load_keeps_its_reservation():
    """reset() waits for the loads it sees; a load started meanwhile by another thread must stay
    accounted (reserved) until it ends, never vanish from the table while it still runs."""
    gates = {name: threading.Event() for name in NAMES}

    def gated(name):
        gates[name].wait(GATE_SECONDS)
        return fake_loader()(name)

    cache = DraftCacheManager(2, gated, budget_bytes=500, size_of=SIZES.get)
    monitor = Monitor(cache)
    cache.update(["general"])  # 300 B, in flight
    resetter = threading.Thread(target=cache.reset)
    listed = threading.Event()  # reset() has listed the loads it waits for (general): law starts after that
    in_flight = cache._in_flight

    def watched():
        found = in_flight()
        if threading.current_thread() is resetter:
            listed.set()
        return found

    cache._in_flight = watched
    resetter.start()
    assert listed.wait(GATE_SECONDS)  # (a fixed pause lined the threads up on this machine's timing only)
    cache.update({"general": 2, "law": 1})  # law (100 B) starts while reset waits
    gates["general"].set()
    resetter.join(5)
    assert not resetter.is_alive()
    # law is still loading: its 100 B stay reserved, so medical (400 B) cannot start beside it
    cache.update(["medical"])
    assert cache.snapshot().bytes_reserved <= 500
    gates["law"].set()
    gates["medical"].set()
    cache.drain()
    cache.update(["medical"])
    cache.drain()
    assert monitor.violations == [], monitor.violations
    assert "medical" in cache.resident() and cache.snapshot().bytes_reserved <= 500
    cache.close()


def test_normalise_ranking_forms():
    assert [n for n, _ in normalise_ranking(["x", "y"])] == ["x", "y"]
    assert [n for n, _ in normalise_ranking({"x": 0.1, "y": 0.9})] == ["y", "x"]
    assert [n for n, _ in normalise_ranking([("x", 1.0), ("y", 2.0)])] == ["y", "x"]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the pinned-memory side-stream path needs CUDA")
def test_pinned_side_stream_copy_to_cuda():
    from memspec_ros.runtime.cache import to_device_via_pinned

    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.LayerNorm(8))
    x = torch.randn(2, 8)
    expected = model(x)
    moved = to_device_via_pinned(model, torch.device("cuda"))
    assert all(p.device.type == "cuda" for p in moved.parameters())
    assert torch.allclose(moved(x.cuda()).cpu(), expected, atol=1e-5)


def test_a_moved_draft_keeps_its_tied_weights_one_tensor():
    """to_device_via_pinned built a Parameter per module: the tied input and output embeddings (the bundled drafts
    tie them) became two copies on the GPU, half again the draft's memory beyond what the budget counted. The move
    (move_tensors, shared with the CUDA path) copies each tensor once."""
    from memspec_ros.runtime.cache import move_tensors
    from memspec_ros.runtime.models import parameter_bytes
    from memspec_ros.testing.tiny_models import tiny_llama

    model = tiny_llama(hidden=32, layers=1, seed=0)
    model.lm_head.weight = model.model.embed_tokens.weight  # tied, as the bundled drafts are
    before, ids = parameter_bytes(model), torch.tensor([[1, 5, 9, 2]])
    with torch.inference_mode():
        expected = model(ids).logits
    copies = []
    moved = move_tensors(model, lambda t: copies.append(t) or t.clone())
    assert moved.lm_head.weight is moved.model.embed_tokens.weight
    assert len(copies) == len({id(t) for t in copies}) == len(list(model.parameters())) + len(list(model.buffers()))
    assert parameter_bytes(moved) == before and not moved.lm_head.weight.requires_grad
    with torch.inference_mode():
        assert torch.equal(moved(ids).logits, expected)


def test_pinned_copy_is_a_plain_move_on_cpu():
    from memspec_ros.runtime.cache import to_device_via_pinned

    model = torch.nn.Linear(2, 2)
    assert to_device_via_pinned(model, torch.device("cpu")) is model


@pytest.fixture(autouse=True)
def _one_thread(one_thread):
    """Every test of this module on one thread (conftest.one_thread)."""


def test_a_closed_cache_reserves_nothing():
    """After close() (the controller's, at cleanup) a late ranking or request starts no load: its pool is gone, and
    a slot reserved for it stayed "loading" with its bytes reserved for good."""
    cache = DraftCacheManager(2, fake_loader(), budget_bytes=1000, size_of=SIZES.get)
    cache.update(["code"])
    cache.drain()
    cache.close()
    cache.update(["math", "law"])
    snap = cache.snapshot()
    assert snap.loading == [] and snap.resident == [] and snap.bytes_reserved == 0  # its drafts let go, too


def test_a_load_marked_to_be_dropped_is_not_available_so_a_choice_requests_it_again():
    """K shrank while a draft was loading, so that load is dropped when it lands; a MAB-Async choice of that draft
    at the same point saw it 'available', skipped the request that keeps it, and the load was thrown away (one
    load wasted and the switch delayed to a later point)."""
    from memspec_ros.runtime.choice import CACHE_REQUEST, Choice, carry_out

    gate, started = threading.Event(), threading.Event()

    def loader(name):
        if name == "c":
            started.set()
            gate.wait(10)
        return LoadedModel(object(), ModelSpec(name), 0, 0, 0)

    cache = DraftCacheManager(3, loader)
    cache.request("a")
    cache.request("b")
    cache.drain()
    cache.set_scores({"a": 3, "b": 2, "c": 1})
    cache.set_active("a")
    cache.request("c", active="a")
    assert started.wait(GATE_SECONDS)  # in flight (a queued load is cancelled by the reconfigure instead)
    cache.reconfigure(capacity=2)  # c no longer fits: marked to be dropped when it lands
    assert not cache.is_available("c")
    choice = Choice("c", block=False, fallback=("a",), cache_action=CACHE_REQUEST,
                    ranking=[("c", 9.0), ("a", 3.0), ("b", 1.0)])
    carry_out(choice, cache, wait=lambda name: 0.0, current="a")
    gate.set()
    cache.drain()
    assert "c" in cache.resident() and cache.snapshot().loads == 3
    cache.close()


def test_a_load_whose_files_change_as_it_lands_is_dropped(monkeypatch):
    """evict_changed() between the loader's staleness test (read outside the lock) and its publishing: the slot was
    not resident yet, so evict_changed skipped it, and the loader then published a model of the old files. The
    test is made under the lock now. The interleaving is forced: the loader's lock runs evict_changed first."""
    from memspec_ros.runtime import cache as cache_module

    version = {"n": 0}
    monkeypatch.setattr(cache_module, "weights_identity", lambda path: (path, version["n"]))
    cache = DraftCacheManager(2, fake_loader(), size_of=SIZES.get)
    real_lock = cache._lock

    class Hooked:  # the loader thread, about to publish, lets an operator change the files and evict_changed run
        armed = True

        def __enter__(self):
            if threading.current_thread().name.startswith("memspec-draft-loader") and Hooked.armed:
                Hooked.armed = False
                version["n"] += 1
                other = threading.Thread(target=cache.evict_changed)
                other.start()
                other.join()
            return real_lock.__enter__()

        def __exit__(self, *exc):
            return real_lock.__exit__(*exc)

    cache._lock = Hooked()
    cache.update(["math"])
    cache.drain()
    assert not Hooked.armed and "math" not in cache.resident()
    cache._lock = real_lock
    cache.close()


def test_a_marked_load_stats_its_files_outside_the_cache_lock_and_is_still_dropped_when_they_changed(monkeypatch):
    """A load in flight when evict_changed ran stats its files as it lands. That ran under the cache's lock, where
    the decode thread's next get/resident waited for it on failing storage (evict_changed keeps its own stats out of
    the lock for that reason). It runs before the lock now, and the load is still dropped: its files changed."""
    from memspec_ros.runtime import cache as cache_module

    version, under_lock = {"n": 0}, []
    gate, started = threading.Event(), threading.Event()

    def load(name):  # as registry_loader: the files' identity taken before the read
        files = (name, version["n"])
        started.set()
        gate.wait(GATE_SECONDS)
        return dataclasses.replace(fake_loader()(name), files=files)

    cache = DraftCacheManager(2, load, size_of=SIZES.get)

    def identity(path):
        if threading.current_thread().name.startswith("memspec-draft-loader"):
            under_lock.append(cache._lock._is_owned())
        return (path, version["n"])

    monkeypatch.setattr(cache_module, "weights_identity", identity)
    cache.update(["math"])
    assert started.wait(GATE_SECONDS)
    version["n"] += 1  # the operator replaces the files while the load reads them
    assert cache.evict_changed() == []  # nothing resident: the load in flight is marked
    gate.set()
    cache.drain()
    assert "math" not in cache.resident() and cache.snapshot().dropped_loads == 1
    assert under_lock and not any(under_lock)
    cache.close()


def test_a_queued_load_of_a_draft_removed_from_the_registry_is_dropped_not_failed():
    """The controller syncs the registry at scheduling points only: a prefetch queued before its draft was removed
    started after, the registry lookup raised, and the cache counted a load failure (a warning, a 30 s back-off)
    for what was a removal. It is a dropped load, and a wait for it says the draft was removed."""
    from memspec_ros.runtime.registry import UnknownDraftError

    registered = {"code", "math"}

    def load(name):
        if name not in registered:
            raise UnknownDraftError(f"no draft named {name!r} is registered")
        return fake_loader()(name)

    cache = DraftCacheManager(2, load, size_of=SIZES.get)
    registered.discard("math")
    cache.update(["math"])
    cache.drain()
    snap = cache.snapshot()
    assert snap.load_failures == 0 and not snap.failed and snap.dropped_loads == 1 and "math" not in snap.resident
    with pytest.raises(DraftLoadError, match="was removed"):
        cache.wait_for("math", timeout=GATE_SECONDS)
    assert cache.snapshot().load_failures == 0
    cache.close()


def test_a_load_that_fails_after_the_budget_shrank_under_it_is_a_dropped_load_not_a_failure(caplog):
    """A load marked unwanted (K or the budget shrank while it read) that then failed was counted in load_failures
    and logged as "retried after 30 s", while its slot was deleted, so no back-off was kept and it never showed in
    failed(). It is counted as the dropped load it is."""
    gate, started = threading.Event(), threading.Event()

    def load(name):
        started.set()
        gate.wait(GATE_SECONDS)
        raise OSError(f"disk error reading {name}")

    cache = DraftCacheManager(1, load, size_of=SIZES.get)
    cache.update(["math"])
    assert started.wait(GATE_SECONDS)
    cache.reconfigure(budget_bytes=SIZES["math"] - 1)  # the budget shrinks under it: the load is unwanted now
    with caplog.at_level("WARNING", logger="memspec_ros.runtime.cache"):
        gate.set()
        cache.drain()
    snap = cache.snapshot()
    assert snap.load_failures == 0 and not snap.failed and snap.dropped_loads == 1
    assert "retried after" not in caplog.text
    cache.close()


def test_a_closed_cache_lets_its_resident_drafts_go():
    """close() stopped the loads but kept the resident drafts referenced until the cache itself was collected: a
    standalone runtime's controller.close() did not free the drafts' memory."""
    import gc
    import weakref

    cache = DraftCacheManager(2, fake_loader(), size_of=SIZES.get)
    cache.update(["code", "math"])
    cache.drain()
    models = [weakref.ref(cache.get(name).model) for name in ("code", "math")]
    assert all(m() is not None for m in models)
    assert cache.close()
    gc.collect()
    assert cache.resident() == [] and all(m() is None for m in models)


def test_load_seconds_sum_the_loads_that_became_resident():
    """A load dropped in flight added its time to load_seconds but not to loads: load_seconds / loads, the mean
    load time, came out high."""
    gate, started = threading.Event(), threading.Event()
    cache = DraftCacheManager(2, gated_loader(gate, 0.05, started), size_of=SIZES.get)
    cache.update(["math"])
    assert started.wait(GATE_SECONDS)  # dropped in flight, not cancelled while queued
    cache.remove("math")
    gate.set()
    cache.drain()
    snap = cache.snapshot()
    assert snap.loads == 0 and snap.load_seconds == 0.0
    cache.update(["code"])
    cache.drain()
    snap = cache.snapshot()
    assert snap.loads == 1 and snap.load_seconds >= 0.05
    cache.close()


def test_a_size_that_cannot_be_read_fails_the_draft_and_k_must_be_a_count():
    """size_of ran unguarded on the decode thread: its exception ended the goal instead of failing the draft;
    reconfigure(capacity=True) was taken as K = 1."""
    cache = DraftCacheManager(2, fake_loader(), size_of=lambda name: 1 // 0 if name == "law" else SIZES[name])
    cache.update(["law", "code"])
    cache.drain()
    assert "law" in cache.failed() and "size could not be read" in str(cache.failed()["law"])
    assert cache.resident() == ["code"]
    with pytest.raises(ValueError, match="integer >= 1"):
        cache.reconfigure(capacity=True)
    cache.close()


def test_a_blocking_wait_names_why_the_load_was_refused():
    """wait_for said "has no draft it may evict" whatever refused the load: a draft larger than the byte budget,
    a size that could not be read, or a closed cache; the first two are recorded on the draft and now raised."""
    cache = DraftCacheManager(2, fake_loader(sizes={"big": 1000}), budget_bytes=100, size_of=lambda name: 1000)
    with pytest.raises(DraftLoadError, match=r"occupies 1000 B in memory, .* the whole 100 B budget"):
        cache.wait_for("big")
    cache.reconfigure(budget_bytes=200)  # tried again: refused on its measured size, before any load
    with pytest.raises(DraftLoadError, match=r"needs 1000 B but the draft memory budget is 200 B"):
        cache.wait_for("big")
    cache.close()

    def unreadable(name):
        raise OSError("no such file")

    cache = DraftCacheManager(2, fake_loader(), size_of=unreadable)
    with pytest.raises(DraftLoadError, match="its size could not be read"):
        cache.wait_for("a")
    cache.close()
    closed = DraftCacheManager(2, fake_loader(), size_of=SIZES.get)
    closed.close()
    with pytest.raises(DraftLoadError, match="the draft cache is closed"):
        closed.wait_for("a")


def test_a_load_that_cannot_get_room_evicts_nothing():
    """Making room evicted the lowest-scored drafts one by one and gave up only when none was left to evict: a
    request that could never fit (the budget held by the active draft, or by a load in flight) still cost every
    other resident draft, and then loaded nothing. Now it is planned first: all the evictions it needs, or none."""
    sizes = {"r": 60, "a": 20, "b": 15, "x": 50, "y": 10}
    cache = DraftCacheManager(4, fake_loader(sizes=sizes), budget_bytes=100, size_of=sizes.get)
    cache.update({"r": 0.9, "a": 0.5, "b": 0.4})
    cache.drain()
    assert sorted(cache.resident()) == ["a", "b", "r"]
    assert cache.request("x", active="r") is False  # 60 held by the active draft: 50 more never fits
    assert sorted(cache.resident()) == ["a", "b", "r"] and cache.snapshot().evictions == 0  # both went before
    assert cache.request("y", active="r") is True  # one that fits once the lowest-scored draft goes: that one only
    cache.drain()
    assert sorted(cache.resident()) == ["a", "r", "y"] and cache.snapshot().evictions == 1
    cache.close()


def test_a_load_that_read_a_path_its_name_no_longer_has_is_dropped_as_it_lands():
    """A path changed and changed back while the draft's load ran (both edits before the next sync): the sync saw
    an unchanged entry and nothing resident, and the load landed with the in-between path's weights under the
    name. The cache asks, as a load lands, whether the path it read is still the name's."""
    gate, started = threading.Event(), threading.Event()
    entry = {"code": "/drafts/code-b"}  # what the loader reads now: the in-between path

    def load(name):
        read = entry[name]
        started.set()
        gate.wait(GATE_SECONDS)
        loaded = fake_loader()(name)
        loaded.source = read
        return loaded

    cache = DraftCacheManager(2, load)
    registered = {"code": "/drafts/code-b"}
    cache.source_current = lambda name, source: registered[name] == source
    cache.update(["code"])
    assert started.wait(GATE_SECONDS)
    registered["code"] = "/drafts/code-a"  # changed back while the load ran
    gate.set()
    cache.drain()
    assert cache.resident() == [] and cache.loading() == [] and "code" not in cache.failed()
    entry["code"] = "/drafts/code-a"  # wanted again: read from the path the name has, and kept
    cache.update(["code"])
    cache.drain()
    assert cache.resident() == ["code"]
    cache.close()


def test_a_blocking_wait_waits_for_the_loads_in_flight_that_hold_the_room():
    """K=1 and a prefetch of 'code' still reading (a goal's wait for it was given up): a blocking wait for 'math' was
    refused at once ("has no draft it may evict"), the goal decoded without its draft, and then ran on 'code'. It now
    waits for the load in flight to land (evictable then), and loads 'math'."""
    gate, started = threading.Event(), threading.Event()
    cache = DraftCacheManager(1, gated_loader(gate, started=started), size_of=SIZES.get)
    assert cache.request("code")
    assert started.wait(GATE_SECONDS)
    # the gate opens from inside the wait (its stop poll): a timer started before it could land the load first
    model, waited = cache.wait_for("math", timeout=10, stop=lambda: gate.set() or False)
    assert model.spec.path == "math" and waited > 0 and cache.resident() == ["math"]
    cache.close()


def test_a_blocking_wait_behind_a_load_in_flight_is_given_up_with_the_reason():
    gate, started = threading.Event(), threading.Event()
    cache = DraftCacheManager(1, gated_loader(gate, started=started), size_of=SIZES.get)
    assert cache.request("code")
    assert started.wait(GATE_SECONDS)
    with pytest.raises(DraftLoadError, match=r"held by loads in flight \(code\), and the wait was given up"):
        cache.wait_for("math", stop=lambda: True)
    with pytest.raises(DraftLoadError, match=r"held by loads in flight \(code\), and the wait timed out"):
        cache.wait_for("math", timeout=0.05)
    gate.set()
    cache.close()


def test_reset_and_close_do_not_wait_unbounded_for_a_hung_read():
    """A read hung on failing storage: reset() waited for it with no limit (a goal's start, the node's cleanup).
    Its wait now ends on stop() or a timeout; the load is marked for dropping and, when it lands, dropped and
    counted (dropped_loads); close() waits a bounded time and leaves it to its thread. drain(timeout) says False."""
    gate, started = threading.Event(), threading.Event()
    cache = DraftCacheManager(2, gated_loader(gate, started=started), size_of=SIZES.get)
    cache.update(["code"])
    assert started.wait(GATE_SECONDS)
    assert cache.drain(timeout=0.05) is False
    assert cache.reset(stop=lambda: True) is False
    assert cache.reset(timeout=0.05) is False
    assert cache.close(timeout=0.05) is False
    gate.set()
    wait_until(lambda: cache.snapshot().dropped_loads == 1, what="the hung load to land and be dropped")
    snap = cache.snapshot()
    assert snap.resident == [] and snap.loading == [] and snap.loads == 0 and snap.bytes_reserved == 0
    assert cache.drain(timeout=5) is True


def test_a_load_that_fails_as_it_is_published_frees_its_room():
    """The publish step of a load (under the lock, after the read) raised: the slot stayed "loading" with its
    future done, holding one of the K places and its bytes for the life of the process."""

    def load(name):
        loaded = fake_loader()(name)
        if name == "code":
            loaded.size_bytes = "unreadable"  # int() of it raises as the load is published
        return loaded

    cache = DraftCacheManager(1, load, size_of=SIZES.get)
    cache.update(["code"])
    cache.drain()
    snap = cache.snapshot()
    assert "code" in snap.failed and snap.loading == [] and snap.load_failures == 1
    model, _ = cache.wait_for("math", timeout=10)  # the one place is free
    assert cache.resident() == ["math"]
    cache.close()


def test_a_draft_failed_in_use_is_no_load_failure():
    cache = DraftCacheManager(2, fake_loader(), size_of=SIZES.get)
    cache.update(["code"])
    cache.drain()
    cache.fail("code", RuntimeError("logits not finite"))
    snap = cache.snapshot()
    assert (snap.use_failures, snap.load_failures) == (1, 0) and "code" in snap.failed
    cache.close()


def test_a_change_callback_that_raises_as_a_load_lands_does_not_fail_the_load(caplog):
    """The load's outcome was settled when the callback ran: its exception was taken for the load's failure, which
    counted the load twice (loaded and failed) and failed the draft for the callback's error."""
    def on_change(snap):
        if snap.resident:
            raise RuntimeError("a subscriber broke")

    cache = DraftCacheManager(2, fake_loader(), size_of=SIZES.get, on_change=on_change)
    cache.update(["code"])
    cache.drain()
    snap = cache.snapshot()
    assert snap.resident == ["code"] and snap.loads == 1 and snap.load_failures == 0 and not snap.failed
    assert "a subscriber broke" in caplog.text
    cache.close()


def test_a_smaller_k_weighs_loads_in_flight_against_resident_drafts_by_score():
    """reconfigure dropped every load in flight before it evicted any resident draft: the best-ranked draft being
    prefetched was lost while a worse resident one stayed (and kept its memory)."""
    gate, started = threading.Event(), threading.Event()
    cache = DraftCacheManager(3, held_on("math", gate, started, []), size_of=SIZES.get)
    try:
        cache.update({"general": 3, "code": 1})
        cache.drain()
        cache.set_active("general")
        cache.update({"math": 5, "general": 3, "code": 1}, active="general")
        assert started.wait(GATE_SECONDS)  # math in flight
        cache.reconfigure(capacity=2)
        assert cache.resident() == ["general"] and cache.loading() == ["math"]  # code (1) went, not math (5)
        gate.set()
        cache.drain()
        assert sorted(cache.resident()) == ["general", "math"]
        # the other way round: a load scored below every resident draft is the one dropped
        cache.reconfigure(capacity=3)
        gate.clear()
        started.clear()
        cache.loader = held_on("code", gate, started, [])
        cache.update({"math": 5, "general": 3, "code": 1}, active="general")
        assert started.wait(GATE_SECONDS)
        cache.reconfigure(capacity=2)
        assert sorted(cache.resident()) == ["general", "math"]  # code's load is marked for dropping
        gate.set()
        cache.drain()
        assert sorted(cache.resident()) == ["general", "math"] and cache.loading() == []
    finally:
        gate.set()
        cache.close()


def test_evict_changed_keeps_a_draft_loaded_again_from_the_new_files_meanwhile(tmp_path, monkeypatch):
    """evict_changed compares files outside its lock, then evicted by name: a draft evicted and loaded again from
    the new files in between was evicted too, a fresh model thrown away with its new measured size."""
    from memspec_ros.runtime import cache as cache_module

    folder = tmp_path / "code"
    folder.mkdir()
    (folder / "model.safetensors").write_bytes(b"x" * 10)
    loaded = []

    def loader(name):
        loaded.append(torch.nn.Linear(1, 1))
        return LoadedModel(loaded[-1], ModelSpec(str(folder)), 100, 64, 512)

    cache = DraftCacheManager(2, loader)
    cache.request("code")
    cache.drain()
    (folder / "model.safetensors").write_bytes(b"y" * 20)  # restored files
    identity, reloaded = cache_module.weights_identity, []

    def reload_between(path):  # another thread evicts and loads the draft again between the two locked sections
        if not reloaded:
            reloaded.append(True)
            cache.remove("code")
            cache.request("code")
            cache.drain()
        return identity(path)

    monkeypatch.setattr(cache_module, "weights_identity", reload_between)
    assert cache.evict_changed() == []  # the names evicted: none
    assert cache.resident() == ["code"] and cache.peek("code").model is loaded[-1] and len(loaded) == 2
    cache.close()


def test_an_on_evict_callback_that_raises_leaves_the_eviction_whole(caplog):
    """An exception in an on_evict callback escaped the eviction loop: a smaller K left drafts resident beyond it,
    and reset() left drafts resident and the working set as it was."""
    cache = DraftCacheManager(3, fake_loader(), size_of=SIZES.get)
    cache.update({"general": 3, "code": 2, "law": 1}, active="general")
    cache.drain()

    def broken(name):
        raise RuntimeError(f"observer failed on {name}")

    cache.on_evict.append(broken)
    cache.reconfigure(capacity=1)
    assert cache.resident() == ["general"]
    assert "observer failed on law" in caplog.text and "observer failed on code" in caplog.text
    cache.reconfigure(capacity=3)
    cache.update({"general": 3, "code": 2}, active="general")
    cache.drain()
    cache.reset()
    assert cache.resident() == [] and cache.snapshot().working_set == []
    cache.close()


def test_a_queued_prefetch_of_a_draft_that_left_the_working_set_never_runs():
    """update() only added W's drafts: a prefetch still queued behind the one loading, for a draft the new ranking
    dropped from W, ran in full on the one loader thread before the new top-K's loads, holding a slot."""
    gate, started, loaded = threading.Event(), threading.Event(), []
    load = held_on("general", gate, started, loaded)

    cache = DraftCacheManager(3, load, size_of=SIZES.get)
    try:
        cache.update({"general": 3, "code": 2, "math": 1})
        assert started.wait(GATE_SECONDS)  # general reading, code and math queued behind it
        cache.update({"general": 3, "law": 2, "medical": 1})
        gate.set()
        cache.drain()
        assert "code" not in loaded and "math" not in loaded
        assert sorted(cache.resident()) == ["general", "law", "medical"]
    finally:
        gate.set()
        cache.close()


def test_a_request_drops_an_earlier_request_still_queued_for_another_draft():
    """MAB-Async and Prediction-Only request one draft a point: an earlier request still queued when the policy
    asked for another ran in full on the one loader thread before it, holding a slot (update() already dropped
    such prefetches). A blocking wait's own request leaves them be (Oracle-Dynamic waits beside its prefetch)."""
    gate, started, loaded = threading.Event(), threading.Event(), []
    load = held_on("general", gate, started, loaded)

    cache = DraftCacheManager(3, load, size_of=SIZES.get)
    try:
        assert cache.request("general")
        assert started.wait(GATE_SECONDS)  # general reading
        assert cache.request("code")  # queued behind it
        assert cache.request("math")  # the policy changed its mind: code never runs
        gate.set()
        cache.drain()
        assert loaded == ["general", "math"] and sorted(cache.resident()) == ["general", "math"]
    finally:
        gate.set()
        cache.close()


def test_a_bf16_draft_bound_for_a_gpu_is_built_without_the_cpus_bf16_path():
    """Drafts are built on the CPU, then moved: a bf16 draft for a GPU took the CPU's bf16 path, whose instruction
    sets the host may lack (every draft load failed there, and goals ran on the target alone). It is built in fp32
    and cast as it moves (the move itself needs a GPU: not run here)."""
    from memspec_ros.runtime.cache import build_dtype

    assert build_dtype("bf16", "none", "cuda") == "fp32" and build_dtype("bf16", "none", "cuda:1") == "fp32"
    assert build_dtype("bf16", "none", "cpu") == "bf16"  # on the CPU: its own bf16 path, as before
    assert build_dtype("fp16", "none", "cuda") == "fp16" and build_dtype("fp32", "none", "cuda") == "fp32"
