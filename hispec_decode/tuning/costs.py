"""Measuring this machine's :class:`~hispec_decode.decoding.cost_model.CostModel`: band passes of 1 and all
layers over grids of rows and sequences, and every exit head."""

from __future__ import annotations

import statistics
import time
from typing import Any, Callable

import torch

from ..cache.block_manager import DEFAULT_BLOCK_SIZE
from ..decoding.cost_model import CostModel, interpolate
from ..decoding.level import vocab_key
from ..engine.model_runner import ModelRunner

ROWS = (1, 2, 3, 4, 6, 8, 12, 16)  # rows of one sequence (a speculative pass)
SEQS = (1, 2, 4, 8, 16)  # sequences of one row each (a batched decoding step; larger batches extrapolate)
HEAD_ROWS = (1, 2, 4, 8, 16)  # rows an exit head is timed at (interpolated in between)
CONTEXT = 256  # tokens already in the cache when a pass is timed


def _interleaved_medians(runs: dict[Any, Callable[[], object]], reps: int) -> dict[Any, float]:
    """Each run's median seconds over ``reps`` sweeps that time every run once, in turn, each time right
    after an untimed call of it (so a run is timed warm, as before, not after another run's weights
    evicted its own): a host that speeds up or slows down while measuring shifts every run alike, so the
    costs of passes relative to one another (what choosing between speculation and plain decoding reads)
    hold."""
    times: dict[Any, list[float]] = {key: [] for key in runs}
    for _ in range(reps):
        for key, fn in runs.items():
            fn()
            t0 = time.perf_counter()
            fn()
            times[key].append(time.perf_counter() - t0)
    return {key: statistics.median(t) for key, t in times.items()}


def _exit_logits(runner: ModelRunner, layer: int, h: torch.Tensor) -> torch.Tensor:
    """Exit ``layer``'s logits for rows ``h`` as decoding computes them: a deep-context head through
    its decoding step (the fused transform against a context, and the context it hands on), any
    other head through :meth:`ModelRunner.exit_logits`."""
    head = runner.heads.get(layer)
    if head is None or not head.needs_context or layer in runner.head_cache_layer:
        return runner.exit_logits(layer, h)
    ctx = torch.zeros(1, h.shape[1], head.context_size, dtype=h.dtype)
    return head.project(runner.context_step(layer, h, ctx)[0], runner.decoder, restrict=runner.use_exit_vocab)[0]


@torch.inference_mode()
def measure_costs(runner: ModelRunner, exit_layers: list[int], reps: int = 7, vocab_sizes: tuple[int, ...] = ()
                  ) -> CostModel:
    """Time band passes of 1 and all layers over the row and sequence grids, each exit head, and the
    vocabulary level's head for each of ``vocab_sizes`` (under its :attr:`Level.key`), in interleaved
    sweeps (:func:`_interleaved_medians`)."""
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

    def band(seqs: int, rows: int, layers: int) -> Callable[[], object]:
        spans = [(s, CONTEXT, rows) for s in range(seqs)]
        x = torch.randn(1, seqs * rows, decoder.config.hidden_size, generator=g).to(decoder.dtype)
        return lambda: decoder.run(x, 0, layers, decoder.meta(cache, spans), cache)

    def head(layer: int, rows: int) -> Callable[[], object]:
        h = torch.randn(1, rows, decoder.config.hidden_size, generator=g).to(decoder.dtype)
        if layer == n:
            return lambda: runner.exit_logits(layer, h).argmax(-1)
        # an early exit's logits are turned into its confidence (a softmax) by every gate
        return lambda: _exit_logits(runner, layer, h).float().softmax(-1).max(-1)

    def vocab_head(size: int, rows: int) -> Callable[[], object]:
        h = torch.randn(1, rows, decoder.config.hidden_size, generator=g).to(decoder.dtype)
        vocab = runner.level_vocab(size)
        return lambda: decoder.vocab_logits(decoder.exit_norm(h), vocab).float().softmax(-1).max(-1)

    runs: dict[tuple, Callable[[], object]] = {}
    for layers in (1, n):
        runs.update({("rows", r, layers): band(1, r, layers) for r in ROWS})
        runs.update({("seqs", s, layers): band(s, 1, layers) for s in SEQS})
    layers_of = sorted(set(exit_layers) | {n})
    runs.update({("exit", layer, r): head(layer, r) for layer in layers_of for r in HEAD_ROWS})
    runs.update({("vocab", size, r): vocab_head(size, r) for size in vocab_sizes for r in HEAD_ROWS})
    t = _interleaved_medians(runs, reps)

    def fit(kind: str, count: int) -> tuple[float, float]:
        one, full = t[kind, count, 1], t[kind, count, n]
        per_layer = max(0.0, (full - one) / (n - 1))
        return max(0.0, one - per_layer), per_layer

    call_rows, layer_rows, call_seqs, layer_seqs = {}, {}, {}, {}
    for r in ROWS:
        call_rows[r], layer_rows[r] = fit("rows", r)
    for s in SEQS:
        call_seqs[s], layer_seqs[s] = fit("seqs", s)
    exits: dict[int, dict[int, float]] = {}
    for layer in layers_of:
        exits[layer] = {}
        for r in HEAD_ROWS:
            seconds = t["exit", layer, r]
            if layer in runner.head_cache_layer:  # a head with attention: its block is part of the exit's cost
                seconds += interpolate(layer_rows, r)
            exits[layer][r] = seconds
    for size in vocab_sizes:
        exits[vocab_key(size)] = {r: t["vocab", size, r] for r in HEAD_ROWS}
    return CostModel(call_rows, layer_rows, call_seqs, layer_seqs, exits)
