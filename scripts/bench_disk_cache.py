"""Time to first token after a restart: a long shared system prompt loaded from llama-server's --kv-cache-dir,
against the same request on a server that computes it.

    python scripts/bench_disk_cache.py [--repeats 3] [--system-tokens 2000] [--threads 2] [--ckpt-dir DIR]
        [--kv-cache-dtype auto|int8] [--llamacpp] [--cache-dir DIR]

First a server with --kv-cache-dir (a new temporary directory) answers one request with the system prompt, and
stops: its blocks are on disk. Then, --repeats times, interleaved: a new server on that directory, and a new
server without it, each started fresh (nothing in memory) and asked the same streamed chat request, greedy: the
system prompt and a question it has not seen. Time to first token counts from the request sent to its first
content. Both answers must be the same text; the disk run must report cached tokens, the other none.

Both servers run the default model (or --ckpt-dir) as `llama-server --no-compile --parallel 1` with
OMP_NUM_THREADS=--threads: prompts are fed eagerly either way, and the stored decode step would only add its
first build to the first start. --kv-cache-dtype is both servers' (int8: a quarter of the bytes on disk).

With --llamacpp, llama.cpp's server does the same on the same weights (an F32 GGUF of the default model, its KV
cache in its default f16), each repeat right after ours, its way: `--slot-save-path`, the warm request's slot
saved to a file (`POST /slots/0?action=save`), and on each fresh server that file restored (`?action=restore`)
before the request.
Its time to first token counts the restore too; its "cached" tokens are those its timings say it did not
evaluate (prompt tokens - `prompt_n`). llama.cpp is built once from the llama-cpp-python sdist (bench_server.py's
build_llama_cpp, in --cache-dir).
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


def start(ckpt_dir: Optional[str], threads: int, max_seq_len: int, kv_cache_dir: Optional[Path],
          kv_cache_dtype: str = "auto") -> subprocess.Popen:
    port = free_port()
    cmd = [sys.executable, "-m", "llama.cli.server", "--port", str(port), "--parallel", "1", "--no-compile",
           "--max-seq-len", str(max_seq_len), "--kv-cache-dtype", kv_cache_dtype]
    cmd += ["--ckpt-dir", ckpt_dir] if ckpt_dir else []
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


def stream_chat(url: str, body: Dict) -> Dict:
    """One streamed chat request: the time its first content arrived (perf_counter), its text, and the last usage
    and timings (llama.cpp's) its chunks carried."""
    first, text, usage, timings = None, "", None, None
    with httpx.stream("POST", url + "/v1/chat/completions", json={"stream": True, **body}, timeout=600) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            payload = json.loads(line[6:])
            usage = payload.get("usage") or usage
            timings = payload.get("timings") or timings
            for choice in payload.get("choices") or []:
                content = (choice.get("delta") or {}).get("content")
                if content:
                    first = first or time.perf_counter()
                    text += content
    return {"first": first or time.perf_counter(), "text": text, "usage": usage, "timings": timings}


def messages(system: str, question: str) -> List[Dict[str, str]]:
    return [{"role": "system", "content": system}, {"role": "user", "content": question}]


def ask(proc: subprocess.Popen, system: str, question: str, max_tokens: int = 8) -> Dict:
    """One streamed greedy chat request: its time to first content, text and usage."""
    start_time = time.perf_counter()
    got = stream_chat(proc.url, {"model": "m", "stream_options": {"include_usage": True}, "temperature": 0,
                                 "max_tokens": max_tokens, "messages": messages(system, question)})
    usage = got["usage"]
    return {"ttft": got["first"] - start_time, "text": got["text"], "prompt_tokens": usage["prompt_tokens"],
            "cached_tokens": usage["prompt_tokens_details"]["cached_tokens"]}


def ask_llama_cpp(proc: subprocess.Popen, system: str, question: str, max_tokens: int = 8,
                  restore: Optional[str] = None) -> Dict:
    """ask() on llama.cpp's server, its slot first restored from `restore` (a file in --slot-save-path): the
    restore's time counts toward the first token. Tokens it did not evaluate count as cached."""
    start_time = time.perf_counter()
    if restore is not None:
        r = httpx.post(proc.url + "/slots/0?action=restore", json={"filename": restore}, timeout=600)
        r.raise_for_status()
    got = stream_chat(proc.url, {"model": "m", "temperature": 0, "max_tokens": max_tokens, "id_slot": 0,
                                 "cache_prompt": True, "messages": messages(system, question)})
    evaluated = got["timings"]["prompt_n"]
    total = (got["usage"] or {}).get("prompt_tokens", evaluated + got["timings"].get("cache_n", 0))
    return {"ttft": got["first"] - start_time, "text": got["text"], "prompt_tokens": total,
            "cached_tokens": total - evaluated}


class LlamaCppSlots:
    """llama.cpp's slot save and restore, as the module docstring says: the slot saved once at construction, then
    each `repeat` a restored and a computed run on fresh servers."""

    def __init__(self, system: str, threads: int, max_seq_len: int, cache_dir: Optional[str]):
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        from bench_server import build_llama_cpp, f32_gguf

        cache = Path(cache_dir or Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache"))
                     / "llama-kv-bench-server")
        self.bin_dir = build_llama_cpp(cache, threads)
        self.gguf = f32_gguf(self.bin_dir, cache, threads)
        self.system, self.threads, self.max_seq_len = system, threads, max_seq_len
        self.slots = Path(tempfile.mkdtemp(prefix="bench-disk-cache-slots-"))
        proc = self.fresh()
        ask_llama_cpp(proc, system, "Where is the library?", max_tokens=1)
        httpx.post(proc.url + "/slots/0?action=save", json={"filename": "system.bin"}, timeout=600).raise_for_status()
        stop(proc)
        print(f"llama.cpp slot file: {(self.slots / 'system.bin').stat().st_size / 2**20:.1f} MiB", flush=True)

    def fresh(self) -> subprocess.Popen:
        from bench_server import start_llama_cpp, wait_ready

        proc = start_llama_cpp(self.bin_dir, self.gguf, self.threads, 1, self.max_seq_len,
                               ["--slot-save-path", str(self.slots)])
        wait_ready(proc.url, proc)
        return proc

    def repeat(self, r: int, question: str) -> List[Dict]:
        runs = []
        for mode in ("restored", "computed"):
            proc = self.fresh()
            result = ask_llama_cpp(proc, self.system, question, restore="system.bin" if mode == "restored" else None)
            stop(proc)
            result.update(mode=f"llama.cpp {mode}", repeat=r)
            runs.append(result)
            print(f"llama.cpp {mode:>8}: ttft {result['ttft'] * 1000:8.0f} ms, {result['cached_tokens']} of "
                  f"{result['prompt_tokens']} prompt tokens not evaluated", flush=True)
        if runs[0]["text"] != runs[1]["text"]:
            print(f"llama.cpp's restored and computed answers differ: {runs[0]['text']!r} {runs[1]['text']!r}")
        return runs

    def close(self) -> None:
        shutil.rmtree(self.slots, ignore_errors=True)


def main(repeats: int = 3, system_tokens: int = 2000, threads: int = 2, ckpt_dir: str = None, json_file: str = None,
         llamacpp: bool = False, cache_dir: str = None, kv_cache_dtype: str = "auto"):
    """Measure time to first token with the system prompt loaded from disk and computed; see the module docstring."""
    directory = Path(tempfile.mkdtemp(prefix="bench-disk-cache-"))
    llama_cpp = None
    try:
        system = PARAGRAPH * max(1, round(system_tokens / 46))  # 46 tokens a paragraph for the default model
        max_seq_len = 2 * system_tokens + 256
        proc = start(ckpt_dir, threads, max_seq_len, directory, kv_cache_dtype)
        warm = ask(proc, system, "Where is the library?", max_tokens=1)
        stop(proc)
        files = list(directory.glob("*.kvblock"))
        print(f"system prompt: {warm['prompt_tokens']} prompt tokens; {len(files)} block files, "
              f"{sum(f.stat().st_size for f in files) / 2**20:.1f} MiB on disk", flush=True)
        llama_cpp = LlamaCppSlots(system, threads, max_seq_len, cache_dir) if llamacpp else None
        runs: List[Dict] = []
        for r in range(repeats):
            question = QUESTIONS[r % len(QUESTIONS)]
            for mode in ("disk", "computed"):
                proc = start(ckpt_dir, threads, max_seq_len, directory if mode == "disk" else None, kv_cache_dtype)
                result = ask(proc, system, question)
                stop(proc)
                result.update(mode=mode, repeat=r)
                runs.append(result)
                print(f"{mode:>8}: ttft {result['ttft'] * 1000:8.0f} ms, {result['cached_tokens']} of "
                      f"{result['prompt_tokens']} prompt tokens cached", flush=True)
            disk, computed = runs[-2], runs[-1]
            if disk["text"] != computed["text"] or disk["cached_tokens"] == 0 or computed["cached_tokens"] != 0:
                raise SystemExit(f"the runs disagree: {disk} {computed}")
            if llama_cpp is not None:  # interleaved with ours, repeat by repeat
                runs += llama_cpp.repeat(r, question)
        for mode in dict.fromkeys(r["mode"] for r in runs):
            ttfts = [r["ttft"] for r in runs if r["mode"] == mode]
            print(f"{mode:>18}: median ttft {statistics.median(ttfts) * 1000:.0f} ms "
                  f"({', '.join(f'{t * 1000:.0f}' for t in ttfts)})")
        if json_file:
            Path(json_file).write_text(json.dumps(runs, indent=2) + "\n")
    finally:
        shutil.rmtree(directory, ignore_errors=True)
        if llama_cpp is not None:
            llama_cpp.close()


if __name__ == "__main__":
    fire.Fire(main)
