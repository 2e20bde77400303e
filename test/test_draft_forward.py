"""The lean draft forward computes what transformers computes, and steps aside where it cannot."""

import pytest
import torch
from row_checks import assert_same_choice
from transformers import LlamaConfig, LlamaForCausalLM

from memspec_ros.runtime.draft_forward import LeanLlamaForward, lean_forward_for, unsupported_reason
from memspec_ros.runtime.speculative import KVState, forward_once
from memspec_ros.testing.tiny_models import tiny_llama


def _llama(**overrides) -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = dict(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=4, max_position_embeddings=256, tie_word_embeddings=True)
    config.update(overrides)
    return LlamaForCausalLM(LlamaConfig(**config)).eval().requires_grad_(False)


MODELS = {
    "gqa (tiny_llama)": lambda: tiny_llama(vocab_size=96, seed=4),
    "mha, tied head": lambda: _llama(),
    "biases, llama3 rope": lambda: _llama(attention_bias=True, mlp_bias=True, rope_parameters={
        "rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 64}),
}


@pytest.mark.parametrize("name", list(MODELS))
def test_logits_match_transformers_through_prefill_steps_catchup_and_rollback(name):
    model = MODELS[name]()
    lean = lean_forward_for(model)
    assert isinstance(lean, LeanLlamaForward)
    ref, mine = KVState(), KVState()
    feeds = [list(range(3, 40)), [7], [9], [11, 12, 13], [5]]  # prompt, two steps, a 3-token catch-up, a step
    with torch.inference_mode():
        for i, feed in enumerate(feeds):
            want = forward_once(model, feed, ref, len(feed), "cpu")
            got = forward_once(model, feed, mine, len(feed), "cpu", lean)
            # the f32 kernel (runtime/cpu_kernels.c) sums in another order than transformers' matmuls: fp32
            # rounding, ~1e-6 of the logits' scale per layer here; a wrong layer moves them by their whole scale
            tolerance = 1e-4 * float(want.abs().max())
            torch.testing.assert_close(got, want, atol=tolerance, rtol=0)
            assert_same_choice(got, want, tolerance)  # a near-tie within it may fall either way
            if i == 2:  # roll both caches back two tokens, as after a rejection
                ref.crop_to(ref.length - 2)
                mine.crop_to(mine.length - 2)
            assert mine.length == ref.length == mine.cache.get_seq_length()


def test_unsupported_models_fall_back_with_the_reason():
    assert unsupported_reason(_llama()) == ""
    quantized = _llama()
    quantized.model.layers[1].mlp.up_proj = torch.nn.Identity()  # stands in for a packed INT4 module
    assert "up_proj" in unsupported_reason(quantized) and lean_forward_for(quantized) is None
    sliding = _llama()
    sliding.config.sliding_window = 16
    assert "sliding" in unsupported_reason(sliding)
    other = torch.nn.Linear(2, 2)
    assert "not 'llama'" in unsupported_reason(other)
    # RoPE whose frequencies depend on the sequence length: the lean forward's table of positions cannot hold them
    for kind in ("dynamic", "longrope"):
        extra = {"short_factor": [1.0] * 8, "long_factor": [2.0] * 8} if kind == "longrope" else {}
        scaled = _llama(max_position_embeddings=2048, rope_parameters={
            "rope_type": kind, "rope_theta": 10000.0, "factor": 2.0, "original_max_position_embeddings": 64, **extra})
        assert f"RoPE type {kind!r}" in unsupported_reason(scaled) and lean_forward_for(scaled) is None
    with pytest.raises(ValueError, match="does not support"):
        LeanLlamaForward(quantized)


@pytest.mark.parametrize("hidden", [64, 256])
def test_without_the_f32_kernel_a_verifys_rows_equal_one_token_steps(hidden, monkeypatch):
    """Where the engine's f32 kernel does not take a plain fp32 linear (no compiler, a bias, a width off its step),
    the lean forward ran it as one BLAS sgemm, which sums a row differently beside other rows (up to 5e-5 apart in
    a review's check): a verify's rows then differed from one-token steps, and greedy output could part from the
    target's own at a near-tie. Now such a layer's verify rows run one at a time where the library's are not
    exact, so the logits are equal bit for bit."""
    from memspec_ros.runtime import draft_forward

    monkeypatch.setattr(draft_forward, "f32_kernel_linear", lambda parts: None)
    model = tiny_llama(vocab_size=96, hidden=hidden, seed=7)
    lean = LeanLlamaForward(model)
    prompt, rows = list(range(3, 30)), [7, 21, 9, 40, 2]
    with torch.inference_mode():
        batched, stepped = KVState(), KVState()
        forward_once(model, prompt, batched, 1, "cpu", lean)
        forward_once(model, prompt, stepped, 1, "cpu", lean)
        verify = forward_once(model, rows, batched, len(rows), "cpu", lean)
        steps = torch.cat([forward_once(model, [t], stepped, 1, "cpu", lean) for t in rows])
    assert torch.equal(verify, steps)


def test_off_the_cpu_a_verifys_rows_are_normalized_one_at_a_time(monkeypatch):
    """A GPU's reduction splits a row's sum among threads by how many rows come together, so the lean forward's
    RMSNorm over a verify's rows differed in the last bits from a one-token step's (on CUDA; not run here: no GPU).
    Off the CPU, 2..9 rows are normalized one at a time (seen on the meta device: one call per row); a prefill's
    rows and the CPU's stay together, where each row is reduced alone."""
    from memspec_ros.runtime import draft_forward

    calls = []
    real = draft_forward._rms_norm

    def counted(x, weight, eps):
        calls.append(tuple(x.shape))
        return real(x, weight, eps)

    monkeypatch.setattr(draft_forward, "_rms_norm", counted)
    for device, rows, expected in (("meta", 5, 1 + 5), ("meta", 12, 1), ("cpu", 5, 1)):
        calls.clear()
        out = draft_forward._rms_norm(torch.randn(1, rows, 64, device=device), torch.ones(64, device=device),
                                       1e-6)
        assert out.shape == (1, rows, 64) and len(calls) == expected, (device, rows, calls)
    x = torch.randn(1, 5, 64)
    rowwise = torch.cat([real(x[:, i : i + 1], torch.ones(64), 1e-6) for i in range(5)], dim=1)
    assert torch.equal(real(x, torch.ones(64), 1e-6), rowwise)  # the CPU's rows: alone or together, the same


def test_a_model_whose_tensors_moved_after_its_lean_forward_was_built_gets_a_new_one():
    """The lean forward, built once per model object, kept raw pointers into the model's tensors (the C decoder's
    norms, layers and embedding): share_memory(), a cast or a move gives the same Parameters new memory and frees
    the old, and every later forward read freed memory. It is built again once they moved."""
    model = _llama(hidden_size=64, intermediate_size=128, num_attention_heads=1, num_key_value_heads=1)
    first = lean_forward_for(model)
    assert lean_forward_for(model) is first  # unmoved: the same one
    model.share_memory()  # every storage moved into shared memory, in place
    second = lean_forward_for(model)
    assert second is not first and lean_forward_for(model) is second
    ref, mine = KVState(), KVState()
    with torch.inference_mode():
        for feed in (list(range(3, 30)), [7], [9, 11]):
            want = forward_once(model, feed, ref, len(feed), "cpu")
            got = forward_once(model, feed, mine, len(feed), "cpu", second)
            tolerance = 1e-4 * float(want.abs().max())  # fp32 summation order (see the test above)
            torch.testing.assert_close(got, want, atol=tolerance, rtol=0)
