"""γ from measured costs: the expected-tokens model, the choice, the acceptance estimate, and the engine using it."""

from __future__ import annotations

import weakref

import pytest
import torch
from conftest import fix_adaptive_costs, patch_forward_times

from memspec_ros.runtime import gamma_choice
from memspec_ros.runtime.gamma_choice import (
    PROBE_EVERY,
    AcceptanceEstimate,
    ForwardCosts,
    GammaChooser,
    best_gamma,
    draft_pays,
    expected_tokens,
    row_pays,
)
from memspec_ros.runtime.speculative import generate
from memspec_ros.testing.tiny_models import noisy_copy, tiny_llama

# forward costs where drafting pays (each verify row 3 ms on a 10 ms verify, a draft token 2 ms), fixed so that the
# choice does not depend on this machine's timing: the draft runs and its tokens are verified and accepted
DRAFTING_PAYS = (lambda model, k, vocab: 10.0 + 3.0 * (k - 1), 2.0)


def test_expected_tokens_by_hand():
    assert expected_tokens(0.5, 0) == 1.0
    assert expected_tokens(0.5, 2) == pytest.approx(1 + 0.5 + 0.25)
    assert expected_tokens(0.0, 4) == 1.0
    assert expected_tokens(1.0, 4) == 5.0


def test_best_gamma_weighs_acceptance_against_measured_costs():
    flat = ForwardCosts(verify_ms=[10.0] * 9, draft_ms=0.5)  # a verify costs the same for any rows (bf16-like)
    assert best_gamma(flat, 0.9, 8) == 8
    # by hand, alpha 0.5: g=1: 1.5/10.5=.143, g=2: 1.75/11=.159, g=3: 1.875/11.5=.163, g=4: 1.9375/12=.161
    assert best_gamma(flat, 0.5, 8) == 3
    per_row = ForwardCosts(verify_ms=[10.0 * k for k in range(1, 10)], draft_ms=2.0)  # every row costs (int4-like)
    # alpha 0.5: g=0: 1/10=.1, g=1: 1.5/22=.068: not drafting wins
    assert best_gamma(per_row, 0.5, 8) == 0
    assert best_gamma(per_row, 1.0, 8) == 0  # even all accepted: g=1 gives 2/22 = .091 < 1/10
    cheap_rows = ForwardCosts(verify_ms=[10.0 + 3.0 * (k - 1) for k in range(1, 10)], draft_ms=0.5)
    # alpha 0.8: g=2: 2.44/17 = .1435, g=3: 2.952/20.5 = .1440, g=4: 3.3616/24 = .1401
    assert best_gamma(cheap_rows, 0.8, 8) == 3


def test_acceptance_estimate_counts_trials_up_to_the_first_rejection():
    est = AcceptanceEstimate(successes=0.0, trials=0.0)
    est.observe(proposed=4, accepted=2)  # two successes and the failed third: 3 trials
    assert est.alpha == pytest.approx(2 / 3)
    est = AcceptanceEstimate(successes=0.0, trials=0.0)
    est.observe(proposed=4, accepted=4)  # all accepted: 4 trials, no failure
    assert est.alpha == 1.0
    drifting = AcceptanceEstimate()
    for _ in range(40):
        drifting.observe(4, 0)
    assert drifting.alpha < 0.05  # recent iterations outweigh the prior and the past


def test_an_idle_draft_is_probed():
    costly = ForwardCosts(verify_ms=[10.0 * k for k in range(1, 10)], draft_ms=5.0)
    chooser = GammaChooser(max_gamma=4)
    picks = [chooser.choose(costly, "d") for _ in range(3 * PROBE_EVERY)]
    assert picks.count(1) == 3 and set(picks) == {0, 1}


def test_adaptive_generation_stays_lossless_and_uses_the_choice(monkeypatch):
    target = tiny_llama(vocab_size=64, seed=0)
    draft = noisy_copy(target, 0.02, seed=1)
    prompt = [1, 5, 7, 9]
    reference = generate(target, prompt, None, max_new_tokens=40).generated_ids
    fix_adaptive_costs(monkeypatch, *DRAFTING_PAYS)
    adaptive = generate(target, prompt, draft, gamma=6, max_new_tokens=40, adaptive_gamma=True)
    assert adaptive.generated_ids == reference
    its = adaptive.stats.iterations
    assert sum(it.accepted for it in its) > 0 and all(it.proposed <= 6 for it in its)
    monkeypatch.undo()
    # costs where drafting never pays: only the probes run the draft, and no row pays for its token (a row costs
    # a whole target step), so the probe's token is dropped and nothing is proposed
    patch_forward_times(monkeypatch, lambda model, k, vocab: 10.0 * k)
    gamma_choice._TARGET_COSTS.clear()
    gamma_choice._DRAFT_COSTS.clear()
    never = generate(target, prompt, draft, gamma=6, max_new_tokens=40, adaptive_gamma=True)
    assert never.generated_ids == reference
    its = never.stats.iterations
    assert {it.proposed for it in its} == {0} and {it.dropped for it in its} == {0, 1}
    assert 0 < sum(it.dropped for it in its) <= len(its) // PROBE_EVERY + 1


def test_a_probe_after_plain_steps_times_its_catch_up_apart_from_its_token(monkeypatch):
    """A draft whose best gamma fell to 0 is probed every PROBE_EVERY iterations; the probe's first forward reads
    the tokens of the plain steps before it. That catch-up was charged to the draft's cost per proposed token, which
    then rose (about 2.6x in a review's run), so gamma stayed 0. It is timed apart, as a switch's catch-up is."""
    from memspec_ros.runtime.speculative import SpeculativeSession

    target = tiny_llama(vocab_size=64, seed=0)
    draft = noisy_copy(target, 0.02, seed=1)
    patch_forward_times(monkeypatch, lambda model, k, vocab: 10.0 * k)  # drafting never pays: probes only
    monkeypatch.setattr(gamma_choice, "_TARGET_COSTS", weakref.WeakKeyDictionary())  # timed anew, others' kept
    monkeypatch.setattr(gamma_choice, "_DRAFT_COSTS", weakref.WeakKeyDictionary())
    session = SpeculativeSession(target, [1, 5, 7, 9], max_new_tokens=40, gamma=6, adaptive_gamma=True)
    seen_costs = []
    observe_cost = session._gamma_chooser.observe_cost
    session._gamma_chooser.observe_cost = lambda name, forwards, ms: (seen_costs.append(forwards),
                                                                      observe_cost(name, forwards, ms))
    while not session.finished:
        session.step("d", draft)
    probes = [it for it in session.stats.iterations if it.draft_forwards]
    assert len(probes) >= 2  # the first proposal and at least one probe after plain steps
    for it in probes[1:]:  # each read the plain steps' tokens in its first forward: timed as catch-up
        assert it.catchup_tokens > 1 and it.timed_draft_forwards == it.draft_forwards - 1
    assert seen_costs.count(0) >= len(probes) - 1  # so no draft-token cost came from a catch-up forward


def test_a_row_pays_when_its_chance_buys_it_at_the_targets_own_rate():
    costs = ForwardCosts(verify_ms=[10.0, 12.0, 15.0, 19.0], draft_ms=1.0)
    # a first proposal's row costs 2 ms, a fifth of a target step: it pays from a 0.2 chance of acceptance
    assert row_pays(costs, 1, 0.2) and not row_pays(costs, 1, 0.19)
    assert row_pays(costs, 2, 0.3) and not row_pays(costs, 2, 0.29)
    # drafting the next token costs its forward besides its row, and can be at most as likely as those before it
    assert not draft_pays(costs, 2, 0.39) and draft_pays(costs, 2, 0.4)
    assert not draft_pays(costs, 3, 0.49) and draft_pays(costs, 3, 0.5)


def _sharpened(model, factor: float):
    """A copy of ``model`` whose logits are ``factor`` times its own: the same argmax, sharper or flatter."""
    copy = noisy_copy(model, 0.0, seed=0)
    with torch.no_grad():
        copy.model.norm.weight.mul_(factor)
    return copy


def _costs_by_model(target, verify_ms: list[float], draft_ms: float):
    return lambda model, k, vocab: verify_ms[k - 1] if model is target else draft_ms


def _fixed_costs(monkeypatch, target, verify_ms: list[float], draft_ms: float) -> None:
    fix_adaptive_costs(monkeypatch, _costs_by_model(target, verify_ms, draft_ms), draft_ms)


def test_the_draft_proposes_while_its_confidence_pays_and_drops_the_token_that_does_not(monkeypatch):
    target = tiny_llama(vocab_size=64, seed=0)
    prompt = [1, 5, 7, 9]
    reference = generate(target, prompt, None, max_new_tokens=30).generated_ids
    _fixed_costs(monkeypatch, target, [10.0 + 2 * k for k in range(6)], 0.1)
    # the target's own argmax, all but certain: every row pays, so the draft proposes as many as the
    # per-iteration choice allows (it grows from the prior's 1 as proposals are accepted), and all stand
    sure = generate(target, prompt, _sharpened(target, 50.0), gamma=4, max_new_tokens=30, adaptive_gamma=True)
    assert sure.generated_ids == reference
    its = sure.stats.iterations
    assert [it.dropped for it in its] == [0] * len(its) and all(it.accepted == it.proposed > 0 for it in its)
    assert max(it.proposed for it in its) == 4
    # logits all zero, so 1/64 for any token: each iteration's first forward's token is dropped, nothing is
    # proposed (the prefill commits the first token; the last iteration has room for none)
    flat = generate(target, prompt, _sharpened(target, 0.0), gamma=4, max_new_tokens=30, adaptive_gamma=True)
    assert flat.generated_ids == reference
    assert [(it.proposed, it.dropped) for it in flat.stats.iterations] == [(0, 1)] * 28 + [(0, 0)]
    assert flat.stats.dropped_proposals == flat.stats.summary()["dropped_proposals"] == 28
    # the stop turned off (memspec.confidence_stop: false): the flat draft proposes what the choice allows
    unstopped = generate(target, prompt, _sharpened(target, 0.0), gamma=4, max_new_tokens=30, adaptive_gamma=True,
                         confidence_stop=False)
    assert unstopped.generated_ids == reference
    assert unstopped.stats.dropped_proposals == 0 and sum(it.proposed for it in unstopped.stats.iterations) > 0


def test_the_controller_runs_adaptive_gamma_losslessly_under_every_policy(monkeypatch):
    from memspec_ros.runtime.controller import RuntimeConfig, RuntimeController
    from memspec_ros.runtime.models import LoadedModel, ModelSpec, parameter_bytes
    from memspec_ros.runtime.oracle import GreedyOracle
    from memspec_ros.runtime.policies import POLICIES
    from memspec_ros.runtime.predictor import FixedRanker
    from memspec_ros.runtime.registry import DraftEntry, DraftRegistry

    target = tiny_llama(vocab_size=64, seed=0)
    drafts = {"general": noisy_copy(target, 0.05, seed=1), "code": noisy_copy(target, 0.01, seed=2)}
    prompt = [1, 5, 7, 9]
    reference = generate(target, prompt, None, max_new_tokens=32).generated_ids
    oracle = GreedyOracle.compute(target, drafts, prompt, 32, gamma=4, interval=4)
    registry = DraftRegistry([DraftEntry(n, f"/virtual/{n}", n, 1000) for n in drafts], validate=False)
    fix_adaptive_costs(monkeypatch, *DRAFTING_PAYS)
    for policy in POLICIES:
        ctl = RuntimeController(
            RuntimeConfig(policy=policy, adaptive_gamma=True, gamma=6), target, None, registry,
            FixedRanker(lambda context: ["code", "general"]), eos_token_ids=[], oracle_for=lambda p: oracle,
            loader=lambda name: LoadedModel(drafts[name], ModelSpec(name), parameter_bytes(drafts[name]), 64, 512))
        result = ctl.generate(prompt, 32)
        assert result.token_ids == reference, policy
        its = result.stats.iterations  # the drafts ran (their proposals were verified and accepted)
        assert sum(it.accepted for it in its) > 0 and all(it.proposed <= 6 for it in its), policy
        ctl.close()


def test_the_controller_measures_the_target_before_any_generation_is_timed(monkeypatch):
    """The target's forward costs (about a second on the real target) are measured when the controller is
    made or reconfigured, never inside a generation's decode: the first goal's speed must not carry them."""
    from memspec_ros.runtime.controller import RuntimeConfig, RuntimeController
    from memspec_ros.runtime.models import LoadedModel, ModelSpec, parameter_bytes
    from memspec_ros.runtime.predictor import FixedRanker
    from memspec_ros.runtime.registry import DraftEntry, DraftRegistry

    target = tiny_llama(vocab_size=64, seed=0)
    draft = noisy_copy(target, 0.02, seed=1)
    timed: list[tuple[str, int]] = []
    during_generation = []

    def fake_time_forward(model, tokens, vocab):
        timed.append(("target" if model is target else "draft", tokens))
        return 10.0 + tokens
    patch_forward_times(monkeypatch, fake_time_forward)
    gamma_choice._TARGET_COSTS.clear()
    gamma_choice._DRAFT_COSTS.clear()
    registry = DraftRegistry([DraftEntry("general", "/virtual/general", "general", 1000)], validate=False)
    ctl = RuntimeController(
        RuntimeConfig(policy="general-static", adaptive_gamma=True, gamma=3), target, None, registry,
        FixedRanker(lambda context: ["general"]), eos_token_ids=[],
        loader=lambda name: LoadedModel(draft, ModelSpec(name), parameter_bytes(draft), 64, 512))
    assert timed == [("target", k) for k in (1, 2, 3, 4)]  # at construction: 1..gamma+1 tokens
    ctl.reconfigure(gamma=5)
    timed.clear()

    def on_chunk(delta, ids):  # how many target timings had run by each streamed chunk
        during_generation.append(sum(kind == "target" for kind, _ in timed))
    result = ctl.generate([1, 5, 7, 9], 24, on_chunk=on_chunk)
    # gamma grew: the whole curve again (its sizes are timed in the same rounds), before the first token
    assert [t for t in timed if t[0] == "target"] == [("target", k) for k in range(1, 7)]
    assert during_generation and set(during_generation) == {6}  # all before the first token, none after
    assert ("draft", 1) in timed  # the draft's own cost (milliseconds) is measured at its first iteration
    assert result.token_ids == generate(target, [1, 5, 7, 9], None, max_new_tokens=24).generated_ids
    ctl.close()


def test_a_drafts_observed_cost_replaces_its_isolated_timing():
    """Catching up after copied iterations makes a draft's iterations dearer than its one-token timing:
    the observed cost per proposed token is what the choice uses once there is one."""
    measured = ForwardCosts(verify_ms=[10.0, 11.0, 12.0, 13.0, 14.0], draft_ms=0.5)
    chooser = GammaChooser(max_gamma=4)
    assert chooser.costs(measured, "d") is measured  # nothing observed yet
    for _ in range(5):
        chooser.observe("d", 4, 4)
    assert chooser.choose(chooser.costs(measured, "d"), "d") == 4
    for _ in range(40):
        chooser.observe_cost("d", 2, 40.0)  # 20 ms a token, catch-up included
    assert chooser.costs(measured, "d").draft_ms == pytest.approx(20.0, rel=0.02)
    assert chooser.costs(measured, "d").verify_ms == measured.verify_ms
    # by hand: g=1 commits at most 2 tokens in 31 ms < 1 in 10 ms: drafting no longer pays
    assert best_gamma(chooser.costs(measured, "d"), chooser.alpha("d"), 4) == 0
    assert chooser.costs(measured, "other") is measured  # per draft
    chooser.observe_cost("other", 0, 99.0)  # nothing proposed: no cost per token to learn
    assert chooser.costs(measured, "other") is measured


def test_the_engine_reports_each_drafted_iterations_time_to_the_choice(monkeypatch):
    target = tiny_llama(vocab_size=64, seed=0)
    draft = noisy_copy(target, 0.02, seed=1)
    # rows almost free: the draft proposes whatever this machine's timings, its confidence stop all but never binds
    _fixed_costs(monkeypatch, target, [10.0 + 0.01 * k for k in range(6)], 0.01)
    seen: list[tuple[str, int, float]] = []
    observe_cost = GammaChooser.observe_cost  # fixed by _fixed_costs: what the choice then uses

    def spy(self, name, proposed, draft_ms):
        seen.append((name, proposed, draft_ms))  # what the engine reports
        observe_cost(self, name, proposed, draft_ms)
    monkeypatch.setattr(GammaChooser, "observe_cost", spy)
    session = generate(target, [1, 5, 7, 9], draft, draft_name="d", gamma=4, max_new_tokens=30, adaptive_gamma=True)
    drafted = [it for it in session.stats.iterations if it.proposed > 0]
    assert drafted
    # each draft forward counts, the proposals' and the dropped token's, but for a catch-up: that forward's time is
    # catchup_seconds, not draft_seconds (counting it made a switch's first iterations read as near-free drafting)
    drafted = [it for it in session.stats.iterations if it.timed_draft_forwards > 0]
    assert any(it.catchup_tokens for it in drafted)
    assert [(n, p) for n, p, _ in seen if p > 0] == [
        ("d", it.proposed + it.dropped - (1 if it.catchup_tokens else 0)) for it in drafted]
    assert [ms for _, p, ms in seen if p > 0] == pytest.approx([1000.0 * it.draft_seconds for it in drafted])


# verify costs: a first row paying from a 0.4 chance (the greedy rule's drop, applied to a sampled token, biased the
# output visibly here), or from 0.3 with a second draw from 0.21 (both proposal lengths taken often)
@pytest.mark.parametrize("verify_ms", [[10.0, 14.0, 18.0, 22.0], [10.0, 13.0, 15.0, 17.0]])
def test_sampled_generation_with_the_confidence_stop_keeps_the_targets_distribution(monkeypatch, verify_ms):
    """Sampled, where the draft stops is decided before each draw, from the tokens drawn before it: a drawn token
    is always proposed, so the proposals are q's draws and the standard acceptance rule gives the target's exact
    joint distribution (tokens 2-4, the first conditioned on). Dropping a drawn token for its own probability (the
    greedy rule) biased it: with the first costs the second token's distribution failed its chi-square."""
    from collections import Counter

    from sampling_checks import check_given_first

    from memspec_ros.runtime.speculative import SamplingConfig

    vocab = 5
    target = tiny_llama(vocab_size=vocab, hidden=32, seed=7, init_range=0.3)
    draft = tiny_llama(vocab_size=vocab, hidden=32, layers=1, seed=8, init_range=0.3)
    _fixed_costs(monkeypatch, target, verify_ms, 0.1)
    sampling = dict(temperature=0.8, top_p=1.0)  # (with top_p 0.9 the old bias went unseen)
    prompt = [1, 3]
    # the second token alone too: fewer bins, more power against the old bias
    runs = check_given_first(
        target, prompt, SamplingConfig(**sampling),
        lambda seed: generate(target, prompt, draft, gamma=2, max_new_tokens=4, adaptive_gamma=True,
                              sampling=SamplingConfig(seed=seed, **sampling)),
        draws=3000, several=False, second_alone=True)  # 3000: the bias it guards against is in one marginal
    dropped = sum(it.dropped for _, stats in runs for it in stats.iterations)
    lengths = Counter(it.proposed for _, stats in runs for it in stats.iterations if it.draft_forwards > 0)
    assert dropped == 0 and lengths[1] > 50, lengths  # no drawn token dropped; the one-proposal stop taken
    if verify_ms[1] == 13.0:  # the stop before the second draw taken often, and passed often
        assert lengths[2] > 50, lengths


def test_non_decreasing_pools_the_runs_that_go_down():
    from memspec_ros.runtime.path_choice import non_decreasing

    assert non_decreasing([1.0, 2.0, 3.0]) == [1.0, 2.0, 3.0]
    # the trace that stopped the math draft after one proposal: pooled, no row looks dearer than a target step
    assert non_decreasing([12.3, 10.0, 16.5, 10.5, 10.1]) == pytest.approx([11.15, 11.15, 12.3667, 12.3667, 12.3667],
                                                                         abs=1e-3)
    assert non_decreasing([5.0, 4.0, 3.0]) == [4.0, 4.0, 4.0]
    assert non_decreasing([]) == []


def test_the_cost_curve_times_its_sizes_in_turns_so_a_burst_of_load_does_not_land_on_one(monkeypatch):
    """A burst of other load on the machine (here: 8 consecutive forwards 3x slower, on a fake clock) inflated one
    size of the curve when the sizes were timed one after another; timed in rounds, each size sees it once or
    twice, the medians keep the real shape and no row comes out dearer than a whole target step."""
    from memspec_ros.runtime import path_choice, speculative

    clock = {"now": 0.0, "calls": 0}

    def fake_forward(model, feed, kv, rows, device, lean):
        clock["calls"] += 1
        slow = 3.0 if 20 <= clock["calls"] < 28 else 1.0  # the burst
        clock["now"] += slow * (10.0 + len(feed)) / 1000.0  # 10 ms a forward and 1 ms a row, at rest
        return real_forward(model, feed, kv, rows, device, lean)

    real_forward = speculative.forward_once
    monkeypatch.setattr(speculative, "forward_once", fake_forward)
    monkeypatch.setattr(path_choice.time, "perf_counter", lambda: clock["now"])
    target = tiny_llama(vocab_size=64, seed=0)
    curve = path_choice.forward_cost_curve(target, 5, 64)
    assert curve == pytest.approx([11.0, 12.0, 13.0, 14.0, 15.0])
    # what timing each size on its own made of the same burst: one size three times dearer than its neighbours
    clock.update(now=0.0, calls=0)
    one_by_one = [path_choice.time_forward(target, k, 64) for k in range(1, 6)]
    assert max(b - a for a, b in zip(one_by_one, one_by_one[1:], strict=False)) > one_by_one[0]


def test_a_draft_is_timed_on_the_forward_the_session_runs_it_with(monkeypatch):
    """The draft's prior cost was always timed on the lean forward: a session on transformers' forward
    (lean_drafts=False, about twice the time) started weighing rows and copies with half the draft's cost."""
    from memspec_ros.runtime import speculative  # timed_forwards imports the engine's forward from it when timing

    target = tiny_llama(vocab_size=64, seed=0)
    draft = noisy_copy(target, 0.02, seed=1)
    used = []
    engine_forward = speculative.forward_once

    def watched(model, ids, kv, keep, device, lean=None):
        if model is draft:
            used.append(lean)
        return engine_forward(model, ids, kv, keep, device, lean)

    monkeypatch.setattr(speculative, "forward_once", watched)
    gamma_choice._DRAFT_COSTS.clear()
    gamma_choice.measure_costs(target, draft, 3, lean_draft=False)
    assert used and all(lean is None for lean in used)
    used.clear()
    gamma_choice.measure_costs(target, draft, 3)  # the lean forward's time is another entry, timed apart
    assert used and all(lean is not None for lean in used)
