"""``CostClock``: how long steps really take here, now, against what the machine's pass costs price them at.

The pass costs (:class:`~hispec_decode.decoding.cost_model.CostModel`) are measured once per machine, and a
measurement taken at a slow or noisy moment gets the costs of passes relative to one another wrong (a
one-row pass priced as dear as a verifying pass of eight, the full model's step dearer than it is): every
round chooser then prices its arms wrong for as long as the record is kept. The engine times every step in
which all requests decode (no prefill) and tells the clock the step's time and its priced seconds; per
:func:`step_class` (batch-size class, top band, rows class) the clock keeps the ratio's running mean, in
log, clipped near its current value once it has a few observations (a step stalled by another process moves
it a little). A class not observed yet takes the mean of every class observed (the host's overall speed).
The choosers multiply what they price in each class by its factor: their rates are then what the steps
took, averaged over many steps of each kind, so a host that runs at another speed than the record's,
overall or for some kinds of pass, is followed within tens of steps.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

ALPHA = 0.1  # weight of the newest observation in a class's running mean (of log time / priced)
SETTLED = 4  # observations of a class before its new ones are clipped near its mean
CLIP = math.log(2.0)  # ... to within this (in log) of it
MAX_CLASS = 16  # batch sizes and row counts from here on share a class

StepClass = tuple[int, int, int]  # (batch-size class, top band, rows class)


def size_class(n: int) -> int:
    """1, 2, 4, 8 or 16: the power of two at or below ``n``, at most :data:`MAX_CLASS`."""
    return min(1 << (max(n, 1).bit_length() - 1), MAX_CLASS)


def step_class(seqs: int, top_band: int, rows: int) -> StepClass:
    """The class of a step of ``seqs`` decoding sequences whose requests reach band ``top_band`` at most,
    one band of one request running ``rows`` rows at most."""
    return size_class(seqs), top_band, size_class(rows)


@dataclass
class CostClock:
    """Measured / priced step seconds, per :data:`StepClass` (see the module docstring)."""

    logs: dict[StepClass, float] = field(default_factory=dict)  # running mean of log(measured / priced)
    counts: dict[StepClass, int] = field(default_factory=dict)

    def factor(self, key: StepClass) -> float:
        """What a step of class ``key`` takes per priced second (1.0 before any observation)."""
        log = self.logs.get(key)
        if log is None:
            log = sum(self.logs.values()) / len(self.logs) if self.logs else 0.0
        return math.exp(log)

    def observe(self, key: StepClass, seconds: float, priced: float) -> None:
        """A step of class ``key`` took ``seconds``, priced at ``priced``."""
        if seconds <= 0 or priced <= 0:
            return
        x = math.log(seconds / priced)
        n = self.counts.get(key, 0)
        if n == 0:
            self.logs[key] = x
        else:
            mean = self.logs[key]
            if n >= SETTLED:
                x = min(max(x, mean - CLIP), mean + CLIP)
            self.logs[key] = mean + max(ALPHA, 1.0 / (n + 1)) * (x - mean)
        self.counts[key] = n + 1
