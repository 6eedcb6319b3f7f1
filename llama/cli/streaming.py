"""Printing generated text as it arrives, so that what was streamed equals the final text."""

from typing import Sequence, TextIO

from llama.detokenize import TextState


class TextStream:
    """Print a growing token list's new text as it is released (llama/detokenize.py), stopping at a stop token.

    What is printed is always a prefix of the final decoding: a character split across byte tokens is held
    back until it is complete, and a decoding that revised earlier text waits for more.
    """

    def __init__(self, tokenizer, prefix: Sequence[int], out: TextIO):
        self.tokenizer = tokenizer
        self.out = out
        self.text = TextState(tokenizer)
        self.printed = ""
        self.stopped = False
        if prefix:
            self._write(self.text.extend(prefix)[0])

    def push(self, token: int) -> None:
        if self.stopped:
            return
        if token in self.tokenizer.stop_ids:
            self.stopped = True
            return
        self._write(self.text.push(token)[0])

    def finish(self, final_tokens: Sequence[int]) -> None:
        """Print whatever of the final text is still missing, and end the line."""
        final = self.tokenizer.decode(list(final_tokens))
        if final.startswith(self.printed):
            self.out.write(final[len(self.printed):])
        self.out.write("\n")
        self.out.flush()

    def _write(self, piece: str) -> None:
        if piece:
            self.out.write(piece)
            self.out.flush()
            self.printed += piece
