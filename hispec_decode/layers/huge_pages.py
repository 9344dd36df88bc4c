"""Weights on 2 MiB pages: one anonymous mapping, advised ``MADV_HUGEPAGE``, that a model's large
read-only tensors are read into (:func:`huge_page_buffer`: the GGUF loader reads its blocks straight
into one) or copied into (:func:`move_to_huge_pages`: packed bf16 copies, vocabulary rows).

Decoding one token reads every weight once, gigabytes a second in streams the hardware prefetches.
On 4 KiB pages each page of such a stream costs a TLB miss and a page walk (a 1 GB model: 262,144
walks a token), and the prefetchers stop at page boundaries; on 2 MiB pages there are 512 times
fewer. torch allocates tensors on whatever pages ``malloc`` gives (4 KiB here unless the system's
transparent huge pages are ``always``), so the weights are copied, storage by storage, into one
mapping that asks for huge pages, and every tensor that views a storage is re-pointed at its copy
(``Tensor.set_``: the same tensor objects, so modules and compiled kernels holding them read the
copy). The originals are freed as their last view moves, so the peak is the weights plus one storage.

Linux only (elsewhere, or with ``HISPEC_HUGE_PAGES=0``, nothing moves). Where the kernel's transparent
huge pages are ``never`` the advice does nothing and the copy still works, on 4 KiB pages.
"""

from __future__ import annotations

import logging
import mmap
import os
from collections.abc import Iterable

import torch

logger = logging.getLogger(__name__)

HUGE_PAGE = 2 << 20
ALIGN = 64  # each storage starts on its own cache line inside the mapping


def enabled() -> bool:
    """Whether weights move to huge pages here: Linux's ``MADV_HUGEPAGE``, and not switched off."""
    return hasattr(mmap, "MADV_HUGEPAGE") and os.environ.get("HISPEC_HUGE_PAGES", "1") != "0"


def move_to_huge_pages(tensors: Iterable[torch.Tensor]) -> int:
    """Copy the storages of ``tensors`` (CPU, dense) into one huge-page mapping and re-point every
    one of them there; returns the bytes moved (0 when nothing moved). Tensors that share a storage
    (slices of one fused weight) keep sharing it. A tensor viewing a storage but not passed keeps the
    old bytes alive (equal values, only memory); pass every view. The tensors must not be resized
    afterwards."""
    if not enabled():
        return 0
    views: dict[int, list[torch.Tensor]] = {}
    storages: dict[int, torch.UntypedStorage] = {}
    seen: set[int] = set()
    for t in tensors:
        if id(t) in seen or t.device.type != "cpu" or t.layout != torch.strided or t.untyped_storage().nbytes() == 0:
            continue
        seen.add(id(t))
        storage = t.untyped_storage()
        key = storage.data_ptr()
        storages.setdefault(key, storage)
        views.setdefault(key, []).append(t)
    total = sum(padded(s.nbytes()) for s in storages.values())
    arena = huge_page_buffer(total)
    if arena is None:
        return 0
    target = arena.untyped_storage()
    offset = 0
    for key in list(storages):
        storage = storages.pop(key)  # the original is freed once its last view has moved
        n = storage.nbytes()
        arena[offset: offset + n].copy_(torch.empty(0, dtype=torch.uint8).set_(storage))
        with torch.no_grad():  # (parameters too)
            for t in views[key]:  # offsets in t's elements: every storage starts 64-byte aligned
                t.set_(target, offset // t.element_size() + t.storage_offset(), t.size(), t.stride())
        offset += padded(n)
        del storage
    return total


def padded(n: int) -> int:
    """``n`` bytes rounded up to a whole cache line (where the next tensor in a buffer starts)."""
    return (n + ALIGN - 1) // ALIGN * ALIGN


def huge_page_buffer(nbytes: int) -> torch.Tensor | None:
    """A uint8 tensor of ``nbytes`` on a mapping of its own, starting on a 2 MiB boundary, its whole
    huge pages advised ``MADV_HUGEPAGE`` (a shorter tail stays on small pages); None where huge pages
    are off or the mapping fails. The tensor's storage holds the mapping for as long as any view lives."""
    if not enabled() or nbytes <= 0:
        return None
    try:
        region = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        start = (-torch.frombuffer(region, dtype=torch.uint8, count=1).data_ptr()) % HUGE_PAGE
        whole = nbytes // HUGE_PAGE * HUGE_PAGE
        if whole:
            region.madvise(mmap.MADV_HUGEPAGE, start, whole)
        return torch.frombuffer(region, dtype=torch.uint8, offset=start, count=nbytes)
    except (OSError, ValueError) as exc:  # no memory to map, or advice refused
        logger.warning("weights stay on small pages: %s", exc)
        return None

