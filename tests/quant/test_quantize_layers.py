"""Quantized layers, one at a time, against weights dequantized without the library (helpers.dequantize_stored):
the values a layer stores are its float weights within half a step of the format's grid, and whichever path
the layer multiplies by (torch's int8 / int4 CPU kernels, the compiled reduction, or widening its weight to
the activations' dtype), for 1 to 4 rows (decoding a batch of 1 to 4) and for 32 (a prompt), it multiplies
by exactly those values. These are the exact weight-only paths (quant_kernels="exact"): the integer kernels,
the CPU's default, round the activations too and are tested against their own reference in test_int_kernels.py.

The tests at the end name the int4 layer classes of llama/quant/linears.py (one per in-memory layout) and the
quantizer's scratch size: they follow the layer classes rather than what a user sees.
"""

import copy
import os
import shutil

import pytest
import torch

from helpers import build, dequantize_stored
from llama.quant import format as qf
from llama.quant.layer_plan import choose_layer_classes
from llama.quant.linears import HAS_INT4_KERNEL, Int4HalvesLinear, Int4KernelLinear, Int4Linear
from llama.quant.quantize import quantize_weight

METHODS = ["int8", "int4"]
ROWS = [1, 2, 3, 4, 32]
needs_compiler = pytest.mark.skipif(shutil.which(os.environ.get("CXX", "g++")) is None,
                                    reason="--compile needs a C++ compiler")


def quantized_layers(model):
    """(name, layer) of every quantized layer of a model: those whose state holds scales."""
    names = {k.removesuffix(".scales") for k in model.state_dict() if k.endswith(".scales")}
    assert len(names) == 2 * 7 + 1  # every projection and the output layer
    return [(name, model.get_submodule(name)) for name in sorted(names)]


def stored_weight(layer) -> torch.Tensor:
    return dequantize_stored(layer.state_dict(), "")


def assert_multiplies_by(layer, weight, x, tolerance):
    """layer(x) equals x @ weight.T, computed in float64, within `tolerance` of the output's largest value."""
    with torch.inference_mode():
        got = layer(x).double()
    want = x.double() @ weight.double().T
    assert got.shape == want.shape
    error = ((got - want).abs().max() / want.abs().max()).item()
    assert error <= tolerance, f"{x.shape[1]} rows: off by {error:.2e} of the largest output"


@pytest.fixture(scope="module")
def models(gqa_ckpt):
    return {(m, dtype): build(gqa_ckpt, quantize=m, dtype=dtype, quant_kernels="exact").model
            for m in METHODS for dtype in ("float32", "bfloat16")}


@pytest.mark.parametrize("method", METHODS)
def test_stored_values_are_the_float_weights_within_half_a_step(gqa_ckpt, models, method):
    float_state = build(gqa_ckpt).model.state_dict()
    for name, layer in quantized_layers(models[method, "float32"]):
        w = float_state[f"{name}.weight"].float()
        stored = stored_weight(layer)
        group = layer.in_features // layer.state_dict()["scales"].shape[1]
        g = w.reshape(w.shape[0], -1, group)
        # The grid's step: max |w| / 127 per row for int8, (max - min) / 15 per group for int4.
        if method == "int8":
            step = g.abs().amax(-1) / 127
        else:
            step = (g.amax(-1) - g.amin(-1)) / 15
        step = step.repeat_interleave(group, dim=1)
        # Half a step, and the float16 rounding of the scale (and of int4's min): 2^-11 of the group's largest.
        bound = step / 2 + 2 ** -10 * g.abs().amax(-1).repeat_interleave(group, dim=1)
        assert ((stored - w).abs() <= bound).all(), name
        assert not torch.equal(stored, w)  # rounded: the comparison is not of a tensor with itself


@pytest.mark.parametrize("kernels", [True, False], ids=["kernels", "no-kernels"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("method", METHODS)
def test_a_layer_multiplies_by_its_stored_values(models, method, dtype, kernels):
    """In float32 the paths are exact up to the order of additions (measured: within 5e-7 of the largest
    output). In bf16 the activations and the output are rounded to 8 significant bits and the kernels' scales
    to bf16 (measured: within 5.3e-3); 2^-6 leaves room for that and still fails a weight 3% off."""
    tolerance = 1e-5 if dtype == "float32" else 2 ** -6
    model = models[method, dtype] if kernels else choose_layer_classes(copy.deepcopy(models[method, dtype]), kernels=False)
    for name, layer in quantized_layers(model):
        weight = stored_weight(layer)
        for rows in ROWS:
            x = torch.randn(1, rows, layer.in_features, generator=torch.Generator().manual_seed(rows))
            assert_multiplies_by(layer, weight, x.to(getattr(torch, dtype)), tolerance)


@pytest.mark.slow
@needs_compiler
@pytest.mark.parametrize("method", METHODS)
def test_a_compiled_layer_multiplies_by_its_stored_values(gqa_ckpt, method):
    """Compiled, up to 4 rows reduce over the packed values in registers; more rows widen the weight."""
    model = build(gqa_ckpt, quantize=method, compile=True, quant_kernels="exact").model  # its layers in the layouts compiled runs read
    for name in ("layers.0.feed_forward.w1", "layers.1.feed_forward.w2", "output"):
        layer = model.get_submodule(name)
        weight = stored_weight(layer)
        # Afresh for each layer: dynamo compiles one function (here every layer's forward) at most 8 times in a
        # process, and fullgraph=True makes the 9th an error rather than an eager fallback.
        torch._dynamo.reset()
        compiled = torch.compile(layer, fullgraph=True)
        for rows in ROWS:
            x = torch.randn(1, rows, layer.in_features, generator=torch.Generator().manual_seed(rows))
            assert_multiplies_by(compiled, weight, x, 1e-5)


# --- the quantizer, and the int4 layer's layouts ------------------------------------------------------


@pytest.mark.parametrize("method", METHODS)
def test_quantization_error_is_what_the_format_allows(method):
    w = torch.randn(96, 256, generator=torch.Generator().manual_seed(0))
    tensors = quantize_weight(w, method, None if method == "int8" else 32)
    dequantized = qf.dequantize(tensors["weight"], tensors["scales"], tensors.get("mins"))
    # Half a step of the grid: int8's step is max|w| / 127 per row, int4's (max - min) / 15 per group
    # (plus float16 rounding of the scale itself).
    if method == "int8":
        step = w.abs().amax(dim=1, keepdim=True) / 127
    else:
        g = w.reshape(96, 8, 32)
        step = ((g.amax(-1) - g.amin(-1)) / 15).repeat_interleave(32, dim=1)
    assert ((dequantized - w).abs() <= step * 0.5 * 1.01 + 1e-3 * step).all()


def test_quantizing_in_chunks_equals_quantizing_at_once(monkeypatch):
    import llama.quant.quantize as quantize

    w = torch.randn(64, 96, generator=torch.Generator().manual_seed(2))
    whole = quantize_weight(w, "int4", 32)
    monkeypatch.setattr(quantize, "_CHUNK_ELEMENTS", 96 * 5)  # five rows at a time, the last chunk short
    chunked = quantize_weight(w, "int4", 32)
    for name in whole:
        assert torch.equal(whole[name], chunked[name])


def test_int4_kernel_layout_gives_back_the_stored_values(models, gqa_ckpt):
    assert type(models["int4", "float32"].layers[0].feed_forward.w1) is Int4Linear  # float32 eager runs keep the format
    layer = models["int4", "bfloat16"].layers[0].feed_forward.w1
    assert type(layer) is (Int4KernelLinear if HAS_INT4_KERNEL else Int4Linear)
    fresh = Int4Linear(layer.in_features, layer.out_features, layer.group_size)
    fresh.load_state_dict(layer.state_dict(), assign=True)
    assert torch.equal(fresh.weight, layer.format_tensors()["weight"])
    if not HAS_INT4_KERNEL:
        return
    repacked = Int4KernelLinear.from_layer(fresh, torch.bfloat16)
    assert torch.equal(repacked.weight, layer.weight)
    assert torch.equal(repacked.format_tensors()["weight"], layer.format_tensors()["weight"])
    # The kernel's scales replace the format's, which are not held twice.
    assert layer.scales is None and layer.mins is None
    exact = models["int4", "float32"].layers[0].feed_forward.w1  # float32: the format's own scales
    tensors, want = layer.format_tensors(), (exact.scales.float(), exact.mins.float())
    scales, mins = tensors["scales"], tensors["mins"]
    # The kernel holds each scale and zero point (min + 8 * scale) in bf16: 2^-9 relative rounding each.
    torch.testing.assert_close(scales.float(), want[0], rtol=2 ** -8, atol=1e-6)
    # (as large as a rounding of min and of 8 * scale, where the two nearly cancel)
    zero_error = (mins.float() + 8 * scales.float() - (want[1] + 8 * want[0])).abs()
    assert (zero_error <= 2 ** -8 * (want[1].abs() + 8 * want[0].abs()) + 1e-6).all()


def test_every_int4_layout_holds_the_same_values(models, monkeypatch):
    """format -> halves -> kernel -> halves -> format: the values, scales and state_dict never change, also
    when a layer is re-packed a slice of rows at a time."""
    import llama.quant.linears as linears

    layer = models["int4", "float32"].layers[0].feed_forward.w1
    assert layer.out_features == 192
    monkeypatch.setattr(linears, "_CHUNK_ELEMENTS", 64 * layer.in_features)  # three slices of 64 rows
    state = {k: v.clone() for k, v in layer.state_dict().items()}
    fresh = Int4Linear(layer.in_features, layer.out_features, layer.group_size)
    fresh.load_state_dict(state, assign=True)
    want = fresh.dequantized()
    halves = Int4HalvesLinear.from_layer(fresh, torch.float32)
    assert not torch.equal(halves.weight, state["weight"])
    # Byte j of group g holds columns 32g + j (low nibble) and 32g + 16 + j (high nibble).
    values = qf.unpack_int4(state["weight"])
    assert torch.equal(halves.weight[:, 0] & 15, values[:, 0]) and torch.equal(halves.weight[:, 0] >> 4, values[:, 16])
    assert torch.equal(halves.dequantized(), want)
    for name, tensor in halves.state_dict().items():
        assert torch.equal(tensor, state[name]), name
    if HAS_INT4_KERNEL:  # from the halves layout to the kernel's, and back
        back = Int4HalvesLinear.from_layer(Int4KernelLinear.from_layer(halves, torch.bfloat16), torch.float32)
        assert torch.equal(back.weight, halves.weight)
        assert torch.equal(Int4Linear.from_layer(back, torch.float32).weight, state["weight"])


@pytest.mark.slow
@needs_compiler
def test_a_compiled_int4_layer_in_another_layout_widens_its_weight(models):
    """Only the halves layout has a compiled reduction; a layer held otherwise (the stored format here, or
    the kernel's with the kernels switched off) computes exactly, by widening, rather than failing."""
    layer = copy.deepcopy(models["int4", "float32"].layers[0].feed_forward.w1)
    assert type(layer) is Int4Linear
    x = torch.randn(1, 1, layer.in_features, generator=torch.Generator().manual_seed(0))
    torch._dynamo.reset()  # as above: not the 9th compilation of the layers' forward in this process
    assert_multiplies_by(torch.compile(layer, fullgraph=True), stored_weight(layer), x, 1e-5)
