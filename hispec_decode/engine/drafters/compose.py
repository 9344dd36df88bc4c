"""One round's draft from the registered drafters: the first active one that proposes something, or,
under ``policy.drafting == "union"`` at batch 1 (where a pass over a few more rows costs little), the
proposals of all of them merged into one tree and verified in one pass.

A union runs the drafters with passes of their own first (the exit drafter: its nodes take the first
slots, in the order band 0 runs them; a chain becomes a one-path tree), then adds each point-mass
drafter's tokens as a path from the root, sharing the nodes whose tokens it repeats. Every node keeps
the position its depth gives, so the check sees each branch as the sequence it would be.
"""

from __future__ import annotations

from ...decoding.tree import DraftTree
from ..sequence import Sequence
from .base import Draft, Drafter, DraftLoop, registered


def propose(seq: Sequence, threshold: float) -> DraftLoop:
    """One round's draft (None: no drafter proposed anything; nothing was appended)."""
    active = [d for d in registered() if d.active(seq)]
    if seq.policy.drafting == "union" and seq.batch_size == 1 and len(active) > 1:
        return (yield from union(seq, active, threshold))
    for drafter in active:
        draft = yield from drafter.propose(seq, threshold)
        if draft is not None:
            return draft
    return None


def union(seq: Sequence, active: list[Drafter], threshold: float) -> DraftLoop:
    """The drafts of every drafter in ``active`` as one tree (see the module docstring)."""
    first = len(seq.tokens)
    draft = None
    for drafter in (d for d in active if not d.point_mass):
        draft = yield from drafter.propose(seq, threshold)
        if draft is not None:
            break
    copying = [d for d in active if d.point_mass]
    if draft is None:  # nothing with passes proposed: the first copy alone, as a chain
        for drafter in copying:
            draft = yield from drafter.propose(seq, threshold)
            if draft is not None:
                return draft
        return None
    tree = draft.tree if draft.tree is not None else _as_tree(seq, first)
    nodes: dict[Drafter, set[int]] = {draft.drafter: set(range(len(tree)))}
    for drafter in copying:
        mine, node = set(), -1
        for token in drafter.tokens(seq, seq.tokens[:first], seq.room()):
            child = next((c for c in tree.children(node) if tree.tokens[c] == token), None)
            if child is None:  # from here on the copy leaves the tree: new nodes, in new slots
                if seq.room() <= 0:
                    break
                child = tree.add(token, node, 0.0)
                seq.tokens.append(token)
            mine.add(child)
            node = child
        nodes[drafter] = mine
    return Draft(None, len(tree), tree=tree, nodes=nodes)


def _as_tree(seq: Sequence, base: int) -> DraftTree:
    """The chain ``seq.tokens[base:]`` as a one-path tree (and ``seq.tree``)."""
    tree = DraftTree(base)
    for i, token in enumerate(seq.tokens[base:]):
        tree.add(token, i - 1, 1.0)
    seq.tree = tree
    return tree
