"""Keys and values held as int8 (`kv_cache_dtype="int8"`), or as bf16 by a float32 model: the cache still changes
the speed, never the answer.

An int8 cache holds blocks of 32 along head_dim (the whole head where head_dim is not a multiple of 32, as in the
tiny models) with one float32 scale each, and the uncached pass rounds its keys and values the same way. Every op
between the roundings is then row-exact (the integer kernels, or float32 weights on RowExactLinear), so cached and
uncached logits are the same bits. bf16 keys and values of a float32 model keep torch's products: the same greedy
tokens, logits apart only where float32 rounding puts a value on the other side of a bf16 rounding boundary
(BF16_KV_BOUND). The rounding is real: the logits differ from a float cache's.
"""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from helpers import build, write_tiny
from llama import kernels
from llama.compile.aot import AheadOfTimeStep, PagedStep
from llama.compile.store import describe_key, package_dir
from llama.compile.step import kv_cache_dtype_note
from llama.errors import LlamaError
from llama.kernels.build import missing
from llama.kv_cache import KVCache, load_kv, resolve_kv_cache_dtype, round_kv, store_kv
from llama.quant.layer import QuantizedLinear
from llama.quant.linears import RowExactInt4Linear, RowExactInt8Linear, RowExactLinear

PROMPTS = ["I believe the meaning of life is", "def fibonacci(n):", "A"]


@pytest.fixture(scope="module")
def wide_ckpt(tmp_path_factory):
    """A tiny grouped-query model with heads of 64: two int8 blocks of 32 a head, as real models have."""
    path, _ = write_tiny(tmp_path_factory.mktemp("wide"), "gqa", dim=256, n_heads=4, n_kv_heads=2)
    return path


def _cached_and_uncached(model, chunks=(12, 28)):
    tokens = torch.randint(0, model.vocab_size, (3, 48), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        uncached = model(tokens)
        cache = model.new_kv_cache(3, 48)
        pieces, pos = [], 0
        for n in chunks:
            pieces.append(model(tokens[:, pos : pos + n], pos, cache))
            pos += n
        pieces += [model(tokens[:, p : p + 1], p, cache) for p in range(pos, 48)]
    return torch.cat(pieces, dim=1), uncached


def _generate_both_ways(llama):
    prompts = [llama.tokenizer.encode(p, bos=True, eos=False) for p in PROMPTS]
    return [llama.generate(prompts, 20, temperature=0, logprobs=True, echo=True, kv_cache=kv, ignore_stop=True)
            for kv in (True, False)]


def test_store_kv_is_q8_0s_rule_and_loads_back_to_half_a_step():
    """Blocks of 32 along the last dimension: scale = max|x| / 127, q = round(x / scale), values then scales' bytes;
    dequantized, each value within half a step of x. An all-zero block stays zero (no 0 / 0)."""
    x = torch.randn(2, 3, 5, 64, generator=torch.Generator().manual_seed(3)) * 4
    x[0, 0, 0] = 0
    rows = store_kv(x, torch.int8)
    assert rows.dtype == torch.int8 and rows.shape == (2, 3, 5, 64 + 2 * 4)
    blocks = x.unflatten(-1, (2, 32))
    scale = blocks.abs().amax(-1, keepdim=True) / 127
    q = torch.where(scale == 0, 0.0, blocks / scale).round()
    assert torch.equal(rows[..., :64].float(), q.flatten(-2))
    assert torch.equal(rows[..., 64:].contiguous().view(torch.float32), scale.squeeze(-1))
    back = load_kv(rows, 64, torch.float32)
    assert torch.equal(back, (q * scale).flatten(-2)) and torch.equal(back, round_kv(x, torch.int8))
    assert (back - x).abs().le(scale.expand_as(blocks).flatten(-2) / 2 + 1e-6).all()
    assert torch.equal(back[0, 0, 0], torch.zeros(64))
    # A head that is not a multiple of 32 wide is one block; bf16 is a rounding on write.
    assert store_kv(x[..., :16], torch.int8).shape[-1] == 16 + 4
    assert torch.equal(round_kv(x, torch.bfloat16), x.to(torch.bfloat16).float())


def test_an_int8_cache_gives_attention_its_stored_rows_only_up_to_the_columns_a_step_reads():
    """`update_at(..., kv_len)` returns the first kv_len positions as the cache stores them (int8 values, then their
    scales' bytes): attention reads them there (`llama_kv.attention`), and nothing past kv_len is touched."""
    cache = KVCache(1, 64, 2, 32, torch.int8, torch.device("cpu"))
    random = torch.Generator().manual_seed(5)
    new = [torch.randn(1, 2, 3, 32, generator=random) for _ in range(2)]
    pos = torch.arange(4, 7)[None]
    whole = cache.update_at(pos, *new)
    part = cache.update_at(pos, *new, kv_len=7)
    for w, p, x in zip(whole, part, new):  # keys, then values
        assert w.shape == (1, 2, 64, 32 + 4) and p.shape == (1, 2, 7, 32 + 4) and p.dtype == torch.int8
        assert torch.equal(p, w[:, :, :7]) and torch.equal(p[:, :, 4:], store_kv(x, torch.int8))
        assert p.data_ptr() == w.data_ptr()  # a view of the cache, not a copy


def test_the_int8_cache_holds_int8_in_about_a_quarter_of_the_bytes(wide_ckpt, gqa_ckpt):
    float32, int8 = build(wide_ckpt), build(wide_ckpt, kv_cache_dtype="int8")
    assert int8.model.kv_cache_dtype == torch.int8 and float32.model.kv_cache_dtype == torch.float32
    cache = int8.model.new_kv_cache(2, 16)
    assert all(c.cache_k.dtype == c.cache_v.dtype == torch.int8 for c in cache)
    pool = int8.model.new_paged_kv_cache(4, 8)
    assert all(t.dtype == torch.int8 for t in pool.keys + pool.values)
    # Per position, layer and KV head: 64 values of 4 bytes, against 64 of 1 byte and two float32 scales.
    assert float32.model.kv_cache_nbytes(1, 1) == 2 * 2 * 2 * 64 * 4
    assert int8.model.kv_cache_nbytes(1, 1) == 2 * 2 * 2 * (64 + 8) == sum(c.nbytes for c in cache) // 32
    assert float32.model.kv_cache_nbytes(1, 1) / int8.model.kv_cache_nbytes(1, 1) == pytest.approx(3.56, abs=0.01)
    assert pool.nbytes == int8.model.kv_cache_nbytes(1, 32)
    # Heads of 8 (the tiny gqa model): one block a head, so 8 bytes and one scale.
    assert build(gqa_ckpt, kv_cache_dtype="int8").model.kv_cache_nbytes(1, 1) == 2 * 2 * 2 * (8 + 4)


def _switch_is_exact(llama):
    cached, uncached = _cached_and_uncached(llama.model)
    assert torch.equal(cached, uncached)
    (toks, lps), (toks_uncached, lps_uncached) = _generate_both_ways(llama)
    assert toks == toks_uncached and lps == lps_uncached


def _float32_switch_is_exact(ckpt):
    if missing() is not None:
        pytest.skip(f"the kernels cannot be built here: {missing()}")
    llama = build(ckpt, kv_cache_dtype="int8")
    assert llama.info.layer_plan.row_exact
    assert {type(m) for m in llama.model.modules() if isinstance(m, nn.Linear)} == {RowExactLinear}
    _switch_is_exact(llama)


def test_int8_kv_on_float32_weights_gives_the_same_bits_for_each_attention_shape(tiny_ckpt):
    _float32_switch_is_exact(tiny_ckpt)


def test_int8_kv_on_float32_weights_gives_the_same_bits_with_blocks_of_32(wide_ckpt):
    _float32_switch_is_exact(wide_ckpt)


@pytest.mark.parametrize("quantize", ["int8", "int4"])
def test_int8_kv_on_the_weight_only_paths_gives_the_same_bits(wide_ckpt, quantize):
    """`quant_kernels="exact"` multiplies float32 activations by the widened weights: under an int8 cache on
    `llama_kv.f32_linear` (RowExactInt8Linear, RowExactInt4Linear), so the switch is exact there too."""
    if missing() is not None:
        pytest.skip(f"the kernels cannot be built here: {missing()}")
    llama = build(wide_ckpt, kv_cache_dtype="int8", quantize=quantize, quant_kernels="exact")
    assert llama.info.quant_kernels == "exact" and llama.info.layer_plan.row_exact
    classes = {type(m) for m in llama.model.modules() if isinstance(m, QuantizedLinear)}
    assert classes <= {RowExactInt8Linear, RowExactInt4Linear}  # int4 keeps its output layer at int8
    assert (RowExactInt8Linear if quantize == "int8" else RowExactInt4Linear) in classes
    _switch_is_exact(llama)


def test_without_row_exact_products_float32_rounding_would_move_int8_keys():
    """Why float32 weights take RowExactLinear under an int8 cache: torch's product gives a row computed alone and
    among others apart in the last bits (MKL picks its kernel by the number of rows), which is what now and then
    puts a key on the other side of an int8 rounding boundary; f32_linear gives them the same bits."""
    if missing() is not None:
        pytest.skip(f"the kernels cannot be built here: {missing()}")
    kernels.load()
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(48, 256, generator=g), torch.randn(128, 256, generator=g)
    assert not all(torch.equal(F.linear(x[i : i + 1], w), F.linear(x, w)[i : i + 1]) for i in range(48))
    together = torch.ops.llama_kv.f32_linear(x, w)
    assert all(torch.equal(torch.ops.llama_kv.f32_linear(x[i : i + 1], w), together[i : i + 1]) for i in range(48))


# bf16 keys and values of a float32 model: torch's products, as a float cache has. A key within float32 rounding
# (1e-7) of a boundary between two bf16 values rounds up in one pass and down in the other: the cached and uncached
# passes compute it among different rows, so now and then one element moves by a whole step. Observed on these
# models: logits (about 4-8 in size) apart by at most 2e-3, against 1e-5 with a float cache.
BF16_KV_BOUND = 2e-2


def _integer_switch_is_exact(ckpt):
    if missing() is not None:
        pytest.skip(f"the integer kernels cannot be built here: {missing()}")
    llama = build(ckpt, quantize="int8", kv_cache_dtype="int8")
    assert llama.info.quant_kernels == "integer"
    _switch_is_exact(llama)


def test_int8_kv_on_the_integer_kernels_gives_the_same_bits(tiny_ckpt):
    _integer_switch_is_exact(tiny_ckpt)


def test_int8_kv_on_the_integer_kernels_gives_the_same_bits_with_blocks_of_32(wide_ckpt):
    _integer_switch_is_exact(wide_ckpt)


@pytest.mark.parametrize("kv_cache_dtype", ["int8", "bfloat16"])
def test_the_rounding_is_real(wide_ckpt, kv_cache_dtype):
    """Logits with int8 (or bf16) keys and values differ from a float32 cache's, cached and uncached: they would
    be equal if the cache silently stayed float32. They stay close: the rounding is small."""
    plain, rounded = build(wide_ckpt), build(wide_ckpt, kv_cache_dtype=kv_cache_dtype)
    for got, float_logits in zip(_cached_and_uncached(rounded.model), _cached_and_uncached(plain.model)):
        difference = (got - float_logits).abs().max().item()
        assert 1e-4 < difference < 0.5, difference


def test_bfloat16_kv_on_a_float32_model(tiny_ckpt):
    llama = build(tiny_ckpt, kv_cache_dtype="bfloat16")
    assert llama.model.dtype == torch.float32
    assert all(c.cache_k.dtype == torch.bfloat16 for c in llama.model.new_kv_cache(1, 4))
    assert not llama.info.layer_plan.row_exact  # torch's products: within BF16_KV_BOUND, not bit for bit
    cached, uncached = _cached_and_uncached(llama.model)
    torch.testing.assert_close(cached, uncached, rtol=0, atol=BF16_KV_BOUND)
    (toks, lps), (toks_uncached, lps_uncached) = _generate_both_ways(llama)
    assert toks == toks_uncached
    for row, row_uncached in zip(lps, lps_uncached):
        torch.testing.assert_close(torch.tensor(row), torch.tensor(row_uncached), rtol=0, atol=BF16_KV_BOUND)


@pytest.mark.skipif(bool(missing()), reason="the kernels cannot be built here")
@pytest.mark.parametrize("cache", [torch.bfloat16, torch.float32])
def test_a_steps_few_rows_take_the_op_and_a_prompts_many_the_fused_kernel(cache):
    """Float32 queries on the CPU: a decode step's few rows go to `llama_kv.attention`, which reads a bf16 cache's rows
    as they are (the same bits as converting them first) and shares a long cache among the threads; a prompt's many
    rows go to torch's fused kernel (over the cache converted to float32)."""
    from llama.nn.row_attention import FEW_ROWS, KernelAttention
    assert kernels.load(), kernels.unavailable_reason()
    attend = KernelAttention()
    gen = torch.Generator().manual_seed(3)
    k, v = (torch.randn(1, 2, 300, 64, generator=gen).to(cache) for _ in range(2))
    for rows in (3, FEW_ROWS + 1):
        q = torch.randn(1, 2, rows, 64, generator=gen)
        mask = torch.zeros(1, 1, rows, 300)
        op = torch.ops.llama_kv.attention(q, k.float(), v.float(), mask)
        fused = F.scaled_dot_product_attention(q, k.float(), v.float(), attn_mask=mask)
        assert not torch.equal(op, fused)  # the two kernels round differently, so the test tells them apart
        assert torch.equal(attend(q, k, v, mask), op if rows <= FEW_ROWS else fused), rows


def test_paged_int8_blocks_copy_and_file_with_their_scales(wide_ckpt):
    """The paged pool's int8 rows carry their scales, so a block copied or written out and loaded back holds the
    same keys and values, and a block of float32 rows does not fit it."""
    model = build(wide_ckpt, kv_cache_dtype="int8").model
    pool = model.new_paged_kv_cache(4, 4)
    xk, xv = (torch.randn(1, 2, 4, 64, generator=torch.Generator().manual_seed(s)) for s in (1, 2))
    layer = pool.for_step(torch.tensor([[1, 0]]), torch.arange(4)[None])[0]
    keys, values = layer.update_at(torch.arange(4)[None], xk, xv)
    assert torch.equal(keys[:, :, :4], store_kv(xk, torch.int8))  # the stored rows, scales after the values
    assert torch.equal(values[:, :, :4], store_kv(xv, torch.int8))
    pool.load_block(3, pool.block_tensor(1))
    pool.copy_prefix(1, 2, 4)
    for block in (2, 3):
        assert torch.equal(pool.block_tensor(block), pool.block_tensor(1))
    with pytest.raises(ValueError):
        pool.load_block(0, torch.zeros(2, 2, 2, 4, 64))


def test_a_bad_kv_cache_dtype_and_compile_true_without_the_stored_step_are_refused_in_one_line(gqa_ckpt, monkeypatch):
    """The stored compiled step takes an int8 cache (tests/compile/test_compile.py); torch.compile's step, which
    LLAMA_COMPILE_AOT=0 (or a GPU) gives, is not tested with one, and compile=True refuses it there."""
    for bad in ("int4", "float16 ", 8, ["int8"]):
        with pytest.raises(LlamaError, match="kv_cache_dtype=.* is not one of auto, float32, bfloat16, int8"):
            resolve_kv_cache_dtype(bad, torch.float32)
    with pytest.raises(LlamaError, match="kv_cache_dtype="):
        build(gqa_ckpt, kv_cache_dtype="int4")
    assert kv_cache_dtype_note(torch.int8, explicit=True, stored_step=True) is None
    monkeypatch.setenv("LLAMA_COMPILE_AOT", "0")
    with pytest.raises(LlamaError, match=r"compile=True .*\(kv_cache_dtype=int8\) only through the stored step"):
        build(gqa_ckpt, kv_cache_dtype="int8", compile=True)


def test_without_the_stored_step_the_default_runs_int8_kv_eagerly_with_one_note(gqa_ckpt, monkeypatch):
    monkeypatch.setenv("LLAMA_COMPILE_AOT", "0")
    llama = build(gqa_ckpt, kv_cache_dtype="int8", compile="auto")
    assert llama.compiled_step is None
    notes = [n for n in llama.info.notes if "kv_cache_dtype=int8" in n]
    assert len(notes) == 1 and "runs eagerly" in notes[0]
    assert not any("kv_cache_dtype" in n for n in build(gqa_ckpt, kv_cache_dtype="float32").info.notes)


def test_a_stored_steps_key_names_the_cache_dtype(gqa_ckpt):
    """An int8 cache's rows are bytes: a package built for a float cache runs on one unchecked and reads garbage (seen:
    logits off by 10). So the cache dtype is part of every stored step's key, and the one-token step takes only
    caches of the dtype its packages were built for."""
    model = build(gqa_ckpt).model
    dtypes = (torch.float32, torch.bfloat16, torch.int8)
    places = {kv: package_dir(describe_key(model, 1, kv_dtype=kv)) for kv in dtypes}
    assert len(set(places.values())) == 3 and places[torch.float32] == package_dir(describe_key(model, 1))
    assert len({PagedStep(model, model.new_paged_kv_cache(8, 4, kv))._place((2, 16))[1] for kv in dtypes}) == 3
    model.kv_cache_dtype = torch.int8
    step = AheadOfTimeStep(model)
    assert step._place(1)[1] == places[torch.int8] and step._place((1, 4))[1] != step._place(1)[1]
    tokens = torch.zeros((1, 1), dtype=torch.long)
    assert step.accepts(tokens, model.new_kv_cache(1, 8), 1)
    assert not step.accepts(tokens, model.new_kv_cache(1, 8, torch.float32), 1)
