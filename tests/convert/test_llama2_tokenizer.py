"""LLaMA-2's real tokenizer, rebuilt from llama.cpp's vocab-only GGUF file, against llama.cpp's test vectors.

The first run downloads the llama-cpp-python source distribution (about 77 MB) through pip; later runs
use the files kept in `<llama home>/llama2-tokenizer`.
"""

import os
import shutil

import gguf
import pytest
from sentencepiece import SentencePieceProcessor

from llama.convert.llama2_vocab import (
    TOKENIZER_MODEL,
    VOCAB_GGUF,
    fetch_llama2_vocab,
    read_llama_cpp_vectors,
)
from llama.convert.spm_from_gguf import sentencepiece_model_from_gguf, write_sentencepiece_model
from llama.errors import LlamaError


@pytest.fixture(scope="session")
def vocab_dir():
    return fetch_llama2_vocab()


@pytest.fixture(scope="session")
def sp(vocab_dir):
    return SentencePieceProcessor(model_file=str(vocab_dir / TOKENIZER_MODEL))


@pytest.fixture(scope="session")
def vectors(vocab_dir):
    return read_llama_cpp_vectors(vocab_dir)


def test_special_ids_and_size(sp):
    assert sp.vocab_size() == 32000
    assert (sp.unk_id(), sp.bos_id(), sp.eos_id(), sp.pad_id()) == (0, 1, 2, -1)
    assert [sp.id_to_piece(i) for i in range(3)] == ["<unk>", "<s>", "</s>"]
    assert sp.is_unknown(0) and sp.is_control(1) and sp.is_control(2)
    # The 256 byte-fallback pieces follow the specials, in byte order.
    assert all(sp.is_byte(i) for i in range(3, 259)) and not sp.is_byte(259)
    assert sp.id_to_piece(3 + 0x0A) == "<0x0A>"


def test_meta_example_prompt(sp):
    ids = sp.encode("I believe the meaning of life is", add_bos=True)
    assert ids == [1, 306, 4658, 278, 6593, 310, 2834, 338]


def test_vector_files_parse(vectors):
    # One vector per input in llama.cpp's convert_hf_to_gguf_update.py test list at this version.
    assert len(vectors) == 46
    assert vectors[0] == ("ied 4 ½ months", [474, 287, 29871, 29946, 29871, 30226, 7378])
    assert ("", []) in vectors
    assert ("\n\n", [29871, 13, 13]) in vectors
    assert len({text for text, _ in vectors}) == len(vectors)


def test_every_llama_cpp_vector_matches(sp, vectors):
    # The ids were written with add_special_tokens=False and llama.cpp compares them with add_special
    # false, so no bos on either side; the leading "▁" (29871) comes from SentencePiece's dummy prefix,
    # not from special handling, and must be kept.
    mismatches = [(text, sp.encode(text), ids) for text, ids in vectors if sp.encode(text) != ids]
    assert mismatches == []


def test_leading_space_keeps_its_own_piece(sp):
    assert sp.encode("Hello world") == [15043, 3186]
    assert sp.encode(" Hello world") == [29871, 15043, 3186]
    assert sp.encode("  Hello") == [259, 15043]


def test_decode_inverts_encode_on_vectors(sp, vectors):
    # The normalizer is "identity", so no character is rewritten and every vector round-trips,
    # leading spaces, tabs, newlines and byte-fallback emoji included.
    failures = [text for text, _ in vectors if sp.decode(sp.encode(text)) != text]
    assert failures == []


def test_decode_does_not_invert_the_whitespace_marker(sp):
    # The one exception under an identity normalizer: "▁" (U+2581) is SentencePiece's own escape for a
    # space, so a literal "▁" in the input encodes like a space and decodes as one.
    text = "a\u2581b"
    assert sp.encode(text) == sp.encode("a b")
    assert sp.decode(sp.encode(text)) == "a b"


@pytest.mark.slow
def test_tokenizer_model_matches_a_fresh_rebuild(vocab_dir, tmp_path):
    gguf_path = vocab_dir / VOCAB_GGUF
    rebuilt = sentencepiece_model_from_gguf(gguf_path)
    assert (vocab_dir / TOKENIZER_MODEL).read_bytes() == rebuilt
    assert sentencepiece_model_from_gguf(gguf.GGUFReader(gguf_path)) == rebuilt

    dest = write_sentencepiece_model(gguf_path, tmp_path / "tokenizer.model")
    assert dest.read_bytes() == rebuilt
    assert dest.stat().st_mode & 0o777 == 0o644
    assert [p.name for p in tmp_path.iterdir()] == ["tokenizer.model"]  # no temporary file left behind


def test_fetch_is_a_no_op_when_complete(vocab_dir, capsys):
    before = {p.name: p.stat().st_mtime_ns for p in vocab_dir.iterdir()}
    reports = []
    assert fetch_llama2_vocab(vocab_dir, progress=lambda *r: reports.append(r)) == vocab_dir
    assert reports == [] and capsys.readouterr().err == ""
    assert {p.name: p.stat().st_mtime_ns for p in vocab_dir.iterdir()} == before


def test_non_llama_gguf_is_rejected(tmp_path):
    path = tmp_path / "gpt2-vocab.gguf"
    writer = gguf.GGUFWriter(str(path), arch="gpt2")
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(["a", "b", "ab"])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()

    with pytest.raises(LlamaError, match="gpt2") as excinfo:
        sentencepiece_model_from_gguf(path)
    assert str(path) in str(excinfo.value)


def test_missing_gguf_is_a_llama_error(tmp_path):
    with pytest.raises(LlamaError, match="does not exist"):
        sentencepiece_model_from_gguf(tmp_path / "absent.gguf")


def test_failed_download_is_a_llama_error(tmp_path, monkeypatch):
    # A real pip run that cannot succeed: no config files, no index, and an empty folder of links.
    monkeypatch.setenv("PIP_CONFIG_FILE", os.devnull)
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(tmp_path))
    dest = tmp_path / "vocab"
    with pytest.raises(LlamaError, match=r"pip could not download llama-cpp-python==0\.3\.36"):
        fetch_llama2_vocab(dest)
    assert not dest.exists()
    assert [p.name for p in tmp_path.iterdir()] == []  # the staging directory was cleaned up


@pytest.mark.slow
def test_transformers_drops_the_leading_space_piece(vocab_dir, sp, vectors, tmp_path):
    """Where Hugging Face's GGUF loader parts ways with SentencePiece on the same vocabulary.

    transformers builds a `tokenizers` Metaspace pre-tokenizer that prepends "▁" only when the text does
    not already start with a space, so " Hello world" loses the 29871 that SentencePiece (and the ids
    llama.cpp recorded) keep. Every vector that starts with a space differs; every other one agrees.
    """
    transformers = pytest.importorskip("transformers")
    # The GGUF file alone in its folder: with a tokenizer.model beside it, transformers 5.23 builds yet
    # another tokenizer (no "▁" prepended at all), which agrees with only 1 of the 46 vectors.
    shutil.copy(vocab_dir / VOCAB_GGUF, tmp_path / VOCAB_GGUF)
    hf = transformers.AutoTokenizer.from_pretrained(str(tmp_path), gguf_file=VOCAB_GGUF)

    assert sp.encode(" Hello world") == [29871, 15043, 3186]
    assert hf.encode(" Hello world", add_special_tokens=False) == [15043, 3186]

    agrees = {text: hf.encode(text, add_special_tokens=False) == ids for text, ids in vectors}
    assert agrees == {text: not text.startswith(" ") for text, _ in vectors}
    assert sum(agrees.values()) == 31
