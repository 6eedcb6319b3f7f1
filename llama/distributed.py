"""Where the model runs: device and dtype choice, and (under torchrun) the process group.

Under torchrun, as with Meta's reference, every rank computes the same text and only rank 0 prints it:
joining the group sends the stdout of ranks other than 0 to /dev/null, so a script written for Meta's
`Llama.build` prints each completion once. Set LLAMA_PRINT_ALL_RANKS=1 to keep every rank's stdout.
stderr is never touched, so errors reach the user from any rank. The group joined here is destroyed at
exit, so torch has no undestroyed group to warn about.
"""

import atexit
import datetime
import os
import sys
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


def init_distributed(device: torch.device, model_parallel_size: Optional[int] = None) -> "tuple[int, int]":
    """Join the torchrun process group if there is one; returns (rank, world_size).

    Under torchrun (WORLD_SIZE set) the group uses NCCL on CUDA and gloo on the CPU, and each rank takes
    the GPU of its LOCAL_RANK; ranks other than 0 then print nothing to stdout unless LLAMA_PRINT_ALL_RANKS=1
    (see the module's docstring). Outside torchrun this is a single process: (0, 1).
    """
    import torch.distributed as dist

    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if model_parallel_size not in (None, world_size):
        raise LlamaError(
            f"model_parallel_size {model_parallel_size} does not match the {world_size} process(es) started; "
            f"run with torchrun --nproc_per_node {model_parallel_size}"
        )
    if world_size == 1:
        return 0, 1
    if not dist.is_initialized():
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
        atexit.register(_destroy_process_group)  # only a group joined here: one the caller made is theirs
    rank = dist.get_rank()
    quiet_other_ranks(rank)
    return rank, dist.get_world_size()


PRINT_ALL_RANKS = "LLAMA_PRINT_ALL_RANKS"


def quiet_other_ranks(rank: int) -> None:
    """Send this process's stdout to /dev/null unless it is rank 0 or LLAMA_PRINT_ALL_RANKS=1 is set."""
    if rank == 0 or os.environ.get(PRINT_ALL_RANKS) == "1" or getattr(sys.stdout, "name", None) == os.devnull:
        return
    sys.stdout.flush()
    sys.stdout = open(os.devnull, "w")


# How long a rank waits at exit for the others before tearing its group down anyway.
EXIT_BARRIER_TIMEOUT = datetime.timedelta(seconds=60)


def _destroy_process_group() -> None:
    """At exit: wait until every rank is here, then destroy the group.

    Without the barrier a rank that finishes first closes its connections while a slower rank may still
    be receiving the last collective or tearing its own group down; under load that can abort the slower
    rank at exit. gloo's monitored barrier gives up after a timeout, so a rank that died cannot hang exit.
    """
    import torch.distributed as dist

    if not dist.is_initialized():
        return
    try:
        if dist.get_backend() == "gloo":
            dist.monitored_barrier(timeout=EXIT_BARRIER_TIMEOUT)
        else:
            dist.barrier()
    except RuntimeError:
        pass  # a peer is gone (torchrun reports its failure): tear down this rank's side regardless
    dist.destroy_process_group()


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
            "use a smaller dtype (--dtype bfloat16), more model-parallel processes, or another device"
        )
