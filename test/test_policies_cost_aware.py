"""memspec-cost-aware: a switch or a prefetch happens only when its predicted gain pays for its cost.

The policy is driven directly with scheduling points and iteration records, so every quantity it
measures is set by the test; nothing is timed.
"""

from __future__ import annotations

from memspec_ros.runtime.choice import CACHE_PREFETCH
from memspec_ros.runtime.policies import COST_AWARE, MemSpecPolicy, SchedulingPoint, make_policy
from memspec_ros.runtime.predictor import FixedRanker
from memspec_ros.runtime.stats import IterationStats

DRAFTS = ["general", "code", "math"]
PROMPT = list(range(50))
N = 4


def ranker(probs: dict[str, float]) -> FixedRanker:
    return FixedRanker(lambda context: dict(probs))


def point(interval: int, generated: int, active: str, resident: list[str], budget: int = 128) -> SchedulingPoint:
    gen = list(range(generated))
    return SchedulingPoint(interval=interval, prompt_ids=PROMPT, generated_ids=gen, recent_ids=gen[-32:],
                           candidates=DRAFTS, domains={d: d for d in DRAFTS}, resident=resident, active=active,
                           max_new_tokens=budget)


def interval_of(draft: str, accepted: int = 1, catchup_tokens: int = 0, catchup_seconds: float = 0.0,
                seconds: float = 0.1) -> list[IterationStats]:
    """N iterations of ``draft``, each accepting ``accepted`` of 4 proposals; the first one caught up."""
    its = []
    for i in range(N):
        it = IterationStats(draft=draft, proposed=4, accepted=accepted, committed=accepted + 1,
                            draft_seconds=seconds * 0.1, verify_seconds=seconds * 0.9)
        if i == 0 and catchup_tokens:
            it.catchup_tokens, it.catchup_seconds = catchup_tokens, catchup_seconds
        its.append(it)
    return its


def started(probs: dict[str, float], catchup_seconds_per_token: float, seconds: float = 0.1):
    """A cost-aware policy after its first choice and one interval of ``general`` (catch-up over the prompt)."""
    policy = make_policy(COST_AWARE, predictor=ranker(probs))
    policy.start(PROMPT)
    policy.choose(point(0, 0, "", []))
    policy.observe("general", interval_of("general", catchup_tokens=len(PROMPT) + 1,
                                          catchup_seconds=catchup_seconds_per_token * (len(PROMPT) + 1),
                                          seconds=seconds))
    return policy


def test_its_first_choice_is_memspecs():
    probs = {"code": 0.6, "math": 0.3, "general": 0.1}
    cost_aware = make_policy(COST_AWARE, predictor=ranker(probs))
    memspec = MemSpecPolicy(ranker(probs))
    for p in (cost_aware, memspec):
        p.start(PROMPT)
    a, b = cost_aware.choose(point(0, 0, "", [])), memspec.choose(point(0, 0, "", []))
    assert a == b  # the same draft, ranking, blocking, fallback order and cache action


def test_a_cheap_switch_with_a_clear_margin_is_taken():
    policy = started({"code": 0.8, "general": 0.1, "math": 0.1}, catchup_seconds_per_token=1e-5)
    choice = policy.choose(point(1, 10, "general", ["general", "code"]))
    assert choice.preferred == "code" and choice.cache_action == CACHE_PREFETCH and not choice.block


def test_a_switch_whose_catch_up_costs_more_than_it_gains_is_declined():
    # the same margin; a catch-up over the context now costs many iterations' worth of tokens
    policy = started({"code": 0.8, "general": 0.1, "math": 0.1}, catchup_seconds_per_token=0.05)
    choice = policy.choose(point(1, 10, "general", ["general", "code"]))
    assert choice.preferred == "general"
    # and MemSpec, which does not weigh costs, switches
    memspec = MemSpecPolicy(ranker({"code": 0.8, "general": 0.1, "math": 0.1}))
    memspec.start(PROMPT)
    assert memspec.choose(point(1, 10, "general", ["general", "code"])).preferred == "code"


def test_near_the_end_of_the_budget_nothing_pays():
    probs = {"code": 0.8, "general": 0.1, "math": 0.1}
    early = started(probs, catchup_seconds_per_token=2e-3).choose(point(1, 10, "general", ["general", "code"]))
    late = started(probs, catchup_seconds_per_token=2e-3).choose(point(1, 124, "general", ["general", "code"]))
    assert early.preferred == "code" and late.preferred == "general"


def test_a_small_margin_does_not_move_the_cache():
    """Without a draft worth prefetching, the resident set stays: the ranking handed to the cache puts
    every resident draft before any non-resident one, so W = top-K evicts nothing."""
    policy = started({"math": 0.36, "general": 0.35, "code": 0.29}, catchup_seconds_per_token=1e-3)
    choice = policy.choose(point(1, 10, "general", ["general", "code"]))
    assert choice.preferred == "general"
    order = [d for d, _ in choice.ranking]
    assert set(order[:2]) == {"general", "code"}  # K = 2: the resident pair is W; math is not loaded


def test_a_worthwhile_non_resident_draft_is_prefetched_and_the_active_one_runs_meanwhile():
    policy = started({"math": 0.9, "general": 0.05, "code": 0.05}, catchup_seconds_per_token=1e-5)
    choice = policy.choose(point(1, 10, "general", ["general", "code"]))
    order = [d for d, _ in choice.ranking]
    assert choice.preferred == "math" and order[:2] == ["math", "general"]  # W = {math, general}: code goes
    # its load is measured: asked at point 1, resident at point 3 -> two intervals of N iterations (after the
    # runner-up MemSpec's first choice prefetched: asked at point 0, resident at point 1)
    policy.observe("general", interval_of("general"))
    policy.choose(point(2, 20, "general", ["general"]))
    policy.observe("general", interval_of("general"))
    policy.choose(point(3, 30, "general", ["general", "math"]))
    assert policy._load_iterations == [N, 2 * N]


def test_on_a_warm_cache_the_first_drafts_background_load_is_measured_too():
    """A warm start: the top draft is not resident and loads in the background while general runs, so the
    points until it is resident are a prefetch's load time; on a cold cache that first load is waited for and
    only the runner-up's prefetch is measured."""
    probs = {"code": 0.6, "math": 0.3, "general": 0.1}
    warm = make_policy(COST_AWARE, predictor=ranker(probs))
    warm.start(PROMPT)
    assert not warm.choose(point(0, 0, "", ["general"])).block
    warm.observe("general", interval_of("general", catchup_tokens=len(PROMPT) + 1, catchup_seconds=1e-3))
    warm.choose(point(1, 10, "general", ["general", "math"]))  # math landed: asked at 0, resident at 1
    warm.observe("general", interval_of("general"))
    warm.choose(point(2, 20, "general", ["general", "math", "code"]))  # code: asked at 0, resident at 2
    assert sorted(warm._load_iterations) == [N, 2 * N]
    cold = make_policy(COST_AWARE, predictor=ranker(probs))
    cold.start(PROMPT)
    assert cold.choose(point(0, 0, "", [])).block
    assert set(cold._asked) == {"math"}


def test_the_catch_up_a_returning_draft_needs_is_what_it_missed():
    """A draft that ran and stayed resident only catches up on the tokens since; an evicted one on everything."""
    policy = started({"code": 0.5, "general": 0.45, "math": 0.05}, catchup_seconds_per_token=1e-3)
    probs = {"code": 0.5, "general": 0.45, "math": 0.05}
    # general is active at 10 tokens; code never ran: it must catch up on the whole context
    never_ran = policy.values(point(1, 10, "general", ["general", "code"]), probs)["code"]
    policy._kv["code"] = len(PROMPT) + 8  # code ran until 2 tokens ago and stayed resident
    returning = policy.values(point(1, 10, "general", ["general", "code"]), probs)["code"]
    assert returning > never_ran


def test_with_a_full_cache_it_stays_on_the_active_draft_while_the_preferred_one_loads():
    """The preferred draft not resident, another resident one worth a switch, the cache full (K = 2): the order
    [preferred, other, active] left the load only the active draft's slot, which the cache never evicts, so the
    prefetch never started, yet its load was timed from then. It stays on the active draft; the other goes."""
    import dataclasses

    policy = started({"math": 0.6, "code": 0.3, "general": 0.1}, catchup_seconds_per_token=1e-5)
    full = dataclasses.replace(point(1, 10, "general", ["general", "code"]), capacity=2)
    choice = policy.choose(full)
    order = [d for d, _ in choice.ranking]
    assert choice.preferred == "math" and order[:2] == ["math", "general"], order


def test_a_catch_up_whose_proposal_was_dropped_still_prices_a_switch():
    """Adaptive gamma can drop a caught-up draft's only proposal (proposed 0): that iteration's catch-up was left
    out, the catch-up seemed free, and every ranking margin switched."""
    from memspec_ros.runtime.stats import IterationStats

    probs = {"code": 0.8, "general": 0.1, "math": 0.1}
    policy = make_policy(COST_AWARE, predictor=ranker(probs))
    policy.start(PROMPT)
    policy.choose(point(0, 0, "", []))
    caught_up = IterationStats(draft="general", proposed=0, accepted=0, committed=1, draft_seconds=0.0,
                               verify_seconds=0.09, catchup_tokens=len(PROMPT) + 1,
                               catchup_seconds=0.05 * (len(PROMPT) + 1))
    policy.observe("general", [caught_up, *interval_of("general")[1:]])
    assert policy.choose(point(1, 10, "general", ["general", "code"])).preferred == "general"  # as when it proposed


def test_loads_are_measured_in_iterations_whatever_n_was_when_they_ran():
    """N reduced mid-goal (a parameter change): the policy kept the largest interval it had seen and converted a
    load's scheduling points to iterations with it, so every load looked N_old/N_new times longer. Converting
    with the new N instead would have made a load measured under the old one look shorter. A load is measured in
    the iterations it took, and an unmeasured one is expected in one interval of the N in force."""
    probs = {"code": 0.5, "math": 0.4, "general": 0.1}
    per_token = 1e-5
    first = interval_of("general", catchup_tokens=len(PROMPT) + 1, catchup_seconds=per_token * (len(PROMPT) + 1))

    def run(intervals: list[list[IterationStats]], resident: list[str]):
        policy = make_policy(COST_AWARE, predictor=ranker(probs))
        policy.start(PROMPT)
        policy.choose(point(0, 0, "", resident))
        for i, its in enumerate(intervals):
            policy.observe("general", its)
            policy.choose(point(i + 1, 10, "general", ["general", *resident]))
        return policy

    at = point(9, 10, "general", ["general", "code"])  # math not resident: its load is one interval away
    # nothing measured (both resident at the first choice): the default delay is the interval in force
    shortened = run([first, first[:1]], ["code", "math"])  # N = 4, then N = 1
    short_all_along = run([first[:1], first[1:2], first[2:3], first[3:4], first[:1]], ["code", "math"])
    assert shortened.values(at, probs)["math"] == short_all_along.values(at, probs)["math"]
    assert run([first, first], ["code", "math"]).values(at, probs)["math"] < shortened.values(at, probs)["math"]
    # a load measured under N = 4 (asked at the first choice, resident one interval later) stays 4 iterations long
    measured = make_policy(COST_AWARE, predictor=ranker(probs))
    measured.start(PROMPT)
    measured.choose(point(0, 0, "", ["general"]))  # code and math asked for
    measured.observe("general", first)
    measured.choose(point(1, 10, "general", ["general", "code", "math"]))
    measured.observe("general", first[:1])  # N = 1 from here
    assert measured._load_iterations == [N, N]


def test_a_draft_whose_kv_the_prompt_cache_kept_is_priced_for_what_it_lacks_only():
    """In a chat turn, a draft that ran in the turn before starts from the prompt cache's prefix; the rule priced
    its catch-up over the whole context and declined switches that paid. The point carries what each draft's KV
    cache holds."""
    probs = {"code": 0.8, "general": 0.1, "math": 0.1}
    policy = started(probs, catchup_seconds_per_token=0.05)
    at = point(1, 10, "general", ["general", "code"])
    assert policy.choose(at).preferred == "general"  # no count: the whole context to catch up, declined
    policy = started(probs, catchup_seconds_per_token=0.05)
    at.draft_context = {"general": len(PROMPT) + 9, "code": len(PROMPT) + 8}  # code's KV: all but two tokens
    assert policy.choose(at).preferred == "code"
    policy = started(probs, catchup_seconds_per_token=0.05)
    at.draft_context = {"general": len(PROMPT) + 9, "math": len(PROMPT) + 8}  # held by another draft: no help
    assert policy.choose(at).preferred == "general"
