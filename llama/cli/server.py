"""llama-server: an OpenAI-compatible HTTP server that batches requests continuously over one shared KV cache.

It listens at once and loads the model in the background (GET /health answers 503 until it is ready),
then prints the URL. Ctrl-C or SIGTERM stops taking requests (new connections are refused), answers those
still waiting for room 503, gives those running --shutdown-grace seconds to finish, then ends them as
max_tokens would (finish_reason "length", and a stream's `data: [DONE]`), and exits 0. Under torchrun the
model is split over the processes as every command splits it: rank 0 serves and schedules, the others run
each step on their slices (llama/server/ranks.py).
"""

import os
import re
import socket
import sys
import threading
from pathlib import Path
from typing import Union

from llama.cli.common import EXIT_ERROR, as_flags, fail, run
from llama.cli.loading import build_from_flags, compile_flag, model_flag
from llama.cli.printer import ProgressPrinter
from llama.runtime.devices import available_memory
from llama.convert.fetch import DEFAULT_MODEL
from llama.errors import LlamaError

API_KEY_ENV = "LLAMA_API_KEY"
_UNITS = {"": 1, "b": 1, "k": 1e3, "kb": 1e3, "kib": 2**10, "m": 1e6, "mb": 1e6, "mib": 2**20, "g": 1e9, "gb": 1e9,
          "gib": 2**30}


def kv_cache_positions(size: Union[int, str, None], bytes_per_position: int, default: int) -> int:
    """--kv-cache-size as positions: a whole number is tokens; a number with a unit (512MiB, 2GB) is bytes."""
    if size is None:
        return default
    if isinstance(size, int) and not isinstance(size, bool):
        tokens = size
    else:
        match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", str(size))
        if not match or match.group(2).lower() not in _UNITS:
            fail(f"--kv-cache-size takes tokens (4096) or bytes with a unit (512MiB, 2GB), not {size!r}")
        if match.group(2) == "":
            tokens = int(float(match.group(1)))
        else:
            tokens = int(float(match.group(1)) * _UNITS[match.group(2).lower()]) // bytes_per_position
    if tokens < 1:
        fail(f"--kv-cache-size {size} holds no token (one takes {bytes_per_position:,} bytes with this model)")
    return tokens


def main(
    ckpt_dir: str = None,
    tokenizer_path: str = None,
    host: str = "127.0.0.1",
    port: int = 8080,
    parallel: int = 4,
    kv_cache_size: Union[int, str] = None,
    max_seq_len: int = 2048,
    block_size: int = 16,
    prefill_chunk: int = 128,
    max_waiting: int = 64,
    api_key: str = None,
    no_kv_cache: bool = False,
    no_webui: bool = False,
    model_name: str = None,
    shutdown_grace: float = 5.0,
    device: str = None,
    dtype: str = None,
    quantize: str = None,
    quant_kernels: str = "integer",
    compile: bool = False,
    no_compile: bool = False,
    model: str = None,
):
    """Serve a LLaMA model over OpenAI's HTTP API, batching requests continuously.

    Examples:
        llama-server
        llama-server --port 8000 --parallel 8 --kv-cache-size 16384
        torchrun --nproc_per_node 2 --no-python llama-server --ckpt-dir llama-2-13b
        curl http://127.0.0.1:8080/v1/chat/completions -H 'Content-Type: application/json' \\
            -d '{"messages": [{"role": "user", "content": "Hello!"}], "max_tokens": 32}'

    Args:
        ckpt_dir: checkpoint directory in Meta's layout, a GGUF file or a Hugging Face folder (converted once);
            default: the default model, fetched on first use.
        tokenizer_path: tokenizer file; default: the one in (or beside) the checkpoint directory.
        host: address to listen on; 0.0.0.0 serves other machines too (set --api-key then).
        port: port to listen on; 0 picks a free one (the ready line names it).
        parallel: sequences decoded together at each step; more wait their turn.
        kv_cache_size: the KV cache all sequences share, in tokens (4096), or in bytes with a unit (512MiB);
            default --parallel x --max-seq-len tokens, so every sequence can reach the full context. Under
            torchrun bytes count per process, each holding its share of the heads.
        max_seq_len: the longest prompt plus reply one request may have.
        block_size: positions per KV-cache block (the unit in which memory is shared and reused).
        prefill_chunk: prompt tokens fed per step, so a long prompt never stalls the streams running.
        max_waiting: requests that may wait for room before more get 503.
        api_key: require `Authorization: Bearer KEY` on every path but /health and the chat page at /;
            default: $LLAMA_API_KEY.
        no_kv_cache: feed every sequence's whole prefix at each step instead of caching keys and values.
            Same answers, slower: to measure and to teach.
        no_webui: do not serve the chat page at / (then GET / is 404, as any unknown path).
        model_name: the model's id in responses and /v1/models; default: the checkpoint directory's name.
        shutdown_grace: seconds running requests get to finish after Ctrl-C or SIGTERM; those still running
            then end with what they have, finish_reason "length" (cut short, as by max_tokens). Waiting ones
            get 503 at once.
        device: cpu, cuda or cuda:N; default CUDA when present, else CPU.
        dtype: float32, bfloat16 or float16; default bf16 on CUDA, float32 on CPU.
        quantize: int8 or int4: hold every linear layer's weights quantized as they load.
        quant_kernels: integer (the default) or exact: what quantized weights multiply with on the CPU (see
            llama-generate).
        compile: compile the batched decode step where the default would not: on a GPU, with torch.compile
            before serving (minutes). The default, with neither flag: on the CPU the step is compiled ahead of
            time for one row and for 2-16 rows (about a minute each for the default model on 2 cores, the first
            time; with a progress line), stored under $LLAMA_HOME and loaded in milliseconds by later starts;
            prompt chunks run eagerly. Without a C++ compiler it runs eagerly, with a note.
        no_compile: run every step eagerly.
        model: the same as --ckpt-dir, by llama.cpp's name (-m FILE): a checkpoint directory, a GGUF file or a
            Hugging Face folder.
    """
    for name, value, low in (("--port", port, 0), ("--parallel", parallel, 1), ("--max-seq-len", max_seq_len, 2),
                             ("--block-size", block_size, 1), ("--prefill-chunk", prefill_chunk, 1),
                             ("--max-waiting", max_waiting, 0)):
        if value < low:
            fail(f"{name} must be at least {low}, not {value}")
    if port > 65535:
        fail(f"--port must be at most 65535, not {port}")
    api_key = api_key if api_key is not None else os.environ.get(API_KEY_ENV) or None
    ckpt_dir = model_flag(ckpt_dir, model)
    settings = dict(ckpt_dir=ckpt_dir, tokenizer_path=tokenizer_path, max_seq_len=max_seq_len, parallel=parallel,
                    kv_cache_size=kv_cache_size, block_size=block_size, no_kv_cache=no_kv_cache, device=device,
                    dtype=dtype, quantize=quantize, quant_kernels=quant_kernels,
                    compile=compile_flag(compile, no_compile, no_kv_cache))
    if os.environ.get("RANK", "0") != "0":  # under torchrun: rank 0 serves, the others run its steps
        _follow(settings)
        return
    try:
        import uvicorn  # noqa: F401
        from llama.server.http import ServerState, create_app
    except ImportError as e:
        fail(f"llama-server needs {e.name}: pip install 'llama-kv[server]'")

    try:
        sock = socket.create_server((host, port), family=socket.AF_INET6 if ":" in host else socket.AF_INET)
    except OSError as e:
        fail(f"cannot listen on {host}:{port}: {e.strerror or e}")
    port = sock.getsockname()[1]
    name = model_name or (Path(str(ckpt_dir)).resolve().name if ckpt_dir is not None else DEFAULT_MODEL)
    state = ServerState(model_id=name, api_key=api_key, kv_cache=not no_kv_cache, webui=not no_webui, log=_log)
    server = _Server(create_app(state), shutdown_grace)
    failure = []

    def load():
        try:
            engine, line = _load(settings, prefill_chunk, max_waiting)
            state.tokenizer, state.max_seq_len = engine.tokenizer, max_seq_len
            state.vocab_size = engine.runner.model.vocab_size
            state.engine = engine  # ready from here on
            server.engine = engine
            url = f"http://{f'[{host}]' if ':' in host else host}:{port}"
            page = "" if no_webui else f"; chat page at {url}/"
            print(f"llama-server: listening on {url} ({name}; {line}{page})", file=sys.stderr, flush=True)
        except BaseException as e:  # reported by the main thread, as every command reports it
            failure.append(e)
            server.should_exit = True

    print(f"llama-server: loading {name} (GET /health answers 503 until it is ready)", file=sys.stderr, flush=True)
    threading.Thread(target=load, name="llama-server-load", daemon=True).start()
    server.run(sockets=[sock])
    if failure:
        raise failure[0]
    if state.engine is not None:
        state.engine.drain(0)
        state.engine.runner.close()  # under torchrun the other ranks exit
    print("llama-server: stopped", file=sys.stderr, flush=True)


def _build(ckpt_dir, tokenizer_path, max_seq_len, parallel, kv_cache_size, block_size, no_kv_cache, device, dtype,
           quantize, quant_kernels, compile):
    """This rank's model, runner and KV cache; returns the runner, its blocks, and a line describing them."""
    from llama.server.runner import Runner

    llama = build_from_flags(ckpt_dir, tokenizer_path, max_seq_len, parallel, 1, device, dtype, False, quantize,
                             quant_kernels)
    world_size = llama.info.world_size
    if compile is True and world_size > 1:
        raise LlamaError(f"compile=True runs in one process, not under torchrun with {world_size} processes")
    if world_size > 1:
        compile = False  # the default's stored step runs in one process, as the commands
    model = llama.model
    per_position = model.kv_cache_nbytes(1, 1)  # this rank's share of the heads
    positions = kv_cache_positions(kv_cache_size, per_position, parallel * max_seq_len)
    num_blocks = -(-positions // block_size)
    if no_kv_cache:
        line = f"--parallel {parallel}, no KV cache: every step feeds each whole prefix"
        num_blocks = 0
    else:
        nbytes = num_blocks * block_size * per_position
        free = available_memory(model.device)
        if free is not None and nbytes > free:
            raise LlamaError(f"a KV cache of {num_blocks * block_size:,} tokens needs {nbytes / 2**30:.2f} GiB on "
                             f"{model.device} but only {free / 2**30:.2f} GiB is available; lower --kv-cache-size")
        share = " per process" if world_size > 1 else ""
        line = (f"--parallel {parallel}, KV cache {num_blocks * block_size:,} tokens in {num_blocks:,} blocks of "
                f"{block_size}, {nbytes / 2**20:,.1f} MiB{share}")
    if compile is True and model.device.type != "cpu" and not no_kv_cache:
        print("compiling the batched decode step (--compile) for 1, 2-4 and 5 or more rows: minutes the first time, "
              "less once Inductor has it cached on disk", file=sys.stderr, flush=True)
    if world_size > 1:
        line += f"; split over {world_size} processes"
    runner = Runner(model, num_blocks, block_size, compile=compile if not no_kv_cache else False, max_rows=parallel,
                    progress=ProgressPrinter(prefix="llama-server: ") if llama.info.rank == 0 else None)
    for note in runner.notes:
        print(f"llama-server: note: {as_flags(note)}", file=sys.stderr, flush=True)
    if runner.compiled is not None:
        line += "; decode step compiled"
    return llama, runner, num_blocks, line


def _load(settings: dict, prefill_chunk: int, max_waiting: int):
    """Build the model, the KV cache, the scheduler and the engine; returns the engine and a line describing them."""
    from llama.server.engine import Engine
    from llama.server.ranks import LeaderRunner, step_group
    from llama.server.scheduler import Scheduler

    llama, runner, num_blocks, line = _build(**settings)
    if llama.info.world_size > 1:
        runner = LeaderRunner(runner, step_group(), on_lost=_rank_lost)
    scheduler = Scheduler(max(num_blocks, 1), settings["block_size"], settings["parallel"], prefill_chunk,
                          kv_cache=not settings["no_kv_cache"])
    engine = Engine(llama.tokenizer, scheduler, runner, max_waiting, log=_log)
    engine.start()
    return engine, line


def _follow(settings: dict) -> None:
    """A rank other than 0: load this rank's slice, then run rank 0's steps until it stops."""
    from llama.server.ranks import follow, step_group

    llama, runner, _, _ = _build(**settings)
    group = step_group()
    print(f"llama-server: rank {llama.info.rank} of {llama.info.world_size} (pid {os.getpid()}) runs the steps "
          "rank 0 sends", file=sys.stderr, flush=True)
    follow(runner, group)


def _rank_lost(why: str) -> None:
    """Another rank is gone: the model cannot run without its slice, so this process ends at once, saying why."""
    print(f"error: {why}", file=sys.stderr, flush=True)
    os._exit(EXIT_ERROR)


def _log(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def _uvicorn_server():
    import uvicorn

    class Server(uvicorn.Server):
        """uvicorn, told to let the engine drain when asked to stop, and to exit 0 rather than re-raise the signal."""

        def __init__(self, app, grace: float):
            config = uvicorn.Config(app, log_level="warning", access_log=False, lifespan="off",
                                    timeout_graceful_shutdown=int(grace) + 5)
            super().__init__(config)
            self.grace, self.engine = grace, None

        def handle_exit(self, sig, frame) -> None:
            super().handle_exit(sig, frame)
            self._captured_signals.clear()

        async def on_tick(self, counter: int) -> bool:
            stop = await super().on_tick(counter)
            if stop and self.engine is not None:
                print("llama-server: stopping: no new requests; those in flight get "
                      f"{self.grace:g} s to finish", file=sys.stderr, flush=True)
                self.engine.stop_accepting(self.grace)
                self.engine = None
            return stop

    return Server


def _Server(app, grace: float):
    return _uvicorn_server()(app, grace)


# How long an idle OpenMP worker of the server spins before it sleeps (libgomp's GOMP_SPINCOUNT, in spins).
SPIN_COUNT = "10000"


def cli() -> None:
    # OpenMP's workers spin between parallel regions, and how long is read once, when torch loads the runtime: too
    # early for anything but the environment. A server shares its cores with its own HTTP thread and its clients.
    # Left spinning (libgomp's default, 300,000 spins), its workers starved the very threads they wait for: on
    # the shared 2-core machine one client got 2.7 tokens/s against 8.3 with OMP_WAIT_POLICY=PASSIVE. Asleep at
    # once, each of a step's hundreds of parallel regions waits for a worker to wake, and a 576 x 1024 product of
    # 8 rows took as long as on one thread (135 against 79 us). A short spin keeps the workers through a step
    # and frees the cores between steps: 8 clients got 122 tokens/s against 96 asleep, one client 40 against 30
    # (scripts/bench_server.py, docs/benchmarks.md). So, unless either variable is set, start again with it set.
    if "OMP_WAIT_POLICY" not in os.environ and "GOMP_SPINCOUNT" not in os.environ:
        os.environ["GOMP_SPINCOUNT"] = SPIN_COUNT
        os.execv(sys.executable, [sys.executable, "-m", "llama.cli.server", *sys.argv[1:]])
    run(main, "llama-server", quick_exit=False)  # no one waits on a stop: its threads end as they will


if __name__ == "__main__":
    cli()
