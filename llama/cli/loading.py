"""Loading the model the way every command does: flags in, a ready Llama out."""

import os
import sys
from pathlib import Path
from typing import Optional

from llama.cli.common import as_flags
from llama.cli.progress import ProgressPrinter
from llama.download import default_model_dir
from llama.generation import Llama
from llama.progress import Progress


def default_ckpt_dir() -> str:
    """The default model's checkpoint directory, fetched and converted on first use (progress on stderr)."""
    return str(default_model_dir(fetch=True, progress=ProgressPrinter(prefix="llama-download: ")))


def build_from_flags(ckpt_dir: Optional[str], tokenizer_path: Optional[str], max_seq_len: int, max_batch_size: int,
                     seed: int, device: Optional[str], dtype: Optional[str], compile: bool = False,
                     quantize: Optional[str] = None, quant_kernels: str = "integer") -> Llama:
    if compile:
        print("compiling the decode step (--compile): one to two minutes the first time, seconds once Inductor "
              "has it cached on disk", file=sys.stderr, flush=True)
    llama = Llama.build(
        ckpt_dir=str(ckpt_dir) if ckpt_dir is not None else default_ckpt_dir(),
        tokenizer_path=str(tokenizer_path) if tokenizer_path is not None else None,
        max_seq_len=max_seq_len,
        max_batch_size=max_batch_size,
        seed=seed,
        device=device,
        dtype=dtype,
        compile=compile,
        quantize=quantize,
        quant_kernels=str(quant_kernels),
        # Under torchrun every rank loads alike: rank 0's reports stand for all.
        progress=_progress(ckpt_dir) if os.environ.get("RANK", "0") == "0" else None,
    )
    if is_main_rank(llama):  # every rank loads alike; one copy of each note is enough
        for note in llama.info.notes:
            print(f"note: {as_flags(note)}", file=sys.stderr, flush=True)
    return llama


def _progress(ckpt_dir: Optional[str]) -> Progress:
    """The loading bar for big checkpoints only; a first build of the integer kernels always says so."""
    printer, big = ProgressPrinter(), _is_big(ckpt_dir)

    def report(what: str, done: int, total: int) -> None:
        if big or what != "loading weights":
            printer(what, done, total)

    return report


def _is_big(ckpt_dir: Optional[str]) -> bool:
    """Whether loading takes long enough (over a GB of weights) to be worth a progress bar."""
    if ckpt_dir is None:
        return False
    return sum(p.stat().st_size for p in Path(ckpt_dir).glob("consolidated.*.pth")) > 2**30


def is_main_rank(llama: Llama) -> bool:
    """Under torchrun every rank computes the same tokens; only rank 0 prints them."""
    return llama.info.rank == 0
