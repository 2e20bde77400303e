"""Deterministic domain corpora for the bundled zoo.

Every text comes from this machine or from a package registry, so a fresh
machine of this kind rebuilds the same corpora without a download at build
time (the ICD-10-CM source needs ``simple-icd-10-cm`` from
``requirements-zoo.txt``).  The split into train and held-out is by
*document* and decided by a hash of the document id, so adding or removing a
source file never moves another document across the split.  Paragraphs are
de-duplicated within a domain (first occurrence in sorted order wins) so that
boiler-plate shared by many files (the GPL text in Debian copyright files,
licence headers in source files) cannot leak from training into evaluation.
"""

from __future__ import annotations

import glob
import hashlib
import os
import random
import re
import sysconfig
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from fractions import Fraction

DOMAINS: tuple[str, ...] = ("general", "code", "math", "law", "medical")
"""Draft names and single-domain workload names, in the order used everywhere."""

WORKLOADS: tuple[str, ...] = ("code", "math", "law", "medical", "general", "mixed")


@dataclass(frozen=True)
class Document:
    """One unit of text; the train/held-out split never cuts through it."""

    domain: str
    doc_id: str
    text: str


@dataclass
class CorpusConfig:
    """Where each domain's text comes from and how much of it to keep."""

    heldout_fraction: float = 0.1
    max_chars: dict[str, int] = field(
        default_factory=lambda: {
            "general": 6_000_000,
            "code": 6_000_000,
            "math": 4_000_000,
            "law": 8_000_000,
            "medical": 6_000_000,
        }
    )
    stdlib_dir: str = sysconfig.get_paths()["stdlib"]
    doc_globs: tuple[str, ...] = ("/usr/share/doc/*/copyright",)
    licence_dir: str = "/usr/share/common-licenses"
    prose_globs: tuple[str, ...] = (
        "/usr/share/vim/vim9*/doc/*.txt",
        "/usr/share/cmake-*/Help/**/*.rst",
        "/usr/share/doc/git/**/*.txt",
        "/usr/share/doc/nodejs/**/*.md",
    )
    math_seed: int = 1234
    math_documents: int = 12_000
    chunk_chars: int = 1500


# --------------------------------------------------------------------------- split


def split_of(doc_id: str, heldout_fraction: float = 0.1) -> str:
    """``"heldout"`` or ``"train"``, a pure function of the document id."""
    h = int.from_bytes(hashlib.sha256(doc_id.encode("utf-8")).digest()[:8], "big")
    return "heldout" if h / 2**64 < heldout_fraction else "train"


def split_documents(
    docs: Iterable[Document], heldout_fraction: float = 0.1
) -> tuple[list[Document], list[Document]]:
    """(train, held-out) lists, preserving the input order within each."""
    train: list[Document] = []
    heldout: list[Document] = []
    for d in docs:
        (heldout if split_of(d.doc_id, heldout_fraction) == "heldout" else train).append(d)
    return train, heldout


def dedupe_paragraphs(docs: Iterable[Document], min_chars: int = 40) -> Iterator[Document]:
    """Drop paragraphs (blank-line separated) already seen in an earlier document.

    Short paragraphs (blank lines, ``}``, ``else:``) are kept: they carry no
    content worth leaking and removing them would mangle code.
    """
    seen: set[bytes] = set()
    for d in docs:
        kept = []
        for para in re.split(r"\n\s*\n", d.text):
            key = hashlib.sha1(" ".join(para.split()).encode("utf-8")).digest()
            if len(para.strip()) >= min_chars:
                if key in seen:
                    continue
                seen.add(key)
            kept.append(para)
        text = "\n\n".join(kept).strip()
        if text:
            yield Document(d.domain, d.doc_id, text)


def _capped(docs: Iterable[Document], max_chars: int) -> list[Document]:
    out, total = [], 0
    for d in docs:
        if total >= max_chars:
            break
        out.append(d)
        total += len(d.text)
    return out


def _chunks(domain: str, doc_id: str, text: str, chunk_chars: int) -> Iterator[Document]:
    """Cut a long file at paragraph boundaries into documents of ~chunk_chars."""
    buf: list[str] = []
    size, k = 0, 0
    for para in re.split(r"\n\s*\n", text):
        buf.append(para)
        size += len(para) + 2
        if size >= chunk_chars:
            yield Document(domain, f"{doc_id}#{k}", "\n\n".join(buf).strip())
            buf, size, k = [], 0, k + 1
    if buf and "".join(buf).strip():
        yield Document(domain, f"{doc_id}#{k}", "\n\n".join(buf).strip())


def read_text_file(path: str) -> str | None:
    """The file's text, or None if it is unreadable or not UTF-8 (a source's files vary by installation)."""
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except (UnicodeDecodeError, OSError):
        return None


# --------------------------------------------------------------------------- code


def code_documents(cfg: CorpusConfig) -> Iterator[Document]:
    """Python standard library modules (PSF licence), tests and vendored code excluded."""
    root = cfg.stdlib_dir
    skip = re.compile(r"(^|/)(test|tests|idlelib|site-packages|lib2to3|__pycache__|turtledemo)(/|$)")
    for path in sorted(glob.glob(os.path.join(root, "**", "*.py"), recursive=True)):
        rel = os.path.relpath(path, root)
        if skip.search(rel):
            continue
        text = read_text_file(path)
        if text and len(text) > 500:
            yield from _chunks("code", f"code:{rel}", text, cfg.chunk_chars)


# --------------------------------------------------------------------------- law


def law_documents(cfg: CorpusConfig) -> Iterator[Document]:
    """Licence texts and Debian machine-readable copyright files."""
    paths = sorted(glob.glob(os.path.join(cfg.licence_dir, "*")))
    for g in cfg.doc_globs:
        paths += sorted(glob.glob(g))
    for path in paths:
        if os.path.islink(path) or not os.path.isfile(path):
            continue
        text = read_text_file(path)
        if text and len(text) > 300:
            yield from _chunks("law", f"law:{path}", text, cfg.chunk_chars)


# --------------------------------------------------------------------------- medical


def medical_documents(cfg: CorpusConfig) -> Iterator[Document]:
    """ICD-10-CM (public domain, CDC/NCHS) via ``simple_icd_10_cm`` (MIT).

    One document per three-character category: the category, its notes and
    every subcode with its description, the way a tabular list reads.
    """
    try:
        import simple_icd_10_cm as cm
    except ImportError as e:  # pragma: no cover - only the build needs it
        raise RuntimeError(
            "the medical corpus needs simple-icd-10-cm: pip install -r requirements-zoo.txt"
        ) from e

    def notes(code: str) -> list[str]:
        lines = []
        for label, fn in (
            ("Includes", cm.get_includes),
            ("Inclusion terms", cm.get_inclusion_term),
            ("Excludes1", cm.get_excludes1),
            ("Excludes2", cm.get_excludes2),
            ("Code first", cm.get_code_first),
            ("Code also", cm.get_code_also),
            ("Use additional code", cm.get_use_additional_code),
            ("Note", cm.get_notes),
        ):
            items = fn(code)
            if items:
                lines.append(f"{label}: " + "; ".join(items))
        return lines

    for chapter in cm.get_all_codes(True):
        if not cm.is_chapter(chapter):
            continue
        for block in cm.get_children(chapter):
            if not cm.is_block(block):
                continue
            for cat in cm.get_children(block):
                if not cm.is_category(cat):
                    continue
                lines = [
                    f"Chapter {chapter}: {cm.get_description(chapter)}",
                    f"Block {block}: {cm.get_description(block)}",
                    f"{cat} {cm.get_description(cat)}",
                ]
                lines += notes(cat)
                for sub in cm.get_descendants(cat, prioritize_blocks=False):
                    if cm.is_extended_subcategory(sub):
                        continue  # 7th-character variants repeat their parent verbatim
                    lines.append(f"{cm.add_dot(sub)} {cm.get_description(sub)}")
                    lines += ["  " + n for n in notes(sub)]
                    seven = cm.get_seven_chr_def(sub)
                    if seven:
                        lines.append("  7th character: " + "; ".join(f"{k} {v}" for k, v in seven.items()))
                yield Document("medical", f"medical:{cat}", "\n".join(lines))


# --------------------------------------------------------------------------- math


def _frac(f: Fraction) -> str:
    return str(f.numerator) if f.denominator == 1 else f"{f.numerator}/{f.denominator}"


def _arithmetic(r: random.Random) -> str:
    a, b, c, d = (r.randint(2, 99) for _ in range(4))
    op1, op2 = r.choice("+-"), r.choice("+-")
    s1 = a + b if op1 == "+" else a - b
    s2 = s1 + c * d if op2 == "+" else s1 - c * d
    return (
        f"Problem: Compute {a} {op1} {b} {op2} {c} * {d}.\n"
        f"Solution: Multiplication comes first: {c} * {d} = {c * d}.\n"
        f"Then from left to right: {a} {op1} {b} = {s1}.\n"
        f"Finally {s1} {op2} {c * d} = {s2}.\n"
        f"Answer: {s2}"
    )


def _fractions(r: random.Random) -> str:
    b, d = r.randint(2, 12), r.randint(2, 12)
    a, c = r.randint(1, b - 1 if b > 1 else 1), r.randint(1, d)
    x, y = Fraction(a, b), Fraction(c, d)
    import math as _m

    lcm = b * d // _m.gcd(b, d)
    s = x + y
    return (
        f"Problem: Add the fractions {a}/{b} + {c}/{d}.\n"
        f"Solution: The least common denominator of {b} and {d} is {lcm}.\n"
        f"Rewrite: {a}/{b} = {a * lcm // b}/{lcm} and {c}/{d} = {c * lcm // d}/{lcm}.\n"
        f"Add the numerators: {a * lcm // b} + {c * lcm // d} = {a * lcm // b + c * lcm // d}, "
        f"so the sum is {a * lcm // b + c * lcm // d}/{lcm}.\n"
        f"Simplify: {a * lcm // b + c * lcm // d}/{lcm} = {_frac(s)}.\n"
        f"Answer: {_frac(s)}"
    )


def _linear(r: random.Random) -> str:
    a, x = r.randint(2, 12), r.randint(-20, 20)
    b = r.randint(-50, 50)
    c = a * x + b
    bs = f"+ {b}" if b >= 0 else f"- {-b}"
    step = f"Subtract {b} from both sides" if b >= 0 else f"Add {-b} to both sides"
    return (
        f"Problem: Solve for x: {a}x {bs} = {c}.\n"
        f"Solution: {step}: {a}x = {c} {'-' if b >= 0 else '+'} {abs(b)} = {c - b}.\n"
        f"Divide both sides by {a}: x = {c - b} / {a} = {x}.\n"
        f"Check: {a} * {x} {bs} = {c}.\n"
        f"Answer: x = {x}"
    )


_NAMES = ["Ana", "Ben", "Chen", "Dara", "Eli", "Farah", "Gus", "Hana", "Ivan", "Jo", "Kofi", "Lena"]
_ITEMS = ["apples", "pencils", "books", "marbles", "stickers", "cookies", "stamps", "cards"]


def _word_problem(r: random.Random) -> str:
    kind = r.randrange(3)
    n = r.choice(_NAMES)
    if kind == 0:
        item = r.choice(_ITEMS)
        a, b, c = r.randint(10, 90), r.randint(2, 9), r.randint(1, 9)
        total = a + b * c
        return (
            f"Problem: {n} has {a} {item}. {n} buys {b} packs with {c} {item} in each pack. "
            f"How many {item} does {n} have now?\n"
            f"Solution: The packs contain {b} * {c} = {b * c} {item}.\n"
            f"Add them to the {a} {item}: {a} + {b * c} = {total}.\n"
            f"Answer: {total}"
        )
    if kind == 1:
        speed, hours = r.randint(20, 90), r.randint(2, 9)
        return (
            f"Problem: A train travels at {speed} km per hour for {hours} hours. How far does it go?\n"
            f"Solution: Distance equals speed times time.\n"
            f"Distance = {speed} * {hours} = {speed * hours} km.\n"
            f"Answer: {speed * hours} km"
        )
    price, pct = r.randint(2, 40) * 10, r.choice([10, 15, 20, 25, 30, 40, 50])
    off = price * pct // 100
    return (
        f"Problem: A jacket costs {price} dollars and is on sale for {pct}% off. What is the sale price?\n"
        f"Solution: The discount is {pct}% of {price} = {pct}/100 * {price} = {off} dollars.\n"
        f"Subtract the discount: {price} - {off} = {price - off}.\n"
        f"Answer: {price - off} dollars"
    )


def _quadratic(r: random.Random) -> str:
    p, q = r.randint(-9, 9), r.randint(-9, 9)
    b, c = -(p + q), p * q

    def sgn(v: int) -> str:
        return f"+ {v}" if v >= 0 else f"- {-v}"

    return (
        f"Problem: Solve x^2 {sgn(b)}x {sgn(c)} = 0.\n"
        f"Solution: Look for two numbers whose product is {c} and whose sum is {-b}: {p} and {q}.\n"
        f"Factor: (x {sgn(-p)})(x {sgn(-q)}) = 0.\n"
        f"So x = {p} or x = {q}.\n"
        f"Answer: x = {min(p, q)}, x = {max(p, q)}"
    )


MATH_GENERATORS: tuple[Callable[[random.Random], str], ...] = (
    _arithmetic,
    _fractions,
    _linear,
    _word_problem,
    _quadratic,
)


def math_documents(cfg: CorpusConfig) -> Iterator[Document]:
    """Seeded worksheets of 3-6 worked problems each (generated, no licence)."""
    r = random.Random(cfg.math_seed)
    for i in range(cfg.math_documents):
        probs = [r.choice(MATH_GENERATORS)(r) for _ in range(r.randint(3, 6))]
        yield Document("math", f"math:{cfg.math_seed}:{i}", "\n\n".join(probs))


# --------------------------------------------------------------------------- general


_PROSE_OK = re.compile(r"^[^{}<>\[\]\\=$@#~^]+$")
_MARKUP = re.compile(r"[|*]([^|*\s]+)[|*]")


def is_prose(para: str) -> bool:
    """A paragraph of English sentences: mostly letters, no code symbols, no indentation."""
    p = para.strip("\n")
    if len(p) < 100 or p.startswith((" ", "\t")):
        return False
    if any(line.startswith(("\t", "    ", ">", "-", "*", "..", "=", "#", "`")) for line in p.splitlines()):
        return False
    p = _MARKUP.sub(r"\1", p)
    if not _PROSE_OK.match(p):
        return False
    letters = sum(c.isalpha() for c in p)
    return len(p.split()) >= 15 and letters / len(p) > 0.72 and p.count(". ") + p.endswith(".") >= 1


def general_documents(cfg: CorpusConfig) -> Iterator[Document]:
    """English prose paragraphs of locally installed manuals (Vim, CMake, Git, Node.js)."""
    paths: list[str] = []
    for g in cfg.prose_globs:
        paths += sorted(glob.glob(g, recursive=True))
    for path in paths:
        text = read_text_file(path)
        if not text:
            continue
        paras = [
            " ".join(line.strip() for line in _MARKUP.sub(r"\1", p).splitlines())
            for p in re.split(r"\n\s*\n", text)
            if is_prose(p)
        ]
        if paras:
            yield from _chunks("general", f"general:{path}", "\n\n".join(paras), cfg.chunk_chars)


# --------------------------------------------------------------------------- all


SOURCES: dict[str, Callable[[CorpusConfig], Iterator[Document]]] = {
    "general": general_documents,
    "code": code_documents,
    "math": math_documents,
    "law": law_documents,
    "medical": medical_documents,
}


def build_domain(domain: str, cfg: CorpusConfig) -> tuple[list[Document], list[Document]]:
    """(train, held-out) documents of one domain, de-duplicated and capped."""
    docs = _capped(dedupe_paragraphs(SOURCES[domain](cfg)), cfg.max_chars[domain])
    return split_documents(docs, cfg.heldout_fraction)
