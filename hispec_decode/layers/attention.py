"""Attention metadata of a ragged batch and the attention kernel every architecture shares.

One forward call runs the new tokens of several sequences packed into one ``[1, T, hidden]``
tensor (no padding). The metadata is an explicit object handed to each layer (never a
global): for every sequence, which positions its new tokens take, where they go in the paged
cache and which slots hold its past. Each sequence attends to its own past only, under its
own causal mask; masks are built once per call and sliding-window size, then shared by all layers.
A sequence with a draft tree (:class:`TreeRows`) gives its tree's rows
their positions (prefix length + depth) and a visibility mask: a node sees the prefix, its ancestors
and itself, never another branch.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from .. import kernels

if TYPE_CHECKING:
    from ..cache.kv_cache import PagedKVCache, Slots


@dataclass(frozen=True)
class TreeRows:
    """What attention needs of a tree: node ``i`` sits at slot ``base + i`` and position
    ``base - 1 + depth[i]``, and sees node ``j`` iff ``visible[i, j]`` (its ancestors and itself)."""

    base: int
    depth: torch.Tensor  # [N] int64
    visible: torch.Tensor  # [N, N] bool


@dataclass
class Segment:
    """The new tokens of one sequence in a packed batch."""

    seq_id: int
    start: int  # position of the first new token (= tokens this band already holds)
    num_new: int
    offset: int  # row of the first new token in the packed batch
    read: Slots  # pool slots of slots 0 .. start + num_new
    device: torch.device
    tree: TreeRows | None = None  # slots from tree.base on are a draft tree's nodes
    _masks: dict[int | None, torch.Tensor | None] = field(default_factory=dict, repr=False)

    def positions(self) -> torch.Tensor:
        """Positions of the slots ``0 .. start + num_new`` (a tree's nodes: base - 1 + depth)."""
        total = self.start + self.num_new
        pos = torch.arange(total)
        if self.tree is not None and total > self.tree.base:
            pos[self.tree.base :] = self.tree.base - 1 + self.tree.depth[: total - self.tree.base]
        return pos

    def mask(self, sliding_window: int | None = None) -> torch.Tensor | None:
        """Boolean mask [num_new, start + num_new] (True = attend), or None when all keys are visible."""
        if sliding_window not in self._masks:
            total = self.start + self.num_new
            if self.tree is None and self.num_new == 1 and (sliding_window is None or total <= sliding_window):
                self._masks[sliding_window] = None
            else:
                kv = torch.arange(total)[None, :]
                q = torch.arange(self.start, total)[:, None]
                allowed = kv <= q
                if self.tree is not None and total > self.tree.base:  # tree rows see the prefix and their ancestors
                    base = self.tree.base
                    nodes = torch.arange(max(self.start, base), total) - base
                    allowed[nodes + base - self.start, base:] = self.tree.visible[nodes][:, : total - base]
                if sliding_window is not None:
                    pos = self.positions()
                    allowed &= pos[None, :] > pos[self.start :, None] - sliding_window
                self._masks[sliding_window] = allowed.to(self.device)
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
    # cos, sin: [1, 1, T, head_dim]; a dict of them by layer type where layers differ (Gemma 3)
    rope: tuple[torch.Tensor, torch.Tensor] | dict[str, tuple[torch.Tensor, torch.Tensor]] | None = None
    _groups: list[RowGroup] | None = field(default=None, repr=False)
    _rows: PagedRows | None = field(default=None, repr=False)
    _stack_rows: object | None = field(default=None, repr=False)

    def paged_rows(self, cache: PagedKVCache) -> PagedRows:
        """Every new row's sequence, visible keys and block table for the paged kernel (once per call)."""
        if self._rows is None:
            self._rows = PagedRows.build(self.segments, cache, self.positions)
        return self._rows

    def stack_rows(self, cache: PagedKVCache) -> object:
        """:meth:`paged_rows` and the write slots as the compiled layer stack takes them (once per call)."""
        if self._stack_rows is None:
            rows = self.paged_rows(cache)
            write = _as_index(self.write) if isinstance(self.write, slice) else self.write.cpu()
            self._stack_rows = kernels.ops().StackRows(write, rows.seq, rows.length, rows.position, rows.tree_base,
                                                       rows.tree_mask, rows.tables, cache.block_size)
        return self._stack_rows

    def row_groups(self, block_size: int) -> list[RowGroup]:
        """The segments with one new token in padded groups (built once per call)."""
        if self._groups is None:
            self._groups = single_row_groups(self.segments, block_size)
        return self._groups

    @property
    def contiguous_positions(self) -> slice | None:
        """The positions as a slice when they are one run ``a, a+1, ...`` (one segment)."""
        if len(self.segments) == 1 and self.segments[0].tree is None:
            s = self.segments[0]
            return slice(s.start, s.start + s.num_new)
        return None


@dataclass
class PagedRows:
    """What the paged attention kernel reads for each query row of a call: row ``r`` belongs to
    segment ``seq[r]``, whose pool blocks are ``tables[seq[r]]``, and sees slots ``lo .. length[r] - 1``
    (causal; ``lo`` > 0 only under a sliding window), except, of the slots from ``tree_base[r]`` on (a
    draft tree's), those its row of ``tree_mask`` does not set."""

    seq: torch.Tensor  # [T] int64
    length: torch.Tensor  # [T] int64: the row's slot + 1
    position: torch.Tensor  # [T] int64: the row's position (= slot outside trees)
    tree_base: torch.Tensor  # [T] int64 (= length outside trees: nothing masked)
    tree_mask: torch.Tensor  # [T, max tree size or 1] uint8
    tables: torch.Tensor  # [segments, max blocks] int32
    _lo: dict[int | None, torch.Tensor] = field(default_factory=dict, repr=False)

    @classmethod
    def build(cls, segments: list[Segment], cache: PagedKVCache, positions: torch.Tensor) -> PagedRows:
        seq, length, tables = [], [], []
        for i, s in enumerate(segments):
            seq += [i] * s.num_new
            length += range(s.start + 1, s.start + s.num_new + 1)
            tables.append(cache.manager.table(s.seq_id)[: -(-(s.start + s.num_new) // cache.block_size)])
        width = max(len(t) for t in tables)
        padded = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
        length_t = torch.tensor(length)
        tree_base = length_t.clone()
        trees = max((len(s.tree.depth) for s in segments if s.tree is not None), default=1)
        mask = torch.zeros(len(length), trees, dtype=torch.uint8)
        for s in segments:
            if s.tree is not None and s.start + s.num_new > s.tree.base:
                first = max(s.start, s.tree.base)
                rows = torch.arange(first, s.start + s.num_new) - s.start + s.offset
                nodes = torch.arange(first, s.start + s.num_new) - s.tree.base
                tree_base[rows] = s.tree.base
                vis = s.tree.visible[nodes]
                mask[rows, : vis.shape[1]] = vis.to(torch.uint8)
        return cls(torch.tensor(seq), length_t, positions.cpu(), tree_base, mask, padded)

    def lo(self, sliding_window: int | None) -> torch.Tensor:
        """The first slot each row sees: by position (a tree's depth stays below the window, so
        below ``base`` a slot is its position)."""
        if sliding_window not in self._lo:
            self._lo[sliding_window] = (torch.zeros_like(self.length) if sliding_window is None
                                        else (self.position + 1 - sliding_window).clamp(min=0))
        return self._lo[sliding_window]


PAGED_MAX_NEW = 32  # segments of at most this many new tokens go to the paged kernel; longer ones
# (prefill chunks) to the flash kernel, whose tiling wins there


@dataclass
class RowGroup:
    """One-token rows of similar context length, attended to in one padded call: their pasts
    gathered block by block into ``[B, n_kv, blocks * block_size, d]``, padding masked out."""

    starts: list[int]  # position of each row's new token
    rows: torch.Tensor  # [B] rows of the packed batch
    blocks: torch.Tensor  # [B * blocks_per_row] pool blocks (padding: block 0)
    valid: torch.Tensor  # [B, blocks_per_row * block_size] bool
    _masks: dict[int | None, torch.Tensor] = field(default_factory=dict, repr=False)

    def mask(self, sliding_window: int | None) -> torch.Tensor:
        """[B, 1, 1, keys] bool (True = attend; broadcast over KV heads and their query groups)."""
        if sliding_window not in self._masks:
            allowed = self.valid
            if sliding_window is not None:
                q = torch.tensor(self.starts, device=allowed.device)
                allowed = allowed & (torch.arange(allowed.shape[1], device=allowed.device)[None, :] > q[:, None] - sliding_window)
            self._masks[sliding_window] = allowed[:, None, None, :]
        return self._masks[sliding_window]


def single_row_groups(segments: list[Segment], block_size: int, spread: float = 1.5) -> list[RowGroup]:
    """The one-token segments in groups of similar length (the longest at most ``spread`` times
    the shortest), so padding to the longest wastes little of the gather."""
    groups: list[list[Segment]] = []
    for seg in sorted((s for s in segments if s.num_new == 1 and s.tree is None), key=lambda s: s.start):
        if groups and seg.start + 1 <= spread * (groups[-1][0].start + 1):
            groups[-1].append(seg)
        else:
            groups.append([seg])
    out = []
    for group in groups:
        device = group[0].device
        per_row = -(-(group[-1].start + 1) // block_size)
        blocks = torch.zeros(len(group), per_row, dtype=torch.long)
        for i, seg in enumerate(group):
            first = _as_index(seg.read)[::block_size] // block_size  # the block of positions 0, bs, 2 bs, ...
            blocks[i, : len(first)] = first
        lengths = torch.tensor([s.start + 1 for s in group])
        valid = torch.arange(per_row * block_size)[None, :] < lengths[:, None]
        out.append(RowGroup([s.start for s in group], torch.tensor([s.offset for s in group]).to(device),
                            blocks.flatten().to(device), valid.to(device)))
    return out


def build_meta(cache: PagedKVCache, spans: list[tuple[int, int, int]],
               trees: list[TreeRows | None] | None = None) -> AttentionMeta:
    """Metadata for new tokens of several sequences: ``spans`` holds ``(seq_id, start, num_new)``;
    ``trees`` the draft tree of each sequence, if it has one."""
    segments, positions, writes, offset = [], [], [], 0
    for j, (seq_id, start, n) in enumerate(spans):
        tree = trees[j] if trees is not None else None
        seg = Segment(seq_id, start, n, offset, cache.slots(seq_id, 0, start + n), cache.device, tree)
        segments.append(seg)
        positions.append(torch.arange(start, start + n) if tree is None else seg.positions()[start:])
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
    and new tokens; returns [1, T, n_heads * head_dim]. On CPU with the compiled kernels, a call
    whose segments are all short (decoding, verification) is one paged-kernel call over the pool;
    otherwise gather-then-SDPA per long segment and batched products for one-token rows."""
    cache.write(layer, meta.write, k, v)
    kern = kernels.ops() if q.device.type == "cpu" else None
    if kern is not None and all(s.num_new <= PAGED_MAX_NEW for s in meta.segments):
        return _attend_paged(kern, q, meta, cache, layer, scale, sliding_window)
    gqa = q.shape[1] != k.shape[1]
    if len(meta.segments) == 1:
        seg = meta.segments[0]
        keys, values = cache.read(layer, seg.read)
        out = F.scaled_dot_product_attention(q, keys, values, attn_mask=seg.mask(sliding_window), scale=scale, enable_gqa=gqa)
        return out.transpose(1, 2).flatten(2)
    out = torch.empty_like(q)
    for seg in meta.segments:
        if seg.num_new > 1 or seg.tree is not None:
            keys, values = cache.read(layer, seg.read)
            sl = slice(seg.offset, seg.offset + seg.num_new)
            out[:, :, sl] = F.scaled_dot_product_attention(  # a tree's rows: under its visibility mask
                q[:, :, sl], keys, values, attn_mask=seg.mask(sliding_window), scale=scale, enable_gqa=gqa)
    for group in meta.row_groups(cache.block_size):
        out[:, :, group.rows] = _attend_rows(q, group, cache, layer, scale, sliding_window)
    return out.transpose(1, 2).flatten(2)


def _attend_paged(kern, q: torch.Tensor, meta: AttentionMeta, cache: PagedKVCache, layer: int, scale: float,
                  sliding_window: int | None) -> torch.Tensor:
    rows = meta.paged_rows(cache)
    out = kern.paged_attention(q[0].contiguous(), cache.keys[layer], cache.values[layer], rows.seq, rows.length,
                               rows.lo(sliding_window), rows.tree_base, rows.tree_mask, rows.tables,
                               cache.block_size, scale)
    return out[None]


def _attend_rows(q: torch.Tensor, group: RowGroup, cache: PagedKVCache, layer: int, scale: float,
                 sliding_window: int | None) -> torch.Tensor:
    """Attention of a group of one-token rows as batched matrix products (on CPU ~9x faster than
    one SDPA call per row, or one masked SDPA call): [1, n_heads, B, head_dim]. The products run
    in the model's dtype, the softmax in float32 (in bf16 a row's numbers can differ in the last
    bits from the same row attended alone, as with any change of GEMM shape)."""
    B, n_heads, d = len(group.starts), q.shape[1], q.shape[3]
    keys, values = cache.read_blocks(layer, group.blocks)  # [n_kv, B * blocks_per_row, block_size, d]
    n_kv = keys.shape[0]
    keys = keys.reshape(n_kv, B, -1, d).transpose(0, 1)  # [B, n_kv, keys, d]
    values = values.reshape(n_kv, B, -1, d).transpose(0, 1)
    qs = q[0, :, group.rows].transpose(0, 1).reshape(B, n_kv, n_heads // n_kv, d) * scale  # [B, n_kv, group, d]
    scores = torch.matmul(qs, keys.transpose(-1, -2)).float()  # [B, n_kv, group, keys], scaled first (fp16 range)
    scores = scores.masked_fill(~group.mask(sliding_window), float("-inf"))
    out = torch.matmul(scores.softmax(-1).to(values.dtype), values)  # [B, n_kv, group, d]
    return out.reshape(B, n_heads, d).transpose(0, 1)[None]


def attend_invariant(
    q: torch.Tensor,  # [1, n_heads, T, head_dim]
    k: torch.Tensor,  # [1, n_kv_heads, T, head_dim]  (the new tokens only)
    v: torch.Tensor,
    meta: AttentionMeta,
    cache: PagedKVCache,
    layer: int,
    scale: float,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """:func:`attend` for the batch-invariant mode: each query row on its own, over exactly the
    keys it sees, in float32 (without the compiled kernels the batch-invariant cache holds float32
    K/V, exact copies of the model dtype's). Every call for a token at position ``t`` then has the
    same shapes and inputs (its ``q``, the K/V of positions ``<= t``) whether the token is decoded
    alone, in a verification pass beside other tentative tokens, in a prefill, or beside other sequences, so it
    computes the same bits: no padding, grouping or kernel choice depends on the rest of the pass.
    With the compiled kernels, every row of the call goes through the paged kernel, which computes
    each row alone by construction."""
    cache.write(layer, meta.write, k, v)
    kern = kernels.ops() if q.device.type == "cpu" else None
    if kern is not None:
        return _attend_paged(kern, q, meta, cache, layer, scale, sliding_window)
    n_heads, d = q.shape[1], q.shape[3]
    out = torch.empty_like(q)
    for seg in meta.segments:
        keys, values = cache.read(layer, seg.read)  # [1, n_kv, start + num_new, d]
        keys, values = keys.float(), values.float()  # a no-op on the fallback's float32 pool
        n_kv = keys.shape[1]
        qf = q[0, :, seg.offset : seg.offset + seg.num_new].float()  # [n_heads, num_new, d]
        for j in range(seg.num_new):
            t = seg.start + j
            position = int(meta.positions[seg.offset + j])
            lo = 0 if sliding_window is None else max(0, position + 1 - sliding_window)
            seen = slice(lo, t + 1)
            if seg.tree is not None and t >= seg.tree.base:  # the prefix, its ancestors and itself
                base = seg.tree.base
                seen = torch.cat([torch.arange(lo, base), base + seg.tree.visible[t - base].nonzero()[:, 0]])
            qs = (qf[:, j].reshape(n_kv, n_heads // n_kv, d) * scale).contiguous()  # [n_kv, group, d]
            probs = torch.matmul(qs, keys[0][:, seen].transpose(1, 2)).softmax(-1)  # [n_kv, group, keys]
            out[0, :, seg.offset + j] = torch.matmul(probs, values[0][:, seen]).reshape(n_heads, d)
    return out.transpose(1, 2).flatten(2)
