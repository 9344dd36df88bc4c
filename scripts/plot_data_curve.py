"""Held-out agreement of exit heads against the training data they have seen, for several runs.

    python scripts/plot_data_curve.py --out docs/training/smollm2-135m-data-curve.png \
        "799k tokens=docs/training/smollm2-135m-selfdistill-eval.json" \
        "2.9M tokens=docs/training/smollm2-135m-2m-eval.json"

Each argument is ``LABEL=EVAL_JSON`` (a run's ``eval.json``, written by ``hispec-train``); every
head of every run is drawn as top-1 agreement with the final layer (the head's own previous
output as context) against the training tokens seen at each evaluation.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from hispec_decode.files import save_figure


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("runs", nargs="+", help="LABEL=EVAL_JSON")
    p.add_argument("--out", type=Path, required=True, help="the PNG to write")
    p.add_argument("--base", default="SmolLM2-135M", help="the base the heads were trained on (the title)")
    args = p.parse_args()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for spec in args.runs:
        label, _, path = spec.partition("=")
        report = json.loads(Path(path).read_text())
        history = [h for h in report["history"] if "tokens_seen" in h]
        for layer in report["heads_layers"]:
            key = f"agreement/L{layer}"
            xs = [h["tokens_seen"] / 1e6 for h in history]
            ax.plot(xs, [100 * h[key] for h in history], marker="o", label=f"L{layer}, {label}")
    ax.set_xlabel("training tokens seen (millions)")
    ax.set_ylabel("held-out top-1 agreement with the final layer (%)")
    ax.set_title(f"exit heads against training data ({args.base}, self-distilled)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    save_figure(fig, args.out)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
