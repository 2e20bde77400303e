"""Tiny Llama models and a tokenizer built on the spot, for tests and for benchmarks
that must run before (or without) the bundled zoo. Nothing is downloaded."""

from __future__ import annotations

from pathlib import Path

import torch

TINY_TEXT = [
    "def add(a, b):\n    return a + b\n",
    "The licensee may copy and distribute the work under these terms.",
    "Solve 3x + 5 = 20. Subtract 5: 3x = 15. Divide by 3: x = 5.",
    "The patient presented with acute bronchitis and a persistent cough.",
    "Robots read the prompt, think, and answer in plain English sentences.",
]


def tiny_llama(
    vocab_size: int = 64,
    hidden: int = 64,
    layers: int = 2,
    seed: int = 0,
    init_range: float = 0.5,
    max_positions: int = 512,
):
    """A randomly initialised Llama; a wide init range keeps argmax ties away."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=hidden * 2,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=max_positions,
        initializer_range=init_range,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
        tie_word_embeddings=False,
    )
    return LlamaForCausalLM(config).eval().requires_grad_(False)


def noisy_copy(model, noise: float, seed: int = 0):
    """A draft that agrees with ``model`` on some tokens: its weights plus Gaussian noise."""
    import copy

    torch.manual_seed(seed)
    clone = copy.deepcopy(model)
    with torch.no_grad():
        for param in clone.parameters():
            param.add_(torch.randn_like(param) * noise * param.std().clamp(min=1e-3))
    return clone


def tiny_tokenizer(vocab_size: int = 300):
    """A byte-level BPE tokenizer trained on a few sentences (fast, deterministic)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<pad>", "<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(TINY_TEXT * 4, trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>")


def save_model_dir(model, tokenizer, path: str | Path) -> Path:
    """Write a standard Hugging Face directory (safetensors + tokenizer)."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    return path
