"""Decode speed of `--quantize int8/int4 --dtype bfloat16` against torchao's weight-only quantization.

    pip install torchao        # into a scratch environment: torchao is not a dependency of this project
    python scripts/compare_torchao.py [--new_tokens 128] [--repeats 3] [--threads 2] [--compiled both|only|no]
        [--methods int8,int4]

Both start from the default model in bf16: ours quantizes while loading (int4 keeps the GGUF's own Q4_1
blocks), torchao's `quantize_` quantizes the loaded bf16 weights (int8 per output channel, int4 in groups of
32 through its CPU tensor, `PrototypeInt4WeightOnlyConfig`). Both call torch's `_weight_int8pack_mm` /
`_weight_int4pack_mm_for_cpu`; what differs is everything around the kernel. Compiled runs go through
llama/compile/step.py for both (torchao's linear layers are left as torchao made them). A combination that
fails is printed with its reason and left out. Runs alternate; each figure is the median of --repeats runs.
A compiled model's speed depends on what else the process holds (measured here: ours int4 compiled at 83
tokens/s among seven models, 118-120 beside one other): compare compiled figures from a run with
`--compiled only --methods int4`, which holds two models.
"agree" counts the first 32 greedy tokens equal to ours in the same mode: torchao's int4 grid is not the
file's, so it differs from ours as any requantization would.

torchao's `set_inductor_config` is turned off: it changes Inductor's settings for the whole process,
which would change how ours compiles too.
"""

import statistics

import fire
import torch

from compare_transformers import PROMPT, ours_once


def build_torchao(method: str, compile: bool, max_seq_len: int):
    from torchao.prototype.quantization.int4.inference_workflow import PrototypeInt4WeightOnlyConfig
    from torchao.quantization import Int8WeightOnlyConfig, quantize_

    from llama import Llama
    from llama.compile.step import compile_step
    from llama.convert.fetch import default_model_dir

    llama = Llama.build(default_model_dir(), max_seq_len=max_seq_len, max_batch_size=1, device="cpu",
                        dtype="bfloat16", compile=False)
    config = (Int8WeightOnlyConfig(set_inductor_config=False) if method == "int8"
              else PrototypeInt4WeightOnlyConfig(group_size=32, set_inductor_config=False))
    quantize_(llama.model, config)
    if compile:  # compile_step compiles the layers as they are: torchao's
        llama.compiled_step = compile_step(llama.model)
    return llama


def _names(value) -> tuple:
    return tuple(value) if isinstance(value, (tuple, list)) else tuple(str(value).split(","))


def build_ours(method: str, compile: bool, max_seq_len: int):
    from llama import Llama
    from llama.convert.fetch import default_model_dir

    return Llama.build(default_model_dir(), max_seq_len=max_seq_len, max_batch_size=1, device="cpu",
                       dtype="bfloat16", quantize=method, compile=compile)


def main(new_tokens: int = 128, repeats: int = 3, threads: int = 2, compiled: str = "both", methods="int8,int4"):
    import torchao

    torch.set_num_threads(threads)
    modes = {"both": (False, True), "only": (True,), "no": (False,)}[compiled]
    kinds = [(who, method, compile) for compile in modes for method in _names(methods) for who in ("ours", "torchao")]
    models = {}
    for who, method, compile in kinds:
        build = build_ours if who == "ours" else build_torchao
        try:
            models[who, method, compile] = build(method, compile, new_tokens + 64)
        except Exception as e:  # torchao's failures come as many exception types; report and go on
            reason = str(e).strip().splitlines()[0][:200] if str(e).strip() else type(e).__name__
            print(f"{who} {method} {'--compile' if compile else 'eager'}: failed: {reason}")
    prompt_ids = next(iter(models.values())).tokenizer.encode(PROMPT, bos=True, eos=False)

    first = {kind: ours_once(llama, prompt_ids, 32)[1] for kind, llama in models.items()}
    rates = {kind: [] for kind in models}
    for _ in range(repeats):
        for kind, llama in models.items():
            rates[kind].append(ours_once(llama, prompt_ids, new_tokens)[0])
    print(f"torch {torch.__version__}, torchao {torchao.__version__}, {threads} threads, batch 1, bf16, "
          f"{new_tokens} new tokens, median of {repeats} interleaved runs")
    for (who, method, compile), r in rates.items():
        ours = first.get(("ours", method, compile))
        agree = "" if ours is None else f"   agree {sum(a == b for a, b in zip(first[who, method, compile], ours))}/32"
        print(f"{who:>8} {method} {'--compile' if compile else 'eager    '}: {statistics.median(r):6.1f} tokens/s{agree}")


if __name__ == "__main__":
    fire.Fire(main)
