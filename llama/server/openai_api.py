"""OpenAI's request and response shapes: parameters checked and turned into jobs, results turned into JSON.

Plain Python, no HTTP and no tensors. Everything a client can get wrong is an `ApiError`, which is made
into OpenAI's one error shape here and nowhere else: `{"error": {"message", "type", "param", "code"}}`.
Unknown fields are ignored, as OpenAI's own server does for fields it does not use.
"""

import json
import math
import secrets
import time
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple

from llama import chat_template
from llama.chat_template import TemplateUnavailable
from llama.constraint import Grammar, StructuredUnavailable
from llama.dialog import encode_dialog, has_special_tags
from llama.errors import LlamaError
from llama.sampling import SamplingControls
from llama.server import tools as tool_calls
from llama.server.engine import TokenLogprob
from llama.server.text import token_bytes, token_text
from llama.tokenizer import special_tokens

ROLES = ("system", "user", "assistant")


class ApiError(Exception):
    """A request the server will not run, with the HTTP status and OpenAI's error fields."""

    def __init__(self, status: int, message: str, param: Optional[str] = None, code: Optional[str] = None,
                 type: Optional[str] = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.type = type or ("invalid_request_error" if status < 500 else "server_error")

    def body(self) -> Dict[str, Any]:
        return error_body(self.message, self.type, self.param, self.code)


def error_body(message: str, type: str, param: Optional[str] = None, code: Optional[str] = None) -> Dict[str, Any]:
    """OpenAI's error object: the one shape every error on the wire has."""
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


@dataclass
class Params:
    """What a request asks for, checked; the prompts as token ids."""

    prompts: List[List[int]]
    max_tokens: Optional[int]
    temperature: float = 1.0
    top_p: float = 1.0
    n: int = 1
    seed: Optional[int] = None
    stop: List[str] = field(default_factory=list)
    stream: bool = False
    include_usage: bool = False
    logprobs: Optional[int] = None  # None: none; k: the chosen token's and the k likeliest alternatives
    ignore_eos: bool = False  # vLLM's and llama.cpp's extension: run to max_tokens through stop tokens
    echo: bool = False
    cache_prompt: bool = True  # llama.cpp's extension: False reuses no cached prefix (every prompt token computed)
    prompt_texts: List[str] = field(default_factory=list)  # completions' echo
    controls: Optional[SamplingControls] = None  # penalties, logit_bias, top_k, min_p; None: none asked for
    grammar: Optional[Grammar] = None  # response_format's JSON schema or JSON object, or the tools'; None: free text
    tools: Optional[tool_calls.ToolUse] = None  # the tools a chat reply may call (not with tool_choice "none")


def parse_chat(body: Any, tokenizer, vocab_size: int) -> Params:
    """A chat completion request: messages in the model's chat format, and the common parameters."""
    body = _object(body)
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ApiError(400, "'messages' must be a non-empty list of messages", "messages", "invalid_type")
    checked = [_message(m, i) for i, m in enumerate(messages)]
    use = _tools(body)
    if use is not None and body.get("response_format") not in (None, {"type": "text"}):
        raise ApiError(400, "'response_format' and 'tools' each constrain the reply; give one of them", "response_format",
                       "invalid_value")
    prompt = _chat_prompt(tokenizer, checked, use)
    params = _common(body, [prompt], vocab_size, tokenizer)
    if use is not None:
        params.tools, params.grammar = use, tool_calls.grammar(use)
        try:
            params.grammar.check(tokenizer)
        except StructuredUnavailable as e:
            raise ApiError(400, f"'tools' are not available on this server: {e}", "tools",
                           "structured_outputs_unavailable") from None
        except LlamaError as e:
            raise ApiError(400, f"Invalid 'tools': {e}", "tools", "invalid_value") from None
    if body.get("max_completion_tokens") is not None:
        params.max_tokens = _integer(body, "max_completion_tokens", None, 1)
    if _boolean(body, "logprobs", False):
        params.logprobs = _integer(body, "top_logprobs", 0, 0, 20)
    elif body.get("top_logprobs") is not None:
        raise ApiError(400, "'top_logprobs' needs 'logprobs' set to true", "top_logprobs", "invalid_value")
    return params


def parse_completion(body: Any, tokenizer, vocab_size: int) -> Params:
    """A completion request: a prompt as a string, a list of strings, token ids, or a list of those."""
    body = _object(body)
    prompts, texts = _prompts(body.get("prompt"), tokenizer, vocab_size)
    params = _common(body, prompts, vocab_size, tokenizer)
    params.prompt_texts = texts
    params.echo = _boolean(body, "echo", False)
    if body.get("logprobs") is not None:
        params.logprobs = _integer(body, "logprobs", None, 0, 5)
    return params


def parse_responses(body: Any, tokenizer, vocab_size: int) -> Params:
    """A Responses request, its text subset: `input` (a string, or a list of messages whose content is a string or
    text parts), `instructions` (a system message before them), `max_output_tokens`, `temperature`, `top_p`,
    `stream`, and `text.format` (chat's `response_format` in the Responses form: the schema's `name`, `schema` and
    `strict` beside its `type`). The other fields, tools and stored state among them, are not served and are
    ignored."""
    body = _object(body)
    given = body.get("input")
    if isinstance(given, str):
        given = [{"role": "user", "content": given}]
    if not isinstance(given, list) or not given:
        raise ApiError(400, "'input' must be a string or a non-empty list of messages", "input", "invalid_type")
    messages = []
    for i, item in enumerate(given):
        if not isinstance(item, dict) or item.get("type", "message") != "message":
            raise ApiError(400, f"input[{i}] must be a message ({{'role': ..., 'content': ...}}); other input items "
                                "are not served", "input", "invalid_value")
        content = item.get("content")
        if isinstance(content, list):  # input_text and output_text parts
            if not all(isinstance(p, dict) and p.get("type") in ("input_text", "output_text", "text")
                       and isinstance(p.get("text"), str) for p in content):
                raise ApiError(400, f"input[{i}].content parts must all be text ({{'type': 'input_text', 'text': ...}})",
                               "input", "invalid_value")
            content = "".join(p["text"] for p in content)
        messages.append({"role": item.get("role"), "content": content})
    instructions = body.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise ApiError(400, "'instructions' must be a string", "instructions", "invalid_type")
    if instructions:
        messages.insert(0, {"role": "system", "content": instructions})
    chat = {"messages": messages, "max_tokens": body.get("max_output_tokens"), "temperature": body.get("temperature"),
            "top_p": body.get("top_p"), "stream": body.get("stream")}
    text = body.get("text")
    form = text.get("format") if isinstance(text, dict) else None
    if isinstance(form, dict) and form.get("type") == "json_schema":
        chat["response_format"] = {"type": "json_schema", "json_schema": {k: v for k, v in form.items() if k != "type"}}
    elif form is not None:
        chat["response_format"] = form
    try:
        return parse_chat(chat, tokenizer, vocab_size)
    except ApiError as e:  # in the Responses request's own terms
        e.param = {"messages": "input", "max_tokens": "max_output_tokens"}.get(e.param, e.param)
        if e.param and e.param.startswith("response_format"):
            e.param = "text.format" + e.param[len("response_format"):].replace(".json_schema", "", 1)
        e.message = e.message.replace("'max_tokens'", "'max_output_tokens'").replace("messages[", "input[")
        e.message = e.message.replace("'response_format.json_schema", "'text.format").replace("'response_format",
                                                                                              "'text.format")
        raise


def response_usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> Dict[str, Any]:
    """The Responses API's `usage`."""
    return {"input_tokens": prompt_tokens, "input_tokens_details": {"cached_tokens": cached_tokens},
            "output_tokens": completion_tokens, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": prompt_tokens + completion_tokens}


def check_lengths(params: Params, max_seq_len: int, param: str) -> None:
    """Refuse prompts that leave no room in the context, and replies asked to be longer than the room left."""
    for prompt in params.prompts:
        if len(prompt) >= max_seq_len:
            raise ApiError(400, f"This model's maximum context length is {max_seq_len} tokens. However, your "
                                f"{param} resulted in {len(prompt)} tokens, which leaves no room for a reply. "
                                f"Please reduce the length of the {param}.", param, "context_length_exceeded")
        if params.max_tokens is not None and len(prompt) + params.max_tokens > max_seq_len:
            raise ApiError(400, f"This model's maximum context length is {max_seq_len} tokens. However, you requested "
                                f"{len(prompt) + params.max_tokens} tokens ({len(prompt)} in the {param}, "
                                f"{params.max_tokens} in the completion). Please reduce the length of the {param} "
                                "or completion.", param, "context_length_exceeded")


def new_id(prefix: str) -> str:
    return f"{prefix}-{secrets.token_hex(12)}"


def now() -> int:
    return int(time.time())


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int, disk_tokens: Optional[int] = None,
          drafted: Optional[int] = None, accepted: Optional[int] = None) -> Dict[str, Any]:
    """OpenAI's `usage`. With a disk cache, `prompt_tokens_details.disk_tokens` (ours) says how many of the cached
    tokens came from disk. With speculation, `completion_tokens_details` counts drafted tokens kept and rejected as
    OpenAI counts a prediction's (`accepted_prediction_tokens`, `rejected_prediction_tokens`)."""
    out = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
           "total_tokens": prompt_tokens + completion_tokens,
           "prompt_tokens_details": {"cached_tokens": cached_tokens}}
    if disk_tokens is not None:
        out["prompt_tokens_details"]["disk_tokens"] = disk_tokens
    if drafted is not None:
        out["completion_tokens_details"] = {"accepted_prediction_tokens": accepted,
                                            "rejected_prediction_tokens": drafted - accepted}
    return out


def chat_logprobs(tokenizer, logprobs: List[TokenLogprob]) -> Dict[str, Any]:
    """Chat's `logprobs` object: for each token, its text, bytes, log-probability and the likeliest alternatives."""
    def entry(token: int, logprob: float) -> Dict[str, Any]:
        return {"token": token_text(tokenizer, token), "logprob": logprob, "bytes": list(token_bytes(tokenizer, token))}
    return {"content": [{**entry(x.token, x.logprob), "top_logprobs": [entry(t, lp) for t, lp in x.top]}
                        for x in logprobs]}


def completion_logprobs(tokenizer, logprobs: List[TokenLogprob], offset: int, k: int) -> Dict[str, Any]:
    """Completions' `logprobs` object; `offset` is where the first token's text starts in the choice's text."""
    tokens, offsets = [], []
    for x in logprobs:
        text = token_text(tokenizer, x.token)
        tokens.append(text)
        offsets.append(offset)
        offset += len(text)
    top = [None if x.logprob is None else {token_text(tokenizer, t): lp for t, lp in x.top} for x in logprobs]
    return {"tokens": tokens, "token_logprobs": [x.logprob for x in logprobs],
            "top_logprobs": top if k else None, "text_offset": offsets}


# Checking the parts of a request.

def _object(body: Any) -> Dict[str, Any]:
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    return body


def _message(m: Any, i: int) -> Dict[str, Any]:
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


def _chat_prompt(tokenizer, messages: List[Dict[str, Any]], use: Optional[tool_calls.ToolUse]) -> List[int]:
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


def _tools(body: Dict[str, Any]) -> Optional[tool_calls.ToolUse]:
    """`tools`, `tool_choice` and `parallel_tool_calls`, checked; None where no tool may be called."""
    given = body.get("tools")
    if given is None or given == []:
        return None
    if not isinstance(given, list):
        raise ApiError(400, f"Invalid type for 'tools': expected an array, but got {_kind(given)} instead.", "tools",
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
    return tool_calls.ToolUse(tuple(tools), choice, _boolean(body, "parallel_tool_calls", True))


def _prompts(prompt: Any, tokenizer, vocab_size: int) -> Tuple[List[List[int]], List[str]]:
    def ids(p: List[Any]) -> List[int]:
        if not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab_size for t in p):
            raise ApiError(400, f"token ids in 'prompt' must be whole numbers from 0 to {vocab_size - 1}", "prompt", "invalid_value")
        return list(p)

    def text(s: str) -> List[int]:
        try:
            return tokenizer.encode(s, bos=True, eos=False)
        except LlamaError as e:
            raise ApiError(400, str(e), "prompt", "invalid_value") from None

    if isinstance(prompt, str):
        prompts, texts = [text(prompt)], [prompt]
    elif isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
        prompts, texts = [text(p) for p in prompt], list(prompt)
    elif isinstance(prompt, list) and prompt and all(isinstance(p, int) and not isinstance(p, bool) for p in prompt):
        prompts = [ids(prompt)]
        texts = [tokenizer.decode(prompts[0])]
    elif isinstance(prompt, list) and prompt and all(isinstance(p, list) for p in prompt):
        prompts = [ids(p) for p in prompt]
        texts = [tokenizer.decode(p) for p in prompts]
    else:
        raise ApiError(400, "'prompt' must be a string, a list of strings, a list of token ids or a list of such lists",
                       "prompt", "invalid_type")
    if any(not p for p in prompts):
        raise ApiError(400, "'prompt' must not be empty", "prompt", "invalid_value")
    return prompts, texts


def _common(body: Dict[str, Any], prompts: List[List[int]], vocab_size: int, tokenizer) -> Params:
    params = Params(prompts, _integer(body, "max_tokens", None, 1))
    params.temperature = _number(body, "temperature", 1.0, 0.0, 2.0)
    params.top_p = _number(body, "top_p", 1.0, 0.0, 1.0)
    params.n = _integer(body, "n", 1, 1, 128)
    params.seed = _integer(body, "seed", None, -2**63, 2**64 - 1)
    params.stream = _boolean(body, "stream", False)
    params.ignore_eos = _boolean(body, "ignore_eos", False)
    params.cache_prompt = _boolean(body, "cache_prompt", True)
    options = body.get("stream_options")
    if options is not None and not isinstance(options, dict):
        raise ApiError(400, "'stream_options' must be an object", "stream_options", "invalid_type")
    params.include_usage = bool(options and _boolean(options, "include_usage", False, "stream_options.include_usage"))
    stop = body.get("stop")
    if isinstance(stop, str):
        stop = [stop]
    if stop is not None and not (isinstance(stop, list) and all(isinstance(s, str) for s in stop)):
        raise ApiError(400, "'stop' must be a string or a list of strings", "stop", "invalid_type")
    params.stop = [s for s in (stop or []) if s]
    controls = _controls(body, vocab_size)
    params.controls = controls if controls.active else None
    params.grammar = response_format(body.get("response_format"), tokenizer)
    return params


def response_format(value: Any, tokenizer) -> Optional[Grammar]:
    """OpenAI's `response_format`: `{"type": "text"}` (or none), `{"type": "json_object"}`, or `{"type":
    "json_schema", "json_schema": {"name", "schema", "strict"}}`, checked against the vocabulary. `strict` false is
    served as true: the reply always keeps to the schema."""
    if value is None:
        return None
    if not isinstance(value, dict):
        raise ApiError(400, f"Invalid type for 'response_format': expected an object, but got {_kind(value)} instead.",
                       "response_format", "invalid_type")
    kind = value.get("type")
    if kind == "text":
        return None
    try:
        if kind == "json_object":
            grammar = Grammar.json_object()
        elif kind == "json_schema":
            spec = value.get("json_schema")
            if not isinstance(spec, dict):
                raise ApiError(400, "'response_format.json_schema' must be an object with a 'schema' (and a 'name')",
                               "response_format.json_schema", "invalid_type")
            if spec.get("name") is not None and not isinstance(spec.get("name"), str):
                raise ApiError(400, "'response_format.json_schema.name' must be a string",
                               "response_format.json_schema.name", "invalid_type")
            if spec.get("strict") is not None and not isinstance(spec.get("strict"), bool):
                raise ApiError(400, "'response_format.json_schema.strict' must be a boolean",
                               "response_format.json_schema.strict", "invalid_type")
            schema = spec.get("schema", {})
            if not isinstance(schema, (dict, bool)):
                raise ApiError(400, f"Invalid type for 'response_format.json_schema.schema': expected an object, but "
                                    f"got {_kind(schema)} instead.", "response_format.json_schema.schema", "invalid_type")
            grammar = Grammar.json_schema(schema)
        else:
            raise ApiError(400, f"Invalid 'response_format.type': expected one of 'text', 'json_object' or "
                                f"'json_schema', but got {kind!r} instead.", "response_format.type", "invalid_value")
        grammar.check(tokenizer)
    except StructuredUnavailable as e:
        raise ApiError(400, f"response_format {kind!r} is not available on this server: {e}", "response_format",
                       "structured_outputs_unavailable") from None
    except LlamaError as e:
        raise ApiError(400, f"Invalid 'response_format': {e}", "response_format", "invalid_json_schema") from None
    return grammar


def _controls(body: Dict[str, Any], vocab_size: int) -> SamplingControls:
    """OpenAI's penalties and `logit_bias`, and the `top_k`, `min_p`, `repeat_penalty` and `repeat_last_n` of vLLM
    and llama.cpp (llama/sampling.py applies them)."""
    bias = body.get("logit_bias")
    if bias is not None and not isinstance(bias, dict):
        raise ApiError(400, f"Invalid type for 'logit_bias': expected an object, but got {_kind(bias)} instead.",
                       "logit_bias", "invalid_type")
    pairs = []
    for key, value in (bias or {}).items():
        token = int(key) if isinstance(key, str) and key.strip().lstrip("-").isdigit() else None
        if token is None or not 0 <= token < vocab_size:
            raise ApiError(400, f"Invalid 'logit_bias': its keys must be token ids from 0 to {vocab_size - 1}, but got "
                                f"{key!r}.", "logit_bias", "invalid_value")
        pairs.append((token, _number(bias, key, 0.0, -100.0, 100.0, f"logit_bias.{key}")))
    repeat_penalty = _number(body, "repeat_penalty", 1.0, 0.0, 10.0)
    if repeat_penalty <= 0:
        raise ApiError(400, f"Invalid 'repeat_penalty': expected a value above 0 (1 is none), but got {repeat_penalty} "
                            "instead.", "repeat_penalty", "invalid_value")
    top_k = _integer(body, "top_k", 0, -1)
    return SamplingControls(
        frequency_penalty=_number(body, "frequency_penalty", 0.0, -2.0, 2.0),
        presence_penalty=_number(body, "presence_penalty", 0.0, -2.0, 2.0),
        repeat_penalty=repeat_penalty, repeat_last_n=_integer(body, "repeat_last_n", 64, -1),
        logit_bias=tuple(sorted(pairs)), top_k=max(top_k, 0), min_p=_number(body, "min_p", 0.0, 0.0, 1.0))


def _number(body: Dict[str, Any], name: str, default: Optional[float], low: float, high: float,
            param: Optional[str] = None) -> Optional[float]:
    value = body.get(name)
    param = param or name
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ApiError(400, f"Invalid type for '{param}': expected a number, but got {_kind(value)} instead.", param,
                       "invalid_type")
    if not low <= value <= high:
        raise ApiError(400, f"Invalid '{param}': expected a value from {low:g} to {high:g}, but got {value} instead.",
                       param, "invalid_value")
    return float(value)


def _integer(body: Dict[str, Any], name: str, default: Optional[int], low: int, high: Optional[int] = None) -> Optional[int]:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int):
        raise ApiError(400, f"Invalid type for '{name}': expected an integer, but got {_kind(value)} instead.", name, "invalid_type")
    if value < low or (high is not None and value > high):
        expected = f"at least {low}" if high is None else f"from {low} to {high}"
        raise ApiError(400, f"Invalid '{name}': expected an integer {expected}, but got {value} instead.", name, "invalid_value")
    return value


def _boolean(body: Dict[str, Any], name: str, default: bool, param: Optional[str] = None) -> bool:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise ApiError(400, f"Invalid type for '{param or name}': expected a boolean, but got {_kind(value)} instead.",
                       param or name, "invalid_type")
    return value


def _kind(value: Any) -> str:
    return {str: "a string", bool: "a boolean", list: "an array", dict: "an object", int: "an integer",
            float: "a decimal"}.get(type(value), type(value).__name__)
