"""The LLaMA-2 transformer in plain PyTorch, with Meta's parameter names and an optional KV cache."""

from dataclasses import dataclass
from typing import List, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import nn

from llama.kv_cache import KVCache, KVRounding, PagedKVCache, being_traced, kv_row_width, load_kv


@dataclass
class ModelArgs:
    """The fields of Meta's `params.json`, plus the limits of a run.

    `hidden_dim` is this project's addition: the feed-forward width stated outright, for models whose
    width Meta's `multiple_of` / `ffn_dim_multiplier` rule cannot express. When it is None (as in all of
    Meta's files) the rule decides.
    """

    dim: int = 4096
    n_layers: int = 32
    n_heads: int = 32
    n_kv_heads: Optional[int] = None
    vocab_size: int = -1  # -1: taken from the tokenizer when the checkpoint is loaded
    multiple_of: int = 256  # feed-forward width is rounded up to a multiple of this
    ffn_dim_multiplier: Optional[float] = None
    norm_eps: float = 1e-5

    max_batch_size: int = 32
    max_seq_len: int = 2048

    # After Meta's fields, so that ModelArgs built positionally as Meta's means the same.
    rope_theta: float = 10000.0
    hidden_dim: Optional[int] = None

    def __post_init__(self):
        if self.n_kv_heads is None:
            self.n_kv_heads = self.n_heads

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @property
    def ffn_hidden_dim(self) -> int:
        """The feed-forward width: `hidden_dim` if given, else Meta's rule applied to 4 * dim."""
        if self.hidden_dim is not None:
            return self.hidden_dim
        hidden = int(2 * (4 * self.dim) / 3)
        if self.ffn_dim_multiplier is not None:
            hidden = int(self.ffn_dim_multiplier * hidden)
        return self.multiple_of * ((hidden + self.multiple_of - 1) // self.multiple_of)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in float32 whatever the activations' dtype, as Meta's reference does; F.rms_norm is one
        # kernel where Meta's formula is five.
        normed = F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps)
        return normed.type_as(x) * self.weight


def rope_cis(head_dim: int, theta: float, positions: torch.Tensor) -> torch.Tensor:
    """e^(i * position * frequency) for each of `positions` (any shape): (*positions.shape, head_dim // 2) complex64.

    Meta's `precompute_freqs_cis` tabulates these for positions 0 .. 2 * max_seq_len once; here they are computed
    for the positions at hand on every call, in float32, so casting the model to bf16 never rounds them, no
    table has to be kept on the right device, and rows at positions of their own (a server's batch) get theirs.
    """
    freqs = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=positions.device)[: head_dim // 2].float() / head_dim))
    angles = positions.float()[..., None] * freqs  # (..., head_dim // 2): what Meta's torch.outer multiplies
    return torch.polar(torch.ones_like(angles), angles)


def positions_mask(input_pos: torch.Tensor, kv_len: int, dtype: torch.dtype) -> torch.Tensor:
    """(rows, seqlen, kv_len) additive mask: the token at position p sees key columns 0 .. p and nothing after.

    Key column j holds position j of the row, in a cache (`KVCache.update_at`) and in a pass without one (whose
    positions are 0 .. seqlen - 1): columns past a row's position hold the future, another sequence's
    leftovers or nothing, and are hidden alike. `input_pos` is (bsz, seqlen), or (1, seqlen) shared by every row.
    """
    cols = torch.arange(kv_len, device=input_pos.device)
    hidden = cols[None, None, :] > input_pos[:, :, None]  # (rows, seqlen, kv_len)
    return torch.zeros(hidden.shape, dtype=dtype, device=input_pos.device).masked_fill(hidden, float("-inf"))


def _check_whole_prefix(input_pos: torch.Tensor) -> None:
    """Without a cache a token sees only the tokens fed with it, so they must be its whole prefix, 0 .. seqlen - 1.
    Fed from a later position, they would be rotated as if something came before them and see nothing of it:
    fluent gibberish. (Not checked while tracing: an exported step cannot branch on a tensor's values.)"""
    if being_traced(input_pos):
        return
    expected = torch.arange(input_pos.shape[1], device=input_pos.device)
    if not torch.equal(input_pos, expected.expand_as(input_pos)):
        first = input_pos[:, 0].tolist()
        raise ValueError("without a KV cache the whole prefix must be fed from position 0 (positions 0 .. seqlen - 1 in "
                         f"every row), not from position {first[0] if len(set(first)) == 1 else first}; to feed tokens "
                         "at later positions, pass the cache that holds the earlier ones "
                         "(cache=model.new_kv_cache(bsz, max_seq_len), where Meta's model keeps one inside)")


def rotation_pairs(freqs_cis: torch.Tensor) -> torch.Tensor:
    """freqs_cis as (cos, sin) pairs that broadcast over (bsz, seqlen, n_heads, head_dim // 2, 2). Indexed as real
    numbers: a compiled step would call torch's dispatcher to index a complex tensor (twice a layer)."""
    freqs = torch.view_as_real(freqs_cis)  # (..., seqlen, head_dim // 2, 2)
    return freqs[None, :, None] if freqs_cis.dim() == 2 else freqs[:, :, None]


def apply_rotary_emb(x: torch.Tensor, freqs_cis: torch.Tensor) -> torch.Tensor:
    """Rotate each adjacent pair (x[2i], x[2i+1]) of every head, read as one complex number: Meta's layout.

    Eagerly as torch's complex product (three ops); while a step is compiled, written out in real numbers
    (`rotate_written_out`), which the compiler fuses into the kernels around it where it would call torch's
    dispatcher for every complex op, ten calls a layer.

    Args:
        x: (bsz, seqlen, n_heads, head_dim).
        freqs_cis: (seqlen, head_dim // 2) complex rotations shared by every row, or (bsz, seqlen, head_dim // 2)
            for rows at positions of their own.
    """
    if being_traced(x):
        return rotate_written_out(x, freqs_cis)
    x_complex = torch.view_as_complex(x.float().unflatten(-1, (-1, 2)))  # (bsz, seqlen, n_heads, head_dim // 2)
    freqs = torch.view_as_complex(rotation_pairs(freqs_cis))
    rotated = torch.view_as_real(x_complex * freqs)  # (bsz, seqlen, n_heads, head_dim // 2, 2)
    return rotated.flatten(-2).type_as(x)


def rotate_written_out(x: torch.Tensor, freqs_cis: torch.Tensor) -> torch.Tensor:
    """`apply_rotary_emb`'s rotation with the complex product written out, one rounding per operation, so that every
    element is rounded alike wherever it falls (torch's complex multiply rounds its SIMD body and its tail apart)."""
    real, imag = x.float().unflatten(-1, (-1, 2)).unbind(-1)  # each (bsz, seqlen, n_heads, head_dim // 2)
    freqs = rotation_pairs(freqs_cis)
    cos, sin = freqs[..., 0], freqs[..., 1]
    rotated = torch.stack([real * cos - imag * sin, real * sin + imag * cos], dim=-1)
    return rotated.flatten(-2).type_as(x)


class Rotary(nn.Module):
    """`apply_rotary_emb`. A module of its own, holding nothing, so that a model on the integer kernels can swap
    it for a row-exact one (llama/nn/row_attention.py)."""

    def forward(self, x: torch.Tensor, freqs_cis: torch.Tensor) -> torch.Tensor:
        return apply_rotary_emb(x, freqs_cis)


class ScaledDotProductAttention(nn.Module):
    """softmax(q k^T / sqrt(d) + mask) v, by torch's fused kernel. A module of its own, holding nothing, so that the
    layer plan can swap in the CPU kernels' attention (llama/nn/row_attention.py)."""

    def reads_cache_rows(self, q: torch.Tensor) -> bool:
        """Whether it takes an int8 or bf16 cache's rows as they are; this one takes them converted (`load_kv`)."""
        return False

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Optional[torch.Tensor]) -> torch.Tensor:
        return F.scaled_dot_product_attention(q, k.to(q.dtype), v.to(q.dtype), attn_mask=mask)


class Attention(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        # Head counts are plain attributes so a model-parallel transform can divide them after construction.
        self.n_heads = args.n_heads
        self.n_kv_heads = args.n_kv_heads
        self.head_dim = args.head_dim
        self.wq = nn.Linear(args.dim, args.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(args.dim, args.n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(args.dim, args.n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(args.n_heads * self.head_dim, args.dim, bias=False)
        self.rotate = Rotary()
        self.attend = ScaledDotProductAttention()

    def forward(self, x: torch.Tensor, freqs_cis: torch.Tensor, mask: torch.Tensor, cache: Optional[KVCache],
                input_pos: torch.Tensor) -> torch.Tensor:
        """Attention of x's tokens, at positions `input_pos`, over the keys of their rows up to themselves.

        Args:
            x: (bsz, seqlen, dim) activations.
            freqs_cis: (rows, seqlen, head_dim // 2) rotations of those positions (`rope_cis`).
            mask: (rows, seqlen, kv_len) additive mask (`positions_mask`); its width is how many key columns
                are read, so a cache filled up to kv_len is never read past it.
            cache: this layer's cache, which writes the new keys and values at `input_pos` and returns every
                column it holds (column j: position j); None to attend over the tokens fed alone.
            input_pos: (rows, seqlen) positions; rows is bsz, or 1 for positions every row shares.
        """
        bsz, seqlen, _ = x.shape
        n_rep = self.n_heads // self.n_kv_heads
        xq, xk, xv = self.project(x)
        xq = xq.view(bsz, seqlen, self.n_heads, self.head_dim)
        xk = xk.view(bsz, seqlen, self.n_kv_heads, self.head_dim)
        xv = xv.view(bsz, seqlen, self.n_kv_heads, self.head_dim)
        xq = self.rotate(xq, freqs_cis)
        xk = self.rotate(xk, freqs_cis)

        keys = xk.transpose(1, 2)  # (bsz, n_kv_heads, seqlen, head_dim)
        values = xv.transpose(1, 2)
        kv_len = mask.shape[-1]
        if cache is not None:
            keys, values = cache.update_at(input_pos, keys, values, kv_len)  # (bsz, n_kv_heads, >= kv_len, head_dim)
        keys, values = keys[:, :, :kv_len], values[:, :, :kv_len]
        if keys.dtype != xq.dtype and not self.attend.reads_cache_rows(xq):  # a cache's rows (llama/kv_cache.py)
            keys, values = load_kv(keys, self.head_dim, xq.dtype), load_kv(values, self.head_dim, xq.dtype)

        # Grouped-query attention without repeating keys and values: query head h reads KV head
        # h // n_rep, so the n_rep query heads of a group are folded into the sequence axis of one
        # attention over that group's KV head.
        xq = xq.view(bsz, seqlen, self.n_kv_heads, n_rep, self.head_dim)
        xq = xq.permute(0, 2, 3, 1, 4).reshape(bsz, self.n_kv_heads, n_rep * seqlen, self.head_dim)
        # A mask that broadcasts but does not cover exactly the keys read would not fail; it would silently let
        # tokens see the future or hide the past.
        assert mask.shape[0] in (1, bsz) and mask.shape[1:] == (seqlen, keys.shape[2]), \
            f"mask {tuple(mask.shape)} for {bsz} x {seqlen} queries, {keys.shape[2]} keys"
        # (rows, seqlen, kv_len) -> (bsz, 1, n_rep * seqlen, kv_len), matching the folded queries; rows sharing one
        # mask read it through a stride of 0.
        mask = mask.repeat(1, n_rep, 1).unsqueeze(1).expand(bsz, -1, -1, -1)
        out = self.attend(xq, keys, values, mask)
        # (bsz, n_kv_heads, n_rep * seqlen, head_dim) -> (bsz, seqlen, n_heads * head_dim)
        out = out.view(bsz, self.n_kv_heads, n_rep, seqlen, self.head_dim).permute(0, 3, 1, 2, 4)
        return self.wo(out.reshape(bsz, seqlen, -1))

    def project(self, x: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x's queries, keys and values: three products (llama/quant/fuse.py makes them one where that is faster)."""
        return self.wq(x), self.wk(x), self.wv(x)


class FeedForward(nn.Module):
    def __init__(self, dim: int, hidden_dim: int):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden_dim, bias=False)
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden_dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.project(x)
        return self.w2(F.silu(gate) * up)

    def project(self, x: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        """x's gate and up-projection: two products (llama/quant/fuse.py makes them one where that is faster)."""
        return self.w1(x), self.w3(x)


class TransformerBlock(nn.Module):
    def __init__(self, layer_id: int, args: ModelArgs):
        super().__init__()
        self.layer_id = layer_id
        self.attention = Attention(args)
        self.feed_forward = FeedForward(args.dim, args.ffn_hidden_dim)
        self.attention_norm = RMSNorm(args.dim, eps=args.norm_eps)
        self.ffn_norm = RMSNorm(args.dim, eps=args.norm_eps)

    def forward(self, x, freqs_cis, mask, cache, input_pos):
        h = x + self.attention(self.attention_norm(x), freqs_cis, mask, cache, input_pos)
        return h + self.feed_forward(self.ffn_norm(h))


def _embedding(num_embeddings: int, dim: int) -> nn.Embedding:
    """nn.Embedding, without the random init that a model built on the meta device would throw away."""
    if torch.empty(0).is_meta:
        # On the meta device nn.init.normal_ imports torch._dynamo, about 1.5 s of every start-up, to draw
        # nothing: Llama.build assigns the checkpoint's weights over these.
        return nn.Embedding.from_pretrained(torch.empty(num_embeddings, dim), freeze=False)
    return nn.Embedding(num_embeddings, dim)


class Transformer(nn.Module):
    """LLaMA-2. Builds on any device, the meta device included; it allocates nothing else.

    The KV cache is not part of the model: `forward` takes one (see `new_kv_cache`) or runs without.
    """

    def __init__(self, params: ModelArgs):
        super().__init__()
        if params.vocab_size <= 0:
            raise ValueError("ModelArgs.vocab_size must be set (a params.json with -1 takes it from the tokenizer)")
        self.params = params
        self.vocab_size = params.vocab_size
        self.n_layers = params.n_layers
        self.tok_embeddings = _embedding(params.vocab_size, params.dim)
        self.layers = nn.ModuleList(TransformerBlock(i, params) for i in range(params.n_layers))
        self.norm = RMSNorm(params.dim, eps=params.norm_eps)
        self.output = nn.Linear(params.dim, params.vocab_size, bias=False)
        self._kv_cache_dtype: Optional[torch.dtype] = None

    @property
    def device(self) -> torch.device:
        """Where the model's weights (and so its activations and caches) live."""
        return self.tok_embeddings.weight.device

    @property
    def dtype(self) -> torch.dtype:
        """The dtype the model computes in: its final norm's. (Not the embedding's, which a loader may hold
        quantized; quantized layers widen to this dtype.)"""
        return self.norm.weight.dtype

    @property
    def kv_cache_dtype(self) -> torch.dtype:
        """What the model's KV caches hold keys and values in: its own dtype unless set (`Llama.build`'s
        kv_cache_dtype, llama/kv_cache.py). Set to another, the uncached pass rounds its keys and values as such a
        cache would, so that both paths read the same keys and values."""
        return self._kv_cache_dtype or self.dtype

    @kv_cache_dtype.setter
    def kv_cache_dtype(self, dtype: Optional[torch.dtype]) -> None:
        self._kv_cache_dtype = dtype

    def kv_cache_nbytes(self, batch_size: int, max_seq_len: int) -> int:
        """Bytes that `new_kv_cache(batch_size, max_seq_len)` would allocate (int8: the scales included)."""
        dtype = self.kv_cache_dtype
        per_position = sum(2 * layer.attention.n_kv_heads * kv_row_width(layer.attention.head_dim, dtype)
                           for layer in self.layers)
        return per_position * batch_size * max_seq_len * dtype.itemsize

    def new_kv_cache(self, batch_size: int, max_seq_len: int, dtype: Optional[torch.dtype] = None) -> List[KVCache]:
        """One empty cache per layer for `batch_size` rows of up to `max_seq_len` positions.

        Sized from the layers themselves, so a model split across ranks gets caches of its local KV heads.
        """
        return [
            KVCache(batch_size, max_seq_len, layer.attention.n_kv_heads, layer.attention.head_dim,
                    dtype or self.kv_cache_dtype, self.device)
            for layer in self.layers
        ]

    def new_paged_kv_cache(self, num_blocks: int, block_size: int, dtype: Optional[torch.dtype] = None) -> PagedKVCache:
        """An empty pool of `num_blocks` blocks of `block_size` positions for every layer, shared by many rows.

        Sized from the layers themselves, as `new_kv_cache` is; it holds `kv_cache_nbytes(1, num_blocks * block_size)` bytes.
        """
        shapes = [(layer.attention.n_kv_heads, layer.attention.head_dim) for layer in self.layers]
        return PagedKVCache(shapes, num_blocks, block_size, dtype or self.kv_cache_dtype, self.device)

    def forward(
        self,
        tokens: torch.Tensor,
        start_pos: int = 0,
        cache: Optional[List[KVCache]] = None,
        num_logits: Optional[int] = None,
        input_pos: Optional[torch.Tensor] = None,
    ) -> torch.Tensor:
        """Logits for the tokens fed: Meta's signature, over `forward_at`.

        Args:
            tokens: (bsz, seqlen) ids at positions start_pos .. start_pos + seqlen - 1.
            start_pos: position of the first token. Without a cache the whole prefix must be fed, so it
                must be 0: tokens fed alone at a later position would see nothing before them.
            cache: per-layer KV caches holding positions 0 .. start_pos - 1, updated in place; None to
                run without one.
            num_logits: compute logits for only the last this many positions (all when None).
            input_pos: (bsz, seqlen) position of every token, for rows that each sit at positions of their
                own (a server's batch); start_pos is then unused (see `forward_at`).

        Returns:
            (bsz, num_logits or seqlen, vocab_size) float32 logits.
        """
        if input_pos is not None:
            return self.forward_at(tokens, input_pos, cache, num_logits)
        seqlen = tokens.shape[1]
        positions = torch.arange(start_pos, start_pos + seqlen, device=tokens.device)[None]  # (1, seqlen): every row's
        # The cache holds nothing past the tokens fed yet: its columns up to theirs are all a token may see.
        return self.forward_at(tokens, positions, cache, num_logits, kv_len=start_pos + seqlen)

    def forward_at(self, tokens: torch.Tensor, input_pos: torch.Tensor, cache: Optional[List[KVCache]] = None,
                   num_logits: Optional[int] = None, kv_len: Optional[int] = None) -> torch.Tensor:
        """Logits for tokens at the positions given: the model's one path (eager, compiled, batched, uncached).

        Args:
            tokens: (bsz, seqlen) ids.
            input_pos: (bsz, seqlen) position of every token, or (1, seqlen) positions every row shares. Each
                token is rotated by its position, its key and value are written at it, and it sees its row's
                positions up to its own. Without a cache they must be 0 .. seqlen - 1: the whole prefix.
            cache: per-layer caches that take positions (`KVCache`, or `PagedKVCache.for_step`'s layers), updated
                in place; None to run without one.
            num_logits: compute logits for only the last this many positions (all when None).
            kv_len: read only the first kv_len key columns of the cache (every column it holds when None), when
                the caller knows the later ones hold nothing yet; a Python number, so a compiled step, whose
                shapes must not depend on the positions, leaves it out.

        Returns:
            (bsz, num_logits or seqlen, vocab_size) float32 logits.
        """
        bsz, seqlen = tokens.shape
        if input_pos.dim() != 2 or input_pos.shape[0] not in (1, bsz) or input_pos.shape[1] != seqlen:
            raise ValueError(f"input_pos {tuple(input_pos.shape)} must be ({bsz}, {seqlen}) or (1, {seqlen}) "
                             f"for tokens {tuple(tokens.shape)}")
        if cache is None:
            _check_whole_prefix(input_pos)
            kv_len = seqlen
            if self.kv_cache_dtype != self.dtype:  # keys and values rounded as the cache would hold them
                cache = [KVRounding(self.kv_cache_dtype)] * self.n_layers
        elif len(cache) != self.n_layers:
            raise ValueError(f"expected {self.n_layers} layer caches, got {len(cache)}")
        elif kv_len is None:
            kv_len = cache[0].kv_len
        h = self.tok_embeddings(tokens)  # (bsz, seqlen, dim)
        freqs_cis = rope_cis(self.params.head_dim, self.params.rope_theta, input_pos)  # (rows, seqlen, head_dim // 2)
        mask = positions_mask(input_pos, kv_len, h.dtype)  # (rows, seqlen, kv_len)
        for i, layer in enumerate(self.layers):
            h = layer(h, freqs_cis, mask, None if cache is None else cache[i], input_pos)
        return self._logits(h, num_logits)

    def _logits(self, h: torch.Tensor, num_logits: Optional[int]) -> torch.Tensor:
        if num_logits is not None:
            h = h[:, -num_logits:]
        return self.output(self.norm(h)).float()
