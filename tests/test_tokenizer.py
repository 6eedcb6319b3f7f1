"""The example SentencePiece tokenizer: LLaMA-2's settings at a smaller vocabulary."""

import pytest

from helpers import EXAMPLE_TOKENIZER
from llama.errors import LlamaError
from llama.tokenizer import Tokenizer

TEXTS = [
    "I believe the meaning of life is",
    "  two leading spaces, and\ttabs\nand newlines\n\n",
    "digits 1234567890 split one by one",
    "unicode: héllo wörld, 世界, emoji 🦙, Ελληνικά",
    "def f(x):\n    return x ** 2  # code",
    "",
]


def test_special_ids_are_llama2s():
    tok = Tokenizer(EXAMPLE_TOKENIZER)
    assert (tok.n_words, tok.bos_id, tok.eos_id, tok.pad_id) == (4000, 1, 2, -1)
    assert tok.sp_model.unk_id() == 0


@pytest.mark.parametrize("text", TEXTS)
def test_decode_inverts_encode(text):
    tok = Tokenizer(EXAMPLE_TOKENIZER)
    ids = tok.encode(text, bos=True, eos=True)
    assert ids[0] == 1 and ids[-1] == 2
    assert tok.decode(ids) == text


def test_unknown_characters_fall_back_to_bytes():
    tok = Tokenizer(EXAMPLE_TOKENIZER)
    ids = tok.encode("🦙", bos=False, eos=False)
    assert 0 not in ids  # no unk: byte fallback
    assert [tok.sp_model.id_to_piece(i) for i in ids][-4:] == ["<0xF0>", "<0x9F>", "<0xA6>", "<0x99>"]


def test_digits_are_split():
    tok = Tokenizer(EXAMPLE_TOKENIZER)
    pieces = [tok.sp_model.id_to_piece(i) for i in tok.encode("2024", bos=False, eos=False)]
    assert "".join(pieces).replace("\u2581", "") == "2024" and len(pieces) >= 4


def test_bad_tokenizer_files_are_refused(tmp_path):
    with pytest.raises(LlamaError, match="does not exist"):
        Tokenizer(tmp_path / "missing.model")
    junk = tmp_path / "tokenizer.model"
    junk.write_bytes(b"this is not a protobuf")
    with pytest.raises(LlamaError, match="is not a SentencePiece tokenizer model"):
        Tokenizer(junk)
