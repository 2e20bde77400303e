"""Reduced-vocabulary drafts distilled from a real target's stored chat answers.

The recipe (``real-target.md`` measured why the naive one fails):

1. **Vocabulary.** The ``rows`` most frequent target ids in the teacher's
   training answers (and, less, in the requests), plus the special tokens; every
   draft shares it, so a specialist starts from the general draft row for row.
   A 49,152-wide head would be most of a small draft's cost; the target still
   verifies every token, so the subset costs nothing in correctness.
2. **Initialisation.** The draft's embedding rows are the target's embedding of
   those ids projected onto their top singular directions, so a draft starts
   knowing which tokens are alike.
3. **General draft.** Distilled on every domain's answers: KL(target || draft)
   over the target's stored top-k log-probabilities (:func:`.rollouts.topk_kl`),
   no target forward during training.
4. **Domain drafts.** Each starts from the general draft and is distilled on its
   own domain's answers only: it begins at the general draft's level there,
   improves, and forgets elsewhere, the shape the paper's zoo has.

Every run validates the draft by what matters, mean accepted tokens per
iteration at ``gamma`` (teacher-forced greedy walk on held-out-from-training
answers), and keeps its best step.
"""

from __future__ import annotations

import hashlib
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from memspec_ros.runtime.draft_vocab import DraftVocab, ReducedVocabDraft, write_vocab_map

from .acceptance import static_score
from .rollouts import IGNORE
from .teacher import Answer


@dataclass
class ChatDraftArch:
    rows: int = 8192  # draft vocabulary, the extra "every other id" row not counted
    hidden_size: int = 256
    num_layers: int = 2
    intermediate_size: int = 768
    num_heads: int = 4
    num_kv_heads: int = 4
    max_positions: int = 2048


def select_vocab(answers: Sequence[Answer], rows: int, always: Sequence[int] = (),
                 prompt_weight: float = 0.25) -> list[int]:
    """The ``rows`` most frequent ids of the answers (requests count ``prompt_weight`` as much), ``always`` first."""
    counts: Counter[int] = Counter()
    for a in answers:
        counts.update(a.answer_ids)
    prompts: Counter[int] = Counter()
    for a in answers:
        prompts.update(a.prompt_ids)
    for token, n in prompts.items():
        counts[token] += prompt_weight * n
    chosen = list(dict.fromkeys(always))
    for token, _ in counts.most_common():
        if len(chosen) >= rows:
            break
        if token not in chosen:
            chosen.append(token)
    return chosen


def coverage(answers: Sequence[Answer], ids: Sequence[int]) -> float:
    """Fraction of answer tokens the vocabulary can propose."""
    keep = set(ids)
    total = sum(len(a.answer_ids) for a in answers)
    return sum(t in keep for a in answers for t in a.answer_ids) / max(total, 1)


def new_draft(target: torch.nn.Module, ids: list[int], arch: ChatDraftArch, seed: int = 0) -> ReducedVocabDraft:
    """A fresh Llama draft over ``ids`` (+ one row for every other id), embeddings from the target's by SVD."""
    from transformers import LlamaConfig, LlamaForCausalLM

    tcfg = target.config
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=len(ids) + 1, hidden_size=arch.hidden_size, num_hidden_layers=arch.num_layers,
        intermediate_size=arch.intermediate_size, num_attention_heads=arch.num_heads,
        num_key_value_heads=arch.num_kv_heads, max_position_embeddings=arch.max_positions,
        tie_word_embeddings=True, rms_norm_eps=tcfg.rms_norm_eps, rope_theta=getattr(tcfg, "rope_theta", 10000.0),
        bos_token_id=None, eos_token_id=None, pad_token_id=None,
    )
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        weight = target.get_input_embeddings().weight
        table = weight[torch.tensor(ids, device=weight.device)].float().cpu()
        table = table - table.mean(0)
        _, _, vh = torch.linalg.svd(table, full_matrices=False)
        k = min(arch.hidden_size, vh.shape[0])  # fewer ids than dimensions: the rest stays zero
        projected = torch.zeros(len(ids), arch.hidden_size)
        projected[:, :k] = table @ vh[:k].T
        projected *= config.initializer_range / projected[:, :k].std()
        emb = model.get_input_embeddings().weight
        emb[: len(ids)] = projected
        emb[len(ids)] = projected.mean(0)
    return ReducedVocabDraft(model, DraftVocab(ids, int(tcfg.vocab_size)))


def _row(answer: Answer, to_draft: torch.Tensor, max_prompt: int, max_len: int):
    """(draft-row inputs, labels, top-k rows, top-k log-probs) for one answer, labels on answer tokens only."""
    prompt = answer.prompt_ids[-max_prompt:]
    ids = torch.tensor(prompt + answer.answer_ids, dtype=torch.long)[:max_len]
    x = to_draft[ids]
    n = len(ids)
    labels = torch.full((n,), IGNORE, dtype=torch.long)
    top_ids = torch.zeros((n, answer.top_ids.shape[1]), dtype=torch.long)
    top_logp = torch.full((n, answer.top_ids.shape[1]), float("-inf"))
    start = len(prompt) - 1  # position start + j predicts answer token j
    k = min(len(answer.answer_ids), n - len(prompt))
    if k > 0:
        rows = x[len(prompt):len(prompt) + k]
        unk = int(to_draft.max())  # the "every other id" row
        labels[start:start + k] = torch.where(rows == unk, IGNORE, rows)
        t_rows = to_draft[answer.top_ids[:k].long()]
        top_ids[start:start + k] = t_rows
        top_logp[start:start + k] = torch.where(t_rows == unk, float("-inf"), answer.top_logp[:k].float())
    return x, labels, top_ids, top_logp


class AnswerStreams:
    """Batches of whole (request, answer) rows for ``train.train``, sampled uniformly from ``answers``."""

    def __init__(self, answers: Sequence[Answer], vocab: DraftVocab, seed: int, max_prompt: int = 192) -> None:
        if not answers:
            raise ValueError("no teacher answers to train on")
        self.answers = list(answers)
        self.to_draft = vocab.to_draft.cpu()
        self.max_prompt = max_prompt
        self.gen = torch.Generator().manual_seed(seed)

    def batch(self, batch_size: int, seq_len: int):
        picks = torch.randint(0, len(self.answers), (batch_size,), generator=self.gen).tolist()
        rows = [_row(self.answers[i], self.to_draft, self.max_prompt, seq_len) for i in picks]
        width = max(len(r[0]) for r in rows)
        k = rows[0][2].shape[1]
        x = torch.zeros((batch_size, width), dtype=torch.long)
        y = torch.full((batch_size, width - 1), IGNORE, dtype=torch.long)
        top_ids = torch.zeros((batch_size, width - 1, k), dtype=torch.long)
        top_logp = torch.full((batch_size, width - 1, k), float("-inf"))
        for i, (xi, yi, ti, li) in enumerate(rows):
            n = len(xi)
            x[i, :n] = xi
            y[i, :n - 1] = yi[:n - 1]
            top_ids[i, :n - 1] = ti[:n - 1]
            top_logp[i, :n - 1] = li[:n - 1]
        return x, y, top_ids, top_logp

    def state(self) -> torch.Tensor:
        return self.gen.get_state()

    def load_state(self, state: torch.Tensor) -> None:
        self.gen.set_state(state)


@torch.inference_mode()
def answer_agreement(draft: torch.nn.Module, answer: Answer) -> list[bool]:
    """agree[j]: the draft's greedy token after request + answer[:j] is answer[j] (target ids)."""
    ids = answer.prompt_ids + answer.answer_ids
    dev = next(draft.parameters()).device
    logits = draft(input_ids=torch.tensor([ids], device=dev), use_cache=False).logits[0]
    preds = logits[len(answer.prompt_ids) - 1: len(ids) - 1].argmax(-1).tolist()
    return [p == t for p, t in zip(preds, answer.answer_ids, strict=False)]


def mean_accepted(draft: torch.nn.Module, answers: Sequence[Answer], gamma: int = 4) -> float:
    """Mean over answers of accepted tokens per iteration in the engine's greedy walk."""
    was_training = draft.training
    draft.eval()
    scores = [static_score(answer_agreement(draft, a), gamma)[0] for a in answers]
    draft.train(was_training)
    return sum(scores) / max(len(scores), 1)


def split_validation(answers: Sequence[Answer], every: int = 20, seed: int = 0) -> tuple[list[Answer], list[Answer]]:
    """(train, validation): an answer is kept for early stopping when a hash of its request (and ``seed``) falls in
    one of ``every`` buckets, so its side does not depend on which other answers are there: a build that answers
    more requests (--teacher-requests) keeps the earlier answers on their side. A shuffle of the whole list moved
    them, so domain drafts rebuilt on more answers were validated on answers ``general`` had trained on (23 of 37
    code answers in a review's check). A domain whose answers all fall outside the bucket keeps the one with the
    smallest hash (a domain draft without any would score 0 at every step and silently keep its start)."""
    def key(a: Answer) -> int:
        data = f"{seed}:".encode() + np.asarray(a.prompt_ids, dtype=np.int64).tobytes()
        return int.from_bytes(hashlib.sha256(data).digest()[:8], "little")

    keys = [key(a) for a in answers]
    val_ids = {i for i, k in enumerate(keys) if k % every == 0}
    for domain in {a.domain for a in answers}:
        mine = [i for i, a in enumerate(answers) if a.domain == domain]
        if not val_ids.intersection(mine):
            val_ids.add(min(mine, key=keys.__getitem__))
    train = [a for i, a in enumerate(answers) if i not in val_ids]
    val = [a for i, a in enumerate(answers) if i in val_ids]
    return train, val


def export_draft(draft: ReducedVocabDraft, tokenizer, out: Path, dtype: torch.dtype = torch.float16) -> Path:
    """A Hugging Face directory (fp16 safetensors, the target's tokenizer) plus ``draft_vocab.json``."""
    out.mkdir(parents=True, exist_ok=True)
    draft.inner.to(dtype).save_pretrained(str(out), safe_serialization=True)
    draft.inner.float()
    tokenizer.save_pretrained(str(out))
    write_vocab_map(out, draft.vocab.target_ids.tolist(), draft.vocab.target_vocab_size)
    return out
