"""llama/quant/layer_plan.py: which class each linear layer becomes, as a pure function of what it is given."""

import itertools

import pytest
import torch
from torch import nn

from llama.quant.dot_linears import (Int4DotLinear, Int4ZeroPointDotLinear, Int8DotLinear, Int8Group16DotLinear)
from llama.quant.fuse import FusedAttention, FusedFeedForward
from llama.quant.layer_plan import LINEAR_CLASSES, Kernels, LayerSpec, plan_layers
from llama.quant.linears import (Int4HalvesLinear, Int4KernelLinear, Int4Linear, Int8KernelLinear, Int8Linear,
                                 MulSumLinear, RowExactInt4Linear, RowExactInt8Linear, RowExactLinear,
                                 FewRowsLinear)

ALL = Kernels(llama_kv=True, int8pack=True, int4pack=True)
FLOAT = LayerSpec(64, 64)
INT8 = LayerSpec(64, 64, "int8")
INT4 = LayerSpec(64, 64, "int4", 32)


def one(spec, dtype=torch.float32, device="cpu", compiled=False, have=ALL, integer=None, row_exact_float=False):
    return plan_layers({"w": spec}, dtype, device, compiled, have, integer, row_exact_float=row_exact_float).classes["w"]


def test_float_layers_take_the_reductions_only_compiled_on_the_cpu():
    assert one(FLOAT) is nn.Linear
    assert one(FLOAT, device="cuda", compiled=True) is nn.Linear
    assert one(FLOAT, compiled=True) is FewRowsLinear
    assert one(FLOAT, compiled=True, have=Kernels()) is MulSumLinear
    assert one(FLOAT, torch.bfloat16, compiled=True) is MulSumLinear
    assert one(LayerSpec(64, 64, row_major=False), compiled=True) is MulSumLinear


def test_float32_layers_become_row_exact_where_asked_and_the_kernels_can():
    """row_exact_float (an int8 KV cache): float32 CPU layers on f32_linear at every row count, eager or compiled
    (quantized ones off the integer kernels too, widened), and attention, the rotary embedding and the norms with
    them; not in bf16, on a GPU, or without the kernels."""
    for compiled in (False, True):
        assert one(FLOAT, compiled=compiled, row_exact_float=True) is RowExactLinear
        assert plan_layers({"w": FLOAT}, torch.float32, "cpu", compiled, ALL, row_exact_float=True).row_exact
    assert one(FLOAT, torch.bfloat16, row_exact_float=True) is nn.Linear
    assert one(FLOAT, device="cuda", row_exact_float=True) is nn.Linear
    assert one(FLOAT, have=Kernels(), row_exact_float=True) is nn.Linear
    assert not plan_layers({"w": FLOAT}, torch.float32, "cpu", False, Kernels(), row_exact_float=True).row_exact
    assert one(LayerSpec(64, 64, row_major=False), row_exact_float=True) is nn.Linear
    assert one(INT8, integer=True, row_exact_float=True) is Int8DotLinear  # the integer kernels are row-exact already
    for integer in (None, False):  # off them: the widened weight on f32_linear
        assert one(INT8, integer=integer, row_exact_float=True) is RowExactInt8Linear
        assert one(INT4, integer=integer, row_exact_float=True) is RowExactInt4Linear
        assert plan_layers({"w": INT4}, torch.float32, "cpu", False, ALL, integer, row_exact_float=True).row_exact
    assert one(INT8, torch.bfloat16, integer=False, row_exact_float=True) is one(INT8, torch.bfloat16, integer=False)


def test_int8_on_torchs_kernel_the_widening_path_or_the_integer_kernels():
    assert one(INT8) is Int8KernelLinear  # eager float32: the kernel's exact loop at a few rows
    assert one(INT8, compiled=True) is Int8Linear  # compiled float32: the reduction
    assert one(INT8, torch.bfloat16, compiled=True) is Int8KernelLinear
    assert one(INT8, have=Kernels()) is Int8Linear
    assert one(LayerSpec(64, 64, "int8", 32)) is Int8Linear  # groups: not the per-channel kernel
    assert one(INT8, device="cuda", integer=True) is Int8Linear
    assert one(INT8, integer=True) is Int8DotLinear
    assert one(INT8, torch.float16, integer=True) is Int8Linear
    assert one(LayerSpec(64, 64, "int8", 16), integer=True) is Int8Group16DotLinear
    assert one(LayerSpec(64, 64, "int8", 8), integer=True) is Int8Linear  # no blocks of 32
    assert one(INT8, integer=True, have=Kernels(int8pack=True)) is Int8KernelLinear  # ours could not be loaded


def test_int4_and_the_family_a_layer_is_in():
    assert one(INT4, torch.bfloat16) is Int4KernelLinear
    assert one(LayerSpec(64, 48, "int4", 32), torch.bfloat16) is Int4Linear  # rows not in blocks of 64
    assert one(INT4) is Int4Linear and one(INT4, compiled=True) is Int4HalvesLinear
    assert one(INT4, integer=True) is Int4DotLinear
    assert one(LayerSpec(64, 64, "int4", 32, zero_point=True), integer=True) is Int4ZeroPointDotLinear
    on_kernels = LayerSpec(64, 64, "int4", 32, integer=True)
    assert one(on_kernels) is Int4DotLinear and one(on_kernels, integer=False) is Int4Linear


def _block(spec, hooked=(), **specs):
    layers = {f"attention.{n}": LayerSpec(spec.in_features, s, spec.method, spec.group_size, hooked=n in hooked)
              for n, s in (("wq", 64), ("wk", 32), ("wv", 32))}
    layers.update({f"feed_forward.{n}": LayerSpec(64, specs.get(n, 128), spec.method, spec.group_size)
                   for n in ("w1", "w2", "w3")})
    return layers, {"attention": FusedAttention, "feed_forward": FusedFeedForward}


def test_projections_of_one_input_become_one_product_on_the_integer_kernels_only():
    layers, groups = _block(INT8)
    plan = plan_layers(layers, torch.float32, "cpu", False, ALL, True, groups)
    assert dict(plan.fused) == groups and plan.row_exact
    assert plan_layers(layers, torch.float32, "cpu", False, ALL, True, groups, fuse=False).fused == {}
    exact = plan_layers(layers, torch.float32, "cpu", False, ALL, False, groups)
    assert exact.fused == {} and not exact.row_exact
    hooked, _ = _block(INT8, hooked=("wk",))
    assert dict(plan_layers(hooked, torch.float32, "cpu", False, ALL, True, groups).fused) == \
        {"feed_forward": FusedFeedForward}
    wide, _ = _block(INT4, w1=200)  # 200 rows are no whole number of 16-row units
    assert dict(plan_layers(wide, torch.float32, "cpu", False, ALL, True, groups).fused) == \
        {"attention": FusedAttention}
    floats, _ = _block(LayerSpec(64, 64))
    assert plan_layers(floats, torch.float32, "cpu", True, ALL, True, groups).fused == {}


def test_every_class_the_plan_chooses_is_in_the_table_and_every_row_is_chosen():
    specs = [FLOAT, LayerSpec(64, 64, row_major=False), INT8, LayerSpec(64, 64, "int8", 16), INT4,
             LayerSpec(64, 64, "int4", 32, zero_point=True), LayerSpec(64, 64, "int4", 32, integer=True)]
    chosen = set()
    for spec, dtype, device, compiled, have, integer, row_exact_float in itertools.product(
            specs, (torch.float32, torch.bfloat16, torch.float16), ("cpu", "cuda"), (False, True),
            (ALL, Kernels()), (None, False, True), (False, True)):
        chosen.add(one(spec, dtype, device, compiled, have, integer, row_exact_float))
    table = [row.cls for row in LINEAR_CLASSES]
    assert len(table) == len(set(table)) and chosen == set(table)


def test_the_plan_is_data():
    plan = plan_layers({"w": INT8}, torch.float32, "cpu", False, ALL)
    with pytest.raises(Exception):
        plan.row_exact = True
    with pytest.raises(TypeError):
        plan.classes["w"] = nn.Linear
