"""Time the integer kernels streaming 7B-shaped layers from 2 MiB pages against 4 KiB ones, one row at a time.

    python scripts/bench_huge_pages.py                  # 2 layers of LLaMA-2 7B's shapes, 2 threads
    python scripts/bench_huge_pages.py --layers 8 --threads 1

Each format the kernels hold (Q8_0, int8 in groups of 16, Q4_0, Q4_1) is laid out once in ordinary memory
(`torch.empty`) and once in memory that asked for 2 MiB pages (`llama.runtime.pages.huge_empty`, what the layer
classes use), with the same values; every layer's weight is its own tensor, far more than the caches hold.
Rounds interleave the eight, and each figure is the median over rounds of one pass over every layer's seven
products, with the weight bytes read per second. Linux with transparent huge pages in "madvise" or "always";
elsewhere both columns are ordinary memory.
"""

import statistics
import time

import fire
import torch

from llama import kernels
from llama.kernels import layout
from llama.runtime.pages import huge_empty

SHAPES = [(4096, 4096)] * 4 + [(11008, 4096), (11008, 4096), (4096, 11008)]  # wq wk wv wo, w1 w3, w2


def _weights(fmt, out, k, gen):
    """The op's arguments after x, for random values of the format."""
    nb = k // kernels.QK
    if fmt in ("q8_0", "q8_16"):
        values = torch.randint(-127, 128, (out, k), generator=gen, dtype=torch.int8)
        scales = (torch.rand(out, nb * (2 if fmt == "q8_16" else 1), generator=gen) * 0.01).half()
        return (layout.pack_q8_16 if fmt == "q8_16" else layout.pack_q8_0)(values, scales)
    values = torch.randint(0, 16, (out, k), generator=gen, dtype=torch.uint8)
    scales = (torch.rand(out, nb, generator=gen) * 0.01).half()
    return (layout.pack_q4(values, scales, None if fmt == "q4_0" else -8 * scales),)


def _placed(tensors, huge):
    out = []
    for t in tensors:
        held = huge_empty(t.shape, t.dtype) if huge else torch.empty(t.shape, dtype=t.dtype)
        held.copy_(t)
        out.append(held)
    return out


def main(layers: int = 2, threads: int = 2, rounds: int = 7):
    if not kernels.load():
        raise SystemExit(f"the kernels cannot run here: {kernels.unavailable_reason()}")
    torch.set_num_threads(threads)
    gen = torch.Generator().manual_seed(0)
    ops = {"q8_0": torch.ops.llama_kv.q8_0_linear, "q8_16": torch.ops.llama_kv.q8_16_linear,
           "q4_0": torch.ops.llama_kv.q4_0_linear, "q4_1": torch.ops.llama_kv.q4_1_linear}
    held = {}
    for fmt in ops:
        plain = [(_weights(fmt, out, k, gen), out, k) for _ in range(layers) for out, k in SHAPES]
        for huge in (False, True):
            held[fmt, huge] = [(_placed(w, huge), out, k) for w, out, k in plain]
    xs = {k: torch.randn(1, k, generator=gen) for k in {k for _, k in SHAPES}}
    times = {key: [] for key in held}
    for _ in range(rounds):
        for (fmt, huge), layer_list in held.items():
            start = time.perf_counter()
            for weights, out, k in layer_list:
                ops[fmt](xs[k], *weights, out)
            times[fmt, huge].append(time.perf_counter() - start)
    print(f"torch {torch.__version__}, {threads} threads, {layers} layers of 7B's shapes, path {kernels.best_path()}; "
          "median ms a pass and GB/s of weights")
    for fmt in ops:
        nbytes = sum(t.nbytes for weights, _, _ in held[fmt, False] for t in weights)
        line = [f"{fmt:6}"]
        for huge in (False, True):
            ms = statistics.median(times[fmt, huge]) * 1000
            line.append(f"{'2 MiB' if huge else '4 KiB'} pages {ms:7.2f} ms {nbytes / ms / 1e6:5.1f} GB/s")
        print("   ".join(line))


if __name__ == "__main__":
    fire.Fire(main)
