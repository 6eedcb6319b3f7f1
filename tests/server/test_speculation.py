"""Speculative decoding in the server: drafts checked in the batched step give the plain decode's answers.

Each draft's tokens are rows of the batched step at consecutive positions through the sequence's blocks, so every
drafted position's logits are the plain step's. Greedy completions equal a solo `Llama.generate` token for token
beside other requests, through tiny blocks, preemption and stop strings; on the integer kernels their logprobs
are the same bits; the blocks a rejected draft took are let go, and what enters the prefix tree is what the plain
decode enters. The drafter of most tests (`Always`) drafts at every step and is mostly wrong, so rejection is
exercised as much as acceptance.
"""

import signal

import pytest

from helpers import Always, Server, build, make_engine, prompts, run, run_jobs, solo, write_tiny
from llama.server.engine import MAX_STEP_ROWS, Delta, Job

openai = pytest.importorskip("openai")

MAX_SEQ_LEN = 128
MAX_TOKENS = [24, 5, 30, 12, 40, 17, 9, 20]


@pytest.fixture(scope="module")
def llama(gqa_ckpt):
    return build(gqa_ckpt, max_seq_len=MAX_SEQ_LEN)


@pytest.mark.parametrize("config", [
    dict(),
    dict(num_blocks=256, block_size=1, prefill_chunk=3),
    dict(num_blocks=20, block_size=4, parallel=8, prefill_chunk=8),  # too small for all: waits and preemption
], ids=["default", "tiny-blocks-and-chunks", "small-cache"])
@pytest.mark.parametrize("draft_tokens", [1, 4])
def test_greedy_completions_with_drafts_equal_generate_alone(llama, config, draft_tokens):
    engine = make_engine(llama, speculate=Always(), draft_tokens=draft_tokens, **config)
    ps = prompts(llama)
    collectors = run_jobs(engine, [Job(p, m, None, temperature=0) for p, m in zip(ps, MAX_TOKENS)])
    for p, m, c in zip(ps, MAX_TOKENS, collectors):
        tokens, _ = solo(llama, p, m)
        assert c.texts() == [llama.tokenizer.decode(tokens)]
        stopped = len(tokens) < m
        assert c.finish_reasons() == ["stop" if stopped else "length"]
        assert c.usage().completion_tokens == len(tokens) + stopped
    assert 0 < engine.accepted_tokens_total < engine.drafted_tokens_total
    if config.get("num_blocks") == 20:
        assert engine.preemptions_total > 0, "the small cache was meant to force preemption"
    engine.drain(5)
    assert engine.scheduler.pool.used == 0  # no block a rejected draft took is still held


@pytest.mark.parametrize("quantize", ["int8", "int4"])
def test_on_the_integer_kernels_the_logprobs_are_the_same_bits(gqa_ckpt, quantize):
    llama = build(gqa_ckpt, max_seq_len=MAX_SEQ_LEN, quantize=quantize)
    assert llama.info.quant_kernels == "integer"
    engine = make_engine(llama, speculate=Always(), draft_tokens=3, parallel=2)  # 2 x 4 rows: every draft made
    ps = prompts(llama)
    collectors = run_jobs(engine, [Job(p, m, None, temperature=0, logprobs=2) for p, m in zip(ps, MAX_TOKENS)])
    for p, m, c in zip(ps, MAX_TOKENS, collectors):
        tokens, logprobs = solo(llama, p, m, logprobs=True)
        got = [lp for e in c.events if isinstance(e, Delta) for lp in e.logprobs][: len(tokens)]
        assert [lp.token for lp in got] == tokens
        assert [lp.logprob for lp in got] == logprobs  # float equality: bit for bit
        assert all(len(lp.top) == 2 for lp in got)
    assert engine.accepted_tokens_total > 0
    engine.drain(5)


def test_the_prefix_tree_holds_what_the_plain_decode_leaves(llama):
    """A follow-up that continues a speculated reply reuses exactly the positions the plain decode's would, and its
    answer is a fresh run's: no rejected token's keys and values were entered as if kept."""
    ps = prompts(llama)
    reuse = {}
    for name, settings in (("plain", {}), ("speculating", dict(speculate=Always(), draft_tokens=4))):
        engine = make_engine(llama, block_size=4, **settings)
        (first,) = run_jobs(engine, [Job(ps[0], 30, None, temperature=0)])
        reply, _ = solo(llama, ps[0], 30)
        follow = ps[0] + reply + llama.tokenizer.encode("And a tuple?", bos=False, eos=False)
        (second,) = run_jobs(engine, [Job(follow, 10, None, temperature=0)])
        assert second.texts() == [llama.tokenizer.decode(solo(llama, follow, 10)[0])]
        reuse[name] = second.usage().cached_tokens
        engine.drain(5)
    assert reuse["speculating"] == reuse["plain"] > len(ps[0])


def test_stop_strings_and_max_tokens_end_where_they_would_without_drafts(llama):
    engine = make_engine(llama, speculate=Always(), draft_tokens=4)
    p = prompts(llama)[4]
    full = llama.tokenizer.decode(solo(llama, p, 40)[0])
    stop = full[len(full) // 2 : len(full) // 2 + 3]
    (c,) = run_jobs(engine, [Job(p, 40, None, temperature=0, stop=[stop])])
    assert c.texts() == [full[: full.index(stop)]] and c.finish_reasons() == ["stop"]
    for m in (1, 2, 3, 7):  # a check yields up to 5 tokens: none past max_tokens is kept
        (c,) = run_jobs(engine, [Job(p, m, None, temperature=0, ignore_eos=True)])
        assert c.usage().completion_tokens == m and c.finish_reasons() == ["length"]
    engine.drain(5)


def test_seeded_sampling_with_drafts_does_not_depend_on_what_else_runs(llama):
    """Above temperature 0 a draft is accepted with the model's probability (and replaced from the residual), drawn
    from the choice's own generator: the same seed gives the same text alone and in a crowd."""
    engine = make_engine(llama, speculate=Always(), draft_tokens=3)
    ps = prompts(llama)
    job = lambda p, seed: Job(p, 20, None, temperature=1.5, top_p=0.95, seed=seed)  # noqa: E731
    (alone,) = run_jobs(engine, [job(ps[0], 123)])
    # One beside it, drafts of 3: 8 rows, within MAX_STEP_ROWS, so every draft it would make alone is made.
    crowd = run_jobs(engine, [job(ps[1], 7), job(ps[0], 123)])
    assert crowd[1].texts() == alone.texts()
    assert engine.drafted_tokens_total > 0
    engine.drain(5)


def test_a_step_feeds_at_most_max_step_rows_with_drafts_among_them(llama, monkeypatch):
    from llama.server.runner import Runner

    engine = make_engine(llama, speculate=Always(), draft_tokens=4)
    widths = []
    step = Runner.step
    monkeypatch.setattr(Runner, "step", lambda self, copies, rows: widths.append(sum(1 + len(r.draft) for r in rows
                                                                                 if len(r.tokens) == 1))
                        or step(self, copies, rows))
    ps = prompts(llama)
    collectors = run_jobs(engine, [Job(p, 20, None, temperature=0) for p in ps])
    for p, c in zip(ps, collectors):
        assert c.texts() == [llama.tokenizer.decode(solo(llama, p, 20)[0])]
    assert max(widths) == MAX_STEP_ROWS  # 8 sequences and drafts of 4 would make 40
    assert engine.drafted_tokens_total > 0  # while fewer decoded, some drafted
    engine.drain(5)


def test_the_usage_counts_drafted_tokens_as_openai_counts_a_prediction(llama):
    engine = make_engine(llama, speculate=Always(), draft_tokens=4)
    (c,) = run_jobs(engine, [Job(prompts(llama)[0], 30, None, temperature=0, n=2)])
    done = c.usage()
    assert done.drafted_tokens == engine.drafted_tokens_total and done.accepted_tokens == engine.accepted_tokens_total
    assert done.drafted_tokens > 0 and done.accepted_tokens <= done.drafted_tokens
    stats = engine.stats()
    assert stats["speculative_drafted_tokens_total"] == done.drafted_tokens
    engine.drain(5)
    plain = make_engine(llama)
    (c,) = run_jobs(plain, [Job(prompts(llama)[0], 5, None, temperature=0)])
    assert c.usage().drafted_tokens is None and "speculative_drafted_tokens_total" not in plain.stats()
    plain.drain(5)


def test_a_server_with_speculate_ngram_answers_as_without(tmp_path):
    """The real command and the real client: `--speculate ngram` gives the text of a server without it, and says what
    it drafted in `usage.completion_tokens_details` and /metrics."""
    ckpt, _ = write_tiny(tmp_path / "gqa", "gqa")
    prompt = "one two three four five six one two three four five six one two three"
    answers, usages = {}, {}
    for name, flags in (("plain", ()), ("ngram", ("--speculate", "ngram", "--draft-tokens", "3"))):
        server = Server(ckpt, "--no-compile", "--parallel", "2", *flags)
        try:
            r = server.client().completions.create(model="m", prompt=prompt, max_tokens=40, temperature=0)
            answers[name], usages[name] = r.choices[0].text, r.usage
            metrics = server.metrics()
        finally:
            assert server.stop(signal.SIGINT) == 0, "\n".join(server.lines[-20:])
    assert answers["ngram"] == answers["plain"]
    details = usages["ngram"].completion_tokens_details
    drafted = details.accepted_prediction_tokens + details.rejected_prediction_tokens
    assert drafted > 0
    assert metrics["llama_kv_speculative_drafted_tokens_total"] == drafted
    assert metrics["llama_kv_speculative_accepted_tokens_total"] == details.accepted_prediction_tokens
    assert usages["plain"].completion_tokens_details is None


@pytest.mark.parametrize("flags, message", [
    (("--speculate", "ngram", "--no-kv-cache"), "cannot run with --no-kv-cache"),
    (("--speculate", "medusa"), "speculate= takes ngram"),
    (("--speculate", "ngram", "--draft-tokens", "0"), "a whole number from 1 to 16"),
])
def test_speculation_the_server_cannot_run_is_refused_in_one_line(gqa_ckpt, flags, message):
    r = run("llama-server", "--ckpt-dir", gqa_ckpt, "--port", "0", *flags, timeout=60)
    assert r.returncode != 0 and "Traceback" not in r.stderr
    (line,) = [ln for ln in r.stderr.splitlines() if ln.startswith("error:")]
    assert message.replace("speculate=", "--speculate") in line or message in line, line
