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
:class:`~hispec_decode.decoding.cost_model.CostModel` (:func:`request_seconds`), so evidence does not
depend on what else the machine is doing. In a batch a request is priced at the sequence's share of the
step's passes: its share of one row per sequence, and each extra row at the average cost of all the
step's extra rows on the machine's row-cost curve. So when many sequences draft at once, every drafted row
costs more, and the sequences whose drafts are accepted least turn plain first: the batch's rows go to
the sequences whose evidence says they pay most.

An arm's rate is its tokens over its seconds, starting from a prior worth :data:`PRIOR_ROUNDS` plain
steps: alone, the derivation's prediction of that arm on the adapter's calibration traces (else plain
decoding's rate, which the costs give); in a batch, plain decoding's rate for every arm, so a batch
speculates only once a sequence's own rounds show it pays there. The chooser takes the arm of highest
rate (on a tie, the policy alone and plain decoding in a batch); an arm out of favour is retried after
:data:`RETRY_EVERY` rounds of its kind, twice as rarely after each retry that loses (at most
:data:`MAX_RETRY_EVERY`), so exploring costs a bounded share of the rounds; plain decoding is never
retried, nor priced (its rate is the costs' own). Decisions read past verdicts and whether a copy exists now, never
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
from .sequence import BandRequest, Sequence

ARMS = ("policy", "plain", "exit", "copy")
DECAY = 0.9  # weight of an arm's earlier rounds, per round of that arm
PRIOR_ROUNDS = 4.0  # the prior's weight, in plain steps' seconds
RETRY_EVERY = 6  # rounds of its kind before an arm out of favour is tried again, at first
MAX_RETRY_EVERY = 96  # ... and at most, after retries that keep losing
MAX_CLASS = 16  # batch sizes from here on share their evidence


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


def size_class(batch_size: int) -> int:
    """The batch-size class whose evidence a round at ``batch_size`` reads and adds to: 1, 2, 4, 8 or 16."""
    return min(1 << (max(batch_size, 1).bit_length() - 1), MAX_CLASS)


def request_seconds(costs: CostModel, request: BandRequest, seqs: int = 1, total_rows: int | None = None) -> float:
    """What ``request`` costs under ``costs`` (before it is served): each band's layers over the rows that
    band has not run yet (bands over the same rows run as one slice, as the runner does), the exit head on
    top, and what a real request adds; ``seqs``: the sequences sharing the step, ``total_rows``: their rows
    in all (the request's share, :meth:`CostModel.share`)."""
    seq = request.seq
    top = request.top_band
    rows = request_rows(request)
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


def request_rows(request: BandRequest) -> list[int]:
    """The rows each band up to the request's top runs for it (those it has not run yet)."""
    seq = request.seq
    return [max(0, request.end - seq.processed(b)) for b in range(request.top_band + 1)]


@dataclass
class _Evidence:
    tokens: float  # committed tokens of this arm's rounds, decayed
    seconds: float  # their priced seconds, decayed
    since: int = 0  # rounds of its kind since it last ran
    retry_every: int = RETRY_EVERY

    @property
    def rate(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0


@dataclass
class RoundChooser:
    """One sequence's choice of arm, round by round (see the module docstring)."""

    policy: Policy  # the engine's
    costs: CostModel
    num_layers: int
    priors: dict[str, float] = field(default_factory=dict)  # arm -> predicted tokens per second, alone
    arm: str = "policy"  # the arm of the round running now
    key: tuple[bool, int] = (False, 1)  # the round's kind (whether it could copy) and batch-size class
    seconds: float = 0.0  # priced seconds of the round running now
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
        evidence = {arm: self._evidence(arm) for arm in offered}
        for e in evidence.values():
            e.since += 1
        favourite = "policy" if self.key[1] == 1 else "plain"
        best = max(offered, key=lambda a: (evidence[a].rate, a == favourite))
        # plain decoding's rate is the costs' own (no evidence to gather): only drafting arms are retried
        stale = [a for a in offered if a not in (best, "plain") and evidence[a].since >= evidence[a].retry_every]
        self.arm = max(stale, key=lambda a: evidence[a].since) if stale else best
        self.seconds = 0.0
        self.picks[self.arm] = self.picks.get(self.arm, 0) + 1
        return self.policies[self.arm]

    def price(self, request: BandRequest, total_rows: int | None = None) -> None:
        """Add a request of the running round to its cost (before it is served); ``total_rows``: the rows of
        every sequence in the step (see :func:`request_seconds`). Plain rounds are not priced: their rate is the
        costs' own, the prior's."""
        if self.arm == "plain":
            return
        self.seconds += request_seconds(self.costs, request, request.seq.batch_size, total_rows)

    def record(self, tokens: int) -> None:
        """The round of :attr:`arm` ended with ``tokens`` committed."""
        if self.arm == "plain":  # its evidence stays the costs' rate (it is never retried)
            return
        e = self._evidence(self.arm)
        kinds = ARMS if self.key[0] else ("policy", "plain")
        leader = max(self._evidence(a).rate for a in kinds if a != self.arm)
        was_retry = e.since >= e.retry_every
        e.tokens = DECAY * e.tokens + tokens
        e.seconds = DECAY * e.seconds + max(self.seconds, 1e-9)
        if was_retry:  # a retry that loses waits twice as long for the next one
            e.retry_every = RETRY_EVERY if e.rate >= leader else min(2 * e.retry_every, MAX_RETRY_EVERY)
        e.since = 0

    def _evidence(self, arm: str) -> _Evidence:
        """The arm's evidence for the running round's kind and batch-size class, from the prior at first."""
        copying, size = self.key
        e = self.evidence.get((arm, copying, size))
        if e is None:
            step = self.costs.full_step(self.num_layers, size) / size + self.costs.request
            rate = (self.priors.get(arm) if size == 1 else None) or 1.0 / max(step, 1e-9)
            e = self.evidence[arm, copying, size] = _Evidence(PRIOR_ROUNDS * step * rate, PRIOR_ROUNDS * step)
        return e
