"""A static per-layer cache of attention keys and values, written in place."""

from typing import Tuple

import torch
from torch import nn


class KVCache(nn.Module):
    """Keys and values of one attention layer for the positions seen so far.

    Sized by KV heads, not query heads: with grouped-query attention the cache is n_heads / n_kv_heads
    times smaller than a per-query-head cache would be. The buffers are allocated once, for the run at
    hand, and every step writes its new positions in place.

    Args:
        batch_size: rows in the batch this cache serves.
        max_seq_len: positions it can hold; writing past them raises.
        n_kv_heads: key/value heads of the layer (after any model-parallel split).
        head_dim: width of each head.
        dtype, device: those of the model's activations.
    """

    def __init__(
        self,
        batch_size: int,
        max_seq_len: int,
        n_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
    ):
        super().__init__()
        shape = (batch_size, n_kv_heads, max_seq_len, head_dim)
        self.register_buffer("cache_k", torch.zeros(shape, dtype=dtype, device=device), persistent=False)
        self.register_buffer("cache_v", torch.zeros(shape, dtype=dtype, device=device), persistent=False)

    @property
    def batch_size(self) -> int:
        return self.cache_k.shape[0]

    @property
    def max_seq_len(self) -> int:
        return self.cache_k.shape[2]

    @property
    def nbytes(self) -> int:
        return self.cache_k.nbytes + self.cache_v.nbytes

    def reset(self) -> None:
        self.cache_k.zero_()
        self.cache_v.zero_()

    def update(self, start_pos: int, xk: torch.Tensor, xv: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        """Write keys and values for positions start_pos .. start_pos + seqlen - 1.

        Args:
            start_pos: position of the first new token.
            xk, xv: (bsz, n_kv_heads, seqlen, head_dim) keys and values of the new tokens.

        Returns:
            Views of the cached keys and values for positions 0 .. start_pos + seqlen - 1,
            each (bsz, n_kv_heads, start_pos + seqlen, head_dim).

        Raises:
            ValueError: the write would go past the end of the cache, or the batch does not fit it.
        """
        bsz, _, seqlen, _ = xk.shape
        end = start_pos + seqlen
        if start_pos < 0 or end > self.max_seq_len:
            raise ValueError(
                f"KV cache overflow: positions {start_pos}..{end - 1} do not fit a cache of "
                f"{self.max_seq_len} positions"
            )
        if bsz > self.batch_size:
            raise ValueError(f"a batch of {bsz} rows does not fit a KV cache built for {self.batch_size}")
        self.cache_k[:bsz, :, start_pos:end] = xk
        self.cache_v[:bsz, :, start_pos:end] = xv
        return self.cache_k[:bsz, :, :end], self.cache_v[:bsz, :, :end]
