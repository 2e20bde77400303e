"""The draft cache keeps |G| <= K and bytes <= budget at every instant, never evicts the active draft,
never blocks update(), and survives failing loads."""

from __future__ import annotations

import random
import threading
import time

import pytest
import torch

from memspec_ros.runtime.cache import DraftCacheManager, DraftLoadError, DraftTooLargeError, normalise_ranking
from memspec_ros.runtime.models import LoadedModel, ModelSpec
from memspec_ros.runtime.stats import CacheStats

NAMES = ["general", "code", "math", "law", "medical"]
SIZES = {"general": 300, "code": 200, "math": 200, "law": 100, "medical": 400}


def fake_loader(delay=0.0, fail=(), sizes=SIZES, jitter=None):
    def load(name: str) -> LoadedModel:
        time.sleep(delay if jitter is None else jitter.uniform(0, delay))
        if name in fail:
            raise OSError(f"disk error reading {name}")
        return LoadedModel(torch.nn.Linear(1, 1), ModelSpec(name), sizes.get(name, 0), 64, 512)

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
        gate.wait(5)
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


def test_failed_load_marks_draft_failed_and_is_skipped():
    cache = DraftCacheManager(2, fake_loader(fail={"math"}))
    cache.update(["math", "code"])
    cache.drain()
    assert cache.resident() == ["code"]
    assert "math" in cache.failed() and "disk error" in str(cache.failed()["math"])
    assert cache.snapshot().load_failures == 1
    # a later update skips the failed draft: W fills with the next viable ones
    assert cache.update(["math", "law", "code"]) == ["law", "code"]
    with pytest.raises(DraftLoadError, match="disk error"):
        cache.wait_for("math")
    cache.close()


def test_a_budget_change_retries_the_drafts_that_did_not_fit():
    cache = DraftCacheManager(2, fake_loader(), budget_bytes=100, size_of=SIZES.get)
    cache.update(["medical", "law"])
    cache.drain()
    assert cache.resident() == ["law"]
    error = cache.failed()["medical"]
    assert isinstance(error, DraftTooLargeError) and "memspec.budget_bytes" in str(error)  # the node's parameter
    assert cache.update(["medical", "law"]) == ["law"]  # skipped while the budget is the same
    cache.reconfigure(budget_bytes=500)
    assert cache.failed() == {} and cache.snapshot().failed == {}  # diagnostics see no stale failure
    cache.update(["medical", "law"])
    cache.drain()
    assert sorted(cache.resident()) == ["law", "medical"]
    cache.close()


def test_a_failed_draft_is_retried_after_the_back_off():
    """A load that failed (a damaged file) is tried again by a later update once retry_seconds have
    passed, not earlier, and the draft becomes resident once its cause is gone (the file restored)."""
    broken = {"math"}
    attempts = []

    def load(name: str) -> LoadedModel:
        attempts.append(name)
        if name in broken:
            raise OSError(f"damaged file for {name}")
        return LoadedModel(torch.nn.Linear(1, 1), ModelSpec(name), 0, 64, 512)

    cache = DraftCacheManager(2, load, retry_seconds=0.3)
    cache.update(["math", "code"])
    cache.drain()
    assert "math" in cache.failed() and attempts.count("math") == 1
    cache.update(["math", "code"])
    cache.drain()
    assert "math" in cache.failed() and attempts.count("math") == 1  # within the back-off: skipped
    broken.clear()  # the file is restored
    time.sleep(0.35)
    assert "math" not in cache.failed()  # the back-off is over: viable again for the policy
    cache.update(["math", "code"])
    cache.drain()
    assert attempts.count("math") == 2 and sorted(cache.resident()) == ["code", "math"]
    assert cache.snapshot().failed == {}
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
    assert isinstance(small.failed()["medical"], DraftTooLargeError)
    cache.close()
    small.close()


def test_a_load_larger_than_reserved_is_refused_when_it_breaks_the_budget():
    """The registry's size is only an estimate: the reservation is made from it before the load, and the
    cache checks the loaded draft's real size afterwards (the over-reservation branch)."""
    claimed = {"general": 300, "code": 100, "law": 100, "math": 60}
    real = {"general": 300, "code": 350, "law": 150, "math": 60}
    rec = Recorder()
    cache = DraftCacheManager(3, fake_loader(sizes=real), budget_bytes=500, size_of=claimed.get, on_change=rec)
    cache.update(["general", "code"])  # reserves 300 + 100 = 400 <= 500
    assert cache.snapshot().bytes_reserved == 400
    cache.drain()
    # code really occupies 350: 300 + 350 > 500, so it is refused, never resident, with the reason
    assert cache.resident() == ["general"]
    error = cache.failed()["code"]
    assert isinstance(error, DraftTooLargeError)
    assert "350 B" in str(error) and "size_bytes" in str(error) and "memspec.budget_bytes" in str(error)
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


def test_pinned_copy_is_a_plain_move_on_cpu():
    from memspec_ros.runtime.cache import to_device_via_pinned

    model = torch.nn.Linear(2, 2)
    assert to_device_via_pinned(model, torch.device("cpu")) is model


torch.set_num_threads(1)  # small models on a shared 2-core machine: threads only contend
