"""llama-server under N concurrent chat clients, against llama.cpp's own llama-server on the same weights.

    python scripts/bench_server.py [--clients 1,4,8,16] [--requests 4] [--threads 2] [--parallel 16]
        [--eager] [--ours-only] [--prefill-chunk N] [--cache-dir DIR] [--json-file FILE]
    python scripts/bench_server.py --long-prompt 2000 [--clients 8] [--requests 2] [--streams 4] ...

Each client sends --requests chat requests one after another, streamed: a system prompt shared with other
clients (one of three) and a question of mixed length (short, medium, long), asking for a mixed number of
tokens (32 to 128) with `ignore_eos`, greedy, so both servers generate exactly the same counts. For each
number of clients it reports, over all requests, time to first token (TTFT: request sent to the first
content) and time per output token after it (TPOT), p50 and p99, and total generated tokens/s over the
run's wall time.

Ours runs the default model (SmolLM2-135M-Instruct) in float32 with OMP_NUM_THREADS=--threads (and, as
llama-server always does unless told otherwise, GOMP_SPINCOUNT=10000), as llama-server runs with no flags
(the decode step compiled ahead of time and loaded from $LLAMA_HOME; the first start builds it, before any
timing), or with --eager as `llama-server --no-compile` (both with --eager --also-default); --prefill-chunk N is passed
on to it. llama.cpp's
server is built here, once, into --cache-dir from the vendored tree of the llama-cpp-python source
distribution (the version llama-download pins; cmake and a C++ compiler needed; nothing of it enters this
repository), and runs an F32 GGUF that its own llama-quantize makes from the shipped Q4_1 file: exactly
the dequantized values our checkpoint holds. Same threads, same --parallel slots, a context of
--max-seq-len per slot, each server with its own defaults otherwise, in the same run, one server at a time.

With --long-prompt N the rounds are long prompts instead. First, each of --clients clients sends --requests
requests one after another whose user message is N tokens of text of its own (no two prompts share more than
the chat template's first tokens, so neither server's prompt cache helps), asking for 16 tokens; it reports
TTFT p50 and p99 over them. Second, --streams clients stream long replies to short questions, and once each
has its first token one more client sends an N-token prompt: it reports that prompt's TTFT and the streams'
time per token while it is read (the gaps between their tokens inside the window from sending it to its first
token; p50 and the longest), against the same streams' gaps before it was sent. Each slot's context is then
at least N + 512 tokens.
"""

import asyncio
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tarfile
import time
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

import fire
import httpx

REPO = Path(__file__).resolve().parent.parent
SYSTEMS = [
    "You are a helpful assistant. Answer briefly and precisely, in plain English.",
    "You are a patient teacher of history. Explain causes and consequences, with dates where they help, "
    "and end with one question that makes the student think further about the period.",
    "You are a senior Python reviewer. Point out bugs first, then style, and suggest the smallest change "
    "that fixes each problem you find.",
]
QUESTIONS = [
    "What is a list?",
    "Why did the Roman Empire split into two halves, and what happened to each of them afterwards?",
    "Here is my function: def mean(xs): return sum(xs) / len(xs). It fails on some inputs and I do not know "
    "which ones or why. What would you change, how would you test it, and what would you name the tests?",
]
MAX_TOKENS = [32, 64, 96, 128]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_ready(url: str, proc: subprocess.Popen, timeout: float = 1800) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"the server at {url} exited with status {proc.returncode}")
        try:
            if httpx.get(url + "/health", timeout=5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise SystemExit(f"the server at {url} was not ready after {timeout:.0f} s")


def start_ours(ckpt_dir: Optional[str], threads: int, parallel: int, max_seq_len: int, eager: bool,
               prefill_chunk: Optional[int] = None) -> subprocess.Popen:
    port = free_port()
    cmd = [sys.executable, "-m", "llama.cli.server", "--port", str(port), "--parallel", str(parallel),
           "--max-seq-len", str(max_seq_len)] + (["--ckpt-dir", ckpt_dir] if ckpt_dir else []) + (["--no-compile"] if eager else [])
    cmd += ["--prefill-chunk", str(prefill_chunk)] if prefill_chunk else []
    # The repository first, then what PYTHONPATH holds already (packages installed with pip's --target, say).
    path = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "PYTHONPATH": path}
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    proc.url = f"http://127.0.0.1:{port}"
    return proc


# Compiler flags of llama.cpp's build without AMX (`build_llama_cpp(amx=False)`): explicit -mno-* flags win over
# the -march=native of GGML_NATIVE, whatever their order.
NO_AMX = "-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"


def build_llama_cpp(cache_dir: Path, threads: int, targets=("llama-server", "llama-quantize"),
                    amx: bool = True) -> Path:
    """llama.cpp's tools (`targets`), built once from the llama-cpp-python sdist's vendored tree for this CPU
    (GGML_NATIVE); `amx=False`: without AMX instructions, into a build directory of its own, for a CPU that reports
    AMX but stops its AMX kernels with an illegal instruction (as some virtual machines do)."""
    from llama.convert.llama2_vocab import SDIST_REQUIREMENT
    from llama.convert.pip_fetch import pip_download

    build = cache_dir / ("build" if amx else "build-noamx")
    bin_dir = build / "bin"
    if all((bin_dir / target).exists() for target in targets):
        return bin_dir
    for tool in ("cmake", "c++"):
        if shutil.which(tool) is None:
            raise SystemExit(f"building llama.cpp's tools needs {tool}; install it or leave llama.cpp out")
    src = cache_dir / "src"
    if not (src / "CMakeLists.txt").exists():
        print(f"fetching {SDIST_REQUIREMENT} (the source of llama.cpp's server) ...", file=sys.stderr, flush=True)
        sdist = pip_download(SDIST_REQUIREMENT, cache_dir / "download", "sdist")
        with tarfile.open(sdist) as archive:
            archive.extractall(cache_dir / "unpacked", filter="data")
        vendored = next((cache_dir / "unpacked").glob("*/vendor/llama.cpp"))
        shutil.rmtree(src, ignore_errors=True)
        shutil.move(str(vendored), src)
    print(f"building llama.cpp's {' and '.join(targets)}{'' if amx else ' without AMX'} (minutes) ...", file=sys.stderr,
          flush=True)
    flags = [] if amx else [f"-DCMAKE_C_FLAGS={NO_AMX}", f"-DCMAKE_CXX_FLAGS={NO_AMX}"]
    subprocess.run(["cmake", "-S", str(src), "-B", str(build), "-DCMAKE_BUILD_TYPE=Release", "-DLLAMA_CURL=OFF",
                    "-DLLAMA_BUILD_SERVER=ON", "-DLLAMA_BUILD_TESTS=OFF", "-DGGML_NATIVE=ON", *flags], check=True)
    subprocess.run(["cmake", "--build", str(build), "--target", *targets, "-j", str(threads)], check=True)
    return bin_dir


# llama.cpp's GGUF type beside each of our --quantize choices (`f32_gguf`'s gguf_type).
GGUF_TYPES = {"none": "F32", "int8": "Q8_0", "int4": "Q4_0"}


def f32_gguf(bin_dir: Path, cache_dir: Path, threads: int, gguf_type: str = "F32",
             source: Optional[Path] = None, output_type: Optional[str] = None) -> Path:
    """The default model as an F32 GGUF (or `gguf_type`: Q8_0, Q4_0, ...), made from the shipped Q4_1 file by
    llama.cpp's own quantizer, every tensor in that type: F32 holds exactly the dequantized values. `source`: another
    GGUF to make it from (an F16 or F32 one, such as scripts/write_random_gguf.py's LLaMA-2 7B shapes);
    `output_type`: the embedding and output layer in that type instead (q8_0, as `--quantize int4` keeps them)."""
    from llama.convert.fetch import default_model_gguf

    source = Path(source) if source is not None else default_model_gguf()
    suffix = f"-{output_type}-output" if output_type else ""
    out = cache_dir / f"{source.stem.split('.')[0]}.{gguf_type}{suffix}.gguf"
    if out == source:
        return out
    if not out.exists():
        partial = out.with_suffix(".partial")
        output = ["--token-embedding-type", output_type, "--output-tensor-type", output_type] if output_type else []
        subprocess.run([str(bin_dir / "llama-quantize"), "--allow-requantize", "--pure", *output, str(source),
                        str(partial), gguf_type, str(threads)], check=True, capture_output=True)
        partial.rename(out)
    return out


def start_llama_cpp(bin_dir: Path, gguf: Path, threads: int, parallel: int, max_seq_len: int,
                    extra: Sequence[str] = ()) -> subprocess.Popen:
    port = free_port()
    cmd = [str(bin_dir / "llama-server"), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port),
           "-t", str(threads), "-tb", str(threads), "-np", str(parallel), "-c", str(parallel * max_seq_len),
           "--jinja", "--no-webui", *extra]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    proc.url = f"http://127.0.0.1:{port}"
    return proc


async def chat_payloads(client: httpx.AsyncClient, url: str, body: Dict[str, object]):
    """The JSON payloads of one streamed chat request, as they arrive."""
    async with client.stream("POST", url + "/v1/chat/completions", json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                yield json.loads(line[6:])


def has_content(payload: Dict[str, object]) -> bool:
    return any((choice.get("delta") or {}).get("content") for choice in payload.get("choices") or [])


async def first_last_tokens(client: httpx.AsyncClient, url: str, body: dict) -> Tuple[Optional[float], Optional[float], int]:
    """One streamed chat request: when its first and last content arrived (None for none) and its tokens (the
    usage chunk's count, else the content chunks')."""
    first = last = None
    chunks, tokens = 0, None
    async for payload in chat_payloads(client, url, body):
        if payload.get("usage"):
            tokens = payload["usage"]["completion_tokens"]
        if has_content(payload):
            now = time.perf_counter()
            first = first or now
            last = now
            chunks += 1
    return first, last, tokens or chunks


async def one_request(client: httpx.AsyncClient, url: str, k: int) -> Dict[str, float]:
    """One streamed chat request; its time to first token, time per output token and tokens."""
    body = {"model": "m", "stream": True, "stream_options": {"include_usage": True}, "temperature": 0,
            "ignore_eos": True, "max_tokens": MAX_TOKENS[k % len(MAX_TOKENS)],
            "messages": [{"role": "system", "content": SYSTEMS[k % len(SYSTEMS)]},
                         {"role": "user", "content": QUESTIONS[(k // len(SYSTEMS)) % len(QUESTIONS)]}]}
    start = time.perf_counter()
    first, last, tokens = await first_last_tokens(client, url, body)
    return {"ttft": (first or time.perf_counter()) - start,
            "tpot": (last - first) / (tokens - 1) if first and tokens > 1 else 0.0, "tokens": tokens}


def long_prompts(count: int, tokens: int) -> List[str]:
    """`count` texts of `tokens` tokens each (as the default model's tokenizer reads them alone), no two alike
    from their first word: numbered sentences of words drawn with a seed of their own."""
    import random

    from llama.convert.fetch import default_model_dir
    from llama.tokenizer import Tokenizer

    tokenizer = Tokenizer(str(default_model_dir() / "tokenizer.json"))
    words = " ".join(SYSTEMS + QUESTIONS).replace(",", "").replace(".", "").replace("?", "").split()
    texts = []
    for k in range(count):
        rng = random.Random(k)
        sentences = [f"Note {k}-{i}: " + " ".join(rng.choice(words) for _ in range(12)) + "." for i in range(tokens // 8)]
        texts.append(tokenizer.decode(tokenizer.encode(" ".join(sentences), bos=False, eos=False)[:tokens]))
    return texts


async def stream_times(client: httpx.AsyncClient, url: str, question: str, max_tokens: int,
                       times: Optional[List[float]] = None) -> Dict[str, object]:
    """One streamed chat request for `question`: when it was sent, when each piece of content arrived (appended to
    `times` as they do, where given), and the usage it reported."""
    body = {"model": "m", "stream": True, "stream_options": {"include_usage": True}, "temperature": 0,
            "ignore_eos": True, "max_tokens": max_tokens, "messages": [{"role": "user", "content": question}]}
    sent, times, usage = time.perf_counter(), [] if times is None else times, {}
    async for payload in chat_payloads(client, url, body):
        usage = payload.get("usage") or usage
        if has_content(payload):
            times.append(time.perf_counter())
    return {"sent": sent, "times": times, "prompt_tokens": usage.get("prompt_tokens", 0)}


async def load_long(url: str, clients: int, requests: int, prompts: List[str]) -> Dict[str, float]:
    """`clients` clients, each sending `requests` long prompts one after another; their TTFT."""
    limits = httpx.Limits(max_keepalive_connections=0)
    async with httpx.AsyncClient(timeout=httpx.Timeout(1800.0), limits=limits) as client:
        async def run_client(c: int) -> List[Dict[str, object]]:
            return [await stream_times(client, url, prompts[c * requests + i], 16) for i in range(requests)]

        start = time.perf_counter()
        results = [r for rs in await asyncio.gather(*(run_client(c) for c in range(clients))) for r in rs]
        wall = time.perf_counter() - start
    ttft = [r["times"][0] - r["sent"] for r in results]
    return {"clients": clients, "requests": len(results), "prompt_tokens": statistics.mean(r["prompt_tokens"] for r in results),
            "prompt_tokens_per_s": sum(r["prompt_tokens"] for r in results) / wall,
            "ttft_p50": _pct(ttft, 50), "ttft_p99": _pct(ttft, 99), "ttfts": sorted(ttft)}


async def load_during_prefill(url: str, streams: int, prompt: str, reply_tokens: int) -> Dict[str, float]:
    """`streams` running streams (replies of up to `reply_tokens`), then one long prompt: its TTFT, and the streams'
    gaps before and during it."""
    limits = httpx.Limits(max_keepalive_connections=0)
    async with httpx.AsyncClient(timeout=httpx.Timeout(1800.0), limits=limits) as client:
        question = QUESTIONS[1]
        logs: List[List[float]] = [[] for _ in range(streams)]
        running = [asyncio.create_task(stream_times(client, url, question, reply_tokens, log)) for log in logs]
        while not all(len(log) >= 8 for log in logs):  # every stream past its first tokens
            for task, log in zip(running, logs):
                if task.done():
                    task.result()  # its error, or a stream that ended far too soon
                    raise SystemExit(f"a stream at {url} ended after {len(log)} pieces")
            await asyncio.sleep(0.01)
        long = await stream_times(client, url, prompt, 16)
        for task in running:
            task.cancel()
        await asyncio.gather(*running, return_exceptions=True)
    start, first = long["sent"], long["times"][0]
    before, during = [], []
    for log in logs:
        for a, b in zip(log, log[1:]):
            if b <= start:
                before.append(b - a)
            elif a < first:  # the gap overlaps the window from sending the prompt to its first token
                during.append(b - a)
    return {"streams": streams, "prompt_tokens": long["prompt_tokens"], "ttft": first - start,
            "tpot_before_p50": _pct(before, 50), "tpot_during_p50": _pct(during, 50) if during else float("nan"),
            "tpot_during_max": max(during) if during else float("nan")}


async def load(url: str, clients: int, requests: int) -> Dict[str, float]:
    # A new connection for each request, for both servers: llama.cpp's closed kept-alive connections as httpx reused
    # them ("Server disconnected without sending a response"; in 2 of 4 runs of 8 clients, nothing in its log).
    limits = httpx.Limits(max_keepalive_connections=0)
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0), limits=limits) as client:
        async def run_client(c: int) -> List[Dict[str, float]]:
            return [await one_request(client, url, c * requests + i) for i in range(requests)]

        start = time.perf_counter()
        results = [r for rs in await asyncio.gather(*(run_client(c) for c in range(clients))) for r in rs]
        wall = time.perf_counter() - start
    ttft, tpot = [r["ttft"] for r in results], [r["tpot"] for r in results]
    return {"clients": clients, "requests": len(results), "tokens": sum(r["tokens"] for r in results),
            "tokens_per_s": sum(r["tokens"] for r in results) / wall,
            "ttft_p50": _pct(ttft, 50), "ttft_p99": _pct(ttft, 99), "tpot_p50": _pct(tpot, 50), "tpot_p99": _pct(tpot, 99)}


def measure_long(name: str, url: str, clients: List[int], requests: int, tokens: int, streams: int) -> List[Dict[str, float]]:
    # Every prompt of the run its own, the last for the streams' test: a prompt a round sent before would be in the
    # server's prompt cache.
    prompts, rows = long_prompts(sum(clients) * requests + 1, tokens), []
    for n in clients:
        mine, prompts = prompts[: n * requests], prompts[n * requests :]
        row = {"server": name, "test": "long prompts", **asyncio.run(load_long(url, n, requests, mine))}
        print(f"{name:18s} {n:3d} clients x {requests} prompts of {row['prompt_tokens']:.0f} tokens: "
              f"TTFT p50 {row['ttft_p50']:6.2f} s  p99 {row['ttft_p99']:6.2f} s  ({row['prompt_tokens_per_s']:.0f} prompt tokens/s "
              "over the round)", flush=True)
        rows.append(row)
    row = {"server": name, "test": "streams during a long prompt",
           **asyncio.run(load_during_prefill(url, streams, prompts[0], tokens + 256))}
    print(f"{name:18s} {streams:3d} streams, then {row['prompt_tokens']:.0f} prompt tokens: TTFT {row['ttft']:6.2f} s  "
          f"streams' TPOT before p50 {row['tpot_before_p50'] * 1000:6.1f} ms, while it is read p50 "
          f"{row['tpot_during_p50'] * 1000:6.1f} ms, longest {row['tpot_during_max'] * 1000:6.0f} ms", flush=True)
    return rows + [row]


def _pct(values: List[float], p: float) -> float:
    values = sorted(values)
    if len(values) == 1:
        return values[0]
    return statistics.quantiles(values, n=100, method="inclusive")[int(p) - 1]


def measure(name: str, proc: subprocess.Popen, clients: List[int], requests: int, long_prompt: int = 0,
            streams: int = 4) -> List[Dict[str, float]]:
    try:
        wait_ready(proc.url, proc)
        asyncio.run(load(proc.url, 1, 1))  # warm-up
        if long_prompt:
            return measure_long(name, proc.url, clients, requests, long_prompt, streams)
        rows = []
        for n in clients:
            row = {"server": name, **asyncio.run(load(proc.url, n, requests))}
            print(f"{name:18s} {n:3d} clients: {row['tokens_per_s']:7.1f} tok/s  TTFT p50 {row['ttft_p50'] * 1000:7.0f} ms "
                  f"p99 {row['ttft_p99'] * 1000:7.0f} ms  TPOT p50 {row['tpot_p50'] * 1000:6.1f} ms "
                  f"p99 {row['tpot_p99'] * 1000:6.1f} ms", flush=True)
            rows.append(row)
        return rows
    finally:
        proc.terminate()
        proc.wait(60)


def main(clients="1,4,8,16", requests: int = 4, threads: int = 2, parallel: int = 16, max_seq_len: int = 512,
         ckpt_dir: str = None, eager: bool = False, also_default: bool = False, ours_only: bool = False,
         cache_dir: str = None, json_file: str = None, long_prompt: int = 0, streams: int = 4, prefill_chunk: int = None):
    """Measure llama-server, and llama.cpp's server unless --ours-only; see the module docstring."""
    # fire reads "1,4,8" as a tuple, "8" as a number.
    counts = [int(c) for c in (clients if isinstance(clients, (tuple, list)) else str(clients).split(","))]
    if long_prompt:
        max_seq_len = max(max_seq_len, long_prompt + 512)
    cache = Path(cache_dir) if cache_dir else Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "llama-kv-bench-server"
    rows = []
    for eager_run in ([True, False] if eager and also_default else [eager]):
        name = "llama-kv" + (" eager" if eager_run else "")
        rows += measure(name, start_ours(ckpt_dir, threads, parallel, max_seq_len, eager_run, prefill_chunk), counts, requests,
                        long_prompt, streams)
    if not ours_only:
        bin_dir = build_llama_cpp(cache, threads)
        gguf = f32_gguf(bin_dir, cache, threads)
        rows += measure("llama.cpp", start_llama_cpp(bin_dir, gguf, threads, parallel, max_seq_len), counts, requests,
                        long_prompt, streams)
    if json_file:
        Path(json_file).write_text(json.dumps(rows, indent=2) + "\n")


if __name__ == "__main__":
    fire.Fire(main)
