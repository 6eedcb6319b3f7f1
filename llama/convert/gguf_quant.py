"""GGUF's quantized blocks laid onto llama/quant/format.py's layout, without widening them to float.

A GGUF tensor of a quantized type is, row by row, a run of blocks that each hold a scale (and maybe a
minimum) beside their packed values. Three of llama.cpp's types are our layout with the blocks of a row
side by side, and map without any loss:

    Q8_0  block of 32: d, 32 x int8           w = d * q                   int8, group 32
    Q4_0  block of 32: d, 32 x 4 bits         w = d * q - 8 * d           int4, group 32, min = -8d
    Q4_1  block of 32: d, m, 32 x 4 bits      w = d * q + m               int4, group 32

The k-quants that most LLaMA-2 GGUFs use have a second level of scales: a super-block of 256 holds a
float16 d (and dmin) and small integer scales per sub-block. Multiplying them out gives our layout, with
the product rounded to float16 (a relative error of at most 2^-11 of each weight; the tests measure it):

    Q6_K  16 x (16 values of 6 bits, int8 scale)        w = d * s * (q - 32)      int8, group 16
    Q4_K  8 x (32 values of 4 bits, 6-bit scale, min)   w = d * s * q - dmin * m  int4, group 32

Q5_K's 5-bit values with a minimum fit neither int4 nor symmetric int8; it is dequantized and quantized
again to int8 with group 32 (an error of at most half a step of that grid).
"""

from typing import Callable, Dict, Optional, Tuple

import numpy as np
import torch

from llama.quant import format as quant_format

QK_K = 256  # a k-quant super-block

# How each GGUF type is kept: (method, group size, what the converter tells the user).
KEPT_TYPES: Dict[str, Tuple[str, int, str]] = {
    "Q8_0": ("int8", 32, "kept exactly as int8, group 32"),
    "Q4_0": ("int4", 32, "kept exactly as int4, group 32"),
    "Q4_1": ("int4", 32, "kept exactly as int4, group 32"),
    "Q6_K": ("int8", 16, "kept as int8, group 16 (its two levels of scales multiplied into one float16 scale)"),
    "Q4_K": ("int4", 32, "kept as int4, group 32 (its two levels of scales and mins multiplied into float16)"),
    "Q5_K": ("int8", 32, "requantized to int8, group 32 (its 5-bit values with a minimum fit neither format)"),
}


def _f16(raw: np.ndarray) -> torch.Tensor:
    """(..., 2) raw bytes -> (...) float16."""
    return torch.from_numpy(np.ascontiguousarray(raw).view(np.float16)[..., 0].copy())


def _blocks(data: np.ndarray, rows: int, block_bytes: int) -> torch.Tensor:
    """A quantized tensor's bytes as (rows, blocks per row, bytes per block) uint8."""
    return torch.from_numpy(np.array(data, dtype=np.uint8, copy=True).reshape(rows, -1, block_bytes))


def _nibbles_by_halves(qs: torch.Tensor) -> torch.Tensor:
    """(..., n) bytes whose low nibbles are values 0..n-1 and high nibbles values n..2n-1 -> (..., 2n)."""
    return torch.cat([qs & 0x0F, qs >> 4], dim=-1)


def _q8_0(data: np.ndarray, rows: int) -> Dict[str, torch.Tensor]:
    blocks = _blocks(data, rows, 34)
    d = _f16(blocks[..., :2].numpy())
    q = blocks[..., 2:].contiguous().view(torch.int8).reshape(rows, -1)
    return {"weight": q, "scales": d}


def _repack_halves(qs: torch.Tensor, rows: int) -> torch.Tensor:
    """A 32-value block's 16 bytes, value j and j + 16 in byte j, repacked as values 2k and 2k + 1 in byte k.

    Byte k < 8 takes the low nibbles of bytes 2k and 2k + 1; byte k >= 8 their high nibbles (k - 8 counted
    from byte 0 again): one pass over the bytes instead of unpacking and packing all values.
    """
    even, odd = qs[..., 0::2], qs[..., 1::2]
    low_values = (even & 0x0F) | ((odd & 0x0F) << 4)
    high_values = (even >> 4) | (odd & 0xF0)
    return torch.cat([low_values, high_values], dim=-1).reshape(rows, -1)


def _q4_0(data: np.ndarray, rows: int) -> Dict[str, torch.Tensor]:
    blocks = _blocks(data, rows, 18)
    d = _f16(blocks[..., :2].numpy())
    # -8d is d with its exponent raised by 3: exact in float16 unless d is beyond 8188, which is checked.
    return {"weight": _repack_halves(blocks[..., 2:], rows), "scales": d, "mins": (d.float() * -8).to(torch.float16)}


def _q4_1(data: np.ndarray, rows: int) -> Dict[str, torch.Tensor]:
    blocks = _blocks(data, rows, 20)
    d, m = _f16(blocks[..., :2].numpy()), _f16(blocks[..., 2:4].numpy())
    return {"weight": _repack_halves(blocks[..., 4:], rows), "scales": d, "mins": m}


def _q6_k(data: np.ndarray, rows: int) -> Dict[str, torch.Tensor]:
    # A super-block: ql (128 bytes, low 4 bits), qh (64 bytes, high 2 bits), 16 int8 scales, d.
    blocks = _blocks(data, rows, 210)
    n = blocks.shape[1]
    ql = blocks[..., :128].reshape(rows, n, 2, 64)    # two halves of 128 values
    qh = blocks[..., 128:192].reshape(rows, n, 2, 32)
    scales = blocks[..., 192:208].contiguous().view(torch.int8).float()  # (rows, n, 16)
    d = _f16(blocks[..., 208:].numpy()).float()                         # (rows, n)
    # In each half, byte j of ql holds value j (low nibble) and value j + 64 (high nibble); byte l of qh
    # holds the high bits of values l, l + 32, l + 64 and l + 96, two bits each.
    low = _nibbles_by_halves(ql)                                         # (rows, n, 2, 128)
    high = torch.cat([(qh >> shift) & 0x03 for shift in (0, 2, 4, 6)], dim=-1)
    q = ((low | (high << 4)).to(torch.int16) - 32).to(torch.int8).reshape(rows, -1)
    group_scales = (d.unsqueeze(-1) * scales).reshape(rows, -1).to(torch.float16)  # (rows, n * 16)
    return {"weight": q, "scales": group_scales}


def _k_scales_and_mins(packed: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """Q4_K / Q5_K's 12 bytes of eight 6-bit scales and eight 6-bit mins -> two (..., 8) tensors."""
    first, second, third = packed[..., 0:4], packed[..., 4:8], packed[..., 8:12]
    # Sub-blocks 0..3 keep their scale and min in the low 6 bits of bytes 0..3 and 4..7; sub-blocks 4..7
    # have their low 4 bits in bytes 8..11 and their top 2 bits in the spare top bits of bytes 0..7.
    scales = torch.cat([first & 0x3F, (third & 0x0F) | ((first >> 6) << 4)], dim=-1)
    mins = torch.cat([second & 0x3F, (third >> 4) | ((second >> 6) << 4)], dim=-1)
    return scales.float(), mins.float()


def _q4_k(data: np.ndarray, rows: int) -> Dict[str, torch.Tensor]:
    # A super-block: d, dmin, 12 bytes of scales and mins, 128 bytes of 4-bit values.
    blocks = _blocks(data, rows, 144)
    n = blocks.shape[1]
    d, dmin = _f16(blocks[..., 0:2].numpy()).float(), _f16(blocks[..., 2:4].numpy()).float()
    scales, mins = _k_scales_and_mins(blocks[..., 4:16])
    # Each 32 bytes hold 64 values: the low nibbles the first 32, the high nibbles the next 32.
    q = _nibbles_by_halves(blocks[..., 16:].reshape(rows, n, 4, 32)).reshape(rows, -1)
    return {
        "weight": quant_format.pack_int4(q),
        "scales": (d.unsqueeze(-1) * scales).reshape(rows, -1).to(torch.float16),
        "mins": (-(dmin.unsqueeze(-1) * mins)).reshape(rows, -1).to(torch.float16),
    }


_EXACT_OR_NEAR: Dict[str, Callable[[np.ndarray, int], Dict[str, torch.Tensor]]] = {
    "Q8_0": _q8_0, "Q4_0": _q4_0, "Q4_1": _q4_1, "Q6_K": _q6_k, "Q4_K": _q4_k,
}


EXACT_TYPES = ("Q8_0", "Q4_0", "Q4_1")


def dequantize_exact(type_name: str, data: np.ndarray, shape: Tuple[int, int]) -> torch.Tensor:
    """A Q8_0, Q4_0 or Q4_1 tensor as float32, the very values gguf.quants.dequantize gives (faster)."""
    kept = _EXACT_OR_NEAR[type_name](data, shape[0])
    return quant_format.dequantize(kept["weight"], kept["scales"], kept.get("mins"))


def keep_quantized(type_name: str, data: np.ndarray, shape: Tuple[int, int],
                   dequantize: Callable[[], torch.Tensor]) -> Optional[Dict[str, torch.Tensor]]:
    """A GGUF tensor of `type_name` as {"weight", "scales"[, "mins"]} in our layout, or None if it cannot be kept.

    Args:
        type_name: the GGML type's name ("Q4_0", ...).
        data: the tensor's raw bytes, one row of blocks per output row.
        shape: its (out, in) shape.
        dequantize: gives the float32 weight, for the types that are quantized again.
    """
    if type_name not in KEPT_TYPES:
        return None
    rows, _ = shape
    if type_name == "Q5_K":
        q, scales = quant_format.quantize_int8(dequantize(), 32)
        return {"weight": q, "scales": scales}
    kept = _EXACT_OR_NEAR[type_name](data, rows)
    # A scale beyond float16's range (no real model has one) would become inf: such a tensor stays float.
    if not all(torch.isfinite(kept[k]).all() for k in ("scales", "mins") if k in kept):
        return None
    return kept
