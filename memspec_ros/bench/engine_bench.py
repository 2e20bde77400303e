"""Engine benchmark: target-only decoding vs transformers' assisted generation vs this engine.

All four methods (transformers' generate, this engine's target alone, transformers' assisted generation, this
engine) run in one process, interleaved prompt by prompt (the order rotates
each round) on the same target/draft pair, greedy, so machine noise hits them
alike. Each method's throughput is generated tokens over the wall time of its
calls (prefill included for all four, since transformers cannot report it
apart); the engine's steady-state throughput (prefill excluded: the paper's metric) is
compared with its own target alone's on the same metric (``decode_ratio_vs_target_alone``,
the figure llama.cpp's bench reports as ``speculative_vs_target_alone``) and
with the analytic bound (E[A] + 1) / (gamma * t_draft + t_verify) built from
per-forward times measured in the same run: after each prompt, the median of a
few isolated forwards (one draft token; gamma + 1 target tokens; one target
token) on a KV cache of the context that prompt reached half-way through its
generation. The bound is taken prompt by prompt and pooled as the decode rate
is: each prompt's iterations and proposals at that prompt's forward times (an
iteration that proposed fewer than gamma at a one-token forward's, and a
switch's catch-up at no cost, so the bound errs high), the run's tokens over the
sum. A pooled formula (mean E[A], median times) weighs a long answer, with
more iterations at a longer context, like a short one.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field

import torch
from transformers import PreTrainedModel

from ..runtime.chat import end_token_ids
from ..runtime.datastore import Datastore
from ..runtime.draft_forward import lean_forward_for, unsupported_reason
from ..runtime.draft_vocab import ReducedVocabDraft, as_transformers_assistant
from ..runtime.lookup import LOOKUP_DRAFT, LookupConfig
from ..runtime.speculative import KVState, forward_once, generate
from ..runtime.stats import GenerationTotals, decode_tokens_per_second, paired_ratio


@dataclass
class EngineBenchConfig:
    gamma: int = 4
    max_new_tokens: int = 128
    runs: int = 3
    prompts: int = 12
    threads: int = 1
    draft: str = "general"
    lean_drafts: bool = True  # the engine's lean draft forward (runtime/draft_forward.py) where it applies
    adaptive_gamma: bool = False  # gamma per iteration from measured costs (runtime/gamma_choice.py)
    context_lookup: bool = False  # proposals copied from the context beside the draft (runtime/lookup.py)
    datastore: Datastore | None = None  # with context_lookup: past answers searched too (runtime/datastore.py)
    stop_at_end: bool = True  # every method stops at the target's end tokens (an instruct model's end of turn)


@dataclass
class EngineBenchResult:
    target: str
    draft: str
    gamma: int
    max_new_tokens: int
    prompts: int
    runs: int
    draft_forward: str  # "lean" or "transformers (<why>)": how the engine ran the draft
    autoregressive_tps: float  # transformers' generate, target alone
    target_alone_tps: float  # this engine without a draft (its own forward)
    hf_assisted_tps: float | None  # None: transformers cannot run this draft
    engine_tps: float
    engine_decode_tps: float
    target_alone_decode_tps: float  # its target alone's, prefill excluded too (the paper's metric)
    # the engine's rate over each baseline's, the median over runs of each run's own ratio (paired_ratio)
    ratio_vs_hf: float | None
    ratio_vs_autoregressive: float | None  # None: no run had a rate (stats.ratio)
    ratio_vs_target_alone: float | None  # whole calls, prefill included, as the other ratios
    decode_ratio_vs_target_alone: float | None  # prefill excluded on both sides (the paper's metric)
    mean_accepted: float
    # the engine's tokens equal its own target alone's (greedy, lossless): this engine's claim
    outputs_identical: bool
    # share of prompts and runs where transformers' generate over the same layers gave those tokens too (1.0 unless
    # the engine's own forward, e.g. the C decoder, rounds a near-tie the other way)
    same_as_transformers: float
    # share where transformers' assisted generation gave its own generate's tokens (None: not run). Its verify
    # runs several rows through transformers' attention, whose rounding may differ from a one-row step's, so
    # on a quantized target a near-tie can go the other way: transformers' property, not this engine's
    hf_assisted_same_as_generate: float | None
    t_draft_ms: float
    t_verify_ms: float
    bound_tps: float | None  # None with context lookup: copied proposals cost no draft forward, so no such bound
    bound_fraction: float | None
    # Where the engine's decode time went against the bound's isolated forwards (t_draft_ms, t_verify_ms, each
    # repeated on its own, so warm in the caches): per draft token and per verify inside the loop, where each
    # forward follows the other model's, and what each iteration spent outside both
    # per draft forward that proposed or was dropped (adaptive gamma's confidence stop); a catch-up forward left out
    loop_draft_ms: float | None = None
    loop_verify_ms: float | None = None  # per verify of gamma + 1 rows, as t_verify_ms
    # per iteration: accepting, committing, streaming text, scheduling, and a context lookup's search
    loop_other_ms: float | None = None
    per_run: dict[str, list[float]] = field(default_factory=dict)
    # each method's generated tokens over one run's prompts (greedy: the same every run). Each rate is its own tokens
    # over its own time, so a method that stopped at an end token earlier (transformers' generate on a near-tie
    # rounded the other way) is compared at another token count: this says by how much
    generated_tokens: dict[str, int] = field(default_factory=dict)


@dataclass
class _LoopTimes:
    """The engine's own iteration records (runtime/stats.py), summed over its generations."""

    gamma: int
    draft_s: float = 0.0
    draft_tokens: int = 0
    verify_s: float = 0.0  # of the verifies of gamma + 1 rows: what t_verify_ms times alone
    full_verifies: int = 0
    iterations: int = 0
    other_s: float = 0.0

    def add(self, stats) -> None:
        parts = stats.time_breakdown()  # "other" as the policy bench splits decode time
        self.other_s += parts["other"]
        self.iterations += len(stats.iterations)
        # like for like with the isolated verify: a target-only step or a short (adaptive) verify is cheaper
        full = [it for it in stats.iterations if it.proposed >= self.gamma]
        self.verify_s += sum(it.verify_seconds for it in full)
        self.full_verifies += len(full)
        drafted = [it for it in stats.iterations if it.draft != LOOKUP_DRAFT]  # copies cost a lookup, no forward
        self.draft_s += sum(it.draft_seconds for it in drafted)
        self.draft_tokens += sum(it.timed_draft_forwards for it in drafted)

    @property
    def draft_ms(self) -> float | None:
        return 1000 * self.draft_s / self.draft_tokens if self.draft_tokens else None

    @property
    def verify_ms(self) -> float | None:
        return 1000 * self.verify_s / self.full_verifies if self.full_verifies else None

    @property
    def other_ms(self) -> float | None:
        return 1000 * self.other_s / self.iterations if self.iterations else None


def bound_fraction(decode_tps: list[float], bound_tps: list[float]) -> float | None:
    """The median over runs of each run's decode rate against that run's own bound (its forwards timed in that
    run)."""
    return paired_ratio(decode_tps, bound_tps)


def _bound_seconds(stats, gamma: int, draft_ms: float, verify_ms: float, one_ms: float) -> float:
    """A generation's decode time had each forward cost its isolated time and nothing else cost any: every
    proposal one draft forward, every iteration one verify, a catch-up one draft forward. That includes each
    generation's first proposal, whose draft forward runs over the whole prompt (the draft's prefill, inside the
    decode time): the bound errs high by it, so bound_fraction errs low by its share. An iteration that proposed
    fewer than gamma (near the end, or a plain step) is costed as a one-token forward: its cost errs low, so the
    bound errs high."""
    full = sum(1 for it in stats.iterations if it.proposed >= gamma)
    proposals = sum(it.draft_forwards for it in stats.iterations)
    return (full * verify_ms + (len(stats.iterations) - full) * one_ms + proposals * draft_ms) / 1000


def _forward_ms(model, context: list[int], feed: int, device, lean=None, repeats: int = 5) -> float:
    """Median time of one forward of ``feed`` tokens after a cached ``context``, as the engine runs it."""
    times = []
    with torch.inference_mode():
        kv = KVState()
        forward_once(model, context, kv, 1, device, lean)
        for _ in range(repeats):
            kv.crop_to(len(context) - feed)
            start = time.perf_counter()
            forward_once(model, context[-feed:], kv, feed, device, lean)
            times.append(time.perf_counter() - start)
    return statistics.median(times) * 1000


def _hf_generate(target, draft, ids: list[int], new: int, gamma: int, eos: list[int]) -> list[int]:
    inputs = torch.tensor([ids], device=next(target.parameters()).device)
    kwargs = dict(do_sample=False, max_new_tokens=new, eos_token_id=eos or None, pad_token_id=0)
    if draft is not None:
        kwargs["assistant_model"] = draft
    with torch.inference_mode():
        out = target.generate(inputs, **kwargs)
    return out[0, len(ids) :].tolist()


def configure_assistant(draft, gamma: int) -> None:
    """A constant schedule of ``gamma`` tokens, no confidence cut-off: the same work as the engine."""
    config = draft.generation_config
    config.num_assistant_tokens = gamma
    config.num_assistant_tokens_schedule = "constant"
    config.assistant_confidence_threshold = 0.0


def run_engine_bench(target, draft, prompts: list[list[int]], cfg: EngineBenchConfig, names=("target", "draft"),
                     progress=None, tokenizer=None) -> EngineBenchResult:
    """Every method on every prompt, interleaved. ``tokenizer``: the target's, whose eos and chat template's end of
    turn end a generation as in the node (runtime/chat.end_token_ids; without it the model's generation config's)."""
    torch.set_num_threads(cfg.threads)
    device = next(target.parameters()).device
    # transformers' assisted generation needs a draft with the target's vocabulary width: a
    # reduced-vocabulary draft runs there as the same layers in a target-width shell
    assistant = as_transformers_assistant(draft) if isinstance(draft, ReducedVocabDraft) else draft
    hf_can = isinstance(assistant, PreTrainedModel)
    if hf_can:
        configure_assistant(assistant, cfg.gamma)
    lean = lean_forward_for(draft) if cfg.lean_drafts else None
    why_not = "switched off" if not cfg.lean_drafts else unsupported_reason(draft)
    draft_forward = "lean" if lean is not None else f"transformers ({why_not})"
    # target_alone: this engine's own one-token decoding (its lean forward), the speed to beat
    methods = ("autoregressive", "target_alone", "hf_assisted", "engine") if hf_can else (
        "autoregressive", "target_alone", "engine")
    per_run: dict[str, list[float]] = {m: [] for m in methods}
    decode_tps: list[float] = []
    alone_decode_tps: list[float] = []  # per run, the target alone's, pooled as the engine's
    bound_tps: list[float] = []  # per run: its decode tokens at the bound's forward times (_bound_seconds)
    accepted = GenerationTotals()  # E[A] pooled over every iteration (stats.py), not a mean of per-prompt means
    draft_ms: list[float] = []
    verify_ms: list[float] = []
    identical = True
    loop = _LoopTimes(cfg.gamma)
    same_as_transformers = 0  # prompts where transformers' generate gave the engine's target-alone tokens
    hf_same = 0  # prompts where transformers' assisted generation gave its generate's tokens
    # warm-up: first calls pay for allocation and lazy initialisation
    eos = end_token_ids(tokenizer, target) if cfg.stop_at_end else []
    lookup = LookupConfig() if cfg.context_lookup else None
    stores = (cfg.datastore,) if cfg.context_lookup and cfg.datastore is not None else ()
    # adaptive: its one-off forward timings happen here
    generate(target, prompts[0], draft, gamma=cfg.gamma, max_new_tokens=8, lean_drafts=cfg.lean_drafts,
             adaptive_gamma=cfg.adaptive_gamma, lookup=lookup, datastores=stores)
    if hf_can:
        _hf_generate(target, assistant, prompts[0], 8, cfg.gamma, eos)
    # every method once: the target alone (the 1.6x goal's denominator) and transformers' generate paid their first
    # call's allocations inside the timed loop, a third to a half of the median's data at --runs 1-2
    generate(target, prompts[0], None, max_new_tokens=8, eos_token_ids=eos)
    _hf_generate(target, None, prompts[0], 8, cfg.gamma, eos)
    for run in range(cfg.runs):
        seconds = dict.fromkeys(methods, 0.0)
        tokens = dict.fromkeys(methods, 0)
        run_decode_s, run_decode_tokens, run_bound_s = 0.0, 0, 0.0
        alone = GenerationTotals()  # the target alone's decode, summed over the run's prompts as the engine's
        for i, ids in enumerate(prompts):
            outputs = {}
            shift = (i + run) % len(methods)
            order = methods[shift:] + methods[:shift]
            for method in order:
                start = time.perf_counter()
                if method == "autoregressive":
                    out = _hf_generate(target, None, ids, cfg.max_new_tokens, cfg.gamma, eos)
                elif method == "target_alone":
                    plain = generate(target, ids, None, max_new_tokens=cfg.max_new_tokens, eos_token_ids=eos)
                    alone.add(plain.stats)
                    out = plain.generated_ids
                elif method == "hf_assisted":
                    out = _hf_generate(target, assistant, ids, cfg.max_new_tokens, cfg.gamma, eos)
                else:
                    session = generate(target, ids, draft, draft_name=names[1], gamma=cfg.gamma,
                                       max_new_tokens=cfg.max_new_tokens, lean_drafts=cfg.lean_drafts,
                                       adaptive_gamma=cfg.adaptive_gamma, lookup=lookup, datastores=stores,
                                       eos_token_ids=eos)
                    out = session.generated_ids
                seconds[method] += time.perf_counter() - start  # the bench's bookkeeping below is no method's
                if method == "engine":
                    if session.draft_failure:  # its figures would be the target alone's, labelled the engine's
                        raise RuntimeError(f"the draft failed during the bench: {session.draft_failure}")
                    run_decode_s += session.stats.decode_seconds
                    run_decode_tokens += session.stats.decode_tokens
                    accepted.add(session.stats)
                    loop.add(session.stats)
                tokens[method] += len(out)
                outputs[method] = out
            # lossless means equal to this engine's own one-token greedy decoding of the target; transformers'
            # generate runs the same layers through another forward, whose float rounding (the C decoder's
            # RMSNorm, RoPE and attention, runtime/cpu_kernels.c) may break a near-tie the other way
            identical &= outputs["engine"] == outputs["target_alone"]
            hf_same += outputs.get("hf_assisted") == outputs["autoregressive"]
            same_as_transformers += outputs["target_alone"] == outputs["autoregressive"]
            # per-forward times for the bound, measured between the generations at a context this
            # prompt really reached (its prompt plus half its output), so load drifts hit them too
            context = ids + outputs["engine"][: len(outputs["engine"]) // 2]
            draft_ms.append(_forward_ms(draft, context, 1, device, lean))
            verify_ms.append(_forward_ms(target, context, cfg.gamma + 1, device, lean_forward_for(target)))
            run_bound_s += _bound_seconds(session.stats, cfg.gamma, draft_ms[-1], verify_ms[-1],
                                          _forward_ms(target, context, 1, device, lean_forward_for(target)))
            if progress is not None:
                progress.update(1)
        for method in methods:
            per_run[method].append(tokens[method] / seconds[method])
        generated = tokens
        decode_tps.append(decode_tokens_per_second(run_decode_tokens, run_decode_s))
        alone_decode_tps.append(alone.tokens_per_second)
        bound_tps.append(decode_tokens_per_second(run_decode_tokens, run_bound_s))
    mean_accepted = accepted.mean_accepted
    t_draft, t_verify = statistics.median(draft_ms), statistics.median(verify_ms)
    bound = None if cfg.context_lookup else statistics.median(bound_tps)
    med = {m: statistics.median(v) for m, v in per_run.items()}
    engine_decode = statistics.median(decode_tps)
    return EngineBenchResult(
        target=names[0], draft=names[1], gamma=cfg.gamma, max_new_tokens=cfg.max_new_tokens,
        prompts=len(prompts), runs=cfg.runs, draft_forward=draft_forward,
        autoregressive_tps=med["autoregressive"], target_alone_tps=med["target_alone"],
        hf_assisted_tps=med.get("hf_assisted"), engine_tps=med["engine"],
        engine_decode_tps=engine_decode, target_alone_decode_tps=statistics.median(alone_decode_tps),
        ratio_vs_hf=paired_ratio(per_run["engine"], per_run["hf_assisted"]) if hf_can else None,
        ratio_vs_autoregressive=paired_ratio(per_run["engine"], per_run["autoregressive"]),
        ratio_vs_target_alone=paired_ratio(per_run["engine"], per_run["target_alone"]),
        decode_ratio_vs_target_alone=paired_ratio(decode_tps, alone_decode_tps),
        mean_accepted=mean_accepted, outputs_identical=identical,
        same_as_transformers=same_as_transformers / (len(prompts) * cfg.runs),
        hf_assisted_same_as_generate=hf_same / (len(prompts) * cfg.runs) if hf_can else None,
        t_draft_ms=t_draft, t_verify_ms=t_verify, bound_tps=bound,
        bound_fraction=bound_fraction(decode_tps, bound_tps) if bound else None,
        loop_draft_ms=loop.draft_ms, loop_verify_ms=loop.verify_ms, loop_other_ms=loop.other_ms,
        per_run=per_run, generated_tokens=dict(generated),
    )
