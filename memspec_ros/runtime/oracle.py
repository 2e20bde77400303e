"""Future knowledge for the oracle baselines, exact under greedy decoding.

Greedy output does not depend on the draft, so the target's greedy continuation
is fixed, and a draft's proposals match it exactly as long as they agree with
the teacher-forced argmax of the draft over that continuation. One draft forward
over [prompt ; continuation] therefore tells how many tokens the draft gets
accepted from ANY position: the run of agreements starting there, capped at
gamma. Walking N iterations from a position gives a draft's utility for the next
interval (tokens committed), which Oracle-Static sums over the whole output and
Oracle-Dynamic looks up at each scheduling point.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch


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


def _weights_digest(model_dir: str | Path) -> str:
    """SHA-256 over a model directory's config and safetensors files: which target this is."""
    digest = hashlib.sha256()
    root = Path(model_dir)
    for path in sorted([root / "config.json", *root.glob("*.safetensors")]):
        digest.update(path.name.encode())
        with open(path, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                digest.update(block)
    return digest.hexdigest()[:16]


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
        if self.path is not None and self.path.is_file():
            self.entries = json.loads(self.path.read_text())

    def continuation(self, target: torch.nn.Module, prompt_ids: Sequence[int], max_new_tokens: int,
                     eos_token_ids: Sequence[int] = ()) -> list[int]:
        prompt = hashlib.sha256(",".join(map(str, prompt_ids)).encode()).hexdigest()[:24]
        key = f"{self.target}:{max_new_tokens}:{sorted(eos_token_ids)}:{prompt}"
        if key in self.entries:
            self.hits += 1
        else:
            self.misses += 1
            self.entries[key] = target_greedy(target, prompt_ids, max_new_tokens, eos_token_ids)
        return list(self.entries[key])

    def save(self) -> None:
        if self.path is None or not self.misses:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        # merge what another run saved since this one loaded: two runs sharing the file keep both
        if self.path.is_file():
            self.entries = {**json.loads(self.path.read_text()), **self.entries}
        tmp = self.path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(self.entries))
        os.replace(tmp, self.path)  # atomic: an interrupted run never leaves half a file


@torch.inference_mode()
@torch.no_grad()
def continuation_logits(model: torch.nn.Module, prompt_ids: Sequence[int], continuation: Sequence[int]) -> torch.Tensor:
    """[len(continuation), vocab]: row j is ``model``'s next-token logits after prompt + continuation[:j]."""
    ids = list(prompt_ids) + list(continuation)
    device = next(model.parameters()).device
    logits = model(input_ids=torch.tensor([ids], device=device), use_cache=False).logits[0]
    # logits at position len(prompt)-1+j predict continuation[j]
    return logits[len(prompt_ids) - 1 : len(ids) - 1]


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


@dataclass
class GreedyOracle:
    """Per-prompt future knowledge: the continuation and every draft's agreement with it."""

    continuation: list[int]
    agreement: dict[str, list[bool]]
    gamma: int = 4
    interval: int = 4
    scores: dict[str, float] = field(default_factory=dict)  # whole-output utility, cached

    @classmethod
    def compute(cls, target: torch.nn.Module, drafts: Mapping[str, torch.nn.Module], prompt_ids: Sequence[int],
                max_new_tokens: int, gamma: int = 4, interval: int = 4,
                eos_token_ids: Sequence[int] = ()) -> GreedyOracle:
        continuation = target_greedy(target, prompt_ids, max_new_tokens, eos_token_ids)
        agreement = {name: draft_agreement(model, prompt_ids, continuation) for name, model in drafts.items()}
        return cls(continuation, agreement, gamma, interval)

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

    def best_static(self, candidates: Sequence[str]) -> str:
        return max(candidates, key=lambda d: (self.static_utility(d), -list(candidates).index(d)))

    def ranking_at(self, position: int, candidates: Sequence[str]) -> list[tuple[str, float]]:
        """Drafts by their utility over the next interval (ties: better whole-output draft first)."""
        scored = [(d, self.utility(d, position) + 1e-3 * self.static_utility(d)) for d in candidates]
        return sorted(scored, key=lambda p: -p[1])
