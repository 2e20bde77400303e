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


# A ChatML-like template (the shape of SmolLM2-Instruct's): role markers, the end-of-turn special token
# <|im_end|>, and a default system turn when the conversation has none.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if loop.first and message['role'] != 'system' %}"
    "{{ '<|im_start|>system\\nYou are a tiny test model.<|im_end|>\\n' }}"
    "{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
CHAT_TOKENS = ("<|im_start|>", "<|im_end|>")


def tiny_tokenizer(vocab_size: int = 300, chat: bool = False):
    """A byte-level BPE tokenizer trained on a few sentences (fast, deterministic).

    ``chat``: also the special tokens <|im_start|> and <|im_end|> (ids 3 and 4) and CHAT_TEMPLATE as
    its chat template, like an instruct model's tokenizer (the eos token stays </s>: set it as needed)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<pad>", "<s>", "</s>", *(CHAT_TOKENS if chat else ())],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(TINY_TEXT * 4, trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>")
    if chat:
        fast.add_special_tokens({"additional_special_tokens": list(CHAT_TOKENS)})  # already in the vocabulary
        fast.chat_template = CHAT_TEMPLATE
    return fast


def save_model_dir(model, tokenizer, path: str | Path) -> Path:
    """Write a standard Hugging Face directory (safetensors + tokenizer)."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    return path
