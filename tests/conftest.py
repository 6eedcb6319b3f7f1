"""Shared fixtures: tiny random LLaMA checkpoints in Meta's exact layout, with the example tokenizer."""

import os
import tempfile
from pathlib import Path

import pytest
import torch

from llama import Llama
from llama.random_weights import write_random_checkpoint
from llama.model import ModelArgs

REPO = Path(__file__).resolve().parent.parent
EXAMPLE_TOKENIZER = REPO / "tokenizer.model.example"

# Multi-head, grouped-query and multi-query attention: n_heads / n_kv_heads = 1, 4 and 4 (down to 1 KV head).
ATTENTION_SHAPES = {
    "mha": {"n_heads": 4, "n_kv_heads": 4},
    "gqa": {"n_heads": 8, "n_kv_heads": 2},
    "mqa": {"n_heads": 4, "n_kv_heads": 1},
}

# A large init scale makes the tiny models' next-token distributions peaked, so greedy decoding is not
# decided by near-ties that float rounding could flip.
TEST_STD = 0.1

torch.set_num_threads(2)


def pytest_configure(config):
    # The integer kernels (llama/kernels) build once into pytest's cache rather than the user's $LLAMA_HOME:
    # every test and subprocess of a run shares that build, the next run reuses it, a changed source rebuilds.
    if not os.environ.get("LLAMA_KERNELS_DIR"):
        cache = getattr(config, "cache", None)
        os.environ["LLAMA_KERNELS_DIR"] = str(cache.mkdir("llama-kernels") if cache else tempfile.mkdtemp())


def tiny_args(kind: str = "gqa", **overrides) -> ModelArgs:
    fields = dict(dim=64, n_layers=2, vocab_size=4000, multiple_of=32, norm_eps=1e-5, max_seq_len=64, max_batch_size=8)
    fields.update(ATTENTION_SHAPES[kind])
    fields.update(overrides)
    return ModelArgs(**fields)


def write_tiny(path: Path, kind: str = "gqa", num_shards: int = 1, seed: int = 0, **overrides):
    """A tiny float32 checkpoint at `path`; returns (path, state_dict)."""
    return write_random_checkpoint(path, tiny_args(kind, **overrides), seed=seed, dtype=torch.float32,
                                   tokenizer_path=EXAMPLE_TOKENIZER, num_shards=num_shards, std=TEST_STD)


@pytest.fixture(scope="session", params=list(ATTENTION_SHAPES))
def tiny_ckpt(request, tmp_path_factory) -> Path:
    """A tiny checkpoint of each attention shape."""
    path, _ = write_tiny(tmp_path_factory.mktemp("ckpt") / request.param, request.param)
    return path


@pytest.fixture(scope="session")
def gqa_ckpt(tmp_path_factory) -> Path:
    path, _ = write_tiny(tmp_path_factory.mktemp("ckpt") / "gqa", "gqa")
    return path


def build(ckpt: Path, **kwargs) -> Llama:
    kwargs = {"max_seq_len": 64, "max_batch_size": 8, "device": "cpu", "dtype": "float32", **kwargs}
    return Llama.build(ckpt, **kwargs)
