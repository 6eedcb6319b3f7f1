"""How Meta splits a model across model-parallel ranks, and how to split a whole model into its shards."""

from typing import Dict, List, Optional

import torch

# The dimension along which each weight is split across shards; None means every shard holds all of it.
# Column-parallel layers (outputs split) split dim 0, row-parallel layers (inputs split) dim 1, and
# fairscale's ParallelEmbedding splits the embedding width.
_SPLIT_DIMS = {
    "tok_embeddings.weight": 1,
    "attention.wq.weight": 0,
    "attention.wk.weight": 0,
    "attention.wv.weight": 0,
    "attention.wo.weight": 1,
    "feed_forward.w1.weight": 0,
    "feed_forward.w3.weight": 0,
    "feed_forward.w2.weight": 1,
    "output.weight": 0,
}


def split_dim(name: str) -> Optional[int]:
    """The dimension `name` is split along in Meta's shards, or None if it is replicated.

    A quantized weight's scales and mins (llama/quant/format.py) split with the weight, by whole groups.
    """
    for companion in (".scales", ".mins"):
        if name.endswith(companion):
            name = name.removesuffix(companion) + ".weight"
    for suffix, dim in _SPLIT_DIMS.items():
        if name == suffix or name.endswith("." + suffix):
            return dim
    return None


def shard_state_dict(state_dict: Dict[str, torch.Tensor], num_shards: int) -> List[Dict[str, torch.Tensor]]:
    """Split a whole model's weights into `num_shards` Meta-style shards (views where possible)."""
    shards: List[Dict[str, torch.Tensor]] = [{} for _ in range(num_shards)]
    for name, tensor in state_dict.items():
        dim = split_dim(name)
        if dim is None:
            pieces = [tensor] * num_shards
        else:
            if tensor.shape[dim] % num_shards:
                raise ValueError(f"{name} of shape {tuple(tensor.shape)} does not split into {num_shards} shards")
            pieces = torch.chunk(tensor, num_shards, dim=dim)
        for shard, piece in zip(shards, pieces):
            shard[name] = piece
    return shards
