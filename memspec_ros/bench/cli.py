"""`memspec-bench`: the project's benchmarks (speed claims live here, never in unit tests)."""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import sys
from dataclasses import asdict
from pathlib import Path

from ..argtypes import (
    controller_limit,
    json_output_file,
    output_file,
    positive_int,
    thread_counts,
    unwritable,
)
from ..runtime import bundled_zoo_dir
from ..runtime.atomic_write import write_result_text
from .action_bench import node_parameter_range

DEFAULT_ZOO = bundled_zoo_dir()


_GAMMA, _CAPACITY, _INTERVAL = (controller_limit(name) for name in ("gamma", "capacity", "interval"))
TINY_ZOO = "tiny"  # --zoo tiny: generated tiny models (fast, their speed-ups say little)
ACTION_GOAL = 0.97  # the ROS path's steady-state tok/s over a direct call's (median of interleaved pairs)


@contextlib.contextmanager
def _named_row_errors(bench: str):
    """A workload line the bench cannot use ends it with the file and line, not a traceback."""
    from ..zoo.workloads import WorkloadFileError

    try:
        yield
    except WorkloadFileError as exc:
        raise SystemExit(f"memspec-bench {bench}: {exc}") from None


def _bench_zoo(args) -> Path | None:
    """--zoo of the engine, action and soak benches: a built zoo's folder, or None for generated tiny models
    (--zoo tiny, or the bundled zoo's default when this install has none, said on stderr). A folder named
    that holds no zoo is refused: a typo ran the tiny models and exited 0."""
    if args.zoo == TINY_ZOO:
        return None
    zoo = Path(args.zoo)
    if (zoo / "registry.yaml").is_file():
        return zoo
    if zoo == DEFAULT_ZOO:
        print(f"no bundled zoo at {zoo}: generated tiny models (speed-ups here say little)", file=sys.stderr)
        return None
    raise SystemExit(f"--zoo {zoo}: no zoo there (registry.yaml missing): pass a built zoo's folder, or"
                     f" '{TINY_ZOO}' for generated tiny models")


# engine options the generated tiny models cannot honour, with their defaults
TINY_IGNORES = {"quantization": "none", "draft_quantization": "none", "dtype": "fp32", "workloads_dir": None,
                "draft": "general", "storage": "emmc"}


def _engine_models(args):
    """The zoo's target and one draft, the prompts, the two models' names and the target's tokenizer (None: generated
    tiny models when no zoo is there)."""
    from ..runtime.models import ModelLoadError, ModelSpec, load_model, tokenizer_fingerprint

    # with --target the zoo only lends its workloads (if it has them); else it is the models' source
    zoo = (None if args.zoo == TINY_ZOO else Path(args.zoo)) if args.target else _bench_zoo(args)
    if args.target or zoo is not None:
        from ..runtime.loader import DraftLists, load_models
        from ..runtime.registry import DraftRegistry

        workloads = Path(args.workloads_dir) if args.workloads_dir else zoo / "workloads" if zoo else None
        try:  # read before the models load: a bad row or registry is named in seconds, not after the loads
            rows = _round_robin_rows(workloads, args.prompts) if workloads and workloads.is_dir() else []
            registry_file = None if args.target else zoo / "registry.yaml"
            names = DraftRegistry.from_yaml(registry_file, validate=False).names() if registry_file else [args.draft]
        except (OSError, ValueError) as exc:  # RegistryError is a ValueError
            raise SystemExit(f"memspec-bench engine: {exc}") from None
        if args.workloads_dir and not rows:
            raise SystemExit(f"--workloads-dir {workloads}: no workload rows there (<name>.jsonl files)")
        if args.draft not in names:  # before the target loads
            raise SystemExit(f"--draft {args.draft}: not in {registry_file}; use one of {', '.join(names)}")
        drafts = DraftLists([args.draft], [args.draft_path]) if args.target else None
        try:  # a model that cannot load (a missing folder, a GPTQ path without its checkpoint) says why, no traceback
            models = load_models(registry_file, drafts=drafts, target_path=args.target, dtype=args.dtype,
                                 quantization=args.quantization, gamma=args.gamma, validate=False)
            draft_path = models.registry.get(args.draft).path
            draft = load_model(ModelSpec(draft_path, dtype=models.draft_dtype, quantization=args.draft_quantization))
        except (ModelLoadError, ValueError) as exc:  # RegistryError is a ValueError
            raise SystemExit(f"memspec-bench engine: {exc}") from None
        target, tokenizer, target_path = models.target, models.tokenizer, models.target.spec.path
        args.forward_paths = {"target": target.forward_path, "draft": draft.forward_path,
                              "target_auto": target.path_choice.as_dict() if target.path_choice else None}
        prompts = _unique_prompt_ids(tokenizer, rows, args.prompts) or [tokenizer("The robot")["input_ids"]]
        if len(prompts) < args.prompts:
            print(f"memspec-bench engine: {len(prompts)} distinct prompt(s), not the {args.prompts} asked for"
                  + (f" (the workloads in {workloads} have no more)" if rows else
                     " (no workloads: give --workloads-dir; 'The robot' stands in)"), file=sys.stderr)
        args.tokenizer_fingerprint = tokenizer_fingerprint(tokenizer)  # a --datastore must be made for it
        return target.model, draft.model, prompts, (target_path, draft_path), tokenizer
    from ..testing.tiny_models import noisy_copy, tiny_llama

    # generated tiny models: the options that choose a zoo's models, paths and prompts would be ignored
    ignored = [f"--{name.replace('_', '-')} {getattr(args, name)}" for name, default in TINY_IGNORES.items()
               if getattr(args, name, default) != default]
    if ignored:
        raise SystemExit(f"memspec-bench engine: {', '.join(ignored)} has no effect on generated tiny models (no"
                         " zoo): pass --zoo <a built zoo> or --target <model dir>, or leave them out")
    target = tiny_llama(vocab_size=512, hidden=256, layers=8, seed=0, init_range=0.1)
    draft = noisy_copy(target, 0.02)
    draft.model.layers = draft.model.layers[:1]  # a one-layer cut of the target: cheap, partly agreeing
    draft.config.num_hidden_layers = 1
    prompts = [[1, 7 + i, 9 + i, 20 + i] for i in range(args.prompts)]
    return target, draft, prompts, ("tiny-target", "tiny-draft"), None


def _round_robin_rows(folder: Path, count: int) -> list[dict]:
    """Rows taken in turn from each workload of ``folder`` (any <name>.jsonl rows, chat rows too), up to ``count``
    of each: enough for ``count`` distinct prompts when files repeat each other's rows."""
    from .policy_bench import read_workload, workloads_in

    per_file = [read_workload(folder / f"{w}.jsonl", count) for w in workloads_in(folder)]
    return [rows[k] for k in range(count) for rows in per_file if k < len(rows)]


def _unique_prompt_ids(tokenizer, rows: list[dict], count: int) -> list[list[int]]:
    """The first ``count`` of the rows' prompts as the node tokenises them, each once: a file that repeats
    another's rows adds nothing."""
    from .policy_bench import row_prompt_ids

    prompts: list[list[int]] = []
    for row in rows:
        ids = row_prompt_ids(tokenizer, row)
        if ids not in prompts:
            prompts.append(ids)
    return prompts[:count]


def round_robin_prompts(tokenizer, folder: Path, count: int) -> list[list[int]]:
    """``count`` distinct prompts taken in turn from each workload of ``folder`` (the scripts' A/B runs)."""
    return _unique_prompt_ids(tokenizer, _round_robin_rows(folder, count), count)


def _draft_load(args, names, result) -> dict | None:
    """The draft's cold load through ``--storage``, once per run, with its ratio to one speculative iteration."""
    from ..runtime.cache import draft_spec
    from ..runtime.loader import draft_dtype
    from ..runtime.model_source import is_model_source
    from ..runtime.storage import DraftStorage, storage_medium

    if not (Path(names[1]).is_dir() or is_model_source(names[1])):
        return None  # generated tiny models: no file to load (a GGUF or pkg: draft is read as the cache reads it)
    storage = DraftStorage(storage_medium(args.storage))
    spec = draft_spec(names[1], draft_dtype(args.dtype), args.draft_quantization)
    records = storage.steady_loads({args.draft: spec}, repeats=max(1, args.runs))  # not the first load's build
    # one iteration as the loop ran it (its forwards follow each other's there), as the policy bench's cost model
    # times it; the isolated forwards where the loop had none to time
    draft_ms = result.loop_draft_ms if result.loop_draft_ms is not None else result.t_draft_ms
    verify_ms = result.loop_verify_ms if result.loop_verify_ms is not None else result.t_verify_ms
    iteration = (result.gamma * draft_ms + verify_ms) / 1000
    return storage.summary(records, iteration)



def _datastore(args, fingerprint: str | None = None):
    """``--datastore``: a file, 'none', or '' for the zoo's datastore.safetensors when it has one; with
    ``fingerprint``, one made for another tokenizer is refused."""
    from ..runtime.datastore import Datastore, DatastoreError
    from ..runtime.loader import find_datastore

    path = {"": find_datastore(args.zoo), "none": ""}.get(args.datastore, args.datastore)
    if not path:
        return None
    try:
        return Datastore.load(path, fingerprint=fingerprint)
    except DatastoreError as exc:
        raise SystemExit(f"--datastore: {exc}") from None


def _finite(value):
    """``value`` with every NaN or infinity replaced by None: ``json.dumps`` writes those as bare NaN/Infinity,
    which is not JSON (jq and browsers refuse the file), e.g. a latency percentile of a run that had no goal."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


def _write_json(result: dict, path: str | None) -> str:
    """``result`` as indented JSON; also written to ``path`` (its folder made) when one is given. A write that
    fails (the disk full, the folder removed during the run) prints the result before it says so: the run's
    figures are not lost with the file."""
    text = json.dumps(_finite(result), indent=2, allow_nan=False)
    if path:
        try:
            Path(path).parent.mkdir(parents=True, exist_ok=True)
            write_result_text(path, text + "\n")  # an earlier result there stays whole until this one is
        except OSError as exc:
            print(text)
            raise SystemExit(f"--json {path}: could not write the result ({exc}); it is printed above") from None
    return text


def _quiet_transformers() -> None:
    """No transformers progress bar per model load: one line per draft load would bury the bench's own bar."""
    try:
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
    except ImportError:
        pass


def cmd_engine(args) -> int:
    import torch
    from tqdm import tqdm

    from .engine_bench import EngineBenchConfig, run_engine_bench

    cfg = EngineBenchConfig(gamma=args.gamma, max_new_tokens=args.max_new_tokens, runs=args.runs,
                            prompts=args.prompts, threads=args.threads, draft=args.draft,
                            lean_drafts=not args.transformers_draft_forward, adaptive_gamma=args.adaptive_gamma,
                            context_lookup=args.context_lookup)
    if args.datastore not in ("", "none") and not cfg.context_lookup:  # a file it names would be read by nothing
        raise SystemExit("--datastore is searched by the context lookup: add --context-lookup")
    if bool(args.target) != bool(args.draft_path):  # one without the other was ignored, or failed in the loader
        raise SystemExit("--target and --draft-path go together (a target directory and a draft for it); without"
                         " them the zoo's target and --draft run")
    for option, value in (("--target", args.target), ("--draft-path", args.draft_path)):
        # found after the target had loaded and its paths were timed (a pkg: source is the loader's to find)
        if value and not value.startswith("pkg:") and not Path(value).exists():
            raise SystemExit(f"{option} {value}: no such file or folder")
    if args.datastore not in ("", "none"):  # a folder or another file: also found only after the loads
        from ..runtime.datastore import DatastoreError, check_fits_in_memory, read_answers

        try:
            check_fits_in_memory(args.datastore)  # before it is read: its indexing would take the memory first
            read_answers(args.datastore)  # (its tokenizer is checked against the target's once that is loaded)
        except DatastoreError as exc:
            raise SystemExit(f"--datastore: {exc}") from None
    torch.set_num_threads(cfg.threads)  # before the load: quantization auto times the paths at this thread count
    target, draft, prompts, names, tokenizer = _engine_models(args)
    if cfg.context_lookup:
        cfg.datastore = _datastore(args, getattr(args, "tokenizer_fingerprint", None))
    with tqdm(total=cfg.runs * len(prompts), desc="engine bench", unit="prompt") as bar:
        result = run_engine_bench(target, draft, prompts, cfg, names=names, progress=bar, tokenizer=tokenizer)
    data = asdict(result)
    data["forward_paths"] = getattr(args, "forward_paths", None)
    data["context_lookup"] = cfg.context_lookup
    data["datastore"] = ({"answers": cfg.datastore.answers, "tokens": cfg.datastore.token_count}
                         if cfg.datastore is not None else None)
    data["storage"] = _draft_load(args, names, result)
    text = _write_json(data, args.json)
    print(text)
    print(
        f"\nengine {result.engine_tps:.1f} tok/s | HF assisted {_num(result.hf_assisted_tps, '.1f')} | "
        f"autoregressive {result.autoregressive_tps:.1f} | ratio vs HF {_num(result.ratio_vs_hf, '.2f')} "
        f"(goal >= 1.3) | vs its target alone {_num(result.ratio_vs_target_alone, '.2f')} whole calls,"
        f" {_num(result.decode_ratio_vs_target_alone, '.2f')} decoding (goal >= 1.6) | vs AR"
        f" {_num(result.ratio_vs_autoregressive, '.2f')} | E[A] {result.mean_accepted:.2f} | "
        + (f"bound fraction {result.bound_fraction:.2f} (goal >= 0.9; draft {result.t_draft_ms:.2f} ms a token, "
           f"verify {result.t_verify_ms:.2f} ms alone, in the loop {_num(result.loop_draft_ms, '.2f')} / "
           f"{_num(result.loop_verify_ms, '.2f')} ms, {_num(result.loop_other_ms, '.2f')} ms an iteration besides)"
           if result.bound_fraction is not None
           else "no draft-cost bound (context lookup)" if cfg.context_lookup else "no bound (no run had one)")
        + f" | identical {result.outputs_identical}"
        f" (transformers' generate the same on {result.same_as_transformers:.0%}"
        + (f", its assisted generation the same as its generate on {result.hf_assisted_same_as_generate:.0%}"
           if result.hf_assisted_same_as_generate is not None else "")
        + f") | draft forward: {result.draft_forward}"
        + (" | tokens per run: " + ", ".join(f"{m} {n}" for m, n in result.generated_tokens.items())
           if len(set(result.generated_tokens.values())) > 1 else "")  # rates over different counts: say so
    )
    return 0 if result.outputs_identical else 1


def _matmul_text(forward: dict) -> str:
    if "matmul_ms" not in forward:  # the engine's C decoder: one call, no per-kernel profile
        return f"layers: {forward['decoder']}"
    return (f"matmul kernels {forward['matmul_ms']:.1f} ms ({forward['matmul_share']:.0%}) of 1 token,"
            f" {forward['verify_matmul_ms']:.1f} ms ({forward['verify_matmul_share']:.0%}) of the verify")


def _llamacpp_rows(args) -> list[tuple[str, dict]]:
    """(workload, row) of the first --prompts rows of each --domains workload of the zoo, read before any model
    loads: an unknown workload or a bad row is named."""
    from .policy_bench import read_workload, workloads_in

    folder = Path(args.zoo) / "workloads"
    rows = []
    for domain in unique_names(args.domains, "--domains"):
        if not (folder / f"{domain}.jsonl").is_file():
            raise SystemExit(f"--domains {domain}: no workload {folder / (domain + '.jsonl')}; the zoo has"
                             f" {', '.join(workloads_in(folder)) if folder.is_dir() else 'none'}")
        try:
            rows += [(domain, row) for row in read_workload(folder / f"{domain}.jsonl", args.prompts)]
        except (OSError, ValueError) as exc:
            raise SystemExit(f"memspec-bench llamacpp: {exc}") from None
    if not rows:
        raise SystemExit(f"--domains {args.domains!r}: no workload rows to run")
    return rows


def _llamacpp_target(args) -> tuple[str, Path]:
    """The target as the engine names it (file or pkg: resource) and as llama.cpp reads it (a .gguf file)."""
    from ..runtime.model_source import source_path
    from ..runtime.models import ModelDirectoryError
    from ..runtime.registry import DraftRegistry, RegistryError

    try:
        registry = DraftRegistry.from_yaml(Path(args.zoo) / "registry.yaml", validate=False)
    except RegistryError as exc:
        raise SystemExit(f"memspec-bench llamacpp: {exc}") from None
    source = args.gguf or registry.target_path
    if not source:
        raise SystemExit(f"{Path(args.zoo) / 'registry.yaml'} names no target: pass --gguf FILE")
    try:
        gguf = source_path(source)
    except ModelDirectoryError as exc:
        raise SystemExit(f"memspec-bench llamacpp: {exc}") from None
    if gguf.suffix != ".gguf" or not gguf.is_file():
        raise SystemExit(f"llama.cpp needs the target as a GGUF file; {source} is not one: pass --gguf FILE")
    return source, gguf


def cmd_llamacpp(args) -> int:
    from tqdm import tqdm

    from ..runtime.chat import end_token_ids
    from ..runtime.forward_paths import PATHS
    from ..runtime.models import ModelSpec, load_model, load_tokenizer, tokenizer_fingerprint
    from ..runtime.registry import DraftRegistry
    from .llamacpp_bench import (
        BenchNoRate,
        LlamaCppBenchConfig,
        LlamaCppMissing,
        llamacpp_program,
        missing_draft_options,
        run_llamacpp_bench,
    )
    from .policy_bench import row_prompt_ids

    paths = tuple(unique_names(args.paths, "--paths"))  # a path named twice loaded the target twice
    unknown = [p for p in paths if p not in PATHS]
    if unknown:
        raise SystemExit(f"unknown forward path(s) {', '.join(unknown)}: use {', '.join(PATHS)}")
    if args.llamacpp_draft and not Path(args.llamacpp_draft).is_file():  # else every speculative run failed
        raise SystemExit(f"--llamacpp-draft {args.llamacpp_draft}: no such file (a draft GGUF)")
    rows = _llamacpp_rows(args)
    source, gguf = _llamacpp_target(args)
    cfg = LlamaCppBenchConfig(paths=paths, threads=args.threads,
                              max_new_tokens=args.max_new_tokens, gamma=args.gamma, runs=args.runs,
                              llamacpp_bin=Path(args.llamacpp_bin),
                              llamacpp_draft=Path(args.llamacpp_draft) if args.llamacpp_draft else None)
    try:
        llamacpp_program(cfg.llamacpp_bin, "llama-completion")
    except LlamaCppMissing as exc:
        raise SystemExit(str(exc)) from None
    registry = DraftRegistry.from_yaml(Path(args.zoo) / "registry.yaml", validate=False)
    without = sorted({d for d, _ in rows} - {e.domain for e in registry.entries()})
    if without:  # before any model loads: the bench runs each prompt's domain draft
        raise SystemExit(f"memspec-bench llamacpp: no draft of domain(s) {', '.join(without)} in"
                         f" {Path(args.zoo) / 'registry.yaml'}: choose --domains that have one")
    tokenizer = load_tokenizer(source)
    cfg.datastore = _datastore(args, tokenizer_fingerprint(tokenizer))
    targets = {}
    for path in tqdm(paths, desc="loading target paths", unit="path"):
        spec = (
            ModelSpec(source, dtype="bf16")
            if path == "bf16"
            else ModelSpec(source, quantization="none" if path == "fp32" else path)
        )
        targets[path] = load_model(spec).model
    drafts = {e.domain: load_model(ModelSpec(e.path, quantization=args.draft_quantization)).model
              for e in registry.entries()}
    prompts = []
    for domain, row in rows:
        ids = row_prompt_ids(tokenizer, row)  # as the node sends it: a prompt row or a chat row
        prompts.append((domain, ids, tokenizer.decode(ids, skip_special_tokens=False)))
    eos = end_token_ids(tokenizer, next(iter(targets.values())))
    with tqdm(total=len(cfg.threads) * cfg.runs * len(prompts), desc="llama.cpp bench", unit="prompt") as bar:
        try:
            result = run_llamacpp_bench(gguf, targets, drafts, prompts, cfg, eos, tokenizer.decode, progress=bar)
        except BenchNoRate as exc:
            raise SystemExit(f"memspec-bench llamacpp: {exc}") from None
    result["draft_quantization"] = args.draft_quantization
    text = _write_json(result, args.json)
    print(text)
    for threads, row in result["threads"].items():
        extra = "".join(f" | {name} {row[name + '_tps']:.1f} ({_num(row[name + '_vs_llamacpp'], '.2f')}x)"
                        for name in ("llamacpp_lookup", "llamacpp_speculative") if name + "_tps" in row)
        print(f"\n{threads} thread(s): llama.cpp {row['llamacpp_tps']:.1f} tok/s{extra}")
        for path, p in row["paths"].items():
            print(f"  {path:5s} alone {p['target_alone_tps']:6.1f} ({_num(p['target_alone_vs_llamacpp'], '.2f')}x)"
                  f" | speculative fixed {p['speculative_fixed_gamma_tps']:6.1f} (E[A] {p['mean_accepted']:.2f})"
                  f" adaptive {p['speculative_adaptive_gamma_tps']:6.1f}"
                  f" | lookup alone {p['lookup_alone_tps']:6.1f}, beside the draft"
                  f" {p['speculative_adaptive_lookup_tps']:6.1f} ({p['lookup_share']:.0%} copied)"
                  + (f" | with the datastore: alone {p['datastore_alone_tps']:6.1f}, beside the draft"
                     f" {p['speculative_adaptive_datastore_tps']:6.1f} ({p['datastore_share']:.0%} copied)"
                     if "datastore_alone_tps" in p else "") +
                  f" | best {_num(p['speculative_vs_llamacpp'], '.2f')}x ({p['speculative_method']}),"
                  f" median {_num(p['speculative_median_vs_llamacpp'], '.2f')}x ({p['speculative_median_method']}),"
                  f" worst {_num(p['speculative_worst_vs_llamacpp'], '.2f')}x ({p['speculative_worst_method']})"
                  f" | identical {p['outputs_identical']} | t1 {p['forward']['one_token_ms']:.1f} ms"
                  f" t_verify {p['forward']['verify_ms']:.1f} ms | {_matmul_text(p['forward'])}")
        best = row["best_speculative_path"]
        print(
            "  goals: target alone >= 0.5x llama.cpp:"
            f" {_num(row['target_alone_vs_llamacpp'], '.2f')}x ({row['best_target_alone_path']});"
            f" speculative >= 1.0x: {_num(row['speculative_vs_llamacpp'], '.2f')}x ({best}; its worst"
            f" configuration {_num(row['paths'][best]['speculative_worst_vs_llamacpp'], '.2f')}x)"
        )
        if row["prompt_tokens_mismatched"]:
            print(f"  WARNING: llama.cpp encoded {len(row['prompt_tokens_mismatched'])} prompt(s) to another length"
                  " than the engine: they were not given the same prompt, and are left out of llama.cpp's figures"
                  " (prompt_tokens_mismatched in the JSON)")
    spec = result.get("llamacpp_speculative")
    missing = missing_draft_options(spec["draft_options"]) if spec else []
    if missing:  # its own defaults then cut or drop drafts that the engine's fixed gamma would verify whole
        print(f"WARNING: this llama.cpp build's llama-speculative-simple lists no {', '.join(missing)}: it ran with"
              " its own defaults for them, so its drafts may stop short of gamma or be dropped (rebuild the pinned"
              " version with scripts/build_llamacpp.sh for a like-for-like llamacpp_speculative figure)")
    return 0 if all(row["outputs_identical"] for row in result["threads"].values()) else 1


def cmd_action(args) -> int:
    from tqdm import tqdm

    from .action_bench import run_action_bench

    _quiet_transformers()
    from ..runtime.loader import HEAD_CONFIG, find_predictor
    from ..runtime.policies import NODE_POLICIES, RANKING_POLICIES

    if args.policy not in NODE_POLICIES:  # before the node starts (the oracles need the future: the offline bench's)
        raise SystemExit(f"--policy {args.policy}: the node runs one of {', '.join(NODE_POLICIES)}")
    if args.predictor:
        if args.policy not in RANKING_POLICIES:  # it was ignored without a word
            raise SystemExit(f"--predictor: {args.policy} ranks no drafts; the predictor serves"
                             f" {', '.join(RANKING_POLICIES)}")
        if not find_predictor(args.predictor):
            # the node would fall back to general-static: the figures would be another policy's under this one's name
            raise SystemExit(f"--predictor {args.predictor}: no trained ranking head there ({HEAD_CONFIG})")
    zoo = _bench_zoo(args)
    with tqdm(total=args.runs * args.prompts, desc="action vs direct", unit="pair") as bar, _named_row_errors("action"):
        result = run_action_bench(zoo, prompts=args.prompts, runs=args.runs, max_new_tokens=args.max_new_tokens,
                                  threads=args.threads, feedback_period=args.feedback_period, policy=args.policy,
                                  predictor=args.predictor or "", storage=args.storage, progress=bar)
    _write_json(result, args.json)
    if result["note"]:
        print(result["note"], file=sys.stderr)
    print(
        f"\nsteady-state tok/s (median): action {result['action_tokens_per_second_median']:.1f} | direct"
        f" {result['direct_tokens_per_second_median']:.1f} | ratio of the medians"
        f" {_num(result['ratio_steady_state'], '.3f')}"
        f"\nend-to-end tok/s (median):   action {result['action_end_to_end_tokens_per_second_median']:.1f} | direct"
        f" {result['direct_end_to_end_tokens_per_second_median']:.1f} | ratio {_num(result['ratio_end_to_end'], '.3f')}"
        f"\nmedian of per-pair steady-state ratios (robust to load bursts on a shared machine; the goal's figure):"
        f" {_num(result['per_pair_steady_state_ratio_median'], '.3f')} (goal >= {ACTION_GOAL})"
        f"\noutputs identical: {result['outputs_identical']} | {result['prompts']} prompts x {result['runs']} runs,"
        f" {result['max_new_tokens']} tokens, policy {result['policy']}, zoo {result['zoo']}"
        f"\nstorage {result['storage']['medium']}{' (emulated)' if result['storage']['emulated'] else ''}:"
        f" {result['storage']['loads']} draft loads, {1000 * result['storage']['mean_load_seconds']:.1f} ms each ="
        f" {_num(result['storage']['load_to_iteration'], '.2f')} iterations"
    )
    # the goal judged on the per-pair median printed above (robust to a burst of load on one side of a pair)
    per_pair = result["per_pair_steady_state_ratio_median"]  # None: no pair had a steady state to compare
    return 0 if result["outputs_identical"] and per_pair is not None and per_pair >= ACTION_GOAL else 1


def cmd_soak(args) -> int:
    from dataclasses import replace

    from tqdm import tqdm

    from .soak_bench import CI, LONG, RSS_GROWTH_LIMIT, run_soak, summary

    _quiet_transformers()
    config = LONG if args.long else CI
    changes = {k: v for k, v in (("goals", args.goals), ("bursts", args.bursts), ("storm_rounds", args.storm_rounds),
                                 ("threads", args.threads), ("storage", args.storage)) if v is not None}
    config = replace(config, **changes)
    zoo = _bench_zoo(args)
    with tqdm(total=config.goals, desc="soak (sequential goals)", unit="goal") as bar, _named_row_errors("soak"):
        result = run_soak(zoo, config, progress=bar)
    result["mode"] = "long" if args.long else "ci"
    # the JSON's verdict is the exit status's: in --long the RSS growth bound too (it said ok where the command
    # exited 1)
    result["memory_ok"] = not args.long or result["rss_growth"] <= RSS_GROWTH_LIMIT
    result["ok"] = result["ok"] and result["memory_ok"]
    _write_json(result, args.json)
    if result["note"]:
        print(result["note"], file=sys.stderr)
    print(summary(result))
    print(f"ok: {result['ok']} (RSS growth bound {RSS_GROWTH_LIMIT:.0%} checked in --long)")
    return 0 if result["ok"] else 1


def cmd_policies(args) -> int:
    from tqdm import tqdm

    from ..runtime.loader import HEAD_CONFIG, PREDICTOR_PREFERENCE, find_predictor
    from ..runtime.policies import POLICIES, RANKING_POLICIES
    from .policy_bench import PolicyBenchConfig, plot_policy_bench, run_policy_bench, validation_table

    policies = unique_names(args.policies, "--policies") if args.policies else list(PolicyBenchConfig.policies)
    unknown = [p for p in policies if p not in POLICIES]
    if unknown:
        raise SystemExit(f"unknown policy {', '.join(unknown)}: use {', '.join(POLICIES)}")
    zoo, folder, workloads = _zoo_and_workloads(args)
    cfg = PolicyBenchConfig(policies=policies, workloads=workloads, prompts=args.prompts, runs=args.runs,
                            max_new_tokens=args.max_new_tokens, capacity=args.capacity, interval=args.interval,
                            gamma=args.gamma, storage=args.storage, workloads_dir=str(folder or ""),
                            threads=args.threads, simulate=not args.no_simulator,
                            quantization=args.quantization, draft_quantization=args.draft_quantization)
    # the zoo's predictor folder: find_predictor prefers its target-hidden head, then its minilm one (pointed at
    # target-hidden alone, a zoo with only a minilm head ran without its ranking policies)
    predictor = Path(args.predictor) if args.predictor else zoo / "predictor"
    ranking = [p for p in policies if p in RANKING_POLICIES]
    if (args.predictor or ranking) and not find_predictor(predictor):
        # a predictor named, or policies that need one (the default list's too), and none found: dropping memspec,
        # prediction-only and the cost-aware variant with exit status 0 and a line at the end of the output passed
        # for a comparison of MemSpec, whose ratios were simply absent
        raise SystemExit(f"{'--predictor ' if args.predictor else ''}{predictor}: no trained ranking head there"
                         f" ({HEAD_CONFIG} in it or in one of its encoder folders:"
                         f" {', '.join(p for p in PREDICTOR_PREFERENCE if p)}), which {', '.join(ranking) or 'the'}"
                         " ranking policies need: train one (memspec-train-predictor), pass --predictor, or name"
                         " --policies without them")
    with tqdm(total=len(policies) * len(workloads) * args.prompts * args.runs, desc="policies", unit="gen") as bar:
        try:
            result = run_policy_bench(zoo, cfg, predictor, progress=bar)
        except (FileNotFoundError, ValueError) as exc:
            raise SystemExit(f"memspec-bench policies: {exc}") from None
        except KeyboardInterrupt:  # said, not silent: the timed runs only compare as a whole
            raise SystemExit(f"memspec-bench policies: interrupted after {bar.n} of {bar.total} timed generations;"
                             " nothing was written (every policy runs on every prompt, interleaved: a part of the"
                             " rounds compares nothing)") from None
    text = _write_json(result, args.json)
    if args.json:
        plot_policy_bench(result, Path(args.json).with_suffix(".png"))
    print(text)
    names = result["config"]["policies"]
    print(f"\nsteady-state tokens/s per workload (GMEAN last, over {', '.join(result['gmean_workloads'])} only):")
    print(f"{'policy':>20} " + " ".join(f"{w:>8}" for w in result["workloads"]) + f" {'GMEAN':>8}")
    for p in names:
        cells = " ".join(f"{result['workloads'][w][p]['tokens_per_second']:8.1f}" for w in result["workloads"])
        print(f"{p:>20} {cells} {result['gmean_tokens_per_second'][p]:8.1f}")
    for key, value in result["ratios"].items():
        print(f"{key}: {value:.3f}")
    from .figures import load_sentence

    storage = result["storage"]
    print(f"storage {storage['medium']}{' (emulated)' if storage['emulated'] else ''}: {load_sentence(storage)}")
    print("decode time breakdown (" + ", ".join(result["time_breakdown"][names[0]]["parts"]) + "; over"
          f" {', '.join(result['gmean_workloads'])}):")
    for p in names:
        parts = result["time_breakdown"][p]["fraction"]
        print(f"{p:>20} " + " ".join(f"{parts[k]:6.1%}" for k in parts))
    live = (result.get("predictor") or {}).get("recent_features_live")
    if live is False:
        print("WARNING: the live target-hidden predictor saw no recent tokens (its forward hook never fired while"
              " decoding): the predicted policies ranked from the prompt alone")
    if "simulator_validation" in result:
        print(validation_table(result["simulator_validation"]))
    if result["config"]["skipped_policies"]:
        print(f"skipped (no trained predictor at {predictor}): {', '.join(result['config']['skipped_policies'])}")
    print(f"lossless (every output equals the target's greedy output): {result['lossless']}")
    return 0 if result["lossless"] else 1


def unique_names(text: str, option: str) -> list[str]:
    """A comma-separated list of names; SystemExit for an empty or repeated one (a workload named twice ran its
    prompts twice per round and weighed double in every GMEAN; a policy named twice ran twice per prompt)."""
    names = [n.strip() for n in text.split(",")]
    if "" in names:
        raise SystemExit(f"{option} {text!r}: an empty name (a stray comma?)")
    repeated = sorted({n for n in names if names.count(n) > 1})
    if repeated:
        raise SystemExit(f"{option} names {', '.join(repeated)} more than once: give each once")
    return names


def _zoo_and_workloads(args) -> tuple[Path, Path | None, list[str]]:
    """policies' and paper's --zoo, --workloads-dir and --workloads, checked: the zoo, the workload folder (None:
    the zoo's held-out workloads) and the workloads to run."""
    from .policy_bench import PolicyBenchConfig, read_workloads, workloads_in

    zoo = Path(args.zoo)
    if not (zoo / "registry.yaml").is_file():
        raise SystemExit(f"no zoo at {zoo} (registry.yaml missing): build it with `memspec-zoo build` or pass --zoo")
    folder = Path(args.workloads_dir) if args.workloads_dir else None
    if folder is not None and not folder.is_dir():
        raise SystemExit(f"--workloads-dir {folder} is not a directory")
    if args.workloads:
        workloads = unique_names(args.workloads, "--workloads")
    else:
        workloads = workloads_in(folder) if folder is not None else list(PolicyBenchConfig.workloads)
    where = folder if folder is not None else zoo / "workloads"
    try:  # every row read now: an empty folder or file, or a bad line, is named before the models load
        counts = {w: len(rows) for w, rows in read_workloads(where, workloads, args.prompts).items()}
    except (OSError, ValueError) as exc:
        raise SystemExit(f"memspec-bench {args.command}: {exc}") from None
    empty = [w for w, n in counts.items() if not n]
    if not workloads or empty:
        raise SystemExit(f"{where}: no workload rows{' in ' + ', '.join(empty) if empty else ''} (<name>.jsonl files"
                         " of {\"domain\", \"prompt\"} or chat rows; train* skipped)")
    short = {w: n for w, n in counts.items() if n < args.prompts}
    if short:  # they run the rows they have: said now, and in the JSON (prompts_run), the titles and the page
        print(f"note: --prompts {args.prompts}, but {', '.join(f'{w} has {n}' for w, n in short.items())} row(s) in"
              f" {where}: each of those runs the rows it has", file=sys.stderr)
    return zoo, folder, workloads


def cmd_paper(args) -> int:
    from tqdm import tqdm

    from .figures import REAL_POLICIES, rerender, run_paper
    from .policy_bench import share

    if args.render_only:
        # it only re-renders README.md from --out's items: every other option was dropped without a word
        defaults = vars(build_parser().parse_args(["paper"]))
        ignored = [f"--{k.replace('_', '-')}" for k, v in vars(args).items()
                   if k not in ("out", "render_only", "func", "command") and v != defaults.get(k)]
        if ignored:
            raise SystemExit(f"memspec-bench paper --render-only: {', '.join(ignored)} have no effect: it only"
                             " re-renders README.md from the items in --out; leave them out")
        try:
            rerender(Path(args.out))
        except (FileNotFoundError, ValueError) as exc:
            raise SystemExit(f"memspec-bench paper --render-only: {exc}") from None
        print(f"{Path(args.out) / 'README.md'}: regenerated from the items in {args.out}")
        return 0
    out = Path(args.out)
    if out.exists() and not out.is_dir():  # found by its mkdir, a traceback, before the runs
        raise SystemExit(f"memspec-bench paper --out {out}: is a file; name a folder for the items")
    if blocked := unwritable(out):
        raise SystemExit(f"memspec-bench paper --out {out}: cannot write in {blocked}")
    zoo, folder, workloads = _zoo_and_workloads(args)
    predictor = Path(args.predictor) if args.predictor else None
    with tqdm(total=len(REAL_POLICIES) * len(workloads) * args.prompts, desc="paper: real runs", unit="gen") as bar:
        try:
            index = run_paper(zoo, Path(args.out), prompts=args.prompts, storage=args.storage, threads=args.threads,
                              predictor_dir=predictor, workloads=workloads, workloads_dir=folder,
                              quantization=args.quantization,
                              draft_quantization=args.draft_quantization, progress=bar, log=tqdm.write)
        except (FileNotFoundError, ValueError) as exc:
            raise SystemExit(f"memspec-bench paper: {exc}") from None
    print(json.dumps(index, indent=2))
    print(f"items ({', '.join(index['items'])}) and README.md written to {args.out} in {index['wall_seconds'] / 60:.1f}"
          f" min; simulator {'within' if index['validation']['within_tolerance'] else 'OUTSIDE'} its tolerance"
          f" ({index['validation']['kind']}: largest end-to-end error"
          f" {share(index['validation']['max_abs_error_end_to_end'])})")
    print(f"lossless (every output equals the target's greedy output): {index['lossless']}")
    within = index["validation"]["within_tolerance"]
    if not within:  # the sweeps and the storage figures come from the simulator alone
        print(f"FAILED: the simulator is outside its tolerance ({index['validation']['kind']}), so the figures it"
              " alone makes (fig10-12, storage, recent) are not evidence; the real runs' figures stand",
              file=sys.stderr)
    return 0 if index["lossless"] and within else 1


def _common_arguments(parser, *, prompts: int, runs: int, threads: int, prompts_help: str, json_type=output_file,
                      threads_type=positive_int,
                      zoo_help: str = "", threads_help: str = "",
                      runs_help: str = "repetitions; medians are reported") -> None:
    """The options every benchmark shares, with its own defaults."""
    parser.add_argument("--json", type=json_type, help="write the result JSON here")
    parser.add_argument("--zoo", default=str(DEFAULT_ZOO),
                        help=f"zoo directory with registry.yaml (default: the bundled zoo{zoo_help})")
    parser.add_argument("--prompts", type=positive_int, default=prompts, help=f"{prompts_help} (default {prompts})")
    parser.add_argument("--runs", type=positive_int, default=runs,
                        help=f"{runs_help} (default {runs})")
    parser.add_argument("--max-new-tokens", type=positive_int, default=128,
                        help="tokens per prompt (default 128, the paper's)")
    parser.add_argument(
        "--threads", type=threads_type, default=threads, help=f"torch CPU threads (default {threads}{threads_help})"
    )


def _workloads_dir_argument(parser) -> None:
    parser.add_argument(
        "--workloads-dir",
        metavar="DIR",
        help='any folder of <name>.jsonl workloads ({"domain", "prompt"} rows or chat rows with'
        ' "messages"; train*.jsonl skipped) (default: the zoo\'s held-out workloads, <zoo>/workloads)',
    )


def _storage_argument(parser, what: str, default: str = "emmc") -> None:
    from ..runtime.storage import STORAGE_CHOICES

    parser.add_argument("--storage", choices=STORAGE_CHOICES, default=default,
                        help=f"storage tier the drafts are read from ({what}): local (this machine's disk, cold), or"
                             " emulated edge media paced to their bandwidth and latency: emmc (eMMC 5.1), sd (UHS-I"
                             " microSD), nvme (PCIe Gen3 NVMe); runtime/storage.py cites the figures"
                             f" (default {default})")


def build_parser() -> argparse.ArgumentParser:
    from ..runtime.models import DTYPE_CHOICES, QUANTIZATIONS

    parser = argparse.ArgumentParser(prog="memspec-bench", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    eng = sub.add_parser("engine", help="target-only vs transformers assisted generation vs this engine")
    _common_arguments(eng, prompts=12, runs=3, threads=1, prompts_help="number of prompts, spread over the workloads",
                      zoo_help=f"; '{TINY_ZOO}': generated tiny models, also used when this install has none",
                      threads_help=": small models on a shared 2-core CPU run fastest on one")
    eng.add_argument("--draft", default="general", help="draft name from the zoo registry (default: general)")
    eng.add_argument("--target", help="target model directory (overrides the zoo; needs --draft-path)")
    eng.add_argument("--draft-path", help="draft model directory, with --target")
    eng.add_argument("--gamma", type=_GAMMA, default=4, help="draft tokens per iteration (default 4)")
    eng.add_argument("--dtype", default="fp32", choices=DTYPE_CHOICES, help="fp32 | bf16 | fp16 | auto (default fp32)")
    eng.add_argument("--quantization", default="none", choices=QUANTIZATIONS,
                     help="target forward path: none | int8 | int4 | gptq | auto (time every path, keep the fastest)")
    eng.add_argument("--draft-quantization", default="none", choices=("none", "int8", "int4"),
                     help="draft forward path: none | int8 | int4")
    eng.add_argument("--adaptive-gamma", action="store_true",
                     help="choose gamma per iteration from measured costs (--gamma is then the most)")
    eng.add_argument("--context-lookup", action="store_true",
                     help="the engine also proposes tokens copied from the context (memspec.context_lookup)")
    eng.add_argument("--datastore", default="",
                     help="with --context-lookup: past answers searched too (default: the zoo's datastore.safetensors"
                          " if it has one; 'none': the context only)")
    _workloads_dir_argument(eng)
    _storage_argument(eng, "the draft's cold load is measured through it and reported beside one iteration")
    eng.add_argument("--transformers-draft-forward", action="store_true",
                     help="run the draft through model(...) instead of the engine's lean Llama draft forward")
    eng.set_defaults(func=cmd_engine)
    lcp = sub.add_parser(
        "llamacpp", help="this engine (every forward path, alone and speculative) beside llama.cpp on the same GGUF"
    )
    lcp.add_argument("--json", type=output_file, help="write the result JSON here")
    lcp.add_argument(
        "--zoo", default=str(DEFAULT_ZOO), help="zoo directory with registry.yaml (default: the bundled zoo)"
    )
    lcp.add_argument("--gguf", help="the target GGUF (default: the zoo registry's target, which must be a GGUF)")
    lcp.add_argument("--paths", default="fp32,bf16,int8,int4", help="forward paths to run (default: all four)")
    lcp.add_argument("--threads", type=thread_counts, default=(1, 2),
                     help="comma-separated thread counts (default 1,2)")
    lcp.add_argument("--domains", default="code,math,law,medical,general", help="workloads the prompts come from")
    lcp.add_argument("--prompts", type=positive_int, default=1, help="held-out prompts per workload (default 1)")
    lcp.add_argument("--runs", type=positive_int, default=1, help="repetitions; medians are reported (default 1)")
    lcp.add_argument("--max-new-tokens", type=positive_int, default=128, help="tokens per prompt (default 128)")
    lcp.add_argument("--gamma", type=_GAMMA, default=4, help="draft tokens per iteration (default 4)")
    lcp.add_argument(
        "--llamacpp-bin",
        default=str(Path(__file__).resolve().parents[2] / "artifacts" / "llamacpp" / "bin"),
        help="folder with llama-completion (scripts/build_llamacpp.sh builds it)",
    )
    lcp.add_argument("--llamacpp-draft", help="a same-vocabulary draft GGUF for llama.cpp's speculative example")
    lcp.add_argument("--draft-quantization", default="none", choices=("none", "int8", "int4"),
                     help="the engine's drafts' forward path (drafts.quantization; default none: fp32). llama.cpp's"
                          " speculative example always gets the draft's own weights as f16")
    lcp.add_argument("--datastore", default="",
                     help="past answers the engine's lookup also searches, run as two more kinds (default: the zoo's"
                          " datastore.safetensors if it has one; 'none': skip them)")
    lcp.set_defaults(func=cmd_llamacpp)
    act = sub.add_parser("action", help="Generate through the ROS action server vs a direct runtime call (ratio)")
    _common_arguments(act, prompts=10, runs=3, threads=1, prompts_help="prompts, round-robin over the workloads",
                      zoo_help=f"; '{TINY_ZOO}': a generated tiny zoo, also used when this install has none",
                      threads_help=": best on a busy 2-core CPU",
                      threads_type=node_parameter_range("model.threads"))
    act.add_argument(
        "--feedback-period",
        type=node_parameter_range("action.feedback_period"),
        default=0.1,
        help="action.feedback_period (default 0.1 s, the node default; 0: every chunk)",
    )
    act.add_argument("--policy", default="memspec", help="memspec.policy (default memspec)")
    act.add_argument("--predictor", help="predictor.path (default: the zoo's predictor/)")
    _storage_argument(act, "the node's cache.storage, for both paths; its loads are recorded", default="local")
    act.set_defaults(func=cmd_action)
    soak = sub.add_parser("soak", help="the node under load: sequential goals, bursts against the queue, a cancel"
                                       " storm; lost goals, cache budget, RSS growth, acceptance latency")
    soak.add_argument("--json", type=output_file, help="write the result JSON here")
    soak.add_argument("--zoo", default=str(DEFAULT_ZOO),
                      help="zoo directory with registry.yaml, or 'tiny' for a generated tiny zoo (default: the"
                           " bundled zoo)")
    soak.add_argument("--long", action="store_true",
                      help="the README's run: 1,000 sequential goals, 10 bursts, 20 storm rounds (RSS bound checked)")
    soak.add_argument("--goals", type=positive_int, help="sequential goals (default 200, --long 1000)")
    soak.add_argument("--bursts", type=positive_int,
                      help="bursts of 20 goal requests against a queue of 4 (default 3, --long 10)")
    soak.add_argument("--storm-rounds", type=positive_int,
                      help="cancel storm rounds of queue + 1 goals (default 5, --long 20)")
    soak.add_argument("--threads", type=node_parameter_range("model.threads"),
                      help="torch CPU threads of the node (default 1)")
    _storage_argument(soak, "the node's cache.storage, recorded in the JSON's config; the soak checks robustness,"
                            " its loads are not timed", default="local")
    soak.set_defaults(func=cmd_soak)
    pol = sub.add_parser(
        "policies", help="MemSpec vs every baseline policy on the zoo's workloads (the paper's comparison)"
    )
    _common_arguments(pol, prompts=4, runs=1, threads=1, prompts_help="prompts per workload (the paper: 100)",
                      json_type=json_output_file,
                      runs_help="repetitions; each workload's rate is over all of them (sums, not medians)")
    pol.add_argument("--predictor", help="trained predictor directory (default: <zoo>/predictor, its target-hidden"
                                         " head first, then minilm)")
    pol.add_argument("--policies",
                     help="comma-separated subset (default: the paper's seven; memspec-cost-aware on request)")
    pol.add_argument("--workloads", help="comma-separated subset (default: code,math,law,medical,general,mixed,"
                                         " or every <name>.jsonl of --workloads-dir)")
    _workloads_dir_argument(pol)
    pol.add_argument("--capacity", type=_CAPACITY, default=2,
                     help="K, drafts resident at once (default 2)")
    pol.add_argument("--interval", type=_INTERVAL, default=4,
                     help="N, iterations between scheduling points (default 4)")
    pol.add_argument("--gamma", type=_GAMMA, default=4, help="draft tokens per iteration (default 4)")
    _storage_argument(pol, "every draft load reads its weights cold through it")
    pol.add_argument("--no-simulator", action="store_true",
                     help="skip replaying the runs in the trace-driven simulator (simulator_validation)")
    _paths_arguments(pol)
    pol.set_defaults(func=cmd_policies)
    pap = sub.add_parser("paper", help="the paper's evaluation (figures 6-12, table 2, storage media, issue 17's"
                                       " goals): real runs + the validated simulator, JSON + PNG + results page")
    pap.add_argument("--out", default=str(Path(__file__).resolve().parents[2] / "docs" / "results"),
                     help="folder for the items and README.md (default: docs/results)")
    pap.add_argument("--zoo", default=str(DEFAULT_ZOO),
                     help="zoo directory with registry.yaml (default: the bundled zoo)")
    pap.add_argument("--predictor", help="trained predictor directory (default: <zoo>/predictor, its target-hidden"
                                         " head first, then minilm)")
    pap.add_argument("--prompts", type=positive_int, default=2,
                     help="prompts per workload in the real runs (default 2)")
    pap.add_argument("--workloads", help="comma-separated subset (default: code,math,law,medical,general,mixed)")
    pap.add_argument("--threads", type=positive_int, default=1, help="torch CPU threads (default 1)")
    _workloads_dir_argument(pap)
    _storage_argument(pap, "the real runs read every draft load through it; the storage item measures all four")
    pap.add_argument("--render-only", action="store_true",
                     help="only regenerate README.md's generated part from the items already in --out")
    _paths_arguments(pap)
    pap.set_defaults(func=cmd_paper)
    return parser


def _paths_arguments(parser) -> None:
    parser.add_argument("--quantization", default="none", choices=("none", "int8", "int4"),
                        help="the target's forward path (model.quantization; default none: fp32)")
    parser.add_argument("--draft-quantization", default="none", choices=("none", "int8", "int4"),
                        help="the drafts' forward path (drafts.quantization; default none: fp32)")


def _num(value: float | None, fmt: str) -> str:
    return "n/a" if value is None else format(value, fmt)


def _inside_a_zoo(args) -> str:
    """The --json or --out that names a path inside the bundled zoo or --zoo: the result (and a plot beside it, or
    the paper's items) would be written over the zoo's own files (registry.yaml, acceptance.json) after the run."""
    zoos = {Path(DEFAULT_ZOO).resolve()} | ({Path(args.zoo).resolve()} if getattr(args, "zoo", None) else set())
    for option in ("json", "out"):
        value = getattr(args, option, None)
        if value and any(Path(value).resolve().is_relative_to(zoo) for zoo in zoos):
            return f"--{option} {value} is inside the zoo ({', '.join(map(str, sorted(zoos)))}): the result would be" \
                   " written among its models; name a path elsewhere"
    return ""


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if refused := _inside_a_zoo(args):
        parser.error(refused)
    try:
        return args.func(args)
    except KeyboardInterrupt:  # said, not a traceback: a bench's figures only compare as a whole
        print(f"\nmemspec-bench {args.command}: interrupted; no figures written", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
