"""What ``generate`` returns: the new tokens of each row, the run's statistics, the finished sequences."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from .knobs import knob_stats
from .decoding.policy import Policy
from .engine.llm_engine import LLMEngine
from .engine.sequence import Counters, Sequence


@dataclass
class GenerateOutput:
    sequences: list[list[int]]  # the new tokens of each row (EOS included if produced)
    stats: dict[str, Any]
    seqs: list[Sequence] = field(default_factory=list, repr=False)  # each row's finished Sequence (tokens, counters)


def _ratio(num: int, den: int) -> float | None:
    return num / den if den else None


def generation_stats(engine: LLMEngine, seqs: list[Sequence], seconds: float) -> dict[str, Any]:
    """Acceptance per level, pass counts, speed and cache use of one ``generate`` call."""
    c = Counters()
    for seq in seqs:
        c.add(seq.counters)
    method, policy = engine.method, engine.policy
    new = sum(len(s.new_tokens) for s in seqs)
    bytes_per_token = engine.cache.bytes_per_token()
    return {
        "method": method,
        "new_tokens": new,
        "acceptance_intermediate": _ratio(c.accepted_intermediate, c.drafted),
        "acceptance_final": _ratio(c.accepted_final, c.tentative),
        "calls_draft": c.calls_draft,
        "calls_intermediate": c.calls_intermediate,
        "calls_full": c.calls_full,
        "copied": c.copied,
        "arms": _arm_picks(seqs),
        "levels": level_stats(engine.exits, engine.runner.decoder.num_layers, c),
        "tokens_per_full_call": _ratio(new, c.calls_full),
        "seconds": seconds,
        "tokens_per_second": new / seconds if seconds > 0 else 0.0,
        **_policy_stats(method, policy),
        "steps": engine.steps,
        "preemptions": engine.preemptions,
        "peak_cache_bytes": engine.peak_slots * bytes_per_token,
        "needed_cache_bytes": engine.peak_tokens * bytes_per_token,
    }


def _arm_picks(seqs: list[Sequence]) -> dict[str, int]:
    """Rounds each arm of the sequences' round choosers ran (engine/chooser.py); empty without choosers."""
    picks: dict[str, int] = {}
    for seq in seqs:
        for arm, n in (seq.chooser.picks if seq.chooser is not None else {}).items():
            picks[arm] = picks.get(arm, 0) + n
    return picks


def level_names(exits: tuple[int, ...], num_layers: int) -> list[str]:
    """Each level's name: ``L<layer>`` for an exit, ``L_v`` for the vocabulary level, ``L_f`` on top."""
    return [f"L{layer}" if layer < num_layers else "L_v" for layer in exits[:-1]] + ["L_f"]


def level_stats(exits: tuple[int, ...], num_layers: int, c: Counters) -> list[dict[str, Any]]:
    """Per level above the drafter: its name (:func:`level_names`), the passes that checked there, the
    proposals they checked and how many they accepted."""
    names = level_names(exits, num_layers)
    return [{"level": names[j], "calls": c.calls.get(j, 0), "checked": c.checked.get(j, 0),
             "accepted": c.accepted.get(j, 0), "acceptance": _ratio(c.accepted.get(j, 0), c.checked.get(j, 0))}
            for j in range(1, len(exits))] if len(exits) > 1 else []


def level_acceptance(names: list[str], c: Counters) -> dict[str, float | None]:
    """Per level above the drafter (``L<layer>``, ``L_v``, ``L_f``): the share of proposals it accepted."""
    return {name: round(c.accepted.get(j, 0) / c.checked[j], 4) if c.checked.get(j) else None
            for j, name in enumerate(names, start=1)}


def _policy_stats(method: str, policy: Policy) -> dict[str, Any]:
    return knob_stats(method, policy.knobs())
