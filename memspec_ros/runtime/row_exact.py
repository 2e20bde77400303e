"""A verify's rows computed exactly as one-token steps, for a target on transformers' forward.

Speculative decoding is lossless only if the target scores each of a verify's gamma + 1 rows with
the very numbers its one-token step for that position gives: a near tie otherwise turns into another
greedy token. The engine's lean Llama forward and its CPU forward paths are built that way. A target
that runs through transformers' forward instead (a GPTQ checkpoint; an architecture other than
Llama) batches the rows in its matmuls and its attention, whose last digits then differ.
:func:`prepare_for_engine` makes such a model row-exact: attention row by row over each row's own
prefix, and every linear whose kernel gives a multi-row call other digits than one-row calls (probed
per shape on this machine) run row by row for calls of 2 to MAX_VERIFY_ROWS rows (a verify's size, and
so a prefill that short too); longer prefills stay batched.
"""

from __future__ import annotations

import logging

import torch

from .forward_paths import MAX_VERIFY_ROWS, ROW_PROBES, blas_rows_exact, rows_agree  # gamma + 1 rows, up to 9

log = logging.getLogger(__name__)


def _probed_linears(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module, int, int]]:
    """The linear layers whose kernels are not torch's plain F.linear: GPT-QModel's, and transformers' Conv1D
    (GPT-2's addmm): (name, module, in_features, out_features)."""
    found = []
    for name, module in model.named_modules():
        if type(module).__module__.startswith("gptqmodel") and hasattr(module, "in_features") \
                and hasattr(module, "out_features"):
            found.append((name, module, module.in_features, module.out_features))
        elif type(module).__name__ == "Conv1D" and hasattr(module, "nf") and module.weight.dim() == 2:
            found.append((name, module, module.weight.shape[0], module.nf))
    return found


def _one_row_at_a_time(module: torch.nn.Module) -> None:
    """Make ``module`` compute a call of 2..MAX_VERIFY_ROWS rows one row at a time (longer calls, prefills, stay
    batched). Once only: a module made so already is left as it is (prepare_for_engine called twice wrapped the
    plain linears again, since their probe reads F.linear, not the module)."""
    if getattr(module, "_memspec_rowwise", False):
        return
    forward = module.forward

    def rowwise(x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1])
        if not 1 < rows.shape[0] <= MAX_VERIFY_ROWS:
            return forward(x)
        return torch.cat([forward(rows[i:i + 1]) for i in range(rows.shape[0])]).reshape(*x.shape[:-1], -1)

    module.forward = rowwise
    module._memspec_rowwise = True


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
    """Make a model on transformers' forward (a GPTQ target, or any architecture the lean forward does not
    take) compute a verify's rows exactly as one-token steps, so that speculative decoding reproduces
    its own greedy output; returns what was done.

    Measured on SmolLM2-135M with bf16 activations (GPT-QModel's fused AVX512 kernel):
    transformers' SDPA attention over a cached prefix gives a 5-row verify other last digits than
    five one-row steps (29 of 36 probes), and the engine's output then differed from the target's
    own on 8 of 12 held-out prompts. So the model gets ``memspec_rowwise_sdpa``, whatever it had: SDPA,
    except that a verify's rows attend one by one to their own prefix, each the very call its
    one-token step makes (0 of 36 probes differ; the engine's lean path does the same). GPT-QModel's
    linears and the plain ones left (the head) are probed per shape with 2..MAX_VERIFY_ROWS rows
    against one row at a time, and a shape whose kernel differs runs such calls row by row (as the
    engine's forward paths do, runtime/forward_paths.py).
    """
    done = {"attention": getattr(model.config, "_attn_implementation", None), "rows_one_by_one": []}
    if done["attention"] != ROWWISE_SDPA:
        # every implementation, eager included: eager's Q.K^T and attention.V take a verify's rows in one matmul,
        # whose last digits differ from one-row calls as SDPA's do (1e-6 in fp32 on a tiny Llama)
        _register_rowwise_sdpa()
        try:
            model.set_attn_implementation(ROWWISE_SDPA)
        except (ValueError, ImportError) as exc:  # a model that cannot take SDPA: eager, and say it is not exact
            log.warning("attention stays batched over a verify's rows (%s): greedy output may differ from the"
                        " target's own in a near tie", exc)
            model.set_attn_implementation("eager")
    done["attention"] = model.config._attn_implementation
    first_parameter = next(model.parameters())
    dtype, device = first_parameter.dtype, first_parameter.device  # a GPTQ model is placed on its device at load
    if dtype not in (torch.float16, torch.bfloat16):
        dtype = torch.float32
    by_shape: dict[tuple, list[tuple[str, torch.nn.Module]]] = {}
    for name, module, n_in, n_out in _probed_linears(model):
        by_shape.setdefault((type(module).__name__, n_in, n_out), []).append((name, module))
    with torch.inference_mode():
        for (_, n_in, _), modules in by_shape.items():
            first = modules[0][1]
            # ROW_PROBES whatever the model's dtype: a quantized kernel (GPT-QModel's) may round inside to bf16
            # in an fp32 model, where one probe misses most of another summation order (check_rows)
            if not rows_agree(lambda x, first=first: first(x.to(device, dtype)[None])[0].float().cpu(), n_in,
                              probes=ROW_PROBES):
                for name, module in modules:
                    if not getattr(module, "_memspec_rowwise", False):
                        _one_row_at_a_time(module)
                        done["rows_one_by_one"].append(name)
    # every plain linear left (the head, which a GPTQ checkpoint usually keeps unquantized: fp32 and fp16 GEMMs over
    # 5 rows differ from 1-row calls on this CPU), by the lean forward's own probe; weights on the meta device hold
    # no numbers to probe
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) and module.weight.device.type != "meta" and not getattr(
                module, "_memspec_rowwise", False) and not blas_rows_exact(module):
            _one_row_at_a_time(module)
            done["rows_one_by_one"].append(name)
    return done


def verify_gap(model: torch.nn.Module, vocab_size: int, prefix: int = 12, lean=None) -> float:
    """The largest difference between a verify's rows and the one-token steps for the same positions, after a
    cached ``prefix``, through the engine's own forward (``lean``: its lean forward, as the engine runs such a
    target; 0.0: bit for bit, as losslessness needs). What :func:`prepare_for_engine` cannot make row-exact shows
    here: a mixture-of-experts layer batches the tokens routed to each expert, whatever its linears do."""
    from .speculative import KVState, forward_once

    device = next(model.parameters()).device
    ids = torch.randint(0, max(vocab_size, 1), (prefix + MAX_VERIFY_ROWS,),
                        generator=torch.Generator().manual_seed(3)).tolist()
    batched, single = KVState(), KVState()
    with torch.inference_mode():
        forward_once(model, ids[:prefix], batched, 1, device, lean)
        forward_once(model, ids[:prefix], single, 1, device, lean)
        verify = forward_once(model, ids[prefix:], batched, MAX_VERIFY_ROWS, device, lean)
        steps = torch.stack([forward_once(model, [t], single, 1, device, lean)[-1] for t in ids[prefix:]])
    return float((verify - steps).abs().max())
