"""Decode speed with the KV cache in float32 and in int8 (`kv_cache_dtype`), after contexts of several lengths.

    python scripts/bench_kv_dtype.py [--contexts 0,2048,8192] [--steps 96] [--rounds 6] [--threads 2]
        [--quantize none,int8] [--kv float32,int8]

The default model (SmolLM2-135M-Instruct, 8,192 positions) at batch 1 with the commands' default step, the stored
compiled one (built before any timing), timed step by step: each context N is a cache holding N positions, then
`--steps` decode steps at positions N, N + 1, ... (a context that leaves no room for them is shortened to
max_seq_len - steps). The cache's first N positions hold keys and values as a prefill leaves them: the model's own,
from a forward of random tokens written into a cache of the dtype at hand; the step's cost depends on how many
positions it reads, not on their values, so the prompt's text does not matter. The cache dtypes alternate in rounds
of `steps / rounds` steps, their order reversed every other round, so that drift in the machine's speed (other
processes) hits both alike; each dtype's tokens/s is its steps over its summed seconds.
"""

import argparse
import time

import torch

from llama import Llama
from llama.convert.fetch import default_model_dir


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--contexts", default="0,2048,8192")
    parser.add_argument("--steps", type=int, default=96)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--quantize", default="none")
    parser.add_argument("--kv", default="float32,int8")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    kv_dtypes = args.kv.split(",")
    rows = []
    for quantize in args.quantize.split(","):
        # compile=True: the stored step, loaded or built now, never the eager one while timing.
        models = {kv: Llama.build(default_model_dir(), max_seq_len=8192, max_batch_size=1, compile=True,
                                  quantize=None if quantize == "none" else quantize, kv_cache_dtype=kv)
                  for kv in kv_dtypes}
        max_seq_len = next(iter(models.values())).model.params.max_seq_len
        for context in map(int, args.contexts.split(",")):
            context = min(context, max_seq_len - args.steps)
            random = torch.Generator().manual_seed(context)
            prompt = torch.randint(3, 1000, (1, max(context, 1)), generator=random)
            caches, seconds = {}, {kv: 0.0 for kv in kv_dtypes}
            with torch.inference_mode():
                for kv, llama in models.items():
                    caches[kv] = llama.model.new_kv_cache(1, context + args.steps)
                    for start in range(0, context, 512):  # the prefill, in chunks that keep its memory small
                        llama.model(prompt[:, start : start + 512], start, caches[kv])
                per_round = args.steps // args.rounds
                token = torch.tensor([[5]])
                for r in range(args.rounds):
                    for kv in kv_dtypes if r % 2 == 0 else kv_dtypes[::-1]:
                        step = models[kv].compiled_step
                        start = time.perf_counter()
                        for pos in range(context + r * per_round, context + (r + 1) * per_round):
                            token = step(token, pos, caches[kv], num_logits=1)[:, -1].argmax(-1, keepdim=True)
                        seconds[kv] += time.perf_counter() - start
            speed = {kv: args.rounds * per_round / seconds[kv] for kv in kv_dtypes}
            rows.append((quantize, context, speed))
            base = speed[kv_dtypes[0]]
            print(f"weights {quantize:5} context {context:5}: "
                  + ", ".join(f"{kv} KV {v:6.1f} tok/s ({v / base:.2f}x)" for kv, v in speed.items()), flush=True)
    print(f"\n| weights | context | {' | '.join(f'{kv} KV tok/s' for kv in kv_dtypes)} | "
          f"{kv_dtypes[-1]} / {kv_dtypes[0]} |")
    print("|---|---:|" + "---:|" * (len(kv_dtypes) + 1))
    for quantize, context, speed in rows:
        print(f"| {quantize} | {context:,} | {' | '.join(f'{speed[kv]:.1f}' for kv in kv_dtypes)} | "
              f"{speed[kv_dtypes[-1]] / speed[kv_dtypes[0]]:.2f} |")


if __name__ == "__main__":
    main()
