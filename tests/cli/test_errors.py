"""Every mistake a user can make with a checkpoint ends in one line naming what to fix, through the command."""

import json
import os
import resource
import signal
import subprocess

import pytest
import torch

from gguf_writer import write_llama_gguf
from helpers import BIN, assert_one_line_error, build, convert_cli, generate, run, write_tiny
from llama.errors import LlamaError
from llama.io.random_weights import PRESETS


def _set(path, name, text):
    (path / name).write_text(text)


def _edit_weights(fn):
    def edit(path):
        sd = torch.load(path / "consolidated.00.pth", weights_only=True)
        fn(sd)
        torch.save(sd, path / "consolidated.00.pth")
    return edit


class _CreatesAFile:
    def __init__(self, target):
        self.target = target

    def __reduce__(self):
        return (open, (self.target, "w"))


def _hostile(path):
    torch.save({"x": _CreatesAFile(str(path / "pwned"))}, path / "consolidated.00.pth")


BREAKAGES = {
    "empty-dir": (lambda p: [f.unlink() for f in p.iterdir()], ["params.json does not exist"]),
    "params-not-json": (lambda p: _set(p, "params.json", "{'dim': 64"), ["params.json is not valid JSON"]),
    "params-wrong-type": (lambda p: _set(p, "params.json", json.dumps({**json.loads((p / "params.json").read_text()), "n_layers": 2.5})),
                          ["n_layers must be an integer, not 2.5"]),
    "params-inconsistent": (lambda p: _set(p, "params.json", json.dumps({**json.loads((p / "params.json").read_text()), "n_kv_heads": 3})),
                            ["n_heads 8 is not divisible by n_kv_heads 3"]),
    "shape-mismatch": (_edit_weights(lambda sd: sd.__setitem__("layers.1.feed_forward.w2.weight", torch.zeros(64, 100))),
                       ["layers.1.feed_forward.w2.weight has shape (64, 100), params.json implies (64, 192)"]),
    "missing-key": (_edit_weights(lambda sd: sd.pop("norm.weight")), ["missing tensor norm.weight"]),
    "unexpected-key": (_edit_weights(lambda sd: sd.__setitem__("lm_head.weight", torch.zeros(1))), ["unexpected tensor lm_head.weight"]),
    "truncated": (lambda p: (p / "consolidated.00.pth").write_bytes((p / "consolidated.00.pth").read_bytes()[:5000]),
                  ["cannot load", "consolidated.00.pth"]),
    "garbage": (lambda p: (p / "consolidated.00.pth").write_bytes(os.urandom(4096)), ["cannot load", "consolidated.00.pth"]),
    "shard-gap": (lambda p: (p / "consolidated.00.pth").rename(p / "consolidated.01.pth"),
                  ["holds shards consolidated.01.pth; expected consolidated.00.pth"]),
    "hostile-pickle": (_hostile, ["could run code"]),
    "tokenizer-missing": (lambda p: (p / "tokenizer.model").unlink(), ["no tokenizer found"]),
    "tokenizer-junk": (lambda p: (p / "tokenizer.model").write_bytes(b"\x00junk" * 100), ["is not a SentencePiece tokenizer model"]),
    "tokenizer-too-big": (lambda p: _set(p, "params.json", json.dumps({**json.loads((p / "params.json").read_text()), "vocab_size": 1000})),
                          ["the tokenizer has 4000 tokens but the model only 1000"]),
}


# Each case starts the command: the quick tier breaks params.json and the weights once each, the full run every way.
QUICK_BREAKAGES = ("params-not-json", "missing-key")


@pytest.mark.parametrize("breakage", [
    name if name in QUICK_BREAKAGES else pytest.param(name, marks=pytest.mark.slow) for name in BREAKAGES
])
def test_broken_checkpoints_give_one_line_errors(tmp_path, breakage):
    path, _ = write_tiny(tmp_path / "ckpt")
    breaker, fragments = BREAKAGES[breakage]
    breaker(path)
    assert_one_line_error(generate(path, "--prompt", "hi"), *fragments)
    assert not (path / "pwned").exists()


@pytest.mark.slow
def test_a_bad_kv_cache_dtype_is_one_line_on_every_command_that_takes_it(gqa_ckpt, tmp_path):
    text = tmp_path / "text.txt"
    text.write_text("Alice was beginning to get very tired of sitting by her sister on the bank. " * 20)
    commands = {"llama-generate": ["--prompt", "hi"], "llama-chat": [], "llama-server": ["--port", "0"],
                "llama-perplexity": [text, "--ctx", "16"]}
    for command, args in commands.items():
        result = run(command, *args, "--ckpt-dir", gqa_ckpt, "--kv-cache-dtype", "int4", input="", timeout=120)
        assert_one_line_error(result, "--kv-cache-dtype int4 is not one of auto, float32, bfloat16, int8")
    # On the CPU the stored step takes an int8 cache; torch.compile's (a GPU's, or LLAMA_COMPILE_AOT=0) does not.
    for command, args in (("llama-generate", ["--prompt", "hi"]), ("llama-server", ["--port", "0"])):
        result = run(command, *args, "--ckpt-dir", gqa_ckpt, "--kv-cache-dtype", "int8", "--compile", timeout=120,
                     env={"LLAMA_COMPILE_AOT": "0"})
        assert_one_line_error(result, "--compile compiles the decode step", "(--kv-cache-dtype int8) only through the "
                              "stored step on the CPU")


def test_not_enough_memory_is_said_before_loading(tmp_path):
    path = tmp_path / "huge"
    path.mkdir()
    (path / "params.json").write_text(json.dumps(PRESETS["70B"]))
    write_tiny(tmp_path / "tok")
    (tmp_path / "tok" / "tokenizer.model").rename(path / "tokenizer.model")
    result = generate(path, "--prompt", "hi", "--dtype", "float32")
    assert_one_line_error(result, "the model's weights in float32 needs", "GiB on cpu but only")


def test_a_kv_cache_that_cannot_fit_is_refused_before_allocating(gqa_ckpt):
    llama = build(gqa_ckpt, max_seq_len=10**10, max_batch_size=8)
    with pytest.raises(LlamaError, match=r"generating 8 x \d+ positions with a KV cache needs .* GiB on cpu but only"):
        llama.generate([[1, 2]] * 8, 10**10 - 2)


def test_nan_logits_are_a_clear_error(gqa_ckpt):
    llama = build(gqa_ckpt)
    with torch.no_grad():
        llama.model.layers[1].feed_forward.w2.weight[0, 0] = float("nan")
    with pytest.raises(LlamaError, match="NaN or infinite logits"):
        llama.generate([[1, 2, 3]], 4, temperature=0.7)


@pytest.mark.slow
def test_truncate_cuts_a_long_prompt_from_the_left(nonstop_ckpt):
    long_prompt = " ".join(f"w{i}" for i in range(60))
    result = generate(nonstop_ckpt, "--prompt", long_prompt, "--max-seq-len", "32", "--max-gen-len", "8",
                      "--truncate", "--json", "--echo")
    assert result.returncode == 0, result.stderr
    record = json.loads(result.stdout)
    assert "cut from" in result.stderr
    assert len(record["tokens"]) == 32 and record["tokens"][0] == 1  # 24 prompt tokens (bos kept) + 8 new
    assert record["text"].split()[:-1] and "w59" in record["text"]


@pytest.mark.slow
def test_ctrl_c_exits_130_keeping_what_was_printed(nonstop_ckpt):
    """Interrupted while it streams, the command exits 130 and what it printed stays printed. Greedy on a
    checkpoint that never stops early, with 100,000 tokens to go (without a cache, ever slower), the run is
    still generating when the signal comes, however fast or slow the machine is."""
    # A shell starts background jobs with SIGINT ignored, and Python then leaves it ignored: give the command
    # the default disposition, as a terminal's foreground process has, whatever started these tests.
    proc = subprocess.Popen([str(BIN / "llama-generate"), "--ckpt-dir", str(nonstop_ckpt), "--prompt", "Hello",
                             "--stream", "--temperature", "0", "--max-gen-len", "100000", "--max-seq-len", "100000",
                             "--no-kv-cache"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        first = proc.stdout.read(1)  # generation has started
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:  # never leave a 100,000-token run behind
            proc.kill()
            proc.wait()
    assert proc.returncode == 130, err
    assert first
    assert "Traceback" not in err and "interrupted" in err


@pytest.mark.slow  # 340 generations: a measurement, not a quick check
def test_memory_does_not_grow_over_many_generate_calls(gqa_ckpt):
    llama = build(gqa_ckpt)
    prompts = [[1, 306, 465], [1, 150, 318, 338]]

    def rss():
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * resource.getpagesize()

    for kv in (True, False):
        for _ in range(20):  # warm up allocator caches
            llama.generate(prompts, 16, temperature=0.8, kv_cache=kv, logprobs=True)
    before = rss()
    for i in range(300):
        llama.generate(prompts, 16, temperature=0.8, kv_cache=i % 2 == 0, logprobs=True)
    grown = rss() - before
    assert grown < 20 * 2**20, f"resident memory grew by {grown / 2**20:.1f} MiB over 300 calls"


def _limit_file_size(max_bytes):
    def apply():
        # A file-size limit makes writes fail with EFBIG, as a full disk fails them with ENOSPC.
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (max_bytes, max_bytes))
    return apply


@pytest.mark.slow
def test_a_full_disk_during_convert_leaves_nothing(tmp_path):
    src = tmp_path / "model.gguf"
    write_llama_gguf(src)
    dest = tmp_path / "out" / "ckpt"
    result = subprocess.run([str(BIN / "llama-convert"), str(src), str(dest)], capture_output=True, text=True,
                            timeout=300, preexec_fn=_limit_file_size(64 * 1024))
    assert result.returncode == 1 and "Traceback" not in result.stderr
    last = result.stderr.strip().splitlines()[-1]  # after the "converting ..." progress line
    assert last.startswith("error: could not write") and "is the disk full" in last
    assert not dest.exists()
    assert list((tmp_path / "out").iterdir()) == []  # no staging directory left behind either
    ok = convert_cli(src, dest)
    assert ok.returncode == 0 and ok.stdout.strip().endswith(str(dest))


def test_an_interrupted_save_leaves_nothing(tmp_path, monkeypatch):
    from llama.io.checkpoint import save_checkpoint

    calls = []

    def interrupted_save(obj, path, *args, **kwargs):
        calls.append(path)
        raise KeyboardInterrupt

    monkeypatch.setattr(torch, "save", interrupted_save)
    with pytest.raises(KeyboardInterrupt):
        save_checkpoint(tmp_path / "ckpt", {"dim": 8}, {"norm.weight": torch.ones(8)})
    assert calls and not (tmp_path / "ckpt").exists() and list(tmp_path.iterdir()) == []
