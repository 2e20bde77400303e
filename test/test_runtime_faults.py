"""Faults inside the runtime, without ROS: a draft whose forward runs out of memory, a numerically broken
draft (NaN or infinite weights), the target running out of memory, any exception on the loader thread, and
cache.remove() hammered from another thread while generations run. After each: greedy output is still the
target's own, sampling finishes, the failed draft is out of service with the cause, and the next
generation succeeds."""

from __future__ import annotations

import random
import threading

import pytest
import torch

from memspec_ros.runtime.controller import RuntimeConfig, RuntimeController
from memspec_ros.runtime.models import LoadedModel, ModelSpec, parameter_bytes
from memspec_ros.runtime.oracle import target_greedy
from memspec_ros.runtime.predictor import FixedRanker
from memspec_ros.runtime.registry import DraftEntry, DraftRegistry
from memspec_ros.runtime.speculative import SamplingConfig
from memspec_ros.testing.tiny_models import noisy_copy

PROMPT = [1, 5, 7, 9, 11, 13]
NEW = 40
NAMES = ("broken", "code", "math")
SAMPLED = SamplingConfig(temperature=0.9, seed=7)


@pytest.fixture(scope="module")
def drafts(target):
    return {name: noisy_copy(target, 0.01, seed=i + 1) for i, name in enumerate(NAMES)}


@pytest.fixture(scope="module")
def expected(target):
    return target_greedy(target, PROMPT, NEW)


class Loader:
    """Hands out the given modules (the test swaps in broken ones); ``fault`` raises from the loader thread."""

    def __init__(self, drafts) -> None:
        self.drafts, self.fault = dict(drafts), None

    def __call__(self, name: str) -> LoadedModel:
        if self.fault is not None and name == "broken":
            raise self.fault
        model = self.drafts[name]
        return LoadedModel(model, ModelSpec(name), parameter_bytes(model), 64, 512)


def make(target, loader, policy="memspec", **cfg) -> RuntimeController:
    registry = DraftRegistry([DraftEntry(n, f"/virtual/{n}", n, 1000) for n in NAMES], validate=False)
    return RuntimeController(RuntimeConfig(policy=policy, general_draft="broken", **cfg), target, None, registry,
                             FixedRanker(lambda c: list(NAMES)), loader=loader, eos_token_ids=[])


def fail_forward(monkeypatch, model, error: BaseException, after: int = 0) -> None:
    """The engine's one forward (lean or transformers') raises ``error`` for ``model`` from its ``after``-th call
    on (0: every call): what an out-of-memory error in the middle of decoding looks like to the engine."""
    from memspec_ros.runtime import speculative

    forward, calls = speculative._forward, {"n": 0}

    def failing(m, *args, **kwargs):
        if m is model:
            calls["n"] += 1
            if calls["n"] > after:
                raise error
        return forward(m, *args, **kwargs)

    monkeypatch.setattr(speculative, "_forward", failing)


def _broken_copy(draft, how: str):
    model = noisy_copy(draft, 0.0)
    with torch.no_grad():
        if how == "nan":
            for param in model.parameters():
                param.fill_(float("nan"))
        elif how == "inf":
            model.model.layers[0].mlp.down_proj.weight.mul_(float("inf"))
        else:  # a head that overflows float32: +inf logits
            model.lm_head.weight.fill_(3e38)
    return model


@pytest.mark.parametrize("policy", ["memspec", "general-static"])
@pytest.mark.parametrize("fault", ["out of memory", "nan", "inf", "overflow"])
def test_a_failing_draft_is_taken_out_of_service_and_decoding_goes_on(target, drafts, expected, policy, fault,
                                                                      monkeypatch):
    loader = Loader(drafts)
    if fault == "out of memory":
        loader.drafts["broken"] = noisy_copy(drafts["broken"], 0.0)
        fail_forward(monkeypatch, loader.drafts["broken"], torch.OutOfMemoryError("CUDA out of memory. Tried to"
                                                                                  " allocate 2.00 GiB"))
        why = "OutOfMemoryError"
    else:
        loader.drafts["broken"] = _broken_copy(drafts["broken"], fault)
        why = "logits are not finite"
    ctl = make(target, loader, policy, capacity=2, interval=2)
    try:
        greedy = ctl.generate(PROMPT, NEW)
        assert greedy.token_ids == expected  # lossless: the iteration went on without the draft
        assert "broken" in ctl.cache.failed() and "broken" not in ctl.cache.resident()
        failed = greedy.stats.cache.failed["broken"]
        assert "taken out of service" in failed and why in failed, failed
        assert "broken" not in greedy.stats.drafts_used
        if policy == "memspec":
            assert greedy.stats.drafts_used, "the other drafts take over"
        ctl.cache.clear_failed()
        sampled = ctl.generate(PROMPT, NEW, SAMPLED)  # meets the broken draft again: no abort
        assert sampled.finish_reason == "length" and len(sampled.token_ids) == NEW
        assert "broken" in ctl.cache.failed()
        # the cause gone and the failure forgotten (the back-off, or clear_failed), the draft serves again
        monkeypatch.undo()
        loader.drafts["broken"] = drafts["broken"]
        ctl.cache.clear_failed()
        again = ctl.generate(PROMPT, NEW)
        assert again.token_ids == expected and "broken" in again.stats.drafts_used
    finally:
        ctl.close()


def test_a_draft_failing_in_adaptive_gammas_timing_forward_is_taken_out_of_service(target, drafts, expected,
                                                                                 monkeypatch):
    """Adaptive gamma times a draft's forward at its first iteration, outside the engine's proposal loop: a draft
    that raises there is taken out of service like one that raises while proposing, not the goal's failure."""
    from memspec_ros.runtime import speculative

    loader = Loader(drafts)
    broken = loader.drafts["broken"] = noisy_copy(drafts["broken"], 0.0)
    forward = speculative.forward_once  # what path_choice.time_forward runs (the engine's loop runs _forward)

    def failing(model, *args, **kwargs):
        if model is broken:
            raise torch.OutOfMemoryError("out of memory while timing")
        return forward(model, *args, **kwargs)

    monkeypatch.setattr(speculative, "forward_once", failing)
    ctl = make(target, loader, capacity=2, interval=2, adaptive_gamma=True)
    try:
        greedy = ctl.generate(PROMPT, NEW)
        assert greedy.token_ids == expected
        failed = greedy.stats.cache.failed["broken"]
        assert "taken out of service" in failed and "OutOfMemoryError" in failed, failed
        assert "broken" not in greedy.stats.drafts_used and greedy.stats.drafts_used
    finally:
        ctl.close()


def test_a_draft_whose_forward_cannot_be_built_is_taken_out_of_service(target, drafts, expected, monkeypatch):
    """A draft's lean forward is built at its first proposal where its loader did not build it; building it raised
    (out of memory fusing its weights) outside the proposal's failure handling, and the goal failed, again at
    every goal."""
    from memspec_ros.runtime import speculative

    loader = Loader(drafts)
    broken = loader.drafts["broken"] = noisy_copy(drafts["broken"], 0.0)
    build = speculative.lean_forward_for

    def failing(model):
        if model is broken:
            raise torch.OutOfMemoryError("out of memory fusing the weights")
        return build(model)

    monkeypatch.setattr(speculative, "lean_forward_for", failing)
    ctl = make(target, loader, capacity=2, interval=2)
    try:
        greedy = ctl.generate(PROMPT, NEW)
        assert greedy.token_ids == expected
        failed = greedy.stats.cache.failed["broken"]
        assert "its forward could not be built (OutOfMemoryError" in failed, failed
        assert "broken" not in greedy.stats.drafts_used and greedy.stats.drafts_used
        assert greedy.stats.cache.use_failures == 1 and greedy.stats.cache.load_failures == 0
    finally:
        ctl.close()


def test_the_target_running_out_of_memory_ends_that_generation_only(target, drafts, expected, monkeypatch):
    ctl = make(target, Loader(drafts), capacity=2)
    with monkeypatch.context() as patch:
        fail_forward(patch, target, torch.OutOfMemoryError("CUDA out of memory (target)"), after=4)
        with pytest.raises(torch.OutOfMemoryError):
            ctl.generate(PROMPT, NEW)
    try:
        assert ctl.generate(PROMPT, NEW).token_ids == expected  # the controller is free and whole again
    finally:
        ctl.close()


@pytest.mark.parametrize("error", [RuntimeError("disk controller reset"), ValueError("bad header"),
                                   MemoryError(), SystemExit(3), KeyboardInterrupt()],
                         ids=lambda e: type(e).__name__)
@pytest.mark.parametrize("policy", ["memspec", "general-static"])
def test_any_exception_on_the_loader_thread_stays_there(target, drafts, expected, error, policy):
    """SystemExit and KeyboardInterrupt included: they reached the decode thread through the load's future
    (wait_for, reset, drain swallow Exception only) and ended the generation, and in the node the executor."""
    loader = Loader(drafts)
    loader.fault = error
    ctl = make(target, loader, policy, capacity=2, interval=2)
    try:
        result = ctl.generate(PROMPT, NEW)
        assert result.token_ids == expected
        assert type(error).__name__ in result.stats.cache.failed["broken"]
        ctl.cache.drain()
        ctl.cache.reset()
        loader.fault = None
        ctl.cache.clear_failed()
        again = ctl.generate(PROMPT, NEW)  # the same loader thread loads it now
        assert again.token_ids == expected and "broken" in again.stats.drafts_used
    finally:
        ctl.close()


@pytest.mark.parametrize("policy", ["memspec", "mab-async", "mab-sync", "prediction-only", "general-static"])
def test_cache_remove_from_another_thread_during_generations(target, drafts, expected, policy):
    """A registry change removes drafts from the cache on the parameter thread while a goal decodes (and loads
    run): every generation stays lossless, none raises, and the cache's limits hold afterwards."""
    ctl = make(target, Loader(drafts), policy, capacity=2, interval=1)
    stop = threading.Event()
    errors: list[BaseException] = []
    removed = {"n": 0}

    def hammer() -> None:
        rng = random.Random(0)
        while not stop.is_set():
            try:
                ctl.cache.remove(rng.choice(NAMES))
                removed["n"] += 1
                if rng.random() < 0.3:
                    ctl.cache.clear_failed()
            except BaseException as exc:  # noqa: BLE001 - any escape is the failure under test
                errors.append(exc)
            stop.wait(rng.uniform(0.0, 0.002))

    worker = threading.Thread(target=hammer, daemon=True)
    worker.start()
    try:
        for _ in range(4):
            assert ctl.generate(PROMPT, NEW).token_ids == expected
        assert ctl.generate(PROMPT, NEW, SAMPLED).finish_reason == "length"
    finally:
        stop.set()
        worker.join(10)
    try:
        assert not errors, errors
        assert removed["n"] > 0
        ctl.cache.drain()
        snap = ctl.cache.snapshot()
        assert len(snap.resident) + len(snap.loading) <= 2 and set(snap.resident) <= set(NAMES)
        assert ctl.generate(PROMPT, NEW).token_ids == expected
    finally:
        ctl.close()


def test_a_model_that_ran_the_lean_forward_is_freed_when_dropped(target, drafts, expected):
    """The lean forward is cached per model in a WeakKeyDictionary; its value held the model, so no draft that
    ever decoded (each reload of an evicted draft is a new object) and no cleaned-up target was ever freed."""
    import gc
    import weakref

    from memspec_ros.testing.tiny_models import tiny_llama

    loader = Loader(drafts)
    loader.drafts = {name: noisy_copy(model, 0.0) for name, model in drafts.items()}
    refs = [weakref.ref(model) for model in loader.drafts.values()]
    own_target = tiny_llama(layers=2, hidden=64, seed=0)
    refs.append(weakref.ref(own_target))
    ctl = make(own_target, loader, capacity=3)
    result = ctl.generate(PROMPT, NEW)
    assert result.token_ids == expected and result.stats.drafts_used
    ctl.cache.reset()
    ctl.close()
    del ctl, loader, own_target, result
    gc.collect()
    assert all(ref() is None for ref in refs), "a model that ran the lean forward outlived every reference to it"


def test_a_draft_dropped_for_outgrowing_its_estimate_reserves_its_real_size_next_time():
    """The registry's estimate is the file size; fp16 weights loaded as fp32 take twice that. The first load
    lands over the budget beside the others (the over-reservation branch) and is dropped, not failed; the cache
    remembers what the draft took, so the next update reserves that much, evicts to make room, and succeeds: a
    draft is dropped once, not refused for the retry back-off."""
    from memspec_ros.runtime.cache import DraftCacheManager

    estimate, real = {"a": 100, "b": 100, "c": 100}, {"a": 200, "b": 200, "c": 200}

    def load(name):
        model = torch.nn.Linear(1, 1)
        return LoadedModel(model, ModelSpec(name), real[name], 1, 1)

    cache = DraftCacheManager(3, load, budget_bytes=500, size_of=estimate.get)
    cache.update(["a", "b"])
    cache.drain()
    cache.update({"a": 3, "b": 2, "c": 1}, active="a")  # reserves 100 for c beside 400: fits the estimate
    cache.drain()
    assert not cache.failed() and sorted(cache.resident()) == ["a", "b"] and not cache.is_available("c")
    cache.update({"a": 3, "c": 2}, active="a")  # c now reserves 200: b (outside W) is evicted to make room
    cache.drain()
    assert sorted(cache.resident()) == ["a", "c"] and not cache.failed()
    assert cache.snapshot().bytes_reserved == 400 <= 500
    cache.close()


def test_a_bandit_is_credited_for_the_iterations_its_draft_ran_before_failing(target, drafts, monkeypatch):
    """A draft that failed mid-interval cleared the active draft, and the scheduling point then gave the bandit ""
    as the interval's draft: the iterations it had run were never credited, and it came back from its retry
    back-off with fewer pulls than it had, over-explored."""
    loader = Loader(drafts)
    loader.drafts["broken"] = noisy_copy(drafts["broken"], 0.0)
    fail_forward(monkeypatch, loader.drafts["broken"], torch.OutOfMemoryError("out of memory"), after=6)
    ctl = make(target, loader, "mab-sync", capacity=3, interval=8)
    made = []
    original = ctl._make_policy
    ctl._make_policy = lambda: made.append(original()) or made[-1]
    try:
        stats = ctl.generate(PROMPT, NEW).stats
        ran = [it for it in stats.iterations if it.draft == "broken" and it.proposed > 0]
        assert ran and "broken" in ctl.cache.failed(), "the test needs 'broken' to run, then fail"
        assert len(ran) < 8, "... within its first interval"
        assert made[0].pulls.get("broken", 0) == 1
    finally:
        ctl.close()
