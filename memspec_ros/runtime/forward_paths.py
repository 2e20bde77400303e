"""Forward paths: how a model's linear layers store weights and multiply on a CPU.

On a 2-core EPYC a 135 M-parameter target decodes at ~36 ms per token in fp32, and
almost all of it is streaming weights from memory through ``nn.Linear``: the
forward is memory-bound, so fewer bytes per weight is the lever (llama.cpp's
Q4_1 file decodes the same model 6x faster). Each path below replaces every
``nn.Linear`` of a model with a module that keeps its weights in a smaller form
and multiplies with a kernel ATen already ships for CPUs:

``fp32``  the weights as loaded.
``bf16``  bf16 weights, bf16 inputs to the matmul, its products rounded to bf16 and
          returned as fp32: half the bytes.
``int8``  int8 weights per output channel; the input quantized per *row* at run
          time and multiplied with exact int32 accumulation (``torch._int_mm``, or
          the engine's kernel, which gives the same integers on every CPU):
          the scheme of torchao's dynamic int8 activation/int8 weight config.
``int4``  4-bit weights in groups of 32 with a scale and a minimum per group
          (the engine's kernel: the inputs quantized to int8 per block of 32;
          without it ATen's ``_weight_int4pack_mm_for_cpu``, bf16 inputs). This is Q4_1's grid, so
          for a Q4_1 GGUF such as the bundled target it holds the file's own
          4-bit weights exactly (only the per-group scale and minimum are rounded
          to bf16, the kernel's format). The LM head stays int8: at 4 bits the
          tied embedding loses more than the layers do, and the GGUF keeps it
          at 8 bits too.

Speculative decoding is lossless relative to the model it runs, so the verify
of γ+1 tokens must compute, row for row, what one-token decoding computes. int8
does by its arithmetic (per-row input scales, exact integer sums). For the int4
and bf16 kernels that is a property of the kernel on this CPU, so every module
is checked once per shape at load (:func:`check_rows`: 2..9 rows at once against
each row alone, bit for bit) and runs its rows one at a time where the check
fails. Attention is made row-exact in the lean forward (runtime/draft_forward.py).
Plain fp32 matmuls (a BLAS sgemm) are not row-exact: they sum a row differently
with others. Where the engine's kernels compiled, the lean forward runs the fp32
path's layers on their f32 kernel instead (:class:`Float32Linear`: the same
weights, each row summed as alone), so fp32 is row-exact by construction too, and
a verify costs about one step; elsewhere fp32 stays as transformers runs it.

The token embedding is a lookup, not a matmul, but it is the largest tensor of a small model (the
bundled target's 49,152 x 576 table is 113 MB in fp32, more than its 30 int4 layers). A GGUF holds
it as Q8_0 (int8 values, one fp16 scale per 32), so on every path but fp32 a table that lies exactly
on that grid is kept in that form (:class:`Q8Embedding`, 30 MB): its rows come back bit for bit, so
the model computes what it computed before. A table off that grid whose every value fp16 holds exactly (a
model loaded from an fp16 file, as the bundled drafts are) is kept in fp16 (:class:`F16Embedding`, half the
bytes, rows widened bit for bit); any other table (a model trained and stored in fp32) stays.

The engine's own kernels (runtime/cpu_kernels.py, compiled on the machine that runs them: AVX512, AVX2
or portable C) take the int4 and int8 layers; a model whose layers all run on them also runs its
whole decoder in one C call (runtime/draft_forward.py). :class:`PathReport` says
which kernels a model got.

Layers whose shapes a kernel cannot take (int4 needs in_features % 32 == 0 and
out_features % 16 == 0) keep fp32 and are counted in :class:`PathReport`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from . import cpu_kernels

PATHS = ("fp32", "bf16", "int8", "int4")
INT4_GROUP = 32  # Q4_1's block size: one scale and one minimum per 32 weights
INT4_LEVELS = 15  # 4 bits: 0..15
I8_KERNEL_BLOCK = 64  # the kernels' step along the input (the VNNI kernel's bytes per load; AVX2 takes 32)
INT8_MAX = 127  # symmetric int8: -127..127 (keeps -128 unused so the grid is symmetric)
_TINY = 1e-12  # guards an all-zero row or group against a zero scale


class ForwardPathError(ValueError):
    """A forward path that does not exist, or that this machine or model cannot run."""


class KeptForm(torch.nn.Module):
    """A module whose buffers are in the form its kernel reads (dtype, CPU memory), by pointer: a cast or a move of
    the model after its conversion (``model.half()``, ``.to("cuda")``) is refused, with the module as it was. Cast,
    an int8 layer's fp32 scales read as 16-bit made the kernel read past them; moved, the kernels read device memory
    as host memory."""

    def check_change(self, fn) -> None:
        """ForwardPathError where ``fn`` (what Module.to, .half, .cuda apply to each tensor) would change one."""
        for name, tensor in [*self.named_parameters(recurse=False), *self.named_buffers(recurse=False)]:
            probe = fn(torch.empty(0, dtype=tensor.dtype, device=tensor.device))
            if (probe.dtype, probe.device) != (tensor.dtype, tensor.device):
                raise ForwardPathError(
                    f"{type(self).__name__}.{name} is kept as {tensor.dtype} on {tensor.device}, the form its kernel"
                    f" reads: a model converted to a forward path is not cast or moved ({probe.dtype} on"
                    f" {probe.device} asked); load it again with the dtype, device and quantization wanted")

    def _apply(self, fn, recurse: bool = True):
        self.check_change(fn)
        return super()._apply(fn, recurse)


_CHECKED_CLASSES: dict[type, type] = {}


def _checked_class(cls: type) -> type:
    """``cls`` whose _apply checks every KeptForm before any tensor is changed (a module's own check came after the
    modules before it were cast: the model was left half cast), under the same name and module (save_pretrained
    records the class name). A class, not a method bound on the instance: that made every converted model a
    reference cycle, freed only by a full garbage collection (an evicted draft stayed in memory past the byte
    budget, its KV caches counted)."""
    if cls in _CHECKED_CLASSES.values():
        return cls
    if cls not in _CHECKED_CLASSES:
        def _apply(self, fn, recurse: bool = True):
            for module in self.modules():
                if isinstance(module, KeptForm):
                    module.check_change(fn)
            return cls._apply(self, fn, recurse)

        _CHECKED_CLASSES[cls] = type(cls.__name__, (cls,), {"_apply": _apply, "__module__": cls.__module__,
                                                            "__qualname__": cls.__qualname__})
    return _CHECKED_CLASSES[cls]


class FastLinear(KeptForm):
    """A linear layer in a compact format. ``rows_at_once`` is False where the kernel was seen to compute
    a row differently when other rows come with it: then rows go through one at a time."""

    in_features: int
    out_features: int
    bias: torch.nn.Parameter | None
    rows_at_once: bool = True

    def _matmul(self, rows: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        # a verify's rows one at a time (each the call a one-token step makes); a prefill's stay together: its
        # rows are no step's (a prompt reused from a cache is only ever the C decoder's, prompt_cache.py), and one
        # call per row made a 500-token prompt 500 matmuls per layer
        if 1 < rows.shape[0] <= MAX_VERIFY_ROWS and not self.rows_at_once:
            y = torch.cat([self._matmul(rows[i : i + 1]) for i in range(rows.shape[0])])
        else:
            y = self._matmul(rows)
        y = y.reshape(*x.shape[:-1], self.out_features).to(x.dtype)
        return y if self.bias is None else y + self.bias


class Bf16Linear(FastLinear):
    """bf16 weights; fp32 in, bf16 products (ATen's CPU bf16 matmul has no fp32 output), fp32 out."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.register_buffer("weight", weight.detach().to(torch.bfloat16).contiguous())
        self.bias = None if bias is None else torch.nn.Parameter(bias.detach().float(), requires_grad=False)
        self.in_features, self.out_features = weight.shape[1], weight.shape[0]

    def _matmul(self, rows: torch.Tensor) -> torch.Tensor:
        return F.linear(rows.to(torch.bfloat16), self.weight)

    @classmethod
    def concat(cls, parts: list[Bf16Linear]) -> Bf16Linear:
        fused = cls.__new__(cls)
        torch.nn.Module.__init__(fused)
        fused.register_buffer("weight", torch.cat([p.weight for p in parts]))
        fused.bias = _concat_bias(parts)
        fused.in_features, fused.out_features = parts[0].in_features, sum(p.out_features for p in parts)
        return fused


class Int8Linear(FastLinear):
    """int8 weights per output channel, inputs quantized per row, exact int32 accumulation.

    Two kernels compute the same numbers (integer sums are exact in any order): the engine's kernel
    (runtime/cpu_kernels.c: VNNI, AVX2 or portable C; weights stored [out, in]) where it compiled, else
    ``torch._int_mm``
    (weights stored [in, out], the layout it multiplies without a copy)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        w = weight.detach().float()
        scale = w.abs().amax(dim=1).clamp(min=_TINY) / INT8_MAX
        self._store(torch.round(w / scale[:, None]).to(torch.int8), scale)
        self.bias = None if bias is None else torch.nn.Parameter(bias.detach().float(), requires_grad=False)
        self.in_features, self.out_features = w.shape[1], w.shape[0]

    def _store(self, q: torch.Tensor, scale: torch.Tensor) -> None:
        """Keep the [out, in] int8 weights in the layout of the kernel that will multiply them."""
        self.own_kernel = cpu_kernels.status().i8 and q.shape[1] > 0 and q.shape[1] % I8_KERNEL_BLOCK == 0
        if self.own_kernel:
            self.register_buffer("qweight", q.contiguous())
            self.register_buffer("bias128", (128 * q.sum(dim=1, dtype=torch.int32)).to(torch.int32))
        else:
            self.register_buffer("qweight_t", q.t().contiguous())
        self.register_buffer("scale", scale.contiguous())

    def int8_weight(self) -> torch.Tensor:
        """The [out, in] int8 weights, whichever layout holds them."""
        return self.qweight if self.own_kernel else self.qweight_t.t()

    def _matmul(self, rows: torch.Tensor) -> torch.Tensor:
        if self.own_kernel:
            return cpu_kernels.i8_matmul(rows, self.qweight, self.bias128, self.scale, check=False)  # built here
        rows = rows.float()
        row_scale = rows.abs().amax(dim=1, keepdim=True).clamp(min=_TINY) / INT8_MAX
        acc = torch._int_mm(torch.round(rows / row_scale).to(torch.int8), self.qweight_t)
        return acc.float() * row_scale * self.scale

    @classmethod
    def concat(cls, parts: list[Int8Linear]) -> Int8Linear:
        fused = cls.__new__(cls)
        torch.nn.Module.__init__(fused)
        fused._store(torch.cat([p.int8_weight() for p in parts]), torch.cat([p.scale for p in parts]))
        fused.bias = _concat_bias(parts)
        fused.in_features, fused.out_features = parts[0].in_features, sum(p.out_features for p in parts)
        return fused


class Int4Linear(FastLinear):
    """4-bit weights, groups of 32 along the input with a bf16 scale and minimum each (Q4_1's grid).

    Multiplied by the engine's kernel (runtime/cpu_kernels.c) wherever it compiled: the rows are quantized to
    int8 per block of 32 and each block's sum is an exact integer (AVX512-VNNI or AMX, AVX2, portable C).
    Without the kernels, ATen's ``_weight_int4pack_mm_for_cpu`` (bf16 inputs and products). Each rounds
    differently, so a model's numbers depend on which ran: :func:`apply_path` reports it, and every
    forward of one model uses the same one."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        w = weight.detach().float()
        out_features, in_features = w.shape
        groups = w.view(out_features, in_features // INT4_GROUP, INT4_GROUP)
        low, high = groups.amin(-1), groups.amax(-1)
        scale = ((high - low) / INT4_LEVELS).clamp(min=_TINY)
        q = torch.round((groups - low[..., None]) / scale[..., None]).clamp(0, INT4_LEVELS).to(torch.int32)
        self.own_kernel = cpu_kernels.status().w4
        if self.own_kernel:
            packed, scale_min = cpu_kernels.pack_w4(q, scale, low)
            self.register_buffer("packed", packed)
            self.register_buffer("scale_min", scale_min)
        else:
            self.register_buffer(
                "packed", torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.view(out_features, in_features), 1)
            )
            # the kernel dequantizes (q - 8) * scale + zero, so zero is the minimum plus 8 steps
            zero = low + 8 * scale
            self.register_buffer(
                "scale_zero", torch.stack([scale, zero], -1).transpose(0, 1).contiguous().to(torch.bfloat16)
            )
        self.bias = None if bias is None else torch.nn.Parameter(bias.detach().float(), requires_grad=False)
        self.in_features, self.out_features = in_features, out_features

    def _matmul(self, rows: torch.Tensor) -> torch.Tensor:
        if self.own_kernel:
            return cpu_kernels.w4_matmul(rows, self.packed, self.scale_min, check=False)  # built here by pack_w4
        return torch.ops.aten._weight_int4pack_mm_for_cpu(
            rows.to(torch.bfloat16), self.packed, INT4_GROUP, self.scale_zero
        )

    @classmethod
    def concat(cls, parts: list[Int4Linear]) -> Int4Linear:
        fused = cls.__new__(cls)
        torch.nn.Module.__init__(fused)
        fused.own_kernel = parts[0].own_kernel
        fused.register_buffer("packed", torch.cat([p.packed for p in parts]))  # one packed row per output
        if fused.own_kernel:
            fused.register_buffer("scale_min", torch.cat([p.scale_min for p in parts]))
        else:
            fused.register_buffer("scale_zero", torch.cat([p.scale_zero for p in parts], dim=1).contiguous())
        fused.bias = _concat_bias(parts)
        fused.in_features, fused.out_features = parts[0].in_features, sum(p.out_features for p in parts)
        return fused

    @staticmethod
    def fits(in_features: int, out_features: int) -> bool:
        return in_features % INT4_GROUP == 0 and out_features % 16 == 0


FAST_LINEARS = (Bf16Linear, Int8Linear, Int4Linear)
F32_KERNEL_BLOCK = 16  # the f32 kernel's step along the input (one AVX512 register)


class Float32Linear(FastLinear):
    """A plain fp32 ``nn.Linear``'s own weights (the same tensor, not a copy) on the engine's f32 kernel.

    Not a path of its own: the lean forward runs the fp32 path's layers with it. A BLAS sgemm sums a row
    in an order that depends on the rows beside it and packs the whole weight matrix for a few rows (a
    5-row verify of the bundled target's fp32 head cost 2.1x one row); the kernel reads the weights once
    per call and sums each row as it sums a row alone, so a verify costs about one step and its rows are
    exact by construction. Its sums are in another order than transformers' forward, so greedy tokens may
    differ from transformers' generate at a near-tie, as on the quantized paths (``same_as_transformers``)."""

    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__()
        self.register_buffer("weight", weight.detach(), persistent=False)
        self.bias = None
        self.out_features, self.in_features = weight.shape
        self.own_kernel = True

    def _matmul(self, rows: torch.Tensor) -> torch.Tensor:
        return cpu_kernels.f32_matmul(rows, self.weight, check=False)  # its own contiguous fp32 weight


def f32_kernel_linear(parts: list[torch.nn.Module]) -> Float32Linear | None:
    """Plain fp32 linears (q/k/v, gate/up side by side; or one) on the f32 kernel, or None where it does not
    apply (no kernel here, a bias, another dtype or device, an input width off its step).

    Parts are fused *in place*: their weights are copied once into one tensor and each part's parameter becomes
    a view of its rows, so the model (and transformers' forward of it) keeps working on the same memory and
    the fused layer costs no second copy of the weights."""
    if not cpu_kernels.status().f32 or any(type(p) is not torch.nn.Linear or p.bias is not None for p in parts):
        return None
    weights = [p.weight for p in parts]
    if any(w.dtype != torch.float32 or w.device.type != "cpu" or w.shape[1] != weights[0].shape[1]
           for w in weights) or weights[0].shape[1] % F32_KERNEL_BLOCK:
        return None
    if len(parts) == 1:
        return Float32Linear(weights[0].contiguous()) if weights[0].is_contiguous() else None
    fused = torch.cat([w.detach() for w in weights])
    row = 0
    with torch.no_grad():
        for part in parts:
            part.weight.data = fused[row : row + part.out_features]
            row += part.out_features
    return Float32Linear(fused)
Q8_BLOCK = 32  # GGUF's Q8_0: one fp16 scale per 32 int8 values


def check_ids(ids: torch.Tensor, rows: int) -> None:
    """torch.nn.Embedding's IndexError for an id outside [0, rows): a tensor indexed by -1 gives the LAST row
    silently, and the compact tables below index theirs (the C forward checks its rows the same way)."""
    if ids.numel():
        low, high = (int(v) for v in torch.aminmax(ids))
        if low < 0 or high >= rows:
            raise IndexError(f"token id out of range: the embedding has {rows} rows, got ids from {low} to {high}")


class Q8Embedding(KeptForm):
    """An embedding table held as a GGUF's Q8_0 holds it: int8 values and one fp16 scale per block of 32.
    Built only by :meth:`exact_from`, which refuses a table its rows would not reproduce bit for bit."""

    def __init__(self, values: torch.Tensor, scales: torch.Tensor) -> None:
        super().__init__()
        self.register_buffer("values", values)  # [rows, dim] int8
        self.register_buffer("scales", scales)  # [rows, dim // Q8_BLOCK] fp16
        self.num_embeddings, self.embedding_dim = values.shape

    @classmethod
    def exact_from(cls, weight: torch.Tensor) -> Q8Embedding | None:
        """The Q8_0 form of ``weight``, or None when ``weight`` is not exactly on that grid."""
        w = weight.detach()
        rows, dim = w.shape
        if w.dtype != torch.float32 or dim % Q8_BLOCK:
            return None
        blocks = w.view(rows, dim // Q8_BLOCK, Q8_BLOCK)
        values = torch.empty(rows, dim, dtype=torch.int8)
        scales = torch.empty(rows, dim // Q8_BLOCK, dtype=torch.float16)
        # quantized and checked in slices of rows: no second full fp32 table at once (the bundled target's is 113 MB)
        for start in range(0, rows, 4096):
            part = blocks[start : start + 4096]
            # Q8_0's quantizer maps each block's largest magnitude to 127, so that value over 127 is the scale
            scale = part.abs().amax(-1) / INT8_MAX
            if not torch.equal(scale.half().float(), scale):
                return None
            q = torch.round(part / scale.clamp(min=_TINY)[..., None]).clamp(-INT8_MAX, INT8_MAX)
            values[start : start + 4096], scales[start : start + 4096] = q.to(torch.int8).view(-1, dim), scale.half()
        compact = cls(values, scales)
        for start in range(0, rows, 4096):
            ids = torch.arange(start, min(start + 4096, rows))
            if not torch.equal(compact(ids), w[start : start + 4096]):
                return None
        return compact

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        check_ids(ids, self.num_embeddings)
        values = self.values[ids].view(*ids.shape, -1, Q8_BLOCK).float()
        return (values * self.scales[ids].float()[..., None]).view(*ids.shape, self.embedding_dim)


def fp16_exact(tensor: torch.Tensor) -> torch.Tensor | None:
    """``tensor`` (fp32) in fp16 when fp16 holds every value exactly (weights loaded from an fp16 file), else None."""
    if tensor.dtype != torch.float32:
        return None
    half = tensor.detach().half().contiguous()
    return half if torch.equal(half.float(), tensor) else None


class F16Embedding(KeptForm):
    """An embedding table kept in fp16 because fp16 holds each of its values exactly (weights loaded from an
    fp16 file): half the bytes of the fp32 table, rows widened back bit for bit. Built only by
    :meth:`exact_from`."""

    def __init__(self, table: torch.Tensor) -> None:
        super().__init__()
        self.register_buffer("table", table)  # [rows, dim] fp16
        self.num_embeddings, self.embedding_dim = table.shape

    @classmethod
    def exact_from(cls, weight: torch.Tensor) -> F16Embedding | None:
        """The fp16 form of ``weight``, or None when fp16 does not hold every value exactly."""
        table = fp16_exact(weight) if weight.dim() == 2 else None
        return cls(table) if table is not None else None

    @property
    def weight(self) -> torch.Tensor:
        """The table's values as the fp32 table had them (a copy): for code that reads an embedding's weight."""
        return self.table.float()

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        check_ids(ids, self.num_embeddings)
        return self.table[ids].float()


def _concat_bias(parts) -> torch.nn.Parameter | None:
    if all(p.bias is None for p in parts):
        return None
    # the zeros in the dtype of the biases they sit beside, not torch's process-wide default
    dtype = next(p.bias.dtype for p in parts if p.bias is not None)
    biases = [p.bias if p.bias is not None else torch.zeros(p.out_features, dtype=dtype) for p in parts]
    return torch.nn.Parameter(torch.cat([b.detach() for b in biases]), requires_grad=False)


def concat_linears(parts: list[torch.nn.Module]) -> torch.nn.Module | None:
    """One module computing ``parts`` side by side (q/k/v, gate/up), or None when they differ in kind."""
    kind = type(parts[0])
    if any(type(p) is not kind for p in parts) or len({p.in_features for p in parts}) != 1:
        return None
    if kind not in FAST_LINEARS:  # plain fp32 linears: f32_kernel_linear fuses them, in place
        return None
    fused = kind.concat(parts)
    # The packed int4 layout interleaves output rows in blocks whose size is the kernel's choice
    # (64 on the CPUs tried), so concatenating is only right when every part fills whole blocks.
    # Rather than assume the block size, check the fused module against its parts on a probe.
    probe = torch.randn(2, parts[0].in_features, dtype=torch.float32, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        if not torch.equal(fused(probe), torch.cat([p(probe) for p in parts], dim=-1)):
            return None
    check_rows(fused)
    _share_storage(fused, parts, probe)
    return fused


def _share_storage(fused: torch.nn.Module, parts: list[torch.nn.Module], probe: torch.Tensor) -> None:
    """Each part's buffers laid out by output row become views of the fused module's (the model keeps its parts for
    transformers' forward, the lean forward runs the fused one): one copy of the weights, as f32_kernel_linear keeps
    on fp32. Without this an int4 target held its q/k/v and gate/up twice (about a third more than its
    parameter_bytes). A buffer whose output is its last dimension (int8's [in, out] weights where ATen multiplies
    them: the no-kernel fallback) becomes column views; one laid out otherwise (ATen's int4 scale_zero, by input
    group) keeps its copy."""
    with torch.no_grad():
        before = [p(probe) for p in parts]
        kept = [dict(p._buffers) for p in parts]
        for name, whole in fused.named_buffers(recurse=False):
            sizes = [p._buffers[name].shape for p in parts]
            if whole.dim() == 0:
                continue
            # the dimension the parts were concatenated along: the first (by output row), else the last
            for dim in dict.fromkeys((0, whole.dim() - 1)):
                rest = [d for d in range(whole.dim()) if d != dim]
                if all(len(s) == whole.dim() and [s[d] for d in rest] == [whole.shape[d] for d in rest]
                       for s in sizes) and sum(s[dim] for s in sizes) == whole.shape[dim]:
                    start = 0
                    for part, size in zip(parts, sizes, strict=True):
                        part._buffers[name] = whole.narrow(dim, start, size[dim])
                        start += size[dim]
                    break
        if not all(torch.equal(p(probe), b) for p, b in zip(parts, before, strict=True)):
            for part, buffers in zip(parts, kept, strict=True):  # a layout not split by rows: they keep their copies
                part._buffers.update(buffers)


MAX_VERIFY_ROWS = 9  # a verify feeds gamma + 1 rows: checked up to gamma = 8, the most the engine allows
ROW_PROBES = 16  # random inputs per check: one probe missed bf16's rare differences (below)
_ROWS_CHECKED: dict[tuple, bool] = {}


def probes_for(dtype: torch.dtype) -> int:
    """Random inputs a row check needs: one where fp32 outputs show any other summation order, ROW_PROBES where
    rounded half-precision outputs hide most of it (check_rows)."""
    return 1 if dtype == torch.float32 else ROW_PROBES


def rows_agree(matmul, in_features: int, probes: int = ROW_PROBES) -> bool:
    """Whether ``matmul`` ([rows, in_features] -> [rows, out]) gives every row of a 2..MAX_VERIFY_ROWS-row call
    bit for bit as that row alone, on ``probes`` random inputs."""
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for _ in range(probes):
            probe = torch.randn(MAX_VERIFY_ROWS, in_features, dtype=torch.float32, generator=gen)
            alone = torch.cat([matmul(probe[i : i + 1]) for i in range(MAX_VERIFY_ROWS)])
            if not all(torch.equal(matmul(probe[:m]), alone[:m]) for m in range(2, MAX_VERIFY_ROWS + 1)):
                return False
    return True


def check_rows(module: FastLinear) -> bool:
    """Whether the kernel computes every row of a 2..MAX_VERIFY_ROWS-row call exactly as alone; sets
    ``module.rows_at_once``. Kernels pick code paths by shape, not by values, so a check per shape decides
    (cached). Speculative decoding is lossless only if a verify's rows equal one-token steps.

    A kernel that sums in another order for more rows differs in most fp32 outputs, but bf16's outputs are
    rounded to 8 bits, which hides most of it: on 576x1536 layers 2-5 outputs in 10,000 still differed, so the
    single 9-row probe (about 1.3 differing outputs expected) called 7 of 12 random weight sets exact, 3 of them
    wrongly (a review's run on an AVX512-BF16 EPYC, oneDNN). Sixteen probes leave a miss at about e^-20.
    The thread count is in the key: ATen's fallbacks (bf16, int4) block by it, and a node reconfigured to more
    threads reloads its target with the verdict of the old count."""
    key = (type(module).__name__, module.in_features, module.out_features, torch.get_num_threads())
    if key not in _ROWS_CHECKED:
        _ROWS_CHECKED[key] = rows_agree(module._matmul, module.in_features)
    module.rows_at_once = _ROWS_CHECKED[key]
    return module.rows_at_once


def blas_rows_exact(linear: torch.nn.Linear) -> bool:
    """Whether torch's own matmul (a BLAS sgemm on the CPU) computes this plain linear's rows of a
    2..MAX_VERIFY_ROWS-row call as each alone, checked once per shape, dtype, device, bias and thread count (the
    library picks its blocking by all of them). Where the engine's f32 kernel does not take a layer (no compiler,
    a bias, a width off its step) this decides whether the lean forward computes a verify's rows one at a time.
    fp32 sums in another order differ in most outputs, so one probe decides there; fp16 and bf16 outputs are
    rounded, which hides most differences (check_rows), so they get ROW_PROBES."""
    weight = linear.weight
    key = ("F.linear", linear.in_features, linear.out_features, weight.dtype, str(weight.device),
           linear.bias is not None, torch.get_num_threads())
    if key not in _ROWS_CHECKED:
        _ROWS_CHECKED[key] = rows_agree(
            lambda x: torch.nn.functional.linear(x.to(weight.device, weight.dtype), weight, linear.bias).cpu(),
            linear.in_features, probes=probes_for(weight.dtype))
    return _ROWS_CHECKED[key]


@dataclass
class PathReport:
    """What :func:`apply_path` did to a model."""

    path: str
    converted: int = 0
    kept_fp32: list[str] = field(default_factory=list)  # layers the path's kernel cannot take
    rows_one_by_one: list[str] = field(default_factory=list)  # layers whose kernel is not row-exact here
    head: str = ""  # the LM head's form
    embedding: str = "fp32"  # the token embedding's form: fp32; q8_0 where the table is on that grid; else fp16
    # where fp16 holds it exactly
    kernels: str = "ATen"  # what multiplies the layers: the engine's kernels (runtime/cpu_kernels.py) or ATen


def check_path(path: str, device: str = "cpu") -> str:
    if path not in PATHS:  # "auto" is chosen before this (path_choice.choose_path): it names no form of its own
        auto = " (auto is resolved to one of them first: runtime/path_choice.py)" if path == "auto" else ""
        raise ForwardPathError(f"unknown forward path {path!r}: use one of {', '.join(PATHS)}{auto}")
    if path in ("int8", "int4") and device != "cpu":  # their kernels read the weights as host memory: a crash
        raise ForwardPathError(f"forward path {path!r} runs on the CPU only (its kernels are CPU code), but the"
                               f" model is on {device}: use fp32 or bf16 there")
    if path == "bf16" and device == "cpu" and not cpu_has_bf16():
        raise ForwardPathError(
            "forward path 'bf16' needs a CPU with bf16 matmul (avx512_bf16 or AMX): use int8, int4 or fp32"
        )
    return path


def cpu_has_bf16() -> bool:
    """Whether this CPU multiplies bf16 natively (x86 avx512_bf16 or AMX, Arm bf16); elsewhere bf16 is emulated
    and slower than fp32, so ``auto`` leaves it out. About the CPU only: a GPU beside it says nothing of it."""
    flags = cpu_kernels.cpu_flags()
    if flags is None:  # not Linux: trust torch's own report of the vector ISA
        return torch.backends.cpu.get_cpu_capability() == "AMX"
    return bool(flags & {"avx512_bf16", "amx_bf16", "bf16"})


def _is_head(name: str) -> bool:
    return name.rsplit(".", 1)[-1] in ("lm_head", "embed_out", "output")


def apply_path(model: torch.nn.Module, path: str, compact_embedding: bool = True) -> PathReport:
    """Replace ``model``'s ``nn.Linear`` layers in place by ``path``'s modules, and (``compact_embedding``) its
    token embedding by a :class:`Q8Embedding` where the table is exactly on that grid, else by an
    :class:`F16Embedding` where fp16 holds it exactly."""
    params = next(model.parameters(), None)
    check_path(path, params.device.type if params is not None else "cpu")
    report = PathReport(path)
    if path == "fp32":
        # its linears stay nn.Linear; the lean forward runs them on the f32 kernel, fused in place (f32_kernel_linear)
        if cpu_kernels.status().f32:
            report.kernels = cpu_kernels.status().describe()
        return report
    kind_for_path = {"bf16": Bf16Linear, "int8": Int8Linear, "int4": Int4Linear}[path]
    linears = [(name, module) for name, module in model.named_modules() if type(module) is torch.nn.Linear]
    for full_name, linear in linears:
        parent_name, _, child_name = full_name.rpartition(".")
        kind = Int8Linear if path == "int4" and _is_head(full_name) else kind_for_path
        if kind is Int4Linear and not Int4Linear.fits(linear.in_features, linear.out_features):
            report.kept_fp32.append(full_name)
            continue
        fast = kind(linear.weight, linear.bias)
        if not check_rows(fast):
            report.rows_one_by_one.append(full_name)
        setattr(model.get_submodule(parent_name), child_name, fast)
        report.converted += 1
        if _is_head(full_name):
            report.head = kind.__name__
    if any(getattr(m, "own_kernel", False) for m in model.modules()):
        report.kernels = cpu_kernels.status().describe()
    elif path in ("int8", "int4"):
        report.kernels = "ATen" + (f" ({cpu_kernels.status().reason})" if cpu_kernels.status().reason else "")
    embeddings = model.get_input_embeddings() if compact_embedding and hasattr(model, "get_input_embeddings") else None
    model.__class__ = _checked_class(type(model))
    if type(embeddings) is torch.nn.Embedding:
        compact = Q8Embedding.exact_from(embeddings.weight)
        if compact is None:
            compact = F16Embedding.exact_from(embeddings.weight)
        if compact is not None:  # its fp32 table (the head's, when tied) is freed: the head was converted above
            model.set_input_embeddings(compact)
            report.embedding = "q8_0" if isinstance(compact, Q8Embedding) else "fp16"
    return report
