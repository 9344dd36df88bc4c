"""``RoundChooser``: every round, each sequence picks the speculation it expects to commit the most
tokens per second with, from its own evidence and this machine's pass costs, alone or in a batch.

Arms (variants of the engine's policy with the same levels, so the sequence's bands stay as they are):

* ``policy``: the engine's policy (derived or tuned for this machine, or given);
* ``plain``: no draft this round (one pass through every band);
* ``exit``: the draft exit's chain or tree without prompt lookup (offered where the policy copies);
* ``copy``: prompt lookup alone (offered where the policy also drafts at an exit).

Rounds come in two kinds: where the sequence's last tokens occurred before (prompt lookup has a copy to
offer) and where they did not; ``exit`` and ``copy`` differ from ``policy`` only in the first kind, so
they are offered only there. Evidence, per sequence, kind, arm and batch-size class (1, 2-3, 4-7, 8-15,
16 and more: a drafted row costs little alone and much in a big batch): the tokens its rounds committed
and what those rounds cost, both decayed (:data:`DECAY` per round of that arm), so a sequence follows its
text as it changes. A round's cost is priced, not timed: each pass it made is priced by the machine's
:class:`~hispec_decode.decoding.cost_model.CostModel` (:func:`request_seconds`), kept by the class of step
it ran in, and read at what such steps take now (the engine's :class:`~.cost_clock.CostClock`, a running
mean over many steps): a record measured at another speed, or with passes' costs wrong relative to one
another, is followed, and one stalled step moves nothing much. In a batch a request is priced at the
sequence's share of the step's passes: its share of one row per sequence, and each extra row at the
average cost of all the step's extra rows on the machine's row-cost curve. So when many sequences draft
at once, every drafted row costs more, and the sequences whose drafts are accepted least turn plain
first: the batch's rows go to the sequences whose evidence says they pay most.

An arm's rate is its tokens over its seconds, starting from a prior worth :data:`PRIOR_ROUNDS` plain
steps: alone, the derivation's prediction of that arm on the adapter's calibration traces (else plain
decoding's rate, which the costs give); in a batch, plain decoding's rate for every arm, so a batch
speculates only once a sequence's own rounds show it pays there. The chooser takes the arm of highest
score, a drafting arm's rate plus one standard error of it (:meth:`RoundChooser.score`), plain decoding's
rate as it is (on a tie, the policy alone and plain decoding in a batch); an arm out of favour is retried after
:data:`RETRY_EVERY` rounds of its kind, twice as rarely after each retry that loses (at most
:data:`MAX_RETRY_EVERY`), so exploring costs a bounded share of the rounds; plain decoding is retried
while the clock has timed few of its steps and the choice is close (its rate depends on the machine, not
the text, so a model's first sequences time it for all), never priced (its rate is the costs' step at the
clock's factor). Decisions read past verdicts and whether a copy exists now, never
the verifier's output for the tokens being decided: every arm is lossless, so the choice changes only
speed. A new sequence starts from the prior: no request pays for another's text.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from ..decoding.cost_model import CostModel
from ..decoding.policy import Policy
from . import drafters
from .drafters.exit import OFF
from .cost_clock import CostClock, StepClass, size_class
from .sequence import BandRequest, Sequence

ARMS = ("policy", "plain", "exit", "copy")
DECAY = 0.9  # weight of an arm's earlier rounds, per round of that arm
PRIOR_ROUNDS = 4.0  # the prior's weight, in plain steps' seconds
RETRY_EVERY = 6  # rounds of its kind before an arm out of favour is tried again, at first
MAX_RETRY_EVERY = 24  # ... and at most, after retries that keep losing
PLAIN_TIMED = 8  # plain steps the clock has timed before plain decoding is no longer retried
PLAIN_CLOSE = 1.5  # ... and it is retried only where the best arm's rate is within this factor of its rate


def arm_policies(policy: Policy) -> dict[str, Policy]:
    """Each arm's policy: the engine's policy, or it with some drafters turned off (and, for ``copy``, the
    point-mass drafters on), the levels the same."""
    passes = [d for d in drafters.registered() if not d.point_mass]
    copying = [d for d in drafters.registered() if d.point_mass]
    return {
        "policy": policy,
        "plain": dataclasses.replace(policy, verify_threshold=OFF, **drafters.without(drafters.registered())),
        "exit": dataclasses.replace(policy, **drafters.without(copying)),
        "copy": dataclasses.replace(policy, drafting="first", **drafters.without(passes),
                                    **drafters.turned_on(policy, copying)),
    }


def request_seconds(costs: CostModel, request: BandRequest, seqs: int = 1, total_rows: int | None = None) -> float:
    """What ``request`` costs under ``costs`` (before it is served): each band's layers over the rows that
    band has not run yet (bands over the same rows run as one slice, as the runner does), the exit head on
    top, and what a real request adds; ``seqs``: the sequences sharing the step, ``total_rows``: their rows
    in all (the request's share, :meth:`CostModel.share`)."""
    seq = request.seq
    top = request.top_band
    rows = request.band_rows()
    plain = top == len(seq.exits) - 1 and request.num_logits == 1 and len(set(rows)) == 1
    seconds, band = 0.0, 0
    while band <= top:
        last = band
        while last < top and rows[last + 1] == rows[band]:
            last += 1
        lo = seq.exits[band - 1] if band else 0
        seconds += costs.share(lo, seq.exits[last], rows[band], seqs, total_rows)
        band = last + 1
    key = seq.levels[top].key  # the head the request's logits come from
    if request.num_logits and key in costs.exits:
        seconds += costs.exit(key, request.num_logits)
    return seconds + (costs.request if plain else costs.speculative_request)


@dataclass
class _Evidence:
    tokens: float  # committed tokens of this arm's rounds, decayed
    seconds: dict[StepClass, float]  # their priced seconds by step class, decayed
    since: int = 0  # rounds of its kind since it last ran
    retry_every: int = RETRY_EVERY

    # decayed (by DECAY squared) sums of the rounds' tokens t and priced seconds s: t^2, t s, s^2
    tt: float = 0.0
    ts: float = 0.0
    ss: float = 0.0

    def rate(self, clock: CostClock) -> float:
        """Tokens per second, each class's priced seconds at what such steps take now."""
        seconds = sum(s * clock.factor(key) for key, s in self.seconds.items())
        return self.tokens / seconds if seconds > 0 else 0.0

    def add(self, tokens: float, seconds: dict[StepClass, float]) -> None:
        """One more round: ``tokens`` committed in ``seconds`` (priced, by class); earlier rounds decay."""
        s = sum(seconds.values())
        self.tokens = DECAY * self.tokens + tokens
        for key in set(self.seconds) | set(seconds):
            self.seconds[key] = DECAY * self.seconds.get(key, 0.0) + seconds.get(key, 0.0)
        self.tt, self.ts, self.ss = (DECAY**2 * self.tt + tokens * tokens, DECAY**2 * self.ts + tokens * s,
                                     DECAY**2 * self.ss + s * s)

    def spread(self) -> float:
        """The rate's standard error relative to the rate (the ratio estimator's, over the decayed rounds;
        the prior adds none): how far the rate could be off from the rounds seen."""
        seconds = sum(self.seconds.values())
        if seconds <= 0 or self.tokens <= 0:
            return 0.0
        r = self.tokens / seconds
        var = max(0.0, self.tt - 2 * r * self.ts + r * r * self.ss) / seconds**2
        return var**0.5 / r


@dataclass
class RoundChooser:
    """One sequence's choice of arm, round by round (see the module docstring)."""

    policy: Policy  # the engine's
    costs: CostModel
    num_layers: int
    priors: dict[str, float] = field(default_factory=dict)  # arm -> predicted tokens per second, alone
    clock: CostClock = field(default_factory=CostClock)  # the engine's: what steps take per priced second
    arm: str = "policy"  # the arm of the round running now
    key: tuple[bool, int] = (False, 1)  # the round's kind (whether it could copy) and batch-size class
    top: int = 0  # the sequence's top band (plain decoding's steps run 1 row up to it)
    seconds: dict[StepClass, float] = field(default_factory=dict)  # priced seconds of the running round, by class
    picks: dict[str, int] = field(default_factory=dict)  # rounds each arm ran (the statistics report them)

    def __post_init__(self) -> None:
        self.policies = arm_policies(self.policy)
        self.evidence: dict[tuple[str, bool, int], _Evidence] = {}

    def offered(self, seq: Sequence) -> list[str]:
        """The arms this round may take: ``exit`` and ``copy`` only where a copy exists now and they differ
        from the policy."""
        arms = ["policy", "plain"]
        if any(d.can_propose(seq) for d in drafters.registered() if d.point_mass):
            for arm in ("exit", "copy"):
                if self.policies[arm] != self.policy:
                    arms.append(arm)
        return arms

    def choose(self, seq: Sequence) -> Policy:
        """The policy of the round starting now (its arm is kept for :meth:`record`)."""
        offered = self.offered(seq)
        self.key = (len(offered) > 2, size_class(seq.batch_size))
        self.top = len(seq.exits) - 1
        evidence = {arm: self._evidence(arm) for arm in offered}
        for e in evidence.values():
            e.since += 1
        favourite = "policy" if self.key[1] == 1 else "plain"
        scores = {arm: self.score(arm) for arm in offered}
        best = max(offered, key=lambda a: (scores[a], a == favourite))
        stale = [a for a in offered if a != best and evidence[a].since >= evidence[a].retry_every
                 and (a != "plain" or self._plain_untimed(scores["plain"], scores[best]))]
        self.arm = max(stale, key=lambda a: evidence[a].since) if stale else best
        self.seconds = {}
        self.picks[self.arm] = self.picks.get(self.arm, 0) + 1
        return self.policies[self.arm]

    def rate(self, arm: str) -> float:
        """``arm``'s tokens per second in the running round's kind and batch-size class: its evidence, or for
        plain decoding the costs' own step at what plain steps take now."""
        if arm == "plain":
            return 1.0 / (self._plain_step() * self.clock.factor(self._plain_class()))
        return self._evidence(arm).rate(self.clock)

    def score(self, arm: str) -> float:
        """What the choice compares: a drafting arm's rate plus one standard error of it, plain decoding's
        rate (known: the costs' step at the clock's factor). An arm whose few last rounds were unlucky is
        not left behind on them: without the error a noisy arm that dips below plain decoding stops
        gathering the evidence that would lift it again."""
        if arm == "plain":
            return self.rate(arm)
        return self.rate(arm) * (1.0 + self._evidence(arm).spread())

    def price(self, key: StepClass, seconds: float) -> None:
        """Add a request of the running round to its cost (before it is served): ``seconds`` priced by
        :func:`request_seconds` in a step of class ``key``. Plain rounds are not priced: their rate is the
        costs' own."""
        if self.arm != "plain":
            self.seconds[key] = self.seconds.get(key, 0.0) + seconds

    def record(self, tokens: int) -> None:
        """The round of :attr:`arm` ended with ``tokens`` committed."""
        e = self._evidence(self.arm)
        kinds = ARMS if self.key[0] else ("policy", "plain")
        leader = max(self.score(a) for a in kinds if a != self.arm)
        was_retry = e.since >= e.retry_every
        if self.arm != "plain":  # plain decoding's rate stays the costs' own (:meth:`rate`)
            e.add(tokens, self.seconds)
        if was_retry:  # a retry that loses waits twice as long for the next one
            e.retry_every = RETRY_EVERY if self.score(self.arm) >= leader else min(2 * e.retry_every, MAX_RETRY_EVERY)
        e.since = 0

    def _plain_step(self) -> float:
        """Priced seconds of one plain decoding step, per sequence, in the running round's batch-size class."""
        size = self.key[1]
        return self.costs.full_step(self.num_layers, size) / size + self.costs.request

    def _plain_untimed(self, plain: float, best: float) -> bool:
        """Whether a plain round is worth retrying: plain decoding's rate depends on the machine alone, not on
        the text, so only while the clock has timed few of its steps (by any sequence of the model), and only
        where the clock's guess could be off by enough to change the choice."""
        return self.clock.counts.get(self._plain_class(), 0) < PLAIN_TIMED and plain * PLAIN_CLOSE >= best

    def _plain_class(self) -> StepClass:
        return self.key[1], self.top, 1

    def _evidence(self, arm: str) -> _Evidence:
        """The arm's evidence for the running round's kind and batch-size class, from the prior at first: a
        prior's seconds are plain steps' (it says how much faster than plain decoding the arm is)."""
        copying, size = self.key
        e = self.evidence.get((arm, copying, size))
        if e is None:
            step = self._plain_step()
            rate = (self.priors.get(arm) if size == 1 else None) or 1.0 / max(step, 1e-9)
            e = self.evidence[arm, copying, size] = _Evidence(PRIOR_ROUNDS * step * rate,
                                                              {self._plain_class(): PRIOR_ROUNDS * step})
        return e
