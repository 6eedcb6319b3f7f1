"""Time to first token across a chat, with the KV cache kept between turns or not; and prefill of a long
prompt with and without a warm prompt-cache file.

    python scripts/bench_session.py                    # the default model, 10 turns, 1,500-token prompt
    python scripts/bench_session.py --ckpt-dir DIR --repeats 5 --json out.json

Conversation: a scripted 10-message chat, greedy. "reuse" is llama-chat as it runs (a Session kept between
turns: only the new tokens are fed). "no reuse" feeds each turn's whole prompt into a fresh cache (llama-chat
before sessions); "no kv cache" feeds it without a cache (--no-kv-cache). Time to first token counts from
the user's message to the first new token, the dialog's encoding included. The last two modes run each
turn's prompt (taken from the reuse run) for one token only, which is all that time to first token needs;
their first token is checked to equal the reuse run's.

Long prompt: a 1,500-token prompt prefilled from nothing, against the same run that first loads a
prompt-cache file (reading and checking it, the model identity included) holding the whole prompt, or its
first 1,400 tokens.
"""

import argparse
import json
import platform
import statistics
import tempfile
import time
from pathlib import Path

import torch

from llama import Llama
from llama.chat.conversation import Conversation
from llama.io.identity import model_identity
from llama.io.prompt_cache import load_prompt_cache, restore, save_prompt_cache
from llama.nn.session import Session

MESSAGES = [
    "Hi! Can you help me plan a short trip to Paris?",
    "What are three museums I should not miss?",
    "Which of them is best for a rainy afternoon?",
    "How do I get there from the Eiffel Tower?",
    "What should I eat nearby for lunch?",
    "Is it expensive?",
    "What is a good dessert to try?",
    "Can you suggest an evening walk?",
    "How late is the metro open?",
    "Thanks! Summarise the plan in two lines.",
]
REPORT_TURNS = (1, 5, 10)


def conversation_ttft(llama: Llama, max_gen_len: int):
    """Per turn: (reuse ttft, no-reuse ttft, no-cache ttft, tokens reused, prompt tokens)."""
    chat = Conversation(llama, max_gen_len=max_gen_len)
    rows = []
    for text in MESSAGES:
        stamps = []
        t0 = time.perf_counter()
        turn = chat.prepare(text)
        reply = chat.respond(turn, temperature=0, on_step=lambda pos, tok: stamps.append(time.perf_counter()))
        reuse = stamps[0] - t0
        first = None
        others = []
        for kv_cache in (True, False):
            t0 = time.perf_counter()
            prompt = llama.dialog_tokens(turn.dialog)
            (out,), _ = llama.generate([prompt], 1, temperature=0, kv_cache=kv_cache)
            others.append(time.perf_counter() - t0)
            first = out[:1]
            assert first == reply.tokens[:1], "the first token differs between modes"
        rows.append((reuse, others[0], others[1], reply.reused, len(turn.prompt)))
    return rows


def long_prompt_tokens(llama: Llama, n: int):
    text = " ".join(f"Paragraph {i}: the committee met on day {i * 7 % 31 + 1} to discuss item {i * 13 % 97}, "
                    f"and agreed to revisit it after {i % 5 + 2} weeks." for i in range(400))
    tokens = llama.tokenizer.encode(text, bos=True, eos=False)
    assert len(tokens) >= n, "the synthetic text is too short"
    return tokens[:n]


def prefill_with_file(llama: Llama, prompt, path: Path) -> float:
    t0 = time.perf_counter()
    session = Session(llama.model)
    restore(session, load_prompt_cache(path, model_identity(llama), llama.model.n_layers))
    llama.generate([prompt], 1, temperature=0, session=session)
    return time.perf_counter() - t0


def _summary(seconds):
    """Milliseconds: the minimum (the run least disturbed by other work on the machine), median and all."""
    ms = [1000 * s for s in seconds]
    return {"min_ms": min(ms), "median_ms": statistics.median(ms), "all_ms": ms}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ckpt-dir", default=None)
    parser.add_argument("--max-gen-len", type=int, default=32)
    parser.add_argument("--prompt-tokens", type=int, default=1500)
    parser.add_argument("--shared-tokens", type=int, default=1400)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", default=None, help="also write the figures to this file")
    args = parser.parse_args()
    if args.ckpt_dir is None:
        from llama.convert.fetch import default_model_dir

        args.ckpt_dir = default_model_dir()
    llama = Llama.build(args.ckpt_dir, max_seq_len=2048, max_batch_size=1, device="cpu", dtype="float32",
                        compile=False)
    llama.generate([llama.tokenizer.encode("Warm up.", bos=True, eos=False)], 4, temperature=0)

    runs = [conversation_ttft(llama, args.max_gen_len) for _ in range(args.repeats)]
    turns = {}
    for t in REPORT_TURNS:
        per = [r[t - 1] for r in runs]
        turns[t] = {"prompt_tokens": per[0][4], "reused_tokens": per[0][3]}
        for i, mode in enumerate(("reuse", "no_reuse", "no_kv_cache")):
            turns[t][mode] = _summary([p[i] for p in per])

    prompt = long_prompt_tokens(llama, args.prompt_tokens)
    cold = []
    with tempfile.TemporaryDirectory() as tmp:
        files = {}
        for name, n in (("whole", len(prompt)), ("prefix", args.shared_tokens)):
            session = Session(llama.model)
            llama.generate([prompt[:n]], 1, temperature=0, session=session)
            session.keep(n)
            files[name] = save_prompt_cache(Path(tmp) / f"{name}.kv", session, model_identity(llama))
        warm = {name: [] for name in files}
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            llama.generate([prompt], 1, temperature=0)
            cold.append(time.perf_counter() - t0)
            for name, path in files.items():
                warm[name].append(prefill_with_file(llama, prompt, path))
        file_mb = {name: path.stat().st_size / 1e6 for name, path in files.items()}

    result = {
        "model": str(args.ckpt_dir), "cpu": platform.processor() or platform.machine(),
        "threads": torch.get_num_threads(), "max_gen_len": args.max_gen_len, "repeats": args.repeats,
        "ttft": turns,
        "long_prompt": {"tokens": len(prompt), "cold": _summary(cold), "warm_whole": _summary(warm["whole"]),
                        "warm_prefix": _summary(warm["prefix"]), "shared_tokens": args.shared_tokens,
                        "file_mb": file_mb},
    }
    cell = lambda s: f"{s['min_ms']:.0f} ({s['median_ms']:.0f})"  # noqa: E731
    print(f"time to first token, ms: min (median) of {args.repeats}")
    print("| turn | prompt tokens | reused | reuse | no reuse | --no-kv-cache |")
    print("|---:|---:|---:|---:|---:|---:|")
    for t, row in turns.items():
        print(f"| {t} | {row['prompt_tokens']} | {row['reused_tokens']} | {cell(row['reuse'])} | "
              f"{cell(row['no_reuse'])} | {cell(row['no_kv_cache'])} |")
    lp = result["long_prompt"]
    print()
    print(f"| {lp['tokens']}-token prompt | time to first token, ms |")
    print("|---|---:|")
    print(f"| no prompt-cache file | {cell(lp['cold'])} |")
    print(f"| warm file holding the whole prompt ({file_mb['whole']:.0f} MB) | {cell(lp['warm_whole'])} |")
    print(f"| warm file holding its first {args.shared_tokens} tokens ({file_mb['prefix']:.0f} MB) | "
          f"{cell(lp['warm_prefix'])} |")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
