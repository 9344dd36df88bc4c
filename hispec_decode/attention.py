"""Attention metadata and the attention kernel every architecture shares.

The metadata of one forward call is an explicit object handed to each layer (never a global):
which positions the new tokens take, where they are written in the cache, and the rotary
tables of those positions. Masks are built once per call and window size, then shared by all
layers of that call.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F


@dataclass
class AttentionMeta:
    """What the layers of one forward call need to know about the new tokens.

    ``positions`` are explicit data: a rejected draft's slot is simply written again by the
    next call that uses that position.
    """

    positions: torch.Tensor  # [T] int64, contiguous: start, start+1, ..., start+T-1
    start: int  # cache slot (= position) of the first new token
    rope: tuple[torch.Tensor, torch.Tensor] | None = None  # cos, sin: [1, 1, T, head_dim]
    _masks: dict[int | None, torch.Tensor | None] = field(default_factory=dict, repr=False)

    @property
    def num_new(self) -> int:
        return int(self.positions.shape[0])

    def mask(self, window: int | None = None) -> torch.Tensor | None:
        """Boolean mask [T, start+T] (True = attend), or None when every key is visible."""
        if window not in self._masks:
            total = self.start + self.num_new
            if self.num_new == 1 and (window is None or total <= window):
                self._masks[window] = None
            else:
                kv = torch.arange(total, device=self.positions.device)[None, :]
                q = self.positions[:, None]
                allowed = kv <= q
                if window is not None:
                    allowed &= kv > q - window
                self._masks[window] = allowed
        return self._masks[window]


def attend(
    q: torch.Tensor,  # [1, n_heads, T, head_dim]
    k: torch.Tensor,  # [1, n_kv_heads, S, head_dim]  (past + new, from the cache)
    v: torch.Tensor,  # [1, n_kv_heads, S, head_dim]
    mask: torch.Tensor | None,  # [T, S] bool or None
    scale: float,
) -> torch.Tensor:
    """Scaled dot-product attention with grouped KV heads; returns [1, T, n_heads * head_dim]."""
    out = F.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, scale=scale, enable_gqa=q.shape[1] != k.shape[1]
    )
    return out.transpose(1, 2).flatten(2)
