"""Statistics of one generation, computed in exactly one place.

The node, the benchmarks and the tests all read these properties, so a number
a user sees (tokens/s, mean accepted tokens, fallback fraction, ...) has one
definition. Times are seconds from ``time.perf_counter``.

Two throughput metrics, both generated tokens over wall time:

* **tokens_per_second**, the paper's metric (its section 4.1, "steady-state
  generation throughput"): the tokens committed by the draft-and-verify
  iterations over the wall time from the end of setup (the first token made,
  the first draft chosen and loaded) to the end of the generation. That time
  includes draft execution, target verification and every wait, switch and
  catch-up inside decoding (the incoming draft's KV catch-up, the predictor's
  work on the decode thread, blocking load waits, the controller's scheduling
  points). It excludes prompt encoding: the target's prefill (which also yields
  the first token, so that token is not counted) and the setup around it (the
  first prediction and the first draft load, made once the prefill is done).
  :func:`decode_tokens_per_second`.
* **end_to_end_tokens_per_second**, what a user feels: every generated token
  (the prefill's first one included) over the whole call, so prompt encoding,
  the first draft load and everything before and after them count. With the
  runtime controller that is the wall time of its ``generate()`` from entry to
  result (``call_seconds``): the work before the policy's start
  (``prepare_seconds``: the request's checks, a pending reconfiguration,
  calibration, the draft cache's reset of reset_cache_per_generation, which
  waits for loads still in flight from the goal before, the prompt cache's
  entry), setup, prefill, decoding, and the bookkeeping after the last token.
  The engine alone: setup + prefill + decoding. :func:`end_to_end_tokens_per_second`.
* **time_to_first_token**: from the call to the first generated token, which the
  prefill makes: ``prepare_seconds``, the policy's start and the prefill.

Several generations (a workload's prompts) combine by summing tokens and
seconds first (:class:`GenerationTotals`), not by averaging per-prompt rates.

Where decoding time goes (:data:`BREAKDOWN`, :meth:`GenerationStats.time_breakdown`):
desired draft (draft forwards of iterations that ran the draft the policy
wanted), fallback draft (draft forwards of iterations that ran another resident
draft because the wanted one was not resident), prediction (the scheduling
point's work on the decode thread: the policy's choice, its predictor's ranking
included, and carrying it out in the draft cache, its wait left out; so
General-Static, which has no predictor, shows a little), load wait (blocked
on a draft load), catch-up (an incoming draft
rebuilding its KV cache), target verify (the target's forward over the
proposals, target-only steps included), and other (the rest of the decode wall
time: scheduling, streaming, bookkeeping, and copying proposals from the context
or the datastore, where no draft ran: a copy is neither the desired draft's nor a
fallback's, as in ``fallback_iterations``). The parts sum to ``decode_seconds``.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, fields

from .lookup import LOOKUP_DRAFT

BREAKDOWN = ("desired_draft", "fallback_draft", "prediction", "load_wait", "catchup", "verify", "other")
# what GenerationStats.combined sums over goals (end to end is summed apart, as call_seconds)
SUMMED_FIELDS = ("prompt_tokens", "completion_tokens", "prefill_seconds", "setup_seconds", "setup_wait_seconds",
                 "start_seconds", "prepare_seconds", "reused_prompt_tokens", "background_prediction_seconds",
                 "decode_seconds", "predictions")
# the paper's split of decoding time (its figures 4, 7 and 9): GenerationStats.execution_parts
EXEC_PARTS = ("desired", "fallback", "target_only", "prediction", "load_wait", "other")


def decode_tokens_per_second(decode_tokens: int, decode_seconds: float) -> float:
    """The paper's metric: tokens committed by iterations over the decode wall time (module docstring)."""
    return decode_tokens / decode_seconds if decode_seconds > 0 else 0.0


def end_to_end_tokens_per_second(completion_tokens: int, end_to_end_seconds: float) -> float:
    """Every generated token over the whole call (module docstring)."""
    return completion_tokens / end_to_end_seconds if end_to_end_seconds > 0 else 0.0


def ratio(value: float, base: float) -> float | None:
    """``value / base``: how every "x vs y" figure of the benches is divided. None where the base is not positive (a
    workload with no decode rate: a goal of one token has none). JSON writes that null and no goal passes on it,
    where a NaN would make the file invalid JSON and an exception would lose the run's other figures."""
    return value / base if base > 0 else None


def paired_ratio(values: Sequence[float], bases: Sequence[float]) -> float | None:
    """The median over runs of each run's value over the same run's base (the methods of one run take turns on each
    prompt, so they share its drift): a ratio of two medians could pair one run's value with another's base. Runs
    whose base is not positive have no ratio (:func:`ratio`); None if no run has one."""
    ratios = [r for v, b in zip(values, bases, strict=True) if (r := ratio(v, b)) is not None]
    return statistics.median(ratios) if ratios else None


def rounded(value: float | None, digits: int = 4) -> float | None:
    """A figure rounded for a JSON file, None (no figure, as :func:`ratio`'s) kept."""
    return None if value is None else round(value, digits)


@dataclass(slots=True)  # one per iteration, kept by every goal in the throughput window: 136 B, not 352 (getsizeof)
class IterationStats:
    """One draft-and-verify iteration of the speculative engine."""

    draft: str  # "" for a target-only step (no draft ran; one that ran may still have proposed nothing: dropped)
    proposed: int  # tokens the draft proposed (gamma, or fewer near max_new_tokens)
    accepted: int  # proposed tokens the target accepted
    committed: int  # tokens appended to the output (accepted + 1, cut by EOS/stop/length)
    draft_seconds: float  # draft forwards that proposed tokens (after any catch-up)
    verify_seconds: float  # the one target forward over all proposals
    catchup_tokens: int = 0  # committed tokens the incoming draft fed to rebuild its KV cache
    catchup_seconds: float = 0.0  # that catch-up forward (it also yields the first proposal)
    dropped: int = 0  # draft forwards whose token was not worth a verify row (adaptive gamma's confidence stop)
    # Filled by the runtime controller (zero when the engine runs alone):
    preferred: str = ""  # the draft the policy wanted to run
    fallback: bool = False  # ran another draft because the preferred one was not resident
    # the scheduling point's work before this iteration on the decode thread: the policy's choice (its predictor's
    # ranking) and the cache's part in carrying it out, any wait for a load left out (load_wait_seconds)
    prediction_seconds: float = 0.0
    load_wait_seconds: float = 0.0  # time blocked waiting for a draft load (never for MemSpec)

    @property
    def draft_forwards(self) -> int:
        """Draft forwards run: one per proposal and per dropped token (a switch's catch-up forward among them);
        none for a copy from the context or the datastore (its draft_seconds are the lookup's)."""
        return 0 if self.draft == LOOKUP_DRAFT else self.proposed + self.dropped

    @property
    def timed_draft_forwards(self) -> int:
        """The draft forwards whose time is ``draft_seconds``: a switch's catch-up forward is timed apart
        (``catchup_seconds``), so a draft token's cost is draft_seconds / this."""
        return self.draft_forwards - (1 if self.catchup_tokens else 0)

    @property
    def seconds(self) -> float:
        return (
            self.draft_seconds
            + self.verify_seconds
            + self.catchup_seconds
            + self.prediction_seconds
            + self.load_wait_seconds
        )

    @property
    def iteration_seconds(self) -> float:
        """One speculative iteration as the paper's figure 2 counts it: draft + verify (no switch costs)."""
        return self.draft_seconds + self.verify_seconds


@dataclass
class CacheStats:
    """A snapshot of the draft model cache (Algorithm 2's resident set G and its counters).

    Counters are cumulative over the cache's life; the controller snapshots the cache
    before and after a generation and :meth:`since` gives that generation's share.
    """

    capacity: int = 0  # K: most drafts resident at once
    budget_bytes: int = 0  # 0: no byte budget, only K
    resident: list[str] = field(default_factory=list)  # G, loaded and runnable
    loading: list[str] = field(default_factory=list)  # prefetches in flight (bytes reserved)
    failed: dict[str, str] = field(default_factory=dict)  # draft -> why its load failed
    working_set: list[str] = field(default_factory=list)  # W: top-K of the last ranking
    active: str = ""  # the draft decoding now (never evicted)
    bytes_resident: int = 0
    bytes_reserved: int = 0  # resident + loads in flight: what the budget is checked against
    hits: int = 0  # get() found the draft resident
    misses: int = 0  # get() did not
    loads: int = 0  # loads completed
    load_failures: int = 0  # loads that raised or did not fit
    use_failures: int = 0  # drafts taken out of service after failing in use (their forward raised, or not finite)
    dropped_loads: int = 0  # loads read from storage, then dropped as they landed (unwanted by then, or stale)
    load_seconds: float = 0.0  # storage -> fast memory, summed over the ``loads`` that became resident (background)
    wait_seconds: float = 0.0  # decode thread blocked in wait_for()
    evictions: int = 0
    wasted_prefetches: int = 0  # loaded, then evicted before ever running

    # cumulative: since() subtracts them, add_counters() sums them
    COUNTERS = ("hits", "misses", "loads", "load_failures", "use_failures", "dropped_loads", "load_seconds",
                "wait_seconds", "evictions", "wasted_prefetches")

    @property
    def hit_rate(self) -> float:
        lookups = self.hits + self.misses
        return self.hits / lookups if lookups else 0.0

    def since(self, before: CacheStats) -> CacheStats:
        """This snapshot's state with counters relative to an earlier snapshot."""
        delta = CacheStats(**{k: getattr(self, k) for k in self.__dataclass_fields__})
        for name in self.COUNTERS:
            setattr(delta, name, getattr(self, name) - getattr(before, name))
        return delta

    def add_counters(self, other: CacheStats) -> None:
        """Add ``other``'s counters to this snapshot's (several generations' shares summed)."""
        for name in self.COUNTERS:
            setattr(self, name, getattr(self, name) + getattr(other, name))

    def summary(self) -> dict[str, float | int | str | list[str]]:
        return {
            "cache_capacity": self.capacity,
            "cache_budget_bytes": self.budget_bytes,
            "cache_resident": list(self.resident),
            "cache_loading": list(self.loading),
            "cache_failed": sorted(self.failed),
            "cache_bytes_resident": self.bytes_resident,
            "cache_hits": self.hits,
            "cache_misses": self.misses,
            "cache_hit_rate": self.hit_rate,
            "cache_loads": self.loads,
            "cache_load_failures": self.load_failures,
            "cache_use_failures": self.use_failures,
            "cache_dropped_loads": self.dropped_loads,
            "cache_load_seconds": self.load_seconds,
            "cache_evictions": self.evictions,
            "cache_wasted_prefetches": self.wasted_prefetches,
        }


def _draft_ran(it: IterationStats) -> bool:
    """A draft model ran in this iteration (a copy from the context or a datastore is no draft's run)."""
    return it.draft not in ("", LOOKUP_DRAFT)


@dataclass
class GenerationStats:
    """A whole generation: prefill, iterations and how it ended."""

    prompt_tokens: int = 0
    # of those, the leading tokens whose target KV came from the generation before (runtime/prompt_cache.py):
    # the prefill encoded only the rest
    reused_prompt_tokens: int = 0
    completion_tokens: int = 0
    prefill_seconds: float = 0.0  # target prefill (prompt encoding) + first token
    # before the policy's start, from the controller's generate() entry: the request's checks, a pending
    # reconfiguration, calibration, the draft cache's reset (reset_cache_per_generation: it waits for loads still in
    # flight), the prompt cache's entry, the session made (0: the engine alone)
    prepare_seconds: float = 0.0
    setup_seconds: float = 0.0  # not decoding: the policy's start, first prediction, initial draft load
    setup_wait_seconds: float = 0.0  # of setup_seconds, the wait for that first draft's load (0 if resident)
    start_seconds: float = 0.0  # of setup_seconds, the policy's start: the only setup before the prefill
    decode_seconds: float = 0.0  # wall time of the iterations after the first token
    # the controller's whole generate() call, entry to result: prepare, setup, prefill, decode and the bookkeeping
    # around them (the last chunk streamed, the answer remembered, the KV caches kept). 0: the engine alone
    call_seconds: float = 0.0
    finish_reason: str = ""
    iterations: list[IterationStats] = field(default_factory=list)
    # Filled by the runtime controller:
    policy: str = ""  # draft-selection policy (general-static, memspec, ...)
    # policy choices made: the scheduling points, the first (after prefill) included. A ranking policy computes one
    # ranking (Algorithm 1) at each; a static one none, so this counts points, not predictor calls
    predictions: int = 0
    background_prediction_seconds: float = 0.0  # predictor work overlapped off the decode thread
    cache: CacheStats | None = None  # this generation's cache counters and final state

    # -- throughput ---------------------------------------------------------
    @property
    def decode_tokens(self) -> int:
        """Tokens produced by iterations (the first token comes from prefill)."""
        return sum(it.committed for it in self.iterations)

    @property
    def tokens_per_second(self) -> float:
        """The paper's metric: decode throughput, prompt encoding excluded (module docstring)."""
        return decode_tokens_per_second(self.decode_tokens, self.decode_seconds)

    @property
    def end_to_end_seconds(self) -> float:
        """What a user waits for the whole answer: the controller's call, else setup + prefill + decoding."""
        if self.call_seconds > 0:
            return self.call_seconds
        return self.prepare_seconds + self.setup_seconds + self.prefill_seconds + self.decode_seconds

    @property
    def end_to_end_tokens_per_second(self) -> float:
        """All generated tokens over the whole call, prefill and the first draft load included."""
        return end_to_end_tokens_per_second(self.completion_tokens, self.end_to_end_seconds)

    @property
    def time_to_first_token(self) -> float:
        """From the call to the first generated token, which the target's prefill makes: what the controller did
        before the policy's start, the policy's start and the prefill. The first prediction and draft load come
        after it (runtime/controller.py, _setup). 0 where no token was generated (a goal cancelled before its
        prefill), as Generate.action says: its preparation time was reported as a time to a token never made."""
        if not self.completion_tokens:
            return 0.0
        return self.prepare_seconds + self.start_seconds + self.prefill_seconds

    # -- speculation --------------------------------------------------------
    @property
    def speculative_iterations(self) -> list[IterationStats]:
        return [it for it in self.iterations if it.proposed > 0]

    @property
    def drafted_iterations(self) -> list[IterationStats]:
        """Speculative iterations whose proposals a draft model made (copies from the context or the datastore
        are not: no draft ran, so they are neither the desired draft's nor a fallback's)."""
        return [it for it in self.speculative_iterations if it.draft != LOOKUP_DRAFT]

    @property
    def draft_runs(self) -> list[IterationStats]:
        """Iterations in which a draft model ran, its proposals verified or not (adaptive gamma's confidence stop
        can drop a draft's only token: it ran, caught up perhaps, and proposed nothing)."""
        return [it for it in self.iterations if _draft_ran(it)]

    @property
    def preferred_iterations(self) -> list[IterationStats]:
        """Drafted iterations under a policy that named a preferred draft: what the fallback share is of."""
        return [it for it in self.drafted_iterations if it.preferred]

    @property
    def fallback_iterations(self) -> int:
        """Drafted iterations that ran another draft because the preferred one was not resident."""
        return sum(1 for it in self.preferred_iterations if it.fallback)

    @property
    def mean_accepted(self) -> float:
        """Mean accepted tokens per speculative iteration (E[A]): a draft's proposals and, with context lookup, the
        copies from the context or datastore alike (their iterations are drafted_iterations' complement)."""
        its = self.speculative_iterations
        return sum(it.accepted for it in its) / len(its) if its else 0.0

    @property
    def acceptance_rate(self) -> float:
        its = self.speculative_iterations
        proposed = sum(it.proposed for it in its)
        return sum(it.accepted for it in its) / proposed if proposed else 0.0

    @property
    def drafts_used(self) -> list[str]:
        """Draft models that ran, in order of first use (copies from the context are not a draft)."""
        seen: list[str] = []
        for it in self.iterations:
            if it.draft and it.draft != LOOKUP_DRAFT and it.draft not in seen:
                seen.append(it.draft)
        return seen

    @property
    def copied_iterations(self) -> int:
        """Iterations whose proposals were copied from the context or the datastore (runtime/lookup.py,
        runtime/datastore.py) instead of drafted."""
        return sum(1 for it in self.iterations if it.draft == LOOKUP_DRAFT)

    @property
    def dropped_proposals(self) -> int:
        """Draft tokens drafted but not verified: adaptive gamma's confidence stop judged their rows not worth it
        (runtime/gamma_choice.py: row_pays). Each cost a draft forward."""
        return sum(it.dropped for it in self.iterations)

    @property
    def draft_switches(self) -> int:
        """Times the active draft model changed between consecutive iterations a draft ran in (copies from the
        context in between change nothing resident)."""
        names = [it.draft for it in self.draft_runs]  # a draft that ran and proposed nothing was switched to too
        return sum(1 for a, b in zip(names, names[1:], strict=False) if a != b)

    # -- where the time went ------------------------------------------------
    def _fraction(self, seconds: float) -> float:
        return seconds / self.decode_seconds if self.decode_seconds > 0 else 0.0

    @property
    def catchup_seconds(self) -> float:
        return sum(it.catchup_seconds for it in self.iterations)

    @property
    def catchup_tokens(self) -> int:
        return sum(it.catchup_tokens for it in self.iterations)

    @property
    def prediction_seconds(self) -> float:
        return sum(it.prediction_seconds for it in self.iterations)

    @property
    def load_wait_seconds(self) -> float:
        return sum(it.load_wait_seconds for it in self.iterations)

    @property
    def prediction_overhead(self) -> float:
        """Share of decoding time spent on prediction on the decode thread."""
        return self._fraction(self.prediction_seconds)

    def time_breakdown(self) -> dict[str, float]:
        """Decode seconds by where they went (:data:`BREAKDOWN`, module docstring); they sum to decode_seconds."""
        parts = dict.fromkeys(BREAKDOWN, 0.0)
        for it in self.iterations:
            if it.draft != LOOKUP_DRAFT:  # a copy's time stays in "other", as the fallback figures leave it out
                parts["fallback_draft" if it.fallback else "desired_draft"] += it.draft_seconds
            parts["prediction"] += it.prediction_seconds
            parts["load_wait"] += it.load_wait_seconds
            parts["catchup"] += it.catchup_seconds
            parts["verify"] += it.verify_seconds
        parts["other"] = max(0.0, self.decode_seconds - sum(parts.values()))
        return parts

    def execution_parts(self) -> dict[str, float]:
        """Decode seconds as the paper's figures 4, 7 and 9 split them (:data:`EXEC_PARTS`): the run time (draft,
        verify, catch-up) of each iteration a draft ran, on the wanted draft (desired execution) or on a resident
        stand-in (fallback execution); of every step no draft ran (a plain target step, flagged fallback or not,
        and a verified copy from the context or a datastore) as target-only; prediction on the decode thread;
        blocking load waits; and the rest."""
        parts = dict.fromkeys(EXEC_PARTS, 0.0)
        for it in self.iterations:  # a draft's run as time_breakdown files it: its seconds, its catch-up's too
            run = it.draft_seconds + it.verify_seconds + it.catchup_seconds
            parts[("fallback" if it.fallback else "desired") if _draft_ran(it) else "target_only"] += run
            parts["prediction"] += it.prediction_seconds
            parts["load_wait"] += it.load_wait_seconds
        parts["other"] = max(0.0, self.decode_seconds - sum(parts.values()))
        return parts

    @property
    def desired_seconds(self) -> float:
        """The paper's desired execution: run time of iterations on the wanted draft (:meth:`execution_parts`)."""
        return self.execution_parts()["desired"]

    @property
    def fallback_seconds(self) -> float:
        """The paper's fallback execution: run time of iterations on a stand-in for the wanted draft."""
        return self.execution_parts()["fallback"]

    @property
    def load_wait_fraction(self) -> float:
        """Share of decoding time blocked on draft loads (MAB-Sync; Oracle-Dynamic where its schedule waits)."""
        return self._fraction(self.load_wait_seconds)

    @property
    def fallback_fraction(self) -> float:
        """Share of drafted iterations run on a draft other than the preferred one."""
        its = self.preferred_iterations
        return sum(1 for it in its if it.fallback) / len(its) if its else 0.0

    @property
    def desired_fraction(self) -> float:
        """Share of drafted iterations that ran the preferred draft."""
        its = self.preferred_iterations
        return sum(1 for it in its if not it.fallback) / len(its) if its else 0.0

    @classmethod
    def combined(cls, goals: Sequence[GenerationStats]) -> GenerationStats:
        """One GenerationStats over ``goals`` (a node's window of goals): their counts and seconds summed, their
        iterations joined, so every figure of the combination is the same property as a goal's. End to end is
        the goals' summed (as ``call_seconds``)."""
        out = cls(**{name: sum(getattr(g, name) for g in goals) for name in SUMMED_FIELDS},
                  call_seconds=sum(g.end_to_end_seconds for g in goals))
        for g in goals:
            out.iterations.extend(g.iterations)
        out.cache = CacheStats()
        for g in goals:
            if g.cache is not None:
                out.cache.add_counters(g.cache)
        return out

    def summary(self) -> dict[str, float | int | str | list[str]]:
        """Flat numbers for JSON, logs and ROS messages."""
        return {
            "prompt_tokens": self.prompt_tokens,
            "reused_prompt_tokens": self.reused_prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "finish_reason": self.finish_reason,
            "tokens_per_second": self.tokens_per_second,
            "end_to_end_tokens_per_second": self.end_to_end_tokens_per_second,
            "time_to_first_token": self.time_to_first_token,
            "mean_accepted": self.mean_accepted,
            "acceptance_rate": self.acceptance_rate,
            "iterations": len(self.iterations),
            "drafts_used": self.drafts_used,
            "draft_switches": self.draft_switches,
            "copied_iterations": self.copied_iterations,
            "dropped_proposals": self.dropped_proposals,
            "catchup_seconds": self.catchup_seconds,
            "catchup_tokens": self.catchup_tokens,
            "prediction_overhead": self.prediction_overhead,
            "load_wait_seconds": self.load_wait_seconds,
            "fallback_fraction": self.fallback_fraction,
            "desired_fraction": self.desired_fraction,
            "desired_seconds": self.desired_seconds,
            "fallback_seconds": self.fallback_seconds,
            "load_wait_fraction": self.load_wait_fraction,
            "policy": self.policy,
            "predictions": self.predictions,
            "background_prediction_seconds": self.background_prediction_seconds,
            **(self.cache.summary() if self.cache is not None else {}),
        }


@dataclass
class GenerationTotals:
    """Several generations summed (a workload's prompts and runs): rates of the sums, not means of rates."""

    generations: int = 0
    decode_tokens: int = 0
    decode_seconds: float = 0.0
    completion_tokens: int = 0
    end_to_end_seconds: float = 0.0
    speculative_iterations: int = 0
    speculative_iteration_seconds: float = 0.0  # their draft + verify
    accepted_tokens: int = 0  # over the speculative iterations
    preferred_iterations: int = 0  # drafted under a policy that named a preferred draft ...
    fallback_iterations: int = 0  # ... of which ran another one
    breakdown: dict[str, float] = field(default_factory=lambda: dict.fromkeys(BREAKDOWN, 0.0))

    @classmethod
    def of(cls, generations: Iterable[GenerationStats]) -> GenerationTotals:
        """``generations`` summed."""
        totals = cls()
        for stats in generations:
            totals.add(stats)
        return totals

    def add(self, stats: GenerationStats) -> None:
        self.generations += 1
        self.decode_tokens += stats.decode_tokens
        self.decode_seconds += stats.decode_seconds
        self.completion_tokens += stats.completion_tokens
        self.end_to_end_seconds += stats.end_to_end_seconds
        its = stats.speculative_iterations
        self.speculative_iterations += len(its)
        self.speculative_iteration_seconds += sum(it.iteration_seconds for it in its)
        self.accepted_tokens += sum(it.accepted for it in its)
        self.preferred_iterations += len(stats.preferred_iterations)
        self.fallback_iterations += stats.fallback_iterations
        for key, seconds in stats.time_breakdown().items():
            self.breakdown[key] += seconds

    def merge(self, other: GenerationTotals) -> GenerationTotals:
        """These totals plus another's (a policy over every workload)."""
        out = GenerationTotals(breakdown=dict(self.breakdown))
        for f in fields(self):  # every count and sum but the breakdown, added below
            if f.name != "breakdown":
                setattr(out, f.name, getattr(self, f.name) + getattr(other, f.name))
        for key, seconds in other.breakdown.items():
            out.breakdown[key] += seconds
        return out

    @property
    def tokens_per_second(self) -> float:
        """The paper's metric over all these generations."""
        return decode_tokens_per_second(self.decode_tokens, self.decode_seconds)

    @property
    def end_to_end_tokens_per_second(self) -> float:
        return end_to_end_tokens_per_second(self.completion_tokens, self.end_to_end_seconds)

    @property
    def mean_iteration_seconds(self) -> float:
        """One speculative iteration (draft + verify), averaged over every iteration."""
        n = self.speculative_iterations
        return self.speculative_iteration_seconds / n if n else 0.0

    @property
    def mean_accepted(self) -> float:
        """E[A] over every speculative iteration of these generations (GenerationStats.mean_accepted, pooled)."""
        n = self.speculative_iterations
        return self.accepted_tokens / n if n else 0.0

    @property
    def fallback_fraction(self) -> float:
        """GenerationStats.fallback_fraction pooled: a generation with one fallback iteration in two does not
        weigh as much as one with thirty preferred iterations."""
        n = self.preferred_iterations
        return self.fallback_iterations / n if n else 0.0

    @property
    def prediction_overhead(self) -> float:
        """GenerationStats.prediction_overhead pooled: prediction's share of all the decode time."""
        return self.breakdown["prediction"] / self.decode_seconds if self.decode_seconds > 0 else 0.0

    def breakdown_fractions(self) -> dict[str, float]:
        """Each part of the breakdown as a share of the decode time."""
        return {k: (v / self.decode_seconds if self.decode_seconds > 0 else 0.0) for k, v in self.breakdown.items()}
