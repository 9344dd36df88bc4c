"""Linear layers for the decode engine: fused, and pre-packed for oneDNN on CPU.

At batch 1 a decoder is a chain of matrix-vector products. On CPU, oneDNN runs them about
twice as fast when the weight is reordered once into its blocked layout (measured here:
bf16 3072x576 in 52 us packed vs 135 us through ``F.linear``; the 49152x576 LM head in
2.1 ms vs 5.7 ms), so on CPU the engine keeps packed copies of the linear weights: the price
is a second copy of those weights in memory (``pack_weights=False`` turns it off). Elsewhere
(CUDA, float16), linears sharing an input are fused by re-pointing the module parameters at
slices of one concatenated tensor, so nothing is stored twice.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def can_pack(weight: torch.Tensor) -> bool:
    return (
        weight.device.type == "cpu"
        and weight.dtype in (torch.float32, torch.bfloat16)
        and torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
    )


class FusedLinear:
    """``y = x @ cat(W_i).T + cat(b_i)`` for linears that read the same input."""

    def __init__(self, linears: list[nn.Linear], pack: bool = True) -> None:
        self.sizes = [lin.out_features for lin in linears]
        weights = [lin.weight.detach() for lin in linears]
        has_bias = any(lin.bias is not None for lin in linears)
        biases = [lin.bias.detach() if lin.bias is not None else w.new_zeros(w.shape[0]) for lin, w in zip(linears, weights)]
        self.packed = pack and can_pack(weights[0])
        if self.packed:
            weight = torch.cat(weights) if len(weights) > 1 else weights[0]
            self.weight = torch.ops.mkldnn._reorder_linear_weight(weight, 1)
            self.bias = torch.cat(biases) if has_bias else None
        elif len(linears) == 1:
            self.weight, self.bias = weights[0], linears[0].bias
        else:  # one tensor, the modules re-pointed at its slices
            self.weight = torch.cat(weights).contiguous()
            self.bias = torch.cat(biases).contiguous() if has_bias else None
            offset = 0
            for lin, n in zip(linears, self.sizes):
                lin.weight = nn.Parameter(self.weight[offset : offset + n], requires_grad=False)
                if lin.bias is not None:
                    lin.bias = nn.Parameter(self.bias[offset : offset + n], requires_grad=False)
                offset += n

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed:
            return torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)

    def split(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return self(x).split(self.sizes, dim=-1)
