"""The linear-layer classes that multiply with the integer kernels: int8 and int4 blocks of 32, rows interleaved.

`Int8DotLinear` holds int8 values in blocks of 32 columns with a float16 scale each (GGUF's Q8_0),
`Int4DotLinear` values 0..15 with a scale and a minimum per block (Q4_1), and `Int4ZeroPointDotLinear` values
0..15 with a scale, each minimum being -8 times it (Q4_0: two bytes a block fewer to read, and the minimum's
term is an exact integer), all in the kernels' interleaved layout (llama/kernels/layout.py), in buffers that
ask for 2 MiB pages (llama/runtime/pages.py). Each `forward` is one call of one op of llama/kernels, which rounds the
activations to int8 blocks and multiplies with integer dot products.
`llama.quant.layer_plan.plan_layers` decides when a layer becomes one of these; `dot_class` says which one can hold it.

Per-channel int8 (one scale a row) and groups that are multiples of 32 are held as blocks of 32 with each
scale repeated, which is exact; `state_dict()` gives back the on-disk layout, with the original groups.
"""

from typing import Dict, Optional, Tuple, Type

import torch

from llama import kernels
from llama.kernels import layout
from llama.quant.layer import QuantizedLinear
from llama.runtime.pages import huge_empty
from llama.quant.format import SCALE_DTYPE, pack_int4

# Re-pack about this many values at a time, so that re-packing a big layer needs tens of MB of scratch.
_CHUNK_ELEMENTS = 1 << 22


def _blocks_per_group(layer: QuantizedLinear) -> int:
    """How many blocks of 32 each of the layer's scales covers (groups of 16 keep their scales as they are: 1)."""
    return max(1, (layer.group_size or layer.in_features) // kernels.QK)


def _row_slices(layer: QuantizedLinear, step: int = kernels.ROWS):
    rows = step * max(1, _CHUNK_ELEMENTS // (layer.in_features * step))
    return [(start, min(start + rows, layer.out_features)) for start in range(0, layer.out_features, rows)]


def _filled(new: QuantizedLinear, names, pieces, step: int) -> None:
    """Give `new` its buffers `names` (registered on the meta device with their final shapes), re-packed a slice of
    rows at a time: `pieces` yields (the slice's first row, its tensors, one per name). The buffers ask for 2 MiB
    pages (llama/runtime/pages.py: big layers stream faster from them than from 4 KiB ones) and are allocated
    first, then filled as the slices come: one slice's pieces alive at a time."""
    buffers = {name: huge_empty(getattr(new, name).shape, getattr(new, name).dtype) for name in names}
    for start, tensors in pieces:
        for name, piece in zip(names, tensors):
            buffers[name][start // step:start // step + piece.shape[0]].copy_(piece)
    for name, tensor in buffers.items():
        setattr(new, name, tensor)


class DotLinear(QuantizedLinear):
    """What the classes share: re-packing a slice of rows at a time, and reading rows back."""

    _rows = kernels.ROWS  # rows interleaved in a group (unit)

    @classmethod
    def from_layer(cls, layer: QuantizedLinear, dtype: torch.dtype) -> "DotLinear":
        return cls.from_layers([layer], dtype)

    @classmethod
    def can_join(cls, layers) -> bool:
        """Whether `from_layers` can hold `layers` as one: the same columns in the same groups, and each layer but the
        last a whole number of this class's groups (units) of rows."""
        first = layers[0]
        return all(l.in_features == first.in_features and l.group_size == first.group_size for l in layers) and \
            all(l.out_features % cls._rows == 0 for l in layers[:-1])

    @classmethod
    def from_layers(cls, layers, dtype: torch.dtype) -> "DotLinear":
        """One layer of `layers`' rows one after another (llama/quant/fuse.py; `can_join` says whether it can). Each row's
        products are the ones, in the order, of its own layer: the kernels' rows are apart."""
        assert cls.can_join(layers)
        first = layers[0]
        new = cls(first.in_features, sum(l.out_features for l in layers), first.group_size)

        def pieces():
            offset = 0
            for layer in layers:
                repeat = _blocks_per_group(layer)
                for start, end in _row_slices(layer, cls._rows):
                    values, *scales = layer.format_values(start, end)
                    # (Scales come from float16, whatever dtype a loader handed them in: back to it exactly.)
                    yield offset + start, cls._pack(values, *(s.to(SCALE_DTYPE).repeat_interleave(repeat, dim=1)
                                                              for s in scales))
                offset += layer.out_features

        _filled(new, cls._buffers_held, pieces(), cls._rows)
        return new

    def format_values(self, start: int = 0, end: Optional[int] = None) -> Tuple[torch.Tensor, ...]:
        end = self.out_features if end is None else min(end, self.out_features)
        first, last = start // self._rows, -(-end // self._rows)  # the groups that hold rows start..end
        held = [getattr(self, name)[first:last] for name in self._buffers_held]
        values, *scales = self._unpack(*held, (last - first) * self._rows)
        rows = slice(start - first * self._rows, end - first * self._rows)
        step = _blocks_per_group(self)  # back to one scale per group (or per row)
        return (values[rows], *(s[rows, ::step] for s in scales))

    def dequantized(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return self._dequantize().to(dtype)


class Int8DotLinear(DotLinear):
    """int8 blocks of 32 (w = q * scale), 8 rows interleaved; multiplied by `torch.ops.llama_kv.q8_0_linear`."""

    method = "int8"
    _buffers_held = ("weight", "scales")
    _pack = staticmethod(layout.pack_q8_0)
    _unpack = staticmethod(layout.unpack_q8_0)
    _scales_per_block = ()  # one scale a block and row; (2,): one for each half

    def __init__(self, in_features: int, out_features: int, group_size: Optional[int] = None):
        super().__init__(in_features, out_features, None if group_size in (None, in_features) else group_size)
        shape = (layout.groups(out_features), in_features // kernels.QK)
        self.register_buffer("weight", torch.empty(*shape, kernels.ROWS * kernels.QK, dtype=torch.int8, device="meta"))
        self.register_buffer("scales", torch.empty(*shape, *self._scales_per_block, kernels.ROWS, dtype=SCALE_DTYPE,
                                                   device="meta"))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.llama_kv.q8_0_linear(x, self.weight, self.scales, self.out_features)

    def format_tensors(self, start: int = 0, end: Optional[int] = None) -> Dict[str, torch.Tensor]:
        values, scales = self.format_values(start, end)
        return {"weight": values, "scales": scales}

    def _dequantize(self) -> torch.Tensor:
        return torch.ops.llama_kv.dequantize_q8_0(self.weight, self.scales, self.out_features)


class Int4DotLinear(DotLinear):
    """int4 blocks of 32 (w = q * scale + min), 16 rows interleaved with their scales and minimums; multiplied by
    `torch.ops.llama_kv.q4_1_linear`."""

    method = "int4"
    _rows = kernels.Q4_ROWS
    _buffers_held = ("weight",)
    _has_mins = True

    def __init__(self, in_features: int, out_features: int, group_size: int = kernels.QK):
        super().__init__(in_features, out_features, group_size)
        shape = (layout.groups(out_features, kernels.Q4_ROWS), in_features // kernels.QK)
        self.register_buffer("weight", torch.empty(*shape, layout.q4_block_bytes(self._has_mins), dtype=torch.uint8,
                                                   device="meta"))

    @classmethod
    def _pack(cls, values: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor) -> Tuple[torch.Tensor]:
        return (layout.pack_q4(values, scales, mins if cls._has_mins else None),)

    @staticmethod
    def _unpack(weight: torch.Tensor, out_features: int) -> Tuple[torch.Tensor, ...]:
        return layout.unpack_q4(weight, out_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.llama_kv.q4_1_linear(x, self.weight, self.out_features)

    def format_tensors(self, start: int = 0, end: Optional[int] = None) -> Dict[str, torch.Tensor]:
        values, scales, mins = self.format_values(start, end)
        return {"weight": pack_int4(values), "scales": scales, "mins": mins}

    def _dequantize(self) -> torch.Tensor:
        return torch.ops.llama_kv.dequantize_q4_1(self.weight, self.out_features)


class Int4ZeroPointDotLinear(Int4DotLinear):
    """int4 blocks of 32 whose minimums are -8 times their scales (w = (q - 8) * scale, GGUF's Q4_0), 16 rows
    interleaved with their scales; multiplied by `torch.ops.llama_kv.q4_0_linear`. It gives back the minimums
    (what the checkpoint stores) from the scales, exactly."""

    _has_mins = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.llama_kv.q4_0_linear(x, self.weight, self.out_features)

    def _dequantize(self) -> torch.Tensor:
        return torch.ops.llama_kv.dequantize_q4_0(self.weight, self.out_features)


def minimums_are_minus_8_scales(layer: QuantizedLinear) -> bool:
    """Whether each of an int4 layer's minimums is -8 times its block's scale, exactly (a GGUF's Q4_0)."""
    scales, mins = getattr(layer, "scales", None), getattr(layer, "mins", None)
    if scales is None or mins is None:  # a layout that keeps them elsewhere: read them back a slice at a time
        pairs = (layer.format_values(start, end)[1:] for start, end in _row_slices(layer))
    else:
        pairs = [(scales, mins)]
    return all(torch.equal(m.float(), s.float() * -8) for s, m in pairs)


class Int8Group16DotLinear(Int8DotLinear):
    """int8 in groups of 16 columns (what a GGUF's Q6_K becomes, llama.cpp's default output layer for Q4_0): Q8_0's
    blocks of 32 with a float16 scale for each half, 8 rows interleaved; multiplied by
    `torch.ops.llama_kv.q8_16_linear`, which sums each half's integer products apart and scales them apart."""

    _pack = staticmethod(layout.pack_q8_16)
    _unpack = staticmethod(layout.unpack_q8_16)
    _scales_per_block = (2,)

    def __init__(self, in_features: int, out_features: int, group_size: Optional[int] = 16):
        super().__init__(in_features, out_features, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.llama_kv.q8_16_linear(x, self.weight, self.scales, self.out_features)

    def _dequantize(self) -> torch.Tensor:
        return torch.ops.llama_kv.dequantize_q8_16(self.weight, self.scales, self.out_features)


def dot_class(method: str, in_features: int, group_size: Optional[int],
              zero_point: bool) -> Optional[Type[QuantizedLinear]]:
    """The integer-kernel class that can hold a quantized layer of this shape, or None where none can: groups that
    neither 32 nor 16 divides into blocks of 32. int8 groups of 16 (a GGUF's Q6_K) go to `Int8Group16DotLinear`,
    int4 whose minimums are all -8 times their scales (`zero_point`, Q4_0) to `Int4ZeroPointDotLinear`."""
    group = group_size or in_features
    group16 = method == "int8" and group == 16
    if in_features % kernels.QK or not (group % kernels.QK == 0 or group16):
        return None
    if group16:
        return Int8Group16DotLinear
    if method == "int8":
        return Int8DotLinear
    return Int4ZeroPointDotLinear if zero_point else Int4DotLinear


def integer_class(layer: QuantizedLinear, dtype: torch.dtype) -> Optional[Type[QuantizedLinear]]:
    """`dot_class` for one layer as this process would run it: None also for another device or dtype (float16), or
    no kernels here (`llama.kernels.unavailable_reason()` says why; building them, the first time, happens here).
    A layer already on the kernels stays on its class."""
    if layer.weight.device.type != "cpu" or dtype not in (torch.float32, torch.bfloat16):
        return None
    if dot_class(layer.method, layer.in_features, layer.group_size, False) is None or not kernels.available():
        return None
    zero_point = isinstance(layer, Int4ZeroPointDotLinear) if isinstance(layer, Int4DotLinear) else \
        layer.method == "int4" and minimums_are_minus_8_scales(layer)
    return dot_class(layer.method, layer.in_features, layer.group_size, zero_point)
