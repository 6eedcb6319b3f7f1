"""llama-bench's measurements and outputs (its numbers are for people to read, not for tests to time)."""

import csv
import json

import pytest

from helpers import build, run
from llama.eval.speed import measure


def test_measure_times_every_step_and_ignores_stop_tokens(gqa_ckpt):
    llama = build(gqa_ckpt)
    prompt = llama.tokenizer.encode("Hello", bos=True, eos=False)
    # Even with every token a stop token, a benchmark run produces exactly the length asked for.
    llama.tokenizer.stop_ids = list(range(llama.model.vocab_size))
    run_ = measure(llama, prompt, batch_size=2, max_new_tokens=20, kv_cache=True)
    assert llama.tokenizer.stop_ids == list(range(llama.model.vocab_size))  # the tokenizer is left as it was
    assert run_.new_tokens == 20 and len(run_.step_s) == 19 and not run_.out_of_time
    assert run_.time_to(1) == run_.prefill_s and run_.time_to(20) > run_.time_to(10) > 0
    assert run_.time_to(21) is None
    assert run_.kv_cache_bytes > 0 and run_.peak_memory_bytes > 0
    assert measure(llama, prompt, 1, 5, kv_cache=False).kv_cache_bytes == 0


def test_measure_stops_at_the_deadline(gqa_ckpt):
    llama = build(gqa_ckpt)
    result = measure(llama, [1, 2, 3], 1, 50, kv_cache=False, deadline=0.0)
    assert result.out_of_time and result.new_tokens == 1


@pytest.mark.slow
def test_llama_bench_writes_table_csv_json_and_plot(gqa_ckpt, tmp_path):
    out = tmp_path / "bench"
    result = run("llama-bench", "--ckpt-dir", gqa_ckpt, "--lengths", "4,8,16", "--batch-sizes", "1,2",
                 "--out-dir", out, "--warmup", "2")
    assert result.returncode == 0, result.stderr
    assert "speedup" in result.stdout and result.stdout.count("\n") == 2 + 2 * 2 * 3  # header, rule, rows
    rows = list(csv.DictReader((out / "bench.csv").open()))
    assert len(rows) == 12
    assert {(r["batch_size"], r["kv_cache"]) for r in rows} == {("1", "True"), ("1", "False"), ("2", "True"), ("2", "False")}
    cached = [r for r in rows if r["kv_cache"] == "True"]
    assert all(float(r["speedup_vs_no_cache"]) > 0 for r in cached)
    assert all(r["speedup_vs_no_cache"] == "" for r in rows if r["kv_cache"] == "False")
    assert {r["step"] for r in rows} == {"eager"}  # LLAMA_COMPILE=0 (conftest.py); tests/compile/test_compile.py: the default
    data = json.loads((out / "bench.json").read_text())
    assert data["environment"]["torch"] and len(data["runs"]) == 4
    assert all(len(r["step_s"]) == 15 for r in data["runs"])
    assert (out / "bench.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.slow
def test_llama_bench_rejects_bad_flags(gqa_ckpt, tmp_path):
    result = run("llama-bench", "--ckpt-dir", gqa_ckpt, "--modes", "fast", "--out-dir", tmp_path)
    assert result.returncode == 1 and result.stderr.startswith("error: --modes")
