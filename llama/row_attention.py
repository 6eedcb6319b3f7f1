"""Attention computed one query row at a time in one fixed order, for models on the integer kernels.

Rounding activations to int8 (llama/int_linears.py) amplifies tiny differences: the 1e-7 by which torch's
fused attention gives a position's output when it is computed alone (a cached step) or among all positions
(an uncached pass) becomes, now and then, a step of a whole int8 unit in some activation, and those steps
multiply through the layers until cached and uncached greedy text part. `RowExactAttention` calls
`torch.ops.llama_kv.attention`, whose rows do not depend on the rows beside them or on the keys their mask
hides; with the integer kernels, whose rows are independent too, cached and uncached runs then give the
same logits bit for bit. `llama.linears.choose_layer_classes` swaps it in with them.
"""

from typing import Optional

import torch

from llama.model import ScaledDotProductAttention


class RowExactAttention(ScaledDotProductAttention):
    """The same attention as its base class, each query row computed alone in one fixed order (CPU)."""

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Optional[torch.Tensor]) -> torch.Tensor:
        return torch.ops.llama_kv.attention(q, k, v, mask)
