"""Write a random-weight checkpoint in Meta's exact layout, for tests, demos and benchmarks.

    python scripts/write_random_checkpoint.py /tmp/tiny --size tiny
    python scripts/write_random_checkpoint.py /tmp/llama7b --size 7B --dtype bfloat16
    python scripts/write_random_checkpoint.py /tmp/small --size 7B --n_layers 4 --shards 2

`--size` picks Meta's params.json for 7B, 13B or 70B (or `tiny`); any params.json field given as a flag
overrides it. The tokenizer (default: tokenizer.model.example) is copied in and sets the vocabulary
size wherever params.json says -1. `--shards` defaults to Meta's count for the size (7B 1, 13B 2, 70B 8).
The weights are drawn and written one tensor at a time, so even 70B needs about 1 GB of memory.
"""

from pathlib import Path
from typing import Optional

import fire

from llama.io.checkpoint import expected_shapes, model_args
from llama.io.random_weights import PRESETS, write_random_weights
from llama.cli.printer import ProgressPrinter
from llama.runtime.devices import resolve_dtype
from llama.errors import LlamaError
from llama.tokenizer import Tokenizer

REPO = Path(__file__).resolve().parent.parent
META_SHARDS = {"7B": 1, "13B": 2, "70B": 8}


def main(dest: str, size: str = "tiny", tokenizer: str = str(REPO / "tokenizer.model.example"),
         dtype: str = "bfloat16", shards: Optional[int] = None, seed: int = 0, overwrite: bool = False,
         **overrides):
    if size not in PRESETS:
        raise SystemExit(f"error: unknown size {size!r}; choose one of {', '.join(PRESETS)}")
    params = dict(PRESETS[size], **overrides)
    shards = shards if shards is not None else META_SHARDS.get(size, 1)
    try:
        tok = Tokenizer(tokenizer)
        args = model_args(params, max_seq_len=2048, max_batch_size=1, tokenizer_vocab=tok.n_words)
        path = write_random_weights(dest, args, seed=seed, dtype=resolve_dtype(dtype, None), tokenizer_path=tokenizer,
                                    num_shards=shards, overwrite=overwrite, progress=ProgressPrinter())
    except LlamaError as e:
        raise SystemExit(f"error: {e}")
    n = sum(shape.numel() for shape in expected_shapes(args).values())
    print(f"wrote {path}: {n:,} parameters, {shards} shard(s), {dtype}")


if __name__ == "__main__":
    fire.Fire(main)
