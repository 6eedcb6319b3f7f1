"""Tool calls in OpenAI's shape: the tools as text in the prompt, each call generated under a grammar, the reply read back.

The model sees the tools as a system message in the Hermes form many small chat models were tuned on: each tool's JSON
in `<tools>`, and calls written as `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`; earlier calls and the
tools' results go back into the dialog the same way (results as `<tool_response>` in a user turn). The call itself is
generated under a grammar (llama/constraint.py) whose JSON is each tool's name and its parameters' schema, so the
arguments always parse and validate: `tool_choice` "required" or a named function allows only calls, "auto" a call
or text that does not start with one, "none" leaves the tools out of the prompt. The reply is read as it comes
(`ReplyReader`): a call's name as soon as it is whole, then its arguments' text as the model writes it, which is what
a whole reply's `tool_calls` hold too.
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


def call_text(name: str, arguments: str) -> str:
    """One call as the model writes it (and as an assistant message's `tool_calls` go back into the prompt), its
    arguments' JSON text as given."""
    return f'{CALL_OPEN}\n{{"name": {json.dumps(name)}, "arguments": {arguments}}}\n{CALL_CLOSE}'


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


class ReplyReader:
    """A reply read as it is generated, into the deltas OpenAI streams: `{"content": ...}` for a reply in words, or
    for calls `{"tool_calls": [...]}`, each call's index, id, type and name first (its arguments "") and then its
    arguments' text piece by piece, as the model writes it.

    A reply is calls when it starts (after whitespace) with `<tool_call>`; until that is known its text is held.
    `read_reply` reads a whole reply with the same reader, so a streamed reply joins into the one sent whole.
    """

    def __init__(self):
        self.text = ""
        self.mode: Optional[str] = None  # None until known, then "text" or "calls"
        self.sent = 0  # "text": characters of it sent as content
        self.calls: List[_Call] = []  # "calls": one a `<tool_call>` opened
        self.named = 0  # calls whose name has been sent

    def feed(self, piece: str) -> List[Dict[str, Any]]:
        """The deltas that `piece`, the reply's next text, makes sendable."""
        self.text += piece
        if self.mode is None:
            head = self.text.lstrip()
            if head.startswith(CALL_OPEN):
                self.mode = "calls"
            elif not CALL_OPEN.startswith(head):
                self.mode = "text"
        if self.mode == "text":
            return self._content()
        return self._calls() if self.mode == "calls" else []

    def finish(self) -> List[Dict[str, Any]]:
        """The deltas left at the reply's end: text held while it might have been a call, or, where no call got as
        far as its name, the whole reply as content."""
        if self.mode == "calls" and self.named:
            return []
        if self.mode != "text":
            self.mode, self.sent = "text", 0
        return self._content() or ([{"content": ""}] if self.sent == 0 else [])

    @property
    def has_calls(self) -> bool:
        return self.mode == "calls" and self.named > 0

    def _content(self) -> List[Dict[str, Any]]:
        if len(self.text) == self.sent:
            return []
        piece, self.sent = self.text[self.sent:], len(self.text)
        return [{"content": piece}]

    def _calls(self) -> List[Dict[str, Any]]:
        out = []
        while True:
            if not self.calls or self.calls[-1].closed:
                after = self.calls[-1].pos if self.calls else 0
                found = self.text.find(CALL_OPEN, after)
                if found < 0:
                    return out
                self.calls.append(_Call(found + len(CALL_OPEN)))
            call = self.calls[-1]
            call.scan(self.text)
            if call.index is None and call.name is not None:
                call.index, self.named = self.named, self.named + 1
                out.append({"tool_calls": [{"index": call.index, "id": "call_" + secrets.token_hex(12),
                                            "type": "function", "function": {"name": call.name, "arguments": ""}}]})
            if call.index is not None:
                arguments = call.arguments(self.text)
                if len(arguments) > call.sent:
                    out.append({"tool_calls": [{"index": call.index,
                                                "function": {"arguments": arguments[call.sent:]}}]})
                    call.sent = len(arguments)
            if not call.closed:
                return out


class _Call:
    """One call's JSON object, scanned as it comes: its `name` once that string is whole, and where the text of its
    `arguments` value starts and (once it has) ends."""

    def __init__(self, start: int):
        self.pos = start  # the next character to scan
        self.depth, self.in_string, self.escaped, self.closed = 0, False, False, False
        self.phase = "key"  # of the object's own members: "key", "colon", "value", "in_value" or "after"
        self.key: Optional[str] = None
        self.start = self.end = 0  # the current member's key or value; `end` is just past its last solid character
        self.name: Optional[str] = None
        self.arguments_span: Optional[List[Optional[int]]] = None  # [start, end or None while it runs]
        self.index: Optional[int] = None  # its place in `tool_calls`, once its name is sent
        self.sent = 0  # characters of the arguments sent

    def scan(self, text: str) -> None:
        for i in range(self.pos, len(text)):
            if self.closed:
                return
            self.pos = i + 1
            c = text[i]
            if self.in_string:
                if self.escaped:
                    self.escaped = False
                elif c == "\\":
                    self.escaped = True
                elif c == '"':
                    self.in_string = False
                    if self.depth == 1:
                        self._member_string_ends(text, i + 1)
                continue
            if c in " \t\r\n":
                continue
            if self.depth == 1 and self.phase == "value":
                self.phase, self.start = "in_value", i
                if self.key == "arguments":
                    self.arguments_span = [i, None]
            scalar_end, self.end = self.end, i + 1
            if c == '"':
                self.in_string = True
                if self.depth == 1 and self.phase == "key":
                    self.start = i
            elif c in "{[":
                self.depth += 1
            elif c in "}]":
                self.depth -= 1
                if self.depth == 1 and self.phase == "in_value":  # an object or array value closes
                    self._value_ends(text, i + 1)
                elif self.depth == 0:
                    if self.phase == "in_value":  # a number, true, false or null closes with the object
                        self._value_ends(text, scalar_end)
                    self.closed = True
            elif c == ":" and self.depth == 1 and self.phase == "colon":
                self.phase = "value"
            elif c == "," and self.depth == 1:
                if self.phase == "in_value":
                    self._value_ends(text, scalar_end)
                self.phase = "key"

    def arguments(self, text: str) -> str:
        """The arguments' text so far: whole once they end, else up to the last character scanned (less trailing
        whitespace after a number, which may end it)."""
        if self.arguments_span is None:
            return ""
        start, end = self.arguments_span
        if end is not None:
            return text[start:end]
        so_far = text[start:self.pos]
        return so_far.rstrip() if self.depth == 1 and not self.in_string else so_far

    def _member_string_ends(self, text: str, end: int) -> None:
        if self.phase == "key":
            try:
                self.key = json.loads(text[self.start:end])
            except json.JSONDecodeError:
                self.key = None
            self.phase = "colon"
        elif self.phase == "in_value":
            self._value_ends(text, end)

    def _value_ends(self, text: str, end: int) -> None:
        if self.key == "name" and self.name is None and text[self.start] == '"':
            try:
                self.name = json.loads(text[self.start:end])
            except json.JSONDecodeError:
                pass
        if self.key == "arguments" and self.arguments_span is not None:
            self.arguments_span[1] = end
        self.phase = "after"


def read_reply(text: str) -> Tuple[Optional[str], Optional[List[Dict[str, Any]]]]:
    """A whole reply as (content, None), or where it calls tools (None, calls in OpenAI's `tool_calls` shape): read
    by `ReplyReader`, so it is what a stream of the same text joins into. A call cut short (max_tokens) keeps the
    arguments written so far, as OpenAI's does."""
    reader = ReplyReader()
    content, calls = None, []
    for delta in reader.feed(text) + reader.finish():
        if "content" in delta:
            content = (content or "") + delta["content"]
        for part in delta.get("tool_calls", []):
            if part["index"] == len(calls):
                calls.append({"id": part["id"], "type": "function",
                              "function": {"name": part["function"]["name"], "arguments": ""}})
            calls[part["index"]]["function"]["arguments"] += part["function"]["arguments"]
    return (None, calls) if calls else (content, None)
