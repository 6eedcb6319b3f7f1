"""Quantized weights as stored: int8 and int4 values with per-group scales, their layout and their record.

This file is the data format only (pure tensor functions, no modules): `llama/quant/quantize.py` turns a built
model's linear layers into ones that compute with these tensors, and the converters write them to disk.

A quantized linear layer `P` (say `layers.0.attention.wq`) whose float weight is (out, in) is stored as:

    P.weight   int8  (out, in)        int8: q in -127..127, w = q * scale
               uint8 (out, in // 2)   int4: two values per byte, column 2j in the low nibble and 2j + 1 in
                                      the high one; q in 0..15, w = q * scale + min
    P.scales   float16 (out, in // group_size)
    P.mins     float16 (out, in // group_size), int4 only

Column i of row o belongs to group i // group_size, so the group size is in / scales.shape[1]. This is
GGUF's block layout with the blocks of a row side by side: a Q8_0 block (d, 32 x int8) is exactly int8
with group size 32, and a Q4_0 block (d, 32 x 4 bits, w = d * (q - 8)) or Q4_1 block (d, m, w = d * q + m)
is exactly int4 with group size 32 (Q4_0's min is -8d, a power-of-two multiple, so float16 holds it).

The token embedding `tok_embeddings.weight` (vocab_size, dim) may be stored the same way, a row per token, as
a GGUF file stores it (its Q8_0, Q4_0 and Q4_1 blocks kept by llama-convert): a model then holds it so and
dequantizes only the rows its tokens look up (llama/quant/embedding.py).

A checkpoint directory that holds such tensors says so in `quantization.json` (see `RECORD_NAME`); the
tensors themselves tell int8 from int4 by dtype, so a file may mix the two.
"""

import json
from pathlib import Path
from typing import Dict, Optional, Tuple

import torch

from llama.errors import LlamaError

RECORD_NAME = "quantization.json"
# 2: the embedding may be quantized too. A checkpoint whose embedding is not says 1, which every version reads.
FORMAT_VERSION = 2
METHODS = ("int8", "int4")
DEFAULT_INT4_GROUP_SIZE = 32  # GGUF's Q4_0 / Q4_1 block: their files convert without loss
SCALE_DTYPE = torch.float16

# What a model's quantized weights hold: weight name -> (method, group size); None is int8 per output channel.
# The linear layers', and the embedding's where the checkpoint stores it quantized.
Plan = Dict[str, Tuple[str, Optional[int]]]

EMBEDDING_WEIGHT = "tok_embeddings.weight"

# The weights that quantizing a model quantizes: every linear layer's (the embedding stays as it is).
LINEAR_SUFFIXES = (
    "attention.wq.weight", "attention.wk.weight", "attention.wv.weight", "attention.wo.weight",
    "feed_forward.w1.weight", "feed_forward.w2.weight", "feed_forward.w3.weight",
)


def is_linear_weight(name: str) -> bool:
    """Whether `name` is the weight of a linear layer, the tensors this format quantizes."""
    return name == "output.weight" or name.endswith(tuple("." + s for s in LINEAR_SUFFIXES))


def may_be_stored_quantized(name: str) -> bool:
    """Whether `name` may be stored in this format: a linear layer's weight, or the embedding."""
    return name == EMBEDDING_WEIGHT or is_linear_weight(name)


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """(out, in) values in 0..15 -> (out, in // 2) uint8, column 2j in the low nibble."""
    q = q.to(torch.uint8)
    return q[:, 0::2] | (q[:, 1::2] << 4)


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """(out, in // 2) uint8 -> (out, in) uint8 values in 0..15."""
    low, high = packed & 0x0F, packed >> 4
    return torch.stack([low, high], dim=-1).flatten(-2)


def _grouped(w: torch.Tensor, group_size: int) -> torch.Tensor:
    out_features, in_features = w.shape
    if group_size <= 0 or in_features % group_size:
        raise ValueError(f"group size {group_size} does not divide the {in_features} input columns")
    return w.float().reshape(out_features, in_features // group_size, group_size)


def quantize_int8(w: torch.Tensor, group_size: Optional[int] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 with one scale per group of `group_size` columns (None: per output channel).

    Returns:
        (q, scales): (out, in) int8 and (out, in // group_size) float16.
    """
    group_size = group_size or w.shape[1]
    g = _grouped(w, group_size)
    scales = (g.abs().amax(dim=-1) / 127).to(SCALE_DTYPE)
    # Quantize against the scale as stored, so that dequantizing reproduces what was rounded.
    s = scales.float().unsqueeze(-1)
    q = torch.where(s > 0, torch.round(g / torch.where(s > 0, s, 1)), 0).clamp(-127, 127)
    return q.to(torch.int8).reshape(w.shape), scales


def quantize_int4(w: torch.Tensor, group_size: int = DEFAULT_INT4_GROUP_SIZE) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Asymmetric int4 (min and scale per group of `group_size` columns), as GGUF's Q4_1.

    Returns:
        (packed, scales, mins): (out, in // 2) uint8 and two (out, in // group_size) float16.
    """
    if w.shape[1] % 2:
        raise ValueError(f"int4 packs columns in pairs; {w.shape[1]} input columns is odd")
    g = _grouped(w, group_size)
    lo, hi = g.amin(dim=-1), g.amax(dim=-1)
    mins = lo.to(SCALE_DTYPE)
    scales = ((hi - mins.float()) / 15).to(SCALE_DTYPE)
    s, m = scales.float().unsqueeze(-1), mins.float().unsqueeze(-1)
    q = torch.where(s > 0, torch.round((g - m) / torch.where(s > 0, s, 1)), 0).clamp(0, 15)
    return pack_int4(q.reshape(w.shape)), scales, mins


def dequantize(weight: torch.Tensor, scales: torch.Tensor, mins: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The float32 (out, in) weight that stored int8 (mins None) or packed int4 values stand for."""
    return dequantize_values(weight if mins is None else unpack_int4(weight), scales, mins)


def dequantize_values(values: torch.Tensor, scales: torch.Tensor, mins: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The float32 (out, in) weight that (out, in) values (int8, or unpacked int4 0..15) stand for."""
    q = values.float()
    out_features, in_features = q.shape
    n_groups = scales.shape[1]
    g = q.reshape(out_features, n_groups, in_features // n_groups) * scales.float().unsqueeze(-1)
    if mins is not None:
        g = g + mins.float().unsqueeze(-1)
    return g.reshape(out_features, in_features)


def method_of(state_dict: Dict[str, torch.Tensor], weight_name: str) -> Optional[str]:
    """"int8" or "int4" if `weight_name` is stored quantized in `state_dict`, None if it is a float tensor."""
    prefix = weight_name.removesuffix(".weight")
    if f"{prefix}.scales" not in state_dict:
        return None
    return "int4" if f"{prefix}.mins" in state_dict else "int8"


def quantized_shapes(float_shapes: Dict[str, torch.Size], methods: Dict[str, Tuple[str, int]]) -> Dict[str, torch.Size]:
    """The tensors (and shapes) a state dict holds once the weights in `methods` are quantized.

    Args:
        float_shapes: name -> shape of every tensor of the float model.
        methods: weight name -> (method, group size) for each quantized weight.
    """
    shapes = {}
    for name, shape in float_shapes.items():
        if name not in methods:
            shapes[name] = shape
            continue
        method, group_size = methods[name]
        out_features, in_features = shape
        prefix = name.removesuffix(".weight")
        groups = torch.Size((out_features, in_features // group_size))
        shapes[name] = torch.Size((out_features, in_features // 2)) if method == "int4" else shape
        shapes[f"{prefix}.scales"] = groups
        if method == "int4":
            shapes[f"{prefix}.mins"] = groups
    return shapes


def write_record(method: str, group_size: Optional[int], source: str, format_version: int = 1) -> bytes:
    """The bytes of `quantization.json` for a checkpoint quantized with `method` (or "mixed")."""
    record = {"format_version": format_version, "method": method, "group_size": group_size, "source": source}
    return (json.dumps(record, indent=2) + "\n").encode()


def record_for(state_dict: Dict[str, torch.Tensor], source: str) -> Optional[bytes]:
    """The `quantization.json` bytes that describe `state_dict`, None if it holds no quantized weight.

    One method and group size throughout gives that method and size (None: one scale per output channel), and
    so does int4 whose output layer is int8 per output channel (what `--quantize int4` writes); anything else
    is "mixed" (each tensor still says what it is: int4 has mins, and the group size is in / scales columns).
    A quantized embedding counts as any weight does, and makes the record format 2: a version of this tool
    that reads only 1 would not know what to do with it, and says so rather than failing on its tensors.
    """
    kinds, output = set(), None
    for name, tensor in state_dict.items():
        if name.endswith(".scales"):
            prefix = name.removesuffix(".scales")
            method = method_of(state_dict, f"{prefix}.weight")
            in_features = state_dict[f"{prefix}.weight"].shape[1] * (2 if method == "int4" else 1)
            kind = (method, None if tensor.shape[1] == 1 else in_features // tensor.shape[1])
            if prefix == "output":
                output = kind
            else:
                kinds.add(kind)
    if output is not None and not (output == ("int8", None) and len(kinds) == 1 and next(iter(kinds))[0] == "int4"):
        kinds.add(output)
    if not kinds:
        return None
    version = 2 if EMBEDDING_WEIGHT.removesuffix(".weight") + ".scales" in state_dict else 1
    if len(kinds) == 1:
        (method, group_size), = kinds
        return write_record(method, group_size, source, version)
    return write_record("mixed", None, source, version)


def read_record(ckpt_dir: Path) -> Optional[Dict]:
    """`ckpt_dir`'s quantization record, None for a float checkpoint.

    Raises:
        LlamaError: the record is damaged, or was written by a newer version of this format.
    """
    from llama.runtime.files import read_json_object

    path = Path(ckpt_dir) / RECORD_NAME
    if not path.is_file():
        return None
    record = read_json_object(path, "it records how the checkpoint's weights are quantized")
    version = record.get("format_version")
    if not isinstance(version, int) or isinstance(version, bool):
        raise LlamaError(f"{path} has no valid format_version; the checkpoint's quantization cannot be read")
    if version > FORMAT_VERSION:
        raise LlamaError(f"{path} is quantization format {version}; this version of llama-kv reads up to "
                         f"{FORMAT_VERSION} (upgrade it)")
    if record.get("method") not in METHODS + ("mixed",):
        raise LlamaError(f"{path}: method must be one of {', '.join(METHODS)} or mixed, not {record.get('method')!r}")
    return record
