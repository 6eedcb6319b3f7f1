"""The tokenizer: SentencePiece (LLaMA-2's `tokenizer.model`) or Hugging Face (`tokenizer.json`), behind
Meta's small interface.

A `tokenizer_config.json` beside the file, when present, says what the vocabulary alone cannot: which
tokens are bos, eos and the end of a turn, whether a prompt starts with bos, and the chat format. Its
keys are a subset of Hugging Face's file of the same name, so theirs is read too:

    {"bos_token": "<|im_start|>", "eos_token": "<|im_end|>", "pad_token": "<|im_end|>",
     "add_bos_token": false, "stop_tokens": ["<|im_end|>", "<|endoftext|>"],
     "chat_format": "chatml", "default_system_prompt": "You are ...", "chat_template": "..."}

Every key is optional. Without the file a SentencePiece model behaves as Meta's reference does.
"""

from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING, Any, Dict, List, Optional, Sequence

from llama.errors import LlamaError
from llama.runtime.files import read_json_object

if TYPE_CHECKING:
    from sentencepiece import SentencePieceProcessor

CONFIG_NAME = "tokenizer_config.json"
CHAT_FORMATS = ("llama2", "chatml")


class Tokenizer:
    """Encodes text to token ids and back.

    Args:
        model_path: a SentencePiece `tokenizer.model`, or a Hugging Face `tokenizer.json`.

    Raises:
        LlamaError: the file is missing or is not a tokenizer, or its `tokenizer_config.json` is malformed.
    """

    def __init__(self, model_path: str):
        path = Path(model_path)
        if not path.is_file():
            raise LlamaError(f"tokenizer file {path} does not exist")
        self.path = path
        config = read_tokenizer_config(path.parent / CONFIG_NAME)
        self.sp_model: Optional["SentencePieceProcessor"] = None
        self.hf_tokenizer = None
        if path.suffix == ".json":
            self._load_hf(path)
        else:
            self._load_sentencepiece(path)

        self.n_words: int = self._vocab_size()
        self.bos_id: int = self._config_id(config, "bos_token", self.bos_id)
        self.eos_id: int = self._config_id(config, "eos_token", self.eos_id)
        self.pad_id: int = self._config_id(config, "pad_token", self.pad_id)
        # Whether `encode(..., bos=True)` really adds bos: models such as SmolLM2 are trained without it.
        self.add_bos: bool = bool(config.get("add_bos_token", True)) and self.bos_id >= 0
        # Tokens that end a generated row: eos, and for chat models the end-of-turn token.
        stops = [self._required_id(config, t, "stop_tokens") for t in config.get("stop_tokens", [])]
        self.stop_ids: List[int] = stops or [self.eos_id]
        self.chat_format: str = _chat_format(config, path.parent / CONFIG_NAME)
        self.default_system_prompt: Optional[str] = config.get("default_system_prompt")
        # The model's own Jinja template, kept for what the chat formats do not cover (llama/chat_template.py).
        template = config.get("chat_template")
        self.chat_template: Optional[str] = template if isinstance(template, str) and template else None

    def _load_sentencepiece(self, path: Path) -> None:
        from sentencepiece import SentencePieceProcessor  # here: a tokenizer.json (the default model's) needs none

        self.sp_model = SentencePieceProcessor()
        try:
            self.sp_model.Load(str(path))
        except (OSError, RuntimeError) as e:
            raise LlamaError(f"{path} is not a SentencePiece tokenizer model ({e})") from None
        self.bos_id, self.eos_id, self.pad_id = self.sp_model.bos_id(), self.sp_model.eos_id(), self.sp_model.pad_id()

    def _load_hf(self, path: Path) -> None:
        try:
            from tokenizers import Tokenizer as HFTokenizer
        except ImportError:
            raise LlamaError(f"{path} is a Hugging Face tokenizer; install the `tokenizers` package to use it") from None
        try:
            self.hf_tokenizer = HFTokenizer.from_file(str(path))
        except Exception as e:  # tokenizers raises a bare Exception for a malformed file
            raise LlamaError(f"{path} is not a Hugging Face tokenizer.json ({str(e).splitlines()[0]})") from None
        # No config: no bos/eos known. -1 is what SentencePiece reports for an id a model lacks.
        self.bos_id = self.eos_id = self.pad_id = -1

    def _vocab_size(self) -> int:
        if self.sp_model is not None:
            return self.sp_model.vocab_size()
        return self.hf_tokenizer.get_vocab_size(with_added_tokens=True)

    def token_to_id(self, piece: str) -> Optional[int]:
        """The id of one whole token such as "<|im_end|>", or None when the vocabulary lacks it."""
        if self.sp_model is not None:
            token_id = self.sp_model.piece_to_id(piece)
            # SentencePiece answers unk for a piece it does not know.
            return None if token_id == self.sp_model.unk_id() and piece != self.sp_model.id_to_piece(token_id) else token_id
        return self.hf_tokenizer.token_to_id(piece)

    def _config_id(self, config: Dict[str, Any], key: str, default: int) -> int:
        if config.get(key) is None:
            return default
        return self._required_id(config, config[key], key)

    def _required_id(self, config: Dict[str, Any], token: Any, key: str) -> int:
        piece = token.get("content") if isinstance(token, dict) else token  # Hugging Face writes AddedToken dicts
        token_id = self.token_to_id(piece) if isinstance(piece, str) else None
        if token_id is None:
            raise LlamaError(f"{self.path.parent / CONFIG_NAME}: {key} names {token!r}, which is not a token of {self.path}")
        return token_id

    def encode(self, s: str, bos: bool, eos: bool) -> List[int]:
        """Token ids of `s`, with the beginning- and end-of-sequence ids added when asked.

        `bos` adds nothing for a model whose config says prompts do not start with it. With a Hugging Face
        tokenizer, special tokens written in the text (such as "<|im_start|>") become their ids.
        """
        if not isinstance(s, str):
            raise TypeError(f"encode expects a str, got {type(s).__name__}")
        try:
            s.encode("utf-8")
        except UnicodeEncodeError:  # lone surrogates: bytes that were not UTF-8, smuggled through the command line
            raise LlamaError("the text is not valid UTF-8; save it as UTF-8 and try again") from None
        if self.sp_model is not None:
            t = self.sp_model.encode(s)
        else:
            t = self.hf_tokenizer.encode(s, add_special_tokens=False).ids
        if bos and self.add_bos:
            t = [self.bos_id] + t
        if eos:
            t = t + [self.eos_id]
        return t

    def decode(self, t: Sequence[int]) -> str:
        """The text of token ids; control tokens such as bos and eos decode to nothing."""
        if self.sp_model is not None:
            return self.sp_model.decode(list(t))
        return self.hf_tokenizer.decode(list(t), skip_special_tokens=True)


def read_tokenizer_config(path: Path) -> Dict[str, Any]:
    """The contents of a `tokenizer_config.json`, or {} when there is none."""
    if not path.is_file():
        return {}
    config = read_json_object(path)
    if not isinstance(config.get("stop_tokens", []), list):
        raise LlamaError(f"{path}: stop_tokens must be a list of token strings")
    return config


def _chat_format(config: Dict[str, Any], path: Path) -> str:
    """The config's chat format, or the one its Jinja chat template evidently writes (LLaMA-2's by default)."""
    chat_format = config.get("chat_format")
    if chat_format is None:
        template = config.get("chat_template") or ""
        chat_format = "chatml" if "<|im_start|>" in str(template) else "llama2"
    if chat_format not in CHAT_FORMATS:
        raise LlamaError(f"{path}: chat_format {chat_format!r} is not one of {', '.join(CHAT_FORMATS)}")
    return chat_format


@lru_cache(maxsize=8)
def special_tokens(tokenizer) -> Dict[int, str]:
    """{id: text} of the tokens that stand for no text of their own (bos, eos, ChatML's tags, unk); read once per
    tokenizer (the caller must not change it)."""
    sp = tokenizer.sp_model
    if sp is not None:
        return {i: sp.id_to_piece(i) for i in range(tokenizer.n_words) if sp.is_control(i) or sp.is_unknown(i)}
    return {i: t.content for i, t in tokenizer.hf_tokenizer.get_added_tokens_decoder().items() if t.special}


def token_bytes(tokenizer, token: int) -> bytes:
    """The bytes one token stands for, as OpenAI's logprobs report them and as a grammar reads them."""
    sp = getattr(tokenizer, "sp_model", None)
    if sp is not None:
        if sp.is_control(token):
            return b""
        if sp.is_byte(token):
            return bytes([int(sp.id_to_piece(token)[1:-1], 16)])  # "<0x0A>"
        return sp.id_to_piece(token).replace("\u2581", " ").encode("utf-8")
    hf = tokenizer.hf_tokenizer
    piece: Optional[str] = hf.id_to_token(token)
    if piece is None:
        return b""
    byte_of = _byte_level_decoder()
    if all(ch in byte_of for ch in piece):  # GPT-2's byte-level alphabet: one character per byte
        return bytes(byte_of[ch] for ch in piece)
    return hf.decode([token], skip_special_tokens=False).encode("utf-8")


_BYTE_LEVEL: dict = {}


def _byte_level_decoder() -> dict:
    """GPT-2's map from the printable characters byte-level BPE writes to the bytes they stand for."""
    if not _BYTE_LEVEL:
        printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
        chars, extra = {}, 0
        for b in range(256):
            if b in printable:
                chars[b] = chr(b)
            else:
                chars[b] = chr(256 + extra)
                extra += 1
        _BYTE_LEVEL.update({c: b for b, c in chars.items()})
    return _BYTE_LEVEL
