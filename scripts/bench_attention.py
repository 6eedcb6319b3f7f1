"""Time the row-exact attention op (llama/kernels/csrc/attention.cpp) of this tree against another tree's.

    python scripts/bench_attention.py --baseline /path/to/other/checkout
        [--positions 512,2048,8192] [--kv float32,bfloat16,int8] [--threads 2] [--rounds 3] [--prefill 2048]
        [--quantize int8]

Each tree runs in a worker process of its own (its sources on PYTHONPATH, so each loads its own build of the
kernels), and the parent asks the workers in turn, so that drift in the machine's speed hits both alike. Per
position count N, on the default model's attention shapes (3 key/value heads of 64, 3 query heads per group
folded into the rows as llama/model.py does, a causal mask per row): the prompt's attention (3N rows against N
keys) and one decode step's (3 rows against N keys), in milliseconds: per round the median of the calls of 0.3 s
after one untimed call, and the median over rounds. A decode step's keys and values come from memory, as in a model,
whose every layer reads its own cache between the weights: each call reads the next of enough copies (256 MB in
all) that none is still in the CPU's caches. --kv gives the caches' dtypes (bfloat16 and int8: stored as
llama/kv_cache.py stores them, under float32 queries), each a row of its own. With --prefill, the
default model quantized with --quantize (the integer kernels run the row-exact attention) reads a prompt of that
many tokens and gives one token, timed end to end in seconds. Every call of the two trees must give the same
logits' argmax; the op's outputs are compared too and their largest difference printed (the two trees need not
agree bit for bit: a new kernel may sum in another order).
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
N_KV_HEADS, N_REP, HEAD_DIM = 3, 3, 64  # SmolLM2-135M: 9 query heads, 3 key/value heads, head_dim 64


def _op_inputs(n: int, rows: int, kv: str):
    """q (1, 3, N_REP * rows, 64), the mask the model gives the last `rows` positions, and copies of k and v
    (1, 3, n, 64) in the cache's dtype: one for a prompt, 256 MB of them for a decode step."""
    import torch

    from llama.kv_cache import store_kv

    gen = torch.Generator().manual_seed(n)
    q = torch.randn(1, N_KV_HEADS, N_REP * rows, HEAD_DIM, generator=gen)
    pos = torch.arange(n - rows, n)
    mask = torch.zeros(rows, n).masked_fill(torch.arange(n)[None, :] > pos[:, None], float("-inf"))
    mask = mask.unsqueeze(0).repeat(1, N_REP, 1).unsqueeze(1)  # (1, 1, N_REP * rows, n), as the model's
    caches = []
    while not caches or (rows == 1 and sum(k.nbytes + v.nbytes for k, v in caches) < 256e6):
        k, v = (torch.randn(1, N_KV_HEADS, n, HEAD_DIM, generator=gen) for _ in range(2))
        if kv != "float32":
            k, v = store_kv(k, getattr(torch, kv)), store_kv(v, getattr(torch, kv))
        caches.append((k, v))
    return q, mask, caches


def worker(threads: int, quantize: str, max_seq_len: int) -> None:
    """Answer the parent's requests, one JSON line each: {"op": [n, rows]} or {"prefill": n}."""
    import torch

    from llama.kernels import build

    torch.set_num_threads(threads)
    build.build_and_load()
    llama, inputs = None, {}
    for line in sys.stdin:
        request = json.loads(line)
        if "op" in request:
            key = tuple(request["op"])
            if key not in inputs:
                inputs = {key: _op_inputs(*key)}  # one shape held at a time: 8,192 positions' mask is 800 MB
            q, mask, caches = inputs[key]
            out = torch.ops.llama_kv.attention(q, *caches[0], mask)  # wakes the threads the other worker left asleep
            times = []
            while sum(times) < 0.3 or len(times) < 2:
                k, v = caches[len(times) % len(caches)]
                start = time.perf_counter()
                torch.ops.llama_kv.attention(q, k, v, mask)
                times.append(time.perf_counter() - start)
            seconds = statistics.median(times)
            answer = {"seconds": seconds, "sample": out[0, :, :: max(1, out.shape[2] // 64)].flatten().tolist()}
        else:
            from llama import Llama
            from llama.convert.fetch import default_model_dir

            if llama is None:
                llama = Llama.build(default_model_dir(), max_seq_len=max_seq_len, max_batch_size=1, compile=False,
                                    quantize=quantize)
            n = request["prefill"]
            prompt = torch.randint(1, llama.model.vocab_size, (n,), generator=torch.Generator().manual_seed(n)).tolist()
            start = time.perf_counter()
            (tokens,), _ = llama.generate([prompt], 1, temperature=0)
            answer = {"seconds": time.perf_counter() - start, "token": tokens}
        print(json.dumps(answer), flush=True)


class Worker:
    def __init__(self, tree: Path, args):
        env = {**os.environ, "PYTHONPATH": str(tree)}
        command = [sys.executable, str(Path(__file__).resolve()), "--worker", "--threads", str(args.threads),
                   "--quantize", args.quantize, "--max_seq_len", str(args.prefill + 8)]
        self.process = subprocess.Popen(command, cwd=tree, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)

    def ask(self, request: dict) -> dict:
        self.process.stdin.write(json.dumps(request) + "\n")
        self.process.stdin.flush()
        line = self.process.stdout.readline()
        if not line:
            raise SystemExit(f"a worker stopped (exit status {self.process.wait()})")
        return json.loads(line)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--baseline", help="the other tree (a checkout of this project)")
    parser.add_argument("--positions", default="512,2048,8192")
    parser.add_argument("--kv", default="float32", help="the caches' dtypes: float32, bfloat16, int8")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--prefill", type=int, default=2048, help="prompt tokens for the end-to-end run (0: none)")
    parser.add_argument("--quantize", default="int8")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--max_seq_len", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(args.threads, args.quantize, args.max_seq_len)
    if not args.baseline:
        parser.error("--baseline: which tree to compare with")
    trees = {"baseline": Path(args.baseline).resolve(), "this tree": REPO}
    workers = {name: Worker(tree, args) for name, tree in trees.items()}
    kvs = args.kv.split(",")
    if any(kv not in ("float32", "bfloat16", "int8") for kv in kvs):
        parser.error(f"--kv {args.kv}: each of float32, bfloat16, int8")
    jobs = [("op", [int(n), int(n), kv]) for kv in kvs for n in args.positions.split(",")]
    jobs += [("op", [int(n), 1, kv]) for kv in kvs for n in args.positions.split(",")]
    jobs += [("prefill", args.prefill)] if args.prefill else []
    print(f"{args.threads} threads, median of {args.rounds} rounds, the two trees alternating")
    print(f"{'what':>44} {'baseline':>10} {'this tree':>10} {'ratio':>7}   largest difference")
    for kind, what in jobs:
        seconds = {name: [] for name in workers}
        answers = {}
        for round_ in range(args.rounds + 1):  # round 0 warms up (and loads the model)
            for name in (list(workers) if round_ % 2 == 0 else list(workers)[::-1]):
                answers[name] = workers[name].ask({kind: what})
                if round_:
                    seconds[name].append(answers[name]["seconds"])
        base, new = (statistics.median(seconds[name]) for name in workers)
        if kind == "op":
            n, rows, kv = what
            label = f"attention, {N_REP * rows} rows x {n} {kv} keys"
            a, b = (answers[name]["sample"] for name in workers)
            note = f"{max(abs(x - y) for x, y in zip(a, b)):.1e}"
            unit, scale = "ms", 1e3
        else:
            label = f"prefill {what} tokens ({args.quantize})"
            note = "same token" if answers["baseline"]["token"] == answers["this tree"]["token"] else "TOKENS DIFFER"
            unit, scale = "s", 1.0
        print(f"{label:>44} {base * scale:>8.2f}{unit:<2} {new * scale:>8.2f}{unit:<2} {base / new:>6.2f}x   {note}")
    for w in workers.values():
        w.process.stdin.close()
        w.process.wait()


if __name__ == "__main__":
    main()
