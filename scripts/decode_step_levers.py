"""The eager float32 decode step of the default model with each way of running its linear layers.

    python scripts/decode_step_levers.py [--new_tokens 64] [--repeats 5] [--threads 2]

Three copies of the default model, differing only in their linear layers' kernel and weight layout:
    F.linear, column-major   the default (MKL; wide matrices stored input-major, as eager CPU runs load them)
    oneDNN, column-major     the same weights through torch.ops.mkldnn._linear_pointwise (a class swap)
    oneDNN, row-major        oneDNN on the weights as they load
Each generates --new_tokens greedily (stop tokens ignored) from the same prompt, runs interleaved; printed:
the median decode tokens/s (the steps after the first new token) and whether the tokens are the same.
"""

import statistics
import time

import fire
import torch
from torch import nn

from compare_transformers import PROMPT, decode_rate


class OneDNNLinear(nn.Linear):
    def forward(self, x):
        return torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, "none", [], "")


def onednn(llama):
    for module in llama.model.modules():
        if type(module) is nn.Linear:
            module.__class__ = OneDNNLinear  # same object, weights and hooks; only forward changes
    return llama


def row_major(llama):
    for module in llama.model.modules():
        if isinstance(module, nn.Linear):
            module.weight = nn.Parameter(module.weight.detach().contiguous(), requires_grad=False)
    return llama


def run(llama, prompt_ids, n):
    stamps = []
    (tokens,), _ = llama.generate([prompt_ids], n, temperature=0, ignore_stop=True,
                                  on_step=lambda pos, tok: stamps.append(time.perf_counter()))
    return decode_rate(stamps), tokens


def main(new_tokens: int = 64, repeats: int = 5, threads: int = 2):
    from llama import Llama
    from llama.convert.fetch import default_model_dir

    if not hasattr(torch.ops.mkldnn, "_linear_pointwise"):
        raise SystemExit("this torch has no oneDNN linear op; nothing to compare")
    torch.set_num_threads(threads)
    build = dict(max_seq_len=new_tokens + 64, max_batch_size=1, device="cpu", dtype="float32", compile=False)
    variants = {
        "F.linear, column-major": Llama.build(default_model_dir(), **build),
        "oneDNN, column-major": onednn(Llama.build(default_model_dir(), **build)),
        "oneDNN, row-major": onednn(row_major(Llama.build(default_model_dir(), **build))),
    }
    prompt_ids = variants["oneDNN, column-major"].tokenizer.encode(PROMPT, bos=True, eos=False)
    for llama in variants.values():
        run(llama, prompt_ids, 8)
    rates = {name: [] for name in variants}
    tokens = {}
    for _ in range(repeats):
        for name, llama in variants.items():
            rate, tokens[name] = run(llama, prompt_ids, new_tokens)
            rates[name].append(rate)
    print(f"torch {torch.__version__}, {threads} threads, float32, batch 1, {new_tokens} new tokens, "
          f"median of {repeats} interleaved runs")
    first = next(iter(tokens.values()))
    for name in variants:
        print(f"{name:>24}: {statistics.median(rates[name]):6.2f} tokens/s "
              f"({1000 / statistics.median(rates[name]):5.1f} ms a step), same tokens: {tokens[name] == first}")


if __name__ == "__main__":
    fire.Fire(main)
