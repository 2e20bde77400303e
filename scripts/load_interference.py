"""How much a draft load on the cache's loader thread slows decoding on the other core.

The policy bench's simulator validation (docs/results) replays MemSpec, Oracle-Dynamic and MAB-Async 3-8%
faster than they ran when it assumes one machine speed for every generation ("pooled"), and within 3% when each
generation's replay is scaled by the speed the target's verifies ran at in it: generations that load drafts run
slower. This measures why, in one process: the same speculative generation (int4 target and its ``general`` draft,
1 thread, the zoo's first held-out prompt) timed alone and while a second thread keeps doing one part of a draft
load through the emulated eMMC (runtime/storage.py):

    read    the paced cold read of the draft's safetensors (sleeps between requests, so it releases the GIL)
    build   building the model from those bytes in memory (transformers' from_pretrained, the int4 path's
            quantization and packing, the reduced vocabulary's wrapper): what a draft's first load does after reading
    load    a whole load, as the cache's loader thread does it: after the draft's first load, a cold read of its
            runtime form and the ~3 ms that put its tensors into an emptied copy of the model (storage.RuntimeForm)

Each kind alternates with a run alone, twice. Reported: the median verify (a C call, no GIL: what the other core's
work costs the target's forward through shared caches and memory) and the wall time per iteration (also the GIL the
decode thread waits for between its calls). The loads here run back to back; in the bench a load is in flight for
a share of a generation only, so its effect there is that share of the slowdown.

    .venv/bin/python scripts/load_interference.py --json docs/results/load-interference.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
from pathlib import Path

import torch

from memspec_ros.bench.cli import round_robin_prompts
from memspec_ros.runtime.cache import registry_loader
from memspec_ros.runtime.loader import load_models
from memspec_ros.runtime.models import ModelSpec, safetensors_files
from memspec_ros.runtime.speculative import SpeculativeSession
from memspec_ros.runtime.storage import DraftStorage, build_model, read_cold, storage_medium

KINDS = ("read", "build", "load")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=200, help="new tokens per timed generation (default 200)")
    ap.add_argument("--reps", type=int, default=2, help="alone/with pairs per kind (default 2)")
    ap.add_argument("--json", type=Path, help="write the figures here")
    args = ap.parse_args()
    torch.set_num_threads(1)
    models = load_models(Path("models/registry.yaml"), quantization="int4", validate=False)
    prompt = round_robin_prompts(models.tokenizer, Path("models/workloads"), 1)[0]
    storage = DraftStorage(storage_medium("emmc"))
    load = registry_loader(models.registry, storage=storage, quantization="int4")
    draft = load("general").model
    entry = models.registry.get("code")
    spec = ModelSpec(path=entry.path, dtype="fp32", device="cpu", quantization="int4")
    files = safetensors_files(spec.path)
    blobs = [f.read_bytes() for f in files]
    work = {
        "read": lambda: [read_cold(f, storage.medium) for f in files],
        "build": lambda: build_model(spec, blobs),
        "load": lambda: load("code"),
    }
    load("code")  # its first load builds it and writes its runtime form: the timed loads read that

    def generation() -> tuple[float, float]:
        session = SpeculativeSession(models.target.model, prompt, max_new_tokens=args.tokens, gamma=4)
        session.prefill()
        while not session.finished:
            session.step("general", draft)
        its = session.stats.iterations
        return (statistics.median(it.verify_seconds for it in its) * 1e3,
                session.stats.decode_seconds / len(its) * 1e3)

    def beside(kind: str) -> tuple[float, float, int]:
        stop, done = threading.Event(), [0]

        def loop() -> None:
            while not stop.is_set():
                work[kind]()
                done[0] += 1

        thread = threading.Thread(target=loop, name=f"memspec-{kind}")
        thread.start()
        try:
            verify, wall = generation()
        finally:
            stop.set()
            thread.join()
        return verify, wall, done[0]

    generation()  # warm
    rows = {}
    for kind in KINDS:
        alone, loaded, count = [], [], 0
        for _ in range(args.reps):
            alone.append(generation())
            v, w, n = beside(kind)
            loaded.append((v, w))
            count += n
        verify_ratio = statistics.median(b[0] / a[0] for a, b in zip(alone, loaded, strict=True))
        wall_ratio = statistics.median(b[1] / a[1] for a, b in zip(alone, loaded, strict=True))
        rows[kind] = {"alone_verify_ms": [a[0] for a in alone], "alone_wall_ms": [a[1] for a in alone],
                      "with_verify_ms": [b[0] for b in loaded], "with_wall_ms": [b[1] for b in loaded],
                      "verify_ratio": verify_ratio, "wall_per_iteration_ratio": wall_ratio, "operations": count}
        print(f"{kind:6s} verify x{verify_ratio:.3f}  wall per iteration x{wall_ratio:.3f}"
              f"  ({count} {kind}s in {args.reps} generations)", flush=True)
    if args.json:
        args.json.write_text(json.dumps({
            "what": __doc__.split("\n\n")[0], "command": " ".join(["scripts/load_interference.py", *sys.argv[1:]]),
            "tokens": args.tokens, "reps": args.reps, "medium": storage.medium.name, "kinds": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
