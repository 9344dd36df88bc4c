"""The measured cost of a band pass, as a function of its layers and rows.

A band pass runs ``layers[lo:hi]`` over ``rows`` new tokens of ``seqs`` sequences; its time on
this machine is modelled as ``call(rows, seqs) + (hi - lo) * layer(rows, seqs)``: a per-call part
(attention metadata, Python) and a per-layer part, each measured at a grid of row counts and
interpolated linearly in between (a pass of 5 rows on a CPU costs about what a pass of 1 row
does in bf16; in a batch of 16 sequences every extra row costs). Exit heads (the LM head of an
early exit, restricted to its vocabulary or not, and the final one) are measured per layer.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from ..cache.block_manager import DEFAULT_BLOCK_SIZE
from ..engine.model_runner import ModelRunner

ROWS = (1, 2, 3, 4, 6, 8, 12, 16)  # rows of one sequence (a speculative pass)
SEQS = (1, 2, 4, 8, 16, 32)  # sequences of one row each (a batched decoding step)
CONTEXT = 256  # tokens already in the cache when a pass is timed


def _interpolate(points: dict[int, float], x: float) -> float:
    keys = sorted(points)
    if x <= keys[0]:
        return points[keys[0]] * x / keys[0] if x < keys[0] else points[keys[0]]
    for a, b in zip(keys, keys[1:]):
        if x <= b:
            return points[a] + (points[b] - points[a]) * (x - a) / (b - a)
    a, b = keys[-2], keys[-1]  # extrapolate with the last slope
    return points[b] + (points[b] - points[a]) * (x - b) / (b - a)


@dataclass
class CostModel:
    """Seconds of band passes and exit heads on this machine, for one model and dtype."""

    call_rows: dict[int, float]  # per-call seconds, one sequence with that many rows
    layer_rows: dict[int, float]  # per-layer seconds, one sequence with that many rows
    call_seqs: dict[int, float]  # per-call seconds, that many sequences of one row
    layer_seqs: dict[int, float]  # per-layer seconds, that many sequences of one row
    # exit layer (or -size: the vocabulary level over that many tokens) -> rows -> seconds
    exits: dict[int, dict[int, float]] = field(default_factory=dict)
    request: float = 0.0  # per plain decoding request: what a real step adds (scheduling, sampling, bookkeeping)
    speculative_request: float = 0.0  # the same for a drafting, checking or verifying request (gates, verdicts)

    def band(self, lo: int, hi: int, rows: int, seqs: int = 1) -> float:
        """Seconds of one pass of ``layers[lo:hi]`` over ``rows`` rows spread over ``seqs`` sequences."""
        if rows <= 0 or hi <= lo:
            return 0.0
        if seqs <= 1:
            return _interpolate(self.call_rows, rows) + (hi - lo) * _interpolate(self.layer_rows, rows)
        # a batch: as many sequences, plus what their extra rows add beyond one each
        base = _interpolate(self.call_seqs, seqs) + (hi - lo) * _interpolate(self.layer_seqs, seqs)
        extra = rows - seqs
        per_row = (_interpolate(self.layer_seqs, seqs + 1) - _interpolate(self.layer_seqs, seqs)) * (hi - lo)
        return base + max(0, extra) * per_row

    def exit(self, layer: int, rows: int) -> float:
        return _interpolate(self.exits[layer], rows) if rows > 0 else 0.0

    def full_step(self, num_layers: int, seqs: int) -> float:
        """One plain decoding step of ``seqs`` sequences: every layer and the final LM head."""
        return self.band(0, num_layers, seqs, seqs) + self.exit(num_layers, seqs)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> CostModel:
        """The inverse of :meth:`to_dict` after a JSON round trip (keys are strings there)."""
        def table(d: dict) -> dict[int, float]:
            return {int(k): float(v) for k, v in d.items()}

        return cls(table(data["call_rows"]), table(data["layer_rows"]), table(data["call_seqs"]),
                   table(data["layer_seqs"]), {int(k): table(v) for k, v in data["exits"].items()},
                   float(data.get("request", 0.0)), float(data.get("speculative_request", 0.0)))

    def to_dict(self) -> dict[str, object]:
        return {"call_rows": self.call_rows, "layer_rows": self.layer_rows, "call_seqs": self.call_seqs,
                "layer_seqs": self.layer_seqs, "exits": self.exits, "request": self.request,
                "speculative_request": self.speculative_request}


def _median_seconds(fn, reps: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


@torch.inference_mode()
def measure_costs(runner: ModelRunner, exit_layers: list[int], reps: int = 7, vocab_sizes: tuple[int, ...] = ()
                  ) -> CostModel:
    """Time band passes of 1 and all layers over the row and sequence grids, each exit head, and the
    vocabulary level's head for each of ``vocab_sizes`` (under the key ``-size``)."""
    decoder = runner.decoder
    n = decoder.num_layers
    size = DEFAULT_BLOCK_SIZE
    cache = runner.new_cache(max(SEQS) * (CONTEXT + max(ROWS)) // size + max(SEQS) + 8, size)
    g = torch.Generator().manual_seed(0)
    for s in range(max(SEQS)):
        cache.manager.add(s, 1)
        cache.manager.reserve(s, CONTEXT + max(ROWS))
        cache.manager.set_length(s, 0, CONTEXT)
    # the cached K/V are random: timing does not depend on their values
    for pool in cache.keys + cache.values:
        pool.normal_(generator=g)

    def timer(seqs: int, rows: int, layers: int) -> float:
        spans = [(s, CONTEXT, rows) for s in range(seqs)]
        x = torch.randn(1, seqs * rows, decoder.config.hidden_size, generator=g).to(decoder.dtype)

        def run() -> None:
            meta = decoder.meta(cache, spans)
            decoder.run(x, 0, layers, meta, cache)
        return _median_seconds(run, reps)

    def fit(seqs: int, rows: int) -> tuple[float, float]:
        one, full = timer(seqs, rows, 1), timer(seqs, rows, n)
        per_layer = max(0.0, (full - one) / (n - 1))
        return max(0.0, one - per_layer), per_layer

    call_rows, layer_rows, call_seqs, layer_seqs = {}, {}, {}, {}
    for r in ROWS:
        call_rows[r], layer_rows[r] = fit(1, r)
    for s in SEQS:
        call_seqs[s], layer_seqs[s] = fit(s, 1)
    exits: dict[int, dict[int, float]] = {}
    for layer in sorted(set(exit_layers) | {n}):
        exits[layer] = {}
        for r in sorted(set(ROWS) | set(SEQS)):
            h = torch.randn(1, r, decoder.config.hidden_size, generator=g).to(decoder.dtype)
            # an early exit's logits are turned into its confidence (a softmax) by every gate
            seconds = _median_seconds(lambda: runner.exit_logits(layer, h).float().softmax(-1).max(-1), reps) \
                if layer < n else _median_seconds(lambda: runner.exit_logits(layer, h).argmax(-1), reps)
            if layer in runner.head_cache_layer:  # a head with attention: its block is part of the exit's cost
                seconds += _interpolate(layer_rows, r)
            exits[layer][r] = seconds
    for size in vocab_sizes:
        vocab = runner.level_vocab(size)
        exits[-size] = {}
        for r in sorted(set(ROWS) | set(SEQS)):
            h = torch.randn(1, r, decoder.config.hidden_size, generator=g).to(decoder.dtype)
            exits[-size][r] = _median_seconds(
                lambda: decoder.vocab_logits(decoder.exit_norm(h), vocab).float().softmax(-1).max(-1), reps)
    return CostModel(call_rows, layer_rows, call_seqs, layer_seqs, exits)
