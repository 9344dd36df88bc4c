"""Linear layers for the decode engine: fused, and pre-packed for the CPU's kernels.

At batch 1 a decoder is a chain of matrix-vector products, bound by reading the weights. On CPU
the engine keeps packed copies of the linear weights (``pack_weights=False`` turns it off):

- in bf16 where the compiled kernels are built, a VNNI layout (:func:`pack_vnni`, arranged for the
  loop that reads it) for this project's kernel (:mod:`hispec_decode.kernels`), which serves every
  call whatever its row count: on AMX tiles where the CPU has them, else an AVX-512 BF16 loop, else
  an AVX2 + FMA loop (weights widened to float32 in registers). Each reads every weight once per
  call and computes each row in an order that ignores the other rows, so a call over 8 rows costs
  little more than one over 1 row where the CPU has the arithmetic to spare, and every bf16 linear
  is batch-invariant as it stands;
- otherwise (float32, or bf16 without the kernels) oneDNN's blocked layout
  (``_reorder_linear_weight``), about twice as fast as ``F.linear``; the batch-invariant mode then
  cuts calls into chunks of a fixed row count.

Elsewhere (CUDA, float16), linears sharing an input are fused by re-pointing the module parameters
at slices of one concatenated tensor, so nothing is stored twice.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from .. import kernels
from ..machine import mkldnn_bf16 as _mkldnn_bf16
from . import quant

_NO_BIAS = torch.empty(0)


def pack_vnni(weight: torch.Tensor, group: int = 1) -> torch.Tensor:
    """[N, K] -> the layout of the kernel that reads it (K zero-padded to Kp, a multiple of 32, as
    AMX tiles need; N to a multiple of 16 * group): per 16 output columns and input pair one 64-byte
    vector, ``group`` column blocks side by side per input pair. ``group`` 1: [N/16, Kp/2, 16, 2]
    (AMX, AVX2); 2: [N/32, Kp/2, 2, 16, 2] (the AVX-512 loop; :func:`vnni_group`)."""
    n, k = weight.shape
    w = F.pad(weight, (0, (-k) % 32, 0, (-n) % (16 * group)))
    blocks = w.view(w.shape[0] // (16 * group), group, 16, w.shape[1] // 2, 2).permute(0, 3, 1, 2, 4).contiguous()
    return blocks.squeeze(2) if group == 1 else blocks


def vnni_group(amx: bool) -> int:
    """The column blocks per input pair of the weight layout that the kernel serving calls reads."""
    return 1 if amx else kernels.ops().linear_bf16_group()


def packed_columns(packed: torch.Tensor) -> int:
    """Output columns of a :func:`pack_vnni` weight, padding included."""
    return packed.shape[0] * 16 * (packed.shape[2] if packed.dim() == 5 else 1)


def vnni_bias(bias: torch.Tensor | None, packed: torch.Tensor) -> torch.Tensor:
    """The kernels' bias: float32, one value per packed column (zeros past the real ones); empty for none."""
    if bias is None:
        return _NO_BIAS
    b, columns = bias.float(), packed_columns(packed)
    return F.pad(b, (0, columns - b.shape[0])) if b.shape[0] != columns else b


def vnni_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, n: int,
                amx: bool = False) -> torch.Tensor:
    """``x @ W.T + bias`` on a :func:`pack_vnni` weight with ``n`` outputs (bf16, CPU), on the
    CPU's vector loop (AVX-512 BF16 or AVX2) or (``amx``) on AMX tiles."""
    lead = x.shape[:-1]
    flat = x.reshape(-1, x.shape[-1])
    if flat.shape[1] != 2 * packed.shape[1]:
        flat = F.pad(flat, (0, 2 * packed.shape[1] - flat.shape[1]))
    k = kernels.ops()
    y = (k.linear_amx if amx else k.linear_bf16)(flat.contiguous(), packed, vnni_bias(bias, packed))
    return (y if y.shape[1] == n else y[:, :n]).reshape(*lead, n)


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
    (the batch-invariant mode) and no VNNI kernel, every call runs on chunks of exactly that many
    rows (the VNNI kernel is row-independent as it stands)."""

    def __init__(self, linears: list[nn.Linear], pack: bool = True, rows: int | None = None) -> None:
        self.rows = rows
        self.sizes = [lin.out_features for lin in linears]
        self.out_features = sum(self.sizes)
        self.vnni: torch.Tensor | None = None  # the VNNI copy (bf16 with the compiled kernel), used for every call
        self.amx = False  # every call on AMX tiles over the VNNI copy
        self.blocks: list[quant.BlockWeight] | None = None  # GGUF block weights (layers.quant), one per format
        if any(isinstance(lin, quant.BlockLinear) for lin in linears):
            if not all(isinstance(lin, quant.BlockLinear) for lin in linears):
                raise ValueError("a fused linear mixes GGUF block weights and dense ones")
            self.blocks = quant.fuse(linears)
            self.packed, self.weight, self.bias = False, None, None
            return
        weights = [lin.weight.detach() for lin in linears]
        has_bias = any(lin.bias is not None for lin in linears)
        biases = [lin.bias.detach() if lin.bias is not None else w.new_zeros(w.shape[0]) for lin, w in zip(linears, weights)]
        # bf16 packs for the compiled VNNI kernel, or for oneDNN where it has bf16 kernels for this CPU
        self.packed = pack and can_pack(weights[0]) and (
            weights[0].dtype == torch.float32 or kernels.has_linear_bf16() or _mkldnn_bf16())
        if self.packed and weights[0].dtype == torch.bfloat16 and kernels.has_linear_bf16():
            self.amx = kernels.has_amx()
            weight = torch.cat(weights) if len(weights) > 1 else weights[0]
            self.vnni = pack_vnni(weight, vnni_group(self.amx))
            self.vnni_bias = vnni_bias(torch.cat(biases), self.vnni) if has_bias else None
            self.weight, self.bias = None, None
        elif self.packed:
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

    @property
    def row_independent(self) -> bool:
        """Whether every call computes each row alone (the VNNI or the block kernel): batch-invariant for free."""
        return self.vnni is not None or (self.blocks is not None and quant.has_kernel())

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.blocks is not None:
            if self.rows is not None and not quant.has_kernel():
                return in_row_chunks(lambda v: quant.fused_call(v, self.blocks), x, rows=self.rows)
            return quant.fused_call(x, self.blocks)
        if self.vnni is not None:
            return vnni_linear(x, self.vnni, self.vnni_bias, self.out_features, amx=self.amx)
        if self.rows is not None:
            return in_row_chunks(self._apply, x, rows=self.rows)
        return self._apply(x)

    def _apply(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed:
            return torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, "none", [], "")
        if x.dim() > 2:  # as 2-d rows: on CPU a 3-d input goes through bmm, which copies the transposed weight
            # every call (335 MB for Gemma 3's LM head; seconds under the trainer's allocator settings)
            return F.linear(x.reshape(-1, x.shape[-1]), self.weight, self.bias).view(*x.shape[:-1], -1)
        return F.linear(x, self.weight, self.bias)

    def split(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return self(x).split(self.sizes, dim=-1)
