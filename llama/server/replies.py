"""A request's engine jobs and their events: submitted, read in the event loop, and collected whole or streamed
as Server-Sent Events.

A request becomes one engine job per prompt (n choices each), whose events the engine's thread hands to the event
loop. A client that leaves cancels the jobs at once, whatever the route is waiting for. A stream's headers wait for
its first event, so that a request refused before it ran gets an HTTP status, not a 200 and an error event.
"""

import asyncio
import json
import traceback
from functools import partial
from typing import Any, AsyncIterator, Callable, Dict, List, Optional

from starlette.requests import Request
from starlette.responses import Response

from llama.server.engine import Delta, Done, Engine, Failed, Job, PromptLogprobs, Unavailable
from llama.server.fields import ApiError, error_body
from llama.server.openai_api import Params, usage

_GONE = object()  # put on a request's event queue when its client disconnects


class ClientGone(Exception):
    """The client disconnected: its jobs are cancelled, and nobody is there to answer."""


class Run:
    """The engine jobs of one request (one per prompt, n choices each), and their events in this event loop.

    Args:
        engine: where the jobs run.
        max_seq_len: the model's context, which bounds a job's default max_tokens.
        params: the request, checked.
        request: the HTTP request, watched for the client leaving.
        chat: a chat request (errors then name `messages`, and text is not continued from a prompt's).
        log: where an internal error's traceback goes.

    Raises:
        ApiError: a prompt the KV cache cannot hold, or the server too busy or stopping.
    """

    def __init__(self, engine: Engine, max_seq_len: int, params: Params, request: Request, chat: bool,
                 log: Callable[[str], None]):
        self.engine, self.params, self.request, self.log = engine, params, request, log
        self.loop = asyncio.get_running_loop()
        self.queue: asyncio.Queue = asyncio.Queue()
        self.jobs: List[Job] = []
        self.done: Dict[int, Done] = {}
        self.prompt_logprobs: Dict[int, list] = {}
        self.watcher: Optional[asyncio.Task] = None
        self.head: Optional[tuple] = None  # the first event, when `started` took it off the queue
        for k, prompt in enumerate(params.prompts):
            room = max_seq_len - len(prompt)
            reason = engine.check(len(prompt), params.max_tokens or 1)
            if reason is not None:
                raise ApiError(400, reason, "max_tokens" if params.max_tokens else ("messages" if chat else "prompt"),
                               "kv_cache_too_small")
            most = engine.most_new_tokens(len(prompt))
            max_tokens = params.max_tokens or min(room, max(1, room if most is None else most))
            self.jobs.append(Job(prompt, max_tokens, partial(self._emit, k), n=params.n, temperature=params.temperature,
                                 top_p=params.top_p, seed=params.seed, stop=params.stop, logprobs=params.logprobs,
                                 echo_logprobs=params.echo and params.logprobs is not None, text_context=not chat,
                                 ignore_eos=params.ignore_eos, cache_prompt=params.cache_prompt,
                                 controls=params.controls, grammar=params.grammar))
        submitted = []
        try:
            for job in self.jobs:
                engine.submit(job)
                submitted.append(job)
        except (Unavailable, ValueError) as e:
            for job in submitted:
                engine.cancel(job)
            raise ApiError(503 if isinstance(e, Unavailable) else 400, str(e),
                           code="server_busy" if isinstance(e, Unavailable) else "kv_cache_too_small") from None
        self.watch()

    def _emit(self, k: int, event) -> None:  # from the engine's thread
        self.loop.call_soon_threadsafe(self.queue.put_nowait, (k, event))

    def watch(self) -> None:
        """Cancel the jobs as soon as the client disconnects, whatever the route is waiting for."""
        async def wait():
            while (await self.request.receive())["type"] != "http.disconnect":
                pass
            self.queue.put_nowait((_GONE, None))
        self.watcher = asyncio.ensure_future(wait())

    async def events(self) -> AsyncIterator:
        """(job number, event) until every job is done.

        Raises:
            ClientGone: the client disconnected (its jobs are cancelled).
            ApiError: the engine could not finish a job.
        """
        while len(self.done) < len(self.jobs):
            if self.head is not None:
                (k, event), self.head = self.head, None
            else:
                k, event = self._raise_for(*await self.queue.get())
            if isinstance(event, Done):
                self.done[k] = event
                self.request.scope["llama_kv.usage"] = self.usage()
            elif isinstance(event, PromptLogprobs):
                self.prompt_logprobs.setdefault(k, []).extend(event.logprobs)
            yield k, event

    async def started(self) -> None:
        """Wait for the first event, so that a stream refused before it ran (a shutdown) gets an HTTP status
        instead of a 200 and an error event; that event is then the first `events` yields.

        Raises:
            ClientGone, ApiError: as `events` does.
        """
        self.head = self._raise_for(*await self.queue.get())

    def _raise_for(self, k, event):
        if k is _GONE:
            self.request.scope["llama_kv.note"] = "client disconnected"
            raise ClientGone()
        if isinstance(event, Failed):
            raise ApiError(event.status, event.message, code="server_error" if event.status == 500 else "shutting_down")
        return k, event

    def close(self) -> None:
        """Cancel whatever is unfinished, and stop watching for the client."""
        for k, job in enumerate(self.jobs):
            if k not in self.done:
                self.engine.cancel(job)
        if self.watcher is not None:
            self.watcher.cancel()

    def usage(self) -> Dict[str, Any]:
        done = list(self.done.values())
        total = lambda name: None if getattr(done[0], name) is None else sum(getattr(d, name) for d in done)  # noqa: E731
        return usage(total("prompt_tokens"), total("completion_tokens"), total("cached_tokens"), total("disk_tokens"),
                     total("drafted_tokens"), total("accepted_tokens"))


async def collect(run: Run, n_choices: int):
    """Every choice's text, log-probabilities and finish reason (choice j of prompt k is k * n + j)."""
    texts, logprobs, reasons = [""] * n_choices, [[] for _ in range(n_choices)], [None] * n_choices
    try:
        async for k, event in run.events():
            if isinstance(event, Delta):
                i = k * run.params.n + event.index
                texts[i] += event.text
                logprobs[i] += event.logprobs
                reasons[i] = event.finish_reason or reasons[i]
    finally:
        run.close()
    return texts, logprobs, reasons


async def stream(run: Run, chunks: AsyncIterator[Dict[str, Any]], frame: Callable[[Dict[str, Any]], bytes] = None,
                 done: bytes = b"data: [DONE]\n\n") -> "_EventStream":
    """The stream, once its first event has come: until then a refusal can still be an HTTP status."""
    try:
        await run.started()
    except BaseException:
        await chunks.aclose()
        run.close()
        raise
    return _EventStream(run, chunks, frame or sse, done)


class _EventStream(Response):
    """Server-Sent Events: one `data:` line per chunk (for the Responses API an `event:` line names it), then `done`
    (chat and completions: `data: [DONE]`); an error after the first chunk (a model failure; a second prompt refused
    at shutdown while the first ran) ends it as an error event."""

    def __init__(self, run: Run, chunks: AsyncIterator[Dict[str, Any]], frame: Callable[[Dict[str, Any]], bytes],
                 done: bytes):
        self.run, self.chunks, self.frame, self.done = run, chunks, frame, done
        self.status_code, self.background = 200, None

    async def __call__(self, scope, receive, send) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": [
            (b"content-type", b"text/event-stream; charset=utf-8"), (b"cache-control", b"no-cache"),
            (b"x-accel-buffering", b"no")]})
        try:
            try:
                async for payload in self.chunks:
                    await send({"type": "http.response.body", "body": self.frame(payload), "more_body": True})
                tail = self.done
            except ApiError as e:
                tail = sse(e.body())
            except ClientGone:
                raise  # not a failure: nobody to tell (and nothing to log)
            except Exception as e:  # never a traceback on the wire
                log_exception(self.run.log, e)
                tail = sse(error_body(f"internal error: {type(e).__name__}", "server_error"))
            await send({"type": "http.response.body", "body": tail, "more_body": False})
        except (ClientGone, OSError):
            pass  # the client left: nothing more to send, its jobs are cancelled below
        finally:
            await self.chunks.aclose()
            self.run.close()


def sse(payload: Dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(payload, ensure_ascii=False).encode() + b"\n\n"


def named_sse(payload: Dict[str, Any]) -> bytes:
    return f"event: {payload['type']}\n".encode() + sse(payload)


def log_exception(log: Callable[[str], None], e: Exception) -> None:
    """An internal error's traceback, for the server's log and never for the wire."""
    log("llama-server: internal error:\n" + "".join(traceback.format_exception(e)).rstrip())
