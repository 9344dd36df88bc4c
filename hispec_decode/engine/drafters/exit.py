"""The exit-head drafter: the draft exit ``L_d`` (an early-exit head, or the vocabulary level when
``draft_layer`` is the number of layers) proposes a chain, or a static or dynamic token tree
(``policy.tree``), one band-0 pass per token or tree level."""

from __future__ import annotations

import torch

from ..sequence import BandRequest, Sequence
from ..tree_draft import draft_tree
from .base import Draft, Drafter, DraftLoop


OFF = 1.5  # a draft threshold above 1: the draft exit never drafts


class ExitDrafter(Drafter):
    name = "exit"
    order = 100  # after every drafter that needs no pass of its own
    off = {"draft_threshold": OFF}

    def active(self, seq: Sequence) -> bool:
        return seq.policy.at_batch(seq.batch_size)[0] <= 1  # then its gate decides per token

    def propose(self, seq: Sequence, threshold: float) -> DraftLoop:
        policy = seq.policy
        if policy.tree != "chain":
            tree = yield from draft_tree(seq, policy, threshold, policy.floor(seq.batch_size))
            return None if tree is None else Draft(self, len(tree), tree=tree)
        drafts, probs = yield from chain(seq, policy.num_draft, threshold)
        return Draft(self, len(drafts), probs) if drafts else None


def chain(seq: Sequence, count: int, threshold: float):
    """Up to ``count`` tokens from the draft exit (band 0) while its top probability is at least
    ``threshold``, stopping at EOS. Returns ``(drafts, their distributions or None when greedy)``; no
    drafts leaves band 0's hidden state waiting for the band above."""
    drafts, probs = [], []
    while len(drafts) < count and seq.room() > 0 and threshold <= 1:
        logits = yield BandRequest(seq, 0, 1)
        seq.counters.calls_draft += 1
        proposal = seq.sampler.propose(logits, threshold, len(seq.tokens))
        if proposal is None:
            break
        token, q = proposal
        seq.tokens.append(token)
        drafts.append(token)
        probs.append(q)
        if token in seq.eos:
            break
    return drafts, None if seq.sampler.greedy or not drafts else torch.stack(probs)
