"""Perplexity of a model over a text, scored in windows of a fixed number of tokens.

How windows are formed and scored (llama.cpp's `llama-perplexity` does the same, so the numbers compare):
the text's tokens are cut into consecutive, non-overlapping windows of `ctx` tokens; the remainder shorter
than a window is left out. Where the tokenizer starts a prompt with bos, each window's first token is
replaced by bos, so every window begins as a prompt does. Within a window only the second half is scored:
the logits at positions ctx // 2 .. ctx - 2 predict the tokens one further on, so every scored token sees
at least ctx // 2 tokens before it, and none is scored twice. Perplexity is exp of the mean negative
log-likelihood over all scored tokens.

With the KV cache, a window is fed in chunks of `chunk_size` tokens, each reading the keys and values of
the chunks before it from the cache; without it, each window is one forward pass over all its tokens.
The two compute the same logits, so the same perplexity.
"""

import math
import time
from dataclasses import asdict, dataclass
from typing import Dict, List, Optional, Sequence

import torch
import torch.nn.functional as F

from llama.errors import LlamaError
from llama.generation import Llama
from llama.runtime.progress import Progress, or_silent

MIN_CTX = 4  # the smallest window that scores a token: positions ctx // 2 .. ctx - 2


@dataclass
class PerplexityResult:
    """What scoring a text gave.

    `stderr` is the standard error of the perplexity from the spread of the scored tokens' NLLs
    (exp(mean) times the mean's standard error), as llama.cpp prints beside its figure.
    """

    perplexity: float
    stderr: float
    mean_nll: float
    text_tokens: int  # tokens in the whole text
    scored_tokens: int
    windows: int
    ctx: int
    kv_cache: bool
    seconds: float
    window_perplexities: List[float]

    def to_dict(self) -> Dict:
        return asdict(self)


def window_starts(n_tokens: int, ctx: int, max_windows: Optional[int] = None) -> List[int]:
    """The offsets in the text's tokens where each window of `ctx` tokens begins.

    Raises:
        LlamaError: `ctx` is too small, or the text has fewer than `ctx` tokens.
    """
    check_ctx(ctx)
    if max_windows is not None and max_windows < 1:
        raise LlamaError(f"the number of windows must be at least 1, not {max_windows}")
    count = n_tokens // ctx
    if count == 0:
        raise LlamaError(f"the text has {n_tokens} tokens, fewer than one window of ctx={ctx}; "
                         "lower ctx= or give a longer text")
    if max_windows is not None:
        count = min(count, max_windows)
    return [k * ctx for k in range(count)]


def check_ctx(ctx: int) -> None:
    if isinstance(ctx, bool) or not isinstance(ctx, int) or ctx < MIN_CTX:
        raise LlamaError(f"ctx= must be a whole number of at least {MIN_CTX} tokens, not {ctx!r}")


@torch.inference_mode()
def window_nll(llama: Llama, window: Sequence[int], kv_cache: bool = True, chunk_size: int = 128) -> torch.Tensor:
    """Negative log-likelihoods (float64) of the scored tokens of one window: those at ctx // 2 + 1 .. ctx - 1.

    Args:
        llama: the model.
        window: `ctx` token ids, fed from position 0.
        kv_cache: feed the window in chunks of `chunk_size` through a KV cache, or in one pass without.
        chunk_size: tokens per forward pass with the cache.
    """
    model, ctx = llama.model, len(window)
    first = ctx // 2
    tokens = torch.tensor([list(window)], dtype=torch.long, device=llama.device)  # (1, ctx)
    if kv_cache:
        cache = model.new_kv_cache(1, ctx)
        scored = []
        for start in range(0, ctx, chunk_size):
            end = min(start + chunk_size, ctx)
            if end <= first:  # context only: fills the cache (forward always returns at least one position)
                model(tokens[:, start:end], start, cache, num_logits=1)
            else:
                scored.append(model(tokens[:, start:end], start, cache, num_logits=end - max(start, first)))
        logits = torch.cat(scored, dim=1)  # (1, ctx - first, vocab)
    else:
        logits = model(tokens, 0, None, num_logits=ctx - first)  # (1, ctx - first, vocab)
    # Position i predicts token i + 1; the last position has nothing after it in the window.
    predicted = logits[0, :-1].float()  # (ctx - first - 1, vocab)
    targets = tokens[0, first + 1:]
    return F.cross_entropy(predicted, targets, reduction="none").double()


def perplexity(
    llama: Llama,
    tokens: Sequence[int],
    ctx: int,
    kv_cache: bool = True,
    chunk_size: int = 128,
    max_windows: Optional[int] = None,
    progress: Optional[Progress] = None,
) -> PerplexityResult:
    """Perplexity of `llama` over a text's tokens, in windows of `ctx` tokens (see the module's docstring).

    Args:
        llama: the model; its max_seq_len must be at least `ctx`.
        tokens: the whole text's token ids, without bos (each window gets its own).
        ctx: tokens per window.
        kv_cache: True feeds each window in chunks through a KV cache; False in one pass. Same result.
        chunk_size: tokens per forward pass with the cache.
        max_windows: score only the first this many windows (all when None).
        progress: called with ("scoring windows", windows done, windows in all) after each window.

    Returns:
        the perplexity, its standard error and what went into it.

    Raises:
        LlamaError: a bad ctx or chunk size, a text shorter than one window, or a window longer than the
            model's max_seq_len.
    """
    starts = window_starts(len(tokens), ctx, max_windows)
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
        raise LlamaError(f"the chunk size must be a whole number of at least 1, not {chunk_size!r}")
    if ctx > llama.model.params.max_seq_len:
        raise LlamaError(f"ctx={ctx} is longer than the model's max_seq_len {llama.model.params.max_seq_len}")
    vocab = llama.model.params.vocab_size
    if len(tokens) and (min(tokens) < 0 or max(tokens) >= vocab):
        raise LlamaError(f"the text's token ids fall outside the model's vocabulary of {vocab}")
    report = or_silent(progress)
    bos = llama.tokenizer.bos_id if llama.tokenizer.add_bos else None

    begin = time.perf_counter()
    nlls, per_window = [], []
    report("scoring windows", 0, len(starts))
    for k, start in enumerate(starts):
        window = list(tokens[start:start + ctx])
        if bos is not None:
            window[0] = bos
        nll = window_nll(llama, window, kv_cache, chunk_size)
        if not torch.isfinite(nll).all():
            raise LlamaError(f"the model produced NaN or infinite logits in window {k + 1}; the weights may be "
                             "corrupt, or the dtype may overflow (try dtype=float32)")
        nlls.append(nll)
        per_window.append(math.exp(nll.mean().item()))
        report("scoring windows", k + 1, len(starts))
    seconds = time.perf_counter() - begin

    all_nll = torch.cat(nlls)
    mean = all_nll.mean().item()
    spread = all_nll.std().item() / math.sqrt(all_nll.numel()) if all_nll.numel() > 1 else 0.0
    return PerplexityResult(
        perplexity=math.exp(mean), stderr=math.exp(mean) * spread, mean_nll=mean, text_tokens=len(tokens),
        scored_tokens=all_nll.numel(), windows=len(starts), ctx=ctx, kv_cache=kv_cache, seconds=seconds,
        window_perplexities=per_window,
    )
