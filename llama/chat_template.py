"""A dialog rendered by the model's own chat template: Jinja in a sandbox, as transformers' `apply_chat_template` does.

A Hugging Face folder's or GGUF's tokenizer config keeps the model's `chat_template`; llama/dialog.py's two formats
cover plain dialogs, and the template is run where they fall short: a dialog with tools, whose template knows them
(it reads the `tools` variable), so the model sees its tools, its calls and their results as it was tuned to. The
template sees what transformers gives one: `messages` (an assistant's `tool_calls` with their arguments as JSON
values), `tools` (OpenAI's function objects), `add_generation_prompt`, `bos_token` and `eos_token`, in transformers'
environment: a sandbox, `trim_blocks` and `lstrip_blocks`, loop controls, `{% generation %}` blocks, `raise_exception`,
`strftime_now`, and a `tojson` that keeps non-ASCII text. jinja2 comes with the `server` extra.
"""

import json
import re
from datetime import datetime
from functools import lru_cache
from typing import Any, Dict, List, Optional

from llama.errors import LlamaError
from llama.tokenizer import special_tokens

INSTALL_HINT = 'chat templates need the jinja2 package: pip install "llama-kv[server]"'


class TemplateUnavailable(LlamaError):
    """jinja2 is not installed."""


def knows_tools(template: Optional[str]) -> bool:
    """Whether `template` renders tools: it reads the `tools` variable. False without a template, or for one jinja2
    cannot read.

    Raises:
        TemplateUnavailable: the template names tools, and jinja2 is missing to tell whether it reads them.
    """
    if not template or "tools" not in template:
        return False
    return "tools" in _variables(template)


def render(template: str, messages: List[Dict[str, Any]], tools: Optional[List[Dict[str, Any]]] = None,
           bos_token: str = "", eos_token: str = "") -> str:
    """The prompt text of `messages` (and `tools`), ending where the assistant's reply begins.

    Raises:
        TemplateUnavailable: jinja2 is missing.
        LlamaError: the template cannot be read, or it refuses or fails on these messages (its reason says which).
    """
    compiled = _compile(template)
    try:
        return compiled.render(messages=messages, tools=tools, add_generation_prompt=True, bos_token=bos_token,
                               eos_token=eos_token)
    except Exception as e:  # a template is a program: whatever it raises on these messages is why they are refused
        raise LlamaError(f"the model's chat template cannot render these messages: {e}") from None


def encode_rendered(tokenizer, text: str) -> List[int]:
    """Token ids of a rendered template: the special tokens it writes (such as "<|im_start|>" or "<s>") as their
    ids, the text between them as text, as transformers tokenizes a rendered template."""
    if tokenizer.hf_tokenizer is not None:
        return tokenizer.encode(text, bos=False, eos=False)  # a tokenizer.json splits at its special tokens itself
    ids = {name: i for i, name in special_tokens(tokenizer).items()}
    if not ids:
        return tokenizer.encode(text, bos=False, eos=False)
    tokens: List[int] = []
    for piece in _special_pattern(tuple(ids)).split(text):
        if piece in ids:
            tokens.append(ids[piece])
        elif piece:
            tokens += tokenizer.encode(piece, bos=False, eos=False)
    return tokens


def token_text(tokenizer, token: int) -> str:
    """The text a template writes for a token such as bos or eos ("" for none)."""
    if token < 0:
        return ""
    if tokenizer.sp_model is not None:
        return tokenizer.sp_model.id_to_piece(token)
    return tokenizer.hf_tokenizer.id_to_token(token) or ""


@lru_cache(maxsize=8)
def _special_pattern(names: tuple) -> "re.Pattern":
    return re.compile("(" + "|".join(re.escape(n) for n in sorted(names, key=len, reverse=True)) + ")")


def _jinja2():
    try:
        import jinja2
        import jinja2.ext
        import jinja2.meta
        import jinja2.sandbox
    except ImportError:
        raise TemplateUnavailable(INSTALL_HINT) from None
    return jinja2


@lru_cache(maxsize=1)
def _environment():
    """transformers' environment for chat templates."""
    jinja2 = _jinja2()

    class Generation(jinja2.ext.Extension):
        """`{% generation %}...{% endgeneration %}`, which marks an assistant's text for training: its text."""

        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(["name:endgeneration"], drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller):
            return caller()

    def raise_exception(message):
        raise jinja2.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                       extensions=[Generation, jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda format: datetime.now().strftime(format)
    return env


@lru_cache(maxsize=8)
def _variables(template: str) -> frozenset:
    jinja2 = _jinja2()
    try:
        return frozenset(jinja2.meta.find_undeclared_variables(_environment().parse(template)))
    except jinja2.TemplateSyntaxError:
        return frozenset()


@lru_cache(maxsize=8)
def _compile(template: str):
    jinja2 = _jinja2()
    try:
        return _environment().from_string(template)
    except jinja2.TemplateSyntaxError as e:
        raise LlamaError(f"the model's chat template is not valid Jinja (line {e.lineno}: {e.message})") from None
