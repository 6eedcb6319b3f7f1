"""The linear-layer classes a built model's projections can become: one class per weight layout.

Each class holds its weight in one layout and multiplies it one way. Which class each layer becomes is decided
once, where the model is loaded, by llama/quant/layer_plan.py, whose `LINEAR_CLASSES` lists every class with what
it holds, how it multiplies and when it is chosen. `model.py` knows none of this; `quantize.py` swaps float layers
for `Int8Linear` / `Int4Linear` (the on-disk layout of llama/quant/format.py). Every quantized class's
`state_dict()` is the on-disk layout.

The Dot classes (llama/quant/dot_linears.py) are what a quantized CPU model runs by default: they round the
activations too, so they multiply by the same weights but not the same activations, within a bound the tests
state (tests/kernels/test_int_kernels.py). Every other class multiplies by the same values: widening is the exact float model of the dequantized weights,
and each faster path is tested against it. torch's kernels are chosen for bf16 activations only: fed
float32 they are scalar loops (the int8 one is still worth it at a few rows), and rounding activations to
bf16 for them would let cached and uncached float32 runs differ. What each path measured:
docs/benchmarks.md, "Figures behind the code".
"""

import functools
import math
from typing import Dict, List, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import nn

from llama.quant.format import DEFAULT_INT4_GROUP_SIZE, SCALE_DTYPE, pack_int4, unpack_int4
from llama.quant.layer import QuantizedLinear
from llama.kv_cache import being_traced

# Up to this many rows (batch x tokens fed), a compiled CPU step computes a linear layer as a reduction,
# and eager float32 per-channel int8 takes the int8 kernel's exact float32 loop; above it, a matrix product
# (MKL, or a widened weight) is faster (docs/benchmarks.md).
REDUCTION_MAX_ROWS = 4

# The private kernels come and go between torch releases; without them their classes are never chosen.
HAS_INT8_KERNEL = hasattr(torch.ops.aten, "_weight_int8pack_mm")
HAS_INT4_KERNEL = all(hasattr(torch.ops.aten, k) for k in ("_weight_int4pack_mm_for_cpu",
                                                           "_convert_weight_to_int4pack_for_cpu"))
INT4_KERNEL_GROUPS = (32, 64, 128, 256)
INT4_ROW_BLOCK = 64  # the int4 kernel packs rows in blocks of this many

# Re-pack this many values at a time, so that re-packing a big layer needs tens of MB of scratch.
_CHUNK_ELEMENTS = 1 << 22


def _rows(x: torch.Tensor):
    """The rows of x (all but its last dimension), as a product that stays symbolic under export (Size.numel()
    would fix a dynamic batch size to the example's)."""
    return math.prod(x.shape[:-1])


def _compiling_few_rows(x: torch.Tensor) -> bool:
    return being_traced(x) and x.device.type == "cpu" and _rows(x) <= REDUCTION_MAX_ROWS


class MulSumLinear(nn.Linear):
    """nn.Linear whose few-row products, when Inductor compiles them on the CPU, are a multiply and a sum.

    Decoding multiplies one row per sequence by every weight matrix, so the work is reading the weights:
    Inductor turns `(x * weight).sum(-1)` into one vectorized loop over the contiguous rows of `weight`,
    which reads it faster than the matrix product it would otherwise call. Eagerly, or with more rows, it
    is nn.Linear.
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if _compiling_few_rows(x):
            out = (x.unsqueeze(-2) * self.weight).sum(-1)  # (..., 1, in) * (out, in), summed over in
            return out if self.bias is None else out + self.bias
        return F.linear(x, self.weight, self.bias)


# Up to this many rows, a compiled float32 step on the CPU multiplies with llama_kv.f32_linear, which reads each weight
# row once for all of them; from 16 rows on MKL's GEMM is as fast (docs/benchmarks.md).
FEW_ROWS_MAX = 16


@functools.lru_cache(maxsize=None)
def onednn_linear() -> bool:
    """Whether oneDNN's float32 GEMM is there, in this build of torch, and multiplies as F.linear does (checked once,
    on a small product; the op is torch's own, not a public API). F.linear takes MKL's GEMM, which multiplied a
    prompt's rows at 0.4-0.5x oneDNN's speed on an AMD EPYC (docs/benchmarks.md, "Figures behind the code"). Each
    output row is its own dot products either way, the same bits alone or among other rows."""
    if not (torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")):
        return False
    random = torch.Generator().manual_seed(0)  # not the global generator: sampling's seeds stay as they were
    x, w = torch.randn(17, 64, generator=random), torch.randn(8, 64, generator=random)
    try:
        return torch.allclose(torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], ""), F.linear(x, w), atol=1e-4)
    except (RuntimeError, TypeError):
        return False


class FewRowsLinear(nn.Linear):
    """nn.Linear whose products of 1-16 float32 rows run on `torch.ops.llama_kv.f32_linear` (llama/kernels).

    Decoding multiplies one row per sequence by every weight matrix: the kernel reads each weight row once for all
    of them, where MKL reads the weights again for each tile of rows and Inductor's reduction (MulSumLinear) once
    per row, one running sum at a time (a batch decodes faster, and one row too: docs/benchmarks.md, "Figures behind
    the code"). More rows, a prompt's, take oneDNN's GEMM eagerly (`onednn_linear`), else F.linear. Weights
    row-major, as the compiled step stores them.
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if 0 < _rows(x) <= FEW_ROWS_MAX:
            out = torch.ops.llama_kv.f32_linear(x, self.weight)
            return out if self.bias is None else out + self.bias
        if not being_traced(x) and x.device.type == "cpu" and onednn_linear():
            return torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)


class RowExactLinear(nn.Linear):
    """float32 weights multiplied on `torch.ops.llama_kv.f32_linear` at every row count, eager and compiled alike.

    Each output is one dot product summed in one fixed order (llama/kernels/csrc/f32_rows.cpp), so a row's outputs
    are the same bits whether it is multiplied alone (a cached step) or among a prompt's rows (an uncached pass);
    MKL's products differ in the last bits between those. Chosen where keys and values are rounded to int8
    (llama/kv_cache.py), which would turn such a difference into a whole int8 step now and then. Weights
    row-major.
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.ops.llama_kv.f32_linear(x, self.weight)
        return out if self.bias is None else out + self.bias


class Int8Linear(QuantizedLinear):
    """int8 weights, w = weight * scale, one scale per group of columns (or per row); multiplied by widening, and in
    a compiled CPU step at a few rows by a reduction that dequantizes each weight in registers inside one loop."""

    method = "int8"

    def __init__(self, in_features: int, out_features: int, group_size: Optional[int] = None):
        super().__init__(in_features, out_features, None if group_size in (None, in_features) else group_size)
        self.register_buffer("scales", torch.empty(out_features, self.n_groups, dtype=SCALE_DTYPE, device="meta"))
        self.register_buffer("weight", torch.empty(out_features, in_features, dtype=torch.int8, device="meta"))

    @classmethod
    def from_layer(cls, layer: QuantizedLinear, dtype: torch.dtype) -> "Int8Linear":
        new = cls(layer.in_features, layer.out_features, layer.group_size)
        tensors = layer.format_tensors()
        new.weight, new.scales = tensors["weight"], tensors["scales"]
        return new

    def format_values(self, start: int = 0, end: Optional[int] = None) -> Tuple[torch.Tensor, ...]:
        return self.weight[start:end], self.scales[start:end]

    def format_tensors(self) -> Dict[str, torch.Tensor]:
        return {"weight": self.weight, "scales": self.scales}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not _compiling_few_rows(x):
            return super().forward(x)
        group = self.in_features // self.n_groups
        xg = x.reshape(*x.shape[:-1], 1, self.n_groups, group)  # (..., 1, n_groups, group)
        wg = self.weight.reshape(self.out_features, self.n_groups, group).to(x.dtype)  # (out, n_groups, group)
        dots = (xg * wg).sum(-1)  # (..., out, n_groups)
        return (dots * self.scales.to(x.dtype)).sum(-1)


class Int8KernelLinear(Int8Linear):
    """Per-channel int8 on the CPU through `aten._weight_int8pack_mm`.

    In bf16 every product takes the kernel. In float32 the kernel is a plain loop, exact, and faster than
    widening at a few rows (eager decoding); more rows widen the weight.
    """

    @classmethod
    def from_layer(cls, layer: QuantizedLinear, dtype: torch.dtype) -> "Int8KernelLinear":
        new = super().from_layer(layer, dtype)
        # The scales in the activations' dtype, held rather than computed per call: Inductor passes the
        # kernel only tensors the model holds.
        new.kernel_scales = new.scales.reshape(-1).to(dtype)
        return new

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32 and _rows(x) > REDUCTION_MAX_ROWS:
            return super().forward(x)
        scales = self.kernel_scales if self.kernel_scales.dtype == x.dtype else self.scales.reshape(-1).to(x.dtype)
        out = torch.ops.aten._weight_int8pack_mm(x.reshape(-1, self.in_features), self.weight, scales)
        return out.reshape(*x.shape[:-1], self.out_features)

    def _load_from_state_dict(self, *args, **kwargs):
        super()._load_from_state_dict(*args, **kwargs)
        self.kernel_scales = self.scales.reshape(-1).to(self.kernel_scales.dtype)  # from the scales just loaded


class Int4Linear(QuantizedLinear):
    """int4 weights, two per byte (column 2j low, 2j + 1 high), w = q * scale + min per group; multiplied by
    widening."""

    method = "int4"

    def __init__(self, in_features: int, out_features: int, group_size: int = DEFAULT_INT4_GROUP_SIZE):
        super().__init__(in_features, out_features, group_size)
        self.register_buffer("scales", torch.empty(out_features, self.n_groups, dtype=SCALE_DTYPE, device="meta"))
        self.register_buffer("weight", torch.empty(out_features, in_features // 2, dtype=torch.uint8, device="meta"))
        self.register_buffer("mins", torch.empty_like(self.scales))

    @classmethod
    def from_layer(cls, layer: "QuantizedLinear", dtype: torch.dtype) -> "Int4Linear":
        new = cls(layer.in_features, layer.out_features, layer.group_size)
        tensors = layer.format_tensors()
        new.weight, new.scales, new.mins = tensors["weight"], tensors["scales"], tensors["mins"]
        return new

    def format_values(self, start: int = 0, end: Optional[int] = None) -> Tuple[torch.Tensor, ...]:
        return unpack_int4(self.weight[start:end]), self.scales[start:end], self.mins[start:end]

    def format_tensors(self) -> Dict[str, torch.Tensor]:
        return {"weight": self.weight, "scales": self.scales, "mins": self.mins}

    def dequantized(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        # Written in place into one float tensor: eager float32 runs pay this on every call, and it takes
        # half the time of widening through temporaries (docs/benchmarks.md).
        w = torch.empty(self.out_features, self.n_groups, self.group_size, dtype=torch.float32, device=self.weight.device)
        self._widen_into(w)
        w.mul_(self.scales.unsqueeze(-1)).add_(self.mins.unsqueeze(-1))
        return w.view(self.out_features, self.in_features).to(dtype)

    def _widen_into(self, w: torch.Tensor) -> None:
        """Write the values 0..15 into w, (out, n_groups, group)."""
        pairs = w.view(self.out_features, self.n_groups, self.group_size // 2, 2)
        packed = self.weight.view(self.out_features, self.n_groups, self.group_size // 2)
        pairs[..., 0].copy_(packed & 0x0F)
        pairs[..., 1].copy_(packed >> 4)

    def _row_slices(self) -> List[Tuple[int, int]]:
        """Row ranges of about _CHUNK_ELEMENTS values on the int4 kernel's row blocks: re-packing a slice at a
        time keeps its scratch small."""
        rows = INT4_ROW_BLOCK * max(1, _CHUNK_ELEMENTS // (self.in_features * INT4_ROW_BLOCK))
        return [(start, start + rows) for start in range(0, self.out_features, rows)]


class RowExactWidening:
    """A quantized class's product, eager and compiled alike, as the widened weight on `llama_kv.f32_linear`: the
    weight-only path (`quant_kernels="exact"`) in float32 under an int8 KV cache, row-exact as RowExactLinear is."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.llama_kv.f32_linear(x, self.dequantized(x.dtype))


class RowExactInt8Linear(RowExactWidening, Int8Linear):
    """Int8Linear, multiplied as RowExactWidening says."""


class RowExactInt4Linear(RowExactWidening, Int4Linear):
    """Int4Linear, multiplied as RowExactWidening says."""


class Int4HalvesLinear(Int4Linear):
    """int4 for a compiled CPU step, in GGUF's Q4 order: each group's first half of columns in the low nibbles
    and its second half in the high ones, so the reduction reads whole vectors of columns."""

    @classmethod
    def from_layer(cls, layer: QuantizedLinear, dtype: torch.dtype) -> "Int4HalvesLinear":
        new = cls(layer.in_features, layer.out_features, layer.group_size)
        half = layer.group_size // 2
        pieces, scales, mins = [], [], []
        for start, end in new._row_slices():
            q, s, m = layer.format_values(start, end)
            scales.append(s)
            mins.append(m)
            q = q.reshape(q.shape[0], new.n_groups, 2, half)  # (rows, n_groups, 2 halves, group / 2)
            pieces.append((q[:, :, 0] | (q[:, :, 1] << 4)).reshape(q.shape[0], new.in_features // 2))
        new.weight, new.scales, new.mins = (torch.cat(p) if len(p) > 1 else p[0] for p in (pieces, scales, mins))
        return new

    def format_values(self, start: int = 0, end: Optional[int] = None) -> Tuple[torch.Tensor, ...]:
        packed = self.weight[start:end]
        halves = packed.reshape(packed.shape[0], self.n_groups, 1, self.group_size // 2)
        values = torch.cat([halves & 0x0F, halves >> 4], dim=2).reshape(packed.shape[0], self.in_features)
        return values, self.scales[start:end], self.mins[start:end]

    def format_tensors(self) -> Dict[str, torch.Tensor]:
        return {"weight": pack_int4(self.format_values()[0]), "scales": self.scales, "mins": self.mins}

    def _widen_into(self, w: torch.Tensor) -> None:
        half = self.group_size // 2
        packed = self.weight.view(self.out_features, self.n_groups, half)
        w[..., :half].copy_(packed & 0x0F)
        w[..., half:].copy_(packed >> 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not _compiling_few_rows(x):
            return super().forward(x)
        # sum_j (q_j * s + m) * x_j over the whole row, each weight dequantized in registers: Inductor writes one
        # loop with one accumulator per row, and each nibble plane meets a contiguous run of x.
        half = self.group_size // 2
        xg = x.reshape(*x.shape[:-1], 1, self.n_groups, 2, half)  # (..., 1, n_groups, 2 halves, group / 2)
        packed = self.weight.reshape(self.out_features, self.n_groups, half)  # (out, n_groups, group / 2)
        scales = self.scales.to(x.dtype).unsqueeze(-1)  # (out, n_groups, 1)
        mins = self.mins.to(x.dtype).unsqueeze(-1)
        low = (packed & 0x0F).to(x.dtype) * scales + mins  # the dequantized weights of each group's first half
        high = (packed >> 4).to(x.dtype) * scales + mins
        return (low * xg[..., 0, :] + high * xg[..., 1, :]).sum((-1, -2))  # (..., out)


class Int4KernelLinear(Int4Linear):
    """int4 on the CPU in bf16 through `aten._weight_int4pack_mm_for_cpu`, in that kernel's own packing.

    The kernel computes (q - 8) * scale + zero with bf16 scales and zero points (zero = min + 8 * scale),
    held in `kernel_scales` in place of the float16 scales and mins, so a 7B model's int4 bytes are not held
    twice. `state_dict()` gives the on-disk layout back, with the scales as the kernel rounds them.
    """

    @classmethod
    def from_layer(cls, layer: QuantizedLinear, dtype: torch.dtype) -> "Int4KernelLinear":
        new = cls(layer.in_features, layer.out_features, layer.group_size)
        packed, scales, mins = [], [], []
        for start, end in new._row_slices():
            q, s, m = layer.format_values(start, end)
            packed.append(torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.to(torch.int32), 1))
            scales.append(s)
            mins.append(m)
        new.weight = torch.cat(packed)
        s, m = torch.cat(scales).float(), torch.cat(mins).float()
        new.kernel_scales = torch.stack([s, m + 8 * s], dim=-1).transpose(0, 1).contiguous().bfloat16()  # (n_groups, out, 2)
        new.scales = new.mins = None
        return new

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.ops.aten._weight_int4pack_mm_for_cpu(x.reshape(-1, self.in_features), self.weight,
                                                         self.group_size, self.kernel_scales)
        return out.reshape(*x.shape[:-1], self.out_features)

    def _kernel_scales_as_format(self) -> Tuple[torch.Tensor, torch.Tensor]:
        s, zero = self.kernel_scales.float().transpose(0, 1).unbind(-1)  # (out, n_groups) each
        return s.to(SCALE_DTYPE), (zero - 8 * s).to(SCALE_DTYPE)

    def format_values(self, start: int = 0, end: Optional[int] = None) -> Tuple[torch.Tensor, ...]:
        packed = self.weight[start:end]  # packed in blocks of rows: slices must start and end on them
        assert start % INT4_ROW_BLOCK == 0 and packed.shape[0] % INT4_ROW_BLOCK == 0
        scales, mins = self._kernel_scales_as_format()
        return _from_kernel_layout(packed, self.in_features), scales[start:end], mins[start:end]

    def format_tensors(self) -> Dict[str, torch.Tensor]:
        values, scales, mins = self.format_values()
        return {"weight": pack_int4(values), "scales": scales, "mins": mins}

    def dequantized(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return dequantize_values(*self.format_values()).to(dtype)


def _from_kernel_layout(packed: torch.Tensor, in_features: int) -> torch.Tensor:
    """Undo `_convert_weight_to_int4pack_for_cpu`: (out, in // 2) kernel bytes -> (out, in) values 0..15.

    The kernel's layout is private and may change between releases, so it is learned rather than assumed:
    packing a 64-row block whose values spell each position's index (four bits at a time) shows where each
    value goes.
    """
    perm = _kernel_permutation(in_features)
    blocks = unpack_int4(packed).reshape(-1, INT4_ROW_BLOCK * in_features)  # (out / 64, 64 * in), kernel order
    values = torch.empty_like(blocks)
    values[:, perm] = blocks
    return values.reshape(-1, in_features)


_PERMUTATIONS: Dict[int, torch.Tensor] = {}


def _kernel_permutation(in_features: int) -> torch.Tensor:
    if in_features not in _PERMUTATIONS:
        n = INT4_ROW_BLOCK * in_features
        index = torch.arange(n).reshape(INT4_ROW_BLOCK, in_features)
        perm = torch.zeros(n, dtype=torch.long)
        for digit in range((n - 1).bit_length() // 4 + 1):
            q = ((index >> (4 * digit)) & 15).to(torch.int32)
            perm |= unpack_int4(torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1)).reshape(-1).long() << (4 * digit)
        _PERMUTATIONS[in_features] = perm
    return _PERMUTATIONS[in_features]
