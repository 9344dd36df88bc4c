"""``hispec-bench --sweep``: choose policy numbers from measurements.

Runs autoregressive decoding and a grid of ``hispec`` (``num_draft`` x ``window``) and
``self_spec`` (``draft_layer`` x ``num_draft``) configurations on the same prompts, interleaved
prompt by prompt, and reports each configuration's tokens/s relative to autoregressive decoding
measured in the same run. Writes a JSON file, a Markdown table and a plot.
"""

from __future__ import annotations

import json
import time
from itertools import product
from pathlib import Path
from typing import Any

from tqdm.auto import tqdm

from ..config import SpeculativeConfig
from ..decoding.policy import Policy
from ..extras import pyplot
from ..files import save_figure, write_text
from ..sampling_params import SamplingParams

HISPEC_DRAFTS = (1, 2, 3, 4)
HISPEC_WINDOWS = (2, 3, 4, 6, 8)
SELF_SPEC_DRAFTS = (1, 2, 3, 4, 6)


def label(c: SpeculativeConfig) -> str:
    if c.method != "autoregressive" and c.draft_layer is None:
        return f"{c.method} (adapter's tuned policy)"
    if c.method == "hispec":
        return f"hispec L{c.draft_layer}/L{c.verify_layer} k_d={c.num_draft} N_i={c.window}"
    if c.method == "self_spec":
        return f"self_spec L{c.draft_layer} k={c.num_draft}"
    return c.method


def grid(p: Policy) -> list[SpeculativeConfig]:
    """The configurations swept around a policy's exit layers ``p``."""
    def config(method: str, **policy: int) -> SpeculativeConfig:
        return SpeculativeConfig(method=method, **policy)

    configs = [config("autoregressive"), config("hispec"), config("self_spec")]  # the last two: tuned (adapter's policy)
    configs += [config("hispec", draft_layer=p.draft_layer, verify_layer=p.verify_layer, window=w, num_draft=k)
                for k, w in product(HISPEC_DRAFTS, HISPEC_WINDOWS)]
    configs += [config("self_spec", draft_layer=d, num_draft=k)
                for d, k in product((p.draft_layer, p.verify_layer), SELF_SPEC_DRAFTS)]
    return configs


def run_sweep(model, policy: Policy, prompts: list[list[int]], max_new_tokens: int) -> list[dict[str, Any]]:
    configs, sampling = grid(policy), SamplingParams(max_new_tokens=max_new_tokens)
    tallies = {c: [0, 0.0, 0, 0, 0, 0] for c in configs}  # tokens, seconds, acc_i, drafted, acc_f, tentative
    for c in configs:  # warm-up
        model.generate([prompts[0]], sampling, c, max_new_tokens=4)
    for i, prompt in enumerate(tqdm(prompts, desc="sweep", unit="prompt")):
        order = configs[i % len(configs):] + configs[: i % len(configs)]
        for c in order:
            t0 = time.perf_counter()
            (seq,) = model.generate([prompt], sampling, c).seqs
            t = tallies[c]
            t[1] += time.perf_counter() - t0
            t[0] += len(seq.new_tokens)
            k = seq.counters
            t[2] += k.accepted_intermediate; t[3] += k.drafted; t[4] += k.accepted_final; t[5] += k.tentative
    ar = tallies[configs[0]]
    ar_tps = ar[0] / ar[1]
    rows = []
    for c in configs:
        tokens, seconds, acc_i, drafted, acc_f, tentative = tallies[c]
        rows.append({"config": label(c), "method": c.method, "draft_layer": c.draft_layer, "verify_layer": c.verify_layer,
                     "window": c.window, "num_draft": c.num_draft, "tokens_per_second": tokens / seconds,
                     "speedup_vs_autoregressive": tokens / seconds / ar_tps,
                     "acceptance_intermediate": acc_i / drafted if drafted else None,
                     "acceptance_final": acc_f / tentative if tentative else None})
    return rows


def write_sweep(rows: list[dict[str, Any]], out_dir: Path, tag: str) -> None:
    write_text(out_dir / f"sweep-{tag}.json", json.dumps(rows, indent=2, sort_keys=True) + "\n")
    lines = ["| configuration | tokens/s | × autoregressive | accepted at L_i | accepted at L_f |", "|---|---|---|---|---|"]
    for r in sorted(rows, key=lambda r: -r["speedup_vs_autoregressive"]):
        pct = lambda x: "–" if x is None else f"{100 * x:.1f}%"  # noqa: E731
        lines.append(f"| {r['config']} | {r['tokens_per_second']:.1f} | {r['speedup_vs_autoregressive']:.2f} | "
                     f"{pct(r['acceptance_intermediate'])} | {pct(r['acceptance_final'])} |")
    write_text(out_dir / f"sweep-{tag}.md", "\n".join(lines) + "\n")
    _plot(rows, out_dir / f"sweep-{tag}.png", tag)


def _plot(rows: list[dict[str, Any]], path: Path, tag: str) -> None:
    plt = pyplot("the sweep's plot")
    import numpy as np

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    hs = [r for r in rows if r["method"] == "hispec" and r["num_draft"] is not None]
    grid_ = np.array([[next(r["speedup_vs_autoregressive"] for r in hs if r["num_draft"] == k and r["window"] == w)
                       for w in HISPEC_WINDOWS] for k in HISPEC_DRAFTS])
    im = ax1.imshow(grid_, cmap="RdYlGn", vmin=min(0.5, grid_.min()), vmax=max(1.5, grid_.max()))
    ax1.set_xticks(range(len(HISPEC_WINDOWS)), [str(w) for w in HISPEC_WINDOWS])
    ax1.set_yticks(range(len(HISPEC_DRAFTS)), [str(k) for k in HISPEC_DRAFTS])
    ax1.set_xlabel("window N_i")
    ax1.set_ylabel("drafts per check k_d")
    for (i, j), v in np.ndenumerate(grid_):
        ax1.text(j, i, f"{v:.2f}", ha="center", va="center", fontsize=8)
    ax1.set_title(f"hispec speed-up vs autoregressive ({tag})")
    fig.colorbar(im, ax=ax1)
    ss = [r for r in rows if r["method"] == "self_spec" and r["draft_layer"] is not None]
    for layer in sorted({r["draft_layer"] for r in ss}):
        pts = [r for r in ss if r["draft_layer"] == layer]
        ax2.plot([r["num_draft"] for r in pts], [r["speedup_vs_autoregressive"] for r in pts], marker="o", label=f"L_d={layer}")
    ax2.axhline(1.0, color="gray", lw=0.8)
    ax2.set_xlabel("drafts per full check k")
    ax2.set_ylabel("speed-up vs autoregressive")
    ax2.set_title("self_spec")
    ax2.legend()
    fig.tight_layout()
    save_figure(fig, path)
    plt.close(fig)
