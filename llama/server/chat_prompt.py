"""A chat request's messages and tools checked, and made into the prompt's tokens.

Through the model's own chat template where the dialog has tools and the template knows them; else in the model's
chat format (llama/dialog.py), the tools written in the Hermes form (llama/server/tools.py).
"""

import json
from typing import Any, Dict, List, Optional

from llama import chat_template
from llama.chat_template import TemplateUnavailable
from llama.dialog import encode_dialog, has_special_tags
from llama.errors import LlamaError
from llama.server import tools as tool_calls
from llama.server.fields import ApiError, boolean, kind_of
from llama.tokenizer import special_tokens

ROLES = ("system", "user", "assistant")


def check_message(m: Any, i: int) -> Dict[str, Any]:
    """A message checked: its role, its content as a string, an assistant's calls (each's id, name and arguments'
    JSON text) and a tool result's call id."""
    if not isinstance(m, dict):
        raise ApiError(400, f"messages[{i}] must be an object with a role and content", "messages", "invalid_type")
    role = "system" if m.get("role") == "developer" else m.get("role")
    if role not in ROLES + ("tool",):
        raise ApiError(400, f"messages[{i}].role must be one of {', '.join(ROLES + ('tool',))}, not {m.get('role')!r}",
                       "messages", "invalid_value")
    content = m.get("content")
    if content is None and role == "assistant":
        content = ""
    if isinstance(content, list):  # content parts: only text ones
        if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in content):
            raise ApiError(400, f"messages[{i}].content parts must all be text ({{'type': 'text', 'text': ...}})",
                           "messages", "invalid_value")
        content = "".join(p["text"] for p in content)
    if not isinstance(content, str):
        raise ApiError(400, f"messages[{i}].content must be a string or a list of text parts", "messages", "invalid_type")
    checked: Dict[str, Any] = {"role": role, "content": content}
    if role == "assistant" and m.get("tool_calls"):
        checked["tool_calls"] = []
        try:
            for c in m["tool_calls"]:
                name, arguments = c["function"]["name"], c["function"]["arguments"]
                json.loads(arguments)
                if not isinstance(name, str):
                    raise TypeError(name)
                checked["tool_calls"].append({"id": c.get("id"), "name": name, "arguments": arguments.strip()})
        except (TypeError, KeyError, ValueError, AttributeError):
            raise ApiError(400, f"messages[{i}].tool_calls must each be {{'type': 'function', 'function': {{'name': "
                                "..., 'arguments': JSON text}}", "messages", "invalid_value") from None
    if role == "tool" and isinstance(m.get("tool_call_id"), str):
        checked["tool_call_id"] = m["tool_call_id"]
    return checked


def chat_prompt(tokenizer, messages: List[Dict[str, Any]], use: Optional[tool_calls.ToolUse]) -> List[int]:
    """The prompt's tokens: through the model's chat template where the dialog has tools (offered, called or
    answered) and the template knows them; else in the model's chat format, the tools in the Hermes form."""
    template = getattr(tokenizer, "chat_template", None)
    involved = use is not None or any(m["role"] == "tool" or m.get("tool_calls") for m in messages)
    try:
        if involved and chat_template.knows_tools(template):
            return _templated_prompt(tokenizer, template, messages, use)
    except TemplateUnavailable as e:
        raise ApiError(500, f"this server cannot run the model's chat template: {e}", None,
                       "chat_template_unavailable") from None
    dialog = _hermes_dialog(messages, use)
    if has_special_tags(dialog, getattr(tokenizer, "chat_format", "llama2")):
        raise ApiError(400, "messages may not contain the chat format's own tags", "messages", "invalid_value")
    try:
        return encode_dialog(tokenizer, dialog)
    except LlamaError as e:
        raise ApiError(400, str(e), "messages", "invalid_value") from None


def _hermes_dialog(messages: List[Dict[str, Any]], use: Optional[tool_calls.ToolUse]) -> List[Dict[str, str]]:
    """The dialog with tools in the Hermes form: the tools first in the system message, where the model looks for
    them; calls as the model wrote them; results as one user turn after the calls (the chat formats alternate user
    and assistant)."""
    dialog: List[Dict[str, Any]] = []
    for m in messages:
        if m["role"] == "tool":
            result = tool_calls.response_text(m["content"])
            if dialog and dialog[-1].get("tool"):
                dialog[-1]["content"] += "\n" + result
            else:
                dialog.append({"role": "user", "content": result, "tool": True})
        elif m.get("tool_calls"):
            written = [tool_calls.call_text(c["name"], c["arguments"]) for c in m["tool_calls"]]
            content = "\n".join(([m["content"]] if m["content"] else []) + written)
            dialog.append({"role": "assistant", "content": content})
        else:
            dialog.append({"role": m["role"], "content": m["content"]})
    if use is not None:
        system = tool_calls.system_text(use)
        if dialog[0]["role"] == "system":
            dialog[0] = {"role": "system", "content": system + "\n\n" + dialog[0]["content"]}
        else:
            dialog.insert(0, {"role": "system", "content": system})
    return [{"role": m["role"], "content": m["content"]} for m in dialog]


def _templated_prompt(tokenizer, template: str, messages: List[Dict[str, Any]],
                      use: Optional[tool_calls.ToolUse]) -> List[int]:
    """The dialog through the model's own template, in the shape transformers gives one: an assistant's calls with
    their arguments as JSON values, the tools as OpenAI's function objects."""
    shaped = []
    for m in messages:
        out = {"role": m["role"], "content": m["content"]}
        if m.get("tool_calls"):
            out["tool_calls"] = [{**({"id": c["id"]} if c["id"] is not None else {}), "type": "function",
                                  "function": {"name": c["name"], "arguments": json.loads(c["arguments"])}}
                                 for c in m["tool_calls"]]
        if "tool_call_id" in m:
            out["tool_call_id"] = m["tool_call_id"]
        shaped.append(out)
    tools = None if use is None else [
        {"type": "function", "function": {"name": t.name, "description": t.description, "parameters": t.parameters}}
        for t in use.tools]
    # The template writes the special tokens; text from the request must not forge them.
    special = set(special_tokens(tokenizer).values())
    for param, given in [("messages", shaped), ("tools", tools or [])]:
        forged = sorted({t for text in _strings(given) for t in special if t and t in text})
        if forged:
            raise ApiError(400, f"{param} may not contain the model's special tokens ({', '.join(forged)})", param,
                           "invalid_value")
    try:
        text = chat_template.render(template, shaped, tools,
                                    bos_token=chat_template.token_text(tokenizer, tokenizer.bos_id),
                                    eos_token=chat_template.token_text(tokenizer, tokenizer.eos_id))
    except LlamaError as e:
        raise ApiError(400, str(e), "messages", "invalid_value") from None
    prompt = chat_template.encode_rendered(tokenizer, text)
    if not prompt:
        raise ApiError(400, "the model's chat template renders these messages as no text", "messages", "invalid_value")
    return prompt


def _strings(value: Any):
    """Every string in a JSON value, its keys included."""
    if isinstance(value, str):
        yield value
    elif isinstance(value, dict):
        for key, item in value.items():
            yield from _strings(key)
            yield from _strings(item)
    elif isinstance(value, list):
        for item in value:
            yield from _strings(item)


def check_tools(body: Dict[str, Any]) -> Optional[tool_calls.ToolUse]:
    """`tools`, `tool_choice` and `parallel_tool_calls`, checked; None where no tool may be called."""
    given = body.get("tools")
    if given is None or given == []:
        return None
    if not isinstance(given, list):
        raise ApiError(400, f"Invalid type for 'tools': expected an array, but got {kind_of(given)} instead.", "tools",
                       "invalid_type")
    tools = []
    for i, t in enumerate(given):
        f = t.get("function") if isinstance(t, dict) and t.get("type", "function") == "function" else None
        if not isinstance(f, dict) or not isinstance(f.get("name"), str) or not f["name"]:
            raise ApiError(400, f"tools[{i}] must be {{'type': 'function', 'function': {{'name': ..., 'parameters': "
                                "...}}", "tools", "invalid_value")
        parameters = f.get("parameters", {"type": "object", "properties": {}})
        if not isinstance(parameters, dict):
            raise ApiError(400, f"tools[{i}].function.parameters must be a JSON schema object", "tools", "invalid_type")
        tools.append(tool_calls.Tool(f["name"], str(f.get("description") or ""), parameters))
    choice = body.get("tool_choice", "auto")
    if isinstance(choice, dict):
        name = (choice.get("function") or {}).get("name") if choice.get("type", "function") == "function" else None
        if name not in [t.name for t in tools]:
            raise ApiError(400, f"'tool_choice' names {name!r}, which is not one of the tools", "tool_choice",
                           "invalid_value")
        choice = name
    elif choice == "none":
        return None
    elif choice not in ("auto", "required"):
        raise ApiError(400, f"Invalid 'tool_choice': expected 'none', 'auto', 'required' or a function, but got "
                            f"{choice!r} instead.", "tool_choice", "invalid_value")
    return tool_calls.ToolUse(tuple(tools), choice, boolean(body, "parallel_tool_calls", True))
