"""``auto``: which forward path is fastest for this model on this machine, measured at load time.

Which path wins depends on the CPU (bf16 matmul units, VNNI, memory bandwidth) and
on the model's shapes, and the ranking for a one-token decode step can differ
from a γ+1-token verify (a 5-row verify of the bundled target costs 1.35-1.5 one-token
steps on int4 with the engine's AVX512-VNNI/AMX kernels, 1.7-2 on its AVX2 ones, ATen's
bf16 almost nothing extra). So ``auto`` times both on a copy of the model, converted to each
candidate path, and keeps the path with the least ``t(1) + t(γ+1)``: one plain
decode step plus one verify, the two forwards a speculative generation is made of.
"""

from __future__ import annotations

import copy
import statistics
import time
from dataclasses import dataclass, field

import torch

from .draft_forward import lean_forward_for, observers_paused, unsupported_reason
from .forward_paths import PATHS, apply_path, cpu_has_bf16
from .row_exact import prepare_for_engine

CONTEXT_TOKENS = 64  # a short chat prompt's worth of cache for the timed forwards to attend to
REPEATS = 5  # timed forwards per size (time_forward keeps their median, choose_path the fastest)
WARMUP = 2  # untimed forwards first (allocator, kernel packing, caches)
CURVE_ROUNDS = 7  # interleaved rounds of a cost curve (every size once a round); the fastest per size is kept


@dataclass
class PathTiming:
    path: str
    one_token_ms: float
    verify_ms: float  # gamma + 1 tokens

    @property
    def cost_ms(self) -> float:
        return self.one_token_ms + self.verify_ms


@dataclass
class PathChoice:
    """The measured candidates and the one kept."""

    path: str
    gamma: int
    timings: list[PathTiming] = field(default_factory=list)
    skipped: dict[str, str] = field(default_factory=dict)  # path -> why it was not measured

    def as_dict(self) -> dict:
        return {
            "chosen": self.path,
            "gamma": self.gamma,
            "rule": "least one_token_ms + verify_ms",
            "timings": [{"path": t.path, "one_token_ms": round(t.one_token_ms, 3), "verify_ms": round(t.verify_ms, 3)}
                        for t in self.timings],
            "skipped": dict(self.skipped),
        }


def candidate_paths() -> tuple[list[str], dict[str, str]]:
    """The paths this CPU can run, and why the others are left out."""
    skipped = {} if cpu_has_bf16() else {"bf16": "no bf16 matmul on this CPU (avx512_bf16/AMX)"}
    return [p for p in PATHS if p not in skipped], skipped


@torch.inference_mode()
def timed_forwards(model: torch.nn.Module, sizes: list[int], vocab_size: int, rounds: int,
                   context: int = CONTEXT_TOKENS, keep: int | None = None, lean: bool = True) -> list[list[float]]:
    """Seconds of each ``sizes`` forward, as the engine runs it: ``rounds`` timed rounds (after ``WARMUP`` untimed
    ones), each round one forward of every size in turn. After a cached ``context`` of that many tokens (a decode
    step or a verify), or over a fresh KV cache with ``context`` 0 (a switched-in draft's catch-up); logits of the
    last ``keep`` positions (default: every fed one, as a verify keeps). ``lean`` False: transformers' forward, as
    a session with ``lean_drafts=False`` runs its drafts."""
    from .speculative import KVState, forward_once  # the engine's own forward; imported late (it imports us)

    lean = lean_forward_for(model) if lean else None
    device = next(model.parameters()).device
    kv = KVState()
    samples: list[list[float]] = [[] for _ in sizes]
    with observers_paused(model):  # made-up tokens: not rows for a target-hidden predictor (a goal may be running)
        if context:
            forward_once(model, [i % vocab_size for i in range(1, context + 1)], kv, 1, device, lean)
        for repeat in range(WARMUP + rounds):
            for times, tokens in zip(samples, sizes, strict=True):
                feed = [i % vocab_size for i in range(3, 3 + tokens)]
                cache = kv if context else KVState()
                start = time.perf_counter()
                forward_once(model, feed, cache, tokens if keep is None else keep, device, lean)
                if repeat >= WARMUP:
                    times.append(time.perf_counter() - start)
                if context:
                    kv.crop_to(context)
    return samples


def time_forward(model: torch.nn.Module, tokens: int, vocab_size: int, lean: bool = True) -> float:
    """Median milliseconds of a ``tokens``-token forward after a cached context, as the engine runs it."""
    return 1000.0 * statistics.median(timed_forwards(model, [tokens], vocab_size, REPEATS, lean=lean)[0])


def non_decreasing(values: list[float]) -> list[float]:
    """The closest non-decreasing sequence in least squares (pool adjacent violators): each run of values that
    goes down is replaced by its mean. A forward of k + 1 rows does all a k-row one does and a row more, so a
    measured curve that goes down is noise, and a decision taken from its differences would act on the noise."""
    blocks: list[list[float]] = []  # [sum, count] of each pooled run
    for v in values:
        blocks.append([v, 1])
        while len(blocks) > 1 and blocks[-2][0] / blocks[-2][1] > blocks[-1][0] / blocks[-1][1]:
            total, count = blocks.pop()
            blocks[-1][0] += total
            blocks[-1][1] += count
    return [total / count for total, count in blocks for _ in range(count)]


def forward_cost_curve(model: torch.nn.Module, tokens: int, vocab_size: int, rounds: int = CURVE_ROUNDS) -> list[float]:
    """Milliseconds of a 1..``tokens``-token forward after a cached context: the fastest of interleaved rounds per
    size, made non-decreasing.

    What adaptive gamma weighs a verify row by is the difference between neighbouring sizes (under 1 ms against a
    7 ms one-token int4 forward of the bundled target), so the curve's shape must survive other load on the
    machine. Timed one size after another (medians), a burst of load landed on one size: 12.3, 10.0, 16.5, 10.5,
    10.1 ms for 1..5 tokens in a one-off trace on the bundled zoo while a training job ran, and the math draft
    then stopped after one proposal in 64 of 129 iterations (1.95 accepted tokens an iteration against 2.66 at a
    fixed gamma of 4). Interleaved, the medians still wandered under that load (sizes 3-6 swapped places between
    three runs) while the fastest round per size gave the same curve each time (6.2-6.4, 6.7-7.0, 7.9-8.2,
    8.8-9.0, 9.2-9.4 ms): load only ever adds time, so the minimum is the forward's own cost."""
    fastest = [1000.0 * min(times) for times in timed_forwards(model, list(range(1, tokens + 1)), vocab_size, rounds)]
    return non_decreasing(fastest)


def shallow_trial(model: torch.nn.Module) -> torch.nn.Module:
    """A copy of ``model``'s modules and config that shares its parameters and buffers. A path's conversion
    replaces the copy's linears by new modules (apply_path never writes into a weight), so the model is left as it
    is, and only the converted weights are new memory: a deep copy per candidate held a second fp32 model
    (540 MB for the bundled target, 4 GB for a 1 B one on an edge device). The f32 kernel's fusion points the
    shared q/k/v parameters at rows of one new tensor, with the same values: choose_path points them back."""
    shared = {id(t): t for t in (*model.parameters(), *model.buffers())}
    return copy.deepcopy(model, shared)


def choose_path(model: torch.nn.Module, gamma: int, paths: list[str] | None = None) -> PathChoice:
    """Time each candidate path on a converted copy of ``model`` (fp32 weights); the model is left as it is."""
    if gamma < 1:
        raise ValueError(f"gamma must be >= 1, got {gamma}")
    candidates, skipped = candidate_paths()
    if paths is not None:
        unknown = [p for p in paths if p not in PATHS]
        if unknown or not paths:  # dropped silently, they left "fp32" chosen with no timing at all
            raise ValueError(f"choose_path: paths {unknown or paths!r}: name one or more of {', '.join(PATHS)}")
        candidates = [p for p in candidates if p in paths]
    vocab = int(getattr(model.config, "vocab_size", 0) or 2)
    choice = PathChoice(path="fp32", gamma=gamma, skipped=skipped)
    own = [(p, p.data) for p in model.parameters()]  # the storage each parameter has now (see shallow_trial)
    for path in candidates:
        trial = shallow_trial(model)
        try:
            # the embedding's form does not change a forward's time, and checking its grid costs 0.5 s a copy
            apply_path(trial, path, compact_embedding=False)
            if unsupported_reason(trial):  # timed as it will run: off the lean forward, a verify's rows go one by
                prepare_for_engine(trial)  # one (load_model does the same to the model itself), not batched
            # the fastest round per size (load only ever adds time): a burst of other load on one path's medians
            # chose the other path
            one, verify = (1000.0 * min(t) for t in timed_forwards(trial, [1, gamma + 1], vocab, REPEATS))
            choice.timings.append(PathTiming(path, one, verify))
        except (RuntimeError, ValueError) as exc:  # a kernel this build of torch lacks, a shape it refuses
            choice.skipped[path] = f"{type(exc).__name__}: {exc}"
        finally:
            del trial
            with torch.no_grad():
                for parameter, data in own:  # a fused trial's rows would keep its whole tensor alive
                    if parameter.data_ptr() != data.data_ptr():
                        parameter.data = data
    if choice.timings:
        choice.path = min(choice.timings, key=lambda t: t.cost_ms).path
    return choice
