"""A torch-free block manager for the paged KV cache.

The cache is a pool of fixed-size blocks (``block_size`` token slots each, shared by every
layer: block ``b`` is slot range ``b*block_size .. (b+1)*block_size`` in each layer's pool).
Each sequence owns a block table (its logical blocks in order) and one length per *band* of
layers: HiSpec's lower layers hold drafts the upper layers have not seen yet, so band 0
(``layers[0:L_d]``) is always at least as long as band 1, and band 1 as band 2.

Blocks carry reference counts so that sequences can share a prefix (:meth:`fork`); a write
into a shared block first copies it (copy-on-write: :meth:`reserve` returns the copies the
caller must apply to the K/V pools). Truncating rejected tokens frees every block that no
band needs any more. :meth:`check` verifies all invariants; the tests call it after every
operation.
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
        self.refcount = [0] * num_blocks
        self._free = list(range(num_blocks - 1, -1, -1))  # a stack: low block ids come out first
        self.seqs: dict[int, SequenceBlocks] = {}

    # -- queries ----------------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        return len(self._free)

    def blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.block_size)

    def extra_blocks(self, seq_id: int, length: int) -> int:
        """Blocks that growing ``seq_id`` to ``length`` tokens would take from the free list
        (new blocks, plus copies of shared blocks the write would touch)."""
        seq = self.seqs[seq_id]
        new = max(0, self.blocks_for(length) - len(seq.table))
        first = min(seq.lengths) // self.block_size if seq.lengths else 0
        shared = sum(1 for b in seq.table[first : self.blocks_for(length)] if self.refcount[b] > 1)
        return new + shared

    def table(self, seq_id: int) -> list[int]:
        return self.seqs[seq_id].table

    def lengths(self, seq_id: int) -> list[int]:
        return self.seqs[seq_id].lengths

    # -- operations -------------------------------------------------------------------------
    def add(self, seq_id: int, num_bands: int) -> None:
        if seq_id in self.seqs:
            raise HiSpecError(f"sequence {seq_id} already has blocks")
        self.seqs[seq_id] = SequenceBlocks([], [0] * num_bands)

    def reserve(self, seq_id: int, length: int) -> list[tuple[int, int]]:
        """Make slots ``min(lengths) .. length`` writable for ``seq_id``: allocate the blocks the
        table lacks and give the sequence private copies of shared blocks in that range.
        Returns ``(src, dst)`` block copies the caller applies to the pools before writing.
        Raises :class:`OutOfBlocksError` without changing anything if the pool is too small."""
        need = self.extra_blocks(seq_id, length)
        if need > len(self._free):
            raise OutOfBlocksError(
                f"sequence {seq_id} needs {need} more KV blocks for {length} tokens; {len(self._free)} of "
                f"{self.num_blocks} are free"
            )
        seq = self.seqs[seq_id]
        copies = []
        first = min(seq.lengths) // self.block_size
        for i in range(first, len(seq.table)):
            if i < self.blocks_for(length) and self.refcount[seq.table[i]] > 1:
                dst = self._pop()
                self.refcount[seq.table[i]] -= 1
                copies.append((seq.table[i], dst))
                seq.table[i] = dst
        while len(seq.table) < self.blocks_for(length):
            seq.table.append(self._pop())
        return copies

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
            self._release(seq.table.pop())

    def fork(self, parent: int, child: int) -> None:
        """``child`` shares every block of ``parent`` (reference counts +1), same lengths."""
        if child in self.seqs:
            raise HiSpecError(f"sequence {child} already has blocks")
        src = self.seqs[parent]
        for b in src.table:
            self.refcount[b] += 1
        self.seqs[child] = SequenceBlocks(list(src.table), list(src.lengths))

    def free(self, seq_id: int) -> None:
        """Release every block of ``seq_id`` (shared blocks survive while others hold them)."""
        for b in self.seqs.pop(seq_id).table:
            self._release(b)

    # -- internals --------------------------------------------------------------------------
    def _pop(self) -> int:
        b = self._free.pop()
        self.refcount[b] = 1
        return b

    def _release(self, b: int) -> None:
        self.refcount[b] -= 1
        if self.refcount[b] == 0:
            self._free.append(b)

    def check(self) -> None:
        """Assert every invariant: reference counts equal table references, free blocks are
        exactly the unreferenced ones, no table holds a block twice, lengths are non-increasing
        across bands and fit the table."""
        counts = [0] * self.num_blocks
        for seq_id, seq in self.seqs.items():
            assert seq.lengths == sorted(seq.lengths, reverse=True), (seq_id, seq.lengths)
            assert len(seq.table) >= self.blocks_for(max(seq.lengths, default=0)), (seq_id, seq.table, seq.lengths)
            assert len(set(seq.table)) == len(seq.table), f"sequence {seq_id} holds a block twice"
            for b in seq.table:
                counts[b] += 1
        assert counts == self.refcount, "reference counts differ from the tables"
        free = set(self._free)
        assert len(free) == len(self._free), "a block is on the free list twice"
        assert free == {b for b in range(self.num_blocks) if counts[b] == 0}, "free list != unreferenced blocks"

    def usage(self) -> dict[str, int]:
        """Token slots held by allocated blocks vs tokens the sequences' longest bands need."""
        held = (self.num_blocks - len(self._free)) * self.block_size
        needed = sum(max(s.lengths, default=0) for s in self.seqs.values())
        return {"slots_held": held, "tokens_needed": needed, "blocks_used": self.num_blocks - len(self._free)}
