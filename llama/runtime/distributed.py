"""torchrun's process group: joining it, quieting the stdout of ranks other than 0, and leaving it at exit.

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
from typing import Optional

import torch

from llama.errors import LlamaError

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


def launched_rank() -> int:
    """This process's rank as torchrun started it ($RANK), known before any group is joined; 0 outside torchrun."""
    return int(os.environ.get("RANK", "0"))


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
