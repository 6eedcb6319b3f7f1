"""Printing generated text as it arrives, so that what was streamed equals the final text."""

from typing import List, Sequence, TextIO


class TextStream:
    """Decode a growing token list and print only what is new.

    Decoding the whole list each time, rather than token by token, keeps SentencePiece's leading spaces
    and multi-byte characters right: a character split across byte tokens is held back until it is
    complete (its partial decoding ends in U+FFFD), and the text printed is always a prefix of the
    final decoding.
    """

    def __init__(self, tokenizer, prefix: Sequence[int], out: TextIO):
        self.tokenizer = tokenizer
        self.out = out
        self.tokens: List[int] = list(prefix)
        self.printed = ""
        self.stopped = False
        if self.tokens:
            self._emit()

    def push(self, token: int) -> None:
        if self.stopped:
            return
        if token in self.tokenizer.stop_ids:
            self.stopped = True
            return
        self.tokens.append(token)
        self._emit()

    def finish(self, final_tokens: Sequence[int]) -> None:
        """Print whatever of the final text is still missing, and end the line."""
        final = self.tokenizer.decode(list(final_tokens))
        if final.startswith(self.printed):
            self.out.write(final[len(self.printed):])
        self.out.write("\n")
        self.out.flush()

    def _emit(self) -> None:
        text = self.tokenizer.decode(self.tokens)
        if text.endswith("\ufffd") or not text.startswith(self.printed):
            return  # an incomplete character, or a decoding that revised earlier text: wait for more
        self.out.write(text[len(self.printed):])
        self.out.flush()
        self.printed = text
