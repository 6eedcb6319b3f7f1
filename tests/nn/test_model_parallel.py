"""Model parallelism under real torchrun (gloo on the CPU): N shards on M processes, cache on and off."""

from pathlib import Path

import pytest

import commands
from helpers import assert_refused_under_torchrun, generate_json, under_torchrun, write_tiny

pytestmark = pytest.mark.slow  # every test starts torchrun

PROMPTS = ["I believe the meaning of life is", "Hello", "def fibonacci(n):"]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """The same weights as 1, 2 and 4 shards."""
    root = tmp_path_factory.mktemp("mp")
    return {n: write_tiny(root / f"shards{n}", "gqa", num_shards=n, seed=11)[0] for n in (1, 2, 4)}


@pytest.fixture(scope="module")
def prompts_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("prompts") / "prompts.txt"
    path.write_text("\n".join(PROMPTS) + "\n")
    return path


def generate(ckpt, prompts_file, nproc, kv_cache=True):
    """llama-generate's JSON records, run by one plain process or by torchrun with `nproc` ranks."""
    flags = ["--prompts-file", prompts_file, "--echo"] + ([] if kv_cache else ["--no-kv-cache"])
    return generate_json(ckpt, *flags, nproc=nproc, max_gen_len=16)


def assert_same(a, b, logprob_tol=1e-5):
    assert len(a) == len(b) == len(PROMPTS)  # only rank 0 printed
    for x, y in zip(a, b):
        assert x["tokens"] == y["tokens"] and x["text"] == y["text"]
        assert max(abs(p - q) for p, q in zip(x["logprobs"], y["logprobs"])) < logprob_tol


@pytest.fixture(scope="module")
def single_process(checkpoints, prompts_file):
    return generate(checkpoints[1], prompts_file, nproc=1)


@pytest.mark.parametrize("kv_cache", [True, False], ids=["cache", "no-cache"])
def test_two_shards_on_two_processes_match_one_process(checkpoints, prompts_file, single_process, kv_cache):
    assert_same(generate(checkpoints[2], prompts_file, nproc=2, kv_cache=kv_cache), single_process)


@pytest.mark.parametrize("kv_cache", [True, False], ids=["cache", "no-cache"])
def test_one_shard_on_two_processes_is_split_on_load(checkpoints, prompts_file, single_process, kv_cache):
    assert_same(generate(checkpoints[1], prompts_file, nproc=2, kv_cache=kv_cache), single_process)


@pytest.mark.parametrize("kv_cache", [True, False], ids=["cache", "no-cache"])
def test_four_shards_on_two_processes_are_merged_and_resplit(checkpoints, prompts_file, single_process, kv_cache):
    assert_same(generate(checkpoints[4], prompts_file, nproc=2, kv_cache=kv_cache), single_process)


@pytest.mark.parametrize("kv_cache", [True, False], ids=["cache", "no-cache"])
def test_two_shards_on_one_process_are_merged(checkpoints, prompts_file, single_process, kv_cache):
    assert_same(generate(checkpoints[2], prompts_file, nproc=1, kv_cache=kv_cache), single_process)


def test_int8_keys_and_values_on_two_processes_match_one_process(checkpoints, prompts_file):
    """Each rank quantizes its own heads' keys and values (blocks lie along a head, never across heads), so two
    ranks give one process's int8-KV tokens, and the cache switch changes no bit on two ranks as on one. The
    logprobs agree within 1e-3, not float32's 1e-5: two ranks sum a row-parallel layer's halves across processes,
    in another order than one process's product, and a key moved so by one float32 rounding now and then lands
    on the other side of an int8 step (4.3e-5 apart on an AVX-512 EPYC)."""
    int8 = lambda ckpt, nproc, kv: generate_json(  # noqa: E731
        ckpt, "--prompts-file", prompts_file, "--echo", "--kv-cache-dtype", "int8", *([] if kv else ["--no-kv-cache"]),
        nproc=nproc, max_gen_len=16)
    alone = int8(checkpoints[1], 1, True)
    cached, uncached = int8(checkpoints[2], 2, True), int8(checkpoints[2], 2, False)
    assert [(r["tokens"], r["logprobs"]) for r in cached] == [(r["tokens"], r["logprobs"]) for r in uncached]
    assert_same(cached, alone, logprob_tol=1e-3)


def test_a_world_size_that_does_not_divide_the_heads_is_refused(checkpoints, prompts_file):
    result = commands.run(under_torchrun(3, "llama-generate") + ["--ckpt-dir", str(checkpoints[1]), "--prompt", "hi",
                                                                 "--device", "cpu"])
    assert_refused_under_torchrun(result, "error: n_heads 8 is not divisible by the model-parallel size 3")


def test_compile_under_torchrun_is_refused(checkpoints):
    result = commands.run(under_torchrun(2, "llama-generate") + ["--ckpt-dir", str(checkpoints[2]), "--prompt", "Hello",
                                                                 "--device", "cpu", "--compile"])
    assert_refused_under_torchrun(result, "error: --compile runs in one process, not under torchrun with 2 processes")
