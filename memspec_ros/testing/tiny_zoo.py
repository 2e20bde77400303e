"""A tiny zoo on disk with the bundled zoo's layout, for node tests and benchmarks without the zoo.

    <dir>/registry.yaml            target + drafts (general, code, math), paths relative to the file
    <dir>/target/                  a random Llama (safetensors + tokenizer)
    <dir>/drafts/<name>/           one-layer cuts of the target plus noise (they agree on some tokens)
    <dir>/predictor/               an untrained target-hidden ranking head (a real PredictionEngine)

The tokenizer has no end-of-sequence token and the target's generation_config no eos_token_id, so
greedy generations run to max_new_tokens (tests that cancel or deactivate mid-goal need goals that
last). ``chat=True``: the tokenizer is an instruct model's (a ChatML-like chat template, special tokens
<|im_start|> and <|im_end|>) and the target's generation_config lists <|im_end|> as its eos_token_id,
as instruct models do; the random target rarely emits it.
"""

from __future__ import annotations

import copy
from pathlib import Path

import torch

from .tiny_models import noisy_copy, save_model_dir, tiny_llama, tiny_tokenizer

DRAFTS = (("general", 0.05), ("code", 0.02), ("math", 0.01))


def build_tiny_zoo(root: str | Path, hidden: int = 256, layers: int = 6, max_positions: int = 4096,
                   drafts=DRAFTS, predictor: bool = True, draft_layers: int = 1, chat: bool = False) -> Path:
    from ..runtime.predictor import HeadConfig, RankingHead, target_fingerprint

    root = Path(root)
    tok = tiny_tokenizer(chat=chat)
    tok.eos_token = None  # no EOS: goals run to max_new_tokens
    target = tiny_llama(vocab_size=len(tok), hidden=hidden, layers=layers, seed=0, init_range=0.1,
                        max_positions=max_positions)
    end = [tok.convert_tokens_to_ids("<|im_end|>")] if chat else None  # the node stops at these ids too
    target.config.eos_token_id = target.generation_config.eos_token_id = end
    save_model_dir(target, tok, root / "target")
    lines = ["target:", "  path: target", "drafts:"]
    for i, (name, noise) in enumerate(drafts):
        draft = noisy_copy(target, noise, seed=10 + i)
        if draft_layers < layers:
            draft.model.layers = copy.deepcopy(draft.model.layers[:draft_layers])
            draft.config.num_hidden_layers = draft_layers
        save_model_dir(draft, tok, root / "drafts" / name)
        lines += [f"  - name: {name}", f"    path: drafts/{name}", f"    domain: {name}"]
    (root / "registry.yaml").write_text("\n".join(lines) + "\n")
    if predictor:
        torch.manual_seed(0)
        head = RankingHead(HeadConfig(encoder="target-hidden", drafts=[n for n, _ in drafts], in_dim=2 * hidden,
                                      hidden=16, recent_tokens=32, interval=4, target=target_fingerprint(target)))
        head.eval().save(root / "predictor")
    return root
