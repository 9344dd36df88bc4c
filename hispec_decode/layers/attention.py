"""Attention metadata of a ragged batch and the attention kernel every architecture shares.

One forward call runs the new tokens of several sequences packed into one ``[1, T, hidden]``
tensor (no padding). The metadata is an explicit object handed to each layer (never a
global): for every sequence, which positions its new tokens take, where they go in the paged
cache and which slots hold its past. Each sequence attends to its own past only, under its
own causal mask; masks are built once per call and sliding-window size, then shared by all layers.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

if TYPE_CHECKING:
    from ..engine.kv_cache import PagedKVCache, Slots


@dataclass
class Segment:
    """The new tokens of one sequence in a packed batch."""

    seq_id: int
    start: int  # position of the first new token (= tokens this band already holds)
    num_new: int
    offset: int  # row of the first new token in the packed batch
    read: Slots  # pool slots of positions 0 .. start + num_new
    device: torch.device
    _masks: dict[int | None, torch.Tensor | None] = field(default_factory=dict, repr=False)

    def mask(self, sliding_window: int | None = None) -> torch.Tensor | None:
        """Boolean mask [num_new, start + num_new] (True = attend), or None when all keys are visible."""
        if sliding_window not in self._masks:
            total = self.start + self.num_new
            if self.num_new == 1 and (sliding_window is None or total <= sliding_window):
                self._masks[sliding_window] = None
            else:
                kv = torch.arange(total, device=self.device)[None, :]
                q = torch.arange(self.start, total, device=self.device)[:, None]
                allowed = kv <= q
                if sliding_window is not None:
                    allowed &= kv > q - sliding_window
                self._masks[sliding_window] = allowed
        return self._masks[sliding_window]


@dataclass
class AttentionMeta:
    """What the layers of one forward call need to know about the new tokens.

    ``positions`` are explicit data: a rejected draft's slot is simply written again by the
    next call that uses that position.
    """

    positions: torch.Tensor  # [T] int64, each segment's positions in order
    segments: list[Segment]
    write: Slots  # pool slots of the T new tokens
    rope: tuple[torch.Tensor, torch.Tensor] | None = None  # cos, sin: [1, 1, T, head_dim]

    @property
    def contiguous_positions(self) -> slice | None:
        """The positions as a slice when they are one run ``a, a+1, ...`` (one segment)."""
        if len(self.segments) == 1:
            s = self.segments[0]
            return slice(s.start, s.start + s.num_new)
        return None


def build_meta(cache: PagedKVCache, spans: list[tuple[int, int, int]]) -> AttentionMeta:
    """Metadata for new tokens of several sequences: ``spans`` holds ``(seq_id, start, num_new)``."""
    segments, positions, writes, offset = [], [], [], 0
    for seq_id, start, n in spans:
        segments.append(Segment(seq_id, start, n, offset, cache.slots(seq_id, 0, start + n), cache.device))
        positions.append(torch.arange(start, start + n))
        writes.append(cache.slots(seq_id, start, start + n))
        offset += n
    if len(writes) == 1:
        write = writes[0]
    else:
        write = torch.cat([_as_index(w) for w in writes]).to(cache.device)
    return AttentionMeta(torch.cat(positions).to(cache.device), segments, write)


def _as_index(slots: Slots) -> torch.Tensor:
    return torch.arange(slots.start, slots.stop) if isinstance(slots, slice) else slots.cpu()


def attend(
    q: torch.Tensor,  # [1, n_heads, T, head_dim]
    k: torch.Tensor,  # [1, n_kv_heads, T, head_dim]  (the new tokens only)
    v: torch.Tensor,  # [1, n_kv_heads, T, head_dim]
    meta: AttentionMeta,
    cache: PagedKVCache,
    layer: int,
    scale: float,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """Write the new K/V into ``layer``'s pool, then let each sequence attend to its own past
    and new tokens (gather-then-SDPA, grouped KV heads); returns [1, T, n_heads * head_dim]."""
    cache.write(layer, meta.write, k, v)
    outs = []
    for seg in meta.segments:
        keys, values = cache.read(layer, seg.read)
        qs = q[:, :, seg.offset : seg.offset + seg.num_new]
        outs.append(F.scaled_dot_product_attention(
            qs, keys, values, attn_mask=seg.mask(sliding_window), scale=scale, enable_gqa=q.shape[1] != keys.shape[1]
        ))
    out = outs[0] if len(outs) == 1 else torch.cat(outs, dim=2)
    return out.transpose(1, 2).flatten(2)
