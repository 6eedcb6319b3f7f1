"""llama-server under load and faults: every valid request answered correctly, every invalid one refused, nothing leaked.

    python scripts/stress_server.py [--clients 16] [--requests 64] [--rounds 1] [--ckpt-dir DIR | --url URL]
        [--parallel 4] [--max-seq-len 512] [--block-size 16] [--max-tokens 16] [--threads 2] [--json-file FILE]

Starts llama-server on a free loopback port (the default model unless --ckpt-dir; with --api-key set), or
uses the one at --url (then --api-key must be its key, and the memory figures need --pid). N clients, in
threads, each send M requests one after another. Seven in ten are valid: chat (through the `openai` package)
or completions (raw httpx), streamed or not, greedy, a system prompt shared with other clients (one of
three), a question of mixed length and a mixed max_tokens. The rest are faults, one kind each: a client
that disconnects after the first chunk of a stream, a malformed body (bad JSON, wrong types), a prompt longer
than the context, a wrong API key.

Every valid answer is compared with the same request sent alone, one at a time, before the load (cached by
request, so each distinct one runs alone once): text and finish reason must be equal. Every fault must get
its status (400, 401) in OpenAI's error shape, or for a disconnect nothing at all. After each round it waits
for `llama_kv_cache_blocks_used` in GET /metrics to reach 0 (a block still held by nobody's request is a leak)
and reads the server's resident memory (/proc/PID/status: VmRSS now, VmHWM the peak). It prints a JSON
summary and exits 1 if anything was wrong: a wrong answer, an unexpected failure, a leaked block, a traceback
in the server's log.
"""

import json
import os
import random
import subprocess
import sys
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

import fire
import httpx
import openai

from bench_server import free_port, wait_ready  # this folder's, as `python scripts/stress_server.py` runs

REPO = Path(__file__).resolve().parent.parent
KEY = "stress-key"
SYSTEMS = [
    "You are a helpful assistant. Answer briefly and precisely, in plain English.",
    "You are a patient teacher of history. Explain causes and consequences, with dates where they help.",
    "You are a senior Python reviewer. Point out bugs first, then style, and suggest the smallest fix.",
]
QUESTIONS = [
    "What is a list?",
    "Why did the Roman Empire split into two halves?",
    "Here is my function: def mean(xs): return sum(xs) / len(xs). It fails on some inputs. Which, and why?",
    "Name three prime numbers.",
]
# Which request each slot of ten is: seven valid, three faults (the fourth fault kind takes a valid slot every
# other cycle, so that every kind comes up within a few requests of any client).
PATTERN = ["valid", "disconnect", "valid", "malformed", "valid", "valid", "too_long", "valid", "wrong_key", "valid"]
MALFORMED = [
    (b"{not json", "/v1/chat/completions"),
    (json.dumps({"messages": "hello", "max_tokens": 4}).encode(), "/v1/chat/completions"),
    (json.dumps({"prompt": "Hi", "max_tokens": -3}).encode(), "/v1/completions"),
    (json.dumps({"prompt": "Hi", "temperature": "hot"}).encode(), "/v1/completions"),
    (json.dumps([1, 2, 3]).encode(), "/v1/completions"),
]
EXPECTED_STATUS = {"malformed": 400, "too_long": 400, "wrong_key": 401}


@dataclass
class Outcome:
    kind: str  # valid, disconnect, malformed, too_long, wrong_key
    ok: bool
    reason: str = ""  # why it is not ok: "wrong answer", "status 500", "ReadTimeout", ...


def valid_request(rng: random.Random, max_tokens: int) -> Dict[str, Any]:
    """A greedy request: chat or completion, its system prompt shared with others, a question of mixed length."""
    s, q = rng.randrange(len(SYSTEMS)), rng.randrange(len(QUESTIONS))
    tokens = max(1, max_tokens // (1 + (q % 2)))  # mixed lengths: some ask for half as many tokens
    if rng.random() < 0.5:
        return {"route": "chat", "messages": [{"role": "system", "content": SYSTEMS[s]},
                                              {"role": "user", "content": QUESTIONS[q]}],
                "max_tokens": tokens, "temperature": 0}
    return {"route": "completions", "prompt": f"{SYSTEMS[s]}\nQuestion: {QUESTIONS[q]}\nAnswer:",
            "max_tokens": tokens, "temperature": 0}


def key_of(request: Dict[str, Any]) -> str:
    return json.dumps(request, sort_keys=True)


# One request of each kind; each returns an Outcome, or for a valid one its (text, finish reason) too.

def ask(url: str, request: Dict[str, Any], stream: bool, timeout: float) -> Tuple[str, Optional[str]]:
    """A valid request's text and finish reason: chat through the openai package, completions through httpx."""
    body = {k: v for k, v in request.items() if k != "route"}
    if request["route"] == "chat":
        client = openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0, timeout=timeout)
        if not stream:
            choice = client.chat.completions.create(model="any", **body).choices[0]
            return choice.message.content, choice.finish_reason
        text, reason = "", None
        for chunk in client.chat.completions.create(model="any", stream=True, **body):
            for c in chunk.choices:
                text += c.delta.content or ""
                reason = c.finish_reason or reason
        return text, reason
    headers = {"Authorization": f"Bearer {KEY}"}
    if not stream:
        r = httpx.post(url + "/v1/completions", json=body, headers=headers, timeout=timeout)
        r.raise_for_status()
        choice = r.json()["choices"][0]
        return choice["text"], choice["finish_reason"]
    text, reason, done = "", None, False
    with httpx.stream("POST", url + "/v1/completions", json={**body, "stream": True}, headers=headers,
                      timeout=timeout) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if line == "data: [DONE]":
                done = True
            elif line.startswith("data: "):
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    raise RuntimeError(f"error event: {chunk['error'].get('code')}")
                text += chunk["choices"][0]["text"]
                reason = chunk["choices"][0]["finish_reason"] or reason
    if not done:
        raise RuntimeError("stream ended without [DONE]")
    return text, reason


def disconnect(url: str, rng: random.Random, timeout: float) -> Outcome:
    """A stream left after its first chunk: the server must cancel it (checked by the blocks at the end)."""
    body = {"prompt": f"{SYSTEMS[rng.randrange(len(SYSTEMS))]}\nTell me a long story.", "max_tokens": 200,
            "temperature": 0, "stream": True}
    with httpx.stream("POST", url + "/v1/completions", json=body, headers={"Authorization": f"Bearer {KEY}"},
                      timeout=timeout) as r:
        if r.status_code != 200:
            return Outcome("disconnect", False, f"status {r.status_code}")
        for line in r.iter_lines():
            if line.startswith("data:"):
                break
    return Outcome("disconnect", True)


def refused(url: str, kind: str, rng: random.Random, max_seq_len: int, timeout: float) -> Outcome:
    """A request the server must refuse with EXPECTED_STATUS[kind] in OpenAI's error shape."""
    headers = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
    if kind == "malformed":
        content, path = MALFORMED[rng.randrange(len(MALFORMED))]
    elif kind == "too_long":
        content, path = json.dumps({"prompt": "many words " * max_seq_len, "max_tokens": 4}).encode(), "/v1/completions"
    else:  # wrong_key
        content, path = json.dumps({"prompt": "Hi", "max_tokens": 2}).encode(), "/v1/completions"
        headers["Authorization"] = "Bearer not-the-key"
    r = httpx.post(url + path, content=content, headers=headers, timeout=timeout)
    if r.status_code != EXPECTED_STATUS[kind]:
        return Outcome(kind, False, f"status {r.status_code}, expected {EXPECTED_STATUS[kind]}")
    try:
        error = r.json()["error"]
        shaped = set(error) == {"message", "type", "param", "code"} and isinstance(error["message"], str)
    except (ValueError, KeyError, TypeError):
        shaped = False
    return Outcome(kind, True) if shaped else Outcome(kind, False, "not OpenAI's error shape")


# The load.

def plan(clients: int, requests: int, max_tokens: int, seed: int) -> List[List[Tuple[str, Dict[str, Any], bool]]]:
    """Per client, its requests in order: (kind, valid request or {}, streamed)."""
    out = []
    for c in range(clients):
        rng = random.Random(seed * 1000 + c)
        out.append([(PATTERN[(c + j) % len(PATTERN)], valid_request(rng, max_tokens), rng.random() < 0.5)
                    for j in range(requests)])
    return out


def solo_answers(url: str, requests: List[Dict[str, Any]], cache: Dict[str, Tuple[str, Optional[str]]],
                 timeout: float) -> None:
    """Each distinct valid request alone, one after another, not streamed: the answers the load must equal."""
    for request in requests:
        if key_of(request) not in cache:
            cache[key_of(request)] = ask(url, request, False, timeout)


def run_client(url: str, work, seed: int, max_seq_len: int, solo: Dict[str, Tuple[str, Optional[str]]],
               timeout: float) -> List[Outcome]:
    rng = random.Random(seed)
    outcomes = []
    for kind, request, stream in work:
        try:
            if kind == "valid":
                answer = ask(url, request, stream, timeout)
                right = answer == solo[key_of(request)]
                outcomes.append(Outcome(kind, right, "" if right else "wrong answer"))
            elif kind == "disconnect":
                outcomes.append(disconnect(url, rng, timeout))
            else:
                outcomes.append(refused(url, kind, rng, max_seq_len, timeout))
        except Exception as e:  # counted by reason, never fatal: the load goes on
            status = getattr(getattr(e, "response", None), "status_code", None)
            outcomes.append(Outcome(kind, False, f"status {status}" if status else type(e).__name__))
    return outcomes


def metrics(url: str) -> Dict[str, float]:
    text = httpx.get(url + "/metrics", headers={"Authorization": f"Bearer {KEY}"}, timeout=30).text
    return {line.split()[0]: float(line.split()[1]) for line in text.splitlines() if line and not line.startswith("#")}


def blocks_used_when_idle(url: str, wait: float = 60) -> int:
    """KV blocks held once nothing runs (cancelled streams leave at the engine's next step, so wait a little)."""
    deadline = time.monotonic() + wait
    while True:
        m = metrics(url)
        idle = m["llama_kv_requests_running"] == 0 and m["llama_kv_requests_waiting"] == 0
        if (idle and m.get("llama_kv_cache_blocks_used", 0) == 0) or time.monotonic() > deadline:
            return int(m.get("llama_kv_cache_blocks_used", 0))
        time.sleep(0.2)


def memory_mib(pid: Optional[int]) -> Dict[str, float]:
    """The process's resident memory now (VmRSS) and at its peak (VmHWM), in MiB."""
    if pid is None:
        return {}
    fields = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        name, _, value = line.partition(":")
        if name in ("VmRSS", "VmHWM"):
            fields[name] = round(int(value.split()[0]) / 1024, 1)
    return fields


def one_round(url: str, clients: int, requests: int, max_tokens: int, max_seq_len: int, seed: int,
              solo: Dict[str, Tuple[str, Optional[str]]], timeout: float) -> Dict[str, Any]:
    work = plan(clients, requests, max_tokens, seed)
    solo_answers(url, [r for w in work for kind, r, _ in w if kind == "valid"], solo, timeout)
    start = time.monotonic()
    with ThreadPoolExecutor(clients) as pool:
        futures = [pool.submit(run_client, url, w, seed * 1000 + c, max_seq_len, solo, timeout)
                   for c, w in enumerate(work)]
        outcomes = [o for f in futures for o in f.result()]
    wall = time.monotonic() - start
    by_kind = Counter(o.kind for o in outcomes)
    return {
        "requests": len(outcomes),
        "wall_s": round(wall, 1),
        "valid": by_kind["valid"],
        "answered_correctly": sum(o.ok for o in outcomes if o.kind == "valid"),
        "wrong_answers": sum(o.reason == "wrong answer" for o in outcomes),
        "faults": {k: by_kind[k] for k in ("disconnect", "malformed", "too_long", "wrong_key")},
        "faults_handled": sum(o.ok for o in outcomes if o.kind != "valid"),
        "failed": dict(Counter(f"{o.kind}: {o.reason}" for o in outcomes if not o.ok and o.reason != "wrong answer")),
        "blocks_used_at_end": blocks_used_when_idle(url),
    }


# The server.

class Started:
    """llama-server in a subprocess on a free loopback port, and every line it logs."""

    def __init__(self, ckpt_dir: Optional[str], parallel: int, max_seq_len: int, threads: int, flags: List[str]):
        self.url = f"http://127.0.0.1:{free_port()}"
        cmd = [sys.executable, "-m", "llama.cli.server", "--port", self.url.rsplit(":", 1)[1], "--api-key", KEY,
               "--parallel", str(parallel), "--max-seq-len", str(max_seq_len), *flags]
        cmd += ["--ckpt-dir", ckpt_dir] if ckpt_dir else []
        # The repository first, then what PYTHONPATH holds already (packages installed with pip's --target, say).
        path = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
        env = {**os.environ, "OMP_NUM_THREADS": str(threads), "PYTHONPATH": path}
        self.proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        self.lines: List[str] = []
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stderr:
            self.lines.append(line.rstrip("\n"))

    def wait_ready(self, timeout: float = 1800) -> None:
        try:
            wait_ready(self.url, self.proc, timeout)
        except SystemExit:
            print("\n".join(self.lines[-10:]), file=sys.stderr)  # why it never came up
            raise

    def stop(self) -> int:
        self.proc.terminate()
        try:
            return self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return -9


def main(clients: int = 16, requests: int = 64, rounds: int = 1, ckpt_dir: str = None, url: str = None,
         pid: int = None, api_key: str = None, parallel: int = 4, max_seq_len: int = 512, max_tokens: int = 16,
         block_size: int = 16, threads: int = 2, seed: int = 0, timeout: float = 600, json_file: str = None) -> None:
    """Run the load `rounds` times and report (the flags are in the module's docstring)."""
    global KEY
    server = None
    if url is None:
        server = Started(ckpt_dir, parallel, max_seq_len, threads, ["--block-size", str(block_size)])
        server.wait_ready()
        url, pid = server.url, server.proc.pid
    else:
        KEY = api_key or ""
    solo: Dict[str, Tuple[str, Optional[str]]] = {}
    report: Dict[str, Any] = {"clients": clients, "requests_per_client": requests, "rounds": []}
    try:
        for r in range(rounds):
            summary = one_round(url, clients, requests, max_tokens, max_seq_len, seed + r, solo, timeout)
            summary.update({f"{k}_mib": v for k, v in memory_mib(pid).items()})
            report["rounds"].append(summary)
            print(json.dumps({"round": r + 1, **summary}), file=sys.stderr, flush=True)
        report["distinct_solo_answers"] = len(solo)
        report["peak_rss_mib"] = memory_mib(pid).get("VmHWM")
    finally:
        if server is not None:
            report["server_exit_status"] = server.stop()
            report["server_tracebacks"] = sum("Traceback" in line for line in server.lines)
            if report["server_tracebacks"]:  # the server's own words, for whoever reads the failure
                print("\n".join(server.lines), file=sys.stderr)
    report["ok"] = all(not s["wrong_answers"] and not s["failed"] and s["blocks_used_at_end"] == 0
                       for s in report["rounds"]) and not report.get("server_tracebacks")
    print(json.dumps(report, indent=1))
    if json_file:
        Path(json_file).write_text(json.dumps(report, indent=1))
    if not report["ok"]:
        raise SystemExit(1)


if __name__ == "__main__":
    fire.Fire(main)
