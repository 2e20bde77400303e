"""What the interleaved A/B scripts share: the bundled zoo on one forward path, held-out prompts round-robin over
its workloads, and each prompt's domain draft."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from memspec_ros.bench.cli import round_robin_prompts
from memspec_ros.runtime.chat import end_token_ids
from memspec_ros.runtime.loader import RuntimeModels, load_models
from memspec_ros.runtime.models import ModelSpec, load_model

DOMAINS = ("code", "general", "law", "math", "medical", "mixed")  # the order round_robin_prompts takes them in


@dataclass
class Zoo:
    models: RuntimeModels
    target: torch.nn.Module
    drafts: dict[str, torch.nn.Module]
    prompts: list[list[int]]
    eos: list[int]

    def draft_for(self, i: int) -> torch.nn.Module:
        """Prompt i's domain draft (``general`` for the mixed workload)."""
        return self.drafts.get(DOMAINS[i % len(DOMAINS)], self.drafts["general"])


def zoo(path: str, count: int) -> Zoo:
    """The bundled zoo with target and drafts on ``path`` (int4 | int8 | none), ``count`` prompts, 1 thread."""
    torch.set_num_threads(1)
    models = load_models(Path("models/registry.yaml"), quantization=path, validate=False)
    target = models.target.model
    drafts = {name: load_model(ModelSpec(models.registry.get(name).path, dtype=models.draft_dtype,
                                         quantization=path)).model
              for name in ("code", "math", "law", "medical", "general")}
    prompts = round_robin_prompts(models.tokenizer, Path("models/workloads"), count)
    return Zoo(models, target, drafts, prompts, end_token_ids(None, target))
