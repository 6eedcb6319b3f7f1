"""llama-perplexity: the figure is exp(mean NLL) of the scored tokens, the same with the cache on or off."""

import json
import math
import sys

import pytest
import torch

from helpers import REPO, assert_one_line_error, build, run
from llama.cli.perplexity import cli
from llama.errors import LlamaError
from llama.eval.likelihood import perplexity, window_starts

CTX = 16


@pytest.fixture(scope="module")
def llama(gqa_ckpt):
    return build(gqa_ckpt, max_seq_len=64, max_batch_size=1)


def text_tokens(n, seed=0, vocab=4000):
    return torch.randint(3, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def reference_nlls(llama, tokens, ctx):
    """Each window's scored NLLs, from whole-window logits and log_softmax, position by position."""
    out = []
    for start in range(0, len(tokens) - ctx + 1, ctx):
        window = [llama.tokenizer.bos_id] + tokens[start + 1:start + ctx]
        with torch.inference_mode():
            logp = torch.log_softmax(llama.model(torch.tensor([window])).double()[0], dim=-1)  # (ctx, vocab)
        out.append([-logp[i, window[i + 1]].item() for i in range(ctx // 2, ctx - 1)])
    return out


def test_perplexity_is_exp_of_the_mean_nll_of_the_second_halves(llama):
    tokens = text_tokens(5 * CTX + 7)  # five whole windows and a remainder that is not scored
    expected = reference_nlls(llama, tokens, CTX)
    flat = [x for window in expected for x in window]
    result = perplexity(llama, tokens, CTX)
    assert result.windows == 5 and result.scored_tokens == len(flat) == 5 * (CTX - CTX // 2 - 1)
    assert result.text_tokens == len(tokens)
    assert result.perplexity == pytest.approx(math.exp(sum(flat) / len(flat)), rel=1e-5)
    assert result.window_perplexities == pytest.approx([math.exp(sum(w) / len(w)) for w in expected], rel=1e-5)
    spread = torch.tensor(flat, dtype=torch.float64).std().item() / math.sqrt(len(flat))
    assert result.stderr == pytest.approx(result.perplexity * spread, rel=1e-4)


@pytest.mark.parametrize("chunk_size", [1, 3, CTX // 2, CTX, 100])
def test_cache_on_and_off_give_the_same_perplexity(llama, chunk_size):
    tokens = text_tokens(3 * CTX, seed=1)
    uncached = perplexity(llama, tokens, CTX, kv_cache=False)
    cached = perplexity(llama, tokens, CTX, kv_cache=True, chunk_size=chunk_size)
    assert cached.mean_nll == pytest.approx(uncached.mean_nll, abs=1e-6)
    assert cached.window_perplexities == pytest.approx(uncached.window_perplexities, rel=1e-5)
    assert (cached.kv_cache, uncached.kv_cache) == (True, False)


def test_windows_at_the_edges():
    with pytest.raises(LlamaError, match="fewer than one window"):
        window_starts(CTX - 1, CTX)
    assert window_starts(CTX, CTX) == [0]
    assert window_starts(2 * CTX - 1, CTX) == [0]
    assert window_starts(2 * CTX, CTX) == [0, CTX]
    assert window_starts(10 * CTX, CTX, max_windows=3) == [0, CTX, 2 * CTX]
    for bad in (3, 0, -8, 4.5, True):
        with pytest.raises(LlamaError, match="at least 4"):
            window_starts(100, bad)
    with pytest.raises(LlamaError, match="windows"):
        window_starts(100, CTX, max_windows=0)


def test_what_is_scored_and_what_only_gives_context(llama):
    tokens = text_tokens(2 * CTX + 5, seed=2)
    base = perplexity(llama, tokens, CTX).window_perplexities

    def changed(i):
        edited = list(tokens)
        edited[i] = 7 if edited[i] != 7 else 8
        return perplexity(llama, edited, CTX).window_perplexities

    assert changed(CTX) == base  # a window's first token: replaced by bos
    assert changed(2 * CTX + 2) == base  # the remainder after the last whole window
    assert changed(CTX + 1)[0] == base[0] and changed(CTX + 1)[1] != base[1]  # context of the second window
    assert changed(CTX - 1)[0] != base[0]  # the last token of a window is scored
    odd = perplexity(llama, tokens, 7)  # odd widths score positions 3..5: three tokens a window
    assert odd.windows == 5 and odd.scored_tokens == 15


def test_library_errors(llama):
    with pytest.raises(LlamaError, match="max_seq_len"):
        perplexity(llama, text_tokens(200), 128)
    with pytest.raises(LlamaError, match="vocabulary"):
        perplexity(llama, [1, 2, 3, 99999] * 8, CTX)
    with pytest.raises(LlamaError, match="chunk size"):
        perplexity(llama, text_tokens(CTX), CTX, chunk_size=0)


@pytest.mark.slow
def test_the_command_agrees_with_the_library(gqa_ckpt, llama):
    text = (REPO / "data" / "alice29.txt").read_text(encoding="utf-8")
    r = run("llama-perplexity", REPO / "data" / "alice29.txt", "--ckpt-dir", gqa_ckpt, "--ctx", CTX,
            "--windows", 4, "--json", "--no-kv-cache")
    assert r.returncode == 0, r.stderr
    record = json.loads(r.stdout)
    expected = perplexity(llama, llama.tokenizer.encode(text, bos=False, eos=False), CTX, max_windows=4)
    assert record["windows"] == 4 and record["kv_cache"] is False
    assert record["perplexity"] == pytest.approx(expected.perplexity, rel=1e-5)
    assert "scoring windows: 100%" in r.stderr  # progress, on stderr


@pytest.mark.slow
def test_the_command_prints_a_readable_line(gqa_ckpt):
    r = run("llama-perplexity", REPO / "data" / "alice29.txt", "--ckpt-dir", gqa_ckpt, "--ctx", 8, "--windows", 2)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("perplexity: ") and "+/-" in r.stdout and "in 2 windows of 8" in r.stdout


@pytest.mark.slow
def test_bad_input_is_one_line(gqa_ckpt, tmp_path):
    short = tmp_path / "short.txt"
    short.write_text("Too short.", encoding="utf-8")
    assert_one_line_error(run("llama-perplexity", tmp_path / "missing.txt"), "does not exist")
    assert_one_line_error(run("llama-perplexity", short, "--ckpt-dir", gqa_ckpt), "fewer than one window")


@pytest.mark.parametrize("content, args, fragment", [
    (b"caf\xe9 au lait " * 20, (), "is not UTF-8 text (byte 3 is invalid)"),
    (b" \n\n ", (), "is empty"),
    (b"Some text.", ("--ctx", 2), "--ctx must be a whole number of at least 4"),
    (b"Some text.", ("--windows", 0), "--windows must be at least 1"),
    (None, (), "is a directory"),
])
def test_more_bad_input_in_process(tmp_path, capsys, monkeypatch, content, args, fragment):
    path = tmp_path
    if content is not None:
        path = tmp_path / "text.txt"
        path.write_bytes(content)
    monkeypatch.setattr(sys, "argv", ["llama-perplexity", str(path), *map(str, args)])
    with pytest.raises(SystemExit) as exit:
        cli()
    lines = capsys.readouterr().err.strip().splitlines()
    assert exit.value.code == 1 and len(lines) == 1 and lines[0].startswith("error: ") and fragment in lines[0]


@pytest.mark.parametrize("method", ["int8", "int4"])
def test_quantized_models_keep_the_cache_switch_exact(gqa_ckpt, method):
    quantized = build(gqa_ckpt, max_seq_len=64, max_batch_size=1, quantize=method)
    tokens = text_tokens(3 * CTX, seed=3)
    cached = perplexity(quantized, tokens, CTX, kv_cache=True, chunk_size=5)
    uncached = perplexity(quantized, tokens, CTX, kv_cache=False)
    assert cached.window_perplexities == pytest.approx(uncached.window_perplexities, rel=1e-5)
