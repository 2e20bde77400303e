"""Prediction overhead of each predictor variant, measured one variant after another in one run.

Each variant's overhead is a share of its own decoding time, so a drift in the machine's speed between the
variants cancels in it; their tokens/s are not interleaved and carry that drift.

Variants: the paper's MiniLM encoder and the target-hidden encoder, each run
synchronously on the decode thread or overlapped on a background thread. The
figure is GenerationStats.prediction_overhead: seconds of scheduling work on the
decode thread (prediction + cache update) as a share of decoding time; the
target-hidden encoder's hook time (inside the target's forwards, prefill
included) is reported beside it as a share of prefill and decoding time (``hook_share``), and
``prediction_overhead_with_hook`` is the two shares summed. Heads
come from ``--predictor`` (models/predictor/<encoder>/); with ``--untrained`` a
random head of the same shape is used, which costs exactly the same.

    python -m memspec_ros.bench.prediction_overhead --registry models/registry.yaml \\
        --workload models/workloads/mixed.jsonl --prompts 6
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from ..argtypes import controller_limit, non_negative_int, output_file, positive_int
from ..runtime import bundled_zoo_dir
from ..runtime.controller import RuntimeConfig
from ..runtime.loader import load_models
from ..runtime.predictor import HeadConfig, MiniLMEncoder, PredictionEngine, RankingHead, TargetHiddenEncoder
from ..runtime.stats import GenerationStats, GenerationTotals
from ..zoo.predictor_training import read_prompts
from ..zoo.workloads import prompt_problem

VARIANTS = [("minilm", False), ("minilm", True), ("target-hidden", False), ("target-hidden", True)]


def build_engine(encoder_name: str, predictor_dir: Path | None, target, tokenizer, drafts: list[str],
                 recent_tokens: int, prompt_tokens: int = 16) -> PredictionEngine:
    """The trained head in ``predictor_dir`` (main() checked it is there), or a random one (``--untrained``)."""
    if predictor_dir is not None:
        return PredictionEngine.load(predictor_dir / encoder_name, target=target, tokenizer=tokenizer)
    if encoder_name == "minilm":
        encoder = MiniLMEncoder(lambda ids: tokenizer.decode(ids, skip_special_tokens=True),
                                prompt_tokens=prompt_tokens)
    else:
        encoder = TargetHiddenEncoder(target, recent_tokens, prompt_tokens)
    torch.manual_seed(0)
    head = RankingHead(HeadConfig(encoder=encoder_name, drafts=drafts, in_dim=2 * encoder.dim,
                                  recent_tokens=recent_tokens, prompt_tokens=prompt_tokens,
                                  truncation_side="left")).eval()
    return PredictionEngine(head, encoder)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    zoo = bundled_zoo_dir()  # the defaults: the bundled zoo's, wherever this runs from
    p.add_argument("--registry", default=str(zoo / "registry.yaml"))
    p.add_argument("--workload", default=str(zoo / "workloads" / "mixed.jsonl"))
    p.add_argument("--predictor", default=str(zoo / "predictor"))
    p.add_argument("--untrained", action="store_true", help="random heads (same cost) instead of trained ones")
    p.add_argument("--prompt-tokens", type=non_negative_int, default=None, metavar="W",
                   help="--untrained heads: the prompt positions their prompt half pools, as memspec-train-predictor's"
                        " (default 16; 0: the whole prompt). Trained heads pool what they were trained with")
    p.add_argument("--prompts", type=positive_int, default=4)
    p.add_argument("--max-new-tokens", type=positive_int, default=128)
    # the controller's own bounds: a value it refuses is named by the parser, not by a traceback after the loads
    p.add_argument("--interval", type=controller_limit("interval"), default=4)
    p.add_argument("--capacity", type=controller_limit("capacity"), default=2)
    p.add_argument("--json", type=output_file, default=None,  # a bad folder named now, not after every variant ran
                   help="also write the results here")
    p.add_argument("--threads", type=non_negative_int, default=1, help="torch intra-op threads (0: torch's default)")
    args = p.parse_args(argv)
    if args.prompt_tokens is not None and not args.untrained:  # ignored there: said, not silently
        p.error("--prompt-tokens sets --untrained heads' pooling; a trained head pools what it was trained with")
    args.prompt_tokens = 16 if args.prompt_tokens is None else args.prompt_tokens
    if not args.untrained:  # a mistyped folder fell back to random heads, reported as if trained
        missing = [e for e, _ in VARIANTS if not (Path(args.predictor) / e / "predictor.json").is_file()]
        if missing:
            p.error(f"--predictor {args.predictor} has no trained {', '.join(sorted(set(missing)))} head"
                    " (<dir>/<encoder>/predictor.json): name the folder memspec-train-predictor wrote, or pass"
                    " --untrained for random heads of the same cost")
    if args.threads > 0:
        torch.set_num_threads(args.threads)

    if not Path(args.registry).is_file():
        p.error(f"--registry {args.registry}: no such file (a zoo's registry.yaml)")
    try:  # read before the models load; this bench tokenises a row's "prompt" as text (chat rows not measured)
        rows = read_prompts(args.workload, args.prompts, row_check=prompt_problem)
    except (OSError, ValueError) as exc:
        p.error(str(exc))
    models = load_models(args.registry, validate=False)
    tokenizer, target, registry = models.tokenizer, models.target.model, models.registry
    prompts = [tokenizer(r["prompt"])["input_ids"][-256:] for r in rows]
    predictor_dir = None if args.untrained else Path(args.predictor)
    results = {}
    for encoder_name, overlap in VARIANTS:
        engine = build_engine(encoder_name, predictor_dir, target, tokenizer, registry.names(), 32,
                              args.prompt_tokens)
        config = RuntimeConfig(policy="memspec", capacity=args.capacity, interval=args.interval,
                               recent_tokens=engine.recent_tokens,  # the head's T
                               overlap_prediction=overlap, prompt_cache=False)  # each prompt encoded in full
        ctl = models.controller(config, engine, eos_token_ids=[])
        try:
            ctl.generate(prompts[0], 16)  # warm-up: loads, first-call overheads
            hook0 = getattr(engine.encoder, "hook_seconds", 0.0)
            runs: list[GenerationStats] = [ctl.generate(ids, args.max_new_tokens).stats for ids in prompts]
        finally:
            ctl.close()
            engine.close()
        pooled = GenerationTotals.of(runs)
        decode, prefill = pooled.decode_seconds, sum(s.prefill_seconds for s in runs)
        key = f"{encoder_name}{' (overlapped)' if overlap else ''}"
        # the hidden-state hook runs inside the target's forwards (the prefill's too): reported beside the figure,
        # which is GenerationStats.prediction_overhead's definition (the paper goal's), not added into it
        hook = getattr(engine.encoder, "hook_seconds", 0.0) - hook0
        hook_share = hook / (decode + prefill) if decode + prefill else 0.0
        results[key] = {
            "prediction_overhead": pooled.prediction_overhead,  # the figure's one definition (runtime/stats.py)
            # over prefill and decoding: the hook's time is both's (over decoding alone the prefill's part made
            # the target-hidden variants look dearer the longer the prompts)
            "hook_share": hook_share,
            # the two shares summed: at least the decode-thread overhead, never below it as one ratio over
            # (prediction + hook) / (decode + prefill) came out for the variants with no hook
            "prediction_overhead_with_hook": pooled.prediction_overhead + hook_share,
            "background_prediction_share": sum(s.background_prediction_seconds for s in runs) / decode
            if decode
            else 0.0,
            "tokens_per_second": pooled.tokens_per_second,
            "predictions": sum(s.predictions for s in runs),
            "mean_accepted": pooled.mean_accepted,  # pooled over every iteration, as the policies bench does
            "fallback_fraction": pooled.fallback_fraction,
        }
    print(f"{'variant':<28}{'overhead':>10}{'hook':>8}{'background':>12}{'tok/s':>9}{'E[A]':>7}{'fallback':>10}")
    for key, r in results.items():
        print(f"{key:<28}{100 * r['prediction_overhead']:>9.2f}%{100 * r['hook_share']:>7.2f}%"
              f"{100 * r['background_prediction_share']:>11.2f}%"
              f"{r['tokens_per_second']:>9.1f}{r['mean_accepted']:>7.2f}{100 * r['fallback_fraction']:>9.1f}%")
    best = min(results, key=lambda k: results[k]["prediction_overhead"])
    print(f"lowest decode-thread overhead: {best}")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)  # output_file: the folder is made at the write
        Path(args.json).write_text(json.dumps(results, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
