"""The integer kernels (llama/kernels) against a pure-torch reference of the same integer arithmetic.

Activations are rounded per block of 32 to int8 (d = max|x| / 127, q = round-half-even(x * (127 / max|x|)));
the kernels then sum int32 dot products of whole blocks and scale them in float32. The reference here does
the rounding with the same float32 operations and the dot products in exact integers, so:

- the activation blocks' int8 values, scales and sums equal the reference exactly;
- each block's int32 dot product equals it exactly (seen through one-hot scales, which make the float steps
  exact);
- the output is within the float32 bound of its sum over blocks: each block adds one fused multiply-add
  (one rounding) of a product the reference forms alike, so for n terms t_b the error is at most
  gamma_n * sum |t_b|, gamma_n = n u / (1 - n u), u = 2^-24 (n = blocks for int8, 2 x blocks for int4,
  whose minimums add a second term per block); bf16 activations add the output's rounding to bf16;
- every instruction path gives the scalar loop's very bits, at 1 and 2 threads, and a row's output does not
  depend on the rows beside it;
- so, with attention computed row by row too (llama/nn/row_attention.py), a model on the integer kernels gives the
  same logits cached and uncached, bit for bit.

The optional dequantize-then-GEMM (kernels.options(gemm_min_rows=...); off by default, as the integer kernel
measured faster at every size) sums the same products in another order, within gamma_(K+4) of the sum of their
magnitudes.
"""

import os
import subprocess
import sys

import pytest
import torch

from helpers import REPO, build
from llama import kernels
from llama.quant import format as qf
from llama.quant.dot_linears import Int4DotLinear, Int4ZeroPointDotLinear, Int8DotLinear, Int8Group16DotLinear
from llama.kernels import layout
from llama.kernels.build import missing
from llama.quant.linears import Int4Linear, Int8KernelLinear, Int8Linear, QuantizedLinear
from llama.model import ScaledDotProductAttention
from llama.nn.row_attention import RowExactAttention
from llama.quant.quantize import quantize_model

# Skipped only where the machine lacks what building the kernels takes (an x86 CPU, a compiler, ninja): a build
# that fails where all of it is here is a defect (torch 2.14's headers need C++20, and a -std=c++17 of ours failed
# every build there, silently running the exact paths), and fails the first test below.
if missing():
    pytest.skip(f"the integer kernels cannot be built here: {missing()}", allow_module_level=True)

U = 2.0 ** -24
QK = kernels.QK
PATHS = list(kernels.PATHS)


def test_the_kernels_build_wherever_a_compiler_and_ninja_are():
    assert kernels.available(), kernels.unavailable_reason()


def gamma(n):
    return n * U / (1 - n * U)


@pytest.fixture(params=PATHS)
def path(request):
    """Each instruction path in turn, forced; those this CPU lacks are skipped (and say so)."""
    assert kernels.load(), kernels.unavailable_reason()  # loaded here too, for a test picked out alone
    if request.param not in kernels.cpu_paths():
        pytest.skip(f"this CPU cannot run the {request.param} path")
    with kernels.options(path=request.param):
        yield request.param


# The reference.

def ref_quantize(x):
    """(M, K) float32 / bf16 -> int8 values (M, K), float32 scales (M, K / 32), int32 sums (M, K / 32)."""
    b = x.float().reshape(x.shape[0], -1, QK)
    amax = b.abs().amax(-1)
    inv = torch.full_like(amax, 127) / amax  # one correctly rounded division, as the kernel's (127 / amax is
    # torch's reciprocal(amax) * 127, rounded twice)
    zero = torch.isinf(inv)  # all zeros, or too small for 127 / amax
    bad = ~torch.isfinite(b).all(-1)  # NaN or an infinity
    q = torch.where((zero | bad).unsqueeze(-1), 0, torch.round(b * inv.unsqueeze(-1)))  # ties to even
    d = torch.where(bad, float("nan"), torch.where(zero, 0.0, amax / 127))
    return q.to(torch.int8).reshape(x.shape), d, q.sum(-1).to(torch.int32)


def ref_linear(x, values, scales, mins=None, group=QK):
    """The exact sum the kernel rounds, and its float32 bound: (M, out) float64 each.

    values: (out, K) int8 or 0..15; scales, mins: (out, K / group) float16, one per block of 32 (or per half block,
    group 16: each half's integer sum scaled apart, in column order)."""
    q, d, total = ref_quantize(x)
    m, nb = d.shape
    out = values.shape[0]
    per = QK // group
    isum = torch.einsum("mbi,obi->mob", q.reshape(m, nb * per, group).double(), values.reshape(out, nb * per, group).double())
    da = d.repeat_interleave(per, dim=1)  # each half block's activation scale is its block's
    terms = [(scales.float().unsqueeze(0) * da.unsqueeze(1)).double() * isum]  # the kernel's float32 dw * da
    if mins is not None:
        terms.append(mins.double().unsqueeze(0) * (d * total.float()).double().unsqueeze(1))  # float32 da * sum
    y = sum(t.sum(-1) for t in terms)
    bound = gamma(nb * per * len(terms)) * sum(t.abs().sum(-1) for t in terms)
    if x.dtype == torch.bfloat16:
        bound = bound + 2.0 ** -8 * (y.abs() + bound)  # the output rounded to bf16
    return y, bound


def ref_dequantized_product(x, values, scales, mins=None):
    """The exact product of the rounded activations and the weights, and the GEMM path's bound."""
    q, d, _ = ref_quantize(x)
    m, nb = d.shape
    xs = (q.reshape(m, nb, QK).double() * d.double().unsqueeze(-1)).reshape(m, -1)
    groups = scales.shape[1]  # one scale a block, or (groups of 16) two
    scaled = (values.reshape(values.shape[0], groups, -1).double() * scales.double().unsqueeze(-1)).reshape(values.shape[0], -1)
    w = scaled if mins is None else scaled + mins.double().repeat_interleave(QK, dim=1)
    magnitude = xs.abs() @ (scaled.abs() + (0 if mins is None else mins.double().abs().repeat_interleave(QK, dim=1))).t()
    bound = gamma(x.shape[1] + 4) * magnitude
    if x.dtype == torch.bfloat16:
        bound = bound + 2.0 ** -8 * (magnitude + bound)
    return xs @ w.t(), bound


# The kernels' block formats: int8 (Q8_0), int8 in groups of 16 (two scales a block: Q6_K's), int4 with a minimum
# (Q4_1), int4 whose minimum is -8 times its scale (Q4_0).
FORMATS = ["int8", "q8_16", "int4", "q4_0"]


def random_weights(method, out, k, gen):
    """Values over the whole range (int8 -128..127, whose extremes test maddubs' saturation), block scales and
    mins (Q4_1 only) as float16 of a trained model's size."""
    nb = k // QK * (2 if method == "q8_16" else 1)
    scales = (torch.rand(out, nb, generator=gen) * 0.02 + 1e-3).half()
    if method in ("int8", "q8_16"):
        return torch.randint(-128, 128, (out, k), generator=gen, dtype=torch.int8), scales, None
    values = torch.randint(0, 16, (out, k), generator=gen, dtype=torch.uint8)
    if method == "q4_0":
        return values, scales, None
    return values, scales, (-8 * scales.float() + torch.randn(out, nb, generator=gen) * 1e-3).half()


def run(method, x, values, scales, mins):
    """The kernel's product for unpacked values and per-block scales."""
    out = values.shape[0]
    if method == "int8":
        w, s = layout.pack_q8_0(values, scales)
        return torch.ops.llama_kv.q8_0_linear(x, w, s, out)
    if method == "q8_16":
        return torch.ops.llama_kv.q8_16_linear(x, *layout.pack_q8_16(values, scales), out)
    if method == "q4_0":
        return torch.ops.llama_kv.q4_0_linear(x, layout.pack_q4(values, scales), out)
    return torch.ops.llama_kv.q4_1_linear(x, layout.pack_q4(values, scales, mins), out)


def ref(method, x, values, scales, mins=None):
    """`ref_linear` of a format: Q4_0 is int8 blocks of the values less 8 (its kernel takes 8 * sum(a) off each
    block's integer sum, exactly)."""
    if method == "q4_0":
        return ref_linear(x, values.to(torch.int8) - 8, scales)
    if method == "q8_16":
        return ref_linear(x, values, scales, group=16)
    return ref_linear(x, values, scales, mins)


def activations(m, k, gen, dtype=torch.float32):
    """Rows of a transformer's size, with the cases the rounding treats apart: a zero block, a block that
    127 / amax overflows, exact ties (x * 127 / amax = n + 0.5), a block of one value."""
    x = torch.randn(m, k, generator=gen) * 3
    x[0, :QK] = 0
    if k >= 4 * QK:
        x[0, QK:2 * QK] = 1e-38
        x[0, 2 * QK:3 * QK] = torch.arange(QK) - 15.5  # amax 15.5: 127 / 15.5 * (n - 15.5) ties where it is exact
        x[0, 3 * QK:4 * QK] = -2.5
    return x.to(dtype)


# Activations.

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_activation_blocks_equal_the_reference_exactly(path, dtype):
    gen = torch.Generator().manual_seed(0)
    x = activations(5, 4096, gen, dtype)
    x[1, 5] = float("nan")
    x[2, 40] = float("inf")
    x[3, 64:96] *= 1e6  # a block of large values beside ordinary ones
    q, d, total = torch.ops.llama_kv.quantize_activations(x)
    rq, rd, rtotal = ref_quantize(x)
    assert torch.equal(q, rq) and torch.equal(total, rtotal)
    assert torch.equal(d.isnan(), rd.isnan()) and torch.equal(d.nan_to_num(), rd.nan_to_num())
    assert d[0, 0] == 0 and d[0, 1] == 0 and d[1, 0].isnan() and d[2, 1].isnan()
    assert q.abs().max() == 127 and (q[0, 2 * QK:3 * QK].float() != 0).all()


# Integer dot products.

@pytest.mark.parametrize("method", FORMATS)
def test_every_blocks_int32_dot_product_is_exact(path, method):
    """With activation scales 1 (each block holds +-127) and one-hot weight scales, each output is one block's
    int32 dot product, exactly; the rows of all -128 (or 15) against all +-127 are the sums maddubs would
    saturate on without the sign trick."""
    gen = torch.Generator().manual_seed(1)
    m, k, out = 3, 512, 45
    nb = k // QK
    x = torch.randint(-127, 128, (m, k), generator=gen).float()
    x.view(m, nb, QK)[:, :, 7] = 127
    x[1] = 127
    x[2] = -127
    values, _, _ = random_weights(method, out, k, gen)
    values[0] = -128 if method in ("int8", "q8_16") else 15
    values[1] = 127 if method in ("int8", "q8_16") else 15
    values[3] = 0  # Q4_0's most negative weight, -8
    per = 2 if method == "q8_16" else 1  # scales a block: one-hot on a half of it sees that half's sum
    one_hot = torch.zeros(out, nb * per)
    one_hot[torch.arange(out), torch.arange(out) % (nb * per)] = 1
    zeros = torch.zeros(out, nb).half()
    signed = values.double() - (8 if method == "q4_0" else 0)
    isum = torch.einsum("mbi,obi->mob", x.reshape(m, nb * per, QK // per).double(), signed.reshape(out, nb * per, QK // per))
    want = isum[:, torch.arange(out), torch.arange(out) % (nb * per)]
    got = run(method, x, values, one_hot.half(), None if method == "q4_0" else zeros)
    assert torch.equal(got.double(), want)
    assert got[2, 0] == {"int8": 128 * 127 * QK, "q8_16": 128 * 127 * 16, "int4": -15 * 127 * QK, "q4_0": -7 * 127 * QK}[method]
    if method == "int4":  # the minimums' term: each output is one block's sum of activations, exactly
        got = run(method, x, values, zeros, one_hot.half())
        assert torch.equal(got.double(), x.reshape(m, nb, QK).sum(-1).double()[:, torch.arange(out) % nb])


SHAPES = [(1, 32, 1), (1, 64, 13), (2, 96, 8), (3, 256, 40), (4, 512, 9), (5, 128, 300), (7, 1024, 70),
          (16, 64, 17), (1, 4096, 24), (11, 2048, 33)]


@pytest.mark.parametrize("method", FORMATS)
@pytest.mark.parametrize("m,k,out", SHAPES)
def test_outputs_equal_the_scalar_loop_and_are_within_the_float_bound(path, method, m, k, out):
    """Rows not a multiple of the 8 (16) interleaved, 1 to 16 activation rows (the batched decode and small-batch
    sizes, several tiles of 4), on every path: the scalar loop's bits, within the bound of the exact sum."""
    gen = torch.Generator().manual_seed(m * k + out)
    x = activations(m, k, gen)
    values, scales, mins = random_weights(method, out, k, gen)
    got = run(method, x, values, scales, mins)
    with kernels.options(path="scalar"):
        scalar = run(method, x, values, scales, mins)
    assert torch.equal(got, scalar)
    want, bound = ref(method, x, values, scales, mins)
    assert ((got.double() - want).abs() <= bound).all()


@pytest.mark.parametrize("method", FORMATS)
@pytest.mark.parametrize("m,k,out", [(16, 576, 24), (37, 576, 300), (64, 1536, 40), (33, 96, 8)])
def test_a_prompts_many_rows_equal_the_scalar_loop(path, method, m, k, out):
    """16 rows and more, as a prompt's products take them (the AMX path's tiles of 16 rows and two groups, and the
    rows past the last 16 on AVX-512 VNNI's), an odd number of groups among them: the scalar loop's bits."""
    gen = torch.Generator().manual_seed(m + k + out)
    x = activations(m, k, gen)
    values, scales, mins = random_weights(method, out, k, gen)
    got = run(method, x, values, scales, mins)
    with kernels.options(path="scalar"):
        assert torch.equal(got, run(method, x, values, scales, mins))


def test_the_amx_path_is_taken_only_where_the_cpu_reports_the_tiles():
    """The AMX path is listed only where the CPU reports the tiles (and the kernel grants them, and a product on them
    ran: some virtual machines report AMX and stop at its first instruction); where it is listed it is the best."""
    assert kernels.load(), kernels.unavailable_reason()
    flags = set()
    with open("/proc/cpuinfo") as f:
        flags = next((set(line.split(":", 1)[1].split()) for line in f if line.startswith("flags")), set())
    if not {"amx_tile", "amx_int8", "avx512_vnni"} <= flags:
        assert "amx" not in kernels.cpu_paths()
    if "amx" in kernels.cpu_paths():
        assert kernels.best_path() == "amx"


@pytest.mark.parametrize("method", FORMATS)
def test_bf16_activations_are_rounded_as_float32_ones_and_the_output_to_bf16(path, method):
    gen = torch.Generator().manual_seed(4)
    x = activations(3, 1024, gen, torch.bfloat16)
    values, scales, mins = random_weights(method, 77, 1024, gen)
    got = run(method, x, values, scales, mins)
    assert got.dtype == torch.bfloat16
    assert torch.equal(got, run(method, x.float(), values, scales, mins).bfloat16())
    want, bound = ref(method, x, values, scales, mins)
    assert ((got.double() - want).abs() <= bound).all()


@pytest.mark.parametrize("method", FORMATS)
@pytest.mark.parametrize("m", [7, 37])
def test_threads_and_neighbouring_rows_change_no_bit(path, method, m):
    gen = torch.Generator().manual_seed(5)
    x = activations(m, 256, gen)
    values, scales, mins = random_weights(method, 300, 256, gen)  # 38 groups, 19 units: split over threads
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = run(method, x, values, scales, mins)
        torch.set_num_threads(2)
        two = run(method, x, values, scales, mins)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, two)
    for i in range(x.shape[0]):
        assert torch.equal(run(method, x[i:i + 1], values, scales, mins)[0], one[i])


@pytest.mark.parametrize("method", FORMATS)
@pytest.mark.parametrize("m", [32, 100])
def test_prompt_chunks_through_the_optional_gemm_are_within_its_bound(method, m):
    """From gemm_min_rows rows on (if set), the product is torch's GEMM of the rounded activations and the
    widened weights; by default it is the integer kernel's at every size."""
    gen = torch.Generator().manual_seed(m)
    x = activations(m, 512, gen)
    values, scales, mins = random_weights(method, 70, 512, gen)
    with kernels.options(gemm_min_rows=32):
        got = run(method, x, values, scales, mins)
    signed = values.to(torch.int8) - 8 if method == "q4_0" else values
    want, bound = ref_dequantized_product(x, signed, scales, mins)
    assert ((got.double() - want).abs() <= bound).all()
    integer = run(method, x, values, scales, mins)  # the default
    want, bound = ref(method, x, values, scales, mins)
    assert ((integer.double() - want).abs() <= bound).all()


def test_dequantizing_gives_the_formats_values_exactly():
    gen = torch.Generator().manual_seed(6)
    for method in FORMATS:
        values, scales, mins = random_weights(method, 45, 256, gen)
        if method == "int8":
            got = torch.ops.llama_kv.dequantize_q8_0(*layout.pack_q8_0(values, scales), 45)
        elif method == "q8_16":
            got = torch.ops.llama_kv.dequantize_q8_16(*layout.pack_q8_16(values, scales), 45)
        elif method == "q4_0":
            got = torch.ops.llama_kv.dequantize_q4_0(layout.pack_q4(values, scales), 45)
            mins = scales * -8
        else:
            got = torch.ops.llama_kv.dequantize_q4_1(layout.pack_q4(values, scales, mins), 45)
        assert torch.equal(got, qf.dequantize_values(values, scales, mins))


@pytest.mark.parametrize("out", [45, 48])
def test_int4_layout_packs_and_unpacks_exactly(out):
    """Values, scales and minimums come back from the kernels' layout as they went in (Q4_0's minimums as -8 times
    the scales), and a value lands where csrc/kernels.h says: unit u, block b, byte 64p + 32h + 4r + c."""
    gen = torch.Generator().manual_seed(9)
    for method in ("int4", "q4_0"):
        values, scales, mins = random_weights(method, out, 256, gen)
        packed = layout.pack_q4(values, scales, mins)
        assert packed.shape == (3, 8, 320 if method == "int4" else 288)
        got = layout.unpack_q4(packed, out)
        assert torch.equal(got[0], values) and torch.equal(got[1], scales)
        assert torch.equal(got[2], scales * -8 if mins is None else mins)
        row, col = 16 + 8 + 5, 3 * QK + 16 + 4 * 2 + 1  # u 1, h 1, r 5; b 3, high nibble, p 2, c 1
        assert packed[1, 3, 64 * 2 + 32 + 4 * 5 + 1] >> 4 == values[row, col]
        assert packed[1, 3, 256:288].view(torch.float16)[13] == scales[row, 3]


def test_unknown_or_missing_paths_are_refused():
    with pytest.raises(ValueError, match="unknown kernel path 'avx9'"):
        kernels.set_options(path="avx9")
    assert kernels.best_path() in kernels.cpu_paths() and "scalar" in kernels.cpu_paths()
    for p in set(PATHS) - set(kernels.cpu_paths()):
        with pytest.raises(RuntimeError, match="does not run on this CPU"):
            kernels.set_options(path=p)


# The layer classes.

def _layer(method, out, k, group_size, gen):
    w = torch.randn(out, k, generator=gen) * 0.05
    layer = Int8Linear(k, out, group_size) if method == "int8" else Int4Linear(k, out, group_size)
    names = ("weight", "scales") if method == "int8" else ("weight", "scales", "mins")
    quantized = qf.quantize_int8(w, group_size) if method == "int8" else qf.quantize_int4(w, group_size)
    for name, tensor in zip(names, quantized):
        setattr(layer, name, tensor)
    return layer


def _assert_holds(layer, stored):
    """`layer` gives back `stored`'s on-disk tensors, weights and row slices (75 rows) exactly."""
    for name, tensor in stored.state_dict().items():
        assert torch.equal(layer.state_dict()[name], tensor), name
    assert torch.equal(layer.dequantized(), stored.dequantized())
    for start, end in [(0, 8), (3, 20), (70, 75), (8, None)]:
        for a, b in zip(layer.format_values(start, end), stored.format_values(start, end)):
            assert torch.equal(a, b)


@pytest.mark.parametrize("method,group_size", [("int8", None), ("int8", 32), ("int8", 64), ("int4", 32), ("int4", 128),
                                               ("q4_0", 32), ("q4_0", 64)])
def test_a_kernel_layer_holds_the_stored_values_and_multiplies_them(method, group_size, monkeypatch):
    """Re-packed a slice of rows at a time (per-channel and larger groups as blocks of 32 with each scale
    repeated), a layer gives back its on-disk tensors exactly, and its product is the kernel's. int4 whose
    minimums are all -8 times their scales (a GGUF's Q4_0) becomes the class that stores no minimums."""
    import llama.quant.dot_linears as int_linears

    gen = torch.Generator().manual_seed(7)
    stored = _layer("int8" if method == "int8" else "int4", 75, 256, group_size, gen)
    if method == "q4_0":
        stored.mins = stored.scales * -8
    kind = {"int8": Int8DotLinear, "int4": Int4DotLinear, "q4_0": Int4ZeroPointDotLinear}[method]
    assert int_linears.integer_class(stored, torch.float32) is kind
    monkeypatch.setattr(int_linears, "_CHUNK_ELEMENTS", 16 * 256)  # five slices, the last one short
    layer = kind.from_layer(stored, torch.float32)
    assert int_linears.integer_class(layer, torch.float32) is kind  # chosen again, it stays
    _assert_holds(layer, stored)
    values, scales, *mins = stored.format_values()
    repeat = (group_size or 256) // QK
    x = torch.randn(2, 3, 256, generator=gen)
    want, bound = ref(method, x.reshape(6, 256), values, scales.repeat_interleave(repeat, 1),
                      *(m.repeat_interleave(repeat, 1) for m in mins))
    got = layer(x)
    assert got.shape == (2, 3, 75)
    assert ((got.reshape(6, 75).double() - want).abs() <= bound).all()
    back = (Int8Linear if method == "int8" else Int4Linear).from_layer(layer, torch.float32)
    for name, tensor in stored.state_dict().items():
        assert torch.equal(back.state_dict()[name], tensor), name


def test_int8_groups_of_16_run_on_the_kernel_with_a_scale_for_each_half(monkeypatch):
    """A GGUF's Q6_K becomes int8 in groups of 16 (llama.cpp's default output layer for Q4_0): held as Q8_0's blocks
    with two scales each, the layer gives back its on-disk tensors exactly, and its product is the kernel's."""
    import llama.quant.dot_linears as int_linears

    gen = torch.Generator().manual_seed(11)
    stored = _layer("int8", 75, 256, 16, gen)
    assert int_linears.integer_class(stored, torch.float32) is Int8Group16DotLinear
    monkeypatch.setattr(int_linears, "_CHUNK_ELEMENTS", 16 * 256)  # five slices, the last one short
    layer = Int8Group16DotLinear.from_layer(stored, torch.float32)
    _assert_holds(layer, stored)
    values, scales = stored.format_values()
    x = torch.randn(2, 3, 256, generator=gen)
    want, bound = ref("q8_16", x.reshape(6, 256), values, scales)
    got = layer(x)
    assert got.shape == (2, 3, 75)
    assert ((got.reshape(6, 75).double() - want).abs() <= bound).all()


def test_a_model_in_groups_of_16_keeps_the_cache_switch_and_its_classes(gqa_ckpt):
    """Choosing the layers again (as the compiled step does after loading) keeps them, and cached and uncached runs
    give the same tokens."""
    from llama.quant.layer_plan import choose_layer_classes

    llama = build(gqa_ckpt)
    quantize_model(llama.model, "int8", group_size=16)
    for compiled in (False, True):
        choose_layer_classes(llama.model, compiled=compiled)
        assert type(llama.model.layers[0].feed_forward.w2) is Int8Group16DotLinear
    prompt = [llama.tokenizer.encode("The history of", bos=True, eos=False)]
    cached = llama.generate(prompt, 12, temperature=0, ignore_stop=True)[0]
    assert cached == llama.generate(prompt, 12, temperature=0, ignore_stop=True, kv_cache=False)[0]


@pytest.fixture(scope="module")
def models(gqa_ckpt):
    return {(m, dt, qk): build(gqa_ckpt, quantize=m, dtype=dt, quant_kernels=qk)
            for m in ("int8", "int4") for dt in ("float32", "bfloat16") for qk in ("integer", "exact")}


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("method", ["int8", "int4"])
def test_quantized_cpu_models_run_on_the_kernels_unless_asked_for_the_exact_paths(models, method, dtype):
    integer, exact = models[method, dtype, "integer"], models[method, dtype, "exact"]
    kind = Int8DotLinear if method == "int8" else Int4DotLinear
    layers = [m for m in integer.model.modules() if isinstance(m, QuantizedLinear) and m is not integer.model.output]
    assert layers and all(type(m) is kind for m in layers)
    assert type(integer.model.output) is Int8DotLinear  # int4 keeps the output layer at int8
    assert integer.info.quant_kernels == "integer" and integer.info.notes == []
    assert not any(isinstance(m, kind) for m in exact.model.modules()) and exact.info.quant_kernels == "exact"
    assert not any(isinstance(m, RowExactAttention) for m in exact.model.modules())
    assert integer.model.state_dict().keys() == exact.model.state_dict().keys()
    for name, tensor in exact.model.state_dict().items():
        if dtype == "float32" or not name.endswith((".scales", ".mins")):  # bf16 int4 holds torch's bf16 scales
            assert torch.equal(integer.model.state_dict()[name], tensor), name


def test_what_the_kernels_cannot_hold_stays_on_the_exact_paths(gqa_ckpt):
    """float16 activations, and int8 groups of 16 (what a GGUF's Q6_K becomes) among them."""
    from llama.quant.layer_plan import layer_class
    sixteens = _layer("int8", 64, 64, 16, torch.Generator().manual_seed(0))
    assert layer_class(sixteens, torch.float16, compiled=False) not in (Int8DotLinear, Int4DotLinear,
                                                                       Int8Group16DotLinear)
    assert layer_class(sixteens, torch.float32, compiled=False, integer=True) is Int8Group16DotLinear
    layer = _layer("int8", 64, 64, None, torch.Generator().manual_seed(0))
    assert layer_class(layer, torch.float16, compiled=False) not in (Int8DotLinear, Int4DotLinear)
    assert layer_class(layer, torch.float32, compiled=False, integer=False) in (Int8KernelLinear, Int8Linear)
    assert layer_class(layer, torch.float32, compiled=False, integer=True) is Int8DotLinear


PROMPTS = [[1, 50, 7, 99], [1, 3000], [1, 17, 933, 2, 2, 45, 3001, 12]]


@pytest.mark.parametrize("method", ["int8", "int4"])
def test_cache_switch_gives_the_same_bits(tiny_ckpt, method):
    """Every row-wise step of a model on the integer kernels gives a position the same bits whether it is fed
    alone (a cached step) or among all positions (an uncached pass): the kernels' rows are independent and
    attention is row-exact (llama/nn/row_attention.py). So cached and uncached logits are equal, not merely close.
    (With torch's fused attention they differed by 1e-7, which rounding activations to 8 bits turned, now and
    then, into a step of a whole int8 unit; on the 30 layers of the default model those grew until the greedy
    text parted after 1 to 20 tokens on 2 to 4 of 4 prompts.)"""
    llama = build(tiny_ckpt, quantize=method)
    assert llama.info.quant_kernels == "integer"
    assert all(type(a) is RowExactAttention for a in llama.model.modules() if isinstance(a, ScaledDotProductAttention))
    cached, lp_cached = llama.generate(PROMPTS, 20, temperature=0, logprobs=True, kv_cache=True)
    uncached, lp_uncached = llama.generate(PROMPTS, 20, temperature=0, logprobs=True, kv_cache=False)
    assert cached == uncached and lp_cached == lp_uncached
    tokens = torch.randint(0, llama.model.vocab_size, (2, 24), generator=torch.Generator().manual_seed(5))
    with torch.inference_mode():
        full = llama.model(tokens)
        cache = llama.model.new_kv_cache(2, 24)
        steps = [llama.model(tokens[:, :8], 0, cache)] + [llama.model(tokens[:, i:i + 1], i, cache) for i in range(8, 24)]
    assert torch.equal(torch.cat(steps, dim=1), full)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_row_exact_attention_is_attention_and_its_rows_stand_alone(dtype):
    """Within float32 rounding of torch's fused kernel (bf16: its output's rounding), and each row's bits the
    same alone against the keys it sees, among all rows with a causal mask, or with keys past its mask."""
    import torch.nn.functional as F

    gen = torch.Generator().manual_seed(8)
    b, h, n, d = 2, 3, 21, 64
    q, k, v = (torch.randn(b, h, n, d, generator=gen).to(dtype) for _ in range(3))
    mask = torch.full((n, n), float("-inf")).triu(1).to(dtype)
    got = torch.ops.llama_kv.attention(q, k, v, mask)
    want = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=mask.float())
    tolerance = 1e-5 if dtype == torch.float32 else 2.0 ** -8 * want.abs().max().item()
    torch.testing.assert_close(got.float(), want, rtol=0, atol=tolerance)
    for i in (0, 9, n - 1):
        alone = torch.ops.llama_kv.attention(q[:, :, i:i + 1], k[:, :, :i + 1], v[:, :, :i + 1], None)
        assert torch.equal(alone, got[:, :, i:i + 1])
    # Keys a cache holds beyond what a step sees (a strided view of a longer buffer) change nothing either.
    longer = torch.cat([k, torch.randn(b, h, 5, d, generator=gen).to(dtype)], dim=2)[:, :, :n]
    assert torch.equal(torch.ops.llama_kv.attention(q, longer, v, mask), got)
    # The plain loop (the kernels forced to the scalar path) gives the very bits of the AVX2 one, where there is one.
    with kernels.options(path="scalar"):
        assert torch.equal(torch.ops.llama_kv.attention(q, k, v, mask), got)
        odd = torch.randn(b, h, n, 21, generator=gen).to(dtype)  # D not a multiple of 8: the lanes' tail
        plain = torch.ops.llama_kv.attention(odd, odd, odd, mask)
    assert torch.equal(torch.ops.llama_kv.attention(odd, odd, odd, mask), plain)


@pytest.mark.parametrize("method", ["int8", "int4"])
def test_rounding_activations_moves_logits_by_what_8_bits_allow(models, gqa_ckpt, method):
    """Against the exact path on the same weights: about 1% of the logits' size (each projection's input is
    off by at most half a step of 1/127 of its block's largest value), in float32 and in bf16 alike."""
    tokens = torch.randint(0, 4000, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        want = models[method, "float32", "exact"].model(tokens)
        for dtype in ("float32", "bfloat16"):
            got = models[method, dtype, "integer"].model(tokens).float()
            assert ((got - want).norm() / want.norm()).item() < 3e-2


@pytest.mark.slow
@pytest.mark.parametrize("method", ["int8", "int4"])
def test_the_compiled_step_calls_the_same_kernels(gqa_ckpt, method):
    compiled = build(gqa_ckpt, quantize=method, compile=True)
    assert type(compiled.model.layers[0].feed_forward.w13) is (Int8DotLinear if method == "int8" else Int4DotLinear)
    eager = build(gqa_ckpt, quantize=method)
    # One prompt: the batch-1 package compile=True stored (a row's output does not depend on the rows beside it,
    # tested above, and another batch size would be another package to build).
    prompts = PROMPTS[:1]
    got, lp_got = compiled.generate(prompts, 12, temperature=0, logprobs=True)
    want, lp_want = eager.generate(prompts, 12, temperature=0, logprobs=True)
    # Everything between the kernels is row-exact too (norms, rotary, attention: llama/row_attention.py), so
    # compiling changes no bit.
    assert got == want and lp_got == lp_want
    uncached, lp_uncached = compiled.generate(prompts, 12, temperature=0, logprobs=True, kv_cache=False)
    assert uncached == got and lp_uncached == lp_got


@pytest.mark.slow
def test_without_a_compiler_the_exact_paths_run_and_a_note_says_why(gqa_ckpt, tmp_path):
    """A fresh build directory and no compiler: the model loads on the exact paths, with one note."""
    code = ("from llama import Llama; "
            f"l = Llama.build({str(gqa_ckpt)!r}, max_seq_len=32, max_batch_size=1, device='cpu', quantize='int8'); "
            "print(l.info.quant_kernels); print(*l.info.notes, sep='\\n')")
    env = {**os.environ, "CXX": str(tmp_path / "no-such-compiler"), "LLAMA_KERNELS_DIR": str(tmp_path / "k"),
           "PYTHONPATH": str(REPO)}
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert result.returncode == 0, result.stderr
    kernels_used, *notes = result.stdout.splitlines()
    assert kernels_used == "exact"
    assert any("integer kernels cannot run here: no C++ compiler was found" in n for n in notes), notes
    assert any("exact but slow" in n for n in notes), notes


@pytest.mark.slow
def test_the_commands_take_quant_kernels(gqa_ckpt):
    bin_dir = os.path.dirname(sys.executable)
    argv = [os.path.join(bin_dir, "llama-generate"), "--ckpt-dir", str(gqa_ckpt), "--prompt", "I believe",
            "--temperature", "0", "--max-gen-len", "4", "--quantize", "int8", "--stats"]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    for flag, shown in [([], "int8, on the integer kernels"), (["--quant-kernels", "exact"], "int8, on the exact kernels")]:
        result = subprocess.run(argv + flag, capture_output=True, text=True, env=env, timeout=300)
        assert result.returncode == 0, result.stderr
        assert shown in result.stderr
    result = subprocess.run(argv + ["--quant-kernels", "fast"], capture_output=True, text=True, env=env, timeout=300)
    assert result.returncode != 0
    assert result.stderr.strip() == "error: unknown --quant-kernels fast; choose one of integer, exact"
