"""The commands the tests run, each in a process of its own, started from a copy of one that has imported torch.

A command on a tiny model spends most of its time importing torch, and the suite starts a few hundred. Here each
test process keeps one server process that imports torch once and forks a child for every command. The child is a
process of its own, as `subprocess.run` would start: it runs the console script, the repository's script or
`python -m`'s module (torchrun's launcher among them) as `python` runs it, with the command's arguments,
environment, directory and standard input, writes to its own standard output and error, runs the threads' and
`atexit`'s shutdown as the interpreter does, and ends with the exit status the command gives.

What a forked child cannot see is what the server read as it started: the environment that the C libraries
(OpenMP, MKL, the allocator) and Python read at start-up. A command whose environment differs from the
server's in any of those runs with `subprocess.run` instead, as does any call while another is under way, and
every call with `LLAMA_TEST_FORK=0` in the tests' environment.
"""

import atexit
import io
import json
import locale
import os
import select
import signal
import subprocess
import sys
import tempfile
import threading
from pathlib import Path
from typing import Dict, List, Optional, Tuple

# Read when a process starts (libgomp, MKL, glibc, Python, torch's C++ side), so a forked child would not see a
# change to them: a command whose environment changes one is started afresh.
READ_AT_START = ("OMP_", "GOMP_", "KMP_", "MKL_", "LD_", "MALLOC", "GLIBC_", "PYTHON", "TORCH_", "PYTORCH_", "LC_",
                 "LANG", "CUDA", "DNNL", "ONEDNN", "OPENBLAS")


def _read_at_start(env: Dict[str, str]) -> Dict[str, str]:
    return {k: v for k, v in env.items() if k.startswith(READ_AT_START)}


def _target(argv: List[str]) -> Optional[Tuple[str, str]]:
    """What a command runs: ("path", file) for a console script of this environment's Python or `python script.py`,
    ("module", name) for `python -m name`; None for anything else (another program, `python -c`)."""
    if argv[0] == sys.executable:
        if len(argv) > 2 and argv[1] == "-m":
            return "module", argv[2]
        return ("path", argv[1]) if len(argv) > 1 and argv[1].endswith(".py") else None
    try:
        with open(argv[0], "rb") as f:
            first = f.readline()
    except OSError:
        return None
    interpreter = first[2:].split()[0].decode(errors="replace") if first.startswith(b"#!") and first[2:].split() else ""
    # A script of this environment's Python (pip writes its path there), not of another program or Python.
    same = (os.path.abspath(os.path.dirname(interpreter)) == os.path.abspath(os.path.dirname(sys.executable))
            and "python" in os.path.basename(interpreter))
    return ("path", argv[0]) if same else None


class Runner:
    """One test process's server of forked commands (started at its first command, ended with the process)."""

    def __init__(self, env: Dict[str, str]):
        self.env = dict(env)
        to_server, self._requests = os.pipe()
        self._replies, from_server = os.pipe()
        self.process = subprocess.Popen([sys.executable, __file__, str(to_server), str(from_server)],
                                        pass_fds=(to_server, from_server), env=self.env, stdin=subprocess.DEVNULL,
                                        stdout=subprocess.DEVNULL)
        os.close(to_server)
        os.close(from_server)
        self._pending = b""
        self.lock = threading.Lock()
        atexit.register(self.close)

    def _reply(self, timeout: Optional[float] = None) -> Optional[dict]:
        """The server's next reply, or None if none came within `timeout` seconds."""
        while b"\n" not in self._pending:
            if not select.select([self._replies], [], [], timeout)[0]:
                return None
            data = os.read(self._replies, 4096)
            if not data:
                raise EOFError("the command server ended")
            self._pending += data
        line, self._pending = self._pending.split(b"\n", 1)
        return json.loads(line)

    def serves(self, argv: List[str], env: Dict[str, str]) -> bool:
        return _target(argv) is not None and _read_at_start(env) == _read_at_start(self.env)

    def run(self, argv: List[str], env: Dict[str, str], input: Optional[str], timeout: float):
        with tempfile.TemporaryDirectory(prefix="command-") as tmp:
            paths = {name: os.path.join(tmp, name) for name in ("stdin", "stdout", "stderr")}
            if input is None:
                paths["stdin"] = os.devnull
            else:
                with open(paths["stdin"], "w") as f:
                    f.write(input)
            request = {"argv": argv, "env": env, "cwd": os.getcwd(), **paths}
            os.write(self._requests, (json.dumps(request) + "\n").encode())
            pid = self._reply()["pid"]
            reply = self._reply(timeout)
            if reply is None:  # the server has not reaped the child yet, so the pid is still the child's
                os.kill(pid, signal.SIGKILL)
                self._reply()
            out, err = (Path(paths[name]).read_bytes() for name in ("stdout", "stderr"))
        if reply is None:  # as subprocess.run raises it: what was written so far, as bytes
            raise subprocess.TimeoutExpired(argv, timeout, out or None, err or None)
        return subprocess.CompletedProcess(argv, reply["status"], _decode(out), _decode(err))

    def close(self):
        if self.process.poll() is None:
            os.close(self._requests)  # the server reads the end of its requests and exits
            self.process.wait(timeout=30)


def _decode(data: bytes) -> str:
    # As subprocess.run(text=True) reads a pipe: the locale's encoding, with universal newlines.
    return io.TextIOWrapper(io.BytesIO(data), encoding=locale.getpreferredencoding(False)).read()


# What every command's environment adds to the tests' own: commands on one thread, two workers side by side.
COMMAND_ENV = {"OMP_NUM_THREADS": "1"}

_runner: Optional[Runner] = None


def run(argv: List[str], env: Optional[Dict[str, str]] = None, input: Optional[str] = None, timeout: float = 300):
    """`subprocess.run(argv, capture_output=True, text=True, ...)`'s result, from a forked child where one can
    serve (the module's docstring). `env`: what the command's environment adds to the tests' and COMMAND_ENV."""
    global _runner
    base = {**os.environ, **COMMAND_ENV}
    env = {**base, **(env or {})}
    if os.environ.get("LLAMA_TEST_FORK", "1") != "0":
        if _runner is None or _runner.process.poll() is not None:
            _runner = Runner(base)
        if _runner.serves(argv, env) and _runner.lock.acquire(blocking=False):
            try:
                return _runner.run(argv, env, input, timeout)
            finally:
                _runner.lock.release()
    return subprocess.run(argv, capture_output=True, text=True, input=input, timeout=timeout, env=env)


def _exit_status(code) -> int:
    """The exit status of `sys.exit(code)`, as the interpreter gives it."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    print(code, file=sys.stderr)
    return 1


def _child(request: dict) -> None:
    """Run the command as `python` runs a script, then end as the interpreter ends; never returns."""
    status = 1
    try:
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        for fd, name, flags in ((0, "stdin", os.O_RDONLY), (1, "stdout", os.O_WRONLY | os.O_CREAT | os.O_TRUNC),
                                (2, "stderr", os.O_WRONLY | os.O_CREAT | os.O_TRUNC)):
            opened = os.open(request[name], flags, 0o644)
            os.dup2(opened, fd)
            os.close(opened)
        argv = request["argv"]
        kind, target = _target(argv)
        import runpy
        try:
            if kind == "module":  # as `python -m`: the directory first on the path, argv[0] the module's file
                sys.argv, sys.path[0] = argv[2:], os.getcwd()
                runpy.run_module(target, run_name="__main__", alter_sys=True)
            else:
                sys.argv = argv[1:] if argv[0] == sys.executable else list(argv)
                sys.path[0] = os.path.dirname(os.path.abspath(target))
                runpy.run_path(target, run_name="__main__")
            status = 0
        except SystemExit as e:
            status = _exit_status(e.code)
        except BaseException:
            error_type, error, frames = sys.exc_info()
            while frames is not None and frames.tb_frame.f_code.co_filename in (__file__, runpy.__file__,
                                                                                "<frozen runpy>"):
                frames = frames.tb_next  # runpy's frames and ours: the traceback starts at the command's own
            sys.excepthook(error_type, error.with_traceback(frames), frames)
            status = 1
        threading._shutdown()  # what the interpreter does as it ends: wait for the threads, then run atexit's
        atexit._run_exitfuncs()
    except BaseException:
        sys.excepthook(*sys.exc_info())
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:
                pass
        os._exit(status)


def _serve(requests_fd: int, replies_fd: int) -> None:
    import gc

    import torch  # noqa: F401  what every command imports first, and what takes the time

    gc.freeze()  # the children share these pages rather than copy them as a collection touches them
    with os.fdopen(requests_fd, "rb") as requests, os.fdopen(replies_fd, "wb", buffering=0) as replies:
        for line in requests:
            request = json.loads(line)
            sys.stdout.flush()
            sys.stderr.flush()
            pid = os.fork()
            if pid == 0:
                requests.close()
                replies.close()
                _child(request)
            replies.write((json.dumps({"pid": pid}) + "\n").encode())
            _, wait_status = os.waitpid(pid, 0)
            replies.write((json.dumps({"status": os.waitstatus_to_exitcode(wait_status)}) + "\n").encode())


if __name__ == "__main__":
    _serve(int(sys.argv[1]), int(sys.argv[2]))
