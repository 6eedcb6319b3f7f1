"""Decode speed of this project against Hugging Face transformers, on the same weights, in one process.

    python scripts/compare_transformers.py [--new_tokens 128,512] [--repeats 3] [--threads 2] [--nocompile]

Both load the default model (SmolLM2-135M-Instruct, from the same GGUF) in float32 on the CPU and decode
greedily at batch 1 from the same prompt token ids, each with its KV cache. Ours runs twice: eager (the
default) and with --compile (compiled before any timing). Runs alternate (ours, ours compiled, theirs,
ours, ...) so that drift in the machine's speed hits all alike; each figure is the median of --repeats
runs. Decode tokens/s counts the steps after the first new token, timed the same way for all
(a timestamp per step). The roofline is the weights read per token divided by the memory bandwidth
measured here with a large copy.
"""

import statistics
import time
from typing import List

import fire
import torch

PROMPT = "The history of the printing press begins in"


def measure_bandwidth(n_bytes: int = 1 << 30, repeats: int = 5) -> float:
    """Bytes per second moved by a large tensor copy (each byte read once and written once)."""
    src = torch.ones(n_bytes // 4, dtype=torch.float32)
    dst = torch.empty_like(src)
    dst.copy_(src)
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - t)
    return 2 * n_bytes / best


def decode_rate(stamps: List[float]) -> float:
    return (len(stamps) - 1) / (stamps[-1] - stamps[0])


def ours_once(llama, prompt_ids, n):
    stamps = []
    # ignore_stop, as transformers' min_new_tokens: both produce exactly n tokens.
    (tokens,), _ = llama.generate([prompt_ids], n, temperature=0, ignore_stop=True,
                                  on_step=lambda pos, tok: stamps.append(time.perf_counter()))
    return decode_rate(stamps), tokens


def theirs_once(model, prompt_ids, n):
    from transformers import LogitsProcessor, LogitsProcessorList

    stamps = []

    class Stamp(LogitsProcessor):
        def __call__(self, input_ids, scores):
            stamps.append(time.perf_counter())
            return scores

    with torch.inference_mode():
        out = model.generate(torch.tensor([prompt_ids]), max_new_tokens=n, min_new_tokens=n, do_sample=False,
                             use_cache=True, logits_processor=LogitsProcessorList([Stamp()]), pad_token_id=0)
    return decode_rate(stamps), out[0, len(prompt_ids):].tolist()


def main(new_tokens="128,512", repeats: int = 3, threads: int = 2, compile: bool = True):
    from transformers import LlamaForCausalLM

    import transformers
    from llama import Llama
    from llama.download import default_model_dir, default_model_gguf

    torch.set_num_threads(threads)
    lengths = [int(n) for n in (new_tokens if isinstance(new_tokens, (tuple, list)) else str(new_tokens).split(","))]
    from llama.cli.progress import ProgressPrinter

    ckpt = default_model_dir(progress=ProgressPrinter(prefix="llama-download: "))
    gguf = default_model_gguf()
    build = dict(max_seq_len=max(lengths) + 64, max_batch_size=1, device="cpu", dtype="float32")
    ours = {"ours": Llama.build(ckpt, **build)}
    if compile:
        ours["ours --compile"] = Llama.build(ckpt, compile=True, **build)
    theirs = LlamaForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32).eval()
    prompt_ids = ours["ours"].tokenizer.encode(PROMPT, bos=True, eos=False)

    # Warm all up, so none pays first-call costs inside the measurement.
    for llama in ours.values():
        ours_once(llama, prompt_ids, 16)
    theirs_once(theirs, prompt_ids, 16)

    print(f"torch {torch.__version__}, transformers {transformers.__version__}, {threads} threads, float32, batch 1")
    print(f"prompt: {PROMPT!r} ({len(prompt_ids)} tokens); decode tokens/s, median of {repeats} interleaved runs\n")
    names = list(ours) + ["transformers"]
    print(f"{'new tokens':>10}  " + "  ".join(f"{name:>14}" for name in names)
          + "  " + "  ".join(f"{name + ' / transformers':>29}" for name in ours) + "  same tokens")
    for n in lengths:
        rates = {name: [] for name in names}
        same = True
        for _ in range(repeats):
            reference = None
            for name, llama in ours.items():
                rate, tokens = ours_once(llama, prompt_ids, n)
                rates[name].append(rate)
                reference = tokens if reference is None else reference
                same = same and tokens == reference
            rate, tokens = theirs_once(theirs, prompt_ids, n)
            rates["transformers"].append(rate)
            same = same and tokens == reference
        median = {name: statistics.median(r) for name, r in rates.items()}
        print(f"{n:>10}  " + "  ".join(f"{median[name]:>14.2f}" for name in names) + "  "
              + "  ".join(f"{median[name] / median['transformers']:>28.2f}x" for name in ours)
              + f"  {'yes' if same else 'no'}")

    weights = sum(p.numel() * p.element_size() for name, p in ours["ours"].model.named_parameters()
                  if not name.startswith("tok_embeddings"))  # the embedding table is read one row per token
    bandwidth = measure_bandwidth()
    print(f"\nroofline: {weights / 1e6:.0f} MB of weights read per token / {bandwidth / 1e9:.1f} GB/s copy "
          f"bandwidth = {bandwidth / weights:.1f} tokens/s at most")


if __name__ == "__main__":
    fire.Fire(main)
