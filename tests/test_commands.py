"""tests/commands.py, which runs the tests' commands in forked copies of a process that has imported torch: what
a command gives there is what it gives in a process `subprocess.run` starts."""

import os
import subprocess
import sys

import pytest

import commands

SCRIPT = '''
import atexit, os, sys, threading, time
print("torch" in sys.modules, os.getcwd(), os.environ.get("PROBE"), sys.argv[1:], repr(sys.stdin.read()), sys.path[0])
atexit.register(lambda: print("atexit ran"))
threading.Thread(target=lambda: (time.sleep(0.2), print("the thread ended"))).start()
print("café\\r\\nto stderr", file=sys.stderr)
mode = sys.argv[1]
if mode == "status":
    sys.exit(3)
if mode == "message":
    sys.exit("error: a message")
if mode == "raise":
    raise ValueError("boom")
if mode == "sleep":
    time.sleep(60)
'''


@pytest.fixture
def script(tmp_path, monkeypatch):
    monkeypatch.delenv("LLAMA_TEST_FORK", raising=False)  # the runner's own tests, however the others run commands
    path = tmp_path / "probe.py"
    path.write_text(SCRIPT)
    monkeypatch.chdir(tmp_path)
    return path


@pytest.mark.parametrize("how, mode, stdin", [("script", "ok", None), ("script", "ok", "some\ninput"),
                                              ("script", "status", None), ("script", "message", None),
                                              ("script", "raise", None), ("-m", "ok", "input"), ("-m", "status", None)])
def test_a_forked_command_gives_what_a_started_one_gives(script, how, mode, stdin):
    argv = [sys.executable, *([str(script)] if how == "script" else ["-m", script.stem]), mode]
    env = {"PROBE": "yes"}
    forked = commands.run(argv, env, input=stdin)
    started = subprocess.run(argv, capture_output=True, text=True, input=stdin or "",
                             env={**os.environ, **commands.COMMAND_ENV, **env})
    assert forked.stdout.startswith("True ") and started.stdout.startswith("False ")  # only one imported torch
    assert forked.stdout[len("True "):] == started.stdout[len("False "):]
    assert "the thread ended\natexit ran\n" in forked.stdout
    assert (forked.returncode, forked.stderr) == (started.returncode, started.stderr)


def test_a_command_past_its_time_is_killed_as_subprocess_run_kills_it(script):
    argv = [sys.executable, str(script), "sleep"]
    with pytest.raises(subprocess.TimeoutExpired) as forked:
        commands.run(argv, timeout=3)
    with pytest.raises(subprocess.TimeoutExpired) as started:
        subprocess.run(argv, capture_output=True, text=True, timeout=3)
    assert forked.value.stderr == started.value.stderr == "café\r\nto stderr\n".encode()  # bytes, as written


def test_what_the_libraries_read_at_start_starts_a_process_afresh(script):
    result = commands.run([sys.executable, str(script), "ok"], {"OMP_NUM_THREADS": "2"})
    assert result.returncode == 0 and result.stdout.startswith("False ")
