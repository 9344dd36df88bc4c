"""The prompt-lookup drafter: tokens that followed an earlier occurrence of the sequence's last
tokens (:func:`hispec_decode.decoding.lookup.lookup`), as point-mass proposals, at the cost of no
model pass. On while ``policy.lookup`` > 0 and a drafted row pays for itself at the batch size.

Its budget adapts: ``policy.lookup`` tokens at first, then twice what the last copy had accepted (at
least 2), since every copied token is a row of the check's pass whether it is accepted or not."""

from __future__ import annotations

from ...decoding.lookup import lookup
from ..sequence import Sequence
from .base import Draft, Drafter, DraftLoop


class PromptLookup(Drafter):
    name = "lookup"
    order = 10
    point_mass = True

    def active(self, seq: Sequence) -> bool:
        return seq.policy.copies(seq.batch_size)

    def tokens(self, seq: Sequence, context: list[int], count: int) -> list[int]:
        budget = min(seq.policy.lookup, seq.copy_budget or seq.policy.lookup, count)
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

    def feedback(self, seq: Sequence, draft: Draft, accepted: int) -> None:
        seq.copy_budget = max(2, 2 * accepted)
