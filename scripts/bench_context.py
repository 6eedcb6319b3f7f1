"""Prompt processing and decode speed by context length, ours against llama.cpp's llama-bench on the same weights.

    python scripts/bench_context.py [--prompts 512,2048,8192] [--contexts 0,2048,8192] [--new_tokens 128]
        [--quantize none,int8,int4] [--kv_cache_dtype auto] [--threads 2] [--repeats 2] [--nollamacpp]
        [--ik_llama_bench PATH] [--model FILE.gguf] [--cache_dir DIR] [--busy N]

Ours: the default model (SmolLM2-135M-Instruct) in each --quantize (none: float32; int8 / int4: the integer
kernels, with the row-exact blocked attention), batch 1, the decode step compiled and
stored as users get it (built before any timing); --kv_cache_dtype as `llama-generate`'s (auto: the model's
dtype, float32; bfloat16 holds half the bytes, as llama.cpp's default F16 cache does), or several (auto,bfloat16),
each a row of its own. Prompt processing: a prompt of N random tokens read at once
and its first token, N / seconds. Decode: after a context of N tokens (read untimed; 0: a one-token prompt),
--new_tokens greedy tokens, timestamped per step, tokens/s over those after the first.

llama.cpp: its llama-bench, built once into --cache_dir from the llama-cpp-python sdist's vendored tree
(scripts/bench_server.py's `build_llama_cpp`, cmake and a C++ compiler needed), on GGUFs its own llama-quantize
makes from the shipped Q4_1 file (F32 and Q8_0 for none and int8; for int4 Q4_1 with the embedding and output layer
in Q8_0, the weights `--quantize int4` holds, and the all-Q4_0 file people download): `-p N -n 0` and
`-p 0 -n 128 -d N`, each with flash attention off and on (`-fa 0,1`), the faster counted. Where the native build
stops with an illegal instruction in its AMX kernels (a CPU that reports AMX and does not run it, as some virtual
machines do), a note says so and a build without AMX measures from then on. --ik_llama_bench names ik_llama.cpp's
llama-bench (built from github.com/ikawrakow/ik_llama.cpp with cmake), run alike with `-rtr 1` (weights repacked at
load) and, as its llama-bench has no `-d`, `-gp N,128` for decode after N. Each runner's repeats are its own
(llama-bench's `-r`); ours alternate with llama.cpp's per --quantize. Medians, tokens/s.

Before the runners, the machine's memory rate on the same threads (1 GiB on 2 MiB pages, as the weights are held,
summed and copied), and after each of ours the weights a decode step reads (every parameter and buffer but the
embedding's) with the rate its decode after 0 reads them at: the roofline a batch-1 decode is held against.

--busy N keeps N other processes busy (each a Python loop, at the same priority) for the whole run: how each engine
decodes on a machine doing other work, as a laptop or a shared server is. `--busy 2 --contexts 0,300,2048 --prompts
512` measures a 2-core machine with both cores wanted elsewhere.

--model measures another GGUF (F16 or F32) instead of the default model, such as LLaMA-2 7B's shapes with 8 layers:
`python scripts/write_random_gguf.py 7b-8l-F16.gguf --size 7B --n_layers 8 --type F16`, then `--model 7b-8l-F16.gguf
--prompts 512,2048 --contexts 0,2048`. llama-quantize makes its F32, Q8_0, Q4_1 (Q8_0 output) and Q4_0 files
into --cache_dir; ours reads the F32 one and quantizes it with --quantize.
"""

import contextlib
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Dict, List, Optional

import fire
import torch

from bench_server import build_llama_cpp, f32_gguf
from llama import Llama
from llama.convert.fetch import default_model_dir
from llama.runtime.pages import huge_empty


# The GGUFs the other engines read beside each --quantize: the same weights as ours first (int4: Q4_1 blocks with the
# embedding and output layer in Q8_0, as `--quantize int4` holds them), then for int4 the file people download, every
# tensor Q4_0 (fewer bytes, and +34% perplexity on the default model: docs/quantization.md).
THEIR_TYPES = {"none": [("F32", None)], "int8": [("Q8_0", None)], "int4": [("Q4_1", "q8_0"), ("Q4_0", None)]}


def _list(value) -> List[str]:
    """fire gives "1,2" as a tuple, "7" as an int."""
    return [str(v).strip() for v in (value if isinstance(value, (tuple, list)) else str(value).split(","))]


def _random_prompt(llama: Llama, n: int, seed: int) -> List[int]:
    ids = torch.randint(1, llama.model.vocab_size, (max(n, 1),), generator=torch.Generator().manual_seed(seed))
    return ids.tolist()


def ours(quantize: str, prompts: List[int], contexts: List[int], new_tokens: int, repeats: int,
         kv_cache_dtype: str = "auto", model: Optional[Path] = None) -> Dict[str, float]:
    """{"pp N": tokens/s, "tg N": tokens/s} of our model (`model`: a GGUF, else the default model) quantized so."""
    llama = Llama.build(str(model or default_model_dir()), max_seq_len=max(prompts + contexts) + new_tokens + 8,
                        max_batch_size=1, compile=True, quantize=None if quantize == "none" else quantize, kv_cache_dtype=kv_cache_dtype)
    llama.generate([_random_prompt(llama, 8, 0)], 4, temperature=0)  # the first call's one-time costs
    rates: Dict[str, List[float]] = {}
    for repeat in range(repeats):
        for n in prompts:
            prompt = _random_prompt(llama, n, repeat)
            start = time.perf_counter()
            llama.generate([prompt], 1, temperature=0)
            rates.setdefault(f"pp {n}", []).append(n / (time.perf_counter() - start))
        for n in contexts:
            stamps = []
            llama.generate([_random_prompt(llama, n, repeat)], new_tokens, temperature=0, ignore_stop=True,
                           on_step=lambda *_: stamps.append(time.perf_counter()))
            rates.setdefault(f"tg {n}", []).append((len(stamps) - 1) / (stamps[-1] - stamps[0]))
    result = {key: statistics.median(values) for key, values in rates.items()}
    result["weight bytes"] = weight_bytes(llama)
    return result


def memory_bandwidth(gib: float = 1.0, repeats: int = 5) -> Dict[str, float]:
    """{"read": GB/s, "copy": GB/s} of this process's threads: `gib` GiB of float32 on 2 MiB pages, as the weights
    are held, summed (bytes read / seconds) and copied (bytes read + written / seconds), the best of `repeats`: the
    rate a decode step that streams its weights once is measured against."""
    n = int(gib * (1 << 30)) // 4
    src, dst = huge_empty((n,), torch.float32).fill_(1.0), huge_empty((n,), torch.float32)  # 2 MiB pages, as weights
    dst.copy_(src)  # every page touched before timing
    rates: Dict[str, float] = {"read": 0.0, "copy": 0.0}
    for _ in range(repeats):
        start = time.perf_counter()
        src.sum()
        rates["read"] = max(rates["read"], src.nbytes / (time.perf_counter() - start) / 1e9)
        start = time.perf_counter()
        dst.copy_(src)
        rates["copy"] = max(rates["copy"], 2 * src.nbytes / (time.perf_counter() - start) / 1e9)
    return rates


def weight_bytes(llama: Llama) -> int:
    """Bytes of weights a decode step reads: every module's parameters and buffers but the embedding's, of which a
    step looks up one row (an output layer tied to it is read whole, so it counts)."""
    seen = {}
    for name, module in llama.model.named_modules():
        if name != "tok_embeddings":
            for t in list(module.parameters(recurse=False)) + list(module.buffers(recurse=False)):
                seen[t.data_ptr()] = t.nbytes
    return sum(seen.values())


class IllegalInstruction(RuntimeError):
    """A llama-bench stopped by SIGILL: its build uses an instruction this CPU reports but does not run."""


def _reports_amx() -> bool:
    try:
        return "amx_tile" in Path("/proc/cpuinfo").read_text()
    except OSError:
        return False


def llama_bench(binary: Path, gguf: Path, prompts: List[int], contexts: List[int], new_tokens: int, threads: int,
                repeats: int, extra: List[str], depth_flag: bool = True) -> Dict[str, float]:
    """{"pp N": tokens/s, "tg N": tokens/s} from a llama-bench, the faster of flash attention off and on.

    Decode after a context of N: llama.cpp's `-d N` (`depth_flag`), or where a llama-bench has no `-d`
    (ik_llama.cpp's), its `-gp N,new_tokens`: the same test, new_tokens timed after an untimed prompt of N."""
    common = [str(binary), "-m", str(gguf), "-t", str(threads), "-r", str(repeats), "-fa", "0,1", "-o", "json", *extra]
    if depth_flag:
        decode = ["-p", "0", "-n", str(new_tokens), "-d", ",".join(map(str, contexts))]
    else:
        decode = ["-p", "0", "-n", str(new_tokens if 0 in contexts else 0)]
        decode += [arg for n in contexts if n for arg in ("-gp", f"{n},{new_tokens}")]
    rates: Dict[str, float] = {}
    for args in (["-p", ",".join(map(str, prompts)), "-n", "0"], decode):
        result = subprocess.run(common + args, capture_output=True, text=True)
        if result.returncode == -signal.SIGILL:
            raise IllegalInstruction(f"{binary} died with an illegal instruction on {gguf.name}")
        result.check_returncode()
        for test in json.loads(result.stdout):
            if test["n_gen"]:  # -d N records n_depth; -gp N,n records the context as n_prompt
                key = f"tg {test.get('n_depth', test['n_prompt'])}"
            else:
                key = f"pp {test['n_prompt']}"
            rates[key] = max(rates.get(key, 0.0), float(test["avg_ts"]))
    return rates


@contextlib.contextmanager
def busy_processes(n: int):
    """`n` other processes kept busy (a Python loop each, at this one's priority) while the block runs."""
    load = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]
    try:
        yield
    finally:
        for proc in load:
            proc.kill()


def main(prompts="512,2048,8192", contexts="0,2048,8192", new_tokens: int = 128, quantize="none,int8,int4",
         kv_cache_dtype="auto", threads: int = 2, repeats: int = 2, llamacpp: bool = True,
         ik_llama_bench: Optional[str] = None, model: Optional[str] = None, cache_dir: Optional[str] = None,
         busy: int = 0):
    """Measure ours and llama.cpp's llama-bench (and ik_llama.cpp's, if named); see the module docstring."""
    torch.set_num_threads(threads)
    prompt_counts = [int(n) for n in _list(prompts)]
    context_counts = [int(n) for n in _list(contexts)]
    cache = Path(cache_dir) if cache_dir else Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "llama-kv-bench-server"
    bin_dir = build_llama_cpp(cache, threads, targets=("llama-bench", "llama-quantize")) if llamacpp else None
    quantizer_dir = bin_dir or (Path(ik_llama_bench).parent if ik_llama_bench else None)
    source = Path(model) if model else None
    if source is not None and not source.is_file():
        raise SystemExit(f"--model {model}: no such GGUF file")
    if source is not None and quantizer_dir is None:
        raise SystemExit("--model needs llama.cpp's or ik_llama.cpp's llama-quantize: "
                         "drop --nollamacpp or name --ik_llama_bench")
    ours_model = f32_gguf(quantizer_dir, cache, threads, "F32", source) if source is not None else None
    keys = [f"pp {n}" for n in prompt_counts] + [f"tg {n}" for n in context_counts]
    llamacpp_dir = bin_dir

    def llamacpp_bench(gguf: Path) -> Dict[str, float]:
        """llama.cpp's llama-bench on `gguf`; where its native build stops in AMX instructions this CPU reports but
        does not run, its build without them from then on (a note says so)."""
        nonlocal llamacpp_dir
        args = (gguf, prompt_counts, context_counts, new_tokens, threads, repeats, [])
        try:
            return llama_bench(llamacpp_dir / "llama-bench", *args)
        except IllegalInstruction as e:
            if llamacpp_dir != bin_dir or not _reports_amx():
                raise SystemExit(f"llama.cpp: {e}") from None
            print(f"note: {e}, in its AMX kernels; llama.cpp from here on is its build without AMX", flush=True)
            llamacpp_dir = build_llama_cpp(cache, threads, targets=("llama-bench",), amx=False)
            return llama_bench(llamacpp_dir / "llama-bench", *args)

    with busy_processes(busy):
        bandwidth = memory_bandwidth()
        print(f"{ours_model or 'the default model'}: tokens/s, {threads} threads; pp N: a prompt of N tokens; "
              f"tg N: {new_tokens} tokens after N of context"
              + (f"; {busy} busy processes running beside" if busy else ""))
        print(f"memory, {threads} threads: read {bandwidth['read']:.1f} GB/s (1 GiB summed), "
              f"copy {bandwidth['copy']:.1f} GB/s (1 GiB copied, bytes read and written)")
        print(f"{'':>24}" + "".join(f"{k:>10}" for k in keys))
        for q in _list(quantize):
            runners = {}
            for kv in _list(kv_cache_dtype):
                name = f"llama-kv {q}" + ("" if kv == "auto" else f" kv {kv}")
                runners[name] = lambda q=q, kv=kv: ours(q, prompt_counts, context_counts, new_tokens, repeats, kv,
                                                        ours_model)
            for gguf_type, output_type in THEIR_TYPES[q] if quantizer_dir is not None else []:
                gguf = f32_gguf(quantizer_dir, cache, threads, gguf_type, source, output_type)
                label = gguf_type + (f" ({output_type.upper()} output)" if output_type else "")
                if bin_dir is not None:
                    runners[f"llama.cpp {label}"] = lambda gguf=gguf: llamacpp_bench(gguf)
                if ik_llama_bench:
                    runners[f"ik_llama.cpp {label}"] = lambda gguf=gguf: llama_bench(
                        Path(ik_llama_bench), gguf, prompt_counts, context_counts, new_tokens, threads, repeats,
                        ["-rtr", "1"], depth_flag=False)
            for name, run in runners.items():
                rates = run()
                print(f"{name:>24}" + "".join(f"{rates[k]:>10.1f}" if k in rates else f"{'-':>10}" for k in keys),
                      flush=True)
                if "weight bytes" in rates and "tg 0" in rates:  # ours: what its decode reads a second
                    read = rates["weight bytes"] * rates["tg 0"] / 1e9
                    print(f"{'':>24}  weights {rates['weight bytes'] / 1e6:.1f} MB a token; at tg 0 {read:.1f} GB/s, "
                          f"{read / bandwidth['read']:.0%} of the read rate", flush=True)


if __name__ == "__main__":
    fire.Fire(main)
