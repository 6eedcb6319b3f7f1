"""How the next token is chosen from the logits, as the plain decode does and as a speculative step checks a draft.

`sample` is Meta's: greedy at temperature 0, else nucleus sampling (`sample_top_p`). `sampling_probs` is the
distribution `sample` draws from, over the whole vocabulary, and `accept_draft` the rule of speculative sampling
(Leviathan et al., 2023; Chen et al., 2023): a drafted token is kept with probability min(1, p / q) and otherwise
replaced by a draw from the normalised residual max(p - q, 0), so that what comes out is distributed exactly as
`sample`'s draws are. At temperature 0 a drafted token is kept where it is the argmax, as `sample` would pick it.
"""

from typing import List, Optional

import torch

from llama.errors import LlamaError

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
