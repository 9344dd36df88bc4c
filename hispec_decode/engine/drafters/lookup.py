"""The prompt-lookup drafter: tokens that followed an earlier occurrence of the sequence's last
tokens (:func:`hispec_decode.decoding.lookup.lookup`), as point-mass proposals, at the cost of no
model pass. On while ``policy.lookup`` > 0 and a drafted row pays for itself at the batch size.

Its budget adapts: ``policy.lookup`` tokens at first, then twice what the last copy had accepted (at
least 2), since every copied token is a row of the check's pass whether it is accepted or not. In a
batch, where a row costs a share of a step (``policy.floor``: the acceptance a speculated token needs
there), it copies only the tokens that pay: under the sequence's own record of copies (each copied
token accepted with a chance q, Laplace-smoothed toward :data:`PRIOR_ACCEPTED` /
(:data:`PRIOR_ACCEPTED` + :data:`PRIOR_REJECTED`)), the d-th token is accepted with chance q^d, and
copying stops at the first d with q^d below the floor."""

from __future__ import annotations

from dataclasses import dataclass, field

from ...decoding.lookup import MIN_NGRAM, lookup
from ..sequence import Sequence
from .base import Draft, Drafter, DraftLoop

COPY_TOKENS = 8  # tokens a copy proposes at most where a round chooser turns lookup on (the policy leaves it off)
PRIOR_ACCEPTED = 3  # pseudo-counts of a sequence's record of copies before its first copy is checked
PRIOR_REJECTED = 1


@dataclass
class CopyRecord:
    """A sequence's record of its copies, and the shortest n-grams looked up that it holds so far."""

    budget: int = 0  # drafts per round at most (0: the policy's)
    accepted: int = 0  # copied tokens accepted
    rejected: int = 0  # copies cut by a rejection
    ngrams: set[tuple[int, ...]] = field(default_factory=set)  # tokens[i : i + MIN_NGRAM] for i < indexed
    indexed: int = 0


class PromptLookup(Drafter):
    name = "lookup"
    order = 10
    point_mass = True
    off = {"lookup": 0}
    on = {"lookup": COPY_TOKENS}

    def new_state(self) -> CopyRecord:
        return CopyRecord()

    def active(self, seq: Sequence) -> bool:
        """On while ``policy.lookup`` > 0 and a drafted row pays for itself at the batch size."""
        return seq.policy.lookup > 0 and seq.policy.floor(seq.batch_size) <= 1

    def can_propose(self, seq: Sequence) -> bool:
        """Whether the last :data:`MIN_NGRAM` tokens occurred before (a copy exists; asked at a round's start,
        where every token is committed): the sequence's n-grams are indexed as they come, so a round costs
        O(its new tokens), not a scan of the sequence."""
        tokens, record, n = seq.tokens, self.state(seq), MIN_NGRAM
        if seq.room() <= 1:
            return False
        end = len(tokens) - n  # n-grams starting before it have a token after them, the suffix excluded
        if end < record.indexed:  # the sequence got shorter than what was indexed: scan it
            return bool(lookup(tokens, 1))
        for i in range(record.indexed, end):
            record.ngrams.add(tuple(tokens[i : i + n]))
        record.indexed = end
        return len(tokens) > n and tuple(tokens[-n:]) in record.ngrams

    def tokens(self, seq: Sequence, context: list[int], count: int) -> list[int]:
        budget = min(seq.policy.lookup, self.state(seq).budget or seq.policy.lookup, count, self.paying(seq))
        out = []
        for token in lookup(context, budget):
            out.append(token)
            if token in seq.eos:
                break
        seq.counters.copied += len(out)
        return out

    def propose(self, seq: Sequence, threshold: float) -> DraftLoop:
        copied = self.tokens(seq, seq.tokens, seq.room())
        seq.tokens += copied
        return Draft(self, len(copied)) if copied else None
        yield  # unreachable: makes this a generator (a copy needs no pass)

    def paying(self, seq: Sequence) -> int:
        """How many leading copied tokens pay for their rows at the sequence's batch size."""
        floor = seq.policy.floor(seq.batch_size)
        if floor <= 0:
            return seq.policy.lookup
        record = self.state(seq)
        q = (record.accepted + PRIOR_ACCEPTED) / (record.accepted + record.rejected + PRIOR_ACCEPTED + PRIOR_REJECTED)
        n, chance = 0, q
        while n < seq.policy.lookup and chance >= floor:
            n, chance = n + 1, chance * q
        return n

    def feedback(self, seq: Sequence, draft: Draft, accepted: int) -> None:
        proposed = len(draft.nodes[self]) if draft.nodes else draft.count
        record = self.state(seq)
        record.accepted += accepted
        record.rejected += accepted < proposed  # each copy ends at its first rejected token
        record.budget = max(2, 2 * accepted)
