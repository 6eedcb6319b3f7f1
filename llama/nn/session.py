"""A KV cache that outlives one `generate` call, and knows which tokens it holds.

A `Session` serves one sequence (batch 1). It keeps the per-layer caches of a whole context
(`max_seq_len` positions) together with the token ids whose keys and values sit at positions
0 .. len(tokens) - 1. The next prompt is compared with those ids, not with any idea of what a chat
prompt looks like: the longest common prefix is reused as it is, and everything after it is fed again,
overwriting whatever the cache held there. A prompt that diverges early simply reuses less.

Reusing a prefix is the same computation as the cached path's chunked prefill (the prefix's keys and
values are what feeding it would produce), so the logits and greedy tokens equal a fresh run's.
"""

from typing import List, Optional, Sequence, Tuple

import torch

from llama.runtime.devices import check_fits
from llama.kv_cache import KVCache
from llama.model import Transformer


def common_prefix_len(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading token ids `a` and `b` share."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


class Session:
    """One sequence's KV cache, kept between calls, with the token ids it holds.

    Pass it to `Llama.generate(..., session=session)`: the call feeds only the prompt's tokens after the
    longest prefix the session already holds, and leaves the session holding the prompt and the tokens
    generated after it (all but the last, which was sampled and never fed).

    Args:
        model: the model whose keys and values the cache holds, for up to its max_seq_len positions.
    """

    def __init__(self, model: Transformer):
        self.model = model
        self.max_seq_len = model.params.max_seq_len
        self.cache: Optional[List[KVCache]] = None  # allocated at first use
        self.tokens: List[int] = []
        self.last_reused = 0  # of the last call: prompt tokens taken from the cache
        self.last_prefilled = 0  # and prompt tokens fed to the model

    @property
    def nbytes(self) -> int:
        return sum(c.nbytes for c in self.cache) if self.cache else 0

    def reset(self) -> None:
        """Forget what the cache holds (its memory stays allocated for the next call)."""
        self.tokens = []

    def caches(self) -> List[KVCache]:
        """The per-layer caches, allocated on first use."""
        if self.cache is None:
            check_fits(self.model.kv_cache_nbytes(1, self.max_seq_len), self.model.device,
                       f"a session's KV cache of {self.max_seq_len} positions")
            self.cache = self.model.new_kv_cache(1, self.max_seq_len)
        return self.cache

    def begin(self, prompt: Sequence[int], reuse: bool = True) -> Tuple[List[KVCache], int]:
        """Prepare to run `prompt`: returns the caches and the position to start feeding from.

        At least the prompt's last token is always fed, since its logits choose the first new token.
        `reuse=False` feeds the whole prompt (for callers that need the logits of every prompt position).
        """
        if len(prompt) > self.max_seq_len:
            raise ValueError(f"a prompt of {len(prompt)} tokens does not fit a session of {self.max_seq_len} positions")
        start = min(common_prefix_len(self.tokens, prompt), len(prompt) - 1) if reuse else 0
        # Positions from `start` on are about to be overwritten; until the call ends the cache holds only the
        # prefix, so an interrupted call leaves the session consistent.
        self.tokens = list(prompt[:start])
        self.last_reused, self.last_prefilled = start, len(prompt) - start
        return self.caches(), start

    def end(self, fed: Sequence[int]) -> None:
        """Record the tokens whose keys and values the call wrote: positions 0 .. len(fed) - 1."""
        assert len(fed) <= self.max_seq_len
        self.tokens = list(fed)

    def keep(self, n: int) -> None:
        """Hold only the first n tokens (the rest will be overwritten by a later call)."""
        self.tokens = self.tokens[:n]

    def kv_tensors(self) -> List[Tuple[torch.Tensor, torch.Tensor]]:
        """Per layer, (keys, values) of the positions held as the cache holds them: each (n_kv_heads, len(tokens),
        width) in the cache's dtype (int8 rows with their scales: llama/kv_cache.py)."""
        n = len(self.tokens)
        return [(c.cache_k[0, :, :n], c.cache_v[0, :, :n]) for c in (self.cache or [])]

    def load(self, tokens: Sequence[int], kv: Sequence[Tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Hold `tokens`, whose per-layer (keys, values) are `kv`, as `kv_tensors` returns them.

        Raises:
            ValueError: the tensors do not fit this model's caches.
        """
        n = len(tokens)
        caches = self.caches()
        if n > self.max_seq_len:
            raise ValueError(f"{n} cached tokens do not fit a session of {self.max_seq_len} positions")
        if len(kv) != len(caches):
            raise ValueError(f"{len(kv)} layers of keys and values for a model of {len(caches)} layers")
        for c, (k, v) in zip(caches, kv):
            expected = (c.cache_k.shape[1], n, c.cache_k.shape[3])
            if tuple(k.shape) != expected or tuple(v.shape) != expected:
                raise ValueError(f"keys and values of shape {tuple(k.shape)} where {expected} belongs")
            if k.dtype != c.dtype or v.dtype != c.dtype:
                raise ValueError(f"keys and values in {k.dtype} where the cache holds {c.dtype}")
        self.tokens = []
        for c, (k, v) in zip(caches, kv):
            c.cache_k[0, :, :n] = k
            c.cache_v[0, :, :n] = v
        self.tokens = list(tokens)
