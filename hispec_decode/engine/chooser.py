"""``RoundChooser``: every round, each sequence picks the speculation it expects to commit the most
tokens per second with, from its own evidence and this machine's pass costs.

Arms (variants of the engine's policy with the same levels, so the sequence's bands stay as they are):

* ``policy``: the engine's policy (derived or tuned for this machine, or given);
* ``plain``: no draft this round (one pass through every band);
* ``exit``: the draft exit's chain or tree without prompt lookup (offered where the policy copies);
* ``copy``: prompt lookup alone (offered where the policy also drafts at an exit).

Rounds come in two kinds: where the sequence's last tokens occurred before (prompt lookup has a copy to
offer) and where they did not; ``exit`` and ``copy`` differ from ``policy`` only in the first kind, so
they are offered only there, and each arm keeps its evidence per kind (a copied passage and prose no
drafter knows are different bets). Evidence, per sequence, kind and arm: the tokens its rounds committed
and what those rounds cost, both decayed (:data:`DECAY` per round of that arm), so a sequence follows its
text as it changes. A round's cost is priced, not timed: each pass it made is priced by the machine's
:class:`~hispec_decode.decoding.cost_model.CostModel` (:func:`request_seconds`; in a batch, the share of
the pass that the sequence's rows add), so evidence does not depend on what else the machine is doing.
An arm's rate is its tokens over its seconds, starting from a prior worth :data:`PRIOR_ROUNDS` rounds
(the derivation's prediction of that arm on the adapter's calibration traces, else plain decoding's rate,
which the costs give).

The chooser takes the arm of highest rate (the policy on a tie); an arm out of favour is retried after
:data:`RETRY_EVERY` rounds of its kind, twice as rarely after each retry that loses (at most
:data:`MAX_RETRY_EVERY`), so exploring costs a bounded share of the rounds; plain decoding is never retried
(its rate is the costs' own). Decisions read past verdicts and
whether a copy exists now, never the verifier's output for the tokens being decided: every arm is
lossless, so the choice changes only speed.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from ..decoding.cost_model import CostModel, vocab_key
from ..decoding.lookup import lookup
from ..decoding.policy import Policy
from .sequence import BandRequest, Sequence

ARMS = ("policy", "plain", "exit", "copy")
DECAY = 0.9  # weight of an arm's earlier rounds, per round of that arm
PRIOR_ROUNDS = 4.0  # the prior's weight, in rounds
RETRY_EVERY = 6  # rounds of its kind before an arm out of favour is tried again, at first
MAX_RETRY_EVERY = 96  # ... and at most, after retries that keep losing
COPY_TOKENS = 8  # tokens a copy proposes at most, where the policy itself does not copy
OFF = 1.5  # a threshold above 1: that stage never speculates


def arm_policies(policy: Policy) -> dict[str, Policy]:
    """Each arm's policy: the engine's policy, or it with one drafter or both turned off (same levels)."""
    return {
        "policy": policy,
        "plain": dataclasses.replace(policy, draft_threshold=OFF, verify_threshold=OFF, lookup=0),
        "exit": dataclasses.replace(policy, lookup=0),
        "copy": dataclasses.replace(policy, draft_threshold=OFF, lookup=policy.lookup or COPY_TOKENS, drafting="first"),
    }


def request_seconds(costs: CostModel, request: BandRequest, num_layers: int, seqs: int = 1) -> float:
    """What ``request`` costs under ``costs`` (before it is served): each band's layers over the rows that
    band has not run yet (bands over the same rows run as one slice, as the runner does), the exit head on
    top, and what a real request adds; ``seqs``: the sequences sharing the pass (the request's share)."""
    seq = request.seq
    top = request.top_band
    end = request.end
    rows = [max(0, end - seq.processed(b)) for b in range(top + 1)]
    plain = top == len(seq.exits) - 1 and request.num_logits == 1 and len(set(rows)) == 1
    seconds, band = 0.0, 0
    while band <= top:
        last = band
        while last < top and rows[last + 1] == rows[band]:
            last += 1
        lo = seq.exits[band - 1] if band else 0
        seconds += costs.share(lo, seq.exits[last], rows[band], seqs)
        band = last + 1
    layer = seq.exits[top]
    if layer == num_layers and top < len(seq.exits) - 1:  # the vocabulary level
        layer = vocab_key(seq.policy.vocab)
    if request.num_logits and layer in costs.exits:
        seconds += costs.exit(layer, request.num_logits)
    return seconds + (costs.request if plain else costs.speculative_request)


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
    priors: dict[str, float] = field(default_factory=dict)  # arm -> predicted tokens per second
    arm: str = "policy"  # the arm of the round running now
    copying: bool = False  # whether the round running now could copy
    seconds: float = 0.0  # priced seconds of the round running now
    picks: dict[str, int] = field(default_factory=dict)  # rounds each arm ran (the statistics report them)

    def __post_init__(self) -> None:
        self.policies = arm_policies(self.policy)
        plain = 1.0 / max(self.costs.full_step(self.num_layers, 1) + self.costs.request, 1e-9)
        self.evidence = {(arm, copying): _Evidence(PRIOR_ROUNDS * (self.priors.get(arm) or plain), PRIOR_ROUNDS)
                         for arm in ARMS for copying in (False, True)}

    def offered(self, seq: Sequence) -> list[str]:
        """The arms this round may take: ``exit`` and ``copy`` only where a copy exists now and they differ
        from the policy."""
        arms = ["policy", "plain"]
        if seq.room() > 1 and lookup(seq.tokens, 1):
            if self.policy.lookup:
                arms.append("exit")
            if self.policy.draft_threshold <= 1 or not self.policy.lookup:
                arms.append("copy")
        return arms

    def choose(self, seq: Sequence) -> Policy:
        """The policy of the round starting now (its arm is kept for :meth:`record`)."""
        offered = self.offered(seq)
        self.copying = len(offered) > 2
        evidence = {arm: self.evidence[arm, self.copying] for arm in offered}
        for e in evidence.values():
            e.since += 1
        best = max(offered, key=lambda a: (evidence[a].rate, a == "policy"))
        # plain decoding's rate is the costs' own (no evidence to gather): only drafting arms are retried
        stale = [a for a in offered if a not in (best, "plain") and evidence[a].since >= evidence[a].retry_every]
        self.arm = max(stale, key=lambda a: evidence[a].since) if stale else best
        self.seconds = 0.0
        self.picks[self.arm] = self.picks.get(self.arm, 0) + 1
        return self.policies[self.arm]

    def price(self, request: BandRequest) -> None:
        """Add a request of the running round to its cost (before it is served)."""
        self.seconds += request_seconds(self.costs, request, self.num_layers, request.seq.batch_size)

    def record(self, tokens: int) -> None:
        """The round of :attr:`arm` ended with ``tokens`` committed."""
        e = self.evidence[self.arm, self.copying]
        kinds = ARMS if self.copying else ("policy", "plain")
        leader = max(self.evidence[a, self.copying].rate for a in kinds if a != self.arm)
        was_retry = e.since >= e.retry_every
        e.tokens = DECAY * e.tokens + tokens
        e.seconds = DECAY * e.seconds + max(self.seconds, 1e-9)
        if was_retry:  # a retry that loses waits twice as long for the next one
            e.retry_every = RETRY_EVERY if e.rate >= leader else min(2 * e.retry_every, MAX_RETRY_EVERY)
        e.since = 0
