"""Generated text as a reader sees it: decoded as tokens arrive, stop strings cut before they can leak.

Plain Python over the tokenizer. The text is always decoded whole (from a few tokens of context), never
token by token, so SentencePiece's spaces and characters split across byte tokens come out right; what
has been released is always a prefix of the final text, and a stream is the final text in pieces. The
commands print with it (llama/cli/streaming.py) and the server streams with it (llama/server/engine.py).
"""

from typing import List, Sequence, Tuple

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
        self.released_text = ""  # those characters
        self.stopped = False

    def push(self, token: int) -> Tuple[str, bool]:
        """Add one generated token (not a stop token); returns (newly released text, whether a stop string ended it)."""
        return self.extend([token])

    def extend(self, tokens: Sequence[int]) -> Tuple[str, bool]:
        """`push` for several tokens at once, decoding once."""
        assert not self.stopped
        self.tokens.extend(tokens)
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
        if end <= self.released or not self.text.startswith(self.released_text):
            return ""  # nothing new, or a decoding that revised what was released: wait for more
        out = self.text[self.released : end]
        self.released, self.released_text = end, self.text[:end]
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
