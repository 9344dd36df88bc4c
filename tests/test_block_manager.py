"""The torch-free block manager: random operation sequences keep every invariant."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hispec_decode import OutOfBlocksError
from hispec_decode.cache.block_manager import BlockManager

BANDS = 3
ops = st.lists(
    st.tuples(st.sampled_from(["add", "grow", "band", "truncate", "free"]),
              st.integers(0, 5), st.integers(0, 60), st.integers(0, BANDS - 1)),
    max_size=80,
)


@settings(max_examples=300, deadline=None)
@given(ops, st.integers(1, 24), st.sampled_from([1, 4, 16]))
def test_random_operations_keep_invariants(operations, num_blocks, block_size):
    m = BlockManager(num_blocks, block_size)
    for op, seq, n, band in operations:
        if op == "add" and seq not in m.seqs:
            m.add(seq, BANDS)
        elif op == "grow" and seq in m.seqs:
            before = (list(m.table(seq)), m.num_free)
            try:
                m.reserve(seq, n)
            except OutOfBlocksError:
                assert (m.table(seq), m.num_free) == before, "a failed reserve changes nothing"
                continue
            assert len(m.table(seq)) >= m.blocks_for(n)
            # writing bands 0..band up to n keeps lengths non-increasing
            for b in range(band + 1):
                lengths = m.lengths(seq)
                m.set_length(seq, b, max(n, lengths[0]) if b == 0 else max(lengths[b], min(n, lengths[b - 1])))
        elif op == "truncate" and seq in m.seqs:
            m.truncate(seq, n)
            assert all(x <= n for x in m.lengths(seq))
            assert len(m.table(seq)) == m.blocks_for(max(m.lengths(seq)))
        elif op == "free" and seq in m.seqs:
            m.free(seq)
        m.check()
        held = sum(len(m.table(s)) for s in m.seqs)
        assert held + m.num_free == num_blocks, "every block is free or held, never both"
    for seq in list(m.seqs):
        m.free(seq)
    m.check()
    assert m.num_free == num_blocks


def test_truncate_frees_whole_blocks_no_band_needs():
    m = BlockManager(10, 4)
    m.add(7, 3)
    m.reserve(7, 13)
    for band, n in enumerate((13, 9, 5)):
        m.set_length(7, band, n)
    assert len(m.table(7)) == 4 and m.num_free == 6
    m.truncate(7, 8)  # drafts rejected: bands become (8, 8, 5)
    assert m.lengths(7) == [8, 8, 5] and len(m.table(7)) == 2 and m.num_free == 8
    with pytest.raises(OutOfBlocksError, match="needs 9 more"):
        m.reserve(7, 44)
    m.check()
