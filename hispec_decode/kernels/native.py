"""The torch code each compiled kernel replaces: the fallback where the kernels are not built,
and the reference the tests compare the kernels with."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm as transformers computes it: normalise in float32, scale in the model's dtype."""
    return weight * F.rms_norm(x.float(), (x.shape[-1],), None, eps).to(x.dtype)


def gemma_rms_norm(x: torch.Tensor, scale: torch.Tensor, eps: float) -> torch.Tensor:
    """Gemma's RMSNorm with ``scale = 1 + weight`` in float32: normalise and scale in float32, then
    round to x's dtype once."""
    return (scale * F.rms_norm(x.float(), (x.shape[-1],), None, eps)).to(x.dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def rope(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """q [B, T, H, d], k [B, T, Hk, d], cos/sin broadcastable to [B, 1, T, d] -> rotated q and k as
    [B, H, T, d] and [B, Hk, T, d]."""
    q, k = q.transpose(1, 2), k.transpose(1, 2)
    return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def paged_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, seq: torch.Tensor, length: torch.Tensor,
                    lo: torch.Tensor, tree_base: torch.Tensor, tree_mask: torch.Tensor, tables: torch.Tensor,
                    block_size: int, scale: float) -> torch.Tensor:
    """The kernel's contract, one row at a time in float32 (a reference, not a fast path): q
    [H, rows, d], pools [Hk, slots, d], row r of sequence ``seq[r]`` sees slots ``lo[r] ..
    length[r] - 1`` through block table ``tables[seq[r]]``, except slots ``p >= tree_base[r]`` whose
    ``tree_mask[r, p - tree_base[r]]`` is 0 (another branch of a draft tree). Returns [rows, H * d]."""
    heads, rows, d = q.shape
    group = heads // keys.shape[0]
    out = torch.empty(rows, heads, d, dtype=q.dtype)
    for r in range(rows):
        p = torch.arange(int(lo[r]), int(length[r]))
        tb = int(tree_base[r])
        p = p[(p < tb) | tree_mask[r, (p - tb).clamp(0, tree_mask.shape[1] - 1)].bool()]
        slots = tables[int(seq[r])].long()[p // block_size] * block_size + p % block_size
        k = keys[:, slots].float().repeat_interleave(group, 0)  # [H, n, d]
        v = values[:, slots].float().repeat_interleave(group, 0)
        probs = ((q[:, r].float()[:, None] @ k.transpose(1, 2)) * scale).softmax(-1)  # [H, 1, n]
        out[r] = (probs @ v)[:, 0].to(q.dtype)
    return out.flatten(1)
