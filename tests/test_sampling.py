"""Sampling controls (llama/sampling.py's `apply_controls`): each control's effect on the logits against values
worked out by hand, and `Llama.generate` under every control giving the same tokens with the cache on and off,
in a batch and alone, and through the commands' flags."""

import math

import pytest
import torch

from helpers import assert_one_line_error, build, generate_json
from llama.errors import LlamaError
from llama.sampling import SamplingControls, apply_controls, check_controls

VOCAB = 8


def logits_of(*values):
    return torch.tensor(values, dtype=torch.float32)


def test_no_control_changes_nothing():
    logits = torch.randn(VOCAB, generator=torch.Generator().manual_seed(0))
    controls = SamplingControls()
    assert not controls.active
    assert torch.equal(apply_controls(logits, controls, [1, 2, 3, 3], 1), logits)


def test_frequency_and_presence_penalties_count_generated_tokens_only():
    logits = logits_of(1, 1, 1, 1, 1, 1, 1, 1)
    # Prompt [7, 3]; generated 3, 3, 5: token 3 twice, 5 once, 7 only in the prompt.
    out = apply_controls(logits, SamplingControls(frequency_penalty=0.5, presence_penalty=0.25), [7, 3, 3, 3, 5], 2)
    expected = logits_of(1, 1, 1, 1 - 2 * 0.5 - 0.25, 1, 1 - 0.5 - 0.25, 1, 1)
    torch.testing.assert_close(out, expected, rtol=0, atol=0)
    assert torch.equal(logits, logits_of(1, 1, 1, 1, 1, 1, 1, 1)), "the input was changed"
    negative = apply_controls(logits, SamplingControls(presence_penalty=-1.0), [7, 3, 3, 3, 5], 2)
    torch.testing.assert_close(negative, logits_of(1, 1, 1, 2, 1, 2, 1, 1), rtol=0, atol=0)


def test_repeat_penalty_divides_positive_and_multiplies_negative_logits_in_the_window():
    logits = logits_of(2, -2, 2, -2, 2, 0, 0, 0)
    tokens = [0, 1, 2, 3, 0]  # with repeat_last_n 3, only 2, 3 and 0 are in the window
    out = apply_controls(logits, SamplingControls(repeat_penalty=2.0, repeat_last_n=3), tokens, 5)
    torch.testing.assert_close(out, logits_of(1, -2, 1, -4, 2, 0, 0, 0), rtol=0, atol=0)
    every = apply_controls(logits, SamplingControls(repeat_penalty=2.0, repeat_last_n=-1), tokens, 5)
    torch.testing.assert_close(every, logits_of(1, -4, 1, -4, 2, 0, 0, 0), rtol=0, atol=0)
    assert torch.equal(apply_controls(logits, SamplingControls(repeat_penalty=2.0, repeat_last_n=0), tokens, 5), logits)


def test_logit_bias_adds_to_the_named_tokens():
    logits = logits_of(0, 1, 2, 3, 4, 5, 6, 7)
    out = apply_controls(logits, SamplingControls(logit_bias=((0, 100.0), (7, -100.0))), [], 0)
    torch.testing.assert_close(out, logits_of(100, 1, 2, 3, 4, 5, 6, -93), rtol=0, atol=0)
    assert int(out.argmax()) == 0


def test_top_k_keeps_the_k_largest():
    logits = logits_of(3, -1, 5, 0, 4, 2, 1, -2)
    out = apply_controls(logits, SamplingControls(top_k=3), [], 0)
    kept = torch.isfinite(out)
    assert sorted(torch.nonzero(kept).flatten().tolist()) == [0, 2, 4]
    assert torch.equal(out[kept], logits[kept])
    assert torch.equal(apply_controls(logits, SamplingControls(top_k=VOCAB), [], 0), logits)


def test_min_p_keeps_tokens_at_least_that_fraction_as_likely_as_the_likeliest():
    logits = torch.randn(64, generator=torch.Generator().manual_seed(1)) * 3
    probs = torch.softmax(logits, dim=-1)
    out = apply_controls(logits, SamplingControls(min_p=0.1), [], 0)
    assert torch.equal(torch.isfinite(out), probs >= 0.1 * probs.max())
    assert 1 < int(torch.isfinite(out).sum()) < 64  # the case is not trivial
    assert torch.equal(out[torch.isfinite(out)], logits[torch.isfinite(out)])


def test_controls_apply_in_order():
    # The bias first, then the repeat penalty on the biased logit, then the penalties, then top_k.
    logits = logits_of(0, 0.25, 0, 1, 0, 0, 0, 0)
    controls = SamplingControls(logit_bias=((3, 3.0),), repeat_penalty=2.0, repeat_last_n=-1, frequency_penalty=1.0,
                                top_k=2)
    out = apply_controls(logits, controls, [5, 3], 1)
    assert torch.nonzero(torch.isfinite(out)).flatten().tolist() == [1, 3]
    assert out[3] == (1 + 3.0) / 2 - 1.0 and out[1] == 0.25


@pytest.mark.parametrize("controls, fragment", [
    (SamplingControls(presence_penalty=3.0), "presence_penalty must be from -2 to 2"),
    (SamplingControls(frequency_penalty=math.nan), "frequency_penalty"),
    (SamplingControls(min_p=1.5), "min_p"),
    (SamplingControls(repeat_penalty=0.0), "repeat_penalty must be more than 0"),
    (SamplingControls(repeat_last_n=-2), "repeat_last_n"),
    (SamplingControls(top_k=-1), "top_k"),
    (SamplingControls(logit_bias=((VOCAB, 1.0),)), "outside the vocabulary of 8"),
    (SamplingControls(logit_bias=((1, 101.0),)), "from -100 to 100"),
])
def test_bad_controls_are_refused(controls, fragment):
    with pytest.raises(LlamaError, match=fragment.replace("(", r"\(")):
        check_controls(controls, VOCAB)


EVERY_CONTROL = SamplingControls(frequency_penalty=0.7, presence_penalty=0.4, repeat_penalty=1.3, repeat_last_n=16,
                                 logit_bias=((13, 4.0), (42, -100.0)), top_k=40, min_p=0.05)


@pytest.fixture(scope="module")
def llama(nonstop_ckpt):
    return build(nonstop_ckpt, max_seq_len=96, max_batch_size=4)


def test_generate_cached_and_uncached_give_the_same_tokens_under_every_control(llama):
    enc = lambda s: llama.tokenizer.encode(s, bos=True, eos=False)  # noqa: E731
    prompts = [enc("the the the the cat"), enc("Once upon a time"), enc("A B C A B C A B")]
    plain, _ = llama.generate(prompts, 24, temperature=0)
    for temperature in (0, 0.9):
        runs = []
        for kv_cache in (True, False):
            llama.generator.manual_seed(5)
            runs.append(llama.generate(prompts, 24, temperature=temperature, top_p=0.95, kv_cache=kv_cache,
                                       controls=EVERY_CONTROL)[0])
        assert runs[0] == runs[1]
    greedy, _ = llama.generate(prompts, 24, temperature=0, controls=EVERY_CONTROL)
    assert greedy != plain  # the controls change the text
    assert all(42 not in t for t in greedy)  # a bias of -100 keeps a token out
    # A row in a batch is the row alone.
    for prompt, tokens in zip(prompts, greedy):
        assert llama.generate([prompt], 24, temperature=0, controls=EVERY_CONTROL)[0][0] == tokens


def test_generate_under_each_control_follows_the_controlled_argmax(llama):
    """Greedy decoding under a control picks, at every step, the argmax of the controlled logits of the plain
    model: checked here against a loop of plain forwards outside the library's decode."""
    prompt = llama.tokenizer.encode("the the the the cat", bos=True, eos=False)
    for controls in (SamplingControls(frequency_penalty=1.5), SamplingControls(presence_penalty=2.0),
                     SamplingControls(repeat_penalty=1.8, repeat_last_n=8), SamplingControls(logit_bias=((7, 6.0),))):
        tokens, _ = llama.generate([prompt], 12, temperature=0, controls=controls)
        seq = list(prompt)
        for _ in range(len(tokens[0])):
            logits = llama.model(torch.tensor([seq]), 0)[0, -1]
            seq.append(int(apply_controls(logits, controls, seq, len(prompt)).argmax()))
        assert seq[len(prompt):] == tokens[0], controls


def test_generate_refuses_controls_with_speculation(llama):
    with pytest.raises(LlamaError, match="speculation"):
        llama.generate([[1, 2, 3]], 4, temperature=0, speculate="ngram", controls=SamplingControls(top_k=3))


def test_generate_command_flags_change_the_text_and_keep_the_switch(nonstop_ckpt):
    flags = ("--repeat-penalty", "1.5", "--repeat-last-n", "32", "--top-k", "20", "--min-p", "0.05")
    prompt = ("--prompt", "the the the the cat sat on the")
    plain = generate_json(nonstop_ckpt, *prompt, max_gen_len=24)
    cached = generate_json(nonstop_ckpt, *prompt, *flags, max_gen_len=24)
    uncached = generate_json(nonstop_ckpt, *prompt, "--no-kv-cache", *flags, max_gen_len=24)
    assert [r["tokens"] for r in cached] == [r["tokens"] for r in uncached]
    assert [r["tokens"] for r in cached] != [r["tokens"] for r in plain]


def test_generate_command_refuses_bad_controls_in_one_line(nonstop_ckpt):
    from helpers import generate

    assert_one_line_error(generate(nonstop_ckpt, "--prompt", "Hi", "--min-p", "2"), "--min-p must be from 0 to 1")
    assert_one_line_error(generate(nonstop_ckpt, "--prompt", "Hi", "--top-k", "3", "--speculate", "ngram"),
                          "--speculate")
