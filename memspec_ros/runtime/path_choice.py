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

from .draft_forward import lean_forward_for, observers_paused
from .forward_paths import PATHS, apply_path, cpu_has_bf16

CONTEXT_TOKENS = 64  # a short chat prompt's worth of cache for the timed forwards to attend to
REPEATS = 5  # timed forwards per size; the median is kept
WARMUP = 2  # untimed forwards first (allocator, kernel packing, caches)


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
def time_forward(model: torch.nn.Module, tokens: int, vocab_size: int) -> float:
    """Median milliseconds of a ``tokens``-token forward after a cached context, as the engine runs it."""
    from .speculative import KVState, forward_once  # the engine's own forward; imported late (it imports us)

    lean = lean_forward_for(model)
    device = next(model.parameters()).device
    ids = [i % vocab_size for i in range(1, CONTEXT_TOKENS + 1)]
    kv = KVState()
    times = []
    with observers_paused(model):  # made-up tokens: not rows for a target-hidden predictor (a goal may be running)
        forward_once(model, ids, kv, 1, device, lean)
        feed = [i % vocab_size for i in range(3, 3 + tokens)]
        for repeat in range(WARMUP + REPEATS):
            start = time.perf_counter()
            forward_once(model, feed, kv, tokens, device, lean)
            if repeat >= WARMUP:
                times.append(time.perf_counter() - start)
            kv.crop_to(CONTEXT_TOKENS)
    return 1000.0 * statistics.median(times)


def choose_path(model: torch.nn.Module, gamma: int, paths: list[str] | None = None) -> PathChoice:
    """Time each candidate path on a converted copy of ``model`` (fp32 weights); the model is left as it is."""
    if gamma < 1:
        raise ValueError(f"gamma must be >= 1, got {gamma}")
    candidates, skipped = candidate_paths()
    if paths is not None:
        candidates = [p for p in candidates if p in paths]
    vocab = int(getattr(model.config, "vocab_size", 0) or 2)
    choice = PathChoice(path="fp32", gamma=gamma, skipped=skipped)
    for path in candidates:
        trial = copy.deepcopy(model)
        try:
            # the embedding's form does not change a forward's time, and checking its grid costs 0.5 s a copy
            apply_path(trial, path, compact_embedding=False)
            choice.timings.append(
                PathTiming(path, time_forward(trial, 1, vocab), time_forward(trial, gamma + 1, vocab))
            )
        except (RuntimeError, ValueError) as exc:  # a kernel this build of torch lacks, a shape it refuses
            choice.skipped[path] = f"{type(exc).__name__}: {exc}"
        finally:
            del trial
    if choice.timings:
        choice.path = min(choice.timings, key=lambda t: t.cost_ms).path
    return choice
