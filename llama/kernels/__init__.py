"""CPU kernels for x86: integer dot products for int8 and int4 weights, float32 products of a few rows: ops of
a small C++ extension built at first use.

`load()` builds (once per version, torch and CPU; llama/kernels/build.py) and loads the extension, whose ops
live in `torch.ops.llama_kv` and are registered with fake implementations here, so `torch.compile` traces
them as it does torch's own. The layer classes that call them are in llama/quant/linears.py; the C++ is under
`csrc/`, one file per job, with the scalar loop every SIMD path must equal in `dot_scalar.cpp`.
`f32_linear` (`f32_rows.cpp`) is the float32 one: a compiled float32 decode step multiplies its few rows with
it (llama.quant.linears.FewRowsLinear), reading each weight row once for all of them; under an int8 KV cache every
float32 product does (RowExactLinear), since each row's outputs are the same bits in any company.

Which instruction path runs is chosen from the CPU's flags when the library loads (the best of AMX, AVX-512 VNNI,
AVX-512 without VNNI, AVX-VNNI, AVX2, scalar; AMX is AVX-512 VNNI with a prompt's int8 products on the tiles, taken
only after one product on them has run in a child process); `LLAMA_KERNEL_PATH` or `options(path=...)` forces one
the CPU has, as the tests do.
"""

import os
from contextlib import contextmanager
from typing import Iterator, List, Optional

import torch

from llama.runtime.progress import Progress

PATHS = ("scalar", "avx2", "avxvnni-emulated", "avxvnni", "avx512", "avx512vnni", "amx")  # in the library's numbering
PATH_ENV = "LLAMA_KERNEL_PATH"
QK = 32  # values per block, of activations and weights
ROWS = 8  # int8 weight rows interleaved in a group
Q4_ROWS = 16  # int4 weight rows interleaved in a unit

_state = {"loaded": False, "reason": None}


def load(progress: Optional[Progress] = None) -> bool:
    """Build (first time only) and load the kernels; False if they cannot be had here (`unavailable_reason` says why).

    Args:
        progress: told ("building the CPU kernels ...", 0, 1) and (..., 1, 1) around a build.
    """
    if _state["loaded"] or _state["reason"] is not None:
        return _state["loaded"]
    from llama.kernels.build import Unavailable, build_and_load

    try:
        build_and_load(progress)
    except Unavailable as e:
        _state["reason"] = str(e)
        return False
    _register_fakes()
    _state["loaded"] = True
    forced = os.environ.get(PATH_ENV)
    if forced:
        set_options(path=forced)
    return True


def loaded() -> bool:
    """Whether the kernels are loaded in this process (never builds or loads them)."""
    return _state["loaded"]


def available() -> bool:
    """Whether the kernels are loaded, loading (and if need be building) them at the first call."""
    return load()


def unavailable_reason() -> Optional[str]:
    """Why the kernels cannot run here, in a few words; None if they can (or have not been tried)."""
    return _state["reason"]


def cpu_paths() -> List[str]:
    """The instruction paths this CPU runs, from the plainest up (the emulated VNNI path is for tests)."""
    return [PATHS[p] for p in torch.ops.llama_kv.cpu_paths()]


def best_path() -> str:
    return [p for p in cpu_paths() if p != "avxvnni-emulated"][-1]


def set_options(path: Optional[str] = None, gemm_min_rows: Optional[int] = None) -> dict:
    """Force an instruction path (None: the CPU's best) and the row count from which products dequantize and
    call torch's GEMM; returns the options before."""
    if path is not None and path not in PATHS:
        raise ValueError(f"unknown kernel path {path!r}; choose one of {', '.join(PATHS)}")
    old_path, old_rows = torch.ops.llama_kv.get_options()
    torch.ops.llama_kv.set_options(-1 if path is None else PATHS.index(path), gemm_min_rows or old_rows)
    return {"path": None if old_path < 0 else PATHS[old_path], "gemm_min_rows": old_rows}


@contextmanager
def options(path: Optional[str] = None, gemm_min_rows: Optional[int] = None) -> Iterator[None]:
    """`set_options` for the duration of a `with` block (tests force each path this way)."""
    old = set_options(path, gemm_min_rows)
    try:
        yield
    finally:
        set_options(**old)


# The C entry points the library gives code compiled ahead of time (the ends of csrc/ops.cpp and attention.cpp),
# as AOTInductor declares them: tensors by handle, an optional one by pointer to a handle, the result last.
_C_SHIMS = {
    "q8_0_linear": "AtenTensorHandle, AtenTensorHandle, AtenTensorHandle, int64_t, AtenTensorHandle*",
    "q8_16_linear": "AtenTensorHandle, AtenTensorHandle, AtenTensorHandle, int64_t, AtenTensorHandle*",
    "q4_0_linear": "AtenTensorHandle, AtenTensorHandle, int64_t, AtenTensorHandle*",
    "q4_1_linear": "AtenTensorHandle, AtenTensorHandle, int64_t, AtenTensorHandle*",
    "f32_linear": "AtenTensorHandle, AtenTensorHandle, AtenTensorHandle*",
    "attention": "AtenTensorHandle, AtenTensorHandle, AtenTensorHandle, AtenTensorHandle*, AtenTensorHandle*",
    "rms_norm": "AtenTensorHandle, AtenTensorHandle, double, AtenTensorHandle*",
}


def c_shims() -> dict:
    """For `torch._inductor.config.aot_inductor.custom_ops_to_c_shims`: the loaded ops whose calls a compiled step
    may make directly (about 3 us a call less than through the dispatcher); empty if the kernels are not loaded."""
    if not loaded():
        return {}
    return {getattr(torch.ops.llama_kv, name).default: [f"AOTITorchError aoti_torch_cpu_{name}({args})"]
            for name, args in _C_SHIMS.items()}


def _register_fakes() -> None:
    """Shapes and dtypes of each op's results without computing them, for torch.compile's tracing."""
    lib = "llama_kv::"

    @torch.library.register_fake(lib + "q8_0_linear")
    def _(x, weight, scales, out_features):
        return x.new_empty((*x.shape[:-1], out_features))

    @torch.library.register_fake(lib + "q8_16_linear")
    def _(x, weight, scales, out_features):
        return x.new_empty((*x.shape[:-1], out_features))

    @torch.library.register_fake(lib + "q4_0_linear")
    def _(x, weight, out_features):
        return x.new_empty((*x.shape[:-1], out_features))

    @torch.library.register_fake(lib + "q4_1_linear")
    def _(x, weight, out_features):
        return x.new_empty((*x.shape[:-1], out_features))

    @torch.library.register_fake(lib + "f32_linear")
    def _(x, weight):
        return x.new_empty((*x.shape[:-1], weight.shape[0]))

    @torch.library.register_fake(lib + "attention")
    def _(q, k, v, mask):
        return torch.empty_like(q, memory_format=torch.contiguous_format)

    @torch.library.register_fake(lib + "rms_norm")
    def _(x, weight, eps):
        return torch.empty_like(x, memory_format=torch.contiguous_format)

    @torch.library.register_fake(lib + "quantize_activations")
    def _(x):
        rows, k = x.shape[:-1].numel(), x.shape[-1]
        return (x.new_empty((rows, k), dtype=torch.int8), x.new_empty((rows, k // QK), dtype=torch.float32),
                x.new_empty((rows, k // QK), dtype=torch.int32))

    @torch.library.register_fake(lib + "dequantize_q8_0")
    def _(weight, scales, out_features):
        return weight.new_empty((out_features, weight.shape[1] * QK), dtype=torch.float32)

    @torch.library.register_fake(lib + "dequantize_q8_16")
    def _(weight, scales, out_features):
        return weight.new_empty((out_features, weight.shape[1] * QK), dtype=torch.float32)

    @torch.library.register_fake(lib + "dequantize_q4_0")
    def _(weight, out_features):
        return weight.new_empty((out_features, weight.shape[1] * QK), dtype=torch.float32)

    @torch.library.register_fake(lib + "dequantize_q4_1")
    def _(weight, out_features):
        return weight.new_empty((out_features, weight.shape[1] * QK), dtype=torch.float32)
