"""llama/quant/fuse.py: projections of the same input made one product on the integer kernels, with the same bits."""

import pytest
import torch

from helpers import build
from llama.quant import fuse as fuse_module
from llama import kernels
from llama.quant.fuse import FusedAttention, FusedFeedForward
from llama.quant.dot_linears import Int4DotLinear, Int8DotLinear, Int8Group16DotLinear
from llama.kernels.build import missing
from llama.model import Attention, FeedForward
from llama.quant.quantize import quantize_model

pytestmark = pytest.mark.skipif(missing() is not None, reason="needs the CPU kernels' build tools")

# (method, group size, the class the projections become)
CASES = [("int8", None, Int8DotLinear), ("int4", 32, Int4DotLinear), ("int8", 16, Int8Group16DotLinear)]


def _models(ckpt, monkeypatch, method, group_size):
    """The same quantized weights twice: fused (the default), and with fusing turned off."""
    def quantized():
        llama = build(ckpt)
        quantize_model(llama.model, method, group_size=group_size)
        return llama

    fused = quantized()
    with monkeypatch.context() as m:
        m.setattr(fuse_module, "fuse", lambda *args: False)
        apart = quantized()
    return fused, apart


@pytest.mark.parametrize("method, group_size, cls", CASES)
def test_fused_projections_give_the_same_bits_and_the_same_state(gqa_ckpt, monkeypatch, method, group_size, cls):
    assert kernels.load()
    fused, apart = _models(gqa_ckpt, monkeypatch, method, group_size)
    block = fused.model.layers[0]
    assert type(block.attention) is FusedAttention and type(block.feed_forward) is FusedFeedForward
    assert type(block.attention.wqkv) is cls and type(block.feed_forward.w13) is cls
    assert not hasattr(block.attention, "wq") and not hasattr(block.feed_forward, "w1")
    plain = apart.model.layers[0]
    assert type(plain.attention) is Attention and type(plain.feed_forward) is FeedForward
    assert type(plain.attention.wq) is cls
    args = fused.model.params
    assert block.attention.sizes == (args.n_heads * args.head_dim,) + (args.n_kv_heads * args.head_dim,) * 2

    # state_dict() is as if never fused: the same names, the same on-disk tensors.
    state, want = fused.model.state_dict(), apart.model.state_dict()
    assert state.keys() == want.keys()
    for name, tensor in want.items():
        assert torch.equal(state[name], tensor), name

    # Every logit the same, bit for bit, in an uncached pass and in cached steps.
    tokens = torch.randint(3, args.vocab_size, (2, 9), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        assert torch.equal(fused.model(tokens, 0), apart.model(tokens, 0))
        caches = [m.model.new_kv_cache(2, 16) for m in (fused, apart)]
        for i in range(9):
            got, expected = (m.model(tokens[:, i:i + 1], i, c) for m, c in zip((fused, apart), caches))
            assert torch.equal(got, expected), i


def test_projections_whose_rows_split_no_group_stay_apart(tmp_path):
    """A feed-forward width of 200 is 12.5 units of 16 int4 rows: w1's rows cannot be followed by w3's in one
    layer, so the two stay as they are (attention, whose widths divide, is fused)."""
    from helpers import write_tiny

    ckpt, _ = write_tiny(tmp_path / "wide", hidden_dim=200)
    llama = build(ckpt, quantize="int4")
    block = llama.model.layers[0]
    assert type(block.attention) is FusedAttention
    assert type(block.feed_forward) is FeedForward and type(block.feed_forward.w1) is Int4DotLinear


def test_the_exact_paths_are_not_fused(gqa_ckpt):
    llama = build(gqa_ckpt, quantize="int8", quant_kernels="exact")
    assert not any(isinstance(m, (FusedAttention, FusedFeedForward)) for m in llama.model.modules())
    assert not any(isinstance(m, (FusedAttention, FusedFeedForward)) for m in build(gqa_ckpt).model.modules())
