"""GGUF files and Hugging Face folders where a checkpoint goes: converted once into $LLAMA_HOME/converted.

`resolve_checkpoint` turns whatever a user passed as the model into a checkpoint directory in Meta's layout.
A checkpoint directory comes back as it is. A `.gguf` file or a Hugging Face LLaMA folder (`config.json`
and weights) is converted on first use, by the converters `llama-convert` uses (a GGUF's quantized blocks
kept as stored), into `$LLAMA_HOME/converted/<key>`, and later uses return that directory at once.

The key is the source's identity, not its path: for every file of the source, its size, its modification
time in nanoseconds and a sha256 of its header followed by 16 evenly spaced 64 KiB samples of the rest
(files under 4 MiB whole). A safetensors file's header is its JSON header; a GGUF file's is its first 8 MiB,
which holds a LLaMA model's whole metadata, vocabulary and tensor table (walking the header to find its end
costs 0.1 s on a 49,152-piece vocabulary, hashing 8 MiB 0.02 s). Hashing whole files would read gigabytes
on every use, which is what the cache is there to avoid. Size and mtime catch every ordinary rewrite (a new
download, a re-quantization, a metadata edit in place); the header catches another model of the same size
whose mtime was carried over (`cp -p`, `rsync -t`) or fell within a coarse file system's timestamp; the
samples catch other weights under an identical header. The path is left out, so a file that is moved or
renamed (which keeps its mtime) is not converted again.

An entry is trusted only through `MANIFEST`, written last: the source, and every file's size and digest
(sampled as above). An entry whose manifest is missing or disagrees with its files (truncated, edited,
half deleted) is removed and converted again, never loaded. Checking it reads about a megabyte a file.

Two processes converting the same source take turns on a lock file (`fcntl.flock`), so the second one
waits and then finds the first one's entry. Each conversion is written into a staging directory and renamed
into place whole: a crash leaves no entry behind, and where locks do not work (no fcntl, some network file
systems) the process that finishes second finds a complete entry in the way, keeps it and drops its own.
"""

import hashlib
import json
import os
import shutil
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Dict, List, Optional, Tuple, Union

from llama.errors import LlamaError
from llama.runtime.files import lock_file, sha256_file, write_atomically
from llama.runtime.paths import home_dir
from llama.runtime.progress import Progress

CACHE_DIR_NAME = "converted"
MANIFEST = "converted-from.json"
# Bump when the converters' output changes, so that old entries are not used: the format is part of the key, so
# a source gets a new entry, and the old one (found by its source path) is removed once the new one is made.
# 2: a GGUF's quantized embedding stays quantized (an entry of 1 holds it in float32, up to 4x the room).
FORMAT = 2
_WHOLE_BELOW = 4 << 20
_SAMPLES, _SAMPLE_BYTES = 16, 64 << 10
_GGUF_HEAD = 8 << 20
_KEY_CHARS = 20
_LOCKS = ".locks"
# The files of a Hugging Face folder that can change what the conversion writes.
_HF_SUFFIXES = (".json", ".safetensors", ".bin", ".model")

Notice = Callable[[str], None]


def cache_dir() -> Path:
    """Where converted sources are kept: `$LLAMA_HOME/converted` (see `llama.runtime.paths.home_dir`)."""
    return home_dir() / CACHE_DIR_NAME


def source_kind(path: Path) -> Optional[str]:
    """"gguf", "hf" (a Hugging Face folder), or None for a directory to be read as a checkpoint in Meta's layout.

    Raises:
        LlamaError: `path` does not exist, or is a file that is not GGUF.
    """
    path = Path(path)
    if path.is_dir():
        is_hf = not (path / "params.json").is_file() and (path / "config.json").is_file()
        return "hf" if is_hf else None
    if path.is_file():
        with open(path, "rb") as f:
            if f.read(4) == b"GGUF":
                return "gguf"
        raise LlamaError(f"{path} is a file but not a GGUF file; give a .gguf file, a Hugging Face model folder "
                         "or a checkpoint directory in Meta's layout")
    raise LlamaError(f"{path} does not exist; give a checkpoint directory, a .gguf file or a Hugging Face model folder")


def resolve_checkpoint(path: Union[str, Path], progress: Optional[Progress] = None,
                       notice: Optional[Notice] = None) -> Path:
    """A checkpoint directory for `path`: the directory itself, or the cached conversion of a GGUF file or a
    Hugging Face folder, converted now if it is not cached yet (or its entry is damaged).

    Args:
        path: a checkpoint directory in Meta's layout, a .gguf file, or a Hugging Face LLaMA folder.
        progress: told how a conversion goes (tensors read, bytes written).
        notice: told, in one line each, where a conversion goes and how much disk it takes, that a damaged
            entry is converted again, or that another process is converting the same source.

    Raises:
        LlamaError: `path` is not any of those, the conversion failed (nothing is left behind), or it would
            not fit on the disk (said before anything is written).
    """
    path = Path(path).expanduser()
    kind = source_kind(path)
    if kind is None:
        return path
    say = notice or (lambda line: None)
    src = path.resolve()
    identity = _source_identity(src, kind)
    key = hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:_KEY_CHARS]
    root = cache_dir()
    entry = root / key
    if entry_damage(entry) is None:
        return entry
    needed = _converted_bytes(src, kind)
    _check_room(root, needed, _tree_bytes(entry), src)  # before anything is written, the lock file included
    with _locked(root, key, src, say) as exclusive:
        damage = entry_damage(entry)  # another process may have converted it while this one waited
        if damage is None:
            return entry
        if entry.exists():
            say(f"the cached conversion of {src.name} in {entry} is damaged ({damage}); converting it again")
            _remove(entry)
        if exclusive:  # without a lock, another process's staging directory may look like a leftover
            _remove_leftovers(root, key)
        free = shutil.disk_usage(root).free
        say(f"converting {src} once into {entry}: about {format_bytes(needed)} on that disk "
            f"({format_bytes(free)} free); later uses load it from there")
        _convert(src, kind, entry, identity, progress, notice)
    _remove_replaced(root, src, key)
    return entry


@dataclass
class CachedConversion:
    """One entry of the cache, for `llama-download --list`."""

    path: Path
    source: str
    kind: str
    size: int  # bytes on disk
    damage: Optional[str]  # None for a sound entry
    current: bool  # whether the source is still there, unchanged


def cached_conversions() -> List[CachedConversion]:
    """Every entry in the cache, oldest first, checked (a damaged one says why) and compared with its source."""
    root = cache_dir()
    entries = sorted((p for p in root.iterdir() if p.is_dir() and not p.name.startswith(".")),
                     key=lambda p: p.stat().st_mtime) if root.is_dir() else []
    out = []
    for entry in entries:
        manifest = _read_manifest(entry) or {}
        source, kind = str(manifest.get("source", "?")), str(manifest.get("kind", "?"))
        try:
            current = _source_identity(Path(source), kind) == manifest.get("identity")
        except (LlamaError, OSError):
            current = False
        out.append(CachedConversion(entry, source, kind, _tree_bytes(entry), entry_damage(entry), current))
    return out


def leftover_bytes() -> int:
    """Bytes held by conversions that never finished (their process was killed), which `clear` removes."""
    root = cache_dir()
    return sum(_tree_bytes(p) for p in root.glob(".*.partial*")) if root.is_dir() else 0


def clear() -> Tuple[int, int]:
    """Remove every converted entry and unfinished conversion.

    A conversion under way in another process is left alone (its lock is held).

    Returns:
        (entries removed, bytes freed).
    """
    root = cache_dir()
    if not root.is_dir():
        return 0, 0
    removed, freed = 0, 0
    for path in sorted(root.iterdir()):
        if path.name == _LOCKS:
            continue
        key = path.name.lstrip(".").split(".")[0]
        with _locked(root, key, path, None, wait=False) as exclusive:
            if exclusive is False:
                continue  # being converted right now
            freed += _tree_bytes(path)
            removed += not path.name.startswith(".")
            _remove(path)
    return removed, freed


def entry_damage(entry: Path) -> Optional[str]:
    """Why the cache entry `entry` must not be loaded, or None when its files are as its manifest records."""
    manifest = _read_manifest(entry)
    if manifest is None:
        return f"it has no readable {MANIFEST}" if entry.exists() else "it does not exist"
    files = manifest.get("files")
    if manifest.get("format") != FORMAT or manifest.get("key") != entry.name or not isinstance(files, dict) or not files:
        return f"its {MANIFEST} is from another version or another entry"
    for name, recorded in files.items():
        path = entry / name
        if Path(name).name != name or not isinstance(recorded, dict):
            return f"its {MANIFEST} is malformed"
        if not path.is_file():
            return f"{name} is missing"
        size = path.stat().st_size
        if size != recorded.get("size"):
            return f"{name} has {size:,} bytes, not {recorded.get('size')}"
        if sample_digest(path) != recorded.get("sha256"):
            return f"{name} was changed"
    extra = sorted(f.name for f in entry.iterdir() if f.name not in files and f.name != MANIFEST)
    if extra:
        return f"it holds {extra[0]}, which it was not converted with"
    return None


def sample_digest(path: Path, header_bytes: int = 0) -> str:
    """sha256 of a file's first `header_bytes` and of 16 evenly spaced 64 KiB samples of the rest (first and
    last included); of the whole file when it is under 4 MiB more than its header."""
    size = path.stat().st_size
    if size <= header_bytes + _WHOLE_BELOW:
        return sha256_file(path)
    h = hashlib.sha256()
    with open(path, "rb") as f:
        header_bytes = min(header_bytes, size)
        h.update(f.read(header_bytes))
        rest = size - header_bytes
        for i in range(_SAMPLES):
            f.seek(header_bytes + (rest - _SAMPLE_BYTES) * i // (_SAMPLES - 1))
            h.update(f.read(_SAMPLE_BYTES))
    return h.hexdigest()


def format_bytes(n: int) -> str:
    """A size as people read disks: 93.1 MB, 4.66 GB."""
    for unit, scale in (("GB", 10**9), ("MB", 10**6), ("kB", 10**3)):
        if n >= scale:
            return f"{n / scale:.{1 if n < 100 * scale else 0}f} {unit}"
    return f"{n} bytes"


def _source_identity(src: Path, kind: str) -> Dict:
    """What the key is made of (see the module's docstring)."""
    if kind == "gguf":
        return {"format": FORMAT, "kind": kind, "files": [_file_identity(src)]}  # its name is not part of it
    if kind != "hf":
        raise LlamaError(f"{src} is of unknown kind {kind!r}")
    # Within a folder the names matter: config.json and a weight file of the same bytes are not the same source.
    files = sorted(f for f in src.iterdir() if f.is_file() and f.suffix in _HF_SUFFIXES and not f.name.startswith("."))
    return {"format": FORMAT, "kind": kind, "files": [{"name": f.name, **_file_identity(f)} for f in files]}


def _file_identity(path: Path) -> Dict:
    st = path.stat()
    return {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "sha256": sample_digest(path, _header_bytes(path))}


def _header_bytes(path: Path) -> int:
    """How much of a file's start is hashed whole: a GGUF file's first 8 MiB, a safetensors file's header."""
    with open(path, "rb") as f:
        start = f.read(8)
    if start[:4] == b"GGUF":
        return _GGUF_HEAD
    if path.suffix == ".safetensors" and len(start) == 8:
        return min(8 + int.from_bytes(start, "little"), path.stat().st_size)
    return 0


def _converted_bytes(src: Path, kind: str) -> int:
    if kind == "gguf":
        from llama.convert.gguf import converted_bytes

        return converted_bytes(src)
    from llama.convert.hf import converted_bytes

    return converted_bytes(src)


def _check_room(root: Path, needed: int, reclaimable: int, src: Path) -> None:
    existing = root
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    free = shutil.disk_usage(existing).free + reclaimable
    if needed > free:
        raise LlamaError(f"converting {src.name} needs about {format_bytes(needed)} in {root} but only "
                         f"{format_bytes(free)} is free there; free some space, or set LLAMA_HOME to a larger disk")


def _locked(root: Path, key: str, src: Path, say: Optional[Notice], wait: bool = True):
    """The lock of `key` under `root` (llama.runtime.files.lock_file), saying so if another process holds it."""
    @contextmanager
    def waiting():
        if say is not None:
            say(f"another process is converting {src.name}; waiting for it to finish")
        yield

    return lock_file(root / _LOCKS / key, waiting, wait)


def _convert(src: Path, kind: str, entry: Path, identity: Dict, progress: Optional[Progress],
             notice: Optional[Notice]) -> None:
    """Convert `src` into a staging directory, write its manifest last, and rename it to `entry`."""
    staging = entry.with_name(f".{entry.name}.{os.getpid()}.partial")
    try:
        if kind == "gguf":
            from llama.convert.gguf import convert_gguf

            convert_gguf(src, staging, notice=notice, progress=progress)
        else:
            from llama.convert.hf import convert_hf

            convert_hf(src, staging, progress=progress)
        files = {f.name: {"size": f.stat().st_size, "sha256": sample_digest(f)} for f in sorted(staging.iterdir())}
        manifest = {"format": FORMAT, "key": entry.name, "kind": kind, "source": str(src), "identity": identity,
                    "converted": time.strftime("%Y-%m-%d %H:%M:%S"), "files": files}
        write_atomically(staging / MANIFEST, json.dumps(manifest, indent=2) + "\n")
        try:
            os.rename(staging, entry)
        except OSError:
            if entry_damage(entry) is not None:
                raise
            # Another process finished the same conversion first, without a lock between us: keep its entry.
    except OSError as e:
        raise LlamaError(f"could not write the conversion of {src.name} into {entry.parent} "
                         f"({e.strerror or e}); nothing was left behind") from None
    finally:
        if staging.exists():
            shutil.rmtree(staging, ignore_errors=True)


def _remove_replaced(root: Path, src: Path, key: str) -> None:
    """Remove the entries converted from the same path before it changed: nothing can use them again."""
    for entry in root.iterdir():
        if entry.name == key or entry.name.startswith(".") or not entry.is_dir():
            continue
        manifest = _read_manifest(entry)
        if manifest is not None and manifest.get("source") == str(src):
            with _locked(root, entry.name, src, None, wait=False) as exclusive:
                if exclusive is not False:
                    _remove(entry)


def _remove_leftovers(root: Path, key: str) -> None:
    """Staging directories of conversions of `key` whose process died (only the lock's holder calls this)."""
    for path in list(root.glob(f".{key}.*")) + list(root.glob(f"..{key}.*")):
        _remove(path)


def _remove(path: Path) -> None:
    """Delete a directory (or file) so that no one sees it half deleted: renamed aside first, then removed."""
    if not path.exists():
        return
    aside = path.with_name(f".{path.name.lstrip('.')}.removing-{os.getpid()}")
    try:
        path.rename(aside)
    except OSError:
        aside = path
    if aside.is_dir() and not aside.is_symlink():
        shutil.rmtree(aside, ignore_errors=True)
    else:
        aside.unlink(missing_ok=True)


def _read_manifest(entry: Path) -> Optional[Dict]:
    try:
        manifest = json.loads((entry / MANIFEST).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return manifest if isinstance(manifest, dict) else None


def _tree_bytes(path: Path) -> int:
    if path.is_file():
        return path.stat().st_size
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) if path.is_dir() else 0
