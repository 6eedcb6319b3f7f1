"""Tokens as OpenAI's logprobs report them: the bytes each stands for, and their text."""

from typing import Optional


def token_bytes(tokenizer, token: int) -> bytes:
    """The bytes one token stands for, as OpenAI's logprobs report them (`bytes`, and the token's text)."""
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


def token_text(tokenizer, token: int) -> str:
    return token_bytes(tokenizer, token).decode("utf-8", errors="replace")


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
