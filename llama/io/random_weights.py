"""Random-weight checkpoints in Meta's exact layout, any shape: for tests, demos and benchmarks.

Nobody needs real weights to see what the KV cache does, to test a loader or to measure a 7B-shaped
model's speed and memory: these write what Meta's files would hold, drawn at random, one tensor at a time.
"""

import itertools
from pathlib import Path
from typing import Dict, Iterator, List, Optional, Tuple

import torch

from llama.io.checkpoint import (
    check_splits, local_shapes, expected_shapes, load_checkpoint, params_dict, write_checkpoint_files,
)
from llama.model import ModelArgs
from llama.runtime.progress import Progress, or_silent
from llama.nn.sharding import shard_state_dict
from llama.io.tensor_file import TensorFileWriter

# The params.json of Meta's LLaMA-2 releases (vocab_size -1: 32,000 from the tokenizer), and a tiny shape
# with grouped-query attention for tests and demos.
PRESETS = {
    "7B": {"dim": 4096, "multiple_of": 256, "n_heads": 32, "n_layers": 32, "norm_eps": 1e-05, "vocab_size": -1},
    "13B": {"dim": 5120, "multiple_of": 256, "n_heads": 40, "n_layers": 40, "norm_eps": 1e-05, "vocab_size": -1},
    "70B": {"dim": 8192, "multiple_of": 4096, "ffn_dim_multiplier": 1.3, "n_heads": 64, "n_kv_heads": 8,
            "n_layers": 80, "norm_eps": 1e-05, "vocab_size": -1},
    "tiny": {"dim": 64, "multiple_of": 32, "n_heads": 8, "n_kv_heads": 2, "n_layers": 2, "norm_eps": 1e-05,
             "vocab_size": -1},
}


def random_state_dict(args: ModelArgs, seed: int = 0, dtype: torch.dtype = torch.float32,
                      std: float = 0.02) -> Dict[str, torch.Tensor]:
    """Weights of the given shape, drawn like a freshly initialised LLaMA (normal, std 0.02; norms at 1).

    Tests of tiny models pass a larger `std`: it makes the next-token distribution peaked, so greedy
    decoding is not decided by near-ties.
    """
    return {name: tensor.to(dtype) for name, tensor in _random_tensors(args, seed, std)}


def _random_tensors(args: ModelArgs, seed: int, std: float) -> Iterator[Tuple[str, torch.Tensor]]:
    """(name, float32 tensor) for each weight, drawn one at a time from one generator."""
    generator = torch.Generator().manual_seed(seed)
    for name, shape in expected_shapes(args).items():
        if name.endswith("norm.weight"):
            yield name, torch.ones(shape)
        else:
            yield name, torch.empty(shape).normal_(0.0, std, generator=generator)


def write_random_checkpoint(ckpt_dir: Path, args: ModelArgs, seed: int = 0, dtype: torch.dtype = torch.float32,
                            tokenizer_path: Optional[Path] = None, num_shards: int = 1,
                            overwrite: bool = False, std: float = 0.02) -> Tuple[Path, Dict[str, torch.Tensor]]:
    """Write a random-weight checkpoint of shape `args` in Meta's layout; returns its path and weights.

    The weights are read back from the files (memory-mapped when there is one shard); for models too big
    to hold, call `write_random_weights`.
    """
    path = write_random_weights(ckpt_dir, args, seed, dtype, tokenizer_path, num_shards, overwrite, std)
    return path, load_checkpoint(path, args)


def write_random_weights(ckpt_dir: Path, args: ModelArgs, seed: int = 0, dtype: torch.dtype = torch.float32,
                         tokenizer_path: Optional[Path] = None, num_shards: int = 1, overwrite: bool = False,
                         std: float = 0.02, progress: Optional[Progress] = None) -> Path:
    """Write a random-weight checkpoint of shape `args` in Meta's layout, one tensor at a time.

    Memory stays at about one float32 tensor (the largest is the embedding: 0.5 GB for 7B), whatever the
    model's size. The weights are those of `random_state_dict(args, seed, dtype, std)`.

    Raises:
        LlamaError: the destination exists, the weights do not split into `num_shards`, or a write failed.
    """
    shapes = expected_shapes(args)
    # Meta's own files carry the rotary frequencies too; writing them keeps these files exactly like theirs.
    shapes["rope.freqs"] = torch.Size((args.head_dim // 2,))
    check_splits(shapes, num_shards)
    specs = [{name: (shape, dtype) for name, shape in local_shapes(shapes, num_shards).items()}] * num_shards
    total = sum(shape.numel() for shape in shapes.values())

    def fill(writers: List[TensorFileWriter]) -> None:
        done = 0
        rope = 1.0 / (args.rope_theta ** (torch.arange(0, args.head_dim, 2).float() / args.head_dim))
        for name, tensor in itertools.chain(_random_tensors(args, seed, std), [("rope.freqs", rope)]):
            for writer, piece in zip(writers, shard_state_dict({name: tensor.to(dtype)}, num_shards)):
                writer.write(name, piece[name])
            done += tensor.numel()
            or_silent(progress)("writing random weights", done, total)

    return write_checkpoint_files(ckpt_dir, params_dict(args), specs, fill, tokenizer_path, overwrite)
