"""What every quantized linear layer shares, whatever its layout: the base class of llama/quant/linears.py's
classes and of llama/quant/dot_linears.py's."""

from typing import Dict, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import nn

from llama.quant.format import dequantize_values


class QuantizedLinear(nn.Module):
    """What every quantized layer shares: the shape, the group size, and widening as the exact fallback."""

    method = ""

    def __init__(self, in_features: int, out_features: int, group_size: Optional[int]):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.group_size = group_size  # None: one group per row (int8 per output channel)

    @property
    def n_groups(self) -> int:
        return 1 if self.group_size is None else self.in_features // self.group_size

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.dequantized(x.dtype))

    def dequantized(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The (out, in) float weight these tensors stand for."""
        return dequantize_values(*self.format_values()).to(dtype)

    def format_values(self, start: int = 0, end: Optional[int] = None) -> Tuple[torch.Tensor, ...]:
        """(values, scales[, mins]) of rows start..end: integer values (int8, or int4 as 0..15) in column order
        and their scales, whatever the layout."""
        raise NotImplementedError

    def format_tensors(self) -> Dict[str, torch.Tensor]:
        """The on-disk tensors by suffix ("weight", "scales"[, "mins"]), whatever the layout."""
        raise NotImplementedError

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        # Always the on-disk layout (llama/quant/format.py), whichever layout the layer computes with.
        for name, tensor in self.format_tensors().items():
            destination[prefix + name] = tensor

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, group_size={self.group_size}"
