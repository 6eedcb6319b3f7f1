"""The row-exact attention op (llama/kernels/csrc/attention.cpp): blocked, online softmax, several rows at once.

What it promises: softmax(q k^T / sqrt(d) + mask) v within float32 rounding; and a row's bits do not depend on the
rows computed with it, on the keys its mask hides, on the number of threads, or on the instruction path. So a
cached step (one position's rows against the keys up to it) gives the bits of the same position in an uncached
pass, at any prompt length: checked here at 2,048 positions and more, where a row meets 32 key blocks and the
rows are taken 8 at a time.
"""

import pytest
import torch
import torch.nn.functional as F

from helpers import build
from llama import kernels
from llama.kernels.build import missing
from llama.kv_cache import load_kv, store_kv

if missing():
    pytest.skip(f"the integer kernels cannot be built here: {missing()}", allow_module_level=True)

BLOCK = 64  # the op's key block (kKeyBlock)


@pytest.fixture(scope="module", autouse=True)
def _loaded():
    assert kernels.load(), kernels.unavailable_reason()


def attention(q, k, v, mask):
    return torch.ops.llama_kv.attention(q, k, v, mask)


def op_paths():
    """The op's own paths among those this CPU runs: the scalar loop, AVX2 (which the VNNI paths below AVX-512 take
    too) and AVX-512 (AVX-512 VNNI's too)."""
    return [path for path in kernels.cpu_paths() if path in ("scalar", "avx2", "avx512")]


def causal(n_rows: int, n_keys: int, dtype=torch.float32) -> torch.Tensor:
    """(n_rows, n_keys) additive mask of the last n_rows positions of n_keys."""
    pos = torch.arange(n_keys - n_rows, n_keys)
    return torch.zeros(n_rows, n_keys).masked_fill(torch.arange(n_keys)[None, :] > pos[:, None], float("-inf")).to(dtype)


def qkv(b, h, n_rows, n_keys, d, dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(b, h, n_rows, d, generator=gen)
    k, v = (torch.randn(b, h, n_keys, d, generator=gen) for _ in range(2))
    return q.to(dtype), k.to(dtype), v.to(dtype)


def reference(q, k, v, mask):
    """float64 attention of the same (rounded) inputs."""
    return F.scaled_dot_product_attention(q.double(), k.double(), v.double(),
                                          attn_mask=None if mask is None else mask.double())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n, d", [(1, 64), (63, 64), (64, 64), (200, 64), (257, 48), (130, 21), (70, 8)])
def test_attention_is_float64_attention_within_rounding(dtype, n, d):
    """Key counts on, off and across block edges; head sizes of whole vectors, 16-wide chunks, and a tail."""
    q, k, v = qkv(2, 3, n, n, d, dtype)
    mask = causal(n, n, dtype)
    want = reference(q, k, v, mask)
    got = attention(q, k, v, mask)
    assert got.dtype == dtype and got.shape == q.shape
    # float32: a few units of rounding of values of size ~1; bf16: the output's own rounding (8 bits)
    tolerance = 2e-6 if dtype == torch.float32 else 2.0 ** -8 * want.abs().max().item()
    torch.testing.assert_close(got.double(), want, rtol=0, atol=tolerance)


def test_a_mask_per_row_with_holes_and_values():
    """A (B, 1, Nq, Nk) mask with finite values and -inf holes anywhere (not only causal), and a row whose keys
    are all in one block: the same as float64 attention, each row as computed alone, the same bits on every path."""
    b, h, n, d = 2, 2, 150, 32
    q, k, v = qkv(b, h, n, n, d, seed=1)
    gen = torch.Generator().manual_seed(2)
    mask = torch.randn(b, 1, n, n, generator=gen)
    mask = mask.masked_fill(torch.rand(b, 1, n, n, generator=gen) < 0.5, float("-inf"))
    mask[:, :, :, 0] = 0.0  # every row sees a key
    mask[0, 0, 7] = float("-inf")
    mask[0, 0, 7, 100] = 1.5  # row 7 of batch 0 sees key 100 alone
    got = attention(q, k, v, mask)
    torch.testing.assert_close(got.double(), reference(q, k, v, mask), rtol=0, atol=2e-6)
    for i in (0, 7, 64, n - 1):
        alone = attention(q[:, :, i:i + 1], k, v, mask[:, :, i:i + 1])
        assert torch.equal(alone, got[:, :, i:i + 1])
    for path in op_paths():
        with kernels.options(path=path):
            assert torch.equal(attention(q, k, v, mask), got), path


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_row_alone_gives_the_bits_it_gives_among_all_at_2048_positions(dtype):
    """The decode step's shapes (one position's query rows, the keys up to it, no mask or a cache longer than
    what the mask lets it see) against the prompt's (all rows, causal): the same bits, for rows at the first key
    block, on block edges and at the end, and among a few rows taken together in any grouping."""
    n, d = 2048, 64
    q, k, v = qkv(1, 2, n, n, d, dtype, seed=3)
    full = attention(q, k, v, causal(n, n, dtype))
    longer_k, longer_v = (torch.cat([x, torch.randn_like(x[:, :, :100].float()).to(dtype)], dim=2) for x in (k, v))
    for i in (0, 1, BLOCK - 1, BLOCK, 1000, n - 2, n - 1):
        alone = attention(q[:, :, i:i + 1], k[:, :, :i + 1], v[:, :, :i + 1], None)
        assert torch.equal(alone, full[:, :, i:i + 1]), i
        # a cache's buffer past what the row sees: hidden keys (random here) change nothing
        seen = torch.zeros(1, n + 100, dtype=dtype)
        seen[:, i + 1:] = float("-inf")
        assert torch.equal(attention(q[:, :, i:i + 1], longer_k, longer_v, seen), full[:, :, i:i + 1]), i
    # Three rows together (a tile that straddles a block edge) against the same keys.
    rows = slice(BLOCK - 2, BLOCK + 1)
    assert torch.equal(attention(q[:, :, rows], k, v, causal(n, n, dtype)[rows]), full[:, :, rows])


def test_the_thread_count_changes_no_bit_at_2048_positions():
    q, k, v = qkv(1, 3, 3 * 2048, 2048, 64, seed=4)
    mask = causal(2048, 2048).repeat(3, 1)  # the model's grouped-query fold: 3 query heads' rows per key head
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = attention(q, k, v, mask)
        torch.set_num_threads(2)
        two = attention(q, k, v, mask)
        torch.set_num_threads(3)  # more threads than cores: other tiles, other splits
        three = attention(q[:, :, :700], k, v, mask[:700])
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, two)
    assert torch.equal(three, one[:, :, :700])


@pytest.mark.parametrize("kv", ["float32", "int8"])
def test_a_decode_step_shared_among_threads_gives_the_bits_of_a_head_among_many(kv):
    """A decode step's few rows over a long cache (here 3 query rows of 1-2 key heads over 3,000 keys, 12 parts of
    256) are split among the threads by parts of the keys, each part's softmax state merged in key order; with many
    heads a thread takes whole heads instead. Both, at 1, 2 and 3 threads: the same bits, and float64 attention
    within rounding, with the mask hiding the cache's last 77 columns."""
    n, d = 3000, 64
    q, k, v = qkv(1, 8, 3, n, d, seed=7)
    if kv == "int8":
        k, v = store_kv(k, torch.int8), store_kv(v, torch.int8)
    mask = torch.zeros(1, 1, 3, n)
    mask[..., n - 77:] = float("-inf")
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        many = attention(q, k, v, mask)  # 8 heads: whole heads a thread
        for t in (1, 2, 3):
            torch.set_num_threads(t)
            for heads in (slice(0, 1), slice(5, 7)):  # 1 or 2 heads: parts spread over the threads
                assert torch.equal(attention(q[:, heads], k[:, heads], v[:, heads], mask), many[:, heads]), (t, heads)
    finally:
        torch.set_num_threads(threads)
    if kv == "int8":
        k, v = load_kv(k, d, torch.float32), load_kv(v, d, torch.float32)
    torch.testing.assert_close(many.double(), reference(q, k, v, mask), rtol=0, atol=2e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("d", [64, 24, 21])
def test_the_scalar_loop_gives_the_bits_of_every_other_path(dtype, d):
    """The plain loop is the reference; the AVX2 and AVX-512 paths (rows in tiles, products in registers) equal
    it, in whole vectors of 64, 16 and 8 values and with a tail of D."""
    n = 300
    q, k, v = qkv(2, 3, n, n, d, dtype, seed=5)
    mask = causal(n, n, dtype)
    with kernels.options(path="scalar"):
        plain = attention(q, k, v, mask)
    for path in kernels.cpu_paths():
        with kernels.options(path=path):
            assert torch.equal(attention(q, k, v, mask), plain), path


@pytest.mark.slow
@pytest.mark.parametrize("method", ["int8", "int4"])
def test_cached_steps_give_the_bits_of_an_uncached_pass_at_2100_positions(gqa_ckpt, method):
    """A tiny grouped-query model on the integer kernels: a prompt of 2,080 tokens in one cached pass then 20
    cached steps, against one uncached pass over all 2,100, the same logits bit for bit."""
    n, prompt = 2100, 2080
    llama = build(gqa_ckpt, quantize=method, max_seq_len=n, max_batch_size=1)
    assert llama.info.quant_kernels == "integer"
    tokens = torch.randint(0, llama.model.vocab_size, (1, n), generator=torch.Generator().manual_seed(6))
    with torch.inference_mode():
        full = llama.model(tokens)
        cache = llama.model.new_kv_cache(1, n)
        steps = [llama.model(tokens[:, :prompt], 0, cache)]
        steps += [llama.model(tokens[:, i:i + 1], i, cache) for i in range(prompt, n)]
    assert torch.equal(torch.cat(steps, dim=1), full)


def test_attention_over_int8_rows_is_attention_over_them_dequantized():
    """`llama_kv.attention` given an int8 cache's rows dequantizes each key and value as it reads them: the same bits
    as dequantizing the whole cache first (`load_kv`) and attending over that, on every instruction path, for heads
    of one block (8, 16) and of several (64, 128), a decode step's few rows and a prompt's many."""
    random = torch.Generator().manual_seed(0)
    for head_dim in (8, 16, 64, 128):
        for bsz, heads, n_q, n_k in [(1, 3, 3, 1), (1, 3, 3, 100), (2, 2, 5, 130), (1, 3, 70, 70)]:
            q = torch.randn(bsz, heads, n_q, head_dim, generator=random)
            k = store_kv(torch.randn(bsz, heads, n_k, head_dim, generator=random) * 3, torch.int8)
            v = store_kv(torch.randn(bsz, heads, n_k, head_dim, generator=random), torch.int8)
            mask = torch.zeros(bsz, 1, n_q, n_k)
            mask[..., n_k // 2 + 1:] = float("-inf")
            for path in op_paths():
                with kernels.options(path=path):
                    rows = attention(q, k, v, mask)
                    floats = attention(q, load_kv(k, head_dim, torch.float32), load_kv(v, head_dim, torch.float32), mask)
                assert torch.equal(rows, floats), (head_dim, bsz, heads, n_q, n_k, path)
    with pytest.raises(RuntimeError, match="do not agree"):
        attention(q, k[..., :-4], v[..., :-4], mask)


def test_attention_over_bfloat16_rows_under_float32_queries_is_attention_over_them_converted():
    """A bf16 cache's rows under a float32 model's queries, widened as they are read: the same bits as
    converting the whole cache to float32 first, on every instruction path, for a decode step's rows spread over
    parts and a prompt's many."""
    random = torch.Generator().manual_seed(1)
    for bsz, heads, n_q, n_k, head_dim in [(1, 3, 3, 1, 64), (1, 3, 3, 700, 64), (2, 2, 5, 130, 24), (1, 3, 70, 70, 64)]:
        q = torch.randn(bsz, heads, n_q, head_dim, generator=random)
        k, v = (torch.randn(bsz, heads, n_k, head_dim, generator=random).bfloat16() for _ in range(2))
        mask = torch.zeros(bsz, 1, n_q, n_k)
        mask[..., n_k // 2 + 1:] = float("-inf")
        for path in op_paths():
            with kernels.options(path=path):
                assert torch.equal(attention(q, k, v, mask), attention(q, k.float(), v.float(), mask)), (n_k, path)
    with pytest.raises(RuntimeError, match="int8 or bfloat16 rows"):
        attention(q, k, v.float(), mask)
