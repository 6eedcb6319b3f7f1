"""Prompt speed with the KV cache in the model's dtype and in int8 (`kv_cache_dtype`): what the row-exact products an
int8 cache takes on float32 weights cost a prompt.

    python scripts/bench_kv_prefill.py [--prompts 512,2048] [--repeats 3] [--threads 2] [--quantize none]

The default model at batch 1, eager (prompts are never compiled), one prompt of random token ids per length written
into an empty cache of each dtype; the two alternate, their order reversed every other repeat, and each one's
tokens/s is its best repeat.
"""

import argparse
import time

import torch

from llama import Llama
from llama.convert.fetch import default_model_dir


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", default="512,2048")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--quantize", default="none")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    lengths = [int(n) for n in args.prompts.split(",")]
    quantize = None if args.quantize == "none" else args.quantize
    models = {kv: Llama.build(default_model_dir(), max_seq_len=max(lengths), max_batch_size=1, compile=False,
                              quantize=quantize, kv_cache_dtype=kv).model for kv in ("auto", "int8")}
    print("| prompt | model's dtype KV, tok/s | int8 KV, tok/s | int8 / model's |\n|---:|---:|---:|---:|")
    for n in lengths:
        tokens = torch.randint(0, models["auto"].vocab_size, (1, n), generator=torch.Generator().manual_seed(n))
        best = {kv: float("inf") for kv in models}
        for r in range(args.repeats):
            for kv, model in (list(models.items()) if r % 2 == 0 else list(reversed(models.items()))):
                cache = model.new_kv_cache(1, n)
                with torch.inference_mode():
                    start = time.perf_counter()
                    model(tokens, 0, cache)
                    best[kv] = min(best[kv], time.perf_counter() - start)
        print(f"| {n:,} | {n / best['auto']:.0f} | {n / best['int8']:.0f} | {best['auto'] / best['int8']:.2f} |",
              flush=True)


if __name__ == "__main__":
    main()
