"""llama-server's KV blocks on disk (`--kv-cache-dir`): found again by a fresh engine, bit for bit what computing
them gives; damaged and foreign files skipped with one line and never loaded; the directory kept under its size.

Prompts are fed in chunks of one block (`prefill_chunk` = `block_size`) and the two prompts that share a prefix
have the same length, so that the engine that loads blocks from disk runs exactly the forward passes the engine
that computes them runs after the loaded blocks: any difference in the bits would be the disk cache's.
"""

import json
import os
import shutil
import signal

import pytest
import torch

from helpers import KEY, Collector, Server, assert_one_line_error, build, run, write_tiny
from llama.io.kv_blocks import MAGIC, SUFFIX, read_block_file
from llama.server.app import start_engine
from llama.server.engine import Delta, Done, Failed, Job

MAX_SEQ_LEN = 128
BS = 4
SYSTEM = "You are a careful assistant. Answer the question in one short sentence, then stop. "


@pytest.fixture(scope="module")
def llama(gqa_ckpt):
    return build(gqa_ckpt, max_seq_len=MAX_SEQ_LEN)


def engine(llama, directory=None, size=2**30, log=None, block_size=BS):
    return start_engine(llama, parallel=4, kv_cache_size=64 * block_size, block_size=block_size,
                        prefill_chunk=block_size, kv_cache_dir=directory, kv_cache_dir_size=size,
                        log=log if log is not None else (lambda line: None)).engine


def shared_prompts(llama):
    """Two prompts of the same length that share SYSTEM's tokens, then differ."""
    enc = lambda s, bos=False: llama.tokenizer.encode(s, bos=bos, eos=False)  # noqa: E731
    shared = enc(SYSTEM, bos=True)
    a, b = enc("Tell me about lists in Python, please."), enc("Why is the sky blue on a clear day?")
    n = min(len(a), len(b))
    assert n >= 5 and a[0] != b[0]
    return shared + a[:n], shared + b[:n], len(shared)


def answer(engine, prompt, max_tokens=12):
    """Greedy tokens, their log-probabilities, and the cached prompt tokens of one job run alone."""
    c = Collector()
    engine.submit(Job(prompt, max_tokens, c, temperature=0, logprobs=0))
    assert c.done.wait(120), "the job did not finish"
    assert not any(isinstance(e, Failed) for e in c.events), c.events
    lps = [lp for e in c.events if isinstance(e, Delta) for lp in e.logprobs]
    (done,) = [e for e in c.events if isinstance(e, Done)]
    return [lp.token for lp in lps], torch.tensor([lp.logprob for lp in lps], dtype=torch.float64), done.cached_tokens


@pytest.fixture(scope="module")
def reference(llama):
    """B's answer on an engine without a disk cache, computed from scratch."""
    _, b, _ = shared_prompts(llama)
    e = engine(llama)
    tokens, logprobs, cached = answer(e, b)
    e.drain(5)
    assert cached == 0
    return tokens, logprobs


@pytest.fixture(scope="module")
def written(llama, tmp_path_factory):
    """A directory in which an engine answered A, and was stopped."""
    directory = tmp_path_factory.mktemp("blocks")
    a, _, _ = shared_prompts(llama)
    e = engine(llama, directory)
    _, _, cached = answer(e, a)
    e.drain(5)
    assert cached == 0 and e.disk.blocks_written > 0 and e.disk.blocks_loaded == 0
    return directory


def dir_bytes(directory):
    """Bytes of the block files in `directory`, while the writer may be removing some."""
    total = 0
    for f in directory.glob("*" + SUFFIX):
        try:
            total += f.stat().st_size
        except FileNotFoundError:
            pass
    return total


def block_paths(e, prompt, n):
    """The files of the first n full blocks of `prompt` under engine e's disk cache."""
    return [e.disk.path(key) for key in e.disk.keys(prompt, [], n)]


def test_a_fresh_engine_loads_the_shared_prefix_from_disk_bit_for_bit(llama, written, reference, tmp_path):
    a, b, n_shared = shared_prompts(llama)
    directory = shutil.copytree(written, tmp_path / "blocks")
    lines = []
    e = engine(llama, directory, log=lines.append)
    tokens, logprobs, cached = answer(e, b)
    e.drain(5)
    assert cached == n_shared // BS * BS > 0  # every full block of the shared prefix, from disk
    assert e.disk.blocks_loaded == n_shared // BS and e.disk.misses == 1  # the walk ended where B leaves A
    assert e.scheduler.prefix_tokens_reused == cached
    assert tokens == reference[0] and torch.equal(logprobs, reference[1])
    assert lines == []
    # B's own blocks are there now too: the same prompt again, on another fresh engine, loads all it may.
    e = engine(llama, directory)
    tokens, logprobs, cached = answer(e, b)
    e.drain(5)
    assert cached == (len(b) - 1) // BS * BS and tokens == reference[0] and torch.equal(logprobs, reference[1])


def damage_truncate(path, other):
    data = path.read_bytes()
    path.write_bytes(data[: len(data) - 7])


def damage_flip(path, other):
    data = bytearray(path.read_bytes())
    data[-10] ^= 0x40  # in the payload: the keys and values
    path.write_bytes(bytes(data))


def damage_header(path, other):
    data = path.read_bytes()
    path.write_bytes(data.replace(b'"block_size": 4', b'"block_size": 5', 1))


def foreign(path, other):
    shutil.copyfile(other, path)


@pytest.mark.parametrize("block, damage, says", [
    (2, damage_truncate, "truncated"),
    (0, damage_flip, "checksum"),
    (1, damage_header, "blocks of 5 positions, not 4"),
    (1, foreign, "made by another model"),
    (0, foreign, "blocks of 8 positions, not 4"),
], ids=["truncated", "flipped-byte", "edited-header", "another-model", "another-block-size"])
def test_a_damaged_or_foreign_file_is_skipped_with_one_line_and_never_loaded(llama, written, reference, tmp_path,
                                                                             gqa_ckpt, block, damage, says):
    a, b, n_shared = shared_prompts(llama)
    directory = shutil.copytree(written, tmp_path / "blocks")
    other = None
    if damage is foreign:  # a block file another model, or another block size, wrote for the same tokens
        if "model" in says:
            ckpt, _ = write_tiny(tmp_path / "other", "gqa", seed=7)
            maker, block_size = build(ckpt, max_seq_len=MAX_SEQ_LEN), BS
        else:
            maker, block_size = llama, 8
        e = engine(maker, tmp_path / "other-blocks", block_size=block_size)
        answer(e, a, max_tokens=1)
        e.drain(5)
        other = block_paths(e, a, block + 1)[block]
    lines = []
    e = engine(llama, directory, log=lines.append)
    target = block_paths(e, b, block + 1)[block]
    damage(target, other)
    tokens, logprobs, cached = answer(e, b)
    e.drain(5)
    assert len(lines) == 1 and str(target) in lines[0] and says in lines[0], lines
    assert e.disk.blocks_loaded == block and e.disk.blocks_rejected == 1 and cached == block * BS
    assert tokens == reference[0] and torch.equal(logprobs, reference[1])
    # Removed when skipped, then written again when the block was computed: a good file now.
    parent = e.disk.keys(b, [], block)[-1] if block else ""
    read_block_file(target, e.disk.spec, parent, b[block * BS : (block + 1) * BS])


def test_the_directory_stays_under_its_size_the_least_recently_used_going_first(llama, tmp_path):
    enc = lambda s: llama.tokenizer.encode(s, bos=True, eos=False)  # noqa: E731
    texts = ["Alpha beta gamma delta epsilon zeta eta.", "Bread and butter and jam on the table.",
             "Cats sleep most of the day in the sun.", "Dogs bark at the mail carrier each morning.",
             "Every river runs down to the sea at last.", "Fish swim in schools through the warm water."]
    lines = []
    probe = engine(llama, tmp_path / "probe")
    file_bytes = probe.disk.file_bytes
    probe.drain(5)
    limit = 6 * file_bytes
    e = engine(llama, tmp_path / "blocks", size=limit, log=lines.append)
    ps = [enc(t) for t in texts]
    sizes = []
    for p in ps:
        answer(e, p, max_tokens=4)
        sizes.append(dir_bytes(tmp_path / "blocks"))
    e.drain(5)
    on_disk = dir_bytes(tmp_path / "blocks")
    assert max(sizes + [on_disk]) <= limit and e.disk.bytes == on_disk
    assert e.disk.blocks_evicted > 0 and e.disk.blocks_written > 6 and lines == []
    first = block_paths(e, ps[0], len(ps[0]) // BS)
    assert not any(p.exists() for p in first)  # the oldest went
    assert all(p.exists() for p in block_paths(e, ps[-1], len(ps[-1]) // BS))  # the newest stayed


def test_two_servers_writing_one_directory_at_once_leave_only_whole_files(llama, gqa_ckpt, reference, tmp_path):
    a, b, _ = shared_prompts(llama)
    others = [llama.tokenizer.encode(SYSTEM + q, bos=True, eos=False) for q in ("What is a set?", "Say hello.")]
    directory = tmp_path / "blocks"
    lines = []
    engines = [engine(build(gqa_ckpt, max_seq_len=MAX_SEQ_LEN), directory, log=lines.append) for _ in range(2)]
    collectors = []
    for prompt in [a, b] + others:  # the same prompts to both, at once: the same blocks written twice over
        for e in engines:
            collectors.append(Collector())
            e.submit(Job(prompt, 8, collectors[-1], temperature=0))
    assert all(c.done.wait(120) for c in collectors)
    for e in engines:
        e.drain(5)
    names = os.listdir(directory)
    assert names and all(n.endswith(SUFFIX) for n in names)  # no temporary file left
    for name in names:  # every file whole, and what its name says
        data = (directory / name).read_bytes()
        start = len(MAGIC) + 4
        header = json.loads(data[start : start + int.from_bytes(data[len(MAGIC) : start], "little")])
        assert name == header["key"] + SUFFIX
        read_block_file(directory / name, engines[0].disk.spec, header["parent"], header["tokens"])
    e = engine(llama, directory, log=lines.append)
    tokens, logprobs, cached = answer(e, b)
    e.drain(5)
    assert cached == (len(b) - 1) // BS * BS and lines == []
    # Computed beside three other prompts, in chunks the shared prefill budget cut across block boundaries: the
    # same values as B alone within float rounding, not necessarily the same bits.
    assert tokens == reference[0] and torch.allclose(logprobs, reference[1], rtol=0, atol=1e-5)


def test_a_disk_cache_is_refused_without_a_kv_cache_and_where_it_cannot_write(llama, tmp_path):
    from llama.errors import LlamaError

    with pytest.raises(LlamaError, match="kv_cache=False keeps none"):
        start_engine(llama, kv_cache=False, kv_cache_dir=tmp_path / "x")
    (tmp_path / "file").write_text("")
    with pytest.raises(LlamaError, match="cannot be used"):
        start_engine(llama, kv_cache_dir=tmp_path / "file" / "blocks")
    with pytest.raises(LlamaError, match="holds no block"):
        start_engine(llama, kv_cache_dir=tmp_path / "blocks", kv_cache_dir_size=100)


@pytest.mark.slow
def test_the_commands_errors_are_one_line(gqa_ckpt, tmp_path):
    (tmp_path / "file").write_text("")
    for flags, fragment in [(["--no-kv-cache", "--kv-cache-dir", tmp_path], "--no-kv-cache"),
                            (["--kv-cache-dir", tmp_path / "file" / "blocks"], "cannot be used"),
                            (["--kv-cache-dir", tmp_path, "--kv-cache-dir-size", "lots"], "--kv-cache-dir-size")]:
        assert_one_line_error(run("llama-server", "--ckpt-dir", gqa_ckpt, *flags, timeout=120), fragment)


@pytest.mark.slow
def test_a_restarted_server_loads_the_prefix_from_disk(tmp_path):
    ckpt, _ = write_tiny(tmp_path / "gqa", "gqa")
    flags = ("--block-size", "4", "--prefill-chunk", "4", "--no-compile", "--api-key", KEY)
    system = SYSTEM + "Always be brief, and never repeat the question."
    ask = lambda s, q, n=12: s.client().chat.completions.create(  # noqa: E731
        model="m", messages=[{"role": "system", "content": system}, {"role": "user", "content": q}],
        max_tokens=n, temperature=0)
    first = Server(ckpt, *flags, "--kv-cache-dir", tmp_path / "blocks")
    try:
        assert ask(first, "What is a list?", 4).usage.prompt_tokens_details.cached_tokens == 0
    finally:
        assert first.stop(signal.SIGTERM) == 0, "\n".join(first.lines[-20:])
    assert any(f.name.endswith(SUFFIX) for f in os.scandir(tmp_path / "blocks"))
    second = Server(ckpt, *flags, "--kv-cache-dir", tmp_path / "blocks")
    try:
        loaded = ask(second, "What is a dict?")
        metrics = second.metrics()
    finally:
        assert second.stop(signal.SIGTERM) == 0, "\n".join(second.lines[-20:])
    plain = Server(ckpt, *flags)
    try:
        computed = ask(plain, "What is a dict?")
    finally:
        assert plain.stop(signal.SIGTERM) == 0, "\n".join(plain.lines[-20:])
    cached = loaded.usage.prompt_tokens_details.cached_tokens
    assert cached > 0 and cached % 4 == 0 and computed.usage.prompt_tokens_details.cached_tokens == 0
    assert metrics["llama_kv_disk_cache_blocks_loaded_total"] == cached // 4
    assert loaded.choices[0].message.content == computed.choices[0].message.content
    assert loaded.usage.completion_tokens == computed.usage.completion_tokens
    assert not any("skipped" in line or "Traceback" in line for line in second.lines)


def test_int8_blocks_carry_their_scales_load_bit_for_bit_and_are_kept_apart_from_float_ones(gqa_ckpt, tmp_path):
    """An int8 cache's blocks go to disk as the cache holds them, scales and all (rows of head_dim 8 values and one
    4-byte scale), load on a fresh engine with the bits computing them gives, and are named apart from a float32
    cache's: a float32 engine on the same directory finds none of them, and skips nothing."""
    int8 = build(gqa_ckpt, max_seq_len=MAX_SEQ_LEN, kv_cache_dtype="int8")
    a, b, n_shared = shared_prompts(int8)
    plain = engine(int8)
    want_tokens, want_logprobs, _ = answer(plain, b)
    plain.drain(5)
    writer = engine(int8, tmp_path)
    answer(writer, a)
    writer.drain(5)
    assert writer.disk.spec.dtype == torch.int8 and writer.disk.spec.shapes == (2, 2, 8 + 4)
    (path, *_) = block_paths(writer, a, 1)
    kv = read_block_file(path, writer.disk.spec, "", a[:BS])
    assert kv.dtype == torch.int8 and kv.shape == (2, 2, 2, BS, 12)
    assert kv[..., 8:].contiguous().view(torch.float32).gt(0).all()  # every row's scale is there
    reader = engine(int8, tmp_path)
    tokens, logprobs, cached = answer(reader, b)
    reader.drain(5)
    assert cached == n_shared // BS * BS > 0 and reader.disk.blocks_loaded == n_shared // BS
    assert tokens == want_tokens and torch.equal(logprobs, want_logprobs)
    lines = []
    floats = engine(build(gqa_ckpt, max_seq_len=MAX_SEQ_LEN), tmp_path, log=lines.append)
    _, _, cached = answer(floats, b)
    floats.drain(5)
    assert cached == 0 and floats.disk.blocks_loaded == 0 and floats.disk.blocks_rejected == 0 and lines == []
    assert block_paths(floats, a, 1) != block_paths(writer, a, 1)


@pytest.mark.slow
def test_a_restarted_int8_server_loads_the_prefix_from_disk(tmp_path):
    """The acceptance check of int8 keys and values: `--kv-cache-dtype int8 --kv-cache-dir DIR`, restarted, loads
    the prefix from disk and answers as a server that computes it."""
    ckpt, _ = write_tiny(tmp_path / "gqa", "gqa")
    flags = ("--block-size", "4", "--prefill-chunk", "4", "--no-compile", "--api-key", KEY, "--kv-cache-dtype", "int8")
    system = SYSTEM + "Always be brief, and never repeat the question."
    ask = lambda s, q, n=12: s.client().chat.completions.create(  # noqa: E731
        model="m", messages=[{"role": "system", "content": system}, {"role": "user", "content": q}],
        max_tokens=n, temperature=0, logprobs=True)
    first = Server(ckpt, *flags, "--kv-cache-dir", tmp_path / "blocks")
    try:
        assert ask(first, "What is a list?", 4).usage.prompt_tokens_details.cached_tokens == 0
    finally:
        assert first.stop(signal.SIGTERM) == 0, "\n".join(first.lines[-20:])
    assert any("int8" in line and "bytes a token" in line for line in first.lines), first.lines
    second = Server(ckpt, *flags, "--kv-cache-dir", tmp_path / "blocks")
    try:
        loaded = ask(second, "What is a dict?")
        metrics = second.metrics()
    finally:
        assert second.stop(signal.SIGTERM) == 0, "\n".join(second.lines[-20:])
    plain = Server(ckpt, *flags)
    try:
        computed = ask(plain, "What is a dict?")
    finally:
        assert plain.stop(signal.SIGTERM) == 0, "\n".join(plain.lines[-20:])
    cached = loaded.usage.prompt_tokens_details.cached_tokens
    assert cached > 0 and cached % 4 == 0 and computed.usage.prompt_tokens_details.cached_tokens == 0
    assert metrics["llama_kv_disk_cache_blocks_loaded_total"] == cached // 4
    assert loaded.choices[0].message.content == computed.choices[0].message.content
    assert [t.logprob for t in loaded.choices[0].logprobs.content] == \
        [t.logprob for t in computed.choices[0].logprobs.content]
    assert not any("skipped" in line or "Traceback" in line for line in second.lines)
