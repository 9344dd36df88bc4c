"""Weights moved onto 2 MiB pages (hispec_decode.layers.huge_pages): same values, shared storages
still shared, the mapping advised (the kernel's ``THPeligible``: whether huge pages were free to back it
at that moment does not decide a verdict)."""
from __future__ import annotations

import mmap
from pathlib import Path

import pytest
import torch

from hispec_decode.layers import huge_pages
from hispec_decode.layers.huge_pages import HUGE_PAGE, move_to_huge_pages

from test_native import needs_kernel

linux = pytest.mark.skipif(not hasattr(mmap, "MADV_HUGEPAGE"), reason="MADV_HUGEPAGE is Linux's")


def thp_mode() -> str:
    try:
        text = Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text()
    except OSError:
        return "never"
    return text.split("[", 1)[1].split("]", 1)[0]


def thp_eligible(address: int) -> bool:
    """Whether the kernel may back the mapping of this process that holds ``address`` with huge pages
    (its ``THPeligible``: set by the advice, whether or not huge pages were free at the moment)."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and all(c in "0123456789abcdef-" for c in head):
            lo, hi = (int(v, 16) for v in head.split("-"))
            inside = lo <= address < hi
        elif inside and line.startswith("THPeligible:"):
            return line.split()[1] == "1"
    return False


@linux
def test_tensors_move_with_their_values_views_and_shared_storages(monkeypatch):
    monkeypatch.setenv("HISPEC_HUGE_PAGES", "1")
    fused = torch.randint(0, 256, (1024, 3000), dtype=torch.uint8)  # 3 MB: slices of one storage
    q, kv = fused[:600], fused[600:]
    dense = torch.randn(700, 513, dtype=torch.bfloat16)  # another dtype, another storage
    lone = torch.randint(0, 256, (5, 7), dtype=torch.uint8)
    before = [t.clone() for t in (fused, q, kv, dense, lone)]
    old = fused.untyped_storage().data_ptr()
    moved = move_to_huge_pages([fused, q, kv, dense, lone, q])  # a tensor passed twice moves once
    assert moved >= fused.numel() + dense.numel() * 2 + lone.numel()
    for t, ref in zip((fused, q, kv, dense, lone), before):
        assert torch.equal(t, ref)
    assert fused.untyped_storage().data_ptr() != old
    assert q.data_ptr() == fused.data_ptr() and kv.data_ptr() == fused.data_ptr() + 600 * 3000
    one = fused.untyped_storage().data_ptr()
    assert all(t.untyped_storage().data_ptr() == one for t in (q, kv, dense, lone))  # one mapping for all
    assert fused.data_ptr() % HUGE_PAGE == 0  # the first storage opens the aligned region
    assert dense.data_ptr() % 64 == 0 and lone.data_ptr() % 64 == 0
    kv.add_(0)  # still ordinary tensors
    if thp_mode() in ("always", "madvise"):
        assert thp_eligible(fused.data_ptr())


def test_switched_off_nothing_moves(monkeypatch):
    monkeypatch.setenv("HISPEC_HUGE_PAGES", "0")
    t = torch.ones(1 << 20, dtype=torch.uint8)
    ptr = t.data_ptr()
    assert not huge_pages.enabled()
    assert move_to_huge_pages([t]) == 0 and t.data_ptr() == ptr


@linux
@needs_kernel
def test_native_blocks_load_onto_one_huge_page_mapping(monkeypatch):
    """The default base on native weights: every block tensor (the fused q/k/v and gate/up buffers
    included) is read into one buffer on huge pages, and decoding from it equals plain decoding of a
    load that kept its weights on ordinary pages."""
    from hispec_decode import HiSpecModel
    from hispec_decode.layers.quant import BlockLinear

    monkeypatch.setenv("HISPEC_HUGE_PAGES", "1")
    model = HiSpecModel.from_pretrained(heads="none", dtype="native")
    blocks = [m.blocks for m in model.base_model.modules() if isinstance(m, BlockLinear)]
    storages = {b.untyped_storage().data_ptr() for b in blocks}
    assert len(storages) == 1
    if thp_mode() in ("always", "madvise"):
        assert thp_eligible(blocks[0].data_ptr())
    monkeypatch.setenv("HISPEC_HUGE_PAGES", "0")
    plain = HiSpecModel.from_pretrained(heads="none", dtype="native")
    held = [m.blocks for m in plain.base_model.modules() if isinstance(m, BlockLinear)]
    assert len({b.untyped_storage().data_ptr() for b in held}) == 1  # one buffer all the same
    if thp_mode() == "madvise":  # huge pages only where asked for
        assert not thp_eligible(held[0].data_ptr())
    prompt = [[1, 2, 3, 4]]
    assert model.generate(prompt, max_new_tokens=12, method="autoregressive").sequences == \
        plain.generate(prompt, max_new_tokens=12, method="autoregressive").sequences
