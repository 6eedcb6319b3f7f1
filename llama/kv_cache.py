"""A static per-layer cache of attention keys and values, written in place.

`KVCache` gives each row of a batch its own contiguous positions. `PagedKVCache` holds every layer's keys
and values in fixed-size blocks that many sequences share, each reading its own blocks through a table
(vLLM's paged layout): the memory of a server that holds many sequences of different lengths at once.
Both take per-row positions as a tensor (`update_at`), so one batched step serves rows at different
positions and no Python number decides where a write goes.

Either may hold keys and values in a dtype other than the model's (`--kv-cache-dtype`): another float dtype,
rounded on write, or int8 in blocks of 32 along head_dim with one float32 scale each (llama.cpp's Q8_0 rule:
scale = max|x| / 127, q = round(x / scale)). An int8 row holds its head_dim values and then its scales' bytes,
so every tensor of the cache stays one int8 tensor that copies, gathers and files take as they are. The caches
give attention these rows as they are, and a bf16 cache its rows under float32 activations
(`torch.ops.llama_kv.attention` dequantizes or widens a block of keys at a time as it reads them; elsewhere the
model converts them first, `load_kv`), and the uncached pass stores its keys and values
the same way before attention (`KVRounding`): the same bits on the integer kernels, where every op is row-exact.
"""

from typing import List, Optional, Sequence, Tuple

import torch
from torch import nn

from llama.errors import LlamaError

# --kv-cache-dtype's choices; "auto" is the model's dtype.
KV_CACHE_DTYPES = {"auto": None, "float32": torch.float32, "bfloat16": torch.bfloat16, "int8": torch.int8}
KV_BLOCK = 32  # int8 values that share one scale, along head_dim
_SCALE = torch.float32  # an int8 block's scale: float32 rather than Q8_0's float16, so no range of activations
# overflows or underflows it and dequantizing multiplies by exactly the scale the values were rounded with


def resolve_kv_cache_dtype(name: Optional[str], model_dtype: torch.dtype) -> torch.dtype:
    """The dtype a KV cache holds keys and values in, from `kv_cache_dtype` ("auto", None: the model's).

    Raises:
        LlamaError: not one of KV_CACHE_DTYPES.
    """
    if name is None or name == "auto":
        return model_dtype
    if isinstance(name, torch.dtype) and name in KV_CACHE_DTYPES.values():
        return name
    if not isinstance(name, str) or name not in KV_CACHE_DTYPES:
        raise LlamaError(f"kv_cache_dtype={name} is not one of {', '.join(KV_CACHE_DTYPES)}")
    return KV_CACHE_DTYPES[name]


def _blocks(head_dim: int) -> int:
    """int8 blocks a head's row splits into: blocks of 32 where head_dim is a multiple of 32, else the whole head
    as one block (the tiny test models' heads of 8 or 16)."""
    return head_dim // KV_BLOCK if head_dim % KV_BLOCK == 0 else 1


def kv_row_width(head_dim: int, dtype: torch.dtype) -> int:
    """Elements of `dtype` a cache holds for one head at one position: head_dim, or for int8 head_dim values and
    then the bytes of their float32 scales."""
    return head_dim + _blocks(head_dim) * _SCALE.itemsize if dtype == torch.int8 else head_dim


def store_kv(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Keys or values (..., head_dim) as a cache of `dtype` holds them: (..., kv_row_width(head_dim, dtype))."""
    if dtype != torch.int8:
        return x.to(dtype)
    blocks = x.float().unflatten(-1, (_blocks(x.shape[-1]), -1))  # (..., n_blocks, block)
    scale = blocks.abs().amax(-1, keepdim=True) / 127
    q = torch.where(scale == 0, 0.0, blocks / scale).round().clamp(-127, 127).to(torch.int8).flatten(-2)
    return torch.cat([q, scale.squeeze(-1).contiguous().view(torch.int8)], dim=-1)  # the scales' bytes after the values


def load_kv(rows: torch.Tensor, head_dim: int, dtype: torch.dtype) -> torch.Tensor:
    """Rows as `store_kv` gives them, back to (..., head_dim) keys or values in `dtype` (int8: dequantized)."""
    if rows.dtype != torch.int8:
        return rows.to(dtype)
    q = rows[..., :head_dim].unflatten(-1, (_blocks(head_dim), -1))  # (..., n_blocks, block)
    scale = rows[..., head_dim:].contiguous().view(_SCALE)  # (..., n_blocks)
    return (q.float() * scale[..., None]).flatten(-2).to(dtype)


def as_read(rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A cache's rows as attention takes them: int8 rows, and bf16 rows for float32 activations, as stored (the model
    converts them where its attention cannot read them, `ScaledDotProductAttention.reads_cache_rows`); other float rows in the
    activations' dtype."""
    if rows.dtype == torch.int8 or (rows.dtype == torch.bfloat16 and dtype == torch.float32):
        return rows
    return rows.to(dtype)


def round_kv(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x as a cache of `dtype` gives it back: what the uncached pass attends over, so that it reads the same keys
    and values as the cached path does."""
    return load_kv(store_kv(x, dtype), x.shape[-1], x.dtype)


class KVRounding:
    """The uncached pass's stand-in for a layer's cache when the cache would hold another dtype: it keeps nothing
    and gives the new keys and values back as a cache of `dtype` would: int8 rows (`store_kv`), or rounded to
    another float dtype (`round_kv`)."""

    def __init__(self, dtype: torch.dtype):
        self.dtype = dtype

    def update_at(self, input_pos: torch.Tensor, xk: torch.Tensor, xv: torch.Tensor,
                  kv_len: Optional[int] = None) -> Tuple[torch.Tensor, torch.Tensor]:
        if self.dtype == torch.int8:
            return store_kv(xk, self.dtype), store_kv(xv, self.dtype)
        return round_kv(xk, self.dtype), round_kv(xv, self.dtype)


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
        dtype: what it holds keys and values in: the model's dtype, another float dtype, or int8 (blocks with
            their scales, `store_kv`); `update_at` returns float ones in the dtype they were given in, int8 rows
            as they are.
        device: that of the model's activations.
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
        shape = (batch_size, n_kv_heads, max_seq_len, kv_row_width(head_dim, dtype))
        self.register_buffer("cache_k", torch.zeros(shape, dtype=dtype, device=device), persistent=False)
        self.register_buffer("cache_v", torch.zeros(shape, dtype=dtype, device=device), persistent=False)

    @classmethod
    def wrap(cls, cache_k: torch.Tensor, cache_v: torch.Tensor) -> "KVCache":
        """A cache over existing (batch, n_kv_heads, max_seq_len, kv_row_width) tensors, written in place: how an
        exported step (llama/compile/aot.py) takes its caches as inputs. An int8 cache's scales are read and written
        through a bitcast of their bytes (`store_kv`), which exports and compiles as it runs eagerly."""
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

    @property
    def dtype(self) -> torch.dtype:
        """What it holds keys and values in."""
        return self.cache_k.dtype

    def reset(self) -> None:
        self.cache_k.zero_()
        self.cache_v.zero_()

    def update_at(self, input_pos: torch.Tensor, xk: torch.Tensor, xv: torch.Tensor,
                  kv_len: Optional[int] = None) -> Tuple[torch.Tensor, torch.Tensor]:
        """Write each row's keys and values at its positions (gpt-fast's `input_pos`).

        Args:
            input_pos: (bsz, seqlen) positions of the new tokens, row by row, or (1, seqlen) shared by every row.
            xk, xv: (bsz, n_kv_heads, seqlen, head_dim) keys and values of the new tokens.
            kv_len: key columns to return (all max_seq_len when None).

        Returns:
            The rows' caches, each (bsz, n_kv_heads, kv_len, head_dim) as `as_read` gives them (xk's dtype, or the
            stored bf16 rows under float32 activations), or for int8 the stored rows (bsz, n_kv_heads, kv_len,
            kv_row_width): column j holds position j. What lies past a row's positions is
            stale and must be masked (`model.positions_mask`).

        Raises:
            ValueError: a position is outside the cache, or the batch does not fit it.
        """
        bsz = xk.shape[0]
        if bsz > self.batch_size:
            raise ValueError(f"a batch of {bsz} rows does not fit a KV cache built for {self.batch_size}")
        _check_positions(input_pos, self.max_seq_len)
        dtype = xk.dtype
        xk, xv = store_kv(xk, self.dtype), store_kv(xv, self.dtype)  # the same tensors where dtype is the model's
        if input_pos.shape[0] == 1:  # one copy along the positions for all rows (advanced indexing is slower)
            self.cache_k[:bsz].index_copy_(2, input_pos[0], xk)
            self.cache_v[:bsz].index_copy_(2, input_pos[0], xv)
        else:
            rows = torch.arange(bsz, device=input_pos.device)[:, None]  # (bsz, 1)
            self.cache_k[rows, :, input_pos] = xk.transpose(1, 2)  # indexed as (bsz, seqlen, n_kv_heads, width)
            self.cache_v[rows, :, input_pos] = xv.transpose(1, 2)
        kv_len = self.max_seq_len if kv_len is None else kv_len
        return as_read(self.cache_k[:bsz, :, :kv_len], dtype), as_read(self.cache_v[:bsz, :, :kv_len], dtype)


def describe_kv_cache(dtype: torch.dtype, bytes_per_token: int) -> str:
    """How the cache holds each token, as the commands say it: "float32, 46,080 bytes a token" ("int8, ..." counts
    the scales)."""
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
        dtype: what it holds keys and values in, as `KVCache`'s (int8: each position's row holds its scales).
        device: that of the model's activations.
    """

    def __init__(self, shapes: Sequence[Tuple[int, int]], num_blocks: int, block_size: int,
                 dtype: torch.dtype, device: torch.device):
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"a paged KV cache needs at least one block of one position, not {num_blocks} x {block_size}")
        self.num_blocks, self.block_size = num_blocks, block_size
        # Laid out (n_kv_heads, positions, width) so that gathering a row's positions gives each head's
        # keys contiguous, ready for attention after one transpose.
        layouts = [(h, num_blocks * block_size, kv_row_width(d, dtype)) for h, d in shapes]
        self.keys = [torch.zeros(shape, dtype=dtype, device=device) for shape in layouts]
        self.values = [torch.zeros(shape, dtype=dtype, device=device) for shape in layouts]

    @classmethod
    def wrap(cls, keys: Sequence[torch.Tensor], values: Sequence[torch.Tensor], block_size: int) -> "PagedKVCache":
        """A pool over existing per-layer (n_kv_heads, positions, kv_row_width) tensors, written in place: how an
        exported step (llama/compile/aot.py) takes the pool as inputs."""
        pool = cls.__new__(cls)
        pool.keys, pool.values = list(keys), list(values)
        pool.block_size, pool.num_blocks = block_size, keys[0].shape[1] // block_size
        return pool

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.keys + self.values)

    @property
    def dtype(self) -> torch.dtype:
        """What it holds keys and values in."""
        return self.keys[0].dtype

    def copy_prefix(self, src: int, dst: int, n: int) -> None:
        """Copy positions 0 .. n - 1 of block `src` into block `dst`, in every layer."""
        if not 0 < n <= self.block_size:
            raise ValueError(f"cannot copy {n} positions of a block of {self.block_size}")
        a, b = src * self.block_size, dst * self.block_size
        for t in self.keys + self.values:
            t[:, b : b + n] = t[:, a : a + n]

    def block_tensor(self, block: int) -> torch.Tensor:
        """A copy of one block's keys and values in every layer as the cache holds them: (n_layers, 2, n_kv_heads,
        block_size, width), keys before values (what llama/server/disk_cache.py keeps on disk); width is head_dim, or
        for int8 the values and their scales' bytes (`kv_row_width`)."""
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

    def update_at(self, input_pos: torch.Tensor, xk: torch.Tensor, xv: torch.Tensor,
                  kv_len: Optional[int] = None) -> Tuple[torch.Tensor, torch.Tensor]:
        """Write the new keys and values into their rows' blocks; return each row's positions gathered in order.

        Args:
            input_pos: (bsz, seqlen) positions of the new tokens (already folded into this step's indices).
            xk, xv: (bsz, n_kv_heads, seqlen, head_dim) keys and values of the new tokens.
            kv_len: unused: the step's block tables already say how many columns are read.

        Returns:
            (bsz, n_kv_heads, kv_len, head_dim) keys and values as `as_read` gives them, or for int8 the stored
            rows (bsz, n_kv_heads, kv_len, kv_row_width): column j holds position j of the row.
        """
        bsz, n_kv_heads = xk.shape[:2]
        dtype, width = xk.dtype, self.keys.shape[2]
        xk, xv = store_kv(xk, self.keys.dtype), store_kv(xv, self.keys.dtype)  # the same tensors in the model's dtype
        # index_copy_ / index_select with flat indices: advanced indexing with a 2-D index is three orders of
        # magnitude slower on the CPU (it walks the whole pool).
        index = self.write.flatten()
        # (n_kv_heads, bsz * seqlen, width)
        self.keys.index_copy_(1, index, xk.transpose(0, 1).reshape(n_kv_heads, -1, width))
        self.values.index_copy_(1, index, xv.transpose(0, 1).reshape(n_kv_heads, -1, width))
        read = self.read.flatten()
        shape = (n_kv_heads, bsz, self.kv_len, width)
        # (n_kv_heads, bsz, kv_len, width) -> (bsz, n_kv_heads, kv_len, width)
        keys = as_read(self.keys.index_select(1, read).view(shape).transpose(0, 1), dtype)
        return keys, as_read(self.values.index_select(1, read).view(shape).transpose(0, 1), dtype)
