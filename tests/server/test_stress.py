"""scripts/stress_server.py, small: 4 clients x 6 requests against a tiny random checkpoint, two rounds.

Its report must say: every valid request answered as it is answered alone, every fault refused with its
status in OpenAI's shape (or, for a client that left, nothing), no KV block held at the end, and no
traceback in the server's log.
"""

import json
import subprocess
import sys

import pytest

from helpers import REPO, write_tiny

pytest.importorskip("openai")


@pytest.mark.slow  # a server and 48 requests
def test_the_stress_script_finds_nothing_wrong(tmp_path):
    ckpt, _ = write_tiny(tmp_path / "gqa", "gqa")
    out = tmp_path / "report.json"
    r = subprocess.run([sys.executable, "scripts/stress_server.py", "--clients", "4", "--requests", "6", "--rounds", "2",
                        "--ckpt-dir", str(ckpt), "--max-seq-len", "256", "--parallel", "2", "--block-size", "4",
                        "--max-tokens", "16", "--json-file", str(out)],
                       cwd=REPO, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["ok"] and report["server_tracebacks"] == 0 and report["server_exit_status"] == 0
    for rnd in report["rounds"]:
        assert rnd["requests"] == 24 and rnd["failed"] == {} and rnd["wrong_answers"] == 0
        assert rnd["answered_correctly"] == rnd["valid"] > 0
        assert rnd["faults_handled"] == sum(rnd["faults"].values()) == rnd["requests"] - rnd["valid"]
        assert all(n > 0 for n in rnd["faults"].values()), rnd["faults"]  # every kind of fault was tried
        assert rnd["blocks_used_at_end"] == 0
        assert rnd["VmHWM_mib"] > 0
