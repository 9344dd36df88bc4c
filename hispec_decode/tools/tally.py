"""One method's tally in ``hispec-bench``: tokens, seconds, counters and outputs over the prompts,
and the row of the table it becomes."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..engine.sequence import Counters
from ..outputs import level_acceptance


@dataclass
class Tally:
    tokens: int = 0
    seconds: float = 0.0
    matches: int = 0
    prompts: int = 0
    counters: Counters = field(default_factory=Counters)
    outputs: list[list[int]] = field(default_factory=list)
    levels: list[str] = field(default_factory=list)  # the name of each level above the drafter
    rates: list[float] = field(default_factory=list)  # each prompt's tokens per second, in prompt order
    arms: dict[str, int] = field(default_factory=dict)  # rounds each arm of the round chooser ran, all prompts

    def tps(self) -> float | None:
        return self.tokens / self.seconds if self.seconds else None

    def row(self, baseline: Tally | None, plain: Tally | None = None) -> dict[str, Any]:
        """``plain``: the autoregressive run with the same numerics (its tokens/s and outputs)."""
        c = self.counters
        tps = self.tps() or 0.0
        base_tps, ar_tps = baseline and baseline.tps(), plain and plain.tps()
        return {
            "tokens": self.tokens, "seconds": round(self.seconds, 4), "tokens_per_second": round(tps, 3),
            "ratio_to_transformers": round(tps / base_tps, 3) if base_tps else None,
            "ratio_to_autoregressive": round(tps / ar_tps, 3) if ar_tps else None,
            "acceptance_intermediate": round(c.accepted_intermediate / c.drafted, 4) if c.drafted else None,
            "acceptance_final": round(c.accepted_final / c.tentative, 4) if c.tentative else None,
            "tokens_per_full_call": round(self.tokens / c.calls_full, 3) if c.calls_full else None,
            "levels": level_acceptance(self.levels, c),
            "matches_transformers": f"{self.matches}/{self.prompts}",
            "matches_autoregressive": (f"{sum(a == b for a, b in zip(self.outputs, plain.outputs))}/{self.prompts}"
                                       if plain else None),
            "per_prompt_ratio_to_autoregressive": spread(self.rates, plain.rates) if plain else None,
            "rounds_by_arm": dict(sorted(self.arms.items())) or None,
        }


def spread(rates: list[float], plain: list[float]) -> dict[str, float] | None:
    """Each prompt's speed over plain decoding's on the same prompt: min, median and max (a mean hides the
    prompts where speculation loses)."""
    ratios = sorted(r / p for r, p in zip(rates, plain) if p > 0)
    if not ratios:
        return None
    mid = len(ratios) // 2
    median = ratios[mid] if len(ratios) % 2 else (ratios[mid - 1] + ratios[mid]) / 2
    return {"min": round(ratios[0], 3), "median": round(median, 3), "max": round(ratios[-1], 3)}
