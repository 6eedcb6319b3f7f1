"""Small file helpers every reader and writer shares: JSON objects in, whole files out, files' digests, and the
lock files that make two processes take turns at the same work."""

import hashlib
import json
import os
import tempfile
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import Any, Callable, ContextManager, Dict, Iterator, Optional, Union

from llama.errors import LlamaError

try:
    import fcntl
except ImportError:  # Windows: no locks; whoever renames into place first wins, whole
    fcntl = None


# Hashing reads through one buffer of this size. Chunks of a megabyte or more, each a new bytes object, are placed
# in glibc's heap once torch has run (its large frees raise glibc's threshold for mapping blocks of their own), and
# hashing a 4.6 MB compiled package that way left 2 MiB of freed heap resident for the rest of the process.
_HASH_BUFFER = 1 << 18


def sha256_file(path: Union[str, Path]) -> str:
    """The sha256 hex digest of a file's bytes."""
    h = hashlib.sha256()
    buffer = bytearray(_HASH_BUFFER)
    view = memoryview(buffer)
    with open(path, "rb") as f:
        while n := f.readinto(buffer):
            h.update(view[:n])
    return h.hexdigest()


def read_json_object(path: Path, missing: str = "") -> Dict[str, Any]:
    """The JSON object in `path`; a missing file, bad JSON or a non-object is a LlamaError naming it.

    Args:
        path: the file.
        missing: what to add to the "does not exist" message, e.g. why the file is needed.
    """
    path = Path(path)
    if not path.is_file():
        raise LlamaError(f"{path} does not exist" + (f": {missing}" if missing else ""))
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise LlamaError(f"{path} is not valid JSON ({e})") from None
    if not isinstance(value, dict):
        raise LlamaError(f"{path} must hold a JSON object, not {type(value).__name__}")
    return value


def write_atomically(path: Path, data: Union[bytes, str]) -> Path:
    """Write a whole file so that a reader sees the old file or the new one, never half of it.

    The data goes to a temporary file in the same directory (so the final rename stays within one file
    system), flushed to disk, then renamed over `path`.
    """
    path = Path(path)
    if isinstance(data, str):
        data = data.encode("utf-8")
    fd, tmp_name = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            os.fchmod(f.fileno(), 0o644)  # mkstemp makes files owner-only; these are ordinary data
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp_name, path)
    except BaseException:
        Path(tmp_name).unlink(missing_ok=True)
        raise
    return path


@contextmanager
def lock_file(path: Path, waiting: Callable[[], ContextManager] = nullcontext,
              wait: bool = True) -> Iterator[Optional[bool]]:
    """Hold an exclusive lock on the file `path` (created, never deleted) while the block runs, so that processes
    doing the same work take turns; where another process holds it, this one waits inside `waiting()` (a progress
    line, a message).

    Yields True when it is held, False when another process holds it and `wait` is False, and None where there
    are no locks (no fcntl, or a file system without them): the block then runs unprotected.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    if fcntl is None:
        yield None
        return
    # Never deleted: deleting it while another process waits on it would let a third process lock a new file of
    # the same name, and two would do the work at once.
    with open(path, "a") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            if not wait:
                yield False
                return
            with waiting():
                fcntl.flock(f, fcntl.LOCK_EX)
        except OSError:
            yield None  # this file system has no locks (ENOLCK)
            return
        try:
            yield True
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)
