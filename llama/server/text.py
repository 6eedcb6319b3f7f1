"""Generated text as a client sees it: decoded as tokens arrive, stop strings cut before they can leak.

Plain Python over the tokenizer. The text is always decoded whole (from a few tokens of context), never
token by token, so SentencePiece's spaces and characters split across byte tokens come out right; what
has been released is always a prefix of the final text, and a stream is the final text in pieces.
"""

from typing import List, Optional, Sequence, Tuple

# Tokens of the prompt decoded in front of a completion, so that its first word keeps its leading space
# (SentencePiece drops the space of a sequence's first word).
CONTEXT_TOKENS = 6


class TextState:
    """The text of one generated sequence, released as soon as no stop string can begin in it.

    Args:
        tokenizer: the model's tokenizer.
        stop: strings that end the text where they first appear; they are never part of it.
        context: token ids decoded in front of the generated ones and then cut off (the prompt's last
            few, for completions; none for chat replies, which start without a space).
    """

    def __init__(self, tokenizer, stop: Sequence[str] = (), context: Sequence[int] = ()):
        self.tokenizer = tokenizer
        self.stop = [s for s in stop if s]
        self.context = list(context)[-CONTEXT_TOKENS:]
        self.context_text = tokenizer.decode(self.context) if self.context else ""
        self.tokens: List[int] = []
        self.text = ""  # the whole text so far, as decoded
        self.released = 0  # characters of it handed out
        self.stopped = False

    def push(self, token: int) -> Tuple[str, bool]:
        """Add one generated token (not a stop token); returns (newly released text, whether a stop string ended it)."""
        assert not self.stopped
        self.tokens.append(token)
        self.text = self._decode()
        start = max(0, self.released - max((len(s) for s in self.stop), default=0))
        hits = [i for i in (self.text.find(s, start) for s in self.stop) if i >= 0]
        if hits:
            self.stopped = True
            self.text = self.text[: min(hits)]
            return self._release(len(self.text)), True
        end = len(self.text)
        while end > self.released and self.text[end - 1] == "\ufffd":  # a character still arriving
            end -= 1
        end -= _held_back(self.text[:end], self.stop)
        return self._release(end), False

    def finish(self) -> str:
        """The sequence ended without a stop string: release everything held back."""
        return self._release(len(self.text))

    def _decode(self) -> str:
        if not self.context:
            return self.tokenizer.decode(self.tokens)
        full = self.tokenizer.decode(self.context + self.tokens)
        if full.startswith(self.context_text):
            return full[len(self.context_text) :]
        return self.tokenizer.decode(self.tokens)  # the context decoded differently in front of them

    def _release(self, end: int) -> str:
        if end <= self.released:
            return ""
        out = self.text[self.released : end]
        self.released = end
        return out


def _held_back(text: str, stops: Sequence[str]) -> int:
    """Characters at the end of `text` that could be the beginning of a stop string."""
    longest = 0
    for s in stops:
        for n in range(min(len(s) - 1, len(text)), longest, -1):
            if text.endswith(s[:n]):
                longest = n
                break
    return longest


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
