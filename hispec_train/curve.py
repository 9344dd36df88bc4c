"""``hispec-curve``: the layer curve of a training run with heads at many layers.

    hispec-curve RUN_DIR --out docs/layer-curve [--dtype bfloat16]

Reads the run's latest held-out evaluation (``eval.json``: per layer top-1 and top-4 agreement
with the final layer and the confidence calibration), measures on this machine what one token's
pass to each exit costs (layers and head, as a fraction of a full decoding step; the heads loaded
from the run's checkpoint), and writes ``OUT.json`` (what ``hispec-tune --curve`` reads) and
``OUT.png``.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path
from typing import Any

from hispec_decode.errors import HiSpecError
from hispec_decode.extras import pyplot
from hispec_decode.files import save_figure, write_text
from hispec_decode.tools.cli import add_debug_arg, run_cli
from hispec_decode.tuning.curve import self_spec_speedup

from .checkpoint import CHECKPOINT_DIR
from .report import EVAL_NAME

logger = logging.getLogger(__name__)


def exit_costs(heads: Path, base: str | None, dtype: str) -> dict[int, float]:
    """Per head layer of the adapter (or checkpoint) ``heads``: one token's pass to that exit, head
    included, over a full decoding step, measured on this machine."""
    from hispec_decode import HiSpecModel
    from hispec_decode.tuning.costs import measure_costs

    model = HiSpecModel.from_pretrained(base, str(heads), dtype=dtype)
    layers = sorted(e.layer for e in model.adapter.config.exits)
    costs = measure_costs(model.runner, layers)
    full = costs.full_step(model.num_layers, 1)
    return {l: (costs.band(0, l, 1) + costs.exit(l, 1)) / full for l in layers}


def build_curve(run_dir: Path, base: str | None, dtype: str) -> dict[str, Any]:
    path = run_dir / EVAL_NAME
    if not path.is_file():
        raise HiSpecError(f"{run_dir} holds no {EVAL_NAME}: train (and evaluate) the heads first")
    report = json.loads(path.read_text())
    curve = report.get("curve") or {}
    if not curve:
        raise HiSpecError(f"{path} has no per-layer curve (written by this version's evaluations)")
    train_cfg = json.loads((run_dir / "train_config.json").read_text())
    costs = exit_costs(run_dir / CHECKPOINT_DIR, base if base is not None else train_cfg.get("base"), dtype)
    last = report["history"][-1]
    layers = {}
    for layer, entry in sorted(curve.items(), key=lambda kv: int(kv[0])):
        speedup, k = self_spec_speedup(entry["top1"], costs[int(layer)])
        layers[layer] = entry | {"cost": costs[int(layer)], "self_spec_estimate": speedup, "self_spec_drafts": k,
                                 "untrained_top1": report["untrained"].get(f"agreement/L{layer}"),
                                 "top1_true_context": last.get(f"agreement_true_context/L{layer}")}
    return {"base": train_cfg.get("base") or "HuggingFaceTB/SmolLM2-135M-Instruct", "head_type": report["head_type"],
            "dtype": dtype, "step": last["step"], "features": train_cfg.get("features"),
            "dataset": train_cfg.get("dataset"), "layers": layers}


def plot_curve(curve: dict[str, Any], path: Path) -> None:
    plt = pyplot("hispec-curve's plot")

    layers = sorted(curve["layers"], key=int)
    xs = [int(l) for l in layers]
    get = lambda key: [curve["layers"][l][key] for l in layers]  # noqa: E731
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    if all(v is not None for v in get("untrained_top1")):
        ax1.plot(xs, get("untrained_top1"), "o:", color="grey", label="untrained exit (norm + LM head)")
    ax1.plot(xs, get("top1"), "o-", label=f"{curve['head_type']} head: top-1")
    ax1.plot(xs, get("top4"), "s--", label="top-4 contains the final token")
    if all(v is not None for v in get("top1_true_context")):
        ax1.plot(xs, get("top1_true_context"), "^-", label="top-1, previous final state known")
    ax1.plot(xs, get("cost"), "k-", alpha=0.5, label="cost of the exit / full step")
    ax1.set_xlabel("exit layer")
    ax1.set_ylim(0, 1)
    ax1.set_title(f"held-out agreement with the final layer ({curve['dtype']} costs)")
    ax1.legend(fontsize=8)
    for l in layers[:: max(1, len(layers) // 5)]:
        cal = [c for c in curve["layers"][l]["calibration"] if c["precision"] is not None]
        ax2.plot([c["coverage"] for c in cal], [c["precision"] for c in cal], "o-", label=f"L{l}")
    ax2.set_xlabel("coverage (positions with top probability >= threshold)")
    ax2.set_ylabel("precision (top-1 agrees)")
    ax2.set_xlim(0, 1)
    ax2.set_ylim(0, 1)
    ax2.set_title("calibration: thresholds 0 to 0.99")
    ax2.legend(fontsize=8)
    fig.tight_layout()
    save_figure(fig, path)
    plt.close(fig)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="hispec-curve", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("run_dir", type=Path, help="a hispec-train run directory")
    p.add_argument("--out", type=Path, required=True, help="output prefix: writes OUT.json and OUT.png")
    p.add_argument("--base", help="the run's base (default: the one in its train_config.json)")
    p.add_argument("--dtype", default="bfloat16", help="dtype the exit costs are measured in")
    add_debug_arg(p)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")

    def run() -> int:
        curve = build_curve(args.run_dir, args.base, args.dtype)
        write_text(args.out.with_suffix(".json"), json.dumps(curve, indent=2, sort_keys=True) + "\n")
        plot_curve(curve, args.out.with_suffix(".png"))
        for layer, e in sorted(curve["layers"].items(), key=lambda kv: int(kv[0])):
            print(f"L{layer:>3}: top-1 {e['top1']:.3f}  top-4 {e['top4']:.3f}  cost {e['cost']:.3f}  "
                  f"self_spec estimate {e['self_spec_estimate']:.2f}x (k={e['self_spec_drafts']})")
        return 0

    return run_cli("hispec-curve", run, args.debug, extra="train")


if __name__ == "__main__":
    sys.exit(main())
