"""What every command shares: one-line errors instead of tracebacks, flags in place of parameter names, and exit statuses."""

import functools
import gc
import inspect
import os
import re
import sys
import time
import traceback
from typing import Callable, List, NoReturn, Optional, Sequence

import fire

from llama.errors import LlamaError

EXIT_ERROR = 1
EXIT_INTERRUPTED = 130  # 128 + SIGINT, what a shell reports for Ctrl-C


# The library names its parameters (`dtype=bfloat16`, `compile=True`, `quantize=`); on the command line the
# same words are flags. Only these names are rewritten, so other text that holds "=" is left alone.
_PARAMETERS = ("dtype", "quantize", "quant_kernels", "compile", "dequantize", "overwrite", "max_seq_len", "max_gen_len",
               "max_batch_size", "ctx", "device", "tokenizer_path", "temperature", "top_p", "kv_cache",
               "speculate", "draft_tokens", "kv_cache_dir", "kv_cache_dir_size", "kv_cache_dtype")
_PARAMETER = re.compile(r"\b(" + "|".join(_PARAMETERS) + r")=(True\b|[^\s,;:)]*)")


def as_flags(message: str) -> str:
    """A library message in the command line's terms: `dtype=bfloat16` -> `--dtype bfloat16`,
    `compile=True` -> `--compile`, `compile=False` -> `--no-compile`, `quantize=` -> `--quantize`."""

    def flag(match: re.Match) -> str:
        name, value = match.group(1).replace("_", "-"), match.group(2)
        if value == "False":  # fire's spelling of a switch turned off
            return f"--no-{name}"
        return f"--{name}" if value in ("", "True") else f"--{name} {value}"

    return _PARAMETER.sub(flag, message)


def fail(message: str) -> NoReturn:
    """Print `message` as the command's one-line error (in its flags' terms) and exit non-zero."""
    print(f"error: {as_flags(message)}", file=sys.stderr)
    sys.exit(EXIT_ERROR)


def whole_numbers(value, flag: str) -> List[int]:
    """A flag's comma-separated whole numbers, each at least 1, sorted without repeats (fire reads "1,4" as a tuple,
    "4" as a number); a one-line error otherwise."""
    items = value if isinstance(value, (list, tuple)) else str(value).split(",")
    try:
        out = sorted({int(v) for v in items})
    except ValueError:
        fail(f"{flag} takes comma-separated whole numbers, not {value!r}")
    if not out or out[0] < 1:
        fail(f"{flag} values must be at least 1")
    return out


def seconds_since_start() -> Optional[float]:
    """Wall-clock seconds since this process started, or None where the system does not say (Linux's /proc does).

    Counted from the process's start rather than from a line of this package, so that the figure holds the
    interpreter's start and every import before a command's `main` runs, torch's included.
    """
    try:
        with open("/proc/self/stat") as f:
            # Field 22, starttime, in clock ticks since boot; the command name before it may hold spaces and ")".
            start_ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        return max(time.clock_gettime(time.CLOCK_BOOTTIME) - start_ticks / os.sysconf("SC_CLK_TCK"), 0.0)
    except (OSError, ValueError, IndexError, AttributeError):  # no /proc, or no CLOCK_BOOTTIME (not Linux)
        return None


def quote_raw_strings(argv: List[str], flags: Sequence[str]) -> List[str]:
    """Make fire take these flags' values as literal text.

    fire evaluates flag values as Python literals, so `--prompt 42` would arrive as an int and
    `--prompt "'hi'"` lose its quotes; passing repr(value) makes it evaluate back to the exact string.
    """
    out, i = [], 0
    while i < len(argv):
        arg = argv[i]
        name, eq, value = arg.partition("=")
        if name in flags and eq:
            out.append(f"{name}={value!r}")
        elif arg in flags and i + 1 < len(argv):
            out += [arg, repr(argv[i + 1])]
            i += 1
        else:
            out.append(arg)
        i += 1
    return out


def model_short_flag(argv: List[str]) -> List[str]:
    """llama.cpp's `-m FILE` as `--model FILE`: fire would take `-m` for any flag starting with m and refuse
    it as ambiguous among --max-gen-len, --max-seq-len and --max-batch-size."""
    out = []
    for arg in argv:
        name, eq, value = arg.partition("=")
        out.append(f"--model{eq}{value}" if name == "-m" else arg)
    return out


def checked_types(main: Callable) -> Callable:
    """Wrap `main` so a flag annotated int, float or bool that fire parsed as something else (`--seed abc`,
    `--max-gen-len 1e3.5`) is a one-line error rather than a TypeError deep inside."""
    sig = inspect.signature(main)

    @functools.wraps(main)
    def checked(*args, **kwargs):
        bound = sig.bind(*args, **kwargs)
        for name, value in bound.arguments.items():
            param = sig.parameters[name]
            if value is param.default:  # fire passes the defaults along with what was given
                continue
            kind, flag = param.annotation, "--" + name.replace("_", "-")
            is_number = isinstance(value, (int, float)) and not isinstance(value, bool)
            if kind is int and not (is_number and float(value).is_integer()):
                fail(f"{flag} takes a whole number, not {value!r}")
            if kind is int:
                bound.arguments[name] = int(value)
            elif kind is float and not is_number:
                fail(f"{flag} takes a number, not {value!r}")
            elif kind is bool and not isinstance(value, bool):
                fail(f"{flag} is a switch: give it alone (or --no{name}), not with the value {value!r}")
        return main(*bound.args, **bound.kwargs)

    return checked


def exit_now(status: int = 0, store_builds: bool = True) -> NoReturn:
    """End a command at once with `status` (1 instead of 0 if its output cannot be flushed).

    Python's teardown of a process that imported torch takes half a second (`python -c "import torch"` spends
    it too) and does nothing a finished command needs: every file is written under a temporary name, closed
    and renamed before `main` returns, and the stored compiled step removes what it unpacked once `main` lets
    go of the model. It would also abort the process ("terminate called without an active exception") while a
    compiled step is still being built on a background thread. `store_builds` waits for those builds first, so
    that later runs load them (a command's success); without it they are left unbuilt (an interruption, an
    error, a server asked to stop). Under torchrun the normal teardown runs, to leave the process group as it
    should (no step is built there).
    """
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        sys.exit(status)
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a reader that went away (`| head`), or a closed stream
            status = status or EXIT_ERROR
    compile_module = sys.modules.get("llama.compile.step")
    if compile_module is not None and store_builds:  # a first run's stored step, built while it answered
        compile_module.finish_background_builds()
        sys.stderr.flush()
    os._exit(status)


def run(main: Callable, name: str, raw_string_flags: Sequence[str] = (), store_builds: bool = True) -> None:
    """Run a fire-based `main`; mistakes become `error: ...` on stderr and exit 1, Ctrl-C exits 130.

    `--debug` anywhere on the command line (or LLAMA_DEBUG=1) shows the full traceback instead. The process
    ends at once (`exit_now`), after storing the compiled steps still being built if `main` returned and
    `store_builds`.
    """
    debug = "--debug" in sys.argv or os.environ.get("LLAMA_DEBUG") == "1"
    argv = quote_raw_strings([a for a in sys.argv[1:] if a != "--debug"], raw_string_flags)
    if "model" in inspect.signature(main).parameters:
        argv = model_short_flag(argv)
    # What the imports made (torch's tens of thousands of objects) lives as long as the process: out of the
    # collector's way, each full collection during loading takes milliseconds rather than a tenth of a second.
    gc.freeze()
    try:
        fire.Fire(checked_types(main), command=argv, name=name)
        exit_now(store_builds=store_builds)
    except KeyboardInterrupt:
        sys.stdout.flush()
        print("\ninterrupted", file=sys.stderr)
        exit_now(EXIT_INTERRUPTED, store_builds=False)
    except (LlamaError, OSError) as e:
        if debug:
            traceback.print_exc()
        message = str(e) if isinstance(e, LlamaError) or not e.strerror else \
            f"{e.strerror}: {e.filename}" if e.filename else e.strerror
        print(f"error: {as_flags(message)}", file=sys.stderr)
        exit_now(EXIT_ERROR, store_builds=False)
