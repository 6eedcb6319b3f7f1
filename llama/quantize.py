"""Weight-only quantization as a transform applied to a built model: its linear layers swapped for int8 / int4 ones.

`swap_linears` replaces each `nn.Linear` named in a plan with an `Int8Linear` or `Int4Linear` holding the
tensors of `llama/quant_format.py` as buffers (`weight`, `scales`, `mins`), so the quantized model's
`state_dict()` is exactly the on-disk layout. The embedding and the norms stay float. `model.py` knows
none of this; forward hooks (model parallelism's all-reduce and all-gather) move to the new layers.

How each layer multiplies, chosen at run time (docs/benchmarks.md has what each candidate measured):
- bfloat16 activations on the CPU (`--dtype bfloat16`), eager or compiled: torch's private kernels,
  `aten._weight_int8pack_mm` (int8, one scale per output channel) and `aten._weight_int4pack_mm_for_cpu`
  (int4 in groups of 32..256), which take bf16 scales. The int4 kernel wants its own layout of the values:
  `use_cpu_kernel_layout` converts a layer in place (its state_dict still gives the on-disk layout).
  With float32 activations these kernels fall to scalar loops (50-500x slower), and feeding them
  activations rounded to bf16 would let the cached and uncached runs round differently (their outputs are
  bf16 too): float32 runs take the exact paths below.
- compiled (llama/compile.py), at up to `REDUCTION_MAX_ROWS` rows: the dequantization is written into the
  dot-product reduction in the activations' dtype, so Inductor generates one loop that reads the packed
  bytes and never materialises a float weight. int4 layers are held in a layout of their own for it
  (`use_reduction_layout`). The fast path for float32 runs.
- eager float32 decoding with per-channel int8: the int8 kernel again, whose float32 path is a plain loop
  but exact, and faster than the next item at a few rows.
- everything else (eager float32 int4, prompts, grouped int8, other devices, a torch without the kernels,
  `use_kernels(False)`): dequantize the weight to the activations' dtype and call `F.linear`: exactly the
  float model of the dequantized weights, always available, and slow (it writes a float weight per call).
"""

from typing import Dict, List, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import nn

from llama.compile import REDUCTION_MAX_ROWS
from llama.errors import LlamaError
from llama.quant_format import (
    DEFAULT_INT4_GROUP_SIZE, METHODS, SCALE_DTYPE, dequantize, dequantize_values, is_linear_weight, pack_int4,
    quantize_int4, quantize_int8, unpack_int4,
)

# weight name -> (method, group size); the group size of per-channel int8 is the input width.
Plan = Dict[str, Tuple[str, int]]

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
    if method == "int4" and group_size % 2:
        raise LlamaError(f"int4 packs columns in pairs within each group; a group of {group_size} columns is odd")
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
        return 1 if self.group_size is None else self.in_features // self.group_size

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._kernel_takes(x):  # eager or compiled (Inductor calls the kernel as it is)
            return self._kernel(x)
        rows = x.shape[:-1].numel()
        if torch.compiler.is_compiling() and x.device.type == "cpu" and rows <= REDUCTION_MAX_ROWS and self._reduces():
            return self._reduction(x)
        return F.linear(x, self.dequantized(x.dtype))

    def dequantized(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The (out, in) float weight these tensors stand for."""
        return dequantize(self.weight, self.scales, getattr(self, "mins", None)).to(dtype)

    def _kernel_takes(self, x: torch.Tensor) -> bool:
        """Whether torch's quantized CPU kernel can multiply `x` by this layer as it is held."""
        return False

    def _reduces(self) -> bool:
        """Whether the layer is held in the layout its compiled reduction reads."""
        return True

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, group_size={self.group_size}"


class Int8Linear(_QuantizedLinear):
    """A linear layer (no bias) with int8 weights: w = weight * scale, one scale per group of columns."""

    def __init__(self, in_features: int, out_features: int, group_size: Optional[int] = None):
        super().__init__(in_features, out_features, group_size)
        self.register_buffer("weight", torch.empty(out_features, in_features, dtype=torch.int8, device="meta"))
        # The kernel's bf16 copy of `scales` (set by use_cpu_kernel_layout; 2 bytes per output channel).
        # Inductor passes the kernel only tensors it holds, not ones computed in the compiled step.
        self.kernel_scales: Optional[torch.Tensor] = None

    def use_cpu_kernel_layout(self) -> bool:
        """Keep the bf16 scales the int8 kernel reads, if this torch and the layer's grouping allow."""
        if self.n_groups == 1 and _HAS_INT8_KERNEL and self.weight.device.type == "cpu":
            self.kernel_scales = self.scales.reshape(-1).bfloat16()
        return self.kernel_scales is not None

    def _kernel_takes(self, x: torch.Tensor) -> bool:
        if self.n_groups != 1:
            return False
        if kernels_ok(x, _HAS_INT8_KERNEL):
            return True
        # In float32 the kernel is exact: a plain loop, yet 7-9x faster than widening the weight (measured on
        # 7B's 11008 x 4096: 12.5 against 88 ms a row), so eager decoding takes it; more rows, and compiled
        # steps (which have their reduction), widen the weight or reduce instead.
        return (x.dtype == torch.float32 and x.device.type == "cpu" and _HAS_INT8_KERNEL and not _kernels_disabled
                and not torch.compiler.is_compiling() and x.shape[:-1].numel() <= REDUCTION_MAX_ROWS)

    def _kernel(self, x: torch.Tensor) -> torch.Tensor:
        scales = self.kernel_scales if x.dtype == torch.bfloat16 and self.kernel_scales is not None \
            else self.scales.reshape(-1).to(x.dtype)
        out = torch.ops.aten._weight_int8pack_mm(x.reshape(-1, self.in_features), self.weight, scales)
        return out.reshape(*x.shape[:-1], self.out_features)

    def _load_from_state_dict(self, *args, **kwargs):
        had_kernel_scales = self.kernel_scales is not None
        super()._load_from_state_dict(*args, **kwargs)
        self.kernel_scales = None
        if had_kernel_scales:  # made again from the scales just loaded
            self.use_cpu_kernel_layout()

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
        # How `weight` holds the values in memory (state_dict() always gives quant_format's layout):
        #   "format"  quant_format's: column 2j in the low nibble, 2j + 1 in the high one (as loaded);
        #   "halves"  each group's first half in the low nibbles and its second half in the high ones, GGUF's
        #             Q4 order: the compiled reduction then reads whole vectors of columns (use_halves_layout);
        #   "kernel"  aten._weight_int4pack_mm_for_cpu's own, with `kernel_scales` holding its scales and zero
        #             points in place of `scales` and `mins`, which are then None (use_cpu_kernel_layout).
        self.layout = "format"
        self.kernel_scales: Optional[torch.Tensor] = None

    def use_cpu_kernel_layout(self) -> bool:
        """Re-pack `weight` in place for `aten._weight_int4pack_mm_for_cpu`, if this torch and shape allow.

        Returns whether it did. Row blocks are packed independently, so this works a slice at a time.
        """
        if (self.layout == "kernel" or not _HAS_INT4_KERNEL or self.weight.device.type != "cpu"
                or self.group_size not in _INT4_KERNEL_GROUPS or self.out_features % _INT4_ROW_BLOCK):
            return self.layout == "kernel"
        packed = torch.cat([torch.ops.aten._convert_weight_to_int4pack_for_cpu(
            self._values(start, end).to(torch.int32), 1) for start, end in self._row_slices()])
        s, m = self.scales.float(), self.mins.float()
        # The kernel computes (q - 8) * scale + zero, so zero = min + 8 * scale.
        self.kernel_scales = torch.stack([s, m + 8 * s], dim=-1).transpose(0, 1).contiguous().bfloat16()  # (n_groups, out, 2)
        # The kernel reads only these: keeping the float16 scales and mins too would hold a fifth of a 7B
        # model's int4 bytes twice (0.8 GB). format_scales() gives them back, as the kernel rounds them.
        self.weight, self.scales, self.mins = packed, None, None
        self.layout = "kernel"
        return True

    def use_halves_layout(self) -> None:
        """Re-pack `weight` in place into the "halves" layout that the compiled reduction reads."""
        if self.layout == "halves":
            return
        half = self.group_size // 2
        pieces = []
        for start, end in self._row_slices():
            q = self._values(start, end)
            q = q.reshape(q.shape[0], self.n_groups, 2, half)  # (rows, n_groups, 2 halves, group / 2)
            pieces.append((q[:, :, 0] | (q[:, :, 1] << 4)).reshape(q.shape[0], self.in_features // 2))
        self.weight = torch.cat(pieces) if len(pieces) > 1 else pieces[0]
        if self.layout == "kernel":
            self.scales, self.mins = self.format_scales()
            self.kernel_scales = None
        self.layout = "halves"

    def _row_slices(self) -> List[Tuple[int, int]]:
        """Row ranges of about _CHUNK_ELEMENTS values each, on the kernel's row blocks: re-packing a slice at a
        time keeps its scratch small."""
        rows = _INT4_ROW_BLOCK * max(1, _CHUNK_ELEMENTS // (self.in_features * _INT4_ROW_BLOCK))
        return [(start, start + rows) for start in range(0, self.out_features, rows)]

    def _values(self, start: int = 0, end: Optional[int] = None) -> torch.Tensor:
        """Rows start..end of the (out, in) values 0..15, in column order, whichever layout the layer holds."""
        packed = self.weight[start:end]
        if self.layout == "kernel":  # packed in blocks of rows: slices must start and end on them
            assert start % _INT4_ROW_BLOCK == 0 and packed.shape[0] % _INT4_ROW_BLOCK == 0
            return _from_kernel_layout(packed, self.in_features)
        if self.layout == "format":
            return unpack_int4(packed)
        halves = packed.reshape(packed.shape[0], self.n_groups, 1, self.group_size // 2)
        return torch.cat([halves & 0x0F, halves >> 4], dim=2).reshape(packed.shape[0], self.in_features)

    def format_weight(self) -> torch.Tensor:
        """`weight` in quant_format's layout, whichever layout the layer holds."""
        return self.weight if self.layout == "format" else pack_int4(self._values())

    def format_scales(self) -> Tuple[torch.Tensor, torch.Tensor]:
        """`scales` and `mins` in quant_format's layout; in the kernel's layout, the bf16 values it computes with."""
        if self.layout != "kernel":
            return self.scales, self.mins
        s, zero = self.kernel_scales.float().transpose(0, 1).unbind(-1)  # (out, n_groups) each
        return s.to(SCALE_DTYPE), (zero - 8 * s).to(SCALE_DTYPE)

    def dequantized(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        if self.layout == "kernel":
            return dequantize_values(self._values(), *self.format_scales()).to(dtype)
        # Written in place into one float tensor: half the time of widening through temporaries (measured
        # on 11008 x 4096: 89 against 172 ms), which eager float32 runs pay on every call.
        n, half = self.n_groups, self.group_size // 2
        w = torch.empty(self.out_features, n, self.group_size, dtype=torch.float32, device=self.weight.device)
        packed = self.weight.view(self.out_features, n, half)
        if self.layout == "format":  # column 2j in the low nibble, 2j + 1 in the high one
            pairs = w.view(self.out_features, n, half, 2)
            pairs[..., 0].copy_(packed & 0x0F)
            pairs[..., 1].copy_(packed >> 4)
        else:  # halves: a group's first half in the low nibbles, its second in the high ones
            w[..., :half].copy_(packed & 0x0F)
            w[..., half:].copy_(packed >> 4)
        w.mul_(self.scales.unsqueeze(-1)).add_(self.mins.unsqueeze(-1))
        return w.view(self.out_features, self.in_features).to(dtype)

    def _kernel_takes(self, x: torch.Tensor) -> bool:
        return self.layout == "kernel" and kernels_ok(x, _HAS_INT4_KERNEL)

    def _kernel(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.ops.aten._weight_int4pack_mm_for_cpu(x.reshape(-1, self.in_features), self.weight,
                                                         self.group_size, self.kernel_scales)
        return out.reshape(*x.shape[:-1], self.out_features)

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        super()._save_to_state_dict(destination, prefix, keep_vars)
        destination[prefix + "weight"] = self.format_weight()
        destination[prefix + "scales"], destination[prefix + "mins"] = self.format_scales()

    def _load_from_state_dict(self, *args, **kwargs):
        if self.layout == "kernel":  # receive quant_format's tensors in buffers of their shapes again
            device = self.weight.device
            self.weight = torch.empty(self.out_features, self.in_features // 2, dtype=torch.uint8, device=device)
            self.scales = torch.empty(self.out_features, self.n_groups, dtype=SCALE_DTYPE, device=device)
            self.mins = torch.empty_like(self.scales)
        super()._load_from_state_dict(*args, **kwargs)
        self.layout, self.kernel_scales = "format", None  # what was loaded is quant_format's layout

    def _reduces(self) -> bool:
        return self.layout == "halves"

    def _reduction(self, x: torch.Tensor) -> torch.Tensor:
        # sum_j (q_j * s + m) * x_j over the whole row, each weight dequantized in registers: Inductor writes
        # one loop with one accumulator per row (summing group by group first, s * sum q x + m * sum x, costs
        # a horizontal sum per group: measured 45 against 54 tokens/s on the default model). In the halves
        # layout the low nibbles of a group's bytes are its first half of columns and the high ones its
        # second, so each nibble plane meets a contiguous run of x and the loop reads whole vectors (the
        # format's even/odd columns made it read x at a stride of 2: 12 tokens/s).
        assert self.layout == "halves", "compile a model whose int4 layers hold the halves layout"
        half = self.group_size // 2
        xg = x.reshape(*x.shape[:-1], 1, self.n_groups, 2, half)  # (..., 1, n_groups, 2 halves, group / 2)
        packed = self.weight.reshape(self.out_features, self.n_groups, half)  # (out, n_groups, group / 2)
        scales = self.scales.to(x.dtype).unsqueeze(-1)  # (out, n_groups, 1)
        mins = self.mins.to(x.dtype).unsqueeze(-1)
        low = (packed & 0x0F).to(x.dtype) * scales + mins  # the dequantized weights of each group's first half
        high = (packed >> 4).to(x.dtype) * scales + mins
        return (low * xg[..., 0, :] + high * xg[..., 1, :]).sum((-1, -2))  # (..., out)


def slow_path_note(plan: Plan, world_size: int = 1) -> str:
    """What to tell the user whose quantized layers will run eagerly in float32 on the CPU, and what is faster."""
    ways = []
    if world_size == 1:  # --compile runs in one process
        ways.append("--compile runs them fast and exact")
    methods = {m for m, _ in plan.values()}
    if ("int8" not in methods or _HAS_INT8_KERNEL) and ("int4" not in methods or _HAS_INT4_KERNEL):
        ways.append("--dtype bfloat16 runs torch's int8/int4 kernels, fast, but cached and uncached runs then agree "
                    "only to bf16 rounding")
    advice = f": {'; '.join(ways)}" if ways else ""
    return f"quantized layers in float32 run eagerly on exact but slow paths{advice}"


def kernels_ok(x: torch.Tensor, available: bool = True) -> bool:
    """Whether a private CPU kernel (that this torch has: `available`) may multiply `x`: bf16 on the CPU."""
    return available and not _kernels_disabled and x.device.type == "cpu" and x.dtype == torch.bfloat16


# The private kernels come and go between torch releases; without them every layer takes the dequantizing
# path. Tests switch them off (`use_kernels(False)`) to run that path on a torch that has them.
_HAS_INT8_KERNEL = hasattr(torch.ops.aten, "_weight_int8pack_mm")
_HAS_INT4_KERNEL = all(hasattr(torch.ops.aten, k) for k in ("_weight_int4pack_mm_for_cpu", "_convert_weight_to_int4pack_for_cpu"))
_INT4_KERNEL_GROUPS = (32, 64, 128, 256)
_INT4_ROW_BLOCK = 64  # the kernel packs rows in blocks of this many; a layer with a partial block keeps the fallback
_kernels_disabled = False


def _from_kernel_layout(packed: torch.Tensor, in_features: int) -> torch.Tensor:
    """Undo `_convert_weight_to_int4pack_for_cpu`: (out, in // 2) kernel bytes -> (out, in) values 0..15.

    The kernel's layout is private and may change between releases, so it is learned rather than assumed:
    packing a 64-row block whose values spell each position's index (four bits at a time) shows where each
    value goes.
    """
    perm = _kernel_permutation(in_features)
    blocks = unpack_int4(packed).reshape(-1, _INT4_ROW_BLOCK * in_features)  # (out / 64, 64 * in), kernel order
    values = torch.empty_like(blocks)
    values[:, perm] = blocks
    return values.reshape(-1, in_features)


_PERMUTATIONS: Dict[int, torch.Tensor] = {}


def _kernel_permutation(in_features: int) -> torch.Tensor:
    if in_features not in _PERMUTATIONS:
        n = _INT4_ROW_BLOCK * in_features
        index = torch.arange(n).reshape(_INT4_ROW_BLOCK, in_features)
        perm = torch.zeros(n, dtype=torch.long)
        for digit in range((n - 1).bit_length() // 4 + 1):
            q = ((index >> (4 * digit)) & 15).to(torch.int32)
            perm |= unpack_int4(torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1)).reshape(-1).long() << (4 * digit)
        _PERMUTATIONS[in_features] = perm
    return _PERMUTATIONS[in_features]


def use_reduction_layout(model: nn.Module) -> nn.Module:
    """Give the int4 layers on the CPU that the bf16 kernel does not take the halves layout that the compiled
    reduction reads (for compiled runs; eager ones read any layout)."""
    for module in model.modules():
        if isinstance(module, Int4Linear) and module.layout == "format" and module.weight.device.type == "cpu":
            module.use_halves_layout()
    return model


def use_cpu_kernel_layout(model: nn.Module) -> nn.Module:
    """Ready every quantized layer of a model for torch's bf16 CPU kernels where they take it (int4 layers are
    re-packed, int8 ones keep bf16 scales)."""
    for module in model.modules():
        if isinstance(module, (Int8Linear, Int4Linear)):
            module.use_cpu_kernel_layout()
    return model


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
