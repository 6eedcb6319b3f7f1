"""llama-server with and without `--speculate ngram`, under 1 and 8 concurrent clients, on data/speculative/'s prompts.

    python scripts/bench_server_speculative.py [--clients 1,8] [--kinds grounded,chat] [--limit N]
        [--max-tokens 128] [--draft-tokens 4] [--threads 2] [--rounds 2]

Two servers run the default model (SmolLM2-135M-Instruct) in float32 as `llama-server` runs with no flags (the
stored compiled steps, built before any timing), one plainly and one with --speculate ngram, --parallel 8, each
started once and measured in turn, round after round, so that drift in the machine's speed hits both alike.
Each client sends its share of a kind's prompts one after another, greedy, streamed. Every answer of the
speculating server must equal the plain one's (the script stops otherwise). Reported: generated tokens/s over
the wall time of each load, and the drafted tokens kept, from /metrics.
"""

import argparse
import asyncio
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Dict, List

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_server import free_port, wait_ready  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
DATA = REPO / "data" / "speculative"


def build_packages(threads: int, draft_tokens: int) -> None:
    """The server's stored decode steps for the rows its steps feed, built here before any server starts
    (a server builds the ones it lacks in the background, serving eagerly meanwhile, which would be timed)."""
    import torch

    from llama import Llama
    from llama.convert.fetch import default_model_dir
    from llama.server.app import build_runner
    from llama.server.engine import MAX_STEP_ROWS

    torch.set_num_threads(threads)
    llama = Llama.build(default_model_dir(), max_seq_len=2048, max_batch_size=8, compile_layers="auto")
    runner, _, _ = build_runner(llama, parallel=8, max_rows=min(MAX_STEP_ROWS, 8 * (1 + draft_tokens)))
    if runner.compiled_step is not None:
        runner.compiled_step.wait()


def start(flags: List[str], threads: int) -> subprocess.Popen:
    port = free_port()
    cmd = [sys.executable, "-m", "llama.cli.server", "--port", str(port), "--parallel", "8", *flags]
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    proc.url = f"http://127.0.0.1:{port}"
    wait_ready(proc.url, proc)
    return proc


async def answer(client: httpx.AsyncClient, url: str, messages, max_tokens: int) -> Dict:
    r = await client.post(url + "/v1/chat/completions", json={"messages": messages, "max_tokens": max_tokens,
                                                              "temperature": 0}, timeout=600)
    r.raise_for_status()
    body = r.json()
    return {"text": body["choices"][0]["message"]["content"], "tokens": body["usage"]["completion_tokens"]}


async def load(url: str, prompts: List, clients: int, max_tokens: int):
    """Every prompt answered, `clients` at a time: (answers in order, generated tokens, wall seconds)."""
    answers = [None] * len(prompts)

    async def client_loop(c: int, client: httpx.AsyncClient):
        for i in range(c, len(prompts), clients):
            answers[i] = await answer(client, url, prompts[i], max_tokens)

    async with httpx.AsyncClient() as client:
        start = time.perf_counter()
        await asyncio.gather(*(client_loop(c, client) for c in range(clients)))
        seconds = time.perf_counter() - start
    return answers, sum(a["tokens"] for a in answers), seconds


def metrics(url: str) -> Dict[str, float]:
    text = httpx.get(url + "/metrics", timeout=30).text
    return {line.split()[0]: float(line.split()[1]) for line in text.splitlines() if line and not line.startswith("#")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--clients", default="1,8")
    parser.add_argument("--kinds", default="grounded,chat")
    parser.add_argument("--limit", type=int, default=0, help="prompts of each kind (0: all)")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--draft-tokens", type=int, default=4)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    build_packages(args.threads, args.draft_tokens)
    servers = {"plain": start([], args.threads),
               "ngram": start(["--speculate", "ngram", "--draft-tokens", str(args.draft_tokens)], args.threads)}
    totals = {}
    try:
        for kind in args.kinds.split(","):
            records = [json.loads(line) for line in (DATA / f"{kind}.jsonl").read_text(encoding="utf-8").splitlines()]
            prompts = [r["messages"] for r in records[: args.limit or None]]
            for name, proc in servers.items():  # a first pass each, untimed: the prefix caches hold every prompt
                asyncio.run(load(proc.url, prompts, 8, 4))
            for clients in map(int, args.clients.split(",")):
                for r in range(args.rounds):
                    order = list(servers) if r % 2 == 0 else list(servers)[::-1]
                    got = {}
                    for name in order:
                        before = metrics(servers[name].url)
                        answers, tokens, seconds = asyncio.run(load(servers[name].url, prompts, clients, args.max_tokens))
                        after = metrics(servers[name].url)
                        got[name] = answers
                        t = totals.setdefault((kind, clients, name), [0, 0.0, 0.0, 0.0])
                        t[0] += tokens
                        t[1] += seconds
                        if name == "ngram":
                            for j, metric in ((2, "drafted"), (3, "accepted")):
                                key = f"llama_kv_speculative_{metric}_tokens_total"
                                t[j] += after[key] - before[key]
                    for i, (a, b) in enumerate(zip(got["plain"], got["ngram"])):
                        if a["text"] != b["text"]:
                            raise SystemExit(f"{kind} prompt {i} at {clients} clients: speculation changed the answer")
                plain, spec = totals[(kind, clients, "plain")], totals[(kind, clients, "ngram")]
                print(f"{kind:>8}, {clients} clients: {plain[0] / plain[1]:6.1f} -> {spec[0] / spec[1]:6.1f} tokens/s "
                      f"({spec[0] / spec[1] / (plain[0] / plain[1]):.2f}x), "
                      f"{spec[3]:.0f} of {spec[2]:.0f} drafted tokens kept", flush=True)
    finally:
        for proc in servers.values():
            proc.terminate()
            proc.wait(60)
    print("\n| prompts | clients | plain tokens/s | --speculate ngram tokens/s | speedup | drafted tokens kept |")
    print("| --- | --- | --- | --- | --- | --- |")
    for (kind, clients, name), (tokens, seconds, drafted, accepted) in totals.items():
        if name != "ngram":
            continue
        p_tokens, p_seconds = totals[(kind, clients, "plain")][:2]
        share = f"{accepted / drafted:.0%}" if drafted else "none drafted"
        print(f"| {kind} | {clients} | {p_tokens / p_seconds:.1f} | {tokens / seconds:.1f} | "
              f"{tokens / seconds / (p_tokens / p_seconds):.2f}x | {share} |")


if __name__ == "__main__":
    main()
