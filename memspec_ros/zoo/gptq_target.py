"""GPTQ INT4 of the bundled target (GPT-QModel), calibrated on the zoo's training requests, and its report.

    memspec-zoo gptq quantize [--target pkg:...] [--requests 128]      # -> ~/.cache/memspec_ros/gptq/<digest>/
    memspec-zoo gptq report --json docs/results/gptq-smollm2.json      # fp32 / engine int4 / GPTQ INT4 side by side

GPT-QModel needs torch >= 2.14.1 and lives in ``.venv-gptq`` (requirements-gptq.txt); ``memspec-zoo
gptq`` runs this module there (``MEMSPEC_GPTQ_PYTHON`` names another interpreter) after resolving the
target (a ``pkg:``/GGUF source is converted once by runtime/model_source.py) to its safetensors
directory in the node's environment. ``python -m memspec_ros.zoo.gptq_target`` under an interpreter
with gptqmodel takes a directory directly.

Calibration: the first ``--requests`` training requests (models/workloads/train_requests.jsonl is
round-robin over domains, so any prefix is balanced; one that asks what a held-out request asks, in
any words, is passed over), each rendered through the chat template as the
node renders a goal, followed by the target's own greedy answer. Answers come from the zoo build's
stored teacher shards when they hold that request (``--answers``, default: the build's work dir named
in models/build_config.json), else the fp32 target answers it here once (cached beside the output).
The calibration never includes a held-out request.

The output directory is keyed by a digest of the target's weights, the calibration token ids, bits,
group size and the gptqmodel version, so a second run finds it. The LM head stays fp32 (GPT-QModel's
default); every linear of the 30 decoder layers is INT4, groups of 32.

The report (every figure measured in one process, under .venv-gptq's torch) compares fp32 (the
engine's lean path), the engine's own int4 path (runtime/forward_paths.py, Q4_1 grid) and the GPTQ
checkpoint, the latter run two ways, each prepared by load_model (gptq.prepare_for_engine: a verify's
rows attend one by one): ``gptq_int4`` in bf16 (GPT-QModel's fused AVX512 kernel takes bf16
activations only) and ``gptq_int4_fp32_activations`` (its layers dequantize each call; one prompt).
docs/results/gptq-smollm2.json also has ``gptq_int4_sdpa``, measured before load_model prepared GPTQ
targets (plain SDPA: not lossless, 8 of 12 prompts differed):

* perplexity of the held-out requests' fp32 greedy answers (the zoo's stored teacher answers, or made
  here), each after its templated request: the same token ids for every model; ``answer`` counts the
  answer tokens only, ``prompt`` the templated request's tokens after the first;
* decode tokens/s at 1 thread of each model alone (the engine's ``generate(target, ids, None)``,
  greedy, 128 tokens, no end-of-turn stop, prompt encoding excluded), models interleaved per prompt;
* ``outputs_identical`` per model: ``generate(target, ids, draft)`` with the bundled ``general`` draft
  (a reduced-vocabulary head) equals ``generate(target, ids, None)`` on every prompt; for GPTQ also
  transformers' own ``generate`` on it (``hf_generate_identical``).
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import math
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

from ..argtypes import controller_limit, group_size, output_file, positive_int
from ..runtime.atomic_write import held_lock, sync_dir, sync_tree
from ..runtime.jsonl import read_jsonl
from .corpora import WORKLOADS

ROOT = Path(__file__).resolve().parents[2]
MARKER = "memspec_gptq.json"  # written last: a directory without it is an interrupted run


def _log(msg: str) -> None:
    print(f"[gptq] {msg}", file=sys.stderr, flush=True)


def default_answers_dir(models: Path) -> Path | None:
    """``<work dir>/teacher`` of the build that made the zoo in ``models`` (build_config.json), if it exists."""
    from .chat_build import recorded_work_dir

    work = recorded_work_dir(models)
    return work / "teacher" if work is not None and (work / "teacher").is_dir() else None


def weights_digest(model_dir: Path) -> str:
    """SHA-256 over the directory's safetensors files (names and bytes)."""
    h = hashlib.sha256()
    for f in sorted(model_dir.glob("*.safetensors")):
        h.update(f.name.encode())
        with f.open("rb") as fh:
            for block in iter(lambda: fh.read(1 << 22), b""):
                h.update(block)
    return h.hexdigest()


def answered(target_dir: Path, rows: list[dict], answers_dir: Path | None, work: Path, split: str,
             threads: int, target_digest: str | None = None) -> tuple[list[tuple[list[int], list[int]]], int]:
    """(prompt ids, fp32 greedy answer ids) per row, and how many of them were stored already.

    Stored answers (``answers_dir/<split>-*.safetensors``) are matched by prompt ids; the rest are
    answered by the fp32 target into ``work`` (resumable shards keyed by the rows they hold).
    """
    import torch
    from tqdm import tqdm

    from memspec_ros.runtime.models import ModelSpec, load_model, load_tokenizer

    from .teacher import TeacherConfig, answer_requests, chat_prompt_ids, load_answers

    tokenizer = load_tokenizer(target_dir)
    prompts = [chat_prompt_ids(tokenizer, r["messages"]) for r in rows]
    stored = {}
    if answers_dir is not None and answers_dir.is_dir():
        stored = {tuple(a.prompt_ids): a.answer_ids for a in load_answers(answers_dir, split)}
    hits = sum(tuple(p) in stored for p in prompts)
    missing = [r for r, p in zip(rows, prompts, strict=True) if tuple(p) not in stored]
    if missing:
        # keyed by the target too: by the prompts alone, a re-released target found the old one's folder, which the
        # stored digest then refused
        key = hashlib.sha256(json.dumps([[chat_prompt_ids(tokenizer, r["messages"]) for r in missing],
                                         target_digest or ""]).encode())
        out = work / f"answers-{split}-{key.hexdigest()[:16]}"
        torch.set_num_threads(threads)
        model = load_model(ModelSpec(str(target_dir))).model
        _log(f"{len(missing)} {split} requests without a stored answer: the fp32 target answers them ({out})")
        with tqdm(total=len(missing), desc=f"answers {split}", unit="req") as bar:
            # marked with the target's digest (model_source.answers_identity, as the build's answers): answers another
            # target made there are refused, not reused
            answer_requests(model, tokenizer, missing, out, split, TeacherConfig(batch_size=16), bar, target_digest)
        del model
        stored.update({tuple(a.prompt_ids): a.answer_ids for a in load_answers(out, split)})
    return [(p, stored[tuple(p)]) for p in prompts], hits


# -- quantize ----------------------------------------------------------------------------------------

def calibration_rows(models: Path, requests: int) -> tuple[list[dict], int]:
    """The first ``requests`` training requests that ask nothing a held-out request asks, and how many
    were passed over for that. Compared by material (chat_workloads.request_material: the problem,
    clause or paragraph a request quotes), not by text: "Solve x^2 - 16x + 63 = 0." in training and
    "Can you help me with this? Solve x^2 - 16x + 63 = 0." held out are one request, and the report's
    perplexity is measured on the held-out ones."""
    from .chat_workloads import heldout_material, request_material

    heldout = heldout_material(models / "workloads")
    rows, skipped = [], 0
    for r in read_jsonl(models / "workloads" / "train_requests.jsonl"):
        if len(rows) == requests:
            break
        if request_material(r["prompt"]) & heldout:
            skipped += 1
        else:
            rows.append(r)
    return rows, skipped


def quantize_target(target_dir: Path, models: Path, requests: int, answers_dir: Path | None, bits: int = 4,
                    group_size: int = 32, threads: int = 2, out_root: Path | None = None, sym: bool = True,
                    target_digest: str | None = None) -> Path:
    """The GPTQ checkpoint of ``target_dir`` calibrated on ``requests`` training requests (cached)."""
    import gptqmodel
    import torch

    from memspec_ros.runtime.gptq import quantize_gptq
    from memspec_ros.runtime.model_source import cache_root

    root = Path(out_root) if out_root else cache_root() / "gptq"
    root.mkdir(parents=True, exist_ok=True)
    rows, skipped = calibration_rows(models, requests)
    seqs, hits = answered(target_dir, rows, answers_dir, root, "train", threads, target_digest)
    ids = [p + a for p, a in seqs]
    h = hashlib.sha256()
    h.update(weights_digest(target_dir).encode())
    h.update(json.dumps({"ids": ids, "bits": bits, "group_size": group_size, "gptqmodel": gptqmodel.__version__}
                        | ({} if sym else {"sym": False})).encode())
    digest = h.hexdigest()
    out = root / digest[:24]
    # one process quantizes and publishes a digest at a time: without it a second one that found no marker removed
    # the first's published folder (its "interrupted run") while the first was loading from it
    lock = root / f".{digest[:24]}.lock"
    with held_lock(lock, lambda: _log(f"another process is quantizing the same run (it holds {lock}): waiting")):
        if (out / MARKER).is_file():  # made before, or by the process that held the lock
            _log(f"cached: {out}")
            return out
        torch.set_num_threads(threads)
        os.environ.setdefault("GPTQMODEL_CPU_WORKERS", str(threads))
        tmp = Path(tempfile.mkdtemp(prefix=f".{digest[:24]}-", dir=root))
        try:
            tokens = sum(map(len, ids))
            _log(f"quantizing {target_dir} to INT{bits} (groups of {group_size}) on {len(ids)} calibration sequences,"
                 f" {tokens} tokens ({hits} answers stored, {len(ids) - hits} made here);"
                 " GPT-QModel shows per-layer progress")
            t0 = time.perf_counter()
            with contextlib.chdir(tmp):  # GPT-QModel writes a logs/ folder into the working directory
                quantize_gptq(target_dir, tmp / "model", ids, bits, group_size, sym)
            seconds = time.perf_counter() - t0
            model_dir = tmp / "model"
            (model_dir / MARKER).write_text(json.dumps({
                "source": str(target_dir), "source_sha256": weights_digest(target_dir), "digest": digest,
                "bits": bits, "group_size": group_size, "sym": sym, "gptqmodel": gptqmodel.__version__,
                "torch": torch.__version__, "threads": threads, "seconds": round(seconds, 1),
                "calibration": {"requests": len(ids), "tokens": tokens, "stored_answers": hits,
                                "skipped_as_heldout_text": skipped,
                                "source": "models/workloads/train_requests.jsonl (first N, round-robin over domains):"
                                          " chat template + the fp32 target's greedy answer"},
            }, indent=1))
            # on disk before it is published: renamed first, a power cut could leave the marker over weights
            # never written (as the GGUF conversion's cache, model_source.converted_dir, syncs its folder)
            sync_tree(model_dir)
            if out.exists():  # an interrupted run's (the lock is held: no other process publishes it now)
                shutil.rmtree(out)
            os.replace(model_dir, out)
            sync_dir(out.parent)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        _log(f"quantized in {seconds:.1f} s")
        return out


# -- report ------------------------------------------------------------------------------------------

def speed_run(model, draft, ids: list[int], domain: str, max_new_tokens: int, gamma: int) -> dict:
    """One prompt's timed generations: the model alone, then with the draft."""
    from memspec_ros.runtime.speculative import generate

    alone = generate(model, ids, None, max_new_tokens=max_new_tokens)
    spec = generate(model, ids, draft, max_new_tokens=max_new_tokens, gamma=gamma)
    return {"domain": domain, "prompt_tokens": len(ids), "tokens": alone.generated_ids,
            "tok_s": alone.stats.tokens_per_second, "alone": alone.stats, "spec": spec.stats,
            "identical": spec.generated_ids == alone.generated_ids}


def speed_line(run: dict) -> str:
    return (f"alone {run['tok_s']:6.1f} tok/s, with draft {run['spec'].tokens_per_second:6.1f} tok/s,"
            f" identical {run['identical']}")


def speed_figures(runs: list[dict]) -> dict:
    """A model's speed figures over its prompts' :func:`speed_run` records: rates of the sums (runtime/stats.py),
    not means of per-prompt rates (the report's before session 44: docs/results/gptq-smollm2.json)."""
    from memspec_ros.runtime.stats import GenerationTotals

    spec = GenerationTotals.of(r["spec"] for r in runs)
    return {"decode_tok_s_1thread": round(GenerationTotals.of(r["alone"] for r in runs).tokens_per_second, 2),
            "decode_tok_s_per_prompt": [round(r["tok_s"], 2) for r in runs],
            "speculative_tok_s_1thread": round(spec.tokens_per_second, 2),
            "speculative_mean_accepted": round(spec.mean_accepted, 3),
            "outputs_identical": all(r["identical"] for r in runs),
            "speed_prompts": len(runs)}


def perplexity(model, seqs: list[tuple[list[int], list[int]]]) -> dict:
    """Perplexity of the answer tokens (each after its prompt) and of the prompt tokens after the first."""
    import torch

    nll = {"answer": 0.0, "prompt": 0.0}
    count = {"answer": 0, "prompt": 0}
    with torch.inference_mode():
        for prompt, answer in seqs:
            ids = torch.tensor([prompt + answer])
            logp = torch.log_softmax(model(input_ids=ids).logits[0, :-1].float(), dim=-1)
            token_nll = -logp.gather(1, ids[0, 1:, None])[:, 0]
            split = len(prompt) - 1  # positions < split predict prompt tokens, the rest answer tokens
            nll["prompt"] += float(token_nll[:split].sum())
            nll["answer"] += float(token_nll[split:].sum())
            count["prompt"] += split
            count["answer"] += len(answer)
    return {k: round(math.exp(nll[k] / count[k]), 4) for k in nll} | {f"{k}_tokens": count[k] for k in count}


def report(target_dir: Path, gptq_dir: Path, draft_dir: Path, models: Path, answers_dir: Path | None,
           ppl_per_workload: int, speed_per_workload: int, max_new_tokens: int, gamma: int, threads: int,
           target_digest: str | None = None) -> dict:
    import torch

    from memspec_ros.runtime.models import ModelSpec, load_model, load_tokenizer, parameter_bytes
    from memspec_ros.runtime.prompt_cache import common_prefix
    from memspec_ros.runtime.speculative import generate
    from memspec_ros.runtime.stats import GenerationTotals, paired_ratio, ratio, rounded
    from memspec_ros.zoo.teacher import chat_prompt_ids

    heldout = {w: read_jsonl(models / "workloads" / f"{w}.jsonl") for w in WORKLOADS}
    ppl_rows = [r for w in WORKLOADS for r in heldout[w][:ppl_per_workload]]
    ppl_seqs, ppl_hits = answered(target_dir, ppl_rows, answers_dir, gptq_dir.parent, "heldout", threads,
                                  target_digest)

    torch.set_num_threads(threads)
    # GPT-QModel's fused CPU kernel (TorchCpuAvx512Linear) takes bf16 activations only: with fp32 ones
    # its layers dequantize the whole weight on every call instead (measured ~3 tok/s here), so the
    # GPTQ checkpoint runs in bf16 (load_model makes it row-consistent with gptq.prepare_for_engine);
    # with fp32 activations (first speed prompt only) it is measured too
    specs = {"fp32": ModelSpec(str(target_dir)), "engine_int4": ModelSpec(str(target_dir), quantization="int4"),
             "gptq_int4": ModelSpec(str(gptq_dir), dtype="bf16", quantization="gptq"),
             "gptq_int4_fp32_activations": ModelSpec(str(gptq_dir), quantization="gptq")}
    speed_limit = {"gptq_int4_fp32_activations": 1}  # prompts; the others run every speed prompt
    loaded, prepared = {}, {}
    for name, spec in specs.items():
        t0 = time.perf_counter()
        loaded[name] = load_model(spec)
        if loaded[name].prepared is not None:
            prepared[name] = loaded[name].prepared
        _log(f"{name}: loaded in {time.perf_counter() - t0:.1f} s ({loaded[name].forward_path})"
             f" {prepared.get(name, '')}")
    draft = load_model(ModelSpec(str(draft_dir))).model
    gptq_layers = sorted({type(m).__name__ for m in loaded["gptq_int4"].model.modules()
                          if type(m).__module__.startswith("gptqmodel")})

    results: dict[str, dict] = {name: {} for name in loaded}
    for name, lm in loaded.items():
        t0 = time.perf_counter()
        results[name]["perplexity"] = perplexity(lm.model, ppl_seqs)
        _log(f"{name}: perplexity {results[name]['perplexity']} in {time.perf_counter() - t0:.0f} s")

    tokenizer = load_tokenizer(target_dir)
    speed_rows = [r for w in WORKLOADS for r in heldout[w][:speed_per_workload]]
    prompts = [chat_prompt_ids(tokenizer, r["messages"]) for r in speed_rows]
    torch.set_num_threads(1)
    load_before = os.getloadavg()
    names = list(loaded)
    for name in names:  # warm-up: first-call allocations and kernel selection stay out of the timings
        generate(loaded[name].model, prompts[0][:16], None, max_new_tokens=8)
        generate(loaded[name].model, prompts[0][:16], draft, max_new_tokens=8, gamma=gamma)
    runs: dict[str, list[dict]] = {name: [] for name in names}
    for i, (row, ids) in enumerate(zip(speed_rows, prompts, strict=True)):
        order = names[i % len(names):] + names[:i % len(names)]  # interleaved, each model first in turn
        for name in order:
            if i >= speed_limit.get(name, len(prompts)):
                continue
            model = loaded[name].model
            run = speed_run(model, draft, ids, row["domain"], max_new_tokens, gamma)
            if name.startswith("gptq"):
                # an explicit mask: without one, generate() masks every prompt token equal to the pad id,
                # and SmolLM2's pad id is <|im_end|>, which ends each chat turn of the prompt
                t = torch.tensor([ids])
                hf = model.generate(t, attention_mask=torch.ones_like(t), do_sample=False,
                                    max_new_tokens=max_new_tokens, eos_token_id=None,
                                    pad_token_id=tokenizer.pad_token_id or 0)[0, len(ids):].tolist()
                run["hf_identical"] = hf == run["tokens"]
            runs[name].append(run)
            _log(f"prompt {i + 1}/{len(prompts)} {row['domain']:8s} {name:12s} {speed_line(run)}")

    load_after = os.getloadavg()
    fp32_tokens = [r["tokens"] for r in runs["fp32"]]
    for name in names:
        rs = runs[name]
        results[name].update({
            "forward_path": loaded[name].forward_path,
            "weight_bytes": parameter_bytes(loaded[name].model),
            **speed_figures(rs),
            "tokens_agreeing_with_fp32_greedy": [common_prefix(r["tokens"], f)
                                                 for r, f in zip(rs, fp32_tokens, strict=False)],
        })
        if name in prepared:
            results[name]["prepare_for_engine"] = prepared[name]
        if name.startswith("gptq"):
            results[name]["attention"] = loaded[name].model.config._attn_implementation
            results[name]["hf_generate_identical"] = all(r["hf_identical"] for r in rs)
    fp = results["fp32"]
    for name in names[1:]:
        # over the prompts both ran (a variant limited to fewer speed prompts against fp32's on the same ones)
        shared = len(runs[name])
        fp_shared = GenerationTotals.of(r["alone"] for r in runs["fp32"][:shared]).tokens_per_second
        mine_tps = GenerationTotals.of(r["alone"] for r in runs[name]).tokens_per_second  # unrounded
        results[name]["speedup_vs_fp32"] = rounded(ratio(mine_tps, fp_shared), 3)
        # per prompt against fp32 on the same prompt moments apart: steadier on a shared machine
        mine = runs[name][:len(runs["fp32"])]
        per_prompt = paired_ratio([r["tok_s"] for r in mine], [f["tok_s"] for f in runs["fp32"][:len(mine)]])
        results[name]["speedup_vs_fp32_median_per_prompt"] = rounded(per_prompt, 3)
        results[name]["answer_perplexity_ratio_vs_fp32"] = rounded(
            ratio(results[name]["perplexity"]["answer"], fp["perplexity"]["answer"]), 4)
    gptq_meta = json.loads((gptq_dir / MARKER).read_text(encoding="utf-8")) if (gptq_dir / MARKER).is_file() else {}
    quant = json.loads((gptq_dir / "config.json").read_text(encoding="utf-8")).get("quantization_config", {})
    return {
        "what": "SmolLM2-135M-Instruct (the bundled target) in fp32, the engine's own int4 path (Q4_1 grid, groups"
                " of 32, ATen kernel, head int8) and GPTQ INT4 from GPT-QModel (groups of 32, LM head not quantized),"
                " run"
                " with bf16 activations (its fused AVX512 kernel; embeddings, norms and head bf16) and with fp32"
                " activations (its layers dequantize the weight on each call)",
        "command": "memspec-zoo gptq report --json docs/results/gptq-smollm2.json",
        "perplexity_text": "held-out chat requests through the chat template, each followed by the fp32 target's own"
                           " greedy answer (up to 128 tokens); the same token ids for every model. 'answer': the"
                           " answer tokens given the request; 'prompt': the templated request's tokens after the first",
        "perplexity_requests": len(ppl_seqs), "perplexity_per_workload": ppl_per_workload,
        "perplexity_answers_stored": ppl_hits,
        "speed": {"threads": 1, "max_new_tokens": max_new_tokens, "greedy": True, "eos_stop": False,
                  "prompts": len(prompts), "per_workload": speed_per_workload,
                  "metric": "decode tokens/s of generate(target, ids, None), prompt encoding excluded; models"
                            " interleaved per prompt",
                  "loadavg_1_5_15_before_after": [[round(v, 2) for v in load] for load in (load_before, load_after)],
                  "cpus": os.cpu_count(), "draft": str(draft_dir.relative_to(ROOT))
                  if draft_dir.is_relative_to(ROOT) else str(draft_dir), "gamma": gamma},
        "outputs_identical": {n: results[n]["outputs_identical"] for n in names},
        "gptq": {"quantization_config": {k: quant.get(k) for k in ("quant_method", "bits", "group_size", "desc_act",
                                                                    "sym", "format", "lm_head") if k in quant},
                 "kernels": gptq_layers, "quantize_seconds": gptq_meta.get("seconds"),
                 "quantize_threads": gptq_meta.get("threads"), "calibration": gptq_meta.get("calibration"),
                 "gptqmodel": gptq_meta.get("gptqmodel")},
        "torch": torch.__version__, "cpu": _cpu_name(),
        "models": results,
    }


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""


# -- command line ------------------------------------------------------------------------------------

def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="gptq_command", required=True)
    for name, help_ in (("quantize", "quantize the target to GPTQ INT4 (cached) and print where it went"),
                        ("report", "quantize if needed, then compare fp32 / engine int4 / GPTQ INT4 (JSON)")):
        p = sub.add_parser(name, help=help_)
        p.add_argument("--target", default=None,
                       help="HF directory (in the node's environment also .gguf / pkg:);"
                            " default: the zoo's registry target")
        p.add_argument("--models", default=str(ROOT / "models"), help="the zoo: workloads, build_config.json, drafts")
        p.add_argument("--requests", type=positive_int, default=128, help="training requests to calibrate on")
        p.add_argument("--answers", default=None, metavar="DIR",
                       help="stored teacher answers (train-*/heldout-*.safetensors); default: the zoo build's")
        p.add_argument("--bits", type=int, choices=(2, 3, 4, 8), default=4, help="GPTQ bits (default 4)")
        p.add_argument("--group-size", type=group_size, default=32,
                       help="input columns per scale, or -1 for one group per row (default 32)")
        p.add_argument("--sym", action=argparse.BooleanOptionalAction, default=True,
                       help="symmetric grid (a scale per group); --no-sym adds a zero point per group")
        p.add_argument("--threads", type=positive_int, default=2, help="threads for quantizing and perplexities")
        p.add_argument("--out-root", default=None, help="default: $XDG_CACHE_HOME/memspec_ros/gptq")
        # set by cli() for the run in .venv-gptq: --target is then the converted folder, whose digest is not the
        # GGUF's that the build's answers record
        p.add_argument("--target-digest", default=None, help=argparse.SUPPRESS)
        if name == "report":
            p.add_argument("--json", required=True, type=output_file)  # checked before the quantization's minutes
            p.add_argument("--draft", default=None, help="default: <models>/drafts/general")
            p.add_argument("--ppl-per-workload", type=positive_int, default=25)
            p.add_argument("--speed-per-workload", type=positive_int, default=2)
            p.add_argument("--max-new-tokens", type=positive_int, default=128)
            p.add_argument("--gamma", type=controller_limit("gamma"), default=4)


def check_stored_answers(answers: Path | None, digest: str) -> None:
    """SystemExit unless the stored answers (a zoo build's teacher folder) are the target's of ``digest``
    (model_source.answers_identity), cut at the length this report describes: matched by prompt ids alone, another
    model's or longer answers were measured silently."""
    from .teacher import TeacherConfig, answered_limits, answered_targets

    if answers is None or not answers.is_dir():
        return
    length = TeacherConfig().max_new_tokens
    for split in ("train", "heldout"):
        others = answered_targets(answers, split) - {digest}
        if others:
            raise SystemExit(f"the {split} answers in {answers} were made by another target than this one:"
                             " give that target's answers with --answers, or another folder (they are made anew)")
        lengths = answered_limits(answers, split) - {length}
        if lengths:
            raise SystemExit(f"the {split} answers in {answers} were cut at max_new_tokens {sorted(lengths)}, not the"
                             f" {length} this report measures: give --answers a folder of {length}-token answers")


def run(a: argparse.Namespace) -> int:
    models = Path(a.models)
    answers = Path(a.answers) if a.answers else default_answers_dir(models)
    from memspec_ros.runtime.model_source import answers_identity

    spec = a.target or registry_target(models)
    # what the build's answers record: a GGUF's own digest, not its converted folder's
    digest = a.target_digest or answers_identity(spec)
    check_stored_answers(answers, digest)
    target = _resolved(spec)
    out = quantize_target(target, models, a.requests, answers, a.bits, a.group_size, a.threads,
                          Path(a.out_root) if a.out_root else None, a.sym, digest)
    print(f"GPTQ INT{a.bits} checkpoint: {out}")
    if a.gptq_command == "report":
        draft = (Path(a.draft) if a.draft else models / "drafts" / "general").resolve()
        result = report(target, out, draft, models, answers, a.ppl_per_workload, a.speed_per_workload,
                        a.max_new_tokens, a.gamma, a.threads, digest)
        from memspec_ros.runtime.atomic_write import write_text_atomic

        Path(a.json).parent.mkdir(parents=True, exist_ok=True)
        write_text_atomic(a.json, json.dumps(result, indent=1) + "\n")  # a cut write left half a committed report
        print(json.dumps({n: {k: m[k] for k in ("perplexity", "decode_tok_s_1thread", "outputs_identical")}
                          for n, m in result["models"].items()}, indent=1))
        print(f"report: {a.json}")
    return 0


def gptq_python() -> Path | None:
    """The interpreter that has GPT-QModel: this one, MEMSPEC_GPTQ_PYTHON, or <repo>/.venv-gptq."""
    import importlib.util

    if importlib.util.find_spec("gptqmodel") is not None:
        return None  # this one
    path = Path(os.environ.get("MEMSPEC_GPTQ_PYTHON", ROOT / ".venv-gptq" / "bin" / "python"))
    if not path.is_file():
        raise SystemExit(f"memspec-zoo gptq: GPT-QModel is not installed here and {path} is missing:"
                         " `make setup` builds .venv-gptq (requirements-gptq.txt)")
    return path


def cli(a: argparse.Namespace, argv: list[str]) -> int:
    """``memspec-zoo gptq ARGS``: run here when gptqmodel imports, else ``python -m memspec_ros.zoo.gptq_target
    ARGS`` in .venv-gptq, with the target resolved here (a pkg:/GGUF source needs this environment's packages)."""
    import subprocess

    from memspec_ros.runtime.model_source import answers_identity

    python = gptq_python()
    if python is None:
        return run(a)
    spec = a.target or registry_target(Path(a.models))
    target = str(_resolved(spec))
    # drop --target X / --target=X (and a --target-digest), then name the directory and the spec's own digest
    named = ("--target", "--target-digest")
    argv = [arg for i, arg in enumerate(argv)
            if not (arg in named or arg.split("=", 1)[0] in named or (i and argv[i - 1] in named))]
    env = dict(os.environ, PYTHONPATH=str(ROOT), HF_HUB_OFFLINE="1")
    env.pop("PYTHONHOME", None)
    cmd = [str(python), "-m", "memspec_ros.zoo.gptq_target", *argv, "--target", target,
           "--target-digest", answers_identity(spec)]
    return subprocess.run(cmd, env=env).returncode


def registry_target(models: Path) -> str:
    """The target named by ``<models>/registry.yaml``, as the registry resolves it."""
    import yaml

    from memspec_ros.runtime.model_source import relative_to

    registry = models / "registry.yaml"
    if not registry.is_file():
        raise SystemExit(f"no zoo at {models} (registry.yaml missing): pass --models, or --target")
    target = (yaml.safe_load(registry.read_text(encoding="utf-8")) or {}).get("target") or {}
    path = target.get("path", "") if isinstance(target, dict) else str(target)
    if not path:
        raise SystemExit(f"{models}/registry.yaml names no target: give --target")
    return relative_to(models, path)


def _resolved(target: str) -> Path:
    """The safetensors directory of a target spec (a pkg:/GGUF source is converted once, then cached)."""
    from memspec_ros.runtime.model_source import is_model_source, resolve_model_path

    return resolve_model_path(target) if is_model_source(target) else Path(target).resolve()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m memspec_ros.zoo.gptq_target", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
