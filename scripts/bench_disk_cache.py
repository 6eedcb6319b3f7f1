"""Time to first token after a restart: a long shared system prompt loaded from llama-server's --kv-cache-dir,
against the same request on a server that computes it.

    python scripts/bench_disk_cache.py [--repeats 3] [--system-tokens 2000] [--threads 2] [--ckpt-dir DIR]

First a server with --kv-cache-dir (a new temporary directory) answers one request with the system prompt, and
stops: its blocks are on disk. Then, --repeats times, interleaved: a new server on that directory, and a new
server without it, each started fresh (nothing in memory) and asked the same streamed chat request, greedy: the
system prompt and a question it has not seen. Time to first token counts from the request sent to its first
content. Both answers must be the same text; the disk run must report cached tokens, the other none.

Both servers run the default model (or --ckpt-dir) as `llama-server --no-compile --parallel 1` with
OMP_NUM_THREADS=--threads: prompts are fed eagerly either way, and the stored decode step would only add its
first build to the first start.
"""

import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Dict, List, Optional

import fire
import httpx

REPO = Path(__file__).resolve().parent.parent
PARAGRAPH = ("The library keeps its books on three floors. The first floor holds newspapers and maps, the second "
             "holds history and science, and the third holds fiction, poetry and a small collection of rare "
             "manuscripts that readers may only see by appointment. ")
QUESTIONS = ["Which floor holds the maps?", "Where are the rare manuscripts?", "What is on the second floor?",
             "Can anyone see the manuscripts?", "Which floor has poetry?"]


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(ckpt_dir: Optional[str], threads: int, max_seq_len: int, kv_cache_dir: Optional[Path]) -> subprocess.Popen:
    port = free_port()
    cmd = [sys.executable, "-m", "llama.cli.server", "--port", str(port), "--parallel", "1", "--no-compile",
           "--max-seq-len", str(max_seq_len)] + (["--ckpt-dir", ckpt_dir] if ckpt_dir else [])
    cmd += ["--kv-cache-dir", str(kv_cache_dir)] if kv_cache_dir is not None else []
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    proc.url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 1800
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"the server exited with status {proc.returncode}: {' '.join(cmd)}")
        try:
            if httpx.get(proc.url + "/health", timeout=5).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise SystemExit("the server was not ready after 30 minutes")


def stop(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGTERM)
    if proc.wait(120) != 0:
        raise SystemExit(f"the server exited with status {proc.returncode}")


def ask(proc: subprocess.Popen, system: str, question: str, max_tokens: int = 8) -> Dict:
    """One streamed greedy chat request: its time to first content, text and usage."""
    body = {"model": "m", "stream": True, "stream_options": {"include_usage": True}, "temperature": 0,
            "max_tokens": max_tokens, "messages": [{"role": "system", "content": system},
                                                   {"role": "user", "content": question}]}
    start_time, first, text, usage = time.perf_counter(), None, "", None
    with httpx.stream("POST", proc.url + "/v1/chat/completions", json=body, timeout=600) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            payload = json.loads(line[6:])
            usage = payload.get("usage") or usage
            for choice in payload.get("choices") or []:
                content = (choice.get("delta") or {}).get("content")
                if content:
                    first = first or time.perf_counter()
                    text += content
    return {"ttft": (first or time.perf_counter()) - start_time, "text": text,
            "prompt_tokens": usage["prompt_tokens"], "cached_tokens": usage["prompt_tokens_details"]["cached_tokens"]}


def main(repeats: int = 3, system_tokens: int = 2000, threads: int = 2, ckpt_dir: str = None, json_file: str = None):
    """Measure time to first token with the system prompt loaded from disk and computed; see the module docstring."""
    directory = Path(tempfile.mkdtemp(prefix="bench-disk-cache-"))
    try:
        system = PARAGRAPH * max(1, round(system_tokens / 46))  # 46 tokens a paragraph for the default model
        max_seq_len = 2 * system_tokens + 256
        proc = start(ckpt_dir, threads, max_seq_len, directory)
        warm = ask(proc, system, "Where is the library?", max_tokens=1)
        stop(proc)
        files = list(directory.glob("*.kvblock"))
        print(f"system prompt: {warm['prompt_tokens']} prompt tokens; {len(files)} block files, "
              f"{sum(f.stat().st_size for f in files) / 2**20:.1f} MiB on disk", flush=True)
        runs: List[Dict] = []
        for r in range(repeats):
            question = QUESTIONS[r % len(QUESTIONS)]
            for mode in ("disk", "computed"):
                proc = start(ckpt_dir, threads, max_seq_len, directory if mode == "disk" else None)
                result = ask(proc, system, question)
                stop(proc)
                result.update(mode=mode, repeat=r)
                runs.append(result)
                print(f"{mode:>8}: ttft {result['ttft'] * 1000:8.0f} ms, {result['cached_tokens']} of "
                      f"{result['prompt_tokens']} prompt tokens cached", flush=True)
            disk, computed = runs[-2], runs[-1]
            if disk["text"] != computed["text"] or disk["cached_tokens"] == 0 or computed["cached_tokens"] != 0:
                raise SystemExit(f"the runs disagree: {disk} {computed}")
        for mode in ("disk", "computed"):
            ttfts = [r["ttft"] for r in runs if r["mode"] == mode]
            print(f"{mode:>8}: median ttft {statistics.median(ttfts) * 1000:.0f} ms "
                  f"({', '.join(f'{t * 1000:.0f}' for t in ttfts)})")
        if json_file:
            Path(json_file).write_text(json.dumps(runs, indent=2) + "\n")
    finally:
        shutil.rmtree(directory, ignore_errors=True)


if __name__ == "__main__":
    fire.Fire(main)
