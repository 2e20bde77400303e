"""The acceptance matrix: mean accepted tokens per iteration, every draft x every workload.

Greedy decoding outputs the target's own greedy continuation whatever the
draft, so the engine's acceptance is computed exactly without running it once
per draft: generate the continuation once per prompt, run each draft once over
prompt + continuation (teacher forcing) and walk the iterations the way the
engine does (``memspec_ros.runtime.oracle``: the first generated token comes
from prefill, each iteration proposes ``min(gamma, left - 1)`` tokens, accepts
the leading agreements and commits them plus the target's token).

Definitions used in the JSON (all per prompt, then averaged over prompts):

* ``matrix[draft][workload]``: mean over prompts of (accepted / iterations)
  when that draft runs the whole generation.
* ``oracle_static_gain``: for each domain workload, mean over prompts of the
  best fixed draft's score divided by the mean of the general draft's score,
  minus one; then averaged over the five domain workloads.
* ``oracle_dynamic_gain_mixed``: on ``mixed``, the dynamic oracle starts at
  position 1 and repeats: score every draft by the tokens it would commit in
  the next N iterations from the current position (its own walk), take the
  best (ties: better whole-output draft), walk those N iterations with it and
  move on, until the continuation is consumed.  Its accepted / iterations,
  averaged over prompts, is divided by the best fixed draft's average, minus
  one.  Switching costs (the new draft's KV catch-up) are not counted: this is
  the upper bound the predictor chases, as in the paper's oracle.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path
from statistics import mean

import torch

from memspec_ros.runtime.atomic_write import write_text_atomic
from memspec_ros.runtime.oracle import ContinuationCache, continuation_logits, draft_agreement, interval_walk

from .corpora import DOMAINS, WORKLOADS
from .workloads import read_jsonl


@dataclass
class AcceptanceConfig:
    models_dir: Path = Path("models")
    prompts_per_workload: int = 100
    gamma: int = 4
    max_new_tokens: int = 128
    interval: int = 4
    threads: int = 2
    continuations: Path | None = None  # ContinuationCache file: reruns skip the target's decoding
    sampling_temperature: float = 0.7  # for sampling_overlap; 0 skips it


def static_score(agree: list[bool], gamma: int) -> tuple[float, int]:
    """(accepted per iteration, iterations) for one draft over the whole generation."""
    _, accepted = interval_walk(agree, 1, gamma, len(agree))
    return (sum(accepted) / len(accepted) if accepted else 0.0), len(accepted)


def sampling_overlap(target_logits: torch.Tensor, draft_logits: torch.Tensor, temperature: float) -> float:
    """Mean over positions of sum_v min(p_v, q_v) at ``temperature`` (rows: ``continuation_logits``).

    The probability that speculative sampling accepts the draft's token at a
    position (Leviathan et al. 2023, Thm 3.5), here evaluated along the greedy
    continuation.  Greedy acceptance only asks the argmax to match; this says
    whether the draft's *distribution* is still usable when users sample.
    """
    p = torch.softmax(target_logits.float() / temperature, -1)
    q = torch.softmax(draft_logits.float() / temperature, -1)
    return torch.minimum(p, q).sum(-1).mean().item()


def repeated_ngram_fraction(tokens: list[int], n: int = 4) -> float:
    """Fraction of ``tokens`` (from the n-th on) that complete an n-gram already seen earlier in them.

    A measure of how loop-like a greedy continuation is: loops are what any
    small draft predicts, whatever its domain.
    """
    seen, hits = set(), 0
    for t in range(n - 1, len(tokens)):
        gram = tuple(tokens[t - n + 1 : t + 1])
        hits += gram in seen
        seen.add(gram)
    return hits / max(len(tokens) - n + 1, 1)


def dynamic_walk(agreement: dict[str, list[bool]], gamma: int, interval: int) -> tuple[float, list[str]]:
    """Best draft per N-iteration interval: (accepted per iteration, draft chosen per interval)."""
    names = list(agreement)
    static = {d: static_score(agreement[d], gamma)[0] for d in names}
    length = len(next(iter(agreement.values())))
    position, accepted, chosen = 1, [], []
    while position < length:
        best = max(names, key=lambda d: (interval_walk(agreement[d], position, gamma, interval)[0], static[d]))
        advance, acc = interval_walk(agreement[best], position, gamma, interval)
        if not acc:
            break
        chosen.append(best)
        accepted += acc
        position += advance
    return (sum(accepted) / len(accepted) if accepted else 0.0), chosen


def load_zoo(models_dir: Path):
    """(tokenizer, target, {draft: model}, target directory) in fp32 on CPU from the registry's layout."""
    import yaml
    from transformers import LlamaForCausalLM, PreTrainedTokenizerFast

    reg = yaml.safe_load((models_dir / "registry.yaml").read_text(encoding="utf-8"))
    tpath = models_dir / (reg["target"]["path"] if isinstance(reg["target"], dict) else reg["target"])
    # local_files_only: a folder that is missing was taken for a Hub repository id and fetched from the network
    tok = PreTrainedTokenizerFast.from_pretrained(str(tpath), local_files_only=True)
    target = LlamaForCausalLM.from_pretrained(str(tpath), dtype=torch.float32, use_safetensors=True,
                                              local_files_only=True).eval()
    drafts = {
        d["name"]: LlamaForCausalLM.from_pretrained(
            str(models_dir / d["path"]), dtype=torch.float32, use_safetensors=True, local_files_only=True
        ).eval()
        for d in reg["drafts"]
    }
    return tok, target, drafts, tpath


def run_acceptance(cfg: AcceptanceConfig, out_json: Path, plot_path: Path | None = None) -> dict:
    from tqdm import tqdm

    torch.set_num_threads(cfg.threads)
    tok, target, drafts, target_dir = load_zoo(cfg.models_dir)
    cache = ContinuationCache(cfg.continuations, target_dir)
    names = [d for d in DOMAINS if d in drafts]
    per_prompt: dict[str, list[dict]] = {}
    t0 = time.time()
    for w in WORKLOADS:
        rows = read_jsonl(cfg.models_dir / "workloads" / f"{w}.jsonl")[: cfg.prompts_per_workload]
        per_prompt[w] = []
        for row in tqdm(rows, desc=f"acceptance {w}", mininterval=10):
            ids = [tok.bos_token_id] + tok(row["prompt"], add_special_tokens=False)["input_ids"]
            cont = cache.continuation(target, ids, cfg.max_new_tokens, [tok.eos_token_id])
            if len(cont) < 2:  # no iteration to score: a 0 for every draft would pull its mean down (as chat skips)
                continue
            logits = {d: continuation_logits(drafts[d], ids, cont) for d in names}  # one forward per draft
            agreement = {d: draft_agreement(drafts[d], ids, cont, logits[d]) for d in names}
            scores = {d: static_score(agreement[d], cfg.gamma)[0] for d in names}
            rec = {
                "tokens": len(cont),
                "accepted_per_iteration": scores,
                "repeated_4gram": repeated_ngram_fraction(cont),
            }
            if cfg.sampling_temperature > 0 and cont:
                t_logits = continuation_logits(target, ids, cont)
                rec["sampling_overlap"] = {
                    d: sampling_overlap(t_logits, logits[d], cfg.sampling_temperature) for d in names
                }
            if w == "mixed":
                dyn, chosen = dynamic_walk(agreement, cfg.gamma, cfg.interval)
                rec.update(dynamic=dyn, dynamic_choices=chosen, pair=row.get("pair"))
            per_prompt[w].append(rec)
        cache.save()
    from .chat_acceptance import acceptance_summary  # the figures, defined once (it imports this module)

    empty = [w for w, recs in per_prompt.items() if not recs]
    if empty:
        raise ValueError(f"no continuations of two or more tokens for workload(s) {', '.join(empty)}")
    result = {
        "config": {k: str(v) for k, v in cfg.__dict__.items()},
        "definitions": __doc__,
        # the matrix, the oracle gains (n/a where general accepts nothing), the ceiling, the workloads' statistics
        **acceptance_summary(per_prompt, names, list(WORKLOADS), cfg.gamma),
        "sampling_temperature": cfg.sampling_temperature,
        "sampling_overlap": {
            d: {w: mean(r["sampling_overlap"][d] for r in per_prompt[w] if "sampling_overlap" in r) for w in WORKLOADS}
            for d in names
        } if cfg.sampling_temperature > 0 else None,
        "wall_seconds": round(time.time() - t0, 1),
        "per_prompt": per_prompt,
    }
    out_json.parent.mkdir(parents=True, exist_ok=True)
    write_text_atomic(out_json, json.dumps(result, indent=1))  # `card` reads it: never half a file
    if plot_path is not None:
        plot_path.parent.mkdir(parents=True, exist_ok=True)
        plot_matrix(result, plot_path)
    return result


def plot_matrix(result: dict, path: Path) -> None:
    """Heatmap of accepted tokens per iteration, each cell annotated, own-domain cells boxed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Rectangle

    matrix = result["matrix"]
    drafts = list(matrix)
    workloads = [w for w in drafts if w in WORKLOADS] + [
        w for w in WORKLOADS if w not in drafts
    ]  # diagonal = own domain
    data = [[matrix[d][w] for w in workloads] for d in drafts]
    fig, ax = plt.subplots(figsize=(7.5, 4.5))
    im = ax.imshow(data, cmap="viridis", aspect="auto")
    ax.set_xticks(range(len(workloads)), workloads)
    ax.set_yticks(range(len(drafts)), drafts)
    ax.set_xlabel("held-out workload")
    ax.set_ylabel("draft")
    for i, d in enumerate(drafts):
        for j, w in enumerate(workloads):
            v = data[i][j]
            ax.text(
                j, i, f"{v:.2f}", ha="center", va="center", color="white" if v < max(map(max, data)) * 0.6 else "black"
            )
            if d == w:
                ax.add_patch(Rectangle((j - 0.5, i - 0.5), 1, 1, fill=False, edgecolor="red", lw=2))
    fig.colorbar(im, ax=ax, label="mean accepted tokens / iteration")
    def pct(gain: float | None) -> str:
        return "n/a" if gain is None else f"{gain:+.0%}"

    ax.set_title(
        f"Acceptance (greedy, gamma={result['config']['gamma']}); "
        f"static oracle {pct(result['oracle_static_gain'])},"
        f" dynamic on mixed {pct(result['oracle_dynamic_gain_mixed'])}",
        fontsize=9,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
