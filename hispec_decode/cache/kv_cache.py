"""Paged K/V storage: one block pool per layer, addressed through the block manager's tables.

Layer ``l`` keeps ``keys[l]`` and ``values[l]`` of shape ``[n_kv_heads, num_blocks * block_size,
head_dim]``; a token at position ``p`` of a sequence lives in slot
``table[p // block_size] * block_size + p % block_size`` of every layer. Which slots are valid
is the block manager's business (a length per band); stale slots after a rejection are
simply written again, never read. When a sequence's blocks happen to be consecutive (the
common case for short batches) reads and writes are slices, otherwise index gathers.
"""

from __future__ import annotations

import torch

from .block_manager import BlockManager

Slots = slice | torch.Tensor


class PagedKVCache:
    def __init__(
        self,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
    ) -> None:
        self.manager = BlockManager(num_blocks, block_size)
        self.block_size = block_size
        self.device = torch.device(device)
        shape = (num_kv_heads, num_blocks * block_size, head_dim)
        # Zeros: batched one-token attention reads whole blocks, padding included, and multiplies the
        # padding's values by probability 0, which must not meet a NaN left in uninitialised memory.
        self.keys = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.values = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self._stack_pools = None

    def stack_pools(self):
        """The pools as the compiled layer stack takes them (:mod:`hispec_decode.kernels`), made once."""
        if self._stack_pools is None:
            from .. import kernels

            self._stack_pools = kernels.ops().StackPools(self.keys, self.values)
        return self._stack_pools

    def slots(self, seq_id: int, start: int, end: int) -> Slots:
        """Pool slots of positions ``start..end`` of ``seq_id`` (a slice when contiguous)."""
        table, bs = self.manager.table(seq_id), self.block_size
        if end <= start:
            return slice(0, 0)
        first, last = start // bs, (end - 1) // bs
        if all(table[i + 1] == table[i] + 1 for i in range(first, last)):
            base = table[first] * bs + start % bs
            return slice(base, base + end - start)
        idx = [table[p // bs] * bs + p % bs for p in range(start, end)]
        return torch.tensor(idx, dtype=torch.long, device=self.device)

    def write(self, layer: int, slots: Slots, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store new K/V ``[1, n_kv, T, d]`` at ``slots`` (T of them)."""
        keys, values = self.keys[layer], self.values[layer]
        keys[:, slots] = k[0].to(keys.dtype)  # a float32 pool (batch-invariant mode) keeps bf16 exactly
        values[:, slots] = v[0].to(values.dtype)

    def move(self, seq_id: int, pairs: list[tuple[int, int]]) -> None:
        """Copy the K/V of positions ``src`` to positions ``dst`` of ``seq_id`` in every layer, for
        each ``(src, dst)`` of ``pairs`` (an accepted tree path moved to consecutive slots)."""
        if not pairs:
            return
        table, bs = self.manager.table(seq_id), self.block_size
        src = torch.tensor([table[p // bs] * bs + p % bs for p, _ in pairs], device=self.device)
        dst = torch.tensor([table[p // bs] * bs + p % bs for _, p in pairs], device=self.device)
        for pool in (*self.keys, *self.values):
            pool[:, dst] = pool[:, src]  # the gather copies first, so overlapping pairs are safe

    def read(self, layer: int, slots: Slots) -> tuple[torch.Tensor, torch.Tensor]:
        """K/V at ``slots`` as ``[1, n_kv, S, d]`` each."""
        if isinstance(slots, slice):
            return self.keys[layer][None, :, slots], self.values[layer][None, :, slots]
        return self.keys[layer].index_select(1, slots)[None], self.values[layer].index_select(1, slots)[None]

    def read_blocks(self, layer: int, blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K/V of whole blocks as ``[n_kv, len(blocks), block_size, d]`` each."""
        k, v = self.keys[layer], self.values[layer]
        shape = (k.shape[0], -1, self.block_size, k.shape[2])
        return k.view(shape).index_select(1, blocks), v.view(shape).index_select(1, blocks)

    def bytes_per_token(self) -> int:
        k = self.keys[0]
        return 2 * len(self.keys) * k.shape[0] * k.shape[2] * k.element_size()
