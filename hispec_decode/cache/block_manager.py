"""A torch-free block manager for the paged KV cache.

The cache is a pool of fixed-size blocks (``block_size`` token slots each, shared by every
layer: block ``b`` is slot range ``b*block_size .. (b+1)*block_size`` in each layer's pool).
Each sequence owns a block table (its logical blocks in order) and one length per *band* of
layers: HiSpec's lower layers hold drafts the upper layers have not seen yet, so band 0
(``layers[0:L_d]``) is always at least as long as band 1, and band 1 as band 2.

Every block is free or held by exactly one table (no sharing: a prompt decoded ``n`` times
is prefilled ``n`` times; prefix sharing would add reference counts here). Truncating rejected
tokens frees every block that no band needs any more. :meth:`check` verifies all invariants;
the tests call it after every operation.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..errors import HiSpecError, OutOfBlocksError

DEFAULT_BLOCK_SIZE = 16


@dataclass
class SequenceBlocks:
    table: list[int] = field(default_factory=list)  # physical block of each logical block
    lengths: list[int] = field(default_factory=list)  # valid tokens per band, non-increasing


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int = DEFAULT_BLOCK_SIZE) -> None:
        if num_blocks < 1 or block_size < 1:
            raise HiSpecError(f"need num_blocks >= 1 and block_size >= 1; got {num_blocks}, {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free = list(range(num_blocks - 1, -1, -1))  # a stack: low block ids come out first
        self.seqs: dict[int, SequenceBlocks] = {}

    # -- queries ----------------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        return len(self._free)

    def blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.block_size)

    def extra_blocks(self, seq_id: int, length: int) -> int:
        """Blocks that growing ``seq_id`` to ``length`` tokens would take from the free list."""
        return max(0, self.blocks_for(length) - len(self.seqs[seq_id].table))

    def table(self, seq_id: int) -> list[int]:
        return self.seqs[seq_id].table

    def lengths(self, seq_id: int) -> list[int]:
        return self.seqs[seq_id].lengths

    # -- operations -------------------------------------------------------------------------
    def add(self, seq_id: int, num_bands: int) -> None:
        if seq_id in self.seqs:
            raise HiSpecError(f"sequence {seq_id} already has blocks")
        self.seqs[seq_id] = SequenceBlocks([], [0] * num_bands)

    def reserve(self, seq_id: int, length: int) -> None:
        """Give ``seq_id`` the blocks its table lacks for ``length`` tokens. Raises
        :class:`OutOfBlocksError` without changing anything if the pool is too small."""
        need = self.extra_blocks(seq_id, length)
        if need > len(self._free):
            raise OutOfBlocksError(
                f"sequence {seq_id} needs {need} more KV blocks for {length} tokens; {len(self._free)} of "
                f"{self.num_blocks} are free"
            )
        table = self.seqs[seq_id].table
        for _ in range(need):
            table.append(self._free.pop())

    def set_length(self, seq_id: int, band: int, length: int) -> None:
        """Band ``band`` of ``seq_id`` now holds ``length`` valid tokens (slots must be reserved)."""
        seq = self.seqs[seq_id]
        if length > len(seq.table) * self.block_size:
            raise RuntimeError(f"sequence {seq_id}: length {length} exceeds its reserved blocks")
        seq.lengths[band] = length

    def truncate(self, seq_id: int, length: int) -> None:
        """Drop tokens at positions >= ``length`` in every band; free blocks no band needs."""
        seq = self.seqs[seq_id]
        seq.lengths = [min(n, length) for n in seq.lengths]
        keep = self.blocks_for(max(seq.lengths, default=0))
        while len(seq.table) > keep:
            self._free.append(seq.table.pop())

    def free(self, seq_id: int) -> None:
        """Release every block of ``seq_id``."""
        self._free.extend(reversed(self.seqs.pop(seq_id).table))

    def check(self) -> None:
        """Assert every invariant: every block is either free or in exactly one table, once;
        lengths are non-increasing across bands and fit the table."""
        counts = [0] * self.num_blocks
        for seq_id, seq in self.seqs.items():
            assert seq.lengths == sorted(seq.lengths, reverse=True), (seq_id, seq.lengths)
            assert len(seq.table) >= self.blocks_for(max(seq.lengths, default=0)), (seq_id, seq.table, seq.lengths)
            assert len(set(seq.table)) == len(seq.table), f"sequence {seq_id} holds a block twice"
            for b in seq.table:
                counts[b] += 1
        assert max(counts, default=0) <= 1, "a block is in two tables"
        free = set(self._free)
        assert len(free) == len(self._free), "a block is on the free list twice"
        assert free == {b for b in range(self.num_blocks) if counts[b] == 0}, "free list != the blocks no table holds"

    def usage(self) -> dict[str, int]:
        """Token slots held by allocated blocks vs tokens the sequences' longest bands need."""
        held = (self.num_blocks - len(self._free)) * self.block_size
        needed = sum(max(s.lengths, default=0) for s in self.seqs.values())
        return {"slots_held": held, "tokens_needed": needed, "blocks_used": self.num_blocks - len(self._free)}
