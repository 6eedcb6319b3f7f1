"""Model parallelism under real torchrun (gloo on the CPU): N shards on M processes, cache on and off."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import write_tiny

BIN = Path(sys.executable).parent
# torchrun as a module of this Python: a virtual environment that takes torch from the system's site-packages
# has no torchrun script of its own.
TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]
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
    args = ["--ckpt-dir", str(ckpt), "--prompts-file", str(prompts_file), "--json", "--logprobs", "--echo",
            "--temperature", "0", "--max-gen-len", "16", "--device", "cpu"]
    if not kv_cache:
        args.append("--no-kv-cache")
    cmd = [str(BIN / "llama-generate")]
    if nproc > 1:
        cmd = TORCHRUN + ["--standalone", f"--nproc_per_node={nproc}", "--no-python"] + cmd
    result = subprocess.run(cmd + args, capture_output=True, text=True, timeout=300,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert result.returncode == 0, result.stderr[-3000:]
    return [json.loads(line) for line in result.stdout.splitlines()]


def assert_same(a, b):
    assert len(a) == len(b) == len(PROMPTS)  # only rank 0 printed
    for x, y in zip(a, b):
        assert x["tokens"] == y["tokens"] and x["text"] == y["text"]
        assert max(abs(p - q) for p, q in zip(x["logprobs"], y["logprobs"])) < 1e-5


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


def test_a_world_size_that_does_not_divide_the_heads_is_refused(checkpoints, prompts_file):
    cmd = TORCHRUN + ["--standalone", "--nproc_per_node=3", "--no-python", str(BIN / "llama-generate"),
                      "--ckpt-dir", str(checkpoints[1]), "--prompt", "hi", "--device", "cpu"]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert result.returncode != 0
    assert "error: n_heads 8 is not divisible by the model-parallel size 3" in result.stderr


def test_compile_under_torchrun_is_refused(checkpoints):
    cmd = TORCHRUN + ["--standalone", "--nproc_per_node=2", "--no-python", str(BIN / "llama-generate"),
                      "--ckpt-dir", str(checkpoints[2]), "--prompt", "Hello", "--device", "cpu", "--compile"]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert result.returncode != 0
    assert "error: --compile runs in one process, not under torchrun with 2 processes" in result.stderr
    # torchrun prints a traceback of its own when a rank exits non-zero; none may come from this project.
    assert str(Path(__file__).resolve().parent.parent / "llama") not in result.stderr
