"""LLaMA-2's real 32,000-piece vocabulary in model files: a quantized GGUF through llama-convert, checked
against transformers loading the same GGUF, and a scaled-down random LLaMA-2 checkpoint.

The first run downloads the vocabulary (see test_llama2_tokenizer.py); later runs use the kept files.
"""

import json
from pathlib import Path

import pytest
import torch
from sentencepiece import SentencePieceProcessor

from gguf_writer import MIXED_TYPES, write_llama_gguf
from helpers import PROMPT, convert_cli, run
from llama import Llama
from llama.convert.llama2_vocab import TOKENIZER_MODEL, VOCAB_GGUF, fetch_llama2_vocab, read_llama_cpp_vectors

# Every test writes a model with the 32,000-piece vocabulary, or runs one in transformers beside ours.
pytestmark = pytest.mark.slow

PROMPT_IDS = [1, 306, 4658, 278, 6593, 310, 2834, 338]
GEN_LEN = 20


@pytest.fixture(scope="module")
def vocab_dir() -> Path:
    return fetch_llama2_vocab()


@pytest.fixture(scope="module")
def gguf_dir(vocab_dir, tmp_path_factory) -> Path:
    """A folder holding only the GGUF file: transformers reads whatever tokenizer files sit beside it."""
    folder = tmp_path_factory.mktemp("gguf")
    write_llama_gguf(folder / "model.gguf", vocab_gguf=vocab_dir / VOCAB_GGUF)
    return folder


@pytest.fixture(scope="module")
def converted(gguf_dir, tmp_path_factory) -> Path:
    dest = tmp_path_factory.mktemp("converted") / "ckpt"
    # Float weights: these tests edit them and compare float logits with transformers' (tests of the
    # quantized conversion are in test_quant_convert.py).
    result = convert_cli(gguf_dir / "model.gguf", dest, "--dequantize")
    assert result.returncode == 0, result.stderr
    return dest


@pytest.fixture(scope="module")
def ours(converted) -> Llama:
    return Llama.build(converted, device="cpu", dtype="float32", max_seq_len=64, max_batch_size=1)


@pytest.fixture(scope="module")
def theirs(gguf_dir):
    transformers = pytest.importorskip("transformers")
    model = transformers.LlamaForCausalLM.from_pretrained(str(gguf_dir), gguf_file="model.gguf", dtype=torch.float32)
    return model.eval()


def test_the_file_mixes_f32_f16_and_q8_0(gguf_dir):
    import gguf

    reader = gguf.GGUFReader(gguf_dir / "model.gguf")
    types = {t.name: t.tensor_type.name for t in reader.tensors}
    assert set(types.values()) == {"F32", "F16", "Q8_0"}
    assert types["token_embd.weight"] == "Q8_0" and types["blk.1.ffn_norm.weight"] == "F32"
    assert [int(n) for n in reader.get_tensor(0).shape] == [64, 32000]  # GGUF lists dims fastest-first
    assert set(MIXED_TYPES) == {name.split(".")[-2] for name in types}


def test_convert_writes_meta_layout_with_the_llama2_tokenizer(converted, vocab_dir):
    assert sorted(p.name for p in converted.iterdir()) == [
        "consolidated.00.pth", "params.json", "tokenizer.model", "tokenizer_config.json"]
    params = json.loads((converted / "params.json").read_text())
    assert params == {"dim": 64, "n_layers": 2, "n_heads": 8, "n_kv_heads": 2, "vocab_size": 32000,
                      "multiple_of": 256, "norm_eps": 1e-05, "rope_theta": 10000.0, "hidden_dim": 160}

    sp = SentencePieceProcessor(model_file=str(converted / "tokenizer.model"))
    reference = SentencePieceProcessor(model_file=str(vocab_dir / TOKENIZER_MODEL))
    assert sp.encode(PROMPT, add_bos=True) == PROMPT_IDS
    texts = [text for text, _ in read_llama_cpp_vectors(vocab_dir)]
    assert [sp.encode(t) for t in texts] == [reference.encode(t) for t in texts]
    assert [sp.id_to_piece(i) for i in range(32000)] == [reference.id_to_piece(i) for i in range(32000)]


def test_logits_match_transformers(ours, theirs):
    assert ours.tokenizer.encode(PROMPT, bos=True, eos=False) == PROMPT_IDS
    tokens = torch.tensor([PROMPT_IDS])
    with torch.no_grad():
        expected = theirs(tokens).logits
    got = ours.model(tokens)
    assert got.shape == expected.shape == (1, len(PROMPT_IDS), 32000)
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-4)
    # The logits are far from flat, so agreeing within 1e-4 says something.
    assert expected.std() > 0.5


def test_rotary_layout_matters(ours, theirs):
    """The comparison is sensitive to the q/k row order that GGUF keeps: transformers' half-split order fails it."""
    tokens = torch.tensor([PROMPT_IDS])
    with torch.no_grad():
        expected = theirs(tokens).logits
    attention = ours.model.layers[0].attention
    original = attention.wq.weight.clone()
    rows, cols = original.shape
    head_dim = rows // attention.n_heads
    try:
        # (n_heads, head_dim // 2, 2, cols) -> (n_heads, 2, head_dim // 2, cols): Meta's order to transformers'.
        attention.wq.weight.copy_(original.reshape(-1, head_dim // 2, 2, cols).transpose(1, 2).reshape(rows, cols))
        assert (ours.model(tokens) - expected).abs().max() > 1e-2
    finally:
        attention.wq.weight.copy_(original)


def test_greedy_continuation_matches_transformers_with_and_without_cache(ours, theirs):
    """Both run GEN_LEN greedy steps whatever they pick, end-of-sequence included (ignore_stop here; no
    eos_token_id there: transformers' min_new_tokens would forbid eos rather than run on through it)."""
    cached, _ = ours.generate([PROMPT_IDS], max_gen_len=GEN_LEN, temperature=0, kv_cache=True, ignore_stop=True)
    uncached, _ = ours.generate([PROMPT_IDS], max_gen_len=GEN_LEN, temperature=0, kv_cache=False, ignore_stop=True)
    theirs.generation_config.eos_token_id = None
    with torch.no_grad():
        hf = theirs.generate(torch.tensor([PROMPT_IDS]), attention_mask=torch.ones(1, len(PROMPT_IDS), dtype=torch.long),
                             max_new_tokens=GEN_LEN, do_sample=False, pad_token_id=0)
    expected = hf[0, len(PROMPT_IDS):].tolist()
    assert len(expected) == GEN_LEN
    assert cached[0] == uncached[0] == expected


def test_scaled_down_llama2_checkpoint_with_the_real_tokenizer(vocab_dir, tmp_path):
    dest = tmp_path / "small7b"
    result = run("scripts/write_random_checkpoint.py", dest, "--size", "7B", "--n_layers", "2", "--dim", "256",
                 "--n_heads", "2", "--tokenizer", vocab_dir / TOKENIZER_MODEL, "--dtype", "float32")
    assert result.returncode == 0, result.stderr
    params = json.loads((dest / "params.json").read_text())
    # The 7B preset's vocab_size -1 is resolved from the tokenizer when the file is written.
    assert (params["vocab_size"], params["dim"], params["n_heads"], params["n_layers"]) == (32000, 256, 2, 2)

    llama = Llama.build(dest, device="cpu", dtype="float32", max_seq_len=32, max_batch_size=1)
    assert llama.model.params.vocab_size == llama.tokenizer.n_words == 32000
    assert llama.model.output.weight.shape == (32000, 256)
    assert llama.tokenizer.encode(PROMPT, bos=True, eos=False) == PROMPT_IDS
    cached, _ = llama.generate([PROMPT_IDS], max_gen_len=8, temperature=0, kv_cache=True, ignore_stop=True)
    uncached, _ = llama.generate([PROMPT_IDS], max_gen_len=8, temperature=0, kv_cache=False, ignore_stop=True)
    assert len(cached[0]) == 8 and cached == uncached
    assert all(0 <= t < 32000 for t in cached[0])
