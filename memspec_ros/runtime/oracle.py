"""Future knowledge for the oracle baselines, exact under greedy decoding.

Greedy output does not depend on the draft, so the target's greedy continuation
is fixed, and a draft's proposals match it exactly as long as they agree with
the teacher-forced argmax of the draft over that continuation. One draft forward
over [prompt ; continuation] therefore tells how many tokens the draft gets
accepted from ANY position: the run of agreements starting there, capped at
gamma. Walking N iterations from a position gives a draft's utility for the next
interval (tokens committed), which Oracle-Static sums over the whole output.

Oracle-Dynamic is the best SCHEDULE over those per-interval utilities under the
same K and costs as every other policy (:class:`ScheduleSolver`): a dynamic
program over (position, active draft, resident set, load in flight) that pays
each switch's catch-up and waits for loads the cache could not overlap, and
minimises the decoding time of the fixed greedy output. Running one draft
throughout is one of its schedules, so it is never worse than Oracle-Static
under its cost model. It is not a bound on every schedule the controller could
carry out: the model has one load in flight at a time (the cache may queue up to
K at one point) and charges a return to a draft that stayed resident the full
catch-up (the engine feeds it only what it missed), so a policy could in
principle beat it there. Oracle-next-interval is the myopic variant: the best
draft for the next interval alone, with MemSpec's mechanics.
"""

from __future__ import annotations

import hashlib
import json
import math
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from .atomic_write import written_aside


@torch.inference_mode()
def target_greedy(target: torch.nn.Module, prompt_ids: Sequence[int], max_new_tokens: int,
                  eos_token_ids: Sequence[int] = ()) -> list[int]:
    """The target's own greedy continuation (what every lossless greedy run must output).

    A plain KV-cached argmax loop: the same computation as generate(do_sample=False)
    without its per-step bookkeeping, which dominates for the small zoo models.
    """
    from transformers import DynamicCache

    device = next(target.parameters()).device
    eos = set(eos_token_ids)
    cache = DynamicCache()
    feed = list(prompt_ids)
    out: list[int] = []
    while len(out) < max_new_tokens:
        logits = target(input_ids=torch.tensor([feed], device=device), past_key_values=cache, use_cache=True,
                        logits_to_keep=1).logits
        token = int(logits[0, -1].argmax())
        out.append(token)
        if token in eos:
            break
        feed = [token]
    return out


@torch.inference_mode()
def engine_greedy(target: torch.nn.Module, prompt_ids: Sequence[int], max_new_tokens: int,
                  eos_token_ids: Sequence[int] = ()) -> list[int]:
    """The target's greedy continuation as the engine computes it: its own forward (runtime/draft_forward.py,
    the C decoder where it applies), one token per forward, no draft.

    On a quantized path this is the output a lossless run must reproduce, and it can differ from
    :func:`target_greedy`: where the kernels round the activations (to int8: per row on the int8 path,
    per block of 32 on int4), the module forward's float arithmetic (attention,
    norms) flips some roundings the decoder does not, and near-ties of the argmax go the other way (on
    the bundled int4 target on an AVX2 CPU, about 0.3 in the logits either way from fp32, and of six
    held-out prompts one had another first token). The oracles need the run's own future, so
    :meth:`GreedyOracle.compute` uses this."""
    from .speculative import generate

    return generate(target, prompt_ids, None, max_new_tokens=max_new_tokens,
                    eos_token_ids=eos_token_ids).generated_ids


def _weights_digest(target: str | Path) -> str:
    """Which target this is, by content (model_source.model_digest and answer_files_digest: a GGUF or pkg: file's
    digest, a folder's weights, config and tokenizer files); the prefix the cache keys carry."""
    from .model_source import answer_files_digest, model_digest

    return hashlib.sha256(f"{model_digest(target)}:{answer_files_digest(target)}".encode()).hexdigest()[:16]


CONTINUATIONS_FORMAT = "memspec-continuations/1"


def read_continuations(path: Path) -> dict[str, list[int]]:
    """A continuations cache's entries; ValueError naming the file unless it is one (this format, or the untagged
    mapping written before it). Any JSON object was taken: a cut file failed in a JSONDecodeError traceback, a list
    in a TypeError, and --continuations models/acceptance.json had cache keys merged into it and was rewritten."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"{path} is not a continuations cache (not JSON: {exc}; cut by an interrupted run?):"
                         " remove it or name another file") from None
    tagged = isinstance(data, dict) and data.get("format") == CONTINUATIONS_FORMAT
    entries = data.get("entries") if tagged else data
    if not isinstance(entries, dict) or not all(
            isinstance(key, str) and key.count(":") >= 3 and isinstance(ids, list)
            and all(type(t) is int for t in ids) for key, ids in entries.items()):
        raise ValueError(f"{path} is not a continuations cache (a {CONTINUATIONS_FORMAT} file of target"
                         " continuations): name another file, it would be rewritten")
    return entries


# an interrupted run (Ctrl-C after hours of decoding, a crash) keeps all but its last minutes: the file was written
# only at the end
SAVE_EVERY_SECONDS = 300.0


class ContinuationCache:
    """The target's greedy continuations, kept on disk between runs.

    A greedy continuation depends only on the target and the prompt, so
    re-measuring a rebuilt draft set (acceptance matrix, predictor traces) need
    not decode the target again; on the zoo that is most of the time such a run
    takes. Entries are keyed by a digest of the target's weight and config
    files, the prompt and the token budget, so another target never hits.
    ``path`` None keeps nothing on disk (and skips hashing the weights).
    """

    def __init__(self, path: str | Path | None, target_dir: str | Path) -> None:
        self.path = Path(path) if path else None
        self.target = _weights_digest(target_dir) if self.path is not None else ""
        self.entries: dict[str, list[int]] = {}
        self.hits = self.misses = 0
        self._unsaved, self._saved_at = 0, time.monotonic()
        if self.path is not None and self.path.is_file():
            self.entries = read_continuations(self.path)

    def continuation(self, target: torch.nn.Module, prompt_ids: Sequence[int], max_new_tokens: int,
                     eos_token_ids: Sequence[int] = ()) -> list[int]:
        prompt = hashlib.sha256(",".join(map(str, prompt_ids)).encode()).hexdigest()[:24]
        key = f"{self.target}:{max_new_tokens}:{sorted(eos_token_ids)}:{prompt}"
        if key in self.entries:
            self.hits += 1
        else:
            self.misses += 1
            self._unsaved += 1
            self.entries[key] = target_greedy(target, prompt_ids, max_new_tokens, eos_token_ids)
            if self.path is not None and time.monotonic() - self._saved_at >= SAVE_EVERY_SECONDS:
                try:
                    self.save()
                except OSError as exc:  # the run goes on; the final save tries again, and its caller says
                    self._saved_at = time.monotonic()
                    print(f"could not save the continuations to {self.path} ({exc}): going on", file=sys.stderr)
        return list(self.entries[key])

    def save(self) -> None:
        """Write the continuations not yet on disk (OSError where the file or its folder cannot be written)."""
        if self.path is None or not self._unsaved:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        # merge what another run saved since this one loaded: two runs sharing the file keep both
        if self.path.is_file():
            self.entries = {**read_continuations(self.path), **self.entries}
        # aside, synced, then renamed: an interrupted run or a power cut never leaves half a file, nor its temporary
        with written_aside(self.path, sync=True) as tmp:
            tmp.write_text(json.dumps({"format": CONTINUATIONS_FORMAT, "entries": self.entries}))
        self._unsaved, self._saved_at = 0, time.monotonic()


@torch.inference_mode()
@torch.no_grad()
def continuation_logits(model: torch.nn.Module, prompt_ids: Sequence[int], continuation: Sequence[int]) -> torch.Tensor:
    """[len(continuation), vocab]: row j is ``model``'s next-token logits after prompt + continuation[:j]."""
    ids = list(prompt_ids) + list(continuation)
    device = next(model.parameters()).device
    logits = model(input_ids=torch.tensor([ids], device=device), use_cache=False).logits[0]
    # logits at position len(prompt)-1+j predict continuation[j]
    return logits[len(prompt_ids) - 1 : len(ids) - 1]


@torch.inference_mode()
def engine_continuation_logits(model: torch.nn.Module, prompt_ids: Sequence[int],
                               continuation: Sequence[int]) -> torch.Tensor:
    """:func:`continuation_logits` on the forward the engine runs ``model`` with (its lean forward where it has
    one), so that agreement is what the engine's draft proposes. The lean forward computes each row alike
    however many come in one call (test_forward_paths.py), so one call over the whole continuation gives
    the rows of the engine's catch-ups and one-token proposals."""
    from .draft_forward import lean_forward_for
    from .speculative import KVState

    lean = lean_forward_for(model)
    if lean is None or not continuation:
        return continuation_logits(model, prompt_ids, continuation)
    ids = list(prompt_ids) + list(continuation)
    return lean(ids[:-1], KVState().cache, 0, len(continuation)).float()


def draft_agreement(draft: torch.nn.Module, prompt_ids: Sequence[int], continuation: Sequence[int],
                    logits: torch.Tensor | None = None) -> list[bool]:
    """agree[j]: the draft's greedy next token after prompt + continuation[:j] equals continuation[j].

    ``logits``: the draft's ``continuation_logits`` when the caller already has them.
    """
    if logits is None:
        logits = continuation_logits(draft, prompt_ids, continuation)
    preds = logits.argmax(-1).tolist()
    return [int(p) == int(t) for p, t in zip(preds, continuation, strict=False)]


def accepted_at(agree: Sequence[bool], position: int, gamma: int) -> int:
    """Draft tokens accepted by one iteration that starts after ``position`` generated tokens.

    Proposals predict continuation[position], [position + 1], ...; like the engine,
    an iteration proposes at most (tokens left - 1) so the target's extra token fits.
    """
    limit = min(gamma, len(agree) - position - 1)
    k = 0
    while k < limit and agree[position + k]:
        k += 1
    return k


def interval_walk(agree: Sequence[bool], position: int, gamma: int, iterations: int) -> tuple[int, list[int]]:
    """(tokens committed, accepted per iteration) for N iterations of one draft from ``position``."""
    start, accepted = position, []
    for _ in range(iterations):
        if position >= len(agree):
            break
        a = accepted_at(agree, position, gamma)
        accepted.append(a)
        position += a + 1
    return position - start, accepted


def nearest_size(seconds: Mapping[int, float], size: int) -> float:
    """``seconds[size]``, or the entry of the nearest size measured (0 with none): verify times by proposals."""
    if size in seconds:
        return seconds[size]
    return seconds[min(seconds, key=lambda k: abs(k - size))] if seconds else 0.0


@dataclass(frozen=True)
class ScheduleCosts:
    """What Oracle-Dynamic's schedule pays, as measured on this machine and storage (the bench fills it).

    Times are in seconds; the schedule counts them in speculative iterations (draft + verify), the
    unit every interval's cost is in. Without ``iteration_seconds`` switches and loads are free.
    """

    capacity: int = 2  # K
    iteration_seconds: float = 0.0  # one speculative iteration (draft + verify), any draft (one architecture)
    # an incoming draft's KV catch-up at a switch: it feeds every token it has not seen (the prompt and the output
    # so far, for a draft that has not run since it was loaded), in one forward that also yields its first
    # proposal; beyond the draft forward an iteration already counts, it costs this much (negative where the
    # measured line starts below one draft forward) ...
    catchup_seconds: float = 0.0
    catchup_token_seconds: float = 0.0  # ... plus this per token fed
    load_seconds: Mapping[str, float] = field(default_factory=dict)  # storage -> fast memory, per draft
    # an iteration's own cost by the proposals it verifies (fewer than gamma near the end of the output, none in
    # the last): its draft forwards, its verify and the rest of the loop. Without them every iteration costs one
    verify_seconds: Mapping[int, float] = field(default_factory=dict)
    draft_token_seconds: float = 0.0
    other_iteration_seconds: float = 0.0

    def iteration_cost(self, proposed: int) -> float:
        """An iteration that verifies ``proposed`` proposals, in speculative iterations."""
        if not self.verify_seconds or self.iteration_seconds <= 0:
            return 1.0
        seconds = (proposed * self.draft_token_seconds + nearest_size(self.verify_seconds, proposed)
                   + self.other_iteration_seconds)
        return seconds / self.iteration_seconds

    def catchup_iterations(self, tokens: int = 0) -> float:
        """A catch-up over ``tokens`` tokens, in speculative iterations, beyond the iteration it is part of. The whole
        catch-up forward is clamped at 0 and then the draft forward it replaces taken off, as the replay charges it
        (simulator.py): clamped after that subtraction, a line starting below one draft forward priced every switch
        higher than the replay by the difference."""
        if self.iteration_seconds <= 0:
            return 0.0
        forward = self.catchup_seconds + self.draft_token_seconds + self.catchup_token_seconds * tokens
        return (max(0.0, forward) - self.draft_token_seconds) / self.iteration_seconds

    def load_iterations(self) -> dict[str, float]:
        if self.iteration_seconds <= 0:
            return {}
        return {d: s / self.iteration_seconds for d, s in self.load_seconds.items()}


@dataclass
class GreedyOracle:
    """Per-prompt future knowledge: the continuation and every draft's agreement with it."""

    continuation: list[int]
    agreement: dict[str, list[bool]]
    gamma: int = 4
    interval: int = 4
    scores: dict[str, float] = field(default_factory=dict)  # whole-output utility, cached
    costs: ScheduleCosts | None = None  # what Oracle-Dynamic's schedule pays (None: free switches and loads)
    prompt_tokens: int = 0  # the prompt's length: a draft switched in catches up on it too
    max_new_tokens: int = 0  # the run's token budget (0: the continuation's length), which caps its proposals
    # Oracle-Dynamic's solved schedules, per drafts (with the costs they were solved under): planning in
    # hindsight is no cost a real policy pays, so a bench solves it before its timed runs (plan()) and every
    # run of this prompt reuses it
    _solvers: dict = field(default_factory=dict, repr=False, compare=False)

    @classmethod
    def compute(cls, target: torch.nn.Module, drafts: Mapping[str, torch.nn.Module], prompt_ids: Sequence[int],
                max_new_tokens: int, gamma: int = 4, interval: int = 4,
                eos_token_ids: Sequence[int] = ()) -> GreedyOracle:
        """The run's own future: the continuation and the agreements on the forwards the engine runs."""
        continuation = engine_greedy(target, prompt_ids, max_new_tokens, eos_token_ids)
        agreement = {name: draft_agreement(model, prompt_ids, continuation,
                                           engine_continuation_logits(model, prompt_ids, continuation))
                     for name, model in drafts.items()}
        return cls(continuation, agreement, gamma, interval, prompt_tokens=len(prompt_ids),
                   max_new_tokens=max_new_tokens)

    def utility(self, draft: str, position: int) -> int:
        """Tokens the draft would commit over the next interval from ``position`` (0 if unknown)."""
        agree = self.agreement.get(draft)
        return interval_walk(agree, position, self.gamma, self.interval)[0] if agree is not None else 0

    def static_utility(self, draft: str) -> float:
        """Mean accepted tokens per iteration running this draft for the whole output."""
        if draft not in self.scores:
            agree = self.agreement.get(draft)
            if agree is None:
                self.scores[draft] = -1.0
            else:
                _, accepted = interval_walk(agree, 1, self.gamma, len(agree))  # 1: prefill made the first token
                self.scores[draft] = sum(accepted) / len(accepted) if accepted else 0.0
        return self.scores[draft]

    def solver(self, drafts: Sequence[str], capacity: int = 0) -> ScheduleSolver:
        """Oracle-Dynamic's schedule over ``drafts`` under this oracle's costs with ``capacity`` drafts resident
        (the cache's K; 0: the costs' own), solved once and kept (memoised states stay valid: they depend only on
        the continuation, the agreements and the costs)."""
        planned = self.costs or ScheduleCosts()
        if capacity and capacity != planned.capacity:  # the cache's K, not the default of costs made without it
            planned = replace(planned, capacity=capacity)
        key = (tuple(drafts), planned.capacity)
        costs, solver = self._solvers.get(key, (None, None))
        if solver is None or costs is not self.costs:  # costs set (or replaced) since: plan again
            solver = ScheduleSolver.for_oracle(self, drafts, planned)
            self._solvers[key] = (self.costs, solver)
        return solver

    def plan(self, drafts: Sequence[str], capacity: int = 0) -> None:
        """Solve Oracle-Dynamic's schedule from the start now (outside any timed run: see ``_solvers``)."""
        self.solver(drafts, capacity).value()

    def best_static(self, candidates: Sequence[str]) -> str:
        return max(candidates, key=lambda d: (self.static_utility(d), -list(candidates).index(d)))

    def ranking_at(self, position: int, candidates: Sequence[str]) -> list[tuple[str, float]]:
        """Drafts by their utility over the next interval (ties: better whole-output draft first)."""
        scored = [(d, self.utility(d, position) + 1e-3 * self.static_utility(d)) for d in candidates]
        return sorted(scored, key=lambda p: -p[1])


# -- Oracle-Dynamic: the best schedule by dynamic programming ------------------------------------

START = "start"  # the first choice: its load is setup (after prefill, before decoding), not decoding time
RESIDENT = "resident"  # run a resident draft (optionally prefetch one, evicting one)
WAIT = "wait"  # wait for the draft being prefetched, then run it
LOAD = "load"  # blocking load of a draft neither resident nor on its way (evicting one), then run it


@dataclass(frozen=True)
class ScheduleAction:
    """One scheduling point's decision: the draft to run for the next interval and the cache's moves."""

    kind: str  # START | RESIDENT | WAIT | LOAD
    run: str
    prefetch: str = ""  # a load started now, in the background (START / RESIDENT only)
    evict: tuple[str, ...] = ()  # drafts whose slots the blocking load and the prefetch take


State = tuple[int, str, frozenset, tuple[str, int] | None]  # position, active, resident set, (loading, intervals since)


class ScheduleSolver:
    """The fastest schedule of drafts over one greedy output, by dynamic programming.

    Cost model (in speculative iterations, the unit every interval is measured in):

    * running draft d for an interval from position p costs the iterations of its walk
      (``step(d, p)`` -> (next position, cost in iterations)); all drafts cost the same per iteration, and an
      iteration that verifies fewer proposals (near the end) costs what it verifies
      (:meth:`ScheduleCosts.iteration_cost`);
    * a switch (the draft differs from the last interval's, the first interval included) at position p costs
      ``switch(p)`` iterations where given (for_oracle: the catch-up line over the prompt and p tokens, clamped
      as the replay clamps it), else ``catchup + catchup_per_token * p``: the incoming draft's KV catch-up, which
      feeds the tokens it has not seen. That is every token for a draft that has not run since it was loaded, and
      fewer for one that ran before and stayed resident; the model charges the former (an upper bound, exact for
      the first switch and for Oracle-Static's one catch-up), since tracking each resident draft's last position
      would multiply the states by the output's length. A catch-up priced at one constant (the first prompt's)
      let the schedule switch where the catch-ups late in an answer cost it more than it gained (Oracle-Dynamic
      came out below Oracle-Static on three workloads of the committed bench);
    * at most ``capacity`` drafts are resident or loading; one load at a time (one loader thread);
      a load of d takes ``load[d]`` iterations and overlaps decoding: started at a scheduling point,
      it is complete k points later when k * ``overlap`` >= load[d], ``overlap`` being what an interval of
      full iterations costs (interval * iteration_cost(gamma): the loop's own time beside draft and verify
      passes while the load runs, as the simulator's clock and the live run's pass it; crediting only
      ``interval`` had the schedule wait for loads a prefetching policy found complete). Catch-ups and
      waits in between are not counted as overlap: the model never credits a load with time it may not
      have had;
    * what the runtime controller can do at a scheduling point, no more: run a resident draft and
      align the cache (prefetch one draft, evicting any but the draft that runs next, which the controller
      keeps: choice.carry_out); or wait for the draft in flight and run it; or, with no
      load in flight, block on loading a draft and run it (evicting any resident one). The first
      draft's load happens before decoding (setup time, outside the decode metric) and is free. The controller
      can also start a prefetch beside a wait or a blocking load, which this model does not (it prefetches only
      beside a resident draft): an omission that can only make the schedule dearer, so Oracle-Dynamic understates
      the headroom there (no compared policy blocks and prefetches after its first choice).

    ``value(state)`` is the least cost from any state, memoised, so the policy can re-plan from
    where the real run is. Running one draft throughout is a schedule of this model, so
    ``cost() <= min(static_cost(d))`` by construction.
    """

    def __init__(self, drafts: Sequence[str], step: Callable[[str, int], tuple[int, float]], start: int, end: int,
                 interval: int, capacity: int, catchup: float = 0.0, load: Mapping[str, float] | None = None,
                 catchup_per_token: float = 0.0, overlap: float | None = None,
                 switch: Callable[[int], float] | None = None) -> None:
        if capacity < 1:
            raise ValueError(f"capacity K must be >= 1, got {capacity}")
        self.drafts = tuple(drafts)
        self.start, self.end, self.interval, self.capacity = start, end, interval, capacity
        self.overlap = float(interval if overlap is None else overlap)  # load time an interval hides
        # a switch's cost at position p: ``switch``, else the line catchup + catchup_per_token * p
        self._switch = switch or (lambda p: catchup + catchup_per_token * p)
        self.load = {d: max(0.0, float((load or {}).get(d, 0.0))) for d in self.drafts}
        self._step_fn = step
        self._steps: dict[tuple[str, int], tuple[int, float]] = {}
        self._memo: dict[State, tuple[float, ScheduleAction | None, State | None]] = {}

    @classmethod
    def for_oracle(cls, oracle: GreedyOracle, drafts: Sequence[str],
                   costs: ScheduleCosts | None = None) -> ScheduleSolver:
        costs = costs or oracle.costs or ScheduleCosts()
        agree = {d: oracle.agreement[d] for d in drafts if d in oracle.agreement}

        def step(d: str, p: int) -> tuple[int, float]:
            # interval_walk's iterations, each priced by the proposals it verifies (capped like the engine's)
            walk, n, cost = agree[d], len(agree[d]), 0.0
            for _ in range(oracle.interval):
                if p >= n:
                    break
                # the engine proposes up to the token budget: an output that ends at an end token is not known
                # to end until it does, so its last iterations verify gamma proposals all the same
                cost += costs.iteration_cost(max(0, min(oracle.gamma, budget - p - 1)))
                p += accepted_at(walk, p, oracle.gamma) + 1
            return p, cost

        budget = oracle.max_new_tokens or len(oracle.continuation)
        # each switch priced over the whole context it feeds (prompt and answer so far), clamped once as the replay
        # clamps it: the prompt's clamped cost plus a per-token line over-charged every switch where the fitted
        # catch-up line starts below zero, so the schedule switched less than the replay's costs justify
        return cls(list(agree), step, 1, len(oracle.continuation), oracle.interval, costs.capacity,
                   load=costs.load_iterations(), overlap=oracle.interval * costs.iteration_cost(oracle.gamma),
                   switch=lambda p: costs.catchup_iterations(oracle.prompt_tokens + p))

    # -- the model -----------------------------------------------------------------------------
    def step(self, d: str, p: int) -> tuple[int, float]:
        key = (d, p)
        if key not in self._steps:
            self._steps[key] = self._step_fn(d, p)
        return self._steps[key]

    def initial_state(self) -> State:
        return (self.start, "", frozenset(), None)

    def normalise(self, state: State) -> State:
        """A load whose time has passed is resident."""
        p, a, resident, loading = state
        if loading is not None and loading[1] * self.overlap >= self.load.get(loading[0], 0.0):
            return (p, a, resident | {loading[0]}, None)
        return state

    def still_loading(self, draft: str, intervals: int) -> int:
        """``intervals`` since ``draft``'s load started, at most the last count at which the model still has it in
        flight (a real load that lands later than the model's: seen landed, the schedule ran it as resident and the
        policy then blocked on it instead of weighing the wait against a resident draft). Unchanged where the model
        has no such count (a load of no time)."""
        load = self.load.get(draft, 0.0)
        if self.overlap <= 0 or load <= 0:
            return intervals
        return min(intervals, math.ceil(load / self.overlap) - 1)

    def switch_cost(self, p: int) -> float:
        """Iterations a draft switched in at position ``p`` spends catching up (see the class's cost model)."""
        return self._switch(p)

    def static_cost(self, draft: str) -> float:
        """One draft throughout (Oracle-Static's schedule) in this model: its iterations plus the first catch-up."""
        p, total = self.start, self.switch_cost(self.start)
        while p < self.end:
            p, n = self.step(draft, p)
            total += n
        return total

    def _run(self, x: str, p: int, a: str) -> tuple[int, float]:
        nxt, iterations = self.step(x, p)
        return nxt, iterations + (self.switch_cost(p) if x != a else 0.0)

    def _prefetches(self, resident: frozenset, protect: set[str]):
        """(draft to prefetch, victims, resident set left) for each prefetch the cache could start now."""
        for b in self.drafts:
            if b in resident:
                continue
            if len(resident) < self.capacity:
                yield b, (), resident
            else:
                for v in sorted(resident - protect):
                    yield b, (v,), resident - {v}

    def _options(self, state: State):
        """(cost now, action, next state) for every decision the controller can carry out here."""
        p, a, resident, loading = state
        if p == self.start and a == "":  # the first choice: its load is setup, before decoding
            for x in self.drafts:
                nxt, cost = self._run(x, p, a)
                if x in resident or len(resident) < self.capacity:
                    starts = [((), resident | {x})]
                else:
                    starts = [((v,), (resident - {v}) | {x}) for v in sorted(resident)]
                for gone, now in starts:
                    yield cost, ScheduleAction(START, x, evict=gone), (nxt, x, now, None)
                    if loading is None:
                        for b, v, left in self._prefetches(now, {x}):
                            yield cost, ScheduleAction(START, x, b, gone + v), (nxt, x, left, (b, 1))
            return
        k_next = None if loading is None else (loading[0], loading[1] + 1)
        for x in sorted(resident):
            nxt, cost = self._run(x, p, a)
            yield cost, ScheduleAction(RESIDENT, x), (nxt, x, resident, k_next)
            if loading is None:
                for b, v, left in self._prefetches(resident, {x}):  # as carry_out: only the draft to run is kept
                    yield cost, ScheduleAction(RESIDENT, x, b, v), (nxt, x, left, (b, 1))
        if loading is not None:
            b, k = loading
            nxt, cost = self._run(b, p, a)
            wait = max(0.0, self.load[b] - k * self.overlap)
            yield wait + cost, ScheduleAction(WAIT, b), (nxt, b, resident | {b}, None)
            return
        for x in self.drafts:
            if x in resident:
                continue
            nxt, cost = self._run(x, p, a)
            victims = [()] if len(resident) < self.capacity else [(v,) for v in sorted(resident)]
            for v in victims:
                yield self.load[x] + cost, ScheduleAction(LOAD, x, evict=v), (nxt, x, (resident - set(v)) | {x}, None)

    # -- the dynamic program ---------------------------------------------------------------------
    def _solve(self, state: State) -> tuple[float, ScheduleAction | None, State | None]:
        state = self.normalise(state)
        if state in self._memo:
            return self._memo[state]
        best: tuple[float, ScheduleAction | None, State | None] = (0.0, None, None)
        if state[0] < self.end and self.drafts:
            best = (float("inf"), None, None)
            for cost, action, nxt in self._options(state):
                total = cost + self._solve(nxt)[0]
                if total < best[0] - 1e-12:
                    best = (total, action, nxt)
        self._memo[state] = best
        return best

    def _with_depth(self, fn, *args):
        limit = sys.getrecursionlimit()
        need = 4 * (self.end - self.start + 2) + 200  # each interval advances >= 1 token
        if need > limit:
            sys.setrecursionlimit(need)
        try:
            return fn(*args)
        finally:
            sys.setrecursionlimit(limit)

    def value(self, state: State | None = None) -> float:
        """Least cost (iterations) from ``state`` (default: the start) to the end of the output."""
        return self._with_depth(self._solve, state or self.initial_state())[0]

    def best_action(self, state: State) -> ScheduleAction | None:
        return self._with_depth(self._solve, state)[1]

    def cost(self) -> float:
        return self.value()

    def plan(self, state: State | None = None) -> list[tuple[int, ScheduleAction]]:
        """The optimal decisions from ``state`` on: (position, action) per scheduling point."""
        state = state or self.initial_state()
        self.value(state)
        steps = []
        while True:
            state = self.normalise(state)
            _, action, nxt = self._memo[state]
            if action is None or nxt is None:
                return steps
            steps.append((state[0], action))
            state = nxt
