"""The serving loop in process, against `Llama.generate` alone: the cache and the batch change speed, never the answer.

Greedy completions equal a solo `generate` of the same prompt token for token, whatever runs beside them,
whatever prefix they reuse, through chunked prompts, preemption and `--no-kv-cache`; seeded sampling does
not depend on what else runs; log-probabilities agree within 1e-5.
"""

import threading

import pytest
import torch

from helpers import build, make_engine, prompts, run_jobs, solo, write_tiny
from llama.compile.aot import PagedStep
from llama.generation import Llama
from llama.server.engine import Delta, Done, Engine, Failed, Job, PromptLogprobs
from llama.server.runner import Row, Runner
from llama.server.scheduler import Scheduler

MAX_SEQ_LEN = 128


@pytest.fixture(scope="module")
def llama(gqa_ckpt):
    return build(gqa_ckpt, max_seq_len=MAX_SEQ_LEN)


@pytest.mark.parametrize("config", [
    dict(),
    dict(num_blocks=256, block_size=1, prefill_chunk=3),
    dict(num_blocks=20, block_size=4, parallel=8, prefill_chunk=8),  # too small for all: waits and preemption
    dict(kv_cache=False),
], ids=["default", "tiny-blocks-and-chunks", "small-cache", "no-kv-cache"])
def test_greedy_completions_equal_generate_alone(llama, config):
    engine = make_engine(llama, **config)
    ps = prompts(llama)
    max_tokens = [24, 5, 30, 12, 40, 17, 9, 20]
    collectors = run_jobs(engine, [Job(p, m, None, temperature=0) for p, m in zip(ps, max_tokens)])
    for p, m, c in zip(ps, max_tokens, collectors):
        tokens, _ = solo(llama, p, m)
        assert c.texts() == [llama.tokenizer.decode(tokens)]
        stopped = len(tokens) < m
        assert c.finish_reasons() == ["stop" if stopped else "length"]
        assert c.usage().completion_tokens == len(tokens) + stopped  # the stop token counts, unshown
        assert c.usage().prompt_tokens == len(p)
    if config.get("num_blocks") == 20:
        assert engine.preemptions_total > 0, "the small cache was meant to force preemption"
    engine.drain(5)
    if engine.scheduler.pool is not None:
        assert engine.scheduler.pool.used == 0


def test_a_shared_prefix_is_reused_and_changes_nothing(llama):
    engine = make_engine(llama, block_size=4)
    ps = prompts(llama)
    (first,) = run_jobs(engine, [Job(ps[0], 10, None, temperature=0)])
    assert first.usage().cached_tokens == 0
    # The others share the system prompt; the third continues the first's prompt and reply.
    tokens0, _ = solo(llama, ps[0], 10)
    follow = ps[0] + tokens0 + llama.tokenizer.encode("And a tuple?", bos=False, eos=False)
    collectors = run_jobs(engine, [Job(ps[1], 10, None, temperature=0), Job(follow, 10, None, temperature=0)])
    shared = len(ps[0]) - 5  # the system prompt's tokens, at least
    assert collectors[0].usage().cached_tokens >= shared // 4 * 4
    assert collectors[1].usage().cached_tokens == len(ps[0]) + len(tokens0) - 1  # all that was fed, to the token
    for p, c in zip([ps[1], follow], collectors):
        assert c.texts() == [llama.tokenizer.decode(solo(llama, p, 10)[0])]
    engine.drain(5)


def test_seeded_sampling_does_not_depend_on_what_else_runs(llama):
    engine = make_engine(llama)
    ps = prompts(llama)
    job = lambda p, seed: Job(p, 20, None, temperature=1.5, top_p=0.95, seed=seed)  # noqa: E731
    (alone,) = run_jobs(engine, [job(ps[0], 123)])
    crowd = run_jobs(engine, [job(p, 7) for p in ps[1:5]] + [job(ps[0], 123)] + [job(p, 9) for p in ps[5:]])
    assert crowd[4].texts() == alone.texts()
    # And it is what Llama.generate draws with the same seed.
    seeded = Llama(llama.model, llama.tokenizer, seed=123)
    assert alone.texts() == [llama.tokenizer.decode(solo(seeded, ps[0], 20, temperature=1.5, top_p=0.95)[0])]
    engine.drain(5)


def test_n_choices_share_their_prompt_and_each_is_reproducible(llama):
    engine = make_engine(llama)
    p = prompts(llama)[2]
    (c,) = run_jobs(engine, [Job(p, 12, None, n=3, temperature=1.5, seed=5)])
    texts = c.texts(3)
    for i in range(3):  # choice i draws from seed + i
        (one,) = run_jobs(engine, [Job(p, 12, None, temperature=1.5, seed=5 + i)])
        assert one.texts() == [texts[i]]
    assert c.usage().prompt_tokens == len(p)
    engine.drain(5)


def test_stop_strings_end_the_text_before_them_and_never_leak(llama):
    engine = make_engine(llama)
    p = prompts(llama)[4]
    full = llama.tokenizer.decode(solo(llama, p, 40)[0])
    stop = full[len(full) // 2 : len(full) // 2 + 3]
    (c,) = run_jobs(engine, [Job(p, 40, None, temperature=0, stop=[stop, "never-there"])])
    assert c.texts() == [full[: full.index(stop)]] and c.finish_reasons() == ["stop"]
    for e in c.events:  # no delta ever carried the stop string's beginning beyond the final text
        if isinstance(e, Delta):
            assert stop[0] not in e.text or full.index(stop) > 0
    engine.drain(5)


def test_logprobs_equal_generate_s_including_the_echoed_prompt(llama):
    engine = make_engine(llama, prefill_chunk=5)  # the prompt's log-probabilities come in pieces
    p = prompts(llama)[0]
    (c,) = run_jobs(engine, [Job(p, 8, None, temperature=0, logprobs=2, echo_logprobs=True)])
    tokens, logprobs = solo(llama, p, 8, logprobs=True, echo=True)
    prompt_lps = [lp for e in c.events if isinstance(e, PromptLogprobs) for lp in e.logprobs]
    gen_lps = [lp for e in c.events if isinstance(e, Delta) for lp in e.logprobs]
    assert [x.token for x in prompt_lps] == p and prompt_lps[0].logprob is None
    assert [x.token for x in gen_lps] == tokens[len(p):]
    ours = [x.logprob for x in prompt_lps[1:] + gen_lps]
    assert ours == pytest.approx(logprobs[1:], abs=1e-5)
    assert all(len(x.top) == 2 and x.top[0][1] >= x.top[1][1] for x in prompt_lps[1:] + gen_lps)
    engine.drain(5)


@pytest.mark.slow
@pytest.mark.skipif(__import__("shutil").which("g++") is None, reason="needs a C++ compiler")
@pytest.mark.parametrize("how", ["stored", "torch.compile"])
def test_the_compiled_decode_step_gives_the_same_completions(gqa_ckpt, how, monkeypatch):
    """On the CPU the step comes from stored packages (llama/compile/aot.py's PagedStep: one row, and 2-16 rows), as
    llama-server's default; LLAMA_COMPILE_AOT=0 (and a GPU) compile it with torch.compile instead."""
    if how == "torch.compile":
        monkeypatch.setenv("LLAMA_COMPILE_AOT", "0")
    # Dynamo's limit on compilations per function counts over the whole process (other tests, a second server,
    # a compiled Llama); with fullgraph=True passing it is an error. A limit of 1 here stands for a process that
    # has compiled a lot already: the server's step keeps its own.
    with torch._dynamo.config.patch(recompile_limit=1):
        _serve_compiled(gqa_ckpt, stored=how == "stored")


def test_the_block_size_is_part_of_a_stored_server_steps_key(gqa_ckpt):
    """The generated code holds the block size in its index arithmetic: a package built for blocks of 4 read past
    the pool of a server with blocks of 16 (an earlier version, which keyed packages without it)."""
    from llama.compile.store import describe_key, package_dir

    model = build(gqa_ckpt, max_seq_len=MAX_SEQ_LEN).model
    places = {package_dir(describe_key(model, [2, 16], "paged",
                                       PagedStep(model, model.new_paged_kv_cache(8, bs)).key_extra))
              for bs in (4, 16, 4)}
    assert len(places) == 2


def _serve_compiled(gqa_ckpt, stored):
    # Its own model, its layers planned for the compiled step as llama-server loads them (the runner compiles the
    # classes it is given): the packages it stores are the ones tests/server/test_server.py's default server loads.
    llama = build(gqa_ckpt, max_seq_len=MAX_SEQ_LEN, compile_layers=True)
    scheduler = Scheduler(64, 4, 8, 16)
    runner = Runner(llama.model, 64, 4, plan=llama.info.plan, max_rows=8)
    assert (runner.compiled_step is not None and isinstance(runner.compiled_step.ahead_of_time, PagedStep)) == stored
    engine = Engine(llama.tokenizer, scheduler, runner)
    engine.start()
    ps = prompts(llama)
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    collectors = run_jobs(engine, [Job(p, 12, None, temperature=0) for p in ps])
    for p, c in zip(ps, collectors):
        assert c.texts() == [llama.tokenizer.decode(solo(llama, p, 12)[0])]
    # Compiled before serving: no batch size or cache length met while serving compiled anything again.
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == graphs
    engine.drain(5)


def test_a_prompt_chunk_reads_only_the_blocks_up_to_its_last_position(llama, monkeypatch):
    """A prompt holds all its blocks from the step it is admitted; a chunk of it attends over the blocks up to its
    own positions, not over every block of the prompt (the later ones hidden by the mask, but computed)."""
    runner = Runner(llama.model, 64, 4)
    widths, for_step = [], runner.cache.for_step
    monkeypatch.setattr(runner.cache, "for_step", lambda tables, pos: widths.append(tables.shape[1]) or for_step(tables, pos))
    tokens = list(range(5, 45))
    for start in (0, 8, 16, 30):
        runner.step([], [Row(tokens[start : start + 8], start, list(range(10)))])  # 10 blocks of 4: the whole prompt
    assert widths == [2, 4, 6, 10]


def test_quantized_weights_serve_what_they_generate(gqa_ckpt):
    llama = build(gqa_ckpt, max_seq_len=MAX_SEQ_LEN, quantize="int8")
    engine = make_engine(llama)
    ps = prompts(llama)[:4]
    collectors = run_jobs(engine, [Job(p, 16, None, temperature=0) for p in ps])
    for p, c in zip(ps, collectors):
        assert c.texts() == [llama.tokenizer.decode(solo(llama, p, 16)[0])]
    engine.drain(5)


def test_the_start_line_says_what_the_kv_cache_holds(llama):
    """At start the server says what its KV budget holds: tokens, blocks, bytes, the dtype and bytes a token, and
    how many sequences of the full context fit at once (vLLM's maximum concurrency)."""
    from llama.server.app import build_runner

    per_token = llama.model.kv_cache_nbytes(1, 1)
    _, blocks, line = build_runner(llama, parallel=2, kv_cache_size=100, block_size=16)
    assert blocks == 7  # 100 positions in whole blocks of 16: 112
    max_seq_len = llama.model.params.max_seq_len
    assert line == (f"--parallel 2, KV cache 112 tokens in 7 blocks of 16, {112 * per_token / 2**20:,.1f} MiB "
                    f"(float32, {per_token:,} bytes a token): room for {112 / max_seq_len:,.1f} sequences of the "
                    f"full {max_seq_len:,}-token context")
    _, blocks, line = build_runner(llama, parallel=3, block_size=16)  # the default: room for --parallel of them
    assert blocks * 16 == 3 * max_seq_len and f"room for 3.0 sequences of the full {max_seq_len:,}-token" in line


@pytest.mark.parametrize("quantize", [None, "int8"], ids=["float32", "integer-kernels"])
def test_an_int8_paged_cache_serves_what_generate_gives_with_int8_kv(gqa_ckpt, quantize):
    """Through tiny blocks and chunks, and a cache too small for all (preemption): each greedy completion is
    `Llama.generate`'s alone with the same int8 keys and values, its logprobs the same bits: every op between the
    roundings is row-exact, on the integer kernels and on float32 weights alike."""
    llama = build(gqa_ckpt, max_seq_len=MAX_SEQ_LEN, kv_cache_dtype="int8", quantize=quantize)
    ps = prompts(llama)
    max_tokens = [24, 5, 30, 12, 40, 17, 9, 20]
    for config in (dict(num_blocks=256, block_size=1, prefill_chunk=3),
                   dict(num_blocks=20, block_size=4, parallel=8, prefill_chunk=8)):
        engine = make_engine(llama, **config)
        assert engine.runner.cache.dtype == torch.int8
        collectors = run_jobs(engine, [Job(p, m, None, temperature=0, logprobs=0) for p, m in zip(ps, max_tokens)])
        for p, m, c in zip(ps, max_tokens, collectors):
            tokens, logprobs = solo(llama, p, m, logprobs=True)
            assert c.texts() == [llama.tokenizer.decode(tokens)]
            got = [lp for e in c.events if isinstance(e, Delta) for lp in e.logprobs][: len(tokens)]
            assert [lp.token for lp in got] == tokens
            assert [lp.logprob for lp in got] == logprobs
        if config["num_blocks"] == 20:
            assert engine.preemptions_total > 0, "the small cache was meant to force preemption"
        engine.drain(5)


@pytest.mark.slow
@pytest.mark.skipif(__import__("shutil").which("g++") is None, reason="needs a C++ compiler")
@pytest.mark.parametrize("quantize", [None, "int8"], ids=["float32", "integer-kernels"])
def test_the_stored_step_serves_an_int8_cache_as_the_eager_step_does(gqa_ckpt, quantize):
    """The server's stored step (PagedStep: one row, and 2-16 rows) built for an int8 pool serves each greedy
    completion as `Llama.generate`'s eager step gives it alone: its logprobs the same bits, on the integer kernels and
    on float32 weights alike (each row-exact under an int8 cache)."""
    llama = build(gqa_ckpt, max_seq_len=MAX_SEQ_LEN, kv_cache_dtype="int8", quantize=quantize, compile_layers=True)
    runner = Runner(llama.model, 64, 4, plan=llama.info.plan, max_rows=8)
    ahead = runner.compiled_step.ahead_of_time
    assert isinstance(ahead, PagedStep) and runner.cache.dtype == ahead.kv_dtype == torch.int8
    engine = Engine(llama.tokenizer, Scheduler(64, 4, 8, 16), runner)
    engine.start()
    ps = prompts(llama)
    collectors = run_jobs(engine, [Job(p, 16, None, temperature=0, logprobs=0) for p in ps])
    for p, c in zip(ps, collectors):
        tokens, logprobs = solo(llama, p, 16, logprobs=True)  # Llama.build compiled nothing: the eager step
        assert c.texts() == [llama.tokenizer.decode(tokens)]
        got = [lp for e in c.events if isinstance(e, Delta) for lp in e.logprobs][: len(tokens)]
        assert [lp.token for lp in got] == tokens
        assert [lp.logprob for lp in got] == logprobs
    engine.drain(5)


def test_int8_kv_holds_about_3_5_times_the_positions_in_a_budget_of_bytes(tmp_path):
    """--kv-cache-size in bytes holds about 3.56 times the positions with int8 keys and values as with float32 (heads
    of 64: 64 bytes and two 4-byte scales against 256 bytes), and the start line says "int8, N bytes a token"."""
    from llama.cli.server import kv_cache_positions
    from llama.server.app import build_runner

    ckpt, _ = write_tiny(tmp_path / "wide", "gqa", dim=256, n_heads=4, n_kv_heads=2)
    blocks, lines = {}, {}
    for kv_dtype in ("auto", "int8"):
        llama = build(ckpt, kv_cache_dtype=kv_dtype)
        budget = lambda per_token: kv_cache_positions("4MiB", per_token, 0)  # noqa: E731
        _, blocks[kv_dtype], lines[kv_dtype] = build_runner(llama, parallel=2, kv_cache_size=budget, block_size=16)
        per_token = llama.model.kv_cache_nbytes(1, 1)
    assert per_token == 2 * 2 * 2 * (64 + 8)
    assert f"(int8, {per_token:,} bytes a token)" in lines["int8"] and "(float32, 2,048 bytes a token)" in lines["auto"]
    assert blocks["int8"] / blocks["auto"] == pytest.approx(256 / 72, rel=0.01)
