"""torch.save files written one tensor at a time: the same tensors as torch.save, in bounded memory."""

import subprocess
import sys

import pytest
import torch

from llama.io.checkpoint import load_checkpoint
from llama.io.random_weights import random_state_dict, write_random_weights
from llama.io.tensor_file import TensorFileWriter

from helpers import EXAMPLE_TOKENIZER, REPO, tiny_args


def test_written_file_loads_with_the_same_tensors_mapped_or_not(tmp_path):
    tensors = {
        "a": torch.randn(33, 17).to(torch.bfloat16),
        "b": torch.randint(-127, 128, (5, 64), dtype=torch.int8),
        "c": torch.randint(0, 256, (3, 7), dtype=torch.uint8),
        "d": torch.randn(9).half(),
        "empty": torch.empty(0, 4),
    }
    path = tmp_path / "t.pth"
    with TensorFileWriter(path, {k: (v.shape, v.dtype) for k, v in tensors.items()}) as writer:
        for name in reversed(list(tensors)):  # any order
            writer.write(name, tensors[name])
    for mmap in (False, True):
        loaded = torch.load(path, weights_only=True, mmap=mmap)
        assert list(loaded) == list(tensors)
        for name, tensor in tensors.items():
            assert loaded[name].dtype == tensor.dtype and torch.equal(loaded[name], tensor), name


def test_a_tensor_of_the_wrong_shape_or_a_missing_one_is_refused(tmp_path):
    writer = TensorFileWriter(tmp_path / "t.pth", {"a": ((2, 3), torch.float32), "b": ((4,), torch.float32)})
    with pytest.raises(ValueError, match="expected"):
        writer.write("a", torch.zeros(3, 2))
    writer.write("a", torch.zeros(2, 3))
    writer.close()
    with pytest.raises(AssertionError, match="never written"):
        writer.check_complete()


@pytest.mark.parametrize("num_shards", [1, 2])
def test_random_weights_written_tensor_by_tensor_are_random_state_dict(tmp_path, num_shards):
    args = tiny_args()
    path = write_random_weights(tmp_path / "ckpt", args, seed=3, dtype=torch.bfloat16, num_shards=num_shards)
    expected = random_state_dict(args, seed=3, dtype=torch.bfloat16)
    loaded = load_checkpoint(path, args)
    assert set(loaded) == set(expected)
    for name in expected:
        assert torch.equal(loaded[name], expected[name]), name
    rope = torch.load(path / "consolidated.00.pth", weights_only=True)["rope.freqs"]
    assert rope.shape == (args.head_dim // 2,) and rope[0] == 1


@pytest.mark.slow
def test_the_script_defaults_to_metas_shard_count_and_refuses_an_uneven_split(tmp_path):
    script = [sys.executable, str(REPO / "scripts" / "write_random_checkpoint.py")]
    small = ["--n_layers", "1", "--dim", "256", "--n_heads", "2", "--tokenizer", str(EXAMPLE_TOKENIZER)]
    done = subprocess.run(script + [str(tmp_path / "13b"), "--size", "13B"] + small, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert sorted(p.name for p in (tmp_path / "13b").glob("*.pth")) == ["consolidated.00.pth", "consolidated.01.pth"]
    assert "writing random weights: 100%" in done.stderr
    bad = subprocess.run(script + [str(tmp_path / "bad"), "--shards", "3"] + small, capture_output=True, text=True)
    assert bad.returncode != 0 and bad.stderr.startswith("error: ") and "split into 3 shards" in bad.stderr
    assert "Traceback" not in bad.stderr and not (tmp_path / "bad").exists()
