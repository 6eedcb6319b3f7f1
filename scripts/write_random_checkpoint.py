"""Write a random-weight checkpoint in Meta's exact layout, for tests, demos and benchmarks.

    python scripts/write_random_checkpoint.py /tmp/tiny --size tiny
    python scripts/write_random_checkpoint.py /tmp/llama7b --size 7B --dtype bfloat16
    python scripts/write_random_checkpoint.py /tmp/small --size 7B --n_layers 4 --shards 2

`--size` picks Meta's params.json for 7B, 13B or 70B (or `tiny`); any params.json field given as a flag
overrides it. The tokenizer (default: tokenizer.model.example) is copied in and sets the vocabulary
size wherever params.json says -1.
"""

from pathlib import Path

import fire

from llama.checkpoint import PRESETS, model_args, write_random_checkpoint
from llama.distributed import resolve_dtype
from llama.errors import LlamaError
from llama.tokenizer import Tokenizer

REPO = Path(__file__).resolve().parent.parent


def main(dest: str, size: str = "tiny", tokenizer: str = str(REPO / "tokenizer.model.example"),
         dtype: str = "bfloat16", shards: int = 1, seed: int = 0, overwrite: bool = False, **overrides):
    if size not in PRESETS:
        raise SystemExit(f"error: unknown size {size!r}; choose one of {', '.join(PRESETS)}")
    params = dict(PRESETS[size], **overrides)
    try:
        tok = Tokenizer(tokenizer)
        args = model_args(params, max_seq_len=2048, max_batch_size=1, tokenizer_vocab=tok.n_words)
        path, state_dict = write_random_checkpoint(dest, args, seed=seed, dtype=resolve_dtype(dtype, None),
                                                   tokenizer_path=tokenizer, num_shards=shards, overwrite=overwrite)
    except LlamaError as e:
        raise SystemExit(f"error: {e}")
    n = sum(t.numel() for t in state_dict.values())
    print(f"wrote {path}: {n:,} parameters, {shards} shard(s), {dtype}")


if __name__ == "__main__":
    fire.Fire(main)
