"""llama_kv.f32_linear (llama/kernels/csrc/f32_rows.cpp): float32 products of a few rows with a row-major weight.

Each output is a sum of K products, in an order of the path's own: within the float32 bound of the exact sum,
gamma_K * sum_k |x_k w_k| (gamma_n = n u / (1 - n u), u = 2^-24), on every instruction path this CPU has. And
a row's outputs do not depend on the rows beside it or on the threads: the same bits alone or in a batch,
which is what lets a server's batched step give each sequence what it gets alone.
"""

import pytest
import torch

from llama import kernels
from llama.kernels.build import missing

if missing():
    pytest.skip(f"the kernels cannot be built here: {missing()}", allow_module_level=True)

U = 2.0 ** -24
# The float paths the library picks from its instruction paths (kernels.h): scalar, AVX2 + FMA, AVX-512.
FLOAT_PATHS = ["scalar", "avx2", "avx512"]
SHAPES = [(37, 19), (64, 576), (1000, 33), (5, 8), (9, 1), (37, 600)]  # (out, in): ragged in both, one-column rows;
# the last with 16 rows is over f32_rows.cpp's PAIR_BYTES: several weight rows a pass, one left over


@pytest.fixture(params=FLOAT_PATHS)
def path(request):
    assert kernels.available(), kernels.unavailable_reason()
    if request.param not in kernels.cpu_paths():
        pytest.skip(f"this CPU cannot run the {request.param} path")
    with kernels.options(path=request.param):
        yield request.param


def _bound(x, w):
    k = x.shape[-1]
    gamma = k * U / (1 - k * U)
    return gamma * (x.double().abs() @ w.double().abs().t())


@pytest.mark.parametrize("out_features, in_features", SHAPES)
def test_within_the_float32_bound_of_the_exact_sum(path, out_features, in_features):
    g = torch.Generator().manual_seed(out_features * 1000 + in_features)
    w = torch.randn(out_features, in_features, generator=g)
    for rows in (1, 2, 3, 4, 5, 8, 16):
        x = torch.randn(rows, in_features, generator=g)
        got = torch.ops.llama_kv.f32_linear(x, w)
        exact = x.double() @ w.double().t()
        assert got.dtype == torch.float32 and got.shape == (rows, out_features)
        assert ((got.double() - exact).abs() <= _bound(x, w)).all(), (path, rows)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("rows", [16, 131])
def test_a_rows_outputs_do_not_depend_on_the_rows_beside_it_or_the_threads(path, threads, rows):
    """16 rows of 600 are past PAIR_BYTES (several weight rows a pass); 131 are past BLOCK_BYTES as well (blocks of
    rows, the last one ragged). Each output as it is alone, in any company and on any number of threads."""
    g = torch.Generator().manual_seed(7)
    w = torch.randn(1531, 600, generator=g)  # no whole number of threes or fours of weight rows
    x = torch.randn(rows, 600, generator=g)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        together = torch.ops.llama_kv.f32_linear(x, w)
        alone = torch.cat([torch.ops.llama_kv.f32_linear(x[i : i + 1], w) for i in range(rows)])
        threes = torch.cat([torch.ops.llama_kv.f32_linear(x[i : i + 3], w) for i in range(0, rows, 3)])
    finally:
        torch.set_num_threads(before)
    reference = torch.ops.llama_kv.f32_linear(x, w)  # at the suite's 2 threads
    assert torch.equal(together, alone) and torch.equal(together, threes) and torch.equal(together, reference)
    assert ((together.double() - x.double() @ w.double().t()).abs() <= _bound(x, w)).all()


def test_leading_dimensions_are_kept_and_bad_weights_refused():
    assert kernels.available(), kernels.unavailable_reason()
    w = torch.randn(48, 32)
    x = torch.randn(2, 3, 32)
    got = torch.ops.llama_kv.f32_linear(x, w)
    assert got.shape == (2, 3, 48)
    torch.testing.assert_close(got, x @ w.t(), rtol=1e-5, atol=1e-5)
    with pytest.raises(RuntimeError, match="contiguous"):
        torch.ops.llama_kv.f32_linear(x, w.t().contiguous().t())  # column-major, as the eager model stores it
    with pytest.raises(RuntimeError, match="float32"):
        torch.ops.llama_kv.f32_linear(x.bfloat16(), w)


def test_a_prompts_rows_on_the_float32_layer_are_within_the_bound_and_as_alone():
    """FewRowsLinear past FEW_ROWS_MAX rows: oneDNN's GEMM where torch has it (`onednn_linear`), else F.linear.
    Either way each output is within the float32 bound of the exact sum, and a row's outputs are the same bits
    among 512 rows as among 17: what lets a server's batched prefill give each prompt what it gets alone."""
    from llama.quant.linears import FEW_ROWS_MAX, FewRowsLinear

    assert kernels.available(), kernels.unavailable_reason()
    g = torch.Generator().manual_seed(11)
    layer = FewRowsLinear(576, 1536, bias=False)
    with torch.no_grad():
        layer.weight.copy_(torch.randn(1536, 576, generator=g) * 0.05)
    x = torch.randn(1, 512, 576, generator=g)
    with torch.no_grad():
        together = layer(x)[0]
        seventeen = layer(x[:, 100:100 + FEW_ROWS_MAX + 1])[0]
    w = layer.weight.detach()
    assert ((together.double() - x[0].double() @ w.double().t()).abs() <= _bound(x[0], w)).all()
    assert torch.equal(together[100:100 + FEW_ROWS_MAX + 1], seventeen)
