"""Write ``docs/workloads-unseen/``: chat workloads from text the zoo never saw (issue 17).

    python scripts/make_unseen_workloads.py [--out docs/workloads-unseen] [--per-domain 12]
    python scripts/make_unseen_workloads.py --check-only      # re-check the committed files

The zoo's drafts were trained on, and its held-out workloads were written from, the sources in
``memspec_ros/zoo/corpora.py`` and ``memspec_ros/zoo/chat_workloads.py``: the Python standard
library, ``/usr/share/common-licenses`` and ``/usr/share/doc/*/copyright``, ICD-10-CM
(``simple-icd-10-cm``), generated arithmetic/algebra problems, and the Vim, CMake, Git and Node.js
manuals.  This script writes one ``<domain>.jsonl`` per domain (code, math, law, medical, general)
from other text on this machine, in the zoo's chat row format
(``{"domain", "prompt", "messages", "source"}``), with request phrasings of its own:

- code: functions of the installed ``networkx`` package (``.venv`` site-packages), "implement this"
  from the first docstring paragraph or "explain this code" over short functions;
- math: prose paragraphs of the installed ``sympy`` package's docstrings (number theory,
  combinatorial and elementary functions), asked to be explained with a worked example;
- law: paragraphs of the licence files shipped in site-packages (``*.dist-info/**/LICEN[CS]E*``,
  ``COPYING*``, ``<package>/LICENSE*``), asked about in plain words;
- medical: this machine holds no medical text besides ICD-10-CM (the zoo's source), so the
  medical requests are written by hand below (source ``"hand-written"``);
- general: English prose paragraphs of the GNU info manuals in ``/usr/share/info`` (coreutils,
  grep, sed, find, ...), asked to be explained or summarised.

Selection is deterministic: candidates in sorted path order, shuffled with a fixed seed per
domain, at most ``--per-file`` per source file, and any candidate that shares a 50-character span
(whitespace normalised) with the zoo's requests (``models/workloads/*.jsonl``, training and
held-out) or with the zoo's corpus sources is skipped.  Then every written request is checked
again: a brute-force substring test of each 50-character window against the zoo's requests, and
the span index against the corpus sources; both counts are printed (both must be 0).  Nothing is
downloaded.
"""

from __future__ import annotations

import argparse
import ast
import glob
import gzip
import json
import os
import random
import re
import sysconfig
from collections.abc import Iterator
from pathlib import Path

from memspec_ros.zoo import corpora
from memspec_ros.zoo.chat_workloads import ChatRequest, clip_quote, public_functions
from memspec_ros.zoo.corpora import CorpusConfig, is_prose, read_text_file

ROOT = Path(__file__).resolve().parents[1]
SITE = sysconfig.get_paths()["purelib"]
DOMAINS = ("code", "math", "law", "medical", "general")
SPAN = 50
MAX_QUOTE = 700
SEED = 17


def norm(text: str) -> str:
    return " ".join(text.split())


def clip(text: str) -> str:
    return clip_quote(text, MAX_QUOTE)


def pick(key: str, options: tuple[str, ...]) -> str:
    return options[random.Random(key).randrange(len(options))]


# --------------------------------------------------------------------------- the zoo's text (to avoid)


class SpanIndex:
    """Does a text share a ``span``-character substring with the reference?  Exact, not sampled.

    Any window of length ``span`` in the query contains one of its aligned chunks of ``span // 2``
    characters; each occurrence of such a chunk in the reference is extended both ways.
    """

    def __init__(self, texts: list[str], span: int = SPAN):
        self.ref = "\x00".join(norm(t) for t in texts)
        self.span = span

    def longest(self, query: str) -> int:
        q, r, h = norm(query), self.ref, self.span // 2
        best = 0
        for a in range(0, len(q) - h + 1, h):
            chunk = q[a : a + h]
            pos = r.find(chunk)
            while pos >= 0:
                left = 0
                while a - left > 0 and pos - left > 0 and q[a - left - 1] == r[pos - left - 1]:
                    left += 1
                right = h
                while a + right < len(q) and pos + right < len(r) and q[a + right] == r[pos + right]:
                    right += 1
                best = max(best, left + right)
                if best >= self.span:
                    return best
                pos = r.find(chunk, pos + 1)
        return best

    def shares(self, query: str) -> bool:
        return self.longest(query) >= self.span


def zoo_request_texts(workload_dir: Path) -> list[str]:
    """Every request of the zoo's training and held-out workload files."""
    texts = []
    for path in sorted(workload_dir.glob("*.jsonl")):
        for line in path.read_text(encoding="utf-8").splitlines():
            if line.strip():
                r = json.loads(line)
                texts += [m["content"] for m in r.get("messages", [])] or [r["prompt"]]
    return texts


def zoo_corpus_texts(cfg: CorpusConfig) -> list[str]:
    """The zoo's corpus sources before de-duplication and caps (a superset of what the drafts saw)."""
    texts = [d.text for src in (corpora.code_documents, corpora.law_documents, corpora.math_documents,
                                corpora.medical_documents) for d in src(cfg)]
    for g in cfg.prose_globs:  # the raw manual files, not only their prose paragraphs
        texts += [t for p in sorted(glob.glob(g, recursive=True)) if (t := read_text_file(p))]
    return texts


# --------------------------------------------------------------------------- candidates per domain

_WRITE = ("Implement `{sig}` in Python. It should do the following: {doc}",
          "I need a Python function `{sig}`. Here is what it must do: {doc}")
_EXPLAIN = ("What does this Python code do? Walk me through it.\n\n```python\n{src}\n```",
            "Describe step by step how this function works:\n\n```python\n{src}\n```")


def code_candidates() -> Iterator[tuple[str, str, str]]:
    """(source id, file, request) over public functions of the installed networkx package."""
    skip = re.compile(r"(^|/)(tests|__pycache__|drawing|readwrite)(/|$)")
    for rel, node, first, src in public_functions(os.path.join(SITE, "networkx"), skip, rel_to=SITE):
        sid = f"site-packages:{rel}:{node.name}"
        if len(src) <= MAX_QUOTE and random.Random(sid + "#kind").random() < 0.5:
            yield sid, rel, pick(sid, _EXPLAIN).format(src=src)
        elif 40 <= len(first) <= 400:
            sig = f"{node.name}({', '.join(a.arg for a in node.args.args)})"
            yield sid, rel, pick(sid, _WRITE).format(sig=sig, doc=first)


_MATH = ("Explain the mathematics in this passage and work through one small example:\n\n{q}",
         "What does this definition say? Give me a worked example.\n\n{q}",
         "Help me understand this piece of maths, step by step:\n\n{q}",
         "Here is a statement from a mathematics text. Explain it and check it on a simple case:\n\n{q}")
_MATH_FILES = ("sympy/ntheory/*.py", "sympy/functions/combinatorial/*.py", "sympy/functions/elementary/*.py",
               "sympy/functions/special/*.py", "sympy/sets/*.py", "sympy/series/*.py")


def math_candidates() -> Iterator[tuple[str, str, str]]:
    """Prose paragraphs of sympy's docstrings (no doctests, tables or headings)."""
    paths = sorted(p for g in _MATH_FILES for p in glob.glob(os.path.join(SITE, g)))
    for path in paths:
        rel = os.path.relpath(path, SITE)
        text = read_text_file(path) or ""
        try:
            tree = ast.parse(text)
        except (SyntaxError, ValueError):
            continue
        for node in ast.walk(tree):
            if not isinstance(node, (ast.FunctionDef, ast.ClassDef)) or node.name.startswith("_"):
                continue
            for k, para in enumerate((ast.get_docstring(node) or "").split("\n\n")):
                lines = para.strip().splitlines()
                if not lines or any(ln.lstrip().startswith((">>>", "...", "..", "===", "---", "*", "-", "|"))
                                    for ln in lines) or any(ln.startswith(" ") for ln in lines):
                    continue
                p = norm(para)
                letters = sum(c.isalpha() for c in p)
                if (len(p) < 140 or letters / len(p) < 0.6 or p.count(". ") + p.endswith(".") < 1
                        or p.count(":") > 1 or len(p.split()) < 20):
                    continue  # parameter lists, "See Also" lists, one-line summaries
                sid = f"site-packages:{rel}:{node.name}#{k}"
                yield sid, rel, pick(sid, _MATH).format(q=clip(p))


_LAW = ("Put this licence paragraph into plain English:\n\n{q}",
        "Can I use software under this text in a commercial product? Explain what the paragraph requires:\n\n{q}",
        "Summarise the conditions in this licence text:\n\n{q}",
        "Which rights and which duties does this paragraph give me?\n\n{q}")


_LEGAL = re.compile(r"licen[cs]|permi|copyright|warrant|distribut|liab|terms|condition|rights", re.I)


def law_candidates() -> Iterator[tuple[str, str, str]]:
    """Paragraphs of the licence files installed with the Python packages (clauses, not author lists)."""
    pats = ("*.dist-info/LICEN[CS]E*", "*.dist-info/COPYING*", "*.dist-info/licenses/**/*",
            "*/LICEN[CS]E*", "*/COPYING*", "*/*/LICEN[CS]E*")
    paths = sorted({p for g in pats for p in glob.glob(os.path.join(SITE, g), recursive=True)
                    if os.path.isfile(p) and not os.path.islink(p)})
    for path in paths:
        rel = os.path.relpath(path, SITE)
        if "AUTHORS" in os.path.basename(path).upper():
            continue
        for k, para in enumerate(re.split(r"\n\s*\n", read_text_file(path) or "")):
            if any(ln.lstrip().startswith(("*", "-", "..", "#", "|", "`")) for ln in para.splitlines()):
                continue  # lists, markup, links
            p = norm(para)
            letters = sum(c.isalpha() for c in p)
            if len(p) < 160 or letters / len(p) < 0.7 or len(_LEGAL.findall(p)) < 2 or "@" in p or p.count(":") > 2:
                continue  # headers, addresses, file metadata, and text that grants or asks nothing
            sid = f"site-packages:{rel}#{k}"
            yield sid, rel, pick(sid, _LAW).format(q=clip(p))


# written by hand for this folder: the machine has no medical text but ICD-10-CM, the zoo's source
MEDICAL = (
    "My dad was just told he has atrial fibrillation. What does that mean for his heart, and what "
    "treatments are usually offered?",
    "I keep getting heartburn after dinner, especially when I lie down. What could be causing it and "
    "what can I do about it?",
    "What is the difference between type 1 and type 2 diabetes?",
    "My daughter has a fever of 39 degrees and a rash on her chest. When should I take her to a doctor?",
    "How does a doctor find out whether someone has asthma, and which inhalers are usually used?",
    "I twisted my ankle playing football and it is swollen and blue. Is it sprained or broken, and how "
    "should I look after it?",
    "What are the early warning signs of a stroke, and what should I do if I see them?",
    "Can you explain what high cholesterol is and why doctors worry about it?",
    "I have had a dry cough for four weeks since a cold. Is that normal, and what might be going on?",
    "What happens during a colonoscopy, and how should I prepare for one?",
    "My mother was diagnosed with osteoporosis. What does that mean, and how can she avoid breaking a bone?",
    "What side effects can I expect from taking ibuprofen every day for back pain?",
)


def medical_candidates() -> Iterator[tuple[str, str, str]]:
    for i, text in enumerate(MEDICAL):
        yield f"hand-written:medical:{i}", f"hand-written:{i}", text


_GENERAL = ("Explain this passage from a manual in simple terms:\n\n{q}",
            "Give me the gist of this paragraph in two sentences:\n\n{q}",
            "Rewrite this paragraph so that a beginner understands it:\n\n{q}",
            "What is the main point of this text?\n\n{q}")


def general_candidates() -> Iterator[tuple[str, str, str]]:
    """English prose paragraphs (the zoo's own prose filter) of the GNU info manuals."""
    for path in sorted(glob.glob("/usr/share/info/*.info*.gz")):
        try:
            with gzip.open(path, "rt", encoding="utf-8") as f:
                text = f.read()
        except (OSError, UnicodeDecodeError):
            continue
        for k, para in enumerate(re.split(r"\n\s*\n", text)):
            if is_prose(para):
                sid = f"{path}#{k}"
                yield sid, path, pick(sid, _GENERAL).format(q=clip(norm(para)))


CANDIDATES = {"code": code_candidates, "math": math_candidates, "law": law_candidates,
              "medical": medical_candidates, "general": general_candidates}


# --------------------------------------------------------------------------- build and check


def select(domain: str, avoid: list[SpanIndex], n: int, per_file: int) -> list[dict]:
    cands = list(CANDIDATES[domain]())
    if domain != "medical":
        random.Random(f"unseen:{domain}:{SEED}").shuffle(cands)
    rows: list[dict] = []
    per: dict[str, int] = {}
    seen: set[str] = set()
    for sid, file, content in cands:
        if len(rows) == n:
            break
        key = norm(content.split("\n\n", 1)[-1])  # the quoted text: one licence paragraph is in two files
        if per.get(file, 0) >= per_file or key in seen or any(ix.shares(content) for ix in avoid):
            continue
        seen.add(key)
        per[file] = per.get(file, 0) + 1
        rows.append(ChatRequest(domain, sid, content).row())
    if len(rows) < n:
        raise SystemExit(f"only {len(rows)} unseen {domain} requests on this machine, {n} wanted")
    return rows


def brute_force_overlaps(text: str, reference: str, span: int = SPAN) -> bool:
    """The plain check: is any ``span``-character window of the text a substring of the reference?"""
    t = norm(text)
    return any(t[i : i + span] in reference for i in range(max(0, len(t) - span + 1)))


def check(out: Path, workload_dir: Path, corpus: SpanIndex | None) -> dict:
    requests_ref = "\x00".join(norm(t) for t in zoo_request_texts(workload_dir))
    result = {"span": SPAN, "requests": 0, "overlap_zoo_requests": 0, "overlap_zoo_corpus": None}
    for domain in DOMAINS:
        for line in (out / f"{domain}.jsonl").read_text(encoding="utf-8").splitlines():
            content = json.loads(line)["messages"][0]["content"]
            result["requests"] += 1
            if brute_force_overlaps(content, requests_ref):
                result["overlap_zoo_requests"] += 1
                print(f"  overlap with the zoo's requests: {domain}: {content[:80]!r}")
            if corpus is not None:
                result["overlap_zoo_corpus"] = (result["overlap_zoo_corpus"] or 0) + corpus.shares(content)
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=ROOT / "docs" / "workloads-unseen")
    ap.add_argument("--zoo-workloads", type=Path, default=ROOT / "models" / "workloads",
                    help="the zoo's training and held-out request files (to avoid)")
    ap.add_argument("--per-domain", type=int, default=12)
    ap.add_argument("--per-file", type=int, default=2, help="at most this many requests from one source file")
    ap.add_argument("--check-only", action="store_true", help="only check the files already in --out")
    ap.add_argument("--no-corpus", action="store_true",
                    help="avoid and check only the zoo's requests, not its corpus sources (faster)")
    a = ap.parse_args()
    corpus = None if a.no_corpus else SpanIndex(zoo_corpus_texts(CorpusConfig()))
    if not a.check_only:
        avoid = [SpanIndex(zoo_request_texts(a.zoo_workloads))] + ([corpus] if corpus else [])
        a.out.mkdir(parents=True, exist_ok=True)
        for domain in DOMAINS:
            rows = select(domain, avoid, a.per_domain, a.per_file)
            with (a.out / f"{domain}.jsonl").open("w", encoding="utf-8") as f:
                for r in rows:
                    f.write(json.dumps(r, ensure_ascii=False) + "\n")
            print(f"{domain}: {len(rows)} requests from {len({r['source'].split('#')[0] for r in rows})} sources")
    res = check(a.out, a.zoo_workloads, corpus)
    print(f"{res['requests']} requests; sharing a {SPAN}-character span (whitespace normalised) with the zoo's"
          f" requests (models/workloads/*.jsonl, training and held-out): {res['overlap_zoo_requests']};"
          f" with the zoo's corpus sources: {res['overlap_zoo_corpus']}")
    if res["overlap_zoo_requests"] or res["overlap_zoo_corpus"]:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
