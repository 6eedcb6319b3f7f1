"""Tokens as OpenAI's logprobs report them: the bytes each stands for, and their text."""

from llama.tokenizer import token_bytes


def token_text(tokenizer, token: int) -> str:
    return token_bytes(tokenizer, token).decode("utf-8", errors="replace")
