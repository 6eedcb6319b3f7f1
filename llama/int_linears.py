"""The linear-layer classes that multiply with the integer kernels: int8 and int4 blocks of 32, rows interleaved.

`Int8DotLinear` holds int8 values in blocks of 32 columns with a float16 scale each (GGUF's Q8_0), and
`Int4DotLinear` values 0..15 with a scale and a minimum per block (Q4_1; Q4_0 is the minimum -8 * scale), both
in the kernels' interleaved layout (llama/kernels/layout.py). Each `forward` is one call of one op of
llama/kernels, which rounds the activations to int8 blocks and multiplies with integer dot products.
`llama.linears.layer_class` decides when a layer becomes one of these; `integer_class` says whether it can.

Per-channel int8 (one scale a row) and groups that are multiples of 32 are held as blocks of 32 with each
scale repeated, which is exact; `state_dict()` gives back the on-disk layout, with the original groups.
"""

from typing import Dict, Optional, Tuple, Type

import torch

from llama import kernels
from llama.kernels import layout
from llama.linears import QuantizedLinear
from llama.quant_format import SCALE_DTYPE, pack_int4

# Re-pack about this many values at a time, so that re-packing a big layer needs tens of MB of scratch.
_CHUNK_ELEMENTS = 1 << 22


def _blocks_per_group(layer: QuantizedLinear) -> int:
    """How many blocks of 32 each of the layer's scales covers."""
    return (layer.group_size or layer.in_features) // kernels.QK


def _row_slices(layer: QuantizedLinear):
    rows = kernels.ROWS * max(1, _CHUNK_ELEMENTS // (layer.in_features * kernels.ROWS))
    return [(start, min(start + rows, layer.out_features)) for start in range(0, layer.out_features, rows)]


class _DotLinear(QuantizedLinear):
    """What the two classes share: re-packing a slice of rows at a time, and reading rows back."""

    integer_kernels = True  # llama.linears.layer_class keeps such a layer on the kernels

    @classmethod
    def from_layer(cls, layer: QuantizedLinear, dtype: torch.dtype) -> "_DotLinear":
        new = cls(layer.in_features, layer.out_features, layer.group_size)
        repeat = _blocks_per_group(layer)
        pieces = []
        for start, end in _row_slices(layer):
            values, *scales = layer.format_values(start, end)
            # (Scales come from float16, whatever dtype a loader handed them in: back to it exactly.)
            pieces.append(cls._pack(values, *(s.to(SCALE_DTYPE).repeat_interleave(repeat, dim=1) for s in scales)))
        for name, *parts in zip(cls._buffers_held, *pieces):
            setattr(new, name, torch.cat(parts) if len(parts) > 1 else parts[0])
        return new

    def format_values(self, start: int = 0, end: Optional[int] = None) -> Tuple[torch.Tensor, ...]:
        end = self.out_features if end is None else min(end, self.out_features)
        first, last = start // kernels.ROWS, -(-end // kernels.ROWS)  # the groups that hold rows start..end
        held = [getattr(self, name)[first:last] for name in self._buffers_held]
        values, *scales = self._unpack(*held, (last - first) * kernels.ROWS)
        rows = slice(start - first * kernels.ROWS, end - first * kernels.ROWS)
        step = _blocks_per_group(self)  # back to one scale per group (or per row)
        return (values[rows], *(s[rows, ::step] for s in scales))

    def dequantized(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return self._dequantize().to(dtype)


class Int8DotLinear(_DotLinear):
    """int8 blocks of 32 (w = q * scale), 8 rows interleaved; multiplied by `torch.ops.llama_kv.q8_0_linear`."""

    method = "int8"
    _buffers_held = ("weight", "scales")
    _pack = staticmethod(layout.pack_q8_0)
    _unpack = staticmethod(layout.unpack_q8_0)

    def __init__(self, in_features: int, out_features: int, group_size: Optional[int] = None):
        super().__init__(in_features, out_features, None if group_size in (None, in_features) else group_size)
        shape = (layout.groups(out_features), in_features // kernels.QK)
        self.register_buffer("weight", torch.empty(*shape, kernels.ROWS * kernels.QK, dtype=torch.int8, device="meta"))
        self.register_buffer("scales", torch.empty(*shape, kernels.ROWS, dtype=torch.float16, device="meta"))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.llama_kv.q8_0_linear(x, self.weight, self.scales, self.out_features)

    def format_tensors(self) -> Dict[str, torch.Tensor]:
        values, scales = self.format_values()
        return {"weight": values, "scales": scales}

    def _dequantize(self) -> torch.Tensor:
        return torch.ops.llama_kv.dequantize_q8_0(self.weight, self.scales, self.out_features)


class Int4DotLinear(_DotLinear):
    """int4 blocks of 32 (w = q * scale + min), 8 rows interleaved; multiplied by `torch.ops.llama_kv.q4_1_linear`."""

    method = "int4"
    _buffers_held = ("weight", "scales", "mins")
    _pack = staticmethod(layout.pack_q4_1)
    _unpack = staticmethod(layout.unpack_q4_1)

    def __init__(self, in_features: int, out_features: int, group_size: int = kernels.QK):
        super().__init__(in_features, out_features, group_size)
        shape = (layout.groups(out_features), in_features // kernels.QK)
        self.register_buffer("weight", torch.empty(*shape, kernels.ROWS * kernels.QK // 2, dtype=torch.uint8,
                                                   device="meta"))
        self.register_buffer("scales", torch.empty(*shape, kernels.ROWS, dtype=torch.float16, device="meta"))
        self.register_buffer("mins", torch.empty_like(self.scales))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.llama_kv.q4_1_linear(x, self.weight, self.scales, self.mins, self.out_features)

    def format_tensors(self) -> Dict[str, torch.Tensor]:
        values, scales, mins = self.format_values()
        return {"weight": pack_int4(values), "scales": scales, "mins": mins}

    def _dequantize(self) -> torch.Tensor:
        return torch.ops.llama_kv.dequantize_q4_1(self.weight, self.scales, self.mins, self.out_features)


class Int8SixteensDotLinear(QuantizedLinear):
    """int8 in groups of 16 columns (what a GGUF's Q6_K becomes, llama.cpp's default output layer for Q4_0) on the
    Q8_0 kernel, as two layouts of blocks of 32: one holds each block's first 16 columns beside 16 zeros, with their
    group's scale, the other its last 16 after 16 zeros, with theirs; `forward` adds the two products. Zeros add
    nothing to a block's integer sum, so each half is its group's exact integer product, for twice the bytes of
    the values (widening them to float32 at every call took 323 ms a token for LLaMA-2 7B's output layer)."""

    method = "int8"
    integer_kernels = True

    def __init__(self, in_features: int, out_features: int, group_size: Optional[int] = 16):
        super().__init__(in_features, out_features, 16)
        shape = (layout.groups(out_features), in_features // kernels.QK)
        # The first halves are `weight` and `scales`, where every layer keeps them (the device, the dtype are read there).
        for suffix in ("", "_second"):
            self.register_buffer(f"weight{suffix}", torch.empty(*shape, kernels.ROWS * kernels.QK, dtype=torch.int8,
                                                                device="meta"))
            self.register_buffer(f"scales{suffix}", torch.empty(*shape, kernels.ROWS, dtype=SCALE_DTYPE, device="meta"))

    @classmethod
    def from_layer(cls, layer: QuantizedLinear, dtype: torch.dtype) -> "Int8SixteensDotLinear":
        new = cls(layer.in_features, layer.out_features)
        pieces = {name: [] for name in ("weight", "scales", "weight_second", "scales_second")}
        for start, end in _row_slices(layer):
            values, scales = layer.format_values(start, end)
            rows, nb = values.shape[0], layer.in_features // kernels.QK
            halves = values.reshape(rows, nb, 2, 16)
            zeros = torch.zeros_like(halves[:, :, 0])
            scales = scales.to(SCALE_DTYPE).reshape(rows, nb, 2)
            for i, (suffix, placed) in enumerate((("", (halves[:, :, 0], zeros)), ("_second", (zeros, halves[:, :, 1])))):
                weight, packed_scales = layout.pack_q8_0(torch.cat(placed, dim=-1).reshape(rows, -1), scales[:, :, i])
                pieces[f"weight{suffix}"].append(weight)
                pieces[f"scales{suffix}"].append(packed_scales)
        for name, parts in pieces.items():
            setattr(new, name, torch.cat(parts) if len(parts) > 1 else parts[0])
        return new

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        first = torch.ops.llama_kv.q8_0_linear(x, self.weight, self.scales, self.out_features)
        return first + torch.ops.llama_kv.q8_0_linear(x, self.weight_second, self.scales_second, self.out_features)

    def format_values(self, start: int = 0, end: Optional[int] = None) -> Tuple[torch.Tensor, ...]:
        end = self.out_features if end is None else min(end, self.out_features)
        first, last = start // kernels.ROWS, -(-end // kernels.ROWS)
        rows = slice(start - first * kernels.ROWS, end - first * kernels.ROWS)
        n = (last - first) * kernels.ROWS
        v1, s1 = layout.unpack_q8_0(self.weight[first:last], self.scales[first:last], n)
        v2, s2 = layout.unpack_q8_0(self.weight_second[first:last], self.scales_second[first:last], n)
        scales = torch.stack((s1, s2), dim=-1).reshape(n, -1)  # the groups of 16 in column order
        return (v1 + v2)[rows], scales[rows]  # each column is zero in one of the two

    def format_tensors(self) -> Dict[str, torch.Tensor]:
        values, scales = self.format_values()
        return {"weight": values, "scales": scales}


def integer_class(layer: QuantizedLinear, dtype: torch.dtype) -> Optional[Type[QuantizedLinear]]:
    """The integer-kernel class for a quantized CPU layer with activations of `dtype`, or None where the kernels
    do not apply: another device or dtype (float16), groups that neither 32 nor 16 divides into blocks of 32, or
    no kernels here (`llama.kernels.unavailable_reason()` says why). int8 groups of 16 (a GGUF's Q6_K) go to
    `Int8SixteensDotLinear`. Building the kernels, the first time, happens here."""
    group = layer.group_size or layer.in_features
    sixteens = layer.method == "int8" and group == 16
    fits = layer.in_features % kernels.QK == 0 and (group % kernels.QK == 0 or sixteens)
    if layer.weight.device.type != "cpu" or dtype not in (torch.float32, torch.bfloat16) or not fits:
        return None
    if not kernels.available():
        return None
    if sixteens:
        return Int8SixteensDotLinear
    return Int8DotLinear if layer.method == "int8" else Int4DotLinear
