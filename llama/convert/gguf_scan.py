"""A bounded check of a GGUF file's structure, before the `gguf` package is let loose on it.

`gguf.GGUFReader` trusts the counts and lengths in the header: a flipped byte can make it loop over
billions of array items or slice far past the end of the file. This scan walks the same header with every
count and length checked against the bytes that remain, so a damaged file is refused in milliseconds.
"""

import mmap
import os
import struct
from pathlib import Path
from typing import List, NamedTuple, Tuple

from llama.errors import LlamaError

_MAGIC = b"GGUF"
# GGUF metadata value types -> their size in bytes (None: a string; 9, an array, is handled apart).
_SCALAR_SIZES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 8: None, 10: 8, 11: 8, 12: 8}
_ARRAY = 9
_MAX_DIMS = 4
_MAX_TENSOR_TYPE = 64  # ggml's type codes are small; anything beyond is damage


class GGUFLayout(NamedTuple):
    """What the scan walked: where the header ends, and each tensor's (name, GGUF dims fastest-first, type code)."""

    header_bytes: int
    tensors: List[Tuple[str, Tuple[int, ...], int]]


class _Cursor:
    def __init__(self, data: memoryview, src: Path):
        self.data, self.pos, self.src = data, 0, src

    def fail(self, what: str) -> LlamaError:
        return LlamaError(f"{self.src} is not a valid GGUF file: {what} at byte {self.pos}; download it again")

    def take(self, fmt: str):
        size = struct.calcsize(fmt)
        if self.pos + size > len(self.data):
            raise self.fail("it ends early")
        value = struct.unpack_from(fmt, self.data, self.pos)
        self.pos += size
        return value[0] if len(value) == 1 else value

    def skip(self, n: int, what: str) -> None:
        if n < 0 or self.pos + n > len(self.data):
            raise self.fail(f"{what} runs past the end of the file")
        self.pos += n

    def string(self, what: str) -> None:
        self.skip(self.take("<Q"), what)

    def text(self, what: str) -> str:
        start = self.pos + 8
        self.string(what)
        return bytes(self.data[start:self.pos]).decode("utf-8", errors="replace")


def _skip_value(cur: _Cursor, vtype: int, depth: int = 0) -> None:
    if vtype == _ARRAY:
        if depth > 1:
            raise cur.fail("arrays nested too deep")
        item_type, count = cur.take("<I"), cur.take("<Q")
        if item_type != _ARRAY and item_type not in _SCALAR_SIZES:
            raise cur.fail(f"unknown array item type {item_type}")
        size = _SCALAR_SIZES.get(item_type)
        min_size = size if size is not None else 8  # a string is at least its 8-byte length
        if count * min_size > len(cur.data) - cur.pos:
            raise cur.fail(f"an array of {count} items longer than the file")
        if size is not None:
            cur.skip(count * size, "an array")
        else:
            for _ in range(count):
                _skip_value(cur, item_type, depth + 1)
    elif vtype == 8:
        cur.string("a string")
    elif vtype in _SCALAR_SIZES:
        cur.skip(_SCALAR_SIZES[vtype], "a value")
    else:
        raise cur.fail(f"unknown value type {vtype}")


def check_gguf_structure(src: Path) -> GGUFLayout:
    """Raise LlamaError unless the header, metadata and tensor table of `src` are well formed and in bounds.

    Returns:
        The header's length in bytes (the tensor data starts at the next alignment boundary) and the tensor
        table, read without touching the data.
    """
    with open(src, "rb") as f:
        if os.fstat(f.fileno()).st_size == 0:
            raise LlamaError(f"{src} is empty, not a GGUF file")
        # Mapped, not read: only the header's pages are touched, however many gigabytes follow.
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mapped:
            view = memoryview(mapped)
            try:
                return _check(view, src)
            finally:
                view.release()  # the map cannot close while a view of it is alive (an exception's frames keep one)


def _check(data: memoryview, src: Path) -> GGUFLayout:
    cur = _Cursor(data, src)
    if bytes(data[:4]) != _MAGIC:
        raise LlamaError(f"{src} is not a GGUF file (it does not start with 'GGUF')")
    cur.pos = 4
    version = cur.take("<I")
    if version not in (2, 3):
        raise cur.fail(f"unsupported GGUF version {version}")
    n_tensors, n_kv = cur.take("<Q"), cur.take("<Q")
    if n_kv * 12 > len(data) or n_tensors * 24 > len(data):
        raise cur.fail(f"{n_kv} metadata entries and {n_tensors} tensors cannot fit in {len(data)} bytes")
    for _ in range(n_kv):
        cur.string("a metadata key")
        _skip_value(cur, cur.take("<I"))
    tensors, data_end = [], 0
    for _ in range(n_tensors):
        name = cur.text("a tensor name")
        n_dims = cur.take("<I")
        if not 0 < n_dims <= _MAX_DIMS:
            raise cur.fail(f"a tensor with {n_dims} dimensions")
        dims = [cur.take("<Q") for _ in range(n_dims)]
        if any(d == 0 or d > 1 << 40 for d in dims):
            raise cur.fail(f"a tensor of shape {dims}")
        tensor_type = cur.take("<I")
        if tensor_type > _MAX_TENSOR_TYPE:
            raise cur.fail("an unknown tensor type")
        offset = cur.take("<Q")
        tensors.append((name, tuple(dims), tensor_type))
        data_end = max(data_end, offset + _tensor_bytes(dims, tensor_type))
    # The data starts at the header's end rounded up to the file's alignment, so this is the least it needs.
    if cur.pos + data_end > len(data):
        raise LlamaError(f"{src} is truncated: its tensors need at least {cur.pos + data_end:,} bytes but the file "
                         f"has {len(data):,}; download it again")
    return GGUFLayout(cur.pos, tensors)


def _tensor_bytes(dims: List[int], tensor_type: int) -> int:
    """The bytes a tensor's data takes (0 for a type the gguf package does not know: the reader decides)."""
    import gguf

    try:
        block_size, type_size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(tensor_type)]
    except (ValueError, KeyError):
        return 0
    numel = 1
    for d in dims:
        numel *= d
    return numel // block_size * type_size
