"""Shared fixtures: tiny random LLaMA checkpoints in Meta's exact layout, with the example tokenizer.

The functions behind them, and everything else the test files share, are in helpers.py.
"""

import os
import tempfile
from pathlib import Path

import pytest
import torch

from helpers import ATTENTION_SHAPES, write_nonstop, write_tiny

torch.set_num_threads(2)


def pytest_configure(config):
    # With workers side by side (pytest-xdist, this process starting them), their OpenMP threads sleep when idle
    # instead of spinning: each worker computes on torch's two threads beside the others and the commands and servers
    # its tests start, and spinning, libgomp's idle threads starve the very threads they wait for. Alone (`-n 0`) the
    # spin pays. The figures are in the README's "Tests". libgomp reads this when torch loads it: it reaches the
    # workers and what they start, not this process.
    if getattr(config.option, "numprocesses", None) and not hasattr(config, "workerinput"):
        os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    # The tests compare commands, run as subprocesses, with models built here on the CPU (helpers.build): on a
    # machine with a GPU the commands must run on the CPU too. tests/test_cuda.py asks for the GPU by name.
    os.environ["LLAMA_DEVICE"] = "cpu"
    # The commands' default compiles the decode step once per model shape and batch size (llama/compile/aot.py): the
    # tests of other things run the plain eager step, and tests/compile/test_compile.py tests the default itself.
    os.environ["LLAMA_COMPILE"] = "0"
    # The integer kernels (llama/kernels) build once into pytest's cache rather than the user's $LLAMA_HOME:
    # every test and subprocess of a run shares that build, the next run reuses it, a changed source rebuilds.
    if not os.environ.get("LLAMA_KERNELS_DIR"):
        cache = getattr(config, "cache", None)
        os.environ["LLAMA_KERNELS_DIR"] = str(cache.mkdir("llama-kernels") if cache else tempfile.mkdtemp())
    # The same for the compiled steps' packages (llama/compile/store.py).
    if not os.environ.get("LLAMA_COMPILED_DIR"):
        cache = getattr(config, "cache", None)
        os.environ["LLAMA_COMPILED_DIR"] = str(cache.mkdir("llama-compiled") if cache else tempfile.mkdtemp())


def pytest_xdist_auto_num_workers(config):
    """`-n auto`: a worker for each core this process may run on, at most 4 (each holds a model or two and runs torch
    on two threads). With PYTEST_XDIST_AUTO_NUM_WORKERS set, pytest-xdist's own hook reads it."""
    if os.environ.get("PYTEST_XDIST_AUTO_NUM_WORKERS"):
        return None
    return min(4, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1)


def pytest_collection_modifyitems(config, items):
    """On pytest-xdist's workers (`--dist loadfile`: each file whole on one worker, handed out in the order
    collected), the files marked `long` first, then the others by their number of tests, most first (pytest-xdist's
    own order, which `--no-loadscope-reorder` in pyproject.toml turns off so that this one holds). A file of many
    minutes with few tests, handed out last by that count, would run alone at the end of the run while the other
    workers had nothing left to do."""
    if not hasattr(config, "workerinput"):
        return  # in one process (`-n 0`) the order changes nothing
    files = {}
    for item in items:
        files.setdefault(item.nodeid.split("::")[0], []).append(item)
    order = sorted(files.values(), key=lambda group: (group[0].get_closest_marker("long") is None, -len(group)))
    items[:] = [item for group in order for item in group]


@pytest.fixture(scope="session", params=list(ATTENTION_SHAPES))
def tiny_ckpt(request, tmp_path_factory) -> Path:
    """A tiny checkpoint of each attention shape."""
    path, _ = write_tiny(tmp_path_factory.mktemp("ckpt") / request.param, request.param)
    return path


@pytest.fixture(scope="session")
def gqa_ckpt(tmp_path_factory) -> Path:
    path, _ = write_tiny(tmp_path_factory.mktemp("ckpt") / "gqa", "gqa")
    return path


@pytest.fixture(scope="session")
def nonstop_ckpt(tmp_path_factory) -> Path:
    """A tiny grouped-query checkpoint whose greedy runs never stop early (helpers.write_nonstop)."""
    return write_nonstop(tmp_path_factory.mktemp("ckpt") / "nonstop")
