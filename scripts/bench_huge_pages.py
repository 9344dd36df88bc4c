"""Weights on 2 MiB pages against weights on the pages torch's allocator gives, side by side.

Two copies of each base load in one process, one with ``HISPEC_HUGE_PAGES=0`` (its kernels built
under that setting too), and plain decoding of a one-token prompt alternates between them round
after round (the order flips every round), 128 new tokens each; every output must equal the other
copy's. Then one call of each copy's LM head, alternating (one long stream from memory). Prints each
base's speeds, the per-round ratio (min / median / max) and the LM head's times, and writes JSON.

    python scripts/bench_huge_pages.py --bases qwen2.5-coder-1.5b,smollm2-135m --rounds 8
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
NEW_TOKENS = 128


def anon_huge_bytes() -> int:
    try:
        for line in Path("/proc/self/smaps_rollup").read_text().splitlines():
            if line.startswith("AnonHugePages:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def lm_head_ms(models: dict, rounds: int, calls: int = 10) -> dict[str, float]:
    """Median milliseconds of one call of each copy's LM head on one row (its weight read from memory:
    the two copies' heads alternate, each larger than the caches), calls alternating."""
    times: dict[str, list[float]] = {name: [] for name in models}
    x = torch.randn(1, models["small pages"].decoder.config.hidden_size).to(models["small pages"].decoder.dtype)
    for _ in range(rounds * calls):
        for name, model in models.items():
            t0 = time.perf_counter()
            model.decoder.lm_head_kernel(x)
            times[name].append((time.perf_counter() - t0) * 1e3)
    return {name: statistics.median(v) for name, v in times.items()}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--bases", default="qwen2.5-coder-1.5b")
    p.add_argument("--dtype", default="auto", help="auto (native for GGUF bases) or bfloat16")
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument("--threads", type=int, default=torch.get_num_threads())
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    sys.path.insert(0, str(ROOT))
    from hispec_decode import HiSpecModel, machine

    torch.set_num_threads(args.threads)
    os.environ.setdefault("HISPEC_DERIVE", "now")  # no policy derivation in the background beside the timings
    results = {"machine": machine.describe(), "threads": args.threads, "dtype": args.dtype, "new_tokens": NEW_TOKENS,
               "bases": {}}
    print(f"machine: {machine.summary(results['machine'])}")
    for alias in args.bases.split(","):
        models, huge = {}, {}
        for name in ("small pages", "huge pages"):
            os.environ["HISPEC_HUGE_PAGES"] = "1" if name == "huge pages" else "0"
            before = anon_huge_bytes()
            model = HiSpecModel.from_pretrained(alias, heads="none", dtype=args.dtype)
            model.decoder.layer_kernels, model.decoder.layer_stack  # noqa: B018 (built under this setting)
            models[name], huge[name] = model, anon_huge_bytes() - before
        os.environ.pop("HISPEC_HUGE_PAGES")
        prompt = [next(iter(models["small pages"].decoder.default_eos_ids()), 0)]
        speeds: dict[str, list[float]] = {name: [] for name in models}
        reference = None
        for r in range(args.rounds + 1):  # round 0 warms both up
            for name in (list(models) if r % 2 else list(models)[::-1]):
                t0 = time.perf_counter()
                out = models[name].generate([prompt], max_new_tokens=NEW_TOKENS, method="autoregressive",
                                            eos_token_id=())
                seconds = time.perf_counter() - t0
                reference = reference or out.sequences[0]
                if out.sequences[0] != reference:
                    raise SystemExit(f"{alias}: the two copies decoded different tokens")
                if r:
                    speeds[name].append(NEW_TOKENS / seconds)
        ratios = sorted(h / s for h, s in zip(speeds["huge pages"], speeds["small pages"]))
        head = lm_head_ms(models, args.rounds)
        row = {"tok_s": speeds, "anon_huge_bytes": huge, "lm_head_ms": head,
               "ratio": {"min": ratios[0], "median": statistics.median(ratios), "max": ratios[-1]}}
        results["bases"][alias] = row
        print(f"{alias}: small pages {statistics.median(speeds['small pages']):.1f} tok/s, huge pages "
              f"{statistics.median(speeds['huge pages']):.1f} (medians); huge / small per round "
              f"{ratios[0]:.2f} / {statistics.median(ratios):.2f} / {ratios[-1]:.2f}; "
              f"{huge['huge pages'] / 2**20:.0f} MiB on huge pages; one LM head call (one row) "
              f"{head['small pages']:.2f} / {head['huge pages']:.2f} ms")
        del models
    out = args.out or ROOT / "docs" / "results" / f"huge-pages-{machine.key('cpu', args.dtype, 'pages')}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
