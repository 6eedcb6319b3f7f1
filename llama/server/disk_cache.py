"""The KV cache's blocks kept on disk: every full block the server computes, found again after eviction or a restart.

llama-server's `--kv-cache-dir DIR` keeps one file per full block (llama/io/kv_blocks.py), named by the key of
its chain of tokens. Each block is written once, when it enters the in-memory prefix tree
(llama/server/blocks.py), from a copy of its keys and values, by a thread of its own, so decoding never waits
for the disk. Where a new sequence's walk of the tree stops, the scheduler asks this cache for the next full
blocks: each file found is read, checked against the model, dtype, block size, shapes, tokens and checksum,
and its keys and values go into the paged cache instead of being computed. A file that fails a check is
skipped with one line to the log and removed, never loaded.

The directory stays under `max_bytes`: before a write that would pass it, the least recently used files (by
modification time; a file read is touched) are removed until the files take at most 90% of it. Several
servers may share a directory: files appear whole (written under a unique temporary name, then renamed),
readers check every file, a file removed by another server is a miss, and each server counts the others' files
at least every tenth of the limit it writes.
"""

import os
import threading
import time
from collections import deque
from pathlib import Path
from typing import Callable, Deque, Dict, List, Sequence, Tuple

import torch

from llama.errors import LlamaError
from llama.io.kv_blocks import SUFFIX, BlockFileError, BlockSpec, block_file_bytes, read_block_file
from llama.runtime.files import write_atomically

DEFAULT_MAX_BYTES = 2**30
_PENDING_BYTES = 256 * 2**20  # blocks waiting for the writer; past this, new ones are not kept (decoding never waits)
_STALE_TEMP_SECONDS = 3600  # a temporary file this old was left by a process that died while writing


def prepare_directory(directory: Path) -> Path:
    """Create `directory` if need be and check that files can be written in it.

    Raises:
        LlamaError: it cannot be created, is not a directory, or cannot be written.
    """
    directory = Path(directory)
    try:
        directory.mkdir(parents=True, exist_ok=True)
        probe = write_atomically(directory / f".probe-{os.getpid()}", b"")
        probe.unlink()
    except OSError as e:
        raise LlamaError(f"kv_cache_dir={directory} cannot be used: {e.strerror or e}") from None
    return directory


def check_disk_cache(kv_cache: bool, world_size: int) -> None:
    """Refuse a disk cache where it cannot work.

    Raises:
        LlamaError: without a KV cache, or under torchrun.
    """
    if not kv_cache:
        raise LlamaError("kv_cache_dir= keeps the KV cache's blocks on disk, and kv_cache=False keeps none; "
                         "leave one of them out")
    if world_size > 1:
        raise LlamaError(f"kv_cache_dir= runs in one process, not under torchrun with {world_size} processes "
                         "(each holds only its slice of the heads)")


class DiskCache:
    """Full KV-cache blocks in files under `directory`, at most `max_bytes` of them.

    Args:
        directory: where the files go; created if need be.
        max_bytes: the most bytes the files may take.
        spec: the model, KV dtype, block size and shapes every file must match.
        log: told one line for each file skipped, and for the first write that fails.

    Raises:
        LlamaError: the directory cannot be used, or `max_bytes` holds no block.
    """

    def __init__(self, directory: Path, max_bytes: int, spec: BlockSpec,
                 log: Callable[[str], None] = lambda line: None):
        self.directory, self.spec, self.log = prepare_directory(directory), spec, log
        self.file_bytes = spec.payload_bytes + 1024 + 20 * spec.block_size  # the header: digests and ids
        if max_bytes < self.file_bytes:
            raise LlamaError(f"kv_cache_dir_size={max_bytes} holds no block: one takes about {self.file_bytes:,} "
                             "bytes with this model and block size")
        self.max_bytes = max_bytes
        # Counters for /metrics.
        self.blocks_written = self.blocks_loaded = self.misses = self.blocks_rejected = 0
        self.blocks_evicted = self.write_failures = 0
        self._lock = threading.Condition()
        self.bytes = self._scan()[1]
        self._written_since_scan = 0
        self._queue: Deque[Tuple[str, str, Tuple[int, ...], torch.Tensor]] = deque()
        self._pending: Dict[str, int] = {}  # keys queued or being written, and their payload bytes
        self._closed = False
        self._thread = threading.Thread(target=self._write_loop, name="llama-server-disk-cache", daemon=True)
        self._thread.start()

    def path(self, key: str) -> Path:
        return self.directory / (key + SUFFIX)

    def keys(self, tokens: Sequence[int], known: List[str], n_blocks: int) -> List[str]:
        """The chain keys of the first `n_blocks` full blocks of `tokens` (`known`: those computed before)."""
        return self.spec.chain_keys(tokens, n_blocks, known)

    # In the engine's thread.

    def load(self, tokens: Sequence[int], known: List[str], first: int, last: int) -> List[torch.Tensor]:
        """The keys and values of full blocks first, first + 1, ... (before `last`) of `tokens`, as long as files for
        them are found and pass every check; each (n_layers, 2, n_kv_heads, block_size, width) on the CPU."""
        keys = self.keys(tokens, known, last)
        bs = self.spec.block_size
        out = []
        for i in range(first, last):
            path = self.path(keys[i])
            try:
                kv = read_block_file(path, self.spec, keys[i - 1] if i else "", tokens[i * bs : (i + 1) * bs])
            except FileNotFoundError:
                self.misses += 1
                break
            except (BlockFileError, OSError) as e:
                self._reject(path, e)
                break
            try:
                os.utime(path)  # used: last in line to be evicted
            except OSError:
                pass
            out.append(kv)
        self.blocks_loaded += len(out)
        return out

    def save(self, tokens: Sequence[int], known: List[str], i: int, read: Callable[[], torch.Tensor]) -> None:
        """Keep full block i of `tokens` on disk, unless a file holds it already; `read` copies its keys and values
        out of the paged cache, called at once if the block is to be written."""
        keys = self.keys(tokens, known, i + 1)
        key, bs = keys[i], self.spec.block_size
        with self._lock:
            if self._closed or key in self._pending:
                return
            if sum(self._pending.values()) + self.spec.payload_bytes > _PENDING_BYTES:
                self.write_failures += 1
                return
        if self.path(key).exists():
            return
        kv = read()
        with self._lock:
            self._pending[key] = self.spec.payload_bytes
            self._queue.append((key, keys[i - 1] if i else "", tuple(tokens[i * bs : (i + 1) * bs]), kv))
            self._lock.notify()

    def close(self) -> None:
        """Write what is queued, then stop the writer."""
        with self._lock:
            self._closed = True
            self._lock.notify()
        self._thread.join()

    def stats(self) -> Dict[str, float]:
        """Gauges and counters for /metrics."""
        return {
            "disk_cache_blocks_written_total": self.blocks_written,
            "disk_cache_blocks_loaded_total": self.blocks_loaded,
            "disk_cache_misses_total": self.misses,
            "disk_cache_blocks_rejected_total": self.blocks_rejected,
            "disk_cache_blocks_evicted_total": self.blocks_evicted,
            "disk_cache_write_failures_total": self.write_failures,
            "disk_cache_bytes": self.bytes,
            "disk_cache_bytes_limit": self.max_bytes,
        }

    def _reject(self, path: Path, e: Exception) -> None:
        """A file that failed a check: one line, and it goes, so that the block is computed and written again."""
        reason = e.strerror if isinstance(e, OSError) and e.strerror else str(e)
        self.log(f"llama-server: skipped the KV block file {path}: {reason}; it was not loaded, and is removed")
        self.blocks_rejected += 1
        try:
            size = path.stat().st_size
            path.unlink()
            with self._lock:
                self.bytes = max(0, self.bytes - size)
        except OSError:
            pass

    # In the writer's thread.

    def _write_loop(self) -> None:
        while True:
            with self._lock:
                while not self._queue and not self._closed:
                    self._lock.wait()
                if not self._queue:
                    return
                key, parent, tokens, kv = self._queue.popleft()
            try:
                data = block_file_bytes(self.spec, parent, tokens, kv)
                self._make_room(len(data))
                write_atomically(self.path(key), data)
                with self._lock:
                    self.bytes += len(data)
                    self.blocks_written += 1
            except OSError as e:
                self.write_failures += 1
                if self.write_failures == 1:
                    self.log(f"llama-server: a KV block could not be written to {self.directory}: "
                             f"{e.strerror or e}; the server goes on, and counts such failures in /metrics")
            finally:
                with self._lock:
                    self._pending.pop(key, None)

    def _make_room(self, size: int) -> None:
        """Remove the least recently used files until `size` more bytes fit, leaving room for a tenth more."""
        # Other servers may write and remove files too: they are counted at each scan, so a scan comes at least
        # every tenth of the limit written here.
        if self.bytes + size <= self.max_bytes and self._written_since_scan + size <= self.max_bytes // 10:
            self._written_since_scan += size
            return
        files, total = self._scan()
        self._written_since_scan = 0
        if total + size <= self.max_bytes:
            with self._lock:
                self.bytes = total
            return
        target = max(0, int(self.max_bytes * 0.9) - size)
        for _, size_on_disk, path in files:
            if total <= target:
                break
            try:
                path.unlink()
                self.blocks_evicted += 1
            except FileNotFoundError:
                pass
            total -= size_on_disk
        with self._lock:
            self.bytes = total

    def _scan(self) -> Tuple[List[Tuple[int, int, Path]], int]:
        """The block files, least recently used first, as (mtime_ns, size, path), and their bytes; temporary files
        left by a process that died while writing are removed."""
        files, now = [], time.time()
        with os.scandir(self.directory) as entries:
            for entry in entries:
                try:
                    st = entry.stat()
                    if entry.name.endswith(SUFFIX) and not entry.name.startswith("."):
                        files.append((st.st_mtime_ns, st.st_size, Path(entry.path)))
                    elif entry.name.startswith(".") and entry.name.endswith(".tmp") and \
                            now - st.st_mtime > _STALE_TEMP_SECONDS:
                        os.unlink(entry.path)
                except OSError:
                    pass  # removed meanwhile
        files.sort(key=lambda f: (f[0], f[2].name))
        return files, sum(f[1] for f in files)
