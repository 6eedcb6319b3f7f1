"""The oneDNN transform of CPU float32 linear layers: same logits, same state_dict, the cache still exact."""

import pytest
import torch
from torch import nn

from conftest import build
from llama import onednn
from llama.onednn import OneDNNLinear, onednn_linear_works, use_onednn_linears

needs_onednn = pytest.mark.skipif(not onednn_linear_works(), reason="this torch has no working oneDNN linear op")


def plain(llama):
    """The same model with F.linear again: what build gave before the transform."""
    for module in llama.model.modules():
        if isinstance(module, nn.Linear):
            module.__class__ = nn.Linear
    return llama


def tokens(n, seed=0):
    return torch.randint(3, 4000, (2, n), generator=torch.Generator().manual_seed(seed))


@needs_onednn
def test_build_swaps_every_linear_layer_and_nothing_else(gqa_ckpt):
    llama = build(gqa_ckpt)
    linears = [m for m in llama.model.modules() if isinstance(m, nn.Linear)]
    assert linears and all(type(m) is OneDNNLinear for m in linears)
    assert type(llama.model.tok_embeddings) is nn.Embedding
    reference = build(gqa_ckpt, dtype="bfloat16")  # other dtypes keep F.linear
    assert all(type(m) is nn.Linear for m in reference.model.modules() if isinstance(m, nn.Linear))


@needs_onednn
def test_logits_and_state_dict_are_unchanged(gqa_ckpt):
    fast, slow = build(gqa_ckpt), plain(build(gqa_ckpt))
    fast_sd, slow_sd = fast.model.state_dict(), slow.model.state_dict()
    assert list(fast_sd) == list(slow_sd) and all(torch.equal(fast_sd[k], slow_sd[k]) for k in fast_sd)
    with torch.inference_mode():
        for n in (1, 7, 40):  # a decode step's single row, a short and a longer prompt
            x = tokens(n, seed=n)
            torch.testing.assert_close(fast.model(x), slow.model(x), rtol=0, atol=1e-5)


@needs_onednn
def test_cache_on_and_off_still_agree(gqa_ckpt):
    llama = build(gqa_ckpt)
    prompts = [[1, 5, 9, 200], [1, 77, 3000]]
    cached, lp_cached = llama.generate(prompts, 20, temperature=0, logprobs=True, kv_cache=True)
    uncached, lp_uncached = llama.generate(prompts, 20, temperature=0, logprobs=True, kv_cache=False)
    assert cached == uncached
    for a, b in zip(lp_cached, lp_uncached):
        torch.testing.assert_close(torch.tensor(a), torch.tensor(b), rtol=0, atol=1e-5)


def test_without_the_op_nothing_changes(gqa_ckpt, monkeypatch):
    monkeypatch.setattr(torch.backends.mkldnn, "is_available", lambda: False)
    onednn.onednn_linear_works.cache_clear()
    try:
        assert not onednn_linear_works()
        llama = build(gqa_ckpt)
        assert use_onednn_linears(llama.model) == 0
        assert all(type(m) is nn.Linear for m in llama.model.modules() if isinstance(m, nn.Linear))
        with torch.inference_mode():
            logits = llama.model(tokens(5))
        assert torch.isfinite(logits).all()
    finally:
        onednn.onednn_linear_works.cache_clear()


def test_a_probe_that_fails_means_no_swap(monkeypatch):
    def broken(*args):
        raise RuntimeError("no oneDNN kernel for this CPU")

    monkeypatch.setattr(torch.ops.mkldnn, "_linear_pointwise", broken, raising=False)
    onednn.onednn_linear_works.cache_clear()
    try:
        assert not onednn_linear_works()
        model = nn.Sequential(nn.Linear(8, 8))
        assert use_onednn_linears(model) == 0 and type(model[0]) is nn.Linear
    finally:
        monkeypatch.undo()
        onednn.onednn_linear_works.cache_clear()
