"""The layer curve: per exit layer, how often a head agrees with the final layer and what exiting
there costs; and the exits worth tuning policies over (what ``hispec-tune --curve`` reads).

The curve file (written by ``hispec-curve``) maps each layer to its held-out top-1 and top-4
agreement, calibration (coverage and precision per confidence threshold) and ``cost``: one
token's pass to that exit, head included, as a fraction of a full decoding step.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ..errors import HiSpecError


def self_spec_speedup(agreement: float, cost: float, max_drafts: int = 6) -> tuple[float, int]:
    """Estimated speed-up of drafting ``k`` tokens at an exit with i.i.d. per-token acceptance
    ``agreement`` and relative cost ``cost``, verified by one full pass; the best ``k``."""
    best = (1.0, 0)
    for k in range(1, max_drafts + 1):
        tokens = sum(agreement**i for i in range(k + 1))  # accepted drafts + the full model's token
        best = max(best, (tokens / (1 + k * cost), k))
    return best


def read_curve(path: str | Path) -> dict[int, dict[str, Any]]:
    try:
        data = json.loads(Path(path).read_text())
        curve = {int(layer): entry for layer, entry in data["layers"].items()}
        for entry in curve.values():
            float(entry["top1"]), float(entry["cost"])
        return curve
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        raise HiSpecError(f"{path} is not a layer curve written by hispec-curve ({type(exc).__name__}: {exc})") from exc


def choose_layers(curve: dict[int, dict[str, Any]], available: list[int], count: int = 4) -> list[int]:
    """The ``count`` exits among ``available`` with the best estimated drafting speed-up, ascending
    (``hispec-tune`` pairs them as draft and intermediate exits)."""
    known = [l for l in available if l in curve]
    if len(known) < 1:
        raise HiSpecError(f"the layer curve covers none of the adapter's exits {available}")
    ranked = sorted(known, key=lambda l: -self_spec_speedup(curve[l]["top1"], curve[l]["cost"])[0])
    return sorted(ranked[:count])
