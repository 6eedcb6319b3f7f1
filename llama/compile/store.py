"""Where the compiled steps' packages are stored and what names each: its directory, the key of all its code
depends on, its loader, and whether this torch can run one."""

import functools
import hashlib
import json
import os
import shutil
import tempfile
from dataclasses import asdict
from pathlib import Path
from typing import Dict, Optional

import torch

from llama.model import Transformer
from llama.runtime.paths import home_dir

DIR_ENV = "LLAMA_COMPILED_DIR"
FORMAT = 1  # of the entries: a new one makes every older entry a stranger, built anew
PACKAGE = "step.pt2"
META = "meta.json"
_SOURCES = Path(__file__).resolve().parents[1]  # the whole llama package


def compiled_dir() -> Path:
    """Where packages live: $LLAMA_COMPILED_DIR if set (the tests keep theirs apart so), else $LLAMA_HOME/compiled."""
    return Path(os.environ[DIR_ENV]).expanduser() if os.environ.get(DIR_ENV) else home_dir() / "compiled"


@functools.lru_cache(maxsize=None)  # the sources do not change under a running process
def _sources_digest() -> str:
    h = hashlib.sha256()
    for path in sorted(_SOURCES.rglob("*")):
        if path.suffix in (".py", ".cpp", ".h", ".inc") and "__pycache__" not in path.parts:
            h.update(str(path.relative_to(_SOURCES)).encode() + b"\0" + path.read_bytes())
    return h.hexdigest()[:16]


def describe_key(model: Transformer, batch_size: object, kind: str = "decode",
                 extra: Optional[Dict[str, object]] = None, kv_dtype: Optional[torch.dtype] = None) -> Dict[str, object]:
    """What a package of `kind` for `model` at `batch_size` (a size, or a range of sizes) depends on, as the
    fields its metadata records; `extra`: what else the step's code holds as a constant (a block size); `kv_dtype`:
    what the caches it takes hold (default: the model's `kv_cache_dtype`), since an int8 cache's rows are read and
    written as bytes: a package built for another cache would read garbage from it, unchecked."""
    from llama.kernels.build import cpu_key

    params = {k: v for k, v in asdict(model.params).items() if k not in ("max_seq_len", "max_batch_size")}
    tensors = hashlib.sha256()
    for name, module in model.named_modules():
        tensors.update(f"{name}:{type(module).__module__}.{type(module).__qualname__}\n".encode())
        for tname, t in list(module.named_parameters(recurse=False)) + list(module.named_buffers(recurse=False)):
            tensors.update(f"  {tname}:{tuple(t.shape)}:{t.dtype}\n".encode())
    return {
        "format": FORMAT,
        "torch": torch.__version__,
        "device": str(model.device.type),
        "cpu": cpu_key(),  # the vector instructions Inductor chooses from
        "threads": torch.get_num_threads(),
        "dtype": str(model.dtype).removeprefix("torch."),
        "kv_dtype": str(kv_dtype or model.kv_cache_dtype).removeprefix("torch."),
        "kind": kind,
        **(extra or {}),
        "batch_size": batch_size,
        "params": params,
        "modules": tensors.hexdigest()[:16],
        "sources": _sources_digest(),
    }


def _key(fields: Dict[str, object]) -> str:
    return hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()[:16]


def package_dir(fields: Dict[str, object]) -> Path:
    """Where the package whose metadata records `fields` (describe_key's) is stored."""
    return compiled_dir() / _key(fields)


def _torch_version() -> tuple:
    return tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2] if p.isdigit())


# Packages were built, loaded and run on torch 2.13 and 2.14. On torch 2.11 (checked on a GPU machine's CPU) loading
# one crashes the process with a segmentation fault inside torch's loader, its own Python wrapper's too, so older
# torches neither build nor load them: the commands' default runs eagerly there, --compile uses torch.compile.
SUPPORTED = _torch_version() >= (2, 13)
UNSUPPORTED_NOTE = (f"the stored compiled step needs torch 2.13 or newer, and this is {torch.__version__}; the decode "
                    "step runs eagerly, about 3 times slower (compile=False hides this note)")


def used(device: torch.device) -> bool:
    """Whether a compiled decode step on `device` comes from stored packages: on the CPU, where SUPPORTED, unless
    LLAMA_COMPILE_AOT=0 (torch.compile in every process instead, as before the packages: to measure the difference,
    scripts/compare_transformers.py --torch_compile, or to work around a torch bug)."""
    return device.type == "cpu" and os.environ.get("LLAMA_COMPILE_AOT", "1") != "0" and SUPPORTED


def package_loader(package: Path):
    """The package's loader from torch's C++ runtime, without importing Inductor (a second of every start-up)."""
    try:
        loader = torch._C._aoti.AOTIModelPackageLoader(str(package), "model", False, 1, -1)
    except TypeError:  # another torch, another constructor: its Python wrapper knows it
        from torch._inductor.package import load_package

        loader = load_package(str(package)).loader
    _remove_extracted()
    return loader


def _remove_extracted(maps: str = "/proc/self/maps") -> None:
    """Remove the directories the loader extracted its package into (aotinductor_* in the temporary directory,
    4 MB for the default model's step), which torch leaves behind at every load. Only those whose library this
    process has mapped: loaded, so no longer needed on disk (Linux keeps a mapped file until it is unmapped)."""
    try:
        with open(maps) as f:
            paths = {line.split(None, 5)[5].strip() for line in f if line.count(" ") >= 5 and "aotinductor_" in line}
    except OSError:  # not Linux: left as torch leaves them
        return
    temp = Path(tempfile.gettempdir()).resolve()
    for path in map(Path, paths):
        extracted = next((p for p in path.parents if p.parent == temp and p.name.startswith("aotinductor_")), None)
        if extracted is not None:
            shutil.rmtree(extracted, ignore_errors=True)
