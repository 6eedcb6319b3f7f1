"""The headline claim: the KV cache changes speed, never the answer.

Cached and uncached runs of the same weights give the same logits at every position (float32, 1e-5
absolute), the same greedy tokens, and the same logprobs; a batch of prompts of different lengths gives
what each prompt gives alone.
"""

import pytest
import torch

from helpers import build
from llama import generation
from llama.io.checkpoint import load_checkpoint, model_args, read_params
from reference import reference_logits

PROMPTS = [
    "I believe the meaning of life is",
    "Simply put, the theory of relativity states that",
    "def fibonacci(n):",
    "A",
]


def _prompt_tokens(llama, prompts=PROMPTS):
    return [llama.tokenizer.encode(p, bos=True, eos=False) for p in prompts]


@pytest.mark.parametrize("prefill_chunks", [[40], [12, 28], [1] * 40], ids=["one-token-steps", "two-chunks", "all-single"])
def test_cached_logits_equal_uncached_at_every_position(tiny_ckpt, prefill_chunks):
    """Prefill some tokens (in one or more chunks), then one token per step; compare with one uncached pass."""
    llama = build(tiny_ckpt)
    model = llama.model
    tokens = torch.randint(0, model.vocab_size, (3, 48), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        uncached = model(tokens)  # (3, 48, vocab), positions 0..47 fed at once from start_pos 0
        cache = model.new_kv_cache(3, 48)
        pieces, pos = [], 0
        for n in prefill_chunks:
            pieces.append(model(tokens[:, pos : pos + n], pos, cache))
            pos += n
        for pos in range(pos, 48):
            pieces.append(model(tokens[:, pos : pos + 1], pos, cache))
    cached = torch.cat(pieces, dim=1)
    assert cached.shape == uncached.shape == (3, 48, model.vocab_size)
    torch.testing.assert_close(cached, uncached, rtol=0, atol=1e-5)


def test_uncached_step_logits_equal_a_growing_prefix(gqa_ckpt):
    """Each uncached step's last logits are those of the prefix alone: later tokens never leak in."""
    model = build(gqa_ckpt).model
    tokens = torch.randint(0, model.vocab_size, (2, 30), generator=torch.Generator().manual_seed(2))
    with torch.inference_mode():
        full = model(tokens)
        for cur in (1, 2, 17, 30):
            torch.testing.assert_close(model(tokens[:, :cur], 0, num_logits=1)[:, 0], full[:, cur - 1], rtol=0, atol=1e-5)


def test_both_paths_match_the_reference_implementation(tiny_ckpt):
    llama = build(tiny_ckpt)
    params = model_args(read_params(tiny_ckpt), 64, 8, llama.tokenizer.n_words)
    state_dict = load_checkpoint(tiny_ckpt, params)
    tokens = torch.randint(0, params.vocab_size, (2, 24), generator=torch.Generator().manual_seed(3))
    ref = reference_logits(state_dict, params, tokens).float()
    with torch.inference_mode():
        cache = llama.model.new_kv_cache(2, 24)
        cached = torch.cat([llama.model(tokens[:, :8], 0, cache)] +
                           [llama.model(tokens[:, p : p + 1], p, cache) for p in range(8, 24)], dim=1)
        uncached = llama.model(tokens)
    # float32 against float64 on logits of magnitude ~4: measured within 3.2e-6. 2e-5 leaves room for other
    # CPUs' orders of additions; a wrong rotary layout, mask, cache position or head grouping is off by ~1.
    torch.testing.assert_close(uncached, ref, rtol=0, atol=2e-5)
    torch.testing.assert_close(cached, ref, rtol=0, atol=2e-5)


def test_greedy_generation_is_identical_with_and_without_cache(tiny_ckpt):
    llama = build(tiny_ckpt)
    prompts = _prompt_tokens(llama)
    runs = {
        # ignore_stop: every row runs its 24 steps, whatever a random model ranks first.
        kv: llama.generate(prompts, max_gen_len=24, temperature=0, logprobs=True, echo=True, kv_cache=kv,
                           ignore_stop=True)
        for kv in (True, False)
    }
    (tok_c, lp_c), (tok_u, lp_u) = runs[True], runs[False]
    assert tok_c == tok_u
    for row_c, row_u, toks in zip(lp_c, lp_u, tok_c):
        assert len(row_c) == len(row_u) == len(toks)
        torch.testing.assert_close(torch.tensor(row_c), torch.tensor(row_u), rtol=0, atol=1e-5)
    # echo returned the prompts in front of their 24 new tokens.
    for prompt, toks in zip(prompts, tok_c):
        assert toks[: len(prompt)] == prompt and len(toks) == len(prompt) + 24


def test_logprobs_are_those_of_the_model(gqa_ckpt):
    """With echo, logprob[i] is log p(token i | tokens before it); the first (bos) gets 0."""
    llama = build(gqa_ckpt)
    prompt = _prompt_tokens(llama)[:1]
    for kv in (True, False):
        (toks,), (lps,) = llama.generate(prompt, max_gen_len=6, temperature=0, logprobs=True, echo=True, kv_cache=kv)
        with torch.inference_mode():
            logits = llama.model(torch.tensor([toks]))[0]
        expected = torch.log_softmax(logits[:-1], -1).gather(-1, torch.tensor(toks[1:])[:, None])[:, 0]
        assert lps[0] == 0.0
        torch.testing.assert_close(torch.tensor(lps[1:]), expected, rtol=0, atol=1e-5)


@pytest.mark.parametrize("kv_cache", [True, False])
def test_each_prompt_of_a_mixed_length_batch_gives_what_it_gives_alone(gqa_ckpt, kv_cache):
    llama = build(gqa_ckpt)
    prompts = _prompt_tokens(llama)
    assert len({len(p) for p in prompts}) == len(prompts)  # really different lengths
    batch_tokens, batch_lps = llama.generate(prompts, 20, temperature=0, logprobs=True, kv_cache=kv_cache)
    for prompt, toks, lps in zip(prompts, batch_tokens, batch_lps):
        (alone_toks,), (alone_lps,) = llama.generate([prompt], 20, temperature=0, logprobs=True, kv_cache=kv_cache)
        assert toks == alone_toks
        torch.testing.assert_close(torch.tensor(lps), torch.tensor(alone_lps), rtol=0, atol=1e-5)


def test_a_one_token_prompt(tiny_ckpt):
    llama = build(tiny_ckpt)
    bos_only = [[llama.tokenizer.bos_id]]
    cached = llama.generate(bos_only, 10, temperature=0, logprobs=True, kv_cache=True, ignore_stop=True)
    uncached = llama.generate(bos_only, 10, temperature=0, logprobs=True, kv_cache=False, ignore_stop=True)
    assert cached[0] == uncached[0] and len(cached[0][0]) == 10
    torch.testing.assert_close(torch.tensor(cached[1]), torch.tensor(uncached[1]), rtol=0, atol=1e-5)


def test_generation_runs_to_exactly_max_seq_len(gqa_ckpt):
    llama = build(gqa_ckpt, max_seq_len=32)
    prompts = _prompt_tokens(llama)
    # ignore_stop: every row fills the context to its last position, whatever a random model ranks first.
    results = [llama.generate(prompts, max_gen_len=1000, temperature=0, echo=True, kv_cache=kv, ignore_stop=True)[0]
               for kv in (True, False)]
    assert results[0] == results[1]
    assert [len(t) for t in results[0]] == [32] * len(prompts)
    assert llama.last_kv_cache_bytes == 0  # the uncached run allocated no cache


def test_cache_is_allocated_for_the_run_not_for_max_seq_len(gqa_ckpt):
    llama = build(gqa_ckpt, max_seq_len=64)
    prompts = _prompt_tokens(llama)[:2]
    llama.generate(prompts, max_gen_len=5, temperature=0)
    total_len = max(len(p) for p in prompts) + 5
    # 2 layers x (keys + values) x batch 2 x 2 KV heads x total_len x head_dim 8 x 4 bytes
    assert llama.last_kv_cache_bytes == 2 * 2 * 2 * 2 * total_len * 8 * 4


def test_bf16_stays_close_to_the_float32_reference(gqa_ckpt):
    f32 = build(gqa_ckpt, dtype="float32")
    bf16 = build(gqa_ckpt, dtype="bfloat16")
    assert bf16.model.output.weight.dtype == torch.bfloat16
    tokens = torch.randint(0, f32.model.vocab_size, (8, 64), generator=torch.Generator().manual_seed(4))
    with torch.inference_mode():
        ref = f32.model(tokens)
        uncached = bf16.model(tokens)
        cache = bf16.model.new_kv_cache(8, 64)
        cached = torch.cat([bf16.model(tokens[:, :32], 0, cache)] +
                           [bf16.model(tokens[:, p : p + 1], p, cache) for p in range(32, 64)], dim=1)
    # bf16 keeps 8 significant bits: on logits of magnitude ~10, errors of a few tenths are expected.
    # Both bf16 paths are held to the float32 reference, not to each other.
    scale = ref.abs().max().item()
    for got in (cached, uncached):
        torch.testing.assert_close(got, ref, rtol=0, atol=0.05 * scale)
        assert (got - ref).abs().mean().item() < 0.01 * scale
        # The most likely token agrees with float32 wherever float32 is not near a tie. How many positions are
        # that clear depends on the random weights (8 of 64 for one seed): of 512, at least 8, short of a
        # coincidence.
        top2 = ref.topk(2, dim=-1).values
        clear = (top2[..., 0] - top2[..., 1]) > 0.1 * scale
        assert clear.sum() >= 8
        assert torch.equal(got.argmax(-1)[clear], ref.argmax(-1)[clear])


@pytest.mark.parametrize("quantize", [None, "int8"], ids=["float32", "int8"])
def test_a_prompt_is_fed_in_chunks_ending_at_multiples_of_prompt_chunk(gqa_ckpt, monkeypatch, quantize):
    """`feed_in_chunks` feeds positions 5..29 as 5-7, 8-15, 16-23, 24-29 (PROMPT_CHUNK 8) and returns the logits of
    the last num_logits positions: those of one uncached pass, the same bits on the integer kernels (rows computed
    alone), within 1e-5 in float32."""
    monkeypatch.setattr(generation, "PROMPT_CHUNK", 8)
    model = build(gqa_ckpt, quantize=quantize).model
    tokens = torch.randint(0, model.vocab_size, (2, 30), generator=torch.Generator().manual_seed(3))
    calls = []

    def forward(x, start_pos, cache, num_logits):
        calls.append((start_pos, x.shape[1], num_logits))
        return model(x, start_pos, cache, num_logits=num_logits)

    atol = 0 if quantize else 1e-5
    with torch.inference_mode():
        uncached = model(tokens)
        for num_logits, logits_calls in ((25, [3, 8, 8, 6]), (10, [1, 1, 4, 6]), (1, [1, 1, 1, 1])):
            cache, calls[:] = model.new_kv_cache(2, 30), []
            model(tokens[:, :5], 0, cache)
            logits = generation.feed_in_chunks(forward, tokens, 5, 30, cache, num_logits)
            assert calls == [(5, 3, logits_calls[0]), (8, 8, logits_calls[1]), (16, 8, logits_calls[2]),
                             (24, 6, logits_calls[3])]
            assert logits.shape == (2, num_logits, model.vocab_size)
            torch.testing.assert_close(logits, uncached[:, 30 - num_logits :], rtol=0, atol=atol)


def test_generate_reads_a_long_prompt_in_chunks_with_the_answer_unchanged(gqa_ckpt, monkeypatch):
    """A prompt longer than PROMPT_CHUNK, cached (read in chunks) and uncached, on the integer kernels: the same
    tokens and log-probabilities, bit for bit, echoed prompt included."""
    monkeypatch.setattr(generation, "PROMPT_CHUNK", 8)
    llama = build(gqa_ckpt, quantize="int8")
    prompt = torch.randint(3, llama.model.vocab_size, (37,), generator=torch.Generator().manual_seed(4)).tolist()
    runs = [llama.generate([prompt], 12, temperature=0, logprobs=True, echo=True, ignore_stop=True, kv_cache=kv)
            for kv in (True, False)]
    assert len(runs[0][0][0]) == 37 + 12 and runs[0][0] == runs[1][0]
    assert runs[0][1] == runs[1][1]


@pytest.mark.parametrize("quantize", [None, "int8"], ids=["float32", "int8"])
def test_the_switch_holds_through_a_prompt_of_2100_tokens_read_in_chunks_of_512(gqa_ckpt, quantize):
    """At PROMPT_CHUNK's own size: a 2,100-token prompt (chunks ending at 512, 1,024, 1,536, 2,048 and 2,100) and 6
    tokens after it, cached against uncached: the same tokens; log-probabilities the same bits on the integer
    kernels, within 1e-5 in float32."""
    assert generation.PROMPT_CHUNK == 512
    llama = build(gqa_ckpt, max_seq_len=2112, max_batch_size=1, quantize=quantize)
    prompt = torch.randint(3, llama.model.vocab_size, (2100,), generator=torch.Generator().manual_seed(5)).tolist()
    (cached,), (lp_cached,) = llama.generate([prompt], 6, temperature=0, logprobs=True, ignore_stop=True)
    (uncached,), (lp_uncached,) = llama.generate([prompt], 6, temperature=0, logprobs=True, ignore_stop=True,
                                                 kv_cache=False)
    assert len(cached) == 6 and cached == uncached
    if quantize:
        assert lp_cached == lp_uncached
    else:
        torch.testing.assert_close(torch.tensor(lp_cached), torch.tensor(lp_uncached), rtol=0, atol=1e-5)
