"""The server split across torchrun's processes: rank 0 serves and schedules, and every rank runs each step.

Under `torchrun --nproc_per_node N --no-python llama-server ...` the model is split as every command splits it
(llama/nn/parallel.py): each rank holds a slice of the weights and of the KV cache's heads, and every step's
collectives need all ranks in it. Rank 0 alone listens, schedules and samples. Before each step it sends the
step (the block copies, and each row's tokens, first position, block table and which logits it needs) to
the other ranks, which run the same step on their slices and wait for the next one. Sampling stays on rank
0, so the other ranks need no generators and no request ever reaches them.

The steps travel over a gloo group of their own whose timeout outlasts any idle spell: a server can wait
hours for its next request, and a collective's default timeout (30 minutes) would end it. A rank that
fails takes the server down: its peers' next collective fails at once (its sockets close with it), and rank
0 stops with one line saying why, rather than serving errors or waiting for a step that never comes.
"""

import datetime
import re
import signal
from typing import Callable, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from llama.errors import LlamaError
from llama.server.runner import Result, Row, Runner

# How long a rank waits for the next step. Idle is normal for a server; a dead peer fails a collective at once.
IDLE_TIMEOUT = datetime.timedelta(days=365)
_STOP = "stop"

Copies = Sequence[Tuple[int, int, int]]


class RankLost(LlamaError):
    """Another rank failed or left: this process group cannot run a step any more."""


def step_group() -> "dist.ProcessGroup":
    """The group the steps travel in; every rank must call this, in the same order as its other collectives."""
    return dist.new_group(backend="gloo", timeout=IDLE_TIMEOUT)


class LeaderRunner:
    """Rank 0's runner: each step goes to the other ranks, then runs here, on this rank's slice.

    Args:
        runner: this rank's runner.
        group: from `step_group`.
        on_lost: told why when another rank is gone; it should end the process (the group cannot recover).
    """

    def __init__(self, runner: Runner, group, on_lost: Callable[[str], None]):
        self.runner, self.group, self.on_lost = runner, group, on_lost
        self.world_size = dist.get_world_size()
        self.closed = False

    # What the engine reads of a runner.
    @property
    def model(self):
        return self.runner.model

    @property
    def device(self) -> torch.device:
        return self.runner.device

    @property
    def cache(self):
        return self.runner.cache

    def step(self, copies: Copies, rows: Sequence[Row]) -> List[Result]:
        """Send the step to every rank, then run it here (see `Runner.step`).

        Raises:
            LlamaError: the model produced NaN or infinite logits (every rank has finished the step by then).
        """
        # Sampling happens here only: the others get each row without its sampler (nor its generator).
        plain = [Row(r.tokens, r.start, r.blocks, r.scored, 0, None, r.draft) for r in rows]
        self._send((list(copies), plain))
        try:
            return self.runner.step(copies, rows)
        except LlamaError:
            raise  # raised after the step's last collective: the ranks are still in step
        except Exception as e:  # a collective failed, or the ranks are no longer in step: nothing can go on
            self._lost(f"a step failed under torchrun ({type(e).__name__}: {_first_line(e)})")
            raise RankLost(str(e)) from e

    def close(self) -> None:
        """Tell the other ranks to exit (once the engine has stopped)."""
        if not self.closed:
            self.closed = True
            self._send(_STOP)

    def _send(self, message) -> None:
        try:
            dist.broadcast_object_list([message], src=0, group=self.group)
        except Exception as e:
            self._lost(f"could not reach the other ranks ({type(e).__name__}: {_first_line(e)})")
            raise RankLost(str(e)) from e

    def _lost(self, what: str) -> None:
        self.closed = True  # no stop message can reach them any more
        self.on_lost(f"{what}: a rank of the {self.world_size} has stopped, and the model cannot run without "
                     "its slice; the server stops")


def follow(runner: Runner, group) -> None:
    """On ranks other than 0: run every step rank 0 sends, until it says stop.

    Ctrl-C and SIGTERM are ignored here: rank 0 takes them, lets the requests in flight finish, then
    says stop; torchrun ends a rank that outlives that. A rank 0 that dies fails the wait for the next
    step at once, and the exception ends this process too.
    """
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)
    while True:
        message = _receive(group)
        if message == _STOP:
            return
        copies, rows = message
        runner.step(copies, rows)


def _receive(group) -> Optional[object]:
    box = [None]
    try:
        dist.broadcast_object_list(box, src=0, group=group)
    except Exception as e:
        raise RankLost(f"rank 0 stopped answering ({type(e).__name__}: {_first_line(e)}); this rank stops too") from e
    return box[0]


def _first_line(e: Exception) -> str:
    """The gist of a collective's failure: gloo's first sentence, without the source location it starts with."""
    text = str(e).strip()
    if not text:
        return type(e).__name__
    return re.sub(r"^\[[^\]]*\]\s*", "", text.splitlines()[0]).split(". ")[0]
