"""Rebuild LLaMA-2's SentencePiece `tokenizer.model` from the vocabulary a GGUF file carries.

A GGUF file with `tokenizer.ggml.model == "llama"` stores the SentencePiece pieces, their scores and their
types, but not the normalizer and trainer settings that decide how text is split. This module supplies
LLaMA-2's settings so that SentencePiece encodes and decodes exactly as Meta's original file does.
"""

import os
from pathlib import Path
from typing import Any, List, Optional, Tuple, Union

import gguf
from sentencepiece import sentencepiece_model_pb2 as spm_pb2

from llama.errors import LlamaError
from llama.runtime.files import write_atomically

_Piece = spm_pb2.ModelProto.SentencePiece

# llama.cpp's token types (llama_token_type) to SentencePiece piece types. The numbers happen to agree
# today; spelling the map out keeps a future renumbering on either side from passing silently.
_PIECE_TYPES = {
    1: _Piece.NORMAL,
    2: _Piece.UNKNOWN,
    3: _Piece.CONTROL,
    4: _Piece.USER_DEFINED,
    5: _Piece.UNUSED,
    6: _Piece.BYTE,
}

# LLaMA-2's ids, used when the GGUF file does not name its own.
_DEFAULT_UNK_ID = 0
_DEFAULT_BOS_ID = 1
_DEFAULT_EOS_ID = 2

GGUFSource = Union[str, os.PathLike, gguf.GGUFReader]


def sentencepiece_model_from_gguf(reader_or_path: GGUFSource) -> bytes:
    """Build a serialized SentencePiece model from a GGUF file's `llama` tokenizer vocabulary.

    Args:
        reader_or_path: a GGUF file path, or a `gguf.GGUFReader` already opened on one.

    Returns:
        The bytes of a SentencePiece `ModelProto`, ready for `SentencePieceProcessor(model_proto=...)`
        or to be written out as `tokenizer.model`.

    Raises:
        LlamaError: the file is missing or not GGUF, its tokenizer is not a `llama` (SentencePiece)
            tokenizer, or its vocabulary is inconsistent.
    """
    reader, name = _open(reader_or_path)

    model = _field(reader, "tokenizer.ggml.model")
    if model != "llama":
        have = "no tokenizer.ggml.model" if model is None else f'tokenizer model "{model}"'
        raise LlamaError(
            f'{name} has {have}, but only a "llama" (SentencePiece) tokenizer can become a tokenizer.model'
        )

    tokens = _required_array(reader, name, "tokenizer.ggml.tokens")
    scores = _required_array(reader, name, "tokenizer.ggml.scores")
    types = _required_array(reader, name, "tokenizer.ggml.token_type")
    if not len(tokens) == len(scores) == len(types):
        raise LlamaError(
            f"{name} has {len(tokens)} tokens but {len(scores)} scores and {len(types)} token types; "
            "re-create the GGUF file with a converter that writes all three"
        )

    proto = spm_pb2.ModelProto()
    for token_id, (piece, score, token_type) in enumerate(zip(tokens, scores, types)):
        if token_type not in _PIECE_TYPES:
            raise LlamaError(
                f"{name} gives token {token_id} ({piece!r}) the type {token_type}, which SentencePiece "
                "has no equivalent for; re-create the GGUF file from the original tokenizer.model"
            )
        proto.pieces.add(piece=piece, score=float(score), type=_PIECE_TYPES[token_type])

    unk_id = _special_id(reader, name, "unknown", _DEFAULT_UNK_ID, proto, _Piece.UNKNOWN)
    bos_id = _special_id(reader, name, "bos", _DEFAULT_BOS_ID, proto, _Piece.CONTROL)
    eos_id = _special_id(reader, name, "eos", _DEFAULT_EOS_ID, proto, _Piece.CONTROL)

    trainer = proto.trainer_spec
    trainer.model_type = spm_pb2.TrainerSpec.BPE
    trainer.vocab_size = len(tokens)
    # Characters outside the vocabulary become <0xNN> byte pieces instead of <unk>.
    trainer.byte_fallback = True
    trainer.split_digits = True
    trainer.allow_whitespace_only_pieces = True
    trainer.treat_whitespace_as_suffix = False
    trainer.unk_id = unk_id
    trainer.bos_id = bos_id
    trainer.eos_id = eos_id
    trainer.pad_id = -1
    # SentencePiece finds bos/eos by piece text, not by id, so the texts must be the vocabulary's own.
    trainer.unk_piece = proto.pieces[unk_id].piece
    trainer.bos_piece = proto.pieces[bos_id].piece
    trainer.eos_piece = proto.pieces[eos_id].piece
    trainer.pad_piece = "<pad>"
    trainer.unk_surface = " \u2047 "

    normalizer = proto.normalizer_spec
    # LLaMA-2 applies no Unicode normalization: "½" or full-width letters keep their own pieces or bytes.
    normalizer.name = "identity"
    normalizer.precompiled_charsmap = b""
    # The leading "▁" that makes "Hello" at the start of text the same token as " Hello" inside it.
    normalizer.add_dummy_prefix = True
    # Runs of spaces are meaningful (code indentation has its own "▁▁▁▁" pieces), so keep them.
    normalizer.remove_extra_whitespaces = False
    normalizer.escape_whitespaces = True

    return proto.SerializeToString()


def write_sentencepiece_model(gguf_path: Union[str, os.PathLike], dest_path: Union[str, os.PathLike]) -> Path:
    """Write the SentencePiece model rebuilt from a GGUF file, replacing `dest_path` atomically.

    Args:
        gguf_path: a GGUF file with a `llama` tokenizer vocabulary.
        dest_path: where to write `tokenizer.model`; its directory must exist.

    Returns:
        `dest_path` as a Path.

    Raises:
        LlamaError: as `sentencepiece_model_from_gguf`, or the destination directory does not exist.
    """
    data = sentencepiece_model_from_gguf(gguf_path)
    dest = Path(dest_path)
    if not dest.parent.is_dir():
        raise LlamaError(f"directory {dest.parent} does not exist; create it before writing {dest.name} there")
    write_atomically(dest, data)
    return dest


def _open(reader_or_path: GGUFSource) -> Tuple[gguf.GGUFReader, str]:
    """The reader and a name for the file to use in messages."""
    if isinstance(reader_or_path, gguf.GGUFReader):
        return reader_or_path, str(getattr(reader_or_path.data, "filename", None) or "the GGUF file")
    path = Path(reader_or_path)
    if not path.is_file():
        raise LlamaError(f"GGUF file {path} does not exist; check the path")
    try:
        return gguf.GGUFReader(path), str(path)
    except (ValueError, OSError) as e:
        raise LlamaError(f"{path} is not a readable GGUF file ({e})") from None


def _field(reader: gguf.GGUFReader, key: str) -> Optional[Any]:
    """The decoded value of a metadata key, or None when the file lacks it."""
    field = reader.get_field(key)
    return None if field is None else field.contents()


def _required_array(reader: gguf.GGUFReader, name: str, key: str) -> List[Any]:
    """A metadata array the tokenizer cannot be built without."""
    value = _field(reader, key)
    if not isinstance(value, list) or not value:
        raise LlamaError(f"{name} has no {key} array; re-create the GGUF file with its tokenizer vocabulary")
    return value


def _special_id(
    reader: gguf.GGUFReader, name: str, which: str, default: int, proto: Any, expected_type: int
) -> int:
    """The id of a special token, checked against the piece type SentencePiece requires for it."""
    key = f"tokenizer.ggml.{which}_token_id"
    value = _field(reader, key)
    token_id = default if value is None else int(value)
    if not 0 <= token_id < len(proto.pieces):
        raise LlamaError(f"{name} sets {key} to {token_id}, outside its {len(proto.pieces)}-token vocabulary")
    piece = proto.pieces[token_id]
    if piece.type != expected_type:
        raise LlamaError(
            f"{name} makes token {token_id} ({piece.piece!r}) its {which} token, but that token's type is "
            f"{_Piece.Type.Name(piece.type)}, not {_Piece.Type.Name(expected_type)}; the vocabulary is inconsistent"
        )
    return token_id
