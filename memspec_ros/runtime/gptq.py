"""GPTQ INT4 quantization of a target through GPT-QModel (making it exact for the engine: runtime/row_exact.py).

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

from .models import load_tokenizer, read_config, safetensors_files
from .row_exact import prepare_for_engine  # noqa: F401 - the GPTQ library's other half (zoo/gptq_cli.py)


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
    safetensors_files(src)  # pickled weights refused: GPTQModel.load would fall back to torch.load on them
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
