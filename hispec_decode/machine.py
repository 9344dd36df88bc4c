"""The machine decoding runs on: its processor, the vector features the kernels use, its threads.

Speed depends on the machine far more than on anything an adapter holds: whether a bf16 linear
runs on AMX tiles, an AVX-512 BF16 loop or an AVX2 loop decides what a pass over several rows
costs, and so which policy pays. Every benchmark result records :func:`describe`, and measured
pass costs are cached under :func:`key` (hispec_decode.tuning.record.machine_record).
"""

from __future__ import annotations

import hashlib
import os
import platform
from functools import lru_cache

import torch

FEATURES = ("amx_bf16", "avx512_bf16", "avx512f", "avx2", "fma")  # /proc/cpuinfo flags the kernels care about


@lru_cache(maxsize=1)
def _cpuinfo() -> tuple[str, frozenset[str]]:
    """The first processor's model name and flags (Linux; elsewhere the platform's processor name)."""
    model, flags = "", frozenset()
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                name, _, value = line.partition(":")
                name = name.strip()
                if name == "model name" and not model:
                    model = value.strip()
                elif name == "flags" and not flags:
                    flags = frozenset(value.split())
                if model and flags:
                    break
    except OSError:
        pass
    return model or platform.processor() or platform.machine() or "unknown CPU", flags


def cpu_model() -> str:
    return _cpuinfo()[0]


def cpu_features() -> dict[str, bool]:
    """Which of :data:`FEATURES` the CPU reports."""
    flags = _cpuinfo()[1]
    return {f: f in flags for f in FEATURES}


def mkldnn_bf16() -> bool:
    """oneDNN has bf16 kernels for this CPU (AVX-512 BF16, AMX or AVX-NE-CONVERT; not an AVX2 CPU)."""
    probe = getattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", None)
    return bool(probe()) if probe is not None else True


def compute_dtype(dtype: torch.dtype, device: torch.device | str = "cpu") -> torch.dtype:
    """The dtype to run torch's own matrix products in for weights of ``dtype`` on ``device``: float32
    for bf16 on a CPU without oneDNN bf16 kernels, where torch emulates bf16 matmuls (several times
    slower than float32 forward, tens of times backward); ``dtype`` otherwise. Bf16 weights widened
    to float32 keep their values; only intermediate results are rounded less."""
    if dtype == torch.bfloat16 and torch.device(device).type == "cpu" and not mkldnn_bf16():
        return torch.float32
    return dtype


def device_name(device: torch.device | str = "cpu") -> str:
    """The processor a model on ``device`` runs on: the CPU's model name, or the GPU's."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return cpu_model()


def describe(device: torch.device | str = "cpu") -> dict[str, object]:
    """What a benchmark result records about where it was measured."""
    from . import kernels

    out: dict[str, object] = {"device": device_name(device), "threads": torch.get_num_threads()}
    if torch.device(device).type == "cpu":
        out |= {"cpu_features": cpu_features(), "bf16_linear": kernels.linear_kind(),
                "block_linear": kernels.block_linear_kind(), "cpus": os.cpu_count()}
    return out


def summary(described: dict[str, object] | None = None) -> str:
    """One line of :func:`describe` (this machine's, or one a result recorded)."""
    d = describe() if described is None else described
    feats = d.get("cpu_features")
    have = ", ".join(f for f, on in feats.items() if on) if isinstance(feats, dict) else ""
    return (f"{d.get('device', 'unknown')}" + (f" [{have}]" if have else "")
            + (f"; bf16 linears: {d['bf16_linear']}" if "bf16_linear" in d else "")
            + (f"; block linears: {d['block_linear']}" if "block_linear" in d else "")
            + f"; {d.get('threads', '?')} threads")


def key(device: torch.device | str, dtype: torch.dtype, base: str) -> str:
    """A file-name-safe key of (processor and its features, threads, dtype, base): what measured costs
    depend on."""
    d = describe(device)
    text = repr((d["device"], d.get("cpu_features"), d.get("bf16_linear"), d["threads"], str(dtype), base))
    slug = "".join(c if c.isalnum() else "-" for c in str(d["device"]))[:40].strip("-")
    return f"{slug}-{hashlib.sha256(text.encode()).hexdigest()[:12]}"
