"""The shared controller loop: lossless under every policy, MemSpec never blocks, failures and
registry changes mid-generation, K = 1, reconfiguration and cancel."""

from __future__ import annotations

import re
import threading
import time
from collections import Counter
from itertools import product

import pytest
import torch
from ros_helpers import wait_until
from sampling_checks import chi2, chi2_critical

from memspec_ros.runtime.cache import DraftCacheManager
from memspec_ros.runtime.controller import RuntimeConfig, RuntimeController
from memspec_ros.runtime.models import LoadedModel, ModelSpec, parameter_bytes
from memspec_ros.runtime.oracle import GreedyOracle, target_greedy
from memspec_ros.runtime.policies import POLICIES, PolicyError
from memspec_ros.runtime.predictor import FixedRanker
from memspec_ros.runtime.registry import DraftEntry, DraftRegistry
from memspec_ros.runtime.speculative import SamplingConfig, warp_probs
from memspec_ros.testing.tiny_models import noisy_copy, tiny_llama, tiny_tokenizer

PROMPT = [1, 5, 7, 9, 11, 13]
NEW = 40


@pytest.fixture(scope="module")
def drafts(target):
    return {
        "general": tiny_llama(layers=1, hidden=32, seed=1),  # accepts ~nothing
        "code": noisy_copy(target, 0.03, seed=2),
        "math": noisy_copy(target, 0.01, seed=3),
        "law": noisy_copy(target, 0.02, seed=4),
    }


@pytest.fixture(scope="module")
def expected(target):
    return target_greedy(target, PROMPT, NEW)


@pytest.fixture(scope="module")
def oracle(target, drafts):
    return GreedyOracle.compute(target, drafts, PROMPT, NEW, gamma=4, interval=4)


class Loader:
    """Injected storage -> memory loader: optional delay, failures, and a count of calls."""

    def __init__(self, drafts, delay=0.0, fail=(), delays=None, sleep=time.sleep):
        self.drafts, self.delay, self.fail, self.calls = drafts, delay, set(fail), []
        self.delays = delays or {}  # per draft, instead of ``delay``
        self.sleep = sleep  # clock_jump: a slow read without a real wait

    def __call__(self, name):
        self.calls.append(name)
        self.sleep(self.delays.get(name, self.delay))
        if name in self.fail:
            raise OSError(f"simulated read error for {name}")
        model = self.drafts[name]
        return LoadedModel(model, ModelSpec(name), parameter_bytes(model), 64, 512)


def registry_of(drafts):
    return DraftRegistry([DraftEntry(n, f"/virtual/{n}", n, 1000) for n in drafts], validate=False)


def alternating(context):
    """A predictor stand-in whose favourite changes every interval (exercises prefetch/eviction)."""
    orders = [
        ["math", "law", "code", "general"],
        ["code", "math", "law", "general"],
        ["law", "code", "math", "general"],
    ]
    return orders[context.interval % 3]


def make(target, drafts, policy, oracle=None, loader=None, registry=None, ranker=alternating, **cfg):
    return RuntimeController(
        RuntimeConfig(policy=policy, **cfg), target, None, registry or registry_of(drafts), FixedRanker(ranker),
        loader=loader or Loader(drafts), oracle_for=(lambda p: oracle) if oracle else None, eos_token_ids=[],
    )


@pytest.mark.parametrize("capacity", [1, 2])
@pytest.mark.parametrize("policy", POLICIES)
def test_greedy_output_identical_to_target_under_every_policy(target, drafts, expected, oracle, policy, capacity):
    ctl = make(target, drafts, policy, oracle, capacity=capacity)
    result = ctl.generate(PROMPT, NEW)
    assert result.token_ids == expected
    assert result.finish_reason == "length"
    stats = result.stats
    assert stats.policy == policy and stats.cache is not None
    assert len(stats.cache.resident) <= capacity
    # with K = 1 a non-blocking policy cannot bring in a second draft while the active one decodes:
    # MAB-Async stays on its first arm ("general", which accepts nothing here)
    if policy != "general-static" and not (policy == "mab-async" and capacity == 1):
        assert stats.mean_accepted > 0
    if policy in BLOCKING:  # it switches by stalling, whatever the threads' timing: the output stays the target's
        assert stats.draft_switches > 0
    ctl.close()


def test_oracle_static_picks_the_best_draft_and_matches_its_trace(target, drafts, oracle):
    ctl = make(target, drafts, "oracle-static", oracle)
    stats = ctl.generate(PROMPT, NEW).stats
    best = oracle.best_static(list(drafts))
    assert stats.drafts_used == [best]
    # cross-check: the teacher-forced walk predicts the engine's acceptance exactly
    assert stats.mean_accepted == pytest.approx(oracle.static_utility(best))
    ctl.close()


def test_memspec_never_blocks_on_a_slow_load(target, drafts):
    loader = Loader(drafts, delay=0.25)
    ctl = make(target, drafts, "memspec", loader=loader, capacity=2, interval=1)
    stats = ctl.generate(PROMPT, NEW).stats
    assert stats.load_wait_seconds == 0.0
    assert all(it.load_wait_seconds == 0.0 for it in stats.iterations)
    assert stats.cache.wait_seconds <= stats.setup_seconds + 1e-6  # only the initial draft (Algorithm 3, line 3)
    assert any(it.fallback for it in stats.iterations), "decoding must go on with a fallback while loads run"
    ctl.close()


class StuckLoader:
    """The first load (the initial draft's) goes through; every later one hangs until ``release`` (or
    ``limit`` seconds, so that a controller that wrongly waits still ends the test). ``waits`` records
    each wait_for() the controller makes on a draft that is not resident, and the drafts resident then."""

    def __init__(self, drafts, limit=30.0):
        self.drafts, self.limit = drafts, limit
        self.release = threading.Event()
        self.done: list[str] = []
        self.waits: list[str] = []
        self.blocked = threading.Event()  # a wait_for on a non-resident draft happened after the first load

    def __call__(self, name):
        if self.done:
            self.release.wait(self.limit)
        self.done.append(name)
        return Loader(self.drafts)(name)

    def watch(self, cache):
        wait_for = cache.wait_for

        def watched(name, timeout=None, stop=None):
            if not cache.is_resident(name):
                self.waits.append(name)
                if self.done:
                    self.blocked.set()
            return wait_for(name, timeout, stop)

        cache.wait_for = watched


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("capacity", [1, 2])
def test_memspec_finishes_generations_while_every_prefetch_is_stuck(target, drafts, expected, capacity, overlap):
    """No clock: the loader hangs every load after the initial draft's until the test releases it, and two
    whole MemSpec generations still finish, lossless, on what is resident. The only blocking load is the
    initial draft's (Algorithm 3, line 3), and it was waited for once."""
    # the limit only ends a wrongly waiting controller's hang (load_wait_seconds and ``waits`` catch it); at 2 s the
    # two generations had to finish before the stuck prefetch landed, which a slow or busy machine need not do
    loader = StuckLoader(drafts)
    ctl = make(target, drafts, "memspec", loader=loader, capacity=capacity, interval=1, overlap_prediction=overlap)
    loader.watch(ctl.cache)
    try:
        for _ in range(2):
            result = ctl.generate(PROMPT, NEW)
            assert result.token_ids == expected
            assert result.stats.load_wait_seconds == 0.0
        assert not loader.release.is_set() and len(loader.done) == 1  # no prefetch finished meanwhile
        assert loader.waits == [loader.done[0]]  # the initial draft, once: never a wait after it
        if capacity == 2:
            assert ctl.cache.loading(), "a prefetch should be stuck in flight"
            assert any(it.fallback for it in result.stats.iterations)  # it decoded on, on a fallback
    finally:
        loader.release.set()
        ctl.close()


class GatedLoader(Loader):
    """Loads ``gated`` drafts only once ``gate`` is set (or after ``limit`` s, so a controller that wrongly
    waits still ends the test); records the drafts whose load finished, in order."""

    def __init__(self, drafts, gated, limit=30.0, size_bytes=None):
        super().__init__(drafts)
        self.gated, self.limit, self.gate, self.done = set(gated), limit, threading.Event(), []
        self.size_bytes = size_bytes  # what a load says it takes (None: the model's parameters)

    def __call__(self, name):
        if name in self.gated:
            self.gate.wait(self.limit)
        loaded = super().__call__(name)
        if self.size_bytes is not None:
            loaded.size_bytes = self.size_bytes
        self.done.append(name)
        return loaded


def by_prompt(context):
    """The second prompt's favourite is a draft the first one's generation did not keep resident."""
    return ["code", "math", "law", "general"] if context.prompt_ids == PROMPT_2 else ["math", "law", "general", "code"]


PROMPT_2 = [2, 4, 6, 8, 10]


@pytest.mark.parametrize("policy", ["memspec", "memspec-cost-aware"])
def test_a_goal_on_a_warm_cache_runs_a_resident_draft_while_its_choice_loads(target, drafts, policy):
    """The node keeps its cache between goals. A goal whose chosen draft is not resident does not wait for
    it: it decodes on the best resident draft, lossless, while the load is held back (a controller that
    waited would sit in it until the limit, and the load would be in ``done`` before the goal ended)."""
    loader = GatedLoader(drafts, gated={"code"})
    ctl = make(target, drafts, policy, loader=loader, capacity=2, interval=2, ranker=by_prompt)
    try:
        ctl.generate(PROMPT, 8)  # cold: waits for its first draft, leaves math (and law) resident
        assert "code" not in ctl.cache.resident() and ctl.cache.resident()
        t0 = time.perf_counter()
        result = ctl.generate(PROMPT_2, NEW)
        assert time.perf_counter() - t0 < loader.limit and "code" not in loader.done
        assert result.token_ids == target_greedy(target, PROMPT_2, NEW)
        first = result.stats.iterations[0]
        assert first.draft in ("math", "law") and first.fallback and first.load_wait_seconds == 0.0
        assert result.stats.cache.wait_seconds == 0.0 and result.stats.load_wait_seconds == 0.0
    finally:
        loader.gate.set()
        ctl.close()


@pytest.mark.parametrize("capacity,budget,wait", [(2, 0, True), (1, 0, False), (2, 1500, False)])
def test_a_warm_goal_waits_for_its_choice_when_configured_or_without_room(target, drafts, capacity, budget, wait):
    """wait_for_initial_draft; and no room to load the choice beside the resident draft (K = 1, or a byte budget
    that holds one draft), where that draft, once running, could not be evicted before the goal ends."""
    loader = GatedLoader(drafts, gated={"code"}, size_bytes=1000)  # the registry's size of every draft
    ctl = make(target, drafts, "memspec", loader=loader, capacity=capacity, budget_bytes=budget, interval=2,
               ranker=by_prompt, wait_for_initial_draft=wait)
    wait_for = ctl.cache.wait_for

    def opened_once_waited_for(*args, **kwargs):  # the gate opens once the goal waits (a timer started before
        threading.Timer(0.05, loader.gate.set).start()  # the goal let a stalled machine land the load first)
        return wait_for(*args, **kwargs)

    try:
        ctl.generate(PROMPT, 8)
        ctl.cache.wait_for = opened_once_waited_for
        result = ctl.generate(PROMPT_2, NEW)
        assert result.token_ids == target_greedy(target, PROMPT_2, NEW)
        first = result.stats.iterations[0]
        assert (first.draft, first.fallback) == ("code", False)  # it ran its choice from the first iteration
        assert result.stats.cache.wait_seconds > 0.0
    finally:
        loader.gate.set()
        ctl.close()


@pytest.mark.parametrize("policy", ["mab-sync", "general-static"])
def test_a_blocking_policy_stalls_on_a_stuck_load(target, drafts, expected, policy):
    """The counterpart, also without a clock: a policy that blocks by design is caught inside wait_for on a
    load that cannot finish, so its generation cannot have ended; released, it ends lossless having
    recorded the wait. (general-static blocks only for its one draft: here the first load is its own.)"""
    loader = StuckLoader(drafts)
    ctl = make(target, drafts, policy, loader=loader, capacity=1, interval=1, general_draft="math")
    loader.watch(ctl.cache)
    out = {}
    worker = threading.Thread(target=lambda: out.setdefault("result", ctl.generate(PROMPT, NEW)))
    worker.start()
    try:
        if policy == "general-static":
            worker.join(60)
            assert out["result"].token_ids == expected and not loader.blocked.is_set()
            assert loader.waits == ["math"] and out["result"].stats.drafts_used == ["math"]
            return
        assert loader.blocked.wait(30), f"{policy} never waited for a draft that was not resident"
        assert "result" not in out  # blocked on the stuck load: it cannot have finished
    finally:
        loader.release.set()
        worker.join(60)
        ctl.close()
    assert out["result"].token_ids == expected
    assert out["result"].stats.load_wait_seconds > 0


@pytest.mark.parametrize("policy", ["general-static", "memspec"])
def test_a_wait_for_a_stalled_load_gives_up_after_max_load_wait_seconds(target, drafts, expected, policy):
    """A read that never ends (a failing SD card, a network mount) held a goal's first draft, and the goal, for
    good: without a cancel nothing ended the wait. It now gives up after max_load_wait_seconds and decodes on
    without the draft, the output unchanged; the load goes on and the draft runs once it lands."""
    loader = GatedLoader(drafts, gated=set(drafts), limit=60.0)
    ctl = make(target, drafts, policy, loader=loader, capacity=2, interval=2, general_draft="math",
               max_load_wait_seconds=0.3)
    try:
        first = ctl.generate(PROMPT, NEW)
        assert first.token_ids == expected
        assert 0.3 <= first.stats.setup_wait_seconds < 60.0  # gave up the wait, not the load
        assert first.stats.drafts_used == []  # the target alone: nothing had landed
        loader.gate.set()
        ctl.cache.drain()
        second = ctl.generate(PROMPT, NEW)
        assert second.token_ids == expected and second.stats.drafts_used  # the loads went on and landed
    finally:
        loader.gate.set()
        ctl.close()
    with pytest.raises(ValueError, match="max_load_wait_seconds"):
        RuntimeConfig(max_load_wait_seconds=-1.0).validate()


def test_a_stalled_load_is_waited_for_once_a_goal_and_a_goal_start_waits_no_longer_for_it(target, drafts, expected,
                                                                                          monkeypatch):
    """general-static (and mab-sync) ask for their draft at every scheduling point: each point waited the whole
    max_load_wait_seconds again for the same stalled read. And with reset_cache_per_generation, the next goal's
    start waited for that read with no limit at all."""
    loader = GatedLoader(drafts, gated=set(drafts), limit=60.0)
    ctl = make(target, drafts, "general-static", loader=loader, capacity=2, interval=2, general_draft="math",
               max_load_wait_seconds=0.2, reset_cache_per_generation=True)
    waits, resets = [], []
    wait_for, reset = ctl.cache.wait_for, ctl.cache.reset
    ctl.cache.wait_for = lambda name, timeout=None, stop=None: waits.append(name) or wait_for(name, timeout, stop)
    from memspec_ros.runtime import cache as cache_module

    waited_for = []
    real_wait = cache_module._wait_futures
    monkeypatch.setattr(cache_module, "_wait_futures",
                        lambda pending, *a: waited_for.append(len(pending)) or real_wait(pending, *a))
    ctl.cache.reset = lambda stop=None, timeout=None: resets.append(timeout) or reset(stop, timeout)
    try:
        result = ctl.generate(PROMPT, NEW)
        assert result.token_ids == expected and result.stats.drafts_used == []
        assert waits == ["math"]  # the first point's wait only, of the 20 points
        ctl.generate(PROMPT, 4)
        assert resets == [0.2, 0.2]  # each goal's start waits for loads in flight at most that long
        # the second start gave up on the stalled read; the third does not wait for it again (every goal started
        # max_load_wait_seconds late while the read hung, which holds the one loader thread whatever a reset does)
        waited_for.clear()
        ctl.generate(PROMPT, 4)
        assert waited_for[0] == 0 and not loader.gate.is_set()
    finally:
        loader.gate.set()
        ctl.close()


def test_a_closed_controller_is_not_kept_alive_by_a_load_still_reading(drafts, monkeypatch):
    """A load left reading as the cache closed (failing storage) holds the cache on its thread, and through the
    cache's callbacks (size_of, source_current) the controller, its target and predictor: a node cleaned up then
    kept a whole target in memory, per configure."""
    import gc
    import weakref

    target = tiny_llama(layers=1, hidden=32, seed=9)
    loader = GatedLoader(drafts, gated={"math"}, limit=60.0)
    ctl = make(target, drafts, "memspec", loader=loader, capacity=2)
    try:
        ctl.cache.request("math")  # reading, and held there
        assert ctl.cache.loading() == ["math"]
        closes = []
        # the node's cleanup, with a short wait: the load is left to end on its own thread
        monkeypatch.setattr(ctl.cache, "close", lambda real=ctl.cache.close: closes.append(real(timeout=0.1)))
        ctl.close()
        assert closes == [False]
        alive = weakref.ref(target)
        monkeypatch.undo()
        del ctl, target
        gc.collect()
        assert loader.done == []  # still reading
        assert alive() is None, [type(r).__name__ for r in gc.get_referrers(alive())]
    finally:
        loader.gate.set()


def test_closing_a_cache_again_does_not_wait_for_the_load_left_reading(target, drafts):
    """A second close (its owner's, after a caller's) shut the pool down again and joined the load the first one
    had left reading: it blocked until the failing storage answered."""
    loader = GatedLoader(drafts, gated={"math"}, limit=60.0)
    ctl = make(target, drafts, "memspec", loader=loader, capacity=2)
    try:
        ctl.cache.request("math")
        assert not ctl.cache.close(timeout=0.1)
        assert not ctl.cache.close()  # at once, saying the load is still left reading
        assert loader.done == []
    finally:
        loader.gate.set()
        ctl.close()


def test_mab_sync_blocks_and_mab_async_does_not(target, drafts):
    sync = make(target, drafts, "mab-sync", loader=Loader(drafts, delay=0.05), capacity=1)
    s = sync.generate(PROMPT, NEW).stats
    assert s.load_wait_seconds > 0.04 and s.fallback_fraction == 0.0
    asy = make(target, drafts, "mab-async", loader=Loader(drafts, delay=0.05), capacity=1)
    a = asy.generate(PROMPT, NEW).stats
    assert a.load_wait_seconds == 0.0
    sync.close()
    asy.close()


def test_prediction_only_decodes_on_the_current_draft_while_its_choice_loads(target, drafts, expected):
    """The paper's Prediction-Only (its Section 4.4) loads the predicted draft on demand without prefetching and,
    as its Figure 9 shows (21.3% fallback execution, no load wait), decodes meanwhile: it blocked for every load
    instead. Only the generation's first draft is waited for, on a cold cache; later loads are the predicted
    draft's alone (no top-K prefetch)."""
    ranking = lambda context: (["math", "code", "law", "general"] if context.interval < 2  # noqa: E731
                               else ["code", "math", "law", "general"])
    # code's load is held until the generation ends (a fixed delay raced the decoding on a busy machine)
    loader = GatedLoader(drafts, gated={"code"})
    loader.delays = {"math": 0.05}
    ctl = make(target, drafts, "prediction-only", loader=loader, ranker=ranking, capacity=3, interval=2)
    try:
        result = ctl.generate(PROMPT, NEW)
        stats = result.stats
        assert result.token_ids == expected
        assert stats.setup_wait_seconds > 0.04 and stats.load_wait_seconds == 0.0  # the first draft only
        assert stats.fallback_fraction > 0.0  # math ran while code loaded
        loader.gate.set()
        ctl.cache.drain()
        assert sorted(ctl.cache.resident()) == ["code", "math"]  # code on demand: no top-K prefetch of law
    finally:
        loader.gate.set()  # or close() waits on the held load
        ctl.close()


def test_load_failing_mid_generation_does_not_stop_decoding(target, drafts, expected):
    for policy in ("memspec", "mab-async", "mab-sync", "prediction-only"):
        loader = Loader(drafts, fail={"code", "law"})
        ctl = make(target, drafts, policy, loader=loader, capacity=2)
        result = ctl.generate(PROMPT, NEW)
        assert result.token_ids == expected, policy
        assert set(result.stats.cache.failed) & {"code", "law"}, policy
        assert result.stats.cache.load_failures >= 1
        ctl.close()


def test_initial_draft_failing_falls_back_to_target_then_next_draft(target, drafts, expected):
    ctl = make(target, drafts, "general-static", loader=Loader(drafts, fail={"general"}))
    result = ctl.generate(PROMPT, NEW)
    assert result.token_ids == expected
    its = result.stats.iterations
    assert all(it.draft == "" for it in its[: ctl.config.interval])  # the target alone until the next point
    assert "general" not in result.stats.drafts_used and "general" in result.stats.cache.failed
    ctl.close()
    ctl = make(target, drafts, "general-static", loader=Loader(drafts, fail=set(drafts)))
    result = ctl.generate(PROMPT, NEW)
    assert result.token_ids == expected and result.stats.drafts_used == []
    ctl.close()


@pytest.mark.parametrize("policy", ["memspec", "mab-async", "general-static"])
def test_removing_the_active_draft_mid_generation(target, drafts, expected, policy):
    registry = registry_of(drafts)
    ctl = make(target, drafts, policy, registry=registry, ranker=lambda c: ["math", "law", "code", "general"],
               general_draft="math")
    removed = []

    def on_chunk(text, ids):
        if not removed and len(ctl.cache.resident()) and ctl.cache.active == "math":
            registry.remove("math")
            removed.append(True)

    result = ctl.generate(PROMPT, NEW, on_chunk=on_chunk)
    assert removed and result.token_ids == expected
    names = [it.draft for it in result.stats.iterations]
    first_gone = names.index("math") if "math" in names else 0
    # after the next scheduling point the removed draft never runs again and is not resident
    assert "math" not in names[first_gone + 2 * ctl.config.interval :]
    assert "math" not in ctl.cache.resident()
    registry.add(DraftEntry("math", "/virtual/math", "math", 1000))  # and it can come back
    assert ctl.generate(PROMPT, NEW).token_ids == expected
    ctl.close()


def test_memspec_does_not_wait_mid_generation_after_its_running_draft_was_removed(target, drafts, expected):
    """With the running draft removed the target decodes alone (no current draft), as at a generation's start;
    carry_out took that for the first choice on a warm cache and, K = 1 having no room beside the resident
    draft, blocked on the preferred draft's load: a stall in decoding MemSpec never makes."""
    registry = registry_of(drafts)
    ctl = None

    def ranker(context):
        if context.interval >= 2:
            ctl.cache.drain()  # the background load started at point 1 has landed: one draft resident, not code
            return ["code", "law", "general", "math"]
        return ["math", "law", "code", "general"]

    ctl = make(target, drafts, "memspec", loader=Loader(drafts, delay=0.2), registry=registry, ranker=ranker,
               capacity=1, interval=2)
    calls = []

    def should_cancel():
        if not calls:
            registry.remove("math")  # an operator edits drafts.names mid-goal: the running draft goes
        calls.append(1)
        return False

    try:
        result = ctl.generate(PROMPT, NEW, should_cancel=should_cancel)
    finally:
        ctl.close()
    assert result.token_ids == expected
    assert result.stats.load_wait_seconds == 0.0
    assert all(it.load_wait_seconds == 0.0 for it in result.stats.iterations)


def test_adding_a_draft_mid_generation_makes_it_a_candidate(target, drafts, expected):
    registry = registry_of({k: v for k, v in drafts.items() if k != "math"})
    ctl = make(target, drafts, "memspec", registry=registry, ranker=lambda c: ["math", "law", "code", "general"])
    added = []

    def on_chunk(text, ids):
        if not added:
            registry.add(DraftEntry("math", "/virtual/math", "math", 1000))
            added.append(True)

    result = ctl.generate(PROMPT, NEW, on_chunk=on_chunk)
    assert result.token_ids == expected
    assert "math" in result.stats.drafts_used
    ctl.close()


@pytest.mark.parametrize("at_chunk", [1, 3])
def test_drafts_and_settings_replaced_together_land_at_one_scheduling_point(target, drafts, expected, at_chunk):
    """A registry change with a memspec.* change of the same call (general-static naming a draft only the new
    registry has) was applied in two steps: a scheduling point between them ran the new policy against the old
    drafts. replace_registry applies both in one step, or neither. The first chunk is the prefill's token: a change
    then landed its drafts at the first choice but not its settings (the first choice ran `general`)."""
    old = registry_of({k: v for k, v in drafts.items() if k != "math"})
    ctl = make(target, drafts, "general-static", registry=old, general_draft="code", interval=2)
    before = ctl.config
    for refused, error in [({"general_draft": "nope"}, PolicyError), ({"capacity": 0}, ValueError)]:
        with pytest.raises(error):
            ctl.replace_registry(registry_of(drafts), **refused)
        assert ctl.config == before and ctl.registry.names() == old.names()  # nothing changed
    old.validate, old.target_fingerprint = True, "the target's"  # one that checks its drafts takes no unchecked ones
    with pytest.raises(ValueError, match="did not check"):
        ctl.replace_registry(registry_of({"math": drafts["math"]}), general_draft="math")
    assert ctl.config == before and ctl.registry.names() == ["general", "code", "law"]
    old.validate = False
    chunks = []

    def on_chunk(text, ids):
        chunks.append(ids)
        if len(chunks) == at_chunk:
            ctl.replace_registry(registry_of({"math": drafts["math"], "general": drafts["general"]}),
                                 general_draft="math")

    result = ctl.generate(PROMPT, NEW, on_chunk=on_chunk)
    assert result.token_ids == expected
    runs = [it.draft for it in result.stats.iterations]
    first_math = runs.index("math")
    assert set(runs[first_math:]) == {"math"}, runs
    assert set(runs[:first_math]) == (set() if at_chunk == 1 else {"code"}), runs
    assert not any(it.fallback for it in result.stats.iterations)  # never the new policy without its draft
    assert ctl.config.general_draft == "math" and ctl.registry.names() == ["math", "general"]
    ctl.close()


def test_a_registry_swap_during_a_goal_waits_for_the_next_point_and_checks_later_changes_against_it(
        target, drafts, expected):
    """replace_registry swapped the live registry at once while its settings waited for the point: the point's own
    reads (candidates, the loader) saw the new drafts with the old settings. It waits with them now; and a change
    made meanwhile is checked against the drafts it will run with (a general_draft only the new registry has was
    refused)."""
    old = registry_of({k: v for k, v in drafts.items() if k != "math"})
    ctl = make(target, drafts, "general-static", registry=old, general_draft="code", interval=2)
    seen = []

    def on_chunk(text, ids):
        if not seen:
            assert ctl.replace_registry(registry_of({k: drafts[k] for k in ("math", "general", "code")})) == []
            seen.append(ctl.registry.names())  # not yet: at the next point
            ctl.reconfigure(general_draft="math")  # valid with the drafts it will run with

    result = ctl.generate(PROMPT, NEW, on_chunk=on_chunk)
    assert seen == [["general", "code", "law"]]
    assert result.token_ids == expected and ctl.registry.names() == ["math", "general", "code"]
    assert result.stats.drafts_used[-1] == "math" and not any(it.fallback for it in result.stats.iterations)
    ctl.close()


def test_the_runtime_api_refuses_what_it_cannot_do_and_changes_nothing(target, drafts, expected):
    """A review of the API with bad input: a closed controller ran every later goal on the target alone (its cache
    loads nothing); replace_registry with no setting changed took drafts the policy in force cannot rank; the
    constructor took a general_draft the registry lacks (another draft ran); stop strings given as a one-shot
    iterable were used up by the check and never matched."""
    from memspec_ros.runtime.policies import PolicyError

    with pytest.raises(PolicyError, match="general_draft 'nope' is not in the draft registry"):
        make(target, drafts, "general-static", general_draft="nope")
    ctl = make(target, drafts, "memspec", ranker=alternating)
    ctl.predictor.classes = ["code", "math"]  # a trained head's classes: it scores only these
    unscored = registry_of({"law": drafts["law"], "general": drafts["general"]})
    with pytest.raises(PolicyError, match="policy memspec"):
        ctl.replace_registry(unscored)
    assert ctl.registry.names() == list(drafts)  # nothing changed
    del ctl.predictor.classes
    ctl.reconfigure(policy="general-static", general_draft="general")
    with pytest.raises(PolicyError, match="general_draft 'general' is not in the draft registry"):
        ctl.replace_registry(registry_of({"law": drafts["law"]}))  # it would lose its draft
    assert ctl.registry.names() == list(drafts)
    ctl.close()
    with pytest.raises(RuntimeError, match="this controller is closed"):
        ctl.generate(PROMPT, 4)


def test_a_goal_that_fails_in_its_setup_or_decode_start_callback_closes_its_policy(target, drafts):
    """_setup and on_decode_start ran before the try whose finally closes the policy: an overlapped ranking's
    background work and time then spilled into the next goal."""
    ctl = make(target, drafts, "prediction-only")
    closed = []
    make_policy = ctl._make_policy

    def spied():
        policy = make_policy()
        close = policy.close
        policy.close = lambda: closed.append(policy.name) or close()
        return policy

    ctl._make_policy = spied
    try:
        with pytest.raises(ZeroDivisionError):
            ctl.generate(PROMPT, 8, on_decode_start=lambda: 1 / 0)
        assert closed == ["prediction-only"]
    finally:
        ctl.close()


def test_a_session_holds_a_prompt_to_the_targets_own_context_where_none_is_given():
    """With max_positions left 0, a RoPE Llama had no limit: a 600-token prompt on a 512-position model generated
    garbage without a word, where the controller refuses it."""
    from memspec_ros.runtime.speculative import ContextLengthError, generate

    model = tiny_llama(layers=1, hidden=32, seed=4)
    limit = model.config.max_position_embeddings
    with pytest.raises(ContextLengthError, match=f"context of {limit} tokens"):
        generate(model, [3] * limit, None, max_new_tokens=4)


def test_stop_strings_given_as_a_one_shot_iterable_still_stop(target, drafts):
    from memspec_ros.testing.tiny_models import tiny_tokenizer

    tok = tiny_tokenizer()
    ctl = RuntimeController(RuntimeConfig(policy="general-static", general_draft="code"), target, tok,
                            registry_of(drafts), None, loader=Loader(drafts), eos_token_ids=[])
    try:
        free = ctl.generate(PROMPT, 16)
        stop = free.text[len(free.text) // 2:][:2]
        assert stop.strip(), free.text
        listed = ctl.generate(PROMPT, 16, stop=[stop])
        once = ctl.generate(PROMPT, 16, stop=iter([stop]))
        assert listed.stats.finish_reason == once.stats.finish_reason == "stop" and once.text == listed.text
    finally:
        ctl.close()


def test_reconfigure_validates_and_applies_at_scheduling_points(target, drafts, expected):
    ctl = make(target, drafts, "memspec", capacity=2)
    for bad, field in [({"capacity": 0}, "capacity"), ({"interval": 0}, "interval"), ({"gamma": 0}, "gamma"),
                       ({"policy": "fastest"}, "policy"), ({"recent_tokens": -1}, "recent_tokens"),
                       ({"colour": 1}, "colour")]:
        with pytest.raises(ValueError, match=field):
            ctl.reconfigure(**bad)
    with pytest.raises(PolicyError, match="oracle"):
        ctl.reconfigure(policy="oracle-dynamic")
    assert ctl.config.capacity == 2 and ctl.config.policy == "memspec"  # nothing changed
    changed = []

    def on_chunk(text, ids):
        if not changed:
            ctl.reconfigure(capacity=1, interval=2, gamma=3, policy="mab-async")
            changed.append(True)

    result = ctl.generate(PROMPT, NEW, on_chunk=on_chunk)
    assert result.token_ids == expected
    assert ctl.config.capacity == 1 and ctl.cache.capacity == 1
    assert result.stats.policy == "memspec>mab-async"
    assert any(it.proposed == 3 for it in result.stats.iterations)
    ctl.close()


@pytest.mark.parametrize("field,bad", [("adaptive_gamma", "false"), ("prompt_cache", "no"), ("general_draft", None),
                                       ("overlap_prediction", []), ("reset_cache_per_generation", 1),
                                       ("context_lookup", "true"), ("policy", 3)])
def test_reconfigure_refuses_a_value_of_the_wrong_type_and_changes_nothing(target, drafts, field, bad):
    """validate() checked only the policy name and the numeric limits: adaptive_gamma="false" passed and, a
    non-empty string, turned adaptive gamma on; general_draft=None passed too."""
    ctl = make(target, drafts, "memspec", capacity=2)
    before = ctl.config
    with pytest.raises(ValueError, match=f"^{field} must be"):
        ctl.reconfigure(**{field: bad})
    assert ctl.config == ctl.next_config == before
    with pytest.raises(ValueError, match=f"^{field} must be"):
        make(target, drafts, **{"policy": "memspec", field: bad})
    ctl.close()


def test_every_runtime_setting_has_a_type_check():
    """validate() checks a field by its annotation, numbers by LIMITS: a new field of another type, or a number
    without limits, would go unchecked."""
    import dataclasses

    from memspec_ros.runtime.controller import _FIELD_TYPES, LIMITS

    for f in dataclasses.fields(RuntimeConfig):
        assert f.type in _FIELD_TYPES, f.name
        assert (f.type in ("int", "float")) == (f.name in LIMITS), f.name
    RuntimeConfig().validate()


class _IdleHookLock:
    """The controller's lock, running ``hook`` on another thread (once) right after a release that leaves the
    controller idle: the moment a ROS parameter callback can call reconfigure() as a goal ends."""

    def __init__(self, ctl) -> None:
        self.ctl, self.lock, self.hook = ctl, threading.Lock(), None

    def __enter__(self):
        self.lock.acquire()
        return self

    def __exit__(self, *exc) -> None:
        self.lock.release()
        if self.hook is not None and not self.ctl._running:
            hook, self.hook = self.hook, None
            thread = threading.Thread(target=hook)
            thread.start()
            thread.join()


def test_a_reconfigure_as_a_goal_ends_is_not_lost_to_the_goals_pending_change(target, drafts):
    """generate() marked itself idle, released the lock and only then applied the change pending from mid-goal: a
    reconfigure() in between built on the pending change, applied both at once, and the older pending change was
    then applied over it (gamma=2 lost)."""
    ctl = make(target, drafts, "general-static", capacity=2, interval=4)
    ctl._lock = _IdleHookLock(ctl)
    returned = []
    seen = []

    def on_chunk(delta, ids):
        seen.extend(ids)
        if len(seen) >= 20 and ctl.next_config.interval != 8:  # the last commit: no scheduling point follows
            ctl.reconfigure(interval=8)  # the goal runs: pending
            ctl._lock.hook = lambda: returned.append(ctl.reconfigure(gamma=2))

    ctl.generate(PROMPT, 20, on_chunk=on_chunk)
    assert [c.gamma for c in returned] == [2] and returned[0].interval == 8
    assert (ctl.config.gamma, ctl.config.interval) == (2, 8) and ctl.next_config == ctl.config
    ctl.close()


@pytest.mark.parametrize("policy", ["mab-sync", "mab-async"])
def test_a_bandit_keeps_what_it_learned_when_a_setting_it_does_not_use_changes(target, drafts, policy):
    """Setting memspec.overlap_prediction or general_draft mid-goal made the bandit anew at the next scheduling
    point: it forgot its pulls and tried every arm again (for MAB-Sync, a blocking load each). Its own setting
    (ucb_c) still makes it anew."""
    made = []
    ctl = make(target, drafts, policy, capacity=2, interval=2)
    original = ctl._make_policy
    ctl._make_policy = lambda: made.append(original()) or made[-1]
    seen = []

    def change(setting):
        def on_chunk(delta, ids):
            seen.extend(ids)
            if len(seen) >= 6 and not changed:
                changed.append(ctl.reconfigure(**setting))
        return on_chunk

    for setting, remade in (({"overlap_prediction": True}, False), ({"general_draft": "code"}, False),
                            ({"ucb_c": 0.5}, True)):
        changed, seen[:] = [], []
        before = len(made)
        ctl.generate(PROMPT, 24, on_chunk=change(setting))
        assert changed and ctl.config == changed[0]
        assert len(made) - before == (2 if remade else 1), setting  # one per goal, one more if remade mid-goal
    ctl.close()


def test_cancel_and_streaming(target, drafts, expected):
    ctl = make(target, drafts, "memspec")
    chunks = []
    stop_after = threading.Event()

    def on_chunk(text, ids):
        chunks.extend(ids)
        if len(chunks) >= 10:
            stop_after.set()

    result = ctl.generate(PROMPT, NEW, on_chunk=on_chunk, should_cancel=stop_after.is_set)
    assert result.finish_reason == "cancelled"
    assert chunks == result.token_ids == expected[: len(chunks)]
    ctl.close()


@pytest.mark.parametrize("policy", ["mab-sync", "prediction-only"])
def test_a_wait_for_a_load_that_fails_is_a_load_wait(target, drafts, expected, policy, clock_jump):
    """The controller's wait returned 0.0 when the load it blocked on failed: the cache had counted the wait, but a
    scheduling point charged it to prediction (0.5 s) and the setup's first choice to setup_seconds, not
    setup_wait_seconds. MAB-Sync tries 'code' at a scheduling point; Prediction-Only blocks on it (ranked first)
    at the first choice."""
    delay = 60.0  # a slow read, as a jump of the clock: a loaded machine's stall of half a second is no match for it
    loader = Loader(drafts, delays={"code": delay}, fail={"code"}, sleep=clock_jump)
    ctl = make(target, drafts, policy, loader=loader, ranker=lambda context: ["code", "math", "law", "general"],
               capacity=2, interval=2)
    result = ctl.generate(PROMPT, NEW)
    stats = result.stats
    assert result.token_ids == expected
    assert stats.cache.load_failures == 1 and loader.calls.count("code") == 1
    # every second the cache counts as a wait is a wait in the generation's statistics, the failed one included
    assert stats.setup_wait_seconds + stats.load_wait_seconds == pytest.approx(stats.cache.wait_seconds, abs=1e-6)
    failed_wait = stats.setup_wait_seconds if policy == "prediction-only" else stats.load_wait_seconds
    assert failed_wait >= delay
    assert stats.prediction_seconds < delay  # the failed wait (>= delay, above) is not in them
    ctl.close()


def test_a_seed_out_of_range_is_refused_when_the_sampling_config_is_made(target, drafts):
    """A seed torch refuses (2**64) raised only where the session seeded its generator: after the controller had
    reset its draft cache for the goal (reset_cache_per_generation) and taken its prompt-cache entry. It is now
    refused when the (frozen) SamplingConfig is made, so no goal can carry one; negative seeds, which torch folds
    onto 2**64 + seed, bools and floats too. Both ends of [0, 2**64) run."""
    for seed in (2**64, -1, True, 1.5):
        with pytest.raises(ValueError, match=r"seed must be None .* or an integer in \[0, 2\*\*64\)"):
            SamplingConfig(temperature=0.7, seed=seed)
    ctl = make(target, {"general": drafts["general"]}, "general-static", capacity=2,
               reset_cache_per_generation=True)
    try:
        for seed in (0, 2**64 - 1):
            assert len(ctl.generate(PROMPT, 4, sampling=SamplingConfig(temperature=0.7, seed=seed)).token_ids) == 4
    finally:
        ctl.close()


def test_one_stop_string_not_in_a_list_is_refused(drafts):
    """A plain string is a Sequence[str]: generate(stop="\n\nUser:") took each character for a stop string and
    ended the output at the first of them, silently. Refused, like a stop that is no string, before the goal
    starts."""
    tokenizer = tiny_tokenizer()
    target = tiny_llama(vocab_size=len(tokenizer), seed=5)
    draft = noisy_copy(target, 0.02, seed=6)
    ctl = RuntimeController(RuntimeConfig(policy="general-static"), target, tokenizer, registry_of({"general": draft}),
                            None, loader=Loader({"general": draft}), eos_token_ids=[])
    prompt = tokenizer("The patient")["input_ids"]
    free = ctl.generate(prompt, 24)
    stop = "\n\nUser:" + free.text[6:8]  # one of its characters is in the output; the whole string is not
    assert stop not in free.text and any(c in free.text for c in stop)
    with pytest.raises(TypeError, match=r"stop strings must be a list of strings, got one string .*: pass \["):
        ctl.generate(prompt, 24, stop=stop)
    with pytest.raises(TypeError, match="stop strings must be strings, got None"):
        ctl.generate(prompt, 24, stop=["ok", None])
    assert ctl.generate(prompt, 24, stop=[stop]).text == free.text  # in a list: one stop string, not in the output
    ctl.close()


def test_a_stop_string_holding_a_special_token_is_refused_as_it_could_never_match(drafts):
    """The output text is decoded without special tokens: a stop string holding one inside other text
    ("User:<|im_end|>") never matched, and the goal ran to its length instead."""
    tokenizer = tiny_tokenizer(chat=True)
    target = tiny_llama(vocab_size=len(tokenizer), seed=5)
    ctl = RuntimeController(RuntimeConfig(policy="general-static"), target, tokenizer,
                            registry_of({"general": noisy_copy(target, 0.02, seed=6)}), None,
                            loader=Loader({"general": noisy_copy(target, 0.02, seed=6)}), eos_token_ids=[])
    prompt = tokenizer("The patient")["input_ids"]
    for stop in (["<|im_start|>x"], ["ok", "User:<|im_end|>"], ["<pad> "]):  # a special token inside other text
        with pytest.raises(ValueError, match="contains the special token .* never appears in the output text"):
            ctl.generate(prompt, 8, stop=stop)
    for stop in (["<|im_start|>"], ["<pad>"], ["<|im_end|>"]):  # exactly one: the generation would end at it
        assert ctl.generate(prompt, 8, stop=stop).stats.completion_tokens >= 1
    assert ctl.generate(prompt, 8, stop=["<|im_start"]).stats.completion_tokens == 8  # no special token: taken
    # exactly an end token of this generation (OpenAI- and llama.cpp-style clients send them as stops): redundant,
    # so taken
    ended = RuntimeController(RuntimeConfig(policy="general-static"), target, tokenizer,
                              registry_of({"general": noisy_copy(target, 0.02, seed=6)}), None,
                              loader=Loader({"general": noisy_copy(target, 0.02, seed=6)}),
                              eos_token_ids=[tokenizer.convert_tokens_to_ids("<|im_end|>")])
    assert tokenizer.eos_token == "</s>"
    assert ended.generate(prompt, 8, stop=["<|im_end|>"]).stats.completion_tokens >= 1
    for stop in (["<|im_end|>", "<|im_start|>x"], ["<|im_end|>", "x</s>"]):
        with pytest.raises(ValueError, match=f"'{re.escape(stop[1])}'.*ends at the model's end token"):
            ended.generate(prompt, 8, stop=stop)
    with pytest.raises(ValueError, match="'x</s>'.*this generation ends at no end token"):
        ctl.generate(prompt, 8, stop=["x</s>"])
    ended.close()
    ctl.close()


def test_a_stop_string_that_is_one_special_token_ends_the_generation_at_it():
    """A raw continuation of an instruct model runs on past its base model's <|endoftext|> (its end tokens are its
    end of turn), into a new document; a stop string of that token was refused as one that could never match the
    text. Given alone, a special token ends the generation at it: finish_reason stop, the token not in the text."""
    from memspec_ros.runtime.speculative import SpeculativeSession

    tokenizer = tiny_tokenizer(chat=True)
    target = tiny_llama(vocab_size=len(tokenizer), seed=5)
    prompt = tokenizer("The patient")["input_ids"]
    special = tokenizer.convert_tokens_to_ids("<|im_start|>")
    plain = [t for t in range(3, 40) if t != special][:2]
    for stops, reason in ((["<|im_start|>"], "stop"), ([], "")):
        session = SpeculativeSession(target, prompt, max_new_tokens=8, tokenizer=tokenizer, stop_strings=stops)
        session.prefill()
        first = session.generated_ids[0]
        committed = session._commit([plain[0], special, plain[1]])  # as a verify commits an accepted run
        assert session.finish_reason == reason, stops
        if reason:  # ended at the token: nothing after it committed, and the text never shows it
            assert committed == 2 and session.generated_ids == [first, plain[0], special]
            assert "<|im_start|>" not in session.text
        else:
            assert committed == 3


def test_memspec_without_predictor_is_refused(target, drafts):
    with pytest.raises(PolicyError, match="predictor"):
        RuntimeController(RuntimeConfig(policy="memspec"), target, None, registry_of(drafts), None,
                          loader=Loader(drafts))


def test_every_iteration_is_accounted(target, drafts, oracle):
    ctl = make(target, drafts, "memspec", capacity=2)
    stats = ctl.generate(PROMPT, NEW).stats
    spec = stats.speculative_iterations
    assert stats.desired_fraction + stats.fallback_fraction == pytest.approx(1.0)
    assert stats.predictions >= 1 + (len(stats.iterations) - 1) // ctl.config.interval
    assert stats.prediction_seconds > 0  # (a bound on its share, "< 1.0", held for any share)
    assert all(it.preferred for it in spec)
    summary = stats.summary()
    assert summary["policy"] == "memspec" and "cache_hits" in summary
    ctl.close()


def test_end_to_end_and_first_token_count_the_wait_for_the_last_goals_prefetch(target, drafts, expected):
    """With reset_cache_per_generation (the bench protocol) the cache's reset waits for prefetches still in flight
    from the goal before; end_to_end_seconds (setup + prefill + decode) and time_to_first_token (start + prefill)
    left that wait out (1.0 s of wall time reported as 0.5 s). They now count from generate()'s entry; the paper's
    decode-only metric is unchanged. The goal before's first prefetch is held until a timer opens it."""
    gate = threading.Event()

    class HeldPrefetch(Loader):
        def __call__(self, name):
            if len(self.calls) == 1:  # the second load: goal 1's first prefetch (one loader thread)
                gate.wait(timeout=30)
            return super().__call__(name)

    ctl = make(target, drafts, "memspec", loader=HeldPrefetch(drafts), capacity=2, interval=1,
               reset_cache_per_generation=True)
    assert ctl.generate(PROMPT, 8).token_ids == expected[:8]
    assert ctl.cache.loading(), "goal 1 leaves its prefetch in flight"
    opened = []
    timer = threading.Timer(0.5, lambda: (opened.append(time.perf_counter()), gate.set()))
    timer.start()
    t0 = time.perf_counter()
    result = ctl.generate(PROMPT, 8)
    wall = time.perf_counter() - t0
    timer.join()
    stats = result.stats
    held = opened[0] - t0  # what the call waited at least (the timer's own 0.5 s less any stall before the call)
    assert result.token_ids == expected[:8]
    assert 0 < stats.end_to_end_seconds == stats.call_seconds <= wall  # the controller's own call (below: its parts)
    # the call began its clock at most wall - call_seconds after t0 (its entry, and after its end the return)
    entry = wall - stats.call_seconds
    assert stats.time_to_first_token >= held - entry  # the first token came after the reset's wait
    assert stats.prepare_seconds >= held - entry  # which came before the policy's start
    assert stats.end_to_end_seconds >= (stats.prepare_seconds + stats.setup_seconds + stats.prefill_seconds
                                        + stats.decode_seconds)
    assert stats.time_to_first_token == stats.prepare_seconds + stats.start_seconds + stats.prefill_seconds
    assert stats.tokens_per_second == stats.decode_tokens / stats.decode_seconds  # the paper's metric: decode only
    ctl.close()


def test_cache_shared_across_generations_and_reset(target, drafts):
    loader = Loader(drafts)
    ctl = make(target, drafts, "general-static", loader=loader, general_draft="code")
    ctl.generate(PROMPT, 8)
    ctl.generate(PROMPT, 8)
    assert loader.calls == ["code"]  # warm cache: loaded once
    ctl.reconfigure(reset_cache_per_generation=True)
    ctl.generate(PROMPT, 8)
    assert loader.calls == ["code", "code"]
    ctl.close()


def test_byte_budget_through_controller(target, drafts, expected):
    sizes = {"general": 300, "code": 200, "math": 200, "law": 100}
    registry = DraftRegistry([DraftEntry(n, f"/virtual/{n}", n, sizes[n]) for n in drafts], validate=False)
    seen = []
    cache = DraftCacheManager(3, Loader({n: drafts[n] for n in drafts}), budget_bytes=350,
                              size_of=lambda n: registry.get(n).size_bytes, on_change=seen.append)

    def loader_sized(name):
        loaded = Loader(drafts)(name)
        loaded.size_bytes = sizes[name]
        return loaded

    cache.loader = loader_sized
    ctl = RuntimeController(RuntimeConfig(policy="memspec", capacity=3, budget_bytes=350), target, None, registry,
                            FixedRanker(alternating), cache=cache, eos_token_ids=[])
    assert ctl.generate(PROMPT, NEW).token_ids == expected
    assert all(s.bytes_reserved <= 350 and len(s.resident) + len(s.loading) <= 3 for s in seen)
    ctl.close()


# -- one seed, one output -------------------------------------------------------------------------


@pytest.mark.parametrize("policy", ["general-static", "mab-sync", "prediction-only", "memspec"])
def test_one_seed_gives_one_output(target, drafts, expected, policy):
    """The same seed gives the same sampled output, on a fresh controller and on a warm one, and other
    seeds give other outputs (the settings reach the engine). Sampled speculative decoding draws its random
    numbers along the drafts that run, so this holds when the same drafts run at the same points: with
    a policy that waits for its draft, or with every draft resident (MemSpec and Prediction-Only, which decode on
    while their choice loads, with K = all drafts, warm);
    asynchronous prefetch timing may otherwise change the drafts, and so the output, of one seed."""
    warm = policy in ("memspec", "prediction-only")  # they decode on while their choice loads
    capacity = len(drafts) if warm else 2

    def fresh():
        ctl = make(target, drafts, policy, capacity=capacity)
        if warm:  # warm: every draft resident, so the preferred one always runs
            ctl.generate(PROMPT, 4)
            for name in drafts:  # Prediction-Only loads one draft a point: the rest asked for here
                ctl.cache.request(name, supersede=False)
            ctl.cache.drain()
            assert len(ctl.cache.resident()) == len(drafts)
        return ctl

    sampling = SamplingConfig(temperature=0.9, seed=11)
    a, b = fresh(), fresh()
    try:
        first = a.generate(PROMPT, NEW, sampling)
        assert first.token_ids != expected  # sampled, not greedy
        assert b.generate(PROMPT, NEW, sampling).token_ids == first.token_ids  # another controller
        assert a.generate(PROMPT, NEW, sampling).token_ids == first.token_ids  # the same one again
        others = {tuple(a.generate(PROMPT, NEW, SamplingConfig(temperature=0.9, seed=s)).token_ids) for s in (12, 13)}
        assert tuple(first.token_ids) not in others
        assert any(it.proposed for it in first.stats.iterations)
    finally:
        a.close()
        b.close()


# -- sampling through the controller -------------------------------------------------------------
# A 4-token vocabulary, so the exact joint distribution of the first tokens is small enough to test with
# a chi-square: the engine's acceptance rule is tested alone in test_engine.py; here it is the controller
# that must hand the goal's sampling settings to every iteration, across draft switches, for every policy.

S_VOCAB = 4
S_PROMPT = [1, 3]
S_NEW = 4
S_SAMPLING = {"temperature": 0.8, "top_p": 0.95}
S_RUNS = 1000
SWITCHING = {"memspec", "mab-sync", "mab-async", "prediction-only"}  # switch drafts at K = 2 here
BLOCKING = {"mab-sync"}  # switch at K = 1 too, by stalling


@pytest.fixture(scope="module")
def sampled():
    """A tiny target and four drafts over 4 tokens, and the exact probability of every 4-token output."""
    target = tiny_llama(vocab_size=S_VOCAB, hidden=32, seed=7, init_range=0.3)
    drafts = {
        "general": tiny_llama(vocab_size=S_VOCAB, hidden=32, layers=1, seed=8, init_range=0.3),  # unrelated
        "code": noisy_copy(target, 0.3, seed=2),
        "math": noisy_copy(target, 0.1, seed=3),
        "law": noisy_copy(target, 0.6, seed=4),
    }
    outputs = list(product(range(S_VOCAB), repeat=S_NEW))
    with torch.no_grad():
        logits = target(torch.tensor([S_PROMPT + list(o) for o in outputs])).logits
    # the target's own distribution: warped softmax at the positions that predict each output token
    probs = warp_probs(logits[:, len(S_PROMPT) - 1 : -1], SamplingConfig(**S_SAMPLING))
    exact = {o: float(torch.prod(probs[i, torch.arange(S_NEW), torch.tensor(o)])) for i, o in enumerate(outputs)}
    assert sum(exact.values()) == pytest.approx(1.0)
    first3: dict[tuple[int, ...], float] = Counter()
    last2: dict[tuple[int, ...], float] = Counter()
    for o, p in exact.items():
        first3[o[:3]] += p
        last2[o[2:]] += p
    oracle = GreedyOracle.compute(target, drafts, S_PROMPT, 2 * S_NEW, gamma=2, interval=1)
    return target, drafts, oracle, dict(first3), dict(last2)


def flipping(context):
    """Two drafts trade first place at every point: on the warm cache both stay resident, so MemSpec switches
    within outputs of a few tokens, where a prefetch started mid-output rarely lands before the output ends."""
    return ["math", "law", "code", "general"] if context.interval % 2 == 0 else ["law", "math", "code", "general"]


@pytest.mark.parametrize("capacity", [1, 2])
@pytest.mark.parametrize("policy", POLICIES)
def test_sampled_output_has_the_targets_distribution_under_every_policy(sampled, policy, capacity):
    """The first three tokens' joint distribution, and the last two's, over S_RUNS seeds equal the target's
    own (chi-square), with a scheduling point every iteration so the drafts switch mid-output."""
    switches, accepted, rejected, tests = _sampled_runs(sampled, policy, capacity)
    assert accepted > 0 and rejected > 0, "both the accept and the reject path of sampling must run"
    if policy in BLOCKING or (capacity == 2 and policy in SWITCHING):
        assert switches > 0, "the drafts must switch for this test to mean anything"
    for name, stat, critical in tests:
        assert stat < critical, (name, stat, critical)


def _sampled_runs(sampled, policy: str, capacity: int) -> tuple[int, int, int, list[tuple[str, float, float]]]:
    """S_RUNS seeded generations under ``policy``: (draft switches, accepted tokens, iterations with a rejection,
    and the chi-square of the first three tokens' and of the last two's joint against the target's as (name,
    statistic, critical value at 0.9999))."""
    target, drafts, oracle, exact3, exact2 = sampled
    ctl = make(target, drafts, policy, oracle, capacity=capacity, interval=1, gamma=2, ranker=flipping)
    first3: Counter = Counter()
    last2: Counter = Counter()
    switches = accepted = rejected = 0
    for seed in range(S_RUNS):
        result = ctl.generate(S_PROMPT, S_NEW, SamplingConfig(seed=seed, **S_SAMPLING))
        ids = tuple(result.token_ids)
        assert len(ids) == S_NEW and result.finish_reason == "length"
        first3[ids[:3]] += 1
        last2[ids[2:]] += 1
        switches += result.stats.draft_switches
        spec = result.stats.speculative_iterations
        accepted += sum(it.accepted for it in spec)
        rejected += sum(1 for it in spec if it.accepted < it.proposed)
    ctl.close()
    tests = []
    for name, observed, exact in (("tokens 1-3", first3, exact3), ("tokens 3-4", last2, exact2)):
        stat, dof = chi2(observed, exact, S_RUNS)
        tests.append((name, stat, chi2_critical(dof, z=3.72)))
    return switches, accepted, rejected, tests


@pytest.mark.parametrize("broken", ["every proposal accepted", "the residual left out (p itself)"])
def test_the_controllers_chi_square_sees_a_wrong_acceptance_rule(sampled, monkeypatch, broken):
    """The negative control of the test above, at its sample size and on its switching drafts: with the acceptance
    rule broken in the engine, the same chi-square fails. A test of too little power would pass either way."""
    from memspec_ros.runtime import speculative

    rule = speculative.speculative_accept

    def wrong(p, q, proposals, generator):
        if broken == "every proposal accepted":
            return len(proposals), int(torch.multinomial(p[len(proposals)], 1, generator=generator))
        accepted, extra = rule(p, q, proposals, generator)
        if accepted < len(proposals):  # a rejection: the extra token from p, not from norm(max(0, p - q))
            extra = int(torch.multinomial(p[accepted], 1, generator=generator))
        return accepted, extra

    monkeypatch.setattr(speculative, "speculative_accept", wrong)
    try:
        _, _, _, tests = _sampled_runs(sampled, "memspec", 2)
    except AssertionError as exc:  # chi2's own refusal: a token top_p leaves the target no chance of was drawn
        assert "outcomes of probability 0 drawn" in str(exc)
        return
    assert any(stat >= critical for _, stat, critical in tests), tests


@pytest.fixture(autouse=True)
def _one_thread(one_thread):
    """Every test of this module on one thread (conftest.one_thread)."""


def test_a_draft_entry_given_another_path_mid_goal_replaces_the_model_in_memory(target, drafts):
    """An operator points draft 'code' at new weights while a goal runs (the node's registry swap: the entry is
    removed and added under the same name). At the next scheduling point the old model leaves the cache and the
    registered one is loaded; the output stays the target's."""
    models = {"/virtual/code": drafts["code"], "/virtual/code-v2": noisy_copy(drafts["code"], 0.0)}
    registry = DraftRegistry([DraftEntry("code", "/virtual/code", "code", 1000)], validate=False)
    loaded_paths: list[str] = []

    def loader(name: str) -> LoadedModel:
        path = registry.get(name).path
        loaded_paths.append(path)
        model = models[path]
        return LoadedModel(model, ModelSpec(path), parameter_bytes(model), 64, 512)

    ctl = RuntimeController(RuntimeConfig(policy="memspec", capacity=1, interval=2), target, None, registry,
                            FixedRanker(lambda c: ["code"]), loader=loader, eos_token_ids=[])
    swapped: list[int] = []

    def swap_after_some_tokens(_delta, ids):
        swapped.append(len(ids))
        if len(swapped) == 3:
            registry.remove("code")
            registry.add(DraftEntry("code", "/virtual/code-v2", "code", 1000))

    try:
        prompt = [1, 5, 7, 9, 11, 13]
        out = ctl.generate(prompt, 40, on_chunk=swap_after_some_tokens)
        assert out.token_ids == target_greedy(target, prompt, 40)
        assert loaded_paths == ["/virtual/code", "/virtual/code-v2"]
        assert ctl.cache.get("code").spec.path == "/virtual/code-v2"
    finally:
        ctl.close()


def test_a_draft_evicted_before_its_entry_changed_is_loaded_at_its_new_size(target, drafts):
    """The registry sync forgot what the cache knew of a changed entry only for resident or loading drafts: 'code',
    measured at 900 B and evicted, then pointed at a 100 B model, kept the old measurement and was refused as too
    large for a 500 B budget ("needs 900 B"), its new files never read."""
    sizes = {"/virtual/code": 900, "/virtual/code-v2": 100, "/virtual/general": 100}
    models = {"/virtual/code": drafts["code"], "/virtual/code-v2": noisy_copy(drafts["code"], 0.0),
              "/virtual/general": drafts["general"]}
    registry = DraftRegistry([DraftEntry("code", "/virtual/code", "code", 900),
                              DraftEntry("general", "/virtual/general", "general", 100)], validate=False)
    loaded_paths: list[str] = []

    def loader(name: str) -> LoadedModel:
        path = registry.get(name).path
        loaded_paths.append(path)
        return LoadedModel(models[path], ModelSpec(path), sizes[path], 64, 512)

    ctl = RuntimeController(RuntimeConfig(policy="memspec", capacity=1, interval=2, budget_bytes=1000), target,
                            None, registry, FixedRanker(lambda c: ["code"]), loader=loader, eos_token_ids=[])
    try:
        prompt = [1, 5, 7, 9, 11, 13]
        assert ctl.generate(prompt, 12).token_ids == target_greedy(target, prompt, 12)
        ctl.cache.request("general")  # K = 1: code is evicted
        ctl.cache.drain()
        assert ctl.cache.resident() == ["general"]
        registry.remove("code")
        registry.add(DraftEntry("code", "/virtual/code-v2", "code", 100))
        ctl.cache.reconfigure(budget_bytes=500)
        out = ctl.generate(prompt, 12)
        assert out.token_ids == target_greedy(target, prompt, 12)
        assert loaded_paths[-1] == "/virtual/code-v2" and "code" in out.stats.drafts_used
        assert not ctl.cache.failed()
    finally:
        ctl.close()


def test_a_draft_loaded_from_a_path_its_entry_no_longer_names_leaves_the_cache(target, drafts):
    """The loader reads an entry's path when its load starts: a path changed and changed back within one interval
    while the load ran left the other path's model resident, since the sync compared the entries alone (A with A)."""
    registry = DraftRegistry([DraftEntry("code", "/virtual/code", "code", 1000)], validate=False)

    def loader(name: str) -> LoadedModel:  # what a load that read the entry while it named v2 returns
        loaded = LoadedModel(drafts["code"], ModelSpec("/virtual/code-v2"), 1000, 64, 512)
        loaded.source = "/virtual/code-v2"
        return loaded

    ctl = RuntimeController(RuntimeConfig(policy="general-static", general_draft="code", capacity=1), target, None,
                            registry, loader=loader, eos_token_ids=[])
    try:
        ctl.cache.request("code")
        ctl.cache.drain()
        assert ctl.cache.resident() == []  # dropped as it landed: the path it read is not the entry's
        # one that landed before the entry changed back (the check passed then) goes at the next sync
        ctl.cache.source_current = None
        ctl.cache.request("code")
        ctl.cache.drain()
        assert ctl.cache.resident() == ["code"]
        ctl._sync_registry("")  # the entry itself is as the last sync saw it
        assert ctl.cache.resident() == []
    finally:
        ctl.close()


def test_a_goal_the_prefill_ends_waits_for_no_draft(target, drafts):
    """max_new_tokens 1 (a behaviour tree's yes/no): the prefill's token is the whole answer, so no draft is chosen,
    loaded or waited for on a cold cache; the answer is the target's."""
    registry = DraftRegistry([DraftEntry(n, f"/virtual/{n}", n, 1000) for n in drafts], validate=False)
    loads: list[str] = []

    def loader(name: str) -> LoadedModel:
        loads.append(name)
        model = drafts[name]
        return LoadedModel(model, ModelSpec(name), parameter_bytes(model), 64, 512)

    ctl = RuntimeController(RuntimeConfig(policy="memspec", capacity=2), target, None, registry,
                            FixedRanker(lambda c: list(drafts)), loader=loader, eos_token_ids=[])
    try:
        prompt = [1, 5, 7, 9, 11, 13]
        out = ctl.generate(prompt, 1)
        assert out.token_ids == target_greedy(target, prompt, 1) and out.finish_reason == "length"
        assert loads == [] and out.stats.predictions == 0 and out.stats.iterations == []
        assert len(ctl.generate(prompt, 8).token_ids) == 8 and loads  # a longer goal loads as before
    finally:
        ctl.close()


def test_a_smaller_budget_binds_the_draft_that_ran_last_idle_and_mid_goal(target, drafts, expected):
    """The draft that ran last stayed protected as 'active': after a goal (nothing decoding) a lowered
    memspec.budget_bytes left it resident over budget, and the next goal ran on it; mid-goal the running draft kept
    its slot past the new budget for the rest of the goal, and a draft that fits never loaded."""
    from memspec_ros.runtime.models import parameter_bytes

    def math_first(context):
        return ["math", "law", "code", "general"]

    small = parameter_bytes(drafts["general"]) + 10  # only the general draft fits
    ctl = make(target, drafts, "memspec", ranker=math_first, capacity=2)
    assert ctl.generate(PROMPT, NEW).token_ids == expected
    ctl.cache.drain()
    assert ctl.cache.snapshot().active == ""  # nothing decodes between goals
    ctl.reconfigure(budget_bytes=small)
    snap = ctl.cache.snapshot()
    assert snap.bytes_resident <= snap.budget_bytes and "math" not in snap.resident
    ctl.close()

    ctl = make(target, drafts, "memspec", ranker=math_first, capacity=2)
    seen = []

    def shrink_once(delta, ids):
        seen.extend(ids)
        if 6 <= len(seen) and ctl.config.budget_bytes == 0 and ctl.next_config.budget_bytes == 0:
            ctl.reconfigure(budget_bytes=small)

    result = ctl.generate(PROMPT, NEW, on_chunk=shrink_once)
    assert result.token_ids == expected
    ctl.cache.drain()
    snap = ctl.cache.snapshot()
    assert snap.bytes_resident <= snap.budget_bytes == small
    assert "math" not in {it.draft for it in result.stats.iterations[-3:]}
    ctl.close()


class CountingRanker(FixedRanker):
    """A fixed ranking that counts the generations it was begun on."""

    def __init__(self, fn) -> None:
        super().__init__(fn)
        self.begun = 0

    def begin(self, prompt_ids) -> None:
        self.begun += 1


def _switch_after(ctl, tokens: int, **changes):
    """An on_chunk that reconfigures once, after ``tokens`` generated tokens (a parameter set mid-goal)."""
    seen = []

    def on_chunk(delta, ids):
        seen.extend(ids)
        if len(seen) >= tokens and not on_chunk.done:
            on_chunk.done = True
            ctl.reconfigure(**changes)
    on_chunk.done = False
    return on_chunk


@pytest.mark.parametrize("overlap", [False, True])
def test_a_policy_taking_over_mid_goal_ranks_with_the_generations_predictor_not_a_restarted_one(
        target, drafts, expected, overlap):
    """memspec -> prediction-only mid-goal: the ranking model is begun once per generation (begun again, a
    target-hidden encoder dropped the rows of this generation), and an overlapped ranker answers the first point
    after the switch with its ranking, not registry order ('general' was preferred there, over 'law'); a policy
    with no predictor of its own (mab-async) leaves the ranking model begun for one that takes over."""
    ranker = CountingRanker(lambda context: ["law", "math", "code", "general"])
    ctl = RuntimeController(RuntimeConfig(policy="memspec", overlap_prediction=overlap), target, None,
                            registry_of(drafts), ranker, loader=Loader(drafts), eos_token_ids=[])
    result = ctl.generate(PROMPT, NEW, on_chunk=_switch_after(ctl, 6, policy="prediction-only"))
    assert result.token_ids == expected and result.stats.policy == "memspec>prediction-only"
    assert ranker.begun == 1
    assert {it.preferred for it in result.stats.iterations} == {"law"}
    ctl.reconfigure(policy="mab-async")
    result = ctl.generate(PROMPT, NEW, on_chunk=_switch_after(ctl, 6, policy="memspec"))
    assert result.token_ids == expected and result.stats.policy == "mab-async>memspec"
    assert ranker.begun == 2  # by the controller, at the generation's start
    ctl.close()


def test_general_draft_and_ucb_c_changed_mid_goal_reach_the_running_goal(target, drafts, expected):
    """Only a new policy name made the policy anew mid-goal: general-static went on with its old draft after
    memspec.general_draft changed (the config said the new one)."""
    ctl = make(target, drafts, "general-static")
    result = ctl.generate(PROMPT, NEW, on_chunk=_switch_after(ctl, 6, general_draft="math"))
    assert result.token_ids == expected and result.stats.policy == "general-static"
    assert result.stats.iterations[0].preferred == "general" and result.stats.iterations[-1].preferred == "math"
    ctl.close()


@pytest.mark.parametrize("policy", ["prediction-only", "memspec"])
def test_the_hit_rate_counts_one_lookup_of_the_preferred_draft_per_scheduling_point(target, drafts, policy):
    """A blocking load counted a miss in wait_for and then a hit in the get after it, and a fallback draft's get
    counted a hit: mab-sync loading at 7 of 8 points showed a hit rate of 0.53. With K = 1 and a favourite that
    changes at every point, each point asks for one draft that is not resident."""
    ctl = make(target, drafts, policy, loader=Loader(drafts, delay=0.01), capacity=1, interval=4)
    stats = ctl.generate(PROMPT, NEW).stats
    cache = stats.cache
    assert cache.hits + cache.misses == stats.predictions > 2
    assert cache.misses >= stats.predictions - 1 and cache.hit_rate <= 1 / stats.predictions
    ctl.close()


def test_a_failed_draft_given_other_files_is_tried_again_at_once(target, drafts, expected):
    """'math' failed to load from broken files; the operator points it at good ones (through the runtime API, as
    the node's registry swap does). The failure stayed recorded for the cache's retry back-off (30 s), so the
    next goal still ran without 'math' although the failure was about other files."""
    registry = DraftRegistry([DraftEntry("math", "/virtual/broken-math", "math", 1000),
                              DraftEntry("law", "/virtual/law", "law", 1000)], validate=False)

    def loader(name: str) -> LoadedModel:
        path = registry.get(name).path
        if "broken" in path:
            raise OSError(f"{path}: corrupt safetensors")
        return LoadedModel(drafts[name], ModelSpec(path), parameter_bytes(drafts[name]), 64, 512)

    ctl = RuntimeController(RuntimeConfig(policy="memspec", capacity=2, interval=2), target, None, registry,
                            FixedRanker(lambda c: ["math", "law"]), loader=loader, eos_token_ids=[])
    try:
        first = ctl.generate(PROMPT, NEW)
        assert "math" not in first.stats.drafts_used and "math" in ctl.cache.failed()
        registry.remove("math")
        registry.add(DraftEntry("math", "/virtual/math", "math", 1000))
        second = ctl.generate(PROMPT, NEW)
        assert second.token_ids == expected
        assert "math" in second.stats.drafts_used and "math" not in ctl.cache.failed()
    finally:
        ctl.close()


def test_a_goals_background_ranking_time_is_reported_by_that_goal(target, drafts):
    """The last scheduling point's background ranking was still running when the goal took its seconds, so they
    landed on the next goal (which waited for that ranking as it began): the first goal reported none."""
    def slow(context):
        time.sleep(0.05)
        return ["math", "law", "code", "general"]

    ctl = make(target, drafts, "memspec", ranker=slow, capacity=2, interval=1, overlap_prediction=True)
    try:
        for _ in range(2):
            stats = ctl.generate(PROMPT, 6).stats
            # interval 0 ranks on the decode thread; each later point starts a background ranking unless one is
            # still running, and every background ranking sleeps 50 ms: at least one ran in this goal
            assert stats.predictions >= 3 and stats.background_prediction_seconds >= 0.05
    finally:
        ctl.close()


def test_a_goal_that_raises_takes_its_background_ranking_time_with_it(target, drafts, monkeypatch):
    """A goal that raised mid-decode skipped the take of its rankers' background seconds: the next goal reported
    them as its own."""
    from memspec_ros.runtime.speculative import SpeculativeSession

    def slow(context):
        time.sleep(0.05)
        return ["math", "law", "code", "general"]

    ctl = make(target, drafts, "memspec", ranker=slow, capacity=2, interval=1, overlap_prediction=True)
    step, steps = SpeculativeSession.step, []

    def failing_step(self, *args, **kwargs):
        steps.append(1)
        if len(steps) == 4:  # after the background rankings of three scheduling points
            raise RuntimeError("the target ran out of memory")
        return step(self, *args, **kwargs)

    try:
        monkeypatch.setattr(SpeculativeSession, "step", failing_step)
        with pytest.raises(RuntimeError, match="out of memory"):
            ctl.generate(PROMPT, 40)
        monkeypatch.setattr(SpeculativeSession, "step", step)
        stats = ctl.generate(PROMPT, 1).stats  # one token: the prefill's, so no ranking of its own in background
        assert stats.background_prediction_seconds == 0.0
    finally:
        ctl.close()


def test_a_failure_before_the_prompt_cache_is_taken_raises_as_itself(target, drafts, monkeypatch):
    """A failure ahead of the prompt cache's take (the target's timing forward, a file check, a cache reset) read
    variables set only after it, so the goal failed with UnboundLocalError instead of its own error."""
    ctl = make(target, drafts, "general-static", capacity=1)

    def failing(adaptive=None):
        raise MemoryError("the timing forward's buffers")

    monkeypatch.setattr(ctl, "calibrate", failing)
    try:
        with pytest.raises(MemoryError, match="timing forward"):
            ctl.generate(PROMPT, 8)
        monkeypatch.undo()
        assert len(ctl.generate(PROMPT, 8).token_ids) > 0  # the controller is not left running
    finally:
        ctl.close()


def test_a_gamma_raised_mid_goal_is_calibrated_at_the_scheduling_point(target, drafts, monkeypatch, clock_jump):
    """Under adaptive gamma a larger gamma needs the target's longer forwards timed. Set mid-goal, only the
    session's gamma changed, and the timing (about a second) ran inside the next iteration's draft step, counted
    as decoding; it runs at the scheduling point that applies the change."""
    ctl = make(target, drafts, "general-static", capacity=1, interval=2, adaptive_gamma=True, gamma=2)
    calls, slow = [], 60.0  # seconds on the stopwatches' clock
    calibrate = ctl.calibrate

    def timed_calibrate(adaptive=None):
        calls.append(ctl.config.gamma)
        if len(calls) > 1:
            clock_jump(slow)  # a slow machine's timing: whatever it takes is no prediction
        return calibrate(adaptive)

    monkeypatch.setattr(ctl, "calibrate", timed_calibrate)
    raised, chunks = [], []

    def on_chunk(text, ids):
        chunks.append(ids)
        if len(chunks) == 2:  # after the first iteration (the first chunk, the prefill's, lands before the first
            raised.append(ctl.reconfigure(gamma=5))  # choice: its timing is setup)

    try:
        stats = ctl.generate(PROMPT, 30, on_chunk=on_chunk).stats
        assert calls == [2, 5]  # before the goal, then at the point that applied gamma 5
        # ... and its time is the point's, not prediction (the paper's overhead): the decode time's other part
        assert stats.prediction_seconds < slow <= stats.execution_parts()["other"]
    finally:
        ctl.close()


@pytest.mark.parametrize("adaptive_before", [True, False])
def test_adaptive_gamma_switched_mid_goal_calibrates_as_the_running_goal_adapts(target, drafts, monkeypatch,
                                                                                 adaptive_before):
    """adaptive_gamma applies from the next goal, but the scheduling point that applied a change calibrated by the
    new setting: switched off with a larger gamma, the running goal (still adapting) timed the longer forwards
    inside an iteration; switched on, the point timed forwards no one would use."""
    from memspec_ros.runtime import controller as controller_module

    timed = []
    monkeypatch.setattr(controller_module, "target_costs", lambda model, gamma: timed.append(gamma))
    ctl = make(target, drafts, "general-static", capacity=1, interval=2, adaptive_gamma=adaptive_before, gamma=2)
    timed.clear()
    changed = []

    def on_chunk(text, ids):
        if not changed:
            changed.append(ctl.reconfigure(gamma=5, adaptive_gamma=not adaptive_before))

    try:
        ctl.generate(PROMPT, 30, on_chunk=on_chunk)
        # before the goal as configured then; at the point as the goal that runs on adapts
        assert timed == ([2, 5] if adaptive_before else [])
    finally:
        ctl.close()


def test_a_file_recheck_asked_for_during_a_generation_runs_when_the_next_one_starts(target, drafts, monkeypatch):
    """The node evicts drafts whose files changed when the registry is set; while a goal ran it could not (the
    cache is in use), and the request was dropped: replaced files were reloaded or not depending on timing."""
    ctl = make(target, drafts, "general-static")
    checked = []
    monkeypatch.setattr(ctl.cache, "evict_changed", lambda: checked.append(ctl.cache.resident()) or [])
    ctl.generate(PROMPT, 4)
    assert checked == []
    ctl.recheck_files_later()
    ctl.generate(PROMPT, 4)
    assert len(checked) == 1  # once, at the start of the next generation
    ctl.generate(PROMPT, 4)
    assert len(checked) == 1
    ctl.close()


class BlockedLoader(Loader):
    """Loads only once ``release`` is set (storage slower than any wait a test would time)."""

    def __init__(self, drafts):
        super().__init__(drafts)
        self.release, self.started = threading.Event(), threading.Event()

    def __call__(self, name):
        self.asked = getattr(self, "asked", None) or name
        self.started.set()
        assert self.release.wait(60), "the test never released the load"
        return super().__call__(name)


@pytest.mark.parametrize("policy", ["mab-sync", "prediction-only", "memspec"])
def test_a_cancel_does_not_sit_out_a_blocking_draft_load(target, drafts, policy):
    """should_cancel was polled only by the decode loop: a goal cancelled (a behaviour tree's halt) while its first
    draft loaded from slow storage kept the node's one generation until that load ended. The wait gives up; the load
    goes on, and the draft is resident for the next goal."""
    loader = BlockedLoader(drafts)
    ctl = make(target, drafts, policy, loader=loader, capacity=2)
    try:
        result = ctl.generate(PROMPT, NEW, should_cancel=loader.started.is_set)  # cancelled once the load began
        assert not loader.release.is_set() and result.finish_reason == "cancelled"  # returned with the load held
        assert len(result.token_ids) <= 1  # the prefill's token at most
        loader.release.set()
        assert ctl.cache.wait_for(loader.asked)[0] is not None and ctl.cache.is_resident(loader.asked)
    finally:
        loader.release.set()
        ctl.close()
    # cancelled before it starts: no draft is chosen or loaded
    ctl = make(target, drafts, policy, loader=Loader(drafts), capacity=2)
    result = ctl.generate(PROMPT, NEW, should_cancel=lambda: True)
    assert result.finish_reason == "cancelled" and ctl.cache.resident() == []
    ctl.close()


def test_a_goal_cancelled_while_it_is_prepared_runs_no_prefill(target, drafts, expected, monkeypatch):
    """The cache reset of reset_cache_per_generation stops waiting for a slow read at a cancel, but the goal went on
    to its prefill, the target over the whole prompt (seconds for a long one), before the decode loop's first check
    ended it: ahead of the queued goals and a deactivate's wait. A goal cancelled before its prefill ends with no
    token and no forward; the next goal is served as ever."""
    from memspec_ros.runtime import speculative

    forwards = []
    real = speculative._forward
    monkeypatch.setattr(speculative, "_forward", lambda model, *a: forwards.append(model) or real(model, *a))
    ctl = make(target, drafts, "general-static", general_draft="math", reset_cache_per_generation=True)
    try:
        cancelled = {"now": False}
        reset = ctl.cache.reset

        def reset_then_cancel(stop=None, timeout=None):  # the cancel comes while the reset waits
            cancelled["now"] = True
            return reset(stop, timeout)

        ctl.cache.reset = reset_then_cancel
        result = ctl.generate(PROMPT, NEW, should_cancel=lambda: cancelled["now"])
        assert result.finish_reason == "cancelled" and result.token_ids == []
        assert forwards == []  # neither the target's prefill nor a draft
        assert result.stats.time_to_first_token == 0.0  # no token: not its preparation time (Generate.action)
        cancelled["now"] = False
        assert ctl.generate(PROMPT, NEW).token_ids == expected
    finally:
        ctl.close()


def test_a_draft_that_fails_mid_interval_hands_the_rest_of_it_to_the_next_resident_draft(target, drafts, expected,
                                                                                          monkeypatch):
    """A draft failing while it proposed left the target decoding alone until the next scheduling point (N up to
    1024) although the Choice's next draft was resident: that one runs the rest of the interval."""
    from memspec_ros.runtime import speculative

    real, calls, made = speculative._forward, [], []

    def math_fails_once(model, *args):
        logits = real(model, *args)
        if model is drafts["math"]:
            calls.append(1)
            if len(calls) == 3:
                # code's prefetch (started at the first scheduling point, on the loader thread) has landed: what
                # the fallback is about, whatever this machine's timing
                wait_until(lambda: made[0].cache.is_resident("code"), 30.0, "code's prefetch")
                return torch.full_like(logits, float("nan"))
        return logits

    monkeypatch.setattr(speculative, "_forward", math_fails_once)
    ctl = make(target, drafts, "memspec", capacity=2, interval=16,
               ranker=lambda context: ["math", "code", "law", "general"])
    made.append(ctl)
    result = ctl.generate(PROMPT, NEW)
    assert result.token_ids == expected
    its = result.stats.iterations
    failed = next(i for i, it in enumerate(its) if it.draft == "" and it.fallback)
    rest = [it.draft for it in its[failed + 1:16]]  # the same interval after the failure
    assert rest and set(rest) == {"code"}, [it.draft for it in its]
    ctl.close()


def test_the_cache_asks_the_registry_whether_a_landing_loads_path_is_still_its_names(target, drafts):
    """The controller answers the cache's question as a load lands (test_runtime_cache: a path changed and changed
    back while the load ran): the entry's path now, and a name removed meanwhile is left to the sync."""
    ctl = make(target, drafts, "general-static")
    try:
        check = ctl.cache.source_current
        assert check("code", "/virtual/code") is True and check("code", "/virtual/code-v2") is False
        assert check("no-such-draft", "/anywhere") is True
    finally:
        ctl.close()


def test_a_request_of_the_wrong_type_is_refused_before_it_takes_anything(target, drafts):
    """max_new_tokens nan passed "< 1" and ran with no length limit, 2.5 failed mid-goal after the prefill had
    streamed; a bytes prompt was decoded as its byte values, 3.7 was taken as 3; sampling=None raised an
    AttributeError in the session (after the conversation's prompt-cache entry had been taken: test_prompt_cache);
    a general_draft typo ran another draft; gamma 2.5 failed in the first proposal and True meant 1."""
    from memspec_ros.runtime.speculative import generate

    ctl = make(target, {"general": drafts["general"]}, "general-static", capacity=1)
    try:
        first = ctl.generate(PROMPT, 4)
        for changes, said in (({"max_new_tokens": float("nan")}, "max_new_tokens must be an integer"),
                              ({"max_new_tokens": 2.5}, "max_new_tokens must be an integer"),
                              ({"max_new_tokens": True}, "max_new_tokens must be an integer"),
                              ({"sampling": None}, "sampling must be a SamplingConfig")):
            with pytest.raises((ValueError, TypeError), match=said):
                ctl.generate(PROMPT, **({"max_new_tokens": 4} | changes))
        for prompt in (b"\x01\x05", [1, 3.7], [1, True]):
            with pytest.raises(TypeError, match="bytes|integers"):
                ctl.generate(prompt, 4)
        assert ctl.generate(torch.tensor(PROMPT), 4).token_ids == first.token_ids  # a tensor's ids are ints
        with pytest.raises(PolicyError, match="'genral' is not in the draft registry"):
            ctl.reconfigure(general_draft="genral")
        assert ctl.config.general_draft == "general"
    finally:
        ctl.close()
    for gamma in (2.5, True):
        with pytest.raises(ValueError, match="must be an integer"):
            generate(target, PROMPT, drafts["general"], max_new_tokens=4, gamma=gamma)


def test_load_runtime_refuses_a_ranking_policy_without_a_predictor_before_loading(tmp_path, monkeypatch):
    """The default policy, memspec, ranks with a trained predictor: without predictor_path the target and every
    draft were loaded before the refusal."""
    from memspec_ros.runtime.controller import load_runtime
    from memspec_ros.runtime.policies import PolicyError

    monkeypatch.setattr("memspec_ros.runtime.loader.load_models",
                        lambda *a, **k: pytest.fail("models loaded before the policy was checked"))
    with pytest.raises(PolicyError, match="policy memspec ranks the drafts with a trained predictor"):
        load_runtime(RuntimeConfig(), str(tmp_path / "registry.yaml"))


def test_a_blocking_switch_holds_no_evicted_draft_while_it_waits(target, drafts):
    """K = 1: a blocking load's wait kept the run's reference to the draft the cache had just evicted for it, so
    two drafts were in memory at once (the cache's limits are to hold at every instant)."""
    import copy
    import gc
    import weakref

    made: list[weakref.ref] = []  # every model handed out
    alive_at_load: list[int] = []

    def loader(name):
        gc.collect()
        alive_at_load.append(sum(r() is not None for r in made))
        model = copy.deepcopy(drafts[name])
        made.append(weakref.ref(model))
        return LoadedModel(model, ModelSpec(name), parameter_bytes(model), 64, 512)

    ctl = make(target, drafts, "mab-sync", loader=loader, capacity=1, interval=1)
    try:
        ctl.generate(PROMPT, NEW)
        assert len(alive_at_load) >= 2  # it switched
        assert alive_at_load == [0] * len(alive_at_load)
    finally:
        ctl.close()
