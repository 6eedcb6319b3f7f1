"""Rendering progress reports on stderr: a bar redrawn in place on a terminal, a line now and then otherwise."""

import sys
import time
from typing import Optional, TextIO


def _duration(seconds: float) -> str:
    seconds = int(seconds + 0.5)
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}" if seconds >= 3600 else f"{seconds // 60}:{seconds % 60:02d}"


class ProgressPrinter:
    """A `llama.runtime.progress.Progress` callback that shows percentage, elapsed time and an ETA.

    Args:
        stream: where to write (stderr by default).
        prefix: put before every line, e.g. the command's name.
        every: without a terminal, the fraction of the work between two printed lines.
    """

    def __init__(self, stream: Optional[TextIO] = None, prefix: str = "", every: float = 0.1):
        self.stream = stream if stream is not None else sys.stderr
        self.prefix = prefix
        self.every = every
        self.tty = self.stream.isatty()
        self._what: Optional[str] = None
        self._start = 0.0
        self._next = 0.0
        self._drawn = False

    def __call__(self, what: str, done: int, total: int) -> None:
        now = time.monotonic()
        if what != self._what:
            self._end_line()
            self._what, self._start, self._next = what, now, 0.0
        fraction = min(done / total, 1.0) if total > 0 else 0.0
        elapsed = now - self._start
        eta = f", {_duration(elapsed * (1 - fraction) / fraction)} left" if 0 < fraction < 1 and elapsed > 1 else ""
        if self.tty:
            width = 30
            bar = "#" * int(width * fraction) + "." * (width - int(width * fraction))
            self.stream.write(f"\r{self.prefix}{what} [{bar}] {100 * fraction:3.0f}% {_duration(elapsed)}{eta} ")
            self._drawn = True
            if fraction >= 1:
                self._end_line()
        elif fraction >= self._next or fraction >= 1:
            self.stream.write(f"{self.prefix}{what}: {100 * fraction:.0f}% after {_duration(elapsed)}{eta}\n")
            self._next = fraction + self.every if fraction < 1 else float("inf")
        self.stream.flush()

    def _end_line(self) -> None:
        if self._drawn:
            self.stream.write("\n")
            self._drawn = False
