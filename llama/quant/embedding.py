"""The token embedding held as a GGUF file stores it: quantized rows, each dequantized when a token looks it up.

`llama-convert` keeps a GGUF's Q8_0, Q4_0 or Q4_1 embedding in llama/quant/format.py's layout, the linear
layers' layout with a row per token (int8 values, or int4 two a byte, in groups of 32 columns with a float16
scale and, for int4, a float16 minimum). `QuantizedEmbedding` holds those tensors as buffers, so that its
`state_dict()` is the on-disk layout, and a lookup gathers the rows of the tokens fed and dequantizes only
them: in float32, as `gguf.quants.dequantize` computes them (the same values bit for bit: tests/quant/test_embedding.py),
then rounded to the model's dtype, which is what a float embedding converted from the same file would hold.
A table of 49,152 x 576 (the default model's) so takes 30 MB rather than 113 MB in float32, and a decode step
reads one row of it per sequence.

`swap_embedding` puts one in place of a built model's `nn.Embedding` at load time, as llama/quant/quantize.py swaps
the linear layers; `model.py` knows nothing of it. Under model parallelism each rank holds a slice of every
row's columns, as Meta splits the embedding's width (llama/nn/sharding.py): a whole number of groups, with their
scales, since the loader refuses a checkpoint whose groups do not divide among the ranks. The slice's rows are
dequantized on each rank and gathered by the all-gather hook, which moves to the new module.
"""

from typing import Optional

import torch
from torch import nn

from llama.quant.format import METHODS, SCALE_DTYPE, dequantize


class QuantizedEmbedding(nn.Module):
    """nn.Embedding over int8 or int4 rows with a float16 scale (and minimum) per group of columns.

    Args:
        num_embeddings: rows of the table (the vocabulary).
        embedding_dim: columns of the table (this rank's slice of them under model parallelism).
        method: "int8" (w = q * scale) or "int4" (w = q * scale + min, two values a byte, column 2j low).
        group_size: columns per scale; None (int8 only) is one scale per row.
        dtype: what a lookup returns, the model's dtype: the float32 values rounded to it.
    """

    def __init__(self, num_embeddings: int, embedding_dim: int, method: str, group_size: Optional[int],
                 dtype: torch.dtype):
        super().__init__()
        assert method in METHODS, method
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.method, self.group_size, self.dtype = method, group_size or embedding_dim, dtype
        assert embedding_dim % self.group_size == 0, (embedding_dim, self.group_size)
        n_groups = embedding_dim // self.group_size
        if method == "int8":
            self.register_buffer("weight", torch.empty(num_embeddings, embedding_dim, dtype=torch.int8, device="meta"))
        else:
            self.register_buffer("weight", torch.empty(num_embeddings, embedding_dim // 2, dtype=torch.uint8,
                                                       device="meta"))
        self.register_buffer("scales", torch.empty(num_embeddings, n_groups, dtype=SCALE_DTYPE, device="meta"))
        self.register_buffer("mins", torch.empty_like(self.scales) if method == "int4" else None)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """(...) token ids -> (..., embedding_dim) rows in `dtype`."""
        ids = tokens.reshape(-1)
        mins = None if self.mins is None else self.mins[ids]
        rows = dequantize(self.weight[ids], self.scales[ids], mins)  # (n, embedding_dim) float32
        return rows.to(self.dtype).view(*tokens.shape, self.embedding_dim)

    def extra_repr(self) -> str:
        return (f"{self.num_embeddings}, {self.embedding_dim}, {self.method}, group_size={self.group_size}, "
                f"dtype={self.dtype}")


def swap_embedding(model: nn.Module, method: str, group_size: Optional[int], dtype: torch.dtype) -> nn.Module:
    """Replace `model.tok_embeddings` by an empty (meta-device) QuantizedEmbedding of its shape, in place.

    Its tensors are then assigned by load_state_dict(assign=True). Forward hooks (model parallelism's
    all-gather) move to the new module. Returns the model.
    """
    old = model.tok_embeddings
    num_embeddings, embedding_dim = old.weight.shape
    new = QuantizedEmbedding(num_embeddings, embedding_dim, method, group_size, dtype)
    new._forward_hooks.update(old._forward_hooks)
    model.tok_embeddings = new
    return model
