"""`llama-convert --quantize int8|int4`: float weights quantized one tensor at a time on their way to disk.

Every linear layer's weight (output included; the embedding stays float) becomes int8 with one scale per
output channel, or int4 with a scale and a minimum per group of 32 columns, in llama/quant_format.py's
layout. The source is read memory-mapped and each weight is quantized as it is reached, so the whole model
is never held in float: memory is about the quantized model plus one float32 weight.
"""

import math
from collections.abc import Mapping
from pathlib import Path
from typing import Dict, Iterator, List, Optional

import torch

from llama import quant_format
from llama.checkpoint import (
    IGNORED_KEYS, check_dest, check_state_dict, expected_shapes, load_shard, model_args, read_params,
    save_checkpoint, shard_paths,
)
from llama.errors import LlamaError
from llama.progress import Progress, or_silent
from llama.sharding import split_dim

# The group size each method uses: int8 per output channel (None), int4 in GGUF's blocks of 32.
GROUP_SIZES = {"int8": None, "int4": quant_format.DEFAULT_INT4_GROUP_SIZE}


def check_method(method: Optional[str]) -> Optional[str]:
    """`method` if it is None, "int8" or "int4"; otherwise a LlamaError saying what to pass."""
    if method is not None and method not in quant_format.METHODS:
        raise LlamaError(f"--quantize must be one of {', '.join(quant_format.METHODS)}, not {method!r}")
    return method


def quantize_tensor(w: torch.Tensor, method: str, group_size: Optional[int] = None) -> Dict[str, torch.Tensor]:
    """A float (out, in) weight as {"weight", "scales"[, "mins"]} of `method`.

    The group size is `group_size`, else GROUP_SIZES'; an int4 weight whose width it does not divide gets
    the largest group that does (their greatest common divisor).

    Raises:
        LlamaError: int4 of a weight with an odd number of columns, which cannot be packed in pairs.
    """
    group_size = group_size or GROUP_SIZES[method]
    if method == "int8":
        q, scales = quant_format.quantize_int8(w, group_size)
        return {"weight": q, "scales": scales}
    if w.shape[1] % 2:
        raise LlamaError(f"int4 packs columns in pairs, and a weight of this model has {w.shape[1]}; "
                         "use --quantize int8")
    packed, scales, mins = quant_format.quantize_int4(w, math.gcd(group_size, w.shape[1]))
    return {"weight": packed, "scales": scales, "mins": mins}


def add_quantized(state_dict: Dict[str, torch.Tensor], name: str, parts: Dict[str, torch.Tensor]) -> None:
    """Store a quantized weight's parts under `P.weight`, `P.scales` and `P.mins` for `name` = `P.weight`."""
    prefix = name.removesuffix(".weight")
    for part, tensor in parts.items():
        state_dict[f"{prefix}.{part}"] = tensor


def quantize_state_dict(state_dict: Mapping, method: str, progress: Optional[Progress] = None) -> Dict[str, torch.Tensor]:
    """Every float linear weight of `state_dict` quantized with `method`, one at a time; the rest as it is.

    `state_dict` may compute its values when they are looked up (a memory-mapped or lazily merged model):
    each is looked up once, and only the quantized result is kept.
    """
    check_method(method)
    names = [n for n in state_dict if n.endswith(".weight")]
    linear = {n for n in names if quant_format.is_linear_weight(n) and quant_format.method_of(state_dict, n) is None}
    result: Dict[str, torch.Tensor] = {}
    done = 0
    for name in state_dict:
        if name in linear:
            add_quantized(result, name, quantize_tensor(state_dict[name], method))
            done += 1
            or_silent(progress)(f"quantizing to {method}", done, len(linear))
        else:
            result[name] = state_dict[name]
    return result


class _MergedShards(Mapping):
    """A Meta checkpoint's shards seen as one model, each weight joined from its pieces when looked up."""

    def __init__(self, shards: List[Dict[str, torch.Tensor]]):
        self.shards = shards

    def __getitem__(self, name: str) -> torch.Tensor:
        dim = split_dim(name)
        pieces = [shard[name] for shard in self.shards]
        return pieces[0] if dim is None or len(pieces) == 1 else torch.cat(pieces, dim=dim)

    def __iter__(self) -> Iterator[str]:
        return iter(self.shards[0])

    def __len__(self) -> int:
        return len(self.shards[0])


def convert_meta(src: Path, dest: Path, quantize: str, overwrite: bool = False,
                 progress: Optional[Progress] = None) -> Path:
    """Quantize a float checkpoint directory in Meta's layout (any number of shards) into `dest`, one shard.

    The tokenizer files beside the weights (tokenizer.model or tokenizer.json, tokenizer_config.json) are
    copied; a tokenizer one level up, where Meta's downloads put it, is copied in too.

    Raises:
        LlamaError: an unknown method, a damaged or already quantized source, or `dest` exists.
    """
    check_method(quantize)
    src, dest = Path(src), Path(dest)
    check_dest(dest, overwrite)
    if quant_format.read_record(src) is not None:
        raise LlamaError(f"{src} is already quantized; quantize its float original instead")
    params = read_params(src)
    paths = shard_paths(src)
    shards = [load_shard(p) for p in paths]
    for shard in shards:
        for key in IGNORED_KEYS:
            shard.pop(key, None)
    for path, shard in zip(paths[1:], shards[1:]):
        if set(shard) != set(shards[0]):
            raise LlamaError(f"{path} does not hold the same tensor names as {paths[0]}")
    merged = _MergedShards(shards)
    tokenizer = next((d / n for d in (src, src.parent) for n in ("tokenizer.model", "tokenizer.json")
                      if (d / n).is_file()), None)
    vocab = None
    if tokenizer is not None and tokenizer.name == "tokenizer.model":
        from llama.tokenizer import Tokenizer

        vocab = Tokenizer(str(tokenizer)).n_words
    args = model_args(params, max_seq_len=1, max_batch_size=1, tokenizer_vocab=vocab, source=str(src / "params.json"))
    # Shapes are checked before the slow work; meta tensors carry a shape and nothing else.
    shapes = {name: torch.empty(_merged_shape(shards, name), device="meta") for name in merged}
    check_state_dict(shapes, expected_shapes(args), str(src))
    quantized = quantize_state_dict(merged, quantize, progress)
    files = {}
    if (src / "tokenizer_config.json").is_file():
        files["tokenizer_config.json"] = (src / "tokenizer_config.json").read_bytes()
    return save_checkpoint(dest, params, quantized, tokenizer_path=tokenizer, overwrite=overwrite, extra_files=files,
                           quantization_source=f"--quantize {quantize} of {src.name}", progress=progress)


def _merged_shape(shards: List[Dict[str, torch.Tensor]], name: str) -> List[int]:
    shape = list(shards[0][name].shape)
    dim = split_dim(name)
    if dim is not None and len(shards) > 1:
        shape[dim] = sum(shard[name].shape[dim] for shard in shards)
    return shape

