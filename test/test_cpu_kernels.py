"""The engine's C kernels (runtime/cpu_kernels.c): each computes its layer, a multi-row call computes every row as
that row alone (the losslessness of a verify rests on it), the one-call decoder equals the lean Python forward
over the same layers, speculative decoding through it stays lossless, and a machine without them falls back."""

from __future__ import annotations

import math
import os
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import fix_adaptive_costs
from row_checks import assert_same_choice
from test_forward_paths import _q8_grid_table, verify_and_steps

from memspec_ros.runtime import cpu_kernels
from memspec_ros.runtime.draft_forward import decoder_summary, lean_forward_for, observe_hidden
from memspec_ros.runtime.draft_vocab import DraftVocab, ReducedVocabDraft
from memspec_ros.runtime.forward_paths import (
    INT4_GROUP,
    Float32Linear,
    Int4Linear,
    Int8Linear,
    apply_path,
    cpu_has_bf16,
)
from memspec_ros.runtime.speculative import KVState, forward_once, generate
from memspec_ros.testing.tiny_models import noisy_copy, tiny_llama

STATUS = cpu_kernels.status()
needs_w4 = pytest.mark.skipif(not STATUS.w4, reason=f"no w4 kernel here: {STATUS.reason}")
needs_i8 = pytest.mark.skipif(not STATUS.i8, reason=f"no i8 kernel here: {STATUS.reason}")
needs_decoder = pytest.mark.skipif(not STATUS.decoder, reason=f"no decoder kernel here: {STATUS.reason}")
needs_step = pytest.mark.skipif(not STATUS.step, reason=f"no step kernel here: {STATUS.reason}")
# Where a C compiler is on PATH (and the kernels are not turned off) they must build: a broken build fails the tests
# below instead of skipping them. Without a compiler the engine runs ATen's kernels, as the README says.
_OFF = cpu_kernels.os.environ.get(cpu_kernels.ENV_SWITCH, "1").strip().lower() in ("0", "false", "no", "off")
try:
    _CC = shutil.which(cpu_kernels._compiler()[0])
except RuntimeError:  # $CC is no command line: the kernels cannot build
    _CC = None
# the compiler command the wrappers below hand on to: $CC's, where it is set
_CC_SH = shlex.join(cpu_kernels._compiler()) if _CC else "cc"
needs_compiler = pytest.mark.skipif(_OFF or _CC is None,
                                    reason="no C compiler on PATH, or kernels turned off: ATen's kernels run")
ROWS = range(1, 11)  # 1..8 rows take one pass over the weights, 9 and 10 two


def _rows_alone(f, x: torch.Tensor) -> torch.Tensor:
    return torch.cat([f(x[i : i + 1]) for i in range(x.shape[0])])


@needs_i8
@pytest.mark.parametrize("rows", ROWS)
def test_i8_kernel_equals_int_mm_bit_for_bit(rows):
    """Integer sums are exact, and the kernel quantizes and scales rows with Int8Linear's own operations, so it
    gives torch._int_mm's numbers exactly."""
    gen = torch.Generator().manual_seed(rows)
    weight, x = torch.randn(80, 128, generator=gen), torch.randn(rows, 128, generator=gen) * 3
    layer = Int8Linear(weight, None)
    assert layer.own_kernel
    q = layer.qweight
    row_scale = x.abs().amax(dim=1, keepdim=True).clamp(min=1e-12) / 127
    sums = torch._int_mm(torch.round(x / row_scale).to(torch.int8), q.t().contiguous())
    want = sums.float() * row_scale * layer.scale
    got = layer(x)
    assert torch.equal(got, want)
    assert torch.equal(got, _rows_alone(layer, x))


@needs_i8
@pytest.mark.parametrize("rows", [1, 5, 16, 17, 33])
def test_i8_kernel_is_exact_on_every_blocking_of_outputs_and_rows(rows):
    """83 outputs (64 + 16 + 3: AMX's blocks of four tiles and of one, and the last outputs in vector code where
    a CPU has AMX) and rows in passes of up to 16: every path gives torch._int_mm's integers, and each row its own."""
    gen = torch.Generator().manual_seed(100 + rows)
    weight, x = torch.randn(83, 192, generator=gen), torch.randn(rows, 192, generator=gen)
    layer = Int8Linear(weight, None)
    row_scale = x.abs().amax(dim=1, keepdim=True).clamp(min=1e-12) / 127
    sums = torch._int_mm(torch.round(x / row_scale).to(torch.int8), layer.qweight.t().contiguous())
    got = layer(x)
    assert torch.equal(got, sums.float() * row_scale * layer.scale)
    assert torch.equal(got, _rows_alone(layer, x))


@needs_compiler
@pytest.mark.parametrize("rows", [*ROWS, 16, 17, 33])
def test_f32_kernel_computes_its_layer_and_each_row_alone(rows):
    """fp32 weights as loaded: within fp32 rounding of the float64 product (the classic bound for a sum of K
    products, K * 2^-24 of the sum of their magnitudes), and every row of a multi-row call bit-equal to that row
    alone, whatever the rows' blocking (8 per pass over the weights) or the outputs' (83: not a multiple of 16)."""
    assert STATUS.f32, STATUS.reason
    gen = torch.Generator().manual_seed(200 + rows)
    weight, x = torch.randn(83, 192, generator=gen), torch.randn(rows, 192, generator=gen) * 3
    layer = Float32Linear(weight)
    got = layer(x)
    want = x.double() @ weight.double().t()
    bound = 192 * 2.0**-24 * (x.double().abs() @ weight.double().abs().t())
    assert ((got.double() - want).abs() <= bound).all()
    assert torch.equal(got, _rows_alone(layer, x))


def test_f32_fusion_shares_the_models_weights_and_leaves_transformers_forward_as_it_was():
    """The lean forward fuses q/k/v and gate/up for the f32 kernel in place: the model's parameters become views of
    the fused tensor (no second copy), and transformers' own forward of the model gives the same logits after."""
    model = tiny_llama(vocab_size=96, hidden=256, layers=2, seed=14, init_range=0.2)
    ids = torch.tensor([[5, 9, 33, 2, 71]])
    with torch.inference_mode():
        before = model(ids).logits
        lean = lean_forward_for(model)
        after = model(ids).logits
    assert torch.equal(before, after)
    attention = model.model.layers[0].self_attn
    fused = lean.layers[0].qkv
    assert isinstance(fused, Float32Linear) and lean.decoder is not None
    storage = fused.weight.untyped_storage().data_ptr()
    assert all(p.weight.untyped_storage().data_ptr() == storage
               for p in (attention.q_proj, attention.k_proj, attention.v_proj))
    assert lean.lm_head.weight.data_ptr() == model.lm_head.weight.data_ptr()  # the head itself, not a copy


def _w4_reference(layer: Int4Linear, x: torch.Tensor) -> torch.Tensor:
    """What the w4 kernel computes, in float64: each group's levels q * scale + minimum (bf16 scale and minimum)
    times the rows quantized to int8 per block of 32 with scale max|x| / 127 (the block sums are exact integers)."""
    in_features = layer.in_features
    q, scale_min = cpu_kernels.unpack_w4(layer.packed, layer.scale_min)
    q = q.double()  # [O, G, 32]
    pair = scale_min.view(torch.bfloat16).view(*scale_min.shape, 2).double()
    scale, low = pair[..., :1], pair[..., 1:]
    blocks = x.float().view(x.shape[0], in_features // INT4_GROUP, INT4_GROUP)
    d = blocks.abs().amax(-1, keepdim=True) / 127  # fp32, as the kernel divides
    xq = torch.where(d > 0, torch.round(blocks / d), torch.zeros_like(blocks)).double()  # round half to even
    # sum_j (q_j * scale + low) * xq_j * d, per group: scale * d * (q . xq) + low * d * sum(xq)
    dots = torch.einsum("ogj,mgj->mog", q, xq)
    return (dots * scale[..., 0][None] * d.double()[:, None, :, 0]
            + low[..., 0][None] * (d.double()[..., 0] * xq.sum(-1))[:, None, :]).sum(-1)


@needs_w4
def test_w4_packing_is_undone_exactly_in_either_layout():
    """pack_w4's layout (per output, or in blocks of 16 outputs for vpdpbusd and AMX) loses nothing: unpack_w4 gives the
    levels and the bf16 scale and minimum back in output order."""
    gen = torch.Generator().manual_seed(5)
    q = torch.randint(0, 16, (48, 3, INT4_GROUP), generator=gen)
    scale, low = torch.rand(48, 3, generator=gen), torch.randn(48, 3, generator=gen)
    packed, scale_min = cpu_kernels.pack_w4(q, scale, low)
    assert packed.shape == (48, 3, 16) and scale_min.shape == (48, 3)
    levels, pairs = cpu_kernels.unpack_w4(packed, scale_min)
    assert torch.equal(levels, q.to(torch.uint8))
    want = torch.stack([scale, low], -1).to(torch.bfloat16).view(torch.int32)[..., 0]
    assert torch.equal(pairs, want)


@pytest.mark.parametrize("kind", ["i8", "w4"])
@pytest.mark.parametrize("rows", [3, 17])
def test_a_row_holding_nan_or_inf_gives_nan_outputs_as_atens_arithmetic_does(kind, rows):
    """The kernels' row maximum passes a NaN over and (int)nearbyintf(NaN) is undefined, so a NaN input came out as
    finite numbers where ATen's row scale makes it NaN: a diverging model gave plausible garbage instead of NaN. Each
    non-finite row now gives NaN outputs, and the other rows their own numbers."""
    if not getattr(STATUS, kind):
        pytest.skip(f"no {kind} kernel here: {STATUS.reason}")
    gen = torch.Generator().manual_seed(rows)
    weight, x = torch.randn(80, 128, generator=gen), torch.randn(rows, 128, generator=gen)
    x[1, 40], x[2, 7] = float("nan"), float("inf")
    layer = (Int8Linear if kind == "i8" else Int4Linear)(weight, None)
    assert layer.own_kernel
    got = layer(x)
    assert bool(got[1:3].isnan().all())
    finite = [0, *range(3, rows)]
    assert bool(got[finite].isfinite().all()) and torch.equal(got[finite], _rows_alone(layer, x[finite]))


@needs_decoder
@pytest.mark.parametrize("path", ["int4", "int8", "fp32"])
def test_the_decoder_keeps_the_tensors_it_points_into_not_only_their_modules(path):
    """The C structs point into the linears' weight tensors, and the decoder kept only the modules: a module's
    tensors replaced after the build (``module.to()``, ``load_state_dict(assign=True)``) were freed under it."""
    from memspec_ros.runtime.cpu_kernels import _kernel_tensors

    lean = lean_forward_for(_decoder_model(path))
    assert lean.decoder is not None, lean.decoder_reason
    kept = {id(t) for t in lean.decoder._keep}
    for layer in lean.layers:
        for name in ("qkv", "o", "gate_up", "down"):
            pointed = _kernel_tensors(getattr(layer, name))
            assert pointed and all(id(t) in kept for t in pointed)  # by the decoder itself, not through the module


@needs_w4
def test_a_kernel_called_unchecked_refuses_shapes_its_loops_cannot_take():
    """The C trusted the Python side's checks, which a layer that built its own operands skips (check=False): rows of
    48 inputs (not whole groups of 32) or 8 (f32: not a multiple of 16) were read and written past their ends."""
    gen = torch.Generator().manual_seed(3)
    q = torch.randint(0, 16, (16, 1, INT4_GROUP), generator=gen)
    packed, scale_min = cpu_kernels.pack_w4(q, torch.rand(16, 1, generator=gen), torch.randn(16, 1, generator=gen))
    with pytest.raises(ValueError, match="the w4 kernel refuses 48 inputs"):
        cpu_kernels.w4_matmul(torch.randn(2, 48), packed, scale_min, check=False)
    with pytest.raises(ValueError, match="the f32 kernel refuses 8 inputs"):
        cpu_kernels.f32_matmul(torch.randn(2, 8), torch.randn(4, 8), check=False)
    assert cpu_kernels.f32_matmul(torch.randn(2, 16), torch.randn(4, 16), check=False).shape == (2, 4)


@needs_w4
@pytest.mark.parametrize("rows", ROWS)
def test_w4_kernel_computes_its_layer_and_each_row_alone(rows):
    gen = torch.Generator().manual_seed(10 + rows)
    weight, x = torch.randn(48, 96, generator=gen), torch.randn(rows, 96, generator=gen)
    x[0, :32] = 0  # an all-zero block: scale 0, not a division by zero
    layer = Int4Linear(weight, None)
    assert layer.own_kernel
    got = layer(x)
    torch.testing.assert_close(got.double(), _w4_reference(layer, x), atol=1e-4, rtol=1e-4)
    assert torch.equal(got, _rows_alone(layer, x))


@needs_w4
@pytest.mark.parametrize("rows", [1, 16, 17, 33])
def test_w4_kernel_on_every_blocking_of_outputs_and_rows(rows):
    """80 outputs (on AMX's tiles, calls of more than 5 rows: a pass of four blocks of 16, then one of one block;
    rows in passes of 16, as a prefill makes them; on vpdpbusd alone, rows in passes of 5): the layer's numbers, and
    each row its own."""
    gen = torch.Generator().manual_seed(200 + rows)
    weight, x = torch.randn(80, 96, generator=gen), torch.randn(rows, 96, generator=gen)
    layer = Int4Linear(weight, None)
    got = layer(x)
    torch.testing.assert_close(got.double(), _w4_reference(layer, x), atol=1e-4, rtol=1e-4)
    assert torch.equal(got, _rows_alone(layer, x))


@needs_w4
def test_w4_kernel_keeps_a_q4_1_layer_to_the_rounding_of_its_rows():
    """Weights already on the 4-bit grid (a Q4_1 GGUF's) come back within the rounding of the rows (int8 blocks:
    half a step of max|x| / 127 per value, as llama.cpp's Q8_1 blocks round them)."""
    gen = torch.Generator().manual_seed(3)
    q = torch.randint(0, 16, (32, 2, INT4_GROUP), generator=gen).float()
    q[..., 0], q[..., 1] = 0, 15
    scale = torch.rand(32, 2, 1, generator=gen) * 0.1 + 0.01
    weight = (q * scale - 0.3).view(32, 64)
    x = torch.randn(3, 64, generator=gen)
    err = (Int4Linear(weight, None)(x) - x @ weight.t()).norm() / (x @ weight.t()).norm()
    assert err < 0.01


def _decoder_model(path: str, seed: int = 7, noise: float = 0.0):
    """A model the decoder takes (hidden 256, head_dim 64, intermediate 512), on ``path``; with ``noise``, the
    seed's model plus Gaussian noise (a draft that agrees with it on some tokens)."""
    model = tiny_llama(vocab_size=96, hidden=256, layers=2, seed=seed, init_range=0.2)
    if noise:
        model = noisy_copy(model, noise, seed=seed + 100)
    apply_path(model, path)
    return model


@needs_decoder
@pytest.mark.parametrize("path", ["int4", "int8", "fp32"])
def test_decoder_runs_the_layers_as_the_lean_forward_does(path):
    model = _decoder_model(path)
    lean = lean_forward_for(model)
    assert lean.decoder is not None, lean.decoder_reason
    assert decoder_summary(model).startswith("memspec kernel")
    prompt, rows = [5, 9, 33, 2, 71, 40, 8, 8, 13], [7, 21, 9, 40, 2]
    out, decoder = {}, lean.decoder
    with torch.inference_mode():
        for name, use in (("decoder", decoder), ("python", None)):  # python: the lean forward, same layers
            lean.decoder = use
            kv = KVState()
            prefill = forward_once(model, prompt, kv, len(prompt), "cpu", lean)
            verify = forward_once(model, rows, kv, len(rows), "cpu", lean)
            out[name] = torch.cat([prefill, verify])
    lean.decoder = decoder
    # The same kernels multiply; RMSNorm, RoPE, attention and SiLU are loops in C instead of torch operations, so
    # the two round an activation differently now and then. Rounded again into the matmul's row format (int8 rows or
    # blocks: steps of 1/127 of their largest value), that difference can become one step of the format, and the
    # logits move by a few such steps, two layers amplifying them (an AMX Xeon, 12 seeds: 0, or up to 1.8e-2 of
    # their scale on int4, 1.3e-3 on int8; fp32 rows are not rounded again, so only float rounding remains there).
    # A wrong layer (RoPE, mask, head mapping) moves them by their scale.
    row_step = 1 / 127
    scale = out["python"].abs().max()
    assert (out["decoder"] - out["python"]).abs().max() < 8 * row_step * scale
    # the same choice up to that difference: on another CPU's rounding a near-tie may fall either way
    assert_same_choice(out["decoder"], out["python"], 8 * row_step * scale)
    if path == "fp32":  # float rounding alone, the C loops' vector e^x included: within a few ulp of the scale
        assert (out["decoder"] - out["python"]).abs().max() < 3e-5 * scale


@needs_decoder
@pytest.mark.parametrize("path", ["int4", "int8", "fp32"])
def test_decoder_verify_rows_equal_one_token_steps_bit_for_bit(path):
    model = _decoder_model(path, seed=8)
    assert lean_forward_for(model).decoder is not None
    prompt, rows = list(range(3, 30)), [7, 21, 9, 40, 2, 11, 60, 5, 17]  # 9 rows: two row blocks
    verify, steps = verify_and_steps(model, prompt, rows)
    assert torch.equal(verify, steps)
    # after a rollback (the kernel's cache rows cropped like any others), a different continuation
    verify, steps = verify_and_steps(model, prompt, [50, 51, 52], crop=2)
    assert torch.equal(verify, steps)


@pytest.mark.parametrize("path", ["int4", "int8", "bf16"] if cpu_has_bf16() else ["int4", "int8"])
def test_the_fused_linears_share_the_models_weights(path):
    """The lean forward's q/k/v and gate/up were copies: an int4 target held them twice, uncounted."""
    from memspec_ros.runtime.models import parameter_bytes

    model = tiny_llama(vocab_size=96, hidden=256, layers=2, seed=3, init_range=0.2)
    apply_path(model, path)
    counted = parameter_bytes(model)
    lean = lean_forward_for(model)
    fused = [m for layer in lean.layers for m in (layer.qkv, layer.gate_up)]
    assert all(type(m).__name__.endswith("Linear") for m in fused)  # fused, not computed part by part
    held = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
            for t in [*model.parameters(), *model.buffers(), *(b for m in fused for b in m.buffers())]}
    # ATen's int4 layout (no kernels here) keeps its scale_zero by input group: that small buffer stays a copy
    extra = sum(b.numel() * b.element_size() for m in fused for n, b in m.named_buffers() if n == "scale_zero")
    assert sum(held.values()) <= counted + extra
    x = torch.randn(3, 256)
    assert torch.equal(model.model.layers[0].self_attn.k_proj(x), lean.layers[0].qkv(x)[:, 256:384])


@needs_decoder
def test_a_layer_whose_rows_differ_together_keeps_the_model_off_the_one_call_decoder():
    """check_rows sends such a layer's verify rows through one at a time; the C decoder took all of them at once."""
    model = _decoder_model("int8", seed=12)
    model.model.layers[1].mlp.down_proj.rows_at_once = False  # not fused: q/k/v and gate/up are checked fused
    lean = lean_forward_for(model)
    assert lean.decoder is None and "computes rows differently together" in lean.decoder_reason


@needs_decoder
@pytest.mark.parametrize("path", ["int4", "int8", "fp32"])
def test_speculative_greedy_through_the_decoder_equals_the_target_alone(path, monkeypatch):
    target, draft = _decoder_model(path, seed=9), _decoder_model(path, seed=9, noise=0.02)
    assert lean_forward_for(target).decoder is not None
    prompt = [5, 9, 33, 2, 71, 40]
    alone = generate(target, prompt, None, gamma=4, max_new_tokens=40, eos_token_ids=[])
    # adaptive gamma on fixed costs where drafting pays (a draft token 0.5 ms, a verify row 1 ms on 10): its choice
    # then does not depend on this machine's timing, and it drafts
    fix_adaptive_costs(monkeypatch, lambda model, k, vocab: 10.0 + (k - 1), 0.5)
    for adaptive in (False, True):
        spec = generate(target, prompt, draft, gamma=4, max_new_tokens=40, eos_token_ids=[], adaptive_gamma=adaptive)
        assert spec.generated_ids == alone.generated_ids
        assert spec.stats.mean_accepted > 0, adaptive  # the draft agreed sometimes: several-row verifies really ran


def _step_model(path: str, kind: str, seed: int = 7):
    """A model the step kernel takes, as the engine meets them: ``plain`` (the decoder's model), ``q8`` (its
    embedding on GGUF's Q8_0 grid, kept as int8 rows: the bundled target's), ``f16`` (an embedding fp16 holds
    exactly, kept as fp16 rows), ``reduced`` (a draft over 40 of the 96 target ids: the bundled drafts')."""
    if kind == "reduced":
        inner = tiny_llama(vocab_size=41, hidden=256, layers=2, seed=seed, init_range=0.2)
        apply_path(inner, path)
        return ReducedVocabDraft(inner, DraftVocab(list(range(3, 83, 2)), 96)).eval()
    model = tiny_llama(vocab_size=96, hidden=256, layers=2, seed=seed, init_range=0.2)
    with torch.no_grad():
        table = model.get_input_embeddings().weight
        if kind == "q8":
            table.copy_(_q8_grid_table(96, 256, seed=seed))
        elif kind == "f16":  # loaded from an fp16 file, as the bundled drafts are: kept as fp16 rows
            table.copy_(table.half().float())
    report = apply_path(model, path)
    assert report.embedding == {"q8": "q8_0", "f16": "fp16"}.get(kind, "fp32") or path == "fp32"
    return model


STEP_CASES = [(p, k) for p in ("int4", "int8", "fp32") for k in ("plain", "q8", "f16", "reduced")
              if p != "fp32" or k in ("plain", "reduced")]


def _prefill_and_verify(model, lean, prompt, rows):
    kv = KVState()
    with torch.inference_mode():
        return torch.cat([forward_once(model, prompt, kv, len(prompt), "cpu", lean),
                          forward_once(model, rows, kv, len(rows), "cpu", lean)])


@needs_step
@pytest.mark.parametrize(("path", "kind"), STEP_CASES)
def test_the_step_kernel_runs_the_whole_forward_as_the_lean_forward_does(path, kind):
    """Ids to logits in one C call (embedding rows, layers, final RMSNorm, head, the reduced vocabulary's scatter)
    against the lean forward's own embedding, RMSNorm and head around the same decoder call."""
    model = _step_model(path, kind)
    lean = lean_forward_for(model)
    assert lean.step is not None, lean.step_reason
    prompt, rows = [5, 9, 33, 2, 71, 40, 8, 8, 13], [7, 21, 9, 40, 2]
    stepped = _prefill_and_verify(model, lean, prompt, rows)
    step, lean.step = lean.step, None
    try:
        python = _prefill_and_verify(model, lean, prompt, rows)
    finally:
        lean.step = step
    # only the final RMSNorm's order of additions differs; on int4/int8 its rows are rounded again for the
    # head's int8 row format, so as in the decoder test above a difference may become one step of it
    finite = torch.isfinite(python)
    assert torch.equal(torch.isfinite(stepped), finite)  # a reduced draft: -inf (q = 0) on the same ids
    assert finite.sum(-1).min() == (40 if kind == "reduced" else 96)
    scale = python[finite].abs().max()
    assert (stepped[finite] - python[finite]).abs().max() < 8 / 127 * scale
    assert_same_choice(stepped, python, 8 / 127 * scale)
    verify, steps = verify_and_steps(model, prompt, rows)
    assert torch.equal(verify, steps)  # a verify's rows equal one-token steps, bit for bit


@needs_step
def test_the_step_kernel_shows_hidden_state_observers_every_fed_row():
    """The target-hidden predictor reads the final-normed hidden state of every row the target is fed."""
    model = _step_model("int8", "plain")
    lean = lean_forward_for(model)
    seen: dict[str, list] = {"step": [], "python": []}
    prompt, rows = [5, 9, 33, 2, 71, 40], [7, 21, 9]
    step = lean.step
    for name in seen:
        handle = observe_hidden(model, lambda hidden, start, name=name: seen[name].append((start, hidden.clone())))
        lean.step = step if name == "step" else None
        try:
            _prefill_and_verify(model, lean, prompt, rows)
        finally:
            lean.step = step
            handle.remove()
    assert [(s, h.shape) for s, h in seen["step"]] == [(0, (6, 256)), (6, (3, 256))]
    assert [s for s, _ in seen["python"]] == [0, 6]
    for (_, a), (_, b) in zip(seen["step"], seen["python"], strict=True):
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-5)


@needs_step
@pytest.mark.parametrize("kind", ["plain", "reduced"])
def test_the_step_kernel_refuses_an_id_outside_the_vocabulary_and_changes_no_cache(kind):
    model = _step_model("int8", kind)
    lean = lean_forward_for(model)
    kv = KVState()
    with torch.inference_mode():
        forward_once(model, [5, 9, 33], kv, 1, "cpu", lean)
        for bad in ([96], [-1], [7, 200]):
            with pytest.raises(IndexError, match=r"token ids must lie in \[0, 96\)"):
                forward_once(model, bad, kv, 1, "cpu", lean)
            assert kv.length == 3 and kv.cache.get_seq_length() == 3
    step = lean.step  # called directly, it checks what the C call would read past: the rotary table too
    with pytest.raises(ValueError, match="rotary table covers"):
        step([1], 10_000, lean._rope, 1, [(torch.empty(1, 1, 1, 64),) * 2] * len(lean.layers))
    with pytest.raises(IndexError, match="token row out of range"):
        step([10_000], 3, lean._rope, 1, [])


@needs_step
def test_a_step_refused_after_the_cache_was_claimed_leaves_every_layer_as_it_was():
    """The step claimed every layer's rows before its own checks and its scratch allocation: a refused call left
    each layer's length ahead of KVState's, over rows no forward wrote, for anything reading the layers."""
    model = _step_model("int8", "plain")
    lean = lean_forward_for(model)
    kv = KVState()
    with torch.inference_mode():
        forward_once(model, [5, 9, 33], kv, 1, "cpu", lean)
        with pytest.raises(ValueError, match="cannot keep the last 3"):
            lean([7, 21], kv.cache, 3, 3)  # keep more rows than fed: refused inside the step, after the claim
        assert [layer.get_seq_length() for layer in kv.cache.layers] == [3] * len(lean.layers)
        again = lean([7, 21], kv.cache, 3, 1)
    fresh = KVState()
    with torch.inference_mode():
        forward_once(model, [5, 9, 33], fresh, 1, "cpu", lean)
        assert torch.equal(again, lean([7, 21], fresh.cache, 3, 1))


def _status_in_subprocess(env: dict[str, str]) -> str:
    code = ("from memspec_ros.runtime import cpu_kernels, forward_paths; import torch;"
            "s = cpu_kernels.status(); l = forward_paths.Int4Linear(torch.randn(16, 64), None);"
            "print(s.describe(), '|', l.own_kernel, '|', l(torch.randn(2, 64)).shape)")
    import os

    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                          env={**os.environ, **env})
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def test_turned_off_the_paths_use_atens_kernels():
    out = _status_in_subprocess({"MEMSPEC_CPU_KERNELS": "0"})
    assert out.startswith("none (ATen's kernels); turned off by MEMSPEC_CPU_KERNELS=0")
    assert "| False |" in out and out.endswith("torch.Size([2, 16])")


@needs_compiler  # _build asks the compiler its version
def test_a_build_that_failed_is_tried_again_a_day_later_not_at_every_start(tmp_path, monkeypatch):
    """Three timed-out attempts cost every process start up to six minutes, each start paying them again; the
    failure is kept for a day now, as a timed-out full build's fallback is."""
    import os
    import time

    calls = []

    def failing(out_dir, library, compiler, flags, keep_fallback=False):
        calls.append(library)
        raise RuntimeError("cc failed: [-fopenmp] timed out after 120 s | [] timed out | [portable] timed out")

    def fast_failure(out_dir, library, compiler, flags, keep_fallback=False):
        raise RuntimeError("cc failed: [-fopenmp] omp.h: No such file")

    monkeypatch.setattr(cpu_kernels, "_compile", fast_failure)
    with pytest.raises(RuntimeError, match="omp.h"):  # a fast failure: not kept (a header installed fixes it)
        cpu_kernels._build(tmp_path)
    assert not list(tmp_path.glob("*.failed.txt"))
    monkeypatch.setattr(cpu_kernels, "_compile", failing)
    with pytest.raises(RuntimeError, match="timed out after 120 s"):
        cpu_kernels._build(tmp_path)
    with pytest.raises(RuntimeError, match="tried again a day later: delete .*failed.txt"):
        cpu_kernels._build(tmp_path)
    assert len(calls) == 1
    marker = calls[0].with_suffix(".failed.txt")
    day_ago = time.time() - cpu_kernels.FALLBACK_RETRY_S - 10
    os.utime(marker, (day_ago, day_ago))
    with pytest.raises(RuntimeError, match="timed out after 120 s"):
        cpu_kernels._build(tmp_path)
    assert len(calls) == 2


def test_without_a_compiler_the_paths_use_atens_kernels_and_say_why(tmp_path):
    out = _status_in_subprocess({"CC": "/bin/false", "MEMSPEC_CACHE_DIR": str(tmp_path)})
    assert out.startswith("none (ATen's kernels); not compiled")
    assert "/bin/false failed" in out and "| False |" in out


def test_a_cc_that_is_no_command_line_leaves_atens_kernels_and_says_what_to_fix(tmp_path):
    """An unbalanced quote in $CC raised out of every status() call, so loading any model failed."""
    out = _status_in_subprocess({"CC": 'gcc "-O2', "MEMSPEC_CACHE_DIR": str(tmp_path)})
    assert out.startswith("none (ATen's kernels); not compiled") and "fix or unset CC" in out, out
    assert "| False |" in out


@needs_compiler
def test_the_library_is_compiled_once_per_machine_and_source(tmp_path):
    first = cpu_kernels._build(tmp_path)
    stamp = first.stat().st_mtime_ns
    assert cpu_kernels._build(tmp_path) == first and first.stat().st_mtime_ns == stamp
    # no partial files left behind: the library, its note where only a fallback build (no OpenMP) succeeded, and
    # the empty lock file the build held (kept: removing a lock file others may have opened races them)
    assert {p.name for p in tmp_path.iterdir()} <= {first.name, cpu_kernels._fallback_note(first).name,
                                                     f".{first.stem}.lock"}


@needs_compiler
def test_a_damaged_cached_library_is_built_again(tmp_path):
    """A cached library cut short (a power cut between write and rename, before it was fsynced) failed to load on
    every start and left ATen's kernels running, silently changing the model's numbers: it is built again."""
    library = cpu_kernels._build(tmp_path / "kernels")
    library.write_bytes(library.read_bytes()[:100])
    # the full build's library (under MEMSPEC_CPU_KERNELS=portable, this file's rerun, another key is loaded)
    out = _status_in_subprocess({"MEMSPEC_CACHE_DIR": str(tmp_path), cpu_kernels.ENV_SWITCH: "1"})
    assert out.startswith("memspec w4") and "| True |" in out, out
    assert library.stat().st_size > 100


def test_a_mistyped_kernel_switch_is_named_not_taken_for_on(tmp_path):
    """MEMSPEC_CPU_KERNELS=portabel (meant for an A/B run against the portable C) built the SIMD kernels silently."""
    out = _status_in_subprocess({"MEMSPEC_CACHE_DIR": str(tmp_path), cpu_kernels.ENV_SWITCH: "portabel"})
    assert "'portabel' is none of 0, portable, 1" in out and "| True |" not in out, out


@needs_compiler
def test_a_library_built_without_openmp_says_so(tmp_path):
    """The fallback builds (no OpenMP, then portable C) are cached under the full build's key: the status says the
    library is degraded and how to retry, instead of looking like the full build."""
    cc = tmp_path / "cc-without-openmp"
    cc.write_text('#!/bin/sh\nfor a in "$@"; do [ "$a" = "-fopenmp" ] && exit 1; done\nexec ' + _CC_SH + ' "$@"\n')
    cc.chmod(0o755)
    for _ in range(2):  # built, then loaded from the cache: both say it
        out = _status_in_subprocess({"CC": str(cc), "MEMSPEC_CACHE_DIR": str(tmp_path / "cache"),
                                     cpu_kernels.ENV_SWITCH: "1"})
        assert "built without OpenMP or -march=native" in out and "| True |" in out, out


@needs_compiler
def test_a_build_that_times_out_still_tries_the_simpler_builds(tmp_path, monkeypatch):
    """A compiler timeout in the first (OpenMP) build escaped the attempt loop: no fallback was tried, and the
    process ran ATen's kernels for its whole life. And what the timed-out compiler started (cc1, ld) is killed
    with it: a late ld could write the output the next attempt links."""
    started = tmp_path / "started.pid"
    cc = tmp_path / "cc-that-hangs-on-openmp"
    cc.write_text(f'#!/bin/sh\nfor a in "$@"; do [ "$a" = "-fopenmp" ] && {{ sleep 60 & echo $! >{started}; wait; }};'
                  f' done\nexec {_CC_SH} "$@"\n')
    cc.chmod(0o755)
    real = cpu_kernels._run_compiler
    # only the hanging attempt is cut short: the real compiles keep the real timeout, however slow the machine
    monkeypatch.setattr(cpu_kernels, "_run_compiler",
                        lambda command: real(command, 2.0) if "-fopenmp" in command else real(command))
    library = tmp_path / "kernels.so"
    cpu_kernels._compile(tmp_path, library, [str(cc)], cpu_kernels.FLAGS)
    assert library.is_file()
    assert "timed out" in cpu_kernels._fallback_note(library).read_text()
    # kept for the processes after this one (a machine too slow for the full build would pay its timeouts at every
    # start), but built again a day later: one busy moment must not leave every later process on it for good
    assert not cpu_kernels._fallback_to_retry(library)
    long_ago = time.time() - cpu_kernels.FALLBACK_RETRY_S - 1
    os.utime(cpu_kernels._fallback_note(library), (long_ago, long_ago))
    assert cpu_kernels._fallback_to_retry(library)
    pid = int(started.read_text())
    deadline = time.monotonic() + 10.0
    while Path(f"/proc/{pid}").exists() and "Z" not in _proc_state(pid):
        assert time.monotonic() < deadline, "the timed-out compiler's child still runs"
        time.sleep(0.05)


def _proc_state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return "Z"


@needs_decoder
@pytest.mark.parametrize("path", ["int4", "int8", "fp32"])
def test_the_thread_count_does_not_change_a_number(path):
    """Threads split outputs (matmuls) and heads (attention); each is computed by the same operations whichever
    thread runs it, so 1 and 3 threads give the same logits bit for bit (3: parts of unequal size)."""
    if "without OpenMP" in (cpu_kernels.status().reason or ""):  # one thread whatever the count: nothing to compare
        pytest.skip("the kernels were built without OpenMP here, so they run one thread whatever the count")
    model = _decoder_model(path, seed=11)
    lean = lean_forward_for(model)
    prompt, rows = list(range(3, 40)), [7, 21, 9, 40, 2]
    before = torch.get_num_threads()
    out = []
    try:
        for threads in (1, 3):
            torch.set_num_threads(threads)
            kv = KVState()
            with torch.inference_mode():
                out.append(torch.cat([forward_once(model, prompt, kv, 4, "cpu", lean),
                                      forward_once(model, rows, kv, len(rows), "cpu", lean)]))
    finally:
        torch.set_num_threads(before)
    assert torch.equal(out[0], out[1])


@needs_decoder
def test_sampled_output_through_the_decoder_keeps_the_targets_distribution():
    """Sampling by the standard rule through the decoder: the joint distribution of generated tokens 2-4 matches
    the target's (chi-square; the exact probabilities from transformers' forward over the same layers, which
    differs from the decoder's only in float rounding)."""
    from sampling_checks import check_given_first

    from memspec_ros.runtime.speculative import SamplingConfig

    target = tiny_llama(vocab_size=5, hidden=256, layers=1, seed=12, init_range=0.1)
    draft = noisy_copy(target, 0.05, seed=13)
    apply_path(target, "int4")
    apply_path(draft, "int4")
    assert lean_forward_for(target).decoder is not None and lean_forward_for(draft).decoder is not None
    check_given_first(
        target, [1, 3], SamplingConfig(temperature=0.8, top_p=0.9),
        lambda seed: generate(target, [1, 3], draft, gamma=3, max_new_tokens=4, eos_token_ids=[],
                              sampling=SamplingConfig(seed=seed, temperature=0.8, top_p=0.9)), draws=1500)


@needs_decoder
def test_the_decoders_exp_is_within_a_few_ulp_of_the_true_one_and_silu_follows():
    """The decoder's softmax and SiLU take e^x from vector code (runtime/cpu_kernels.c: exp16/exp8) where libm's
    expf would stay scalar; checked against float64 over the softmax's range (scores minus their maximum, down to
    where e^x leaves float's normal range) and SiLU's, and the sum against the exact one."""
    library = cpu_kernels._library()
    x = torch.cat([torch.linspace(-87.0, 0.0, 100_003), torch.tensor([-1e-7, -0.0, 0.0])]).float()
    shift = 3.25
    v = (x + shift).contiguous()
    total = library.exp_shifted_sum(v.data_ptr(), v.numel(), shift)
    exact = torch.exp(x.double())
    ulp = torch.finfo(torch.float32).eps
    assert ((v.double() - exact).abs() / exact).max() < 4 * ulp  # a few ulp everywhere, tails included
    assert total == pytest.approx(float(exact.sum()), rel=1e-5)
    gate = torch.linspace(-80.0, 80.0, 4096).float()
    up = torch.randn(4096, generator=torch.Generator().manual_seed(0)).float()
    out = torch.empty(4096)
    library.silu_mul(gate.data_ptr(), up.data_ptr(), out.data_ptr(), 4096)
    exact = gate.double() * torch.sigmoid(gate.double()) * up.double()
    assert ((out.double() - exact).abs() <= 8 * ulp * exact.abs() + 1e-30).all()


@needs_decoder
def test_the_decoders_exp_keeps_a_nan_score_nan_as_libms_expf_does():
    """A NaN attention score (a KV row a diverged token left) must make the softmax's sum NaN on every CPU: the
    vector e^x's range clamp had turned NaN into e^-87 on AVX512/AVX2 only, so a diverged model kept giving finite
    logits there and NaN in the portable C and ATen. Every lane position is tried (the vector body and the tail)."""
    library = cpu_kernels._library()
    for at in (0, 5, 15, 16, 33):
        v = torch.zeros(37)
        v[at] = float("nan")
        v = v.contiguous()
        assert math.isnan(library.exp_shifted_sum(v.data_ptr(), v.numel(), 0.0)), at
        assert math.isnan(float(v[at])) and bool((v[torch.arange(37) != at] == 1.0).all())


@needs_compiler
def test_status_names_the_instruction_set_of_each_kernel():
    """Every kernel exists on every CPU with a compiler: AVX512 or AVX2 code where -march=native has it, portable C
    elsewhere; the status names which, and whether w4 takes the blocked layout."""
    assert STATUS.w4 and STATUS.i8 and STATUS.decoder, STATUS.reason
    parts = dict(part.split(" ", 1) for part in STATUS.isa.split(", "))
    assert set(parts) == {"w4", "i8", "attention"}
    # where Linux lets the process use AMX's tiles
    amx = {"AMX-INT8 (AVX512-VNNI up to 5 rows)", "AMX-INT8 (AVX512-VNNI for the last outputs)"}
    assert set(parts.values()) <= {"AVX512-VNNI", "AVX512", "AVX2", "portable C"} | amx
    assert STATUS.w4_blocked == (parts["w4"] in {"AVX512-VNNI"} | amx)
    assert STATUS.isa in STATUS.describe()


@needs_compiler
@pytest.mark.skipif(cpu_kernels.os.environ.get(cpu_kernels.ENV_SWITCH) == cpu_kernels.PORTABLE,
                    reason="this run is the portable one")
@pytest.mark.timeout(960)  # its subprocess may take the 900 s it is given, past pytest's default of 600
def test_the_portable_kernels_pass_the_same_tests(tmp_path):
    """The portable C (what an ARM robot compiles) is not what this machine runs by default, so the tests above run
    again with it: the i8 sums bit-equal to torch._int_mm, w4 against its reference, every verify row equal to a
    one-token step, the decoder against the lean forward, speculative greedy output equal to the target's own."""
    import os

    from conftest import STRICT_ENV

    # strict: a skip fails the rerun unless a fact of the machine no setup changes (a compiler without OpenMP) made it
    env = {**os.environ, cpu_kernels.ENV_SWITCH: cpu_kernels.PORTABLE, "MEMSPEC_CACHE_DIR": str(tmp_path),
           STRICT_ENV: "1"}
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__,
                           "-k", "not (sampled or portable_kernels or compiler or turned_off or once)"],
                          capture_output=True, text=True, timeout=900, env=env, cwd=os.path.dirname(__file__))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    assert " passed" in done.stdout and " failed" not in done.stdout
    code = "from memspec_ros.runtime import cpu_kernels as k; print(k.status().isa)"
    probe = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env)
    assert probe.stdout.strip() == "w4 portable C, i8 portable C, attention portable C", probe.stderr


@pytest.mark.skipif(cpu_kernels._load()[0] is None, reason=f"the kernels are not loaded here: {STATUS.reason}")
@pytest.mark.parametrize("dim", [24, 64])  # 24: rows of 48 and 20, not multiples of 16 (the dot's tail)
def test_the_ranking_head_in_one_call_computes_the_modules_probabilities(dim):
    from memspec_ros.runtime.predictor import HeadConfig, RankingHead, mean_rows

    torch.manual_seed(0)
    head = RankingHead(HeadConfig(encoder="target-hidden", drafts=list("abcde"), in_dim=2 * dim, hidden=20)).eval()
    with torch.no_grad():  # a LayerNorm that is not the identity
        head.net[0].weight.uniform_(0.5, 1.5)
        head.net[0].bias.normal_(0.0, 0.1)
    kernel = head.kernel()
    assert kernel is not None and head.kernel() is kernel  # built once
    prompt, stream = torch.randn(dim), torch.randn(30, dim)
    for parts in ([], [stream[:7]], [stream[:5], stream[5:9], stream[20:29]]):  # none: a prompt-only ranking
        expected = torch.softmax(head(torch.cat([prompt, mean_rows(parts, dim)])[None])[0], -1)
        got = torch.tensor(kernel(prompt, parts))
        assert torch.allclose(got, expected, rtol=1e-5, atol=1e-6), (got, expected)
    with pytest.raises(ValueError, match="contiguous CPU fp32"):
        kernel(prompt.double(), [])
    with pytest.raises(ValueError, match="contiguous CPU fp32"):
        kernel(prompt, [stream[:, :dim].t()])  # another width
    with pytest.raises(ValueError, match="recent parts"):  # one row given 1-D: the C read dim rows of it
        kernel(prompt, [stream[0]])


def test_the_kernel_wrappers_refuse_operands_they_would_read_past():
    """The C reads raw pointers: a weight of another width, a row length its loops do not step, or a packed
    layout of other groups was read out of bounds (or gave silently wrong numbers)."""
    with pytest.raises(ValueError, match="multiple of 16"):
        cpu_kernels.f32_matmul(torch.randn(1, 24), torch.randn(8, 24))
    with pytest.raises(ValueError, match="weight"):
        cpu_kernels.f32_matmul(torch.randn(1, 32), torch.randn(8, 16))
    with pytest.raises(ValueError, match="multiple of 64"):
        cpu_kernels.i8_matmul(torch.randn(1, 32), torch.zeros(16, 32, dtype=torch.int8),
                              torch.zeros(16, dtype=torch.int32), torch.ones(16))
    with pytest.raises(ValueError, match="weight"):
        cpu_kernels.i8_matmul(torch.randn(1, 64), torch.zeros(16, 128, dtype=torch.int8),
                              torch.zeros(16, dtype=torch.int32), torch.ones(16))
    packed, scale_min = cpu_kernels.pack_w4(torch.randint(0, 16, (16, 1, 32)), torch.ones(16, 1), torch.zeros(16, 1))
    with pytest.raises(ValueError, match="packed"):  # rows of two groups against weights packed for one
        cpu_kernels.w4_matmul(torch.randn(1, 64), packed, scale_min)
    with pytest.raises(ValueError, match="positive multiple of 64"):  # the AMX path divided by K / 64: SIGFPE
        cpu_kernels.i8_matmul(torch.randn(1, 0), torch.zeros(16, 0, dtype=torch.int8),
                              torch.zeros(16, dtype=torch.int32), torch.ones(16))


@pytest.mark.skipif(not cpu_kernels.status().w4, reason="no int4 kernel on this CPU")
def test_a_block_of_subnormal_inputs_quantizes_to_zeros_not_to_wrapped_int8():
    """A step of top/127 that is subnormal rounds down so far that x / step passed 127 and wrapped in int8: the
    product came out with the wrong sign (at 1e-41, but wrong)."""
    packed, scale_min = cpu_kernels.pack_w4(torch.full((16, 1, 32), 15), torch.ones(16, 1), torch.zeros(16, 1))
    y = cpu_kernels.w4_matmul(torch.full((1, 32), 190 * 2.0**-149), packed, scale_min)
    assert (y >= 0).all()


@needs_step
def test_the_step_kernel_refuses_kv_buffers_it_would_write_past():
    model = _step_model("int8", "plain")
    lean = lean_forward_for(model)
    with torch.inference_mode():
        forward_once(model, [5, 9, 33], KVState(), 1, "cpu", lean)  # builds the rotary table the step reads
    step, d = lean.step, lean.step.decoder
    layers = len(lean.layers)
    short = [(torch.zeros(1, d.kv_heads, 4, d.head_dim), torch.zeros(1, d.kv_heads, 4, d.head_dim))] * layers
    with pytest.raises(ValueError, match=r"cannot take positions 3\.\.4"):
        step([1, 2], 3, lean._rope, 1, short)
    other_heads = [(torch.zeros(1, d.kv_heads + 1, 8, d.head_dim),) * 2] * layers
    with pytest.raises(ValueError, match="KV buffer"):
        step([1], 0, lean._rope, 1, other_heads)
    # a later layer unlike the first: only its capacity was checked, and the C wrote past its end
    good = (torch.zeros(1, d.kv_heads, 8, d.head_dim), torch.zeros(1, d.kv_heads, 8, d.head_dim))
    for bad in (torch.zeros(1, d.kv_heads, 8, d.head_dim, dtype=torch.float16),
                torch.zeros(1, d.kv_heads, 1, d.head_dim).expand(1, d.kv_heads, 8, d.head_dim),
                torch.zeros(1, d.kv_heads - 1 or 2, 8, d.head_dim)):
        with pytest.raises(ValueError, match="layer 1's KV buffers"):
            step([1], 0, lean._rope, 1, [good, (bad, bad)] + [good] * (layers - 2))
    with pytest.raises(ValueError, match="layers of KV buffers"):
        step([1], 0, lean._rope, 1, short[:-1])


def test_a_cache_folder_made_under_umask_0000_is_reused(tmp_path, monkeypatch):
    """Under a umask of 0000 (some CI runners') the cache folder was made world-writable, so every later process
    refused it as not its own alone and compiled the kernels again in a temporary folder."""
    import os

    from memspec_ros.runtime import cpu_kernels

    built = []

    def fake_compile(out_dir, library, compiler, flags):
        library.write_bytes(b"not a real library")
        library.chmod(0o755)  # as _compile leaves it
        built.append(library)

    monkeypatch.setattr(cpu_kernels, "_compile", fake_compile)
    cache = tmp_path / "kernels"
    old = os.umask(0)
    try:
        first = cpu_kernels._build(cache)
        assert cpu_kernels._build(cache) == first and len(built) == 1 and first.parent == cache
    finally:
        os.umask(old)
    assert not cache.stat().st_mode & 0o022


@needs_compiler  # _build asks the compiler its version
def test_processes_building_together_compile_once_and_a_fallback_never_replaces_a_full_build(tmp_path, monkeypatch):
    """Processes started together each compiled; one slowed past a timeout published its fallback over the full
    build another had just published, and every later process ran the slower kernels. One compiles a key at a
    time now (a lock file beside the library), and the others take what it built."""
    import threading

    from memspec_ros.runtime import cpu_kernels

    built, inside, release = [], threading.Event(), threading.Event()

    def slow_compile(out_dir, library, compiler, flags, keep_fallback=False):
        inside.set()
        release.wait(30.0)
        library.write_bytes(b"the full build")
        library.chmod(0o755)
        built.append(library)

    monkeypatch.setattr(cpu_kernels, "_compile", slow_compile)
    cache = tmp_path / "kernels"
    got: list = []
    first = threading.Thread(target=lambda: got.append(cpu_kernels._build(cache)))
    second = threading.Thread(target=lambda: got.append(cpu_kernels._build(cache)))
    try:
        first.start()
        assert inside.wait(30.0)
        second.start()  # waits on the lock the first holds
        second.join(0.3)
        assert second.is_alive() and built == []
    finally:
        release.set()
        first.join(30.0)
        if second.is_alive() or second.ident is not None:
            second.join(30.0)
    assert len(built) == 1 and got == [built[0], built[0]] and built[0].read_bytes() == b"the full build"


def test_compile_for_a_fallbacks_retry_publishes_only_the_full_build(tmp_path, monkeypatch):
    """_compile itself: asked to retry a fallback (keep_fallback), a full build that times out again while the
    simpler one builds raises and leaves the library and no temporary file; without it, the fallback is
    published with its note (what a first build on a busy machine keeps)."""
    import subprocess

    from memspec_ros.runtime import cpu_kernels

    def run(command, timeout=None):  # the OpenMP attempt times out, the next one builds
        if cpu_kernels.OPENMP in command:
            return None
        Path(command[command.index("-o") + 1]).write_bytes(b"a new fallback")
        return subprocess.CompletedProcess(command, 0, "", "")

    monkeypatch.setattr(cpu_kernels, "_run_compiler", run)
    monkeypatch.setattr(cpu_kernels, "_open", lambda path: object())
    monkeypatch.setattr(cpu_kernels, "_close", lambda library: None)
    library = tmp_path / "memspec_kernels-k.so"
    library.write_bytes(b"the fallback")
    with pytest.raises(RuntimeError, match="the full build failed again"):
        cpu_kernels._compile(tmp_path, library, ["cc"], cpu_kernels.FLAGS, keep_fallback=True)
    assert library.read_bytes() == b"the fallback" and sorted(p.name for p in tmp_path.iterdir()) == [library.name]
    cpu_kernels._compile(tmp_path, library, ["cc"], cpu_kernels.FLAGS)
    assert library.read_bytes() == b"a new fallback" and "timed out" in cpu_kernels._fallback_note(library).read_text()


@needs_compiler  # _build asks the compiler its version
def test_a_fallbacks_retry_that_gets_only_a_fallback_again_keeps_it(tmp_path, monkeypatch):
    """A fallback kept after a timed-out full build is built again a day later; a retry that times out again
    replaced it with another fallback. It is replaced only by a full build now, and tried again a day later."""
    import os
    import time

    from memspec_ros.runtime import cpu_kernels

    attempts = []

    def compile_(out_dir, library, compiler, flags, keep_fallback=False):
        attempts.append(keep_fallback)
        if keep_fallback:
            raise RuntimeError("the full build failed again: timed out")
        library.write_bytes(b"a fallback")
        library.chmod(0o755)
        cpu_kernels._fallback_note(library).write_text("[-fopenmp] timed out after 120 s")

    monkeypatch.setattr(cpu_kernels, "_compile", compile_)
    library = cpu_kernels._build(tmp_path)
    note = cpu_kernels._fallback_note(library)
    day_ago = time.time() - cpu_kernels.FALLBACK_RETRY_S - 10
    os.utime(note, (day_ago, day_ago))
    assert cpu_kernels._build(tmp_path) == library and attempts == [False, True]
    assert library.read_bytes() == b"a fallback" and time.time() - note.stat().st_mtime < 60  # retried a day later
    assert cpu_kernels._build(tmp_path) == library and attempts == [False, True]  # not at every start


def test_a_cached_library_someone_else_could_have_written_is_never_loaded(tmp_path, monkeypatch):
    """The library's name is computed from public inputs (source, compiler, CPU): anyone who could write it in a
    shared or misconfigured cache folder ran code in the node when it loaded. One that is not this user's alone is
    left there, and this process builds its own."""
    from memspec_ros.runtime import cpu_kernels

    built = []

    def fake_compile(out_dir, library, compiler, flags):
        library.write_bytes(b"not a real library")
        library.chmod(0o700)
        built.append(library)

    monkeypatch.setattr(cpu_kernels, "_compile", fake_compile)
    cache = tmp_path / "kernels"
    first = cpu_kernels._build(cache)
    assert first.parent == cache and built == [first]
    assert cpu_kernels._build(cache) == first and len(built) == 1  # ours alone: reused
    first.chmod(0o766)  # writable by others: someone's could be under this name
    private = cpu_kernels._build(cache)
    assert private.parent != cache and private.name == first.name and len(built) == 2
    first.chmod(0o700)
    planted = tmp_path / "planted.so"
    planted.write_bytes(b"someone's")
    first.unlink()
    first.symlink_to(planted)  # a link to a file elsewhere
    assert cpu_kernels._build(cache).parent != cache and len(built) == 3
    first.unlink()
    cache.chmod(0o777)  # a folder every user can write to: no library is built there to be swapped before it loads
    assert cpu_kernels._build(cache).parent != cache and len(built) == 4 and not first.exists()
    cache.chmod(0o755)


@needs_step
def test_the_step_kernel_writes_fp32_whatever_torchs_default_dtype_is_meanwhile():
    """Its output buffers took torch's process-wide default dtype, which transformers' from_pretrained changes
    while another thread loads a model: the C code wrote fp32 through them (past a 16-bit buffer's end; a 64-bit
    one, as here, gave numbers made of two fp32s each)."""
    model = _step_model("int8", "plain")
    lean = lean_forward_for(model)
    assert lean.step is not None, lean.step_reason
    prompt, rows = [5, 9, 33, 2, 71, 40, 8], [7, 21, 9]
    expected = _prefill_and_verify(model, lean, prompt, rows)
    before = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        got = _prefill_and_verify(model, lean, prompt, rows)
    finally:
        torch.set_default_dtype(before)
    assert got.dtype == torch.float32 and torch.equal(got, expected)


@needs_compiler
def test_a_library_that_builds_but_does_not_load_falls_back_to_the_next_build(tmp_path):
    """A build that compiles but cannot load here (an OpenMP runtime the dynamic loader cannot find) was deleted
    and built again with the same flags, which failed the same way: the kernels were off on every start."""
    cc = tmp_path / "cc-openmp-unloadable"
    # the OpenMP build compiled without -fopenmp (a compiler without OpenMP failed it outright, so "built but does
    # not load" never came), then its output spoilt
    cc.write_text('#!/bin/sh\nomp=0; out=; prev=\nfor a in "$@"; do [ "$a" = "-fopenmp" ] && omp=1\n'
                  '  [ "$prev" = "-o" ] && out="$a"; prev="$a"; done\n'
                  'for a in "$@"; do shift; [ "$a" = "-fopenmp" ] || set -- "$@" "$a"; done\n'
                  + _CC_SH + ' "$@" || exit $?\n'
                  '[ "$omp" = 1 ] && printf "not an ELF file" >"$out"\nexit 0\n')
    cc.chmod(0o755)
    out = _status_in_subprocess({"CC": str(cc), "MEMSPEC_CACHE_DIR": str(tmp_path / "cache"),
                                 cpu_kernels.ENV_SWITCH: "1"})
    assert "| True |" in out and "built but does not load" in out, out


@needs_compiler
def test_a_library_the_linker_left_group_writable_is_still_reused(tmp_path, monkeypatch):
    """gold, lld and mold keep umask 002's group write bit on their output; such a file is never loaded from the
    cache (someone else could have written it), so every process compiled its own library."""
    cc = tmp_path / "cc-group-writable"
    cc.write_text('#!/bin/sh\nout=; prev=\nfor a in "$@"; do [ "$prev" = "-o" ] && out="$a"; prev="$a"; done\n'
                  + _CC_SH + ' "$@" || exit $?\n[ -z "$out" ] || chmod 775 "$out"\n')
    cc.chmod(0o755)
    monkeypatch.setenv("CC", str(cc))
    first = cpu_kernels._build(tmp_path / "kernels")
    assert first.parent == tmp_path / "kernels" and first.stat().st_mode & 0o777 == 0o755
    assert cpu_kernels._build(tmp_path / "kernels") == first


def test_a_fallback_due_for_its_retry_stays_when_no_build_succeeds(tmp_path, monkeypatch):
    """The daily retry removed the fallback before building: a build that failed again (a machine busy again, a
    compiler gone) left no library, and every later process sat through the timeouts. It stays, tried again a day
    later; a build that succeeds replaces it."""
    library = tmp_path / "memspec_kernels-k.so"
    library.write_bytes(b"the fallback")
    library.chmod(0o755)
    note = cpu_kernels._fallback_note(library)
    note.write_text("[-fopenmp] timed out after 120 s")
    long_ago = time.time() - cpu_kernels.FALLBACK_RETRY_S - 1
    os.utime(note, (long_ago, long_ago))
    monkeypatch.setattr(cpu_kernels, "_compiler", lambda: ["cc"])
    monkeypatch.setattr(cpu_kernels.subprocess, "run", lambda *a, **k: subprocess.CompletedProcess(a, 0, "cc 1", ""))
    monkeypatch.setattr(cpu_kernels, "_native_macros", lambda compiler: "")
    monkeypatch.setattr(cpu_kernels.hashlib, "sha256", lambda data: type("H", (), {"hexdigest": lambda self: "k"})())

    def fails(out_dir, lib, compiler, flags, keep_fallback=False):
        raise RuntimeError("cc failed: busy again")

    monkeypatch.setattr(cpu_kernels, "_compile", fails)
    assert cpu_kernels._build(tmp_path) == library and library.read_bytes() == b"the fallback"
    assert not cpu_kernels._fallback_to_retry(library)  # the next try a day from now


@pytest.mark.skipif(cpu_kernels._load()[0] is None, reason=f"the kernels are not loaded here: {STATUS.reason}")
def test_the_kernel_library_is_loaded_from_the_file_that_was_checked(tmp_path):
    """The library was checked (_ours_alone) and then dlopen'd by its path, which dlopen looked up again: someone
    who could rename entries on the way could swap it in between. It is opened without following a link, checked
    on the open file and loaded through that descriptor, which stays open while it is loaded: dlopen finds a library
    by its name first, so a descriptor number freed and taken again handed back the library loaded before."""
    import shutil

    loaded = cpu_kernels._library()  # built (or found) in this run's cache, and loaded through its descriptor
    copy = tmp_path / "kernels.so"
    shutil.copyfile(cpu_kernels.status().library, copy)
    copy.chmod(0o755)
    library = cpu_kernels._open(copy)
    try:
        assert library._handle != loaded._handle and library.memspec_kernel_features() >= 0
        maps = Path("/proc/self/maps").read_text()
        assert str(copy) in maps  # the copy itself is mapped, not the library loaded before
    finally:
        cpu_kernels._close(library)


def test_a_kernel_library_behind_a_link_or_writable_by_others_is_not_loaded(tmp_path):
    """Checked on the open file before dlopen: a link is refused (never followed), and a file others can write."""
    import errno

    library = tmp_path / "kernels.so"
    library.write_bytes(b"not loaded: refused before dlopen")
    library.chmod(0o755)  # the link's target passes every other check: only the link itself can be refused
    link = tmp_path / "link.so"
    link.symlink_to(library)
    with pytest.raises(OSError) as refused:
        cpu_kernels._open(link)
    assert refused.value.errno == errno.ELOOP  # not followed (a followed one fails later, in dlopen, errno None)
    library.chmod(0o775 | 0o002)
    with pytest.raises(OSError, match="not this user's alone"):
        cpu_kernels._open(library)


def test_the_kernels_are_compiled_from_the_bytes_their_cache_key_hashed(tmp_path, monkeypatch):
    """The key hashed the C source as read at the start of _build, but the compiler read the file by its path later,
    after up to LOCK_WAIT_S waiting for another process's lock: a checkout changed meanwhile published a library of
    other source (other struct layouts) under the old source's key."""
    import subprocess

    source = tmp_path / "cpu_kernels.c"
    source.write_text("int hashed_version;\n")
    monkeypatch.setattr(cpu_kernels, "SOURCE", source)
    cpu_kernels._source_text.cache_clear()
    try:
        assert cpu_kernels._source_text() == "int hashed_version;\n"  # what the key hashes
        source.write_text("int changed_meanwhile;\n")  # a git checkout while the lock was waited for
        compiled = []

        def compiler(command, timeout=None):
            compiled.append(Path(command[command.index("-lm") - 1]).read_text())
            return subprocess.CompletedProcess(command, 1, "", "stop here")

        monkeypatch.setattr(cpu_kernels, "_run_compiler", compiler)
        with pytest.raises(RuntimeError, match="stop here"):
            cpu_kernels._compile(tmp_path, tmp_path / "lib.so", ["cc"], ("-O2",))
        # (behind a #line naming cpu_kernels.c: the compiler's messages point at the file, not the gone copy)
        assert compiled and set(compiled) == {f'#line 1 "{source}"\nint hashed_version;\n'}
        assert sorted(p.name for p in tmp_path.iterdir()) == ["cpu_kernels.c"]  # its copy went with the attempt
    finally:
        cpu_kernels._source_text.cache_clear()


@needs_compiler
def test_the_decoder_refuses_norm_weights_it_would_read_past_or_off_the_cpu():
    """The C decoder reads hidden-size floats of host memory from every RMSNorm weight: one of another length was
    read past its end; a zero kv-head count divided by zero in C."""
    import dataclasses

    from memspec_ros.runtime.draft_forward import LeanLlamaForward

    lean = LeanLlamaForward(tiny_llama(hidden=256, layers=1, seed=3))  # 4 heads of 64, 2 kv heads
    dims = (256, 4, 2, 64, 512)
    assert isinstance(cpu_kernels.Decoder.build(lean.layers, dims, 1e-5), cpu_kernels.Decoder)
    short = [dataclasses.replace(lean.layers[0], attn_norm=lean.layers[0].attn_norm[:128].contiguous())]
    assert "an RMSNorm weight of 128 values" in cpu_kernels.Decoder.build(short, dims, 1e-5)
    assert "shapes the kernel does not take" in cpu_kernels.Decoder.build(lean.layers, (256, 4, 0, 64, 512), 1e-5)
