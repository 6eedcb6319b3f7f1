"""What every command shares: one-line errors instead of tracebacks, and exit statuses."""

import os
import sys
import traceback
from typing import Callable

import fire

from llama.errors import LlamaError

EXIT_ERROR = 1
EXIT_INTERRUPTED = 130  # 128 + SIGINT, what a shell reports for Ctrl-C


def fail(message: str) -> "NoReturn":  # noqa: F821
    """Print `message` as the command's one-line error and exit non-zero."""
    print(f"error: {message}", file=sys.stderr)
    sys.exit(EXIT_ERROR)


def run(main: Callable, name: str) -> None:
    """Run a fire-based `main`; mistakes become `error: ...` on stderr and exit 1, Ctrl-C exits 130.

    `--debug` anywhere on the command line (or LLAMA_DEBUG=1) shows the full traceback instead.
    """
    debug = "--debug" in sys.argv or os.environ.get("LLAMA_DEBUG") == "1"
    argv = [a for a in sys.argv[1:] if a != "--debug"]
    try:
        fire.Fire(main, command=argv, name=name)
    except KeyboardInterrupt:
        sys.stdout.flush()
        print("\ninterrupted", file=sys.stderr)
        sys.exit(EXIT_INTERRUPTED)
    except (LlamaError, OSError) as e:
        if debug:
            traceback.print_exc()
        message = str(e) if isinstance(e, LlamaError) else f"{e.strerror or e}: {e.filename or ''}".rstrip(": ")
        fail(message)
