"""Ways to multiply rows of activations (one, by default) by a float32 weight matrix on the CPU, timed per shape.

    python scripts/linear_levers.py [--threads 2] [--repeats 20] [--rows 1]

For each linear shape of the default model (SmolLM2-135M: dim 576, feed-forward 1536, 3 KV heads of 64,
vocabulary 49152), as many random weight matrices as one decode step multiplies (60 of 576 x 576 for wq
and wo, ...), so that, as in a real step, each product reads its weight from memory, not from a cache.
Printed: the median time of one pass over them by each candidate kernel, per matrix, and the bytes of
weight read per second that it implies. Candidates that this torch build lacks are skipped:
    F.linear, row-major      PyTorch's default: (out, in) weights, MKL's sgemm/sgemv
    F.linear, column-major   the same values stored input-major (as eager CPU runs load them)
    mkl packed               torch.ops.mkl._mkl_linear on a weight packed by _mkl_reorder_linear_weight
    onednn packed            torch.ops.mkldnn._linear_pointwise on a weight from mkldnn._reorder_linear_weight
    onednn, plain weight     torch.ops.mkldnn._linear_pointwise on the (out, in) weight as it is
    onednn, column-major     the same on the input-major copy
    llama_kv.f32_linear      ours (llama/kernels), row-major: each output summed in one fixed order, a row's bits
                             the same in any company (FewRowsLinear, RowExactLinear); skipped where it cannot build
`--rows 512` times a prompt's products instead of a decode step's.
The "decode step" line adds up each kernel's passes: the matrix-product part of one decode step.
"""

import statistics
import time
from typing import Callable, Dict, List, Optional

import fire
import torch
import torch.nn.functional as F

from llama import kernels as llama_kernels

LAYERS = 30
SHAPES = {  # name: (out, in), and how many of it one decode step multiplies
    "wq, wo": ((576, 576), 2 * LAYERS),
    "wk, wv": ((192, 576), 2 * LAYERS),
    "w1, w3": ((1536, 576), 2 * LAYERS),
    "w2": ((576, 1536), LAYERS),
    "output": ((49152, 576), 1),
}


def candidates(weights: List[torch.Tensor], rows: int) -> Dict[str, Optional[Callable]]:
    """name -> a function of x that multiplies x by every weight in turn (None: not in this build)."""
    out: Dict[str, Optional[Callable]] = {}
    out["F.linear, row-major"] = lambda x: [F.linear(x, w) for w in weights]
    column_major = [w.t().contiguous().t() for w in weights]
    out["F.linear, column-major"] = lambda x: [F.linear(x, w) for w in column_major]
    try:
        packed = [torch.ops.mkl._mkl_reorder_linear_weight(w, rows) for w in weights]
        out["mkl packed"] = lambda x: [torch.ops.mkl._mkl_linear(x, p, w, None, rows) for p, w in zip(packed, weights)]
    except (AttributeError, RuntimeError):
        out["mkl packed"] = None
    try:
        onednn = [torch.ops.mkldnn._reorder_linear_weight(w, rows) for w in weights]
        out["onednn packed"] = lambda x: [torch.ops.mkldnn._linear_pointwise(x, p, None, "none", [], "") for p in onednn]
        out["onednn, plain weight"] = lambda x: [torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], "")
                                                 for w in weights]
        out["onednn, column-major"] = lambda x: [torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], "")
                                                 for w in column_major]
    except (AttributeError, RuntimeError):
        out["onednn packed"] = out["onednn, plain weight"] = out["onednn, column-major"] = None
    out["llama_kv.f32_linear"] = ((lambda x: [torch.ops.llama_kv.f32_linear(x, w) for w in weights])
                                  if llama_kernels.load() else None)
    return out


def median_seconds(fn: Callable, x: torch.Tensor, repeats: int) -> float:
    for _ in range(3):
        fn(x)
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn(x)
        times.append(time.perf_counter() - t)
    return statistics.median(times)


@torch.inference_mode()
def main(threads: int = 2, repeats: int = 20, rows: int = 1):
    torch.set_num_threads(threads)
    torch.manual_seed(0)
    print(f"torch {torch.__version__}, {threads} threads, float32, {rows} row(s); median of {repeats} passes")
    step: Dict[str, float] = {}
    names = None
    for shape_name, ((n_out, n_in), count) in SHAPES.items():
        weights = [torch.randn(n_out, n_in) * 0.02 for _ in range(count)]
        x = torch.randn(rows, n_in)
        kernels = candidates(weights, rows)
        names = names or list(kernels)
        reference = F.linear(x, weights[-1])
        cells = []
        for name, fn in kernels.items():
            if fn is None:
                cells.append(f"{name}: n/a")
                step[name] = float("nan")
                continue
            error = (fn(x)[-1] - reference).abs().max().item()
            s = median_seconds(fn, x, repeats)
            step[name] = step.get(name, 0.0) + s
            cells.append(f"{name}: {s / count * 1e6:8.1f} us {weights[0].nbytes * count / s / 1e9:5.1f} GB/s "
                         f"(max diff {error:.1e})")
        del kernels
        print(f"{shape_name:>7} {n_out}x{n_in} (x{count}):\n    " + "\n    ".join(cells), flush=True)
    step_name = "decode step" if rows == 1 else f"one step of {rows} rows"
    print(f"{step_name}, products only: " + ", ".join(f"{n} {step[n] * 1e3:.1f} ms" for n in names))


if __name__ == "__main__":
    fire.Fire(main)
