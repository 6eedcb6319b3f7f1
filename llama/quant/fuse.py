"""Projections that read the same input made one product, as a transform applied to a loaded model.

Attention's wq, wk and wv, and the feed-forward's w1 and w3 (gate and up), each multiply the same activations.
On the integer kernels (llama/quant/dot_linears.py) a product costs a call, a rounding of the activations and a
wake-up of the threads whatever its size, and a small model's are small: the default model makes 210 a token.
`fuse` holds each group as one layer of their rows one after another (`wqkv`, `w13`), and the module becomes the
class `FUSED` names for it, whose `project` makes one product and splits it: 120 a token (the layer plan,
llama/quant/layer_plan.py, decides which groups become one and changes the module's class). The kernels compute
every output row apart from the others, so each row gets the same bits as before (tested). `state_dict()` still gives
each projection under its own name, in the on-disk layout; the model's `forward` (llama/model.py) is unchanged.
"""

from typing import Tuple, Type

import torch
from torch import nn

from llama.quant.dot_linears import DotLinear
from llama.model import Attention, FeedForward


class _Fused:
    """A module whose layers `names` are one layer, `joined`, of their rows in that order; `sizes` their rows."""

    names: Tuple[str, ...] = ()
    joined = ""
    sizes: Tuple[int, ...] = ()

    def _products(self, x: torch.Tensor) -> Tuple[torch.Tensor, ...]:
        return getattr(self, self.joined)(x).split(self.sizes, dim=-1)


class FusedAttention(_Fused, Attention):
    names, joined = ("wq", "wk", "wv"), "wqkv"

    def project(self, x: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self._products(x)


class FusedFeedForward(_Fused, FeedForward):
    names, joined = ("w1", "w3"), "w13"

    def project(self, x: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        return self._products(x)


# The modules whose projections can be one product, and the class each then becomes.
FUSED = {Attention: FusedAttention, FeedForward: FusedFeedForward}


def _separate_state(module: _Fused, state, prefix: str, local_metadata) -> None:
    """state_dict() as if never fused: each projection's on-disk tensors under its own name."""
    joined = getattr(module, module.joined)
    for key in [k for k in state if k.startswith(f"{prefix}{module.joined}.")]:
        del state[key]
    start = 0
    for name, size in zip(module.names, module.sizes):
        for suffix, tensor in joined.format_tensors(start, start + size).items():
            state[f"{prefix}{name}.{suffix}"] = tensor
        start += size


def fuse(parent: nn.Module, fused_class: Type[_Fused], cls: Type[DotLinear], dtype: torch.dtype) -> bool:
    """Hold `parent`'s projections `fused_class.names` as one layer `fused_class.joined` of the integer-kernel class
    `cls`, its state_dict() still giving each under its own name; returns True. The layer plan has checked that
    `cls` can join them (`cls.can_join`), and makes `parent` a `fused_class` (llama/quant/layer_plan.py)."""
    layers = [getattr(parent, name) for name in fused_class.names]
    joined = cls.from_layers(layers, dtype)
    for name in fused_class.names:
        delattr(parent, name)
    setattr(parent, fused_class.joined, joined)
    parent.sizes = tuple(layer.out_features for layer in layers)
    parent.register_state_dict_post_hook(_separate_state)
    return True
