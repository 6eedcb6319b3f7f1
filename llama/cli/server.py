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
import sys
from dataclasses import replace
from pathlib import Path
from typing import Tuple, Union

from llama.cli.common import EXIT_ERROR, as_flags, fail, run
from llama.cli.flags import with_model_flags
from llama.cli.loading import build_from_flags
from llama.cli.printer import ProgressPrinter
from llama.compile import store
from llama.convert.fetch import DEFAULT_MODEL
from llama.run_plan import ModelFlags, check_before_loading
from llama.runtime.distributed import launched_rank
from llama.errors import LlamaError
from llama.runtime.devices import local_device, resolve_device

API_KEY_ENV = "LLAMA_API_KEY"
_UNITS = {"": 1, "b": 1, "k": 1e3, "kb": 1e3, "kib": 2**10, "m": 1e6, "mb": 1e6, "mib": 2**20, "g": 1e9, "gb": 1e9,
          "gib": 2**30}


def _number_and_unit(size: Union[int, str], flag: str, takes: str) -> Tuple[float, str]:
    """A size flag's number and its unit in lower case ("" for none); a one-line error if it is neither."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", str(size))
    if isinstance(size, bool) or not match or match.group(2).lower() not in _UNITS:
        fail(f"{flag} takes {takes}, not {size!r}")
    return float(match.group(1)), match.group(2).lower()


def kv_cache_positions(size: Union[int, str, None], bytes_per_position: int, default: int) -> int:
    """--kv-cache-size as positions: a whole number is tokens; a number with a unit (512MiB, 2GB) is bytes."""
    if size is None:
        return default
    if isinstance(size, int) and not isinstance(size, bool):
        tokens = size
    else:
        number, unit = _number_and_unit(size, "--kv-cache-size", "tokens (4096) or bytes with a unit (512MiB, 2GB)")
        tokens = int(number) if unit == "" else int(number * _UNITS[unit]) // bytes_per_position
    if tokens < 1:
        fail(f"--kv-cache-size {size} holds no token (one takes {bytes_per_position:,} bytes with this model)")
    return tokens


def byte_count(size: Union[int, str], flag: str) -> int:
    """A flag's bytes: a whole number, or a number with a unit (500MB, 2GiB)."""
    number, unit = _number_and_unit(size, flag, "bytes, alone (1073741824) or with a unit (500MB, 2GiB)")
    return int(number * _UNITS[unit])


@with_model_flags
def main(
    flags: ModelFlags = None,
    host: str = "127.0.0.1",
    port: int = 8080,
    parallel: int = 4,
    kv_cache_size: Union[int, str] = None,
    max_seq_len: int = 2048,
    block_size: int = 16,
    prefill_chunk: int = 256,
    max_waiting: int = 64,
    api_key: str = None,
    no_kv_cache: bool = False,
    kv_cache_dir: str = None,
    kv_cache_dir_size: Union[int, str] = "1GiB",
    no_webui: bool = False,
    model_name: str = None,
    shutdown_grace: float = 5.0,
    speculate: str = None,
    draft_tokens: int = 4,
):
    """Serve a LLaMA model over OpenAI's HTTP API, batching requests continuously.

    Examples:
        llama-server
        llama-server --port 8000 --parallel 8 --kv-cache-size 16384
        llama-server --kv-cache-dir ~/.cache/llama-kv-blocks --kv-cache-dir-size 4GiB
        llama-server --speculate ngram
        torchrun --nproc_per_node 2 --no-python llama-server --ckpt-dir llama-2-13b
        curl http://127.0.0.1:8080/v1/chat/completions -H 'Content-Type: application/json' \\
            -d '{"messages": [{"role": "user", "content": "Hello!"}], "max_tokens": 32}'

    Args:
        <model flags>
        <kv cache dtype flag>
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
        kv_cache_dir: also keep every full block of the KV cache in this directory (created if need be), so that
            a prefix computed once is loaded instead of computed again, after its blocks left memory or the server
            restarted; keyed by the model, the KV dtype, the block size and the tokens. Several servers may share
            it. Not with --no-kv-cache, nor under torchrun.
        kv_cache_dir_size: the most bytes --kv-cache-dir may take (500MB, 2GiB); the least recently used blocks
            go first.
        no_webui: do not serve the chat page at / (then GET / is 404, as any unknown path).
        model_name: the model's id in responses and /v1/models; default: the checkpoint directory's name.
        shutdown_grace: seconds running requests get to finish after Ctrl-C or SIGTERM; those still running
            then end with what they have, finish_reason "length" (cut short, as by max_tokens). Waiting ones
            get 503 at once.
        compile: compile the batched decode step where the default would not: on a GPU, with torch.compile
            before serving (minutes). The default, with neither flag: on the CPU the step is compiled ahead of
            time for one row and for 2-16 rows (about a minute each for the default model on 2 cores, the first
            time; with a progress line), stored under $LLAMA_HOME and loaded in milliseconds by later starts;
            prompt chunks run eagerly. Without a C++ compiler it runs eagerly, with a note.
        no_compile: run every step eagerly.
        speculate: ngram: draft tokens for every request by prompt lookup (the tokens that followed the latest
            earlier occurrence of its last few tokens, in its prompt or its output so far) and check each draft
            in the batched step: at temperature 0 exactly the text without it, faster where the output repeats
            the input (summaries, edits, code); above it the same distribution. `usage.completion_tokens_details`
            counts the drafted tokens accepted and rejected. Needs the KV cache.
        draft_tokens: the most tokens a draft holds (1-16; default 4).
    """
    for name, value, low in (("--port", port, 0), ("--parallel", parallel, 1), ("--max-seq-len", max_seq_len, 2),
                             ("--block-size", block_size, 1), ("--prefill-chunk", prefill_chunk, 1),
                             ("--max-waiting", max_waiting, 0)):
        if value < low:
            fail(f"{name} must be at least {low}, not {value}")
    if port > 65535:
        fail(f"--port must be at most 65535, not {port}")
    api_key = api_key if api_key is not None else os.environ.get(API_KEY_ENV) or None
    dir_size = byte_count(kv_cache_dir_size, "--kv-cache-dir-size")
    # The run plan decides the batched step (compile_layers): the model's layers are planned for it, and the runner
    # makes it. What the plan would refuse without the checkpoint is refused before the server listens.
    compile = flags.checked().compile
    flags = replace(flags, max_seq_len=max_seq_len, max_batch_size=parallel, seed=1, compile=False,
                    compile_layers=compile if not no_kv_cache else False)
    try:
        check_before_loading(flags, int(os.environ.get("WORLD_SIZE", "1")),
                             stored_step=store.used(local_device(resolve_device(flags.device))))
    except LlamaError as e:
        fail(as_flags(str(e)))
    if speculate is not None:
        from llama.server.app import check_server_speculation

        try:
            check_server_speculation(speculate, draft_tokens, not no_kv_cache)
        except LlamaError as e:
            fail(as_flags(str(e)))
    if kv_cache_dir is not None:  # refused before the model loads, not after
        from llama.server.disk_cache import check_disk_cache, prepare_directory

        check_disk_cache(not no_kv_cache, int(os.environ.get("WORLD_SIZE", "1")))
        prepare_directory(Path(kv_cache_dir).expanduser())

    def load():
        """This rank's Llama, as every command loads it."""
        llama = build_from_flags(flags)
        if llama.info.plan.batched_step == "torch.compile":
            print("compiling the batched decode step (--compile) for 1, 2-4 and 5 or more rows: minutes the first "
                  "time, less once Inductor has it cached on disk", file=sys.stderr, flush=True)
        return llama

    def kv_cache_tokens(per_position: int) -> int:
        """--kv-cache-size in positions, once the model says how many bytes one takes."""
        return kv_cache_positions(kv_cache_size, per_position, parallel * max_seq_len)

    runner_settings = dict(parallel=parallel, kv_cache_size=kv_cache_tokens, block_size=block_size,
                           kv_cache=not no_kv_cache)
    if launched_rank() != 0:  # under torchrun: rank 0 serves, the others run its steps
        from llama.server.app import follow_steps

        follow_steps(load(), say=_say, **runner_settings)
        return
    try:
        import uvicorn  # noqa: F401
        from llama.server.app import serve
    except ImportError as e:
        fail(f"llama-server needs {e.name}: pip install 'llama-kv[server]'")
    name = model_name or (Path(flags.ckpt_dir).resolve().name if flags.ckpt_dir is not None else DEFAULT_MODEL)
    serve(load, host, port, prefill_chunk=prefill_chunk, max_waiting=max_waiting, model_id=name, api_key=api_key,
          webui=not no_webui, shutdown_grace=shutdown_grace, progress=ProgressPrinter(prefix="llama-server: "),
          kv_cache_dir=str(Path(kv_cache_dir).expanduser()) if kv_cache_dir is not None else None,
          kv_cache_dir_size=dir_size, speculate=speculate, draft_tokens=draft_tokens, on_rank_lost=_rank_lost,
          say=_say, log=_log, **runner_settings)


def _say(line: str) -> None:
    """The server's own lines, in the command line's terms."""
    print(f"llama-server: {as_flags(line)}", file=sys.stderr, flush=True)


def _rank_lost(why: str) -> None:
    """Another rank is gone: the model cannot run without its slice, so this process ends at once, saying why."""
    print(f"error: {why}", file=sys.stderr, flush=True)
    os._exit(EXIT_ERROR)


def _log(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


# How long an idle OpenMP worker of the server spins before it sleeps (libgomp's GOMP_SPINCOUNT, in spins).
SPIN_COUNT = "10000"


def cli() -> None:
    # OpenMP's workers spin between parallel regions, and how long is read once, when torch loads the runtime: too
    # early for anything but the environment. A server shares its cores with its own HTTP thread and its clients.
    # Left spinning for libgomp's default 300,000 spins, its workers starve the very threads they wait for; asleep
    # at once, each of a step's hundreds of parallel regions waits for a worker to wake, as slow as one thread. A
    # short spin keeps the workers through a step and frees the cores between steps (the figures: scripts/
    # bench_server.py, docs/benchmarks.md, "Figures behind the code"). So, unless either variable is set, start again with it set.
    if "OMP_WAIT_POLICY" not in os.environ and "GOMP_SPINCOUNT" not in os.environ:
        os.environ["GOMP_SPINCOUNT"] = SPIN_COUNT
        os.execv(sys.executable, [sys.executable, "-m", "llama.cli.server", *sys.argv[1:]])
    run(main, "llama-server", store_builds=False)  # a stop is a stop: a package still being built is built next time


if __name__ == "__main__":
    cli()
