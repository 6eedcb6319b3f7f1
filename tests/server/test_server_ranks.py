"""llama-server split over two processes under real torchrun (gloo): rank 0 serves, both ranks run each step.

The answers are compared with one process's `Llama.generate` on the same weights stored as one shard, so
nothing depends on what the random model says. A rank killed mid-run must take the server down with one
line saying why, never leave it hanging or serving errors.
"""

import os
import re
import signal
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

import commands
from helpers import REPO, assert_refused_under_torchrun, build, under_torchrun, wait_for, write_tiny
from test_server import MAX_SEQ_LEN, Server, ask_question, continuation, solo, solo_chat

pytestmark = pytest.mark.slow  # every test starts torchrun

LLAMA_SERVER_UNDER_TORCHRUN = tuple(under_torchrun(2, "llama-server"))


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """The same weights as one shard (for the one-process answers) and as two (one a rank)."""
    root = tmp_path_factory.mktemp("ranks")
    return {n: write_tiny(root / f"shards{n}", "gqa", num_shards=n, seed=5)[0] for n in (1, 2)}


@pytest.fixture(scope="module")
def llama(checkpoints):
    return build(checkpoints[1], max_seq_len=MAX_SEQ_LEN)


def start(ckpt, *flags) -> Server:
    # Tiny blocks and a cache smaller than all requests together: blocks are shared, copied and preempted on
    # both ranks alike.
    return Server(ckpt, "--parallel", "4", "--block-size", "4", "--prefill-chunk", "16", "--kv-cache-size", "160",
                  *flags, launcher=LLAMA_SERVER_UNDER_TORCHRUN)


def follower_pid(server: Server) -> int:
    def said():
        return [m for m in (re.search(r"rank 1 of 2 \(pid (\d+)\)", line) for line in server.lines) if m]
    wait_for("rank 1 to say it is ready", said)
    return int(said()[0].group(1))


def test_two_processes_give_one_process_answers_and_stop_together(checkpoints, llama):
    server = start(checkpoints[2])
    try:
        assert any("listening on" in line and "split over 2 processes" in line for line in server.lines)
        follower_pid(server)
        with ThreadPoolExecutor(6) as pool:
            answers = list(pool.map(lambda i: ask_question(server, i, 24), range(6)))
        for messages, text in answers:
            assert text == solo_chat(llama, messages, 24)[0]

        # A prompt whose prefix both ranks hold in their caches, and a completion with every logprob.
        prompt = llama.tokenizer.encode("Once upon a time there was", bos=True, eos=False)
        tokens, _ = solo(llama, prompt, 16)
        for _ in range(2):
            r = server.client().completions.create(model="m", prompt=prompt, max_tokens=16, temperature=0, logprobs=1)
            assert r.choices[0].text == continuation(llama, prompt, tokens)
        assert r.usage.prompt_tokens_details.cached_tokens > 0
        expected = llama.generate([prompt], 16, temperature=0, logprobs=True)[1][0]
        assert max(abs(a - b) for a, b in zip(r.choices[0].logprobs.token_logprobs, expected)) < 1e-5
        assert server.metrics()["llama_kv_cache_blocks_used"] == 0
    finally:
        # As a user stops it: SIGTERM to torchrun, which passes it on to both ranks. Rank 0 lets what is in
        # flight finish and tells rank 1 to stop; rank 1 waits for that, so neither is killed.
        server.proc.send_signal(signal.SIGTERM)
        server.proc.wait(60)
    assert any(line == "llama-server: stopped" for line in server.lines), "\n".join(server.lines[-20:])
    assert not any("exitcode" in line and "-9" in line for line in server.lines)  # no rank had to be killed


def test_speculation_under_torchrun_gives_one_process_answers(checkpoints, llama):
    """Every rank feeds a draft's tokens as rows of the step (rank 0 sends the drafts with the rows), so the
    drafted positions' keys and values land in both ranks' slices alike."""
    server = start(checkpoints[2], "--speculate", "ngram", "--draft-tokens", "3")
    try:
        prompt = llama.tokenizer.encode("one two three four one two three four one two three", bos=True, eos=False)
        tokens, _ = solo(llama, prompt, 24)
        r = server.client().completions.create(model="m", prompt=prompt, max_tokens=24, temperature=0)
        assert r.choices[0].text == continuation(llama, prompt, tokens)
        with ThreadPoolExecutor(4) as pool:
            answers = list(pool.map(lambda i: ask_question(server, i, 24), range(4)))
        for messages, text in answers:
            assert text == solo_chat(llama, messages, 24)[0]
        assert server.metrics()["llama_kv_speculative_drafted_tokens_total"] > 0
    finally:
        server.proc.send_signal(signal.SIGTERM)
        server.proc.wait(60)


def test_a_rank_that_dies_takes_the_server_down_saying_why(checkpoints):
    server = start(checkpoints[2])
    try:
        os.kill(follower_pid(server), signal.SIGKILL)
        # Whatever comes first, torchrun tearing rank 0 down or this request reaching the lost rank, the server
        # goes away: the request fails rather than hang, and the process group exits non-zero.
        try:
            httpx.post(server.url + "/v1/completions", json={"prompt": "Hello", "max_tokens": 8}, timeout=60)
        except httpx.HTTPError:
            pass
        assert server.proc.wait(60) != 0
    finally:
        if server.proc.poll() is None:
            server.proc.kill()
    errors = [line for line in server.lines if line.startswith("error: ")]
    assert errors, "\n".join(server.lines[-30:])
    assert "a rank of the 2 has stopped, and the model cannot run without its slice; the server stops" in errors[0]
    assert str(REPO / "llama") not in "\n".join(server.lines)  # no traceback of ours (torchrun prints its own)


def test_compile_under_torchrun_is_refused(checkpoints):
    cmd = [*LLAMA_SERVER_UNDER_TORCHRUN, "--ckpt-dir", str(checkpoints[2]), "--port", "0", "--compile"]
    assert_refused_under_torchrun(commands.run(cmd),
                                  "error: --compile runs in one process, not under torchrun with 2 processes")
