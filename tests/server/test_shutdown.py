"""llama-server stopping under load: SIGTERM while streams run and more requests wait.

Running requests end as a max_tokens cut ends them (finish_reason "length", then `data: [DONE]`), waiting
ones get 503 in OpenAI's error shape, and the process exits 0. The only times asserted are generous
bounds that tell a hang from a stop.
"""

import json
import signal
import threading
import time

import httpx
import pytest

from helpers import wait_for, write_nonstop
from test_server import Server

pytestmark = pytest.mark.slow  # every test starts a server and stops it under load

GRACE = 1.0
MAX_TOKENS = 3000  # far more than a tiny model decodes in the grace: running requests are cut, not finished


@pytest.fixture(scope="module")
def nonstop(tmp_path_factory):
    return write_nonstop(tmp_path_factory.mktemp("shutdown") / "nonstop")


class Stream(threading.Thread):
    """A streamed completion read with raw httpx: the status, and every `data:` line exactly as it came."""

    def __init__(self, url, prompt):
        super().__init__(daemon=True)
        self.url, self.prompt = url, prompt
        self.status, self.lines, self.body, self.first = None, [], None, threading.Event()

    def run(self):
        body = {"prompt": self.prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "stream": True}
        with httpx.stream("POST", self.url + "/v1/completions", json=body, timeout=120) as r:
            self.status = r.status_code
            if r.status_code != 200:
                self.body = json.loads(r.read())
                self.first.set()
                return
            for line in r.iter_lines():
                if line.startswith("data:"):
                    self.lines.append(line)
                    self.first.set()
        self.first.set()


class Post(threading.Thread):
    """A chat completion, not streamed."""

    def __init__(self, url, question):
        super().__init__(daemon=True)
        self.url, self.question = url, question
        self.status, self.body = None, None

    def run(self):
        body = {"messages": [{"role": "user", "content": self.question}], "max_tokens": MAX_TOKENS, "temperature": 0}
        r = httpx.post(self.url + "/v1/chat/completions", json=body, timeout=120)
        self.status, self.body = r.status_code, r.json()


def metric(server, name):
    return server.metrics()[f"llama_kv_{name}"]


def assert_openai_error(body, code):
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
    assert body["error"]["type"] == "server_error" and body["error"]["code"] == code, body


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "Ctrl-C"])
def test_stopping_cuts_running_requests_and_sends_waiting_ones_away(nonstop, sig):
    s = Server(nonstop, "--parallel", "3", "--max-seq-len", MAX_TOKENS + 64, "--shutdown-grace", GRACE)
    try:
        running = [Stream(s.url, "Once upon a time"), Stream(s.url, "The capital of France is")]
        running_post = Post(s.url, "Tell me a story.")
        for t in running:
            t.start()
        running_post.start()
        for t in running:
            assert t.first.wait(60), "a running stream got no first chunk"
        wait_for("three requests running", lambda: metric(s, "requests_running") == 3)
        waiting = [Stream(s.url, "Waiting one"), Stream(s.url, "Waiting two")]
        waiting_post = Post(s.url, "Am I waiting?")
        for t in waiting + [waiting_post]:
            t.start()
        wait_for("three requests waiting", lambda: metric(s, "requests_waiting") == 3)
        assert not any(t.first.is_set() for t in waiting)  # no headers yet: a refusal can still be a status

        start = time.monotonic()
        s.proc.send_signal(sig)
        wait_for("the stopping line", lambda: any("stopping" in line for line in s.lines))
        try:  # a new connection now is refused, or answered 503
            late = httpx.post(s.url + "/v1/completions", json={"prompt": "Late", "max_tokens": 4}, timeout=30)
            assert late.status_code == 503 and late.json()["error"]["code"] == "shutting_down", late.text
        except httpx.TransportError:
            pass
        assert s.proc.wait(GRACE + 30) == 0, "\n".join(s.lines[-20:])
        assert time.monotonic() - start < GRACE + 30  # a bound that tells a hang, not a speed
        for t in running + waiting + [running_post, waiting_post]:
            t.join(30)
            assert not t.is_alive(), "a client is still waiting after the server exited"
    finally:
        if s.proc.poll() is None:
            s.proc.kill()

    for t in running:
        assert t.status == 200 and t.lines[-1] == "data: [DONE]", t.lines[-3:]
        chunks = [json.loads(line[5:]) for line in t.lines[:-1]]
        assert all("error" not in c for c in chunks)
        assert chunks[-1]["choices"][0]["finish_reason"] == "length"
        assert all(c["choices"][0]["finish_reason"] is None for c in chunks[:-1])
    assert running_post.status == 200, running_post.body
    choice = running_post.body["choices"][0]
    assert choice["finish_reason"] == "length" and choice["message"]["content"]  # its partial text
    assert 0 < running_post.body["usage"]["completion_tokens"] < MAX_TOKENS  # cut, not finished
    for t in waiting:
        assert t.status == 503 and t.lines == []
        assert_openai_error(t.body, "shutting_down")
    assert waiting_post.status == 503
    assert_openai_error(waiting_post.body, "shutting_down")
    # Every running stream was cut short too (the log counts each request's tokens).
    completions = [int(line.split("completion=")[1].split()[0]) for line in s.lines
                   if "POST /v1/completions 200" in line]
    assert len(completions) == 2 and all(0 < n < MAX_TOKENS for n in completions), completions
    assert any("stopping" in line for line in s.lines) and s.lines[-1].endswith("stopped")
    assert not any("Traceback" in line for line in s.lines), "\n".join(s.lines)

