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


def target_alone(target: torch.nn.Module, prompt: list[int], new: int, eos: int | None = None) -> list[int]:
    """The engine's own greedy decoding of ``target`` alone, one token per forward: what every speculative run must
    reproduce token for token (lossless). transformers' generate is no such reference: the engine's kernels sum in
    another order than ATen's (by CPU: 8 or 16 lanes, AVX2, AVX512, AMX), which may flip a near-tie."""
    from memspec_ros.runtime.speculative import generate

    return generate(target, prompt, None, max_new_tokens=new,
                    eos_token_ids=[] if eos is None else [eos]).generated_ids


def assert_transformers_agrees_up_to_a_tie(ids: list[int], model: torch.nn.Module, prompt: list[int],
                                           tolerance: float = 1e-3) -> None:
    """transformers' greedy decoding of ``model`` gives ``ids``, or the two part where the engine's token is within
    ``tolerance`` of the logit scale of transformers' best (a near-tie that another summation order may flip), not
    at a token the engine got wrong."""
    out = model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=len(ids), eos_token_id=None,
                         pad_token_id=0, output_scores=True, return_dict_in_generate=True)
    reference = out.sequences[0, len(prompt):].tolist()
    differ = next((k for k, (a, b) in enumerate(zip(ids, reference, strict=True)) if a != b), None)
    if differ is not None:
        row = out.scores[differ][0].float()
        first, ours = float(row.max()), float(row[ids[differ]])  # the engine's token within the tie, not any token
        assert first - ours < tolerance * max(1.0, abs(first)), (differ, first, ours)


def assert_same_choice(got: torch.Tensor, reference: torch.Tensor, tolerance: float) -> None:
    """Each row's argmax in ``got`` is the reference's best token or one within ``tolerance`` of it: two forwards
    that round differently may split a near-tie either way (another CPU's SIMD width changes the order of sums)."""
    picked = reference.gather(-1, got.argmax(-1, keepdim=True)).squeeze(-1)
    assert bool((picked >= reference.max(-1).values - tolerance).all()), (picked, reference.max(-1).values)


def assert_greedy_up_to_a_tie(ids: list[int], logits: torch.Tensor, tolerance: float) -> None:
    """Each of ``ids`` is the argmax of its row of ``logits`` (the model's one unpadded forward over the text, row k
    the distribution ``ids[k]`` was chosen from), or within ``tolerance`` of it: a batched, padded or KV-cached
    decoding sums in another order than that one forward, and may split a near-tie the other way (another CPU's
    BLAS, another batch size). A token that is not near the best is wrong whatever the order of sums."""
    assert logits.shape[0] == len(ids), (logits.shape, len(ids))
    assert_same_choice(torch.nn.functional.one_hot(torch.tensor(ids), logits.shape[-1]).float(), logits.float(),
                       tolerance)


def assert_top_k_up_to_a_tie(top_ids: torch.Tensor, top_values: torch.Tensor, logp: torch.Tensor,
                             tolerance: float) -> None:
    """Stored top-k ids and values are the top k of ``logp`` (rows of log-probabilities): the values the stored ids
    have under ``logp`` are the stored values and the k largest there, each within ``tolerance`` (two ids tied at
    the k-th place, or swapped in order, are either one's)."""
    k = top_ids.shape[-1]
    theirs = logp.gather(-1, top_ids.long())
    torch.testing.assert_close(theirs, top_values.float(), atol=tolerance, rtol=0)
    torch.testing.assert_close(theirs, logp.topk(k, -1).values, atol=tolerance, rtol=0)
