"""Decode speed with and without speculative decoding (prompt lookup), on the prompts shipped in data/speculative/.

    python scripts/bench_speculative.py [--quantize none,int8,int4] [--draft_tokens 4] [--max_gen_len 128]
        [--threads 2] [--limit N] [--kinds grounded,chat] [--draft_quantize int4] [--llamacpp]

The default model (SmolLM2-135M-Instruct) answers every prompt in its chat format, greedily, at batch 1, with the
stored compiled steps (built before any timing), once plainly and once with `speculate="ngram"`, the two runs
alternating so that drift in the machine's speed hits both alike. Every speculative answer must equal the plain
one token for token (the script stops otherwise). Decode tokens/s counts the tokens after the first, timed with a
timestamp per token, summed over a kind's prompts; "kept" is the share of drafted tokens kept, and "a check" the
tokens a checking step yields (the drafted tokens kept and the model's own after them). With --draft_quantize, a
third run drafts with a copy of the model quantized so (`DraftModel`, `--draft-model`) instead of prompt lookup.

With --llamacpp, llama.cpp's own prompt lookup runs beside ours on every prompt: its `llama-lookup` example (built once
from the llama-cpp-python sdist's vendored tree, as scripts/bench_server.py builds its server; cmake and a C++
compiler needed), on a GGUF of the same weights (F32, Q8_0, Q4_0 for float32, int8, int4, made by its own quantizer
from the shipped file), given the same chat-formatted prompt, greedy, with `--spec-draft-n-max 0` (no drafts: its
plain decode, through the same loop) and with `--spec-draft-n-max` K. Its tokens/s is its own "decoded" figure
(tokens over the seconds after the prompt); each process loads the model anew, outside that figure.

data/speculative/grounded.jsonl holds input-grounded prompts (passages of Alice's Adventures in Wonderland to
repeat, rewrite or summarise; functions of this project to edit or explain), chat.jsonl open-ended ones.
"""

import argparse
import json
import re
import subprocess
import time
from pathlib import Path

import torch

from llama import Llama
from llama.convert.fetch import default_model_dir
from llama.speculative import DraftModel, SpeculationStats

DATA = Path(__file__).resolve().parent.parent / "data" / "speculative"


def timed(llama: Llama, prompt, max_gen_len: int, **kwargs):
    """(tokens, decode seconds after the first token) of one greedy answer."""
    stamps = []
    (tokens,), _ = llama.generate([prompt], max_gen_len, temperature=0, on_step=lambda *_: stamps.append(time.perf_counter()),
                                  **kwargs)
    return tokens, (stamps[-1] - stamps[0] if len(stamps) > 1 else 0.0)


def chatml_text(llama: Llama, messages) -> str:
    """The prompt `llama.dialog_tokens(messages)` encodes, as text with its tags, for llama.cpp to tokenize."""
    system = getattr(llama.tokenizer, "default_system_prompt", None)
    if messages[0]["role"] != "system" and system is not None:
        messages = [{"role": "system", "content": system}, *messages]
    turns = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages)
    return turns + "<|im_start|>assistant\n"


def lcpp_lookup(binary: Path, gguf: Path, prompt: str, max_gen_len: int, draft_tokens: int, threads: int):
    """(tokens, decode seconds, drafted, kept) of one greedy answer by llama.cpp's llama-lookup."""
    out = subprocess.run([str(binary), "-m", str(gguf), "-p", prompt, "-n", str(max_gen_len), "-c", "2048",
                          "--temp", "0", "-t", str(threads), "-tb", str(threads),
                          "--spec-draft-n-max", str(draft_tokens)],
                         capture_output=True, text=True)
    log = out.stdout + out.stderr
    decoded = re.search(r"decoded\s+(\d+) tokens in\s+([\d.]+) seconds", log)
    if out.returncode != 0 or decoded is None:
        raise SystemExit(f"llama-lookup failed ({out.returncode}): {log[-400:]}")
    drafted = re.search(r"n_drafted\s+=\s+(\d+)", log)
    kept = re.search(r"n_accept\s+=\s+(\d+)", log)
    return (int(decoded.group(1)), float(decoded.group(2)), int(drafted.group(1)) if drafted else 0,
            int(kept.group(1)) if kept else 0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quantize", default="none,int8,int4")
    parser.add_argument("--draft_tokens", type=int, default=4)
    parser.add_argument("--max_gen_len", type=int, default=128)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--limit", type=int, default=0, help="prompts of each kind (0: all)")
    parser.add_argument("--kinds", default="grounded,chat")
    parser.add_argument("--draft_quantize", default=None, help="also draft with a copy of the model quantized so")
    parser.add_argument("--llamacpp", action="store_true", help="llama.cpp's llama-lookup beside ours")
    parser.add_argument("--cache_dir", default=None, help="where llama.cpp is built (scripts/bench_server.py's)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    rows, lcpp_rows = [], []
    if args.llamacpp:
        import os

        from bench_server import GGUF_TYPES, build_llama_cpp, f32_gguf

        cache = Path(args.cache_dir or Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache"))
                     / "llama-kv-bench-server")
        bin_dir = build_llama_cpp(cache, args.threads, targets=("llama-lookup", "llama-quantize"))
    for quantize in args.quantize.split(","):
        llama = Llama.build(default_model_dir(), max_seq_len=2048, max_batch_size=1, compile=True,
                            quantize=None if quantize == "none" else quantize)
        warm = llama.dialog_tokens([{"role": "user", "content": "one two three one two three one two three"}])
        llama.generate([warm], 16, temperature=0, speculate="ngram", draft_tokens=args.draft_tokens)  # builds its step
        draft = None
        if args.draft_quantize:
            draft = Llama.build(default_model_dir(), max_seq_len=2048, max_batch_size=1, compile=True,
                                quantize=args.draft_quantize)
        ways = {"spec": lambda: {"speculate": "ngram", "draft_tokens": args.draft_tokens}}
        if draft is not None:
            ways["draft"] = lambda: {"speculate": DraftModel(draft, llama), "draft_tokens": args.draft_tokens}
        gguf = f32_gguf(bin_dir, cache, args.threads, GGUF_TYPES[quantize]) if args.llamacpp else None
        for kind in args.kinds.split(","):
            records = [json.loads(line) for line in (DATA / f"{kind}.jsonl").read_text(encoding="utf-8").splitlines()]
            records = records[: args.limit] if args.limit else records
            seconds = {w: 0.0 for w in ["plain", *ways]}
            counts = {w: 0 for w in seconds}
            stats = {w: SpeculationStats() for w in ways}
            lcpp = {k: [0, 0.0, 0, 0] for k in (0, args.draft_tokens)}  # drafts at most: tokens, seconds, drafted, kept
            for i, record in enumerate(records):
                prompt = llama.dialog_tokens(record["messages"])
                if gguf is not None:
                    for k in lcpp if i % 2 == 0 else list(lcpp)[::-1]:
                        got = lcpp_lookup(bin_dir / "llama-lookup", gguf, chatml_text(llama, record["messages"]),
                                          args.max_gen_len, k, args.threads)
                        lcpp[k] = [a + b for a, b in zip(lcpp[k], got)]
                order = list(seconds) if i % 2 == 0 else list(seconds)[::-1]
                out = {}
                for which in order:
                    out[which] = timed(llama, prompt, args.max_gen_len, **(ways[which]() if which in ways else {}))
                    if which in ways:
                        stats[which].add(llama.last_speculation)
                for which in ways:
                    if out[which][0] != out["plain"][0]:
                        raise SystemExit(f"{quantize} {kind} prompt {i}: {which} changed the answer")
                for which in seconds:
                    seconds[which] += out[which][1]
                    counts[which] += len(out[which][0]) - 1
            tps = {w: counts[w] / seconds[w] for w in seconds}
            if gguf is not None:
                plain, spec = lcpp[0], lcpp[args.draft_tokens]
                lcpp_rows.append((GGUF_TYPES[quantize], kind, len(records), plain[0] / plain[1], spec[0] / spec[1],
                                  spec[3] / max(spec[2], 1)))
                print(f"llama.cpp {GGUF_TYPES[quantize]:>4} {kind:>8}: {plain[0] / plain[1]:6.1f} -> "
                      f"{spec[0] / spec[1]:6.1f} tokens/s ({plain[1] / plain[0] * spec[0] / spec[1]:.2f}x), "
                      f"{spec[3]} of {spec[2]} drafted kept", flush=True)
            for which in ways:
                rows.append((quantize, kind, which, len(records), tps["plain"], tps[which], stats[which]))
                print(f"{quantize:>5} {kind:>8} {which:>5}: {tps['plain']:6.1f} -> {tps[which]:6.1f} tokens/s "
                      f"({tps[which] / tps['plain']:.2f}x), {stats[which].describe()}", flush=True)
    print("\n| weights | prompts | drafts | plain tokens/s | speculative tokens/s | speedup | drafted tokens kept | "
          "tokens a check |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for quantize, kind, which, n, plain_tps, spec_tps, stats in rows:
        weights = "float32" if quantize == "none" else quantize
        drafts = "prompt lookup" if which == "spec" else f"{args.draft_quantize} copy"
        print(f"| {weights} | {kind} ({n}) | {drafts} | {plain_tps:.1f} | {spec_tps:.1f} | {spec_tps / plain_tps:.2f}x | "
              f"{stats.acceptance:.0%} | {stats.tokens_per_check:.2f} |")
    if lcpp_rows:
        print("\n| llama.cpp weights | prompts | plain tokens/s | llama-lookup tokens/s | speedup | "
              "drafted tokens kept |")
        print("| --- | --- | --- | --- | --- | --- |")
        for gguf_type, kind, n, plain_tps, spec_tps, kept in lcpp_rows:
            print(f"| {gguf_type} | {kind} ({n}) | {plain_tps:.1f} | {spec_tps:.1f} | "
                  f"{spec_tps / plain_tps:.2f}x | {kept:.0%} |")


if __name__ == "__main__":
    main()
