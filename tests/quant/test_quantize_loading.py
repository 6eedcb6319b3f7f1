"""Quantized models under torchrun, and what loading tensor by tensor costs in memory.

Under torchrun each rank quantizes its own slice of every layer as it loads. Two ranks must compute what one
process computes with the same quantized values: the same greedy tokens and logprobs within 1e-5 (measured:
2e-6, float32 rounding of the all-reduce's other order of additions), cache on and off.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import commands
from helpers import (EXAMPLE_TOKENIZER, assert_refused_under_torchrun, build, generate_json, tiny_args, under_torchrun,
                     write_tiny)
from llama import kernels
from llama.quant import format as qf
from llama.io.checkpoint import params_dict, save_checkpoint
from llama.kernels.build import missing
from llama.model import ModelArgs
from llama.io.random_weights import write_random_checkpoint

PROMPTS = ["I believe the meaning of life is", "Hello", "def fibonacci(n):"]
# Meta's RowParallelLinear layers: each rank holds a slice of every row (its input columns).
ROW_PARALLEL = ("attention.wo.weight", "feed_forward.w2.weight")


def generate(ckpt, prompts_file, nproc, *flags):
    """llama-generate's JSON records for PROMPTS, greedy with logprobs and echo, by one process or torchrun."""
    records = generate_json(ckpt, "--prompts-file", prompts_file, "--echo", *flags, nproc=nproc)
    assert len(records) == len(PROMPTS)  # only rank 0 printed
    return records


def assert_same(a, b):
    for x, y in zip(a, b, strict=True):
        assert x["tokens"] == y["tokens"]
        assert max(abs(p - q) for p, q in zip(x["logprobs"], y["logprobs"], strict=True)) < 1e-5


@pytest.fixture(scope="module")
def prompts_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("prompts") / "prompts.txt"
    path.write_text("\n".join(PROMPTS) + "\n")
    return path


@pytest.fixture(scope="module")
def two_shards(tmp_path_factory):
    """Two shards of float weights, and the whole state dict they hold."""
    return write_tiny(tmp_path_factory.mktemp("mpq") / "shards2", "gqa", num_shards=2, seed=11)


def int8_as_two_ranks_hold_it(state, path):
    """One process's checkpoint of what two ranks hold after quantizing their slices to int8 per output
    channel: a column-parallel layer's rows whole, so one scale per row; a row-parallel layer's rows in halves,
    each half (a rank's slice) with its own scale: int8 in groups of half a row."""
    quantized = {}
    for name, w in state.items():
        if not qf.is_linear_weight(name):
            quantized[name] = w
            continue
        group = w.shape[1] // 2 if name.endswith(ROW_PARALLEL) else None
        quantized[name], quantized[name.replace(".weight", ".scales")] = qf.quantize_int8(w, group)
    return save_checkpoint(path, params_dict(tiny_args("gqa")), quantized, tokenizer_path=EXAMPLE_TOKENIZER)


# 2 ranks against 1 process to 1e-5 is a claim of the exact paths: on the integer kernels each rank rounds its own
# slice of activations and the ranks' partial sums add in another order, so logits move by the activations'
# rounding (the next test holds them to their own claim).
EXACT = ("--quant-kernels", "exact")


@pytest.mark.slow
@pytest.mark.parametrize("method", ["int8", "int4"])
def test_torchrun_quantizes_each_ranks_slice_as_one_process_would(two_shards, prompts_file, method, tmp_path):
    path, state = two_shards
    if method == "int4":  # groups of 32 columns: a rank's slice holds whole groups, quantized as one process does
        one = generate(path, prompts_file, 1, "--quantize", "int4", *EXACT)
    else:  # per output channel: a rank's half of a row gets a scale of its own
        one = generate(int8_as_two_ranks_hold_it(state, tmp_path / "int8"), prompts_file, 1, *EXACT)
    for flags in ([], ["--no-kv-cache"]):
        assert_same(generate(path, prompts_file, 2, "--quantize", method, *EXACT, *flags), one)


@pytest.mark.slow
@pytest.mark.parametrize("method", ["int8", "int4"])
def test_torchrun_on_the_integer_kernels_gives_cached_and_uncached_runs_the_same_bits(two_shards, prompts_file, method):
    if missing():
        pytest.skip(f"the integer kernels cannot be built here: {missing()}")
    assert kernels.available(), kernels.unavailable_reason()  # else the runs below take the exact paths
    path, _ = two_shards
    cached = generate(path, prompts_file, 2, "--quantize", method)
    uncached = generate(path, prompts_file, 2, "--quantize", method, "--no-kv-cache")
    for a, b in zip(cached, uncached, strict=True):
        assert a["tokens"] == b["tokens"] and a["logprobs"] == b["logprobs"]


@pytest.mark.slow
def test_torchrun_splits_a_stored_int4_checkpoint_by_whole_groups(tmp_path, prompts_file):
    path, _ = write_tiny(tmp_path / "f", "gqa", seed=11)
    state = build(path, quantize="int4").model.state_dict()
    params = json.loads((path / "params.json").read_text())
    save_checkpoint(tmp_path / "q", params, state, tokenizer_path=EXAMPLE_TOKENIZER,
                    extra_files={qf.RECORD_NAME: qf.write_record("int4", 32, "test")})
    one = generate(tmp_path / "q", prompts_file, 1, *EXACT)
    for flags in ([], ["--no-kv-cache"]):
        assert_same(generate(tmp_path / "q", prompts_file, 2, *EXACT, *flags), one)


@pytest.mark.slow
def test_a_stored_per_channel_int8_checkpoint_that_cannot_split_is_refused_in_one_line(tmp_path, prompts_file):
    path, _ = write_tiny(tmp_path / "f", "gqa", seed=11)
    state = build(path, quantize="int8").model.state_dict()
    params = json.loads((path / "params.json").read_text())
    save_checkpoint(tmp_path / "q", params, state, tokenizer_path=EXAMPLE_TOKENIZER,
                    extra_files={qf.RECORD_NAME: qf.write_record("int8", None, "test")})
    result = commands.run(under_torchrun(2, "llama-generate") + ["--ckpt-dir", str(tmp_path / "q"), "--prompts-file",
                                                                 str(prompts_file), "--device", "cpu"])
    assert_refused_under_torchrun(result, "do not split across 2 processes; run it in one process")


PEAK_SCRIPT = """
import sys, torch
from llama import Llama

def status(field):
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(field))

with open("/proc/self/clear_refs", "w") as f:
    f.write("5")  # reset the peak (VmHWM) to now: importing torch peaks higher than a small model loads
base = status("VmRSS:")
llama = Llama.build(sys.argv[1], max_seq_len=16, max_batch_size=1, device="cpu", dtype=sys.argv[2],
                    quantize=None if sys.argv[3] == "none" else sys.argv[3])
llama.generate([[1, 2, 3]], 2, temperature=0)
print(status("VmHWM:") - base)
"""


@pytest.fixture(scope="module")
def mid_ckpt(tmp_path_factory):
    """A bf16 checkpoint of about 210 MB: big enough that loading it twice over would show."""
    args = ModelArgs(dim=1024, n_layers=8, n_heads=8, vocab_size=4000, multiple_of=256, max_seq_len=16, max_batch_size=1)
    path, state = write_random_checkpoint(tmp_path_factory.mktemp("mid") / "mid", args, dtype=torch.bfloat16,
                                          tokenizer_path=EXAMPLE_TOKENIZER)
    return path, sum(t.numel() * t.element_size() for t in state.values())


def _peak(path, dtype, quantize):
    result = subprocess.run([sys.executable, "-c", PEAK_SCRIPT, str(path), dtype, quantize], capture_output=True,
                            text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert result.returncode == 0, result.stderr[-2000:]
    return int(result.stdout.split()[-1])


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="needs Linux's /proc peak-memory reset")
@pytest.mark.parametrize("dtype,quantize,limit", [
    ("bfloat16", "none", 1.2),  # the file's pages are the model: nothing is copied
    ("float32", "none", 2.5),  # the float32 copy, without the file's pages on top (that would be 3x)
    ("float32", "int8", 1.2),  # int8 is half the bf16 bytes, plus quantization scratch
    ("bfloat16", "int4", 1.0),  # int4 with scales and mins is 0.31 of them, plus the same scratch
])
def test_peak_memory_of_loading_is_what_the_memory_check_reckons(mid_ckpt, gqa_ckpt, dtype, quantize, limit):
    """Peak resident memory while loading and generating, less what a tiny model costs (the tokenizer,
    kernels' workspaces), must stay within what llama.io.weights.peak_bytes told the memory check, and far
    below holding the checkpoint twice."""
    from llama.io.checkpoint import expected_shapes, read_params
    from llama.io.weights import peak_bytes
    from llama.quant.quantize import plan_for

    path, nbytes = mid_ckpt
    grown = _peak(path, dtype, quantize) - _peak(gqa_ckpt, dtype, quantize)
    args = ModelArgs(**read_params(path), max_seq_len=16, max_batch_size=1)
    with torch.device("meta"):
        from llama.model import Transformer

        plan = plan_for(Transformer(args), quantize) if quantize != "none" else {}
    reckoned = peak_bytes(expected_shapes(args), plan, getattr(torch, dtype), 1, 1, 2)
    # Two processes' peaks differ by a few MiB of allocator arenas whatever the model: 8 MiB of slack for that.
    assert grown <= reckoned + 8 * 2**20, f"grew {grown / 2**20:.0f} MiB, reckoned {reckoned / 2**20:.0f} MiB"
    assert grown < limit * nbytes, f"grew {grown / 2**20:.0f} MiB for {nbytes / 2**20:.0f} MiB of bf16 weights"


@pytest.fixture(scope="module")
def bf16_tiny(tmp_path_factory):
    path, _ = write_tiny(tmp_path_factory.mktemp("bf16") / "tiny", dtype=torch.bfloat16)
    return path


def _needs(path):
    """What loading the tiny bf16 checkpoint needs in float32 and in bf16, by the loader's own reckoning."""
    from llama.io.checkpoint import expected_shapes
    from llama.io.weights import peak_bytes

    full = expected_shapes(tiny_args("gqa"))
    return peak_bytes(full, {}, torch.float32, 1, 1, 2), peak_bytes(full, {}, torch.bfloat16, 1, 1, 2)


def test_a_bf16_checkpoint_whose_float32_copy_cannot_fit_runs_in_bf16_with_a_note(bf16_tiny, monkeypatch):
    import llama.io.weights as weights
    from llama.errors import LlamaError

    need32, need16 = _needs(bf16_tiny)
    assert need16 < need32
    monkeypatch.setattr(weights, "available_memory", lambda device: (need16 + need32) // 2)
    llama = build(bf16_tiny, dtype=None)
    assert llama.model.tok_embeddings.weight.dtype == torch.bfloat16
    assert len(llama.info.notes) == 1 and "runs in bfloat16" in llama.info.notes[0]
    with pytest.raises(LlamaError, match="the model's weights in float32 needs .* GiB on cpu but only"):
        build(bf16_tiny, dtype="float32")  # an explicit dtype still wins, and is refused before loading
    monkeypatch.setattr(weights, "available_memory", lambda device: need16 // 2)
    # Not even bf16 fits, and on a model this small quantizing's scratch outweighs what it saves.
    with pytest.raises(LlamaError, match="nothing smaller fits on one device here"):
        build(bf16_tiny, dtype=None)


@pytest.mark.parametrize("free_gib,fits", [
    (30, None),  # float32 (about 25 GiB with loading's peak) fits
    (20, ["dtype=bfloat16", "quantize=int8 dtype=bfloat16", "quantize=int4 dtype=bfloat16"]),
    (10, ["quantize=int8 dtype=bfloat16", "quantize=int4 dtype=bfloat16"]),
    (6, ["quantize=int4 dtype=bfloat16"]),
    (3, []),
])
def test_a_model_too_big_is_refused_naming_what_would_fit(monkeypatch, free_gib, fits):
    """LLaMA-2 7B's shapes (on the meta device: nothing is allocated) against a machine of `free_gib`."""
    import re

    import llama.io.weights as weights
    from llama.errors import LlamaError
    from llama.model import ModelArgs

    args = ModelArgs(dim=4096, n_layers=32, n_heads=32, vocab_size=32000, max_seq_len=64, max_batch_size=1)
    monkeypatch.setattr(weights, "available_memory", lambda device: free_gib * 2**30)
    if fits is None:
        assert weights.choose_dtype(None, args, {}, torch.float32, True, torch.device("cpu"), 1) == (torch.float32, [])
        return
    with pytest.raises(LlamaError) as error:
        weights.choose_dtype(None, args, {}, torch.float32, True, torch.device("cpu"), 1)
    message = str(error.value)
    assert message.startswith("the model's weights in float32 needs ")
    named = re.findall(r"((?:[a-z_]+=[a-z0-9]+ ?)+) \([0-9.]+ GiB\)", message)
    assert named == fits, message
    if not fits:
        assert "nothing smaller fits" in message


def test_a_bf16_checkpoint_that_fits_in_float32_runs_in_float32_without_a_note(bf16_tiny):
    llama = build(bf16_tiny, dtype=None)
    assert llama.model.tok_embeddings.weight.dtype == torch.float32 and llama.info.notes == []
