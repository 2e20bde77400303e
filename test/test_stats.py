"""GenerationStats and CacheStats on hand-built records: every expected number below is worked out
by hand in the comments, so a wrong formula (denominator, filter, sum) fails here, not in a benchmark."""

from __future__ import annotations

import pytest

from memspec_ros.runtime.stats import CacheStats, GenerationStats, GenerationTotals, IterationStats


def it(draft, proposed, accepted, committed, *, preferred="", fallback=False, draft_s=0.0, verify_s=0.0,
       catchup_s=0.0, catchup_tokens=0, prediction_s=0.0, wait_s=0.0) -> IterationStats:
    return IterationStats(draft=draft, proposed=proposed, accepted=accepted, committed=committed,
                          draft_seconds=draft_s, verify_seconds=verify_s, catchup_tokens=catchup_tokens,
                          catchup_seconds=catchup_s, preferred=preferred, fallback=fallback,
                          prediction_seconds=prediction_s, load_wait_seconds=wait_s)


@pytest.fixture
def stats() -> GenerationStats:
    """Five iterations of the kinds the controller records (times are exact binary fractions):

    #  draft  preferred  fallback  proposed accepted committed  seconds (draft+verify+catchup+pred+wait)
    1  a      a          no        4        2        3          0.25 + 0.25                    = 0.5
    2  b      a          yes       4        1        2          0.125 + 0.25 + 0.125 (catchup) = 0.5
    3  -      a          yes       0        0        1          0.25 verify + 0.25 wait        = 0.5
       (a target-only step: nothing resident; the controller marks it a fallback)
    4  a      a          no        3        3        4          0.25 + 0.25 + 0.5 (prediction) = 1.0
    5  b      -          no        4        0        1          0.25 + 0.25                    = 0.5
       (no preference: the engine alone, no policy)
    """
    s = GenerationStats(prompt_tokens=7, completion_tokens=12, prefill_seconds=0.5, setup_seconds=0.5,
                        start_seconds=0.125, decode_seconds=2.0, finish_reason="length")
    s.iterations = [
        it("a", 4, 2, 3, preferred="a", draft_s=0.25, verify_s=0.25),
        it("b", 4, 1, 2, preferred="a", fallback=True, draft_s=0.125, verify_s=0.25, catchup_s=0.125,
           catchup_tokens=5),
        it("", 0, 0, 1, preferred="a", fallback=True, verify_s=0.25, wait_s=0.25),
        it("a", 3, 3, 4, preferred="a", draft_s=0.25, verify_s=0.25, prediction_s=0.5),
        it("b", 4, 0, 1, draft_s=0.25, verify_s=0.25),
    ]
    return s


def test_throughput(stats):
    # decode tokens: 3 + 2 + 1 + 4 + 1 = 11 (the 12th, first, token came from prefill)
    assert stats.decode_tokens == 11
    assert stats.tokens_per_second == 11 / 2.0 == 5.5  # decode tokens over decode time only
    # end to end: all 12 tokens over setup 0.5 + prefill 0.5 + decode 2.0 = 3.0 s
    assert stats.end_to_end_seconds == 3.0
    assert stats.end_to_end_tokens_per_second == 4.0
    # the first token is the prefill's: of the setup only the policy's start came before it
    assert stats.time_to_first_token == 0.5 + 0.125 and stats.start_seconds == 0.125
    assert GenerationStats().tokens_per_second == 0.0 and GenerationStats().end_to_end_tokens_per_second == 0.0


def test_end_to_end_is_the_controllers_whole_call_and_first_token_counts_what_came_before_the_policy(stats):
    # the engine alone (no call measured): its parts; the controller's work before the policy's start counts
    stats.prepare_seconds = 0.25
    assert stats.end_to_end_seconds == 0.25 + 3.0
    assert stats.time_to_first_token == 0.25 + 0.125 + 0.5
    # the controller's generate() measured: its whole wall time, the bookkeeping between the parts included
    stats.call_seconds = 4.0
    assert stats.end_to_end_seconds == 4.0 and stats.end_to_end_tokens_per_second == 12 / 4.0
    assert stats.tokens_per_second == 5.5  # the paper's metric: decoding only, as before


def test_speculation_counts_only_iterations_that_proposed(stats):
    # speculative iterations: 1, 2, 4, 5 (3 proposed nothing)
    assert [i.draft for i in stats.speculative_iterations] == ["a", "b", "a", "b"]
    # E[A] = (2 + 1 + 3 + 0) / 4 = 1.5; over all five iterations it would be 6 / 5 = 1.2
    assert stats.mean_accepted == 1.5
    # acceptance rate = accepted / proposed = 6 / (4 + 4 + 3 + 4) = 6 / 15 = 0.4
    assert stats.acceptance_rate == pytest.approx(0.4)
    assert stats.drafts_used == ["a", "b"]
    assert stats.draft_switches == 3  # a -> b -> a -> b (the target-only step between is not a draft)


def test_fallback_and_desired_fractions(stats):
    # denominator: speculative iterations that had a preferred draft: 1, 2, 4 (not 3: it proposed nothing,
    # not 5: no preference). Fallbacks among them: 2 only -> 1/3. A wrong denominator (all speculative: 1/4),
    # or counting target-only step 3 (2/4), gives another number.
    assert stats.fallback_fraction == pytest.approx(1 / 3)
    assert stats.desired_fraction == pytest.approx(2 / 3)
    # seconds: desired = iterations 1 and 4 = 0.5 + 1.0; fallback = iteration 2 only = 0.5
    assert stats.desired_seconds == 1.5
    assert stats.fallback_seconds == 0.5


def test_copies_from_the_context_are_neither_desired_nor_fallback_nor_draft_forwards(stats):
    """A copied iteration (context lookup) ran no draft: the controller still stamps it with the run's preferred
    draft and fallback flag, which must not move the fallback share, the drafts' seconds or the cost per draft
    forward. Two copies added to the fixture, one marked a fallback: every draft figure as before."""
    from memspec_ros.runtime.lookup import LOOKUP_DRAFT

    before = (stats.fallback_fraction, stats.desired_fraction, stats.desired_seconds, stats.fallback_seconds,
              stats.draft_switches, stats.drafts_used)
    parts = stats.time_breakdown()
    stats.iterations += [it(LOOKUP_DRAFT, 4, 4, 5, preferred="a", fallback=True, draft_s=0.001, verify_s=0.25),
                         it(LOOKUP_DRAFT, 2, 1, 2, preferred="a", draft_s=0.001, verify_s=0.25)]
    assert (stats.fallback_fraction, stats.desired_fraction, stats.desired_seconds, stats.fallback_seconds,
            stats.draft_switches, stats.drafts_used) == before
    # the paper's split: a copy's verify is target-only time (figures 7 and 9 drew it as desired execution, while
    # the desired and fallback seconds of the summary left it out: one figure, two definitions)
    parts_after = stats.execution_parts()
    assert parts_after["target_only"] == pytest.approx(0.25 + 2 * (0.001 + 0.25))
    assert (parts_after["desired"], parts_after["fallback"]) == (stats.desired_seconds, stats.fallback_seconds)
    assert [i.draft_forwards for i in stats.iterations] == [4, 4, 0, 3, 4, 0, 0]
    # the catch-up forward of iteration 2 is timed apart: 3 of its 4 forwards are in its draft_seconds
    assert [i.timed_draft_forwards for i in stats.iterations] == [4, 3, 0, 3, 4, 0, 0]
    assert stats.copied_iterations == 2 and len(stats.speculative_iterations) == 6
    # nor in the time breakdown (a copy's time went to desired or fallback draft by the run's flag)
    after = stats.time_breakdown()
    assert (after["desired_draft"], after["fallback_draft"]) == (parts["desired_draft"], parts["fallback_draft"])


def test_where_the_time_went(stats):
    assert stats.catchup_seconds == 0.125 and stats.catchup_tokens == 5
    assert stats.prediction_seconds == 0.5
    assert stats.prediction_overhead == 0.5 / 2.0
    assert stats.load_wait_seconds == 0.25
    assert stats.load_wait_fraction == 0.25 / 2.0
    assert [i.seconds for i in stats.iterations] == [0.5, 0.5, 0.5, 1.0, 0.5]


def test_summary_carries_the_same_numbers(stats):
    s = stats.summary()
    assert s["tokens_per_second"] == 5.5 and s["mean_accepted"] == 1.5
    assert s["fallback_fraction"] == pytest.approx(1 / 3) and s["iterations"] == 5
    assert s["draft_switches"] == 3 and s["drafts_used"] == ["a", "b"]


def test_no_speculation_gives_zeros_not_errors():
    s = GenerationStats(completion_tokens=3, decode_seconds=1.0)
    s.iterations = [it("", 0, 0, 1, preferred="a", fallback=True), it("", 0, 0, 1)]
    assert s.mean_accepted == 0.0 and s.acceptance_rate == 0.0
    assert s.fallback_fraction == 0.0 and s.desired_fraction == 0.0  # no speculative iteration had a preference
    assert s.draft_switches == 0 and s.drafts_used == []
    assert s.tokens_per_second == 2.0


def test_cache_stats_hit_rate_and_since():
    before = CacheStats(capacity=2, hits=3, misses=1, loads=2, load_failures=0, load_seconds=0.5, wait_seconds=0.25,
                        evictions=1, wasted_prefetches=1, resident=["a"])
    after = CacheStats(capacity=2, budget_bytes=100, hits=10, misses=4, loads=5, load_failures=1, load_seconds=2.0,
                       wait_seconds=0.75, evictions=3, wasted_prefetches=1, resident=["a", "b"], active="b",
                       bytes_resident=80, bytes_reserved=90)
    assert after.hit_rate == 10 / 14
    delta = after.since(before)
    # counters: after - before; state (resident, active, capacity, bytes) is the later snapshot's
    assert (delta.hits, delta.misses, delta.loads, delta.load_failures) == (7, 3, 3, 1)
    assert (delta.load_seconds, delta.wait_seconds, delta.evictions, delta.wasted_prefetches) == (1.5, 0.5, 2, 0)
    assert delta.hit_rate == 7 / 10
    assert delta.resident == ["a", "b"] and delta.active == "b" and delta.capacity == 2
    assert (delta.budget_bytes, delta.bytes_resident, delta.bytes_reserved) == (100, 80, 90)
    assert CacheStats().hit_rate == 0.0
    summary = delta.summary()
    assert summary["cache_hits"] == 7 and summary["cache_hit_rate"] == 0.7 and summary["cache_loads"] == 3


def test_goals_combined_give_their_pooled_figures(stats):
    """GenerationStats.combined (the node's throughput window; it was a function of the diagnostics module, beside
    GenerationTotals' own pooling): the combination's rates are the summed tokens over the summed seconds."""
    other = GenerationStats(prompt_tokens=3, completion_tokens=2, decode_seconds=0.5, prefill_seconds=0.25)
    other.iterations = [it("a", 4, 0, 1, preferred="a", draft_s=0.25, verify_s=0.25)]
    both = GenerationStats.combined([stats, other])
    totals = GenerationTotals()
    for s in (stats, other):
        totals.add(s)
    assert both.decode_tokens == stats.decode_tokens + other.decode_tokens == totals.decode_tokens
    assert both.tokens_per_second == pytest.approx(totals.tokens_per_second)
    assert both.end_to_end_seconds == pytest.approx(stats.end_to_end_seconds + other.end_to_end_seconds)
    assert both.mean_accepted == pytest.approx(totals.mean_accepted)
    assert GenerationStats.combined([]).completion_tokens == 0


def test_a_draft_whose_only_token_was_dropped_is_filed_as_a_draft_run_by_both_breakdowns():
    """Adaptive gamma's confidence stop can drop a switched-in draft's only proposal: the draft ran (a catch-up and
    a forward) and proposed nothing. execution_parts (figures 7 and 9) filed those seconds as target-only while
    time_breakdown filed them as the draft's and its catch-up, and draft_switches missed the switch."""
    its = [IterationStats("a", 4, 3, 4, 0.04, 0.1),
           IterationStats("b", 0, 0, 1, 0.0, 0.08, catchup_tokens=30, catchup_seconds=0.05, dropped=1),
           IterationStats("", 0, 0, 1, 0.0, 0.07)]
    stats = GenerationStats(decode_seconds=0.4, iterations=its)
    parts = stats.execution_parts()
    assert parts["desired"] == pytest.approx(0.04 + 0.1 + 0.05 + 0.08)  # b's catch-up and verify with a's run
    assert parts["target_only"] == pytest.approx(0.07)  # the plain target step alone
    breakdown = stats.time_breakdown()
    assert breakdown["catchup"] == pytest.approx(0.05) and breakdown["desired_draft"] == pytest.approx(0.04)
    assert sum(parts.values()) == pytest.approx(sum(breakdown.values())) == pytest.approx(0.4)
    assert stats.draft_switches == 1
