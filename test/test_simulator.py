"""The trace-driven simulator replays the controller: same policy objects, same decisions, same accounting.

Nothing here is timed: the simulator's clock is virtual and the real runs are compared on decisions
(which draft ran, fallback or not, how many tokens were accepted and caught up), not on seconds.
"""

from __future__ import annotations

import pytest
import torch

from memspec_ros.runtime.controller import RuntimeConfig, RuntimeController
from memspec_ros.runtime.models import LoadedModel, ModelSpec, parameter_bytes
from memspec_ros.runtime.oracle import GreedyOracle, ScheduleCosts
from memspec_ros.runtime.policies import COST_AWARE, PAPER_POLICIES, make_policy
from memspec_ros.runtime.predictor import (
    FixedRanker,
    HeadConfig,
    PredictionContext,
    PredictionEngine,
    RankingHead,
    TargetHiddenEncoder,
)
from memspec_ros.runtime.registry import DraftEntry, DraftRegistry
from memspec_ros.runtime.simulator import (
    CostModel,
    PromptTrace,
    SimCache,
    SimConfig,
    Simulator,
    TraceHiddenEncoder,
    live_recent_features,
    replay_predictor,
    target_hidden_states,
)
from memspec_ros.testing.tiny_models import noisy_copy, tiny_llama

PROMPTS = ([1, 5, 7, 9, 11, 13], [3, 4, 8, 16, 32, 63, 3])
NEW, GAMMA, INTERVAL = 40, 4, 2
DOMAINS = {"general": "general", "code": "code", "math": "math", "law": "law"}


@pytest.fixture(scope="module")
def models():
    torch.manual_seed(0)
    target = tiny_llama(layers=2, hidden=32, seed=0)
    drafts = {"general": tiny_llama(layers=1, hidden=32, seed=1), "code": noisy_copy(target, 0.03, seed=2),
              "math": noisy_copy(target, 0.01, seed=3), "law": noisy_copy(target, 0.02, seed=4)}
    return target, drafts


@pytest.fixture(scope="module")
def traces(models):
    target, drafts = models
    out = []
    for i, prompt in enumerate(PROMPTS):
        oracle = GreedyOracle.compute(target, drafts, prompt, NEW, GAMMA, INTERVAL)
        trace = PromptTrace.from_oracle(f"w{i}", prompt, oracle)
        trace.hidden = target_hidden_states(target, prompt, trace.continuation)
        out.append(trace)
    return out


def context_ranker() -> FixedRanker:
    """A deterministic ranking that changes with the recent tokens (so policies switch), no model."""
    names = list(DOMAINS)

    def rank(context: PredictionContext):
        seed = sum(context.recent_ids[-3:]) + len(context.prompt_ids)
        order = names[seed % len(names):] + names[: seed % len(names)]
        return [(n, 1.0 - 0.2 * i) for i, n in enumerate(order)]

    return FixedRanker(rank)


def real_controller(target, drafts, oracles, policy, predictor, capacity=2):
    registry = DraftRegistry([DraftEntry(n, f"/virtual/{n}", n, 1000) for n in drafts], validate=False)

    def load(name):  # in memory: a load ends long before the next scheduling point
        model = drafts[name]
        return LoadedModel(model, ModelSpec(name), parameter_bytes(model), 64, 512)

    config = RuntimeConfig(policy=policy, capacity=capacity, interval=INTERVAL, gamma=GAMMA,
                           reset_cache_per_generation=True)
    ctl = RuntimeController(config, target, None, registry, predictor, loader=load,
                            oracle_for=lambda ids: oracles[tuple(ids)], eos_token_ids=[])
    point = ctl._point

    def point_after_loads(*args, **kwargs):
        # The replay's loads (tiny_costs: 1e-4 s) end before the next scheduling point. On a busy machine the real
        # loader thread may not have run by then (seen under load: a fallback the replay did not have), so every
        # scheduling point first waits for the loads in flight; what is compared is the decisions, not the timing.
        ctl.cache.drain()
        return point(*args, **kwargs)

    ctl._point = point_after_loads
    return ctl


def decisions(stats):
    return [(it.draft, it.fallback, it.accepted, it.committed, it.catchup_tokens) for it in stats.iterations]


def tiny_costs(drafts) -> CostModel:
    """Loads far shorter than an interval (as the in-memory loader), everything else some time."""
    return CostModel(verify_seconds={k: 1.0 + 0.1 * k for k in range(GAMMA + 1)}, draft_token_seconds=0.1,
                     catchup_base_seconds=0.1, catchup_token_seconds=0.01, prefill_base_seconds=0.5,
                     prefill_token_seconds=0.01, load_seconds=dict.fromkeys(drafts, 1e-4))


@pytest.mark.parametrize("policy", PAPER_POLICIES)
@pytest.mark.parametrize("capacity", [1, 2, 3])
def test_the_simulator_makes_the_controllers_decisions(models, traces, policy, capacity):
    target, drafts = models
    costs = ScheduleCosts(capacity=capacity, iteration_seconds=1.0, catchup_seconds=0.3,
                          load_seconds=dict.fromkeys(drafts, 0.5))
    oracles = {tuple(t.prompt_ids): t.oracle(NEW, GAMMA, INTERVAL, costs) for t in traces}
    ranker = context_ranker()
    ctl = real_controller(target, drafts, oracles, policy, ranker, capacity)
    config = SimConfig(capacity=capacity, interval=INTERVAL, gamma=GAMMA, max_new_tokens=NEW)
    sim = Simulator(tiny_costs(drafts), config, DOMAINS, list(drafts))
    try:
        for trace in traces:
            real = ctl.generate(trace.prompt_ids, NEW)
            assert real.token_ids == trace.continuation  # the trace is the run's output
            replay = sim.generate(make_policy(policy, predictor=ranker, oracle_for=lambda ids: oracles[tuple(ids)]),
                                  trace)
            assert decisions(replay) == decisions(real.stats)
            assert replay.completion_tokens == real.stats.completion_tokens
            assert replay.predictions == real.stats.predictions
    finally:
        ctl.close()


@pytest.mark.parametrize("prompt_tokens", [0, 3])
def test_the_replayed_hidden_state_predictor_sees_the_live_features(models, traces, prompt_tokens):
    """One teacher-forced pass gives the features the live encoder gives at every scheduling point
    (with its recent half live or not, as :func:`live_recent_features` finds it in this runtime), pooling the
    prompt positions the head names (prompt_tokens)."""
    target, drafts = models
    torch.manual_seed(0)
    head = RankingHead(HeadConfig(encoder="target-hidden", drafts=list(drafts), in_dim=64, hidden=8,
                                  recent_tokens=8, interval=INTERVAL, prompt_tokens=prompt_tokens)).eval()
    live = PredictionEngine(head, TargetHiddenEncoder(target, 8, prompt_tokens))
    seen: list[tuple[PredictionContext, torch.Tensor]] = []

    class Recording:
        def begin(self, prompt_ids):
            live.begin(prompt_ids)

        def rank(self, context):
            seen.append((context, live.features(context)))
            return live.rank(context)

    ctl = real_controller(target, drafts, {}, "memspec", Recording())
    try:
        for trace in traces:
            seen.clear()
            ctl.generate(trace.prompt_ids, NEW)
            replay = TraceHiddenEncoder(32, traces, recent=live_recent_features(live, trace.prompt_ids,
                                                                                trace.continuation),
                                        prompt_tokens=prompt_tokens)
            replay.begin(trace.prompt_ids)
            assert len(seen) > 3
            for context, features in seen:
                expected = torch.cat([replay.prompt_features(context.prompt_ids),
                                      replay.recent_features(context.recent_ids[-8:], context.generated)])
                if context.interval == 0:  # the live encoder's prompt pass comes before prefill: same features
                    assert not features[32:].any()
                torch.testing.assert_close(features, expected, atol=1e-4, rtol=1e-4)
    finally:
        ctl.close()
        live.close()
    engine = replay_predictor(PredictionEngine(head, TargetHiddenEncoder(target, 8, prompt_tokens)), traces)
    assert isinstance(engine.encoder, TraceHiddenEncoder) and engine.encoder.prompt_tokens == prompt_tokens


def test_a_cost_model_fitted_to_simulated_runs_is_the_model_that_made_them(models, traces):
    _, drafts = models
    truth = tiny_costs(drafts)
    truth.point_seconds = {"memspec": 0.05, "mab-async": 0.002}
    truth.setup_seconds = {"memspec": 0.3, "mab-async": 0.0}
    truth.load_seconds = dict.fromkeys(drafts, 0.2)
    # the controller's call outside setup, prefill and decoding: end to end counts it (runtime/stats.py), so the
    # replay must too, or the validation compares two definitions (a reset's wait was -39% apart)
    truth.call_other_seconds = 0.07
    sim = Simulator(truth, SimConfig(interval=INTERVAL, gamma=GAMMA, max_new_tokens=NEW), DOMAINS, list(drafts))
    ranker = context_ranker()
    runs = [(p, sim.generate(make_policy(p, predictor=ranker), t)) for p in ("memspec", "mab-async") for t in traces]
    fitted = CostModel.measure(runs, truth.load_seconds)
    for k in fitted.verify_seconds:
        assert fitted.verify_seconds[k] == pytest.approx(truth.verify(k))
    assert fitted.draft_token_seconds == pytest.approx(truth.draft_token_seconds)
    assert fitted.catchup_token_seconds == pytest.approx(truth.catchup_token_seconds)
    assert fitted.catchup_base_seconds == pytest.approx(truth.catchup_base_seconds)
    assert fitted.prefill_token_seconds == pytest.approx(truth.prefill_token_seconds)
    assert fitted.point_seconds == pytest.approx(truth.point_seconds)
    # setup = the first choice's own work plus the first (blocking) load
    assert fitted.setup_seconds == pytest.approx(truth.setup_seconds, abs=1e-6)
    assert fitted.call_other_seconds == pytest.approx(0.07)
    # re-simulating with the fitted model gives the same runs
    again = Simulator(fitted, sim.config, DOMAINS, list(drafts))
    for policy, stats in runs[:2]:
        trace = traces[runs.index((policy, stats)) % len(traces)]
        replayed = again.generate(make_policy(policy, predictor=ranker), trace)
        assert replayed.decode_seconds == pytest.approx(stats.decode_seconds)
        assert replayed.end_to_end_seconds == pytest.approx(stats.end_to_end_seconds)


def test_a_policy_the_costs_never_timed_is_not_replayed_for_free(models, traces):
    """A cost model fitted to runs of some policies charged an untimed one no scheduling-point or setup work: the
    held-out replay's mab-sync (make bench times none) ran its UCB points for nothing beside a mab-async paying
    for the same code. It is refused, or charged a timed policy's work when one is stood in for it."""
    _, drafts = models
    costs = tiny_costs(drafts)
    costs.point_seconds, costs.setup_seconds = {"mab-async": 0.05}, {"mab-async": 0.2}
    config = SimConfig(interval=INTERVAL, gamma=GAMMA, max_new_tokens=NEW)
    with pytest.raises(ValueError, match="measured no scheduling-point or setup work for policy 'mab-sync'"):
        Simulator(costs, config, DOMAINS, list(drafts)).generate(make_policy("mab-sync"), traces[0])
    free = Simulator(tiny_costs(drafts), config, DOMAINS, list(drafts)).generate(make_policy("mab-sync"), traces[0])
    charged = Simulator(costs.standing_in("mab-sync", "mab-async"), config, DOMAINS, list(drafts)).generate(
        make_policy("mab-sync"), traces[0])
    assert decisions(charged) == decisions(free)  # the same run, its work charged
    points = charged.predictions - 1  # the first choice is the setup's
    assert charged.end_to_end_seconds == pytest.approx(free.end_to_end_seconds + 0.2 + 0.05 * points)
    # timed, but no run reached a scheduling point (short answers): its setup was measured, its points cost nothing
    costs.point_seconds = {}
    Simulator(costs, config, DOMAINS, list(drafts)).generate(make_policy("mab-async"), traces[0])


def test_the_simulator_refuses_candidates_it_cannot_replay(models, traces):
    """An empty candidate list was taken for every draft; a candidate the trace has no agreement for was replayed
    as a draft that accepts nothing, charged its costs without a word."""
    _, drafts = models
    config = SimConfig(interval=INTERVAL, gamma=GAMMA, max_new_tokens=NEW)
    with pytest.raises(ValueError, match="candidates is empty"):
        Simulator(tiny_costs(drafts), config, DOMAINS, [])
    sim = Simulator(tiny_costs(drafts), config, {**DOMAINS, "zz": "zz"}, [*drafts, "zz"])
    with pytest.raises(ValueError, match="candidates zz have no recorded agreement in this trace"):
        sim.generate(make_policy("general-static", general_draft="zz"), traces[0])


def test_blocking_loads_are_charged_as_load_wait_and_slower_media_never_help(models, traces):
    _, drafts = models
    results = {}
    for load in (0.0, 0.5, 5.0):
        costs = tiny_costs(drafts).with_loads(dict.fromkeys(drafts, load), f"{load}s")
        sim = Simulator(costs, SimConfig(interval=INTERVAL, gamma=GAMMA, max_new_tokens=NEW), DOMAINS, list(drafts))
        stats = sim.generate(make_policy("mab-sync"), traces[0])
        assert stats.load_wait_seconds == pytest.approx(stats.time_breakdown()["load_wait"])
        results[load] = stats
        general = sim.generate(make_policy("general-static"), traces[0])
        assert general.setup_seconds >= load  # the first draft's load is setup, outside the paper's metric
        assert general.load_wait_seconds == 0.0
    # MAB-Sync blocks on every load it needs: the same decisions, waits that grow with the load time
    assert decisions(results[0.0]) == decisions(results[5.0])
    assert results[5.0].load_wait_seconds > results[0.5].load_wait_seconds > 0
    assert results[5.0].end_to_end_seconds > results[0.5].end_to_end_seconds > results[0.0].end_to_end_seconds


def test_the_cache_loads_one_draft_at_a_time_and_never_evicts_the_active_one():
    clock = type("Clock", (), {"now": 0.0, "__call__": lambda self: self.now})()
    cache = SimCache(2, lambda name: 1.0, clock)
    cache.update([("a", 3), ("b", 2), ("c", 1)])
    assert cache.resident() == []
    clock.now = 1.5
    assert cache.resident() == ["a"]  # b waits for a's load on the one loader
    clock.now = 2.5
    assert sorted(cache.resident()) == ["a", "b"]
    cache.set_active("a")
    cache.update([("c", 3), ("b", 2), ("a", 1)], active="a")  # W = {c, b}: no room, a is active, b in W
    assert sorted(cache.resident()) == ["a", "b"] and not cache.is_available("c")
    cache.update([("c", 3), ("a", 2), ("b", 1)], active="a")  # W = {c, a}: b makes room
    assert cache.is_resident("a") and not cache.is_available("b") and cache.is_available("c")
    assert cache.wait_for("c") == pytest.approx(1.0)


def test_a_blocking_wait_goes_ahead_of_the_queued_loads_as_in_the_real_cache():
    """The real cache puts the waited-for load ahead of the loads queued before it (runtime/cache.py _put_first);
    the replay must, or it charges a cold start the loads the last goal left queued."""
    clock = type("Clock", (), {"now": 0.0, "__call__": lambda self: self.now})()
    cache = SimCache(3, lambda name: 1.0, clock)
    cache.update([("a", 3), ("b", 2), ("c", 1)])  # a reads until 1, then b until 2, then c until 3
    clock.now = 0.5
    assert cache.wait_for("c") == pytest.approx(1.5)  # after a, ahead of b
    clock.now = 2.1
    assert sorted(cache.resident()) == ["a", "c"]  # b reads from 2 to 3: passed, still loaded
    clock.now = 3.1
    assert sorted(cache.resident()) == ["a", "b", "c"] and cache.loads == 3


def test_a_blocking_wait_whose_room_loads_in_flight_hold_waits_for_them_as_the_real_cache_does():
    """The real cache's wait_for waits for the loads in flight holding the room, then loads (runtime/cache.py);
    the simulated one gave up at once, and replayed the blocking policies differently there."""
    clock = type("Clock", (), {"now": 0.0, "__call__": lambda self: self.now})()
    cache = SimCache(1, lambda name: 1.0, clock)
    assert cache.request("a")  # in flight until t = 1
    assert cache.wait_for("b") == pytest.approx(2.0)  # a lands at 1 (evictable), then b's own second
    clock.now = 2.5
    assert cache.resident() == ["b"]
    cache.set_active("b")
    assert cache.wait_for("c") == 0.0  # the room is the active draft's: nothing in flight to wait for


def test_a_speed_scaled_cost_model_scales_every_compute_cost_and_no_load():
    """scaled() left call_other_seconds (the call's checks and bookkeeping) at the fitted speed: a speed-matched
    replay's end-to-end time kept that part unscaled."""
    from dataclasses import asdict

    model = CostModel(draft_token_seconds=1e-3, catchup_base_seconds=2e-3, catchup_token_seconds=3e-4,
                      other_iteration_seconds=4e-4, prefill_base_seconds=5e-3, prefill_token_seconds=6e-5,
                      call_other_seconds=7e-4, verify_seconds={1: 0.01, 5: 0.02}, point_seconds={"memspec": 1e-3},
                      setup_seconds={"memspec": 2e-3}, load_seconds={"code": 0.05})
    slow, data = model.scaled(2.0), asdict(model)
    for key, value in asdict(slow).items():
        if key.endswith("seconds") and key != "load_seconds":  # every compute cost, in one number or per key
            expected = ({k: 2.0 * v for k, v in data[key].items()} if isinstance(value, dict)
                        else 2.0 * data[key])
            assert value == pytest.approx(expected), key
    assert slow.load_seconds == model.load_seconds  # storage is not the machine's compute speed


def test_a_trace_replays_only_the_budgets_it_recorded(traces):
    trace = traces[0]
    assert trace.budget(NEW) == NEW
    assert trace.budget(NEW // 2) == NEW // 2
    with pytest.raises(ValueError, match="cannot replay"):
        trace.budget(NEW + 1)
    ended = PromptTrace("w", [1], [5, 6, 7], {"d": [True, True, True]}, eos=True)
    assert ended.budget(100) == 3  # it stopped at its end token: any larger budget outputs the same


def test_the_cost_aware_policy_replays_losslessly_in_both(models, traces):
    """memspec-cost-aware decides from measured times, so the decisions may differ; the output may not."""
    target, drafts = models
    ranker = context_ranker()
    ctl = real_controller(target, drafts, {}, COST_AWARE, ranker)
    sim = Simulator(tiny_costs(drafts), SimConfig(interval=INTERVAL, gamma=GAMMA, max_new_tokens=NEW), DOMAINS,
                    list(drafts))
    try:
        for trace in traces:
            assert ctl.generate(trace.prompt_ids, NEW).token_ids == trace.continuation
            stats = sim.generate(make_policy(COST_AWARE, predictor=ranker), trace)
            assert stats.completion_tokens == len(trace.continuation)
    finally:
        ctl.close()


def test_a_replayed_point_hands_the_policy_each_drafts_kv_length_as_the_controller_does(models, traces):
    """The controller gives memspec-cost-aware each resident draft's KV length (SchedulingPoint.draft_context); the
    simulator's points had none, so the replayed policy estimated the catch-up its own way and could decide
    otherwise than the real run."""
    _, drafts = models
    sim = Simulator(tiny_costs(drafts), SimConfig(interval=INTERVAL, gamma=GAMMA, max_new_tokens=NEW), DOMAINS,
                    list(drafts))
    policy = make_policy(COST_AWARE, predictor=context_ranker())
    seen = []
    choose = policy.choose
    policy.choose = lambda point: seen.append(point) or choose(point)
    sim.generate(policy, traces[0])
    later = [p for p in seen if p.interval > 0]
    assert later and all(p.draft_context is not None for p in later)
    for p in later:  # the draft that ran holds the prompt and every committed token but the newest
        if p.active:
            assert p.draft_context[p.active] <= len(traces[0].prompt_ids) + len(p.generated_ids)
            assert p.draft_context[p.active] > len(traces[0].prompt_ids)


def test_the_policy_bench_reports_the_simulators_validation(tmp_path, capsys):
    """`memspec-bench policies` replays its own runs and prints the comparison (the numbers are the machine's)."""
    import json

    from memspec_ros.bench.cli import main
    from memspec_ros.bench.policy_bench import gmean
    from memspec_ros.testing.tiny_zoo import build_tiny_zoo

    zoo = build_tiny_zoo(tmp_path / "zoo", hidden=64, layers=2)
    (zoo / "workloads").mkdir()
    # math has one prompt: no odd-numbered prompt there for the held-out replay (its GMEAN was 0 and the rendered
    # page raised on the undefined error)
    for workload, prompts in (("code", ("def add(a, b):", "class Stack:")), ("math", ("Solve 3x + 5 = 20.",)),
                              ("mixed", ("Explain this code:", "Prove it."))):
        (zoo / "workloads" / f"{workload}.jsonl").write_text(
            "".join(json.dumps({"domain": workload, "prompt": prompt}) + "\n" for prompt in prompts))
    out = tmp_path / "policies.json"
    policies = ["general-static", "mab-sync", "oracle-dynamic", "memspec", COST_AWARE]
    assert main(["policies", "--zoo", str(zoo), "--predictor", str(zoo / "predictor"), "--workloads", "code,math,mixed",
                 "--policies", ",".join(policies), "--prompts", "2", "--max-new-tokens", "16",
                 "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    validation = result["simulator_validation"]
    assert list(validation["policies"]) == policies
    # every GMEAN over the same workloads on both sides: the domains, not mixed (it once compared 2 with 3)
    assert validation["gmean_over"] == validation["pooled"]["gmean_over"] == result["gmean_workloads"] == [
        "code", "math"]
    assert validation["held_out"]["gmean_over"] == ["code"]  # the workloads with held-out runs
    for kind in (validation, validation["pooled"], validation["held_out"]):
        for row in kind["policies"].values():
            assert row["simulated_end_to_end"] > 0 and row["measured_end_to_end"] > 0
            ratio = row["simulated_end_to_end"] / row["measured_end_to_end"]
            assert row["error_end_to_end"] == pytest.approx(ratio - 1)
            assert set(row["workloads"]) == {"code", "math", "mixed"}
            for side in ("measured", "simulated"):
                assert row[f"{side}_end_to_end"] == pytest.approx(
                    gmean([row["workloads"][w][f"{side}_end_to_end"] for w in kind["gmean_over"]]))
        assert kind["within_tolerance"] == (kind["max_abs_error_end_to_end"] <= validation["tolerance"])
        # the decode metric's error is reported beside the gate's (the sweeps publish that metric)
        assert kind["max_abs_error_tokens_per_second"] == pytest.approx(
            max(abs(r["error_tokens_per_second"]) for r in kind["policies"].values()))
    assert validation["gate"]["max_abs_error_tokens_per_second"] == \
        validation["held_out"]["max_abs_error_tokens_per_second"]
    from memspec_ros.bench.figures import render_validation  # the results page's table renders it

    assert "held out: over code" in "\n".join(render_validation(validation))
    undefined = {**validation, "held_out": {**validation["held_out"], "max_abs_error_end_to_end": None}}
    assert "held out: n/a" in "\n".join(render_validation(undefined))  # it raised TypeError
    # one iteration unit: the load ratios count in the fitted model's gamma iteration, as the figures and the plan do
    fitted = CostModel.from_json(validation["cost_model"])
    assert result["storage"]["iteration_seconds"] == pytest.approx(fitted.iteration_seconds(4))
    for p in policies:  # the published table is what the validation calls measured
        assert validation["policies"][p]["measured_end_to_end"] == pytest.approx(
            result["gmean_end_to_end_tokens_per_second"][p])
    # held out: only the second prompt of each workload is replayed, against its own measurement
    assert validation["held_out"]["policies"]["memspec"]["measured_end_to_end"] != pytest.approx(
        validation["policies"]["memspec"]["measured_end_to_end"])
    captured = capsys.readouterr()
    printed = captured.out
    assert "held out" in printed
    # math ran its one row: said at the start and recorded, and the titles say so (they said 2 for every workload)
    assert "but math has 1 row(s)" in captured.err
    assert result["config"]["prompts_run"] == {"code": 2, "math": 1, "mixed": 2}
    from memspec_ros.bench.policy_bench import prompts_label

    assert prompts_label(result["config"]) == "up to 2 prompts/workload (math 1)"
    assert "GMEAN last, over code, math only" in printed  # not over the mixed column beside it


def test_the_paper_harness_writes_every_item_and_the_results_page(tmp_path):
    """`memspec-bench paper`: each item a JSON (and a PNG), every figure naming its medium, the README's part
    between its markers replaced, the rest of the page kept."""
    import json

    from memspec_ros.bench.cli import main
    from memspec_ros.bench.figures import BEGIN, END
    from memspec_ros.testing.tiny_zoo import build_tiny_zoo

    zoo = build_tiny_zoo(tmp_path / "zoo", hidden=64, layers=2)
    (zoo / "workloads").mkdir()
    for workload, prompt in (("code", "def add(a, b):"), ("math", "Solve 3x + 5 = 20.")):
        (zoo / "workloads" / f"{workload}.jsonl").write_text(json.dumps({"domain": workload, "prompt": prompt}) + "\n")
    out = tmp_path / "results"
    out.mkdir()
    (out / "README.md").write_text(f"# Results\n\nhand-written\n\n{BEGIN}\nstale\n{END}\n\nafter\n")
    code = main(["paper", "--zoo", str(zoo), "--predictor", str(zoo / "predictor"), "--out", str(out),
                 "--prompts", "1", "--workloads", "code,math", "--storage", "sd"])
    index = json.loads((out / "paper.json").read_text())
    # exit 0 only for a lossless run whose simulator held its tolerance (one prompt per workload may not)
    assert code == (0 if index["lossless"] and index["validation"]["within_tolerance"] else 1)
    assert index["lossless"]
    assert {"fig6", "fig7", "fig8_9", "fig10", "fig11", "fig12", "table2", "storage", "goals"} <= set(index["items"])
    for name in index["items"]:
        item = json.loads((out / f"{name}.json").read_text())
        assert item["source"]
        if name.startswith("fig"):
            assert item["medium"] == "sd" and (out / f"{name}.png").stat().st_size > 0
    # every figure names its medium: Table 2 too, which reads none (an accuracy)
    assert json.loads((out / "table2.json").read_text())["medium"].startswith("storage: none")
    sweep = json.loads((out / "fig12.json").read_text())
    assert sweep["source"] == "simulator" and [int(v) for v in sweep["rows"]] == [2, 3, 4]
    # MAB-Async's c, swept as the paper did (it kept 2.0, which the real runs use)
    mab_c = json.loads((out / "mab_c.json").read_text())
    assert mab_c["parameter"] == "ucb_c" and list(mab_c["rows"]) == ["0.1", "0.5", "1.0", "2.0", "3.0"]
    assert (out / "mab_c.png").stat().st_size > 0
    assert json.loads((out / "fig6.json").read_text())["source"] == "real runs"
    storage = json.loads((out / "storage.json").read_text())
    assert storage["media"] == ["local", "nvme", "emmc", "sd"] and storage["rows"]["sd"]["emulated"] is True
    # the run's own medium: the load cost its cost model and Oracle-Dynamic charged, not a second sample of it
    policies = json.loads((out / "policies.json").read_text())
    assert storage["rows"]["sd"]["load_seconds_per_draft"] == pytest.approx(
        policies["storage"]["modelled_load_seconds"], rel=1e-12)
    page = (out / "README.md").read_text()
    assert page.startswith("# Results\n\nhand-written") and page.rstrip().endswith("after")
    assert "stale" not in page and page.count(BEGIN) == 1 and "emulated" in page and "![" in page
    assert "no draft): **yes**" in page  # the runs were lossless, and the page says so


def test_the_results_page_names_every_run_that_was_not_lossless():
    from memspec_ros.bench.figures import _lossless_line

    rows = {"code": {"memspec": {"lossless": True}, "general-static": {"lossless": True}},
            "math": {"memspec": {"lossless": False}, "general-static": {"lossless": True}}}
    line = _lossless_line({"workloads": rows})
    assert "**NO**" in line and "memspec on math" in line and "general-static" not in line
    rows["math"]["memspec"]["lossless"] = True
    assert "**yes**" in _lossless_line({"workloads": rows})


def test_oracle_dynamic_stays_above_oracle_static_where_a_late_catch_up_costs_more():
    """A switch feeds the switched-in draft the prompt and the output so far, so a late switch costs more than the
    first catch-up. Priced at the first catch-up's constant, the schedule switched for 4-token stretches late in a
    long prompt's answer and came out below running one draft throughout (a reviewer's case, at the committed
    bench's fitted costs: 202.8 against 204.2 tok/s)."""
    new, gamma, interval, prompt = 128, 4, 4, 300
    a, b = [True] * new, [False] * new
    for start in range(40, new, 12):  # from token 40, every 12 tokens a 4-token stretch only b gets right
        for j in range(start, min(start + 4, new)):
            a[j], b[j] = False, True
    costs = CostModel(verify_seconds={0: 0.0094, 1: 0.0098, 2: 0.0105, 3: 0.0113, 4: 0.0121},
                      draft_token_seconds=0.00028, catchup_base_seconds=0.00061, catchup_token_seconds=0.0000296,
                      other_iteration_seconds=0.0002, load_seconds={"a": 0.038, "b": 0.038})
    trace = PromptTrace("w", list(range(1, prompt + 1)), list(range(1000, 1000 + new)), {"a": a, "b": b})
    sim = Simulator(costs, SimConfig(capacity=2, interval=interval, gamma=gamma, max_new_tokens=new),
                    {"a": "a", "b": "b"}, ["a", "b"])
    plan = costs.schedule_costs(capacity=2, gamma=gamma)
    assert plan.catchup_token_seconds == costs.catchup_token_seconds  # the line, not one catch-up's constant

    def oracle_for(ids):
        return trace.oracle(new, gamma, interval, plan)
    tps = {p: sim.generate(make_policy(p, oracle_for=oracle_for, general_draft="a"), trace).tokens_per_second
           for p in ("oracle-static", "oracle-dynamic")}
    assert tps["oracle-dynamic"] >= tps["oracle-static"]
    # the same schedule priced at the first catch-up alone (what the DP planned with before) falls below
    flat = ScheduleCosts(capacity=2, iteration_seconds=plan.iteration_seconds,
                         catchup_seconds=costs.catchup(prompt + 1), load_seconds=plan.load_seconds)

    def flat_oracle(ids):
        return trace.oracle(new, gamma, interval, flat)
    flat_tps = sim.generate(make_policy("oracle-dynamic", oracle_for=flat_oracle, general_draft="a"),
                            trace).tokens_per_second
    assert flat_tps < tps["oracle-static"]


@pytest.mark.parametrize("base", [0.00061, 0.0001, -0.002])
def test_the_schedule_prices_a_catch_up_as_the_replay_charges_it(base):
    """The replay charges a switched-in draft's catch-up forward, clamped at 0, in place of one draft forward; the
    schedule took that forward off before clamping, so a fitted line starting below one draft forward priced every
    switch higher than the replay did, by the difference (and Oracle-Dynamic switched less than it could)."""
    costs = CostModel(verify_seconds={0: 0.0094, 4: 0.0121}, draft_token_seconds=0.00028,
                      catchup_base_seconds=base, catchup_token_seconds=0.0000296)
    plan = costs.schedule_costs(capacity=2, gamma=4)
    for tokens in (0, 1, 10, 300):
        replayed = costs.catchup(tokens) - costs.draft_token_seconds  # beyond the draft forward it replaces
        assert plan.catchup_iterations(tokens) * plan.iteration_seconds == pytest.approx(replayed, abs=1e-12)
    # the solver's switch at answer position p feeds the prompt and p tokens, clamped once over them: it priced the
    # prompt's clamped catch-up plus a per-token line, over-charging (base -0.002: 0.0027 s against the replay's
    # 0.00098 at p = 100) wherever the line starts below zero
    from memspec_ros.runtime.oracle import ScheduleSolver

    prompt = 10
    oracle = GreedyOracle([0] * 200, {"a": [True] * 200, "b": [False] * 200}, 4, 4, costs=plan, prompt_tokens=prompt)
    solver = ScheduleSolver.for_oracle(oracle, ["a", "b"])
    for p in (0, 50, 100, 190):
        replayed = costs.catchup(prompt + p) - costs.draft_token_seconds
        assert solver.switch_cost(p) * plan.iteration_seconds == pytest.approx(replayed, abs=1e-12), p


def test_the_held_out_validation_takes_nothing_from_the_runs_it_checks(tmp_path, monkeypatch):
    """The gate replays each checked run with the cost model fitted on the other prompts at the fitted speed:
    the checked runs' own timings must not enter their replay. Speed-matched, the replay scaled each run's
    compute by that run's own verify time (most of its decode time), so the verify part agreed by construction
    and the held-out figure tested little. Here the checked runs' recorded verify times are doubled: their
    held-out replay does not move (the speed-matched one does)."""
    import json

    from memspec_ros.bench.policy_bench import PolicyBenchConfig, collect_policy_bench, validate_simulator
    from memspec_ros.testing.tiny_zoo import build_tiny_zoo

    zoo = build_tiny_zoo(tmp_path / "zoo", hidden=64, layers=2)
    (zoo / "workloads").mkdir()
    (zoo / "workloads" / "code.jsonl").write_text("".join(
        json.dumps({"domain": "code", "prompt": p}) + "\n" for p in ("def add(a, b):", "class Stack:")))
    cfg = PolicyBenchConfig(policies=["general-static", "memspec"], workloads=["code"], prompts=2,
                            max_new_tokens=16, storage="local", simulate=False)
    bench = collect_policy_bench(zoo, cfg, zoo / "predictor")
    before = validate_simulator(bench)
    first = bench.traces[0].prompt_ids
    for _, _, ids, stats in bench.runs:
        if list(ids) != list(first):  # the odd-numbered prompt: the checked one
            for it in stats.iterations:
                it.verify_seconds *= 2
    after = validate_simulator(bench)
    for p in cfg.policies:
        held = (before["held_out"]["policies"][p], after["held_out"]["policies"][p])
        assert held[1]["simulated_end_to_end"] == pytest.approx(held[0]["simulated_end_to_end"])
        matched = (before["held_out_speed_matched"]["policies"][p], after["held_out_speed_matched"]["policies"][p])
        assert matched[1]["simulated_end_to_end"] < matched[0]["simulated_end_to_end"]
    assert after["gate"]["kind"].startswith("held out")
    assert after["gate"]["max_abs_error_end_to_end"] == after["held_out"]["max_abs_error_end_to_end"]
    # the oracles of the replays plan with what the timed Oracle-Dynamic planned with, not the fitted costs
    planned = []
    policy = type(bench).policy
    monkeypatch.setattr(type(bench), "policy", lambda self, name, config, costs=None, schedule=None: (
        planned.append(schedule) or policy(self, name, config, costs, schedule)))
    validate_simulator(bench)
    assert planned and all(s is bench.schedule_costs for s in planned)


def test_the_cost_models_per_iteration_and_per_point_costs_are_pooled_over_the_runs():
    """Each run's other-time per iteration (and prediction per scheduling point) was averaged with equal weight:
    a 3-iteration answer at 0.5 ms and a 32-iteration one at 0.24 ms gave 0.37 ms per iteration, not 0.26."""
    from memspec_ros.runtime.simulator import CostModel
    from memspec_ros.runtime.stats import GenerationStats, IterationStats

    def run(iterations: int, other_ms: float, points: int, prediction_ms: float) -> GenerationStats:
        stats = GenerationStats(decode_seconds=iterations * other_ms / 1000, predictions=points + 1)
        stats.iterations = [IterationStats(draft="a", proposed=4, accepted=1, committed=2, draft_seconds=0.0,
                                           verify_seconds=0.0) for _ in range(iterations)]
        stats.iterations[0].prediction_seconds = points * prediction_ms / 1000
        stats.decode_seconds += stats.iterations[0].prediction_seconds
        return stats

    costs = CostModel.measure([("memspec", run(3, 0.5, 1, 1.0)), ("memspec", run(32, 0.24, 7, 0.2))], {}, "local")
    assert costs.other_iteration_seconds == pytest.approx((3 * 0.5 + 32 * 0.24) / 35 / 1000)
    assert costs.point_seconds["memspec"] == pytest.approx((1 * 1.0 + 7 * 0.2) / 8 / 1000)


def test_the_setup_charged_is_of_the_runs_that_chose_a_draft():
    """A generation the prefill's token ended makes no first choice (its setup the policy's start alone), and the
    replay charges it no setup; its near-zero setup went into the median charged to every other generation. With
    no run that chose, those are what there is."""
    from memspec_ros.runtime.simulator import CostModel
    from memspec_ros.runtime.stats import GenerationStats

    def run(setup: float, chose: bool) -> GenerationStats:
        return GenerationStats(setup_seconds=setup, predictions=1 if chose else 0)

    runs = [("memspec", run(0.0001, False)), ("memspec", run(0.0001, False)), ("memspec", run(0.02, True)),
            ("general-static", run(0.0002, False))]
    costs = CostModel.measure(runs, {}, "local")
    assert costs.setup_seconds == {"memspec": pytest.approx(0.02), "general-static": pytest.approx(0.0002)}


@pytest.mark.parametrize("bad, says", [({"capacity": 0}, r"capacity \(K\) must be an integer in \[1, 64\]"),
                                       ({"interval": 0}, r"interval \(N\) must be"),
                                       ({"gamma": 0}, "gamma must be"),
                                       ({"recent_tokens": -1}, r"recent_tokens \(T\) must be"),
                                       ({"max_new_tokens": 0}, "max_new_tokens must be an integer >= 1")])
def test_the_simulator_refuses_settings_the_runtime_refuses(bad, says):
    """SimConfig checked nothing: with K = 0 no load could make room, every policy decoded on the target alone and
    a sweep printed figures for a setting no real run can have."""
    with pytest.raises(ValueError, match=says):
        SimConfig(**bad)
    assert SimConfig(capacity=64, interval=1, gamma=1, recent_tokens=0, max_new_tokens=1).capacity == 64


def test_a_held_out_replay_that_covers_no_workload_leaves_the_gate_to_the_pooled_one(tmp_path):
    """Every domain workload with one prompt and mixed (left out of the GMEAN) with two: the held-out replay covered
    no workload, and the gate read "held out" with an undefined error and failed, where the pooled replay is the
    only one there is."""
    import json

    from memspec_ros.bench.cli import main
    from memspec_ros.testing.tiny_zoo import build_tiny_zoo

    zoo = build_tiny_zoo(tmp_path / "zoo", hidden=64, layers=2)
    (zoo / "workloads").mkdir()
    for workload, prompts in (("code", ("def add(a, b):",)), ("mixed", ("Explain this code:", "Prove it."))):
        (zoo / "workloads" / f"{workload}.jsonl").write_text(
            "".join(json.dumps({"domain": workload, "prompt": prompt}) + "\n" for prompt in prompts))
    out = tmp_path / "policies.json"
    main(["policies", "--zoo", str(zoo), "--predictor", str(zoo / "predictor"), "--workloads", "code,mixed",
          "--policies", "general-static,memspec", "--prompts", "2", "--max-new-tokens", "12", "--json", str(out)])
    validation = json.loads(out.read_text())["simulator_validation"]
    assert validation["held_out"]["gmean_over"] == []
    assert validation["gate"]["kind"].startswith("pooled")
    assert validation["gate"]["max_abs_error_end_to_end"] == validation["pooled"]["max_abs_error_end_to_end"]
    assert validation["gate"]["max_abs_error_end_to_end"] is not None


def test_a_replay_runs_the_mab_policies_with_the_configs_exploration_coefficient():
    """The paper swept MAB-Async's c (0.1 to 3) and kept its best: the replay builds the bandits with the simulated
    configuration's c, which the runtime's range bounds."""
    import types

    from memspec_ros.bench.policy_bench import BenchRun, PolicyBenchConfig

    run = BenchRun(result={}, cfg=PolicyBenchConfig(), traces=[], costs=types.SimpleNamespace(
        schedule_costs=lambda capacity, gamma: None), schedule_costs=None, predictor=None, domains={}, registry=None,
        runs=[])
    for c in (0.1, 3.0):
        assert run.policy("mab-async", run.sim_config(ucb_c=c)).c == c
    assert run.policy("mab-sync", run.sim_config()).c == 2.0  # the real runs' (RuntimeConfig's default)
    with pytest.raises(ValueError, match="ucb_c"):
        run.sim_config(ucb_c=float("nan"))


@pytest.mark.parametrize(("new", "reason"), [(8, "eos"), (12, "eos"), (7, "length")])
def test_a_replayed_answer_ending_at_its_budgets_last_token_finishes_as_the_engine_says(new, reason):
    """An end token as the budget's last token was replayed as "length"; the engine checks end tokens first."""
    costs = CostModel(verify_seconds={0: 0.01, 2: 0.012}, draft_token_seconds=0.001, load_seconds={"a": 0.01})
    trace = PromptTrace("w", [1, 2, 3], list(range(100, 107)) + [0], {"a": [True] * 8}, eos=True)
    sim = Simulator(costs, SimConfig(capacity=1, interval=2, gamma=2, max_new_tokens=new), {"a": "a"}, ["a"])
    stats = sim.generate(make_policy("general-static", general_draft="a"), trace)
    assert stats.finish_reason == reason and stats.completion_tokens == min(new, 8)


def test_a_forward_line_never_falls_with_its_tokens():
    """The catch-up and prefill lines are fitted through a few timed forwards: noise made one fall, and Oracle-Dynamic
    (whose catch-up slope is no longer clamped apart from the replay's) then priced late switches at nothing."""
    from memspec_ros.runtime.simulator import fit_line

    assert fit_line([1, 2, 3], [1.0, 2.0, 3.0]) == pytest.approx((0.0, 1.0))
    assert fit_line([1, 2, 3], [3.0, 2.5, 1.0]) == pytest.approx((6.5 / 3, 0.0))  # the mean, flat
    assert fit_line([4, 4], [1.0, 3.0]) == (2.0, 0.0) and fit_line([], []) == (0.0, 0.0)
