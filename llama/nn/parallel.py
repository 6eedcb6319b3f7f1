"""Model parallelism as a transform applied to a plain model after it is built.

Meta's scheme (fairscale's parallel layers): column-parallel layers (wq, wk, wv, w1, w3, output) keep a
slice of their output rows and need no communication; row-parallel layers (wo, w2) keep a slice of their
input columns and sum their partial outputs across ranks; the embedding keeps a slice of its width and
the output keeps a slice of the vocabulary, each gathered back to full size. Each rank then runs
n_heads / world_size query heads and n_kv_heads / world_size KV heads. `model.py` knows none of this.
"""

import torch
import torch.distributed as dist
from torch import nn

from llama.errors import LlamaError
from llama.model import ModelArgs, Transformer
from llama.nn.sharding import split_dim


def check_divisible(args: ModelArgs, world_size: int) -> None:
    """Raise unless every split dimension of the model divides by `world_size`."""
    for name, value in (("n_heads", args.n_heads), ("n_kv_heads", args.n_kv_heads), ("dim", args.dim),
                        ("feed-forward width", args.ffn_hidden_dim), ("vocab_size", args.vocab_size)):
        if value % world_size:
            raise LlamaError(
                f"{name} {value} is not divisible by the model-parallel size {world_size}; "
                "run with a number of processes that divides the model's heads"
            )


def _all_reduce(module, inputs, output):
    dist.all_reduce(output)
    return output


def _all_gather_last_dim(module, inputs, output):
    pieces = [torch.empty_like(output) for _ in range(dist.get_world_size())]
    dist.all_gather(pieces, output.contiguous())
    return torch.cat(pieces, dim=-1)


def _resize(module: nn.Module, shape) -> None:
    """Give a (meta-device) layer a weight of its local shape, to be filled by load_state_dict(assign=True)."""
    module.weight = nn.Parameter(torch.empty(shape, device=module.weight.device, dtype=module.weight.dtype),
                                 requires_grad=False)


def parallelize(model: Transformer, world_size: int) -> Transformer:
    """Turn a whole model (built on the meta device) into this rank's part of a model-parallel one."""
    check_divisible(model.params, world_size)
    named = dict(model.named_modules())
    for name, module in named.items():
        key = f"{name}.weight"
        dim = split_dim(key)
        if dim is None or not hasattr(module, "weight"):
            continue
        shape = list(module.weight.shape)
        shape[dim] //= world_size
        _resize(module, shape)
        if name.endswith(("attention.wo", "feed_forward.w2")):
            module.register_forward_hook(_all_reduce)
        elif name in ("tok_embeddings", "output"):
            module.register_forward_hook(_all_gather_last_dim)
    for layer in model.layers:
        layer.attention.n_heads //= world_size
        layer.attention.n_kv_heads //= world_size
    return model
