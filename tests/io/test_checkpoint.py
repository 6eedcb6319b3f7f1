"""Meta's on-disk layout: what loads, what is refused and how the refusal reads."""

import json
import os
import shutil

import pytest
import torch

from helpers import EXAMPLE_TOKENIZER, build, tiny_args, write_tiny
from llama.io.random_weights import write_random_checkpoint
from llama.runtime.devices import resolve_device, resolve_dtype
from llama.errors import LlamaError


def test_written_checkpoint_has_metas_files_and_loads_back_exactly(tmp_path):
    path, state_dict = write_tiny(tmp_path / "ckpt")
    assert sorted(os.listdir(path)) == ["consolidated.00.pth", "params.json", "tokenizer.model"]
    on_disk = torch.load(path / "consolidated.00.pth", weights_only=True)
    assert "rope.freqs" in on_disk  # as in Meta's own files; the loader accepts and drops it
    llama = build(path)
    for name, tensor in llama.model.state_dict().items():
        assert torch.equal(tensor, state_dict[name]), name


def test_vocab_size_minus_one_comes_from_the_tokenizer(tmp_path):
    path, _ = write_tiny(tmp_path / "ckpt")
    params = json.loads((path / "params.json").read_text())
    params["vocab_size"] = -1
    (path / "params.json").write_text(json.dumps(params))
    assert build(path).model.vocab_size == 4000


def test_tokenizer_is_found_one_level_up_as_in_metas_downloads(tmp_path):
    path, _ = write_tiny(tmp_path / "llama-2-7b")
    shutil.move(path / "tokenizer.model", tmp_path / "tokenizer.model")
    assert build(path).tokenizer.n_words == 4000
    (tmp_path / "tokenizer.model").unlink()
    with pytest.raises(LlamaError, match="no tokenizer found"):
        build(path)
    assert build(path, tokenizer_path=EXAMPLE_TOKENIZER).tokenizer.n_words == 4000


def test_two_shards_load_on_one_process_as_the_whole_model(tmp_path):
    one, sd = write_tiny(tmp_path / "one", seed=5)
    two, _ = write_tiny(tmp_path / "two", seed=5, num_shards=2)
    assert sorted(p.name for p in two.glob("*.pth")) == ["consolidated.00.pth", "consolidated.01.pth"]
    shard0 = torch.load(two / "consolidated.00.pth", weights_only=True)
    assert shard0["layers.0.attention.wq.weight"].shape == (32, 64)  # column-parallel: rows split
    assert shard0["layers.0.attention.wo.weight"].shape == (64, 32)  # row-parallel: columns split
    assert shard0["tok_embeddings.weight"].shape == (4000, 32)  # embedding width split
    assert shard0["norm.weight"].shape == (64,)  # replicated
    a, b = build(one), build(two)
    for name, tensor in a.model.state_dict().items():
        assert torch.equal(tensor, b.model.state_dict()[name]), name


def _edit(path, fn):
    sd = torch.load(path / "consolidated.00.pth", weights_only=True)
    fn(sd)
    torch.save(sd, path / "consolidated.00.pth")


@pytest.mark.parametrize("edit, message", [
    (lambda sd: sd.pop("layers.1.ffn_norm.weight"), "missing tensor layers.1.ffn_norm.weight"),
    (lambda sd: sd.__setitem__("layers.9.extra", torch.zeros(1)), "unexpected tensor layers.9.extra"),
    (lambda sd: sd.__setitem__("layers.0.attention.wk.weight", torch.zeros(64, 64)),
     r"layers.0.attention.wk.weight has shape \(64, 64\), params.json implies \(16, 64\)"),
])
def test_weights_that_do_not_match_params_are_named(tmp_path, edit, message):
    path, _ = write_tiny(tmp_path / "ckpt")
    _edit(path, edit)
    with pytest.raises(LlamaError, match=message):
        build(path)


@pytest.mark.parametrize("content, message", [
    ("{not json", "not valid JSON"),
    ("[1, 2]", "JSON object"),
    ('{"dim": "64"}', "dim must be an integer"),
    ('{"dim": 64, "n_heads": 5, "n_layers": 1, "vocab_size": 4000}', "not divisible by n_heads"),
    ('{"dim": 64, "n_heads": 8, "n_kv_heads": 3, "n_layers": 1, "vocab_size": 4000}', "not divisible by n_kv_heads"),
    ('{"dim": 64, "n_heads": 8, "n_layers": 1, "use_scaled_rope": true}', "does not understand: use_scaled_rope"),
])
def test_bad_params_json_is_refused(tmp_path, content, message):
    path, _ = write_tiny(tmp_path / "ckpt")
    (path / "params.json").write_text(content)
    with pytest.raises(LlamaError, match=message):
        build(path)


def test_missing_pieces_are_named(tmp_path):
    with pytest.raises(LlamaError, match="does not exist"):
        build(tmp_path / "nowhere")
    path, _ = write_tiny(tmp_path / "ckpt")
    (path / "consolidated.00.pth").rename(path / "weights.bin")
    with pytest.raises(LlamaError, match="no consolidated.NN.pth"):
        build(path)
    (path / "params.json").unlink()
    with pytest.raises(LlamaError, match="params.json does not exist"):
        build(path)


def test_truncated_weights_are_refused(tmp_path):
    path, _ = write_tiny(tmp_path / "ckpt")
    data = (path / "consolidated.00.pth").read_bytes()
    (path / "consolidated.00.pth").write_bytes(data[: len(data) // 2])
    with pytest.raises(LlamaError, match="cannot load .*consolidated.00.pth"):
        build(path)


def test_device_and_dtype_defaults(monkeypatch):
    monkeypatch.setenv("LLAMA_DEVICE", "")
    device = resolve_device(None)
    assert device.type == ("cuda" if torch.cuda.is_available() else "cpu")
    monkeypatch.setenv("LLAMA_DEVICE", "cpu")
    assert resolve_device(None).type == "cpu"
    monkeypatch.setenv("LLAMA_DEVICE", "gpu0")
    with pytest.raises(LlamaError, match=r"unknown device 'gpu0' \(from LLAMA_DEVICE\)"):
        resolve_device(None)
    assert resolve_dtype(None, torch.device("cpu")) == torch.float32
    assert resolve_dtype("bf16", torch.device("cpu")) == torch.bfloat16
    with pytest.raises(LlamaError, match="unknown dtype"):
        resolve_dtype("int8", torch.device("cpu"))
    with pytest.raises(LlamaError, match="unknown device"):
        resolve_device("gpu0")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message a machine without CUDA gives")
def test_cuda_without_a_gpu_is_a_clear_error(gqa_ckpt):
    with pytest.raises(LlamaError, match="no CUDA GPU"):
        build(gqa_ckpt, device="cuda")


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_defaults_to_bf16_and_cache_matches(gqa_ckpt, monkeypatch):
    from llama import Llama

    monkeypatch.setenv("LLAMA_DEVICE", "")  # the default device, not the CPU the other tests keep to

    llama = Llama.build(gqa_ckpt, max_seq_len=64, max_batch_size=4)
    assert llama.device.type == "cuda"
    assert llama.model.output.weight.dtype == (torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16)
    f32 = Llama.build(gqa_ckpt, max_seq_len=64, max_batch_size=4, dtype="float32")
    prompts = [[1, 306, 465, 278], [1, 150]]
    cached = f32.generate(prompts, 16, temperature=0, logprobs=True, kv_cache=True)
    uncached = f32.generate(prompts, 16, temperature=0, logprobs=True, kv_cache=False)
    assert cached[0] == uncached[0]
    # TF32 matmuls are off by default in PyTorch, so float32 on the GPU is held to nearly the CPU tolerance.
    torch.testing.assert_close(torch.tensor(cached[1]), torch.tensor(uncached[1]), rtol=0, atol=1e-4)


@pytest.mark.parametrize("in_the_way", ["file", "directory", "link"])
def test_overwrite_leaves_only_the_new_checkpoint(tmp_path, in_the_way):
    dest = tmp_path / "out" / "ckpt"
    dest.parent.mkdir()
    if in_the_way == "file":
        dest.write_text("an old file")
    elif in_the_way == "directory":
        write_tiny(dest, seed=1)
    else:
        (tmp_path / "target").write_text("kept")
        dest.symlink_to(tmp_path / "target")
    with pytest.raises(LlamaError, match="already exists"):
        write_tiny(dest)
    _, state_dict = write_random_checkpoint(dest, tiny_args(), overwrite=True)
    assert os.listdir(dest.parent) == ["ckpt"]  # nothing hidden (no .ckpt.old-PID) beside it
    assert sorted(os.listdir(dest)) == ["consolidated.00.pth", "params.json"]
    assert torch.equal(torch.load(dest / "consolidated.00.pth", weights_only=True)["norm.weight"], state_dict["norm.weight"])
    if in_the_way == "link":
        assert (tmp_path / "target").read_text() == "kept"  # the link is replaced, not what it points to
