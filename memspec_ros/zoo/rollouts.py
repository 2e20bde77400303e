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
greedily, and stores at every position of prompt + continuation the target's
argmax and its top-k tokens with their log-probabilities, from one full
forward.  Drafts train on the KL to that distribution (``topk_kl``): on the
positions where the engine will use them, and still calibrated for sampling.
Held-out text is never touched.
"""

from __future__ import annotations

import json
import shutil
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from tqdm import tqdm

from memspec_ros.runtime.atomic_write import write_text_atomic, written_aside

IGNORE = -100
"""Label of padding positions (cross-entropy's ignore_index)."""


@dataclass
class RolloutConfig:
    sequences_per_source: int = 1024
    min_prompt_tokens: int = 32  # the held-out workloads' prompt lengths
    max_prompt_tokens: int = 96
    new_tokens: int = 128  # what the acceptance matrix and the benchmarks generate
    batch_size: int = 64
    top_k: int = 32  # the target's distribution is kept as its top-k log-probs (soft labels)
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
def target_labels(target, ids: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """At every position but the last: the target's argmax [B, T-1] and its ``top_k`` tokens / log-probs [B, T-1, k]."""
    logp = torch.log_softmax(target(input_ids=ids).logits[:, :-1].float(), -1)
    top = logp.topk(top_k, dim=-1)
    return logp.argmax(-1), top.indices, top.values


def _prompt_windows(name: str, stream_len: int, cfg: RolloutConfig, gen: torch.Generator):
    """(prompt length, window offsets) per batch: only the random draws, so a resumed build replays them."""
    done = 0
    while done < cfg.sequences_per_source:
        b = min(cfg.batch_size, cfg.sequences_per_source - done)
        plen = int(torch.randint(cfg.min_prompt_tokens, cfg.max_prompt_tokens + 1, (1,), generator=gen))
        if stream_len <= plen + 1:
            raise ValueError(f"source {name!r} has {stream_len} tokens, fewer than one prompt of {plen}")
        yield plen, torch.randint(0, stream_len - plen, (b,), generator=gen).tolist()
        done += b


def make_rollouts(
    target,
    streams: dict[str, torch.Tensor],
    cfg: RolloutConfig,
    out: Path,
    log: Callable[[str], None] = print,
) -> dict:
    """Write ``out`` (safetensors: ``{source}.{k}.ids`` / ``.labels`` / ``.top_ids`` / ``.top_logp``) and return
    its summary.

    Each batch shares one prompt length (no padding, so batched forwards
    compute exactly what unpadded ones do); lengths are drawn per batch.
    Every finished source is kept in ``<out>.parts/``, so an interrupted run
    resumes at the first unfinished source and writes the same file.
    """
    if cfg.min_prompt_tokens < 1 or cfg.max_prompt_tokens < cfg.min_prompt_tokens:
        raise ValueError(
            f"prompt tokens must satisfy 1 <= min <= max, got {cfg.min_prompt_tokens}..{cfg.max_prompt_tokens}"
        )
    if cfg.new_tokens < 1 or cfg.sequences_per_source < 1 or cfg.batch_size < 1 or cfg.top_k < 1:
        raise ValueError("new_tokens, sequences_per_source, batch_size and top_k must be positive")
    target.eval()
    gen = torch.Generator().manual_seed(cfg.seed)
    tensors: dict[str, torch.Tensor] = {}
    summary = {"config": asdict(cfg), "sources": {}}
    parts = out.parent / (out.name + ".parts")
    parts.mkdir(parents=True, exist_ok=True)
    t_start = time.time()
    for name, stream in streams.items():
        windows = list(_prompt_windows(name, len(stream), cfg, gen))
        part = parts / f"{name}.safetensors"
        if part.exists():
            done = json.loads(part.with_suffix(".json").read_text(encoding="utf-8"))
            if done["config"] != asdict(cfg):
                raise ValueError(
                    f"{part} was made with {done['config']}, not {asdict(cfg)}: delete {parts} to start over"
                )
            tensors.update(load_file(str(part)))
            summary["sources"][name] = done["summary"]
            log(f"rollouts: {name} cached in {part}")
            continue
        own: dict[str, torch.Tensor] = {}
        agree = total = 0
        bar = tqdm(total=cfg.sequences_per_source, desc=f"rollouts {name}", mininterval=5, dynamic_ncols=True)
        for k, (plen, offs) in enumerate(windows):
            x = torch.stack([stream[o : o + plen] for o in offs]).long()
            ids = greedy_continue(target, x, cfg.new_tokens)
            labels, top_ids, top_logp = target_labels(target, ids, cfg.top_k)
            # the continuation is the argmax of incremental forwards; the labels come
            # from one full forward: they agree but for float ties, which we count
            agree += int((labels[:, plen - 1 :] == ids[:, plen:]).sum())
            total += labels[:, plen - 1 :].numel()
            own[f"{name}.{k}.ids"] = ids.to(torch.int32).cpu()
            own[f"{name}.{k}.labels"] = labels.to(torch.int32).cpu()
            own[f"{name}.{k}.top_ids"] = top_ids.to(torch.int32).cpu()
            own[f"{name}.{k}.top_logp"] = top_logp.half().cpu()
            bar.update(len(offs))
        bar.close()
        summary["sources"][name] = {"sequences": cfg.sequences_per_source, "batches": len(windows),
                                    "label_agreement": agree / max(total, 1)}
        # the .json first, the tensors by a rename last: the part file's existence says the source is done
        # (synced too: a power cut could leave the synced part beside an empty .json, and the resume failed on it)
        write_text_atomic(part.with_suffix(".json"), json.dumps({"config": asdict(cfg),
                                                                 "summary": summary["sources"][name]}))
        with written_aside(part, sync=True) as partial:
            save_file(own, str(partial))
        tensors.update(own)
        log(
            f"rollouts: {name} {cfg.sequences_per_source} sequences, full-forward labels agree"
            f" with the greedy tokens on {agree / max(total, 1):.4%}"
        )
    summary["seconds"] = round(time.time() - t_start, 1)
    # the .json, then the tensors by a rename: the build takes an existing rollouts file for a finished stage, so a
    # cut write must leave none (its parts/ stay and rebuild it), not a truncated file taken as done
    write_text_atomic(out.with_suffix(".json"), json.dumps(summary, indent=1))
    with written_aside(out, sync=True) as partial:
        save_file(tensors, str(partial))
    shutil.rmtree(parts)
    return summary


Row = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]
"""One rollout: ids [T], argmax labels [T-1], top-k ids [T-1, k], top-k log-probs [T-1, k]."""


def _padded(rows: list[Row]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-pad rows to one width; padded labels are ``IGNORE`` (and their soft labels never read)."""
    width, k = max(len(r[0]) for r in rows), rows[0][2].shape[-1]
    x = torch.zeros(len(rows), width, dtype=torch.long)
    y = torch.full((len(rows), width - 1), IGNORE, dtype=torch.long)
    top_ids = torch.zeros(len(rows), width - 1, k, dtype=torch.long)
    top_logp = torch.zeros(len(rows), width - 1, k, dtype=torch.float32)
    for i, (ids, labels, tid, tlp) in enumerate(rows):
        x[i, : len(ids)] = ids
        y[i, : len(labels)] = labels
        top_ids[i, : len(labels)] = tid
        top_logp[i, : len(labels)] = tlp.float()
    return x, y, top_ids, top_logp


def topk_kl(logits: torch.Tensor, labels: torch.Tensor, top_ids: torch.Tensor, top_logp: torch.Tensor) -> torch.Tensor:
    """Mean KL(target || draft) per labelled position, over the target's top-k tokens plus one bucket for the rest.

    Soft labels keep the draft calibrated: trained on the argmax alone the
    zoo's general draft became so confident that, sampling at temperature
    0.7, its expected acceptance sum(min(p, q)) on code / law / general fell
    from 0.86 / 0.86 / 0.88 to 0.24 / 0.46 / 0.25 (``memspec-zoo acceptance``).
    """
    mask = (labels != IGNORE).float()
    logq = torch.log_softmax(logits.float(), -1)
    logq_k = logq.gather(-1, top_ids)
    # a -inf label is a top-k token the draft has no row for (reduced vocabulary): its mass joins "rest"
    known = torch.isfinite(top_logp)
    p_k = torch.where(known, top_logp.exp(), 0.0)
    p_rest = (1 - p_k.sum(-1)).clamp_min(0.0)
    q_rest = (1 - torch.where(known, logq_k.exp(), 0.0).sum(-1)).clamp_min(1e-6)
    kl = (p_k * (torch.where(known, top_logp, 0.0) - logq_k)).sum(-1) + p_rest * (
        p_rest.clamp_min(1e-6).log() - q_rest.log()
    )
    return (kl * mask).sum() / mask.sum().clamp_min(1.0)


class RolloutStreams:
    """Batches of whole rollouts (right-padded, padding labelled ``IGNORE``) by source weight.

    The same ``batch / state / load_state`` interface as ``train.TokenStreams``,
    so ``train.train`` resumes either; a batch is ``(ids, labels, top_ids, top_logp)``.
    """

    def __init__(self, paths: Path | Sequence[Path], weights: dict[str, float], seed: int, split: str = "all",
                 val_every: int = 10):
        """``paths``: one rollouts file or several, whose rollouts of a source are joined in order;
        ``split``: ``train`` / ``val`` (every ``val_every``-th rollout of a source) / ``all``."""
        if split not in ("train", "val", "all"):
            raise ValueError(f"split must be train, val or all, got {split!r}")
        paths = [paths] if isinstance(paths, Path) else list(paths)
        every: dict[str, list[Row]] = {}
        for path in paths:
            tensors = load_file(str(path))
            keys = sorted(
                (k for k in tensors if k.endswith(".ids")), key=lambda k: (k.split(".")[0], int(k.split(".")[1]))
            )
            for key in keys:
                base = key[: -len("ids")]
                if base + "top_logp" not in tensors:
                    raise ValueError(
                        f"{path} has no soft labels ({base}top_logp): it predates them; delete it and rerun"
                        " the rollouts stage"
                    )
                parts = (tensors[key], tensors[base + "labels"], tensors[base + "top_ids"], tensors[base + "top_logp"])
                every.setdefault(key.split(".")[0], []).extend(zip(*parts, strict=True))
        unknown = [n for n in weights if weights[n] > 0 and n not in every]
        if unknown:
            raise ValueError(f"no rollouts for {unknown} in {', '.join(map(str, paths))} (has {sorted(every)})")
        keep = {"all": lambda i: True, "val": lambda i: i % val_every == 0, "train": lambda i: i % val_every != 0}[
            split
        ]
        self.names = [n for n in weights if weights[n] > 0]
        self.seqs = {n: [r for i, r in enumerate(every[n]) if keep(i)] for n in self.names}
        empty = [n for n in self.names if not self.seqs[n]]
        if empty:  # a batch drew from it with torch.randint(0, 0): a RuntimeError naming nothing
            raise ValueError(f"no {split} rollouts for {', '.join(empty)} in {', '.join(map(str, paths))}: every"
                             f" {val_every}th rollout of a source is held out for validation, so each needs at least"
                             " 2 (more rollouts per source)")
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
                x, y, _, _ = _padded(rows[i : i + batch_size])
                pred = model(input_ids=x[:, :-1].to(dev)).logits.argmax(-1).cpu()
                mask = y != IGNORE
                hit, n = hit + int((pred == y)[mask].sum()), n + int(mask.sum())
            per_source.append(hit / max(n, 1))
        model.train(was_training)
        return sum(per_source) / len(per_source)

    def batch(self, batch_size: int, seq_len: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(ids, labels, top-k ids, top-k log-probs); ``seq_len`` caps the length (rollouts are cut from the right)."""
        picks = torch.multinomial(self.probs, batch_size, replacement=True, generator=self.gen).tolist()
        rows = []
        for k in picks:
            pool = self.seqs[self.names[k]]
            ids, labels, tid, tlp = pool[int(torch.randint(0, len(pool), (1,), generator=self.gen))]
            rows.append((ids[:seq_len], labels[: seq_len - 1], tid[: seq_len - 1], tlp[: seq_len - 1]))
        return _padded(rows)

    def state(self) -> torch.Tensor:
        return self.gen.get_state()

    def load_state(self, state: torch.Tensor) -> None:
        self.gen.set_state(state)
