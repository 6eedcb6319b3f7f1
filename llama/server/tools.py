"""Tool calls in OpenAI's shape: the tools as text in the prompt, each call generated under a grammar, the reply read back.

The model sees the tools as a system message in the Hermes form many small chat models were tuned on: each tool's JSON
in `<tools>`, and calls written as `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`; earlier calls and the
tools' results go back into the dialog the same way (results as `<tool_response>` in a user turn). The call itself is
generated under a grammar (llama/constraint.py) whose JSON is each tool's name and its parameters' schema, so the
arguments always parse and validate: `tool_choice` "required" or a named function allows only calls, "auto" a call
or text that does not start with one, "none" leaves the tools out of the prompt.
"""

import json
import secrets
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple

from llama.constraint import Grammar

CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"


@dataclass(frozen=True)
class Tool:
    name: str
    description: str
    parameters: Dict[str, Any]


@dataclass(frozen=True)
class ToolUse:
    """What a request's tools allow: the tools, `tool_choice` ("auto", "required" or a tool's name) and whether a
    reply may hold several calls."""

    tools: Tuple[Tool, ...]
    choice: str
    parallel: bool = True


def system_text(use: ToolUse) -> str:
    """The system message that tells the model its tools and how to call them."""
    listed = "\n".join(json.dumps({"type": "function", "function": {"name": t.name, "description": t.description,
                                                                     "parameters": t.parameters}}) for t in use.tools)
    return ("You are a function calling AI model. You are given function signatures within <tools></tools> XML tags. "
            "You may call one or more functions to assist with the user query. Here are the available tools: "
            f"<tools>\n{listed}\n</tools>\nFor each function call, return a JSON object with the function name and "
            f"arguments within {CALL_OPEN}{CALL_CLOSE} XML tags:\n{CALL_OPEN}\n"
            '{"name": <function-name>, "arguments": <args-json-object>}\n' + CALL_CLOSE)


def call_text(name: str, arguments: Any) -> str:
    """One call as the model writes it (and as an assistant message's `tool_calls` go back into the prompt)."""
    return f"{CALL_OPEN}\n{json.dumps({'name': name, 'arguments': arguments})}\n{CALL_CLOSE}"


def response_text(content: str) -> str:
    """A tool's result as it goes back into the prompt."""
    return f"<tool_response>\n{content}\n</tool_response>"


def grammar(use: ToolUse) -> Grammar:
    """What the reply may be: one call (or several, where `parallel`), of the tools `choice` allows; with "auto",
    or instead text that does not start with a call."""
    tools = [t for t in use.tools if use.choice in ("auto", "required") or t.name == use.choice]
    # JSON spaced as json.dumps spaces it, as the system message shows a call: a small model cannot pad a call with
    # whitespace, and the calls it writes read as the ones `call_text` writes back.
    call = {"x-guidance": {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "},
            "anyOf": [{"type": "object", "additionalProperties": False, "required": ["name", "arguments"],
                       "properties": {"name": {"const": t.name}, "arguments": t.parameters}} for t in tools]}
    calls = "call (\"\\n\" call)*" if use.parallel else "call"
    lark = f'start: {calls}{" | TEXT" if use.choice == "auto" else ""}\n'
    lark += f'call: "{CALL_OPEN}\\n" %json {json.dumps(call)} "\\n{CALL_CLOSE}"\n'
    if use.choice == "auto":
        lark += "TEXT: /[^<](.|\\n)*/\n"  # a reply in words: anything not starting with a tag
    return Grammar.from_text(lark)


def read_calls(text: str) -> Optional[List[Dict[str, Any]]]:
    """The calls in a reply, in OpenAI's `tool_calls` shape (arguments as JSON text), or None for a reply in words."""
    if not text.lstrip().startswith(CALL_OPEN):
        return None
    calls = []
    for part in text.split(CALL_OPEN)[1:]:
        body = part.split(CALL_CLOSE)[0].strip()
        try:
            call = json.loads(body)
        except json.JSONDecodeError:  # cut by max_tokens: the complete calls are the reply
            break
        calls.append({"id": "call_" + secrets.token_hex(12), "type": "function",
                      "function": {"name": call["name"], "arguments": json.dumps(call["arguments"])}})
    return calls
