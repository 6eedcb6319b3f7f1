"""Malformed GGUF files and params.json: every seeded mutation of a small valid file must end in success or
LlamaError, never another exception, a crash, a hang or a huge allocation.

The cases run in a worker process with a capped address space (so a huge allocation fails fast instead of
swapping); a worker that dies, or has not answered a case after HANG_S seconds, is replaced and the case
counts as failed. The work is bounded by the inputs (a one-layer model of width 32, contexts of 16 positions,
1,200 cases), not by the clock: HANG_S only tells a loop that never ends from a slow machine. Run this file as
a script with `--worker` to get the worker; the test starts it itself.
"""

import json
import os
import random
import resource
import select
import shutil
import struct
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Tuple

import pytest

SEED = 20240806
N_GGUF_CASES = 800
N_PARAMS_CASES = 400
# A case takes milliseconds; this is only how long to wait before calling a case that has not answered a hang,
# far beyond what any case needs on a loaded machine (a slow case is not a failure here; an endless one is).
HANG_S = 120.0
# Address space the worker may add beyond what it holds after importing torch: far more than the tiny
# models need, far less than a length field of 2**40 would ask for.
HEADROOM_BYTES = 1 << 30

# --- GGUF layout: where the integer fields sit, so that mutations can aim at them ------------------------

_SCALAR_FORMATS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<B", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9


def gguf_fields(data: bytes) -> Dict[str, List[Tuple[int, int]]]:
    """(offset, width) of every integer field of a valid GGUF v3 file, grouped by what the field means."""
    fields: Dict[str, List[Tuple[int, int]]] = {}
    pos = 0

    def note(kind: str, width: int) -> int:
        nonlocal pos
        fields.setdefault(kind, []).append((pos, width))
        value = int.from_bytes(data[pos : pos + width], "little")
        pos += width
        return value

    def string(kind: str) -> None:
        nonlocal pos
        length = note(kind, 8)
        pos += length

    def value(value_type: int, kind: str) -> None:
        nonlocal pos
        if value_type == _STRING:
            string(f"{kind}_string_length")
        elif value_type == _ARRAY:
            item_type = note("array_item_type", 4)
            count = note("array_count", 8)
            for _ in range(count):
                value(item_type, "array_item")
        else:
            width = struct.calcsize(_SCALAR_FORMATS[value_type])
            if value_type in (6, 12):
                pos += width  # floats are left to the byte flips
            else:
                note(f"{kind}_int", width)

    assert data[:4] == b"GGUF"
    pos = 4
    note("version", 4)
    n_tensors = note("tensor_count", 8)
    n_kv = note("kv_count", 8)
    for _ in range(n_kv):
        string("key_length")
        value(note("value_type", 4), "kv")
    for _ in range(n_tensors):
        string("tensor_name_length")
        n_dims = note("tensor_n_dims", 4)
        for _ in range(n_dims):
            note("tensor_dim", 8)
        note("tensor_type", 4)
        note("tensor_offset", 8)
    return fields


def _interesting(width: int, original: int, rng: random.Random) -> int:
    """A value likely to break a parser: zero, one, sign and size boundaries, or the original nudged."""
    bits = 8 * width
    return rng.choice([
        0, 1, 2, 3, 31, 32, 255, 2**16, original + 1, max(original - 1, 0), original * 2, original * 1000,
        2 ** (bits - 1) - 1, 2 ** (bits - 1), 2**bits - 1, 2**bits - 2, rng.randrange(2**bits),
        min(2**32, 2**bits - 1), min(2**40, 2**bits - 1), min(2**62, 2**bits - 1),
    ]) % 2**bits


def mutate_gguf(data: bytes, fields: Dict[str, List[Tuple[int, int]]], rng: random.Random) -> Tuple[bytes, str]:
    """One mutated copy of a GGUF file and a description of the change."""
    kind = rng.choice(["truncate", "flip", "field", "field", "field", "field2"])
    if kind == "truncate":
        end = rng.randrange(len(data))
        return data[:end], f"truncate to {end} bytes"
    if kind == "flip":
        out = bytearray(data)
        flips = []
        for _ in range(rng.randint(1, 8)):
            at = rng.randrange(len(out))
            mask = rng.randint(1, 255)
            out[at] ^= mask
            flips.append(f"{at}^{mask:#04x}")
        return bytes(out), "flip bytes " + ", ".join(flips)
    out = bytearray(data)
    changes = []
    for _ in range(1 if kind == "field" else 2):
        name = rng.choice(sorted(fields))
        offset, width = rng.choice(fields[name])
        original = int.from_bytes(out[offset : offset + width], "little")
        new = _interesting(width, original, rng)
        out[offset : offset + width] = new.to_bytes(width, "little")
        changes.append(f"{name} at {offset} ({width} bytes) {original} -> {new}")
    return bytes(out), "set " + "; ".join(changes)


# --- params.json ---------------------------------------------------------------------------------------

_JSON_VALUES = [0, 1, -1, 2, 3, 7, -2**31, 2**31, 2**40, 2**63, 10**30, 0.5, 1e-300, 1e308, -0.0, float("nan"),
                float("inf"), "64", "", None, True, False, [], [64], {}, {"dim": 64}]


def mutate_params(text: str, rng: random.Random) -> Tuple[str, str]:
    """One mutated copy of a params.json text and a description of the change."""
    params = json.loads(text)
    kind = rng.choice(["truncate", "flip", "value", "value", "value", "two_values", "drop", "add", "replace"])
    if kind == "truncate":
        end = rng.randrange(len(text))
        return text[:end], f"truncate to {end} characters"
    if kind == "flip":
        raw = bytearray(text.encode())
        at = rng.randrange(len(raw))
        raw[at] ^= rng.randint(1, 255)
        return raw.decode("latin-1"), f"flip byte {at}"
    if kind == "drop":
        name = rng.choice(sorted(params))
        del params[name]
        return json.dumps(params), f"drop {name}"
    if kind == "add":
        name = rng.choice(["hidden_dim", "ffn_dim_multiplier", "rope_theta", "n_kv_heads", "max_seq_len", "rope_scaling"])
        params[name] = rng.choice(_JSON_VALUES)
        return json.dumps(params), f"add {name}={params[name]!r}"
    if kind == "replace":
        whole = rng.choice([[], "params", 7, None, [params]])
        return json.dumps(whole), f"replace the whole file with {whole!r}"
    changes = []
    for _ in range(1 if kind == "value" else 2):
        name = rng.choice(sorted(params) + ["hidden_dim", "ffn_dim_multiplier"])
        value = rng.choice(_JSON_VALUES + [params.get(name, 1) if isinstance(params.get(name), (int, float)) else 1])
        if rng.random() < 0.3 and isinstance(params.get(name), int) and not isinstance(params.get(name), bool):
            value = params[name] + rng.choice([-1, 1, params[name]])
        params[name] = value
        changes.append(f"{name}={value!r}")
    return json.dumps(params), "set " + ", ".join(changes)


# --- the worker ------------------------------------------------------------------------------------------


def _run_case(request: Dict[str, Any]) -> Dict[str, Any]:
    """Run one case in the worker; classify the outcome and say which step ended it."""
    from llama import Llama
    from llama.convert.gguf import convert_gguf
    from llama.errors import LlamaError

    stage = "build"
    try:
        if request["kind"] == "gguf":
            stage = "convert"
            # Float weights until Llama.build reads quantized checkpoints (branch issue12-runtime); then the
            # default conversion, which keeps Q8_0 quantized, should be fuzzed here instead.
            ckpt = convert_gguf(Path(request["src"]), Path(request["dest"]), dequantize=True)
            # A file that converts must then load, or fail to load with LlamaError too.
            stage = "build"
        else:
            ckpt = request["ckpt"]
        Llama.build(ckpt, device="cpu", dtype="float32", max_seq_len=16, max_batch_size=1)
    except LlamaError as e:
        return {"outcome": "LlamaError", "stage": stage, "message": str(e)}
    except BaseException as e:  # noqa: B036 - anything else is what the fuzz test looks for
        if isinstance(e, KeyboardInterrupt):
            raise
        tb = traceback.extract_tb(e.__traceback__)
        where = next((f"{Path(f.filename).name}:{f.lineno} in {f.name}" for f in reversed(tb)
                      if "/llama/" in f.filename), "?")
        return {"outcome": "exception", "stage": stage, "type": type(e).__name__, "message": str(e).splitlines()[0][:200] if str(e) else "",
                "where": where,
                "raised_at": f"{Path(tb[-1].filename).name}:{tb[-1].lineno} in {tb[-1].name}" if tb else "?",
                "traceback": "".join(traceback.format_exception(type(e), e, e.__traceback__))[-4000:]}
    return {"outcome": "ok", "stage": stage}


def _worker() -> None:
    """Answer one JSON request per line on stdin with one JSON line on the original stdout."""
    replies = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)  # anything the library prints goes to stderr, not into the replies
    import torch  # noqa: F401 - imported before the address space is capped: its own mappings are large

    import llama.convert.gguf  # noqa: F401
    from llama import Llama  # noqa: F401

    with open("/proc/self/status") as f:
        vm_kb = next(int(line.split()[1]) for line in f if line.startswith("VmSize:"))
    limit = vm_kb * 1024 + HEADROOM_BYTES
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    replies.write(json.dumps({"ready": True}) + "\n")
    replies.flush()
    for line in sys.stdin:
        replies.write(json.dumps(_run_case(json.loads(line))) + "\n")
        replies.flush()


class Worker:
    """The worker process, restarted after a crash or a timeout."""

    def __init__(self, log: Path):
        self.log = log
        self.proc: Optional[subprocess.Popen] = None

    def _start(self) -> None:
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen([sys.executable, __file__, "--worker"], stdin=subprocess.PIPE,
                                         stdout=subprocess.PIPE, stderr=log, env=env)
        reply = self._read(600.0)  # importing torch on a loaded machine: not a time limit, a guard against a hang
        assert reply == {"ready": True}, f"the fuzz worker did not start: {reply}; see {self.log}"

    def _read(self, timeout: float) -> Optional[Dict[str, Any]]:
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
        if not ready:
            return None
        line = self.proc.stdout.readline()
        return json.loads(line) if line else None

    def run(self, request: Dict[str, Any]) -> Dict[str, Any]:
        if self.proc is None or self.proc.poll() is not None:
            self._start()
        self.proc.stdin.write((json.dumps(request) + "\n").encode())
        self.proc.stdin.flush()
        reply = self._read(HANG_S)
        if reply is not None:
            return reply
        hung = self.proc.poll() is None
        self.stop()
        if hung:
            return {"outcome": "hang", "type": "hang", "where": f"no answer after {HANG_S:.0f} s", "message": ""}
        return {"outcome": "crash", "type": f"worker died (exit {self.proc.returncode})", "where": "?", "message": ""}

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
        if self.proc is not None:
            self.proc.wait()
            self.proc.stdin.close()
            self.proc.stdout.close()


# --- the test --------------------------------------------------------------------------------------------


def _fuzz(worker: Worker, cases: List[Tuple[str, Callable[[], Dict[str, Any]], Callable[[Dict[str, Any]], List[str]]]]):
    """Run (description, make request, leftovers) cases; returns the outcome counts and the failures."""
    counts: Dict[str, int] = {}
    failures = []
    for i, (description, make, leftovers) in enumerate(cases):
        request = make()
        reply = worker.run(request)
        if i == 0:
            assert reply["outcome"] == "ok", f"the unchanged file does not load: {reply}"
        counts[reply["outcome"]] = counts.get(reply["outcome"], 0) + 1
        if reply["outcome"] not in ("ok", "LlamaError"):
            failures.append((description, reply))
        elif reply["outcome"] == "LlamaError" and reply["stage"] == "convert":
            left = leftovers(request)
            if left:
                failures.append((description, {"outcome": "leftovers", "type": "files left at DEST",
                                               "where": ", ".join(left), "message": reply["message"]}))
    return counts, failures


def _summary(failures) -> str:
    """One paragraph per distinct (exception type, place), with the first mutation that caused it."""
    distinct: Dict[Tuple[str, str], List] = {}
    for description, reply in failures:
        distinct.setdefault((reply["type"], reply["where"]), []).append((description, reply))
    parts = []
    for (kind, where), group in sorted(distinct.items(), key=lambda item: -len(item[1])):
        description, reply = group[0]
        parts.append(f"{len(group)} x {kind} at {where} (raised at {reply.get('raised_at', '?')}): "
                     f"{reply['message']!r}; e.g. {description}")
    return "\n".join(parts)


@pytest.mark.slow
def test_malformed_files_end_in_llama_error(tmp_path):
    from gguf_writer import write_llama_gguf
    from helpers import write_tiny

    start = time.perf_counter()
    base_gguf = write_llama_gguf(tmp_path / "base.gguf", n_layers=1, dim=32, n_heads=4, n_kv_heads=2, hidden=64)
    data = base_gguf.read_bytes()
    fields = gguf_fields(data)
    ckpt, _ = write_tiny(tmp_path / "ckpt")
    params_text = (ckpt / "params.json").read_text()
    out = tmp_path / "out"
    out.mkdir()
    rng = random.Random(SEED)

    def gguf_case(i: int):
        mutated, description = mutate_gguf(data, fields, rng) if i else (data, "unchanged")
        src = tmp_path / "case.gguf"

        def make():
            src.write_bytes(mutated)
            for entry in out.iterdir():  # the previous case's successful output
                shutil.rmtree(entry)
            return {"kind": "gguf", "src": str(src), "dest": str(out / f"case{i}")}

        return f"GGUF case {i}: {description}", make, lambda request: sorted(p.name for p in out.iterdir())

    def params_case(i: int):
        text, description = mutate_params(params_text, rng) if i else (params_text, "unchanged")

        def make():
            (ckpt / "params.json").write_text(text, encoding="latin-1" if "flip" in description else "utf-8")
            return {"kind": "params", "ckpt": str(ckpt)}

        return f"params.json case {i}: {description}", make, lambda request: []

    # Made up front so that every case is the same whatever the outcomes before it.
    gguf_cases = [gguf_case(i) for i in range(N_GGUF_CASES)]
    params_cases = [params_case(i) for i in range(N_PARAMS_CASES)]
    worker = Worker(tmp_path / "worker.log")
    try:
        gguf_counts, gguf_failures = _fuzz(worker, gguf_cases)
        params_counts, params_failures = _fuzz(worker, params_cases)
    finally:
        worker.stop()
    elapsed = time.perf_counter() - start
    print(f"GGUF {gguf_counts}, params.json {params_counts}, {elapsed:.1f} s")

    failures = gguf_failures + params_failures
    assert not failures, (f"{len(failures)} of {N_GGUF_CASES + N_PARAMS_CASES} cases ended other than in "
                          f"success or LlamaError:\n{_summary(failures)}")
    # The mutations reach past the first check: most break the file, some leave it loadable.
    for counts, n in ((gguf_counts, N_GGUF_CASES), (params_counts, N_PARAMS_CASES)):
        assert counts.get("ok", 0) >= 1 and counts.get("LlamaError", 0) >= n // 3, counts


if __name__ == "__main__" and sys.argv[1:] == ["--worker"]:
    _worker()
