"""Policy benchmark: the paper's comparison of MemSpec against every baseline.

Protocol (the paper's section 4.1, scaled to the bundled zoo): greedy, batch 1,
N = 4, K = 2, gamma = 4, 128 new tokens, runtime state (draft cache, bandit
statistics) reset per prompt; throughput is generated tokens per second of
steady-state decoding, prompt encoding excluded; per workload the tokens/s
over all its prompts, then the geometric mean across workloads. All policies run
in one process through the same controller loop, interleaved prompt by prompt
with a rotating order, so machine noise hits them alike.

Storage emulation: the zoo's drafts are a few MB and load from this machine's
page cache in milliseconds, while the paper's premise is an edge device where
loading a draft costs more than several decoding iterations. ``load_ms_per_mb``
adds a sleep to every draft load on the cache's loader thread (it releases the
GIL, like real I/O), scaled to the draft's size, so the load-to-iteration cost
ratio matches that premise. It is reported in the JSON; 0 disables it.
"""

from __future__ import annotations

import json
import math
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

from ..runtime.cache import registry_loader
from ..runtime.chat import end_token_ids, prompt_ids
from ..runtime.controller import RuntimeConfig, RuntimeController
from ..runtime.models import LoadedModel, ModelSpec, load_model, load_tokenizer, tokenizer_fingerprint
from ..runtime.oracle import GreedyOracle
from ..runtime.policies import PAPER_POLICIES
from ..runtime.predictor import PredictionEngine
from ..runtime.registry import DraftRegistry

WORKLOADS = ("code", "math", "law", "medical", "general", "mixed")


@dataclass
class PolicyBenchConfig:
    policies: Sequence[str] = PAPER_POLICIES
    workloads: Sequence[str] = WORKLOADS
    prompts: int = 4  # per workload (the paper: 100; pass --prompts 100 for the full protocol)
    runs: int = 1
    max_new_tokens: int = 128
    capacity: int = 2
    interval: int = 4
    gamma: int = 4
    recent_tokens: int = 32
    load_ms_per_mb: float = 25.0
    threads: int = 1


@dataclass
class PolicyRow:
    """One policy on one workload, summed over its prompts and runs."""

    decode_tokens: int = 0
    decode_seconds: float = 0.0
    completion_tokens: int = 0
    end_to_end_seconds: float = 0.0
    accepted: list[float] = field(default_factory=list)
    fallback: list[float] = field(default_factory=list)
    prediction_overhead: list[float] = field(default_factory=list)
    load_wait_seconds: float = 0.0
    switches: int = 0
    lossless: bool = True

    @property
    def tokens_per_second(self) -> float:
        return self.decode_tokens / self.decode_seconds if self.decode_seconds else 0.0

    @property
    def end_to_end_tokens_per_second(self) -> float:
        return self.completion_tokens / self.end_to_end_seconds if self.end_to_end_seconds else 0.0

    def summary(self) -> dict:
        mean = lambda xs: statistics.fmean(xs) if xs else 0.0  # noqa: E731
        return {
            "tokens_per_second": self.tokens_per_second,
            "end_to_end_tokens_per_second": self.end_to_end_tokens_per_second,
            "mean_accepted": mean(self.accepted),
            "fallback_fraction": mean(self.fallback),
            "prediction_overhead": mean(self.prediction_overhead),
            "load_wait_seconds": self.load_wait_seconds,
            "draft_switches": self.switches,
            "lossless": self.lossless,
        }


def gmean(values: Sequence[float]) -> float:
    values = [v for v in values if v > 0]
    return math.exp(statistics.fmean(math.log(v) for v in values)) if values else 0.0


def slow_storage(loader: Callable[[str], LoadedModel], load_ms_per_mb: float) -> Callable[[str], LoadedModel]:
    """Wrap a loader so each load also takes ``load_ms_per_mb`` per MB of weights (emulated storage)."""
    if load_ms_per_mb <= 0:
        return loader

    def load(name: str) -> LoadedModel:
        loaded = loader(name)
        time.sleep(loaded.size_bytes / 1e6 * load_ms_per_mb / 1000)
        return loaded

    return load


def read_workload(path: Path, limit: int) -> list[str]:
    lines = [line for line in path.read_text().splitlines() if line.strip()]
    return [json.loads(line)["prompt"] for line in lines[:limit]]


def run_policy_bench(zoo: Path, cfg: PolicyBenchConfig, predictor_dir: Path | None, progress=None) -> dict:
    import torch

    torch.set_num_threads(cfg.threads)
    registry_file = zoo / "registry.yaml"
    probe = DraftRegistry.from_yaml(registry_file, validate=False)
    tokenizer = load_tokenizer(probe.target_path)
    target = load_model(ModelSpec(str(probe.target_path)))
    registry = DraftRegistry.from_yaml(registry_file, target_fingerprint=tokenizer_fingerprint(tokenizer))
    predictor = None
    if predictor_dir is not None and (predictor_dir / "predictor.json").is_file():
        predictor = PredictionEngine.load(predictor_dir, target=target.model, tokenizer=tokenizer)
    policies = [p for p in cfg.policies if predictor is not None or p not in ("memspec", "prediction-only")]
    skipped = sorted(set(cfg.policies) - set(policies))
    eos = end_token_ids(tokenizer, target.model)

    # future knowledge for the oracles (exact under greedy): every draft once, outside the timed runs
    drafts = {e.name: load_model(ModelSpec(str(e.path))).model for e in registry}
    prompts = {w: [prompt_ids(tokenizer, t) for t in read_workload(zoo / "workloads" / f"{w}.jsonl", cfg.prompts)]
               for w in cfg.workloads}  # the chat template where the target has one, as the node sends them
    oracles: dict[tuple[int, ...], GreedyOracle] = {}
    for ids_list in prompts.values():
        for ids in ids_list:
            oracles[tuple(ids)] = GreedyOracle.compute(target.model, drafts, ids, cfg.max_new_tokens,
                                                       cfg.gamma, cfg.interval, eos)
    del drafts

    config = RuntimeConfig(policy=policies[0], capacity=cfg.capacity, interval=cfg.interval, gamma=cfg.gamma,
                           recent_tokens=cfg.recent_tokens, reset_cache_per_generation=True)
    controller = RuntimeController(
        config, target.model, tokenizer, registry, predictor,
        loader=slow_storage(registry_loader(registry), cfg.load_ms_per_mb),
        oracle_for=lambda ids: oracles[tuple(ids)], eos_token_ids=eos, max_positions=target.max_positions,
    )
    rows = {w: {p: PolicyRow() for p in policies} for w in cfg.workloads}
    try:
        for run in range(cfg.runs):
            for w in cfg.workloads:
                for i, ids in enumerate(prompts[w]):
                    k = (i + run) % len(policies)
                    for policy in policies[k:] + policies[:k]:
                        controller.reconfigure(policy=policy)
                        result = controller.generate(ids, cfg.max_new_tokens)
                        s, row = result.stats, rows[w][policy]
                        row.decode_tokens += s.decode_tokens
                        row.decode_seconds += s.decode_seconds
                        row.completion_tokens += s.completion_tokens
                        row.end_to_end_seconds += s.end_to_end_seconds
                        row.accepted.append(s.mean_accepted)
                        row.fallback.append(s.fallback_fraction)
                        row.prediction_overhead.append(s.prediction_overhead)
                        row.load_wait_seconds += s.load_wait_seconds
                        row.switches += s.draft_switches
                        row.lossless &= result.token_ids == oracles[tuple(ids)].continuation
                        if progress is not None:
                            progress.update(1)
    finally:
        controller.close()
    table = {w: {p: rows[w][p].summary() for p in policies} for w in cfg.workloads}
    geo = {p: gmean([table[w][p]["tokens_per_second"] for w in cfg.workloads]) for p in policies}
    geo_e2e = {p: gmean([table[w][p]["end_to_end_tokens_per_second"] for w in cfg.workloads]) for p in policies}
    ratios = {}
    if "memspec" in geo:
        ratios = {f"memspec_vs_{p}": geo["memspec"] / geo[p] for p in policies if p != "memspec" and geo[p] > 0}
    return {
        "config": asdict(cfg) | {"zoo": str(zoo), "policies": policies, "workloads": list(cfg.workloads), "skipped_policies": skipped},
        "workloads": table,
        "gmean_tokens_per_second": geo,
        "gmean_end_to_end_tokens_per_second": geo_e2e,
        "ratios": ratios,
        "lossless": all(table[w][p]["lossless"] for w in cfg.workloads for p in policies),
    }


def plot_policy_bench(result: dict, path: Path) -> None:
    """Grouped bars: tokens/s per workload and policy, plus the geometric mean."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    policies = result["config"]["policies"]
    groups = list(result["workloads"]) + ["GMEAN"]
    values = {p: [result["workloads"][w][p]["tokens_per_second"] for w in result["workloads"]]
              + [result["gmean_tokens_per_second"][p]] for p in policies}
    fig, ax = plt.subplots(figsize=(11, 4.2))
    width = 0.8 / len(policies)
    for j, p in enumerate(policies):
        ax.bar([g + j * width for g in range(len(groups))], values[p], width, label=p)
    ax.set_xticks([g + 0.4 - width / 2 for g in range(len(groups))], groups)
    ax.set_ylabel("steady-state tokens/s")
    cfg = result["config"]
    ax.set_title(f"Policies on {Path(cfg['zoo']).name}/ (K={cfg['capacity']}, N={cfg['interval']}, gamma={cfg['gamma']}, "
                 f"{cfg['max_new_tokens']} tokens, {cfg['prompts']} prompts/workload, load {cfg['load_ms_per_mb']} ms/MB)")
    ax.legend(ncol=4, fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
