"""The engine's preallocated KV cache behaves exactly like transformers' DynamicCache."""

import torch
from transformers import DynamicCache

from memspec_ros.runtime.kv_cache import PreallocatedLayer, preallocated_cache
from memspec_ros.testing.tiny_models import tiny_llama


def _states(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(1, 2, n, 8, generator=g), torch.randn(1, 2, n, 8, generator=g)


def test_layer_matches_dynamic_layer_through_appends_crops_and_growth():
    mine, ref = preallocated_cache(), DynamicCache()
    # appends and crops that cross the initial capacity (256) several times
    steps = [(300, 0), (5, -3), (1, 0), (400, -120), (7, -7), (600, -1)]
    for seed, (n, crop) in enumerate(steps):
        k, v = _states(n, seed)
        got_k, got_v = mine.update(k, v, 0)
        want_k, want_v = ref.update(k, v, 0)
        assert torch.equal(got_k, want_k) and torch.equal(got_v, want_v)
        if crop:
            mine.crop(crop)
            ref.crop(crop)
        assert mine.get_seq_length() == ref.get_seq_length()
    assert isinstance(mine.layers[0], PreallocatedLayer)


def test_crop_is_a_view_and_appends_do_not_reallocate_within_capacity():
    cache = preallocated_cache()
    cache.update(*_states(10, 0), 0)
    layer = cache.layers[0]
    buffer = layer._key_buffer
    for seed in range(20):
        cache.update(*_states(3, seed + 1), 0)
        cache.crop(-2)
    assert layer._key_buffer is buffer  # no new allocation: 10 + 20 tokens fit the first buffer
    assert cache.get_seq_length() == 30
    assert layer.keys.data_ptr() == buffer.data_ptr()


def test_positive_crop_is_refused():
    cache = preallocated_cache()
    cache.update(*_states(4, 0), 0)
    try:
        cache.crop(2)
    except ValueError as exc:
        assert "negative" in str(exc)
    else:
        raise AssertionError("crop(2) must be refused")


def test_model_logits_identical_with_either_cache():
    model = tiny_llama(vocab_size=64, hidden=32, layers=2, seed=3).eval()
    ids = torch.tensor([[1, 5, 9, 12, 40, 7, 3, 22]])
    with torch.inference_mode():
        outs = []
        for cache in (preallocated_cache(), DynamicCache()):
            first = model(input_ids=ids[:, :5], past_key_values=cache, use_cache=True).logits
            cache.crop(-2)  # roll back two tokens, then feed a different continuation
            second = model(input_ids=ids[:, 3:], past_key_values=cache, use_cache=True).logits
            outs.append((first, second))
    assert torch.equal(outs[0][0], outs[1][0])
    assert torch.allclose(outs[0][1], outs[1][1], atol=1e-6, rtol=0)


def test_keys_and_values_read_the_valid_prefix_after_claims_crops_and_a_reset():
    """The views are made when read (a kernel writes the buffers claim_rows hands out), so every read sees exactly
    the rows written and not cropped, as DynamicLayer's would."""
    from memspec_ros.runtime.kv_cache import claim_rows

    cache = preallocated_cache()
    rows = []
    for seed, n in enumerate((5, 3, 1)):
        keys, values = claim_rows(cache, 0, torch.empty(1, 2, n, 8))
        k, v = _states(n, seed)
        length = sum(r[0].shape[-2] for r in rows)
        keys[..., length : length + n, :], values[..., length : length + n, :] = k, v
        rows.append((k, v))
        layer = cache.layers[0]
        assert torch.equal(layer.keys, torch.cat([r[0] for r in rows], -2))
        assert torch.equal(layer.values, torch.cat([r[1] for r in rows], -2))
    cache.crop(-4)
    assert cache.get_seq_length() == 5 and torch.equal(layer.keys, rows[0][0]) and torch.equal(layer.values, rows[0][1])
    layer.reset()
    assert cache.get_seq_length() == 0 and layer.keys is None and layer.values is None
    k, v = _states(2, 9)
    got_k, got_v = cache.update(k, v, 0)
    assert torch.equal(got_k, k) and torch.equal(got_v, v) and cache.get_seq_length() == 2


def test_copy_prefix_copies_the_positions_and_refuses_more_than_held():
    import pytest

    from memspec_ros.runtime.kv_cache import copy_prefix

    cache = preallocated_cache()
    keys, values = torch.randn(1, 2, 10, 4), torch.randn(1, 2, 10, 4)
    for layer in range(2):
        cache.update(keys + layer, values - layer, layer)
    copy = copy_prefix(cache, 6)
    assert copy.get_seq_length() == 6
    for layer in range(2):
        assert torch.equal(copy.layers[layer].keys, keys[..., :6, :] + layer)
        assert torch.equal(copy.layers[layer].values, values[..., :6, :] - layer)
    copy.update(torch.zeros(1, 2, 1, 4), torch.zeros(1, 2, 1, 4), 0)  # they grow apart
    assert cache.layers[0].keys.shape[-2] == 10 and torch.equal(cache.layers[0].keys, keys)
    with pytest.raises(ValueError, match="fewer than the 11 positions"):
        copy_prefix(cache, 11)


def test_freed_memory_is_handed_back_where_the_c_library_can():
    import platform

    from memspec_ros.runtime.kv_cache import release_freed_memory

    assert release_freed_memory() == (platform.libc_ver()[0] == "glibc")


def test_a_crop_brings_every_layer_to_one_length_after_a_forward_that_failed_part_way():
    """A forward that raises after writing some layers (transformers' path, the lean Python one) left those layers
    ahead; crops counted from each layer's own length kept them ahead for good, and later forwards attended over
    the stale rows. The draft-failure path keeps its cache and crops to its own length, so even that crop evens
    the layers out."""
    from memspec_ros.runtime.kv_cache import claim_rows
    from memspec_ros.runtime.speculative import KVState, forward_once

    model = tiny_llama(vocab_size=64, hidden=64, layers=3, seed=5)
    prompt, nxt = [3, 9, 14, 2, 30], [7]
    with torch.inference_mode():
        kv = KVState()
        forward_once(model, prompt, kv, 1, "cpu")
        like = torch.empty(1, model.config.num_key_value_heads, 2,
                           model.config.hidden_size // model.config.num_attention_heads)
        claim_rows(kv.cache, 0, like)  # layer 0 written two rows further, the others not: then the forward raised
        assert [layer.get_seq_length() for layer in kv.cache.layers] == [7, 5, 5]
        kv.crop_to(kv.length)
        assert [layer.get_seq_length() for layer in kv.cache.layers] == [5, 5, 5] and kv.length == 5
        got = forward_once(model, nxt, kv, 1, "cpu")
        fresh = KVState()
        expected = forward_once(model, prompt + nxt, fresh, 1, "cpu")
    assert torch.allclose(got, expected, atol=1e-5)
    kv.crop_to(9)  # past what it holds: nothing grows
    assert kv.length == 6 and [layer.get_seq_length() for layer in kv.cache.layers] == [6, 6, 6]


def test_a_kernel_forward_refuses_a_start_that_is_not_the_cache_length():
    """The C kernels write rows at the caller's ``start`` and attend over 0..start+n-1, while a claim extends each
    layer from its own length: a start that differs would attend over unwritten rows (or leave the cache counting
    rows written elsewhere). Refused before anything is claimed, and the cache is unchanged."""
    import pytest

    from memspec_ros.runtime.kv_cache import claimed_rows

    cache = preallocated_cache()
    like = torch.empty(1, 2, 3, 8)
    with claimed_rows(cache, 2, like, 0):
        pass
    assert [layer.get_seq_length() for layer in cache.layers] == [3, 3]
    for start in (0, 2, 4):
        with pytest.raises(ValueError, match=rf"from position {start} on a cache whose layers hold \[3\]"):
            with claimed_rows(cache, 2, like, start):
                raise AssertionError("the block must not run")
    assert [layer.get_seq_length() for layer in cache.layers] == [3, 3]
    with claimed_rows(cache, 2, like, 3):
        pass
    assert [layer.get_seq_length() for layer in cache.layers] == [6, 6]


def test_a_generations_cache_grows_to_its_last_row_not_past_it():
    """The prefill claimed the prompt's rows exactly and the first verify doubled them: a 1,024-token prompt with
    128 new tokens took 2,048 rows for 1,152. The buffers still double, but not past what the generation can ever
    write (prompt + answer - 1, the last token never fed); a generous max_new_tokens reserves nothing up front. The
    output is the same."""
    from memspec_ros.runtime.speculative import SpeculativeSession, generate
    from memspec_ros.testing.tiny_models import noisy_copy

    target = tiny_llama(vocab_size=64, hidden=32, layers=2, seed=3).eval()
    draft = noisy_copy(target, 0.02, seed=4)
    prompt = [1 + i % 60 for i in range(300)]  # past the first buffer's 256 rows
    alone = generate(target, prompt, None, max_new_tokens=40).generated_ids
    session = SpeculativeSession(target, prompt, gamma=4, max_new_tokens=40)
    session.prefill()
    while not session.finished:
        session.step("d", draft)
    assert session.generated_ids == alone and session.stats.mean_accepted > 0
    rows = {layer._key_buffer.shape[-2] for layer in session._target_kv.cache.layers}
    assert rows == {300 + 40 - 1}
    generous = SpeculativeSession(target, prompt, gamma=4, max_new_tokens=150)
    generous.prefill()
    rows = {layer._key_buffer.shape[-2] for layer in generous._target_kv.cache.layers}
    assert rows == {300}  # nothing taken up front for an answer that may end far sooner
    generous.step("d", draft)
    rows = {layer._key_buffer.shape[-2] for layer in generous._target_kv.cache.layers}
    assert rows == {300 + 150 - 1}  # doubled at the first verify, but not past the last row (600)
