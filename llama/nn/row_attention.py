"""Attention, rotary embedding and norms on the CPU kernels: over a cache's rows as stored, and row by row in one fixed
order for models on the integer kernels.

`KernelAttention` is the attention of every CPU model with the kernels loaded: a step's few rows, and any over an int8
cache, through `torch.ops.llama_kv.attention`, which reads the cache's rows as they are stored.

Rounding activations to int8 (llama/quant/dot_linears.py) amplifies tiny differences: the 1e-7 by which torch's
fused attention gives a position's output when it is computed alone (a cached step) or among all positions
(an uncached pass) becomes, now and then, a step of a whole int8 unit in some activation, and those steps
multiply through the layers until cached and uncached greedy text part. `RowExactAttention` calls
`torch.ops.llama_kv.attention`, whose rows do not depend on the rows beside them or on the keys their mask
hides; with the integer kernels, whose rows are independent too, cached and uncached runs then give the
same logits bit for bit. `RowExactRotary` does the same for the rotary embedding: torch's complex multiply
rounds some elements differently by where they fall in its vectors (fused in the SIMD body, not in the tail),
so a position rotated alone and among others could differ in the last bit (it did under torchrun, one head
of 8 dimensions a rank). `RowExactRMSNorm` calls `torch.ops.llama_kv.rms_norm`: torch's rms_norm and the
reduction Inductor compiles for it sum the squares in different orders, so the compiled decode step and the
eager uncached pass normalised some rows a bit apart. The layer plan (llama/quant/layer_plan.py) swaps all three in
with the integer kernels.
"""

from typing import Optional

import torch

from llama import kernels
from llama.kv_cache import being_traced
from llama.model import RMSNorm, Rotary, ScaledDotProductAttention, rotate_written_out

# Query rows (a KV head's, grouped-query heads folded in) up to which attention on the CPU runs `llama_kv.attention`
# rather than torch's fused kernel: a decode step's. It reads a bf16 cache's rows as they are, where converting them
# writes and reads the cache again, and shares a step's few rows among the threads by parts of the keys. A prompt's
# many rows are arithmetic, where the fused kernel is faster (docs/benchmarks.md, "Figures behind the code").
FEW_ROWS = 64


class KernelAttention(ScaledDotProductAttention):
    """The same attention as its base class, over an int8 cache's rows and for a step's few float32 rows on the CPU
    (`FEW_ROWS`) by `llama_kv.attention`, which dequantizes or widens each key and value as it reads them: the same
    bits as converting the cache first. The layer plan swaps it in on the CPU wherever the kernels are loaded."""

    def reads_cache_rows(self, q: torch.Tensor) -> bool:
        return q.device.type == "cpu" and q.dtype == torch.float32

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Optional[torch.Tensor]) -> torch.Tensor:
        if k.dtype == torch.int8 or (q.shape[-2] <= FEW_ROWS and self.reads_cache_rows(q)):
            return torch.ops.llama_kv.attention(q, k, v, mask)
        return super().forward(q, k, v, mask)


class RowExactAttention(KernelAttention):
    """The same attention as its base class, each query row computed alone in one fixed order (CPU). A bf16 cache's
    rows are widened once for a prompt's many query rows rather than again by each tile of them as it reads them:
    the same bits (widening is exact)."""

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Optional[torch.Tensor]) -> torch.Tensor:
        if k.dtype == torch.bfloat16 and q.dtype == torch.float32 and q.shape[-2] > FEW_ROWS:
            k, v = k.float(), v.float()
        return torch.ops.llama_kv.attention(q, k, v, mask)


class RowExactRotary(Rotary):
    """The same rotation as its base class, written out in real numbers eagerly too (`rotate_written_out`): by
    `torch.ops.llama_kv.rotary` in one pass where the kernels are loaded and take it (float32 on the CPU), the
    same operations and roundings as the ten torch ops of the written-out form, which a compiled step fuses into
    its own code."""

    def forward(self, x: torch.Tensor, freqs_cis: torch.Tensor) -> torch.Tensor:
        if (being_traced(x) or not kernels.loaded() or x.dtype != torch.float32 or x.device.type != "cpu"
                or x.stride(-1) != 1):
            return rotate_written_out(x, freqs_cis)
        pairs = torch.view_as_real(freqs_cis)  # (positions, head_dim // 2, 2), or (batch, positions, ...)
        if pairs.shape[:-2] not in (x.shape[1:2], x.shape[:2]):
            return rotate_written_out(x, freqs_cis)
        return torch.ops.llama_kv.rotary(x, pairs)


class RowExactRMSNorm(RMSNorm):
    """The same normalisation as its base class, each row's squares summed in one fixed order by
    `torch.ops.llama_kv.rms_norm`, eagerly and in a compiled step alike (CPU)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.llama_kv.rms_norm(x, self.weight, self.eps)
