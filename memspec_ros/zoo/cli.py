"""``memspec-zoo``: build the bundled zoo, measure it, write its card.

    memspec-zoo build [--stages corpora,tokenizer,...] [--target-minutes 72] [--device cuda]
    memspec-zoo acceptance --json OUT [--prompts-per-workload 100]
    memspec-zoo card            # latencies, perplexities, acceptance -> models/MODEL_CARD.md
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

# On a small machine shared with other processes, OpenMP threads that spin at
# barriers while a sibling is descheduled made a 2-thread training step ~8x
# slower than a 1-thread one (measured here); passive waiting removes that.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


def _build_parser(sub) -> None:
    from .build import DRAFT_RECIPES, STAGES, BuildConfig

    defaults = BuildConfig()

    p = sub.add_parser("build", help="build corpora, tokenizer, workloads and train the zoo (resumable)")
    p.add_argument("--stages", default=",".join(STAGES), help=f"comma list out of {','.join(STAGES)}")
    p.add_argument("--work-dir", default="artifacts/zoo-build")
    p.add_argument("--out", default="models")
    p.add_argument("--device", default="cpu", help="cpu or cuda (a larger/longer zoo on a GPU)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    for name, minutes in (("target", defaults.target_train.max_minutes), ("general", defaults.general_train.max_minutes),
                          ("onpolicy", defaults.onpolicy_train.max_minutes), ("domain", defaults.domain_train.max_minutes)):
        only = " (--draft-recipe shared only)" if name == "onpolicy" else ""
        p.add_argument(f"--{name}-minutes", type=float, default=minutes, help=f"wall-clock budget per {name} model{only}")
        p.add_argument(f"--{name}-steps", type=int, default=100_000, help=f"step budget per {name} model")
    p.add_argument("--target-init", default=None, metavar="DIR",
                   help="continue training this target (a Hugging Face dir with model.safetensors, e.g. an earlier"
                        " build's <work dir>/hf/target) for --target-minutes instead of starting from random weights")
    p.add_argument("--target-lr", type=float, default=2e-3, help="peak learning rate of the target's run")
    p.add_argument("--compile", action=argparse.BooleanOptionalAction, default=True,
                   help="torch.compile the target's training step (about 1.2x faster on a 2-core CPU after a minute"
                        " of compiling; training falls back to eager where it cannot compile)")
    p.add_argument("--rollouts-per-source", type=int, default=1024,
                   help="target continuations of training prompts per source a draft learns from, for on-policy"
                        " distillation: the four domains (--draft-recipe shared: also general and mixed)")
    p.add_argument("--domain-rollouts-per-source", type=int, default=1024,
                   help="continuations per domain that domain drafts learn from: the shared rollouts plus"
                        " more of the same domain (must be >= --rollouts-per-source)")
    p.add_argument("--draft-recipe", choices=DRAFT_RECIPES, default="paper",
                   help="paper: general = the draft distilled on the corpus mix, each domain draft that draft"
                        " distilled on-policy on its domain's target continuations; shared: general distilled"
                        " on-policy on every source's, each domain draft from it (see the model card)")
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--target-layers", type=int, default=16)
    p.add_argument("--target-hidden", type=int, default=256)
    p.add_argument("--draft-layers", type=int, default=2)
    p.add_argument("--draft-hidden", type=int, default=128)


def _resized(arch, hidden: int, layers: int):
    """``arch`` at another width and depth: the same FFN ratio, 64-wide attention heads."""
    from dataclasses import replace

    heads = max(1, hidden // 64)
    return replace(arch, hidden_size=hidden, num_layers=layers, num_heads=heads, num_kv_heads=heads,
                   intermediate_size=int(hidden * arch.intermediate_size / arch.hidden_size))


def _run_build(a) -> int:
    from dataclasses import replace

    from .build import BuildConfig, ZooBuild

    cfg = BuildConfig(work_dir=Path(a.work_dir), out_dir=Path(a.out), device=a.device, threads=a.threads, seed=a.seed)
    common = dict(batch_size=a.batch_size, seq_len=a.seq_len)
    cfg.target_train = replace(cfg.target_train, max_minutes=a.target_minutes, max_steps=a.target_steps, lr=a.target_lr,
                               compile=a.compile,
                               **common)
    cfg.target_init = Path(a.target_init) if a.target_init else None
    cfg.general_train = replace(cfg.general_train, max_minutes=a.general_minutes, max_steps=a.general_steps, **common)
    cfg.onpolicy_train = replace(cfg.onpolicy_train, max_minutes=a.onpolicy_minutes, max_steps=a.onpolicy_steps, **common)
    cfg.domain_train = replace(cfg.domain_train, max_minutes=a.domain_minutes, max_steps=a.domain_steps, **common)
    cfg.rollouts = replace(cfg.rollouts, sequences_per_source=a.rollouts_per_source)
    cfg.domain_rollouts_per_source = a.domain_rollouts_per_source
    cfg.draft_recipe = a.draft_recipe
    cfg.target_arch = _resized(cfg.target_arch, a.target_hidden, a.target_layers)
    cfg.draft_arch = _resized(cfg.draft_arch, a.draft_hidden, a.draft_layers)
    try:
        build = ZooBuild(cfg)  # checks the configuration before any work
    except ValueError as exc:
        raise SystemExit(f"memspec-zoo build: {exc}") from None
    build.run([s.strip() for s in a.stages.split(",") if s.strip()])
    return 0


def _acceptance_parser(sub) -> None:
    p = sub.add_parser("acceptance", help="acceptance matrix of every draft on every workload (greedy, teacher-forced)")
    p.add_argument("--json", required=True, help="output JSON path")
    p.add_argument("--models", default="models")
    p.add_argument("--prompts-per-workload", type=int, default=100)
    p.add_argument("--gamma", type=int, default=4)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--interval", type=int, default=4, help="N iterations per interval of the dynamic oracle")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--plot", default=None, help="heatmap PNG (default: next to the registry)")
    p.add_argument("--sampling-temperature", type=float, default=0.7,
                   help="also report each draft's expected speculative-sampling acceptance at this temperature (0: skip)")
    p.add_argument("--continuations", default=None, metavar="JSON",
                   help="cache file of the target's greedy continuations (keyed by its weights): reruns with"
                        " rebuilt drafts skip decoding the target (default: no cache)")


def _run_acceptance(a) -> int:
    from .acceptance import AcceptanceConfig, run_acceptance

    cfg = AcceptanceConfig(
        models_dir=Path(a.models),
        prompts_per_workload=a.prompts_per_workload,
        gamma=a.gamma,
        max_new_tokens=a.max_new_tokens,
        interval=a.interval,
        threads=a.threads,
        continuations=Path(a.continuations) if a.continuations else None,
        sampling_temperature=a.sampling_temperature,
    )
    run_acceptance(cfg, Path(a.json), Path(a.plot) if a.plot else Path(a.models) / "acceptance_matrix.png")
    return 0


def _card_parser(sub) -> None:
    p = sub.add_parser("card", help="measure latencies and perplexities, write models/MODEL_CARD.md")
    p.add_argument("--models", default="models")
    p.add_argument("--work-dir", default="artifacts/zoo-build")
    p.add_argument("--acceptance-json", default=None)
    p.add_argument("--threads", type=int, default=2, help="torch threads for the perplexities (default 2); latencies are"
                                                          " measured at 1 and 2 threads")
    p.add_argument("--notes", default=None, help="markdown appended to the 'Build as run' section")


def _run_card(a) -> int:
    from .card import write_card

    write_card(
        Path(a.models),
        Path(a.work_dir),
        Path(a.acceptance_json) if a.acceptance_json else None,
        a.threads,
        Path(a.notes) if a.notes else None,
    )
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="memspec-zoo", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    _build_parser(sub)
    _acceptance_parser(sub)
    _card_parser(sub)
    a = ap.parse_args(argv)
    return {"build": _run_build, "acceptance": _run_acceptance, "card": _run_card}[a.cmd](a)


if __name__ == "__main__":
    sys.exit(main())
