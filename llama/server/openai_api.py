"""OpenAI's request and response shapes: parameters checked and turned into jobs, results turned into JSON.

Plain Python, no HTTP and no tensors. What a client gets wrong is an `ApiError` (llama/server/fields.py); a chat's
messages become its prompt in llama/server/chat_prompt.py. Unknown fields are ignored, as OpenAI's own server does
for fields it does not use.
"""

import secrets
import time
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple

from llama.constraint import Grammar, StructuredUnavailable
from llama.errors import LlamaError
from llama.sampling import SamplingControls
from llama.server import tools as tool_calls
from llama.server.chat_prompt import chat_prompt, check_message, check_tools
from llama.server.engine import TokenLogprob
from llama.server.fields import ApiError, boolean, check_object, integer, kind_of, number
from llama.server.text import token_bytes, token_text


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
    body = check_object(body)
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ApiError(400, "'messages' must be a non-empty list of messages", "messages", "invalid_type")
    checked = [check_message(m, i) for i, m in enumerate(messages)]
    use = check_tools(body)
    if use is not None and body.get("response_format") not in (None, {"type": "text"}):
        raise ApiError(400, "'response_format' and 'tools' each constrain the reply; give one of them", "response_format",
                       "invalid_value")
    prompt = chat_prompt(tokenizer, checked, use)
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
        params.max_tokens = integer(body, "max_completion_tokens", None, 1)
    if boolean(body, "logprobs", False):
        params.logprobs = integer(body, "top_logprobs", 0, 0, 20)
    elif body.get("top_logprobs") is not None:
        raise ApiError(400, "'top_logprobs' needs 'logprobs' set to true", "top_logprobs", "invalid_value")
    return params


def parse_completion(body: Any, tokenizer, vocab_size: int) -> Params:
    """A completion request: a prompt as a string, a list of strings, token ids, or a list of those."""
    body = check_object(body)
    prompts, texts = _prompts(body.get("prompt"), tokenizer, vocab_size)
    params = _common(body, prompts, vocab_size, tokenizer)
    params.prompt_texts = texts
    params.echo = boolean(body, "echo", False)
    if body.get("logprobs") is not None:
        params.logprobs = integer(body, "logprobs", None, 0, 5)
    return params


def parse_responses(body: Any, tokenizer, vocab_size: int) -> Params:
    """A Responses request, its text subset: `input` (a string, or a list of messages whose content is a string or
    text parts), `instructions` (a system message before them), `max_output_tokens`, `temperature`, `top_p`,
    `stream`, and `text.format` (chat's `response_format` in the Responses form: the schema's `name`, `schema` and
    `strict` beside its `type`). The other fields, tools and stored state among them, are not served and are
    ignored."""
    body = check_object(body)
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
    params = Params(prompts, integer(body, "max_tokens", None, 1))
    params.temperature = number(body, "temperature", 1.0, 0.0, 2.0)
    params.top_p = number(body, "top_p", 1.0, 0.0, 1.0)
    params.n = integer(body, "n", 1, 1, 128)
    params.seed = integer(body, "seed", None, -2**63, 2**64 - 1)
    params.stream = boolean(body, "stream", False)
    params.ignore_eos = boolean(body, "ignore_eos", False)
    params.cache_prompt = boolean(body, "cache_prompt", True)
    options = body.get("stream_options")
    if options is not None and not isinstance(options, dict):
        raise ApiError(400, "'stream_options' must be an object", "stream_options", "invalid_type")
    params.include_usage = bool(options and boolean(options, "include_usage", False, "stream_options.include_usage"))
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
        raise ApiError(400, f"Invalid type for 'response_format': expected an object, but got {kind_of(value)} "
                            "instead.", "response_format", "invalid_type")
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
                                    f"got {kind_of(schema)} instead.", "response_format.json_schema.schema",
                               "invalid_type")
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
        raise ApiError(400, f"Invalid type for 'logit_bias': expected an object, but got {kind_of(bias)} instead.",
                       "logit_bias", "invalid_type")
    pairs = []
    for key, value in (bias or {}).items():
        token = int(key) if isinstance(key, str) and key.strip().lstrip("-").isdigit() else None
        if token is None or not 0 <= token < vocab_size:
            raise ApiError(400, f"Invalid 'logit_bias': its keys must be token ids from 0 to {vocab_size - 1}, but got "
                                f"{key!r}.", "logit_bias", "invalid_value")
        pairs.append((token, number(bias, key, 0.0, -100.0, 100.0, f"logit_bias.{key}")))
    repeat_penalty = number(body, "repeat_penalty", 1.0, 0.0, 10.0)
    if repeat_penalty <= 0:
        raise ApiError(400, f"Invalid 'repeat_penalty': expected a value above 0 (1 is none), but got {repeat_penalty} "
                            "instead.", "repeat_penalty", "invalid_value")
    top_k = integer(body, "top_k", 0, -1)
    return SamplingControls(
        frequency_penalty=number(body, "frequency_penalty", 0.0, -2.0, 2.0),
        presence_penalty=number(body, "presence_penalty", 0.0, -2.0, 2.0),
        repeat_penalty=repeat_penalty, repeat_last_n=integer(body, "repeat_last_n", 64, -1),
        logit_bias=tuple(sorted(pairs)), top_k=max(top_k, 0), min_p=number(body, "min_p", 0.0, 0.0, 1.0))
