"""Evaluation reports: ``eval.json`` and ``agreement.png`` in the run directory."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from hispec_decode.extras import pyplot
from hispec_decode.files import save_figure, write_text

from .config import TrainConfig

EVAL_NAME = "eval.json"
PLOT_NAME = "agreement.png"


def write_eval_report(run_dir: Path, cfg: TrainConfig, untrained: dict[str, float], history: list[dict[str, Any]],
                      curve: dict[int, dict[str, Any]] | None = None) -> None:
    """``curve``: the latest evaluation per layer (top-1, top-4, calibration; see ``hispec-curve``)."""
    report = {"heads_layers": cfg.heads_layers, "head_type": cfg.head_type, "window": cfg.window,
              "untrained": untrained, "history": history, "curve": {str(l): c for l, c in (curve or {}).items()}}
    write_text(run_dir / EVAL_NAME, json.dumps(report, indent=2, sort_keys=True) + "\n")
    plot_agreement(report, run_dir / PLOT_NAME)


def plot_agreement(report: dict[str, Any], path: Path) -> None:
    """Left: agreement with the final layer per exit layer, trained head vs untrained exit.
    Right: agreement over training steps."""
    plt = pyplot("the training report's plots")

    layers = report["heads_layers"]
    last = report["history"][-1] if report["history"] else {}
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    xs = range(len(layers))
    ax1.bar([x - 0.2 for x in xs], [report["untrained"][f"agreement/L{l}"] for l in layers], 0.4, label="untrained (norm + LM head)")
    ax1.bar([x + 0.2 for x in xs], [last.get(f"agreement/L{l}", 0) for l in layers], 0.4, label=f"{report['head_type']} head")
    ax1.set_xticks(list(xs), [f"L{l}" for l in layers])
    ax1.set_ylim(0, 1)
    ax1.set_ylabel("top-1 agreement with the final layer")
    ax1.set_title(f"held-out agreement at step {last.get('step', 0)}")
    ax1.legend()
    by_tokens = all("tokens_seen" in h for h in report["history"])
    xs = [h["tokens_seen"] if by_tokens else h["step"] for h in report["history"]]
    for l in layers:
        ax2.plot(xs, [h[f"agreement/L{l}"] for h in report["history"]], marker="o", label=f"L{l}")
    ax2.set_xlabel("training tokens seen" if by_tokens else "step")
    if by_tokens:  # 800,000 as 800k: long tick labels overlap
        from matplotlib.ticker import EngFormatter

        ax2.xaxis.set_major_formatter(EngFormatter(sep=""))
    ax2.set_ylim(0, 1)
    ax2.set_title("agreement against training data")
    ax2.legend()
    fig.tight_layout()
    save_figure(fig, path)
    plt.close(fig)
