"""The HTTP room: OpenAI's routes on Starlette, requests checked, answered and streamed, and never a tensor touched.

A request is checked (llama/server/openai_api.py), becomes one engine job per prompt, and is answered
from the job's events (llama/server/replies.py): whole, or as Server-Sent Events while they come. A stream's
headers wait for its first event, so a request refused before it ran (the server stopping) gets its status, 503,
not a 200. A client that leaves cancels its jobs at once, streaming or not. Every error leaves in OpenAI's one
shape; nothing a client sends can show it a traceback or stop the server from serving the next request. `GET /`
is the chat page (llama/server/webui/index.html), a static file that talks to the same API.
"""

import hmac
import json
import time
from dataclasses import dataclass, field
from functools import partial
from importlib import resources
from typing import Any, Callable, Dict, Optional

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import HTMLResponse, JSONResponse, PlainTextResponse, Response
from starlette.routing import Route

from llama.server.engine import Delta, Engine
from llama.server.fields import ApiError
from llama.server.openai_api import (
    Params, chat_logprobs, check_lengths, completion_logprobs, new_id, now, parse_chat, parse_completion,
    parse_responses, response_usage,
)
from llama.server.replies import ClientGone, Run, collect, log_exception, named_sse, stream
from llama.server.tools import ReplyReader, read_reply


@dataclass
class ServerState:
    """What the routes need: the engine once the model is loaded, and what describes the model."""

    model_id: str
    api_key: Optional[str] = None
    engine: Optional[Engine] = None
    tokenizer: Any = None
    max_seq_len: int = 0
    vocab_size: int = 0
    kv_cache: bool = True  # False under --no-kv-cache: nothing is cached, so `cache_prompt` changes nothing
    webui: bool = True  # serve the chat page at GET / (--no-webui turns it off)
    created: int = field(default_factory=now)
    log: Callable[[str], None] = field(default=lambda line: None)  # one line per request, and failures


def create_app(state: ServerState):
    """The ASGI application: routes, the API key check, and one log line per request."""
    routes = [Route("/", _webui_page(), methods=["GET"])] if state.webui else []
    routes += [
        Route("/health", partial(_health, state), methods=["GET"]),
        Route("/metrics", _endpoint(state, _metrics), methods=["GET"]),
        Route("/v1/models", _endpoint(state, _models), methods=["GET"]),
        Route("/v1/models/{model_id:path}", _endpoint(state, _model), methods=["GET"]),
        Route("/v1/responses", _endpoint(state, _responses), methods=["POST"]),
        Route("/v1/chat/completions", _endpoint(state, _chat), methods=["POST"]),
        Route("/v1/completions", _endpoint(state, _completions), methods=["POST"]),
    ]
    app = Starlette(routes=routes, exception_handlers={HTTPException: _http_error})
    return _LogRequests(_CheckKey(app, state), state)


# Routes.

def _webui_page():
    """The chat page, read once: it is static, and a file the package ships (pyproject's package-data)."""
    page = resources.files("llama.server").joinpath("webui/index.html").read_text(encoding="utf-8")

    async def webui(request: Request) -> Response:
        return HTMLResponse(page, headers={"cache-control": "no-cache"})
    return webui


async def _health(state: ServerState, request: Request) -> Response:
    if state.engine is None:
        return _error(ApiError(503, "the model is still loading", code="model_loading"))
    return JSONResponse({"status": "ok"})


def _model_card(state: ServerState) -> Dict[str, Any]:
    return {"id": state.model_id, "object": "model", "created": state.created, "owned_by": "llama-kv",
            "max_model_len": state.max_seq_len, "kv_cache": state.kv_cache}


async def _models(state: ServerState, request: Request) -> Response:
    return JSONResponse({"object": "list", "data": [_model_card(state)]})


async def _model(state: ServerState, request: Request) -> Response:
    model_id = request.path_params["model_id"]
    if model_id != state.model_id:
        raise ApiError(404, f"The model '{model_id}' does not exist: this server serves '{state.model_id}' "
                            "(GET /v1/models lists it).", "model", "model_not_found")
    return JSONResponse(_model_card(state))


async def _metrics(state: ServerState, request: Request) -> Response:
    lines = []
    for name, value in state.engine.stats().items():
        kind = "counter" if name.endswith("_total") else "gauge"
        lines += [f"# HELP llama_kv_{name} {_METRIC_HELP.get(name, name.replace('_', ' '))}",
                  f"# TYPE llama_kv_{name} {kind}", f"llama_kv_{name} {value}"]
    return PlainTextResponse("\n".join(lines) + "\n", media_type="text/plain; version=0.0.4")


async def _chat(state: ServerState, request: Request) -> Response:
    params = parse_chat(await _json(request), state.tokenizer, state.vocab_size)
    check_lengths(params, state.max_seq_len, "messages")
    run = Run(state.engine, state.max_seq_len, params, request, chat=True, log=state.log)
    rid, created = new_id("chatcmpl"), now()
    if params.stream:
        return await stream(run, _chat_chunks(state, run, params, rid, created))
    texts, logprobs, reasons = await collect(run, params.n)
    choices = []
    for i in range(params.n):
        message, reason = _chat_message(params, texts[i], reasons[i])
        choices.append({"index": i, "message": message, "finish_reason": reason,
                        "logprobs": chat_logprobs(state.tokenizer, logprobs[i]) if params.logprobs is not None else None})
    return JSONResponse({"id": rid, "object": "chat.completion", "created": created, "model": state.model_id,
                         "system_fingerprint": None, "choices": choices, "usage": run.usage()})


async def _completions(state: ServerState, request: Request) -> Response:
    params = parse_completion(await _json(request), state.tokenizer, state.vocab_size)
    check_lengths(params, state.max_seq_len, "prompt")
    run = Run(state.engine, state.max_seq_len, params, request, chat=False, log=state.log)
    rid, created = new_id("cmpl"), now()
    if params.stream:
        return await stream(run, _completion_chunks(state, run, params, rid, created))
    texts, logprobs, reasons = await collect(run, len(params.prompts) * params.n)
    choices = []
    for i in range(len(texts)):
        head = params.prompt_texts[i // params.n] if params.echo else ""
        lps = (run.prompt_logprobs.get(i // params.n, []) if params.echo else []) + logprobs[i]
        choices.append({"index": i, "text": head + texts[i], "finish_reason": reasons[i],
                        "logprobs": completion_logprobs(state.tokenizer, lps, 0, params.logprobs)
                        if params.logprobs is not None else None})
    return JSONResponse({"id": rid, "object": "text_completion", "created": created, "model": state.model_id,
                         "choices": choices, "usage": run.usage()})


async def _responses(state: ServerState, request: Request) -> Response:
    """The Responses API for text: one message out, streamed as its typed events or whole."""
    body = await _json(request)
    params = parse_responses(body, state.tokenizer, state.vocab_size)
    check_lengths(params, state.max_seq_len, "input")
    run = Run(state.engine, state.max_seq_len, params, request, chat=True, log=state.log)
    rid, created = new_id("resp"), now()
    shown = {"instructions": body.get("instructions"), "max_output_tokens": params.max_tokens,
             "temperature": params.temperature, "top_p": params.top_p}
    message_id = new_id("msg")
    if params.stream:
        return await stream(run, _response_events(state, run, rid, created, message_id, shown), named_sse, b"")
    texts, _, reasons = await collect(run, 1)
    return JSONResponse(_response(state, rid, created, message_id, shown, texts[0], reasons[0], run))


def _response(state: ServerState, rid: str, created: int, message_id: str, shown: Dict[str, Any],
              text: Optional[str], reason: Optional[str], run: Optional[Run]) -> Dict[str, Any]:
    """A Responses object: in progress (no text yet), completed (a stop) or incomplete (max_output_tokens)."""
    status = "in_progress" if text is None else ("incomplete" if reason == "length" else "completed")
    output = [] if text is None else [_response_message(message_id, text, status)]
    done = list(run.done.values()) if run is not None else []
    return {"id": rid, "object": "response", "created_at": created, "status": status, "model": state.model_id,
            "output": output, "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            **shown, "parallel_tool_calls": False, "tool_choice": "none", "tools": [], "metadata": {},
            "usage": response_usage(done[0].prompt_tokens, done[0].completion_tokens, done[0].cached_tokens)
            if done else None}


def _response_message(message_id: str, text: str, status: str) -> Dict[str, Any]:
    return {"type": "message", "id": message_id, "status": status, "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]}


async def _response_events(state: ServerState, run: Run, rid: str, created: int, message_id: str,
                           shown: Dict[str, Any]):
    """The Responses API's stream for one message: created, in_progress, the item and its text part added, the text's
    deltas, then each of them done and the response completed (or incomplete, at max_output_tokens)."""
    number = iter(range(1 << 62))
    where = {"item_id": message_id, "output_index": 0, "content_index": 0}

    def event(type: str, **fields) -> Dict[str, Any]:
        return {"type": type, "sequence_number": next(number), **fields}

    yield event("response.created", response=_response(state, rid, created, message_id, shown, None, None, None))
    yield event("response.in_progress", response=_response(state, rid, created, message_id, shown, None, None, None))
    yield event("response.output_item.added", output_index=0,
                item={**_response_message(message_id, "", "in_progress"), "content": []})
    yield event("response.content_part.added", item_id=message_id, output_index=0, content_index=0,
                part={"type": "output_text", "text": "", "annotations": [], "logprobs": []})
    text, reason = "", None
    async for _, item in run.events():
        if isinstance(item, Delta):
            if item.text:
                text += item.text
                yield event("response.output_text.delta", **where, delta=item.text, logprobs=[])
            reason = item.finish_reason or reason
    final = _response(state, rid, created, message_id, shown, text, reason, run)
    yield event("response.output_text.done", **where, text=text, logprobs=[])
    yield event("response.content_part.done", item_id=message_id, output_index=0, content_index=0,
                part={"type": "output_text", "text": text, "annotations": [], "logprobs": []})
    yield event("response.output_item.done", output_index=0, item=final["output"][0])
    yield event(f"response.{final['status']}", response=final)


def _chat_message(params: Params, text: str, reason: Optional[str]):
    """A chat choice's message and finish reason: the text, or where the request has tools and the reply calls them,
    the calls (finish reason "tool_calls" when the reply ended by itself)."""
    content, calls = read_reply(text) if params.tools is not None else (text, None)
    if not calls:
        return {"role": "assistant", "content": content}, reason
    return {"role": "assistant", "content": None, "tool_calls": calls}, ("tool_calls" if reason == "stop" else reason)


async def _chat_chunks(state: ServerState, run: Run, params: Params, rid: str, created: int):
    base = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": state.model_id,
            "system_fingerprint": None}
    extra = {"usage": None} if params.include_usage else {}

    def chunk(index, delta, logprobs=None, finish_reason=None):
        return {**base, "choices": [{"index": index, "delta": delta, "logprobs": logprobs,
                                     "finish_reason": finish_reason}], **extra}

    # With tools a reply may be calls, whose message has no content: it comes in the deltas that follow.
    for i in range(params.n):
        yield chunk(i, {"role": "assistant", "content": None if params.tools is not None else ""})
    readers = [ReplyReader() for _ in range(params.n)] if params.tools is not None else None
    async for _, event in run.events():
        if not isinstance(event, Delta):
            continue
        lps = chat_logprobs(state.tokenizer, event.logprobs) if params.logprobs is not None else None
        if readers is None:
            if event.text or event.logprobs:
                yield chunk(event.index, {"content": event.text}, lps)
            reason = event.finish_reason
        else:  # words as they come; calls as their names, then their arguments' text, come
            reader = readers[event.index]
            deltas = reader.feed(event.text) + (reader.finish() if event.finish_reason else [])
            if event.logprobs and lps is not None and not deltas:  # tokens held back still report theirs
                deltas = [{}]
            for j, delta in enumerate(deltas):
                yield chunk(event.index, delta, lps if j == 0 else None)
            reason = "tool_calls" if event.finish_reason == "stop" and reader.has_calls else event.finish_reason
        if reason:
            yield chunk(event.index, {}, None, reason)
    if params.include_usage:
        yield {**base, "choices": [], "usage": run.usage()}


async def _completion_chunks(state: ServerState, run: Run, params: Params, rid: str, created: int):
    base = {"id": rid, "object": "text_completion", "created": created, "model": state.model_id}
    extra = {"usage": None} if params.include_usage else {}
    offsets: Dict[int, int] = {}  # per choice: characters sent so far, and whether its echo went out

    def chunk(index, text, logprobs, finish_reason=None):
        logprobs = (completion_logprobs(state.tokenizer, logprobs, offsets.get(index, 0), params.logprobs)
                    if params.logprobs is not None else None)
        offsets[index] = offsets.get(index, 0) + len(text)
        return {**base, "choices": [{"index": index, "text": text, "logprobs": logprobs,
                                     "finish_reason": finish_reason}], **extra}

    async for k, event in run.events():
        if not isinstance(event, Delta):
            continue
        i = k * params.n + event.index
        if params.echo and i not in offsets:  # the prompt goes first (its log-probabilities are all in by now)
            yield chunk(i, params.prompt_texts[k], run.prompt_logprobs.get(k, []))
        if event.text or event.logprobs or event.finish_reason:
            yield chunk(i, event.text, event.logprobs, event.finish_reason)
    if params.include_usage:
        yield {**base, "choices": [], "usage": run.usage()}


# Errors, the API key, and the log.

def _endpoint(state: ServerState, handler):
    """A route that waits for the model, and turns every failure into OpenAI's error shape."""
    async def endpoint(request: Request) -> Response:
        try:
            if state.engine is None:
                raise ApiError(503, "the model is still loading; try again when GET /health answers 200",
                               code="model_loading")
            return await handler(state, request)
        except ApiError as e:
            return _error(e)
        except ClientGone:
            return Response(status_code=499)  # nobody is there to read it
        except Exception as e:
            log_exception(state.log, e)
            return _error(ApiError(500, f"internal error: {type(e).__name__}; the server logged it"))
    return endpoint


def _error(e: ApiError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status)


async def _http_error(request: Request, exc: HTTPException) -> Response:
    if exc.status_code == 404:
        message, code = f"Unknown request URL: {request.method} {request.url.path}.", "unknown_url"
    elif exc.status_code == 405:
        message, code = f"Method {request.method} is not allowed for {request.url.path}.", "method_not_allowed"
    else:
        message, code = str(exc.detail), None
    return _error(ApiError(exc.status_code, message, code=code))


async def _json(request: Request) -> Any:
    body = await request.body()
    try:
        return json.loads(body)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ApiError(400, f"We could not parse the JSON body of your request ({e}). The body must be valid JSON.",
                       code="invalid_json") from None


class _CheckKey:
    """With an API key, every path but /health and the chat page needs `Authorization: Bearer KEY` (compared in
    constant time). The page is static and holds no secret; the API calls it makes carry the key."""

    def __init__(self, app, state: ServerState):
        self.app, self.state = app, state
        self.open_paths = ("/health", "/") if state.webui else ("/health",)

    async def __call__(self, scope, receive, send):
        key = self.state.api_key
        if scope["type"] == "http" and key and scope["path"] not in self.open_paths:
            header = dict(scope["headers"]).get(b"authorization", b"")
            given = header[7:].strip() if header[:7].lower() == b"bearer " else b""
            if not hmac.compare_digest(given, key.encode()):
                message = ("Incorrect API key provided." if given else
                           "You didn't provide an API key: send it as 'Authorization: Bearer KEY'.")
                return await _error(ApiError(401, message, code="invalid_api_key"))(scope, receive, send)
        await self.app(scope, receive, send)


class _LogRequests:
    """One line per request: method, path, status, tokens, time."""

    def __init__(self, app, state: ServerState):
        self.app, self.state = app, state

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        start, status = time.perf_counter(), []

        async def send_status(message):
            if message["type"] == "http.response.start":
                status.append(message["status"])
            await send(message)

        try:
            await self.app(scope, receive, send_status)
        finally:
            u = scope.get("llama_kv.usage")
            tokens = (f" prompt={u['prompt_tokens']} cached={u['prompt_tokens_details']['cached_tokens']} "
                      f"completion={u['completion_tokens']}" if u else "")
            note = f" ({scope['llama_kv.note']})" if "llama_kv.note" in scope else ""
            self.state.log(f"llama-server: {scope['method']} {scope['path']} {status[0] if status else '-'}{tokens} "
                           f"{time.perf_counter() - start:.3f}s{note}")


_METRIC_HELP = {
    "requests_running": "Requests with a sequence in the running batch.",
    "requests_waiting": "Requests waiting for room in the batch or the KV cache.",
    "sequences_running": "Sequences (choices) decoded or prefilled at each step.",
    "sequences_waiting": "Sequences waiting, preempted ones included.",
    "prompt_tokens_total": "Prompt tokens received.",
    "generation_tokens_total": "Tokens generated.",
    "prefix_cache_reused_tokens_total": "Prompt positions whose keys and values were reused from the cache, not computed.",
    "preemptions_total": "Sequences preempted for want of KV blocks (recomputed later).",
    "steps_total": "Batched model steps run.",
    "speculative_drafted_tokens_total": "Tokens drafted by prompt lookup (--speculate ngram) and checked by the model.",
    "speculative_accepted_tokens_total": "Drafted tokens the model kept: each saved a step.",
    "cache_block_size": "Positions per KV-cache block.",
    "cache_blocks_total": "KV-cache blocks in all.",
    "cache_blocks_used": "KV-cache blocks held by running sequences.",
    "cache_blocks_free": "KV-cache blocks free, or holding a cached prefix nobody holds.",
    "cache_blocks_cached": "Free blocks still holding a prefix a later request may reuse.",
    "cache_bytes_used": "Bytes of the KV cache held by running sequences.",
    "cache_bytes_free": "Bytes of the KV cache not held.",
    "disk_cache_blocks_written_total": "KV blocks written to --kv-cache-dir.",
    "disk_cache_blocks_loaded_total": "KV blocks loaded from --kv-cache-dir instead of computed (disk hits).",
    "disk_cache_misses_total": "Lookups in --kv-cache-dir that found no file for the next block.",
    "disk_cache_blocks_rejected_total": "Files in --kv-cache-dir skipped and removed: damaged, edited or foreign.",
    "disk_cache_blocks_evicted_total": "Files removed from --kv-cache-dir to stay under --kv-cache-dir-size.",
    "disk_cache_write_failures_total": "KV blocks not written to --kv-cache-dir: a write failed, or too many waited.",
    "disk_cache_bytes": "Bytes of KV block files in --kv-cache-dir, as this server counts them.",
    "disk_cache_bytes_limit": "--kv-cache-dir-size.",
}
