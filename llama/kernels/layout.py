"""The kernels' weight layout: quantized rows interleaved 8 at a time, 4 columns of each row side by side.

int8: a group of 8 rows is stored block by block (32 columns); within a block, values go in 8 runs of 32
bytes, run j holding columns 4j .. 4j + 3 of each of the 8 rows, so one broadcast activation word meets a
whole vector of weights and each 32-bit lane sums one row. Scales are float16, (groups, blocks, 8).

int4: a unit of 16 rows (two halves of 8) is stored block by block, each block one run of bytes: 4 runs of
64, run p holding the two halves' 32 bytes side by side, the low nibbles columns 4p .. 4p + 3 and the high
nibbles columns 16 + 4p .. 16 + 4p + 3; then the 16 rows' float16 scales; then (Q4_1) their float16 minimums.
Q4_0's minimum is -8 times its scale and is not stored. (units, blocks, 288 or 320) uint8.

Rows past the weight's end are zeros. csrc/kernels.h draws the same picture.
"""

from typing import Optional, Tuple

import torch

QK = 32
ROWS = 8
Q4_ROWS = 16
Q4_VALUE_BYTES = Q4_ROWS * QK // 2


def groups(out_features: int, rows: int = ROWS) -> int:
    return -(-out_features // rows)


def _padded(t: torch.Tensor, rows: int = ROWS) -> torch.Tensor:
    extra = groups(t.shape[0], rows) * rows - t.shape[0]
    return t if extra == 0 else torch.cat([t, t.new_zeros((extra, *t.shape[1:]))])


def _pack_scales(s: torch.Tensor) -> torch.Tensor:
    """(out, blocks) -> (groups, blocks, 8)."""
    s = _padded(s)
    return s.reshape(-1, ROWS, s.shape[1]).transpose(1, 2).contiguous()


def _unpack_scales(s: torch.Tensor, out_features: int) -> torch.Tensor:
    return s.transpose(1, 2).reshape(-1, s.shape[1])[:out_features]


def pack_q8_0(values: torch.Tensor, scales: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """(out, K) int8 values and (out, K / 32) float16 scales -> the kernel's (groups, K / 32, 256) and
    (groups, K / 32, 8)."""
    v = _padded(values)
    g, nb = v.shape[0] // ROWS, v.shape[1] // QK
    v = v.reshape(g, ROWS, nb, QK // 4, 4).permute(0, 2, 3, 1, 4)  # (group, block, run j, row, column in run)
    return v.reshape(g, nb, ROWS * QK).contiguous(), _pack_scales(scales)


def unpack_q8_0(weight: torch.Tensor, scales: torch.Tensor, out_features: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """The inverse of `pack_q8_0`: (out, K) values and (out, K / 32) scales."""
    g, nb = weight.shape[:2]
    v = weight.reshape(g, nb, QK // 4, ROWS, 4).permute(0, 3, 1, 2, 4)  # (group, row, block, run j, column in run)
    return v.reshape(g * ROWS, nb * QK)[:out_features], _unpack_scales(scales, out_features)


def pack_q8_16(values: torch.Tensor, scales: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """int8 in groups of 16: (out, K) values and (out, K / 16) float16 scales -> `pack_q8_0`'s values and scales
    (groups, K / 32, 2, 8), each block's two halves' scales one after the other."""
    weight, _ = pack_q8_0(values, scales[:, ::2])
    s = _padded(scales)
    g, nb = s.shape[0] // ROWS, s.shape[1] // 2
    return weight, s.reshape(g, ROWS, nb, 2).permute(0, 2, 3, 1).contiguous()


def unpack_q8_16(weight: torch.Tensor, scales: torch.Tensor, out_features: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """The inverse of `pack_q8_16`: (out, K) values and (out, K / 16) scales."""
    g, nb = weight.shape[:2]
    values, _ = unpack_q8_0(weight, scales[:, :, 0], out_features)
    return values, scales.permute(0, 3, 1, 2).reshape(g * ROWS, nb * 2)[:out_features]


def q4_block_bytes(has_mins: bool) -> int:
    """Bytes of one int4 unit's block: values, scales and (Q4_1) minimums."""
    return Q4_VALUE_BYTES + 2 * Q4_ROWS * (2 if has_mins else 1)


def pack_q4(values: torch.Tensor, scales: torch.Tensor, mins: Optional[torch.Tensor] = None) -> torch.Tensor:
    """(out, K) values 0..15, (out, K / 32) float16 scales and, for Q4_1, mins -> the kernel's (units, K / 32,
    288 or 320) uint8 (Q4_0 where `mins` is None: each minimum -8 times its scale)."""
    v = _padded(values.to(torch.uint8), Q4_ROWS)
    u, nb = v.shape[0] // Q4_ROWS, v.shape[1] // QK
    v = v.reshape(u, 2, ROWS, nb, 2, QK // 8, 4).permute(0, 3, 4, 5, 1, 2, 6)  # (unit, block, nibble, p, half, row, col)
    parts = [(v[:, :, 0] | (v[:, :, 1] << 4)).reshape(u, nb, Q4_VALUE_BYTES)]
    for s in (scales,) if mins is None else (scales, mins):
        s = _padded(s.to(torch.float16), Q4_ROWS).reshape(u, Q4_ROWS, nb).transpose(1, 2)  # (unit, block, row)
        parts.append(s.contiguous().view(torch.uint8))
    return torch.cat(parts, dim=-1)


def unpack_q4(weight: torch.Tensor, out_features: int) -> Tuple[torch.Tensor, ...]:
    """The inverse of `pack_q4`: (out, K) values 0..15 and (out, K / 32) scales, and mins for Q4_1 (a block of
    320 bytes; Q4_0's are given back as -8 times the scales, what a checkpoint stores for it)."""
    u, nb, block = weight.shape
    p = weight[..., :Q4_VALUE_BYTES].reshape(u, nb, 1, QK // 8, 2, ROWS, 4)
    v = torch.cat([p & 0x0F, p >> 4], dim=2).permute(0, 4, 5, 1, 2, 3, 6)  # (unit, half, row, block, nibble, p, col)
    values = v.reshape(u * Q4_ROWS, nb * QK)[:out_features]

    def halves(start):
        h = weight[..., start:start + 2 * Q4_ROWS].contiguous().view(torch.float16)  # (unit, block, row)
        return h.transpose(1, 2).reshape(u * Q4_ROWS, nb)[:out_features]

    scales = halves(Q4_VALUE_BYTES)
    mins = halves(Q4_VALUE_BYTES + 2 * Q4_ROWS) if block == q4_block_bytes(True) else scales * -8
    return values, scales, mins
