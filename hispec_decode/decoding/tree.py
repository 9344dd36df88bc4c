"""Draft trees: data (tokens, parents, depths), shapes (static and dynamic), and the rows a band
pass over a tree needs.

A tree hangs under a *root*, the last token of the sequence before it (at slot ``base - 1``). Its
nodes take the slots ``base, base + 1, ...`` in the order they were added, parents before children
(so ``tokens[base:]`` of the sequence are the nodes), and the positions ``base - 1 + depth``: the
K/V of a node is computed at the position it would have in the sequence, seeing the committed
prefix and its own ancestors only (:class:`~hispec_decode.layers.attention.TreeRows`, read by every band). After
verification the accepted path's entries are moved to consecutive slots and everything else is
forgotten (:meth:`hispec_decode.engine.sequence.Sequence.accept_path`).

Shapes (``Policy.tree``):

* ``chain``: today's single chain (:func:`hispec_decode.engine.strategies.draft`).
* ``static``: a fixed shape of child ranks (Medusa / EAGLE-1), the ``tree_nodes`` best rank paths
  under a prior of how often the draft's ``r``-th choice is right (:func:`static_shape`).
* ``dynamic``: EAGLE-2's tree: each level expands the ``tree_width`` children of highest path
  probability (the product of the draft's probabilities along the path); once the depth limit or the
  budget is reached, the budget left is filled with the best candidates not taken (leaves).
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field
from functools import lru_cache

import torch

from ..layers.attention import TreeRows

# How often the draft exit's r-th most likely token is the full model's (shipped SmolLM2 L2 heads on
# held-out tokens: top-1 31.8%, top-4 52.9%; docs/heads.md), for static shapes; beyond: ~1/r^2.
RANK_PRIOR = (0.318, 0.105, 0.061, 0.045)


@dataclass
class DraftTree:
    """The nodes of one draft tree, in slot order (see the module docstring)."""

    base: int  # slot of node 0; the root is the token at slot base - 1
    tokens: list[int] = field(default_factory=list)
    parents: list[int] = field(default_factory=list)  # -1: the root
    depths: list[int] = field(default_factory=list)  # 1 for the root's children
    scores: list[float] = field(default_factory=list)  # the draft's probability of the path to the node
    _rows: TreeRows | None = field(default=None, repr=False)

    def __len__(self) -> int:
        return len(self.tokens)

    def add(self, token: int, parent: int, score: float) -> int:
        if not -1 <= parent < len(self.tokens):
            raise ValueError(f"parent {parent} is not a node of this tree (0..{len(self.tokens) - 1}, or -1)")
        self.tokens.append(token)
        self.parents.append(parent)
        self.depths.append(1 if parent < 0 else self.depths[parent] + 1)
        self.scores.append(score)
        self._rows = None
        return len(self.tokens) - 1

    def score(self, node: int) -> float:
        return 1.0 if node < 0 else self.scores[node]

    def depth(self, node: int) -> int:
        return 0 if node < 0 else self.depths[node]

    def children(self, node: int) -> list[int]:
        return [i for i, p in enumerate(self.parents) if p == node]

    def slot_of(self, node: int) -> int:
        """The cache slot of ``node`` (-1: the root's)."""
        return self.base + node

    def rows(self) -> TreeRows:
        if self._rows is None:
            n = len(self.tokens)
            visible = torch.zeros(n, n, dtype=torch.bool)
            for i, p in enumerate(self.parents):
                if p >= 0:
                    visible[i] = visible[p]
                visible[i, i] = True
            self._rows = TreeRows(self.base, torch.tensor(self.depths, dtype=torch.long), visible)
        return self._rows


@lru_cache(maxsize=64)
def static_shape(nodes: int, depth: int, width: int) -> tuple[tuple[int, ...], ...]:
    """The ``nodes`` rank paths of highest prior probability (products of :data:`RANK_PRIOR` along
    the path), at most ``depth`` deep and ``width`` ranks wide, parents before children: e.g.
    ``(0,), (1,), (0, 0)`` is the top-2 first level and the top child of the first choice."""
    prior = [RANK_PRIOR[r] if r < len(RANK_PRIOR) else RANK_PRIOR[-1] * (len(RANK_PRIOR) / (r + 1)) ** 2
             for r in range(width)]
    chosen: list[tuple[int, ...]] = []
    frontier = [(-prior[r], (r,)) for r in range(width)]
    heapq.heapify(frontier)
    while frontier and len(chosen) < nodes:
        neg, path = heapq.heappop(frontier)
        chosen.append(path)
        if len(path) < depth:
            for r in range(width):
                heapq.heappush(frontier, (neg * prior[r], path + (r,)))
    return tuple(sorted(chosen, key=lambda p: (len(p), p)))
