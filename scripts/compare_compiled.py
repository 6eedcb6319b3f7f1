"""Decode speed of the compiled step of the default model, float32 and bf16, float, int8 and int4, interleaved.

    python scripts/compare_compiled.py [--new_tokens 128] [--repeats 3] [--threads 2]
    LLAMA_COMPILE_CPP_WRAPPER=0 python scripts/compare_compiled.py     # the same without Inductor's C++ wrapper

Every model is built with --compile (compiled before any timing), then each generates --new_tokens greedily
(stop tokens ignored) from the same prompt, runs interleaved; printed: the median decode tokens/s. Run it
alternately with and without the environment variable to see what the C++ wrapper is worth (llama/compile/step.py).
"""

import os
import statistics

import fire
import torch

from compare_transformers import PROMPT, ours_once

KINDS = [("float32", None), ("float32", "int8"), ("float32", "int4"), ("bfloat16", "int8"), ("bfloat16", "int4")]


def main(new_tokens: int = 128, repeats: int = 3, threads: int = 2):
    from llama import Llama
    from llama.convert.fetch import default_model_dir

    torch.set_num_threads(threads)
    models = {kind: Llama.build(default_model_dir(), max_seq_len=new_tokens + 64, max_batch_size=1, device="cpu",
                                dtype=kind[0], quantize=kind[1], compile=True) for kind in KINDS}
    prompt_ids = next(iter(models.values())).tokenizer.encode(PROMPT, bos=True, eos=False)

    for llama in models.values():
        ours_once(llama, prompt_ids, 8)
    rates = {kind: [] for kind in KINDS}
    for _ in range(repeats):
        for kind, llama in models.items():
            rates[kind].append(ours_once(llama, prompt_ids, new_tokens)[0])
    wrapper = os.environ.get("LLAMA_COMPILE_CPP_WRAPPER", "1") != "0"
    print(f"torch {torch.__version__}, {threads} threads, batch 1, {new_tokens} new tokens, median of {repeats} "
          f"interleaved runs, Inductor's C++ wrapper {'on' if wrapper else 'off'}")
    for (dtype, quantize), r in rates.items():
        print(f"{dtype:>9} {quantize or 'float':>6} --compile: {statistics.median(r):6.1f} tokens/s")


if __name__ == "__main__":
    fire.Fire(main)
