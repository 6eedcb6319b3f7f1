"""LLaMA-2 inference with a switchable KV cache; imports as Meta's `llama` package does."""

from llama.constraint import Grammar
from llama.dialog import Dialog
from llama.errors import LlamaError
from llama.generation import Llama
from llama.model import ModelArgs, Transformer
from llama.tokenizer import Tokenizer

__all__ = ["Dialog", "Grammar", "Llama", "LlamaError", "ModelArgs", "Tokenizer", "Transformer"]
