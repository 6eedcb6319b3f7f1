"""llama/pages.py: the buffers the integer kernels stream ask for 2 MiB pages, in private memory of their own."""

import sys

import pytest
import torch

from llama.pages import HUGE_PAGE, huge_empty

linux = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="madvise and /proc/self/smaps are Linux's")


def _mapping(address):
    """The /proc/self/smaps entry (its header line and fields) of the mapping that holds `address`."""
    entry = None
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and ":" not in head:
                start, end = (int(x, 16) for x in head.split("-"))
                entry = {"range": (start, end), "line": line} if start <= address < end else None
            elif entry is not None and ":" in line:
                key, _, value = line.partition(":")
                entry[key] = value.strip()
                if key == "VmFlags":
                    return entry
    raise AssertionError(f"no mapping holds {address:#x}")


@linux
def test_a_big_buffer_is_private_aligned_and_asks_for_2_mib_pages():
    t = huge_empty((3 * HUGE_PAGE // 4 + 5, 2), torch.float16)  # 3 MiB and a bit: not a whole number of huge pages
    t.fill_(1.5)
    assert t.is_contiguous() and t.shape == (3 * HUGE_PAGE // 4 + 5, 2) and t.dtype == torch.float16
    assert t.data_ptr() % HUGE_PAGE == 0
    flags = _mapping(t.data_ptr())["VmFlags"].split()
    # "hg": madvise(MADV_HUGEPAGE). Not "sh": a shared anonymous mapping is shmem, whose huge pages follow another
    # switch, "never" by default (Python's mmap.mmap(-1, n) is shared unless told otherwise).
    assert "hg" in flags and "sh" not in flags, flags
    assert (t == 1.5).all()


def test_a_small_buffer_is_ordinary_memory():
    t = huge_empty((100, 3), torch.float32)
    assert t.shape == (100, 3) and t.untyped_storage().nbytes() == 1200
