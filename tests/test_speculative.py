"""Speculative decoding gives the plain decode's tokens (llama/speculative.py): drafts checked in one step, kept where
the plain decode would have chosen them, the cache rolled back past the rest.

Tiny random models seldom repeat themselves, so most tests draft with `Always`, which proposes a draft at every
step: every step is then a checking one, and the drafts are kept or rejected as the model decides.
"""

import random
from collections import Counter

import pytest
import torch

from helpers import Always, assert_one_line_error, build, chat, generate, generate_json, run, write_tiny
from llama.chat.conversation import Conversation
from llama.errors import LlamaError
from llama.nn.session import Session
from llama.sampling import accept_draft, sample_top_p, sampling_probs
from llama.speculative import DraftModel, PromptLookup, Speculation

PROMPTS = [[1, 5, 6, 7, 8, 5, 6, 7, 9, 10, 5, 6], [1, 300, 301, 302, 300, 301], [1], [1, 900, 901, 902, 903, 904, 905]]


class Fixed:
    """Drafts the same tokens at every step."""

    def __init__(self, tokens):
        self.tokens = tokens

    def draft(self, tokens, k):
        return self.tokens[:k]


@pytest.fixture(autouse=True)
def never_pause(monkeypatch):
    """Every draft is checked, however few were kept before: the tests want many checks, not speed."""
    monkeypatch.setattr(Speculation, "CHECK_COST", 0.0)


def brute_force_lookup(tokens, k, sizes=(3, 2)):
    for n in sizes:
        if len(tokens) < n:
            continue
        tail = tokens[-n:]
        for e in range(len(tokens) - 1, n - 1, -1):
            if tokens[e - n : e] == tail:
                return tokens[e : e + k]
    return []


def test_prompt_lookup_drafts_what_followed_the_latest_earlier_occurrence():
    lookup = PromptLookup()
    assert lookup.draft([1, 2, 3, 4, 9, 9, 2, 3], 3) == [4, 9, 9]  # "2 3" occurred before: what followed it
    assert lookup.draft([1, 2, 3, 4, 9, 9, 2, 3, 4, 5, 2, 3, 4], 2) == [5, 2]  # the latest "2 3 4", the longest match
    assert PromptLookup().draft([1, 2, 3, 4, 5], 4) == []  # nothing repeats
    assert PromptLookup().draft([7, 7], 4) == []  # a 1-gram is not matched
    assert PromptLookup().draft([7, 7, 7], 4) == [7]  # "7 7" ended at position 2, and one token followed it


def test_prompt_lookup_indexed_as_it_grows_equals_a_search_from_scratch():
    rng = random.Random(0)
    for _ in range(20):
        seq = [rng.randrange(6) for _ in range(5)]
        lookup = PromptLookup()
        for _ in range(60):
            k = rng.randrange(1, 6)
            assert lookup.draft(seq, k) == brute_force_lookup(seq, k), seq
            seq += [rng.randrange(6) for _ in range(rng.randrange(1, 4))]


@pytest.mark.parametrize("k", [1, 3, 8])
def test_greedy_speculation_gives_the_plain_tokens_and_logprobs(tiny_ckpt, k):
    llama = build(tiny_ckpt, max_seq_len=96)
    plain, plain_lp = llama.generate(PROMPTS, 60, temperature=0, logprobs=True, echo=True, ignore_stop=True)
    spec, spec_lp = llama.generate(PROMPTS, 60, temperature=0, logprobs=True, echo=True, ignore_stop=True,
                                   speculate=Always(), draft_tokens=k)
    stats = llama.last_speculation
    assert spec == plain
    for a, b in zip(spec_lp, plain_lp):
        torch.testing.assert_close(torch.tensor(a), torch.tensor(b), rtol=0, atol=1e-5)
    # Both kinds of check happened: drafts kept, drafts rejected.
    assert stats.checks > 20 and 0 < stats.accepted < stats.drafted, stats


def test_speculation_to_exactly_max_seq_len_and_with_stop_tokens(tiny_ckpt):
    llama = build(tiny_ckpt, max_seq_len=40)
    for ignore_stop in (True, False):
        plain, _ = llama.generate(PROMPTS, 200, temperature=0, ignore_stop=ignore_stop)
        spec, _ = llama.generate(PROMPTS, 200, temperature=0, ignore_stop=ignore_stop, speculate=Always(),
                                 draft_tokens=4)
        assert spec == plain
    assert [len(p) + len(t) for p, t in zip(PROMPTS, plain)] == [40] * len(PROMPTS)  # ignore_stop: the whole context


def test_ngram_speculation_on_a_repeating_prompt_keeps_drafts(tiny_ckpt):
    llama = build(tiny_ckpt, max_seq_len=128)
    prompt = [1] + list(range(500, 520)) * 3
    plain, _ = llama.generate([prompt], 60, temperature=0, ignore_stop=True)
    spec, _ = llama.generate([prompt], 60, temperature=0, ignore_stop=True, speculate="ngram")
    assert spec == plain
    assert llama.last_speculation.checks > 0


@pytest.mark.parametrize("method", ["int8", "int4"])
def test_on_the_integer_kernels_the_logprobs_are_the_same_bits(tiny_ckpt, method):
    llama = build(tiny_ckpt, max_seq_len=96, quantize=method)
    assert llama.info.quant_kernels == "integer"
    plain, plain_lp = llama.generate(PROMPTS, 50, temperature=0, logprobs=True, ignore_stop=True)
    for k in (2, 5):
        spec, spec_lp = llama.generate(PROMPTS, 50, temperature=0, logprobs=True, ignore_stop=True,
                                       speculate=Always(), draft_tokens=k)
        assert spec == plain and spec_lp == plain_lp  # float equality: bit for bit
        assert 0 < llama.last_speculation.accepted < llama.last_speculation.drafted


def test_a_session_keeps_only_the_tokens_kept(tiny_ckpt):
    """Turn after turn through one session, speculation gives a fresh plain run's tokens, and the session's cache
    holds exactly the kept tokens' keys and values: a later turn that reuses them gives a fresh run's logprobs."""
    llama = build(tiny_ckpt, max_seq_len=128)
    session = Session(llama.model)
    history = [1, 40, 41, 42, 40, 41]
    for turn in range(4):
        fresh, fresh_lp = llama.generate([history], 16, temperature=0, logprobs=True, ignore_stop=True)
        got, got_lp = llama.generate([history], 16, temperature=0, logprobs=True, ignore_stop=True, session=session,
                                     speculate=Always(), draft_tokens=3)
        assert got == fresh
        torch.testing.assert_close(torch.tensor(got_lp), torch.tensor(fresh_lp), rtol=0, atol=1e-5)
        if turn:
            assert session.last_reused > 0
        assert session.tokens == history + got[0][:-1]  # the last token was sampled, never fed
        history = history + got[0] + [60 + turn, 61 + turn]


def test_chat_replies_are_the_same_with_speculation(tmp_path):
    path, _ = write_tiny(tmp_path / "chat", "gqa", max_seq_len=256)
    llama = build(path, max_seq_len=256)
    plain = Conversation(llama, "Be brief.", max_gen_len=24)
    spec = Conversation(llama, "Be brief.", max_gen_len=24, speculate="ngram", draft_tokens=3)
    for message in ["hello there", "say it again", "and once more, please"]:
        a = plain.respond(plain.prepare(message), temperature=0)
        b = spec.respond(spec.prepare(message), temperature=0)
        assert b.tokens == a.tokens and b.text == a.text


@pytest.mark.parametrize("target_quantize, draft_quantize", [(None, "int8"), ("int8", "int4")])
def test_a_draft_model_gives_the_plain_tokens(tiny_ckpt, target_quantize, draft_quantize):
    """An int8 (or int4) copy of the model drafts: the plain decode's tokens, and on the integer kernels its bits."""
    target = build(tiny_ckpt, max_seq_len=96, quantize=target_quantize)
    draft = build(tiny_ckpt, max_seq_len=96, quantize=draft_quantize)
    plain, plain_lp = target.generate(PROMPTS, 50, temperature=0, logprobs=True, ignore_stop=True)
    spec, spec_lp = target.generate(PROMPTS, 50, temperature=0, logprobs=True, ignore_stop=True,
                                    speculate=DraftModel(draft, target), draft_tokens=4)
    stats = target.last_speculation
    assert spec == plain and stats.checks > 10 and 0 < stats.accepted < stats.drafted
    if target_quantize:
        assert spec_lp == plain_lp
    else:
        for a, b in zip(spec_lp, plain_lp):
            torch.testing.assert_close(torch.tensor(a), torch.tensor(b), rtol=0, atol=1e-5)


def test_a_draft_model_of_another_vocabulary_is_refused(tiny_ckpt, tmp_path):
    other, _ = write_tiny(tmp_path / "other", "gqa", vocab_size=4096)
    with pytest.raises(LlamaError, match="a draft model must share the model's tokenizer"):
        DraftModel(build(other), build(tiny_ckpt))


def test_sampling_probs_is_the_distribution_sample_top_p_draws_from():
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(50, generator=gen) * 2
    for temperature, top_p in ((1.0, 0.9), (0.7, 0.5), (1.3, 1.0)):
        probs = sampling_probs(logits, temperature, top_p)
        assert float(probs.sum()) == pytest.approx(1.0, abs=1e-6)
        draws = sample_top_p(torch.softmax(logits / temperature, -1).expand(20000, -1).clone(), top_p, gen)
        freq = torch.bincount(draws.reshape(-1), minlength=50).float() / 20000
        assert set(torch.nonzero(freq).reshape(-1).tolist()) <= set(torch.nonzero(probs).reshape(-1).tolist())
        assert float((freq - probs).abs().sum()) / 2 < 0.03


@pytest.mark.parametrize("with_draft_probs", [False, True])
def test_accepting_or_resampling_leaves_the_distribution_as_it_was(with_draft_probs):
    """Whatever is drafted, the token that stands at the position is distributed as `sample`'s draws: the rule of
    speculative sampling. Keeping every draft, or resampling from p instead of the residual, fails this."""
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(12, generator=gen)
    p = sampling_probs(logits, 1.0, 1.0)
    q = sampling_probs(torch.randn(12, generator=gen), 1.0, 1.0) if with_draft_probs else None
    n = 20000
    counts = Counter()
    for _ in range(n):
        drafted = int(torch.multinomial(q, 1, generator=gen)) if q is not None else 3
        replacement = accept_draft(logits, drafted, 1.0, 1.0, gen, draft_probs=q)
        counts[drafted if replacement is None else replacement] += 1
    freq = torch.tensor([counts[i] / n for i in range(12)])
    assert float((freq - p).abs().sum()) / 2 < 0.02, (freq, p)


def test_at_temperature_the_tokens_are_distributed_as_the_plain_sampler_s(tmp_path):
    """Over many seeds, the second and third generated tokens (where drafts are checked) come out as often with
    speculation as without it: their distributions lie within sampling noise of each other (total variation under
    0.12 over 400 draws where the model chooses among about 15 tokens). A rule that kept every draft would make the
    drafted token the second one every time (a distance over 0.2), as would one that resampled a rejected draft
    from p rather than the residual (about 0.25)."""
    path, _ = write_tiny(tmp_path / "t", "gqa", max_seq_len=32)
    llama = build(path, max_seq_len=32)
    prompt, n = [1, 50, 51, 52], 400

    def draws(**kwargs):
        out = []
        for seed in range(n):
            llama.generator.manual_seed(seed)
            (tokens,), _ = llama.generate([prompt], 3, temperature=0.08, top_p=0.95, ignore_stop=True, **kwargs)
            out.append(tuple(tokens))
        return out

    plain = draws()
    second = Counter(t[1] for t in plain)
    favourite = second.most_common(1)[0][0]
    assert 0.2 < second[favourite] / n < 0.8  # a drafted token the model often rejects
    # A draft model samples its drafts: an int4 copy of the model, whose distribution is near the model's but not it.
    draft = DraftModel(build(path, max_seq_len=32, quantize="int4"), llama)
    for spec in (draws(speculate=Fixed([favourite, favourite]), draft_tokens=2), draws(speculate=draft, draft_tokens=2)):
        # Two plain runs of 400 other seeds each lay 0.05-0.07 apart at position 1 and 0.08-0.11 at position 2,
        # where the model chooses among about 30 tokens.
        for position, bound in ((1, 0.12), (2, 0.18)):
            a, b = Counter(t[position] for t in plain), Counter(t[position] for t in spec)
            tv = sum(abs(a[x] - b[x]) for x in set(a) | set(b)) / (2 * n)
            assert tv < bound, (position, tv)


def test_requests_that_cannot_speculate_are_refused(tiny_ckpt):
    llama = build(tiny_ckpt)
    with pytest.raises(LlamaError, match="kv_cache=False"):
        llama.generate([[1, 2, 3]], 4, speculate="ngram", kv_cache=False)
    with pytest.raises(LlamaError, match="speculate= takes ngram"):
        llama.generate([[1, 2, 3]], 4, speculate="draft")
    with pytest.raises(LlamaError, match="draft_tokens= takes a whole number from 1 to 16"):
        llama.generate([[1, 2, 3]], 4, speculate="ngram", draft_tokens=0)


@pytest.mark.slow
def test_the_commands_speculate_and_print_the_plain_text(nonstop_ckpt):
    flags = ["--prompt", "one two three one two three one two", "--max-gen-len", "40", "--max-seq-len", "64"]
    plain = generate_json(nonstop_ckpt, *flags, max_gen_len=40)
    spec = generate_json(nonstop_ckpt, *flags, "--speculate", "ngram", "--draft-tokens", "3", max_gen_len=40)
    assert spec[0]["tokens"] == plain[0]["tokens"] and spec[0]["text"] == plain[0]["text"]
    torch.testing.assert_close(torch.tensor(spec[0]["logprobs"]), torch.tensor(plain[0]["logprobs"]), rtol=0, atol=1e-5)
    counts = spec[0]["speculation"]
    assert counts["checks"] + counts["plain_steps"] >= 1 and counts["accepted"] <= counts["drafted"]
    stats = generate(nonstop_ckpt, *flags, "--speculate", "ngram", "--stats")
    assert stats.returncode == 0 and "speculation:     ngram, drafts of up to 4 tokens: " in stats.stderr
    drafted = generate_json(nonstop_ckpt, *flags, "--draft-model", nonstop_ckpt, "--draft-quantize", "int8",
                            max_gen_len=40)
    assert drafted[0]["tokens"] == plain[0]["tokens"] and drafted[0]["speculation"]["accepted"] > 0
    messages = "hello there\nsay that again\n"
    assert (chat(nonstop_ckpt, "--speculate", "ngram", "--max-gen-len", "16", input=messages).stdout
            == chat(nonstop_ckpt, "--max-gen-len", "16", input=messages).stdout)


@pytest.mark.slow
def test_the_commands_refuse_speculation_they_cannot_run_in_one_line(gqa_ckpt):
    assert_one_line_error(generate(gqa_ckpt, "--prompt", "a", "--speculate", "draft"), "--speculate takes ngram, not 'draft'")
    assert_one_line_error(generate(gqa_ckpt, "--prompt", "a", "--speculate", "ngram", "--draft-tokens", "0"),
                          "--draft-tokens takes a whole number from 1 to 16, not 0")
    assert_one_line_error(generate(gqa_ckpt, "--prompt", "a", "--speculate", "ngram", "--no-kv-cache"),
                          "it cannot run with --no-kv-cache")
    assert_one_line_error(run("llama-chat", "--ckpt-dir", gqa_ckpt, "--speculate", "ngram", "--no-kv-cache", input=""),
                          "it cannot run with --no-kv-cache")
    assert_one_line_error(generate(gqa_ckpt, "--prompt", "a", "--speculate", "ngram", "--draft-model", gqa_ckpt),
                          "two ways to draft; give one")
    assert_one_line_error(generate(gqa_ckpt, "--prompt", "a", "--draft-quantize", "int4"), "--draft-quantize")
    assert_one_line_error(generate(gqa_ckpt, "--prompt", "a", "--draft-model", gqa_ckpt, "--no-kv-cache"),
                          "it cannot run with --no-kv-cache")
