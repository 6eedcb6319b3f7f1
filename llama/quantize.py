"""Weight-only quantization as a transform applied to a built model: its linear layers swapped for int8 / int4 ones.

`swap_linears` replaces each `nn.Linear` named in a plan with an `Int8Linear` or `Int4Linear` holding the
tensors of `llama/quant_format.py` as buffers (`weight`, `scales`, `mins`), so the quantized model's
`state_dict()` is exactly the on-disk layout. The embedding and the norms stay float. `model.py` knows
none of this; forward hooks (model parallelism's all-reduce and all-gather) move to the new layers.

How each layer multiplies, chosen at run time:
- eager, on the CPU: int8 with one scale per output channel uses `aten._weight_int8pack_mm` when torch
  has it (a vectorized kernel for float32 activations); everything else (int4, grouped int8, other devices,
  a torch without the kernel) dequantizes the weight and calls `F.linear`, which is always correct.
- compiled (llama/compile.py), at up to `REDUCTION_MAX_ROWS` rows: the dequantization is written into the
  dot-product reduction, so Inductor generates one loop that reads the packed bytes and never materialises
  a float weight. See docs/benchmarks.md for what each candidate measured.
"""

from typing import Dict, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import nn

from llama.compile import REDUCTION_MAX_ROWS
from llama.errors import LlamaError
from llama.quant_format import (
    DEFAULT_INT4_GROUP_SIZE, METHODS, SCALE_DTYPE, dequantize, is_linear_weight, quantize_int4, quantize_int8,
)

# weight name -> (method, group size); the group size of per-channel int8 is the input width.
Plan = Dict[str, Tuple[str, int]]

# Quantize a float weight this many elements at a time, so that quantizing a 32000 x 4096 output layer needs
# a few hundred MB of scratch, not several times the layer in float32.
_CHUNK_ELEMENTS = 1 << 24


def check_method(quantize: Optional[str]) -> Optional[str]:
    """`quantize` checked to be None, "int8" or "int4".

    Raises:
        LlamaError: any other value, in one line that lists the choices.
    """
    if quantize is None or quantize in METHODS:
        return quantize
    raise LlamaError(f"unknown quantization {quantize!r}; choose one of {', '.join(METHODS)} (or leave it out for float)")


def describe(plan: Plan) -> Optional[str]:
    """A short name for a plan: "int8", "int8-g32", "int4-g32", "mixed", or None for a float model."""
    kinds = set()
    for method, group_size in plan.values():
        per_channel = method == "int8" and group_size is None
        kinds.add(method if per_channel else f"{method}-g{group_size}")
    return None if not kinds else kinds.pop() if len(kinds) == 1 else "mixed"


def plan_for(model: nn.Module, method: str, group_size: Optional[int] = None) -> Plan:
    """Quantize every linear layer of `model` with `method`: int8 per output channel unless a group size is
    given, int4 in groups of `group_size` (default 32, GGUF's Q4 block) columns."""
    if method == "int4" and group_size is None:
        group_size = DEFAULT_INT4_GROUP_SIZE
    plan = {}
    for name, module in model.named_modules():
        if isinstance(module, nn.Linear) and is_linear_weight(f"{name}.weight"):
            in_features = module.weight.shape[1]
            if group_size is not None and in_features % group_size:
                raise LlamaError(f"{name} has {in_features} input columns, not a multiple of the group size {group_size}")
            plan[f"{name}.weight"] = (method, group_size)
    return plan


class _QuantizedLinear(nn.Module):
    """What int8 and int4 layers share: the shape, the group size, and the eager/compiled choice."""

    def __init__(self, in_features: int, out_features: int, group_size: Optional[int]):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.group_size = group_size  # None: one group per row (int8 per output channel)
        n_groups = 1 if group_size is None else in_features // group_size
        self.register_buffer("scales", torch.empty(out_features, n_groups, dtype=SCALE_DTYPE, device="meta"))

    @property
    def n_groups(self) -> int:
        return self.scales.shape[1]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.shape[:-1].numel()
        if torch.compiler.is_compiling() and x.device.type == "cpu" and rows <= REDUCTION_MAX_ROWS:
            return self._reduction(x)
        return self._eager(x)

    def dequantized(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The (out, in) float weight these tensors stand for."""
        return dequantize(self.weight, self.scales, getattr(self, "mins", None)).to(dtype)

    def _eager(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.dequantized(x.dtype))

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, group_size={self.group_size}"


class Int8Linear(_QuantizedLinear):
    """A linear layer (no bias) with int8 weights: w = weight * scale, one scale per group of columns."""

    def __init__(self, in_features: int, out_features: int, group_size: Optional[int] = None):
        super().__init__(in_features, out_features, group_size)
        self.register_buffer("weight", torch.empty(out_features, in_features, dtype=torch.int8, device="meta"))

    def _eager(self, x: torch.Tensor) -> torch.Tensor:
        if self.n_groups == 1 and int8_kernel_ok(x):
            out = torch.ops.aten._weight_int8pack_mm(x.reshape(-1, self.in_features), self.weight,
                                                     self.scales.reshape(-1).to(x.dtype))
            return out.reshape(*x.shape[:-1], self.out_features)
        return super()._eager(x)

    def _reduction(self, x: torch.Tensor) -> torch.Tensor:
        group = self.in_features // self.n_groups
        xg = x.reshape(*x.shape[:-1], 1, self.n_groups, group)  # (..., 1, n_groups, group)
        wg = self.weight.reshape(self.out_features, self.n_groups, group).to(x.dtype)  # (out, n_groups, group)
        dots = (xg * wg).sum(-1)  # (..., out, n_groups)
        return (dots * self.scales.to(x.dtype)).sum(-1)


class Int4Linear(_QuantizedLinear):
    """A linear layer (no bias) with int4 weights, two per byte: w = q * scale + min per group of columns."""

    def __init__(self, in_features: int, out_features: int, group_size: int = DEFAULT_INT4_GROUP_SIZE):
        super().__init__(in_features, out_features, group_size)
        self.register_buffer("weight", torch.empty(out_features, in_features // 2, dtype=torch.uint8, device="meta"))
        self.register_buffer("mins", torch.empty_like(self.scales))

    def _reduction(self, x: torch.Tensor) -> torch.Tensor:
        # sum_j (q_j * s + m) * x_j = s * sum_j q_j x_j + m * sum_j x_j, group by group; the low nibble holds
        # the even column and the high nibble the odd one.
        group = self.in_features // self.n_groups
        xg = x.reshape(*x.shape[:-1], 1, self.n_groups, group // 2, 2)  # (..., 1, n_groups, group / 2, 2)
        packed = self.weight.reshape(self.out_features, self.n_groups, group // 2)  # (out, n_groups, group / 2)
        low, high = (packed & 0x0F).to(x.dtype), (packed >> 4).to(x.dtype)
        dots = (low * xg[..., 0] + high * xg[..., 1]).sum(-1)  # (..., out, n_groups)
        sums = xg.sum((-1, -2))  # (..., 1, n_groups)
        return (dots * self.scales.to(x.dtype) + sums * self.mins.to(x.dtype)).sum(-1)


def int8_kernel_ok(x: torch.Tensor) -> bool:
    """Whether `aten._weight_int8pack_mm` can take `x`: a CPU tensor of a float type, on a torch that has it."""
    return (_HAS_INT8_KERNEL and x.device.type == "cpu" and x.dtype in (torch.float32, torch.bfloat16, torch.float16)
            and not _kernels_disabled)


# The private kernels come and go between torch releases; without them every layer takes the dequantizing
# path. Tests switch them off (`use_kernels(False)`) to run that path on a torch that has them.
_HAS_INT8_KERNEL = hasattr(torch.ops.aten, "_weight_int8pack_mm")
_kernels_disabled = False


def use_kernels(enabled: bool) -> bool:
    """Allow or forbid torch's private quantized kernels; returns the previous setting."""
    global _kernels_disabled
    previous = not _kernels_disabled
    _kernels_disabled = not enabled
    return previous


def new_layer(method: str, in_features: int, out_features: int, group_size: Optional[int]) -> _QuantizedLinear:
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


def quantize_model(model: nn.Module, method: str, group_size: Optional[int] = None) -> nn.Module:
    """Quantize every linear layer of a built model (real weights, any device) in place; returns it."""
    check_method(method)
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
    return model
