"""The memory-bandwidth bound of plain decoding, measured on the machine the benchmark runs on.

At batch 1 a decoding step reads every weight once (the layers' linears and the LM head; the
embedding table only for one row), so no implementation can decode faster than
``bandwidth / weight bytes`` tokens per second. ``hispec-bench`` measures the bandwidth in the same
run as the methods (the best of several large reductions: a read-only stream on all threads) and
reports each method's speed as a fraction of that bound.
"""

from __future__ import annotations

import time

import torch

from ..layers.quant import BlockEmbedding, BlockLinear

PROBE_BYTES = 768 << 20  # well past any last-level cache


def memory_bandwidth(probe_bytes: int = PROBE_BYTES, reps: int = 7) -> float:
    """Bytes per second of the fastest of ``reps`` sums over a ``probe_bytes`` float32 tensor."""
    x = torch.ones(probe_bytes // 4, dtype=torch.float32)
    x.sum()  # first touch
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        x.sum()
        best = min(best, time.perf_counter() - t0)
    return probe_bytes / best


def _weights(module: torch.nn.Module) -> list[torch.Tensor]:
    """The tensors a module's weights are stored in: its parameters and its GGUF block weights' blocks."""
    out = []
    for m in module.modules():
        out += [m.blocks] if isinstance(m, BlockLinear) else list(m.parameters(recurse=False))
    return out


def decode_step_bytes(model: torch.nn.Module) -> int:
    """Weight bytes one batch-1 decoding step reads: every weight once (in its stored format), except an
    input embedding table that is not also the LM head (a step reads one of its rows)."""
    embedding = {t.data_ptr() for t in _weights(model.get_input_embeddings())}
    head = model.get_output_embeddings()
    tied = head is not None and bool(embedding & {t.data_ptr() for t in _weights(head)})
    tensors = {t.data_ptr(): t for t in _weights(model)}
    return sum(t.numel() * t.element_size() for ptr, t in tensors.items() if tied or ptr not in embedding)


def roofline(model: torch.nn.Module, tokens_per_second: dict[str, float], bandwidth: float) -> dict[str, float]:
    """The bound and each method's fraction of it (``tokens_per_second``: batch-1 speeds by method)."""
    step = decode_step_bytes(model)
    bound = bandwidth / step
    return {"bandwidth_gb_per_s": bandwidth / 1e9, "bytes_per_step": step, "bound_tokens_per_second": bound,
            **{f"fraction_of_bound_{m}": tps / bound for m, tps in tokens_per_second.items()}}
