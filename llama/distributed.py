"""Where the model runs: device and dtype choice, and (under torchrun) the process group."""

from typing import Optional, Union

import torch

from llama.errors import LlamaError

_DTYPES = {
    "float32": torch.float32, "fp32": torch.float32, "float": torch.float32,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "float16": torch.float16, "fp16": torch.float16, "half": torch.float16,
}


def resolve_device(device: Optional[Union[str, torch.device]] = None) -> torch.device:
    """`device`, checked to exist; None picks CUDA when present, else the CPU."""
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(device)
    except (RuntimeError, TypeError):
        raise LlamaError(f"unknown device {device!r}; use cpu, cuda or cuda:N") from None
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
