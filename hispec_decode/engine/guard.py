"""``SpeculationGuard``: speculation stays on at a batch size only while it is faster there, as
measured on the engine's own steps.

A policy is chosen from predictions (:mod:`hispec_decode.tuning.derive`) or from decoding other
prompts (``hispec-tune``); either can be wrong for the workload at hand: another machine, prompts
its drafts do not know, a batch size where the extra rows cost more than they bring. The guard
therefore runs two arms per (policy, batch size): speculation as the policy says, and plain
decoding, in epochs of :data:`EPOCH_TOKENS` committed tokens. Each arm's estimate is its committed
tokens over its seconds, summed over its epochs with older ones decayed.

Plain decoding costs the same whatever the text, so one epoch measures it; speculation pays in
bursts (a copied passage, then text no drafter knows), so it is measured over several epochs at
once (:data:`SPECULATION_PROBE` of them, fewer when it is clearly losing), starting at a varying
point of the stream (probes that always began at the same point of every answer would see only that
part of it). The first epoch decodes plainly, the next ones speculate; from then on the faster arm
runs, and now and then (every :data:`PROBE_EVERY` epochs or so, twice as rarely after each probe
that loses again, up to :data:`MAX_PROBE_EVERY`) the other one does. An epoch also ends once it has
taken :data:`PROBE_TIME` times as long as an epoch of the other arm: a hopeless arm costs a bounded
time per probe. Which arm runs never changes a token: both are lossless.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

EPOCH_TOKENS = 32  # committed tokens per measurement epoch
SPECULATION_PROBE = 3  # epochs a probe of speculation lasts (the plain arm needs one)
CLEARLY_WORSE = 0.35  # a probe ends early once its arm runs at less than this fraction of the other
PROBE_EVERY = 8  # epochs between probes of the arm not in favour, at first
MAX_PROBE_EVERY = 64  # ... and at most, after probes that keep losing
PROBE_TIME = 2.0  # an epoch ends by time after this many of the other arm's epoch durations
DECAY = 0.7  # weight of an arm's earlier epochs in its estimate, per epoch of that arm


@dataclass
class _Arm:
    tokens: float = 0.0  # committed tokens and their seconds, decayed over epochs
    seconds: float = 0.0

    @property
    def rate(self) -> float | None:
        return self.tokens / self.seconds if self.seconds > 0 else None

    def add(self, tokens: int, seconds: float) -> None:
        self.tokens = DECAY * self.tokens + tokens
        self.seconds = DECAY * self.seconds + seconds


@dataclass
class _State:
    speculate: bool = False  # the arm running now
    tokens: int = 0  # of the current epoch
    seconds: float = 0.0
    probe_left: int = 0  # epochs left of the probe running now (0: no probe)
    since_probe: int = 0  # epochs of the favoured arm since the last probe
    probe_every: int = PROBE_EVERY
    wait: int = PROBE_EVERY  # epochs until the next probe
    arms: dict[bool, _Arm] = field(default_factory=lambda: {True: _Arm(), False: _Arm()})


class SpeculationGuard:
    """Per (policy, batch size): whether to speculate now (:meth:`speculate`), from the steps
    :meth:`record` was told about."""

    def __init__(self, seed: int = 0) -> None:
        self._states: dict[tuple[object, int], _State] = {}
        self._rng = random.Random(seed)  # when probes start (never what a token is)

    def speculate(self, policy: object, batch_size: int) -> bool:
        return self._state(policy, batch_size).speculate

    def record(self, policy: object, batch_size: int, seconds: float, tokens: int) -> None:
        """A step of ``batch_size`` sequences under the arm :meth:`speculate` gave took ``seconds``
        and committed ``tokens``."""
        s = self._state(policy, batch_size)
        s.seconds += seconds
        s.tokens += tokens
        other = s.arms[not s.speculate].rate
        if s.tokens < EPOCH_TOKENS and (other is None or s.seconds * other < PROBE_TIME * EPOCH_TOKENS):
            return
        ran = s.speculate
        s.arms[ran].add(s.tokens, max(s.seconds, 1e-9))
        s.tokens, s.seconds = 0, 0.0
        mine, theirs = s.arms[ran].rate, s.arms[not ran].rate
        if theirs is None:  # the first epoch (plain decoding): now speculation, over a whole probe
            self._probe(s, not ran)
            return
        if s.probe_left:
            s.probe_left -= 1
            if s.probe_left and mine >= CLEARLY_WORSE * theirs:
                return  # the probe goes on
            s.probe_left = 0
            won = mine >= theirs
            s.probe_every = PROBE_EVERY if won else min(2 * s.probe_every, MAX_PROBE_EVERY)
            s.since_probe, s.wait = 0, s.probe_every + self._rng.randrange(s.probe_every // 2 + 1)
            s.speculate = ran if won else not ran
            return
        favoured = s.arms[True].rate >= s.arms[False].rate
        s.since_probe += 1
        if s.since_probe >= s.wait:
            self._probe(s, not favoured)
        else:
            s.speculate = favoured

    @staticmethod
    def _probe(s: _State, arm: bool) -> None:
        s.speculate = arm
        s.probe_left = SPECULATION_PROBE if arm else 1

    def rates(self, policy: object, batch_size: int) -> tuple[float | None, float | None]:
        """The estimates of (speculation, plain decoding), committed tokens per second."""
        s = self._state(policy, batch_size)
        return s.arms[True].rate, s.arms[False].rate

    def _state(self, policy: object, batch_size: int) -> _State:
        return self._states.setdefault((policy, batch_size), _State())
