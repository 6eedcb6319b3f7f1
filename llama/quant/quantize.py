"""Weight-only quantization as a transform applied to a built model: its linear layers swapped for int8 / int4 ones.

`swap_linears` replaces each `nn.Linear` named in a plan with an `Int8Linear` or `Int4Linear`
(llama/quant/linears.py) holding the tensors of `llama/quant/format.py` as buffers (`weight`, `scales`, `mins`),
so the quantized model's `state_dict()` is exactly the on-disk layout. The norms stay float, and so does
the embedding unless the checkpoint stores it quantized (a GGUF's blocks kept; llama/quant/embedding.py swaps
it). `model.py` knows none of this; forward hooks (model parallelism's all-reduce and all-gather) move to
the new layers. Loading then gives each layer the class that multiplies fastest where it runs, from its layer
plan (llama/quant/layer_plan.py).

The one quantizer here serves loading (`--quantize`), `quantize_model` and `llama-convert --quantize`:
int8 with one scale per output channel, int4 with a scale and a minimum per group of 32 columns (GGUF's
Q4 block); a weight whose width 32 does not divide gets the largest even group that does.

On the CPU the layers then run, by default, on the integer kernels (`quant_kernels="integer"`, llama/kernels:
activations rounded to int8 blocks too, integer dot products); `quant_kernels="exact"` keeps the weight-only
paths, which multiply the float activations by the dequantized weights.
"""

import math
from typing import Dict, Optional

import torch
from torch import nn

from llama.errors import LlamaError
from llama.quant.layer import QuantizedLinear
from llama.quant.linears import HAS_INT4_KERNEL, HAS_INT8_KERNEL, Int4Linear, Int8Linear
from llama.quant.layer_plan import choose_layer_classes
from llama.quant.format import (DEFAULT_INT4_GROUP_SIZE, EMBEDDING_WEIGHT, METHODS, Plan, is_linear_weight,
                                quantize_int4, quantize_int8)

# What quantized layers multiply with: "integer" (llama/quant/dot_linears.py, where the kernels run) or "exact"
# (the weight-only paths of llama/quant/linears.py).
QUANT_KERNELS = ("integer", "exact")

# Quantize a float weight this many elements at a time, so that quantizing a 32000 x 4096 output layer needs
# some tens of MB of scratch, not several times the layer in float32.
_CHUNK_ELEMENTS = 1 << 22


def check_method(quantize: Optional[str]) -> Optional[str]:
    """`quantize` checked to be None, "int8" or "int4".

    Raises:
        LlamaError: any other value, in one line that lists the choices.
    """
    if quantize is None or quantize in METHODS:
        return quantize
    raise LlamaError(f"unknown quantization {quantize!r}; choose one of {', '.join(METHODS)} (or leave it out for float)")


def check_quant_kernels(quant_kernels: str) -> str:
    """`quant_kernels` checked to be "integer" or "exact".

    Raises:
        LlamaError: any other value, in one line that lists the choices.
    """
    if quant_kernels in QUANT_KERNELS:
        return quant_kernels
    raise LlamaError(f"unknown quant_kernels={quant_kernels}; choose one of {', '.join(QUANT_KERNELS)}")


def group_size_for(method: str, in_features: int, group_size: Optional[int] = None, name: str = "a weight") -> Optional[int]:
    """The group size `method` quantizes a weight of `in_features` columns with.

    int8: per output channel (None) unless `group_size` is given. int4: `group_size` if given, else 32, or
    where 32 does not divide the width, the largest group that does (so any even width can be int4).

    Raises:
        LlamaError: a given group size that is odd (int4) or does not divide the width, or an int4 weight of
            an odd width, which cannot be packed in pairs.
    """
    if group_size is None and method == "int4":
        group_size = math.gcd(DEFAULT_INT4_GROUP_SIZE, in_features)
        if group_size % 2:
            raise LlamaError(f"int4 packs columns in pairs, and {name} has {in_features} input columns; "
                             "use quantize=int8")
    if group_size is None:
        return None
    if method == "int4" and group_size % 2:
        raise LlamaError(f"int4 packs columns in pairs within each group; a group of {group_size} columns is odd")
    if in_features % group_size:
        raise LlamaError(f"{name} has {in_features} input columns, not a multiple of the group size {group_size}")
    return group_size


def describe_plan(plan: Plan) -> Optional[str]:
    """A short name for a plan: "int8", "int8-g32", "int4-g32, output int8" (`--quantize int4`), "mixed", or None
    for a float model; a quantized embedding (a GGUF's, kept) adds ", embedding int8-g32" (or is all there is)."""
    kinds = {}
    for name, (method, group_size) in plan.items():
        per_channel = method == "int8" and group_size is None
        kinds[name] = method if per_channel else f"{method}-g{group_size}"
    embedding = kinds.pop(EMBEDDING_WEIGHT, None)
    linear = _describe_linear(kinds)
    if embedding is None:
        return linear
    return f"{linear}, embedding {embedding}" if linear else f"embedding {embedding}"


def _describe_linear(kinds: Dict[str, str]) -> Optional[str]:
    rest = {kind for name, kind in kinds.items() if name != OUTPUT_WEIGHT}
    if len(rest) == 1 and rest.pop().startswith("int4") and kinds.get(OUTPUT_WEIGHT) == "int8":
        return f"{kinds[next(n for n in kinds if n != OUTPUT_WEIGHT)]}, output int8"  # what --quantize int4 gives
    kinds = set(kinds.values())
    return None if not kinds else kinds.pop() if len(kinds) == 1 else "mixed"


# The output layer keeps 8 bits when the rest goes to 4, as llama.cpp keeps it above 4 bits (Q6_K or Q8_0): it
# is the one layer whose rounding reaches the logits with nothing after it to average it out. Rounded to int4
# it cost the default model +6.2% perplexity on data/alice29.txt (docs/benchmarks.md), for 1% of the weights.
OUTPUT_WEIGHT = "output.weight"


def layer_method(weight_name: str, method: str) -> str:
    """The method one linear weight is quantized with when the model is quantized with `method`."""
    return "int8" if method == "int4" and weight_name == OUTPUT_WEIGHT else method


def plan_for(model: nn.Module, method: str, group_size: Optional[int] = None) -> Plan:
    """Quantize every linear layer of `model` with `method` (`layer_method`: int4 keeps the output layer at
    int8, per output channel), in groups as `group_size_for` says."""
    plan = {}
    for name, module in model.named_modules():
        weight = f"{name}.weight"
        if isinstance(module, nn.Linear) and is_linear_weight(weight):
            m = layer_method(weight, method)
            plan[weight] = (m, group_size_for(m, module.weight.shape[1], group_size if m == method else None, name))
    return plan


def new_layer(method: str, in_features: int, out_features: int, group_size: Optional[int]) -> QuantizedLinear:
    """An empty (meta-device) quantized layer of this shape, to be filled by load_state_dict(assign=True)."""
    if method == "int8":
        return Int8Linear(in_features, out_features, None if group_size in (None, in_features) else group_size)
    return Int4Linear(in_features, out_features, group_size)


def swap_linears(model: nn.Module, plan: Plan) -> nn.Module:
    """Replace each linear layer named in `plan` by an empty quantized layer of its shape, in place.

    The new layers live on the meta device until their tensors are assigned (load_state_dict(assign=True)
    or `quantize_model`). Forward hooks move with them.
    """
    named = dict(model.named_modules())
    for weight_name, (method, group_size) in plan.items():
        name = weight_name.removesuffix(".weight")
        old = named[name]
        out_features, in_features = old.weight.shape
        layer = new_layer(method, in_features, out_features, group_size)
        layer._forward_hooks.update(old._forward_hooks)
        parent_name, _, child = name.rpartition(".")
        setattr(named[parent_name] if parent_name else model, child, layer)
    return model


def quantize_weight(weight: torch.Tensor, method: str, group_size: Optional[int]) -> Dict[str, torch.Tensor]:
    """A float (out, in) weight as the tensors of `method`, by suffix ("weight", "scales", "mins").

    Works a slice of rows at a time, so the float32 scratch stays small whatever the weight's size.
    """
    out_features, in_features = weight.shape
    rows = max(1, _CHUNK_ELEMENTS // in_features)
    pieces = []
    for start in range(0, out_features, rows):
        chunk = weight[start:start + rows]
        if method == "int8":
            pieces.append(quantize_int8(chunk, group_size))
        else:
            pieces.append(quantize_int4(chunk, group_size))
    names = ("weight", "scales") if method == "int8" else ("weight", "scales", "mins")
    return {n: torch.cat([p[i] for p in pieces]) if len(pieces) > 1 else pieces[0][i] for i, n in enumerate(names)}


def quantize_model(model: nn.Module, method: str, group_size: Optional[int] = None,
                   quant_kernels: str = "integer") -> nn.Module:
    """Quantize every linear layer of a built model (real weights, any device) in place; returns it.

    `quant_kernels` says what the layers multiply with on the CPU: "integer" or "exact" (see above).
    """
    check_method(method)
    check_quant_kernels(quant_kernels)
    plan = plan_for(model, method, group_size)
    named = dict(model.named_modules())
    weights = {n: named[n.removesuffix(".weight")].weight.detach() for n in plan}
    swap_linears(model, plan)
    named = dict(model.named_modules())
    for weight_name, (m, g) in plan.items():
        layer = named[weight_name.removesuffix(".weight")]
        tensors = quantize_weight(weights[weight_name], m, layer.group_size)
        for suffix, tensor in tensors.items():
            setattr(layer, suffix, tensor.to(weights[weight_name].device))
    return choose_layer_classes(model, integer=quant_kernels == "integer")


def slow_path_note(plan: Plan, world_size: int = 1) -> str:
    """What to tell the user whose quantized layers will run eagerly in float32 on the CPU, and what is faster."""
    ways = []
    if world_size == 1:  # compiling runs in one process
        ways.append("compile=True runs them fast and exact")
    methods = {m for name, (m, _) in plan.items() if is_linear_weight(name)}
    if ("int8" not in methods or HAS_INT8_KERNEL) and ("int4" not in methods or HAS_INT4_KERNEL):
        ways.append("dtype=bfloat16 runs torch's int8/int4 kernels, fast, but cached and uncached runs then agree "
                    "only to bf16 rounding")
    advice = f": {'; '.join(ways)}" if ways else ""
    return f"quantized layers in float32 run eagerly on exact but slow paths{advice}"


