"""The check that a model scores a verify's rows with exactly the numbers its one-token steps give."""

from __future__ import annotations

import torch

from memspec_ros.runtime.speculative import KVState, forward_once


def assert_verify_rows_equal_steps(model: torch.nn.Module, vocab_size: int, prefix: int = 30) -> None:
    """After a cached ``prefix``, a 2-, 5- and 9-row forward (gamma 1, 4, 8) equals that many one-token steps
    bit for bit (through forward_once without a lean forward: the transformers path)."""
    ids = torch.randint(0, vocab_size, (prefix + 10,), generator=torch.Generator().manual_seed(3)).tolist()
    for rows in (2, 5, 9):
        batched, single = KVState(), KVState()
        forward_once(model, ids[:prefix], batched, 1, "cpu")
        forward_once(model, ids[:prefix], single, 1, "cpu")
        verify = forward_once(model, ids[prefix:prefix + rows], batched, rows, "cpu")
        steps = torch.stack([forward_once(model, [t], single, 1, "cpu")[-1] for t in ids[prefix:prefix + rows]])
        assert torch.equal(verify, steps), f"{rows} rows: largest difference {(verify - steps).abs().max()}"
