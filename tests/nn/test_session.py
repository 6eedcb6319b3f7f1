"""A KV cache kept between calls changes what is fed, never the answer.

A session reuses the longest common prefix of token ids it holds; the logits of the tokens fed after it
equal a fresh run's (float32, 1e-5), and greedy tokens are identical, whether the next prompt extends the
last one, diverges from it, stops inside it or shares nothing with it.

Greedy runs here ignore stop tokens, so that each runs its exact length whatever a random model ranks first.
"""

import pytest
import torch

from helpers import build
from llama.errors import LlamaError
from llama.nn.session import Session, common_prefix_len

PROMPT = "I believe the meaning of life is"


def _fresh(llama, prompt, n=12):
    return llama.generate([prompt], n, temperature=0, logprobs=True, ignore_stop=True)


def _with(session, llama, prompt, n=12):
    return llama.generate([prompt], n, temperature=0, logprobs=True, ignore_stop=True, session=session)


def _assert_same(a, b):
    (tok_a,), (lp_a,) = a
    (tok_b,), (lp_b,) = b
    assert tok_a == tok_b and len(tok_a) > 0
    torch.testing.assert_close(torch.tensor(lp_a), torch.tensor(lp_b), rtol=0, atol=1e-5)


def test_common_prefix_len():
    assert common_prefix_len([1, 2, 3], [1, 2, 4, 5]) == 2
    assert common_prefix_len([], [1]) == 0
    assert common_prefix_len([1, 2], [1, 2, 3]) == 2
    assert common_prefix_len([7], [8]) == 0


@pytest.mark.parametrize("case", ["extends", "diverges", "inside", "unrelated"])
def test_logits_after_a_held_prefix_equal_one_pass(tiny_ckpt, case):
    """The model fed only the tokens after what the session reuses computes the logits of a full pass at every
    position fed, whether the new prompt extends what the session holds, diverges from it, falls inside it or
    shares nothing with it."""
    llama = build(tiny_ckpt)
    g = torch.Generator().manual_seed(5)
    # Drawn from two halves of the vocabulary, so that `new` never continues `held` by chance.
    held_prompt = torch.randint(3, 2000, (20,), generator=g).tolist()
    new = torch.randint(2000, llama.model.vocab_size, (16,), generator=g).tolist()
    session = Session(llama.model)
    llama.generate([held_prompt], 6, temperature=0, ignore_stop=True, session=session)
    held = list(session.tokens)
    assert len(held) == 25  # the prompt and 5 generated tokens (the last, sampled, is never fed)
    prompt, reused = {
        "extends": (held + new, len(held)),
        "diverges": (held[:8] + new, 8),
        "inside": (held[:12], 11),  # its last token is fed again: its logits pick the first new token
        "unrelated": (new, 0),
    }[case]
    with torch.inference_mode():
        cache, start = session.begin(prompt)
        assert start == reused
        tail = llama.model(torch.tensor([prompt[start:]]), start, cache)
        full = llama.model(torch.tensor([prompt]))
    assert tail.shape[1] == len(prompt) - reused
    torch.testing.assert_close(tail, full[:, start:], rtol=0, atol=1e-5)


def test_each_call_feeds_only_what_is_new_and_answers_as_a_fresh_run(tiny_ckpt):
    llama = build(tiny_ckpt)
    session = Session(llama.model)
    base = llama.tokenizer.encode(PROMPT, bos=True, eos=False)

    first = _with(session, llama, base)
    _assert_same(first, _fresh(llama, base))
    assert (session.last_reused, session.last_prefilled) == (0, len(base))
    # The session holds the prompt and every generated token but the last (sampled, never fed).
    assert session.tokens == base + first[0][0][:-1]

    # The next prompt extends the last exchange: only the new tokens are fed.
    longer = base + first[0][0] + llama.tokenizer.encode(" and then", bos=False, eos=False)
    _assert_same(_with(session, llama, longer), _fresh(llama, longer))
    assert session.last_reused == len(base) + len(first[0][0]) - 1
    assert session.last_prefilled == len(longer) - session.last_reused

    # A prompt that diverges early rewinds to the common prefix.
    other = base[:3] + llama.tokenizer.encode(" nothing at all", bos=False, eos=False)
    _assert_same(_with(session, llama, other), _fresh(llama, other))
    assert session.last_reused == 3

    # A prompt wholly inside what is held still feeds its last token, whose logits pick the first new one.
    inside = other[:5]
    _assert_same(_with(session, llama, inside), _fresh(llama, inside))
    assert (session.last_reused, session.last_prefilled) == (4, 1)

    # Nothing in common.
    unrelated = llama.tokenizer.encode("Zebras", bos=False, eos=False)
    assert unrelated[0] != session.tokens[0]
    _assert_same(_with(session, llama, unrelated), _fresh(llama, unrelated))
    assert session.last_reused == 0


def test_echoed_logprobs_feed_the_whole_prompt(gqa_ckpt):
    llama = build(gqa_ckpt)
    session = Session(llama.model)
    prompt = llama.tokenizer.encode(PROMPT, bos=True, eos=False)
    llama.generate([prompt], 4, temperature=0, session=session)
    (toks,), (lps,) = llama.generate([prompt], 8, temperature=0, logprobs=True, echo=True, ignore_stop=True,
                                     session=session)
    (f_toks,), (f_lps,) = llama.generate([prompt], 8, temperature=0, logprobs=True, echo=True, ignore_stop=True)
    assert session.last_reused == 0 and toks == f_toks
    torch.testing.assert_close(torch.tensor(lps), torch.tensor(f_lps), rtol=0, atol=1e-5)


def test_an_interrupted_call_leaves_the_session_usable(gqa_ckpt):
    llama = build(gqa_ckpt)
    session = Session(llama.model)
    prompt = llama.tokenizer.encode(PROMPT, bos=True, eos=False)
    llama.generate([prompt], 10, temperature=0, session=session)
    other = prompt[:4] + llama.tokenizer.encode(" elsewhere entirely", bos=False, eos=False)

    def stop_early(pos, tokens):
        if pos > len(other) + 2:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):  # ignore_stop: the call is still running at the 4th step
        llama.generate([other], 10, temperature=0, ignore_stop=True, on_step=stop_early, session=session)
    # Whatever the interrupted call wrote, the session claims only what it knows to be there.
    assert other[: len(session.tokens)] == session.tokens
    _assert_same(_with(session, llama, other), _fresh(llama, other))


def test_a_session_runs_up_to_max_seq_len(gqa_ckpt):
    llama = build(gqa_ckpt, max_seq_len=32)
    session = Session(llama.model)
    prompt = llama.tokenizer.encode(PROMPT, bos=True, eos=False)
    (toks,), _ = llama.generate([prompt], 100, temperature=0, echo=True, ignore_stop=True, session=session)
    assert len(toks) == 32 and len(session.tokens) == 31
    (again,), _ = llama.generate([toks[:30]], 100, temperature=0, echo=True, ignore_stop=True, session=session)
    assert again == toks and session.last_reused == 29


def test_a_session_serves_one_prompt_with_the_cache_on(gqa_ckpt):
    llama = build(gqa_ckpt)
    session = Session(llama.model)
    prompt = llama.tokenizer.encode(PROMPT, bos=True, eos=False)
    with pytest.raises(LlamaError, match="one prompt"):
        llama.generate([prompt, prompt], 4, session=session)
    with pytest.raises(LlamaError, match="cache on"):
        llama.generate([prompt], 4, kv_cache=False, session=session)
    assert session.tokens == []
