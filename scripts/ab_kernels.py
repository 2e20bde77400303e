"""The CPU kernels at a git revision against the working tree's, both loaded in one process and interleaved
(runtime/cpu_kernels.c): the target's 1- and 5-token forward at two contexts, then held-out prompts (round-robin
over the zoo's workloads, each with its domain's draft) decoded alone and with the draft (adaptive gamma), and,
where the two compute differently, how close each stays to the fp32 target (its greedy answers teacher-forced
through the path: answer perplexity, share of positions whose argmax is the fp32 answer's token).

    .venv/bin/python scripts/ab_kernels.py HEAD int4 24      # revision, path (int4 | int8 | none), prompts
    .venv/bin/python scripts/ab_kernels.py HEAD int4 0       # the forwards only (verify rows and prefills)
"""

from __future__ import annotations

import ctypes
import math
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from ab_common import zoo

from memspec_ros.runtime import cpu_kernels
from memspec_ros.runtime.draft_forward import lean_forward_for
from memspec_ros.runtime.loader import load_models
from memspec_ros.runtime.speculative import KVState, forward_once, generate


def libraries(revision: str) -> dict:
    new, status = cpu_kernels._load()
    source = subprocess.run(["git", "show", f"{revision}:memspec_ros/runtime/cpu_kernels.c"], check=True,
                            capture_output=True, text=True).stdout
    folder = Path(tempfile.mkdtemp())
    (folder / "old.c").write_text(source)
    subprocess.run([*cpu_kernels._compiler(), *cpu_kernels.FLAGS, cpu_kernels.OPENMP, "-o", str(folder / "old.so"),
                    str(folder / "old.c"), "-lm"], check=True)
    old = ctypes.CDLL(str(folder / "old.so"))
    try:
        cpu_kernels._bind(old)
    except AttributeError:  # an older source without a function bound last (the forward's are bound first)
        pass
    return {"old": (old, status), "new": (new, status)}


def forward_ms(target, lean, context: int, rows: int, repeats: int = 11, keep: int = 0) -> float:
    """Median ms of a forward of ``rows`` after ``context`` cached positions, logits of the last ``keep`` (0: all,
    as a verify; 1: a prefill's)."""
    kv, times = KVState(), []
    with torch.inference_mode():
        forward_once(target, [1000 + i for i in range(context)], kv, 1, "cpu", lean)
        for r in range(repeats + 2):
            start = time.perf_counter()
            forward_once(target, [7 + i for i in range(rows)], kv, keep or rows, "cpu", lean)
            end = time.perf_counter()
            kv.crop_to(context)
            if r >= 2:
                times.append(end - start)
    return statistics.median(times) * 1000


def main(revision: str, path: str, count: int) -> None:
    import weakref

    from memspec_ros.runtime import gamma_choice

    libs = libraries(revision)
    # adaptive gamma's forward timings per library: shared, the second arm chose gamma from the first arm's costs
    costs = {w: (weakref.WeakKeyDictionary(), weakref.WeakKeyDictionary()) for w in libs}

    def use(which: str) -> None:
        cpu_kernels._load = lambda: libs[which]
        gamma_choice._TARGET_COSTS, gamma_choice._DRAFT_COSTS = costs[which]

    z = zoo(path, count)
    target, prompts, eos = z.target, z.prompts, z.eos
    lean = lean_forward_for(target)
    for context, rows, keep in ((64, 1, 0), (64, 5, 0), (200, 1, 0), (200, 5, 0), (64, 8, 0), (1, 64, 1),
                                (1, 256, 1)):
        times = {w: [] for w in libs}
        for rep in range(6):
            for w in (("old", "new") if rep % 2 == 0 else ("new", "old")):
                use(w)
                times[w].append(forward_ms(target, lean, context, rows, repeats=11 if rows < 64 else 3, keep=keep))
        old, new = (statistics.median(times[w]) for w in ("old", "new"))
        kind = f"prefill of {rows} tokens" if keep else f"forward, context {context}, {rows} rows"
        print(f"{path} {kind}: {revision} {old:.2f} ms, working tree {new:.2f} ms -> {old / new:.3f}x", flush=True)
    if count == 0:
        return
    totals = {(kind, w): [0.0, 0] for kind in ("alone", "adaptive") for w in libs}
    for w in libs:  # untimed: each library's one-off cost curves (adaptive gamma) before any timed decode
        use(w)
        generate(target, prompts[0], z.draft_for(0), gamma=4, max_new_tokens=8, eos_token_ids=eos, adaptive_gamma=True)
    same = 0
    for i, ids in enumerate(prompts):
        answers = {}
        for w in (("old", "new") if i % 2 == 0 else ("new", "old")):
            use(w)
            for kind in ("alone", "adaptive"):
                draft = z.draft_for(i) if kind == "adaptive" else None
                session = generate(target, ids, draft, gamma=4, max_new_tokens=128, eos_token_ids=eos,
                                   adaptive_gamma=kind == "adaptive")
                totals[(kind, w)][0] += session.stats.decode_seconds
                totals[(kind, w)][1] += session.stats.decode_tokens
                answers[(kind, w)] = session.generated_ids
            assert answers[("alone", w)] == answers[("adaptive", w)], "not lossless"
        same += answers[("alone", "old")] == answers[("alone", "new")]
    for kind in ("alone", "adaptive"):
        old, new = (totals[(kind, w)][1] / totals[(kind, w)][0] for w in ("old", "new"))
        print(f"{path} {kind}: {revision} {old:.1f} tok/s, working tree {new:.1f} -> {new / old:.3f}x")
    print(f"greedy answers the same with both: {same} of {len(prompts)} (each lossless against its own target)")
    if same == len(prompts) or path == "none":
        return
    use("old")  # the fp32 target's answers, then each library's path teacher-forced on them
    reference = load_models(Path("models/registry.yaml"), quantization="none", validate=False).target.model
    answers = [generate(reference, p, None, max_new_tokens=128, eos_token_ids=eos).generated_ids for p in prompts]
    for w in ("old", "new"):
        use(w)
        nll = agree = n = 0
        with torch.inference_mode():
            for prompt, answer in zip(prompts, answers, strict=True):
                # the rows that predict the answer's tokens: from the prompt's last position on
                logits = forward_once(target, prompt + answer, KVState(), len(answer) + 1, "cpu", lean)[:-1].float()
                wanted = torch.tensor(answer)
                nll -= float(torch.log_softmax(logits, -1)[torch.arange(len(answer)), wanted].sum())
                agree += int((logits.argmax(-1) == wanted).sum())
                n += len(answer)
        name = revision if w == "old" else "working tree"
        print(f"{path} on the fp32 answers, {name}: perplexity {math.exp(nll / n):.4f},"
              f" the fp32 token at {agree / n:.2%} of {n} positions")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]))
