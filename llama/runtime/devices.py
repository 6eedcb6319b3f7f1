"""Where the model runs and whether it fits: device and dtype choice, and memory checks.

Library code never names a device or dtype of its own (STYLE.md): the caller's choice, or the defaults
here (CUDA with bf16 when present, else the CPU with float32), are resolved once and passed on.
"""

import os
from typing import Optional, Union

import torch

from llama.errors import LlamaError

_DTYPES = {
    "float32": torch.float32, "fp32": torch.float32, "float": torch.float32,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "float16": torch.float16, "fp16": torch.float16, "half": torch.float16,
}


# The device every command and Llama.build use when none is given (`LLAMA_DEVICE=cpu` keeps a GPU machine's runs
# on the CPU); unset or empty, CUDA when present, else the CPU.
DEVICE_ENV = "LLAMA_DEVICE"


def resolve_device(device: Optional[Union[str, torch.device]] = None) -> torch.device:
    """`device`, checked to exist; None takes $LLAMA_DEVICE, or CUDA when present, else the CPU."""
    if device is None:
        device = os.environ.get(DEVICE_ENV) or None
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(device)
    except (RuntimeError, TypeError):
        where = f" (from {DEVICE_ENV})" if os.environ.get(DEVICE_ENV) == device else ""
        raise LlamaError(f"unknown device {device!r}{where}; use cpu, cuda or cuda:N") from None
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise LlamaError(f"device {device} was asked for, but this machine has no CUDA GPU that torch can use")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise LlamaError(f"device {device} does not exist: this machine has {torch.cuda.device_count()} CUDA GPU(s)")
    elif device.type not in ("cpu", "mps"):
        raise LlamaError(f"device {device} is not supported; use cpu or cuda")
    elif device.type == "mps" and not torch.backends.mps.is_available():
        raise LlamaError("device mps was asked for, but it is not available on this machine")
    return device


def resolve_dtype(dtype: Optional[Union[str, torch.dtype]], device: torch.device) -> torch.dtype:
    """`dtype` by name or value; None picks bf16 on CUDA (fp16 where bf16 is unsupported) and float32 elsewhere."""
    if dtype is None:
        if device.type == "cuda":
            return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
        return torch.float32
    if isinstance(dtype, torch.dtype):
        if dtype not in _DTYPES.values():
            raise LlamaError(f"dtype {dtype} is not supported; use float32, bfloat16 or float16")
        return dtype
    try:
        return _DTYPES[str(dtype).lower()]
    except KeyError:
        raise LlamaError(f"unknown dtype {dtype!r}; use float32, bfloat16 or float16") from None


def local_device(device: torch.device) -> torch.device:
    """Under torchrun each rank takes its own GPU (LOCAL_RANK); the CPU is shared."""
    if device.type == "cuda" and device.index is None and "LOCAL_RANK" in os.environ:
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        torch.cuda.set_device(device)
    return device


def available_memory(device: torch.device) -> Optional[int]:
    """Bytes that could still be allocated on `device`, or None where that cannot be told."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return free
    if device.type == "cpu":
        try:
            with open("/proc/meminfo") as f:
                for line in f:
                    if line.startswith("MemAvailable:"):
                        return int(line.split()[1]) * 1024
        except OSError:
            return None
    return None


def check_fits(n_bytes: int, device: torch.device, what: str) -> None:
    """Raise before loading if `n_bytes` clearly cannot fit on `device`."""
    free = available_memory(device)
    if free is not None and n_bytes > free:
        raise LlamaError(
            f"{what} needs {n_bytes / 2**30:.1f} GiB on {device} but only {free / 2**30:.1f} GiB is available; "
            "use a smaller dtype (dtype=bfloat16), more model-parallel processes, or another device"
        )
