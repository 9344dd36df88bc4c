"""``hispec-bench --batch-sizes``: batched throughput, transformers' padded batch vs this engine.

For each batch size ``B`` the same prompts are cut into batches of ``B``; every method decodes
every batch (the order of methods rotates batch by batch, so machine noise hits all alike) and
the table reports total new tokens per second. Several dtypes are interleaved the same way (each
batch decoded in every dtype before the next), so their ratio is not biased by which ran first.
transformers decodes a left-padded batch with an attention mask and stops when every row is done; the engine decodes a ragged continuous
batch on its paged cache. Outputs are compared with transformers' row by row, and the paged
cache's peak bytes with the bytes the sequences need.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from tqdm.auto import tqdm

from ..config import DEFAULT_SCHEDULE, SpeculativeConfig
from ..engine.sequence import Counters
from ..extras import pyplot
from ..outputs import level_acceptance
from ..sampling_params import SamplingParams
from .args import autoregressive_of, method_settings


@dataclass
class BatchTally:
    tokens: int = 0
    seconds: float = 0.0
    counters: Counters = field(default_factory=Counters)
    outputs: list[list[int]] = field(default_factory=list)
    peak_cache_bytes: int = 0
    needed_cache_bytes: int = 0
    levels: list[str] = field(default_factory=list)  # the name of each level above the drafter


def hf_generate_padded(model, rows: list[list[int]], max_new_tokens: int, eos: frozenset[int]) -> list[list[int]]:
    """transformers' generate on a left-padded batch; each row cut after its first EOS."""
    width = max(map(len, rows))
    pad = min(eos) if eos else 0
    ids = torch.tensor([[pad] * (width - len(r)) + r for r in rows])
    mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows])
    with torch.inference_mode():
        out = model.base_model.generate(ids, attention_mask=mask, max_new_tokens=max_new_tokens, do_sample=False,
                                        pad_token_id=pad)
    seqs = []
    for row in out[:, width:].tolist():
        end = next((i + 1 for i, t in enumerate(row) if t in eos), len(row))
        seqs.append(row[:end])
    return seqs


def run_batched(models: dict[str, Callable[[str], Any]], prompts: list[list[int]], batch_sizes: list[int],
                sampling: SamplingParams, config: SpeculativeConfig, methods: list[str], schedule: str = DEFAULT_SCHEDULE,
                max_batches: int | None = None) -> dict[str, dict[str, Any]]:
    """``models[dtype](spec)`` is the model a method spec runs on in that dtype
    (:class:`~hispec_decode.tools.args.ModelVariants`); ``methods`` may name a verification schedule
    per method, e.g. ``hispec:gather``. Every batch is decoded by every (dtype, method) in an order that
    rotates batch by batch, so dtypes are compared under the same machine noise as methods are.
    Returns ``{dtype: {batch size: rows}}``."""
    first_dtype = next(iter(models))
    eos = sampling.eos_ids(models[first_dtype]("autoregressive").decoder.default_eos_ids())
    runs = [(d, m) for d in models for m in methods]
    results: dict[str, dict[str, Any]] = {d: {} for d in models}
    for b in batch_sizes:
        batches = [prompts[i : i + b] for i in range(0, len(prompts), b)][:max_batches]
        tallies = {r: BatchTally() for r in runs}
        for d, m in runs:  # warm-up at this batch size
            _decode(models[d](m), m, batches[0], sampling.replace(max_new_tokens=4), config, eos, schedule)
        for i, batch in enumerate(tqdm(batches, desc=f"batch size {b}", unit="batch")):
            for d, m in runs[i % len(runs):] + runs[: i % len(runs)]:
                t0 = time.perf_counter()
                seqs, out = _decode(models[d](m), m, batch, sampling, config, eos, schedule)
                t = tallies[d, m]
                t.seconds += time.perf_counter() - t0
                t.tokens += sum(map(len, seqs))
                t.outputs += seqs
                if out is not None:
                    for seq in out.seqs:
                        t.counters.add(seq.counters)
                    t.levels = [level["level"] for level in out.stats["levels"]]
                    t.peak_cache_bytes = max(t.peak_cache_bytes, out.stats["peak_cache_bytes"])
                    t.needed_cache_bytes = max(t.needed_cache_bytes, out.stats["needed_cache_bytes"])
        for d in models:
            rows = _rows({m: tallies[d, m] for m in methods})
            for m, row in rows.items():  # the same method in the first dtype, measured batch for batch beside it
                ref = tallies[first_dtype, m]
                row["ratio_to_first_dtype"] = round(row["tokens_per_second"] / (ref.tokens / ref.seconds), 3) \
                    if ref.seconds and ref.tokens else None
            results[d][str(b)] = rows
    return results


def _decode(model, spec: str, batch: list[list[int]], sampling: SamplingParams, config: SpeculativeConfig,
            eos: frozenset[int], schedule: str):
    if spec == "transformers":
        return hf_generate_padded(model, batch, sampling.max_new_tokens, eos), None
    settings, overrides = method_settings(model, spec, config)
    out = model.generate(batch, sampling, settings, **({"schedule": schedule} | overrides))
    return out.sequences, out


def _rows(tallies: dict[str, BatchTally]) -> dict[str, Any]:
    base = tallies.get("transformers")
    ar = next((t for m, t in tallies.items() if m.partition(":")[0] == "autoregressive"), None)
    rows = {}
    for m, t in tallies.items():
        tps = t.tokens / t.seconds if t.seconds else 0.0
        c = t.counters
        rows[m] = {
            "tokens": t.tokens, "seconds": round(t.seconds, 3), "tokens_per_second": round(tps, 3),
            "ratio_to_transformers": round(tps / (base.tokens / base.seconds), 3) if base else None,
            "ratio_to_autoregressive": round(tps / (ar.tokens / ar.seconds), 3) if ar else None,
            "acceptance_intermediate": round(c.accepted_intermediate / c.drafted, 4) if c.drafted else None,
            "acceptance_final": round(c.accepted_final / c.tentative, 4) if c.tentative else None,
            "levels": level_acceptance(t.levels, c),
            "matches_transformers": (f"{sum(a == b for a, b in zip(t.outputs, base.outputs))}/{len(t.outputs)}"
                                     if base else None),
            "matches_autoregressive": (f"{sum(a == b for a, b in zip(t.outputs, plain.outputs))}/{len(t.outputs)}"
                                       if (plain := tallies.get(autoregressive_of(m))) else None),
            "peak_cache_bytes": t.peak_cache_bytes or None,
            "needed_cache_bytes": t.needed_cache_bytes or None,
        }
    return rows


def format_batched(results: dict[str, Any], dtype: str, first: str | None = None) -> str:
    """The rows of one dtype; ``first``: the dtype its ``x first`` column compares with."""
    head = (f"{'batch':>5} {'method':18} {'tok/s':>8} {'x HF':>6} {'x AR':>6} "
            + (f"{'x ' + first:>10} " if first else "") + f"{'= HF':>7} {'= AR':>7} "
            f"{'cache peak/need':>16}  accepted per level")
    lines = [f"batched throughput ({dtype})", head, "-" * len(head)]
    for b, rows in results.items():
        for m, r in rows.items():
            def f(x, pct=False):
                return "-" if x is None else (f"{100 * x:.1f}%" if pct else f"{x:.2f}")
            cache = "-" if not r["peak_cache_bytes"] else f"{r['peak_cache_bytes'] / 2**20:.1f}/{r['needed_cache_bytes'] / 2**20:.1f} MiB"
            lines.append(f"{b:>5} {m:18.18} {r['tokens_per_second']:8.2f} {f(r['ratio_to_transformers']):>6} "
                         f"{f(r['ratio_to_autoregressive']):>6} "
                         + (f"{f(r.get('ratio_to_first_dtype')):>10} " if first else "")
                         + f"{r['matches_transformers'] or '-':>7} "
                         f"{r.get('matches_autoregressive') or '-':>7} {cache:>16}  "
                         + (" ".join(f"{k} {f(v, True)}" for k, v in (r.get("levels") or {}).items()) or "-"))
    return "\n".join(lines)


def plot_batched(results: dict[str, Any], path) -> None:
    """Per dtype: each method's tokens/s against the batch size, and its ratio to autoregressive."""
    plt = pyplot("hispec-bench-batch --plot")

    from ..files import save_figure

    dtypes = list(results["dtypes"])
    fig, axes = plt.subplots(len(dtypes), 2, figsize=(12, 3.8 * len(dtypes)), squeeze=False)
    for (ax1, ax2), dtype in zip(axes, dtypes):
        by_size = results["dtypes"][dtype]
        sizes = sorted(by_size, key=int)
        methods = list(by_size[sizes[0]])
        for m in methods:
            ax1.plot([int(b) for b in sizes], [by_size[b][m]["tokens_per_second"] for b in sizes], marker="o", label=m)
            ax2.plot([int(b) for b in sizes], [by_size[b][m]["ratio_to_autoregressive"] for b in sizes], marker="o", label=m)
        ax2.axhline(1.0, color="grey", lw=0.8, ls="--")
        for ax, label in ((ax1, "tokens/s (all rows)"), (ax2, "x autoregressive")):
            ax.set_xscale("log", base=2)
            ax.set_xlabel("batch size")
            ax.set_ylabel(label)
            ax.grid(alpha=0.3)
            ax.legend(fontsize=8)
        ax1.set_title(f"{dtype}: batched throughput, {results['max_new_tokens']} new tokens, greedy")
        ax2.set_title(f"{dtype}: ratio to this engine's autoregressive decoding")
    fig.tight_layout()
    save_figure(fig, path)
    plt.close(fig)
