"""oneDNN pre-packed fp32 linears for the CPU (DESIGN.md §7): t(8)/t(1) ~ 1.5 instead of ~2.1 with MKL.

The ops are private (inductor's freezing path uses them), so everything here checks they exist and
work, and falls back to a plain F.linear otherwise.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F


@functools.cache
def onednn_available() -> bool:
    try:
        w, x = torch.randn(8, 4), torch.randn(2, 3, 4)
        pw = torch.ops.mkldnn._reorder_linear_weight(w, None)
        y = torch.ops.mkldnn._linear_pointwise(x, pw, None, "none", [], "")
        return torch.allclose(y, F.linear(x, w), atol=1e-5)
    except Exception:
        return False


class Linear:
    """y = x W^T + b with the weight packed once for oneDNN when on the CPU in fp32."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None, pack: bool = True) -> None:
        weight, bias = weight.detach(), None if bias is None else bias.detach()
        self.packed = pack and weight.device.type == "cpu" and weight.dtype == torch.float32 and onednn_available()
        self.weight = torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), None) if self.packed else weight
        self.bias = bias
        self.out_features = weight.shape[0]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed:
            return torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)
