"""The threads of a decode step, chosen by whether they get their cores.

A decode step is a few hundred short parallel regions, and each waits for every thread of the team. On a machine
whose cores other work keeps busy, a thread the scheduler has taken away holds up every region until it runs again:
two threads then decode many times slower than one (docs/benchmarks.md, "On a busy machine"). `StepThreads` times
the steps and moves the thread count: down when the threads do not get their cores (the process's CPU time over
the steps' wall time falls short of the thread count), back up when the machine has a core idle again.

It changes speed only where no result depends on the thread count: the CPU kernels' products, attention and norms
compute each row in one fixed order whatever the threads (llama/kernels), so the plan turns it on only where they
carry the step (`RunPlan.adapt_threads`; tests/test_switch_exact.py checks that the tokens and log-probabilities
stay the same bits). Linux only (the idle cores come from /proc/stat); elsewhere the thread count stays as set.
"""

import os
from collections import Counter
from time import perf_counter, process_time
from typing import Callable, List, Optional

import torch

WINDOW_S = 0.2  # the steps' wall time a decision waits for; one slow step is enough
SHARE = 0.85  # below this share of a core a thread, on average, the threads are not getting their cores
IDLE = 0.7  # cores' worth of idle time that lets one more thread run
MOST_WAIT_S = 8.0  # the longest wait before trying more threads again after a try that failed


def idle_seconds(stat: str = "/proc/stat") -> Optional[float]:
    """Idle seconds so far of the CPUs this process may run on, summed; None where /proc/stat cannot be read."""
    try:
        cpus = {f"cpu{c}" for c in os.sched_getaffinity(0)}
        with open(stat) as f:
            lines = [line.split() for line in f if line.startswith("cpu")]
        ticks = sum(int(fields[4]) + int(fields[5]) for fields in lines if fields[0] in cpus)  # idle + iowait
        return ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, AttributeError, ValueError, IndexError):
        return None


def choose_threads(now: int, most: int, wall: float, cpu: float, idle: float) -> int:
    """The thread count for the next steps, from the last ones': `now` threads ran for `wall` seconds, the process
    used `cpu` seconds of CPU, and the cores it may use were idle for `idle` seconds in all."""
    got = cpu / wall  # cores' worth this process got
    if now > 1 and got < SHARE * now:
        return max(1, min(now - 1, int(got)))
    if now < most and idle / wall >= IDLE:
        return min(most, now + max(1, int(idle / wall + 1 - IDLE)))
    return now


class StepThreads:
    """Times decode steps (`with threads:` around each) and sets torch's thread count between them, never above
    the count torch had when the decode's first step began; `close()` after the decode puts that count back. The
    count it settles on is kept for the next decode, so that a busy machine does not cost a slow window a call."""

    def __init__(self, idle: Callable[[], Optional[float]] = idle_seconds):
        self._idle = idle
        self.most = torch.get_num_threads()
        self.now = self.most
        self.changes: List[int] = []  # every count set, in order
        self.last = Counter()  # the last decode's steps by their thread count
        self._wait_s = WINDOW_S  # wall time before more threads are tried again
        self._since_drop = 0.0
        self._raised = False
        self._decoding = False

    @property
    def works(self) -> bool:
        """Whether idle cores can be read here (Linux): without them a lowered count could never come back up."""
        return self._idle() is not None

    def describe(self) -> str:
        """The last decode's threads: "2", or "2; 1 for 37 of 64 steps, the cores being busy"."""
        fewer = sum(n for threads, n in self.last.items() if threads < self.most)
        if not fewer:
            return str(self.most)
        counts = ", ".join(f"{threads} for {n}" for threads, n in sorted(self.last.items()) if threads < self.most)
        return f"{self.most}; {counts} of {sum(self.last.values())} steps, the cores being busy"

    def close(self) -> None:
        """After a decode: torch's thread count as it was before its first step."""
        if self._decoding:
            self._decoding = False
            if torch.get_num_threads() != self.most:
                torch.set_num_threads(self.most)

    def __enter__(self) -> "StepThreads":
        if not self._decoding:  # a decode's first step: the count settled on before, from a new window
            self._decoding = True
            if torch.get_num_threads() != self.most:  # the caller set another count since: start from it
                self.most = self.now = torch.get_num_threads()
            self._set(self.now)
            self._begin_window()
            self.last = Counter()
        self.last[self.now] += 1
        self._t0, self._c0 = perf_counter(), process_time()
        return self

    def __exit__(self, *exc) -> None:
        self._wall += perf_counter() - self._t0
        self._cpu += process_time() - self._c0
        if self._wall >= WINDOW_S:
            self._decide()

    def _begin_window(self) -> None:
        self._wall = self._cpu = 0.0
        self._idle0 = self._idle() if self.now < self.most else None
        self._clock0 = perf_counter()

    def _decide(self) -> None:
        idle = 0.0
        if self._idle0 is not None:
            idle1 = self._idle()
            # Idle over the window's whole time, prorated to the steps' part of it.
            span = perf_counter() - self._clock0
            idle = 0.0 if idle1 is None or span <= 0 else (idle1 - self._idle0) * self._wall / span
        if self.now < self.most:
            self._since_drop += self._wall
            if self._since_drop < self._wait_s:
                idle = 0.0  # not yet: the last try at more threads failed
        chosen = choose_threads(self.now, self.most, self._wall, self._cpu, idle)
        if chosen < self.now:
            # More threads right after a try at them did not get their cores: wait longer before the next try.
            self._wait_s = min(MOST_WAIT_S, self._wait_s * 2) if self._raised else WINDOW_S
            self._since_drop = 0.0
            self._raised = False
        elif chosen > self.now:
            self._raised = True
        else:
            self._raised = False
        self._set(chosen)
        self._begin_window()

    def _set(self, n: int) -> None:
        if n != torch.get_num_threads():
            torch.set_num_threads(n)
            self.changes.append(n)
        self.now = n


def describe_threads(threads: Optional[StepThreads]) -> str:
    """The last decode's threads, as `StepThreads.describe` says them, or torch's count where nothing moved it."""
    return threads.describe() if threads is not None else str(torch.get_num_threads())
