"""LLaMA-2 inference with a switchable KV cache."""

from llama.errors import LlamaError
from llama.generation import Llama
from llama.model import ModelArgs, Transformer
from llama.tokenizer import Tokenizer

__all__ = ["Llama", "LlamaError", "ModelArgs", "Tokenizer", "Transformer"]
