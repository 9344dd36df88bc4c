"""The block kernel (``linear_q``) of another git revision against the working tree's, side by side.

Builds ``hispec_decode/kernels/csrc/linear_q.cpp`` twice with the extension's flags (the revision's
sources from ``git show``, the working tree's as they are), checks that both give the same bits on
every shape and row count, then times them call against call, interleaved round after round, and
prints each one's median milliseconds and the ratio. The weights are random blocks of the named
formats at a real model's shapes (default: Qwen2.5-Coder-1.5B's Q4_K_M weights), interleaved (x8).
``--from-memory`` cycles each call through copies of the weight that together exceed the caches, so
that every call reads its weight from memory, as a model's layers are read during decoding.

    python scripts/bench_block_kernel.py --rev HEAD --rows 1,2,4,8,16 --rounds 15 [--from-memory]
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parent.parent
CSRC = "hispec_decode/kernels/csrc"
HEADERS = ("vec.h", "quant_blocks.h", "blocks_rows.h", "blocks_x8.h", "linear_q.cpp")
SHAPES = {  # name -> (format, out features, in features): Qwen2.5-Coder-1.5B's Q4_K_M weights, then 0.5B's, SmolLM2's
    "qkv Q4_K": ("Q4_K", 2048, 1536), "gate+up Q4_K": ("Q4_K", 17920, 1536), "down Q6_K": ("Q6_K", 1536, 8960),
    "o Q4_K": ("Q4_K", 1536, 1536), "lm_head Q6_K": ("Q6_K", 151936, 1536),
    "0.5B gate+up Q5_0": ("Q5_0", 9728, 896), "0.5B down Q8_0": ("Q8_0", 896, 4864),
    "smol gate+up Q4_1": ("Q4_1", 3072, 576)}
DEFAULT = "qkv Q4_K,gate+up Q4_K,down Q6_K,lm_head Q6_K"


def build(name: str, sources: Path):
    from torch.utils.cpp_extension import load_inline

    out = Path(tempfile.mkdtemp(prefix=f"bench_{name}_"))
    return load_inline(f"bench_linear_q_{name}", cpp_sources=[f'#include "{sources / "linear_q.cpp"}"\n'],
                       functions=["linear_q"], extra_cflags=["-O3", "-march=native", "-fopenmp", "-ffp-contract=off"],
                       extra_ldflags=["-fopenmp"], extra_include_paths=[str(sources)], build_directory=str(out))


def sources_at(rev: str) -> Path:
    out = Path(tempfile.mkdtemp(prefix="bench_src_"))
    for f in HEADERS:
        text = subprocess.run(["git", "show", f"{rev}:{CSRC}/{f}"], cwd=ROOT, check=True, capture_output=True).stdout
        (out / f).write_bytes(text)
    return out


MEMORY_BYTES = 512 << 20  # copies of a weight with --from-memory: at least this many bytes in all


def median_ms(fn, reps: int) -> float:
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rev", default="HEAD", help="the git revision compared against the working tree")
    ap.add_argument("--rows", default="1,2,4,8,16")
    ap.add_argument("--shapes", default=DEFAULT, help=f"some of: {', '.join(SHAPES)}")
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--from-memory", action="store_true", help="each call reads its weight from memory, not a cache")
    args = ap.parse_args()
    sys.path.insert(0, str(ROOT / "tests"))
    from hispec_decode.layers import quant
    from test_native import random_blocks

    torch.set_num_threads(args.threads)
    old, new = build("old", sources_at(args.rev)), build("new", ROOT / CSRC)
    rows = [int(r) for r in args.rows.split(",")]
    print(f"threads {args.threads}; {args.rev} against the working tree; ms per call, median of {args.rounds} rounds")
    print(f"{'weight':<18} {'rows':>4} {'old ms':>8} {'new ms':>8} {'old/new':>8}")
    none = torch.empty(0)
    for shape in args.shapes.split(","):
        fmt, n, k = SHAPES[shape]
        blocks, t = quant.pack(torch.from_numpy(np.ascontiguousarray(random_blocks(quant.SERVED[fmt], n, k))),
                               quant.SERVED[fmt])
        copies = [blocks] + [blocks.clone() for _ in range(-(-MEMORY_BYTES // blocks.numel()) - 1)] if args.from_memory \
            else [blocks]
        turn = itertools.count()

        def call(fn, x):
            return fn(x, copies[next(turn) % len(copies)], t, none)

        for m in rows:
            x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
            a, b = old.linear_q(x, blocks, t, none), new.linear_q(x, blocks, t, none)
            if not torch.equal(a, b):
                raise SystemExit(f"{shape}, {m} rows: the two builds differ (max {float((a - b).abs().max())})")
            times = {"old": [], "new": []}
            for _ in range(args.rounds):  # interleaved: the machine's drift hits both alike
                times["old"].append(median_ms(lambda: call(old.linear_q, x), 3))
                times["new"].append(median_ms(lambda: call(new.linear_q, x), 3))
            o, w = statistics.median(times["old"]), statistics.median(times["new"])
            print(f"{shape:<18} {m:>4} {o:>8.3f} {w:>8.3f} {o / w:>7.2f}x")


if __name__ == "__main__":
    main()
