"""Time the integer kernels (llama/kernels) against the paths they replace, per layer shape and row count.

    python scripts/bench_int_kernels.py                                    # the default model's and 7B's shapes
    python scripts/bench_int_kernels.py --shapes 11008x4096 --rows 1,2,4,8,16,32,64,128,512 --threads 2

For each OUTxIN weight and each number of activation rows M: int8 and int4 through the integer kernel
(forced, at every M) and through dequantize-then-GEMM (forced), against what runs without them: torch's
int8 kernel (per channel) and int4 kernel with bf16 activations, dequantize-then-F.linear in float32 (the
exact eager path), and F.linear on float32 weights. Every candidate runs once per round, rounds interleave so
that drift in the machine's speed hits all alike, and each figure is the median over rounds, in microseconds
per call, with the weight bytes it reads per second at M = 1. The last column per M says which of the
kernel's two ways was faster there: where GEMM starts to win is `gemm_min_rows` (llama/kernels/csrc/ops.cpp).
"""

import statistics
import time

import fire
import torch
import torch.nn.functional as F

from llama import kernels
from llama.quant import format as qf
from llama.kernels import layout


def _list(value):
    """fire gives "1,2" as a tuple, "7" as an int, "1536x576,576x1536" as a string."""
    return [str(v).strip() for v in (value if isinstance(value, (tuple, list)) else str(value).split(","))]


def _time(fn, seconds):
    fn()
    n, start = 0, time.perf_counter()
    while True:
        fn()
        n += 1
        elapsed = time.perf_counter() - start
        if elapsed >= seconds:
            return elapsed / n


def candidates(out_f, in_f, m):
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(out_f, in_f, generator=gen) * 0.02
    x = torch.randn(m, in_f, generator=gen)
    xb = x.bfloat16()
    q8, s8 = qf.quantize_int8(w, 32)
    w8, s8p = layout.pack_q8_0(q8, s8)
    p4, s4, m4 = qf.quantize_int4(w, 32)
    v4 = qf.unpack_int4(p4)
    w4 = layout.pack_q4(v4, s4, m4)
    w40 = layout.pack_q4(v4, s4)  # as if Q4_0: each minimum -8 times its scale
    qc, sc = qf.quantize_int8(w)  # per channel, for torch's int8 kernel
    scf = sc.float().reshape(-1)
    packed4 = torch.ops.aten._convert_weight_to_int4pack_for_cpu(v4.to(torch.int32), 1)
    sz = torch.stack([s4.float(), m4.float() + 8 * s4.float()], -1).transpose(0, 1).contiguous().bfloat16()
    ops = torch.ops.llama_kv

    def integer(fn):
        def run():
            with kernels.options(gemm_min_rows=1 << 30):
                fn()
        return run

    def gemm(fn):
        def run():
            with kernels.options(gemm_min_rows=1):
                fn()
        return run

    return {
        "int8 kernel": (1, integer(lambda: ops.q8_0_linear(x, w8, s8p, out_f))),
        "int8 kernel, GEMM": (1, gemm(lambda: ops.q8_0_linear(x, w8, s8p, out_f))),
        "int8 kernel bf16": (1, integer(lambda: ops.q8_0_linear(xb, w8, s8p, out_f))),
        "int4 kernel": (0.5, integer(lambda: ops.q4_1_linear(x, w4, out_f))),
        "int4 kernel, GEMM": (0.5, gemm(lambda: ops.q4_1_linear(x, w4, out_f))),
        "int4 kernel bf16": (0.5, integer(lambda: ops.q4_1_linear(xb, w4, out_f))),
        "int4 Q4_0 kernel": (0.5, integer(lambda: ops.q4_0_linear(x, w40, out_f))),
        "torch int8pack_mm bf16": (1, lambda: torch.ops.aten._weight_int8pack_mm(xb, qc, scf.bfloat16())),
        "torch int8pack_mm fp32": (1, lambda: torch.ops.aten._weight_int8pack_mm(x, qc, scf)),
        "torch int4pack_mm bf16": (0.5, lambda: torch.ops.aten._weight_int4pack_mm_for_cpu(xb, packed4, 32, sz)),
        "int8 dequantize + F.linear": (1, lambda: F.linear(x, qf.dequantize(q8, s8))),
        "int4 dequantize + F.linear": (0.5, lambda: F.linear(x, qf.dequantize(p4, s4, m4))),
        "float32 F.linear": (4, lambda: F.linear(x, w)),
    }


def main(shapes="1536x576,576x1536,49152x576,11008x4096,4096x11008", rows="1,2,4,8,16,32,64,128",
         threads: int = 2, rounds: int = 5, seconds: float = 0.2):
    assert kernels.load(), kernels.unavailable_reason()
    torch.set_num_threads(threads)
    shapes = [tuple(int(v) for v in s.split("x")) for s in _list(shapes)]
    rows = [int(r) for r in _list(rows)]
    print(f"{threads} threads, kernel path {kernels.best_path()}, torch {torch.__version__}; "
          f"microseconds per call, median of {rounds} interleaved rounds")
    for out_f, in_f in shapes:
        for m in rows:
            cands = candidates(out_f, in_f, m)
            times = {name: [] for name in cands}
            for _ in range(rounds):
                for name, (_, fn) in cands.items():
                    times[name].append(_time(fn, seconds))
            med = {name: statistics.median(t) for name, t in times.items()}
            print(f"\n{out_f}x{in_f}, M = {m}:")
            for name, (bytes_per_value, _) in cands.items():
                rate = f"  {out_f * in_f * bytes_per_value / med[name] / 1e9:6.1f} GB/s" if m == 1 else ""
                print(f"  {name:28s} {med[name] * 1e6:10.1f}{rate}")
            for method in ("int8", "int4"):
                faster = "GEMM" if med[f"{method} kernel, GEMM"] < med[f"{method} kernel"] else "integer kernel"
                print(f"  {method}: {faster} is faster")


if __name__ == "__main__":
    fire.Fire(main)
