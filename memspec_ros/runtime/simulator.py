"""Trace-driven simulator: the real policy objects, replayed over recorded utilities and measured costs.

Under greedy decoding the output does not depend on the draft, so one recorded trace per prompt
(the target's greedy continuation and every draft's agreement with it, :class:`oracle.GreedyOracle`)
says how many tokens any draft gets accepted from any position. The simulator runs the controller's
loop (runtime/controller.py's ``_run``) over such a trace in virtual time: the SAME
:class:`~runtime.policies.DraftPolicy` objects choose at every scheduling point, the SAME
:func:`~runtime.choice.carry_out` carries out their choices on a
:class:`SimCache` with the draft cache's rules (runtime/cache.py: K slots, W = top-K, lowest-scored
eviction, the active draft protected, ONE loader thread), and every piece of time
comes from a :class:`CostModel` measured on real runs (verify per proposal count, draft forward per
token, catch-up per token fed, scheduling-point work per policy, prefill per prompt token, each
draft's load through the storage medium). Each simulated generation is a real
:class:`~runtime.stats.GenerationStats`, so both throughput metrics, the fallback fraction and the
time breakdown have the same definitions as for real runs (runtime/stats.py).

The predictor is replayed too: the minilm encoder works on token ids as it is, and the
target-hidden encoder's hook (which records the target's hidden states while it verifies) is
replaced by :class:`TraceHiddenEncoder`, which pools the same positions of ONE teacher-forced target
pass over prompt + continuation, so the same ranking head ranks the same contexts.

What it leaves out, by design: the real loader competes with decoding for the CPU while it builds
a draft, and the machine's own noise. The policy bench measures how far that takes the simulator
from real runs (``simulator_validation`` in its JSON) on the same prompts; sweeps are only as good
as that validation.
"""

from __future__ import annotations

import logging
import statistics
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field

import torch

from .cache import normalise_ranking
from .choice import Choice, Resolution, carry_out
from .draft_forward import lean_forward_for, observe_hidden
from .oracle import GreedyOracle, ScheduleCosts, nearest_size
from .policies import DraftPolicy, SchedulingPoint
from .predictor import PredictionEngine, mean_rows, prompt_window, recent_window
from .speculative import KVState
from .stats import GenerationStats, GenerationTotals, IterationStats

log = logging.getLogger(__name__)

EPSILON = 1e-9  # a load that ends now is resident only strictly after it started (the loader is a thread)


# -- traces ---------------------------------------------------------------------------------------

@dataclass
class PromptTrace:
    """One prompt's recorded future: the target's greedy continuation and each draft's agreement with it.

    ``eos``: the continuation ends with an end token (it stopped before any budget); otherwise it
    was cut at ``len(continuation)`` tokens and budgets up to that length can be replayed.
    ``hidden``: the target's final hidden states over prompt + continuation (target-hidden predictor).
    """

    workload: str
    prompt_ids: list[int]
    continuation: list[int]
    agreement: dict[str, list[bool]]
    eos: bool = False
    hidden: torch.Tensor | None = None

    @classmethod
    def from_oracle(cls, workload: str, prompt_ids: Sequence[int], oracle: GreedyOracle,
                    eos_token_ids: Iterable[int] = ()) -> PromptTrace:
        cont = list(oracle.continuation)
        eos = bool(cont) and cont[-1] in set(eos_token_ids)
        return cls(workload, list(prompt_ids), cont, {d: list(a) for d, a in oracle.agreement.items()}, eos)

    def budget(self, max_new_tokens: int) -> int:
        """Tokens a generation with this budget outputs (the continuation may end sooner, at its end token)."""
        if max_new_tokens > len(self.continuation) and not self.eos:
            raise ValueError(f"the trace has {len(self.continuation)} tokens without an end token: it cannot"
                             f" replay a budget of {max_new_tokens}; record it with a larger budget")
        return min(max_new_tokens, len(self.continuation))

    def oracle(self, max_new_tokens: int, gamma: int, interval: int, costs: ScheduleCosts | None) -> GreedyOracle:
        """The oracle a real run with this budget gets (the continuation cut to the budget)."""
        n = self.budget(max_new_tokens)
        return GreedyOracle(self.continuation[:n], {d: a[:n] for d, a in self.agreement.items()}, gamma, interval,
                            costs=costs, prompt_tokens=len(self.prompt_ids), max_new_tokens=max_new_tokens)

    def accepted(self, draft: str, position: int, proposed: int) -> int:
        """Proposals the target accepts from ``position`` (greedy: the run of agreements, capped). A draft the trace
        did not record is refused: replayed as one that accepts nothing, it was charged its costs without a word."""
        agree = self.agreement.get(draft)
        if agree is None:
            raise KeyError(f"draft {draft!r} has no recorded agreement in this trace (recorded: "
                           f"{', '.join(sorted(self.agreement))}): record it, or leave it out of the candidates")
        k = 0
        while k < proposed and position + k < len(agree) and agree[position + k]:
            k += 1
        return k


@torch.inference_mode()
def target_hidden_states(target: torch.nn.Module, prompt_ids: Sequence[int],
                         continuation: Sequence[int]) -> torch.Tensor:
    """[len(prompt) + len(continuation), hidden]: the target's final hidden state at every position (one pass).

    Taken from the forward the engine runs the target with where it has one (its observers, which feed the
    live encoder), so that on a quantized path the replayed predictor sees the rows the live one saw
    (transformers' forward rounds the int8 activations differently, runtime/oracle.py: engine_greedy)."""
    ids = list(prompt_ids) + list(continuation)
    lean = lean_forward_for(target)
    if lean is not None:
        rows: list[torch.Tensor] = []
        handle = observe_hidden(target, lambda hidden, start: rows.append(hidden.detach().float().cpu()))
        try:
            lean(ids, KVState().cache, 0, 1)
        finally:
            handle.remove()
        return torch.cat(rows)
    device = next(target.parameters()).device
    decoder = getattr(target, "model", None) or target.get_decoder()
    out = decoder(input_ids=torch.tensor([ids], device=device), use_cache=False)
    hidden = out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0]
    return hidden[0].detach().float().cpu()


class TraceHiddenEncoder:
    """The target-hidden encoder fed from recorded hidden states instead of a hook on the live target.

    It pools the positions the live encoder pools (runtime/predictor.py: the mean over
    :func:`prompt_window` and over :func:`recent_window`), so the same ranking head sees the same features.
    ``recent=False`` replays a live encoder whose hook sees no decoding forwards (its recent half
    stays zero: :func:`live_recent_features` tells which one a runtime has).
    """

    name = "target-hidden"

    def __init__(self, dim: int, traces: Iterable[PromptTrace], recent: bool = True, prompt_tokens: int = 0) -> None:
        self.dim = dim
        self.recent = recent
        self.prompt_tokens = prompt_tokens
        self._hidden = {tuple(t.prompt_ids): t.hidden for t in traces if t.hidden is not None}
        self._current: torch.Tensor | None = None
        self._prompt_len = 0

    def begin(self, prompt_ids: Sequence[int]) -> None:
        key = tuple(prompt_ids)
        if key not in self._hidden:
            raise KeyError("no recorded hidden states for this prompt: record its trace with the target first")
        self._current, self._prompt_len = self._hidden[key], len(key)

    def prompt_features(self, prompt_ids: Sequence[int]) -> torch.Tensor:
        assert self._current is not None
        window = prompt_window(self._prompt_len, self.prompt_tokens)
        return self._current[window.start : window.stop].mean(0)

    def recent_rows(self, recent_ids: Sequence[int], generated: int) -> list[torch.Tensor]:
        if not recent_ids or self._current is None or not self.recent:
            return []
        window = recent_window(self._prompt_len, generated, len(recent_ids))
        rows = self._current[window.start : window.stop]
        return [rows] if len(rows) else []

    def recent_features(self, recent_ids: Sequence[int], generated: int) -> torch.Tensor:
        return mean_rows(self.recent_rows(recent_ids, generated), self.dim)


def live_recent_features(engine: PredictionEngine, prompt_ids: Sequence[int], generated_ids: Sequence[int]) -> bool:
    """Whether a live predictor saw the recent tokens of the generation it just ran (its recent half is
    not all zero): call it right after ``generated_ids`` were generated from ``prompt_ids``, by a controller
    with the prompt cache off (with it on, the target-hidden encoder hands its rows to the cache at the
    generation's end, and this would read none: the policy bench runs with it off)."""
    if not generated_ids:
        return False
    recent = list(generated_ids[-engine.recent_tokens :])
    features = engine.encoder.recent_features(recent, len(generated_ids))
    return bool(features.abs().sum() > 0)


def replay_predictor(engine: PredictionEngine | None, traces: Sequence[PromptTrace],
                     recent: bool = True) -> PredictionEngine | None:
    """The same ranking head over recorded contexts (target-hidden), or the engine itself (minilm: ids only).

    ``recent``: whether the live encoder's recent half is live (:func:`live_recent_features`)."""
    if engine is None or engine.config.encoder != "target-hidden":
        return engine
    encoder = TraceHiddenEncoder(engine.encoder.dim, traces, recent, engine.config.prompt_tokens)
    return PredictionEngine(engine.head, encoder, engine.recent_tokens)


# -- measured costs ------------------------------------------------------------------------------------

def _mean(xs: Sequence[float], default: float = 0.0) -> float:
    return statistics.fmean(xs) if xs else default


def fit_line(xs: Sequence[float], ys: Sequence[float]) -> tuple[float, float]:
    """Least-squares (intercept, slope) of a forward's seconds (ys) on its tokens (xs); the mean as intercept where
    xs do not vary, or where noise made the slope negative: a forward over more tokens never takes less time, and a
    falling line priced late catch-ups at nothing in Oracle-Dynamic's plan and in the replay alike."""
    if not xs:
        return 0.0, 0.0
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    var = sum((x - mx) ** 2 for x in xs)
    if var <= 0:
        return my, 0.0
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / var
    return (my - slope * mx, slope) if slope >= 0 else (my, 0.0)


@dataclass
class CostModel:
    """Every time the simulator charges, measured on real runs of this machine (seconds).

    Pooled over every measured policy (one machine, one target, drafts of one architecture), except
    the work each policy does on the decode thread at its scheduling points and at its start and first
    choice (setup), which is its own.
    """

    verify_seconds: dict[int, float] = field(default_factory=dict)  # by proposals verified (0: a target-only step)
    draft_token_seconds: float = 0.0  # one draft forward of one token
    catchup_base_seconds: float = 0.0  # a catch-up forward (it also yields the first proposal) ...
    catchup_token_seconds: float = 0.0  # ... plus this per token fed
    other_iteration_seconds: float = 0.0  # the rest of the decode wall time, per iteration
    prefill_base_seconds: float = 0.0
    prefill_token_seconds: float = 0.0
    point_seconds: dict[str, float] = field(default_factory=dict)  # per policy: one scheduling point's work
    setup_seconds: dict[str, float] = field(default_factory=dict)  # per policy: the first choice, first load excluded
    load_seconds: dict[str, float] = field(default_factory=dict)  # per draft, through the storage medium
    medium: str = ""
    # per generation: the controller's call outside setup, prefill and decoding (its checks, calibration, the
    # cache's reset, the prompt cache, the bookkeeping after the last token): end to end counts the whole call
    call_other_seconds: float = 0.0

    def verify(self, proposed: int) -> float:
        return nearest_size(self.verify_seconds, proposed)

    def catchup(self, tokens: int) -> float:
        return max(0.0, self.catchup_base_seconds + self.catchup_token_seconds * tokens)

    def prefill(self, prompt_tokens: int) -> float:
        return max(0.0, self.prefill_base_seconds + self.prefill_token_seconds * prompt_tokens)

    def load(self, draft: str) -> float:
        if draft in self.load_seconds:
            return self.load_seconds[draft]
        return _mean(list(self.load_seconds.values()))

    def policy_costs(self, policy: str) -> tuple[float, float]:
        """(one scheduling point's work, the setup's) for ``policy``. A model that measured some policies but not
        this one raises: replayed at no cost, an untimed policy (mab-sync beside a timed mab-async running the same
        UCB code) was flattered by what the others paid. A model that measured none charges none (a sweep over
        hand-made costs)."""
        # timed: a generation of it was measured (its setup always is; its points only where a run reached one, so
        # a timed policy without a point measured charges none)
        if (self.setup_seconds or self.point_seconds) and policy not in self.setup_seconds:
            raise ValueError(f"the cost model measured no scheduling-point or setup work for policy {policy!r} (it"
                             f" timed {', '.join(sorted(self.setup_seconds)) or 'none'}): time it in the runs the model"
                             " is fitted to, or stand a timed policy in for it (CostModel.standing_in)")
        return self.point_seconds.get(policy, 0.0), self.setup_seconds.get(policy, 0.0)

    def standing_in(self, policy: str, timed: str) -> CostModel:
        """This model with ``timed``'s measured scheduling-point and setup work charged to ``policy`` as well (a
        policy the runs did not time that does the same work at its points)."""
        point = {policy: self.point_seconds[timed]} if timed in self.point_seconds else {}
        return CostModel(**{**asdict(self), "point_seconds": {**self.point_seconds, **point},
                            "setup_seconds": {**self.setup_seconds, policy: self.setup_seconds[timed]}})

    def with_loads(self, load_seconds: Mapping[str, float], medium: str) -> CostModel:
        """The same machine reading its drafts from another medium."""
        return CostModel(**{**asdict(self), "load_seconds": dict(load_seconds), "medium": medium})

    def scaled(self, speed: float) -> CostModel:
        """The same model on a machine ``speed`` times slower at computing (loads, paced I/O, unchanged)."""
        data = asdict(self)
        for key in ("draft_token_seconds", "catchup_base_seconds", "catchup_token_seconds", "other_iteration_seconds",
                    "prefill_base_seconds", "prefill_token_seconds", "call_other_seconds"):
            data[key] *= speed
        for key in ("verify_seconds", "point_seconds", "setup_seconds"):
            data[key] = {k: v * speed for k, v in data[key].items()}
        return CostModel(**data)

    def speed_of(self, stats: GenerationStats) -> float:
        """How much slower than this model a real generation's machine was: its measured target verify time
        over the model's for the same proposal counts (1.0 where nothing was verified)."""
        measured = sum(it.verify_seconds for it in stats.iterations)
        modelled = sum(self.verify(it.proposed) for it in stats.iterations)
        return measured / modelled if measured > 0 and modelled > 0 else 1.0

    def iteration_seconds(self, gamma: int) -> float:
        """A full speculative iteration (gamma draft tokens + their verify): the unit ScheduleCosts counts in."""
        return gamma * self.draft_token_seconds + self.verify(gamma)

    def schedule_costs(self, capacity: int, gamma: int) -> ScheduleCosts:
        """What Oracle-Dynamic plans with, from this model: every iteration priced as the replay prices it, and
        the catch-up line net of the draft forward a catch-up replaces (the replay charges a switched-in draft
        ``gamma - 1`` draft forwards besides it)."""
        return ScheduleCosts(capacity=capacity, iteration_seconds=self.iteration_seconds(gamma),
                             catchup_seconds=self.catchup_base_seconds - self.draft_token_seconds,
                             # the fitted slope as the replay uses it (clamped at 0, the plan charged more)
                             catchup_token_seconds=self.catchup_token_seconds,
                             load_seconds=dict(self.load_seconds), verify_seconds=dict(self.verify_seconds),
                             draft_token_seconds=self.draft_token_seconds,
                             other_iteration_seconds=self.other_iteration_seconds)

    @classmethod
    def measure(cls, runs: Iterable[tuple[str, GenerationStats]], load_seconds: Mapping[str, float],
                medium: str = "") -> CostModel:
        """Fit the model to real generations: ``runs`` = (policy, stats) of every measured generation."""
        verify: dict[int, list[float]] = {}
        draft_tok: list[float] = []
        catch_x: list[float] = []
        catch_y: list[float] = []
        other = [0.0, 0]  # seconds, iterations: pooled over the runs (sums first, as every figure)
        prefill_x: list[float] = []
        prefill_y: list[float] = []
        point: dict[str, list[float]] = {}  # policy -> [seconds, points], pooled
        setup: dict[str, dict[bool, list[float]]] = {}  # policy -> made a first choice -> the runs' setups
        call_other: list[float] = []
        for policy, stats in runs:
            its = stats.iterations
            for it in its:
                verify.setdefault(it.proposed, []).append(it.verify_seconds)
                tokens = it.timed_draft_forwards
                if tokens > 0:
                    draft_tok.append(it.draft_seconds / tokens)
                if it.catchup_tokens:
                    catch_x.append(it.catchup_tokens)
                    catch_y.append(it.catchup_seconds)
            parts = stats.time_breakdown()
            other[0] += parts["other"]
            other[1] += len(its)
            # the work at scheduling points (intervals >= 1): choose + resolve, waits excluded
            points = stats.predictions - 1
            if points > 0:
                pooled = point.setdefault(policy, [0.0, 0])
                pooled[0] += stats.prediction_seconds
                pooled[1] += points
            prefill_x.append(stats.prompt_tokens)
            prefill_y.append(stats.prefill_seconds)
            # the setup's own work: its wait for the first draft is what the replay charges as that draft's load. A
            # generation the prefill's token ended chose nothing (its setup only the policy's start), and the replay
            # charges such a one no setup: its near-zero would pull down the median charged to every other one
            # (with no other run of the policy, those are all there is)
            setup.setdefault(policy, {True: [], False: []})[stats.predictions > 0].append(
                max(0.0, stats.setup_seconds - stats.setup_wait_seconds))
            if stats.call_seconds > 0:  # a controller's run: its whole call timed
                call_other.append(max(0.0, stats.call_seconds - stats.setup_seconds - stats.prefill_seconds
                                      - stats.decode_seconds))
        catch_base, catch_tok = fit_line(catch_x, catch_y)
        pre_base, pre_tok = fit_line(prefill_x, prefill_y)
        return cls(
            verify_seconds={k: statistics.median(v) for k, v in sorted(verify.items())},
            draft_token_seconds=statistics.median(draft_tok) if draft_tok else 0.0,
            catchup_base_seconds=catch_base, catchup_token_seconds=catch_tok,
            other_iteration_seconds=other[0] / other[1] if other[1] else 0.0,
            prefill_base_seconds=pre_base, prefill_token_seconds=pre_tok,
            point_seconds={p: seconds / points for p, (seconds, points) in point.items()},
            setup_seconds={p: statistics.median(chose[True] or chose[False]) for p, chose in setup.items()},
            load_seconds=dict(load_seconds), medium=medium,
            call_other_seconds=statistics.median(call_other) if call_other else 0.0,
        )

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, data: Mapping) -> CostModel:
        data = dict(data)
        data["verify_seconds"] = {int(k): v for k, v in data.get("verify_seconds", {}).items()}
        return cls(**data)


# -- the draft cache, in virtual time -----------------------------------------------------------------

@dataclass
class _SimSlot:
    name: str
    ready_at: float  # virtual time the load completes (resident strictly after it started)
    started: float
    used: bool = False
    reads_from: float = 0.0  # virtual time the loader starts reading it (later than ``started`` while queued)


class SimCache:
    """:class:`runtime.cache.DraftCacheManager`'s rules in virtual time (count capacity; loads never fail).

    One loader: a load starts when the previous one ends, and takes the draft's measured load time.
    """

    def __init__(self, capacity: int, load_seconds: Callable[[str], float], clock: Callable[[], float]) -> None:
        self.capacity = capacity
        self.load_seconds = load_seconds
        self.clock = clock
        self._slots: dict[str, _SimSlot] = {}
        self._scores: dict[str, float] = {}
        self._active = ""
        self._loader_free = 0.0
        self.on_evict: list[Callable[[str], None]] = []
        self.loads = self.evictions = self.hits = self.misses = 0

    def _is_ready(self, slot: _SimSlot, now: float | None = None) -> bool:
        now = self.clock() if now is None else now
        return slot.ready_at <= now and now > slot.started

    # -- queries
    def resident(self) -> list[str]:
        return [n for n, s in self._slots.items() if self._is_ready(s)]

    def loading(self) -> list[str]:
        return [n for n, s in self._slots.items() if not self._is_ready(s)]

    def failed(self) -> dict:
        return {}

    def is_resident(self, name: str) -> bool:
        slot = self._slots.get(name)
        return slot is not None and self._is_ready(slot)

    def is_available(self, name: str) -> bool:
        return name in self._slots

    def get(self, name: str, count: bool = True) -> str | None:
        if self.is_resident(name):
            self.hits += count
            self._slots[name].used = True
            return name
        self.misses += count
        return None

    def room_beside(self, current: str, name: str) -> bool:
        """Whether K leaves room for ``name`` beside ``current`` once no other load is in the way (count capacity)."""
        return self.capacity >= 2

    def set_scores(self, ranking) -> None:
        self._scores = dict(normalise_ranking(ranking))

    def set_active(self, name: str) -> None:
        self._active = name

    # -- Algorithm 2
    def update(self, ranking, active: str | None = None) -> list[str]:
        if active is not None:
            self._active = active
        pairs = normalise_ranking(ranking)
        self._scores = dict(pairs)
        working = [n for n, _ in pairs][: self.capacity]
        self._cancel_queued_outside(working)
        for name in working:
            if name not in self._slots:
                self._make_room_and_load(name, protect=set(working))
        return working

    def _cancel_queued_outside(self, working: list[str]) -> None:
        """As the real cache's update(): a load still queued (the loader not yet reading it) for a draft outside
        ``working`` never runs; the queued loads kept behind it start that much sooner."""
        now = self.clock()
        queued = self._queued(now)
        if all(s.name in working for s in queued):
            return
        for slot in queued:
            if slot.name not in working:
                del self._slots[slot.name]
                self.loads -= 1  # never read
        self._retime([s for s in queued if s.name in working], now)

    def _queued(self, now: float) -> list[_SimSlot]:
        """The loads the loader has not started reading, in the order it reads them."""
        return sorted((s for s in self._slots.values() if s.reads_from > now), key=lambda s: s.reads_from)

    def _retime(self, order: list[_SimSlot], now: float) -> None:
        """The queued loads read one after another in ``order``, from the end of the one reading now."""
        free = max([now] + [s.ready_at for s in self._slots.values() if s.reads_from <= now < s.ready_at])
        for slot in order:
            slot.reads_from, slot.ready_at = free, max(free + self.load_seconds(slot.name), now + EPSILON)
            free = slot.ready_at
        self._loader_free = free

    def request(self, name: str, active: str | None = None, supersede: bool = True) -> bool:
        if active is not None:
            self._active = active
        if supersede:  # as the real cache: an earlier request still queued for another draft never runs
            self._cancel_queued_outside([name])
        if name in self._slots:
            return True
        return self._make_room_and_load(name, protect={name})

    def wait_for(self, name: str) -> float:
        """Seconds the decode thread blocks until ``name`` is resident (loading it if needed); a hit or a miss, as
        the real cache's wait_for counts it."""
        slot = self._slots.get(name)
        resident = slot is not None and self._is_ready(slot)
        self.hits += resident
        self.misses += not resident
        deferred = False  # started once the loads holding the room have landed: nothing queued is passed then
        if slot is None and not self.request(name, supersede=False):
            # no room now: the real cache waits for the loads in flight that hold it (they land evictable), then
            # loads; with none in flight it gives up at once
            pending = [s.ready_at for s in self._slots.values() if not self._is_ready(s)]
            if not pending:
                return 0.0
            landed = max(pending) + EPSILON  # the cache as it is once they have landed
            if not self._make_room_and_load(name, protect={name}, now=landed):
                return max(0.0, landed - self.clock())
            deferred = True
        slot = self._slots[name]
        now = self.clock()
        queued = self._queued(now)
        if not deferred and slot in queued and queued[0] is not slot:  # as the real cache: it goes first
            self._retime([slot] + [s for s in queued if s is not slot], now)
        slot.used = True
        return max(0.0, slot.ready_at - now) if not self._is_ready(slot) else 0.0

    def _victim(self, protect: set[str], now: float | None = None) -> str | None:
        candidates = [n for n, s in self._slots.items()
                      if self._is_ready(s, now) and n not in protect and n != self._active]
        if not candidates:
            return None
        return min(candidates, key=lambda n: self._scores.get(n, float("-inf")))

    def _make_room_and_load(self, name: str, protect: set[str], now: float | None = None) -> bool:
        """``now``: the time the load is asked for (default the clock's)."""
        now = self.clock() if now is None else now
        while len(self._slots) >= self.capacity:
            victim = self._victim(protect, now)
            if victim is None:
                return False
            self._evict(victim)
        start = max(now, self._loader_free)
        self._loader_free = ready = start + self.load_seconds(name)
        self._slots[name] = _SimSlot(name, max(ready, now + EPSILON), now, reads_from=start)
        self.loads += 1
        return True

    def _evict(self, name: str) -> None:
        self._slots.pop(name)
        self.evictions += 1
        for callback in list(self.on_evict):
            try:
                callback(name)
            except Exception:  # as the real cache: one observer's failure leaves the eviction loop whole
                log.exception("an on_evict callback failed for draft %r (the eviction stands)", name)


# -- the controller's loop, in virtual time ---------------------------------------------------------

@dataclass(frozen=True)
class SimConfig:
    capacity: int = 2  # K
    interval: int = 4  # N
    gamma: int = 4
    recent_tokens: int = 32  # T
    max_new_tokens: int = 128
    ucb_c: float = 2.0  # the MAB policies' exploration coefficient (RuntimeConfig.ucb_c)

    def __post_init__(self) -> None:
        # the runtime's ranges: K = 0 had every policy decode on the target alone and a sweep print figures for a
        # setting no real run can have
        from .controller import RuntimeConfig

        RuntimeConfig(capacity=self.capacity, interval=self.interval, gamma=self.gamma,
                      recent_tokens=self.recent_tokens, ucb_c=self.ucb_c).validate()
        if isinstance(self.max_new_tokens, bool) or not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be an integer >= 1, got {self.max_new_tokens!r}")


class _Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _carry_out(cache: SimCache, clock: _Clock, choice: Choice, current: str = "", first: bool = False) -> Resolution:
    """runtime/choice.py's ``carry_out`` on the simulated cache: a blocking wait advances the clock, so the
    cache sees the load done afterwards."""

    def wait(name: str) -> float:
        waited = cache.wait_for(name)
        if waited > 0:
            clock.now += waited + EPSILON  # past the load's end, float rounding aside
        return waited

    return carry_out(choice, cache, wait=wait, current=current, first=first)


class Simulator:
    """Replays generations of any policy over recorded traces with a measured :class:`CostModel`."""

    def __init__(self, costs: CostModel, config: SimConfig, domains: Mapping[str, str],
                 candidates: Sequence[str] | None = None) -> None:
        self.costs = costs
        self.config = config
        self.domains = dict(domains)
        self.candidates = list(domains if candidates is None else candidates)  # (a one-shot iterable: read once)
        if candidates is not None and not self.candidates:  # taken for "every draft", silently
            raise ValueError("candidates is empty: leave it out (None) to replay every draft of ``domains``")

    def generate(self, policy: DraftPolicy, trace: PromptTrace, costs: CostModel | None = None) -> GenerationStats:
        """One generation of ``trace``'s prompt under ``policy``, in virtual time (its GenerationStats).

        ``costs``: this generation's own cost model (default: the simulator's)."""
        missing = [c for c in self.candidates if c not in trace.agreement]
        if missing:  # before any virtual time: each would be replayed as a draft that accepts nothing
            raise ValueError(f"candidates {', '.join(missing)} have no recorded agreement in this trace (recorded:"
                             f" {', '.join(sorted(trace.agreement))}): record them, or leave them out")
        cfg, costs = self.config, costs or self.costs
        point_work, setup_work = costs.policy_costs(policy.name)
        clock = _Clock()
        cache = SimCache(cfg.capacity, costs.load, clock)
        budget = trace.budget(cfg.max_new_tokens)
        prompt = list(trace.prompt_ids)
        stats = GenerationStats(prompt_tokens=len(prompt))
        stats.policy = policy.name
        kv: dict[str, int] = {}  # draft -> tokens in its KV cache (prompt + generated positions)
        cache.on_evict.append(lambda name: kv.pop(name, None))

        def point_at(interval: int, generated: int, active: str) -> SchedulingPoint:
            gen = trace.continuation[:generated]
            t = cfg.recent_tokens
            return SchedulingPoint(interval=interval, prompt_ids=prompt, generated_ids=list(gen),
                                   recent_ids=list(gen[-t:]) if t else [], candidates=list(self.candidates),
                                   domains=self.domains, resident=cache.resident(), loading=cache.loading(),
                                   active=active,
                                   max_new_tokens=cfg.max_new_tokens, capacity=cfg.capacity,
                                   # each draft's KV length, as the controller hands memspec-cost-aware the
                                   # session's: without it the policy estimated the catch-up its own way
                                   draft_context=dict(kv))

        # the controller's order (runtime/controller.py: _setup): the policy starts, the target prefills (committing
        # the first token), then the first choice is made and its draft loaded, blocking
        policy.start(prompt)
        clock.now += costs.prefill(len(prompt))
        stats.prefill_seconds = clock.now
        active, preferred, fallback = "", "", False
        if budget > 1:  # else the prefill's token ended it: the controller chooses and loads nothing either
            choice = policy.choose(point_at(0, 1, ""))
            stats.predictions += 1
            clock.now += setup_work
            first = _carry_out(cache, clock, choice, first=True)  # the first draft: the choice blocks for it
            active, preferred, fallback = first.draft, first.preferred, first.fallback
            stats.setup_wait_seconds = first.waited
        stats.setup_seconds = clock.now - stats.prefill_seconds
        decode_start = clock.now
        position = 1  # the prefill committed the first token
        stats.completion_tokens = 1
        interval, interval_its, last_draft, skipped_plain = 0, [], "", False
        pending_point, pending_wait = 0.0, 0.0
        while position < budget:
            if len(interval_its) >= cfg.interval:
                policy.observe(active, interval_its)
                interval += 1
                interval_its = []
                choice = policy.choose(point_at(interval, position, active))
                stats.predictions += 1
                work = point_work
                clock.now += work
                resolution = _carry_out(cache, clock, choice, current=active)
                active, preferred, fallback = resolution.draft, resolution.preferred, resolution.fallback
                pending_point, pending_wait = work, resolution.waited
            remaining = cfg.max_new_tokens - position
            proposed = min(cfg.gamma, remaining - 1) if active else 0
            it = IterationStats(draft=active if proposed > 0 else "", proposed=max(0, proposed), accepted=0,
                                committed=0, draft_seconds=0.0, verify_seconds=0.0)
            if proposed > 0:
                total = len(prompt) + position
                fed = total - kv.get(active, 0)
                # a switch, a cache dropped, or plain steps since this draft last ran (its first forward then
                # reads them: the engine times it as catch-up, runtime/speculative.py's _skipped_plain)
                if active not in kv or active != last_draft or skipped_plain:
                    it.catchup_tokens, it.catchup_seconds = fed, costs.catchup(fed)
                    it.draft_seconds = (proposed - 1) * costs.draft_token_seconds
                else:
                    it.draft_seconds = proposed * costs.draft_token_seconds
                last_draft, skipped_plain = active, False
                it.accepted = trace.accepted(active, position, proposed)
            else:
                it.proposed = 0
                skipped_plain = True
            it.verify_seconds = costs.verify(it.proposed)
            it.committed = min(it.accepted + 1, budget - position)
            if proposed > 0:
                # the engine crops the draft's KV cache to the committed tokens; the last proposal was never fed
                kv[active] = len(prompt) + position + min(it.accepted, proposed - 1)
            position += it.committed
            it.preferred, it.fallback = preferred, fallback
            it.prediction_seconds, it.load_wait_seconds = pending_point, pending_wait
            pending_point = pending_wait = 0.0
            # the point's work and any wait are already on the clock (they are charged to this iteration)
            clock.now += it.draft_seconds + it.verify_seconds + it.catchup_seconds + costs.other_iteration_seconds
            stats.iterations.append(it)
            interval_its.append(it)
        if interval_its:
            policy.observe(active, interval_its)
        policy.close()
        stats.completion_tokens = position
        stats.decode_seconds = clock.now - decode_start
        # an end token as the budget's last token ends the answer as "eos" in the engine, which checks it first
        stats.finish_reason = "eos" if trace.eos and budget == len(trace.continuation) else "length"
        # end to end as the controller counts it: its whole call (runtime/stats.py)
        stats.call_seconds = costs.call_other_seconds + stats.setup_seconds + stats.prefill_seconds \
            + stats.decode_seconds
        return stats

    def run(self, policy_for: Callable[[], DraftPolicy], traces: Sequence[PromptTrace]) -> dict[str, GenerationTotals]:
        """Totals per workload of one policy over ``traces`` (a fresh policy object per prompt, as the controller)."""
        totals: dict[str, GenerationTotals] = {}
        for trace in traces:
            stats = self.generate(policy_for(), trace)
            totals.setdefault(trace.workload, GenerationTotals()).add(stats)
        return totals
