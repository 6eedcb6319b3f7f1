"""What a JSON schema costs a reply on llama-server: time per output token with `response_format` against without.

    python scripts/bench_structured.py [--clients 1,8] [--requests 3] [--threads 2] [--parallel 8] [--tokens 96]

One server (the default model, llama-server's defaults: the decode step compiled ahead of time) answers three
rounds for each number of clients, every request streamed and greedy:

- free: no schema, `ignore_eos`, --tokens tokens each;
- schema: `response_format` with a schema whose reply is an array of exactly --tokens / 4 whole numbers (about
  --tokens tokens; each reply ends when its array is complete);
- mixed: half the clients with the schema, half free, in the same batches.

It reports the time per output token after the first (TPOT) p50 of each round, and the schema's and the mixed
round's free rows' tokens/s as a fraction of the free round's: the first is what a constrained row pays (its mask,
about 30-60 us a token), the second shows that rows without a schema pay nothing for the others'.
"""

import asyncio
import statistics
import sys
from pathlib import Path
from typing import Dict, List

import fire
import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_server import first_last_tokens, start_ours, wait_ready  # noqa: E402

QUESTION = "List some numbers between 0 and 999."


def schema_for(tokens: int) -> Dict[str, object]:
    n = max(1, tokens // 4)
    return {"type": "json_schema", "json_schema": {"name": "numbers", "strict": True, "schema": {
        "type": "array", "minItems": n, "maxItems": n, "items": {"type": "integer", "minimum": 0, "maximum": 999}}}}


async def one_request(client: httpx.AsyncClient, url: str, tokens: int, constrained: bool) -> Dict[str, float]:
    body = {"model": "m", "stream": True, "stream_options": {"include_usage": True}, "temperature": 0,
            "max_tokens": tokens * 2 if constrained else tokens, "messages": [{"role": "user", "content": QUESTION}]}
    body.update({"response_format": schema_for(tokens)} if constrained else {"ignore_eos": True})
    first, last, count = await first_last_tokens(client, url, body)
    return {"tpot": (last - first) / (count - 1), "tokens": count, "constrained": constrained}


async def round_(url: str, clients: int, requests: int, tokens: int, constrained: List[bool]) -> List[Dict[str, float]]:
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0)) as client:
        async def run_client(c: int) -> List[Dict[str, float]]:
            return [await one_request(client, url, tokens, constrained[c]) for _ in range(requests)]
        return [r for rs in await asyncio.gather(*(run_client(c) for c in range(clients))) for r in rs]


def main(clients="1,8", requests: int = 3, threads: int = 2, parallel: int = 8, tokens: int = 96,
         max_seq_len: int = 512):
    """Measure llama-server with and without a schema; see the module docstring."""
    counts = [int(c) for c in str(clients).strip("()").split(",") if str(c).strip()] if not isinstance(clients, int) \
        else [clients]
    proc = start_ours(None, threads, parallel, max_seq_len, eager=False)
    try:
        wait_ready(proc.url, proc)
        asyncio.run(round_(proc.url, 1, 1, 16, [True]))  # warm-up: the step, and llguidance's tokenizer
        asyncio.run(round_(proc.url, 1, 1, 16, [False]))
        for n in counts:
            p50 = {}
            for name, constrained in (("free", [False] * n), ("schema", [True] * n),
                                      ("mixed", [i % 2 == 0 for i in range(n)])):
                results = asyncio.run(round_(proc.url, n, requests, tokens, constrained))
                for kind in (True, False):
                    tpots = [r["tpot"] for r in results if r["constrained"] == kind]
                    if tpots:
                        p50[(name, kind)] = statistics.median(tpots)
                        made = sum(r["tokens"] for r in results if r["constrained"] == kind)
                        print(f"{n} clients, {name:6s} round, {'schema' if kind else 'free':6s} rows: TPOT p50 "
                              f"{p50[(name, kind)] * 1000:6.2f} ms ({1 / p50[(name, kind)]:6.1f} tokens/s a row), "
                              f"{made} tokens", flush=True)
            free = p50[("free", False)]
            print(f"{n} clients: a schema row's tokens/s is {free / p50[('schema', True)]:.1%} of a free row's; "
                  f"beside schema rows a free row's is {free / p50[('mixed', False)]:.1%}" if n > 1 else
                  f"{n} client: a schema row's tokens/s is {free / p50[('schema', True)]:.1%} of a free row's",
                  flush=True)
    finally:
        proc.terminate()
        proc.wait(60)


if __name__ == "__main__":
    fire.Fire(main)
