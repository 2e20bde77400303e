"""GPTQ INT4 quantization of a target through GPT-QModel, and making a GPTQ target exact for the engine.

GPT-QModel is the maintained GPTQ backend (auto-gptq is archived; transformers 5
loads GPTQ checkpoints through gptqmodel only). It needs torch >= 2.14.1, so on
this project's dev machines it lives in its own environment (``.venv-gptq``,
from ``requirements-gptq.txt``); on a robot it is installed beside the node.
The command line (quantize a directory, the end-to-end self-check) is zoo/gptq_cli.py.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

import torch

from .models import load_tokenizer, read_config


def quantize_gptq(src: str | Path, out: str | Path, texts: Sequence[str | Sequence[int]], bits: int = 4,
                  group_size: int = 32, sym: bool = True) -> Path:
    """Quantize the model in ``src`` with calibration ``texts`` and save it (safetensors) to ``out``.

    Each calibration item is a text (tokenized with the model's tokenizer) or a sequence of token
    ids used as it is (e.g. a chat request through the template followed by the model's answer).
    ``sym=False`` gives each group a zero point as well as a scale (asymmetric grid).
    """
    os.environ.setdefault("GPTQMODEL_CPU_WORKERS", str(max(1, min(2, os.cpu_count() or 1))))
    from .models import gptq_backend_available

    if not gptq_backend_available():
        raise SystemExit("GPT-QModel is not installed: `pip install -r requirements-gptq.txt` (needs torch >= 2.14.1)")
    from gptqmodel import GPTQModel, QuantizeConfig

    read_config(src)  # a clear error for a bad directory before gptqmodel's own
    tokenizer = load_tokenizer(src)
    calibration = [dict(tokenizer(text)) if isinstance(text, str)
                   else {"input_ids": [int(t) for t in text], "attention_mask": [1] * len(text)}
                   for text in texts if (text.strip() if isinstance(text, str) else len(text))]
    if not calibration:
        raise ValueError("no calibration text: give a few hundred tokens of representative text")
    model = GPTQModel.load(str(src), QuantizeConfig(bits=bits, group_size=group_size, sym=sym), device="cpu")
    model.quantize(calibration, batch_size=1)
    model.save(str(out))
    tokenizer.save_pretrained(str(out))
    return Path(out)


MAX_VERIFY_ROWS = 9  # as runtime/forward_paths.py: a verify feeds gamma + 1 rows, gamma up to 8


def _gptq_linears(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    return [(n, m) for n, m in model.named_modules() if type(m).__module__.startswith("gptqmodel")
            and hasattr(m, "in_features") and hasattr(m, "out_features")]


def _one_row_at_a_time(module: torch.nn.Module) -> None:
    """Make ``module`` compute a call of 2..MAX_VERIFY_ROWS rows one row at a time (prefills stay batched)."""
    forward = module.forward

    def rowwise(x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1])
        if not 1 < rows.shape[0] <= MAX_VERIFY_ROWS:
            return forward(x)
        return torch.cat([forward(rows[i:i + 1]) for i in range(rows.shape[0])]).reshape(*x.shape[:-1], -1)

    module.forward = rowwise


ROWWISE_SDPA = "memspec_rowwise_sdpa"


def _rowwise_sdpa(module, query, key, value, attention_mask, **kwargs):
    """transformers' SDPA attention, except that a call of 2..MAX_VERIFY_ROWS query rows after a cached
    prefix (a verify) runs each row alone over its own prefix, as the one-token step for that position
    does: same key/value views, and no mask where that row attends to its whole prefix (a one-token
    step gets none)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    q_len, kv_len = query.shape[2], key.shape[2]
    if not 1 < q_len <= MAX_VERIFY_ROWS or kv_len == q_len:
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    start = kv_len - q_len  # row i attends to keys [0, start + i]
    masks: list[torch.Tensor | None] = [None] * q_len
    if attention_mask is not None:
        allowed = attention_mask if attention_mask.dtype == torch.bool else attention_mask == 0
        causal = torch.arange(kv_len, device=key.device) <= torch.arange(start, kv_len, device=key.device)[:, None]
        if not bool((allowed == causal).all()):  # padding or another pattern: each row keeps its own mask
            masks = [attention_mask[..., i:i + 1, :start + i + 1] for i in range(q_len)]
    outs = []
    for i, mask in enumerate(masks):
        end = start + i + 1
        out, _ = sdpa_attention_forward(module, query[:, :, i:i + 1], key[:, :, :end], value[:, :, :end], mask,
                                        **kwargs)
        outs.append(out)
    return torch.cat(outs, dim=1), None


def _register_rowwise_sdpa() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(ROWWISE_SDPA, _rowwise_sdpa)
    AttentionMaskInterface.register(ROWWISE_SDPA, sdpa_mask)


def prepare_for_engine(model: torch.nn.Module) -> dict:
    """Make a loaded GPTQ model compute a verify's rows exactly as one-token steps, so that
    speculative decoding reproduces its own greedy output; returns what was done.

    The engine runs a GPTQ target through transformers' forward (its lean path takes plain linears
    only). Measured on SmolLM2-135M with bf16 activations (GPT-QModel's fused AVX512 kernel):
    transformers' SDPA attention over a cached prefix gives a 5-row verify other last digits than
    five one-row steps (29 of 36 probes), and the engine's output then differed from the target's
    own on 8 of 12 held-out prompts. So an SDPA model gets ``memspec_rowwise_sdpa``: SDPA as before,
    except that a verify's rows attend one by one to their own prefix, each the very call its
    one-token step makes (0 of 36 probes differ; the engine's lean path does the same); another
    implementation becomes eager. GPT-QModel's linears are probed per shape with 2..MAX_VERIFY_ROWS
    rows against one row at a time, and a shape whose kernel differs runs such calls row by row (as
    the engine's forward paths do, runtime/forward_paths.py); none did here.
    """
    done = {"attention": getattr(model.config, "_attn_implementation", None), "rows_one_by_one": []}
    if done["attention"] == "sdpa":
        _register_rowwise_sdpa()
        model.set_attn_implementation(ROWWISE_SDPA)
    elif done["attention"] not in ("eager", ROWWISE_SDPA):
        model.set_attn_implementation("eager")
    done["attention"] = model.config._attn_implementation
    first_parameter = next(model.parameters())
    dtype, device = first_parameter.dtype, first_parameter.device  # a GPTQ model is placed on its device at load
    if dtype not in (torch.float16, torch.bfloat16):
        dtype = torch.float32
    by_shape: dict[tuple, list[tuple[str, torch.nn.Module]]] = {}
    for name, module in _gptq_linears(model):
        by_shape.setdefault((type(module).__name__, module.in_features, module.out_features), []).append((name, module))
    with torch.inference_mode():
        for (_, n_in, _), modules in by_shape.items():
            probe = torch.randn(1, MAX_VERIFY_ROWS, n_in, generator=torch.Generator().manual_seed(1)).to(device, dtype)
            first = modules[0][1]
            alone = torch.cat([first(probe[:, i:i + 1]) for i in range(MAX_VERIFY_ROWS)], dim=1)
            if not all(torch.equal(first(probe[:, :m]), alone[:, :m]) for m in range(2, MAX_VERIFY_ROWS + 1)):
                for name, module in modules:
                    _one_row_at_a_time(module)
                    done["rows_one_by_one"].append(name)
    return done
