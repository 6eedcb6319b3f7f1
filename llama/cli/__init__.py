"""The command-line tools. Only this layer prints or exits.

A script of your own behaves as the commands do with the two calls below, which the example scripts use:

    from llama.cli import build, run

    def main(ckpt_dir: str = None, model: str = None, max_seq_len: int = 128):
        generator = build(ckpt_dir=ckpt_dir, model=model, max_seq_len=max_seq_len)
        ...

    if __name__ == "__main__":
        run(main)
"""

import sys
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Optional

if TYPE_CHECKING:
    from llama.generation import Llama


def build(ckpt_dir: Optional[str] = None, model: Optional[str] = None, **kwargs) -> "Llama":
    """`Llama.build(ckpt_dir, **kwargs)` as every command loads: the default model where neither `ckpt_dir` nor
    `model` (llama.cpp's name for it, -m) is given, a .gguf file or Hugging Face folder converted first (saying so),
    a progress bar for big checkpoints, and the load's notes on stderr, once under torchrun.

    Raises:
        SystemExit: `ckpt_dir` and `model` name different models (one line on stderr).
        LlamaError: as `Llama.build`; `run` prints it as one line.
    """
    from llama.cli.flags import model_flag
    from llama.cli.loading import build_from_flags
    from llama.run_plan import ModelFlags

    return build_from_flags(ModelFlags(ckpt_dir=model_flag(ckpt_dir, model), **kwargs))


def run(main: Callable, name: Optional[str] = None) -> None:
    """Run a fire-based `main` as the commands run theirs, then exit: -m for --model where `main` takes `model`,
    a mistake (a `LlamaError`, a missing file) one `error: ...` line on stderr and exit status 1 (`--debug` shows the
    traceback), Ctrl-C exit status 130, and a compiled step still being built stored first. `name`: the program's
    name in --help (default: the script's file name)."""
    from llama.cli.common import run as run_command

    run_command(main, name or Path(sys.argv[0]).name)
