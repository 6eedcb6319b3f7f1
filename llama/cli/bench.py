"""llama-bench: what the KV cache does to speed, measured: a table, CSV, JSON and a plot."""

import csv
import io
import json
import platform
import sys
import time
from datetime import datetime, timezone
from dataclasses import replace
from pathlib import Path
from typing import List

import torch

from llama.eval.speed import Run, measure
from llama.cli.common import fail, run, whole_numbers
from llama.cli.flags import with_model_flags
from llama.cli.flags import model_flags
from llama.cli.loading import build_from_flags, is_main_rank
from llama.runtime.files import write_atomically

DEFAULT_LENGTHS = (32, 64, 128, 256, 512, 1024)


def _progress(text: str) -> None:
    if sys.stderr.isatty():
        print(f"\r\033[K{text}", end="", file=sys.stderr, flush=True)
    else:
        print(text, file=sys.stderr, flush=True)


@with_model_flags
def main(
    ckpt_dir: str = None,
    tokenizer_path: str = None,
    lengths=",".join(map(str, DEFAULT_LENGTHS)),
    batch_sizes="1",
    prompt: str = "The history of the printing press begins",
    time_budget: float = 300.0,
    modes: str = "cache,no-cache",
    max_seq_len: int = 2048,
    device: str = None,
    dtype: str = None,
    out_dir: str = "bench-out",
    plot: bool = True,
    warmup: int = 8,
    compile: bool = False,
    no_compile: bool = False,
    quantize: str = None,
    quant_kernels: str = "integer",
    model: str = None,
):
    """Generate with and without the KV cache over a sweep of lengths and report what each costs.

    For each batch size and mode, one greedy run produces the longest length (stop tokens ignored), every
    step timed; the time to each shorter length is read off the same run. The uncached mode's work grows
    with position, so each run stops once --time-budget seconds have passed and reports how far it got.

    Examples:
        llama-bench                                   # the default model, lengths 32..1024, batch 1
        llama-bench --lengths 32,128,256 --batch-sizes 1,4,16 --time-budget 120
        llama-bench --ckpt-dir llama-2-7b --device cuda --lengths 128,512,2048

    Args:
        <model flags>
        lengths: comma-separated numbers of new tokens to report (capped by max_seq_len).
        batch_sizes: comma-separated batch sizes, e.g. 1,4,16.
        prompt: the prompt every row starts from.
        time_budget: seconds one run may take before it stops early.
        modes: cache, no-cache, or both (comma-separated).
        max_seq_len: the context limit; prompt plus the longest length must fit.
        out_dir: where bench.csv, bench.json and bench.png are written.
        plot: draw bench.png (needs matplotlib).
        warmup: tokens generated once before measuring, to settle kernels and allocators (and to load or
            compile every batch size's step before the clock starts).
        compile: compile every step: the uncached ones and any on a GPU with torch.compile (minutes).
            Without it, the cached steps on the CPU run the stored compiled step, as every command's do
            (built once per model shape and batch size, then loaded from $LLAMA_HOME), and the uncached ones
            run eagerly; the table says which step each mode ran.
        no_compile: run every step eagerly, as the plain reference model does.
    """
    lengths = whole_numbers(lengths, "--lengths")
    batch_sizes = whole_numbers(batch_sizes, "--batch-sizes")
    mode_names = [m.strip() for m in str(modes).split(",") if m.strip()]
    if not mode_names or set(mode_names) - {"cache", "no-cache"}:
        fail(f"--modes takes cache, no-cache or both, not {modes!r}")
    if time_budget <= 0:
        fail(f"--time-budget must be positive, not {time_budget}")

    flags = model_flags(ckpt_dir, tokenizer_path, device, dtype, quantize, quant_kernels, model, "auto", compile,
                        no_compile, no_kv_cache=mode_names == ["no-cache"])
    llama = build_from_flags(replace(flags, max_seq_len=max_seq_len, max_batch_size=max(batch_sizes),
                                     compile_batch_size=batch_sizes[0]))
    prompt_tokens = llama.tokenizer.encode(str(prompt), bos=True, eos=False)
    longest = min(max(lengths), max_seq_len - len(prompt_tokens))
    if longest < 1:
        fail(f"the prompt ({len(prompt_tokens)} tokens) leaves no room in --max-seq-len {max_seq_len}")
    lengths = [n for n in lengths if n <= longest] or [longest]
    main_rank = is_main_rank(llama)

    if warmup:
        for bsz in batch_sizes:
            for mode in mode_names:
                measure(llama, prompt_tokens, bsz, warmup, mode == "cache")
    runs: List[Run] = []
    for bsz in batch_sizes:
        for mode in mode_names:
            kv = mode == "cache"
            if main_rank:
                _progress(f"batch {bsz}, {mode}: generating {longest} tokens ...")
            deadline = time.perf_counter() + time_budget
            result = measure(llama, prompt_tokens, bsz, longest, kv, deadline=deadline)
            runs.append(result)
            if main_rank:
                note = " (time budget reached)" if result.out_of_time else ""
                _progress(f"batch {bsz}, {mode}: {result.new_tokens} tokens in {result.total_s:.1f} s{note}")
                if sys.stderr.isatty():
                    print(file=sys.stderr)
    if not main_rank:
        return

    rows = _rows(runs, lengths, {kv: step_kind(llama, kv) for kv in (True, False)})
    _print_table(rows)
    out = Path(str(out_dir))
    out.mkdir(parents=True, exist_ok=True)
    meta = _environment(llama, ckpt_dir, prompt_tokens)
    write_atomically(out / "bench.csv", _csv_text(rows))
    write_atomically(out / "bench.json", json.dumps({"environment": meta, "rows": rows,
                                                      "runs": [r.to_dict() for r in runs]}, indent=1))
    written = [out / "bench.csv", out / "bench.json"]
    if plot:
        png = _plot(runs, lengths, out / "bench.png", meta)
        if png:
            written.append(png)
    print("wrote " + ", ".join(str(p) for p in written), file=sys.stderr)


def step_kind(llama, kv_cache: bool) -> str:
    """The decode step a mode runs: "compiled" (the stored one), "torch.compile" or "eager"."""
    step = llama.compiled_step
    if step is None:
        return "eager"
    if kv_cache and step.ahead_of_time is not None:
        return "compiled"
    return "eager" if step.eager_otherwise else "torch.compile"


def _rows(runs: List[Run], lengths: List[int], steps: dict) -> List[dict]:
    rows = []
    by_key = {(r.batch_size, r.kv_cache): r for r in runs}
    for r in runs:
        for n in lengths:
            total = r.time_to(n)
            other = by_key.get((r.batch_size, not r.kv_cache))
            other_total = other.time_to(n) if other else None
            speedup = None
            if r.kv_cache and total and other_total:
                speedup = round(other_total / total, 2)
            rows.append({
                "batch_size": r.batch_size,
                "kv_cache": r.kv_cache,
                "step": steps[r.kv_cache],
                "new_tokens": n,
                "prompt_tokens": r.prompt_tokens,
                "prefill_ms": round(1000 * r.prefill_s, 2),
                "total_s": round(total, 4) if total is not None else None,
                "decode_tokens_per_s": round(r.decode_tokens_per_s(n), 2) if total is not None else None,
                "last_token_ms": round(1000 * r.step_s[n - 2], 2) if total is not None and n >= 2 else None,
                "speedup_vs_no_cache": speedup,
                "peak_memory_mib": round(r.peak_memory_bytes / 2**20, 1),
                "kv_cache_bytes": r.kv_cache_bytes,
            })
    return rows


def _print_table(rows: List[dict]) -> None:
    header = ["batch", "kv cache", "step", "new tokens", "prefill ms", "total s", "decode tok/s", "last token ms",
              "speedup", "peak MiB", "kv cache MiB"]
    lines = [header]
    for row in rows:
        def fmt(v, spec):
            return "-" if v is None else format(v, spec)
        lines.append([str(row["batch_size"]), "on" if row["kv_cache"] else "off", row["step"], str(row["new_tokens"]),
                      fmt(row["prefill_ms"], ".1f"), fmt(row["total_s"], ".2f"), fmt(row["decode_tokens_per_s"], ".1f"),
                      fmt(row["last_token_ms"], ".1f"),
                      fmt(row["speedup_vs_no_cache"], ".1f") + ("x" if row["speedup_vs_no_cache"] else ""),
                      fmt(row["peak_memory_mib"], ".0f"), fmt(row["kv_cache_bytes"] / 2**20, ".2f")])
    widths = [max(len(line[i]) for line in lines) for i in range(len(header))]
    for k, line in enumerate(lines):
        print("  ".join(cell.rjust(w) for cell, w in zip(line, widths)))
        if k == 0:
            print("  ".join("-" * w for w in widths))


def _csv_text(rows: List[dict]) -> str:
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=list(rows[0]))
    writer.writeheader()
    writer.writerows(rows)
    return buf.getvalue()


def _environment(llama, ckpt_dir, prompt_tokens) -> dict:
    device = llama.device
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else (platform.processor() or platform.machine())
    return {
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "checkpoint": str(ckpt_dir) if ckpt_dir else "default model",
        "device": f"{device} ({name})",
        "threads": torch.get_num_threads(),
        "dtype": str(llama.model.dtype).removeprefix("torch."),
        "quantization": llama.info.quantization,
        "steps": {"cache": step_kind(llama, True), "no-cache": step_kind(llama, False)},
        "torch": torch.__version__,
        "python": platform.python_version(),
        "prompt_tokens": len(prompt_tokens),
        "parameters": sum(p.numel() for p in llama.model.parameters()),
    }


def _plot(runs: List[Run], lengths: List[int], path: Path, meta: dict):
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("note: matplotlib is not installed; skipping bench.png (pip install matplotlib)", file=sys.stderr)
        return None
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    for r in runs:
        positions = [r.prompt_tokens + i + 1 for i in range(len(r.step_s))]
        label = f"{'KV cache' if r.kv_cache else 'no cache'}, batch {r.batch_size}"
        ax1.plot(positions, [1000 * s for s in r.step_s], label=label, linewidth=1,
                 linestyle="-" if r.kv_cache else "--")
    ax1.set_xlabel("position of the token being generated")
    ax1.set_ylabel("latency per token (ms)")
    ax1.set_title("Per-token latency")
    ax1.set_yscale("log")
    ax1.grid(True, alpha=0.3)
    ax1.legend()
    by_key = {(r.batch_size, r.kv_cache): r for r in runs}
    for bsz in sorted({r.batch_size for r in runs}):
        cached, uncached = by_key.get((bsz, True)), by_key.get((bsz, False))
        if not (cached and uncached):
            continue
        ns = [n for n in range(2, cached.new_tokens + 1) if uncached.time_to(n) and cached.time_to(n)]
        ax2.plot(ns, [uncached.time_to(n) / cached.time_to(n) for n in ns], label=f"batch {bsz}")
    ax2.set_xlabel("new tokens generated")
    ax2.set_ylabel("time without cache / time with cache")
    ax2.set_title("Speedup from the KV cache")
    ax2.grid(True, alpha=0.3)
    if ax2.lines:
        ax2.legend()
    steps = meta["steps"]
    compiled = "" if set(steps.values()) == {"eager"} else \
        f", steps: cache {steps['cache']}, no cache {steps['no-cache']}"
    quant = f" {meta['quantization']}" if meta.get('quantization') else ""
    fig.suptitle(f"{meta['checkpoint']} - {meta['device']}, {meta['dtype']}{quant}{compiled}, {meta['threads']} threads, "
                 f"torch {meta['torch']}", fontsize=9)
    fig.tight_layout()
    png = io.BytesIO()
    fig.savefig(png, format="png", dpi=110)
    plt.close(fig)
    return write_atomically(path, png.getvalue())


def cli() -> None:
    run(main, "llama-bench", raw_string_flags=("--prompt",))


if __name__ == "__main__":
    cli()
