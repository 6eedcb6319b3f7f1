"""oneDNN's matrix product for the float32 linear layers of a model on the CPU: a load-time transform.

In the eager decode step almost all the time goes to multiplying one row of activations by each weight
matrix. PyTorch sends that to MKL, which reads the 576 x 1536 and 1536 x 576 matrices of the default
model at 8-12 GB/s on a 2-core EPYC; `torch.ops.mkldnn._linear_pointwise` (the oneDNN kernel Inductor
uses for linear layers on the CPU) reads them at 14-15 GB/s, on the weight as it is stored, and is also
faster for the many-row products of a prompt (docs/benchmarks.md, "The eager float path").

The op is private and exists only in builds with oneDNN, so `use_onednn_linears` first checks that it is
there and gives F.linear's answer on a small probe; otherwise it changes nothing and the model keeps
F.linear. The weights, their names and `state_dict()` stay as they are; only `forward` changes.
"""

from functools import lru_cache

import torch
import torch.nn.functional as F
from torch import nn


class OneDNNLinear(nn.Linear):
    """nn.Linear whose product runs through oneDNN. Same parameters, same state_dict, same values to ~1e-6."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, "none", [], "")


@lru_cache(maxsize=None)
def onednn_linear_works() -> bool:
    """Whether this torch has oneDNN's linear op and it agrees with F.linear on a small product."""
    op = getattr(torch.ops.mkldnn, "_linear_pointwise", None)
    if op is None or not torch.backends.mkldnn.is_available():
        return False
    try:
        generator = torch.Generator().manual_seed(0)
        x, w = torch.randn(3, 64, generator=generator), torch.randn(48, 64, generator=generator)
        return bool(torch.allclose(op(x, w, None, "none", [], ""), F.linear(x, w), rtol=1e-5, atol=1e-5))
    except (RuntimeError, TypeError):
        return False


def use_onednn_linears(model: nn.Module) -> int:
    """Make every plain float32 CPU nn.Linear of `model` an OneDNNLinear, in place; returns how many changed.

    Layers already swapped by another transform (quantized, parallel wrappers of other classes), and
    layers in other dtypes or on other devices, are left alone.
    """
    if not onednn_linear_works():
        return 0
    changed = 0
    for module in model.modules():
        weight = getattr(module, "weight", None)
        if type(module) is nn.Linear and weight.dtype == torch.float32 and weight.device.type == "cpu":
            # Changing the class keeps the module object itself, so forward hooks (the model-parallel
            # transform's all-reduce) and every reference to it stay valid.
            module.__class__ = OneDNNLinear
            changed += 1
    return changed
