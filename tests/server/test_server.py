"""llama-server as a client sees it: the real `openai` package (and raw HTTP for the errors) against a server
started here on a free loopback port, with a tiny random checkpoint.

Every greedy answer is compared with `Llama.generate` alone on the same prompt, so nothing depends on what
a random model happens to say; waits are bounded and generous, and nothing depends on timing.

The quick tier (`-m "not slow"`) starts one server and asks it everything; the other servers, each a start-up
of its own, are marked slow.
"""

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

openai = pytest.importorskip("openai")

from helpers import KEY, REPO, SERVER_MAX_SEQ_LEN, Server, build, write_tiny  # noqa: E402
from llama.server.app import create_server_app  # noqa: E402
from llama.server.engine import Engine, Job  # noqa: E402
from llama.server.http import ServerState, create_app  # noqa: E402
from llama.server.runner import Runner  # noqa: E402
from llama.server.scheduler import Scheduler  # noqa: E402

MAX_SEQ_LEN = SERVER_MAX_SEQ_LEN
KV_TOKENS = 200  # less than the context: some requests must wait, some can never fit
SYSTEM = "You are a careful assistant. Answer the question in one short sentence, then stop."


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    path, _ = write_tiny(tmp_path_factory.mktemp("server") / "gqa", "gqa")
    return path


@pytest.fixture(scope="module")
def llama(ckpt):
    return build(ckpt, max_seq_len=MAX_SEQ_LEN)


@pytest.fixture(scope="module")
def server(ckpt):
    s = Server(ckpt, "--api-key", KEY, "--parallel", "4", "--block-size", "4", "--prefill-chunk", "16",
               "--kv-cache-size", KV_TOKENS)
    yield s
    assert s.stop(signal.SIGINT) == 0, "\n".join(s.lines[-20:])


@pytest.fixture(scope="module")
def slow_server(ckpt):
    """One sequence at a time, no KV cache."""
    s = Server(ckpt, "--parallel", "1", "--no-kv-cache")
    yield s
    assert s.stop() == 0, "\n".join(s.lines[-20:])


def solo(llama, prompt, max_tokens):
    """Greedy tokens of Llama.generate alone, and whether a stop token ended them."""
    tokens, _ = llama.generate([prompt], max_tokens, temperature=0)
    return tokens[0], len(tokens[0]) < max_tokens


def chat_messages(question, system=SYSTEM):
    return ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": question}]


def solo_chat(llama, messages, max_tokens):
    tokens, stopped = solo(llama, llama.dialog_tokens(messages), max_tokens)
    return llama.tokenizer.decode(tokens), len(tokens) + stopped, stopped


def continuation(llama, prompt, tokens):
    """A completion's text as a client wants it: what the tokens add to the prompt's text."""
    return llama.tokenizer.decode(prompt + tokens)[len(llama.tokenizer.decode(prompt)):]


QUESTIONS = ["What is a list?", "What is a dict?", "Why is the sky blue?", "Name a prime number.",
             "What is Python?", "Say hello.", "What is two plus two?", "Tell me a story."]


def test_chat_completion_equals_generate_alone(server, llama):
    messages = chat_messages(QUESTIONS[0])
    r = server.client().chat.completions.create(model="anything", messages=messages, max_tokens=20, temperature=0)
    text, n_tokens, stopped = solo_chat(llama, messages, 20)
    assert r.choices[0].message.content == text and r.choices[0].message.role == "assistant"
    assert r.choices[0].finish_reason == ("stop" if stopped else "length")
    assert r.usage.prompt_tokens == len(llama.dialog_tokens(messages))
    assert r.usage.completion_tokens == n_tokens and r.usage.total_tokens == r.usage.prompt_tokens + n_tokens
    assert r.object == "chat.completion" and r.id.startswith("chatcmpl-") and r.model == "gqa" and r.created > 0


def test_streamed_chat_is_the_same_answer_in_pieces(server, llama):
    messages = chat_messages(QUESTIONS[1])
    client = server.client()
    whole = client.chat.completions.create(model="m", messages=messages, max_tokens=24, temperature=0)
    chunks = list(client.chat.completions.create(model="m", messages=messages, max_tokens=24, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert len({c.id for c in chunks}) == 1
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert content == whole.choices[0].message.content == solo_chat(llama, messages, 24)[0]
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == [whole.choices[0].finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens


def test_completions_from_text_token_ids_and_several_prompts_with_echo(server, llama):
    client = server.client()
    prompts = ["The capital of France is", "def fibonacci(n):"]
    r = client.completions.create(model="m", prompt=prompts, max_tokens=12, temperature=0, echo=True)
    assert [c.index for c in r.choices] == [0, 1]
    total = 0
    for p, choice in zip(prompts, r.choices):
        ids = llama.tokenizer.encode(p, bos=True, eos=False)
        tokens, stopped = solo(llama, ids, 12)
        assert choice.text == p + continuation(llama, ids, tokens)
        assert choice.finish_reason == ("stop" if stopped else "length")
        total += len(ids)
    assert r.usage.prompt_tokens == total
    ids = llama.tokenizer.encode(prompts[1], bos=True, eos=False)
    by_ids = client.completions.create(model="m", prompt=ids, max_tokens=12, temperature=0)
    assert by_ids.choices[0].text == r.choices[1].text[len(prompts[1]):]
    streamed = list(client.completions.create(model="m", prompt=prompts[1], max_tokens=12, temperature=0, stream=True))
    assert "".join(c.choices[0].text for c in streamed) == by_ids.choices[0].text


def test_n_choices(server, llama):
    client = server.client()
    messages = chat_messages(QUESTIONS[2])
    greedy = client.chat.completions.create(model="m", messages=messages, max_tokens=10, temperature=0, n=2)
    assert [c.index for c in greedy.choices] == [0, 1]
    assert {c.message.content for c in greedy.choices} == {solo_chat(llama, messages, 10)[0]}
    sampled = [client.chat.completions.create(model="m", messages=messages, max_tokens=10, temperature=1.5, n=3, seed=11)
               for _ in range(2)]
    assert [c.message.content for c in sampled[0].choices] == [c.message.content for c in sampled[1].choices]
    assert sampled[0].usage.prompt_tokens == greedy.usage.prompt_tokens  # the prompt counts once


def test_stop_strings_never_leak_not_even_in_part(server, llama):
    messages = chat_messages(QUESTIONS[4])
    full = solo_chat(llama, messages, 40)[0]
    assert len(full) > 12, "the tiny model's answer is too short to cut"
    stop = full[len(full) // 2 : len(full) // 2 + 4]
    expected = full[: full.index(stop)]
    client = server.client()
    r = client.chat.completions.create(model="m", messages=messages, max_tokens=40, temperature=0, stop=[stop, "zzzz"])
    assert r.choices[0].message.content == expected and r.choices[0].finish_reason == "stop"
    sent = ""
    for c in client.chat.completions.create(model="m", messages=messages, max_tokens=40, temperature=0, stop=stop,
                                            stream=True):
        sent += (c.choices[0].delta.content or "") if c.choices else ""
        assert expected.startswith(sent)  # at no moment did the stream hold more than the final text
    assert sent == expected


def test_logprobs_match_generate(server, llama):
    client = server.client()
    messages = chat_messages(QUESTIONS[5])
    r = client.chat.completions.create(model="m", messages=messages, max_tokens=8, temperature=0, logprobs=True,
                                       top_logprobs=3)
    tokens, logprobs = llama.generate([llama.dialog_tokens(messages)], 8, temperature=0, logprobs=True)
    content = r.choices[0].logprobs.content
    assert [c.logprob for c in content] == pytest.approx(logprobs[0], abs=1e-4)
    assert all(len(c.top_logprobs) == 3 and c.top_logprobs[0].logprob >= c.logprob - 1e-6 for c in content)
    assert "".join(bytes(c.bytes).decode("utf-8", "replace") for c in content).strip() == r.choices[0].message.content.strip()
    ids = llama.tokenizer.encode("The capital of France is", bos=True, eos=False)
    tokens, logprobs = llama.generate([ids], 6, temperature=0, logprobs=True, echo=True)
    c = client.completions.create(model="m", prompt=ids, max_tokens=6, temperature=0, logprobs=2, echo=True)
    lp = c.choices[0].logprobs
    assert lp.token_logprobs[0] is None and lp.token_logprobs[1:] == pytest.approx(logprobs[0][1:], abs=1e-4)
    assert len(lp.tokens) == len(tokens[0]) and all(len(t) == 2 for t in lp.top_logprobs[1:])


def test_a_shared_prefix_is_reused_and_counted(server, llama):
    client = server.client()
    system = SYSTEM + " Always be brief, and never repeat the question."
    first = client.chat.completions.create(model="m", messages=chat_messages(QUESTIONS[6], system), max_tokens=4, temperature=0)
    messages = chat_messages(QUESTIONS[7], system)
    second = client.chat.completions.create(model="m", messages=messages, max_tokens=12, temperature=0)
    shared = len(llama.tokenizer.encode(system, bos=False, eos=False))
    assert second.usage.prompt_tokens_details.cached_tokens >= shared - 4  # the system prompt, to the block
    assert first.usage.prompt_tokens_details.cached_tokens < shared
    assert second.choices[0].message.content == solo_chat(llama, messages, 12)[0]


def ask_question(server, i, max_tokens):
    """Greedy chat on question i (every other with the system prompt, every third streamed): (messages, text)."""
    client = server.client()
    messages = chat_messages(QUESTIONS[i], SYSTEM if i % 2 else None)
    if i % 3 == 0:
        chunks = client.chat.completions.create(model="m", messages=messages, max_tokens=max_tokens, temperature=0,
                                                stream=True)
        return messages, "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    r = client.chat.completions.create(model="m", messages=messages, max_tokens=max_tokens, temperature=0)
    return messages, r.choices[0].message.content


def test_cache_prompt_false_reuses_nothing_and_changes_nothing_else(server, llama):
    client = server.client()
    system = SYSTEM + " Reply in plain words."
    messages = chat_messages(QUESTIONS[5], system)
    first = client.chat.completions.create(model="m", messages=messages, max_tokens=12, temperature=0)
    uncached = client.chat.completions.create(model="m", messages=messages, max_tokens=12, temperature=0,
                                              extra_body={"cache_prompt": False})
    cached = client.chat.completions.create(model="m", messages=messages, max_tokens=12, temperature=0)
    assert uncached.usage.prompt_tokens_details.cached_tokens == 0
    assert cached.usage.prompt_tokens_details.cached_tokens > 0  # the same prompt, just computed: reused when allowed
    answer = solo_chat(llama, messages, 12)[0]
    assert first.choices[0].message.content == uncached.choices[0].message.content == answer
    assert cached.choices[0].message.content == answer


def test_eight_concurrent_clients_get_their_solo_answers(server, llama):
    """More than --parallel and more than the KV cache holds at once: some wait, some are preempted."""
    with ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(lambda i: ask_question(server, i, 30), range(8)))
    for messages, text in answers:
        assert text == solo_chat(llama, messages, 30)[0]
    assert server.metrics()["llama_kv_cache_blocks_used"] == 0


@pytest.mark.slow
@pytest.mark.skipif(shutil.which(os.environ.get("CXX", "g++")) is None, reason="needs a C++ compiler")
def test_the_default_compiled_step_serves_concurrent_clients_their_solo_answers(ckpt, llama):
    """With no flag about compiling (LLAMA_COMPILE=auto, which conftest.py turns off for the other tests) the
    server loads its decode step from stored packages (llama/compile/aot.py: one row, and 2-16 rows), built first."""
    # Two threads and blocks of 4, as in tests/server/test_engine.py's stored step of the same tiny shape: the packages it
    # stored serve here. (A package for another block size must not: the size is part of the key, as a run with
    # the default 16 after those of 4 once showed, reading past the pool.)
    s = Server(ckpt, "--api-key", KEY, "--parallel", "4", "--block-size", "4",
               env={"LLAMA_COMPILE": "auto", "OMP_NUM_THREADS": "2"})
    try:
        (ready,) = [line for line in s.lines if "listening on " in line]
        assert "decode step compiled" in ready, "\n".join(s.lines)
        assert not any(line.startswith("llama-server: note:") for line in s.lines), "\n".join(s.lines)
        with ThreadPoolExecutor(6) as pool:
            answers = list(pool.map(lambda i: ask_question(s, i, 24), range(6)))
        for messages, text in answers:
            assert text == solo_chat(llama, messages, 24)[0]
    finally:
        assert s.stop() == 0, "\n".join(s.lines[-20:])


@pytest.mark.slow
@pytest.mark.skipif(shutil.which(os.environ.get("CXX", "g++")) is None, reason="needs a C++ compiler")
def test_a_server_stopped_while_its_step_is_built_stops_cleanly(ckpt, tmp_path):
    """The first start builds the stored packages on a background thread; asked to stop before they are done, the
    server stops at once with status 0 (Python's teardown under a running build aborted the process), leaving
    nothing half-written: the next start builds them again and serves."""
    env = {"LLAMA_COMPILE": "auto", "OMP_NUM_THREADS": "2", "LLAMA_COMPILED_DIR": str(tmp_path)}
    s = Server(ckpt, "--api-key", KEY, "--parallel", "2", env=env)
    (ready,) = [line for line in s.lines if "listening on " in line]
    assert "in the background" in ready, "\n".join(s.lines)
    assert s.stop() == 0, "\n".join(s.lines[-20:])
    assert s.lines[-1] == "llama-server: stopped", "\n".join(s.lines[-20:])
    assert not [p for p in tmp_path.rglob("*") if p.is_file() and p.suffix == ".pt2"]  # the build was cut short
    again = Server(ckpt, "--api-key", KEY, "--parallel", "2", env=env)
    try:
        assert ask_question(again, 0, 8)[1]
    finally:
        assert again.stop() == 0, "\n".join(again.lines[-20:])


def test_a_client_that_disconnects_frees_its_sequence(server):
    before = server.metrics()
    with httpx.stream("POST", server.url + "/v1/completions", headers={"Authorization": f"Bearer {KEY}"}, timeout=60,
                      json={"prompt": "Once upon a time", "max_tokens": 180, "temperature": 0, "stream": True,
                            "ignore_eos": True}) as r:
        lines = r.iter_lines()
        assert next(line for line in lines if line.startswith("data:"))
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        m = server.metrics()
        if m["llama_kv_sequences_running"] == 0:
            break
        time.sleep(0.2)
    assert m["llama_kv_sequences_running"] == 0 and m["llama_kv_cache_blocks_used"] == 0
    # Freed long before its 180 tokens: it would otherwise have run to the end.
    assert m["llama_kv_generation_tokens_total"] - before["llama_kv_generation_tokens_total"] < 150
    assert any("client disconnected" in line for line in server.lines)
    assert not any("internal error" in line for line in server.lines)  # a client leaving is not the server failing


def test_ignore_eos_runs_to_max_tokens_as_generate_does(server, llama):
    ids = llama.tokenizer.encode("Once upon a time", bos=True, eos=False)
    r = server.client().completions.create(model="m", prompt=ids, max_tokens=60, temperature=0,
                                           extra_body={"ignore_eos": True})
    tokens, _ = llama.generate([ids], 60, temperature=0, ignore_stop=True)
    assert r.usage.completion_tokens == 60 and r.choices[0].finish_reason == "length"
    assert r.choices[0].text == continuation(llama, ids, tokens[0])


def test_the_api_key(server):
    for headers, status in (({}, 401), ({"Authorization": "Bearer wrong"}, 401),
                            ({"Authorization": f"Bearer {KEY}"}, 200)):
        r = httpx.get(server.url + "/v1/models", headers=headers, timeout=30)
        assert r.status_code == status
        if status == 401:
            assert r.json()["error"]["code"] == "invalid_api_key" and r.json()["error"]["type"] == "invalid_request_error"
    assert httpx.get(server.url + "/health", timeout=30).status_code == 200  # open without the key
    with pytest.raises(openai.AuthenticationError):
        server.client(key="wrong").models.list()
    assert [m.id for m in server.client().models.list().data] == ["gqa"]


ERRORS = [
    (b"{not json", 400, None, "invalid_json"),
    ({"messages": "hello"}, 400, "messages", "invalid_type"),
    ({"messages": []}, 400, "messages", "invalid_type"),
    ({"messages": [{"role": "wizard", "content": "hi"}]}, 400, "messages", "invalid_value"),
    ({"messages": [{"role": "assistant", "content": "hi"}]}, 400, "messages", "invalid_value"),
    ({"messages": [{"role": "user", "content": "hi"}], "temperature": "hot"}, 400, "temperature", "invalid_type"),
    ({"messages": [{"role": "user", "content": "hi"}], "temperature": 3}, 400, "temperature", "invalid_value"),
    ({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 0}, 400, "max_tokens", "invalid_value"),
    ({"messages": [{"role": "user", "content": "hi"}], "n": True}, 400, "n", "invalid_type"),
    ({"messages": [{"role": "user", "content": "hi"}], "stop": 5}, 400, "stop", "invalid_type"),
    ({"messages": [{"role": "user", "content": "hi"}], "cache_prompt": "no"}, 400, "cache_prompt", "invalid_type"),
    ({"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2}, 400, "top_logprobs", "invalid_value"),
    ({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 250}, 400, "messages", "context_length_exceeded"),
    ({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 190}, 400, "max_tokens", "kv_cache_too_small"),
    ({"messages": [{"role": "user", "content": "word " * 300}]}, 400, "messages", "context_length_exceeded"),
]


@pytest.mark.parametrize("body,status,param,code", ERRORS)
def test_mistakes_get_openai_shaped_errors(server, body, status, param, code):
    r = httpx.post(server.url + "/v1/chat/completions", content=body if isinstance(body, bytes) else json.dumps(body),
                   headers={"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}, timeout=60)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert (error["param"], error["code"], error["type"]) == (param, code, "invalid_request_error")
    assert "Traceback" not in r.text


def test_length_errors_name_the_token_counts(server, llama):
    long = "word " * 300
    n = len(llama.dialog_tokens([{"role": "user", "content": long}]))
    r = httpx.post(server.url + "/v1/chat/completions", headers={"Authorization": f"Bearer {KEY}"}, timeout=60,
                   json={"messages": [{"role": "user", "content": long}]})
    assert f"{n} tokens" in r.json()["error"]["message"] and str(MAX_SEQ_LEN) in r.json()["error"]["message"]
    ids = [1] * 20
    r = httpx.post(server.url + "/v1/completions", headers={"Authorization": f"Bearer {KEY}"}, timeout=60,
                   json={"prompt": ids, "max_tokens": 240})
    assert "260 tokens (20 in the prompt, 240 in the completion)" in r.json()["error"]["message"]


def test_unknown_paths_methods_and_fields(server):
    headers = {"Authorization": f"Bearer {KEY}"}
    r = httpx.get(server.url + "/v1/engines", headers=headers, timeout=30)
    assert r.status_code == 404 and r.json()["error"]["code"] == "unknown_url"
    r = httpx.get(server.url + "/v1/chat/completions", headers=headers, timeout=30)
    assert r.status_code == 405 and "error" in r.json()
    r = httpx.post(server.url + "/v1/completions", headers=headers, timeout=60,
                   json={"prompt": "Hi", "max_tokens": 2, "frequency_penalty": 0.5, "tools": [], "whatever": {"x": 1}})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1
    assert any("POST /v1/completions 200 prompt=" in line and "completion=" in line for line in server.lines)


@pytest.mark.slow  # starts a second server
def test_without_a_kv_cache_the_answers_are_the_same(slow_server, server, llama):
    messages = chat_messages(QUESTIONS[3])
    ours = slow_server.client().chat.completions.create(model="m", messages=messages, max_tokens=16, temperature=0)
    cached = server.client().chat.completions.create(model="m", messages=messages, max_tokens=16, temperature=0)
    assert ours.choices[0].message.content == cached.choices[0].message.content == solo_chat(llama, messages, 16)[0]
    assert ours.usage.prompt_tokens_details.cached_tokens == 0


def test_a_full_queue_answers_503(llama):
    """--max-waiting 1 with one request waiting: the next is turned away. (In process, with an engine whose loop
    never starts, so that nothing leaves the queue while the test looks.)"""
    from starlette.testclient import TestClient

    engine = Engine(llama.tokenizer, Scheduler(64, 4, 1, 16), Runner(llama.model, 64, 4), max_waiting=1)
    app, _ = create_server_app(engine, model_id="m")
    engine.submit(Job([1, 5, 9], 4, lambda event: None))
    with TestClient(app) as client:
        r = client.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2})
        assert r.status_code == 503 and r.json()["error"]["type"] == "server_error"
        assert "queue of 1 waiting requests is full" in r.json()["error"]["message"]
        engine.stop_accepting(0)
        r = client.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2})
        assert r.status_code == 503 and "shutting down" in r.json()["error"]["message"]


def test_health_and_routes_answer_503_while_the_model_loads():
    from starlette.testclient import TestClient

    with TestClient(create_app(ServerState(model_id="m", api_key="k"))) as client:
        r = client.get("/health")
        assert r.status_code == 503 and r.json()["error"]["code"] == "model_loading"
        r = client.post("/v1/chat/completions", json={}, headers={"Authorization": "Bearer k"})
        assert r.status_code == 503 and set(r.json()["error"]) == {"message", "type", "param", "code"}


@pytest.mark.slow
def test_sigterm_ends_requests_in_flight_and_exits_0(ckpt):
    """Without a KV cache too (tests/server/test_shutdown.py has the cache, waiting requests and Ctrl-C)."""
    s = Server(ckpt, "--shutdown-grace", "1", "--no-kv-cache")
    body = {"prompt": "Once upon a time", "max_tokens": 230, "temperature": 0, "stream": True, "ignore_eos": True}
    with httpx.stream("POST", s.url + "/v1/completions", json=body, timeout=120) as r:
        lines = r.iter_lines()
        next(line for line in lines if line.startswith("data:"))
        start = time.monotonic()
        s.proc.send_signal(signal.SIGTERM)
        rest = [line for line in lines if line.startswith("data:")]
    assert rest[-1] == "data: [DONE]" and json.loads(rest[-2][5:])["choices"][0]["finish_reason"] == "length"
    assert s.proc.wait(60) == 0 and time.monotonic() - start < 30
    assert any("stopping" in line for line in s.lines) and s.lines[-1].endswith("stopped")


def test_kv_cache_size_is_tokens_or_bytes_with_a_unit():
    from llama.cli.server import kv_cache_positions

    assert kv_cache_positions(None, 1000, 4096) == 4096
    assert kv_cache_positions(2048, 1000, 1) == 2048
    assert kv_cache_positions("2048", 1000, 1) == 2048
    assert kv_cache_positions("1MiB", 1024, 1) == 1024 and kv_cache_positions("2 MB", 1000, 1) == 2000
    with pytest.raises(SystemExit):
        kv_cache_positions("lots", 1000, 1)
    with pytest.raises(SystemExit):
        kv_cache_positions("10b", 1000, 1)  # less than one token


@pytest.mark.slow
def test_a_bad_checkpoint_or_a_taken_port_is_a_one_line_error(server, tmp_path):
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    port = server.url.rsplit(":", 1)[1]
    for args, fragment in ((["--ckpt-dir", tmp_path, "--port", "0"], "params.json does not exist"),
                           (["--port", port], f"cannot listen on 127.0.0.1:{port}")):
        r = subprocess.run([sys.executable, "-m", "llama.cli.server", *map(str, args)], capture_output=True, text=True,
                           timeout=300, env=env, cwd=REPO)
        assert r.returncode == 1 and "Traceback" not in r.stderr
        assert r.stderr.strip().splitlines()[-1].startswith("error: ") and fragment in r.stderr


def test_metrics_say_what_runs_waits_and_what_the_cache_holds(server):
    m = server.metrics()
    for name in ("requests_running", "requests_waiting", "prompt_tokens_total", "generation_tokens_total",
                 "prefix_cache_reused_tokens_total", "cache_blocks_used", "cache_blocks_free", "cache_bytes_used",
                 "cache_bytes_free"):
        assert f"llama_kv_{name}" in m
    assert m["llama_kv_cache_blocks_total"] * m["llama_kv_cache_block_size"] >= KV_TOKENS
    assert m["llama_kv_cache_blocks_used"] + m["llama_kv_cache_blocks_free"] == m["llama_kv_cache_blocks_total"]
    assert m["llama_kv_prefix_cache_reused_tokens_total"] > 0  # the earlier tests shared system prompts
