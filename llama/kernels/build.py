"""Building the integer kernels' C++ extension at first use, cached under $LLAMA_HOME by torch version and CPU.

The sources under `csrc/` are compiled once by `torch.utils.cpp_extension.load` (the compiler that
`--compile` already relies on, driven by ninja) into `$LLAMA_HOME/kernels/torch-<version>-<cpu>/` (or
`$LLAMA_KERNELS_DIR/...`); the library's name carries a digest of the sources, so a changed kernel builds
anew and an unchanged one is loaded in milliseconds. Every instruction path is compiled into the one library
with function-level targets, and the CPU's flags choose among them when it runs.
"""

import ctypes
import hashlib
import os
import platform
import shutil
from pathlib import Path
from typing import Optional

import torch

from llama.runtime.paths import home_dir
from llama.runtime.progress import Progress, or_silent, step

CSRC = Path(__file__).resolve().parent / "csrc"
SOURCES = ("ops.cpp", "quantize_act.cpp", "dot_scalar.cpp", "dot_avx2.cpp", "dot_vnni.cpp", "dot_avx512.cpp",
           "dot_amx.cpp", "attention.cpp", "f32_rows.cpp", "norm.cpp", "rotary.cpp")
DIR_ENV = "LLAMA_KERNELS_DIR"
BUILD_NOTE = "building the CPU kernels (int8/int4, and float32 decode products; once, a minute or two)"
# No -std: torch adds the standard its own headers need (C++17 up to torch 2.13, C++20 from 2.14). Hidden symbols:
# loaded RTLD_GLOBAL, the library shows the libraries loaded after it only its C entry points (LLAMA_KV_EXPORT).
FLAGS = ("-O3", "-fopenmp", "-ffp-contract=off", "-fvisibility=hidden", "-fvisibility-inlines-hidden")
# The CPU flags that name the cache directory: the paths the library may take here.
_KEY_FLAGS = ("avx2", "fma", "f16c", "avx_vnni", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "amx_tile", "amx_int8")


class Unavailable(Exception):
    """The kernels cannot be built or loaded here; the message says what is missing, in a few words."""


def missing_compiler() -> Optional[str]:
    """Why no C++ compiler can be run here ($CXX, else c++), in a few words; None where one can."""
    compiler = os.environ.get("CXX", "c++")
    return f"no C++ compiler was found ({compiler}; set CXX to name one)" if shutil.which(compiler) is None else None


def missing() -> Optional[str]:
    """What this machine lacks to build the kernels (an x86 CPU, a C++ compiler, ninja), or None."""
    machine = platform.machine().lower()
    if machine not in ("x86_64", "amd64"):
        return f"they are written for x86 CPUs, and this one is {machine or 'unknown'}"
    reason = missing_compiler()
    if reason:
        return reason
    from torch.utils.cpp_extension import is_ninja_available

    if not is_ninja_available():
        return "ninja, which builds them, is not installed (pip install ninja)"
    return None


def cpu_key() -> str:
    """The machine and its SIMD flags that matter here, e.g. "x86_64-avx2-f16c-fma"."""
    flags = set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                flags = set(line.split(":", 1)[1].split())
                break
    except OSError:
        pass
    return "-".join([platform.machine().lower()] + sorted(flags & set(_KEY_FLAGS)))


def source_digest() -> str:
    h = hashlib.sha256(" ".join(FLAGS).encode())
    for path in sorted(CSRC.iterdir()):
        h.update(path.name.encode() + b"\0" + path.read_bytes())
    return h.hexdigest()[:12]


def build_dir() -> Path:
    """Where this torch on this CPU keeps its builds: under $LLAMA_KERNELS_DIR if set (the tests keep theirs
    apart so), else under $LLAMA_HOME/kernels."""
    base = Path(os.environ[DIR_ENV]).expanduser() if os.environ.get(DIR_ENV) else home_dir() / "kernels"
    return base / f"torch-{torch.__version__}-{cpu_key()}"


def build_and_load(progress: Optional[Progress] = None) -> Path:
    """Build the library if this version of the sources has not been built here, and load its ops into torch.

    Returns:
        the library's path.

    Raises:
        Unavailable: no x86 CPU, compiler or ninja, or the build failed (with its first error line).
    """
    name = f"llama_kv_kernels_{source_digest()}"
    directory = build_dir()
    library = directory / f"{name}.so"
    if not library.exists():  # loading a built one needs no compiler (nor cpp_extension's imports: 0.07 s)
        reason = missing()
        if reason:
            raise Unavailable(reason)
        from torch.utils.cpp_extension import load

        directory.mkdir(parents=True, exist_ok=True)
        try:
            with step(or_silent(progress), BUILD_NOTE):
                load(name, [str(CSRC / s) for s in SOURCES], extra_cflags=list(FLAGS), extra_ldflags=["-fopenmp"],
                     build_directory=str(directory), is_python_module=False, verbose=False)
        except Exception as e:  # a compiler's failure comes as RuntimeError, CalledProcessError, OSError ...
            lines = [line for line in str(e).splitlines() if "error" in line.lower()] or str(e).splitlines() or [type(e).__name__]
            raise Unavailable(f"their C++ build failed ({lines[0].strip()[:200]})") from e
    _export_symbols(library)
    torch.ops.load_library(str(library))
    return library


def _export_symbols(library: Path) -> None:
    """Make the library's C entry points (aoti_torch_cpu_<op>) visible to the compiled steps loaded after it."""
    ctypes.CDLL(str(library), mode=os.RTLD_NOW | os.RTLD_GLOBAL)
