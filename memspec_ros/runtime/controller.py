"""The Runtime Controller (the paper's Algorithm 3): one shared loop for every policy.

Every N iterations (a scheduling point) the controller asks the policy for a
Choice and carries it out (runtime/choice.py's ``carry_out``, which the simulator
shares): the cache acts as the Choice says, decoding blocks only if it says so, and
the draft that runs is the preferred one if resident, otherwise the first resident
draft of the Choice's fallback order, any other resident draft, or the target
alone. Between scheduling points nothing changes, which is where registry edits,
reconfiguration and policy switches take effect.

This is the single entry point the ROS node calls. The node builds it from files as
``load_models`` does (runtime/loader.py: the target's end-of-turn ids, context, draft
forward path, storage tier and datastore come with it); ``RuntimeController(config,
target, tokenizer, registry, predictor, ...)`` is the low-level constructor::

    controller = load_models("models/registry.yaml").controller(config)   # or load_runtime(config, ...)
    result = controller.generate(prompt, max_new_tokens, sampling, stop, on_chunk, should_cancel)
    controller.reconfigure(capacity=3, policy="mab-async")   # ValueError naming the field; nothing changed
    controller.replace_registry(other_registry, general_draft="math")   # new drafts and settings together

A running generation takes a reconfiguration, and a registry replaced through the controller, at its next scheduling
point, both at once.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from .cache import DraftCacheManager, DraftLoadError, Loader, registry_loader
from .chat import raw_ids
from .choice import Choice, Resolution, carry_out, run_first_resident
from .datastore import Datastore
from .forward_paths import MAX_VERIFY_ROWS
from .gamma_choice import target_costs
from .lookup import LOOKUP_DRAFT, LookupConfig
from .models import LoadedModel
from .oracle import GreedyOracle
from .policies import POLICIES, RANKING_POLICIES, DraftPolicy, PolicyError, SchedulingPoint, make_policy
from .predictor import OverlappedPredictor, RankingModel, SynchronousPredictor, check_ranks_registry
from .prompt_cache import PromptCache, Reuse, reuse_refused
from .registry import DraftEntry, DraftRegistry
from .speculative import (
    ChunkCallback,
    DraftFailure,
    KVState,
    SamplingConfig,
    SpeculativeSession,
    check_generation,
    input_rows,
    served_positions,
)
from .stats import GenerationStats, IterationStats

log = logging.getLogger(__name__)

GREEDY = SamplingConfig()
I64 = 2**63 - 1

# the most answer tokens remember_answers keeps in all (1,000 answers of 128 tokens): their index (15 MB, 0.24 s to
# build again after each goal, measured here on random tokens) stays bounded whatever the answers' length (1,000
# of 2,048 tokens: 5.4 s and about 260 MB)
REMEMBERED_TOKENS = 128_000

# Each numeric setting's range, in one place: RuntimeConfig.validate checks it and the node declares its
# memspec.* parameters with it.
LIMITS: dict[str, tuple[int, int] | tuple[float, float]] = {
    "capacity": (1, 64),
    "budget_bytes": (0, I64),
    "interval": (1, 1024),
    "recent_tokens": (0, 4096),
    # at most 8: a verify of gamma + 1 rows must equal one-token steps, and the forward paths check their
    # kernels' rows up to forward_paths.MAX_VERIFY_ROWS (9); an unchecked 10+ row verify could differ
    "gamma": (1, MAX_VERIFY_ROWS - 1),
    # re-indexed after every goal, on the goal's thread: 1,000 answers of 128 tokens took 0.2 s to index
    # (timed once on the 2-core development machine)
    "remember_answers": (0, 1000),
    "prompt_cache_bytes": (0, I64),
    "ucb_c": (0.0, 100.0),
    "max_load_wait_seconds": (0.0, 86400.0),
}


@dataclass(frozen=True)
class RuntimeConfig:
    """The runtime's knobs; the same names as the node's ROS parameters."""

    policy: str = "memspec"
    capacity: int = 2  # K: drafts resident at once (the paper: 2 on an 8 GB Jetson)
    budget_bytes: int = 0  # optional byte budget for drafts of different sizes (0: count only)
    interval: int = 4  # N: iterations between scheduling points
    recent_tokens: int = 32  # T: generated tokens the predictor sees
    gamma: int = 4  # draft tokens proposed per iteration
    overlap_prediction: bool = False  # run the predictor on a background thread (ranking one interval late)
    general_draft: str = "general"  # General-Static's draft
    ucb_c: float = 2.0  # MAB exploration coefficient (the paper's best)
    reset_cache_per_generation: bool = False  # the paper's protocol; a robot keeps its cache warm
    # a generation's first choice waits for its draft even when another one is resident (policies.py: by default
    # the non-blocking policies run the resident draft meanwhile and wait only on a cold cache)
    wait_for_initial_draft: bool = False
    adaptive_gamma: bool = False  # gamma per iteration (0..gamma) from measured costs (runtime/gamma_choice.py)
    # with adaptive_gamma: the draft stops where its own confidence no longer pays for a verify row (row_pays)
    confidence_stop: bool = True
    # copy proposals from the context where its last tokens recur (runtime/lookup.py), and from the
    # controller's datastore of past answers if it has one
    context_lookup: bool = False
    # the last this many answers are kept in memory and searched like the datastore (0: none): a robot
    # asked again what it was asked before answers faster (runtime/datastore.py)
    remember_answers: int = 0
    # keep the target's and the drafts' KV caches between generations and reuse them for a prompt that starts with
    # the same tokens (a conversation's earlier turns, a fixed system prompt): runtime/prompt_cache.py. Outputs are
    # unchanged
    prompt_cache: bool = True
    # the caches of goals before the last are kept while all of them, the last goal's included, hold at most this
    # many bytes (oldest dropped first), so goals that alternate between conversations or system prompts (a
    # behaviour tree's skills, several people) each continue their own; the last goal's is always kept, even
    # above it. 0: only the last goal's
    prompt_cache_bytes: int = 128 * 2**20
    # the longest a blocking wait for a draft's load lasts (a cold cache's first draft, mab-sync, general-static):
    # then decoding goes on without it (a resident draft or the target alone: the output is the same) while the load
    # goes on. A stalled read (an SD card failing, a network mount) held the goal for good. 0: no limit
    max_load_wait_seconds: float = 30.0

    def validate(self) -> RuntimeConfig:
        """This config, or ValueError naming the first field whose value has the wrong type or range."""
        for f in dataclasses.fields(self):
            # a switch must be a bool: a string such as "false" (a YAML or command line slip) is truthy and would
            # turn the feature on; a name must be a string
            value, expected = getattr(self, f.name), _FIELD_TYPES.get(f.type)
            if expected is None:
                raise TypeError(f"RuntimeConfig.{f.name}: no check for its type {f.type!r}")
            if expected is bool and not isinstance(value, bool):
                raise ValueError(f"{f.name} must be true or false (a bool), got {value!r}")
            if expected is str and not isinstance(value, str):
                raise ValueError(f"{f.name} must be a string, got {value!r}")
        if self.policy not in POLICIES:
            raise ValueError(f"policy must be one of {', '.join(POLICIES)}, got {self.policy!r}")
        for name, (lo, hi) in LIMITS.items():
            value, kind = getattr(self, name), "a number" if isinstance(lo, float) else "an integer"
            types = (int, float) if isinstance(lo, float) else int
            if not (isinstance(value, types) and not isinstance(value, bool) and lo <= value <= hi):
                raise ValueError(f"{_LABELS.get(name, name)} must be {kind} in [{lo}, {hi}], got {value!r}")
        return self


_LABELS = {"capacity": "capacity (K)", "interval": "interval (N)", "recent_tokens": "recent_tokens (T)"}
# RuntimeConfig's field annotations (strings: this module postpones annotations), each with the type validate()
# requires; numbers are checked against LIMITS, which names every int and float field
_FIELD_TYPES: dict[str, type] = {"bool": bool, "str": str, "int": int, "float": float}


@dataclass
class _Run:
    """One generation's loop state between scheduling points."""

    policy: DraftPolicy
    registry_version: int  # the registry's version the cache was last synced with
    active: str = ""  # the draft decoding ("" : the target alone)
    model: LoadedModel | None = None
    preferred: str = ""  # the policy's choice (active differs when it fell back)
    fallback: bool = False
    order: tuple[str, ...] = ()  # the last Choice's preferred draft and fallbacks: where a failed draft's interval goes
    interval: int = 0
    iterations: list[IterationStats] = dataclasses.field(default_factory=list)  # this interval's
    prediction_seconds: float = 0.0  # the last scheduling point's work, charged to the next iteration
    wait_seconds: float = 0.0  # its blocking load wait, likewise

    def follow(self, choice: Choice, resolution: Resolution) -> None:
        """Decode on what a carried-out Choice picked until the next scheduling point."""
        self.active, self.model = resolution.draft, resolution.model
        self.preferred, self.fallback = resolution.preferred, resolution.fallback
        self.order = (choice.preferred, *choice.fallback)


@dataclass
class GenerationResult:
    text: str
    finish_reason: str  # length | eos | stop | cancelled
    stats: GenerationStats
    token_ids: list[int]


def policy_settings(config: RuntimeConfig) -> tuple:
    """The settings the configured policy object is made with (RuntimeController._make_policy): a change of any of
    them mid-goal makes the policy anew at the next scheduling point. Only those it uses: made anew, a bandit
    forgets what it learned and tries every arm again (for MAB-Sync, a blocking load each)."""
    name = config.policy
    if name == "general-static":
        return name, config.general_draft
    if name in ("mab-sync", "mab-async"):
        return name, config.ucb_c
    if name in RANKING_POLICIES:
        return name, config.overlap_prediction
    return (name,)


def interval_draft(run: _Run) -> str:
    """The draft the interval just run proposed with: the active one, else (it failed mid-interval and the target
    decoded alone since) the one its iterations name, so that a bandit is still credited for what it did."""
    if run.active:
        return run.active
    return next((it.draft for it in reversed(run.iterations) if it.draft and it.draft != LOOKUP_DRAFT), "")


def predictor_refusal(policy: str, predictor, recent_tokens: int, interval: int) -> str:
    """Why ``policy`` may not rank with ``predictor`` at T = ``recent_tokens`` and N = ``interval`` ("" if it may):
    the controller refuses such a configuration, and a simulated sweep must not publish it either."""
    if policy not in RANKING_POLICIES:
        return ""
    trained = getattr(predictor, "recent_tokens", None)  # a trained head's T (a PredictionEngine's)
    if isinstance(trained, int) and trained > 0 and recent_tokens not in (0, trained):
        # the engine cuts the window to its own T: a larger one was ignored, a smaller one gave features the
        # head never saw in training
        return (f"recent_tokens (T) {recent_tokens} is not the predictor's T, {trained}: it was trained on the"
                f" last {trained} generated tokens (set {trained}, or 0 to rank on the prompt alone)")
    horizon = getattr(predictor, "label_horizon", 0)
    head_interval = getattr(predictor, "interval", 0)
    if isinstance(horizon, int) and horizon > 0 and interval != head_interval:
        # its labels name the best draft over the next intervals of ITS N: at another N it ranks for a span
        # it was not trained on (a head of label horizon 0, the rest of the output, has no N of its own)
        return (f"interval (N) {interval} is not the predictor's N, {head_interval}: its labels are the best draft"
                f" over the next {horizon} interval(s) of {head_interval} iterations (set {head_interval}, or"
                f" retrain with --interval {interval})")
    return ""


class RuntimeController:
    """Owns the draft cache and runs generations with the configured policy."""

    def __init__(
        self,
        config: RuntimeConfig,
        target: torch.nn.Module,
        tokenizer,
        registry: DraftRegistry,
        predictor: RankingModel | None = None,
        *,
        loader: Loader | None = None,
        cache: DraftCacheManager | None = None,
        oracle_for: Callable[[Sequence[int]], GreedyOracle] | None = None,
        eos_token_ids: Sequence[int] | None = None,
        max_positions: int = 0,
        draft_dtype: str = "fp32",
        draft_quantization: str = "none",
        storage: str | None = None,
        device: str = "cpu",
        datastore: Datastore | None = None,
    ) -> None:
        self.config = config.validate()
        if datastore is not None:  # refused here, not by every goal's session
            datastore.check_vocab(input_rows(target))
        self.datastore = datastore  # past answers context lookup also searches (runtime/datastore.py)
        self._answers: deque[list[int]] = deque()  # this controller's own latest answers (remember_answers)
        self._remembered: Datastore | None = None  # the index over them
        self.target = target
        self.tokenizer = tokenizer
        self.registry = registry
        self._synced_entries = {e.name: e for e in registry.entries()}  # the entries the cache was last synced with
        self.predictor = predictor
        self.oracle_for = oracle_for
        if eos_token_ids is None:
            eos = getattr(tokenizer, "eos_token_id", None) if tokenizer is not None else None
            eos_token_ids = [eos] if eos is not None else []
        self.eos_token_ids = list(eos_token_ids)
        # the session's own limits too (speculative.SpeculativeSession): a larger max_positions passed the request's
        # check here and was refused by the session, after the prompt cache's entry had been taken
        self.max_positions = served_positions(target, max_positions)
        self.cache = cache or DraftCacheManager(
            config.capacity,
            loader or registry_loader(registry, draft_dtype, device, storage=storage, quantization=draft_quantization,
                                      target_vocab_size=int(getattr(target.config, "vocab_size", 0) or 0)),
            budget_bytes=config.budget_bytes,
            size_of=self._size_of,
        )
        # a load that read another path than its entry names when it lands is dropped (_sync_registry's stale(),
        # for a load still in flight at the sync)
        self.cache.source_current = self._source_current
        self._lock = threading.Lock()
        self._pending: RuntimeConfig | None = None
        self._pending_registry: DraftRegistry | None = None  # replace_registry's, for the next scheduling point
        self._registry_left: list[DraftEntry] = []  # the entries it took out during the generation running
        self._recheck_files = False  # recheck_files_later(): evict changed drafts when the next generation starts
        self._running = False
        self._should_cancel: Callable[[], bool] | None = None  # the running generation's (a blocking wait asks it)
        self._stalled: set[str] = set()  # drafts whose load the running generation gave up waiting for (_wait)
        self._closed = False
        # the predictor as the policies use it, by overlap_prediction: ranking on the decode thread or overlapped
        self._rankers: dict[bool, SynchronousPredictor | OverlappedPredictor] = {}
        self.prompt_cache = PromptCache(config.prompt_cache_bytes)  # the last goals' KV caches (config.prompt_cache)
        # why this target's KV cache is not reused ("" : it is): checked now, before any generation
        self.prompt_cache_refused = reuse_refused(target)
        try:
            self._check_policy(self.config)  # fail now, not at the first goal
            _check_general_draft(self.config, registry.names())
            self.calibrate()
        except BaseException:
            self.close()  # a cache handed in may be loading already
            raise

    def calibrate(self, adaptive: bool | None = None) -> None:
        """With adaptive gamma, measure the target's forward costs now (once per thread count; about a second
        for a 135 M target), so that no generation's timing carries them. Also run before each generation:
        gamma, the thread count or adaptive_gamma itself may have changed since. ``adaptive``: whether the
        generation running adapts (adaptive_gamma applies from the next goal; None: the configuration's)."""
        if self.config.adaptive_gamma if adaptive is None else adaptive:
            target_costs(self.target, self.config.gamma)

    # -- configuration -------------------------------------------------------------------
    def _size_of(self, name: str) -> int:
        try:  # one lookup: a registry edit between a membership test and get() failed the draft's size
            return self.registry.get(name).size_bytes
        except KeyError:
            return 0

    def _check_policy(self, config: RuntimeConfig, registry: DraftRegistry | None = None) -> None:
        """PolicyError (or ValueError) if ``config``'s policy cannot run here with ``registry`` (default: the one in
        use)."""
        registry = registry if registry is not None else self.registry
        reason = predictor_refusal(config.policy, self.predictor, config.recent_tokens, config.interval)
        if reason:
            raise ValueError(reason)
        # as a policy takes it (a Ranker: _make_policy's wrappers), so that its close finds what it ends
        ranker = SynchronousPredictor(self.predictor) if self.predictor is not None else None
        make_policy(config.policy, predictor=ranker, oracle_for=self.oracle_for,
                    general_draft=config.general_draft, ucb_c=config.ucb_c).close()
        self.check_ranking(config.policy, registry)

    def check_ranking(self, policy: str, registry: DraftRegistry) -> None:
        """PolicyError if ``policy`` ranks with the trained predictor and that predictor scores none of
        ``registry``'s drafts (a head trained for other drafts)."""
        classes = getattr(self.predictor, "classes", None)  # a trained head's (a PredictionEngine's)
        if policy in RANKING_POLICIES and classes is not None:
            try:
                check_ranks_registry(classes, {e.name: e.domain for e in registry.entries()})
            except ValueError as exc:
                raise PolicyError(f"policy {policy}: {exc}") from exc

    def reconfigure(self, *, for_registry: DraftRegistry | None = None, **changes) -> RuntimeConfig:
        """Validate and apply changes (K, N, T, gamma, policy, ...): now if idle, else at the next scheduling point.

        Raises ValueError naming the field for an unknown field or a bad value, and
        PolicyError if the policy cannot run here; in both cases nothing changes. ``for_registry``: the registry
        the policy is checked against, where the caller replaces the one in use in the same change (a policy valid
        only with the new drafts was refused against the old).
        """
        with self._lock:
            new = self._checked_change(for_registry, changes)
            if self._running:
                self._pending = new
            else:
                self._apply(new)
            return new

    def replace_registry(self, other: DraftRegistry, **changes) -> list[DraftEntry]:
        """Take ``other``'s drafts and apply ``changes`` (checked against them) in one step: now if idle, else both
        at the running generation's next scheduling point. Done in two steps, a point between them ran, for an
        interval, a policy checked against the new drafts with the old ones (general-static naming a draft only the
        new registry has), or the old policy with the new; swapped at once while the settings waited, the point's
        own reads saw the new drafts with the old settings. Errors as :meth:`reconfigure`'s, with nothing changed.
        Returns the entries that left or changed (DraftRegistry.replace_with), which leave the draft cache and the
        prompt cache here; none while a generation runs (they leave the draft cache as it takes the swap, and the
        prompt cache when it ends)."""
        with self._lock:
            # also with no settings changed: the policy in force must be able to run with the new drafts (a trained
            # predictor scoring none of them was taken)
            new = self._checked_change(other, changes)
            self.registry.check_replacement(other)  # its one refusal, before anything is applied
            if self._running:
                self._pending_registry = other
                if changes:
                    self._pending = new
                return []
            config = self.config
            if changes:
                self._apply(new)
            try:
                removed = self.registry.replace_with(other)
            except BaseException:  # (checked above: a failure nobody foresaw) the settings go back with the drafts
                if changes:
                    self._apply(config)
                raise
            # idle: the removed drafts leave both caches now, under this lock (a caller that decided this by its own
            # idea of "a goal runs", the node's goal runner, kept them resident and counted until the next goal
            # when the swap landed between a goal's acceptance and its generate() or after generate() returned)
            self._drafts_left(removed)
            return removed

    def _drafts_left(self, removed: Sequence[DraftEntry]) -> None:
        """Drafts a registry swap took out, out of the draft cache and the prompt cache; the caller holds ``_lock``
        with no generation running. The swap is in force whatever happens here: a failure is logged, and the next
        generation's first sync drops them from the draft cache."""
        if not removed:
            return
        try:
            self._sync_registry("")
            self.prompt_cache.forget_drafts([entry.name for entry in removed])
        except Exception:
            log.exception("the draft registry was replaced, but the removed drafts could not leave the caches")

    def check_reconfigure(self, *, for_registry: DraftRegistry | None = None, **changes) -> RuntimeConfig:
        """What :meth:`reconfigure` would apply, checked the same way (the same errors), with nothing applied: a
        caller that changes other things in the same step checks them all before it applies any."""
        with self._lock:
            return self._checked_change(for_registry, changes)

    def _checked_change(self, for_registry: DraftRegistry | None, changes: dict) -> RuntimeConfig:
        """The settings after ``changes``, validated; the caller holds ``_lock``."""
        known = {f.name for f in dataclasses.fields(RuntimeConfig)}
        for key in changes:
            if key not in known:
                raise ValueError(f"{key} is not a runtime setting: use one of {', '.join(sorted(known))}")
        new = dataclasses.replace(self._pending or self.config, **changes).validate()
        # against the drafts it will run with: the ones given, else a swap waiting for the next point, else these
        registry = next(r for r in (for_registry, self._pending_registry, self.registry) if r is not None)
        self._check_policy(new, registry)
        names = registry.names()
        if for_registry is not None or {"policy", "general_draft"} & set(changes):  # (drafts replaced: also
            _check_general_draft(new, names)  # general-static's own, which it would lose)
        return new

    @property
    def next_config(self) -> RuntimeConfig:
        """The settings the next scheduling point runs with: a change waiting for it, else the current ones."""
        with self._lock:
            return self._pending or self.config

    def _apply(self, new: RuntimeConfig) -> None:
        if (new.capacity, new.budget_bytes) != (self.config.capacity, self.config.budget_bytes):
            # applied where nothing decodes (idle, or a scheduling point, which chooses the draft again): the K and
            # budget in force bind the draft that ran last too, which the cache would otherwise keep as active
            self.cache.set_active("")
            self.cache.reconfigure(new.capacity, new.budget_bytes)
            self.prompt_cache.trim()  # the caches of drafts that left go now (and count no more), not at the next goal
        if new.prompt_cache_bytes != self.prompt_cache.budget_bytes:
            self.prompt_cache.set_budget(new.prompt_cache_bytes)
        if not new.prompt_cache:
            self.prompt_cache.clear()  # switched off: its memory goes now, not at the next goal
        self.config = new
        if len(self._answers) > new.remember_answers:  # fewer kept (0: forget them): now, not after a goal succeeds
            self._remember([])

    def recheck_files_later(self) -> None:
        """Have the next generation start by evicting the resident drafts whose files changed
        (cache.evict_changed, which must not run beside a generation): a registry set again while a goal ran
        reloaded replaced files only if it came while idle."""
        with self._lock:
            self._recheck_files = True

    def _take_pending(self) -> RuntimeConfig | None:
        with self._lock:
            return self._take_pending_locked()

    def _take_pending_locked(self) -> RuntimeConfig | None:
        """Apply the change waiting for a scheduling point, if any; the caller holds ``_lock``."""
        pending, self._pending = self._pending, None
        if pending is not None:
            self._apply(pending)
        if self._pending_registry is not None:
            other, self._pending_registry = self._pending_registry, None
            self._registry_left += self.registry.replace_with(other)
        return pending

    def _make_policy(self) -> DraftPolicy:  # from policy_settings(self.config)
        ranker = None
        if self.predictor is not None:
            overlap = self.config.overlap_prediction
            ranker = self._rankers.get(overlap)
            if ranker is None or ranker.ranker is not self.predictor:
                kind = OverlappedPredictor if overlap else SynchronousPredictor
                ranker = self._rankers[overlap] = kind(self.predictor)
        return make_policy(self.config.policy, predictor=ranker, oracle_for=self.oracle_for,
                           general_draft=self.config.general_draft, ucb_c=self.config.ucb_c)

    # -- the loop (Algorithm 3) --------------------------------------------------------------
    def generate(
        self,
        prompt: str | Sequence[int],
        max_new_tokens: int = 128,
        sampling: SamplingConfig = GREEDY,
        stop: Sequence[str] = (),
        on_chunk: ChunkCallback | None = None,
        should_cancel: Callable[[], bool] | None = None,
        on_decode_start: Callable[[], None] | None = None,
    ) -> GenerationResult:
        """One generation. ``stop``: a list of stop strings (one string alone is refused: it would be one stop
        string per character); ``on_chunk(text_delta, token_ids)`` streams; ``should_cancel()`` is polled per iteration;
        ``on_decode_start()`` is called when decoding starts (after the prefill's token and the first draft's
        choice and load): the paper's metric is timed from there (runtime/stats.py), and a stream's running rate
        can be too."""
        # end to end and time to first token count from here (runtime/stats.py): the request's checks, a pending
        # reconfiguration, calibration and the cache reset of reset_cache_per_generation (which waits for loads
        # still in flight) come before the policy starts, and a user waits for them too
        t_call = time.perf_counter()
        if self._closed:  # its cache loads nothing any more: it ran on the target alone without a word
            raise RuntimeError("this controller is closed: make a new one")
        prompt_ids = self._encode(prompt)
        if not isinstance(stop, (str, bytes)):  # a one-shot iterable was used up by the check: its stops never matched
            stop = list(stop)
        # before anything is taken for it (the prompt cache's entry, the predictor's rows): a refused request
        # leaves them as they were
        check_generation(prompt_ids, max_new_tokens, self.max_positions, stop, self.tokenizer,
                         input_rows(self.target), self.eos_token_ids)
        if not isinstance(sampling, SamplingConfig):  # an AttributeError in the session, the entry already taken
            raise TypeError(f"sampling must be a SamplingConfig, got {type(sampling).__name__}")
        with self._lock:
            if self._running:
                raise RuntimeError("a generation is already running on this controller: one goal at a time")
            self._running = True
        session: SpeculativeSession | None = None
        # before the try: a failure ahead of the prompt cache's take (a timing forward, a file check, a reset)
        # read them in the handler and surfaced as UnboundLocalError instead of its own exception
        taken, prefix = 0, None
        rows_handed = False  # the predictor's hidden rows of this goal went to the prompt cache
        try:
            self._take_pending()
            with self._lock:
                recheck, self._recheck_files = self._recheck_files, False
            if recheck:  # before this generation uses the cache
                self.cache.evict_changed()
            self.calibrate()
            if self.config.reset_cache_per_generation:
                # a goal cancelled as it starts does not sit out a slow read, nor any goal a stalled one for good (the
                # load a goal gave up waiting for, after max_load_wait_seconds, may still be reading)
                self.cache.reset(stop=should_cancel, timeout=self.config.max_load_wait_seconds or None)
            reuse = self.config.prompt_cache and not self.prompt_cache_refused
            # the generation owns what it takes until it hands its own back (switched off, the cache is empty:
            # _apply cleared it)
            reused = self.prompt_cache.take(prompt_ids) if reuse else Reuse()
            prefix = reused.target
            # a conversation taken out of the cache is handed back if the goal fails (_hand_back); a copy's
            # original stayed there
            taken = prefix.length if prefix is not None and reused.moved else 0
            reuse_rows = getattr(self.predictor, "reuse_rows", None)
            if reuse_rows is not None:  # a target-hidden encoder's rows of the reused positions (None: not kept)
                reuse_rows(reused.hidden_rows if prefix is not None else None, prefix.length if prefix else 0)
            reused.hidden_rows = None  # the predictor holds what it needs: a slice kept here held the whole tensor
            session = SpeculativeSession(
                self.target, prompt_ids, max_new_tokens=max_new_tokens, gamma=self.config.gamma, sampling=sampling,
                eos_token_ids=self.eos_token_ids, stop_strings=stop, tokenizer=self.tokenizer, on_chunk=on_chunk,
                max_positions=self.max_positions, adaptive_gamma=self.config.adaptive_gamma,
                confidence_stop=self.config.confidence_stop,
                lookup=LookupConfig() if self.config.context_lookup else None,
                datastores=self._datastores() if self.config.context_lookup else (),
                prefix=prefix, draft_prefixes=reused.drafts,
            )
            # the session holds its own copy: a draft evicted during the goal must not live on here, beside the
            # cache's accounting, until the call returns
            reused.drafts = {}
            self._should_cancel, self._stalled = should_cancel, set()
            result = self._run(session, prompt_ids, should_cancel, on_decode_start, t_call)
            if taken and not session.started:  # cancelled before its prefill: the conversation it took goes back,
                # the drafts' caches with it (the predictor's rows were handed to it: released below, not kept)
                self._hand_back(prompt_ids[:taken], prefix, self._kept_drafts(session))
                taken = 0
                if reuse_rows is not None:  # the rows handed to the predictor for this goal: not held until the next
                    reuse_rows(None, 0)
            self._remember(result.token_ids)
            # a failed generation's KV is not kept, nor one whose cache was switched off while it ran
            if reuse and session.started and self.config.prompt_cache:
                prefix_rows = getattr(self.predictor, "prefix_rows", None)
                rows = prefix_rows(session.target_kv.length) if prefix_rows is not None else None
                rows_handed = True
                drafts = self._kept_drafts(session)
                taken = 0  # the cache owns this KV from here: nothing to hand back, whatever happens next
                self.prompt_cache.keep(session.tokens, session.target_kv, drafts, rows, prompt_length=len(prompt_ids))
            result.stats.call_seconds = time.perf_counter() - t_call
            return result
        except BaseException:
            if taken:  # a conversation moved out
                self._hand_back(prompt_ids[:taken], prefix)
            raise
        finally:
            self._should_cancel = None
            drop_rows = getattr(self.predictor, "prefix_rows", None)
            if not rows_handed and drop_rows is not None:
                # none kept (the prompt cache off or refused, the goal failed): the target-hidden encoder held every
                # row this goal fed, uncounted, until the next goal began (134 MB for a 4096-wide target at 8k)
                drop_rows(0)
            if session is not None and session.drop_draft in self.cache.on_evict:
                self.cache.on_evict.remove(session.drop_draft)
            self.cache.set_active("")  # no draft decodes between goals: none is protected as the running one
            with self._lock:
                self._running = False
                # in the same critical section: a reconfigure() from another thread (a parameter callback) between
                # the two would see the controller idle, apply the pending change plus its own at once, and then
                # have the older pending change applied over it, losing its own
                self._take_pending_locked()
                left, self._registry_left = self._registry_left, []
                # drafts a registry swap took out during the goal: out of both caches now, not at the next goal, and
                # under the lock: a reconfigure() from a parameter thread, which sees the controller idle from here,
                # clears or trims the prompt cache, and a trim here wrote its old entries back over that clear
                self._drafts_left(left)

    def _kept_drafts(self, session: SpeculativeSession) -> dict[str, tuple[torch.nn.Module, KVState]]:
        """The drafts' KV caches the prompt cache keeps beside the target's: none with the draft cache reset at every
        goal (its drafts are loaded anew as other objects: their caches could serve no later goal, and would only
        take the budget's bytes from the target's)."""
        return {} if self.config.reset_cache_per_generation else session.draft_kvs

    def _hand_back(self, tokens: list[int], prefix: KVState,
                   drafts: dict[str, tuple[torch.nn.Module, KVState]] | None = None) -> None:
        """The conversation a goal took, back into the prompt cache where the goal failed or was cancelled before
        its prefill: the positions it took were never written again (every write starts past them), so the next turn
        need not prefill the whole conversation anew. Not where the cache was switched off meanwhile."""
        if not self.config.prompt_cache:
            return
        try:
            self.prompt_cache.keep(tokens, prefix, drafts)
        except Exception:  # the goal's own failure is what its caller must see
            log.exception("the prompt cache could not take back a failed goal's conversation")

    def _datastores(self) -> tuple[Datastore, ...]:
        """What context lookup searches after the context: this controller's own answers, then the datastore."""
        return tuple(d for d in (self._remembered if self.config.remember_answers else None, self.datastore)
                     if d is not None)

    def _remember(self, answer: list[int]) -> None:
        """Keep ``answer`` among the last ``remember_answers``, at most REMEMBERED_TOKENS tokens in all (the oldest
        go first; one longer answer is kept alone), and index them again (milliseconds for a few answers; 0.2 s for
        1,000 of 128 tokens, timed once on the 2-core development machine)."""
        keep, before = self.config.remember_answers, len(self._answers)
        if answer and keep:
            self._answers.append(list(answer))
        # bounded by tokens too: an answer may be as long as the context (see REMEMBERED_TOKENS)
        tokens = self.remembered_tokens
        while len(self._answers) > keep or (len(self._answers) > 1 and tokens > REMEMBERED_TOKENS):
            tokens -= len(self._answers.popleft())
        if answer and keep or len(self._answers) != before:  # only a changed list is indexed again
            self._remembered = Datastore(self._answers) if self._answers else None

    @property
    def remembered_answers(self) -> int:
        return len(self._answers)

    @property
    def remembered_tokens(self) -> int:
        return sum(map(len, self._answers))

    def _encode(self, prompt: str | Sequence[int]) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("a text prompt needs a tokenizer; pass token ids instead")
            if not prompt.strip():  # a tokenizer that adds BOS made a prompt of it alone and answered that
                raise ValueError("the prompt is empty or only whitespace: give some text")
            ids = raw_ids(self.tokenizer, prompt)
        elif isinstance(prompt, (bytes, bytearray)):  # its byte values were taken as token ids
            raise TypeError("a prompt is text (str) or token ids, not bytes: decode it first")
        else:
            # a tensor's or an array's as Python ints; check_generation refuses ids that are not integers (3.7 was
            # taken as 3)
            ids = prompt.tolist() if hasattr(prompt, "tolist") else list(prompt)
        if not ids:
            raise ValueError("the prompt is empty: give at least one token")
        return ids

    def _run(self, session: SpeculativeSession, prompt_ids: list[int], should_cancel: Callable[[], bool] | None,
             on_decode_start: Callable[[], None] | None, t_call: float) -> GenerationResult:
        stats = session.stats
        cache = self.cache
        cache.on_evict.append(session.drop_draft)
        before = cache.snapshot()
        run = _Run(self._make_policy(), self.registry.version)
        try:  # the setup and the caller's callback too: a failure there left the policy open (an overlapped
            # ranking's background time then counted in the next goal)
            self._setup(run, session, prompt_ids, t_call)
            if on_decode_start is not None and not session.finished:
                on_decode_start()
            while not session.finished:
                if should_cancel is not None and should_cancel():
                    session.cancel()
                    break
                if len(run.iterations) >= self.config.interval:
                    self._scheduling_point(run, session, prompt_ids)
                run.iterations.append(self._step(run, session))
            if run.iterations:
                run.policy.observe(interval_draft(run), run.iterations)
        finally:
            # also when the goal raised: its policy ends, and its rankers' background time goes with it (left to the
            # next goal's take, it was counted as that goal's)
            run.policy.close()
            background = sum((r.take_background_seconds() for r in self._rankers.values()), 0.0)
        stats.background_prediction_seconds = background
        stats.cache = cache.snapshot().since(before)
        return GenerationResult(session.text, session.finish_reason, stats, session.generated_ids)

    def _setup(self, run: _Run, session: SpeculativeSession, prompt_ids: list[int], t_call: float) -> None:
        """Prediction on the prompt, the initial draft load, cache preparation (Algorithm 3, lines 2-5), with the
        target's prefill between the policy's start and its first choice: a ranker that reads the target's hidden
        states (the target-hidden encoder) then finds the prompt's already, instead of running the target over the
        prompt a second time before prefill (0.71 s a generation with the int4 target on an AVX2 CPU). The prefill
        needs no draft, and the first iteration waits for the first choice either way."""
        stats = session.stats
        policy = run.policy
        stats.policy = policy.name
        self._sync_registry("")  # drafts removed while idle leave the cache before this generation
        t_start = time.perf_counter()
        stats.prepare_seconds = t_start - t_call
        if self._should_cancel is not None and self._should_cancel():
            # cancelled (or aborted, or out of its time) while it was being prepared: the cache reset that ended its
            # wait for a slow read at the cancel, a file check, a calibration. The prefill ran on regardless, the
            # target over the whole prompt (seconds for a long one) ahead of the queued goals and a deactivate
            session.cancel()
            return
        if self.predictor is not None and not policy.begins_predictor:
            # the ranking model follows every generation whatever the policy, so one that takes over mid-generation
            # finds it there (a target-hidden encoder's rows of this prompt, its recent positions)
            self.predictor.begin(prompt_ids)
        policy.start(prompt_ids)
        setup = stats.start_seconds = time.perf_counter() - t_start
        session.prefill()
        cancelled = self._should_cancel is not None and self._should_cancel()
        if session.finished or cancelled:  # the prefill's token ended it (max_new_tokens 1, an end token), or the
            # goal was cancelled meanwhile: no draft will run, so none is chosen or waited for (a behaviour tree's
            # one-token answer; a preempted goal ends at the decode loop's first check)
            stats.setup_seconds = setup
            return
        t_choose = time.perf_counter()
        # a change that came during the prefill (a goal's first chunk is the prefill's token) lands before the first
        # choice, as at every point: the registry was read here while the settings of the same change waited
        self._land_changes(run, session, prompt_ids)
        point = self._point(0, session, prompt_ids, active="")
        choice = run.policy.choose(point)  # (the policy a change landing above made)
        stats.predictions += 1
        first = self._carry_out(choice, current="", first=True)  # the first draft: blocking on a cold cache
        run.follow(choice, first)
        stats.setup_seconds = setup + time.perf_counter() - t_choose
        stats.setup_wait_seconds = first.waited
        session.restart_decode_clock()  # setup is not decoding (runtime/stats.py: the paper's metric)

    def _scheduling_point(self, run: _Run, session: SpeculativeSession, prompt_ids: list[int]) -> None:
        """Every N iterations: pending reconfiguration and registry edits land, the policy chooses, the cache acts."""
        stats = session.stats
        run.policy.observe(interval_draft(run), run.iterations)
        run.interval += 1
        run.iterations = []
        self._land_changes(run, session, prompt_ids)
        # the point's own work from here: a reconfiguration or registry edit landing above (a recalibration takes
        # about a second) is no prediction, and stays in the decode time's "other" part
        t0 = time.perf_counter()
        point = self._point(run.interval, session, prompt_ids, run.active)
        choice = run.policy.choose(point)
        stats.predictions += 1
        # the draft that ran is the cache's to keep (the resolution hands it back if it runs on): a blocking load
        # evicts it to make room, and held here while the load was waited for, it was a K + 1st draft in memory
        run.model = None
        resolution = self._carry_out(choice, current=run.active)
        run.follow(choice, resolution)
        run.prediction_seconds = time.perf_counter() - t0 - resolution.waited
        run.wait_seconds = resolution.waited

    def _land_changes(self, run: _Run, session: SpeculativeSession, prompt_ids: list[int]) -> None:
        """A scheduling point's first step (the first choice's too): a reconfiguration waiting for it and the
        registry's edits land, taken under one lock, so a change that replaced the drafts and the settings together
        (replace_registry) lands whole."""
        stats = session.stats
        before = self.config
        with self._lock:
            pending = self._take_pending_locked()
            registry_version = self.registry.version
        if pending is not None:
            session.gamma = self.config.gamma
            # a larger gamma under adaptive gamma needs the target's longer forwards timed: here, at the point (its
            # second in the decode time's "other" part), not inside the next iteration's draft step nor as prediction;
            # as this session adapts: adaptive_gamma itself changes at the next goal
            self.calibrate(adaptive=session.adaptive_gamma)
            if run.active and not self.cache.is_resident(run.active):
                run.active, run.model = "", None  # a smaller K or budget evicted it: pick anew below
            if policy_settings(before) != policy_settings(self.config):  # what the policy object is made with
                renamed = run.policy.name != self.config.policy
                run.policy.close()
                run.policy = self._make_policy()
                run.policy.resume(prompt_ids)
                if renamed:
                    stats.policy = f"{stats.policy}>{run.policy.name}"
        if registry_version != run.registry_version:
            run.registry_version = registry_version
            if self._sync_registry(run.active):
                run.active, run.model = "", None  # the active draft was removed: pick anew

    def _step(self, run: _Run, session: SpeculativeSession) -> IterationStats:
        """One draft-and-verify iteration on the chosen draft (or the target alone), with what led to it. A draft
        that fails while proposing is taken out of service and the iteration runs on the target alone."""
        draft = run.model.model if run.model is not None else None
        try:
            it = session.step(run.active if draft is not None else "", draft)
        except DraftFailure as exc:  # nothing was committed: the target's state is as before the step
            self.cache.fail(exc.draft, exc)  # evicted (its KV cache dropped) and failed, with the reason
            session.drop_draft(exc.draft)
            run.active, run.model, run.fallback = "", None, True
            it = session.step("", None)
            self._fall_back(run)  # the rest of the interval: the Choice's next resident draft, not the target alone
        it.preferred = run.preferred
        it.fallback = run.fallback
        it.prediction_seconds, it.load_wait_seconds = run.prediction_seconds, run.wait_seconds
        run.prediction_seconds = run.wait_seconds = 0.0
        return it

    def _fall_back(self, run: _Run) -> None:
        """After the active draft failed: the first resident draft of the last Choice's order runs until the next
        scheduling point (with N up to 1024, the target decoded alone that long beside a runnable draft)."""
        run.active, run.model = run_first_resident(self.cache, run.order)
        if run.active:
            run.fallback = run.active != run.preferred  # the preferred draft, landed since the point, is no fallback

    def _point(self, interval: int, session: SpeculativeSession, prompt_ids: list[int], active: str) -> SchedulingPoint:
        generated = session.generated_ids
        t = self.config.recent_tokens
        entries = self.registry.entries()
        return SchedulingPoint(
            interval=interval,
            prompt_ids=prompt_ids,
            generated_ids=list(generated),
            recent_ids=list(generated[-t:]) if t else [],
            candidates=[e.name for e in entries],
            domains={e.name: e.domain for e in entries},
            # loading before resident (two lock takes): a load landing between them then shows as resident, where
            # read the other way round it was in neither list, and Oracle-Dynamic took its prefetch for refused
            loading=self.cache.loading(),
            resident=self.cache.resident(),
            active=active,
            failed=list(self.cache.failed()),
            max_new_tokens=session.max_new_tokens,
            wait_for_initial_draft=self.config.wait_for_initial_draft,
            capacity=self.config.capacity,
            draft_context=session.draft_context_lengths(
                {n: loaded.model for n in self.cache.resident() if (loaded := self.cache.peek(n)) is not None}),
        )

    def _sync_registry(self, active: str) -> bool:
        """Drop from the cache the drafts no longer registered, and those whose entry changed (another path under
        the same name: the model in memory is not the registered one); True if the active one went."""
        registered = {e.name: e for e in self.registry.entries()}
        before, self._synced_entries = self._synced_entries, registered
        def changed(name: str) -> bool:
            return name not in registered or (name in before and before[name] != registered[name])

        # every changed name, resident or not: remove() drops a resident or loading model and forgets what the cache
        # knew of the name (its measured size, its score); a snapshot of the resident and loading ones (two lock
        # takes) missed a load landing between them, and an evicted draft kept its old files' measured size
        def stale(name: str) -> bool:  # read from another path than its entry names now: a path changed and changed
            # back within one interval while its load ran (the loader reads the entry when it starts)
            model = self.cache.peek(name)
            return name in registered and model is not None and bool(model.source) and \
                model.source != registered[name].path

        # (and the cache's own names: one loaded while briefly registered between two syncs)
        names = {*before, *registered, *self.cache.resident(), *self.cache.loading()}
        gone = [n for n in names if changed(n) or stale(n)]
        for name in gone:  # a failure recorded for it goes too: other files (or none) may be tried at once
            self.cache.remove(name)
        return active in gone

    def _source_current(self, name: str, source: str) -> bool:
        """Whether ``source`` (the path a load of ``name`` read) is what the registry names now (the cache asks
        as the load lands, on the loader thread)."""
        try:
            return self.registry.get(name).path == source
        except KeyError:  # removed meanwhile: the sync drops it (not this check's to say)
            return True

    def _carry_out(self, choice: Choice, current: str, first: bool = False) -> Resolution:
        return carry_out(choice, self.cache, wait=self._wait, current=current, first=first)

    def _wait(self, name: str) -> float:
        """Block until ``name`` is resident or its load fails: the seconds waited either way. A failure is
        recorded by the cache and decoding goes on without the draft; the time blocked on it is still a load wait
        (setup_wait_seconds, load_wait_seconds), not the scheduling point's prediction or the setup's other work.
        A load this goal already gave up waiting for (max_load_wait_seconds) and still reading is not waited for
        again: mab-sync and general-static ask at every point, and each point waited the whole limit anew."""
        if name in self._stalled and name in self.cache.loading():
            return 0.0
        try:
            _, waited = self.cache.wait_for(name, timeout=self.config.max_load_wait_seconds or None,
                                            stop=self._should_cancel)  # a cancel gives the wait up
        except DraftLoadError as exc:
            if name in self.cache.loading():  # the wait timed out, the load goes on
                self._stalled.add(name)
            log.info("decoding on without draft %r: %s", name, exc)  # a failed load was logged by the cache too
            return exc.waited
        return waited

    def close(self) -> None:
        self._closed = True
        self.prompt_cache.clear()
        self.cache.close()
        for ranker in self._rankers.values():
            ranker.close()


def _check_general_draft(config: RuntimeConfig, names: Sequence[str]) -> None:
    """PolicyError where general-static is set to run a draft the registry lacks (a typo ran another one, silently:
    general-static's own fallback is for a draft that failed or left; a registry of no drafts runs the target alone)."""
    if config.policy == "general-static" and names and config.general_draft not in names:
        raise PolicyError(f"general_draft {config.general_draft!r} is not in the draft registry ({', '.join(names)}):"
                          " policy general-static runs that draft")


def load_runtime(
    config: RuntimeConfig,
    registry_path: str,
    *,
    target_path: str | None = None,
    predictor_path: str | None = None,
    dtype: str = "fp32",
    device: str = "cpu",
    quantization: str = "none",
) -> RuntimeController:
    """Everything from files (runtime/loader.py): target + tokenizer, the registry (validated against the
    target's tokenizer), the predictor (from ``predictor_path`` or one of its encoder subfolders; ValueError when
    a path is given that holds none),
    and the controller (generation ends at the tokenizer's eos token and at the target's generation_config
    eos_token_id ids).

    ``predictor_path`` is a trained head directory (models/predictor/target-hidden or
    models/predictor/minilm). A policy that needs a predictor without one raises PolicyError.
    """
    from .loader import find_predictor, load_models  # imported here: the loader builds on this module

    config.validate()  # before the loads: a capacity of 0 was refused only once every model had loaded
    head = find_predictor(predictor_path)
    if predictor_path and not head:  # dropped silently, then a ranking policy said to set the path it was given
        raise ValueError(f"no trained predictor in {predictor_path} (nor in its target-hidden/ or minilm/"
                         " subfolders): give the folder memspec-train-predictor wrote")
    if config.policy in RANKING_POLICIES and not head:  # said once the target and every draft had loaded
        raise PolicyError(f"policy {config.policy} ranks the drafts with a trained predictor: give predictor_path"
                          " (the zoo's predictor/ folder), or choose a policy that needs none")
    models = load_models(registry_path, target_path=target_path, predictor_path=head,
                         dtype=dtype, device=device, quantization=quantization, gamma=config.gamma)
    try:
        return models.controller(config)
    except BaseException:  # a refused policy: the predictor's hook on the target is released, not left behind
        models.close()
        raise
