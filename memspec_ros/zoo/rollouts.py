"""On-policy distillation data: the target's own greedy continuations.

Speculative decoding accepts a draft token when it equals the target's argmax
*on the target's own output*.  Drafts distilled only on corpus text learn the
target's distribution on human text, which is not where they are used: greedy
continuations of a small target are repetitive, formulaic and domain-shaped
in ways the corpus is not.  DistillSpec (Zhou et al., 2023) measured that
distilling on the target's generations is what raises acceptance; this module
makes that data.

For every source (a domain's training stream, or the mixed one) it samples
prompt windows from the *training* tokens, lets the target continue each one
greedily, and labels every position of prompt + continuation with the
target's argmax from one full forward.  Training a draft by cross-entropy on
those labels maximises exactly the quantity the engine's greedy acceptance
counts.  Held-out text is never touched.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from tqdm import tqdm

IGNORE = -100
"""Label of padding positions (cross-entropy's ignore_index)."""


@dataclass
class RolloutConfig:
    sequences_per_source: int = 1024
    min_prompt_tokens: int = 32  # the held-out workloads' prompt lengths
    max_prompt_tokens: int = 96
    new_tokens: int = 128  # what the acceptance matrix and the benchmarks generate
    batch_size: int = 64
    seed: int = 0


@torch.no_grad()
def greedy_continue(target, x: torch.Tensor, new_tokens: int) -> torch.Tensor:
    """``x`` [B, L] continued by ``new_tokens`` greedy tokens (no stop at EOS: fixed-size batches)."""
    out = target(input_ids=x, use_cache=True)
    past, nxt = out.past_key_values, out.logits[:, -1].argmax(-1, keepdim=True)
    pieces = [x, nxt]
    for _ in range(new_tokens - 1):
        out = target(input_ids=nxt, past_key_values=past, use_cache=True)
        past, nxt = out.past_key_values, out.logits[:, -1].argmax(-1, keepdim=True)
        pieces.append(nxt)
    return torch.cat(pieces, 1)


@torch.no_grad()
def target_labels(target, ids: torch.Tensor) -> torch.Tensor:
    """The target's argmax next token at every position but the last: [B, T-1]."""
    return target(input_ids=ids).logits[:, :-1].argmax(-1)


def make_rollouts(
    target,
    streams: dict[str, torch.Tensor],
    cfg: RolloutConfig,
    out: Path,
    log: Callable[[str], None] = print,
) -> dict:
    """Write ``out`` (safetensors: ``{source}.{k}.ids`` / ``.labels``, int32) and return its summary.

    Each batch shares one prompt length (no padding, so batched forwards
    compute exactly what unpadded ones do); lengths are drawn per batch.
    """
    if cfg.min_prompt_tokens < 1 or cfg.max_prompt_tokens < cfg.min_prompt_tokens:
        raise ValueError(f"prompt tokens must satisfy 1 <= min <= max, got {cfg.min_prompt_tokens}..{cfg.max_prompt_tokens}")
    if cfg.new_tokens < 1 or cfg.sequences_per_source < 1 or cfg.batch_size < 1:
        raise ValueError("new_tokens, sequences_per_source and batch_size must be positive")
    target.eval()
    gen = torch.Generator().manual_seed(cfg.seed)
    tensors: dict[str, torch.Tensor] = {}
    summary = {"config": asdict(cfg), "sources": {}}
    t_start = time.time()
    for name, stream in streams.items():
        done, k, agree, total = 0, 0, 0, 0
        bar = tqdm(total=cfg.sequences_per_source, desc=f"rollouts {name}", mininterval=5, dynamic_ncols=True)
        while done < cfg.sequences_per_source:
            b = min(cfg.batch_size, cfg.sequences_per_source - done)
            plen = int(torch.randint(cfg.min_prompt_tokens, cfg.max_prompt_tokens + 1, (1,), generator=gen))
            if len(stream) <= plen + 1:
                raise ValueError(f"source {name!r} has {len(stream)} tokens, fewer than one prompt of {plen}")
            offs = torch.randint(0, len(stream) - plen, (b,), generator=gen).tolist()
            x = torch.stack([stream[o : o + plen] for o in offs]).long()
            ids = greedy_continue(target, x, cfg.new_tokens)
            labels = target_labels(target, ids)
            # the continuation is the argmax of incremental forwards; the labels come
            # from one full forward: they agree but for float ties, which we count
            agree += int((labels[:, plen - 1 :] == ids[:, plen:]).sum())
            total += labels[:, plen - 1 :].numel()
            tensors[f"{name}.{k}.ids"] = ids.to(torch.int32).cpu()
            tensors[f"{name}.{k}.labels"] = labels.to(torch.int32).cpu()
            done, k = done + b, k + 1
            bar.update(b)
        bar.close()
        summary["sources"][name] = {"sequences": done, "batches": k, "label_agreement": agree / max(total, 1)}
        log(f"rollouts: {name} {done} sequences, full-forward labels agree with the greedy tokens on {agree / max(total, 1):.4%}")
    summary["seconds"] = round(time.time() - t_start, 1)
    out.parent.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out))
    out.with_suffix(".json").write_text(json.dumps(summary, indent=1))
    return summary


def _padded(rows: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-pad (ids, labels) rows to one width; padded labels are ``IGNORE``."""
    width = max(len(r[0]) for r in rows)
    x = torch.zeros(len(rows), width, dtype=torch.long)
    y = torch.full((len(rows), width - 1), IGNORE, dtype=torch.long)
    for i, (ids, labels) in enumerate(rows):
        x[i, : len(ids)] = ids
        y[i, : len(labels)] = labels
    return x, y


class RolloutStreams:
    """Batches of whole rollouts (right-padded, padding labelled ``IGNORE``) by source weight.

    The same ``batch / state / load_state`` interface as ``train.TokenStreams``,
    so ``train.train`` resumes either; a batch is ``(ids, labels)``.
    """

    def __init__(self, path: Path, weights: dict[str, float], seed: int, split: str = "all", val_every: int = 10):
        """``split``: ``train`` / ``val`` (every ``val_every``-th rollout of a source) / ``all``."""
        if split not in ("train", "val", "all"):
            raise ValueError(f"split must be train, val or all, got {split!r}")
        tensors = load_file(str(path))
        keys = sorted((k for k in tensors if k.endswith(".ids")), key=lambda k: (k.split(".")[0], int(k.split(".")[1])))
        every: dict[str, list[tuple[torch.Tensor, torch.Tensor]]] = {}
        for key in keys:
            ids, labels = tensors[key], tensors[key[: -len("ids")] + "labels"]
            every.setdefault(key.split(".")[0], []).extend(zip(ids, labels, strict=True))
        unknown = [n for n in weights if weights[n] > 0 and n not in every]
        if unknown:
            raise ValueError(f"no rollouts for {unknown} in {path} (has {sorted(every)})")
        keep = {"all": lambda i: True, "val": lambda i: i % val_every == 0, "train": lambda i: i % val_every != 0}[split]
        self.names = [n for n in weights if weights[n] > 0]
        self.seqs = {n: [r for i, r in enumerate(every[n]) if keep(i)] for n in self.names}
        w = torch.tensor([weights[n] for n in self.names], dtype=torch.float64)
        self.probs = w / w.sum()
        self.gen = torch.Generator().manual_seed(seed)

    @torch.no_grad()
    def agreement(self, model, batch_size: int = 32) -> float:
        """Fraction of labelled positions where ``model``'s argmax is the target's (each source weighted alike)."""
        was_training = model.training
        model.eval()
        dev = next(model.parameters()).device
        per_source = []
        for name in self.names:
            rows, hit, n = self.seqs[name], 0, 0
            for i in range(0, len(rows), batch_size):
                x, y = _padded(rows[i : i + batch_size])
                pred = model(input_ids=x[:, :-1].to(dev)).logits.argmax(-1).cpu()
                mask = y != IGNORE
                hit, n = hit + int((pred == y)[mask].sum()), n + int(mask.sum())
            per_source.append(hit / max(n, 1))
        model.train(was_training)
        return sum(per_source) / len(per_source)

    def batch(self, batch_size: int, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``seq_len`` caps the length (rollouts are cut from the right)."""
        picks = torch.multinomial(self.probs, batch_size, replacement=True, generator=self.gen).tolist()
        rows = []
        for k in picks:
            pool = self.seqs[self.names[k]]
            ids, labels = pool[int(torch.randint(0, len(pool), (1,), generator=self.gen))]
            rows.append((ids[:seq_len], labels[: seq_len - 1]))
        return _padded(rows)

    def state(self) -> torch.Tensor:
        return self.gen.get_state()

    def load_state(self, state: torch.Tensor) -> None:
        self.gen.set_state(state)
