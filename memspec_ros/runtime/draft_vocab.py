"""Drafts whose head covers a subset of the target's vocabulary (as FR-Spec and EAGLE-3 do).

A real target's vocabulary is wide (49,152 ids for SmolLM2): a draft with its
own full-width embedding and head spends most of its parameters and most of
its forward there.  A reduced-vocabulary draft keeps only the ``V_d`` ids a
domain actually uses, plus one extra input row for every other id:

- inputs: a target id maps to its draft row, or to the shared extra row;
- outputs: the draft's ``V_d`` logits are scattered back into a target-width
  row, ``-inf`` everywhere else, so the draft's probability ``q`` is exactly
  zero outside its subset.

That stays lossless, because the target verifies every token: greedy commits
only the target's argmax whatever was proposed, and the speculative-sampling
rule accepts a proposal with probability ``min(1, p/q)`` (``q > 0`` for every
proposal, which is always drawn from the subset) and otherwise resamples from
``max(p - q, 0)``, which covers every id outside the subset with its full
target probability.  The engine needs no special case: it sees a draft with
target-width logits.

On disk the draft is an ordinary Hugging Face directory whose ``vocab_size``
is ``V_d + 1``, plus ``draft_vocab.json``: the target id of each draft row and
the target's vocabulary size.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import torch

VOCAB_FILE = "draft_vocab.json"
# far past the widest real vocabularies (~262 k): a file claiming more would have a map of that width allocated (8 bytes
# an id) before the draft's target width is compared with the target's
MAX_TARGET_VOCAB = 1 << 22


class DraftVocabError(ValueError):
    """``draft_vocab.json`` is malformed or does not fit the model beside it."""


def read_vocab_map(path: str | Path, draft_vocab_size: int) -> tuple[list[int], int]:
    """(target id of each draft row, target vocabulary size), checked against the model's width."""
    file = Path(path) / VOCAB_FILE
    try:
        data = json.loads(file.read_text(encoding="utf-8"))
        raw, target_size = data["target_ids"], data["target_vocab_size"]
        if isinstance(target_size, bool) or not isinstance(target_size, int):  # Infinity: a bare OverflowError
            raise ValueError(f"target_vocab_size must be a whole number, not {str(target_size)[:40]}")
        # a list of integers, none empty: a string of digits iterated to ids, or [] min()-ed, slipped through
        if not isinstance(raw, list) or not raw or not all(isinstance(i, int) and not isinstance(i, bool) for i in raw):
            raise ValueError("target_ids must be a non-empty list of integers")
        ids = list(raw)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise DraftVocabError(f"{file} is not a valid draft vocabulary ({exc}): rebuild the draft") from exc
    if len(ids) + 1 != draft_vocab_size:
        raise DraftVocabError(f"{file} maps {len(ids)} ids but the model has {draft_vocab_size} rows"
                              " (expected one more, the row for every other id): rebuild the draft")
    if len(set(ids)) != len(ids) or min(ids) < 0 or max(ids) >= target_size:
        raise DraftVocabError(f"{file}: target ids must be distinct and in [0, {target_size})")
    if target_size > MAX_TARGET_VOCAB:  # a map of that width is allocated before the target's width is compared
        raise DraftVocabError(f"{file}: a target vocabulary of {target_size} ids, more than any tokenizer's"
                              f" ({MAX_TARGET_VOCAB}): rebuild the draft")
    return ids, target_size


def write_vocab_map(path: str | Path, target_ids: list[int], target_vocab_size: int) -> None:
    (Path(path) / VOCAB_FILE).write_text(json.dumps({"target_vocab_size": target_vocab_size,
                                                     "target_ids": [int(i) for i in target_ids]}))


class DraftVocab(torch.nn.Module):
    """The two maps between target ids and draft rows; buffers so they follow the model's device."""

    def __init__(self, target_ids: list[int], target_vocab_size: int) -> None:
        super().__init__()
        rows = len(target_ids)
        to_draft = torch.full((target_vocab_size,), rows, dtype=torch.long)  # row ``rows``: every other id
        to_draft[torch.tensor(target_ids, dtype=torch.long)] = torch.arange(rows)
        self.register_buffer("target_ids", torch.tensor(target_ids, dtype=torch.long), persistent=False)
        self.register_buffer("to_draft", to_draft, persistent=False)
        self.target_vocab_size = target_vocab_size

    def inputs(self, target_ids: torch.Tensor) -> torch.Tensor:
        return self.to_draft[target_ids]

    def logits(self, draft_logits: torch.Tensor) -> torch.Tensor:
        """Target-width logits: the draft's own where it has a row, -inf elsewhere (q = 0 there)."""
        rows = self.target_ids.numel()
        out = draft_logits.new_full((*draft_logits.shape[:-1], self.target_vocab_size), float("-inf"))
        return out.index_copy_(-1, self.target_ids, draft_logits[..., :rows])


class ReducedVocabDraft(torch.nn.Module):
    """A causal LM over draft rows, presented to the engine as one over target ids."""

    def __init__(self, inner: torch.nn.Module, vocab: DraftVocab) -> None:
        super().__init__()
        self.inner = inner
        self.vocab = vocab
        self.config = inner.config

    def forward(self, input_ids: torch.Tensor, **kwargs):
        out = self.inner(input_ids=self.vocab.inputs(input_ids), **kwargs)
        return SimpleNamespace(
            logits=self.vocab.logits(out.logits), past_key_values=getattr(out, "past_key_values", None)
        )


def wrap_if_reduced(model: torch.nn.Module, path: str | Path) -> tuple[torch.nn.Module, int]:
    """(the model the engine runs, its vocabulary size in target ids) for a draft directory."""
    if not (Path(path) / VOCAB_FILE).is_file():
        return model, int(model.config.vocab_size)
    ids, target_size = read_vocab_map(path, int(model.config.vocab_size))
    device = next(model.parameters()).device
    return ReducedVocabDraft(model, DraftVocab(ids, target_size).to(device)), target_size


class _TargetWidthEmbedding(torch.nn.Module):
    """The draft's input rows looked up by target id (every other id to the shared extra row)."""

    def __init__(self, rows: torch.nn.Module, vocab: DraftVocab) -> None:
        super().__init__()
        self.rows = rows
        self.vocab = vocab

    @property
    def weight(self) -> torch.Tensor:  # what transformers reads for the embeddings' dtype and device
        return self.rows.weight

    def forward(self, target_ids: torch.Tensor) -> torch.Tensor:
        return self.rows(self.vocab.inputs(target_ids))


class _TargetWidthHead(torch.nn.Module):
    """The draft's head, its logits scattered into a target-width row (-inf outside its subset)."""

    def __init__(self, head: torch.nn.Module, vocab: DraftVocab) -> None:
        super().__init__()
        self.head = head
        self.vocab = vocab

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.vocab.logits(self.head(hidden))


def as_transformers_assistant(draft: ReducedVocabDraft):
    """The same draft as a transformers causal LM over target ids, for ``generate(assistant_model=...)``.

    Transformers' assisted generation takes only a ``PreTrainedModel`` whose vocabulary is the
    target's. This one shares the draft's own layers and weights (nothing is copied, so any
    quantization applies to both) inside a shell of the inner model's class with a target-width
    config: the embedding maps target ids to draft rows and the head scatters the draft's logits as
    ``ReducedVocabDraft`` does, so both propose the same tokens.
    """
    import copy

    inner = draft.inner
    config = copy.deepcopy(inner.config)
    config.vocab_size = draft.vocab.target_vocab_size
    config.tie_word_embeddings = False  # the head is a module of its own, not a transpose of the embedding
    with torch.device("meta"):  # a shell: every module that holds weights is replaced by the draft's below
        shell = type(inner)(config)
    body, own = shell.model, inner.model
    body.embed_tokens = _TargetWidthEmbedding(own.embed_tokens, draft.vocab)
    for name, module in own.named_children():
        if name != "embed_tokens":
            setattr(body, name, module)
    shell.lm_head = _TargetWidthHead(inner.lm_head, draft.vocab)
    shell.generation_config = copy.deepcopy(inner.generation_config)
    left = [name for name, t in [*shell.named_parameters(), *shell.named_buffers()] if t.is_meta]
    if left:
        raise TypeError(f"{type(inner).__name__} has parts the transformers shell does not take over: {left}")
    return shell.eval()
