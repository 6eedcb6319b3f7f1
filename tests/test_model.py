"""The model's shape and parts: parameter counts, rotary layout, the cache object, agreement with a reference."""

import pytest
import torch

from helpers import tiny_args
from llama.io.checkpoint import model_args
from llama.io.random_weights import PRESETS, random_state_dict
from llama.kv_cache import KVCache
from llama.model import Transformer, apply_rotary_emb, rope_cis
from llama.nn.row_attention import RowExactRotary
from reference import reference_logits


@pytest.mark.parametrize(
    "size, n_params, hidden",
    [("7B", 6_738_415_616, 11008), ("13B", 13_015_864_320, 13824), ("70B", 68_976_648_192, 28672)],
)
def test_meta_sizes_have_exact_parameter_counts(size, n_params, hidden):
    args = model_args(PRESETS[size], max_seq_len=4096, max_batch_size=1, tokenizer_vocab=32000)
    with torch.device("meta"):
        model = Transformer(args)
    assert all(p.is_meta for p in model.parameters())
    assert sum(p.numel() for p in model.parameters()) == n_params
    assert model.layers[0].feed_forward.w1.weight.shape == (hidden, args.dim)
    assert args.head_dim == 128


def test_70b_attention_is_grouped_with_8_kv_heads():
    args = model_args(PRESETS["70B"], max_seq_len=4096, max_batch_size=1, tokenizer_vocab=32000)
    with torch.device("meta"):
        model = Transformer(args)
    assert model.layers[0].attention.wk.weight.shape == (8 * 128, 8192)
    assert model.layers[0].attention.wq.weight.shape == (64 * 128, 8192)


def test_hidden_dim_overrides_metas_rule():
    assert tiny_args(hidden_dim=200).ffn_hidden_dim == 200
    assert tiny_args().ffn_hidden_dim == 192  # 2/3 * 256 = 170, rounded up to a multiple of 32


def test_rotary_rotates_adjacent_pairs_by_position_times_frequency():
    """Meta's interleaved layout, written out in real arithmetic: pair i of a head at position p turns by
    p * theta^(-2i / head_dim)."""
    torch.manual_seed(0)
    x = torch.randn(2, 5, 3, 16)
    start_pos, theta = 7, 10000.0
    ours = apply_rotary_emb(x, rope_cis(16, theta, torch.arange(start_pos, start_pos + 5)))
    pos = torch.arange(start_pos, start_pos + 5).float()[None, :, None, None]
    freqs = theta ** (-torch.arange(0, 16, 2).float() / 16)
    angle = pos * freqs  # (1, 5, 1, 8)
    even, odd = x[..., 0::2], x[..., 1::2]
    expected = torch.stack((even * angle.cos() - odd * angle.sin(), even * angle.sin() + odd * angle.cos()), -1).flatten(-2)
    torch.testing.assert_close(ours, expected, rtol=0, atol=1e-5)


def test_rotary_scores_depend_only_on_relative_position():
    torch.manual_seed(0)
    q, k = torch.randn(1, 1, 1, 32), torch.randn(1, 1, 1, 32)

    def score(m, n):
        return (apply_rotary_emb(q, rope_cis(32, 10000.0, torch.tensor([m]))) *
                apply_rotary_emb(k, rope_cis(32, 10000.0, torch.tensor([n])))).sum()

    torch.testing.assert_close(score(5, 2), score(105, 102), rtol=0, atol=1e-4)
    assert not torch.allclose(score(5, 2), score(5, 3), atol=1e-3)


@pytest.mark.parametrize("heads", [1, 2, 3])
@pytest.mark.parametrize("head_dim", [8, 64])
def test_the_row_exact_rotary_rotates_a_position_alone_bit_for_bit_as_among_others(heads, head_dim):
    """A cached step rotates one position; an uncached pass rotates it among all. The integer kernels round
    activations to 8 bits, which turns a last-bit difference here into different text, so models on them
    rotate with RowExactRotary (torch's complex multiply, the float paths' rotary, differed for one head of 8
    dimensions: a rank's share of the tiny model under torchrun). It rotates as the complex product does."""
    x = torch.randn(3, 12, heads, head_dim, generator=torch.Generator().manual_seed(heads))
    freqs = rope_cis(head_dim, 10000.0, torch.arange(12))
    together = RowExactRotary()(x, freqs)
    torch.testing.assert_close(together, apply_rotary_emb(x, freqs), rtol=0, atol=1e-6)
    for p in range(12):
        assert torch.equal(RowExactRotary()(x[:, p:p + 1].contiguous(), freqs[p:p + 1]), together[:, p:p + 1]), p


def test_kv_cache_is_sized_by_kv_heads_and_refuses_to_overflow():
    model = Transformer(tiny_args("gqa"))
    caches = model.new_kv_cache(batch_size=3, max_seq_len=10)
    assert len(caches) == 2
    assert caches[0].cache_k.shape == (3, 2, 10, 8)  # 2 KV heads, not 8 query heads
    assert caches[0].nbytes == 2 * 3 * 2 * 10 * 8 * 4
    keys, values = caches[0].update_at(torch.arange(4)[None], torch.ones(3, 2, 4, 8), torch.ones(3, 2, 4, 8))
    assert keys.shape == (3, 2, 10, 8) and keys[0, 0, 3, 0] == 1 and keys[0, 0, 4, 0] == 0
    keys, _ = caches[0].update_at(torch.arange(4, 10)[None], torch.full((3, 2, 6, 8), 2.0), torch.ones(3, 2, 6, 8))
    assert keys[0, 0, 3, 0] == 1 and keys[0, 0, 4, 0] == 2 and keys[2, 1, 9, 7] == 2
    with pytest.raises(ValueError, match="overflow"):
        caches[0].update_at(torch.tensor([[10]]), torch.ones(3, 2, 1, 8), torch.ones(3, 2, 1, 8))
    with pytest.raises(ValueError, match="overflow"):
        caches[0].update_at(torch.arange(8, 11)[None], torch.ones(3, 2, 3, 8), torch.ones(3, 2, 3, 8))


def test_kv_cache_reset_clears_it():
    cache = KVCache(1, 4, 1, 2, torch.float32, torch.device("cpu"))
    cache.update_at(torch.arange(4)[None], torch.ones(1, 1, 4, 2), torch.ones(1, 1, 4, 2))
    cache.reset()
    assert cache.cache_k.abs().sum() == 0 and cache.cache_v.abs().sum() == 0


def test_uncached_forward_refuses_a_nonzero_start_pos():
    model = Transformer(tiny_args())
    with pytest.raises(ValueError, match="position 0"):
        model(torch.zeros(1, 3, dtype=torch.long), start_pos=3)


@pytest.mark.parametrize("kind", ["mha", "gqa", "mqa"])
def test_model_matches_an_independent_reference(kind):
    args = tiny_args(kind)
    sd = random_state_dict(args, seed=1, std=0.1)
    model = Transformer(args)
    model.load_state_dict(sd)
    tokens = torch.randint(0, args.vocab_size, (2, 20), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        ours = model(tokens)
    ref = reference_logits(sd, args, tokens).float()
    # float32 against float64 on logits of magnitude ~4: measured within 3e-6. 2e-5 leaves room for other
    # CPUs' orders of additions; a wrong rotary layout, mask or head grouping gives differences of order 1.
    torch.testing.assert_close(ours, ref, rtol=0, atol=2e-5)
