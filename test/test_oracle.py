"""Oracle-Dynamic is the best schedule under the same K and costs: never worse than Oracle-Static by
construction, equal to an exhaustive search where one is possible, and carried out by the controller.

Every cost here is in the model's unit (speculative iterations); nothing is timed.
"""

from __future__ import annotations

import math
import random
import time
from dataclasses import replace
from functools import cache
from pathlib import Path

import pytest
import torch

from memspec_ros.runtime.controller import RuntimeConfig, RuntimeController
from memspec_ros.runtime.models import LoadedModel, ModelSpec, load_model, parameter_bytes
from memspec_ros.runtime.oracle import GreedyOracle, ScheduleCosts, ScheduleSolver, interval_walk, target_greedy
from memspec_ros.runtime.registry import DraftEntry, DraftRegistry
from memspec_ros.testing.tiny_models import noisy_copy, tiny_llama


def random_table(rng: random.Random, drafts: int, length: int, gamma: int, interval: int):
    """Agreement arrays of drafts with different strengths, and the interval walk over them."""
    agree = {f"d{i}": [rng.random() < rng.choice([0.2, 0.5, 0.8, 0.95]) for _ in range(length)] for i in range(drafts)}

    def step(d: str, p: int) -> tuple[int, int]:
        tokens, accepted = interval_walk(agree[d], p, gamma, interval)
        return p + tokens, len(accepted)

    return list(agree), step


def random_solver(seed: int, capacity: int | None = None, drafts: int = 5, length: int = 96) -> ScheduleSolver:
    rng = random.Random(seed)
    interval = rng.choice([1, 2, 4])
    names, step = random_table(rng, drafts, length, rng.choice([2, 4]), interval)
    load = {d: rng.choice([0.0, rng.uniform(0, 3 * interval), rng.uniform(0, 40)]) for d in names}
    return ScheduleSolver(names, step, 1, length, interval, capacity or rng.randint(1, 4),
                          catchup=rng.choice([0.0, rng.uniform(0, 2)]), load=load,
                          catchup_per_token=rng.choice([0.0, rng.uniform(0, 0.05)]))


@pytest.mark.parametrize("seed", range(40))
def test_the_schedule_is_never_slower_than_the_best_static_draft(seed):
    solver = random_solver(seed)
    static = min(solver.static_cost(d) for d in solver.drafts)
    assert solver.cost() <= static + 1e-9
    # the plan it reports is a schedule of the model that costs what the DP says
    assert simulate(solver, solver.plan()) == pytest.approx(solver.cost())


def simulate(solver: ScheduleSolver, plan) -> float:
    """Replay a plan with plain rules, independently of the solver's transition code."""
    p, active, resident, loading, cost, points = solver.start, "", set(), None, 0.0, 0
    for position, action in plan:
        assert position == p
        if loading is not None and (points - loading[1]) * solver.interval >= solver.load[loading[0]]:
            resident.add(loading[0])
            loading = None
        x, victims = action.run, iter(action.evict)
        if action.kind == "start":
            if x not in resident and len(resident) >= solver.capacity:
                resident.remove(next(victims))
            resident.add(x)
        elif action.kind == "resident":
            assert x in resident
        elif action.kind == "wait":
            assert loading is not None and loading[0] == x
            cost += max(0.0, solver.load[x] - (points - loading[1]) * solver.interval)
            resident.add(x)
            loading = None
        else:
            assert action.kind == "load" and loading is None and x not in resident
            cost += solver.load[x]
            if len(resident) >= solver.capacity:
                resident.remove(next(victims))
            resident.add(x)
        if action.prefetch:
            assert loading is None and action.prefetch not in resident and action.kind in ("start", "resident")
            if len(resident) >= solver.capacity:
                victim = next(victims)
                assert victim != x  # the controller protects the draft that runs next (choice.carry_out)
                resident.remove(victim)
            loading = (action.prefetch, points)
        assert len(resident) + (loading is not None) <= solver.capacity
        nxt, iterations = solver.step(x, p)
        cost += iterations + (solver.switch_cost(p) if x != active else 0.0)
        p, active, points = nxt, x, points + 1
    assert p >= solver.end
    return cost


def exhaustive(solver: ScheduleSolver) -> float:
    """The least cost over every sequence of decisions, by plain recursion (no shared code with the DP)."""
    drafts, cap, n = solver.drafts, solver.capacity, solver.interval

    @cache
    def best(p: int, active: str, resident: frozenset, loading: tuple[str, int] | None) -> float:
        if p >= solver.end:
            return 0.0
        if loading is not None and loading[1] * n >= solver.load[loading[0]]:
            resident, loading = resident | {loading[0]}, None
        out = math.inf
        for x in drafts:
            runs = []  # (wait, resident after, loading after, may prefetch, evictable for the prefetch)
            if p == solver.start and active == "":
                runs.append((0.0, resident | {x}, None, True, {x}))
            elif x in resident:
                runs.append((0.0, resident, None if loading is None else (loading[0], loading[1] + 1),
                             loading is None, {x}))  # as the DP and carry_out: only the draft to run is kept
            elif loading is not None and loading[0] == x:
                runs.append((max(0.0, solver.load[x] - loading[1] * n), resident | {x}, None, False, set()))
            elif loading is None:
                victims = [None] if len(resident) < cap else list(resident)
                runs += [(solver.load[x], (resident - {v}) | {x}, None, False, set()) for v in victims]
            nxt, iterations = solver.step(x, p)
            run_cost = iterations + (solver.switch_cost(p) if x != active else 0.0)
            for wait, res, load_after, may_prefetch, protect in runs:
                out = min(out, wait + run_cost + best(nxt, x, frozenset(res), load_after))
                if not may_prefetch or cap < 2:
                    continue
                for b in drafts:
                    if b in res:
                        continue
                    lefts = [res] if len(res) < cap else [res - {v} for v in res - protect]
                    for left in lefts:
                        out = min(out, wait + run_cost + best(nxt, x, frozenset(left), (b, 1)))
        return out

    return best(solver.start, "", frozenset(), None)


@pytest.mark.parametrize("seed", range(12))
def test_the_dynamic_program_equals_an_exhaustive_search(seed):
    solver = random_solver(1000 + seed, capacity=random.Random(seed).randint(1, 3), drafts=3, length=28)
    assert solver.cost() == pytest.approx(exhaustive(solver))


@pytest.mark.parametrize("seed", range(10))
def test_more_memory_never_makes_the_schedule_slower(seed):
    costs = [random_solver(2000 + seed, capacity=k).cost() for k in (1, 2, 3, 4)]
    assert all(b <= a + 1e-9 for a, b in zip(costs, costs[1:], strict=False))


def test_with_free_switches_it_takes_the_best_draft_of_every_interval_path():
    rng = random.Random(7)
    names, step = random_table(rng, 4, 80, 4, 2)
    solver = ScheduleSolver(names, step, 1, 80, 2, capacity=4)

    @cache
    def shortest(p: int) -> int:  # any draft at every interval, nothing to pay
        return 0 if p >= 80 else min(step(d, p)[1] + shortest(step(d, p)[0]) for d in names)

    assert solver.cost() == shortest(1)


def test_loads_that_never_pay_keep_one_draft():
    rng = random.Random(3)
    names, step = random_table(rng, 5, 128, 4, 4)
    solver = ScheduleSolver(names, step, 1, 128, 4, capacity=2, catchup=1.0, load=dict.fromkeys(names, 1e6))
    runs = {action.run for _, action in solver.plan()}
    assert len(runs) == 1 and solver.cost() == min(solver.static_cost(d) for d in names)


# -- the policy carries out the schedule through the real controller ----------------------------------

PROMPT = [1, 5, 7, 9, 11, 13]
NEW = 48


@pytest.fixture(scope="module")
def models():
    torch.manual_seed(0)
    target = tiny_llama(layers=2, hidden=32, seed=0)
    drafts = {"general": tiny_llama(layers=1, hidden=32, seed=1), "code": noisy_copy(target, 0.03, seed=2),
              "math": noisy_copy(target, 0.01, seed=3), "law": noisy_copy(target, 0.02, seed=4)}
    return target, drafts


def controller(target, drafts, oracle, capacity=2):
    registry = DraftRegistry([DraftEntry(n, f"/virtual/{n}", n, 1000) for n in drafts], validate=False)

    def load(name):
        model = drafts[name]
        return LoadedModel(model, ModelSpec(name), parameter_bytes(model), 64, 512)

    config = RuntimeConfig(policy="oracle-dynamic", capacity=capacity, interval=oracle.interval, gamma=oracle.gamma,
                           reset_cache_per_generation=True)
    return RuntimeController(config, target, None, registry, loader=load, oracle_for=lambda ids: oracle,
                             eos_token_ids=[])


def per_interval_drafts(stats, interval: int) -> list[str]:
    return [stats.iterations[i].draft for i in range(0, len(stats.iterations), interval)]


@pytest.mark.parametrize("load_iterations", [1.0, 6.0])
def test_oracle_dynamic_runs_its_schedule_losslessly(models, load_iterations):
    target, drafts = models
    oracle = GreedyOracle.compute(target, drafts, PROMPT, NEW, gamma=4, interval=2)
    oracle.costs = ScheduleCosts(capacity=2, iteration_seconds=1.0, catchup_seconds=0.25,
                                 load_seconds=dict.fromkeys(drafts, load_iterations))
    solver = ScheduleSolver.for_oracle(oracle, list(drafts))
    plan = solver.plan()
    ctl = controller(target, drafts, oracle)
    try:
        result = ctl.generate(PROMPT, NEW)
    finally:
        ctl.close()
    assert result.token_ids == target_greedy(target, PROMPT, NEW)
    if result.stats.load_wait_seconds == 0.0:  # the loader kept up with the model: the run IS the plan
        assert per_interval_drafts(result.stats, oracle.interval) == [a.run for _, a in plan]
        assert len(result.stats.iterations) == sum(solver.step(a.run, p)[1] for p, a in plan)


def test_oracle_dynamic_plans_once_per_prompt_outside_the_timed_runs(models, monkeypatch):
    """The schedule is hindsight: a bench solves it before its timed runs (GreedyOracle.plan) and every run of the
    prompt reuses it. Solved inside the first choice, it was charged to Oracle-Dynamic's setup (27 ms a generation
    against 0.2-0.5 ms for the other policies) and so to its end-to-end figure. New costs plan again."""
    target, drafts = models
    oracle = GreedyOracle.compute(target, drafts, PROMPT, NEW, gamma=4, interval=2)
    oracle.costs = ScheduleCosts(capacity=2, iteration_seconds=1.0, catchup_seconds=0.25,
                                 load_seconds=dict.fromkeys(drafts, 1.0))
    built = []
    real = ScheduleSolver.for_oracle.__func__
    monkeypatch.setattr(ScheduleSolver, "for_oracle",
                        classmethod(lambda cls, *a, **k: built.append(1) or real(cls, *a, **k)))
    oracle.plan(list(drafts))
    assert len(built) == 1
    ctl = controller(target, drafts, oracle)
    try:
        first, second = ctl.generate(PROMPT, NEW), ctl.generate(PROMPT, NEW)
    finally:
        ctl.close()
    assert len(built) == 1  # both runs took the planned schedule
    assert first.token_ids == second.token_ids == target_greedy(target, PROMPT, NEW)
    oracle.costs = replace(oracle.costs, catchup_seconds=0.5)
    oracle.plan(list(drafts))
    assert len(built) == 2


def test_oracle_dynamic_on_a_warm_cache_loads_its_first_draft_at_setup_as_planned(models):
    """The schedule's first draft loads during setup (the solver's START). On a warm cache the first choice did
    not block, so a resident draft the schedule had not chosen decoded while the planned one loaded (Oracle-
    Dynamic ran a draft accepting nothing for the whole answer, below Oracle-Static). Now the first iteration
    runs the planned draft, and its load is setup, not decoding."""
    target, drafts = models
    oracle = GreedyOracle.compute(target, drafts, PROMPT, NEW, gamma=4, interval=2)
    oracle.costs = ScheduleCosts(capacity=2, iteration_seconds=1.0, catchup_seconds=0.25,
                                 load_seconds=dict.fromkeys(drafts, 2.0))
    registry = DraftRegistry([DraftEntry(n, f"/virtual/{n}", n, 1000) for n in drafts], validate=False)

    def load(name):
        time.sleep(0.05)
        return LoadedModel(drafts[name], ModelSpec(name), parameter_bytes(drafts[name]), 64, 512)

    config = RuntimeConfig(policy="general-static", capacity=2, interval=oracle.interval, gamma=oracle.gamma,
                           general_draft="general")
    ctl = RuntimeController(config, target, None, registry, loader=load, oracle_for=lambda ids: oracle,
                            eos_token_ids=[])
    try:
        ctl.generate(PROMPT, 8)  # the last goal left "general" resident
        ctl.cache.drain()
        assert ctl.cache.resident() == ["general"]
        planned = oracle.solver(list(drafts)).best_action((1, "", frozenset({"general"}), None))
        assert planned.run != "general"  # the case: the plan starts on a draft that is not resident
        ctl.reconfigure(policy="oracle-dynamic")
        result = ctl.generate(PROMPT, NEW)
    finally:
        ctl.close()
    assert result.token_ids == target_greedy(target, PROMPT, NEW)
    assert result.stats.iterations[0].draft == planned.run and not result.stats.iterations[0].fallback
    assert result.stats.setup_wait_seconds > 0  # loaded at setup, outside the decode metric


@pytest.mark.parametrize("capacity", [1, 3])
def test_oracle_dynamic_plans_with_the_caches_k(models, monkeypatch, capacity):
    """An oracle without costs planned with ScheduleCosts()'s K = 2 whatever the controller's K: prefetches into
    slots a K = 1 cache does not have, a third draft a K = 3 cache could hold left out. The cache's K wins."""
    target, drafts = models
    oracle = GreedyOracle.compute(target, drafts, PROMPT, NEW, gamma=4, interval=2)
    planned = []
    real = ScheduleSolver.for_oracle.__func__
    monkeypatch.setattr(ScheduleSolver, "for_oracle", classmethod(
        lambda cls, o, d, costs=None: planned.append(costs.capacity) or real(cls, o, d, costs)))
    ctl = controller(target, drafts, oracle, capacity=capacity)
    try:
        result = ctl.generate(PROMPT, NEW)
    finally:
        ctl.close()
    assert result.token_ids == target_greedy(target, PROMPT, NEW)
    assert planned and set(planned) == {capacity}


def test_oracle_next_interval_is_the_myopic_variant(models):
    from memspec_ros.runtime.policies import POLICIES, make_policy

    target, drafts = models
    oracle = GreedyOracle.compute(target, drafts, PROMPT, NEW, gamma=4, interval=2)
    assert "oracle-next-interval" in POLICIES
    policy = make_policy("oracle-next-interval", oracle_for=lambda ids: oracle)
    assert policy.name == "oracle-next-interval"


BUNDLED = Path(__file__).resolve().parents[1] / "models"


@pytest.mark.skipif(not (BUNDLED / "registry.yaml").is_file(), reason="the bundled zoo is not built")
def test_the_oracles_future_is_the_engines_own_run_on_the_bundled_int4_target():
    """On a quantized path the module forward (transformers') and the engine's forward round the int8
    activations differently, so their greedy outputs part at near-ties (here: the first token of some
    prompts). The oracle is the run's future: its continuation must be what the engine outputs, and its
    agreement must give every real iteration's accepted count, or the oracles plan for another text and
    the simulator replays one (what made `make bench` on int4 report lossless false and miss its
    validation)."""
    from memspec_ros.bench.policy_bench import workload_prompts
    from memspec_ros.runtime.draft_forward import observe_hidden
    from memspec_ros.runtime.loader import load_models
    from memspec_ros.runtime.oracle import engine_greedy
    from memspec_ros.runtime.simulator import target_hidden_states
    from memspec_ros.runtime.speculative import generate

    torch.set_num_threads(1)
    models = load_models(BUNDLED / "registry.yaml", quantization="int4")
    try:
        entry = next(iter(models.registry))
        draft = load_model(ModelSpec(str(entry.path), quantization="int4")).model
        prompts = workload_prompts(BUNDLED / "workloads", ["math", "code"], 2, models.tokenizer)
        target, eos, checked = models.target.model, models.end_token_ids, 0
        for ids in (ids for per_workload in prompts.values() for ids in per_workload):
            oracle = GreedyOracle.compute(target, {entry.name: draft}, ids, 24, gamma=4, interval=4,
                                          eos_token_ids=eos)
            run = generate(target, ids, draft, draft_name=entry.name, max_new_tokens=24, eos_token_ids=eos)
            assert run.generated_ids == oracle.continuation
            position = 1  # the prefill committed the first token
            for it in run.stats.iterations:
                agree = oracle.agreement[entry.name][position : position + it.proposed]
                expected = next((k for k, ok in enumerate(agree) if not ok), len(agree))
                assert it.accepted == expected, (position, it)
                position += it.committed
                checked += it.proposed
        assert checked > 0  # the draft proposed: agreement was compared, not only the text
        # the replayed predictor's view (runtime/simulator.py) is the live encoder's: the rows the engine's
        # forward hands its observers while it decodes, not transformers' forward of the same text
        seen: list[torch.Tensor] = []
        handle = observe_hidden(target, lambda hidden, start: seen.append(hidden.detach().float().clone()))
        try:
            alone = engine_greedy(target, ids, 24, eos)
        finally:
            handle.remove()
        fed = torch.cat(seen)  # the prompt, then every generated token but the last
        # (row-exact on the kernels; the tolerance is for CPUs where the lean forward runs torch's attention,
        # far below transformers' forward's 1e-2 differences on this int4 target)
        torch.testing.assert_close(target_hidden_states(target, ids, alone)[: fed.shape[0]], fed, atol=1e-4,
                                   rtol=1e-4)
    finally:
        models.close()


def test_a_load_is_credited_with_the_whole_time_an_interval_of_iterations_takes():
    """Each iteration costs its draft, verify and the loop's other time, and a load runs through all of it; the
    solver credited an interval with N iterations' draft and verify only, so it had the schedule wait on (or put
    off) a load a prefetching policy found complete: the 'upper bound' could then be beaten."""
    costs = ScheduleCosts(iteration_seconds=1.0, verify_seconds={0: .5, 1: .5, 2: .5, 3: .6, 4: .6},
                          draft_token_seconds=.1, other_iteration_seconds=.3, load_seconds={"a": 0.0, "b": 4.5})
    oracle = GreedyOracle([0] * 200, {"a": [False] * 200, "b": [True] * 200}, 4, 4, costs=costs)
    solver = ScheduleSolver.for_oracle(oracle, ["a", "b"])
    # an interval of 4 full iterations is 4 x 1.3 = 5.2 iterations of time, past b's 4.5: b is resident after one
    assert solver.normalise((50, "a", frozenset({"a"}), ("b", 1)))[3] is None


def test_the_oracle_prices_the_last_iterations_of_an_answer_that_ends_at_an_end_token_as_the_engine_runs_them():
    """The engine proposes up to the token budget (it cannot know the end token comes); the solver priced the
    last iterations of an answer shorter than the budget by the proposals left to the answer's end."""
    costs = ScheduleCosts(iteration_seconds=1.0, verify_seconds={0: .5, 1: .5, 2: .5, 3: .6, 4: .6},
                          draft_token_seconds=.1)
    short = GreedyOracle([0] * 10, {"d": [False] * 10}, 4, 1, costs=costs, max_new_tokens=128)
    assert ScheduleSolver.for_oracle(short, ["d"]).step("d", 7)[1] == pytest.approx(costs.iteration_cost(4))
    at_budget = replace(short, max_new_tokens=0)  # cut by the budget: the proposals left are the budget's
    assert ScheduleSolver.for_oracle(at_budget, ["d"]).step("d", 7)[1] == pytest.approx(costs.iteration_cost(2))


def test_oracle_dynamic_plans_a_refused_prefetch_as_no_load_in_flight(monkeypatch):
    """Oracle-Dynamic remembered each prefetch it asked for as in flight until the draft was resident. A prefetch
    the cache refused (its byte budget) or that failed never lands: the schedule then waited for a load that was
    not coming (a blocking load of the refused draft, planned as a cheap wait). It plans from the cache's own
    loads (SchedulingPoint.loading) where the point says them. And a load still reading after the time the model
    gives it (3 iterations here, landed after 2 intervals of 2) was planned as resident, so the schedule ran it and
    the policy blocked on it: it is planned as still in flight, the wait weighed against the resident draft."""
    from memspec_ros.runtime.policies import OracleDynamicPolicy, SchedulingPoint

    length = 40
    oracle = GreedyOracle(list(range(length)), {"a": [True] * length, "b": [True, False] * (length // 2)},
                          gamma=4, interval=2, costs=ScheduleCosts(capacity=2, iteration_seconds=1.0,
                                                                   load_seconds={"a": 3.0, "b": 3.0}))
    policy = OracleDynamicPolicy(lambda ids: oracle)
    policy.start([1, 2, 3])
    planned_from = []
    solver = oracle.solver(["a", "b"], 2)
    best = solver.best_action
    monkeypatch.setattr(solver, "best_action", lambda state: planned_from.append(state) or best(state))

    def point(loading):
        return SchedulingPoint(interval=2, prompt_ids=[1, 2, 3], generated_ids=list(range(9)), recent_ids=[],
                               candidates=["a", "b"], domains={}, resident=["b"], active="b", capacity=2,
                               loading=loading)

    for loading, expected in ((["a"], ("a", 1)), ([], None), (None, ("a", 2))):  # None: unknown, as before
        policy._loading = ("a", 0)  # the policy asked for "a" at the first scheduling point
        policy.choose(point(loading))
        assert planned_from[-1][3] == expected, loading
