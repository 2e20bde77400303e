"""Chat requests per domain for an instruct target, written from this machine's own sources.

An instruct model such as SmolLM2-135M-Instruct answers *requests*: given raw
code or licence text to continue it loops on one sentence, but asked through
its chat template it writes a function, explains a clause, solves a problem.
So its workloads are chat requests, as a robot's users would send them:

- ``code``: "Write a Python function ``name(args)`` that ...", from the
  docstrings of the Python standard library, and "Explain what this function
  does" over short stdlib functions;
- ``math``: the generated problems of :mod:`.corpora` (arithmetic, fractions,
  linear and quadratic equations, word problems), asked to be solved;
- ``law``: paragraphs of the licences in ``/usr/share/common-licenses`` and of
  Debian copyright files, to be explained or summarised;
- ``medical``: ICD-10-CM conditions (``simple-icd-10-cm``), asked about
  symptoms, causes, treatment;
- ``general``: prose paragraphs of local manuals to summarise, and everyday
  requests;
- ``mixed``: one request that asks for two things of different domains, so
  the answer changes domain part-way and the best draft changes with it.

Each request has an id from its source; the held-out/train split is a pure
function of that id (:func:`.corpora.split_of`), so the held-out requests
never share a source with the training ones.  Rows are JSONL with ``domain``,
``prompt`` (the user turn as text, what a behaviour-tree client would send),
``messages`` (the chat) and ``source``.
"""

from __future__ import annotations

import ast
import glob
import json
import os
import random
import re
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import cache
from pathlib import Path

from ..runtime.jsonl import read_jsonl
from .corpora import DOMAINS, MATH_GENERATORS, WORKLOADS, CorpusConfig, is_prose, read_text_file, split_of
from .errors import ZooSetupError

MIXED_PAIRS: tuple[tuple[str, str], ...] = (
    ("general", "code"),
    ("law", "code"),
    ("medical", "math"),
    ("code", "medical"),
    ("math", "law"),
    ("general", "medical"),
)
"""(first, second) domain of each mixed request."""


@dataclass(frozen=True)
class ChatRequest:
    domain: str
    source: str
    content: str

    def row(self) -> dict:
        return {"domain": self.domain, "prompt": self.content,
                "messages": [{"role": "user", "content": self.content}], "source": self.source}


@dataclass
class ChatWorkloadConfig:
    heldout_per_workload: int = 100
    train_per_domain: int = 1000
    heldout_fraction: float = 0.15
    seed: int = 2026
    max_quote_chars: int = 700
    corpus: CorpusConfig | None = None

    @property
    def sources(self) -> CorpusConfig:
        return self.corpus or CorpusConfig()


def clip_quote(text: str, limit: int) -> str:
    """At most ``limit`` characters, cut after a sentence where one ends past half of it."""
    text = text.strip()
    if len(text) <= limit:
        return text
    cut = text[:limit]
    end = max(cut.rfind(". "), cut.rfind("\n"))
    return (cut[: end + 1] if end > limit // 2 else cut).strip()


def _ask(asks: tuple[str, ...], rid: str) -> str:
    """One of four phrasings, a pure function of the request id (two independent hash bits)."""
    return asks[int(split_of(rid + "#t", 0.5) == "heldout") + 2 * int(split_of(rid + "#u", 0.5) == "heldout")]


# --------------------------------------------------------------------------- code


def public_functions(root: str, skip: re.Pattern[str], rel_to: str | None = None,
                     ) -> Iterator[tuple[str, ast.FunctionDef, str, str]]:
    """(file path relative to ``rel_to`` (default ``root``), function node, first docstring paragraph with its
    whitespace collapsed, source) of every public module-level function in the .py files under ``root``, in
    sorted path order; files whose relative path matches ``skip``, unreadable or unparsable ones are left out."""
    for path in sorted(glob.glob(os.path.join(root, "**", "*.py"), recursive=True)):
        rel = os.path.relpath(path, rel_to or root)
        if skip.search(rel):
            continue
        text = read_text_file(path)
        if not text:
            continue
        try:
            tree = ast.parse(text)
        except (SyntaxError, ValueError):
            continue
        for node in tree.body:
            if isinstance(node, ast.FunctionDef) and not node.name.startswith("_"):
                first = " ".join((ast.get_docstring(node) or "").split("\n\n")[0].split())
                yield rel, node, first, ast.get_source_segment(text, node) or ""


def _stdlib_functions(cfg: CorpusConfig) -> Iterator[tuple[str, str, str, str]]:
    """(id, signature, first docstring paragraph, source) of public stdlib functions."""
    skip = re.compile(r"(^|/)(test|tests|idlelib|site-packages|lib2to3|__pycache__|turtledemo|encodings)(/|$)")
    for rel, node, first, source in public_functions(cfg.stdlib_dir, skip):
        if 30 <= len(first) <= 400:
            args = ", ".join(a.arg for a in node.args.args)
            yield f"code:{rel}:{node.name}", f"{node.name}({args})", first, source


_EXPLAIN_CODE = "Explain what this Python function does:\n\n```python\n{q}\n```"
_WRITE_CODE = "Write a Python function {q}"


def code_requests(cfg: ChatWorkloadConfig) -> Iterator[ChatRequest]:
    for rid, sig, doc, source in _stdlib_functions(cfg.sources):
        # the template is a function of the id, so a source always yields the same request
        if len(source) <= cfg.max_quote_chars and split_of(rid + "#explain", 0.5) == "heldout":
            content = _EXPLAIN_CODE.format(q=source)
        else:
            content = _WRITE_CODE.format(q=f"`{sig}` that does this: {doc}")
        yield ChatRequest("code", rid, content)


# --------------------------------------------------------------------------- math

_MATH_ASKS = ("Solve this step by step: {p}", "{p} Show your work.", "Can you help me with this? {p}", "{p}")


MATH_PROBLEMS = 18_000
"""Math problems generated, whatever the training quota: the held-out requests are a shuffle of this pool's
held-out share, so a pool that grew with ``train_per_domain`` changed them (18,000 is the pool the committed
zoo's held-out requests were drawn from, 20 x (800 + 100)); 15,321 of them fall to training."""


def math_requests(cfg: ChatWorkloadConfig) -> Iterator[ChatRequest]:
    r = random.Random(cfg.seed)
    for i in range(MATH_PROBLEMS):
        problem = r.choice(MATH_GENERATORS)(r).split("\n")[0].removeprefix("Problem: ")
        yield ChatRequest("math", f"math:{cfg.seed}:{i}", r.choice(_MATH_ASKS).format(p=problem))


# --------------------------------------------------------------------------- law

_LAW_ASKS = (
    "Explain in plain words what this licence clause means:\n\n{q}",
    "What does this clause allow, and what does it forbid?\n\n{q}",
    "Summarize this part of a software licence for a developer:\n\n{q}",
    "I am not a lawyer. What are my obligations under this text?\n\n{q}",
)


def law_requests(cfg: ChatWorkloadConfig) -> Iterator[ChatRequest]:
    src = cfg.sources
    paths = sorted(glob.glob(os.path.join(src.licence_dir, "*")))
    for g in src.doc_globs:
        paths += sorted(glob.glob(g))
    seen: set[str] = set()
    for path in paths:
        if os.path.islink(path) or not os.path.isfile(path):
            continue
        text = read_text_file(path) or ""
        for k, para in enumerate(re.split(r"\n\s*\n", text)):
            para = " ".join(para.split())
            letters = sum(c.isalpha() for c in para)
            if len(para) < 160 or letters / len(para) < 0.7 or para in seen:
                continue  # short headers, file lists, and boiler-plate already seen in another file
            seen.add(para)
            rid = f"law:{path}#{k}"
            yield ChatRequest("law", rid, _ask(_LAW_ASKS, rid).format(q=clip_quote(para, cfg.max_quote_chars)))


# --------------------------------------------------------------------------- medical

_MED_ASKS = (
    "What is {c}? Describe its usual symptoms and treatment.",
    "Explain {c} to a patient in simple words.",
    "What causes {c}, and how is it diagnosed?",
    "How is {c} treated, and can it be prevented?",
)


def medical_requests(cfg: ChatWorkloadConfig) -> Iterator[ChatRequest]:
    try:
        import simple_icd_10_cm as cm
    except ImportError as e:
        raise ZooSetupError("the medical requests need simple-icd-10-cm: pip install -r requirements-zoo.txt") from e
    for code in cm.get_all_codes(False):
        if not (cm.is_category(code) or cm.is_subcategory(code)) or cm.is_extended_subcategory(code):
            continue
        desc = cm.get_description(code)
        if not desc or "other" in desc.lower().split() or "unspecified" in desc.lower() or len(desc) > 90:
            continue  # residual classes ("Other specified ...") are not conditions a person asks about
        rid = f"medical:{code}"
        yield ChatRequest("medical", rid, _ask(_MED_ASKS, rid).format(c=desc[0].lower() + desc[1:]))


# --------------------------------------------------------------------------- general

_ACTIVITIES = ("cooking dinner for friends", "learning a new language", "keeping a small garden", "saving money",
               "sleeping better", "running a first 5 km race", "moving to a new city", "studying for an exam",
               "organising a birthday party", "working from home", "training a puppy", "travelling by train")
_SUBJECTS = ("a lighthouse keeper", "a lost cat", "a robot that learns to paint", "two friends on a mountain",
             "a rainy market day", "an old clock", "a child's first day at school", "a baker who wakes up late",
             "a ship in a storm", "a forgotten letter")
_EVERYDAY = ("Give me three practical tips for {a}.", "Write a short story about {s}.",
             "Describe {s} in a few sentences.", "What should I think about before {a}?")


_SUMMARIZE = "Summarize this paragraph in plain words:\n\n{q}"


def general_requests(cfg: ChatWorkloadConfig) -> Iterator[ChatRequest]:
    src = cfg.sources
    paths: list[str] = []
    for g in src.prose_globs:
        paths += sorted(glob.glob(g, recursive=True))
    for path in paths:
        for k, para in enumerate(re.split(r"\n\s*\n", read_text_file(path) or "")):
            if is_prose(para):
                text = clip_quote(" ".join(para.split()), cfg.max_quote_chars)
                yield ChatRequest(
                    "general", f"general:{path}#{k}", _SUMMARIZE.format(q=text)
                )
    for i, template in enumerate(_EVERYDAY):
        for j, a in enumerate(_ACTIVITIES):
            for m, s in enumerate(_SUBJECTS):
                if "{a}" in template and m or "{s}" in template and j:
                    continue  # each template once per value it uses
                yield ChatRequest("general", f"general:everyday:{i}:{j}:{m}", template.format(a=a, s=s))


SOURCES: dict[str, Callable[[ChatWorkloadConfig], Iterator[ChatRequest]]] = {
    "general": general_requests,
    "code": code_requests,
    "math": math_requests,
    "law": law_requests,
    "medical": medical_requests,
}


# --------------------------------------------------------------------------- splits


def _first_of_each(requests) -> list[ChatRequest]:
    """``requests`` with each material (request_material) kept once, the first: a random problem drawn twice, the
    same paragraph in two manuals, an ICD code the library lists twice were two rows of one workload (math held out
    "Solve x^2 + 9x + 8 = 0." twice) or a held-out and a training copy."""
    seen: set[frozenset[str]] = set()
    kept = []
    for q in requests:
        material = request_material(q.content)
        if material not in seen:
            seen.add(material)
            kept.append(q)
    return kept


def _split(requests: list[ChatRequest], cfg: ChatWorkloadConfig, domain: str) -> tuple[list, list]:
    r = random.Random(f"{cfg.seed}:{domain}")
    train = [q for q in requests if split_of(q.source, cfg.heldout_fraction) == "train"]
    heldout = [q for q in requests if split_of(q.source, cfg.heldout_fraction) == "heldout"]
    r.shuffle(train)
    r.shuffle(heldout)
    return train, heldout


_MIXED_FIRST, _MIXED_SECOND = "I have two questions. First: ", "\n\nSecond: "


def _mixed(a: ChatRequest, b: ChatRequest) -> ChatRequest:
    return ChatRequest("mixed", f"mixed:{a.source}+{b.source}", f"{_MIXED_FIRST}{a.content}{_MIXED_SECOND}{b.content}")


@cache
def _templates() -> list[tuple[str, str]]:
    """(text before, text after) the material of every request phrasing, the most specific first."""
    asks = [*_MATH_ASKS, *_LAW_ASKS, *_MED_ASKS, *_EVERYDAY, _EXPLAIN_CODE, _WRITE_CODE, _SUMMARIZE]
    pairs = [tuple(re.sub(r"\{[pcas]\}", "{q}", a).split("{q}")) for a in asks]
    return sorted(pairs, key=lambda pair: -len(pair[0]) - len(pair[1]))


def request_material(prompt: str) -> frozenset[str]:
    """What a request asks about, without its phrasing: the problem, clause, function or paragraph it quotes (the
    whole prompt where no phrasing matches; both parts of a mixed request). Two requests with the same material are
    one request for a split: the same paragraph in two manuals, one random problem drawn twice and asked in other
    words, had both a held-out and a training copy (44 of the 600 held-out requests, 25 of them math and 15 verbatim,
    in the first 10,240 training requests of the committed zoo)."""
    if prompt.startswith(_MIXED_FIRST) and _MIXED_SECOND in prompt:
        first, _, second = prompt[len(_MIXED_FIRST):].partition(_MIXED_SECOND)
        return request_material(first) | request_material(second)
    text = prompt.strip()
    for before, after in _templates():
        if text.startswith(before) and text.endswith(after) and len(text) > len(before) + len(after):
            return frozenset([" ".join(text[len(before): len(text) - len(after)].split())])
    return frozenset([" ".join(text.split())])


def build_chat_workloads(cfg: ChatWorkloadConfig) -> tuple[dict[str, list[ChatRequest]], dict[str, list[ChatRequest]]]:
    """(held-out requests per workload, training requests per domain), deterministic.

    ``mixed`` requests pair two requests of different domains from the *same*
    split (they use requests beyond the per-domain quota), so held-out mixed
    requests share no source with any training request.
    """
    heldout: dict[str, list[ChatRequest]] = {}
    train: dict[str, list[ChatRequest]] = {}
    spare_train: dict[str, list[ChatRequest]] = {}
    spare_held: dict[str, list[ChatRequest]] = {}
    n_mixed = cfg.heldout_per_workload // len(MIXED_PAIRS) + 1
    n_mixed_train = cfg.train_per_domain // (2 * len(MIXED_PAIRS)) + 1
    splits = {domain: _split(_first_of_each(SOURCES[domain](cfg)), cfg, domain) for domain in DOMAINS}
    # a training request whose material a held-out request of any domain also asks about is dropped: its answer
    # would teach the drafts (and fill the datastore with) a held-out answer
    held_material = set().union(*(request_material(q.content) for _, ho in splits.values() for q in ho))
    for domain in DOMAINS:
        tr, ho = splits[domain]
        tr = [q for q in tr if not request_material(q.content) & held_material]
        # each mixed pair the domain is in takes n_mixed more of its held-out requests (code and medical: three)
        need_ho = cfg.heldout_per_workload + n_mixed * sum(domain in pair for pair in MIXED_PAIRS)
        if len(ho) < need_ho:
            raise ZooSetupError(f"only {len(ho)} held-out {domain} requests on this machine, {need_ho} needed:"
                               " lower ChatWorkloadConfig.heldout_per_workload or install the sources"
                               " (requirements-zoo.txt)")
        heldout[domain], spare_held[domain] = ho[: cfg.heldout_per_workload], ho[cfg.heldout_per_workload :]
        train[domain], spare_train[domain] = tr[: cfg.train_per_domain], tr[cfg.train_per_domain :]
    r = random.Random(cfg.seed)
    mixed_held, mixed_train = [], []
    short = [f"{d} {len(train[d])} of {cfg.train_per_domain}" for d in DOMAINS if len(train[d]) < cfg.train_per_domain]
    for a, b in MIXED_PAIRS:
        for _ in range(n_mixed):
            mixed_held.append(_mixed(spare_held[a].pop(), spare_held[b].pop()))
        made = 0
        for _ in range(n_mixed_train):
            if spare_train[a] and spare_train[b]:
                mixed_train.append(_mixed(spare_train[a].pop(), spare_train[b].pop()))
                made += 1
        if made < n_mixed_train:
            short.append(f"mixed {a}+{b} {made} of {n_mixed_train}")
    if short:  # said, not silent: the drafts then learn less of those (the committed zoo's mixed pairs: 2 of 6)
        warnings.warn(f"fewer training requests than asked, this machine's sources hold no more: {'; '.join(short)}",
                      stacklevel=2)
    r.shuffle(mixed_held)
    heldout["mixed"] = mixed_held[: cfg.heldout_per_workload]
    train["mixed"] = mixed_train
    return {w: heldout[w] for w in WORKLOADS}, train


def heldout_material(folder: Path) -> set[str]:
    """The material (request_material) of every held-out request in a workload folder's ``<workload>.jsonl``."""
    held: set[str] = set()
    for path in sorted(Path(folder).glob("*.jsonl")):
        if not path.stem.startswith("train"):
            for line in path.read_text(encoding="utf-8").splitlines():
                if line.strip():
                    held |= request_material(json.loads(line)["prompt"])
    return held


def asks_heldout(requests: Path, folder: Path) -> list[bool]:
    """Per row of a ``requests`` file: does it ask what a held-out request in ``folder`` asks (its material)."""
    held = heldout_material(folder)
    rows = read_jsonl(requests)
    return [bool(request_material(row["prompt"]) & held) for row in rows]


def withhold_heldout(answers: list, requests: Path, folder: Path) -> tuple[list, int]:
    """``answers`` (answer ``i`` to row ``i`` of the ``requests`` file) with those to requests that ask what a
    held-out request in ``folder`` asks replaced by empty ones (the rows stay aligned), and how many were."""
    asks = asks_heldout(requests, folder)
    withheld = [i < len(asks) and asks[i] for i in range(len(answers))]
    return [[] if w else answer for w, answer in zip(withheld, answers, strict=True)], sum(withheld)


def write_jsonl(path: Path, requests: list[ChatRequest]) -> None:
    """The requests' rows, written aside and renamed (workloads.write_jsonl): the build takes an existing
    train_requests.jsonl for a finished stage, so a cut write must leave no file rather than a shorter one."""
    from .workloads import write_jsonl as write_rows

    write_rows(path, [q.row() for q in requests])
