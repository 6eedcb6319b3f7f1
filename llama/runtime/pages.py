"""Memory pages: handing a memory-mapped file's pages back, and asking for 2 MiB pages for what a kernel streams.

Linux only; elsewhere (or where libc cannot be reached) each call is a no-op or a plain allocation.

`huge_empty` is for the re-packed weights the CPU kernels read once per token (llama/quant/dot_linears.py): with
4 KiB pages, streaming a layer of megabytes walks the TLB through hundreds of entries, and a big layer reads
measurably faster from 2 MiB pages (docs/benchmarks.md, "Figures behind the code"). Transparent huge pages are often enabled only where asked for ("madvise", Debian's
and Ubuntu's default), so the buffer asks with madvise(MADV_HUGEPAGE) before its pages are first touched.
Layers under 2 MiB (all of a small model's) get them by sharing mappings, while loading asks for it
(`shared_huge_pages`).
"""

import ctypes
import mmap
import sys
from contextlib import contextmanager
from typing import Iterator, Optional, Sequence

import torch

_PAGE = mmap.PAGESIZE
HUGE_PAGE = 1 << 21
_MADV_DONTNEED = 4
_MADV_HUGEPAGE = 14
_libc = None
if sys.platform.startswith("linux"):
    try:
        _libc = ctypes.CDLL(None, use_errno=True)
        _libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    except (OSError, AttributeError):
        _libc = None


def return_free_memory() -> None:
    """Hand the scratch that loading freed back to the system (glibc keeps freed heap memory otherwise)."""
    if _libc is not None and hasattr(_libc, "malloc_trim"):
        _libc.malloc_trim(0)


def release_pages(tensor: torch.Tensor) -> None:
    """Drop a memory-mapped file tensor's pages from this process's resident memory (Linux; elsewhere a no-op).

    Only for tensors that torch.load(mmap=True) returned: their pages are clean and read back from the file
    if touched again. Never call it on ordinary (anonymous) memory, whose contents it would erase.
    """
    if _libc is None or tensor.device.type != "cpu" or tensor.numel() == 0:
        return
    storage = tensor.untyped_storage()
    start, end = storage.data_ptr(), storage.data_ptr() + storage.nbytes()
    start -= start % _PAGE
    end += -end % _PAGE
    _libc.madvise(ctypes.c_void_p(start), ctypes.c_size_t(end - start), _MADV_DONTNEED)


def _huge_mapping(nbytes: int) -> torch.Tensor:
    """`nbytes` of uint8 in a private memory mapping of their own, starting on a 2 MiB boundary, that has asked
    for 2 MiB pages (the tail past the last whole one keeps 4 KiB pages). Freed with the last tensor on it."""
    # Private: a shared anonymous mapping is shmem, whose huge pages follow another switch ("never" by default).
    mapping = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    whole = torch.frombuffer(mapping, dtype=torch.uint8)
    offset = -whole.data_ptr() % HUGE_PAGE
    _libc.madvise(ctypes.c_void_p(whole.data_ptr() + offset), ctypes.c_size_t(nbytes - nbytes % HUGE_PAGE),
                  _MADV_HUGEPAGE)
    return whole[offset:offset + nbytes]


class _Arena:
    """Buffers under 2 MiB side by side, 64-byte aligned, in mappings of `CHUNK` bytes with 2 MiB pages. A chunk
    lives as long as a buffer on it; a buffer's bytes are not reused when it goes (they are meant to stay)."""

    CHUNK = 32 << 20

    def __init__(self):
        self.chunk, self.used = None, 0

    def take(self, nbytes: int) -> torch.Tensor:
        if self.chunk is None or self.used + nbytes > self.chunk.numel():
            self.chunk, self.used = _huge_mapping(self.CHUNK), 0
        piece = self.chunk[self.used:self.used + nbytes]
        self.used += -(-nbytes // 64) * 64
        return piece


_arena: Optional[_Arena] = None


@contextmanager
def shared_huge_pages() -> Iterator[None]:
    """Within it, `huge_empty` places buffers under 2 MiB side by side in shared mappings with 2 MiB pages, rather
    than in ordinary memory: a small model's layers are all under 2 MiB (the default model's largest, int8, is
    0.9 MB), and read from 4 KiB pages they decoded 10% slower (docs/benchmarks.md). For buffers that stay as
    long as the model, as re-packed weights do."""
    global _arena
    outer, _arena = _arena, (_Arena() if _libc is not None else None)
    try:
        yield
    finally:
        _arena = outer


def huge_empty(shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised contiguous CPU tensor in memory that has asked the kernel for 2 MiB pages, which it gets
    where transparent huge pages are not "never" and memory allows. From 2 MiB on, in a private mapping of its own
    that starts on a 2 MiB boundary: not glibc's heap, so the loader's scratch freed between two such buffers is
    handed back rather than left as holes that raise the peak (the mapping is up to 2 MiB longer than the tensor;
    pages never touched take no memory). Under 2 MiB, beside others in a shared mapping within
    `shared_huge_pages()`, else an ordinary `torch.empty`; without libc, always that."""
    nbytes = torch.Size(shape).numel() * dtype.itemsize
    if _libc is None or (nbytes < HUGE_PAGE and _arena is None):
        return torch.empty(shape, dtype=dtype)
    memory = _arena.take(nbytes) if nbytes < HUGE_PAGE else _huge_mapping(nbytes)
    return memory.view(dtype).view(shape)
