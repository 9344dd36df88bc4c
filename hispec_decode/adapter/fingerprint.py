"""A fingerprint of a base model, so heads trained for one base are refused by another.

It combines the architecture's shape with a signature: a fixed sample of weight values from
the embedding, the first, middle and last decoder layers and the LM head. Signatures are
compared with a relative tolerance of 1%, so the same base loaded in float32, bfloat16 or
float16 matches, while another model (or another checkpoint whose weights differ by more
than rounding) does not.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

import torch
from torch import nn

from ..layers.quant import BlockEmbedding, BlockLinear

SAMPLES_PER_TENSOR = 16
RELATIVE_TOLERANCE = 1e-2
SHAPE_KEYS = ("model_type", "num_hidden_layers", "hidden_size", "vocab_size")


def _first_matrix(module: nn.Module) -> torch.Tensor | nn.Module:
    """The first weight matrix of ``module``'s submodules, in their order (a GGUF block linear as the module)."""
    for m in module.modules():
        if isinstance(m, (BlockLinear, BlockEmbedding)):
            return m
        own = next((p for p in m.parameters(recurse=False) if p.dim() == 2), None)
        if own is not None:
            return own
    raise ValueError(f"{type(module).__name__} holds no weight matrix")


def _weight(module: nn.Module) -> torch.Tensor | nn.Module:
    return module if isinstance(module, (BlockLinear, BlockEmbedding)) else module.weight


def sample_values(t: torch.Tensor | nn.Module) -> list[float]:
    """SAMPLES_PER_TENSOR values of ``t`` at fixed, evenly spaced flat indices (a signature's part);
    of a GGUF block weight, only the rows that hold them are de-quantized."""
    if isinstance(t, BlockEmbedding):
        t = t.table
    if isinstance(t, BlockLinear):
        n, cols = t.out_features * t.in_features, t.in_features
        idx = torch.tensor([i * (n - 1) // (SAMPLES_PER_TENSOR - 1) for i in range(SAMPLES_PER_TENSOR)])
        rows = t.rows(idx // cols).float()
        return [float(rows[i, c]) for i, c in enumerate((idx % cols).tolist())]
    flat = t.detach().reshape(-1)
    n = flat.numel()
    idx = torch.tensor([i * (n - 1) // (SAMPLES_PER_TENSOR - 1) for i in range(SAMPLES_PER_TENSOR)])
    return [float(x) for x in flat[idx].float().cpu()]


def compute_fingerprint(model: nn.Module) -> dict[str, Any]:
    """The fingerprint of a loaded Hugging Face causal LM (a JSON-able dict)."""
    cfg = model.config
    layers = next(m for m in model.modules() if isinstance(m, nn.ModuleList) and len(m) == cfg.num_hidden_layers)
    tensors = [
        _weight(model.get_input_embeddings()),
        _first_matrix(layers[0]),
        _first_matrix(layers[len(layers) // 2]),
        _first_matrix(layers[-1]),
        _weight(model.get_output_embeddings()),
    ]
    fp: dict[str, Any] = {k: getattr(cfg, k) for k in SHAPE_KEYS}
    fp["signature"] = [x for t in tensors for x in sample_values(t)]
    return fp


def fingerprint_id(fp: dict[str, Any]) -> str:
    """A short id for messages and model cards (rounded, so dtype changes rarely alter it)."""
    signature = fp.get("signature") if isinstance(fp.get("signature"), list) else []
    rounded = {k: fp.get(k) for k in SHAPE_KEYS} | {
        "signature": [f"{x:.2g}" if isinstance(x, (int, float)) else repr(x) for x in signature]}
    return hashlib.sha256(json.dumps(rounded, sort_keys=True).encode()).hexdigest()[:12]


def fingerprints_match(expected: dict[str, Any], actual: dict[str, Any]) -> bool:
    if any(expected.get(k) != actual.get(k) for k in SHAPE_KEYS):
        return False
    a, b = expected.get("signature", []), actual.get("signature", [])
    if not isinstance(a, list) or not isinstance(b, list):
        return False
    numbers = all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in [*a, *b])
    if len(a) != len(b) or not numbers:
        return False
    return all(abs(x - y) <= RELATIVE_TOLERANCE * max(abs(x), abs(y)) + 1e-6 for x, y in zip(a, b))


def base_id(model: nn.Module) -> str:
    """A short hash of a base's fingerprint (what a base without an adapter keeps its own things under)."""
    fingerprint = json.dumps(compute_fingerprint(model), sort_keys=True, default=str)
    return hashlib.sha256(fingerprint.encode()).hexdigest()[:16]
