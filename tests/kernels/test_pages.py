"""llama/runtime/pages.py: the buffers the integer kernels stream ask for 2 MiB pages, in private memory of their own."""

import sys

import pytest
import torch

from llama.kernels.build import missing
from llama.runtime import pages
from llama.runtime.pages import HUGE_PAGE, huge_empty, shared_huge_pages

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


def test_a_small_buffer_is_ordinary_memory(monkeypatch):
    """Under 2 MiB and outside shared_huge_pages: torch's own allocation of exactly its bytes, no mapping of ours.
    (Not its mapping's flags: other code in the process, the compiled steps' runtime among it, may have advised the
    heap around it to use 2 MiB pages, as the suite's order once showed.)"""
    monkeypatch.setattr(pages, "_huge_mapping", lambda nbytes: pytest.fail(f"a buffer of {nbytes} bytes was mapped"))
    t = huge_empty((100, 3), torch.float32)
    assert t.shape == (100, 3) and t.untyped_storage().nbytes() == 1200


@linux
def test_small_buffers_share_a_mapping_with_2_mib_pages_while_asked_to(monkeypatch):
    """A small model's layers are each under 2 MiB: side by side in one mapping, they get 2 MiB pages too; after
    the block, a small buffer is torch's own memory again (asserted by where it lies, not by its mapping's flags,
    which other code in the process may have advised)."""
    with shared_huge_pages():
        a = huge_empty((1000, 3), torch.float32)  # 12,000 bytes: the next starts 64-byte aligned after it
        b = huge_empty((100, 5), torch.int8)
        c = huge_empty((7,), torch.float16)
    a.fill_(2.0), b.fill_(-3), c.fill_(0.5)
    assert b.data_ptr() == a.data_ptr() + 12032 and c.data_ptr() == b.data_ptr() + 512
    assert a.data_ptr() % HUGE_PAGE == 0 and (a == 2).all() and (b == -3).all() and (c == 0.5).all()
    mapping = _mapping(a.data_ptr())
    assert "hg" in mapping["VmFlags"].split() and "sh" not in mapping["VmFlags"].split()
    assert mapping["range"] == _mapping(c.data_ptr())["range"]
    monkeypatch.setattr(pages, "_huge_mapping", lambda nbytes: pytest.fail(f"a buffer of {nbytes} bytes was mapped"))
    after = huge_empty((100, 3), torch.float32)
    start, end = mapping["range"]
    assert not start <= after.data_ptr() < end and after.untyped_storage().nbytes() == 1200


@linux
@pytest.mark.skipif(missing() is not None, reason="needs the CPU kernels' build tools")
def test_a_quantized_models_small_layers_are_on_2_mib_pages(gqa_ckpt):
    from helpers import build
    from llama.quant.dot_linears import DotLinear

    llama = build(gqa_ckpt, quantize="int8")
    layers = [m for m in llama.model.modules() if isinstance(m, DotLinear)]
    assert layers and all(m.weight.nbytes < HUGE_PAGE for m in layers)
    for layer in layers:
        assert "hg" in _mapping(layer.weight.data_ptr())["VmFlags"].split()
