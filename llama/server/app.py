"""A server from a `Llama`: the engine over its model, the HTTP application over the engine, and serving them.

`serve(generator, ...)` is llama-server without its command line: it listens at once, builds the model in the
background when `generator` is a function that returns one (GET /health answers 503 until it is ready), and
serves until Ctrl-C or SIGTERM, then lets the requests running finish within `shutdown_grace` seconds. It
prints nothing itself: what it says of itself goes to `say` (in the library's terms, parameter names and all),
one line per request and any failure's traceback to `log`. `start_engine` and `create_server_app` are its two
halves, for a caller (a test) that serves in its own way.
"""

import os
import socket
import threading
from pathlib import Path
from typing import Any, Callable, List, NamedTuple, Optional, Tuple, Union

from llama.errors import LlamaError
from llama.generation import Llama
from llama.io.identity import model_identity
from llama.io.kv_blocks import BlockSpec
from llama.kv_cache import describe_kv_cache
from llama.runtime.devices import available_memory
from llama.runtime.progress import Progress
from llama.server.disk_cache import DEFAULT_MAX_BYTES, DiskCache, check_disk_cache, prepare_directory
from llama.server.engine import MAX_STEP_ROWS, Engine
from llama.server.http import ServerState, create_app
from llama.server.runner import Runner
from llama.server.scheduler import Scheduler
from llama.speculative import DEFAULT_DRAFT_TOKENS, DraftModel, Drafter, check_speculation

Log = Callable[[str], None]
KVCacheSize = Union[int, Callable[[int], int], None]  # positions, or a function of the bytes one position takes


def _quiet(line: str) -> None:
    pass


def build_runner(llama: Llama, parallel: int = 4, kv_cache_size: KVCacheSize = None, block_size: int = 16,
                 kv_cache: bool = True, progress: Optional[Progress] = None,
                 max_rows: Optional[int] = None) -> Tuple[Runner, int, str]:
    """This rank's runner over `llama`'s model and a KV cache of `kv_cache_size` positions: a number, or a function
    of the bytes one position takes on this rank (which depends on the model and the ranks) that returns it;
    default: room for `parallel` sequences of the model's max_seq_len. A decode step feeds up to `max_rows` rows
    (default `parallel`; more with speculation's drafts). Whether that step is compiled, `llama`'s run plan says
    (`Llama.build(compile_layers=...)`, llama/run_plan.py).

    Returns:
        the runner, its number of KV-cache blocks, and a line describing them.

    Raises:
        LlamaError: the KV cache does not fit the device's memory.
    """
    world_size = llama.info.world_size
    model = llama.model
    per_position = model.kv_cache_nbytes(1, 1)  # this rank's share of the heads
    if kv_cache_size is None:
        positions = parallel * model.params.max_seq_len
    else:
        positions = kv_cache_size(per_position) if callable(kv_cache_size) else kv_cache_size
    num_blocks = -(-positions // block_size)
    if not kv_cache:
        line = f"--parallel {parallel}, no KV cache: every step feeds each whole prefix"
        num_blocks = 0
    else:
        nbytes = num_blocks * block_size * per_position
        free = available_memory(model.device)
        if free is not None and nbytes > free:
            raise LlamaError(f"a KV cache of {num_blocks * block_size:,} tokens needs {nbytes / 2**30:.2f} GiB on "
                             f"{model.device} but only {free / 2**30:.2f} GiB is available; lower --kv-cache-size")
        share = " per process" if world_size > 1 else ""
        # vLLM's "maximum concurrency": how many sequences of the whole context the cache holds at once.
        full = num_blocks * block_size / model.params.max_seq_len
        line = (f"--parallel {parallel}, KV cache {num_blocks * block_size:,} tokens in {num_blocks:,} blocks of "
                f"{block_size}, {nbytes / 2**20:,.1f} MiB{share} "
                f"({describe_kv_cache(model.kv_cache_dtype, per_position)}): "
                f"room for {full:,.1f} sequences of the full {model.params.max_seq_len:,}-token context")
    if world_size > 1:
        line += f"; split over {world_size} processes"
    runner = Runner(model, num_blocks, block_size, plan=llama.info.plan, max_rows=max_rows or parallel,
                    progress=progress)
    if runner.compiled_step is not None:
        line += "; decode step compiled" + (" in the background (the eager step serves, with the same answers, "
                                            "until it is ready)" if runner.compiled_step.building else "")
    return runner, num_blocks, line


def check_server_speculation(speculate: Union[str, Drafter, None], draft_tokens: int, kv_cache: bool) -> None:
    """Raise LlamaError for speculation the server cannot do: it drafts by prompt lookup (or a drafter without a
    state of its own, shared by every sequence), with a KV cache; not with a draft model."""
    if isinstance(speculate, DraftModel):
        raise LlamaError("the server drafts by prompt lookup (speculate=ngram), not with a draft model")
    check_speculation(speculate, draft_tokens, kv_cache)


class Started(NamedTuple):
    """What `start_engine` started, and what to say about it."""

    engine: Engine
    line: str  # what runs: the batch, the KV cache, the compiled step
    notes: List[str]  # what the user should hear about the compiled step


def start_engine(llama: Llama, parallel: int = 4, kv_cache_size: KVCacheSize = None, block_size: int = 16,
                 prefill_chunk: int = 256, max_waiting: int = 64, kv_cache: bool = True,
                 progress: Optional[Progress] = None, kv_cache_dir: Optional[str] = None,
                 kv_cache_dir_size: int = DEFAULT_MAX_BYTES,
                 speculate: Union[str, Drafter, None] = None, draft_tokens: int = DEFAULT_DRAFT_TOKENS,
                 on_rank_lost: Log = _quiet, log: Log = _quiet) -> Started:
    """The running serving loop over `llama`: its runner (`build_runner`), a scheduler of `parallel` sequences
    fed `prefill_chunk` prompt tokens a step, and room for `max_waiting` requests waiting. With `kv_cache_dir`,
    every full block computed is also kept in that directory, at most `kv_cache_dir_size` bytes of them, and
    found there again (llama/server/disk_cache.py). With `speculate="ngram"`, every choice drafts up to
    `draft_tokens` tokens by prompt lookup, checked in the batched step (llama/server/engine.py).

    Under torchrun this is rank 0's part, and `on_rank_lost` is told when another rank is gone (`follow_steps` is
    the other ranks' part).

    Returns:
        the engine, started, a line describing it, and the notes of its compiled step.

    Raises:
        LlamaError: the KV cache does not fit, or `kv_cache_dir` cannot be used (without a KV cache, under torchrun,
            a directory that cannot be written, a size that holds no block), or `speculate` cannot run.
    """
    check_server_speculation(speculate, draft_tokens, kv_cache)
    if kv_cache_dir is not None:
        check_disk_cache(kv_cache, llama.info.world_size)
        prepare_directory(kv_cache_dir)
    runner, num_blocks, line = build_runner(llama, parallel, kv_cache_size, block_size, kv_cache, progress,
                                            max_rows=max(parallel, min(MAX_STEP_ROWS, parallel * (1 + draft_tokens)))
                                            if speculate else parallel)
    if speculate:
        line += f"; speculative decoding by prompt lookup, up to {draft_tokens} drafted tokens a step"
    notes = list(runner.notes)
    disk = None
    if kv_cache_dir is not None:
        disk = open_disk_cache(llama, runner, kv_cache_dir, kv_cache_dir_size, log)
        line += (f"; KV blocks kept on disk in {disk.directory} (up to {disk.max_bytes / 2**20:,.1f} MiB, "
                 f"{disk.bytes / 2**20:,.1f} MiB there now)")
    if llama.info.world_size > 1:
        from llama.server.ranks import LeaderRunner, step_group

        runner = LeaderRunner(runner, step_group(), on_lost=on_rank_lost)
    scheduler = Scheduler(max(num_blocks, 1), block_size, parallel, prefill_chunk, kv_cache=kv_cache, disk=disk)
    engine = Engine(llama.tokenizer, scheduler, runner, max_waiting, log=log, disk=disk, speculate=speculate,
                    draft_tokens=draft_tokens)
    engine.start()
    return Started(engine, line, notes)


def open_disk_cache(llama: Llama, runner: Runner, directory: str, max_bytes: int, log: Log = _quiet) -> DiskCache:
    """The disk cache for `runner`'s KV cache: its files keyed by `llama`'s identity, the cache's dtype, block size
    and shapes (read from its tensors: an int8 cache's rows are wider than head_dim, holding their scales)."""
    cache = runner.cache
    shapes = {(k.shape[0], k.shape[2]) for k in cache.keys}
    if len(shapes) != 1:
        raise LlamaError("kv_cache_dir= needs every layer to hold the same number of KV heads of the same width")
    ((n_kv_heads, width),) = shapes
    spec = BlockSpec(model_identity(llama), cache.keys[0].dtype, cache.block_size,
                     (len(cache.keys), n_kv_heads, width))
    return DiskCache(Path(directory), max_bytes, spec, log)


def follow_steps(llama: Llama, say: Log = _quiet, **runner_settings) -> None:
    """A rank other than 0 under torchrun: run rank 0's steps on this rank's slice until it stops (`runner_settings`:
    those of `build_runner`, as rank 0 was given them)."""
    from llama.server.ranks import follow, step_group

    runner, _, _ = build_runner(llama, **runner_settings)
    group = step_group()
    say(f"rank {llama.info.rank} of {llama.info.world_size} (pid {os.getpid()}) runs the steps rank 0 sends")
    follow(runner, group)


def attach(state: ServerState, engine: Engine) -> None:
    """Make the routes of `state`'s app answer with `engine` (until then, 503)."""
    model = engine.runner.model
    state.tokenizer, state.max_seq_len = engine.tokenizer, model.params.max_seq_len
    state.vocab_size = model.vocab_size
    state.engine = engine  # ready from here on


def create_server_app(engine: Optional[Engine] = None, model_id: str = "llama", api_key: Optional[str] = None,
                      kv_cache: bool = True, webui: bool = True, log: Log = _quiet) -> Tuple[Any, ServerState]:
    """The ASGI application of the OpenAI-compatible API over `engine` (None: 503 until `attach` gives one).

    Returns:
        the application and its state.
    """
    state = ServerState(model_id=model_id, api_key=api_key, kv_cache=kv_cache, webui=webui, log=log)
    if engine is not None:
        attach(state, engine)
    return create_app(state), state


def serve(generator: Union[Llama, Callable[[], Llama]], host: str = "127.0.0.1", port: int = 8080,
          parallel: int = 4, kv_cache_size: KVCacheSize = None, block_size: int = 16,
          prefill_chunk: int = 256, max_waiting: int = 64, kv_cache: bool = True, model_id: str = "llama",
          api_key: Optional[str] = None, webui: bool = True, shutdown_grace: float = 5.0,
          progress: Optional[Progress] = None,
          kv_cache_dir: Optional[str] = None, kv_cache_dir_size: int = DEFAULT_MAX_BYTES,
          speculate: Optional[str] = None, draft_tokens: int = DEFAULT_DRAFT_TOKENS,
          on_rank_lost: Log = _quiet, say: Log = _quiet, log: Log = _quiet) -> None:
    """Serve `generator` (a `Llama`, or a function that builds one while the server already listens) over
    OpenAI's HTTP API at `host`:`port` (0: a free port) until Ctrl-C or SIGTERM; with `kv_cache_dir`, keeping the
    KV cache's full blocks on disk as `start_engine` does.

    Raises:
        LlamaError: `host`:`port` cannot be listened on, or the model or its KV cache could not be built (the
            server has stopped then).
    """
    try:
        sock = socket.create_server((host, port), family=socket.AF_INET6 if ":" in host else socket.AF_INET)
    except OSError as e:
        raise LlamaError(f"cannot listen on {host}:{port}: {e.strerror or e}") from e
    port = sock.getsockname()[1]
    app, state = create_server_app(model_id=model_id, api_key=api_key, kv_cache=kv_cache, webui=webui, log=log)
    server = _uvicorn_server()(app, shutdown_grace, say)
    failure = []

    def load():
        try:
            llama = generator() if callable(generator) else generator
            engine, line, notes = start_engine(
                llama, parallel=parallel, kv_cache_size=kv_cache_size, block_size=block_size,
                prefill_chunk=prefill_chunk, max_waiting=max_waiting, kv_cache=kv_cache, progress=progress,
                kv_cache_dir=kv_cache_dir, kv_cache_dir_size=kv_cache_dir_size,
                speculate=speculate, draft_tokens=draft_tokens, on_rank_lost=on_rank_lost, log=log)
            for note in notes:
                say(f"note: {note}")
            attach(state, engine)
            server.engine = engine
            url = f"http://{f'[{host}]' if ':' in host else host}:{port}"
            page = f"; chat page at {url}/" if webui else ""
            say(f"listening on {url} ({model_id}; {line}{page})")
        except BaseException as e:  # raised in the caller's thread, once the server has stopped
            failure.append(e)
            server.should_exit = True

    say(f"loading {model_id} (GET /health answers 503 until it is ready)")
    threading.Thread(target=load, name="llama-server-load", daemon=True).start()
    server.run(sockets=[sock])
    if failure:
        raise failure[0]
    if state.engine is not None:
        state.engine.drain(0)
        state.engine.runner.close()  # under torchrun the other ranks exit
    say("stopped")


def _uvicorn_server():
    import uvicorn

    class Server(uvicorn.Server):
        """uvicorn, told to let the engine drain when asked to stop, and to exit 0 rather than re-raise the signal."""

        def __init__(self, app, grace: float, say: Log):
            config = uvicorn.Config(app, log_level="warning", access_log=False, lifespan="off",
                                    timeout_graceful_shutdown=int(grace) + 5)
            super().__init__(config)
            self.grace, self.say, self.engine = grace, say, None

        def handle_exit(self, sig, frame) -> None:
            super().handle_exit(sig, frame)
            self._captured_signals.clear()

        async def on_tick(self, counter: int) -> bool:
            stop = await super().on_tick(counter)
            if stop and self.engine is not None:
                self.say(f"stopping: no new requests; those in flight get {self.grace:g} s to finish")
                self.engine.stop_accepting(self.grace)
                self.engine = None
            return stop

    return Server
