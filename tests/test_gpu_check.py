"""scripts/gpu_check.sh: its dry run (every step of the GPU run, on the CPU with a tiny model) and its refusals.

The GPU run itself needs a CUDA GPU and is not run here; the dry run runs the same Python, the same steps and writes
the same JSON, so what it checks here holds for the figures a GPU run writes.
"""

import json
import os
import subprocess
import sys

import pytest
import torch

from helpers import REPO, assert_one_line_error

SCRIPT = REPO / "scripts" / "gpu_check.sh"
# The server's load (scripts/bench_server.py): client k's request asks for MAX_TOKENS[k % 4] tokens, ignoring the
# end of text, so every reply has exactly that many.
MAX_TOKENS = [32, 64, 96, 128]


def gpu_check(*args, timeout=120) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(SCRIPT), *map(str, args)], capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "PYTHON": sys.executable})


def test_an_unknown_flag_or_a_missing_value_is_one_line_and_status_2():
    for args, fragment in ((["--fast"], "unknown argument '--fast'"), (["--out"], "--out needs a value"),
                           (["--budget", "soon"], "--budget takes whole seconds")):
        result = gpu_check(*args)
        assert_one_line_error(result, fragment, "usage: scripts/gpu_check.sh")
        assert result.returncode == 2


def test_the_gpu_run_without_wheels_is_refused_in_one_line(tmp_path):
    result = gpu_check("--wheels", tmp_path / "none", "--out", tmp_path / "out")
    assert_one_line_error(result, "no llama_kv wheel in", "scripts/gpu_check.sh prepare")
    assert not (tmp_path / "out").exists()  # refused before anything was written


@pytest.mark.skipif(torch.cuda.is_available(), reason="here torch sees a GPU")
def test_the_gpu_run_without_a_gpu_is_refused_in_one_line(tmp_path):
    (tmp_path / "wheels").mkdir()
    (tmp_path / "wheels" / "llama_kv-0.1.0-py3-none-any.whl").touch()
    result = gpu_check("--wheels", tmp_path / "wheels", "--out", tmp_path / "out")
    assert_one_line_error(result, "sees no CUDA GPU", "--dry-run")
    assert result.returncode == 1 and not (tmp_path / "out").exists()


@pytest.mark.slow
def test_the_dry_run_writes_every_figure_of_the_gpu_run(tmp_path):
    result = subprocess.run(["bash", str(SCRIPT), "--dry-run", "--out", str(tmp_path / "out"), "--work",
                             str(tmp_path / "work"), "--python", sys.executable],
                            capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    assert "Traceback" not in result.stdout + result.stderr
    log = (tmp_path / "out" / "gpu_check.log").read_text()
    assert log == result.stdout and "done in" in log  # the log is the whole output
    data = json.loads((tmp_path / "out" / "gpu_check.json").read_text())

    assert data["mode"] == "dry-run" and 0 < data["wall_s"] < 900
    assert data["steps"].keys() == {"machine", "tests", "equivalence", "checkpoint", "speed", "server", "compile"}
    assert all(step["status"] == "ok" for step in data["steps"].values()), data["steps"]
    assert data["machine"]["torch"] == torch.__version__ and data["machine"]["device"].startswith("cpu")

    tests = data["tests"]  # the CPU's counterparts of the GPU's tests, each recorded
    assert tests["ok"] and tests["exit_status"] == 0 and tests["failed"] == tests["error"] == 0
    assert tests["passed"] == len(tests["cases"]) >= 10
    assert all(outcome == "passed" for outcome in tests["cases"].values())

    eq = data["equivalence"]
    assert eq["ok"] and eq["greedy_tokens_equal"] and eq["tf32_matmul"] is False
    assert 0 <= eq["float32"]["max_abs_diff"] <= 1e-5 and eq["float32"]["ok"]
    bf16 = eq["bfloat16"]
    assert bf16["ok"] and bf16["top_token_agrees"] and bf16["clear_positions"] >= 8
    assert 0 < bf16["max_abs_diff_cached"] <= bf16["bound"] == pytest.approx(0.05 * bf16["logits_scale"])

    roofline = data["roofline"]
    assert roofline["bandwidth_gb_s"] > 0 and roofline["dtype"] == "bfloat16"
    assert roofline["batch1_tokens_per_s"] == pytest.approx(roofline["bandwidth_gb_s"] * 1e9
                                                            / roofline["weight_bytes_per_token"], rel=0.01)

    runs = {(r["batch_size"], r["kv_cache"], r["compile"], r["quantize"]): r for r in data["decode"]}
    assert runs.keys() == {(1, True, False, None), (1, False, False, None), (8, True, False, None),
                           (8, False, False, None), (1, True, False, "int8"), (1, True, False, "int4"),
                           (1, True, True, None)}
    for key, run in runs.items():
        assert run["dtype"] == "bfloat16" and run["new_tokens"] == 16 and not run["out_of_time"], key
        assert run["decode_tokens_per_s"] > 0 and run["prefill_s"] > 0 and run["peak_memory_gib"] > 0, key
        assert (run["kv_cache_bytes"] > 0) == run["kv_cache"], key  # no cache allocated without it
        assert ("roofline_fraction" in run) == (run["batch_size"] == 1 and run["kv_cache"]), key
    assert runs[8, True, False, None]["kv_cache_bytes"] == 8 * runs[1, True, False, None]["kv_cache_bytes"]

    ttft = data["time_to_first_token"]
    assert ttft["prompt_tokens"] == 64 and ttft["seconds"] > 0 and len(ttft["runs"]) == 3

    theirs = data["transformers"]
    assert theirs["version"] and [r["batch_size"] for r in theirs["decode"]] == [1, 8]
    assert all(r["decode_tokens_per_s"] > 0 for r in theirs["decode"])
    assert theirs["time_to_first_token"]["seconds"] > 0
    # The same weights: a wrong name or rotary order would put the logits as far apart as they are large.
    assert theirs["logits_max_abs_diff"] < 0.05 * theirs["logits_scale"]

    rows = data["server"]["rows"]
    assert [r["clients"] for r in rows] == [1, 8, 32]
    for r in rows:
        assert r["requests"] == r["clients"] and r["tokens"] == sum(MAX_TOKENS[k % 4] for k in range(r["clients"]))
        assert r["tokens_per_s"] > 0 and 0 < r["ttft_p50"] <= r["ttft_p99"]
