"""Speculative decoding that gives the plain decode's tokens: drafted cheaply, checked by the model in one step.

Decoding on a CPU reads every weight once a step, so a step that feeds a few tokens costs little more than a step
that feeds one. A draft of k tokens is fed after the last token in one step of k + 1 tokens; each of its rows is
computed as if alone (the kernels' promise, llama/kernels), so its logits are those k + 1 plain steps would give,
and the draft is kept up to its first token the plain decode would not have chosen (`llama.sampling.accept_draft`),
plus one token of the model's own. At temperature 0 the tokens are the plain decode's, one for one; above it they
are distributed as its draws are.

A rejected token leaves nothing behind: the cache's keys and values past the last token kept lie beyond every
later query's position, masked, until the next step writes over them; a session records only the tokens kept.

Drafts come from prompt lookup (`PromptLookup`): the tokens that followed the latest earlier occurrence of the
last few tokens, in the prompt or the output so far. That costs nothing and pays where the output repeats its
input (summaries, edits, code, answers quoting a passage); where there is no such occurrence, or the recent drafts
mostly failed, the step is the plain one.
"""

from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Protocol, Set, Tuple, Union

import torch

from llama.errors import LlamaError
from llama.nn.session import common_prefix_len
from llama.sampling import check_draft, logprobs_of, sample_one, sampling_probs

METHODS = ("ngram",)
# Tokens a draft holds at most, by default: the step that checks them feeds one more (scripts/bench_speculative.py).
DEFAULT_DRAFT_TOKENS = 4
MAX_DRAFT_TOKENS = 16


@dataclass
class SpeculationStats:
    """What speculation did in one `generate` call (or more, added up)."""

    drafted: int = 0  # drafted tokens checked
    accepted: int = 0  # of them, kept
    checks: int = 0  # steps that checked a draft
    plain_steps: int = 0  # steps that fed one token

    @property
    def acceptance(self) -> float:
        """The share of drafted tokens kept."""
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def tokens_per_check(self) -> float:
        """Tokens a checking step yields on average: the drafted tokens kept, and the model's own after them."""
        return (self.accepted + self.checks) / self.checks if self.checks else 0.0

    def add(self, other: "SpeculationStats") -> None:
        for name in ("drafted", "accepted", "checks", "plain_steps"):
            setattr(self, name, getattr(self, name) + getattr(other, name))

    def describe(self) -> str:
        if not self.checks:
            return f"no draft checked ({self.plain_steps} plain steps)"
        return (f"{self.accepted} of {self.drafted} drafted tokens kept ({self.acceptance:.0%}), "
                f"{self.tokens_per_check:.2f} tokens a checking step, {self.checks} checking and "
                f"{self.plain_steps} plain steps")


class PromptLookup:
    """Drafts by prompt lookup: the tokens that followed the latest earlier occurrence of the sequence's last n
    tokens, for n from `max_ngram` down to `min_ngram`.

    The n-grams are indexed as the sequence grows, so a draft costs a few dictionary lookups however long it is.
    The index follows one list as it grows; given another list, it starts over.
    """

    def __init__(self, max_ngram: int = 3, min_ngram: int = 2):
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"n-gram sizes {min_ngram}..{max_ngram} are not a range of whole numbers from 1")
        self.sizes = range(max_ngram, min_ngram - 1, -1)
        self._latest: Dict[int, Dict[Tuple[int, ...], int]] = {n: {} for n in self.sizes}  # n-gram -> where it ended
        self._indexed = 0  # n-grams ending before this position are in the index
        self._tokens: Optional[List[int]] = None  # the sequence indexed, which only grows

    def draft(self, tokens: List[int], k: int) -> List[int]:
        """Up to k tokens to follow `tokens`; none where its last n tokens occurred nowhere before."""
        end = len(tokens)
        if tokens is not self._tokens or end < self._indexed:  # another sequence: index it from the start
            self._tokens, self._indexed = tokens, 0
            self._latest = {n: {} for n in self.sizes}
        for e in range(max(self._indexed, 1), end):  # every n-gram that ends before the last token's end
            for n in self.sizes:
                if e >= n:
                    self._latest[n][tuple(tokens[e - n : e])] = e
        self._indexed = max(self._indexed, end)
        for n in self.sizes:
            if end >= n:
                e = self._latest[n].get(tuple(tokens[end - n :]))
                if e is not None:
                    return tokens[e : e + k]
        return []


class Drafter(Protocol):
    """Where drafts come from: `PromptLookup`, `DraftModel`, or any object with this method.

    A drafter that samples its drafts also has `sample_with(temperature, top_p, generator)`, called before a
    sequence's first draft, and leaves in `last_probs` the distribution each drafted token was drawn from, which the
    rule of speculative sampling needs (`llama.sampling.accept_draft`)."""

    def draft(self, tokens: List[int], k: int) -> List[int]:
        """Up to k tokens likely to follow `tokens` (the prompt and the output so far); none to take a plain step."""


class DraftModel:
    """Drafts with a second, smaller model that shares the target's tokenizer: the tokens it would generate next.

    It keeps a KV cache of its own and the tokens it holds; each draft first feeds what changed since the last one
    (the target's correction and the tokens after it), so rejected drafts cost nothing to roll back. An int4 copy of
    the target itself (`Llama.build(..., quantize="int4")`) is a draft model every user has.

    Args:
        draft: a `Llama` (its `model`, `tokenizer` and `compiled_step`): its one-token steps run compiled where it
            was built so.
        target: the `Llama` whose drafts it makes, to check that the two share a vocabulary.

    Raises:
        LlamaError: the two models' vocabularies differ.
    """

    def __init__(self, draft, target):
        a, b = draft.tokenizer, target.tokenizer
        if (draft.model.params.vocab_size, a.bos_id, a.eos_id) != (target.model.params.vocab_size, b.bos_id, b.eos_id) \
                or a.n_words != b.n_words:
            raise LlamaError(f"the draft model's vocabulary ({a.n_words} tokens, bos {a.bos_id}, eos {a.eos_id}) is not "
                             f"the model's ({b.n_words} tokens, bos {b.bos_id}, eos {b.eos_id}): a draft model must "
                             "share the model's tokenizer")
        self.llama = draft
        self.cache = None
        self.held: List[int] = []  # tokens whose keys and values the cache holds, in order
        self.temperature, self.top_p, self.generator = 0.0, 1.0, None
        self.last_probs: Optional[List[torch.Tensor]] = None

    def sample_with(self, temperature: float, top_p: float, generator: Optional[torch.Generator]) -> None:
        self.temperature, self.top_p, self.generator = temperature, top_p, generator

    def draft(self, tokens: List[int], k: int) -> List[int]:
        model = self.llama.model
        size = model.params.max_seq_len
        if self.cache is None:
            self.cache = model.new_kv_cache(1, size)
        k = min(k, size - len(tokens))
        if k < 1:
            return []
        start = min(common_prefix_len(self.held, tokens), len(tokens) - 1)  # the last token is always fed
        with torch.inference_mode():
            logits = self._feed(tokens[start:], start)
            drafted: List[int] = []
            probs: List[torch.Tensor] = []
            for i in range(k):
                if self.temperature > 0:
                    p = sampling_probs(logits, self.temperature, self.top_p)
                    token = int(torch.multinomial(p, 1, generator=self.generator))
                    probs.append(p)
                else:
                    token = int(torch.argmax(logits))
                drafted.append(token)
                if i < k - 1:
                    logits = self._feed([token], len(tokens) + i)
        self.held = list(tokens) + drafted[:-1]
        self.last_probs = probs if self.temperature > 0 else None
        return drafted

    def _feed(self, tokens: List[int], start: int) -> torch.Tensor:
        """(vocab,) the draft model's logits after feeding `tokens` at `start`: a token or two through its one-token
        step (compiled where it is), more (a prompt) in one eager step."""
        model, step = self.llama.model, self.llama.compiled_step
        ids = torch.tensor([tokens], dtype=torch.long, device=model.device)
        if len(tokens) > 2 or step is None:
            return model(ids, start, self.cache, num_logits=1)[0, -1]
        for i in range(len(tokens)):
            logits = step(ids[:, i : i + 1], start + i, self.cache, num_logits=1)
        return logits[0, -1]


def new_drafter(speculate: Union[str, Drafter]) -> Drafter:
    """A fresh drafter for one sequence: "ngram" is prompt lookup; an object with a `draft` method is used as it is."""
    return PromptLookup() if speculate == "ngram" else speculate


def check_speculation(speculate: Union[str, Drafter, None], draft_tokens: int, kv_cache: bool) -> None:
    """Raise LlamaError for a speculation request that cannot run."""
    if speculate is None:
        return
    if not callable(getattr(speculate, "draft", None)) and speculate not in METHODS:
        raise LlamaError(f"speculate= takes {' or '.join(METHODS)}, not {speculate!r}")
    if isinstance(draft_tokens, bool) or not isinstance(draft_tokens, int) or not 1 <= draft_tokens <= MAX_DRAFT_TOKENS:
        raise LlamaError(f"draft_tokens= takes a whole number from 1 to {MAX_DRAFT_TOKENS}, not {draft_tokens!r}")
    if not kv_cache:
        raise LlamaError("speculative decoding checks each draft against the KV cache and keeps the cache only up to "
                         "the last token it accepts; it cannot run with kv_cache=False")


class Speculation:
    """The draft-and-check loop of one sequence, for `Llama.generate`.

    Args:
        draft_tokens: the most tokens a draft holds; each checking step feeds one more. A shorter draft is padded
            to it, so that one compiled step serves every check.
        drafter: where drafts come from (prompt lookup by default).
    """

    # A checking step costs about this many plain steps (compiled, the default model, 5 tokens against 1 on 2 cores:
    # scripts/bench_speculative.py); drafting stops for a while where recent checks yielded fewer tokens a step.
    CHECK_COST = 1.3

    def __init__(self, draft_tokens: int = DEFAULT_DRAFT_TOKENS, drafter: Optional[Drafter] = None):
        self.k = draft_tokens
        self.drafter = drafter if drafter is not None else PromptLookup()
        self.stats = SpeculationStats()
        self._yield = 2.0  # recent tokens a check yielded, a moving average
        self._pause = 0  # plain steps to take before drafting again
        self._backoff = 1

    def decode(self, tokens: torch.Tensor, prompt_len: int, fed: int, total_len: int,
               forward: Callable[[int, int, int, bool], torch.Tensor], can_check: Callable[[int], bool],
               temperature: float, top_p: float, generator: Optional[torch.Generator], stop_ids: Set[int],
               token_logprobs: Optional[torch.Tensor],
               on_step: Optional[Callable[[int, torch.Tensor], None]]) -> Tuple[int, int]:
        """Continue row 0 of `tokens` from `prompt_len` until a stop token or `total_len` tokens.

        Args:
            tokens: (1, total_len) the prompt in front; filled in place.
            fed: positions the cache holds already (a session's reuse).
            forward: (start, end, num_logits, first) -> (1, num_logits, vocab) logits of tokens[:, start:end] fed at
                start with the cache.
            can_check: whether a step of that many tokens runs fast now (compiled); where not, steps are plain.
            token_logprobs: (1, total_len) filled with each new token's log-probability, or None.
            on_step: called with each new token's position and (1,) token, in order.

        Returns:
            (filled, fed): tokens known, and positions whose keys and values the cache holds (the last token is
            never fed).
        """
        seq = tokens[0, :prompt_len].tolist()
        if hasattr(self.drafter, "sample_with"):
            self.drafter.sample_with(temperature, top_p, generator)
        stop = False
        logits = forward(fed, prompt_len, prompt_len - fed if token_logprobs is not None else 1, True)[0]
        if token_logprobs is not None and prompt_len - fed > 1:
            token_logprobs[0, fed + 1 : prompt_len] = logprobs_of(logits[:-1], tokens[0, fed + 1 : prompt_len])
        fed = prompt_len
        new = [sample_one(logits[-1], temperature, top_p, generator)]
        last_logits = logits[-1:]
        while True:
            for i, token in enumerate(new):
                pos = len(seq)
                seq.append(token)
                tokens[0, pos] = token
                if token_logprobs is not None:
                    token_logprobs[0, pos] = logprobs_of(last_logits[i], tokens[0, pos])
                if on_step is not None:
                    on_step(pos, tokens[:, pos])
                if token in stop_ids:
                    stop = True
                    break
            if stop or len(seq) >= total_len:
                return len(seq), fed
            # seq[fed] is the last token, not fed yet: a step feeds it, and the draft after it. The padded step must
            # fit before the end: a draft comes only where k more tokens could be kept.
            draft = self.next_draft(seq, total_len - len(seq) - 1, whole=True)
            n = 1 + self.k
            if draft and not can_check(n):
                draft = []
            if not draft:
                self.stats.plain_steps += 1
                last_logits = forward(fed, fed + 1, 1, False)[0]
                fed += 1
                new = [sample_one(last_logits[-1], temperature, top_p, generator)]
                continue
            # Padded to one size of step (the compiled one); the padding's rows are never read.
            tokens[0, fed + 1 : fed + n] = torch.tensor(draft + draft[-1:] * (self.k - len(draft)), device=tokens.device)
            last_logits = forward(fed, fed + n, n, False)[0]
            new = check_draft(last_logits, draft, temperature, top_p, generator,
                              getattr(self.drafter, "last_probs", None))
            accepted = len(new) - 1
            fed += len(new)  # the last token kept, and the ones before it, are fed; its successor is not
            self.record(len(draft), accepted)

    def next_draft(self, seq: List[int], room: int, whole: bool = False) -> List[int]:
        """The next draft after `seq`: at most `room` tokens (the new tokens a check could keep beyond its own),
        none at all where `whole` and fewer than k fit; none while drafting is paused."""
        if self._pause > 0:
            self._pause -= 1
            return []
        k = min(self.k, room)
        if k < 1 or (whole and k < self.k):
            return []
        return list(self.drafter.draft(seq, k))[:k]

    def record(self, drafted: int, accepted: int) -> None:
        """A check of `drafted` tokens kept `accepted` of them: counted, and drafting pauses where checks stop paying."""
        self.stats.checks += 1
        self.stats.drafted += drafted
        self.stats.accepted += accepted
        self._yield = 0.7 * self._yield + 0.3 * (accepted + 1)
        if self._yield < self.CHECK_COST:
            self._pause = self._backoff
            self._backoff = min(2 * self._backoff, 64)
            self._yield = self.CHECK_COST  # one more try after the pause
        else:
            self._backoff = 1
