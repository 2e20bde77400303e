"""Draft-selection policies behind ONE interface, so the shared controller loop compares them fairly.

At every scheduling point (every N iterations) the controller asks the policy for
a :class:`~runtime.choice.Choice`: which draft it would like to run (``preferred``),
whether decoding blocks until that draft is resident (``block``), what the cache
does meanwhile (``cache_action``: nothing, request the draft, or prefetch the
ranking's top K), in which order to fall back while it is not resident
(``fallback``), and optionally a ranking of all drafts. The controller carries
out every policy's Choice the same way (runtime/choice.py's ``carry_out``).
After the interval it reports the iterations back (``observe``).

The policies' three ways, each a function here that fills in the whole Choice:

* :func:`wait_choice`: block until the preferred draft is resident (General/Oracle-Static's
  one load, MAB-Sync). The wait is recorded as load wait time.
* :func:`request_choice`: load the preferred draft in the background, evicting the
  lowest-scored other draft; decode meanwhile on the current draft (MAB-Async, Prediction-Only).
* :func:`prefetch_choice`: hand the whole ranking to the cache (Algorithm 2: W = top-K), run
  the best RESIDENT draft, never wait (MemSpec, Oracle-next-interval).

A generation's first draft blocks, whatever the policy's way, when no draft it could run is resident
(Algorithm 3, line 3: the initial draft is loaded before decoding starts; the paper's protocol empties
the cache per prompt, so there it always blocks). On a warm cache, as a robot's node keeps between goals,
the non-blocking ways (request, prefetch) run the best resident draft while their choice loads, as at
every later point: the controller never stalls for a non-resident draft. ``wait_for_initial_draft``
(RuntimeConfig, the node's ``memspec.wait_for_initial_draft``) makes every generation's first choice
block, for storage fast enough that waiting costs less than an interval on a weaker draft. Where the cache
has no room to load the choice beside the resident draft (K = 1, or a byte budget that holds one of them),
carry_out waits for it too: the running draft is never evicted, so it would run the whole generation.
Oracle-Dynamic prefetches and waits as its schedule says (runtime/oracle.py:
the best schedule under the same K and measured costs, by dynamic programming).

With K = 1 the non-blocking policies (memspec, mab-async, prediction-only, oracle-next-interval) keep
their first draft: bringing in another one needs a second slot while the active
draft decodes, and the active draft is never evicted. Blocking policies switch by
stalling. That is the paper's trade-off at its sharpest, not a bug.

Predicted policies ask their ranker at every scheduling point the same way
(``submit`` the context, use the ``latest`` ranking): a plain ranker ranks it there
and then, an overlapped one (runtime/predictor.py) answers with the ranking it
finished before, one interval late.

Bandit reward (MAB-Sync/Async): the mean number of accepted draft tokens per
iteration over the interval the arm ran (E[A] of equation 1), counted for the
draft that actually ran. UCB1 uses per-arm counts: score = mean + c*sqrt(ln t / n_arm),
c = 2.0 (the paper's best), every arm tried once before UCB applies.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

from .choice import CACHE_NONE, CACHE_PREFETCH, CACHE_REQUEST, Choice
from .lookup import LOOKUP_DRAFT
from .oracle import LOAD, RESIDENT, START, WAIT, GreedyOracle, ScheduleAction
from .predictor import PredictionContext, Ranker
from .stats import IterationStats

# the paper's seven (its figures compare these), then the myopic oracle kept for comparison
PAPER_POLICIES = ("general-static", "oracle-static", "mab-sync", "mab-async", "prediction-only", "oracle-dynamic",
                  "memspec")
COST_AWARE = "memspec-cost-aware"  # beyond the paper: MemSpec whose switches and prefetches pay for themselves
RANKING_POLICIES = ("memspec", "prediction-only", COST_AWARE)  # the policies that rank with the trained predictor
POLICIES = (*PAPER_POLICIES, "oracle-next-interval", COST_AWARE)
ORACLE_POLICIES = ("oracle-static", "oracle-dynamic", "oracle-next-interval")
# what a live node can run (memspec.policy): the oracles need each goal's future, the offline bench's alone
NODE_POLICIES = tuple(p for p in POLICIES if p not in ORACLE_POLICIES)


class PolicyError(ValueError):
    """A policy cannot run with what it was given (no predictor, no oracle, no drafts)."""


@dataclass
class SchedulingPoint:
    """What a policy may look at when it chooses (the controller fills it)."""

    interval: int  # i: 0 for the first choice (after prefill), then one per N iterations
    prompt_ids: list[int]
    generated_ids: list[int]  # committed output so far
    recent_ids: list[int]  # the last T generated tokens
    candidates: list[str]  # registered drafts now (registry order)
    domains: dict[str, str]
    resident: list[str]  # G now
    active: str  # the draft that ran the last interval ("" none)
    failed: list[str] = field(default_factory=list)  # drafts whose load failed (skip them)
    max_new_tokens: int = 0  # the generation's token budget (0: unknown)
    wait_for_initial_draft: bool = False  # the first choice blocks even when a draft is resident
    capacity: int = 0  # K, the drafts the cache holds now (0: unknown; Oracle-Dynamic then plans with its costs')
    # drafts whose load is in flight now (None: unknown). Oracle-Dynamic reads it: a prefetch the cache refused
    # (its byte budget) or that failed is no load its schedule may wait for
    loading: list[str] | None = None
    # context tokens each draft's KV cache holds now, reused prompt-cache prefixes included (None: unknown; the
    # cost-aware rule then counts from what it saw run)
    draft_context: dict[str, int] | None = None

    def prediction_context(self) -> PredictionContext:
        return PredictionContext(
            prompt_ids=self.prompt_ids,
            recent_ids=self.recent_ids if self.interval > 0 else [],
            interval=self.interval,
            candidates=self.candidates,
            domains=self.domains,
            generated=len(self.generated_ids),
        )

    @property
    def viable(self) -> list[str]:
        return [d for d in self.candidates if d not in self.failed]

    @property
    def first(self) -> bool:
        """The generation's first choice (Algorithm 3, lines 2-5)."""
        return self.interval == 0

    @property
    def initial_wait(self) -> bool:
        """The first choice blocks for its draft whatever the policy's way when no draft it could run is
        resident (a cold cache: the initial draft load, Algorithm 3, line 3), or when configured to. (Where the
        cache has no room for the choice beside the resident draft, carry_out waits for it too.)"""
        return self.first and (self.wait_for_initial_draft or not any(d in self.resident for d in self.viable))


def _ranked_then_current(point: SchedulingPoint, ranking: list[tuple[str, float]] | None) -> tuple[str, ...]:
    names = tuple(n for n, _ in ranking) if ranking else ()
    return names + ((point.active,) if point.active and point.active not in names else ())


def wait_choice(point: SchedulingPoint, preferred: str, ranking: list[tuple[str, float]] | None = None) -> Choice:
    """Block until ``preferred`` is resident (its load evicts the lowest-scored draft of ``ranking``); should the
    load fail, run the best resident draft by ``ranking``, then the current one."""
    return Choice(preferred, block=True, fallback=_ranked_then_current(point, ranking), cache_action=CACHE_NONE,
                  ranking=ranking)


def request_choice(point: SchedulingPoint, preferred: str, ranking: list[tuple[str, float]]) -> Choice:
    """Load ``preferred`` in the background and decode on the current draft meanwhile (then by ``ranking``)."""
    fallback = ((point.active,) if point.active else ()) + tuple(n for n, _ in ranking)
    return Choice(preferred, block=point.initial_wait, fallback=fallback, cache_action=CACHE_REQUEST, ranking=ranking)


def prefetch_choice(point: SchedulingPoint, preferred: str, ranking: list[tuple[str, float]]) -> Choice:
    """Hand ``ranking`` to the cache (W = top-K) and run the best resident draft by it, then the current one."""
    return Choice(preferred, block=point.initial_wait, fallback=_ranked_then_current(point, ranking),
                  cache_action=CACHE_PREFETCH, ranking=ranking)


class DraftPolicy:
    """Base class: ``choose`` at every scheduling point, ``observe`` after each interval."""

    name = ""
    begins_predictor = False  # whether start() begins the predictor on the generation (the controller does if not)

    def start(self, prompt_ids: Sequence[int]) -> None:
        """A new generation (the paper resets runtime state per prompt)."""

    def resume(self, prompt_ids: Sequence[int]) -> None:
        """This policy takes over a generation in its middle (memspec.policy changed while it ran): its own state
        starts as for a new generation; what the generation already set up (the predictor's) stays."""
        self.start(prompt_ids)

    def choose(self, point: SchedulingPoint) -> Choice:
        raise NotImplementedError

    def observe(self, draft: str, iterations: Sequence[IterationStats]) -> None:
        """The iterations of the interval that just ran (bandits learn from them)."""

    def close(self) -> None:
        pass


class GeneralStaticPolicy(DraftPolicy):
    """One general-purpose draft for everything (the paper's General-Static)."""

    name = "general-static"

    def __init__(self, general_draft: str = "general") -> None:
        self.general_draft = general_draft

    def choose(self, point: SchedulingPoint) -> Choice:
        viable = point.viable
        if not viable:
            return wait_choice(point, "")
        if self.general_draft in viable:
            return wait_choice(point, self.general_draft)
        general = [d for d in viable if point.domains.get(d) == "general"]
        return wait_choice(point, general[0] if general else viable[0])


class OracleStaticPolicy(DraftPolicy):
    """The best single draft for this prompt, known from its traces (Oracle-Static)."""

    name = "oracle-static"

    def __init__(self, oracle_for: Callable[[Sequence[int]], GreedyOracle]) -> None:
        self.oracle_for = oracle_for
        self._choice = ""

    def start(self, prompt_ids: Sequence[int]) -> None:
        self._oracle = self.oracle_for(prompt_ids)
        self._choice = ""

    def choose(self, point: SchedulingPoint) -> Choice:
        viable = point.viable
        if not viable:
            return wait_choice(point, "")
        if self._choice not in viable:
            self._choice = self._oracle.best_static(viable)
        return wait_choice(point, self._choice)


class OracleDynamicPolicy(DraftPolicy):
    """The best schedule with future knowledge under the same K and costs (Oracle-Dynamic).

    At every scheduling point it takes the optimal decision of :class:`~runtime.oracle.ScheduleSolver` from the
    state the run is really in (position, active draft, resident set, its own prefetch in flight),
    so a load that took longer than the model said is re-planned around, not followed blindly.
    The costs (iteration, catch-up, per-draft load time, K) come with the oracle
    (``GreedyOracle.costs``, measured by the bench); without them switches and loads are free.
    """

    name = "oracle-dynamic"

    def __init__(self, oracle_for: Callable[[Sequence[int]], GreedyOracle]) -> None:
        self.oracle_for = oracle_for

    def start(self, prompt_ids: Sequence[int]) -> None:
        self._oracle = self.oracle_for(prompt_ids)
        self._loading: tuple[str, int] | None = None  # (draft prefetched, interval it started at)

    def choose(self, point: SchedulingPoint) -> Choice:
        viable = [d for d in point.viable if d in self._oracle.agreement]
        if not viable:
            return prefetch_choice(point, "", [])
        solver = self._oracle.solver(viable, point.capacity)  # solved once per drafts and K, kept by the oracle
        resident = frozenset(d for d in point.resident if d in viable)
        loading = None
        if self._loading is not None:
            draft, since = self._loading
            refused = point.loading is not None and draft not in point.loading  # never started, or failed
            if draft in resident or draft not in viable or refused:
                self._loading = None
            elif point.loading is not None and draft in point.loading:  # still reading, whatever the plan said:
                loading = (draft, solver.still_loading(draft, point.interval - since))  # re-planned around
            else:
                loading = (draft, point.interval - since)
        position = len(point.generated_ids) if point.interval else 1
        active = point.active if point.active in resident else ""
        action = solver.best_action((position, active, resident, loading))
        if action is None:  # nothing left to schedule
            return prefetch_choice(point, active, [(active, 1.0)] if active else [])
        return self._choice_for(action, point, resident, loading)

    def _choice_for(self, action: ScheduleAction, point: SchedulingPoint, resident: frozenset,
                    loading: tuple[str, int] | None) -> Choice:
        """The Choice that does what the schedule says (carried out by runtime/choice.py's carry_out)."""
        keep = sorted((resident | ({loading[0]} if loading else set())) - set(action.evict) - {action.run})
        ranking = [(action.run, 3.0)] + ([(action.prefetch, 2.0)] if action.prefetch else []) + [(d, 1.0) for d in keep]
        if action.kind == WAIT or (action.kind == RESIDENT and action.run not in point.resident):
            self._loading = None  # waiting for it (also a load the model thought was done)
            if action.kind == RESIDENT and action.prefetch:
                # a load that lands later than planned: wait for it, and still start the prefetch the plan has
                # beside it (carry_out loads first, then hands the ranking to the cache), or the schedule run is
                # not the one solved
                self._loading = (action.prefetch, point.interval)
                return Choice(action.run, block=True, fallback=_ranked_then_current(point, ranking),
                              cache_action=CACHE_PREFETCH, ranking=ranking)
            return wait_choice(point, action.run, ranking)
        if action.kind == LOAD:  # blocking load: set_scores + wait_for evict the lowest-scored draft
            return wait_choice(point, action.run, ranking + [(v, 0.0) for v in action.evict])
        assert action.kind in (START, RESIDENT)
        if action.prefetch:
            self._loading = (action.prefetch, point.interval)
        choice = prefetch_choice(point, action.run, ranking)
        if action.kind == START and action.run not in point.resident:
            # the schedule's first draft loads during setup, evicting the drafts the schedule drops (the solver's
            # model, and Oracle-Static's way): on a warm cache the first choice did not block, and another resident
            # draft decoded while it loaded
            choice = replace(choice, block=True)
        return choice


class OracleNextIntervalPolicy(DraftPolicy):
    """The best draft for the next interval alone, with MemSpec's mechanics (myopic Oracle-Dynamic).

    The cache is steered by the true utility of the next interval and the best resident draft
    runs. It pays every switch and catch-up the next interval's best draft asks for, so it can
    fall below Oracle-Static; Oracle-Dynamic is the schedule that does not.
    """

    name = "oracle-next-interval"

    def __init__(self, oracle_for: Callable[[Sequence[int]], GreedyOracle]) -> None:
        self.oracle_for = oracle_for

    def start(self, prompt_ids: Sequence[int]) -> None:
        self._oracle = self.oracle_for(prompt_ids)

    def choose(self, point: SchedulingPoint) -> Choice:
        viable = point.viable
        if not viable:
            return prefetch_choice(point, "", [])
        ranking = self._oracle.ranking_at(len(point.generated_ids) if point.interval else 1, viable)
        return prefetch_choice(point, ranking[0][0], ranking)


class _UCB1(DraftPolicy):
    """UCB1 with per-arm counts (not BanditSpec's shared count), each arm tried once first."""

    def __init__(self, c: float = 2.0) -> None:
        self.c = c
        self.pulls: dict[str, int] = {}
        self.reward_sum: dict[str, float] = {}

    def start(self, prompt_ids: Sequence[int]) -> None:
        self.pulls, self.reward_sum = {}, {}

    def ucb(self, arm: str, total: int) -> float:
        n = self.pulls.get(arm, 0)
        if n == 0:
            return math.inf
        return self.reward_sum[arm] / n + self.c * math.sqrt(math.log(max(total, 1)) / n)

    def choose(self, point: SchedulingPoint) -> Choice:
        arms = point.viable
        if not arms:
            return self.arm_choice(point, "", [])
        total = sum(self.pulls.get(a, 0) for a in arms)
        scores = {a: self.ucb(a, total) for a in arms}
        untried = [a for a in arms if self.pulls.get(a, 0) == 0]
        if untried:  # each arm once, in registry order; the current one first if untried
            best = point.active if point.active in untried else untried[0]
        else:
            best = max(arms, key=lambda a: (scores[a], -arms.index(a)))
        finite = {a: (s if math.isfinite(s) else 1e9) for a, s in scores.items()}
        finite[best] = max(finite.values()) + 1.0
        ranking = sorted(finite.items(), key=lambda p: -p[1])
        return self.arm_choice(point, best, ranking)

    def arm_choice(self, point: SchedulingPoint, arm: str, ranking: list[tuple[str, float]]) -> Choice:
        """How the chosen arm reaches fast memory."""
        raise NotImplementedError

    def observe(self, draft: str, iterations: Sequence[IterationStats]) -> None:
        spec = [it for it in iterations if it.proposed > 0 and it.draft == draft]
        if not draft or not spec:
            return
        reward = sum(it.accepted for it in spec) / len(spec)  # accepted tokens per iteration
        self.pulls[draft] = self.pulls.get(draft, 0) + 1
        self.reward_sum[draft] = self.reward_sum.get(draft, 0.0) + reward


class MABSyncPolicy(_UCB1):
    """UCB1 that blocks to load its choice (MAB-Sync)."""

    name = "mab-sync"

    def arm_choice(self, point: SchedulingPoint, arm: str, ranking: list[tuple[str, float]]) -> Choice:
        return wait_choice(point, arm, ranking)


class MABAsyncPolicy(_UCB1):
    """UCB1 whose non-resident choice loads in the background while the current draft keeps decoding (MAB-Async)."""

    name = "mab-async"

    def arm_choice(self, point: SchedulingPoint, arm: str, ranking: list[tuple[str, float]]) -> Choice:
        return request_choice(point, arm, ranking)


class _Predicted(DraftPolicy):
    def __init__(self, predictor: Ranker | None) -> None:
        if predictor is None:
            raise PolicyError(f"policy {self.name!r} needs a trained predictor: train one with memspec-train-predictor"
                              " and load it (the node's predictor.path, set while unconfigured: cleanup, set it,"
                              " configure), or use a policy without one: general-static, mab-sync or mab-async")
        self.predictor = predictor

    begins_predictor = True

    def start(self, prompt_ids: Sequence[int]) -> None:
        self.predictor.begin(prompt_ids)
        self._reset(prompt_ids)

    def resume(self, prompt_ids: Sequence[int]) -> None:
        # begun again, a target-hidden encoder dropped the rows it had of this generation (an extra target pass over
        # the prompt, recent features from nothing) and an overlapped ranker answered in registry order
        self.predictor.resume()
        self._reset(prompt_ids)

    def _reset(self, prompt_ids: Sequence[int]) -> None:
        """The policy's own per-generation state."""

    def close(self) -> None:
        # a ranking in flight in the background ends with the policy: one made in its place mid-goal (overlap_
        # prediction turned off) ranked on the decode thread while it still ran, two threads in one encoder (the
        # MiniLM one's fast tokenizer can raise "Already borrowed")
        self.predictor.resume()

    def ranking(self, point: SchedulingPoint) -> list[tuple[str, float]]:
        """The ranker's latest ranking for this point (an overlapped ranker's is one interval late)."""
        context = point.prediction_context()
        self.predictor.submit(context)
        ranking = self.predictor.latest(context.candidates)
        if ranking is None:
            return [(d, 0.0) for d in context.candidates]  # nothing finished yet: keep registry order
        return ranking


class PredictionOnlyPolicy(_Predicted):
    """The predicted best draft, loaded on demand without prefetch: the paper's ablation (its Section 4.4).

    As the paper's: it decodes on the current draft while the predicted one loads (its Figure 9 has Prediction-Only
    spend 21.3% of its runtime in fallback execution and no load wait), and only the predicted draft is loaded, not
    the ranking's top K. (Until session 51 it blocked for each load instead, a MAB-Sync with a predictor.)"""

    name = "prediction-only"

    def choose(self, point: SchedulingPoint) -> Choice:
        ranking = [p for p in self.ranking(point) if p[0] in point.viable]
        if not ranking:
            return request_choice(point, "", [])
        return request_choice(point, ranking[0][0], ranking)


class MemSpecPolicy(_Predicted):
    """Rank -> cache update (W = top-K, async prefetch) -> best RESIDENT draft. Never waits (Algorithm 3)."""

    name = "memspec"

    def choose(self, point: SchedulingPoint) -> Choice:
        ranking = [p for p in self.ranking(point) if p[0] in point.viable]
        if not ranking:
            return prefetch_choice(point, "", [])
        return prefetch_choice(point, ranking[0][0], ranking)


class CostAwareMemSpecPolicy(_Predicted):
    """MemSpec whose switches and prefetches must pay for themselves (beyond the paper).

    The paper's MemSpec runs the best-ranked resident draft and prefetches the top K, whatever the
    ranking's margin, the tokens left, or what a switch costs. This policy values each other draft
    ``b`` against the active draft ``a`` at every scheduling point, in tokens, from what it has
    measured in this generation (``observe``) and the prediction:

    * predicted gain = (p(b) - p(a)) * E[A] * (R - delay(b)): the ranking margin is the confidence,
      read as the expected relative change in accepted tokens per iteration (E[A], measured so far);
      R = iterations left = (max_new_tokens - generated) / (1 + E[A]); delay(b) = 0 for a resident
      draft, else its load time in iterations (measured: iterations from asking for a prefetch to
      seeing it resident; one interval before any is measured, the earliest a prefetched draft can
      run), less the iterations since its prefetch was asked for;
    * cost = the catch-up b needs (its KV cache lacks every token since it last ran, or the whole
      context if it never ran or was evicted) * the measured catch-up seconds per token, in tokens:
      / (draft + verify seconds per iteration) * (1 + E[A]).

    It switches to the resident draft of largest positive value, prefetches a non-resident draft
    only when its value is positive (evicting the lowest-valued resident draft, never the active
    one), and otherwise keeps the resident set as it is. Free slots are filled from the ranking as
    MemSpec does (no eviction and no catch-up until the draft runs), so the first choice is MemSpec's.
    Nothing here is a constant fitted to a workload: every quantity is measured while it runs.
    """

    name = COST_AWARE

    def _reset(self, prompt_ids: Sequence[int]) -> None:
        super()._reset(prompt_ids)
        self._prompt_len = len(prompt_ids)
        self._kv: dict[str, int] = {}  # draft -> context tokens its KV cache holds (while resident)
        self._accepted = self._iterations = self._catchup_tokens = 0
        self._iteration_seconds = self._catchup_seconds = 0.0
        self._interval_length = 0  # N, as the last interval showed it
        self._seen = 0  # iterations observed in this generation
        self._asked: dict[str, int] = {}  # non-resident draft -> iterations seen when its prefetch was asked for
        # measured: iterations from asking to resident (in iterations, not points: N may change mid-goal)
        self._load_iterations: list[int] = []
        self.declined = 0  # switches or prefetches MemSpec would have made and this rule did not

    def observe(self, draft: str, iterations: Sequence[IterationStats]) -> None:
        # N as the last interval showed it: the default load delay, one interval (the largest N seen kept an N
        # reduced mid-goal, and every unmeasured load looked that much longer)
        self._interval_length = len(iterations) or self._interval_length
        self._seen += len(iterations)
        for it in iterations:
            if it.draft == LOOKUP_DRAFT:  # copies from the context say nothing of a draft
                continue
            if it.catchup_tokens:  # also where adaptive gamma then dropped the caught-up draft's only proposal
                self._catchup_tokens += it.catchup_tokens
                self._catchup_seconds += it.catchup_seconds
            if it.proposed <= 0:
                continue
            self._iterations += 1
            self._accepted += it.accepted
            self._iteration_seconds += it.draft_seconds + it.verify_seconds

    def values(self, point: SchedulingPoint, probs: dict[str, float]) -> dict[str, float]:
        """Each other viable draft's net value (tokens) of switching to it from the active draft."""
        active = point.active
        generated = len(point.generated_ids)
        mean_accepted = self._accepted / self._iterations
        per_iteration = 1.0 + mean_accepted
        budget = point.max_new_tokens or 2 * generated  # unknown budget: assume as many tokens again
        left = max(0, budget - generated) / per_iteration
        seconds = self._iteration_seconds / self._iterations
        per_token = self._catchup_seconds / self._catchup_tokens if self._catchup_tokens else 0.0
        interval = self._interval_length or 1
        delay = statistics.fmean(self._load_iterations) if self._load_iterations else interval
        context = self._prompt_len + generated
        out = {}
        # scores as probabilities: a draft the head does not know scores UNKNOWN_SCORE (-1), which made every
        # margin from it above 1, worth more than E[A] tokens an iteration
        known = {d: min(1.0, max(0.0, p)) for d, p in probs.items()}
        for b, p in known.items():
            if b == active:
                continue
            # a load asked for at an earlier point has only the rest of its measured time to go
            since = self._seen - self._asked[b] if b in self._asked else 0
            wait = 0.0 if b in point.resident else max(0.0, delay - since)
            gain = (p - known.get(active, 0.0)) * mean_accepted * max(0.0, left - wait)
            # what its KV cache holds: the session's count where the point has it (a draft that ran in the previous
            # chat turn starts from the prompt cache's prefix, not from nothing), else what this rule saw it run
            if point.draft_context is not None:
                held = point.draft_context.get(b, 0) if b in point.resident else 0
            else:
                held = self._kv.get(b, 0)
            catchup = (context - held) * per_token
            cost = catchup / seconds * per_iteration if seconds > 0 else 0.0
            out[b] = gain - cost
        return out

    def choose(self, point: SchedulingPoint) -> Choice:
        ranking = [p for p in self.ranking(point) if p[0] in point.viable]
        if not ranking:
            return prefetch_choice(point, "", [])
        resident = [d for d, _ in ranking if d in point.resident]
        for d in [d for d in self._asked if d in resident]:
            self._load_iterations.append(self._seen - self._asked.pop(d))
        for d in [d for d in self._kv if d not in point.resident]:
            del self._kv[d]  # evicted: its KV cache went with it
        active = point.active if point.active in point.resident else ""
        if active:
            self._kv[active] = self._prompt_len + len(point.generated_ids) - 1
        if point.interval == 0 or not active or not self._iterations:
            # the prefetches this asks for, whose loads are measured: the runner-up, and the top draft unless the
            # choice waits for it (a cold cache's first draft is a blocking load, not a prefetch)
            asked = ranking[1:2] if point.initial_wait else ranking[:2]
            self._ask([d for d, _ in asked if d not in point.resident])
            return prefetch_choice(point, ranking[0][0], ranking)  # MemSpec's choice: nothing measured yet
        values = self.values(point, dict(ranking))
        worth = sorted((d for d, v in values.items() if v > 0), key=lambda d: -values[d])
        preferred = worth[0] if worth else active
        best_resident = next((d for d in worth if d in point.resident), active)
        if preferred not in point.resident and point.capacity and len(point.resident) >= point.capacity:
            # a full cache keeps the active draft and the one switched to: the load would have no slot (it never
            # started, yet was timed). Stay on the active draft; the other resident one makes room for the load.
            best_resident = active
        if preferred != ranking[0][0]:
            self.declined += 1
        # what the cache should hold, best first (W = top-K of this order, runtime/cache.py): the
        # preferred draft, what runs until it is resident, every resident draft (so only the preferred
        # draft, when worth it, evicts one: the lowest-valued), then free-slot fillers by the ranking
        others = sorted((d for d in resident if d not in (preferred, best_resident, active)), key=lambda d: -values[d])
        fill = [d for d, _ in ranking if d not in point.resident]
        order = list(dict.fromkeys([preferred, best_resident, active, *others, *fill]))
        self._ask([preferred] if preferred not in point.resident else [])
        return prefetch_choice(point, preferred, [(d, float(len(order) - i)) for i, d in enumerate(order)])

    def _ask(self, drafts: Sequence[str]) -> None:
        """Note when each draft's prefetch was asked for (earlier asks for other drafts lapse)."""
        self._asked = {d: self._asked.get(d, self._seen) for d in drafts}


def make_policy(
    name: str,
    *,
    predictor: Ranker | None = None,
    oracle_for: Callable[[Sequence[int]], GreedyOracle] | None = None,
    general_draft: str = "general",
    ucb_c: float = 2.0,
) -> DraftPolicy:
    """The policy called ``name`` (one of POLICIES)."""
    if name == "general-static":
        return GeneralStaticPolicy(general_draft)
    if name in ORACLE_POLICIES:
        if oracle_for is None:
            raise PolicyError(f"policy {name!r} needs per-prompt traces (an oracle): it is a benchmark baseline,"
                              " not for deployment; use memspec or general-static on the robot")
        oracle_class = {"oracle-static": OracleStaticPolicy, "oracle-dynamic": OracleDynamicPolicy,
                        "oracle-next-interval": OracleNextIntervalPolicy}[name]
        return oracle_class(oracle_for)
    if name == "mab-sync":
        return MABSyncPolicy(ucb_c)
    if name == "mab-async":
        return MABAsyncPolicy(ucb_c)
    if name == "prediction-only":
        return PredictionOnlyPolicy(predictor)
    if name == "memspec":
        return MemSpecPolicy(predictor)
    if name == COST_AWARE:
        return CostAwareMemSpecPolicy(predictor)
    raise PolicyError(f"unknown policy {name!r}: use one of {', '.join(POLICIES)}")
