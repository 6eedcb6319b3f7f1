"""llama_kv.rotary (llama/kernels/csrc/rotary.cpp): the rotary embedding in one pass.

What it promises: the bits of llama/model.py's `rotate_written_out`, the form a compiled step fuses into its own
code, for every layout a layer hands it (the queries and keys are views of one projection's output), for one
table of rotations shared by the batch or one per row; so an eager prompt and a compiled decode step rotate a
position alike.
"""

import pytest
import torch

from llama import kernels
from llama.kernels.build import missing
from llama.model import rope_cis, rotate_written_out
from llama.nn.row_attention import RowExactRotary

if missing():
    pytest.skip(f"the kernels cannot be built here: {missing()}", allow_module_level=True)


@pytest.fixture(scope="module", autouse=True)
def _loaded():
    assert kernels.load(), kernels.unavailable_reason()


@pytest.mark.parametrize("batch, positions, heads, head_dim", [(1, 512, 9, 64), (3, 7, 2, 8), (2, 1, 3, 6)])
def test_rotary_gives_the_bits_of_the_written_out_rotation(batch, positions, heads, head_dim):
    gen = torch.Generator().manual_seed(positions)
    # The layer's layout: queries and keys side by side in one projection's rows, so x is a strided view.
    fused = torch.randn(batch, positions, heads + 2, head_dim, generator=gen) * 10
    x = fused[:, :, 1:1 + heads]
    freqs = rope_cis(head_dim, 500000.0, torch.arange(40, 40 + positions))
    out = torch.ops.llama_kv.rotary(x, torch.view_as_real(freqs))
    assert out.is_contiguous() and out.shape == x.shape
    assert torch.equal(out, rotate_written_out(x, freqs))
    # Positions of their own for each row, as a batch of sequences at different lengths has.
    per_row = rope_cis(head_dim, 10000.0, torch.randint(0, 4096, (batch, positions), generator=gen))
    assert torch.equal(torch.ops.llama_kv.rotary(x, torch.view_as_real(per_row)), rotate_written_out(x, per_row))


def test_the_row_exact_rotary_takes_the_op_and_keeps_the_written_out_form_where_it_cannot():
    x = torch.randn(2, 5, 3, 16, generator=torch.Generator().manual_seed(0))
    freqs = rope_cis(16, 10000.0, torch.arange(5))
    want = rotate_written_out(x, freqs)
    assert torch.equal(RowExactRotary()(x, freqs), want)
    assert torch.equal(RowExactRotary()(x.double(), freqs), rotate_written_out(x.double(), freqs))
    # A table for one position broadcast over five: not the op's shape, so the written-out form broadcasts it.
    assert torch.equal(RowExactRotary()(x, freqs[:1]), rotate_written_out(x, freqs[:1]))


def test_rotary_refuses_what_it_cannot_rotate():
    x = torch.randn(1, 4, 2, 8)
    pairs = torch.view_as_real(rope_cis(8, 10000.0, torch.arange(4)))
    with pytest.raises(RuntimeError, match="pairs must be"):
        torch.ops.llama_kv.rotary(x, pairs[:3])
    with pytest.raises(RuntimeError, match="float32"):
        torch.ops.llama_kv.rotary(x.double(), pairs)
    with pytest.raises(RuntimeError, match="head_dim even and contiguous"):
        torch.ops.llama_kv.rotary(x.transpose(2, 3), pairs)
