"""``SpeculationGuard``: speculation stays on at a batch size only while it is faster there, as
measured on the engine's own steps.

A policy is chosen from predictions (:mod:`hispec_decode.tuning.derive`) or from decoding other
prompts (``hispec-tune``); either can be wrong for the workload at hand: another machine, prompts
its drafts do not know, a batch size where the extra rows cost more than they bring. The guard
therefore runs two arms per (policy, batch size): speculation as the policy says, and plain
decoding. Time passes in epochs of :data:`EPOCH_TOKENS` committed tokens; each epoch's committed
tokens per second go into its arm's running estimate. The first epochs try speculation, then plain
decoding; from then on the faster arm runs, and every :data:`PROBE_EVERY`-th epoch the other one
does, so a change of workload is noticed. Which arm runs never changes a token: both are lossless.
"""

from __future__ import annotations

from dataclasses import dataclass, field

EPOCH_TOKENS = 48  # committed tokens per measurement epoch
PROBE_EVERY = 8  # every this many epochs the arm not in favour runs once
DECAY = 0.5  # weight of an arm's earlier epochs in its estimate


@dataclass
class _Arm:
    rate: float | None = None  # committed tokens per second, decayed over epochs

    def add(self, rate: float) -> None:
        self.rate = rate if self.rate is None else DECAY * self.rate + (1 - DECAY) * rate


@dataclass
class _State:
    speculate: bool = True  # the arm running now
    tokens: int = 0  # of the current epoch
    seconds: float = 0.0
    epochs: int = 0
    arms: dict[bool, _Arm] = field(default_factory=lambda: {True: _Arm(), False: _Arm()})


class SpeculationGuard:
    """Per (policy, batch size): whether to speculate now (:meth:`speculate`), from the steps
    :meth:`record` was told about."""

    def __init__(self) -> None:
        self._states: dict[tuple[object, int], _State] = {}

    def speculate(self, policy: object, batch_size: int) -> bool:
        return self._state(policy, batch_size).speculate

    def record(self, policy: object, batch_size: int, seconds: float, tokens: int) -> None:
        """A step of ``batch_size`` sequences under the arm :meth:`speculate` gave took ``seconds``
        and committed ``tokens``."""
        s = self._state(policy, batch_size)
        s.seconds += seconds
        s.tokens += tokens
        if s.tokens < EPOCH_TOKENS:
            return
        s.arms[s.speculate].add(s.tokens / max(s.seconds, 1e-9))
        s.tokens, s.seconds = 0, 0.0
        s.epochs += 1
        spec, plain = s.arms[True].rate, s.arms[False].rate
        if spec is None or plain is None:  # try each arm once
            s.speculate = spec is None
            return
        favoured = spec >= plain
        s.speculate = (not favoured) if s.epochs % PROBE_EVERY == 0 else favoured

    def rates(self, policy: object, batch_size: int) -> tuple[float | None, float | None]:
        """The estimates of (speculation, plain decoding), committed tokens per second."""
        s = self._state(policy, batch_size)
        return s.arms[True].rate, s.arms[False].rate

    def _state(self, policy: object, batch_size: int) -> _State:
        return self._states.setdefault((policy, batch_size), _State())
