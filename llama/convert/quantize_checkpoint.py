"""`llama-convert --quantize int8|int4`: float weights quantized one tensor at a time on their way to disk.

Every linear layer's weight (output included; the embedding stays as it is) becomes int8 with one scale per
output channel, or int4 with a scale and a minimum per group of 32 columns, in llama/quant/format.py's
layout. The source is read memory-mapped and each weight is quantized as it is reached, so the whole model
is never held in float: memory is about the quantized model plus one float32 weight.
"""

from collections.abc import Mapping
from pathlib import Path
from typing import Dict, Iterator, Optional

import torch

from llama.quant import format as quant_format
from llama.io.checkpoint import CheckpointReader, check_dest, model_args, read_params, save_checkpoint, tokenizer_beside
from llama.errors import LlamaError
from llama.runtime.progress import Progress, or_silent
from llama.quant.quantize import check_method, group_size_for, layer_method, quantize_weight
from llama.nn.sharding import split_dim


def quantize_tensor(w: torch.Tensor, method: str, name: str = "a weight") -> Dict[str, torch.Tensor]:
    """A float (out, in) weight as {"weight", "scales"[, "mins"]} of `method`, grouped as loading groups it
    (`llama.quant.quantize.group_size_for`)."""
    return quantize_weight(w, method, group_size_for(method, w.shape[1], name=name))


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
            add_quantized(result, name, quantize_tensor(state_dict[name], layer_method(name, method), name))
            done += 1
            or_silent(progress)(f"quantizing to {method}", done, len(linear))
        else:
            result[name] = state_dict[name]
    return result


class _MergedShards(Mapping):
    """A checkpoint's shards seen as one model, each weight joined from its pieces when looked up."""

    def __init__(self, reader: CheckpointReader):
        self.shards = reader.shards

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
    reader = CheckpointReader(src)
    tokenizer = tokenizer_beside(src)
    vocab = None
    if tokenizer is not None and tokenizer.name == "tokenizer.model":
        from llama.tokenizer import Tokenizer

        vocab = Tokenizer(str(tokenizer)).n_words
    args = model_args(params, max_seq_len=1, max_batch_size=1, tokenizer_vocab=vocab, source=str(src / "params.json"))
    reader.check(args)  # before the slow work
    merged = _MergedShards(reader)
    quantized = quantize_state_dict(merged, quantize, progress)
    files = {}
    if (src / "tokenizer_config.json").is_file():
        files["tokenizer_config.json"] = (src / "tokenizer_config.json").read_bytes()
    return save_checkpoint(dest, params, quantized, tokenizer_path=tokenizer, overwrite=overwrite, extra_files=files,
                           quantization_source=f"--quantize {quantize} of {src.name}", progress=progress)
