"""Where a verify's time goes beyond a 1-token step: the whole forward and the head alone, for 1, 2, 3, 5 and 8
rows after a 200-token context; the bundled target, 1 thread, medians of 15.

    .venv/bin/python scripts/forward_rows_profile.py none    # fp32 (on the f32 kernel where it compiled); or int8, int4
"""

from __future__ import annotations

import statistics
import sys
import time

import torch

from memspec_ros.runtime.draft_forward import _linear, _rms_norm, lean_forward_for
from memspec_ros.runtime.loader import load_models
from memspec_ros.runtime.speculative import KVState, forward_once

CONTEXT = list(range(1000, 1200))


def median_ms(call, repeats: int = 15) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1000


def main(quantization: str) -> None:
    torch.set_num_threads(1)
    target = load_models("models/registry.yaml", quantization=quantization, validate=False).target.model
    lean = lean_forward_for(target)
    kv = KVState()
    with torch.inference_mode():
        forward_once(target, CONTEXT, kv, 1, "cpu", lean)
        for rows in (1, 2, 3, 5, 8):
            hidden = torch.randn(1, rows, target.config.hidden_size)

            def forward(rows=rows):
                kv.crop_to(len(CONTEXT) - rows)
                forward_once(target, CONTEXT[-rows:], kv, rows, "cpu", lean)

            def head(hidden=hidden):
                _linear(lean.lm_head, _rms_norm(hidden, lean.norm, lean.eps))

            print(f"{quantization} rows {rows}: forward {median_ms(forward):.2f} ms | head {median_ms(head):.2f} ms")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "int4")
