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

from typing import Callable

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


def in_row_chunks(fn: Callable[..., torch.Tensor], *xs: torch.Tensor, rows: int) -> torch.Tensor:
    """``fn`` applied to fixed-size chunks of ``rows`` rows (the last zero-padded), for the
    batch-invariant mode: a GEMM's result for one row can depend on how many rows share the call
    (its kernel and reduction order are chosen by shape), never on which rows or where a row sits
    in a call of a fixed shape (tested: ``tests/test_invariant.py``). ``xs`` share their leading
    dimensions ``[..., n, features_i]``; ``fn`` maps rows to rows."""
    lead = xs[0].shape[:-1]
    flat = [x.reshape(-1, x.shape[-1]) for x in xs]
    n = flat[0].shape[0]
    if n <= rows:  # the usual decoding step: one call, padded
        out = fn(*(F.pad(f, (0, 0, 0, rows - n)) if n < rows else f for f in flat))[:n]
    else:
        pad = (-n) % rows
        if pad:
            flat = [F.pad(f, (0, 0, 0, pad)) for f in flat]
        out = torch.cat([fn(*(f[i : i + rows] for f in flat)) for i in range(0, n + pad, rows)])[:n]
    return out.reshape(*lead, out.shape[-1])


class FusedLinear:
    """``y = x @ cat(W_i).T + cat(b_i)`` for linears that read the same input; with ``rows`` set
    (the batch-invariant mode), every call runs on chunks of exactly that many rows."""

    def __init__(self, linears: list[nn.Linear], pack: bool = True, rows: int | None = None) -> None:
        self.rows = rows
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
        if self.rows is not None:
            return in_row_chunks(self._apply, x, rows=self.rows)
        return self._apply(x)

    def _apply(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed:
            return torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)

    def split(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return self(x).split(self.sizes, dim=-1)
