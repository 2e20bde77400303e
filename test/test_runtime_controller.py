"""The shared controller loop: lossless under every policy, MemSpec never blocks, failures and
registry changes mid-generation, K = 1, reconfiguration and cancel."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from memspec_ros.runtime.cache import DraftCacheManager
from memspec_ros.runtime.controller import RuntimeConfig, RuntimeController
from memspec_ros.runtime.models import LoadedModel, ModelSpec, parameter_bytes
from memspec_ros.runtime.oracle import GreedyOracle, target_greedy
from memspec_ros.runtime.policies import POLICIES, PolicyError
from memspec_ros.runtime.predictor import FixedRanker
from memspec_ros.runtime.registry import DraftEntry, DraftRegistry
from memspec_ros.testing.tiny_models import noisy_copy, tiny_llama

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

    def __init__(self, drafts, delay=0.0, fail=()):
        self.drafts, self.delay, self.fail, self.calls = drafts, delay, set(fail), []

    def __call__(self, name):
        self.calls.append(name)
        time.sleep(self.delay)
        if name in self.fail:
            raise OSError(f"simulated read error for {name}")
        model = self.drafts[name]
        return LoadedModel(model, ModelSpec(name), parameter_bytes(model), 64, 512)


def registry_of(drafts):
    return DraftRegistry([DraftEntry(n, f"/virtual/{n}", n, 1000) for n in drafts], validate=False)


def alternating(context):
    """A predictor stand-in whose favourite changes every interval (exercises prefetch/eviction)."""
    orders = [["math", "law", "code", "general"], ["code", "math", "law", "general"], ["law", "code", "math", "general"]]
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


def test_mab_sync_blocks_and_mab_async_does_not(target, drafts):
    sync = make(target, drafts, "mab-sync", loader=Loader(drafts, delay=0.05), capacity=1)
    s = sync.generate(PROMPT, NEW).stats
    assert s.load_wait_seconds > 0.04 and s.fallback_fraction == 0.0
    asy = make(target, drafts, "mab-async", loader=Loader(drafts, delay=0.05), capacity=1)
    a = asy.generate(PROMPT, NEW).stats
    assert a.load_wait_seconds == 0.0
    sync.close()
    asy.close()


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
    assert stats.prediction_seconds > 0 and stats.prediction_overhead < 1.0
    assert all(it.preferred for it in spec)
    summary = stats.summary()
    assert summary["policy"] == "memspec" and "cache_hits" in summary
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


torch.set_num_threads(1)
