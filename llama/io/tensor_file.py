"""torch.save files written one tensor at a time, so a big checkpoint never sits in memory whole.

torch.save needs every tensor of a file at once. Under `torch.serialization.skip_data` it writes the file's
structure with room for each tensor's bytes but not the bytes themselves, and without reading the tensors,
so placeholders from `torch.empty` (whose pages are never touched) cost no memory. `TensorFileWriter` then
maps the file and copies each tensor into its place, handing the pages back to the kernel once they are
on their way to disk. The result is an ordinary torch.save file: `torch.load(weights_only=True)` reads it,
memory-mapped or not.
"""

import mmap
import os
import struct
import zipfile
from pathlib import Path
from typing import Dict, Tuple

import torch

TensorSpec = Tuple[torch.Size, torch.dtype]


class TensorFileWriter:
    """A torch.save file of the tensors in `specs` (name -> (shape, dtype)), filled in with `write`.

    Every tensor must be written before it closes (`check_complete`), or the file holds zeros there. A
    failed write leaves a partial file: callers write inside a temporary directory.
    """

    def __init__(self, path: Path, specs: Dict[str, TensorSpec]):
        self.path = Path(path)
        self.specs = {name: (torch.Size(shape), dtype) for name, (shape, dtype) in specs.items()}
        # torch.empty reserves address space only: no page of these is ever touched.
        placeholders = {name: torch.empty(shape, dtype=dtype) for name, (shape, dtype) in self.specs.items()}
        with torch.serialization.skip_data():
            torch.save(placeholders, self.path)
        del placeholders
        self._offsets = _data_offsets(self.path, self.specs)
        self._file = open(self.path, "r+b")
        self._map = mmap.mmap(self._file.fileno(), 0) if os.path.getsize(self.path) else None
        self._written = set()

    def write(self, name: str, value: torch.Tensor) -> None:
        """Copy `value` (of the shape and dtype in specs) into the file as tensor `name`."""
        shape, dtype = self.specs[name]
        if value.shape != shape or value.dtype != dtype:
            raise ValueError(f"{name}: expected {tuple(shape)} {dtype}, got {tuple(value.shape)} {value.dtype}")
        nbytes = value.numel() * value.element_size()
        if nbytes:
            offset = self._offsets[name]
            target = torch.frombuffer(self._map, dtype=torch.uint8, count=nbytes, offset=offset)
            target.view(dtype).view(shape).copy_(value)
            del target  # the buffer export must end before the map can be closed
            self._release(offset, nbytes)
        self._written.add(name)

    def _release(self, offset: int, nbytes: int) -> None:
        # Start the pages' way to disk and drop them from this process: the resident size stays one tensor.
        start = offset - offset % mmap.PAGESIZE
        length = offset + nbytes - start
        self._map.flush(start, length)
        if hasattr(self._map, "madvise"):
            self._map.madvise(mmap.MADV_DONTNEED, start, length)

    def close(self) -> None:
        if self._map is not None:
            self._map.flush()
            self._map.close()
            self._map = None
        self._file.close()

    def __enter__(self) -> "TensorFileWriter":
        return self

    def check_complete(self) -> None:
        """Assert that every tensor was written (a file with holes would load as zeros there)."""
        missing = [name for name in self.specs if name not in self._written]
        assert not missing, f"{self.path}: tensor {missing[0]} was never written"

    def __exit__(self, exc_type, exc, tb) -> None:
        self.close()
        if exc_type is None:
            self.check_complete()


def _data_offsets(path: Path, specs: Dict[str, TensorSpec]) -> Dict[str, int]:
    """Where in the file each tensor's bytes go.

    torch.load with mmap=True maps the whole file once, so a tensor's address minus its record's offset in
    the zip archive is the same for every tensor; the archive gives the records' offsets.
    """
    records = {}
    with open(path, "rb") as f, zipfile.ZipFile(f) as archive:
        for info in archive.infolist():
            if "/data/" in info.filename and info.file_size:
                f.seek(info.header_offset + 26)
                name_len, extra_len = struct.unpack("<HH", f.read(4))
                records[info.header_offset + 30 + name_len + extra_len] = info.file_size
    mapped = torch.load(path, mmap=True, weights_only=True, map_location="cpu")
    addresses = {name: t.untyped_storage().data_ptr() for name, t in mapped.items() if t.numel()}
    del mapped
    if not addresses:
        return {}
    base = min(addresses.values()) - min(records)
    offsets = {name: address - base for name, address in addresses.items()}
    for name, offset in offsets.items():
        shape, dtype = specs[name]
        nbytes = shape.numel() * torch.empty(0, dtype=dtype).element_size()
        assert records.get(offset) == nbytes, f"{name}: no record of {nbytes} bytes at offset {offset}"
    return offsets
