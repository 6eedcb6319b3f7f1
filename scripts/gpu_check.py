"""The steps of scripts/gpu_check.sh that run Python: each adds its figures to one JSON file as soon as it has them.

    python scripts/gpu_check.py machine --json-file F
    python scripts/gpu_check.py tests --json-file F [--dry-run]
    python scripts/gpu_check.py equivalence --json-file F --device cuda
    python scripts/gpu_check.py speed --json-file F --ckpt-dir DIR --device cuda
        [--runs eager,ttft,transformers,int8,int4] [--new-tokens 64] [--prompt-tokens 2000] [--batches 1,8] [--copy-gb 4] [--budget-s 150]
    python scripts/gpu_check.py speed --json-file F --ckpt-dir DIR --device cuda --runs compile
    python scripts/gpu_check.py server --json-file F --ckpt-dir DIR [--clients 1,8,32] [--requests 2]
    python scripts/gpu_check.py record --json-file F --key steps.NAME --value '{"status": "ok", "seconds": 12}'
    python scripts/gpu_check.py summary --json-file F

machine: the device, torch, CUDA, transformers and Python versions, TF32's switches.
tests: on a GPU `pytest -m cuda` (tests/test_cuda.py and the like: the cache's promises on CUDA, float32 at the CPU's
tolerance, bf16 against the float32 reference, the quantized layers, the compiled step, the server's batched steps,
the commands);
with --dry-run their CPU counterparts in tests/test_kv_cache_equivalence.py. It records each test's outcome.
equivalence: a tiny random model on --device, cached against uncached logits at every position (float32, TF32 off,
within the CPU's 1e-5), bf16 both ways against the float32 reference (within 5% of the logits' scale, the same top
token wherever float32 has a clear one), and greedy tokens with the cache and without: the differences themselves.
speed: decode tokens/s with llama.eval.speed.measure (one warm-up run first) at each batch, with the cache and without,
in --dtype, eager; time to the first token of a --prompt-tokens prompt; transformers' LlamaForCausalLM on the same
weights (decode at each batch, the same prompt's first token, and how far its logits are from ours); --quantize int8
and int4 at batch 1; with --runs compile, the torch.compile step at batch 1 (its compilation timed apart). Peak
memory is torch.cuda.max_memory_allocated on a GPU, the resident set on the CPU. The roofline is the bytes of weights
read per token (all but the embedding) over the bandwidth of a timed copy of --copy-gb on the same device.
server: llama-server under scripts/bench_server.py's load (streamed chat requests, 32 to 128 tokens each) at each
number of clients: tokens/s and time to first token.
"""

import gc
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ElementTree
from pathlib import Path
from typing import Any, Dict, List, Optional

import fire

REPO = Path(__file__).resolve().parent.parent
GIB = 1 << 30


# The JSON file, written whole after every figure so that a run stopped at any point leaves what it measured.

def read_json(path: Path) -> Dict[str, Any]:
    return json.loads(path.read_text()) if path.exists() else {}


def record(path: Path, key: str, value: Any) -> None:
    """Set `key` ("a.b" for a nested one) in the JSON file at `path`, replacing the file in one step."""
    data = read_json(path)
    *parents, last = key.split(".")
    node = data
    for name in parents:
        node = node.setdefault(name, {})
    node[last] = value
    partial = path.with_name(path.name + ".partial")
    partial.write_text(json.dumps(data, indent=1) + "\n")
    partial.replace(path)


def append(path: Path, key: str, row: Dict[str, Any]) -> None:
    record(path, key, read_json(path).get(key, []) + [row])


def say(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)


# machine

def machine_facts() -> Dict[str, Any]:
    import platform

    import torch

    facts = {"python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda,
             "cpu_count": os.cpu_count(), "tf32_matmul": torch.backends.cuda.matmul.allow_tf32,
             "tf32_cudnn": torch.backends.cudnn.allow_tf32}
    try:
        import transformers

        facts["transformers"] = transformers.__version__
    except ImportError:
        facts["transformers"] = None
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        facts.update(device=props.name, gpu_memory_gib=round(props.total_memory / GIB, 1),
                     capability=f"{props.major}.{props.minor}", multiprocessors=props.multi_processor_count)
        try:
            facts["driver"] = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                             capture_output=True, text=True, timeout=30).stdout.strip() or None
        except (OSError, subprocess.SubprocessError):
            facts["driver"] = None
    else:
        facts["device"] = "cpu: " + (platform.processor() or platform.machine())
    return facts


# tests

def junit_outcomes(xml_file: Path) -> Dict[str, str]:
    """Each test case's outcome in a pytest JUnit XML report: passed, failed, error or skipped."""
    outcomes = {}
    for case in ElementTree.parse(xml_file).iter("testcase"):
        name = f"{case.get('classname', '')}::{case.get('name')}"
        kinds = {child.tag for child in case}
        outcomes[name] = next((k for k, tag in (("failed", "failure"), ("error", "error"), ("skipped", "skipped"))
                               if tag in kinds), "passed")
    return outcomes


def run_tests(json_path: Path, dry_run: bool) -> bool:
    if dry_run:  # the CPU's versions of what the GPU run proves: the cache's logits and bf16 against float32
        selection = ["tests/test_kv_cache_equivalence.py", "-k",
                     "cached_logits_equal_uncached_at_every_position or bf16_stays_close"]
    else:
        selection = ["-m", "cuda"]
    with tempfile.TemporaryDirectory() as tmp:
        xml_file = Path(tmp) / "junit.xml"
        # In one process (no pyproject.toml addopts, whose -n asks for pytest-xdist): the tests share one GPU, and
        # the GPU machine has pytest alone.
        cmd = [sys.executable, "-m", "pytest", "-o", "addopts=", "-q", "-rfEs", f"--junitxml={xml_file}", *selection]
        say("pytest " + " ".join(selection))
        start = time.perf_counter()
        status = subprocess.run(cmd, cwd=REPO).returncode
        outcomes = junit_outcomes(xml_file) if xml_file.exists() else {}
    counts = {kind: sum(o == kind for o in outcomes.values()) for kind in ("passed", "failed", "error", "skipped")}
    ok = status == 0 and counts["passed"] > 0 and not counts["failed"] and not counts["error"]
    record(json_path, "tests", {"command": "python -m pytest " + " ".join(selection), "exit_status": status, **counts,
                                "seconds": round(time.perf_counter() - start, 1), "cases": outcomes, "ok": ok})
    return ok


# equivalence

def tiny_checkpoint(dest: Path) -> Path:
    """The tests' tiny shape (2 layers, dim 64, 8 heads sharing 2 KV heads), drawn with their larger scale (0.1), so
    that greedy tokens are not decided by near-ties."""
    from llama.io.checkpoint import model_args
    from llama.io.random_weights import PRESETS, write_random_checkpoint
    from llama.tokenizer import Tokenizer

    tokenizer = REPO / "tokenizer.model.example"
    vocab = Tokenizer(str(tokenizer)).n_words
    args = model_args(PRESETS["tiny"], max_seq_len=64, max_batch_size=8, tokenizer_vocab=vocab)
    path, _ = write_random_checkpoint(dest, args, seed=0, tokenizer_path=tokenizer, std=0.1)
    return path


def cached_and_uncached(model, tokens, prefill: int):
    """Logits at every position: one uncached pass, and a prefill then one token a step with the cache."""
    import torch

    tokens = tokens.to(model.device)
    batch, length = tokens.shape
    with torch.inference_mode():
        uncached = model(tokens)
        cache = model.new_kv_cache(batch, length)
        pieces = [model(tokens[:, :prefill], 0, cache)]
        pieces += [model(tokens[:, pos:pos + 1], pos, cache) for pos in range(prefill, length)]
    return torch.cat(pieces, dim=1).float().cpu(), uncached.float().cpu()


def equivalence(json_path: Path, device: str) -> bool:
    import torch

    from llama import Llama

    if torch.device(device).type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = False  # PyTorch's default, stated: float32 held to the CPU's bound
        torch.backends.cudnn.allow_tf32 = False
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = tiny_checkpoint(Path(tmp) / "tiny")
        f32 = Llama.build(ckpt, max_seq_len=64, max_batch_size=8, device=device, dtype="float32", compile=False)
        bf16 = Llama.build(ckpt, max_seq_len=64, max_batch_size=8, device=device, dtype="bfloat16", compile=False)
    vocab = f32.model.vocab_size
    tokens = torch.randint(0, vocab, (3, 40), generator=torch.Generator().manual_seed(1))
    cached, uncached = cached_and_uncached(f32.model, tokens, prefill=12)
    f32_diff = (cached - uncached).abs().max().item()

    tokens = torch.randint(0, vocab, (8, 64), generator=torch.Generator().manual_seed(4))
    _, reference = cached_and_uncached(f32.model, tokens, prefill=32)
    bf16_cached, bf16_uncached = cached_and_uncached(bf16.model, tokens, prefill=32)
    scale = reference.abs().max().item()
    top2 = reference.topk(2, dim=-1).values
    clear = (top2[..., 0] - top2[..., 1]) > 0.1 * scale  # positions where float32's top token is not near a tie
    bf16_diffs = {name: (got - reference).abs().max().item() for name, got in (("cached", bf16_cached),
                                                                              ("uncached", bf16_uncached))}
    top_agrees = all(torch.equal(got.argmax(-1)[clear], reference.argmax(-1)[clear])
                     for got in (bf16_cached, bf16_uncached))

    prompts = [[1, 306, 465, 278], [1, 150], [1, 2172, 386, 2989, 920]]
    runs = [f32.generate(prompts, 20, temperature=0, kv_cache=kv, ignore_stop=True)[0] for kv in (True, False)]
    result = {
        "device": device,
        "tf32_matmul": torch.backends.cuda.matmul.allow_tf32,
        "float32": {"max_abs_diff": f32_diff, "bound": 1e-5, "ok": f32_diff <= 1e-5},
        "bfloat16": {"max_abs_diff_cached": bf16_diffs["cached"], "max_abs_diff_uncached": bf16_diffs["uncached"],
                     "logits_scale": scale, "bound": 0.05 * scale, "clear_positions": int(clear.sum()),
                     "top_token_agrees": top_agrees,
                     "ok": max(bf16_diffs.values()) <= 0.05 * scale and top_agrees and int(clear.sum()) > 0},
        "greedy_tokens_equal": runs[0] == runs[1],
    }
    result["ok"] = result["float32"]["ok"] and result["bfloat16"]["ok"] and result["greedy_tokens_equal"]
    record(json_path, "equivalence", result)
    say(f"equivalence on {device}: float32 cached against uncached {f32_diff:.2e} (bound 1e-5); bf16 against float32 "
        f"{max(bf16_diffs.values()):.3f} (bound {0.05 * scale:.3f}); greedy tokens equal: "
        f"{result['greedy_tokens_equal']}")
    return result["ok"]


# speed

def weight_bytes(model) -> int:
    """Bytes of weights read per decoded token: all but the embedding, of which a step reads one row a token."""
    return sum(t.numel() * t.element_size() for name, t in model.state_dict().items()
               if not name.startswith("tok_embeddings"))


def free(device: str) -> None:
    import torch

    gc.collect()
    if torch.device(device).type == "cuda":
        torch.cuda.empty_cache()


def decode_row(llama, name: str, prompt: List[int], batch: int, kv_cache: bool, new_tokens: int,
               deadline: float, **facts) -> Dict[str, Any]:
    """One timed run after a short warm-up of the same kind (first calls, allocations and compilations out of it)."""
    from llama.eval.speed import measure

    start = time.perf_counter()
    measure(llama, prompt, batch, 4, kv_cache)
    warmup = time.perf_counter() - start
    run = measure(llama, prompt, batch, new_tokens, kv_cache, deadline=deadline)
    row = {"name": name, "batch_size": batch, "kv_cache": kv_cache, "prompt_tokens": len(prompt),
           "new_tokens": run.new_tokens, "decode_tokens_per_s": round(run.decode_tokens_per_s(), 2),
           "prefill_s": round(run.prefill_s, 4), "peak_memory_gib": round(run.peak_memory_bytes / GIB, 3),
           "kv_cache_bytes": run.kv_cache_bytes, "warmup_s": round(warmup, 2), "out_of_time": run.out_of_time,
           **facts}
    say(f"{name}: {row['decode_tokens_per_s']} tokens/s, peak {row['peak_memory_gib']} GiB")
    return row


def first_token_row(name: str, prompt: List[int], once, repeats: int, peak) -> Dict[str, Any]:
    """Time to the first new token of `prompt` (median of `repeats` after a warm-up): `once()` returns it in seconds."""
    once()
    times = [once() for _ in range(repeats)]
    row = {"name": name, "prompt_tokens": len(prompt), "seconds": round(statistics.median(times), 4),
           "runs": [round(t, 4) for t in times], "peak_memory_gib": round(peak() / GIB, 3)}
    say(f"{name}: first token of a {len(prompt)}-token prompt in {row['seconds']} s")
    return row


def roofline(json_path: Path, ckpt: Path, device: str, dtype: str, copy_gb: float) -> float:
    """Record the copy bandwidth and the roofline of the checkpoint's shape in `dtype`; returns the bandwidth."""
    import torch
    from compare_transformers import measure_bandwidth  # this folder's, as `python scripts/gpu_check.py` runs

    from llama.io.checkpoint import expected_shapes, model_args, read_params
    from llama.tokenizer import Tokenizer

    args = model_args(read_params(ckpt), 1, 1, Tokenizer(str(ckpt / "tokenizer.model")).n_words)
    weights = torch.finfo(getattr(torch, dtype)).bits // 8 * sum(
        shape.numel() for name, shape in expected_shapes(args).items() if not name.startswith("tok_embeddings"))
    bandwidth = measure_bandwidth(int(copy_gb * 1e9), device=device)
    record(json_path, "roofline", {"copy_bytes": int(copy_gb * 1e9), "bandwidth_gb_s": round(bandwidth / 1e9, 1),
                                   "dtype": dtype, "weight_bytes_per_token": weights,
                                   "batch1_tokens_per_s": round(bandwidth / weights, 2)})
    say(f"roofline: {weights / 1e6:.1f} MB of {dtype} weights a token at {bandwidth / 1e9:.0f} GB/s copy bandwidth = "
        f"{bandwidth / weights:.1f} tokens/s at most")
    return bandwidth


def with_roofline(row: Dict[str, Any], llama, bandwidth: Optional[float]) -> Dict[str, Any]:
    if bandwidth and row["batch_size"] == 1 and row["kv_cache"]:
        row["roofline_fraction"] = round(row["decode_tokens_per_s"] * weight_bytes(llama.model) / bandwidth, 3)
    return row


def permute_rotary(w, n_heads: int):
    """Rows of a Meta wq / wk weight in transformers' order (what its conversion script's `permute` does): within a
    head, the first halves of all rotary pairs, then the second halves (the inverse of llama.convert.hf's)."""
    rows, cols = w.shape
    # (n_heads, head_dim // 2, 2, cols) -> (n_heads, 2, head_dim // 2, cols)
    return w.reshape(n_heads, rows // n_heads // 2, 2, cols).transpose(1, 2).reshape(rows, cols)


def transformers_model(ckpt: Path, device: str, dtype: str, max_seq_len: int):
    """transformers' LlamaForCausalLM holding the checkpoint's weights: the same config, the same state dict."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from llama.io.checkpoint import load_checkpoint, model_args, read_params
    from llama.tokenizer import Tokenizer

    args = model_args(read_params(ckpt), max_seq_len, 1, Tokenizer(str(ckpt / "tokenizer.model")).n_words)
    config = LlamaConfig(vocab_size=args.vocab_size, hidden_size=args.dim, intermediate_size=args.ffn_hidden_dim,
                         num_hidden_layers=args.n_layers, num_attention_heads=args.n_heads,
                         num_key_value_heads=args.n_kv_heads, rms_norm_eps=args.norm_eps, rope_theta=args.rope_theta,
                         max_position_embeddings=max_seq_len, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)
    names = {"attention.wq": "self_attn.q_proj", "attention.wk": "self_attn.k_proj", "attention.wv": "self_attn.v_proj",
             "attention.wo": "self_attn.o_proj", "feed_forward.w1": "mlp.gate_proj", "feed_forward.w2": "mlp.down_proj",
             "feed_forward.w3": "mlp.up_proj", "attention_norm": "input_layernorm",
             "ffn_norm": "post_attention_layernorm"}
    top = {"tok_embeddings": "model.embed_tokens", "norm": "model.norm", "output": "lm_head"}
    state = {}
    for name, tensor in load_checkpoint(ckpt, args).items():
        if name == "rope.freqs":  # transformers computes its own
            continue
        stem, kind = name.rsplit(".", 1)
        if stem.startswith("layers."):
            _, i, part = stem.split(".", 2)
            stem = f"model.layers.{i}.{names[part]}"
            if part == "attention.wq":
                tensor = permute_rotary(tensor, args.n_heads)
            elif part == "attention.wk":
                tensor = permute_rotary(tensor, args.n_kv_heads)
        else:
            stem = top[stem]
        state[f"{stem}.{kind}"] = tensor.to(device=device, dtype=getattr(torch, dtype))
    with torch.device(device):
        model = LlamaForCausalLM(config).to(getattr(torch, dtype))
    model.load_state_dict(state, strict=True)
    return model.eval()


def run_transformers(json_path: Path, ckpt: Path, device: str, dtype: str, prompt: List[int], long_prompt: List[int],
                     batches: List[int], new_tokens: int, ours_logits, deadline: float) -> None:
    import torch
    from compare_transformers import theirs_once

    import transformers

    from llama.eval.speed import memory_probe

    model = transformers_model(ckpt, device, dtype, len(long_prompt) + 16)
    with torch.inference_mode():
        logits = model(torch.tensor([prompt], device=device)).logits[0, -1].float().cpu()
    diff = (logits - ours_logits).abs().max().item()
    result = {"version": transformers.__version__, "dtype": dtype, "attention": model.config._attn_implementation,
              "logits_max_abs_diff": round(diff, 5), "logits_scale": round(ours_logits.abs().max().item(), 5),
              "same_top_token": int(logits.argmax()) == int(ours_logits.argmax()), "decode": []}
    record(json_path, "transformers", result)
    say(f"transformers {transformers.__version__}: last logits within {diff:.4f} of ours "
        f"(scale {result['logits_scale']:.3f})")
    for batch in batches:
        if time.perf_counter() > deadline:
            break
        theirs_once(model, prompt, 4, batch)  # warm-up
        peak = memory_probe(torch.device(device))  # resets the peak on a GPU
        rate, _, first = theirs_once(model, prompt, new_tokens, batch)
        result["decode"].append({"batch_size": batch, "new_tokens": new_tokens, "decode_tokens_per_s": round(rate, 2),
                                 "prefill_s": round(first, 4), "peak_memory_gib": round(peak() / GIB, 3)})
        record(json_path, "transformers", result)
        say(f"transformers batch {batch}: {rate:.2f} tokens/s")
    if time.perf_counter() < deadline:
        peak = memory_probe(torch.device(device))
        result["time_to_first_token"] = first_token_row("transformers", long_prompt,
                                                        lambda: theirs_once(model, long_prompt, 2)[2], 3, peak)
        record(json_path, "transformers", result)
    del model
    free(device)


def speed(json_path: Path, ckpt: Path, device: str, dtype: str, runs: List[str], new_tokens: int, prompt_tokens: int,
          batches: List[int], copy_gb: float, budget_s: float) -> bool:
    import torch

    from llama import Llama
    from llama.eval.speed import measure, memory_probe
    from llama.tokenizer import Tokenizer

    deadline = time.perf_counter() + budget_s
    build = dict(max_seq_len=prompt_tokens + 16, max_batch_size=max(batches), device=device, dtype=dtype)
    tokenizer = Tokenizer(str(ckpt / "tokenizer.model"))
    prompt = tokenizer.encode("I believe the meaning of life is", bos=True, eos=False)
    long_prompt = torch.randint(3, tokenizer.n_words, (prompt_tokens,), generator=torch.Generator().manual_seed(5))
    long_prompt = long_prompt.tolist()
    recorded = read_json(json_path).get("roofline", {}).get("bandwidth_gb_s")
    bandwidth = recorded * 1e9 if recorded else roofline(json_path, ckpt, device, dtype, copy_gb)
    llama = None

    def load(name: str, **flags):
        nonlocal llama
        llama = None
        free(device)
        say(f"loading {ckpt.name} for {name} ...")
        start = time.perf_counter()
        llama = Llama.build(ckpt, **build, **flags)
        say(f"loaded in {time.perf_counter() - start:.1f} s")

    def timed(batch: int, kv_cache: bool, compile: bool = False, quantize: Optional[str] = None) -> None:
        name = (f"{dtype} batch {batch}, cache " + ("on" if kv_cache else "off (--no-kv-cache)")
                + (", --compile" if compile else "") + (f", --quantize {quantize}" if quantize else ""))
        row = decode_row(llama, name, prompt, batch, kv_cache, new_tokens, deadline, dtype=dtype, compile=compile,
                         quantize=quantize)
        append(json_path, "decode", with_roofline(row, llama, bandwidth))

    def in_time() -> bool:
        return time.perf_counter() < deadline

    if "eager" in runs or "ttft" in runs or "transformers" in runs:
        load("the eager runs", compile=False)
    if "eager" in runs:
        for batch in batches:
            for kv_cache in (True, False):
                if in_time():
                    timed(batch, kv_cache)
    if "ttft" in runs and in_time():
        peak = memory_probe(torch.device(device))
        record(json_path, "time_to_first_token", first_token_row(
            f"ours {dtype}", long_prompt, lambda: measure(llama, long_prompt, 1, 1, True).prefill_s, 3, peak))
    if "transformers" in runs and in_time():
        with torch.inference_mode():
            ours_logits = llama.model(torch.tensor([prompt], device=llama.device))[0, -1].float().cpu()
        llama = None
        free(device)
        run_transformers(json_path, ckpt, device, dtype, prompt, long_prompt, batches, new_tokens, ours_logits,
                         deadline)
    for method in ("int8", "int4"):
        if method in runs and in_time():
            load(f"--quantize {method}", compile=False, quantize=method)
            timed(1, True, quantize=method)
    if "compile" in runs and in_time():
        load("--compile", compile=True)
        timed(1, True, compile=True)
    llama = None
    free(device)
    if not in_time():
        say(f"speed: out of its {budget_s:.0f} s; what it measured is in {json_path}")
    return in_time()


# server

def server(json_path: Path, ckpt: Path, clients: List[int], requests: int, parallel: int, max_seq_len: int,
           threads: int) -> bool:
    from bench_server import measure, start_ours  # this folder's, as `python scripts/gpu_check.py` runs

    # --no-compile: the step a GPU runs by default; on the CPU it spares the dry run building stored packages.
    rows = measure("llama-server", start_ours(str(ckpt), threads, parallel, max_seq_len, eager=True), clients,
                   requests)
    record(json_path, "server", {"flags": f"--parallel {parallel} --max-seq-len {max_seq_len} --no-compile",
                                 "requests_per_client": requests, "rows": rows})
    return all(row["tokens_per_s"] > 0 for row in rows)


# summary

def summary(json_path: Path) -> None:
    data = read_json(json_path)
    m = data.get("machine", {})
    print(f"\n{m.get('device')}; torch {m.get('torch')}, CUDA {m.get('cuda')}, transformers {m.get('transformers')}")
    for name, step in data.get("steps", {}).items():
        print(f"  step {name:12s} {step.get('status')} ({step.get('seconds')} s)")
    tests = data.get("tests")
    if tests:
        print(f"  tests: {tests['passed']} passed, {tests['failed']} failed, {tests['error']} errors, "
              f"{tests['skipped']} skipped: {tests['command']}")
    if "equivalence" in data:
        print(f"  equivalence: {data['equivalence']['ok']}")
    if "roofline" in data:
        r = data["roofline"]
        print(f"  roofline: {r['bandwidth_gb_s']} GB/s, {r['batch1_tokens_per_s']} tokens/s at batch 1")
    for row in data.get("decode", []):
        fraction = f", {row['roofline_fraction']:.0%} of the roofline" if "roofline_fraction" in row else ""
        print(f"  {row['name']:45s} {row['decode_tokens_per_s']:9.2f} tokens/s, peak {row['peak_memory_gib']} GiB"
              + fraction)
    if "time_to_first_token" in data:
        t = data["time_to_first_token"]
        print(f"  time to first token, {t['prompt_tokens']}-token prompt: {t['seconds']} s")
    for row in data.get("transformers", {}).get("decode", []):
        print(f"  transformers batch {row['batch_size']:<3d} {row['decode_tokens_per_s']:9.2f} tokens/s")
    for row in data.get("server", {}).get("rows", []):
        print(f"  llama-server {row['clients']:3d} clients: {row['tokens_per_s']:.1f} tokens/s, "
              f"TTFT p50 {row['ttft_p50'] * 1000:.0f} ms")


def _ints(value) -> List[int]:
    """fire reads "1,8" as a tuple and "8" as a number."""
    return [int(v) for v in (value if isinstance(value, (tuple, list)) else str(value).split(","))]


def main(step: str, json_file: str, dry_run: bool = False, device: str = "cuda", dtype: str = "bfloat16",
         ckpt_dir: str = None, runs="eager,ttft,transformers,int8,int4", new_tokens: int = 64,
         prompt_tokens: int = 2000, batches="1,8", copy_gb: float = 4.0, budget_s: float = 150.0,
         clients="1,8,32", requests: int = 2, parallel: int = 32, max_seq_len: int = 512, threads: int = 4,
         key: str = None, value: str = None):
    """Run one step of scripts/gpu_check.sh (see the module docstring); exits 1 when the step's check fails."""
    path = Path(json_file)
    path.parent.mkdir(parents=True, exist_ok=True)
    if step == "record":
        record(path, key, value)  # fire has read it as a Python literal: a dict, a number, a string
        return
    if step == "summary":
        summary(path)
        return
    if step == "machine":
        record(path, "machine", machine_facts())
        ok = True
    elif step == "tests":
        ok = run_tests(path, dry_run)
    elif step == "equivalence":
        ok = equivalence(path, device)
    elif step == "speed":
        runs = runs if isinstance(runs, (tuple, list)) else str(runs).split(",")
        ok = speed(path, Path(ckpt_dir), device, dtype, list(runs), new_tokens, prompt_tokens, _ints(batches),
                   copy_gb, budget_s)
    elif step == "server":
        ok = server(path, Path(ckpt_dir), _ints(clients), requests, parallel, max_seq_len, threads)
    else:
        raise SystemExit(f"error: unknown step {step!r}")
    if not ok:
        raise SystemExit(1)


if __name__ == "__main__":
    fire.Fire(main)
