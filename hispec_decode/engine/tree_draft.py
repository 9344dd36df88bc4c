"""Drafting a token tree at ``L_d``: one band-0 pass per level, over every node of the level at once.

The first request brings the root (the sequence's last token) through band 0 and gives the draft's
distribution of the first position; each further level's nodes run through band 0 together (tree
attention: each sees the prefix and its ancestors) and give their children's candidates. The last
level's nodes, and the leaves a dynamic tree adds at the end, are left for the check to run.
"""

from __future__ import annotations

from typing import Generator

import torch

from ..decoding.policy import Policy
from ..decoding.tree import DraftTree, static_shape
from .sequence import BandRequest, Sequence

TreeLoop = Generator[BandRequest, torch.Tensor, "DraftTree | None"]


def draft_tree(seq: Sequence, policy: Policy, threshold: float, floor: float = 0.0) -> TreeLoop:
    """Draft a tree of at most ``policy.tree_nodes`` nodes and ``policy.num_draft`` levels under
    ``policy.tree`` (``static`` or ``dynamic``), with ``policy.tree_width`` children per node at most.
    Returns None (and no tree is out) when the root's top probability is below ``threshold`` or there
    is no room; ``floor``: the path probability a node needs (the batch-aware break-even, 0 at batch 1).
    Every decision reads the draft's distributions only, so any tree keeps decoding lossless."""
    room = seq.room()
    if room <= 0 or threshold > 1:
        return None
    logits = yield BandRequest(seq, 0, 1)
    seq.counters.calls_draft += 1
    base = len(seq.tokens)
    width, depth_limit, budget = policy.tree_width, min(policy.num_draft, room), min(policy.tree_nodes, room)
    (first,) = seq.sampler.candidates(logits[-1:], width, [base])
    if not first or (threshold > 0 and first[0][1] < threshold):
        return None
    tree = DraftTree(base)
    seq.tree = tree

    def add(token: int, parent: int, score: float) -> int:
        seq.tokens.append(token)  # tokens[base:] are the nodes, in slot order
        return tree.add(token, parent, score)

    shape = static_shape(budget, depth_limit, width) if policy.tree == "static" else None
    frontier: list[tuple[int, list[tuple[int, float]]]] = [(-1, first)]  # (node, its candidates)
    pool: list[tuple[float, int, int]] = []  # dynamic: candidates not taken, (path probability, parent, token)
    rank_path = {-1: ()}  # static: node -> its rank path
    level = 1
    while True:
        new: list[int] = []
        if shape is not None:
            wanted = {p for p in shape if len(p) == level}
            for node, cands in frontier:
                for rank, (token, prob) in enumerate(cands):
                    path = rank_path[node] + (rank,)
                    if path in wanted and tree.score(node) * prob > floor:
                        new.append(add(token, node, tree.score(node) * prob))
                        rank_path[new[-1]] = path
        else:
            scored = sorted(((tree.score(node) * prob, node, token) for node, cands in frontier for token, prob in cands),
                            key=lambda c: -c[0])
            take = max(0, min(width, budget - len(tree)))
            for score, node, token in scored[:take]:
                if score > floor:
                    new.append(add(token, node, score))
            pool += scored[take:]
        expand = [i for i in new if tree.tokens[i] not in seq.eos]
        if not expand or level >= depth_limit or len(tree) >= budget:
            break
        logits = yield BandRequest(seq, 0, len(new))
        seq.counters.calls_draft += 1
        rows = [j for j, i in enumerate(new) if i in expand]  # a list: one row stays a [1, ...] slice, in numpy too
        frontier = list(zip(expand, seq.sampler.candidates(logits[rows], width, [base + tree.depth(i) for i in expand])))
        level += 1
    if shape is None:  # EAGLE-2's re-ranking: the budget left goes to the best candidates not taken
        for score, node, token in sorted(pool, key=lambda c: -c[0])[: max(0, budget - len(tree))]:
            if score > floor:
                add(token, node, score)
    if not len(tree):  # nothing paid its rows
        seq.tree = None
        return None
    return tree
