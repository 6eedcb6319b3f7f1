"""Decode speed of this project against Hugging Face transformers and llama.cpp, on the same weights.

    python scripts/compare_transformers.py [--new_tokens 128,512] [--repeats 3] [--threads 2] [--nocompile]
        [--nollamacpp] [--lcpp_types F32,Q8_0,Q4_0] [--gguf_dir DIR] [--noquantized]
        [--quant_kernels integer,exact] [--prompt_tokens 512] [--torch_compile] [--batch 4]
    python scripts/compare_transformers.py --ckpt DIR --lcpp_gguf FILE [--notransformers]  # e.g. 7B-shaped

All load the default model (SmolLM2-135M-Instruct, from the same GGUF) on the CPU and decode greedily at
batch 1 from the same prompt token ids, each with its KV cache, ignoring stop tokens. Ours runs in float32
eagerly (`--no-compile`) and compiled, as every command runs with no flag (compiled before any timing: on the CPU
the stored package of llama/compile/aot.py; --torch_compile adds the step torch.compile makes in the process);
with --quantize int8 / int4, unless
--noquantized, on each of --quant_kernels: "integer" (the integer kernels of llama/kernels, float32 eager
and compiled, and bf16) and "exact" (the weight-only paths: float32 compiled, bf16 eager and compiled).
transformers runs in float32. llama.cpp is optional: the `llama_cpp` module of llama-cpp-python built from
source (`pip install --no-binary llama-cpp-python llama-cpp-python`), left out with a note when it is not
installed. It runs a GGUF of each --lcpp_types, made once into --gguf_dir by llama.cpp's own quantizer from
the shipped Q4_1 file: F32 holds exactly the dequantized values ours loads, and Q8_0 / Q4_0 are quantized
from them, every tensor in that type (pure).

--ckpt runs ours on another checkpoint instead (a GGUF that llama-convert kept quantized runs as stored,
on each of --quant_kernels), and --lcpp_gguf gives llama.cpp the GGUF it came from: that is how the 7B-shaped
comparison of issue 21 is made (a random 7B-shaped F16 GGUF of 8 layers, quantized to Q8_0 / Q4_0 by
llama.cpp's quantizer, converted by llama-convert). With --prompt_tokens N the prompt is N tokens long and
a second table gives each runner's time to the first new token (prefill), median of the same runs.

With --batch N every runner decodes N copies of the prompt together, and tokens/s counts all N rows: ours and
transformers as one batch, llama.cpp as its batched example does (N sequences in one KV cache, one llama_decode
per step feeding each sequence's newest token).

Runs alternate (ours, ours compiled, ..., transformers, llama.cpp F32, ..., ours, ...) so that drift in the
machine's speed hits all alike; each figure is the median of --repeats runs. Decode tokens/s counts the
steps after the first new token, timed the same way for all (a timestamp per step). "agree" counts the
leading tokens equal to ours (float32, eager). The roofline is the float32 weights read per token divided
by the memory bandwidth measured here with a large copy.
"""

import ctypes
import functools
import inspect
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Callable, Dict, List

import fire
import torch

PROMPT = "The history of the printing press begins in"
LCPP_FTYPES = {"F32": 0, "F16": 1, "Q4_0": 2, "Q4_1": 3, "Q8_0": 7}  # llama.cpp's LLAMA_FTYPE_* values


def measure_bandwidth(n_bytes: int = 1 << 30, repeats: int = 5, device: str = "cpu") -> float:
    """Bytes per second moved by a large tensor copy on `device` (each byte read once and written once)."""
    src = torch.ones(n_bytes // 4, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    best = float("inf")
    for _ in range(repeats):
        _sync(src)
        t = time.perf_counter()
        dst.copy_(src)
        _sync(src)
        best = min(best, time.perf_counter() - t)
    return 2 * n_bytes / best


def _sync(tensor: torch.Tensor) -> None:
    """Wait for the GPU's queued work, so that a clock read after it counts that work."""
    if tensor.is_cuda:
        torch.cuda.synchronize(tensor.device)


def decode_rate(stamps: List[float]) -> float:
    return (len(stamps) - 1) / (stamps[-1] - stamps[0])


def ours_once(llama, prompt_ids, n, batch=1):
    stamps = [time.perf_counter()]
    # ignore_stop, as transformers' min_new_tokens: both produce exactly n tokens.
    (tokens, *_), _ = llama.generate([prompt_ids] * batch, n, temperature=0, ignore_stop=True,
                                     on_step=lambda pos, tok: stamps.append(time.perf_counter()))
    return decode_rate(stamps[1:]) * batch, tokens, stamps[1] - stamps[0]


def theirs_once(model, prompt_ids, n, batch=1):
    from transformers import LogitsProcessor, LogitsProcessorList

    stamps = [time.perf_counter()]

    class Stamp(LogitsProcessor):
        def __call__(self, input_ids, scores):
            _sync(scores)
            stamps.append(time.perf_counter())
            return scores

    with torch.inference_mode():
        prompts = torch.tensor([prompt_ids] * batch, device=model.device)
        out = model.generate(prompts, max_new_tokens=n, min_new_tokens=n, do_sample=False, use_cache=True,
                             logits_processor=LogitsProcessorList([Stamp()]), pad_token_id=0)
    return decode_rate(stamps[1:]) * batch, out[0, len(prompt_ids):].tolist(), stamps[1] - stamps[0]


def make_ggufs(source: Path, out_dir: Path, types: List[str], threads: int) -> Dict[str, Path]:
    """GGUFs of the default model in each llama.cpp type, made once by llama.cpp's quantizer (pure: every tensor)."""
    import llama_cpp

    out_dir.mkdir(parents=True, exist_ok=True)
    paths = {}
    for name in types:
        path = out_dir / f"{source.stem.split('.')[0]}.{name}.gguf"
        if not path.exists():
            params = llama_cpp.llama_model_quantize_default_params()
            params.ftype = LCPP_FTYPES[name]
            params.nthread = threads
            params.allow_requantize = True  # the shipped file is Q4_1: F32 dequantizes it exactly
            params.pure = True
            partial = path.with_suffix(".partial")
            if llama_cpp.llama_model_quantize(str(source).encode(), str(partial).encode(), ctypes.byref(params)) != 0:
                raise SystemExit(f"llama.cpp could not quantize {source} to {name}")
            partial.rename(path)
        paths[name] = path
    return paths


def lcpp_once(llm, prompt_ids, n):
    stamps, tokens = [time.perf_counter()], []
    llm.reset()  # no reuse of the last run's prompt: every run pays its prefill, as ours do
    for token in llm.generate(prompt_ids, temp=0.0, top_k=1, repeat_penalty=1.0):  # greedy; no stop tokens here
        stamps.append(time.perf_counter())
        tokens.append(token)
        if len(tokens) == n:
            break
    return decode_rate(stamps[1:]), tokens, stamps[1] - stamps[0]


class LcppBatch:
    """llama.cpp decoding `batch` sequences together, as its own batched example does: one llama_decode per step
    feeds every sequence's newest token (sequence ids 0 .. batch - 1, one KV cache), greedy by argmax."""

    def __init__(self, llm, batch: int, n_ctx: int):
        import llama_cpp

        params = llm.context_params
        params.n_seq_max, params.n_ctx, params.kv_unified = batch, n_ctx * batch, True
        params.n_batch = params.n_ubatch = max(params.n_batch, batch)
        self.lib, self.llm, self.batch = llama_cpp, llm, batch
        self.ctx = llama_cpp.llama_init_from_model(llm._model.model, params)
        self.n_vocab = llm.n_vocab()

    def _decode(self, rows):
        """rows: (sequence, position, token, wants logits) for one llama_decode; returns the logits' batch indices."""
        lib = self.lib
        b = lib.llama_batch_init(len(rows), 0, 1)
        try:
            for i, (seq, pos, token, wants) in enumerate(rows):
                b.token[i], b.pos[i], b.n_seq_id[i], b.logits[i] = token, pos, 1, wants
                b.seq_id[i][0] = seq
            b.n_tokens = len(rows)
            if lib.llama_decode(self.ctx, b) != 0:
                raise SystemExit("llama.cpp's llama_decode failed")
        finally:
            lib.llama_batch_free(b)
        return [i for i, row in enumerate(rows) if row[3]]

    def _argmax(self, i):
        import numpy as np

        return int(np.ctypeslib.as_array(self.lib.llama_get_logits_ith(self.ctx, i), shape=(self.n_vocab,)).argmax())

    def __call__(self, prompt_ids, n):
        self.lib.llama_memory_clear(self.lib.llama_get_memory(self.ctx), True)
        stamps, tokens = [time.perf_counter()], []
        last = len(prompt_ids) - 1
        rows = [(s, j, t, j == last) for s in range(self.batch) for j, t in enumerate(prompt_ids)]
        for step in range(n):
            nxt = [self._argmax(i) for i in self._decode(rows)]
            stamps.append(time.perf_counter())
            tokens.append(nxt[0])
            rows = [(s, len(prompt_ids) + step, nxt[s], True) for s in range(self.batch)]
        return decode_rate(stamps[1:]) * self.batch, tokens, stamps[1] - stamps[0]


def agree(a: List[int], b: List[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def _list(value) -> List[str]:
    return [v.strip() for v in (value if isinstance(value, (tuple, list)) else str(value).split(",")) if str(v).strip()]


def quantized_variants(ckpt, kinds, quant_kernels, compile: bool, build: dict) -> Dict[str, object]:
    """Our quantized models: for each method (None: as the checkpoint stores it) and each of quant_kernels."""
    from llama import Llama

    ours = {}
    for kind in kinds:
        label = f"ours {kind}" if kind else "ours"
        for qk in quant_kernels:
            common = dict(quantize=kind, quant_kernels=qk, **build)
            if qk == "integer":  # the same kernels eager, compiled and in bf16
                ours[f"{label} integer"] = Llama.build(ckpt, dtype="float32", compile=False, **common)
                if compile:
                    ours[f"{label} integer --compile"] = Llama.build(ckpt, dtype="float32", compile=True, **common)
                ours[f"{label} integer bf16"] = Llama.build(ckpt, dtype="bfloat16", compile=False, **common)
            else:  # float32 only compiled (eagerly it widens weights: exact but slow); bf16: torch's kernels
                if compile:
                    ours[f"{label} exact --compile"] = Llama.build(ckpt, dtype="float32", compile=True, **common)
                ours[f"{label} exact bf16"] = Llama.build(ckpt, dtype="bfloat16", compile=False, **common)
                if compile:
                    ours[f"{label} exact bf16 --compile"] = Llama.build(ckpt, dtype="bfloat16", compile=True, **common)
    return ours


def main(new_tokens="128,512", repeats: int = 3, threads: int = 2, compile: bool = True, llamacpp: bool = True,
         lcpp_types="F32,Q8_0,Q4_0", gguf_dir: str = None, quantized: bool = True, quant_kernels="integer,exact",
         ckpt: str = None, lcpp_gguf: str = None, transformers: bool = True, prompt_tokens: int = 0,
         torch_compile: bool = False, batch: int = 1):
    import transformers as transformers_module
    from llama import Llama
    from llama.convert.fetch import default_model_dir, default_model_gguf
    from llama.quant.format import read_record

    torch.set_num_threads(threads)
    lengths = [int(n) for n in _list(new_tokens)]
    from llama.cli.printer import ProgressPrinter

    default = ckpt is None
    ckpt = default_model_dir(progress=ProgressPrinter(prefix="llama-download: ")) if default else Path(ckpt)
    gguf = default_model_gguf() if default else None
    build = dict(max_seq_len=max(lengths) + max(prompt_tokens, 64) + 64, max_batch_size=batch, device="cpu")
    stored = read_record(ckpt) is not None
    ours = {}
    if not stored:
        ours["ours"] = Llama.build(ckpt, dtype="float32", compile=False, **build)
        if compile:
            ours["ours --compile"] = Llama.build(ckpt, dtype="float32", compile=True, **build)
        if torch_compile:  # the compiled step as it was before the stored packages (llama/compile/aot.py)
            os.environ["LLAMA_COMPILE_AOT"] = "0"
            ours["ours --compile, torch.compile"] = Llama.build(ckpt, dtype="float32", compile=True, **build)
            del os.environ["LLAMA_COMPILE_AOT"]
    if quantized and "quantize" in inspect.signature(Llama.build).parameters:  # once this version has --quantize
        kernels_param = "quant_kernels" in inspect.signature(Llama.build).parameters
        ours.update(quantized_variants(ckpt, [None] if stored else ["int8", "int4"],
                                       _list(quant_kernels) if kernels_param else ["exact"], compile, build))
    runners: Dict[str, Callable] = {name: functools.partial(ours_once, llama, batch=batch) for name, llama in ours.items()}
    versions = f"torch {torch.__version__}"
    if transformers and gguf is not None:
        from transformers import LlamaForCausalLM

        theirs = LlamaForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32).eval()
        runners["transformers"] = functools.partial(theirs_once, theirs, batch=batch)
        versions += f", transformers {transformers_module.__version__}"
    if llamacpp:
        try:
            import llama_cpp
        except ImportError:
            print("note: llama_cpp is not installed, so llama.cpp is left out "
                  "(pip install --no-binary llama-cpp-python llama-cpp-python)")
        else:
            ggufs = {}
            if gguf is not None and lcpp_types:
                ggufs = make_ggufs(gguf, Path(gguf_dir) if gguf_dir else Path(tempfile.gettempdir()) / "llama-kv-ggufs",
                                   _list(lcpp_types), threads)
            if lcpp_gguf:
                ggufs[Path(lcpp_gguf).stem] = Path(lcpp_gguf)
            for name, path in ggufs.items():
                llm = llama_cpp.Llama(str(path), n_ctx=build["max_seq_len"], n_batch=512, n_threads=threads,
                                      n_threads_batch=threads, verbose=False)
                runners[f"llama.cpp {name}"] = (functools.partial(lcpp_once, llm) if batch == 1
                                                else LcppBatch(llm, batch, build["max_seq_len"]))
            versions += f", llama-cpp-python {llama_cpp.__version__}"
    tokenizer = next(iter(ours.values())).tokenizer
    prompt_ids = tokenizer.encode(PROMPT, bos=True, eos=False)
    if prompt_tokens:  # a long prompt, for the time to the first token: the text again and again
        body = tokenizer.encode(" " + PROMPT + " a press that changed how books were made.", bos=False, eos=False)
        prompt_ids = (prompt_ids + body * (prompt_tokens // len(body) + 1))[:prompt_tokens]

    # Warm all up, so none pays first-call costs inside the measurement.
    for run in runners.values():
        run(prompt_ids, 16)

    print(f"{versions}, {threads} threads, batch {batch}"
          + (f" (the same prompt in every row; tokens/s counts all {batch} rows)" if batch > 1 else ""))
    print(f"checkpoint: {ckpt}; prompt: {PROMPT!r} ({len(prompt_ids)} tokens); decode tokens/s, median of {repeats} "
          f"interleaved runs; agree: leading tokens equal to the first runner's ({next(iter(runners))})\n")
    names = list(runners)
    rates = {(name, n): [] for name in names for n in lengths}
    firsts = {(name, n): [] for name in names for n in lengths}
    agreed = {(name, n): 0 for name in names for n in lengths}
    for n in lengths:
        for _ in range(repeats):
            reference = None
            for name, run in runners.items():
                rate, tokens, first = run(prompt_ids, n)
                rates[name, n].append(rate)
                firsts[name, n].append(first)
                reference = tokens if reference is None else reference
                agreed[name, n] = agree(tokens, reference)
    median = {key: statistics.median(r) for key, r in rates.items()}
    width = max(len(name) for name in names)
    base = next((b for b in ("llama.cpp F32", "transformers") if b in names), names[0])
    print(f"{'':{width}}  " + "  ".join(f"{f'{n} tokens':>10}  {'/ ' + base:>16}  {'agree':>5}" for n in lengths))
    for name in names:
        print(f"{name:{width}}  " + "  ".join(
            f"{median[name, n]:>10.2f}  {median[name, n] / median[base, n]:>15.2f}x  {agreed[name, n]:>5}"
            for n in lengths))

    if prompt_tokens:
        print(f"\ntime to the first new token after the {len(prompt_ids)}-token prompt, seconds (median):")
        for name in names:
            print(f"{name:{width}}  " + "  ".join(f"{statistics.median(firsts[name, n]):>10.3f}" for n in lengths))

    bandwidth = measure_bandwidth()
    for name, llama in ours.items():  # the bytes each of ours reads per token: its weights but the embedding
        if name in ("ours", "ours int8 integer", "ours int4 integer", "ours integer"):
            weights = sum(t.numel() * t.element_size() for key, t in llama.model.state_dict().items()
                          if not key.startswith("tok_embeddings"))  # the embedding is read one row per token
            print(f"\nroofline of {name}: {weights / 1e6:.0f} MB of weights read per token / {bandwidth / 1e9:.1f} GB/s "
                  f"copy bandwidth = {bandwidth / weights:.1f} tokens/s at most", end="")
    print()


if __name__ == "__main__":
    fire.Fire(main)
