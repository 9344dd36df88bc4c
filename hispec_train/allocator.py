"""Keep freed memory in the process (glibc): training's large temporaries are not page-faulted anew.

A training step allocates and frees tensors of tens of MB over and over (``[rows, vocab]`` logits,
``[B, heads, T, T]`` attention scores). glibc serves every allocation above its mmap threshold
(at most 32 MB) with a fresh ``mmap`` and returns it on ``free``, so each such tensor costs a page
fault per 4 KB page on first touch: on the feature-attention recipe this was a third of a step's CPU
time (a 9.9 s step took 6.6 s without it). With mmap off and trimming off, freed blocks stay in the
heap and are reused; the process keeps its peak footprint until it exits, which suits a training run.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import sys

logger = logging.getLogger(__name__)

M_TRIM_THRESHOLD = -1  # glibc's mallopt parameters (malloc.h)
M_MMAP_MAX = -4
DISABLE_ENV = "HISPEC_KEEP_FREED_MEMORY"  # "0": leave the allocator as it is


def keep_freed_memory() -> bool:
    """Turn off glibc's mmap for large blocks and heap trimming in this process; True if done.

    Nothing happens off Linux/glibc or with ``HISPEC_KEEP_FREED_MEMORY=0``. Blocks a thread's
    arena cannot hold still fall back to mmap (glibc does so by itself)."""
    if os.environ.get(DISABLE_ENV, "1") == "0" or not sys.platform.startswith("linux"):
        return False
    name = ctypes.util.find_library("c")
    if name is None:
        return False
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # not glibc (musl has no mallopt)
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    done = mallopt(M_MMAP_MAX, 0) == 1 and mallopt(M_TRIM_THRESHOLD, 2**31 - 1) == 1
    if done:
        logger.debug("glibc keeps freed memory (mmap for large blocks and trimming off)")
    return done
