"""Progress of long work (downloads, conversions, quantizing while loading), told through a callback.

Library code never prints: it calls `progress(what, done, total)` as it goes, and the command-line layer
renders those calls (`llama.cli.printer.ProgressPrinter`: a bar on a terminal, plain lines otherwise).
`done` and `total` are in any unit the caller likes (bytes, tensors); `total` 0 means unknown.
"""

from contextlib import contextmanager
from typing import Callable, Iterator, Optional

Progress = Callable[[str, int, int], None]


def no_progress(what: str, done: int, total: int) -> None:
    """The callback for callers who want no reports."""


def or_silent(progress: Optional[Progress]) -> Progress:
    return progress if progress is not None else no_progress


@contextmanager
def step(progress: Progress, what: str) -> Iterator[None]:
    """Report work that cannot be measured as it goes: (what, 0, 1) before it, (what, 1, 1) once it is done."""
    progress(what, 0, 1)
    yield
    progress(what, 1, 1)
