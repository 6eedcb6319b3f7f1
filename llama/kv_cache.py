"""A static per-layer cache of attention keys and values, written in place.

`KVCache` gives each row of a batch its own contiguous positions. `PagedKVCache` holds every layer's keys
and values in fixed-size blocks that many sequences share, each reading its own blocks through a table
(vLLM's paged layout): the memory of a server that holds many sequences of different lengths at once.
Both take per-row positions as a tensor (`update_at`), so one batched step serves rows at different
positions and no Python number decides where a write goes.
"""

from typing import List, Sequence, Tuple

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

    @classmethod
    def wrap(cls, cache_k: torch.Tensor, cache_v: torch.Tensor) -> "KVCache":
        """A cache over existing (batch, n_kv_heads, max_seq_len, head_dim) tensors, written in place: how an
        exported step (llama/compile/aot.py) takes its caches as inputs."""
        cache = cls.__new__(cls)
        nn.Module.__init__(cache)
        cache.register_buffer("cache_k", cache_k, persistent=False)
        cache.register_buffer("cache_v", cache_v, persistent=False)
        return cache

    @property
    def batch_size(self) -> int:
        return self.cache_k.shape[0]

    @property
    def max_seq_len(self) -> int:
        return self.cache_k.shape[2]

    @property
    def kv_len(self) -> int:
        """Key columns `update_at` returns: every position the cache holds."""
        return self.max_seq_len

    @property
    def nbytes(self) -> int:
        return self.cache_k.nbytes + self.cache_v.nbytes

    def reset(self) -> None:
        self.cache_k.zero_()
        self.cache_v.zero_()

    def update_at(self, input_pos: torch.Tensor, xk: torch.Tensor, xv: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        """Write each row's keys and values at its positions (gpt-fast's `input_pos`).

        Args:
            input_pos: (bsz, seqlen) positions of the new tokens, row by row, or (1, seqlen) shared by every row.
            xk, xv: (bsz, n_kv_heads, seqlen, head_dim) keys and values of the new tokens.

        Returns:
            The rows' whole caches, each (bsz, n_kv_heads, max_seq_len, head_dim): column j holds position j.
            What lies past a row's positions is stale and must be masked (`model.positions_mask`).

        Raises:
            ValueError: a position is outside the cache, or the batch does not fit it.
        """
        bsz = xk.shape[0]
        if bsz > self.batch_size:
            raise ValueError(f"a batch of {bsz} rows does not fit a KV cache built for {self.batch_size}")
        _check_positions(input_pos, self.max_seq_len)
        if input_pos.shape[0] == 1:  # one copy along the positions for all rows (advanced indexing is slower)
            self.cache_k[:bsz].index_copy_(2, input_pos[0], xk)
            self.cache_v[:bsz].index_copy_(2, input_pos[0], xv)
            return self.cache_k[:bsz], self.cache_v[:bsz]
        rows = torch.arange(bsz, device=input_pos.device)[:, None]  # (bsz, 1)
        self.cache_k[rows, :, input_pos] = xk.transpose(1, 2)  # indexed as (bsz, seqlen, n_kv_heads, head_dim)
        self.cache_v[rows, :, input_pos] = xv.transpose(1, 2)
        return self.cache_k[:bsz], self.cache_v[:bsz]


def describe_kv_cache(dtype: torch.dtype, bytes_per_token: int) -> str:
    """How the cache holds each token, as the commands say it: "float32, 46,080 bytes a token"."""
    return f"{str(dtype).removeprefix('torch.')}, {bytes_per_token:,} bytes a token"


def being_traced(x: torch.Tensor) -> bool:
    """Whether `x` is a tracer's stand-in (torch.compile's, or torch.export's) rather than a tensor being computed.

    Not `torch.compiler.is_compiling()`: that is one flag for the whole process, set while a step is exported or
    compiled on a background thread (llama/compile/aot.py), when the eager steps running meanwhile must stay eager."""
    return torch.compiler.is_dynamo_compiling() or type(x) is not torch.Tensor


def _check_positions(input_pos: torch.Tensor, limit: int) -> None:
    """Raise ValueError for a position outside 0 .. limit - 1 (skipped while compiling: an exported step
    cannot branch on a tensor's values, and an index out of range still fails there)."""
    if being_traced(input_pos) or input_pos.numel() == 0:
        return
    low, high = int(input_pos.min()), int(input_pos.max())
    if low < 0 or high >= limit:
        raise ValueError(f"KV cache overflow: positions {low}..{high} do not fit a cache of {limit} positions")


class PagedKVCache:
    """Keys and values of every layer in blocks of `block_size` positions, one pool that many sequences share.

    A sequence owns a list of blocks, its block table: its position p lives in block `table[p // block_size]`
    at offset `p % block_size`. Blocks need not be contiguous or in order, and two sequences may hold the
    same block (a shared prefix). Which block belongs to whom is decided outside (a scheduler); the pool
    only stores, copies and gathers.

    Args:
        shapes: (n_kv_heads, head_dim) of each layer.
        num_blocks: blocks in the pool.
        block_size: positions per block.
        dtype, device: those of the model's activations.
    """

    def __init__(self, shapes: Sequence[Tuple[int, int]], num_blocks: int, block_size: int,
                 dtype: torch.dtype, device: torch.device):
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"a paged KV cache needs at least one block of one position, not {num_blocks} x {block_size}")
        self.num_blocks, self.block_size = num_blocks, block_size
        # Laid out (n_kv_heads, positions, head_dim) so that gathering a row's positions gives each head's
        # keys contiguous, ready for attention after one transpose.
        self.keys = [torch.zeros((h, num_blocks * block_size, d), dtype=dtype, device=device) for h, d in shapes]
        self.values = [torch.zeros((h, num_blocks * block_size, d), dtype=dtype, device=device) for h, d in shapes]

    @classmethod
    def wrap(cls, keys: Sequence[torch.Tensor], values: Sequence[torch.Tensor], block_size: int) -> "PagedKVCache":
        """A pool over existing per-layer (n_kv_heads, positions, head_dim) tensors, written in place: how an
        exported step (llama/compile/aot.py) takes the pool as inputs."""
        pool = cls.__new__(cls)
        pool.keys, pool.values = list(keys), list(values)
        pool.block_size, pool.num_blocks = block_size, keys[0].shape[1] // block_size
        return pool

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.keys + self.values)

    def copy_prefix(self, src: int, dst: int, n: int) -> None:
        """Copy positions 0 .. n - 1 of block `src` into block `dst`, in every layer."""
        if not 0 < n <= self.block_size:
            raise ValueError(f"cannot copy {n} positions of a block of {self.block_size}")
        a, b = src * self.block_size, dst * self.block_size
        for t in self.keys + self.values:
            t[:, b : b + n] = t[:, a : a + n]

    def block_tensor(self, block: int) -> torch.Tensor:
        """A copy of one block's keys and values in every layer: (n_layers, 2, n_kv_heads, block_size, head_dim),
        keys before values (what llama/server/disk_cache.py keeps on disk)."""
        a = block * self.block_size
        return torch.stack([torch.stack([k[:, a : a + self.block_size], v[:, a : a + self.block_size]])
                            for k, v in zip(self.keys, self.values)])

    def load_block(self, block: int, kv: torch.Tensor) -> None:
        """Write one block's keys and values in every layer, from a tensor shaped as `block_tensor` returns.

        Raises:
            ValueError: the tensor's shape or dtype is not this cache's.
        """
        expected = (len(self.keys), 2, *self.keys[0].shape[:1], self.block_size, self.keys[0].shape[2])
        if tuple(kv.shape) != expected or kv.dtype != self.keys[0].dtype:
            raise ValueError(f"a block of {tuple(kv.shape)} {kv.dtype} does not fit a cache of {expected} "
                             f"{self.keys[0].dtype} blocks")
        a = block * self.block_size
        for layer, (k, v) in enumerate(zip(self.keys, self.values)):
            k[:, a : a + self.block_size] = kv[layer, 0]
            v[:, a : a + self.block_size] = kv[layer, 1]

    def for_step(self, block_tables: torch.Tensor, input_pos: torch.Tensor) -> List["PagedLayerCache"]:
        """Per-layer caches for one forward of rows with these block tables, feeding tokens at `input_pos`.

        Args:
            block_tables: (bsz, max_blocks) each row's blocks in order; a row with fewer pads with any
                valid block (its columns lie past the row's positions and are masked).
            input_pos: (bsz, seqlen) positions of the tokens fed, each inside its row's table.
        """
        bs = self.block_size
        _check_positions(input_pos, block_tables.shape[1] * bs)
        # Flat indices into the pool: where each new token's keys go, and where each row's position j is read.
        write = torch.gather(block_tables, 1, input_pos // bs) * bs + input_pos % bs  # (bsz, seqlen)
        offsets = torch.arange(bs, device=block_tables.device)
        read = (block_tables[:, :, None] * bs + offsets).flatten(1)  # (bsz, max_blocks * block_size)
        return [PagedLayerCache(k, v, write, read) for k, v in zip(self.keys, self.values)]


class PagedLayerCache:
    """One layer of a `PagedKVCache`, bound to one step's block tables; made by `PagedKVCache.for_step`."""

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, write: torch.Tensor, read: torch.Tensor):
        self.keys, self.values, self.write, self.read = keys, values, write, read

    @property
    def kv_len(self) -> int:
        return self.read.shape[1]

    def update_at(self, input_pos: torch.Tensor, xk: torch.Tensor, xv: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        """Write the new keys and values into their rows' blocks; return each row's positions gathered in order.

        Args:
            input_pos: (bsz, seqlen) positions of the new tokens (already folded into this step's indices).
            xk, xv: (bsz, n_kv_heads, seqlen, head_dim) keys and values of the new tokens.

        Returns:
            (bsz, n_kv_heads, kv_len, head_dim) keys and values: column j holds position j of the row.
        """
        bsz, n_kv_heads, _, head_dim = xk.shape
        # index_copy_ / index_select with flat indices: advanced indexing with a 2-D index is three orders of
        # magnitude slower on the CPU (it walks the whole pool).
        index = self.write.flatten()
        self.keys.index_copy_(1, index, xk.transpose(0, 1).reshape(n_kv_heads, -1, head_dim))  # (n_kv_heads, bsz * seqlen, head_dim)
        self.values.index_copy_(1, index, xv.transpose(0, 1).reshape(n_kv_heads, -1, head_dim))
        read = self.read.flatten()
        shape = (n_kv_heads, bsz, self.kv_len, head_dim)
        # (n_kv_heads, bsz, kv_len, head_dim) -> (bsz, n_kv_heads, kv_len, head_dim)
        keys = self.keys.index_select(1, read).view(shape).transpose(0, 1)
        return keys, self.values.index_select(1, read).view(shape).transpose(0, 1)
