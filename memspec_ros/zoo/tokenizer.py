"""The zoo's one shared tokenizer: byte-level BPE trained on the domain mix.

The paper requires target and drafts to share a vocabulary (draft tokens are
verified by id).  One small vocabulary (2048) keeps the embedding and LM head,
which dominate a 1 M-parameter draft, cheap.  Byte-level means no ``unk``
ever occurs, so any prompt a user sends is encodable.
"""

from __future__ import annotations

import random
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from .corpora import Document

BOS, EOS, PAD, UNK = "<s>", "</s>", "<pad>", "<unk>"


@dataclass
class TokenizerConfig:
    vocab_size: int = 2048
    min_frequency: int = 2
    sample_chars_per_domain: int = 1_500_000
    seed: int = 0


def _sample_texts(docs: dict[str, list[Document]], cfg: TokenizerConfig) -> list[str]:
    """Equal characters per domain so no domain owns the merges."""
    texts: list[str] = []
    for domain in sorted(docs):
        pool = list(docs[domain])
        random.Random(f"{cfg.seed}:{domain}").shuffle(pool)
        total = 0
        for d in pool:
            if total >= cfg.sample_chars_per_domain:
                break
            texts.append(d.text)
            total += len(d.text)
    return texts


def train_tokenizer(train_docs: dict[str, list[Document]], out_dir: str | Path, cfg: TokenizerConfig):
    """Train, wrap as ``PreTrainedTokenizerFast`` and ``save_pretrained`` into out_dir."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=cfg.vocab_size,
        min_frequency=cfg.min_frequency,
        special_tokens=[BOS, EOS, PAD, UNK],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_sample_texts(train_docs, cfg), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=BOS, eos_token=EOS, pad_token=PAD, unk_token=UNK
    )
    fast.model_max_length = 2048
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(str(out_dir))
    return fast


def load_tokenizer(path: str | Path):
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast.from_pretrained(str(path), local_files_only=True)  # a missing folder: no Hub


def encode_documents(tok, docs: Iterable[Document]) -> list[list[int]]:
    """Token ids of each document, framed by BOS/EOS (the encoder adds neither)."""
    texts = [d.text for d in docs]
    ids = tok(texts, add_special_tokens=False)["input_ids"] if texts else []
    return [[tok.bos_token_id, *x, tok.eos_token_id] for x in ids]
