"""``SpeculationGuard``: speculation stays on at a batch size only while it is faster there, as
measured on the engine's own steps.

A policy is chosen from predictions (:mod:`hispec_decode.tuning.derive`) or from decoding other
prompts (``hispec-tune``); either can be wrong for the workload at hand: another machine, prompts
its drafts do not know, a batch size where the extra rows cost more than they bring. The guard
therefore runs two arms per (policy, batch size): speculation as the policy says, and plain
decoding. Time passes in epochs; each epoch's committed tokens per second go into its arm's running
estimate. The first epoch decodes plainly, the second speculates; from then on the faster arm runs,
and now and then (every :data:`PROBE_EVERY` epochs, twice as rarely after each probe that loses
again, up to :data:`MAX_PROBE_EVERY`) the other one does, so a change of workload is noticed. An
epoch ends after :data:`EPOCH_TOKENS` committed tokens, or once it has taken as long as that many
tokens take on the other arm: a losing arm costs at most one epoch's time per probe. Which arm
runs never changes a token: both are lossless.
"""

from __future__ import annotations

from dataclasses import dataclass, field

EPOCH_TOKENS = 48  # committed tokens per measurement epoch
PROBE_EVERY = 8  # epochs between probes of the arm not in favour, at first
MAX_PROBE_EVERY = 64  # ... and at most, after probes that keep losing
DECAY = 0.5  # weight of an arm's earlier epochs in its estimate


@dataclass
class _Arm:
    rate: float | None = None  # committed tokens per second, decayed over epochs

    def add(self, rate: float) -> None:
        self.rate = rate if self.rate is None else DECAY * self.rate + (1 - DECAY) * rate


@dataclass
class _State:
    speculate: bool = False  # the arm running now
    tokens: int = 0  # of the current epoch
    seconds: float = 0.0
    since_probe: int = 0  # epochs of the favoured arm since the last probe
    probing: bool = False  # the epoch running now is a probe of the arm not in favour
    probe_every: int = PROBE_EVERY
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
        other = s.arms[not s.speculate].rate
        if s.tokens < EPOCH_TOKENS and (other is None or s.seconds * other < EPOCH_TOKENS):
            return
        ran = s.speculate
        s.arms[ran].add(s.tokens / max(s.seconds, 1e-9))
        s.tokens, s.seconds = 0, 0.0
        spec, plain = s.arms[True].rate, s.arms[False].rate
        if spec is None or plain is None:  # each arm once: plain decoding, then speculation
            s.speculate = spec is None
            return
        favoured = spec >= plain
        if s.probing:  # a probe that won resets the interval, one that lost again doubles it
            s.probe_every = PROBE_EVERY if favoured == ran else min(2 * s.probe_every, MAX_PROBE_EVERY)
            s.since_probe = 0
        else:
            s.since_probe += 1
        s.probing = s.since_probe >= s.probe_every
        s.speculate = (not favoured) if s.probing else favoured

    def rates(self, policy: object, batch_size: int) -> tuple[float | None, float | None]:
        """The estimates of (speculation, plain decoding), committed tokens per second."""
        s = self._state(policy, batch_size)
        return s.arms[True].rate, s.arms[False].rate

    def _state(self, policy: object, batch_size: int) -> _State:
        return self._states.setdefault((policy, batch_size), _State())
