"""The kernels' weight layout: quantized rows interleaved 8 at a time, 4 columns of each row side by side.

A group of 8 rows is stored block by block (32 columns); within a block, int8 values go in 8 runs of 32
bytes, run j holding columns 4j .. 4j + 3 of each of the 8 rows, so one broadcast activation word meets a
whole vector of weights and each 32-bit lane sums one row. int4 values go in 4 runs, the low nibbles holding
columns 4p .. 4p + 3 and the high nibbles columns 16 + 4p .. 16 + 4p + 3. Scales (and mins) are float16,
(groups, blocks, 8). Rows past the weight's end are zeros. csrc/kernels.h draws the same picture.
"""

from typing import Tuple

import torch

QK = 32
ROWS = 8


def groups(out_features: int) -> int:
    return -(-out_features // ROWS)


def _padded(t: torch.Tensor) -> torch.Tensor:
    extra = groups(t.shape[0]) * ROWS - t.shape[0]
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


def pack_q4_1(values: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor) -> Tuple[torch.Tensor, ...]:
    """(out, K) values 0..15, (out, K / 32) float16 scales and mins -> (groups, K / 32, 128) uint8 and two
    (groups, K / 32, 8)."""
    v = _padded(values.to(torch.uint8))
    g, nb = v.shape[0] // ROWS, v.shape[1] // QK
    v = v.reshape(g, ROWS, nb, 2, QK // 8, 4).permute(0, 2, 3, 4, 1, 5)  # (group, block, half, run p, row, col)
    packed = v[:, :, 0] | (v[:, :, 1] << 4)  # the first 16 columns low, the last 16 high
    return packed.reshape(g, nb, ROWS * QK // 2).contiguous(), _pack_scales(scales), _pack_scales(mins)


def unpack_q4_1(weight: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor,
                out_features: int) -> Tuple[torch.Tensor, ...]:
    """The inverse of `pack_q4_1`: (out, K) values 0..15 and (out, K / 32) scales and mins."""
    g, nb = weight.shape[:2]
    p = weight.reshape(g, nb, 1, QK // 8, ROWS, 4)
    v = torch.cat([p & 0x0F, p >> 4], dim=2).permute(0, 4, 1, 2, 3, 5)  # (group, row, block, half, run p, col)
    return (v.reshape(g * ROWS, nb * QK)[:out_features], _unpack_scales(scales, out_features),
            _unpack_scales(mins, out_features))
