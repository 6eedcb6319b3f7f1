"""How the next token is chosen from the logits, as the plain decode does and as a speculative step checks a draft.

`sample` is Meta's: greedy at temperature 0, else nucleus sampling (`sample_top_p`). Before it, `apply_controls`
changes one row's logits by what the row's tokens so far say (`SamplingControls`: OpenAI's penalties and
`logit_bias`, llama.cpp's repeat penalty, top-k and min-p), a pure function of those tokens, so a row's next
token is the same whether its keys and values were cached or recomputed, alone or in a batch. `sampling_probs` is the
distribution `sample` draws from, over the whole vocabulary, and `accept_draft` the rule of speculative sampling
(Leviathan et al., 2023; Chen et al., 2023): a drafted token is kept with probability min(1, p / q) and otherwise
replaced by a draw from the normalised residual max(p - q, 0), so that what comes out is distributed exactly as
`sample`'s draws are. At temperature 0 a drafted token is kept where it is the argmax, as `sample` would pick it.
"""

import math
from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

import torch

from llama.errors import LlamaError

@dataclass(frozen=True)
class SamplingControls:
    """How a row's logits are changed before temperature and top_p, in this order (llama.cpp's):

    - `logit_bias`: (token id, bias) pairs, each bias added to that token's logit (OpenAI's, -100 to 100).
    - `repeat_penalty` over the last `repeat_last_n` tokens of the row, prompt included (llama.cpp's; 0: none,
      -1: all): each distinct token there has a positive logit divided by it and a negative one multiplied by it.
    - `frequency_penalty` and `presence_penalty` over the generated tokens (OpenAI's, -2 to 2): a token's logit
      loses count * frequency_penalty + (count > 0) * presence_penalty, count being how often it was generated.
    - `top_k`: only the k largest logits stay (0: all; ties with the k-th stay too).
    - `min_p`: only tokens whose probability is at least min_p times the likeliest one's stay (0: all); on the
      logits as they are then, before temperature, as llama.cpp's chain does.

    Tokens that do not stay get a logit of -inf.
    """

    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repeat_penalty: float = 1.0
    repeat_last_n: int = 64
    logit_bias: Tuple[Tuple[int, float], ...] = ()
    top_k: int = 0
    min_p: float = 0.0

    @property
    def active(self) -> bool:
        """Whether any control changes the logits."""
        return bool(self.frequency_penalty or self.presence_penalty or (self.repeat_penalty != 1 and self.repeat_last_n)
                    or self.logit_bias or self.top_k > 0 or self.min_p > 0)


def apply_controls(logits: torch.Tensor, controls: SamplingControls, tokens: Sequence[int], prompt_len: int) -> torch.Tensor:
    """One row's (vocab,) logits changed by `controls`, given the row's tokens so far (prompt, then generated).

    Args:
        logits: the model's logits for the next token; not changed (a new tensor is returned).
        controls: what to apply.
        tokens: every token of the row before the next one: its prompt, then what was generated.
        prompt_len: how many of `tokens` are the prompt (the penalties of OpenAI count only the rest).

    Returns:
        (vocab,) the logits to sample from.
    """
    out = logits.clone()
    if controls.logit_bias:
        ids = torch.tensor([t for t, _ in controls.logit_bias], device=out.device)
        out.index_add_(0, ids, torch.tensor([b for _, b in controls.logit_bias], dtype=out.dtype, device=out.device))
    last_n = controls.repeat_last_n
    if controls.repeat_penalty != 1 and last_n != 0:
        window = tokens if last_n < 0 else tokens[max(0, len(tokens) - last_n) :]
        if len(window):
            ids = torch.tensor(sorted(set(window)), device=out.device)
            seen = out[ids]
            out[ids] = torch.where(seen > 0, seen / controls.repeat_penalty, seen * controls.repeat_penalty)
    generated = tokens[prompt_len:]
    if (controls.frequency_penalty or controls.presence_penalty) and len(generated):
        counts = torch.bincount(torch.tensor(list(generated), device=out.device), minlength=out.shape[-1])
        counts = counts.to(out.dtype)
        out -= counts * controls.frequency_penalty + (counts > 0).to(out.dtype) * controls.presence_penalty
    if 0 < controls.top_k < out.shape[-1]:
        kth = torch.topk(out, controls.top_k).values[-1]
        out[out < kth] = -math.inf
    if controls.min_p > 0:
        # p_i >= min_p * p_max  <=>  logit_i >= logit_max + log(min_p): the softmax's normaliser cancels.
        out[out < out.max() + math.log(controls.min_p)] = -math.inf
    return out


def check_controls(controls: SamplingControls, vocab_size: int) -> None:
    """Raise LlamaError, naming the parameter, for a control out of its range."""
    c = controls
    for name, value, low, high in (("frequency_penalty", c.frequency_penalty, -2, 2),
                                   ("presence_penalty", c.presence_penalty, -2, 2), ("min_p", c.min_p, 0, 1)):
        if not low <= value <= high:  # also catches NaN
            raise LlamaError(f"{name} must be from {low} to {high}, not {value}")
    if not (c.repeat_penalty > 0 and math.isfinite(c.repeat_penalty)):
        raise LlamaError(f"repeat_penalty must be more than 0 (1 is none), not {c.repeat_penalty}")
    if c.repeat_last_n < -1:
        raise LlamaError(f"repeat_last_n must be -1 (every token), 0 (none) or more, not {c.repeat_last_n}")
    if c.top_k < 0:
        raise LlamaError(f"top_k must be 0 (every token) or more, not {c.top_k}")
    for token, bias in c.logit_bias:
        if not 0 <= token < vocab_size:
            raise LlamaError(f"logit_bias names token {token}, outside the vocabulary of {vocab_size}")
        if not -100 <= bias <= 100:
            raise LlamaError(f"logit_bias of token {token} must be from -100 to 100, not {bias}")


def check_finite(logits: torch.Tensor, position: int) -> None:
    """Raise LlamaError where the logits about to be sampled hold NaN or infinity: what corrupt weights or a dtype
    that overflows give, and no token can be chosen from."""
    lowest, highest = torch.aminmax(logits)  # NaN in either where there is one; a tenth of isfinite's time
    if not (math.isfinite(lowest) and math.isfinite(highest)):
        raise LlamaError(f"the model produced NaN or infinite logits at position {position}; the weights may be "
                         "corrupt, or the dtype may overflow (try dtype float32)")


def sample_top_p(probs: torch.Tensor, p: float, generator: Optional[torch.Generator] = None) -> torch.Tensor:
    """Nucleus sampling: draw from the smallest set of tokens whose probabilities sum past `p`.

    Args:
        probs: (bsz, vocab) probabilities.
        p: the cumulative-probability threshold, in (0, 1].
        generator: the source of randomness.

    Returns:
        (bsz, 1) sampled token ids.
    """
    probs_sort, probs_idx = torch.sort(probs, dim=-1, descending=True)
    probs_sum = torch.cumsum(probs_sort, dim=-1)
    mask = probs_sum - probs_sort > p  # tokens wholly past the threshold; the most likely one always stays
    probs_sort[mask] = 0.0
    probs_sort.div_(probs_sort.sum(dim=-1, keepdim=True))
    next_token = torch.multinomial(probs_sort, num_samples=1, generator=generator)
    return torch.gather(probs_idx, -1, next_token)


def sample(logits: torch.Tensor, temperature: float, top_p: float, generator: Optional[torch.Generator]) -> torch.Tensor:
    """(bsz,) next tokens from (bsz, vocab) logits; temperature 0 is greedy."""
    if temperature > 0:
        probs = torch.softmax(logits / temperature, dim=-1)
        return sample_top_p(probs, top_p, generator).reshape(-1)
    return torch.argmax(logits, dim=-1)


def check_sampling(temperature: float, top_p: float, max_gen_len: int) -> None:
    for name, value in (("temperature", temperature), ("top_p", top_p), ("max_gen_len", max_gen_len)):
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise LlamaError(f"{name} must be a number, not {value!r}")
    if not isinstance(max_gen_len, int):
        raise LlamaError(f"max_gen_len must be a whole number, not {max_gen_len!r}")
    if not temperature >= 0:  # also catches NaN
        raise LlamaError(f"temperature must be 0 (greedy) or more, not {temperature}")
    if not 0 < top_p <= 1:
        raise LlamaError(f"top_p must be in (0, 1], not {top_p}")
    if max_gen_len < 0:
        raise LlamaError(f"max_gen_len must be 0 or more, not {max_gen_len}")


def logprobs_of(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """(bsz, n) log-probabilities of `targets` under (bsz, n, vocab) logits.

    Over the vocabulary as it lies in memory, each position apart: cross_entropy over a transposed (bsz, vocab, n)
    view sums a strided axis and came out up to 2e-4 away from this on a 49,152-token vocabulary."""
    return torch.log_softmax(logits, dim=-1).gather(-1, targets[..., None])[..., 0]


def sampling_probs(logits: torch.Tensor, temperature: float, top_p: float) -> torch.Tensor:
    """(vocab,) the probabilities `sample` draws the next token from, given one position's (vocab,) logits at
    temperature > 0: the softmax at `temperature`, cut to the nucleus as `sample_top_p` cuts it and normalised."""
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    probs_sort, probs_idx = torch.sort(probs, dim=-1, descending=True)
    mask = torch.cumsum(probs_sort, dim=-1) - probs_sort > top_p
    probs_sort[mask] = 0.0
    probs_sort.div_(probs_sort.sum(dim=-1, keepdim=True))
    return torch.zeros_like(probs).scatter_(-1, probs_idx, probs_sort)


def accept_draft(logits: torch.Tensor, drafted: int, temperature: float, top_p: float,
                 generator: Optional[torch.Generator], draft_probs: Optional[torch.Tensor] = None) -> Optional[int]:
    """Whether a drafted token stands where the target model's (vocab,) logits say what comes next.

    Args:
        logits: the target model's logits at the drafted token's position.
        drafted: the token id drafted there.
        temperature, top_p: the sampling the plain decode would do.
        generator: the source of randomness (temperature > 0).
        draft_probs: (vocab,) the distribution the drafted token was drawn from; None for a draft that is not
            sampled (prompt lookup), a distribution that puts everything on `drafted`.

    Returns:
        None when the drafted token stands; else the token that takes its place: at temperature 0 the argmax,
        above it a draw from the residual, so that the position's token is distributed as `sample`'s is.
    """
    if temperature == 0:
        best = int(torch.argmax(logits))
        return None if best == drafted else best
    p = sampling_probs(logits, temperature, top_p)
    q_drafted = 1.0 if draft_probs is None else float(draft_probs[drafted])
    if float(torch.rand((), generator=generator, device=p.device)) * q_drafted < float(p[drafted]):
        return None
    if draft_probs is None:
        residual = p.clone()
        residual[drafted] = 0.0
    else:
        residual = (p - draft_probs).clamp_(min=0.0)
    total = float(residual.sum())
    if total <= 0:  # p equals q: rejection has probability 0, and rounding made it happen
        return drafted
    return int(torch.multinomial(residual / total, 1, generator=generator))


def check_draft(logits: torch.Tensor, draft: List[int], temperature: float, top_p: float,
                generator: Optional[torch.Generator], draft_probs: Optional[List[torch.Tensor]] = None) -> List[int]:
    """The tokens a draft yields, from (1 + len(draft), vocab) logits of the newest token and of each drafted one:
    the drafted tokens up to the first the plain decode would not have chosen (`accept_draft`; `draft_probs`, where
    the drafts were sampled, the distribution of each), then the model's own token: the replacement, or one more."""
    kept: List[int] = []
    for i, drafted in enumerate(draft):
        replacement = accept_draft(logits[i], drafted, temperature, top_p, generator,
                                   draft_probs=draft_probs[i] if draft_probs else None)
        if replacement is not None:
            return kept + [replacement]
        kept.append(drafted)
    return kept + [sample_one(logits[len(draft)], temperature, top_p, generator)]


def sample_one(logits: torch.Tensor, temperature: float, top_p: float, generator: Optional[torch.Generator]) -> int:
    """One position's next token from its (vocab,) logits, drawn from `sampling_probs` (`sample`'s distribution)."""
    if temperature == 0:
        return int(torch.argmax(logits))
    return int(torch.multinomial(sampling_probs(logits, temperature, top_p), 1, generator=generator))
