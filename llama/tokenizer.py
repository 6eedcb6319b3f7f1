"""The tokenizer: LLaMA-2's SentencePiece model, behind Meta's small interface."""

from pathlib import Path
from typing import List, Sequence

from sentencepiece import SentencePieceProcessor

from llama.errors import LlamaError


class Tokenizer:
    """Encodes text to token ids and back.

    Args:
        model_path: a SentencePiece `tokenizer.model`.

    Raises:
        LlamaError: the file is missing or is not a tokenizer model.
    """

    def __init__(self, model_path: str):
        path = Path(model_path)
        if not path.is_file():
            raise LlamaError(f"tokenizer file {path} does not exist")
        self.path = path
        self.sp_model = SentencePieceProcessor()
        try:
            self.sp_model.Load(str(path))
        except (OSError, RuntimeError) as e:
            raise LlamaError(f"{path} is not a SentencePiece tokenizer model ({e})") from None
        self.n_words: int = self.sp_model.vocab_size()
        self.bos_id: int = self.sp_model.bos_id()
        self.eos_id: int = self.sp_model.eos_id()
        self.pad_id: int = self.sp_model.pad_id()
        # Tokens that end a generated row.
        self.stop_ids: List[int] = [self.eos_id]

    def encode(self, s: str, bos: bool, eos: bool) -> List[int]:
        """Token ids of `s`, with the beginning- and end-of-sequence ids added when asked."""
        if not isinstance(s, str):
            raise TypeError(f"encode expects a str, got {type(s).__name__}")
        t = self.sp_model.encode(s)
        if bos:
            t = [self.bos_id] + t
        if eos:
            t = t + [self.eos_id]
        return t

    def decode(self, t: Sequence[int]) -> str:
        """The text of token ids; control tokens such as bos and eos decode to nothing."""
        return self.sp_model.decode(list(t))
