"""``hispec-bench --profile``: where the time of a decoding run goes, split into attention,
linears and everything else.

The split is by operator, over each operator's own (self) CPU time in a ``torch.profiler`` trace:
linears are the GEMM operators (this project's compiled ``hispec::linear_amx`` and
``hispec::linear_bf16``, oneDNN's packed ``_linear_pointwise``, ``addmm``, ``mm``); attention is
the compiled ``hispec::paged_attention``, the flash kernel, the batched matrix products (``bmm``: only attention multiplies
3-d tensors here), the softmax, the masking and the paged cache's gathers and scatters; "other
ops" is every remaining operator (norms, rotary, casts, slices, concatenations, sampling); the
rest of the wall time ("python") is spent outside any operator. The sampler's softmax and the
embedding lookup count as attention: both are a small part of a step.
"""

from __future__ import annotations

import time
from typing import Any, Callable

from .. import kernels

LINEAR_OPS = {"hispec::linear_amx", "hispec::linear_bf16", "mkldnn::_linear_pointwise", "aten::addmm", "aten::mm"}
ATTENTION_OPS = {"hispec::paged_attention", "aten::_scaled_dot_product_flash_attention_for_cpu", "aten::bmm", "aten::_softmax",
                 "aten::masked_fill_", "aten::index_select", "aten::index_put_", "aten::_index_put_impl_"}


def profile_split(run: Callable[[], Any]) -> dict[str, Any]:
    """Run ``run()`` under the profiler; seconds and fractions of its wall time per part, and the
    ten operators with the most self time."""
    from torch.profiler import ProfilerActivity, profile

    with kernels.traced(), profile(activities=[ProfilerActivity.CPU]) as prof:
        t0 = time.perf_counter()
        run()
        wall = time.perf_counter() - t0
    parts = {"attention": 0.0, "linears": 0.0, "other_ops": 0.0}
    per_op: dict[str, float] = {}
    for event in prof.key_averages():
        seconds = event.self_cpu_time_total / 1e6
        per_op[event.key] = seconds
        part = "linears" if event.key in LINEAR_OPS else "attention" if event.key in ATTENTION_OPS else "other_ops"
        parts[part] += seconds
    parts["python"] = max(0.0, wall - sum(parts.values()))
    top = sorted(per_op.items(), key=lambda kv: -kv[1])[:10]
    return {"wall_seconds": wall, "seconds": parts, "fractions": {k: v / wall for k, v in parts.items()},
            "top_ops": {k: v for k, v in top}}
