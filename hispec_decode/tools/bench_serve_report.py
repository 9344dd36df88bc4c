"""The report of ``hispec-bench-serve``: a Markdown table and a PNG of its results."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ..extras import pyplot
from ..files import save_figure


def plot(results: dict[str, Any], path: Path) -> None:
    plt = pyplot("hispec-bench-serve --plot")

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    panels = [("output_tokens_per_second", "output tokens/s", None),
              ("ttft_ms_p50", "time to first token (ms)", "ttft_ms_p99"),
              ("itl_ms_p50", "inter-token latency (ms)", "itl_ms_p99")]
    for ax, (key, label, p99) in zip(axes, panels):
        for name, levels in results["servers"].items():
            xs = [lv["concurrency"] for lv in levels["levels"]]
            line, = ax.plot(xs, [lv[key] for lv in levels["levels"]], marker="o", label=f"{name} p50" if p99 else name)
            if p99:
                ax.plot(xs, [lv[p99] for lv in levels["levels"]], marker="x", ls="--", color=line.get_color(),
                        label=f"{name} p99")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrent clients")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(f"hispec-serve, {results['model']} ({results['dtype']}), {results['max_tokens']} new tokens, greedy chat")
    fig.tight_layout()
    save_figure(fig, path)
    plt.close(fig)


def table(results: dict[str, Any]) -> str:
    rows = ["server | clients | req/s | tok/s | TTFT p50/p99 ms | ITL p50/p99 ms | vLLM's TPOT mean | vLLM's ITL "
            "median/p99 ms | failed", "|".join(["---"] * 9)]
    f = lambda x: "-" if x is None else f"{x:.0f}" if x >= 10 else f"{x:.1f}"  # noqa: E731
    for name, s in results["servers"].items():
        for lv in s["levels"]:
            v = lv["vllm"]
            rows.append(f"{name} | {lv['concurrency']} | {lv['requests_per_second']:.2f} | "
                        f"{lv['output_tokens_per_second']:.1f} | {f(lv['ttft_ms_p50'])}/{f(lv['ttft_ms_p99'])} | "
                        f"{f(lv['itl_ms_p50'])}/{f(lv['itl_ms_p99'])} | {f(v['mean_tpot_ms'])} | "
                        f"{f(v['median_itl_ms'])}/{f(v['p99_itl_ms'])} | {lv['failed']}")
    return "\n".join(rows)
