"""``hispec-eval-heads``: adapters side by side on a feature store's held-out tokens, measured as drafting
needs them.

    hispec-eval-heads --heads hispec_decode/default_heads/smollm2-135m runs/feature-heads/checkpoint \\
        --features runs/store-smollm2 --out docs/training/heads-compared [--seq-len 640] [--costs]

Per adapter and head: top-1 and top-4 agreement with the final layer of the first draft after a
verification, the acceptance of each position of a chain the head drafts alone (steps 1..4, each given
that every earlier draft was right), the expected accepted length of such a chain, the calibration, and
with ``--costs`` what one token's pass to the exit costs (layers and head) over a full decoding step on
this machine. ``--answers-only`` counts only the positions that predict the base's answer tokens (the
prompts' positions still feed the heads' context), which is where decoding drafts. Writes ``OUT.json``
and ``OUT.png``.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from hispec_decode.adapter.config import HiSpecAdapterConfig
from hispec_decode.errors import HiSpecError
from hispec_decode.extras import pyplot
from hispec_decode.files import save_figure, write_text
from hispec_decode.tools.cli import add_debug_arg, positive_int, run_cli

from .distill import DRAFT_STEPS, Agreement, agreement
from .store import StoreManifest
from .store_data import FeatureStore, answer_starts

logger = logging.getLogger(__name__)


def evaluate_adapter(heads_dir: str, features: str, base: str | None, seq_len: int, batch_size: int,
                     max_tokens: int | None, costs: bool, counted_from: list[int] | None = None) -> dict[str, Any]:
    """One adapter's measurements on the store's held-out split (module docstring); ``counted_from``:
    per held-out sequence, the first position counted (:func:`answer_starts`; default: all)."""
    from hispec_decode import HiSpecModel
    from hispec_decode.adapter.fingerprint import compute_fingerprint
    from hispec_decode.machine import compute_dtype

    # bf16, or float32 on a CPU that would emulate bf16 matmuls (hispec_decode.machine.compute_dtype)
    dtype = "bfloat16" if compute_dtype(torch.bfloat16) == torch.bfloat16 else "float32"
    model = HiSpecModel.from_pretrained(base, heads_dir, dtype=dtype, pack_weights=False)
    decoder, adapter = model.decoder, model.adapter
    layers = sorted(e.layer for e in adapter.config.exits)
    store = FeatureStore(features, layers, "eval", compute_fingerprint(model.base_model))
    heads = {l: adapter.head(l).float().eval() for l in layers}
    counts = Agreement()
    batches = store.sequential(batch_size, seq_len, max_tokens, counted_from)
    with torch.no_grad():
        for b in tqdm(batches, desc=f"evaluating {heads_dir}"):
            agreement(decoder, heads, dict(zip(layers, b.hidden)), b.final, layers[0], layers[min(1, len(layers) - 1)],
                      128, counts, b.valid, b.input_ids)
    out: dict[str, Any] = {"heads": heads_dir, "tokens": counts.tokens, "rates": counts.rates(),
                           "curve": {str(l): c for l, c in counts.curve().items()},
                           "head_types": {str(e.layer): e.head_type for e in adapter.config.exits},
                           "positions": "all" if counted_from is None else "answers"}
    if costs:
        from .curve import exit_costs

        out["cost"] = {str(l): c for l, c in exit_costs(Path(heads_dir), base, "bfloat16").items()}
    return out


def plot(results: list[dict[str, Any]], path: Path) -> None:
    """Acceptance per draft position, one group of bars per adapter and exit."""
    plt = pyplot("hispec-eval-heads --plot")

    fig, ax = plt.subplots(figsize=(9, 4))
    bars = [(f"{Path(r['heads']).name or r['heads']} L{l} ({r['head_types'][l]})", c["acceptance_per_step"])
            for r in results for l, c in r["curve"].items()]
    width = 0.8 / max(1, len(bars))
    for i, (label, acc) in enumerate(bars):
        ax.bar([s + i * width for s in range(DRAFT_STEPS)], acc, width, label=label)
    ax.set_xticks([s + 0.4 - width / 2 for s in range(DRAFT_STEPS)], [f"draft {s + 1}" for s in range(DRAFT_STEPS)])
    ax.set_ylim(0, 1)
    ax.set_ylabel("accepted, given the earlier drafts were")
    ax.set_title("held-out acceptance per draft position (greedy, against the final layer)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    save_figure(fig, path)
    plt.close(fig)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="hispec-eval-heads", description=__doc__.split("\n\n")[0])
    p.add_argument("--heads", nargs="+", required=True, help="adapter directories (or training checkpoints)")
    p.add_argument("--features", required=True, help="a feature store holding the heads' layers")
    p.add_argument("--out", required=True, help="output path without extension (OUT.json, OUT.png)")
    p.add_argument("--base", help="the base (default: embedded SmolLM2)")
    p.add_argument("--seq-len", type=positive_int, default=640, help="held-out windows (attention heads see this much)")
    p.add_argument("--batch-size", type=positive_int, default=8)
    p.add_argument("--max-tokens", type=positive_int, help="held-out tokens to use (default: all)")
    p.add_argument("--costs", action="store_true", help="also time each exit's pass against a full step")
    p.add_argument("--answers-only", action="store_true",
                   help="count only positions whose next token is the base's answer (a self-distilled store), as "
                        "decoding drafts; the prompts' positions still give the heads their context")
    add_debug_arg(p)
    return p


def check_inputs(heads: list[str], features: str) -> None:
    """Every adapter readable and every layer it needs in the store, before any work."""
    manifest = StoreManifest.load(features)
    for h in heads:
        config = HiSpecAdapterConfig.from_pretrained(h)
        missing = sorted({e.layer for e in config.exits} - set(manifest.layers))
        if missing:
            raise HiSpecError(f"feature store {features} holds layers {manifest.layers}; adapter {h} needs {missing} "
                              f"too: rebuild the store with hispec-store --layers including them")


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")

    def run() -> int:
        out = Path(args.out)
        if out.suffix in (".json", ".png"):  # a dot elsewhere is part of the name (qwen2.5-...)
            raise HiSpecError(f"--out is a path without extension (OUT.json and OUT.png are written); got {out}")
        check_inputs(args.heads, args.features)
        starts = answer_starts(args.features, "eval") if args.answers_only else None  # before any model loads
        results = [evaluate_adapter(h, args.features, args.base, args.seq_len, args.batch_size, args.max_tokens,
                                    args.costs, starts) for h in args.heads]
        out.parent.mkdir(parents=True, exist_ok=True)
        write_text(out.parent / f"{out.name}.json", json.dumps(results, indent=2, sort_keys=True) + "\n")
        plot(results, out.parent / f"{out.name}.png")
        for r in results:
            for l, c in r["curve"].items():
                acc = ", ".join(f"{a:.3f}" for a in c["acceptance_per_step"])
                cost = f", cost {r['cost'][l]:.3f}" if "cost" in r else ""
                print(f"{r['heads']} L{l} ({r['head_types'][l]}): top-1 {c['top1']:.3f}, top-4 {c['top4']:.3f}, "
                      f"acceptance per draft [{acc}], chain {r['rates'][f'chain_accepted/L{l}']:.2f}{cost}")
        print(f"wrote {out}.json and {out}.png")
        return 0

    return run_cli("hispec-eval-heads", run, args.debug, extra="train")


if __name__ == "__main__":
    sys.exit(main())
