"""Perplexity of the default model by this project and by llama.cpp, on the same tokens and windows.

    python scripts/compare_perplexity.py [--file data/alice29.txt] [--ctx 512] [--windows N] [--threads 2]
        [--quantize none,int8,int4] [--kv auto,int8] [--nollamacpp] [--lcpp_types F32,Q8_0,Q4_0] [--gguf_dir DIR]

Ours runs `llama.eval.likelihood.perplexity` on the default model in float32 (and with each --quantize kind
where this version's Llama.build takes `quantize`). llama.cpp (optional, as in compare_transformers.py:
the `llama_cpp` module of llama-cpp-python) scores the very same windows of our token ids, with the same
rule (llama/eval/likelihood.py: the second half of each window of --ctx tokens), from all of each window's
logits, for a GGUF of each --lcpp_types made by llama.cpp's quantizer from the shipped Q4_1 file. llama.cpp's
F32 holds the same values as our float32 model, so the two F32 rows check each other.

--kv: the KV cache dtypes to score with (`--kv-cache-dtype`); llama.cpp's counterparts are an F32 cache for
`auto` and `-ctk q8_0 -ctv q8_0` for int8 (blocks of 32 with one scale, the rule ours follows), both with flash
attention on (llama.cpp quantizes the V cache only with it). Each row's change is read against the float cache of
the same weights, ours against ours and llama.cpp's against llama.cpp's.
"""

import math
import time
from pathlib import Path

import fire
import numpy as np
import torch

from compare_transformers import make_ggufs

REPO = Path(__file__).resolve().parent.parent
# --kv's choices and llama.cpp's cache type for each (ggml_type: 0 F32, 8 Q8_0).
LCPP_KV = {"auto": 0, "int8": 8}
LCPP_KV_NAMES = {"auto": "F32", "int8": "q8_0"}


def _list(value) -> list:
    """A comma-separated option as fire passes it (a string, or a tuple where it parsed the commas)."""
    return [v.strip() for v in (value if isinstance(value, str) else ",".join(map(str, value))).split(",")]


def lcpp_perplexity(llm, windows, ctx):
    """exp(mean NLL) of the scored tokens of each window, from llama.cpp's logits (logits_all)."""
    nlls = []
    for window in windows:
        llm.reset()
        llm.eval(window)
        logits = torch.from_numpy(np.array(llm.scores[:ctx], dtype=np.float32))  # (ctx, vocab)
        first = ctx // 2
        logp = torch.log_softmax(logits[first:-1].double(), dim=-1)
        targets = torch.tensor(window[first + 1:])
        nlls.append(-logp.gather(1, targets[:, None])[:, 0])
    return math.exp(torch.cat(nlls).mean().item())


def main(file: str = str(REPO / "data" / "alice29.txt"), ctx: int = 512, windows: int = None, threads: int = 2,
         quantize="none,int8,int4", kv="auto", llamacpp: bool = True, lcpp_types="F32,Q8_0,Q4_0", gguf_dir: str = None):
    import inspect
    import tempfile

    from llama import Llama
    from llama.convert.fetch import default_model_dir, default_model_gguf
    from llama.eval.likelihood import perplexity, window_starts

    torch.set_num_threads(threads)
    text = Path(file).read_text(encoding="utf-8")
    kinds = _list(quantize)
    kv_dtypes = sorted(_list(kv), key=lambda k: k != "auto")  # the float cache first: the others are read against it
    unknown = [k for k in kv_dtypes if k not in LCPP_KV]
    if unknown:
        raise SystemExit(f"--kv {','.join(unknown)}: this script compares {', '.join(LCPP_KV)}")
    if "quantize" not in inspect.signature(Llama.build).parameters:
        kinds = [k for k in kinds if k == "none"]
    rows = []
    tokens = None
    for kind in kinds:
        for kv_dtype in kv_dtypes:
            extra = {} if kind == "none" else {"quantize": kind}
            if kv_dtype != "auto":
                extra["kv_cache_dtype"] = kv_dtype
            llama = Llama.build(default_model_dir(), max_seq_len=ctx, max_batch_size=1, device="cpu",
                                dtype="float32", compile=False, **extra)  # whole windows: no decode step to compile
            tokens = llama.tokenizer.encode(text, bos=False, eos=False)
            start = time.perf_counter()
            result = perplexity(llama, tokens, ctx, max_windows=windows)
            name = "ours, float32" if kind == "none" else f"ours, --quantize {kind}"
            rows.append((name + ("" if kv_dtype == "auto" else f", {kv_dtype} KV"), result.perplexity,
                         time.perf_counter() - start, kv_dtype))
            bos = llama.tokenizer.bos_id if llama.tokenizer.add_bos else None
            del llama
    if llamacpp:
        try:
            import llama_cpp
        except ImportError:
            print("note: llama_cpp is not installed, so llama.cpp is left out")
        else:
            windows_ = []
            for s in window_starts(len(tokens), ctx, windows):
                w = list(tokens[s:s + ctx])
                if bos is not None:
                    w[0] = bos
                windows_.append(w)
            types = _list(lcpp_types)
            out_dir = Path(gguf_dir) if gguf_dir else Path(tempfile.gettempdir()) / "llama-kv-ggufs"
            for name, path in make_ggufs(default_model_gguf(), out_dir, types, threads).items():
                for kv_dtype in kv_dtypes:
                    cache = {} if kv_dtypes == ["auto"] else {  # the binding's defaults where no KV dtype is compared
                        "type_k": LCPP_KV[kv_dtype], "type_v": LCPP_KV[kv_dtype], "flash_attn": True}
                    llm = llama_cpp.Llama(str(path), n_ctx=ctx, n_batch=ctx, n_ubatch=ctx, n_threads=threads,
                                          n_threads_batch=threads, logits_all=True, verbose=False, **cache)
                    start = time.perf_counter()
                    label = f"llama.cpp {name}" + ("" if kv_dtype == "auto" else f", {LCPP_KV_NAMES[kv_dtype]} KV")
                    rows.append((label, lcpp_perplexity(llm, windows_, ctx), time.perf_counter() - start, kv_dtype))
                    del llm
    n_windows = len(window_starts(len(tokens), ctx, windows))
    print(f"{file}: {len(tokens)} tokens; {n_windows} windows of {ctx}, the second half of each scored "
          f"({n_windows * (ctx - ctx // 2 - 1)} tokens); {threads} threads\n")
    reference = rows[0][1]
    print(f"{'':36} {'perplexity':>10} {'vs ours float32':>16} {'vs its float KV':>16} {'seconds':>8}")
    float_kv = None
    for name, ppl, seconds, kv_dtype in rows:
        float_kv = ppl if kv_dtype == "auto" else float_kv  # the same weights' float-cache row comes just before
        against = f"{100 * (ppl / float_kv - 1):>+15.3f}%" if kv_dtype != "auto" and float_kv else f"{'':>16}"
        print(f"{name:36} {ppl:>10.4f} {100 * (ppl / reference - 1):>+15.2f}% {against} {seconds:>8.1f}")


if __name__ == "__main__":
    fire.Fire(main)
