"""``CostModel``: the measured cost of a band pass, as a function of its layers and rows.

A band pass runs ``layers[lo:hi]`` over ``rows`` new tokens of ``seqs`` sequences; its time on
this machine is modelled as ``call(rows, seqs) + (hi - lo) * layer(rows, seqs)``: a per-call part
(attention metadata, Python) and a per-layer part, each measured at a grid of row counts and
interpolated linearly in between (a pass of 5 rows on a CPU costs about what a pass of 1 row
does in bf16; in a batch of 16 sequences every extra row costs). Exit heads (the LM head of an
early exit, restricted to its vocabulary or not, and the final one) are measured per layer.
How it is measured: :func:`hispec_decode.tuning.costs.measure_costs`; who reads it: the per-machine
derivation (:mod:`hispec_decode.tuning`) and each sequence's round chooser
(:mod:`hispec_decode.engine.chooser`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


def interpolate(points: dict[int, float], x: float) -> float:
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
    # a level's head (its Level.key: an exit's layer, the full model's, the vocabulary level's) -> rows -> seconds
    exits: dict[int, dict[int, float]] = field(default_factory=dict)
    request: float = 0.0  # per plain decoding request: what a real step adds (scheduling, sampling, bookkeeping)
    speculative_request: float = 0.0  # the same for a drafting, checking or verifying request (gates, verdicts)

    def band(self, lo: int, hi: int, rows: int, seqs: int = 1) -> float:
        """Seconds of one pass of ``layers[lo:hi]`` over ``rows`` rows spread over ``seqs`` sequences (in a
        batch, rows beyond one per sequence cost what as many more sequences would: the measured curve)."""
        if rows <= 0 or hi <= lo:
            return 0.0
        if seqs <= 1:
            return interpolate(self.call_rows, rows) + (hi - lo) * interpolate(self.layer_rows, rows)
        return interpolate(self.call_seqs, seqs) + (hi - lo) * interpolate(self.layer_seqs, max(rows, seqs))

    def share(self, lo: int, hi: int, rows: int, seqs: int, total: int | None = None) -> float:
        """What one sequence's ``rows`` add to a pass of ``layers[lo:hi]`` shared by ``seqs`` sequences with
        ``total`` rows in all (default: one each, plus this sequence's extra rows): its share of a one-row-each
        pass, and every row beyond its first at the average cost of the pass's extra rows on the measured
        curve, so rows cost more the more of them the batch spends."""
        if seqs <= 1:
            return self.band(lo, hi, rows)
        if rows <= 0 or hi <= lo:
            return 0.0
        total = max(total or 0, seqs + rows - 1)
        extra = 0.0
        if total > seqs:
            per_row = (interpolate(self.layer_seqs, total) - interpolate(self.layer_seqs, seqs)) * (hi - lo) / (total - seqs)
            extra = (rows - 1) * max(per_row, 0.0)
        return self.band(lo, hi, seqs, seqs) / seqs + extra

    def exit(self, layer: int, rows: int) -> float:
        return interpolate(self.exits[layer], rows) if rows > 0 else 0.0

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
