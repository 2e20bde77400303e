"""A policy's Choice says whether to block and in which order to fall back; carry_out does just that.

The Choices come from the real policies; they are carried out on the simulator's cache in virtual time,
so nothing here is timed.
"""

from __future__ import annotations

import pytest

from memspec_ros.runtime.choice import CACHE_NONE, CACHE_PREFETCH, CACHE_REQUEST, Choice, carry_out
from memspec_ros.runtime.oracle import ScheduleCosts
from memspec_ros.runtime.policies import POLICIES, SchedulingPoint, make_policy, request_choice, wait_choice
from memspec_ros.runtime.predictor import FixedRanker
from memspec_ros.runtime.simulator import PromptTrace, SimCache

DRAFTS = ["general", "code", "math"]
PROMPT = [1, 2, 3, 4]
BLOCKING = {"general-static", "oracle-static", "mab-sync"}  # prediction-only requests, as the paper's


class Clock:
    now = 0.0

    def __call__(self) -> float:
        return self.now


def point(interval: int, active: str = "", resident: tuple[str, ...] = (), wait_first: bool = False) -> SchedulingPoint:
    generated = list(range(5 * interval))
    return SchedulingPoint(interval=interval, prompt_ids=PROMPT, generated_ids=generated, recent_ids=generated[-8:],
                           candidates=list(DRAFTS), domains={d: d for d in DRAFTS}, resident=list(resident),
                           active=active, max_new_tokens=40, wait_for_initial_draft=wait_first)


def recording_wait(cache: SimCache, clock: Clock, waits: list[str]):
    """carry_out's ``wait`` on the simulated cache: blocks in virtual time and records which drafts it waited for."""

    def wait(name: str) -> float:
        waited = cache.wait_for(name)
        waits.append(name)
        clock.now += waited + 1e-9
        return waited

    return wait


def policies():
    trace = PromptTrace("w", PROMPT, list(range(40)), {d: [i % (2 + k) > 0 for i in range(40)]
                                                     for k, d in enumerate(DRAFTS)})
    oracle = trace.oracle(40, 4, 2, ScheduleCosts(capacity=2, iteration_seconds=1.0, catchup_seconds=0.1,
                                                  load_seconds=dict.fromkeys(DRAFTS, 0.5)))
    ranker = FixedRanker(lambda context: {"code": 0.6, "math": 0.3, "general": 0.1})
    for name in POLICIES:
        yield name, make_policy(name, predictor=ranker, oracle_for=lambda ids: oracle)


def test_every_policys_first_draft_blocks_and_later_ones_only_if_the_policy_blocks():
    for name, policy in policies():
        policy.start(PROMPT)
        first = policy.choose(point(0))
        assert first.block and first.preferred, name  # Algorithm 3, line 3: whatever the policy's way
        later = policy.choose(point(1, "general", ("general",)))
        if name in BLOCKING:
            assert later.block and later.cache_action == CACHE_NONE, name
        elif name in ("memspec", "oracle-next-interval", "mab-async", "prediction-only"):
            assert not later.block, name
            requests = name in ("mab-async", "prediction-only")  # the one draft on demand, not the top K
            assert later.cache_action == (CACHE_REQUEST if requests else CACHE_PREFETCH), name
        if later.preferred != "general":
            assert "general" in later.fallback, name  # the current draft is always a fallback


def test_on_a_warm_cache_only_blocking_policies_wait_for_the_first_draft():
    """A generation that starts with a draft resident (the node keeps its cache between goals): the policies
    that never stall run it while their choice loads; the blocking ones, and every policy configured with
    wait_for_initial_draft, still wait."""
    for name, policy in policies():
        policy.start(PROMPT)
        warm = policy.choose(point(0, resident=("general",)))
        assert warm.preferred, name
        if name in BLOCKING:
            assert warm.block, name
        elif name in ("memspec", "memspec-cost-aware", "oracle-next-interval", "mab-async", "prediction-only"):
            assert not warm.block and "general" in warm.fallback, name
        policy.start(PROMPT)
        assert policy.choose(point(0, resident=("general",), wait_first=True)).block, name


def test_a_warm_first_choice_runs_the_best_resident_draft_and_keeps_it_while_the_top_k_load():
    """MemSpec's first choice, both slots held by drafts outside its top K: the best resident draft by the
    ranking runs and is protected like an active draft; the other slot makes room for the top draft."""
    clock = Clock()
    cache = SimCache(2, lambda name: 1.0, clock)
    for name in ("general", "math"):
        cache.request(name)
        clock.now += 1.5
    cache.set_active("general")  # the last goal's draft
    ranking = [("code", 3.0), ("law", 2.0), ("math", 1.0), ("general", 0.5)]
    choice = Choice("code", block=False, fallback=("code", "law", "math", "general"), cache_action=CACHE_PREFETCH,
                    ranking=ranking)
    resolution = carry_out(choice, cache, wait=pytest.fail, first=True)
    assert (resolution.draft, resolution.preferred, resolution.fallback, resolution.waited) == ("math", "code", True,
                                                                                               0.0)
    assert cache.is_resident("math") and cache.is_available("code") and not cache.is_available("general")


@pytest.mark.parametrize("action", [CACHE_PREFETCH, CACHE_REQUEST])
def test_a_later_point_keeps_the_best_resident_draft_not_the_one_that_ran(action):
    """K = 2, {math, general} resident, general ran the last interval, ranking code law math general: the cache
    action kept general (it had run) and evicted math to load code, so general, ranked last, ran the next interval
    although math was resident at the point. The draft kept is the one that runs next."""
    clock = Clock()
    cache = SimCache(2, lambda name: 1.0, clock)
    for name in ("general", "math"):
        cache.request(name)
        clock.now += 1.5
    cache.set_active("general")
    ranking = [("code", 3.0), ("law", 2.0), ("math", 1.0), ("general", 0.5)]
    choice = Choice("code", block=False, fallback=("code", "law", "math", "general"), cache_action=action,
                    ranking=ranking)
    resolution = carry_out(choice, cache, wait=pytest.fail, current="general")
    assert (resolution.draft, resolution.fallback, resolution.waited) == ("math", True, 0.0)
    assert cache.is_resident("math") and cache.is_available("code") and not cache.is_available("general")


@pytest.mark.parametrize("action", [CACHE_PREFETCH, CACHE_REQUEST])
def test_a_warm_first_choice_with_no_room_beside_the_resident_draft_waits_for_its_draft(action):
    """K = 1: the resident draft, once running, could not be evicted for the choice, so it would run the whole
    generation; carry_out waits for the choice instead (evicting the idle draft), as on a cold cache."""
    clock = Clock()
    cache = SimCache(1, lambda name: 1.0, clock)
    cache.request("general")
    clock.now = 2.0
    waits: list[str] = []
    wait = recording_wait(cache, clock, waits)

    ranking = [("code", 2.0), ("general", 1.0)]
    choice = Choice("code", block=False, fallback=("code", "general"), cache_action=action, ranking=ranking)
    resolution = carry_out(choice, cache, wait=wait, first=True)
    assert waits == ["code"] and resolution.waited == pytest.approx(1.0)
    assert (resolution.draft, resolution.fallback) == ("code", False) and cache.resident() == ["code"]


@pytest.mark.parametrize("action", [CACHE_PREFETCH, CACHE_REQUEST])
def test_a_later_non_blocking_choice_with_no_draft_running_never_waits(action):
    """Mid-generation the target may decode alone (its draft removed, failed or evicted): a non-blocking choice
    then runs what is resident meanwhile, even with no room for its draft, instead of waiting as a first
    choice does."""
    clock = Clock()
    cache = SimCache(1, lambda name: 1.0, clock)
    cache.request("general")
    clock.now = 2.0
    choice = Choice("code", block=False, fallback=("code", "general"), cache_action=action,
                    ranking=[("code", 2.0), ("general", 1.0)])
    resolution = carry_out(choice, cache, wait=pytest.fail)
    assert resolution.waited == 0.0 and resolution.preferred == "code" and resolution.fallback


def test_a_blocking_prefetch_choice_evicts_by_its_own_ranking_not_the_last_goals():
    """A first choice that blocks and then prefetches (MemSpec told to wait for its first draft, Oracle-Dynamic's
    planned first draft): its load must evict the draft its ranking drops. The prefetch sets the scores only after
    the load, so the last goal's scores chose the victim: here the draft the new ranking keeps."""
    clock = Clock()
    cache = SimCache(2, lambda name: 1.0, clock)
    for name in ("a", "b"):
        cache.request(name)
        clock.now += 1.5
    cache.set_scores([("a", 2.0), ("b", 1.0)])  # the last goal's
    waits: list[str] = []
    choice = Choice("c", block=True, fallback=("c", "b"), cache_action=CACHE_PREFETCH, ranking=[("c", 3.0), ("b", 2.0)])
    resolution = carry_out(choice, cache, wait=recording_wait(cache, clock, waits), first=True)
    assert waits == ["c"] and resolution.draft == "c"
    assert sorted(cache.resident()) == ["b", "c"]


def test_mab_async_decodes_on_the_current_draft_while_its_choice_loads():
    clock = Clock()
    cache = SimCache(2, lambda name: 1.0, clock)
    cache.request("math")
    clock.now = 2.0
    ranking = [("code", 3.0), ("general", 2.0), ("math", 1.0)]
    cache.request("general")
    clock.now = 4.0
    assert sorted(cache.resident()) == ["general", "math"]
    choice = request_choice(point(1, active="math", resident=("general", "math")), "code", ranking)
    assert choice.fallback[0] == "math" and not choice.block
    resolution = carry_out(choice, cache, wait=pytest.fail, current="math")
    # math goes on although general ranks above it; code loads in the background in general's slot
    assert (resolution.draft, resolution.preferred, resolution.fallback, resolution.waited) == ("math", "code", True,
                                                                                               0.0)
    assert cache.is_available("code") and not cache.is_available("general")


def test_a_blocking_choice_waits_for_its_draft_and_runs_it():
    clock = Clock()
    cache = SimCache(1, lambda name: 1.5, clock)
    waits: list[str] = []
    wait = recording_wait(cache, clock, waits)

    choice = wait_choice(point(2, active=""), "code", [("code", 1.0), ("math", 0.5)])
    resolution = carry_out(choice, cache, wait=wait)
    assert waits == ["code"] and resolution.waited == pytest.approx(1.5)
    assert (resolution.draft, resolution.fallback, resolution.model) == ("code", False, "code")


def test_no_draft_means_the_target_alone_and_a_bad_cache_action_is_refused():
    cache = SimCache(2, lambda name: 1.0, Clock())
    resolution = carry_out(Choice("", block=True), cache, wait=pytest.fail)
    assert (resolution.draft, resolution.model, resolution.fallback) == ("", None, False)
    with pytest.raises(ValueError, match="cache_action"):
        Choice("code", cache_action="wait")


def test_the_simulated_cache_drops_a_queued_prefetch_that_left_the_working_set_as_the_real_one_does():
    """runtime/cache.py's update() now cancels a prefetch still queued for a draft that left W; the simulator's cache
    ran it, so sweeps at K >= 3 replayed loads the real runs no longer make."""
    clock = Clock()
    clock.now = 0.0
    cache = SimCache(3, lambda name: 1.0, clock)
    cache.update([("general", 3.0), ("code", 2.0), ("math", 1.0)])  # general reads 0-1, code 1-2, math 2-3
    clock.now = 0.5
    cache.update([("general", 3.0), ("law", 2.0), ("medical", 1.0)])
    assert sorted(cache.loading()) == ["general", "law", "medical"] and cache.loads == 3
    clock.now = 3.0 + 1e-6  # law read 1-2 and medical 2-3, right behind general
    assert sorted(cache.resident()) == ["general", "law", "medical"]
