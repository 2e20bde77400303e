"""Bytes of weights a loaded target holds on a forward path, against what ``parameter_bytes`` counts.

The lean forward fuses q/k/v and gate/up into one module each (runtime/draft_forward.py); where those fused
weights were copies, the model held them twice and the draft cache's byte accounting did not see it. This counts
every distinct storage reachable from the model and its lean forward:

    .venv/bin/python scripts/held_weight_bytes.py --quantization int4
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from memspec_ros.runtime.draft_forward import lean_forward_for
from memspec_ros.runtime.loader import load_models
from memspec_ros.runtime.models import parameter_bytes

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quantization", default="int4", choices=("none", "int8", "int4"))
    a = p.parse_args()
    torch.set_num_threads(1)
    model = load_models(ROOT / "models" / "registry.yaml", quantization=a.quantization).target.model
    counted = parameter_bytes(model)
    lean = lean_forward_for(model)
    tensors = [*model.parameters(), *model.buffers()]
    for layer in lean.layers:
        for module in (layer.qkv, layer.o, layer.gate_up, layer.down):
            tensors += list(module.buffers())
    held = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
    print(f"{a.quantization}: parameter_bytes {counted / 1e6:.1f} MB, held {sum(held.values()) / 1e6:.1f} MB")


if __name__ == "__main__":
    main()
