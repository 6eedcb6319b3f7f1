"""llama-convert: a tiny random transformers LLaMA, saved as a Hugging Face directory and as a GGUF file,
converts into Meta's layout and computes the same logits as transformers does."""

import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from helpers import EXAMPLE_TOKENIZER, HF_SHAPE, convert_cli, save_hf, tiny_hf_model, write_gguf
from llama import Llama
from llama.errors import LlamaError
from llama.tokenizer import Tokenizer

transformers = pytest.importorskip("transformers")
gguf = pytest.importorskip("gguf")


# A tied model converts as an untied one with its embedding copied into the output layer: the quick tier has untied.
@pytest.fixture(scope="module", params=[False, pytest.param(True, marks=pytest.mark.slow)], ids=["untied", "tied"])
def hf_model(request):
    return tiny_hf_model(tied=request.param)


def assert_same_logits(ckpt: Path, hf_model) -> float:
    llama = Llama.build(ckpt, max_seq_len=64, max_batch_size=4, device="cpu", dtype="float32")
    ids = torch.randint(3, HF_SHAPE["vocab_size"], (3, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ours = llama.model(ids)
        theirs = hf_model(ids).logits.float()
    diff = (ours - theirs).abs().max().item()
    torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-5)
    return diff


@pytest.mark.slow
def test_hf_directory_converts_to_the_same_logits(hf_model, tmp_path):
    src = save_hf(hf_model, tmp_path / "hf")
    result = convert_cli(src, tmp_path / "meta")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().splitlines()[-1] == str(tmp_path / "meta")
    params = __import__("json").loads((tmp_path / "meta" / "params.json").read_text())
    assert params["hidden_dim"] == 200 and params["rope_theta"] == 500000.0 and params["norm_eps"] == 1e-6
    assert params["n_kv_heads"] == 2
    assert_same_logits(tmp_path / "meta", hf_model)
    # The tokenizer is the source's, unchanged.
    assert (tmp_path / "meta" / "tokenizer.model").read_bytes() == EXAMPLE_TOKENIZER.read_bytes()


def test_gguf_converts_to_the_same_logits(hf_model, tmp_path):
    src = write_gguf(hf_model, tmp_path / "tiny.gguf")
    result = convert_cli(src, tmp_path / "meta")
    assert result.returncode == 0, result.stderr
    # Progress as lines (stderr is not a terminal here), from the callback the command renders.
    for step in ("reading GGUF tensors", "writing checkpoint"):
        assert f"llama-convert: {step}: 100% after " in result.stderr, result.stderr
    assert_same_logits(tmp_path / "meta", hf_model)
    # The SentencePiece model rebuilt from the GGUF vocabulary encodes as the original does.
    ours, original = Tokenizer(str(tmp_path / "meta" / "tokenizer.model")), Tokenizer(str(EXAMPLE_TOKENIZER))
    text = "Hello world, 123 naïve   spaces\n\nand lines"
    assert ours.encode(text, bos=True, eos=False) == original.encode(text, bos=True, eos=False)


def test_gguf_rows_are_in_meta_order():
    """transformers turns GGUF's q/k rows into its own order when it loads a GGUF file; undoing its
    permutation as llama-convert does for a Hugging Face directory must give the GGUF rows back, so GGUF
    rows need no permutation to be Meta's."""
    from transformers.modeling_gguf_pytorch_utils import LlamaTensorProcessor

    from llama.convert.hf import unpermute_rotary

    gguf_rows = np.random.default_rng(0).standard_normal((48, 10)).astype(np.float32)
    processor = LlamaTensorProcessor(config={"num_attention_heads": 6, "num_key_value_heads": 6})
    hf_rows = processor.process(gguf_rows, "blk.0.attn_q.weight").weights
    assert not np.array_equal(hf_rows, gguf_rows)
    assert torch.equal(unpermute_rotary(torch.from_numpy(np.ascontiguousarray(hf_rows)), 6), torch.from_numpy(gguf_rows))


@pytest.mark.slow
def test_existing_destination_is_refused(tmp_path):
    src = save_hf(tiny_hf_model(tied=False), tmp_path / "hf")
    dest = tmp_path / "meta"
    dest.mkdir()
    (dest / "keep.txt").write_text("mine")
    result = convert_cli(src, dest)
    assert result.returncode != 0
    lines = result.stderr.strip().splitlines()
    assert lines[-1].startswith("error: ") and "already exists" in lines[-1] and not any("Traceback" in l for l in lines)
    assert sorted(p.name for p in dest.iterdir()) == ["keep.txt"]


@pytest.mark.slow
def test_truncated_gguf_leaves_nothing(tmp_path):
    whole = write_gguf(tiny_hf_model(tied=False), tmp_path / "whole.gguf").read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(whole[: len(whole) * 2 // 3])
    result = convert_cli(cut, tmp_path / "meta")
    assert result.returncode != 0
    assert result.stderr.strip().splitlines()[-1].startswith("error: ") and "cut.gguf" in result.stderr
    assert not (tmp_path / "meta").exists()
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []  # no staging left behind


def test_hf_directory_without_weights_is_refused(tmp_path):
    src = save_hf(tiny_hf_model(tied=False), tmp_path / "hf")
    for path in src.glob("*.safetensors"):
        path.unlink()
    from llama.convert.hf import convert_hf

    with pytest.raises(LlamaError, match="no \\*.safetensors"):
        convert_hf(src, tmp_path / "meta")
    assert not (tmp_path / "meta").exists()


def test_sharded_safetensors_are_read_through_their_index(tmp_path):
    """A Mistral-style directory: sharded model-0000x-of-0000y.safetensors with their index, and a
    consolidated.safetensors (Meta's names) beside them that must not be read."""
    import json

    from safetensors.torch import save_file

    from llama.convert.hf import convert_hf

    model = tiny_hf_model(tied=False)
    src = tmp_path / "hf"
    model.save_pretrained(src, safe_serialization=True, max_shard_size="400KB")
    shutil.copyfile(EXAMPLE_TOKENIZER, src / "tokenizer.model")
    index = json.loads((src / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1  # really sharded
    save_file({"tok_embeddings.weight": torch.zeros(4000, 64), "layers.0.attention.wq.weight": torch.zeros(64, 64)},
              str(src / "consolidated.safetensors"))

    assert_same_logits(convert_hf(src, tmp_path / "meta"), model)

    # The index is what tells the files apart: without it every *.safetensors file is read.
    (src / "model.safetensors.index.json").rename(tmp_path / "index.json")
    with pytest.raises(LlamaError, match=r"holds tensor (tok_embeddings|layers\.0\.attention\.wq)\.weight, which a LLaMA model does not have"):
        convert_hf(src, tmp_path / "meta2")

    # An index naming a file that is not there is one sentence, not a KeyError.
    index["weight_map"]["lm_head.weight"] = "model-00009-of-00009.safetensors"
    (src / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(LlamaError, match="names weight file 'model-00009-of-00009.safetensors', which is not in"):
        convert_hf(src, tmp_path / "meta3")
    assert not (tmp_path / "meta2").exists() and not (tmp_path / "meta3").exists()
