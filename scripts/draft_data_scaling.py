"""How the bundled drafts' acceptance grows with the target answers, and the steps, they are trained on.

Issue 16's acceptance goals (each domain draft +40% over ``general`` on its own workload,
``oracle_static_gain`` >= 0.20) were missed with about 350 target answers per domain, and every
probe since has said "more answers is the lever". This measures the lever instead of assuming it:
the same recipe as ``memspec-zoo build`` (``general`` from scratch on every domain's answers, each
domain draft fine-tuned from it on its own domain's), run on nested fractions of the same answers,
with acceptance measured on answers that neither early stopping nor training saw.

Data: the target's greedy answers to the zoo's training requests, recovered from the committed
datastore (``models/datastore.safetensors`` holds answer ``i`` of ``models/workloads/train_requests.jsonl``
row ``i``; the script checks a few against the target's own greedy output first). The datastore keeps
only the greedy tokens, not the build's top-8 soft labels, so the drafts here are trained on hard labels
(top-1 KL, i.e. cross-entropy on the target's greedy token): their absolute acceptance is not the
bundled drafts', the comparison between runs is what this measures. The step budget matters as much as
the data: at 420 ``general`` steps the domain drafts' edge grew with the answers, and at 840 steps on all
of them ``general`` caught up with them (docs/results/README.md, "Why the drafts barely differ").

Split: every 10th answer (shuffled, seed 0) is held out; half of those stop training early, the other
half are scored. Acceptance: mean accepted tokens per gamma-4 iteration in the engine's greedy walk,
teacher-forced on the target's answers (``chat_drafts.mean_accepted``, the build's definition).

    .venv/bin/python scripts/draft_data_scaling.py --fractions 0.25,0.5,1 \
        --general-steps 420 --domain-steps 120 --json docs/results/draft-data-scaling.json

Resumable: each run's final parameters go under ``--work`` and are reused.

``--general-data general`` runs the paper's recipe instead: ``general`` is distilled (and early-stopped) on the
general workload's answers only, the paper's "general-purpose (i.e., not fine-tuned)" draft, and the domain
drafts start from it (``--domain-lr`` raises their rate: they start near chance off the general domain).
``--export-also NAME=DIR`` adds another run's draft to the exported zoo, so both kinds of ``general`` are
scored in one matrix (docs/results/README.md, "The paper's General-Static draft").

``--export-zoo DIR`` also writes the last fraction's drafts as a zoo beside the bundled one (same
registry, workloads, datastore and predictor, linked; the drafts exported as the build exports them),
so ``memspec-zoo acceptance --models DIR`` and ``memspec-bench engine --zoo DIR`` measure them on the
zoo's held-out requests, which none of these runs trained on.
"""

from __future__ import annotations

import argparse
import copy
import json
import random
import time
from dataclasses import asdict, replace
from pathlib import Path

import torch

from memspec_ros.runtime.atomic_write import write_text_atomic, written_aside
from memspec_ros.zoo.chat_build import ChatBuildConfig
from memspec_ros.zoo.chat_drafts import AnswerStreams, mean_accepted, new_draft
from memspec_ros.zoo.corpora import DOMAINS as ALL_DOMAINS
from memspec_ros.zoo.teacher import Answer, TeacherConfig, answer_batch, datastore_answers
from memspec_ros.zoo.train import NO_TIME_BUDGET, train

ROOT = Path(__file__).resolve().parents[1]
DOMAINS = tuple(d for d in ALL_DOMAINS if d != "general")  # the ones with a draft of their own


def log(msg: str) -> None:
    print(f"[scaling {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def check_pairing(target, tok, answers: list[Answer], n: int = 4, tokens: int = 24) -> None:
    """The datastore's answers must be this target's greedy answers to these requests, in this order."""
    from memspec_ros.runtime.chat import end_token_ids

    pad = int(tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id)  # as the teacher pads
    picks = answers[:: max(1, len(answers) // n)][:n]
    for a in picks:  # one at a time: no padding, so the greedy output is the target's own
        got = answer_batch(target, [a.prompt_ids], TeacherConfig(max_new_tokens=tokens, top_k=1),
                           set(end_token_ids(tok, target)), pad)[0].answer_ids
        if got != a.answer_ids[:len(got)]:
            raise SystemExit(f"the datastore's answers do not pair with train_requests.jsonl: "
                             f"{tok.decode(got)!r} vs {tok.decode(a.answer_ids[:tokens])!r}")
    log(f"pairing checked on {len(picks)} requests: the datastore holds the target's greedy answers")


def export_zoo(models: Path, out: Path, drafts: dict, tok, extra: tuple[str, ...] = ()) -> None:
    """``out``: the bundled zoo's files linked, ``drafts`` (name -> ReducedVocabDraft) exported in place of its own;
    the ``extra`` ones, which the bundled registry does not name, are added to the copied registry."""
    import shutil

    import yaml

    from memspec_ros.runtime.registry import weights_bytes
    from memspec_ros.zoo.chat_drafts import export_draft

    out.mkdir(parents=True, exist_ok=True)
    for item in models.iterdir():
        if item.name in ("drafts", "acceptance.json", "acceptance_matrix.png"):
            continue  # the drafts are replaced; the acceptance files would describe the bundled ones
        link = out / item.name
        if item.name == "registry.yaml":  # copied: its draft paths are relative to where it lies
            shutil.copyfile(item, link)
        elif not link.exists():
            link.symlink_to(item.resolve())
    for name, draft in drafts.items():
        export_draft(draft, tok, out / "drafts" / name)
    if extra:
        registry = yaml.safe_load((out / "registry.yaml").read_text())
        registry["drafts"] = [e for e in registry["drafts"] if e["name"] not in extra] + [
            {"name": n, "path": f"drafts/{n}", "domain": "all", "size_bytes": weights_bytes(out / "drafts" / n)}
            for n in extra]
        (out / "registry.yaml").write_text(yaml.safe_dump(registry, sort_keys=False))
    log(f"zoo with these drafts: {out} (memspec-zoo acceptance --models {out})")


def plot(report: dict, path: Path) -> None:
    """Left: mean accepted tokens vs answers trained on; right: each domain draft's gain over ``general``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = report["runs"]
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    x = [r["answers"] for r in runs]
    left.plot(x, [r["general"]["accepted_all"] for r in runs], "o-", color="k", label="general, all held-out")
    for d in DOMAINS:
        left.plot(x, [r["domains"][d]["domain_accepted"] for r in runs], "o--", label=f"{d} draft on {d}")
        gains = [r["domains"][d]["gain"] for r in runs]
        right.plot(x, [float("nan") if g is None else 100 * g for g in gains], "o-", label=d)
    right.axhline(40, color="r", ls=":", label="goal +40%")
    left.set_ylim(0, 1.35 * max(max(line.get_ydata()) for line in left.get_lines()))  # room for the legend
    for ax, where in ((left, "upper left"), (right, "lower right")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("target answers trained on (all domains)")
        ax.legend(fontsize=7, loc=where, ncol=2)
    left.set_ylabel("mean accepted tokens / iteration (gamma 4)")
    right.set_ylabel("domain draft vs general on its domain (%)")
    fig.suptitle("Draft acceptance vs training answers (hard labels, same steps per run)", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", type=Path, default=ROOT / "models")
    p.add_argument("--work", type=Path, default=ROOT / "artifacts" / "data_scaling")
    p.add_argument("--fractions", default="0.25,0.5,1")
    # step budgets, not minutes: every fraction gets the same compute whatever else runs on the machine
    p.add_argument("--general-steps", type=int, default=420)
    p.add_argument("--domain-steps", type=int, default=120)
    p.add_argument("--domain-lr", type=float, default=None,
                   help="the domain drafts' peak learning rate (default: the build's fine-tuning rate); a `general` "
                        "that never saw a domain starts it near chance, so a fine-tuning rate leaves it undertrained")
    p.add_argument("--threads", type=int, default=2)
    # capacity: a draft too small to hold every domain may specialise where the bundled size does not
    p.add_argument("--hidden-size", type=int, default=None, help="draft width (default: the bundled zoo's)")
    p.add_argument("--num-layers", type=int, default=None, help="draft depth (default: the bundled zoo's)")
    p.add_argument("--intermediate-size", type=int, default=None, help="MLP width (default: the bundled zoo's)")
    p.add_argument("--batch-size", type=int, default=None, help="training batch (default: the bundled build's)")
    p.add_argument("--general-data", choices=("all", "general"), default="all",
                   help="what `general` is distilled on: every domain's answers (the build's recipe) or only the "
                        "general workload's, the paper's general-purpose draft that is not fine-tuned on any domain")
    p.add_argument("--json", type=Path, default=ROOT / "docs" / "results" / "draft-data-scaling.json")
    p.add_argument("--export-zoo", type=Path, default=None,
                   help="also write the last fraction's drafts as a zoo here (bundled zoo's other files linked)")
    p.add_argument("--export-also", action="append", default=[], metavar="NAME=DIR",
                   help="with --export-zoo: also export the draft another run left in DIR (its <draft>-<fraction> "
                        "folder under --work) as NAME, listed in the zoo's registry, e.g. a `general` distilled on "
                        "every domain beside the paper's general-purpose one")
    a = p.parse_args()
    also = dict(item.split("=", 1) for item in a.export_also)
    if also and not a.export_zoo:
        p.error("--export-also adds drafts to the zoo --export-zoo DIR writes: give --export-zoo too")
    unfinished = [d for d in also.values() if not (Path(d) / "final.safetensors").is_file()]
    if unfinished:
        p.error(f"--export-also NAME=DIR needs a finished run in DIR, and {', '.join(unfinished)} has no "
                "final.safetensors")
    torch.set_num_threads(a.threads)

    from memspec_ros.runtime.models import ModelSpec, load_model, load_tokenizer

    build = json.loads((a.models / "build_config.json").read_text())
    target_ref = build["target"]
    tok = load_tokenizer(target_ref)
    target = load_model(ModelSpec(target_ref)).model
    answers = datastore_answers(a.models / "datastore.safetensors", tok)
    check_pairing(target, tok, answers)
    vocab_ids = json.loads((a.models / "drafts" / "general" / "draft_vocab.json").read_text())["target_ids"]

    base = ChatBuildConfig()  # the build's dataclasses, with the values the bundled zoo was built with
    sizes = {k: v for k, v in (("hidden_size", a.hidden_size), ("num_layers", a.num_layers),
                               ("intermediate_size", a.intermediate_size)) if v is not None}
    arch = replace(base.arch, **{**build["arch"], **sizes})
    batch = {"batch_size": a.batch_size} if a.batch_size else {}
    gtrain = replace(base.general_train, **{**build["general_train"], "max_steps": a.general_steps,
                                             "max_minutes": NO_TIME_BUDGET, "validate_every": 60, **batch})
    dtrain = replace(base.domain_train, **{**build["domain_train"], "max_steps": a.domain_steps,
                                           "max_minutes": NO_TIME_BUDGET, "validate_every": 20,
                                           "seed": build["seed"] + 1, **batch,
                                           **({"lr": a.domain_lr} if a.domain_lr else {})})
    order = list(answers)
    random.Random(0).shuffle(order)
    held = [x for i, x in enumerate(order) if not i % 10]
    pool = [x for i, x in enumerate(order) if i % 10]  # nested fractions: each is a prefix of this
    stop, score = held[::2], held[1::2]
    fractions = [float(f) for f in a.fractions.split(",")]
    flags = " ".join(f"--{k.replace('_', '-')} {v}" for k, v in vars(a).items()
                     if k not in ("models", "work", "json", "export_zoo", "export_also"))
    # The paper's General-Static draft is "a single general-purpose (i.e., not fine-tuned) draft" (its Section
    # 4.1): with --general-data general it neither trains nor stops early on a domain's answers.
    general_only = a.general_data == "general"
    report = {"what": "mean accepted tokens per gamma-4 iteration vs the number of target answers trained on",
              "command": f"scripts/draft_data_scaling.py {flags}",
              "labels": "hard (the target's greedy token); the bundled drafts used top-8 soft labels",
              "general_data": a.general_data, "answers_total": len(answers), "stop_answers": len(stop),
              "score_answers": len(score),
              "score_answers_by_domain": {d: sum(x.domain == d for x in score) for d in (*DOMAINS, "general", "mixed")},
              "arch": asdict(arch), "general_train": asdict(gtrain), "domain_train": asdict(dtrain), "runs": []}

    def fit(name: str, start, train_set, stop_set, tcfg):
        from safetensors.torch import load_model, save_model  # the draft's head is tied to its embedding

        # what the weights depend on besides the run's name: reused by the name alone, a rerun in the same --work
        # with other --general-steps, --general-data or architecture reported the first run's drafts
        identity = json.loads(json.dumps({"arch": asdict(arch), "general_data": a.general_data,
                                          "train": asdict(tcfg), "train_answers": len(train_set),
                                          "stop_answers": len(stop_set)}, default=str))
        final, meta_file = a.work / name / "final.safetensors", a.work / name / "meta.json"
        if final.is_file() and meta_file.is_file():  # meta.json is written last: it marks the run done
            meta = json.loads(meta_file.read_text())
            if meta.pop("identity", None) != identity:
                raise SystemExit(f"{a.work / name} holds a run with other settings: give another --work or remove"
                                 " that folder")
            load_model(start.inner, str(final))
            return meta
        data = AnswerStreams(train_set, start.vocab, build["seed"], build["max_prompt_tokens"])
        meta = train(start.inner, data, tcfg, a.work / name / "run", desc=name, log=log,
                     validate=lambda _m: mean_accepted(start, stop_set, 4), identity=identity)
        with written_aside(final) as tmp:  # a cut file is never taken for a finished run's weights
            save_model(start.inner, str(tmp))
        meta = {k: meta[k] for k in ("step", "best_step", "best_score") if k in meta}  # train() says "step"
        write_text_atomic(meta_file, json.dumps({**meta, "identity": identity}))
        return meta

    for f in fractions:
        sub = pool[: round(f * len(pool))]
        general = new_draft(target, vocab_ids, arch, seed=build["seed"])
        gsub = [x for x in sub if x.domain == "general"] if general_only else sub
        gstop = [x for x in stop if x.domain == "general"] if general_only else stop
        gmeta = fit(f"general-{f}", general, gsub, gstop, gtrain)
        trained = {"general": general}
        run = {"fraction": f, "answers": len(sub), "answer_tokens": sum(len(x.answer_ids) for x in sub),
               "general": {"answers": len(gsub), "train": gmeta,
                           "accepted_all": round(mean_accepted(general, score), 4)}, "domains": {}}
        for d in DOMAINS:
            dsub = [x for x in sub if x.domain == d]
            spec = copy.deepcopy(general)
            dmeta = fit(f"{d}-{f}", spec, dsub, [x for x in stop if x.domain == d], dtrain)
            trained[d] = spec
            own = [x for x in score if x.domain == d]
            g, s = mean_accepted(general, own), mean_accepted(spec, own)
            gain = s / g - 1 if g else None  # no gain is defined over a general that accepts nothing
            run["domains"][d] = {"answers": len(dsub), "train": dmeta, "general_accepted": round(g, 4),
                                 "domain_accepted": round(s, 4), "gain": None if gain is None else round(gain, 4)}
            log(f"f={f} {d}: {len(dsub)} answers, general {g:.3f} -> {d} {s:.3f}"
                + ("" if gain is None else f" ({gain:+.1%})"))
        gains = [v["gain"] for v in run["domains"].values()]
        # over every domain or none: a mean over the domains whose gain is defined is another figure
        run["mean_domain_gain"] = None if None in gains or not gains else round(sum(gains) / len(gains), 4)
        report["runs"].append(run)
        mean_gain = "n/a" if run["mean_domain_gain"] is None else f"{run['mean_domain_gain']:+.1%}"
        log(f"f={f}: {len(sub)} answers, general accepted {run['general']['accepted_all']:.3f}, "
            f"mean domain gain {mean_gain}")
        a.json.parent.mkdir(parents=True, exist_ok=True)
        a.json.write_text(json.dumps(report, indent=1))
        plot(report, a.json.with_suffix(".png"))
    if a.export_zoo:
        from safetensors.torch import load_model as load_weights

        for name, run_dir in also.items():
            trained[name] = new_draft(target, vocab_ids, arch, seed=build["seed"])
            load_weights(trained[name].inner, str(Path(run_dir) / "final.safetensors"))
        export_zoo(a.models, a.export_zoo, trained, tok, extra=tuple(also))


if __name__ == "__main__":
    main()
