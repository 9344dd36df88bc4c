"""Candidate policies and their predicted speed: what the tuner and the derivation both replay.

A :class:`Candidate` is a method and a :class:`~hispec_decode.decoding.policy.Policy`;
:func:`predict` replays it on calibration traces under a machine's :class:`~.costs.CostModel`;
:func:`batch_thresholds` turns the costs into the acceptance a drafted token needs per batch size.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from ..decoding.policy import Policy
from ..knobs import KNOBS, read_by
from .costs import SEQS, CostModel
from .simulate import Trace, replay

SPECULATION_OFF = 1.5  # a threshold above 1: never speculate


@dataclass(frozen=True)
class Candidate:
    method: str
    policy: Policy
    num_layers: int  # the model's: where a policy's layer names the full model (no middle level; L_v)

    def kwargs(self) -> dict[str, Any]:
        return {"method": self.method, **read_by(self.method, self.policy.knobs()), "batch_aware": False, "guard": False}

    def label(self) -> str:
        """The method, its levels (``L2 -> L4 -> L_v(8192) -> L_f``) and the knobs they read (from
        :data:`~hispec_decode.knobs.KNOBS`): equal labels are equal policies for what they decode."""
        p, n = self.policy, self.num_layers
        if self.method == "autoregressive":
            return self.method
        levels = [str(level) for level in p.levels(self.method, n)]
        knobs = [f"{k.symbol}={_value(getattr(p, k.name))}" for k in KNOBS if k.shown(self.method, p, n)]
        return f"{self.method} {' -> '.join(levels)}: {' '.join(knobs)}"


def _value(v: Any) -> str:
    return f"{v:g}" if isinstance(v, float) else str(v)


def predict(candidate: Candidate, traces: list[Trace], costs: CostModel, num_layers: int,
            eos: frozenset[int]) -> dict[str, float]:
    tokens = seconds = 0.0
    for trace in traces:
        r = replay(trace, candidate.method, candidate.policy, costs, num_layers, eos)
        tokens += r.tokens
        seconds += r.seconds
    return {"tokens_per_second": tokens / seconds, "seconds": seconds, "tokens": tokens}


def batch_thresholds(costs: CostModel, num_layers: int, cap: float, policy: Policy,
                     traces: list[Trace] | None = None) -> dict[str, float]:
    """Per batch size, the acceptance a drafted token needs there (above ``cap``, what the exits reach,
    or where no gate pays: :data:`SPECULATION_OFF`). In units of a plain step's cost per sequence, a
    drafted token costs its row in the full pass (``m``), and every sequence pays its share of the
    batch's draft pass to the policy's draft exit (``d``) whether its draft then passes the gate or not.
    With ``traces``, the gate is the confidence t that maximizes the gain per sequence and step,
    f(t) * (a(t) - m) - d (f: the share of positions whose draft reaches t; a: how often those drafts
    are the base's token); speculation stops where no t gains. Without them (or for a draft exit they
    do not record), a token pays at acceptance m + d."""
    layer = policy.draft_layer
    head = policy.levels("self_spec", num_layers)[0].key  # the draft level's head (L_v drafting: its small one)
    drafts = _drafts(traces, layer) if traces else None
    out, floor = {"1": 0.0}, 0.0
    for b in SEQS[1:]:
        step = costs.full_step(num_layers, b)
        m = (costs.full_step(num_layers, b + 1) - step) / (step / b)
        d = (costs.band(0, layer, b, b) + (costs.exit(head, b) if head in costs.exits else 0.0)) / step
        gate = m + d if drafts is None else _best_gate(*drafts, m, d)
        floor = max(floor, gate)  # never lower in a bigger batch (timing noise aside)
        out[str(b)] = round(floor, 3) if floor <= cap else SPECULATION_OFF
    return out


def _drafts(traces: list[Trace], layer: int) -> tuple[np.ndarray, np.ndarray] | None:
    """The draft exit's confidence at every generated position of ``traces``, highest first, and
    whether its token there was the base model's (None: the traces do not record this exit)."""
    if any(layer not in t.conf for t in traces):
        return None
    conf = np.concatenate([t.conf[layer][t.prompt_length - 1 : len(t.tokens) - 1, 0] for t in traces])
    hit = np.concatenate([t.top[layer][t.prompt_length - 1 : len(t.tokens) - 1, 0] == np.asarray(t.tokens[t.prompt_length:])
                          for t in traces])
    order = np.argsort(-conf, kind="stable")
    return conf[order], hit[order]


def _best_gate(conf: np.ndarray, hit: np.ndarray, m: float, d: float) -> float:
    """The confidence gate with the largest gain f * (a - m) - d per sequence and step (see
    :func:`batch_thresholds`); :data:`SPECULATION_OFF` where none is positive."""
    if not len(conf):
        return SPECULATION_OFF
    gain = np.cumsum(hit - m) / len(conf) - d  # drafting the k likeliest positions
    k = int(np.argmax(gain))
    return float(conf[k]) if gain[k] > 0 else SPECULATION_OFF


def policy_dict(policy: Policy) -> dict[str, Any]:
    return policy.knobs()


