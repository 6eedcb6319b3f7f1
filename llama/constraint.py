"""Structured outputs: a grammar every generated token must keep to, applied as a mask on a row's logits.

The grammar engine is llguidance (the `structured` extra): it compiles a JSON schema, or a Lark or llama.cpp GBNF
grammar, against the tokenizer's vocabulary, and before each token says which tokens may come next. It was chosen
over xgrammar and outlines-core for compiling a schema in milliseconds and masking a vocabulary in microseconds with
no dependencies of its own (xgrammar masked faster but brings torch, transformers and triton; outlines-core compiled
schemas slowly).

A row's mask is a pure function of the tokens it has generated (`Constraint.mask` catches the matcher up with them),
as the sampling controls are: a row gets the same tokens through the KV cache or without it, alone or in a batch.
Tokens the grammar forbids get a logit of -inf; once the grammar is complete only the stop tokens stay, so a
constrained row ends with finish reason "stop" unless max_tokens cuts it first.
"""

import json
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, List, Sequence, Union

import numpy as np
import torch

from llama.errors import LlamaError
from llama.tokenizer import special_tokens, token_bytes

INSTALL_HINT = 'structured outputs need the llguidance package: pip install "llama-kv[structured]"'

# Whitespace a JSON reply may have between its tokens: none, one space, or a newline and an indent of up to 20
# (llama.cpp's json-schema-to-grammar allows the same). Unbounded whitespace lets a small model pad a reply with
# blank lines until max_tokens.
JSON_WHITESPACE = r"(?: |\n[ \t]{0,20})?"


class StructuredUnavailable(LlamaError):
    """llguidance is not installed."""


def _llguidance():
    try:
        import llguidance
    except ImportError:
        raise StructuredUnavailable(INSTALL_HINT) from None
    return llguidance


@dataclass(frozen=True)
class Grammar:
    """What a constrained row's text must be, as llguidance's grammar text; made by the static methods below.

    `kind` is what the user gave ("json_schema", "json_object" or "grammar"), for messages.
    """

    source: str
    kind: str

    @staticmethod
    def json_schema(schema: Union[dict, bool, str]) -> "Grammar":
        """A JSON value valid under `schema` (a dict, or its JSON text).

        Raises:
            LlamaError: the schema is not JSON, or llguidance is missing.
        """
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except json.JSONDecodeError as e:
                raise LlamaError(f"the JSON schema is not valid JSON: {e}") from None
        if not isinstance(schema, (dict, bool)):
            raise LlamaError(f"a JSON schema must be an object, not {type(schema).__name__}")
        llg = _llguidance()
        try:
            source = llg.LLMatcher.grammar_from_json_schema(schema, defaults={"whitespace_pattern": JSON_WHITESPACE})
        except ValueError as e:
            raise LlamaError(f"the JSON schema is invalid: {e}") from None
        return Grammar(source, "json_schema")

    @staticmethod
    def json_object() -> "Grammar":
        """Any JSON object (OpenAI's `{"type": "json_object"}`)."""
        return Grammar(Grammar.json_schema({"type": "object"}).source, "json_object")

    @staticmethod
    def from_text(text: str) -> "Grammar":
        """A grammar in llguidance's Lark-like form (`start: ...`) or llama.cpp's GBNF (`root ::= ...`).

        Raises:
            LlamaError: GBNF that could not be read, or llguidance is missing.
        """
        llg = _llguidance()
        try:
            source = llg.grammar_from("grammar", text)
        except ValueError as e:
            raise LlamaError(f"the grammar is invalid: {e}") from None
        return Grammar(source, "grammar")

    def check(self, tokenizer) -> None:
        """Compile the grammar against the vocabulary once, to refuse it before any work.

        Raises:
            LlamaError: the grammar or schema is invalid, with llguidance's reason.
        """
        llg = _llguidance()
        is_error, messages = llg.LLMatcher.validate_grammar_with_warnings(self.source, ll_tokenizer(tokenizer))
        if is_error:
            what = "JSON schema" if self.kind == "json_schema" else "grammar"
            raise LlamaError(f"the {what} is invalid: {_first_lines(messages[0])}")


class Constraint:
    """One row's grammar state: the mask on its next token's logits, given the tokens it has generated.

    Args:
        grammar: what the row's text must be.
        tokenizer: the model's tokenizer. Logits wider than its vocabulary (a model's padding rows) are masked.

    Raises:
        LlamaError: the grammar is invalid (`Grammar.check` says so before any work).
    """

    def __init__(self, grammar: Grammar, tokenizer):
        llg = _llguidance()
        self.vocab_size = tokenizer.n_words
        self.matcher = llg.LLMatcher(ll_tokenizer(tokenizer), grammar.source, log_level=0)
        if self.matcher.is_error():
            raise LlamaError(f"the {grammar.kind.replace('_', ' ')} is invalid: {_first_lines(self.matcher.get_error())}")
        self._consumed: List[int] = []
        self._bitmask = np.zeros((self.vocab_size + 31) // 32, dtype=np.int32)

    def mask(self, logits: torch.Tensor, generated: Sequence[int]) -> torch.Tensor:
        """`logits` (vocab,) with every token the grammar forbids after `generated` set to -inf (a new tensor).

        Raises:
            LlamaError: `generated` holds a token the grammar forbids (it was not chosen under this mask).
        """
        self._catch_up(generated)
        self.matcher.unsafe_compute_mask_ptr(self._bitmask.ctypes.data, self._bitmask.nbytes)
        # One bit a token, the lowest bit of each 32-bit word first: unpacked little-endian, bytes in memory order.
        forbidden = np.unpackbits(self._bitmask.view(np.uint8), bitorder="little")[: self.vocab_size] == 0
        width = logits.shape[-1]
        if width != self.vocab_size:
            forbidden = np.concatenate([forbidden, np.ones(max(0, width - self.vocab_size), dtype=bool)])[:width]
        if logits.device.type == "cpu" and logits.dtype == torch.float32:
            # numpy's masked copy: faster than torch's masked_fill over a vocabulary's logits.
            out = logits.numpy().copy()
            np.copyto(out, np.float32(-np.inf), where=forbidden)
            return torch.from_numpy(out)
        return logits.masked_fill(torch.from_numpy(forbidden).to(logits.device), -float("inf"))

    def _catch_up(self, generated: Sequence[int]) -> None:
        """Bring the matcher to the state after `generated`, from where it was (usually one token behind)."""
        k = len(self._consumed)
        if list(generated[:k]) != self._consumed:  # another history than the one consumed: start again
            self.matcher.reset()
            self._consumed, k = [], 0
        for token in generated[k:]:
            if not self.matcher.consume_token(int(token)):
                raise LlamaError(f"token {token} breaks the grammar: {_first_lines(self.matcher.get_error())}")
            self._consumed.append(int(token))


@lru_cache(maxsize=8)
def ll_tokenizer(tokenizer) -> Any:
    """llguidance's view of the tokenizer: each token's bytes, special tokens marked, and the stop tokens as its eos.
    Built once per tokenizer (about 0.4 s for a 49,152-token vocabulary)."""
    llg = _llguidance()
    tokens = [token_bytes(tokenizer, i) for i in range(tokenizer.n_words)]
    special = special_tokens(tokenizer)
    for i, name in special.items():
        tokens[i] = b"\xff" + name.encode("utf-8")  # llguidance's marker: never matched as text
    built = {}

    def encode(text: Union[bytes, str]) -> List[int]:
        """Text to tokens, as llguidance asks for the forced parts of a grammar (a key's quotes and name)."""
        text = text.decode("utf-8", errors="replace") if isinstance(text, bytes) else text
        if tokenizer.hf_tokenizer is not None:
            return tokenizer.hf_tokenizer.encode(text, add_special_tokens=False).ids
        # SentencePiece would put its word-start space before the text; the longest-match tokens have none.
        return built["tokenizer"].greedy_tokenize(text) if "tokenizer" in built else []

    class _Vocabulary:
        eos_token_id = tokenizer.stop_ids[0]
        bos_token_id = tokenizer.bos_id if tokenizer.bos_id >= 0 else None
        special_token_ids = sorted(special)

        def __init__(self):
            self.tokens = tokens

        def __call__(self, text):
            return encode(text)

    built["tokenizer"] = llg.LLTokenizer(llg.TokenizerWrapper(_Vocabulary()), eos_token=list(tokenizer.stop_ids))
    return built["tokenizer"]


def _first_lines(message: str, n: int = 3) -> str:
    """llguidance's reason without the parser state and grammar it appends."""
    head = message.split("\n<state>")[0].split("\n<grammar>")[0].strip()
    return " ".join(head.splitlines()[:n])
