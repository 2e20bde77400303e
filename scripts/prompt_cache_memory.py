"""Resident memory of a controller whose prompt cache keeps dropping goals' caches, with and without handing the
freed pages back to the system (kv_cache.release_freed_memory), one setting per process.

The bundled zoo on the fp32 path, the default prompt-cache budget (128 MiB), MemSpec with K = 3 and N = 2 (the
soak's settings), ``--goals`` goals over the soak's prompts, every sixth of up to 600 new tokens (seeded), the others
8; resident memory and the cache's own bytes every 30 goals, and the hand-back's time per call.

    .venv/bin/python scripts/prompt_cache_memory.py --hand-back on
    .venv/bin/python scripts/prompt_cache_memory.py --hand-back off
"""

from __future__ import annotations

import argparse
import gc
import random
import statistics
import time
from pathlib import Path

import torch

from memspec_ros.argtypes import int_in
from memspec_ros.bench.soak_bench import rss_bytes, soak_prompts
from memspec_ros.runtime import kv_cache, prompt_cache
from memspec_ros.runtime.chat import prompt_ids
from memspec_ros.runtime.controller import RuntimeConfig, load_runtime

ROOT = Path(__file__).resolve().parents[1]
SAMPLE_EVERY = 30  # goals between two RSS samples


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--hand-back", choices=("on", "off"), default="on")
    p.add_argument("--goals", type=int_in(SAMPLE_EVERY, 1_000_000), default=240,
                   help=f"goals to run (default 240; at least {SAMPLE_EVERY}: RSS is sampled every {SAMPLE_EVERY})")
    a = p.parse_args()
    torch.set_num_threads(1)
    seconds: list[float] = []

    def timed() -> bool:
        t0 = time.perf_counter()
        done = kv_cache.release_freed_memory()
        seconds.append(time.perf_counter() - t0)
        return done

    prompt_cache.release_freed_memory = timed if a.hand_back == "on" else (lambda: False)
    config = RuntimeConfig(policy="memspec", capacity=3, interval=2)
    controller = load_runtime(config, str(ROOT / "models/registry.yaml"), predictor_path=str(ROOT / "models/predictor"),
                              quantization="none", dtype="fp32")
    prompts = soak_prompts(ROOT / "models")
    rng = random.Random(0)
    samples = []
    for i in range(a.goals):
        ids = prompt_ids(controller.tokenizer, prompts[i % len(prompts)], [])
        controller.generate(ids, max_new_tokens=rng.randint(50, 600) if i % 6 == 5 else 8)
        if i % SAMPLE_EVERY == SAMPLE_EVERY - 1:
            gc.collect()
            samples.append(rss_bytes() / 1e6)
            print(f"hand-back {a.hand_back}, {i + 1} goals: RSS {samples[-1]:.0f} MB; the cache holds"
                  f" {controller.prompt_cache.conversations} goals, {controller.prompt_cache.bytes / 1e6:.0f} MB",
                  flush=True)
    print(f"hand-back {a.hand_back}: RSS {min(samples):.0f}-{max(samples):.0f} MB over the samples"
          + (f"; {len(seconds)} hand-backs, {1000 * statistics.median(seconds):.1f} ms median,"
             f" {1000 * max(seconds):.1f} ms at most" if seconds else ""))
    controller.close()


if __name__ == "__main__":
    main()
