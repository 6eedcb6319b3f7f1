"""Which class every linear layer of a loaded model becomes, decided once where the model is loaded.

`plan_layers` is a pure function of what it is given: what each linear layer holds (`LayerSpec`, read off the
model by `describe_layers`), the activations' dtype, the device, whether the decode step will be compiled, which
kernels the process has (`Kernels`, looked up by the loader, never inside), whether quantized layers should run
on the integer kernels, whether projections of one input may become one product and whether re-packed layers go
on 2 MiB pages. Its `LayerPlan` is data a test can read: each layer's class, the modules whose projections become
one product (llama/quant/fuse.py), and whether attention, the rotary embedding and the norms become row-exact
(llama/nn/row_attention.py). `apply_layer_plan` carries it out, once per load; it is the one place where a
module's class is changed.

A model whose decode step will be compiled is planned for it when it loads (`compiled`), and its eager steps
(the prompt, and every step while the stored step is still being built in the background) run on the same
classes: a compiled class's own path runs only while the step is traced (`llama.kv_cache.being_traced`), and
eagerly it is the plain product of the same weights, or the kernel it names. One plan therefore serves both
steps, and the eager and stored steps of the default mode multiply with the same layers.
"""

from contextlib import nullcontext
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Dict, Mapping, Optional, Tuple

import torch
from torch import nn

from llama import kernels as kernel_ops
from llama.model import RMSNorm, Rotary, ScaledDotProductAttention
from llama.nn.row_attention import KernelAttention, RowExactAttention, RowExactRMSNorm, RowExactRotary
from llama.quant import fuse
from llama.quant.dot_linears import (DotLinear, Int4DotLinear, Int4ZeroPointDotLinear, Int8DotLinear,
                                     Int8Group16DotLinear, dot_class, minimums_are_minus_8_scales)
from llama.quant.layer import QuantizedLinear
from llama.quant.linears import (HAS_INT4_KERNEL, HAS_INT8_KERNEL, INT4_KERNEL_GROUPS, INT4_ROW_BLOCK,
                                 Int4HalvesLinear, Int4KernelLinear, Int4Linear, Int8KernelLinear, Int8Linear,
                                 MulSumLinear, RowExactInt4Linear, RowExactInt8Linear, RowExactLinear,
                                 RowExactWidening, FewRowsLinear)
from llama.runtime.pages import return_free_memory, shared_huge_pages


@dataclass(frozen=True)
class LinearClass:
    """One row of the table of linear-layer classes."""

    cls: type
    holds: str
    multiplies: str
    chosen: str


# Every class a linear layer can become (llama/quant/linears.py, llama/quant/dot_linears.py): `plan_layers` chooses
# among these and no others. "Compiled" means the model is planned for a compiled CPU decode step.
LINEAR_CLASSES = (
    LinearClass(nn.Linear, "float (out, in)", "F.linear",
                "float weights, unless compiled on the CPU"),
    LinearClass(MulSumLinear, "float, row-major",
                "a multiply-and-sum Inductor turns into one loop, at up to REDUCTION_MAX_ROWS rows when compiled",
                "float weights compiled on the CPU, where FewRowsLinear is not"),
    LinearClass(FewRowsLinear, "float32, row-major",
                "llama_kv.f32_linear at 1 to FEW_ROWS_MAX rows (each weight row read once for all); more, "
                "oneDNN's GEMM eagerly where torch has it (onednn_linear), else F.linear",
                "float32 weights compiled on the CPU, with llama/kernels loaded and the weight row-major"),
    LinearClass(RowExactLinear, "float32, row-major", "llama_kv.f32_linear at every row count, eager and compiled",
                "float32 weights on the CPU with llama/kernels loaded, where keys and values are rounded to int8"),
    LinearClass(Int8Linear, "int8 + float16 scales",
                "widening the weight, then F.linear; compiled on the CPU, at a few rows a reduction dequantizing in "
                "registers", "int8 where none of the classes below is"),
    LinearClass(Int8KernelLinear, "the same, + the scales in the activations' dtype",
                "aten._weight_int8pack_mm (float32: at a few rows only)",
                "per-channel int8 on the CPU with torch's kernel, in bf16, or in float32 eagerly"),
    LinearClass(RowExactInt8Linear, "the same as Int8Linear", "widening the weight, then llama_kv.f32_linear",
                "int8 off the integer kernels in float32 on the CPU with llama/kernels loaded, under an int8 KV cache"),
    LinearClass(Int4Linear, "int4, two values a byte, column 2j low", "widening the weight, then F.linear",
                "int4 where none of the classes below is"),
    LinearClass(RowExactInt4Linear, "the same as Int4Linear", "widening the weight, then llama_kv.f32_linear",
                "int4 off the integer kernels in float32 on the CPU with llama/kernels loaded, under an int8 KV cache"),
    LinearClass(Int4HalvesLinear, "int4, a group's first half low, its second high (GGUF's Q4 order)",
                "widening; compiled, the reduction", "int4 compiled on the CPU, where Int4KernelLinear is not"),
    LinearClass(Int4KernelLinear, "aten's own int4 packing, bf16 scales and zero points",
                "aten._weight_int4pack_mm_for_cpu",
                "int4 on the CPU in bf16 with torch's kernel, groups of 32 to 256, rows a multiple of 64"),
    LinearClass(Int8DotLinear, "int8 blocks of 32, 8 rows interleaved",
                "llama_kv.q8_0_linear: activations rounded to int8 blocks, integer dot products",
                "int8 on the CPU on the integer kernels (float32 or bf16, groups a multiple of 32)"),
    LinearClass(Int8Group16DotLinear, "int8 blocks of 32 with a scale for each half, 8 rows interleaved",
                "llama_kv.q8_16_linear, each half's sum scaled apart",
                "int8 in groups of 16 (a GGUF's Q6_K) on the integer kernels"),
    LinearClass(Int4DotLinear, "int4 blocks of 32 + scales and minimums, 16 rows interleaved in one stream",
                "llama_kv.q4_1_linear", "int4 on the integer kernels (groups a multiple of 32)"),
    LinearClass(Int4ZeroPointDotLinear, "the same without the minimums (each -8 times its scale)",
                "llama_kv.q4_0_linear", "int4 on the integer kernels whose minimums are all -8 times their scales "
                "(a GGUF's Q4_0)"),
)


@dataclass(frozen=True)
class Kernels:
    """The kernels a plan may choose beyond torch's own products; the loader says which the process has."""

    llama_kv: bool = False  # llama/kernels is loaded: the integer kernels, f32_linear, row-exact attention
    int8pack: bool = False  # torch's aten._weight_int8pack_mm
    int4pack: bool = False  # torch's aten._weight_int4pack_mm_for_cpu and its packing

    @staticmethod
    def here() -> "Kernels":
        """What this process has now; loads nothing (`llama.kernels.load()` first, to have ours)."""
        return Kernels(kernel_ops.loaded(), HAS_INT8_KERNEL, HAS_INT4_KERNEL)


@dataclass(frozen=True)
class LayerSpec:
    """What the plan needs to know of one linear layer."""

    in_features: int
    out_features: int
    method: str = ""  # "int8" or "int4"; "" for float weights
    group_size: Optional[int] = None  # None: one scale per row
    row_major: bool = True  # float: its weight contiguous as (out, in), as the compiled reductions read it
    integer: bool = False  # on the integer kernels now (`integer=None` keeps it there)
    zero_point: bool = False  # int4 whose minimums are all -8 times their scales (a GGUF's Q4_0)
    hooked: bool = False  # has forward hooks (model parallelism's): never one product with others

    @property
    def n_groups(self) -> int:
        return 1 if self.group_size is None else self.in_features // self.group_size


@dataclass(frozen=True)
class LayerPlan:
    """What `apply_layer_plan` makes of a model: each linear layer's class by module name, the modules whose
    projections become one product (module name -> its fused class, llama/quant/fuse.py), and whether attention, the
    rotary embedding and the norms are the row-exact ones."""

    dtype: torch.dtype  # the activations', which re-packing needs
    classes: Mapping[str, type] = field(default_factory=dict)
    fused: Mapping[str, type] = field(default_factory=dict)
    row_exact: bool = False
    kernel_attention: bool = False  # attention through llama/kernels where it reads a cache's rows (`KernelAttention`)
    pages: bool = True  # re-packed layers under 2 MiB side by side on 2 MiB pages (llama/runtime/pages.py)


def plan_layers(layers: Mapping[str, LayerSpec], dtype: torch.dtype, device: str, compiled: bool, have: Kernels,
                integer: Optional[bool] = None, groups: Mapping[str, type] = MappingProxyType({}), fuse: bool = True,
                pages: bool = True, row_exact_float: bool = False) -> LayerPlan:
    """The class of every linear layer, decided from what it is given alone.

    Args:
        layers: module name -> what that linear layer holds (`describe_layers`).
        dtype: the activations' dtype (the model's).
        device: the model's device type, "cpu" or "cuda".
        compiled: the decode step will be compiled (llama/compile): on the CPU, the classes with compiled paths.
        have: the kernels the process has; `Kernels()` keeps every quantized layer on the exact widening paths
            (tests turn the kernels off this way).
        integer: quantized layers run on the integer kernels (llama/quant/dot_linears.py) where they can hold
            them; False keeps them on the exact weight-only paths; None keeps each on the family it is in.
        groups: module name -> its fused class, for the modules whose projections could be one product
            (`describe_layers`); they are where the projections all become one integer-kernel class that can
            join them, unless `fuse` is False.
        pages: re-packed layers go on 2 MiB pages.
        row_exact_float: float32 layers too become row-exact (`RowExactLinear`, and quantized ones off the integer
            kernels `RowExactInt8Linear` / `RowExactInt4Linear`), with attention, the rotary embedding and the
            norms: asked where keys and values are rounded to int8, so that a position computed alone and among
            others rounds them alike.
    """
    cpu = device == "cpu"
    classes = {name: _layer_class(spec, dtype, cpu, compiled, have, integer, row_exact_float)
               for name, spec in layers.items()}
    fused = {}
    for parent, fused_class in (groups.items() if fuse else ()):
        names = [f"{parent}.{n}" if parent else n for n in fused_class.names]
        specs = [layers.get(n) for n in names]
        if any(s is None or s.hooked or not s.method for s in specs):
            continue
        cls = classes[names[0]]
        if all(classes[n] is cls for n in names) and issubclass(cls, DotLinear) and cls.can_join(specs):
            fused[parent] = fused_class
    row_exact = any(issubclass(cls, (DotLinear, RowExactLinear, RowExactWidening)) for cls in classes.values())
    return LayerPlan(dtype, MappingProxyType(classes), MappingProxyType(fused), row_exact, cpu and have.llama_kv, pages)


def row_exact_floats(row_exact_float: bool, dtype: torch.dtype, cpu: bool, have: Kernels) -> bool:
    """Whether `row_exact_float` can be had: float32 on the CPU with llama/kernels loaded (`llama_kv.f32_linear`). The
    loader asks it too, to keep such weights row-major."""
    return row_exact_float and cpu and have.llama_kv and dtype == torch.float32


def _layer_class(spec: LayerSpec, dtype: torch.dtype, cpu: bool, compiled: bool, have: Kernels,
                 integer: Optional[bool], row_exact_float: bool = False) -> type:
    """One layer's class: `LINEAR_CLASSES`' "chosen" column, in code."""
    row_exact_float = row_exact_floats(row_exact_float, dtype, cpu, have)
    if not spec.method:
        if row_exact_float and spec.row_major:
            return RowExactLinear
        if not (cpu and compiled):
            return nn.Linear
        return FewRowsLinear if have.llama_kv and dtype == torch.float32 and spec.row_major else MulSumLinear
    if spec.integer if integer is None else integer:
        if cpu and have.llama_kv and dtype in (torch.float32, torch.bfloat16):
            cls = dot_class(spec.method, spec.in_features, spec.group_size, spec.zero_point)
            if cls is not None:
                return cls
    if row_exact_float:
        return RowExactInt8Linear if spec.method == "int8" else RowExactInt4Linear
    if spec.method == "int8":
        kernel = cpu and have.int8pack and spec.n_groups == 1
        if kernel and (dtype == torch.bfloat16 or (dtype == torch.float32 and not compiled)):
            return Int8KernelLinear
        return Int8Linear
    if cpu and have.int4pack and dtype == torch.bfloat16 and spec.group_size in INT4_KERNEL_GROUPS \
            and spec.out_features % INT4_ROW_BLOCK == 0:
        return Int4KernelLinear
    return Int4HalvesLinear if cpu and compiled else Int4Linear


_LINEAR = (nn.Linear, QuantizedLinear)


def describe_layers(model: nn.Module) -> Tuple[Dict[str, LayerSpec], Dict[str, type]]:
    """`plan_layers`' `layers` and `groups` for a loaded model: what each linear layer holds, and the modules
    whose projections could become one product."""
    layers, groups = {}, {}
    for name, module in model.named_modules():
        if isinstance(module, _LINEAR):
            layers[name] = _spec(module)
        elif type(module) in fuse.FUSED:
            groups[name] = fuse.FUSED[type(module)]
    return layers, groups


def _spec(layer: nn.Module) -> LayerSpec:
    hooked = bool(layer._forward_hooks)
    if isinstance(layer, nn.Linear):
        return LayerSpec(layer.in_features, layer.out_features, row_major=layer.weight.is_contiguous(), hooked=hooked)
    if isinstance(layer, Int4DotLinear):
        zero_point = isinstance(layer, Int4ZeroPointDotLinear)  # chosen already: it stays
    else:
        # Only where the integer kernels could hold it: reading the minimums back costs a pass over them.
        zero_point = (layer.method == "int4" and layer.weight.device.type == "cpu"
                      and dot_class("int4", layer.in_features, layer.group_size, True) is not None
                      and minimums_are_minus_8_scales(layer))
    return LayerSpec(layer.in_features, layer.out_features, layer.method, layer.group_size,
                     integer=isinstance(layer, DotLinear), zero_point=zero_point, hooked=hooked)


def apply_layer_plan(model: nn.Module, plan: LayerPlan) -> nn.Module:
    """Make `model` what `plan` says, in place; returns it.

    Quantized layers are re-packed into their new class's layout (the old tensors are dropped) and keep their
    forward hooks; float ones only change class (the same parameters, the same state_dict). Attention, the rotary
    embedding and the norms hold nothing: a change of class is all they take.
    """
    # The parents only: a list of every module would hold each old layer until the end, the model twice.
    parents = [(name, m) for name, m in model.named_modules() if any(isinstance(c, _LINEAR) for c in m.children())]
    with shared_huge_pages() if plan.pages else nullcontext():
        for prefix, parent in parents:
            repacked = False
            fused_class = plan.fused.get(prefix)
            if fused_class is not None:
                first = f"{prefix}.{fused_class.names[0]}" if prefix else fused_class.names[0]
                if fuse.fuse(parent, fused_class, plan.classes[first], plan.dtype):
                    parent.__class__ = fused_class
                    repacked = True
            for name in [n for n, c in parent.named_children() if isinstance(c, _LINEAR)]:
                layer, cls = getattr(parent, name), plan.classes.get(f"{prefix}.{name}" if prefix else name)
                if cls is None or type(layer) is cls:  # None: made one product above
                    continue
                if isinstance(layer, nn.Linear):
                    layer.__class__ = cls
                    continue
                new = cls.from_layer(layer, plan.dtype)
                new._forward_hooks.update(layer._forward_hooks)
                setattr(parent, name, new)
                repacked = True
            layer = new = None
            if repacked:
                # Hand the old layers' freed heap memory back now: the integer kernels' new ones live in mappings
                # of their own (2 MiB pages, llama/runtime/pages.py), which would not reuse it.
                return_free_memory()
    # Row-exact where the integer kernels run, or keys and values are rounded to int8 (`row_exact_float`): either
    # rounding would amplify any difference between a position computed alone and among others, or compiled and
    # eager; torch's own ops otherwise.
    attention = RowExactAttention if plan.row_exact else KernelAttention if plan.kernel_attention else \
        ScaledDotProductAttention
    swaps = {ScaledDotProductAttention: attention, Rotary: RowExactRotary if plan.row_exact else Rotary,
             RMSNorm: RowExactRMSNorm if plan.row_exact else RMSNorm}
    for module in model.modules():
        for plain, chosen in swaps.items():
            if isinstance(module, plain):
                module.__class__ = chosen
                break
    return model


def choose_layer_classes(model: nn.Module, compiled: bool = False, kernels: bool = True,
                         integer: Optional[bool] = None) -> nn.Module:
    """Plan a model built in memory (`quantize_model`, tests) with the kernels this process has, and apply the plan;
    returns the model. `kernels=False` plans with none; the integer kernels are loaded (built the first time) where
    a quantized CPU layer asks for them."""
    layers, groups = describe_layers(model)
    dtype, device = model.dtype, model.device.type
    if kernels and device == "cpu" and dtype in (torch.float32, torch.bfloat16) and any(
            s.method and (s.integer if integer is None else integer) for s in layers.values()):
        kernel_ops.load()
    have = Kernels.here() if kernels else Kernels()
    return apply_layer_plan(model, plan_layers(layers, dtype, device, compiled, have, integer, groups))


def layer_class(layer: nn.Module, dtype: torch.dtype, compiled: bool, kernels: bool = True,
                integer: Optional[bool] = None) -> type:
    """`plan_layers`' class for one layer, with the kernels this process has (loading ours where it asks for them)."""
    spec = _spec(layer)
    device = layer.weight.device.type
    if kernels and device == "cpu" and spec.method and (spec.integer if integer is None else integer):
        kernel_ops.load()
    return _layer_class(spec, dtype, device == "cpu", compiled, Kernels.here() if kernels else Kernels(), integer)
