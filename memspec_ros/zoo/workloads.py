"""Mixed-domain documents and the JSONL prompt sets (held-out workloads, predictor training).

``mixed`` texts alternate short segments of two domains (prose that turns
into code, a licence header followed by a module, a clinical code list
followed by a worked calculation).  The target is trained on such texts
(built from *training* documents) so it learns to switch domain by itself;
the held-out ``mixed`` prompts (built from *held-out* documents) end part-way
into a segment, so the target's own continuation finishes that segment and
then switches: the best draft changes within one generation.
"""

from __future__ import annotations

import json
import random
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from ..runtime.jsonl import WorkloadFileError, read_jsonl  # noqa: F401 - the zoo's and the benches' reader
from .corpora import DOMAINS, Document

MIXED_PAIRS: tuple[tuple[str, str], ...] = (
    ("general", "code"),
    ("general", "math"),
    ("law", "code"),
    ("medical", "math"),
    ("general", "medical"),
)
"""(first, second) domain of each mixed text: prose into code or a derivation, etc."""


@dataclass
class WorkloadConfig:
    prompts_per_domain: int = 100
    min_prompt_tokens: int = 32
    max_prompt_tokens: int = 96
    max_mixed_prompt_tokens: int = 128
    segment_chars: tuple[int, int] = (120, 320)
    segments_per_domain: int = 3
    seed: int = 2024


def _units(domain: str, text: str) -> list[str]:
    """Sentences for prose, lines for everything else: the cut points of a segment."""
    if domain == "general":
        return [u for u in re.split(r"(?<=[.!?])\s+", text) if u]
    return text.split("\n")


class SegmentReader:
    """Consecutive runs of whole sentences/lines of one document.

    Successive segments continue where the previous one stopped, so a mixed
    text reads as two documents interleaved rather than one phrase repeated.
    """

    def __init__(self, doc: Document, r: random.Random, lo: int, hi: int):
        self.units = _units(doc.domain, doc.text)
        self.sep = " " if doc.domain == "general" else "\n"
        self.pos = r.randrange(max(1, len(self.units) // 2))
        self.lo, self.hi = lo, hi

    def next(self) -> str:
        out: list[str] = []
        size = 0
        while self.pos < len(self.units):
            u = self.units[self.pos]
            if size >= self.lo or (out and size + len(u) > self.hi):
                break
            out.append(u)
            size += len(u) + 1
            self.pos += 1
        return self.sep.join(out).strip()[: self.hi * 2]


def mixed_document(
    pools: dict[str, Sequence[Document]], pair: tuple[str, str], r: random.Random, cfg: WorkloadConfig, doc_id: str
) -> Document:
    a, b = pair
    ra = SegmentReader(r.choice(pools[a]), r, *cfg.segment_chars)
    rb = SegmentReader(r.choice(pools[b]), r, *cfg.segment_chars)
    parts: list[str] = []
    for _ in range(cfg.segments_per_domain):
        parts += [ra.next(), rb.next()]
    return Document("mixed", doc_id, "\n\n".join(p for p in parts if p))


def mixed_documents(pools: dict[str, Sequence[Document]], n: int, seed: int, cfg: WorkloadConfig) -> list[Document]:
    r = random.Random(seed)
    return [mixed_document(pools, MIXED_PAIRS[i % len(MIXED_PAIRS)], r, cfg, f"mixed:{seed}:{i}") for i in range(n)]


def _cut(tok, text: str, n_tokens: int, keep_end: bool = False) -> str:
    """The first (or, with ``keep_end``, the last) ``n_tokens`` tokens of ``text``."""
    ids = tok(text, add_special_tokens=False)["input_ids"]
    return tok.decode(ids[-n_tokens:] if keep_end else ids[:n_tokens])


def _prompt_text(doc: Document) -> str:
    """Where a prompt starts: ICD-10-CM documents open with their chapter and block
    headings, shared by every category of a block, so those would make held-out
    prompts equal to training text; start at the category line instead."""
    if doc.domain == "medical":
        return doc.text.split("\n", 2)[-1]
    return doc.text


def domain_prompts(
    tok, docs: Sequence[Document], domain: str, cfg: WorkloadConfig, seed: int, exclude: set[str] = frozenset()
) -> list[dict]:
    """The start (32-96 tokens) of distinct documents, one prompt per document, none in ``exclude``."""
    r = random.Random(f"{seed}:{domain}")
    pool = [d for d in docs if len(d.text) > 200]
    r.shuffle(pool)
    out: list[dict] = []
    seen = set(exclude)
    for d in pool:
        if len(out) == cfg.prompts_per_domain:
            break
        n = r.randint(cfg.min_prompt_tokens, cfg.max_prompt_tokens)
        prompt = _cut(tok, _prompt_text(d), n)
        if prompt in seen:
            continue
        seen.add(prompt)
        out.append({"domain": domain, "prompt": prompt, "source": d.doc_id})
    if len(out) < cfg.prompts_per_domain:
        raise ValueError(f"{domain}: only {len(out)} distinct prompts for {cfg.prompts_per_domain}")
    return out


def mixed_prompts(tok, pools: dict[str, Sequence[Document]], cfg: WorkloadConfig, seed: int) -> list[dict]:
    """Segment of A, segment of B, and the first sentence/line of the next A segment.

    The prompt ends inside domain A after one A->B switch; the target's
    continuation finishes A and (having learned the alternation) turns to B.
    A text longer than the prompt budget loses its *start*, never its end:
    cutting the end would leave most prompts ending inside B (79 of the 100
    held-out prompts did, before this was fixed).
    """
    r = random.Random(f"{seed}:mixed")
    out = []
    for i in range(cfg.prompts_per_domain):
        a, b = MIXED_PAIRS[i % len(MIXED_PAIRS)]
        while True:  # documents too short for three segments are skipped (seeded, so deterministic)
            da, db = r.choice(pools[a]), r.choice(pools[b])
            ra = SegmentReader(da, r, *cfg.segment_chars)
            rb = SegmentReader(db, r, *cfg.segment_chars)
            first, second, rest = ra.next(), rb.next(), ra.next()
            if first and second and rest:
                break
        third = _units(a, rest)[0]
        text = f"{first}\n\n{second}\n\n{third}"
        out.append(
            {
                "domain": "mixed",
                "prompt": _cut(tok, text, cfg.max_mixed_prompt_tokens, keep_end=True),
                "pair": f"{a}->{b}",
                "source": f"{da.doc_id}|{db.doc_id}",
            }
        )
    return out


def write_jsonl(path: str | Path, rows: Sequence[dict]) -> None:
    """One JSON object per line, replaced whole (a build's stage is done when its file exists: a cut write was
    taken for a finished one)."""
    from memspec_ros.runtime.atomic_write import write_text_atomic

    Path(path).parent.mkdir(parents=True, exist_ok=True)
    write_text_atomic(path, "".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows))


def prompt_problem(row: dict) -> str | None:
    """What a row lacks for a command that sends its text as a goal's prompt (not chat messages)."""
    return None if isinstance(row.get("prompt"), str) and row["prompt"] else 'a row needs a "prompt" here'


def request_problem(row: dict) -> str | None:
    """What a workload or request row lacks: a \"prompt\" or chat \"messages\" (None: it has one)."""
    prompt, messages = row.get("prompt"), row.get("messages")
    if prompt is not None and not isinstance(prompt, str):
        return '"prompt" must be a string'
    if messages is not None and not (isinstance(messages, list) and all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
            for m in messages)):
        return '"messages" must be a list of {"role": str, "content": str} turns'
    if prompt or messages:
        return None
    return 'a row needs a "prompt" or chat "messages"'


def write_workloads(
    tok, train: dict[str, list[Document]], heldout: dict[str, list[Document]], out_dir: str | Path, cfg: WorkloadConfig
) -> None:
    """models/workloads/{domain}.jsonl from held-out docs, train_prompts.jsonl from train docs."""
    out_dir = Path(out_dir)
    evaluation: set[str] = set()
    for domain in DOMAINS:
        rows = domain_prompts(tok, heldout[domain], domain, cfg, cfg.seed)
        evaluation |= {r["prompt"] for r in rows}
        write_jsonl(out_dir / f"{domain}.jsonl", rows)
    write_jsonl(out_dir / "mixed.jsonl", mixed_prompts(tok, heldout, cfg, cfg.seed))
    rows = []
    for domain in DOMAINS:
        rows += domain_prompts(tok, train[domain], domain, cfg, cfg.seed + 1, exclude=evaluation)
    rows += mixed_prompts(tok, train, cfg, cfg.seed + 1)
    write_jsonl(out_dir / "train_prompts.jsonl", rows)
