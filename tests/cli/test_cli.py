"""The console commands, run as a user runs them: subprocesses, exit statuses, what they print.

Tests that need greedy output of an exact length run the checkpoint whose greedy runs never stop early
(helpers.write_nonstop): the commands have no switch to ignore stop tokens.

Every command started costs a Python and torch start-up: the quick tier (`-m "not slow"`) keeps the cache
switch through the command, the streaming decoder and two argument mistakes, and the rest are marked slow.
"""

import io
import json
import os
import pty
import re
import subprocess
import sys
import time

import pytest

from helpers import (
    BIN, EXAMPLE_TOKENIZER, PROMPT, assert_one_line_error, build, chat, chat_stats, generate, json_lines, run,
)
from llama import Llama
from llama.cli import generate as generate_command
from llama.cli.streaming import TextStream
from llama.tokenizer import Tokenizer


@pytest.mark.slow
def test_generate_echo_prints_prompt_then_continuation(nonstop_ckpt):
    llama = build(nonstop_ckpt)
    prompt = llama.tokenizer.encode(PROMPT, bos=True, eos=False)
    (new,), _ = llama.generate([prompt], 12, temperature=0)
    assert len(new) == 12
    plain = generate(nonstop_ckpt, "--prompt", PROMPT)
    echoed = generate(nonstop_ckpt, "--prompt", PROMPT, "--echo")
    assert plain.returncode == echoed.returncode == 0, plain.stderr + echoed.stderr
    assert plain.stdout == llama.tokenizer.decode(new) + "\n"
    assert echoed.stdout == llama.tokenizer.decode(prompt + new) + "\n"
    assert echoed.stdout.startswith(PROMPT)


def test_no_kv_cache_prints_the_same_text(nonstop_ckpt):
    cached = generate(nonstop_ckpt, "--prompt", PROMPT, "--json", "--logprobs")
    uncached = generate(nonstop_ckpt, "--prompt", PROMPT, "--json", "--logprobs", "--no-kv-cache")
    (a,), (b,) = json_lines(cached.stdout), json_lines(uncached.stdout)
    assert (a["kv_cache"], b["kv_cache"]) == (True, False)
    assert a["text"] == b["text"] and a["tokens"] == b["tokens"] and len(a["tokens"]) == 12
    # Measured: within 2e-6 (float32 rounding of two orders of additions).
    assert max(abs(x - y) for x, y in zip(a["logprobs"], b["logprobs"])) < 1e-5


@pytest.mark.slow
def test_json_gives_one_object_per_prompt(nonstop_ckpt, tmp_path):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("Hello\n\nThe answer is\n42\n", encoding="utf-8")
    result = generate(nonstop_ckpt, "--prompts-file", prompts, "--json")
    assert result.returncode == 0, result.stderr
    records = json_lines(result.stdout)
    assert [r["prompt"] for r in records] == ["Hello", "The answer is", "42"]  # blank lines skipped
    for r in records:
        assert set(r) == {"prompt", "text", "tokens", "kv_cache", "timings"}
        assert len(r["tokens"]) == 12 and r["timings"]["total_s"] > 0


@pytest.mark.slow
def test_prompt_is_taken_as_literal_text(gqa_ckpt):
    result = generate(gqa_ckpt, "--prompt", "'quoted', [1, 2]", "--json")
    assert json.loads(result.stdout)["prompt"] == "'quoted', [1, 2]"
    assert json.loads(generate(gqa_ckpt, "--prompt", "42", "--json").stdout)["prompt"] == "42"


@pytest.mark.slow
def test_stats_reports_prefill_decode_and_cache_bytes(gqa_ckpt):
    cached = generate(gqa_ckpt, "--prompt", PROMPT, "--stats")
    uncached = generate(gqa_ckpt, "--prompt", PROMPT, "--stats", "--no-kv-cache")
    assert "prefill:" in cached.stderr and "tokens/s" in cached.stderr
    assert "kv cache bytes:  0" in uncached.stderr
    assert "kv cache bytes:  0" not in cached.stderr and "kv cache bytes:" in cached.stderr
    # Keys and values of 2 layers x 2 KV heads x 8 dimensions, in float32: 2 * 2 * 2 * 8 * 4 bytes a token.
    assert "kv cache:        on (float32, 256 bytes a token)\n" in cached.stderr
    assert "kv cache:        off\n" in uncached.stderr
    assert re.search(r"^threads: +1$", cached.stderr, re.M), cached.stderr  # OMP_NUM_THREADS=1 (tests/helpers.py)


@pytest.mark.slow
def test_stats_reports_the_phases_of_the_run_within_its_wall_time(nonstop_ckpt):
    start = time.perf_counter()
    result = generate(nonstop_ckpt, "--prompt", PROMPT, "--stats")
    wall = time.perf_counter() - start
    assert result.returncode == 0, result.stderr
    phases = [line for line in result.stderr.splitlines() if line.startswith("phases:")]
    assert len(phases) == 1, result.stderr
    match = re.fullmatch(r"phases: +import ([\d.]+) s, load ([\d.]+) s, prefill ([\d.]+) s, decode ([\d.]+) s",
                         phases[0])
    assert match, phases[0]
    start_up, load, prefill, decode = (float(x) for x in match.groups())
    assert start_up > 0  # Python and torch's import take time on any machine
    assert min(load, prefill, decode) >= 0
    # Four figures rounded to 0.01 s, and a process start that /proc gives to the 0.01 s tick below it.
    assert start_up + load + prefill + decode <= wall + 4 * 0.005 + 0.01
    prefill_ms = float(re.search(r"prefill: +([\d.]+) ms", result.stderr).group(1))
    assert abs(prefill - prefill_ms / 1000) <= 0.0051  # the same measurement as the prefill line's


@pytest.mark.slow
def test_start_up_loads_no_module_the_default_run_does_not_use():
    """torch._dynamo (1-2 s, pulled in by random init on the meta device), SentencePiece (the default model has a
    tokenizer.json) and safetensors (prompt-cache files only) stay out of a plain run's start-up."""
    code = (
        "import sys, torch\n"
        "import llama.cli.generate\n"
        "from llama.model import ModelArgs, Transformer\n"
        "with torch.device('meta'):\n"
        "    Transformer(ModelArgs(dim=64, n_layers=2, n_heads=4, vocab_size=100))\n"
        "print(' '.join(m for m in ('torch._dynamo', 'sentencepiece', 'safetensors') if m in sys.modules))\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == ""


@pytest.mark.slow
def test_streaming_prints_exactly_the_final_text(nonstop_ckpt):
    for extra in ([], ["--echo"]):
        streamed = generate(nonstop_ckpt, "--prompt", PROMPT, "--stream", *extra)
        final = generate(nonstop_ckpt, "--prompt", PROMPT, "--stream", "False", *extra)
        assert streamed.returncode == 0 and streamed.stdout == final.stdout
        assert len(final.stdout) > len(PROMPT if extra else "") + 1  # 12 tokens of text, not an empty line


class _Terminal(io.StringIO):
    """A stdout that says it is a terminal and logs each write."""

    def __init__(self, log):
        super().__init__()
        self.log = log

    def isatty(self):
        return True

    def write(self, text):
        self.log.append(text)
        return super().write(text)


@pytest.mark.slow
def test_on_a_terminal_text_is_written_while_it_is_generated(nonstop_ckpt, monkeypatch):
    """A single prompt printed to a terminal streams by default: text is written piece by piece while the
    model generates it, not all at once when it has finished, and adds up to the piped text."""
    log = []
    original = Llama.generate

    def generate_and_note_the_end(self, *args, **kwargs):
        out = original(self, *args, **kwargs)
        log.append(None)  # generation has finished
        return out

    monkeypatch.setattr(Llama, "generate", generate_and_note_the_end)
    monkeypatch.setattr(sys, "stdout", _Terminal(log))
    generate_command.main(prompt=PROMPT, ckpt_dir=str(nonstop_ckpt), temperature=0, max_gen_len=12)
    end = log.index(None)
    during = [piece for piece in log[:end] if piece]
    assert len(during) > 1, log  # in pieces, before generation ended
    assert "".join(p for p in log if p is not None) == generate(nonstop_ckpt, "--prompt", PROMPT).stdout


@pytest.mark.slow
def test_a_single_prompt_streams_on_a_terminal(nonstop_ckpt):
    """Under a real pseudo-terminal, what arrives adds up to the piped (non-streamed) text. (That it is
    written while it is generated is the test above: how the reads here split the text is up to timing.)"""
    master, slave = pty.openpty()
    proc = subprocess.Popen([str(BIN / "llama-generate"), "--ckpt-dir", str(nonstop_ckpt), "--prompt", PROMPT,
                             "--temperature", "0", "--max-gen-len", "12"], stdout=slave, stderr=subprocess.PIPE)
    os.close(slave)
    chunks = []
    while True:
        try:
            data = os.read(master, 4096)
        except OSError:
            break
        if not data:
            break
        chunks.append(data)
    assert proc.wait(timeout=300) == 0
    on_terminal = b"".join(chunks).decode().replace("\r\n", "\n")
    assert on_terminal == generate(nonstop_ckpt, "--prompt", PROMPT).stdout


def test_stream_decoding_holds_back_split_characters():
    tok = Tokenizer(EXAMPLE_TOKENIZER)
    text = "héllo wörld 世界 🦙 done"
    ids = tok.encode(text, bos=False, eos=False)
    out = io.StringIO()
    writes = []
    out.write = lambda s, _w=out.write: (writes.append(s), _w(s))[1]
    stream = TextStream(tok, [], out)
    for i in ids:
        stream.push(i)
    stream.push(tok.eos_id)
    stream.push(ids[0])  # nothing after a stop token is printed
    stream.finish(ids)
    assert out.getvalue() == text + "\n"
    assert not any("\ufffd" in w for w in writes)
    assert len(writes) > 5  # it did stream, piece by piece


BAD_ARGUMENTS = [
    (["--prompt", "hi", "--ckpt-dir", "/nonexistent/ckpt"], ["/nonexistent/ckpt"]),
    (["--prompt", "   "], ["empty"]),
    ([], ["--prompt"]),
    (["--prompt", "hi", "--temperature", "-1"], ["temperature"]),
    (["--prompt", "hi", "--top-p", "1.5"], ["top_p"]),
    (["--prompt", "hi", "--max-gen-len", "0"], ["max-gen-len"]),
    (["--prompt", "hi", "--dtype", "int4"], ["dtype"]),
    (["--prompt", "hi", "--device", "tpu"], ["device"]),
    (["--prompt", "hi", "--temperature", "abc"], ["--temperature takes a number, not 'abc'"]),
    (["--prompt", "hi", "--max-gen-len", "2.5"], ["--max-gen-len takes a whole number"]),
    (["--prompt", "hi", "--echo=yes"], ["--echo is a switch"]),
    (["--precompile", "--prompt", "hi"], ["--precompile builds the compiled decode step and exits"]),
    (["--precompile", "0"], ["--precompile values must be at least 1"]),
    (["--precompile", "four"], ["--precompile takes comma-separated whole numbers, not 'four'"]),
    (["--precompile", "--no-kv-cache"], ["leave out --no-compile and --no-kv-cache"]),
]
# Each case starts the command: the quick tier runs a missing path and a flag of the wrong type, the full run all.
QUICK_BAD_ARGUMENTS = (0, 8)


@pytest.mark.parametrize("args, fragments", [
    case if i in QUICK_BAD_ARGUMENTS else pytest.param(*case, marks=pytest.mark.slow)
    for i, case in enumerate(BAD_ARGUMENTS)
])
def test_bad_arguments_give_a_one_line_error(gqa_ckpt, args, fragments):
    if "--ckpt-dir" not in args:
        args = args + ["--ckpt-dir", str(gqa_ckpt)]
    assert_one_line_error(run("llama-generate", *args), *fragments)


@pytest.mark.slow
def test_debug_shows_the_traceback(tmp_path):
    result = run("llama-generate", "--prompt", "hi", "--ckpt-dir", tmp_path / "missing", "--debug")
    assert result.returncode == 1
    assert "Traceback" in result.stderr and result.stderr.strip().splitlines()[-1].startswith("error: ")


@pytest.mark.slow
def test_text_that_is_not_utf8_is_refused(gqa_ckpt):
    result = subprocess.run([str(BIN / "llama-generate"), "--ckpt-dir", str(gqa_ckpt), "--prompt", b"caf\xe9"],
                            capture_output=True, text=True, timeout=300)
    assert_one_line_error(result, "not valid UTF-8")


@pytest.mark.slow
def test_stream_needs_a_single_prompt(gqa_ckpt, tmp_path):
    prompts = tmp_path / "two.txt"
    prompts.write_text("a\nb\n")
    assert_one_line_error(generate(gqa_ckpt, "--prompts-file", prompts, "--stream"), "--stream")
    assert_one_line_error(generate(gqa_ckpt, "--prompt", "a", "--stream", "--json"), "--json")


@pytest.mark.slow
def test_bad_prompts_files(gqa_ckpt, tmp_path):
    latin1 = tmp_path / "latin1.txt"
    latin1.write_bytes("caf\xe9\n".encode("latin-1"))
    assert_one_line_error(generate(gqa_ckpt, "--prompts-file", latin1), "not UTF-8", str(latin1))
    assert_one_line_error(generate(gqa_ckpt, "--prompts-file", tmp_path / "missing.txt"), "does not exist")
    many = tmp_path / "many.txt"
    many.write_text("a\n" * 9)
    assert_one_line_error(generate(gqa_ckpt, "--prompts-file", many), "9 prompts exceed --max-batch-size 8")


@pytest.mark.slow
def test_prompt_longer_than_max_seq_len(gqa_ckpt):
    result = generate(gqa_ckpt, "--prompt", "word " * 100, "--max-seq-len", "32")
    assert_one_line_error(result, "more than max_seq_len 32")


@pytest.mark.slow
@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="checks the no-GPU message")
def test_cuda_without_gpu(gqa_ckpt):
    assert_one_line_error(generate(gqa_ckpt, "--prompt", "hi", "--device", "cuda"), "no CUDA GPU")


@pytest.mark.slow
def test_help_reads_well():
    result = run("llama-generate", "--help")
    assert result.returncode == 0
    text = result.stdout + result.stderr  # fire writes help to stderr when it is not a terminal
    for flag in ("--prompt", "--prompts_file", "--echo", "--no_kv_cache", "--json", "--stats", "--logprobs"):
        assert flag in text
    assert "llama-generate --prompt \"The capital of France is\" --echo" in text
    assert "Optional[Optional]" not in text


@pytest.mark.slow
def test_chat_keeps_history_resets_and_leaves_on_eof(nonstop_ckpt):
    """Each reply answers the whole conversation so far: the second message's prompt holds the first exchange
    (cache on and off), /reset starts over, and the end of input leaves. Replies are counted from the lines
    --stats writes after each, not by splitting the model's text (which may hold line breaks of its own)."""
    first, second = "Hello there, I am Ada and I would like to talk about the weather today", "Tell me more"
    script = f"{first}\n{second}\n/reset\n{first}\n"
    cached = chat(nonstop_ckpt, "--stats", input=script)
    uncached = chat(nonstop_ckpt, "--stats", "--no-kv-cache", input=script)
    assert "(history cleared)" in cached.stderr
    assert uncached.stdout == cached.stdout
    # What a chat of the first message alone, and of the first two, prints: its replies, each with a newline.
    alone = chat(nonstop_ckpt, input=f"{first}\n").stdout
    pair = chat(nonstop_ckpt, input=f"{first}\n{second}\n").stdout
    assert cached.stdout == pair + alone  # after /reset the first message gets the first reply again
    assert pair.startswith(alone) and alone.endswith("\n")

    tokenizer = Tokenizer(str(nonstop_ckpt / "tokenizer.model"))
    llama = build(nonstop_ckpt)
    reply = alone[:-1]
    with_history = llama.dialog_tokens([{"role": "user", "content": first}, {"role": "assistant", "content": reply},
                                        {"role": "user", "content": second}])
    assert len(with_history) > len(llama.dialog_tokens([{"role": "user", "content": second}])) + 20
    for result, kv_cache in ((cached, True), (uncached, False)):
        turns = chat_stats(result.stderr)
        assert len(turns) == 3, result.stderr  # one line per reply
        # The second prompt is the whole dialog so far; after /reset the first message stands alone again.
        assert [t["prompt"] for t in turns] == [turns[0]["prompt"], len(with_history), turns[0]["prompt"]]
        assert turns[0]["prompt"] > len(tokenizer.encode(first, bos=False, eos=False))
        if kv_cache:  # and the first exchange's keys and values are reused for it
            assert turns[1]["reused"] >= turns[0]["prompt"] - 2
        else:
            assert all(t["reused"] == 0 and t["prefilled"] == t["prompt"] for t in turns)


@pytest.mark.slow
def test_example_scripts_run_with_and_without_cache(gqa_ckpt):
    for script in ("example_text_completion.py", "example_chat_completion.py"):
        args = ["--ckpt_dir", gqa_ckpt, "--temperature", "0", "--max_gen_len", "8"]
        cached, uncached = run(script, *args), run(script, *args, "--no-kv-cache")
        assert cached.returncode == 0, cached.stderr
        assert cached.stdout.count("==================================") >= 3
        assert cached.stdout == uncached.stdout
