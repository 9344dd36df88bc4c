"""The drafter interface (one round's drafting from the registered drafters is in :mod:`.compose`).

Glossary:

* *draft*: tokens a drafter appended after the sequence's last committed-or-tentative token, for
  the exit above to check in one pass: a chain (``seq.tokens[first:]``) or a tree (``seq.tree``, its
  nodes ``seq.tokens[tree.base:]`` in slot order);
* *probs*: the drafter's distribution of each chain token, [count, vocab] (sampling with an exit
  drafter); None for point masses (prompt lookup) and under greedy decoding: the verifier then
  accepts a token with the target's probability of it (the point-mass rule), which is exact;
* a tree is verified by the point-mass rule node by node (:meth:`TokenSampler.verify_tree`).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, ClassVar, Generator, Iterable

import torch

from ...decoding.tree import DraftTree
from ..sequence import BandRequest, Sequence

_REGISTRY: list[Drafter] = []


@dataclass
class Draft:
    """One drafter's proposal for a round: ``count`` chain tokens appended to ``seq.tokens`` (``tree``
    None) or the nodes of ``tree`` (also ``seq.tree``); ``probs`` [count, vocab] or None (see the module
    docstring); ``nodes``: a union's tree nodes per drafter that proposed them."""

    drafter: Drafter | None
    count: int
    probs: torch.Tensor | None = None
    tree: DraftTree | None = None
    nodes: dict[Drafter, set[int]] | None = None

    def feedback(self, seq: Sequence, accepted: list[int]) -> None:
        """Tell each drafter what the check accepted of its proposal (``accepted``: the chain's accepted
        indices, or the tree's accepted path)."""
        if self.nodes is None:
            if self.drafter is not None:
                self.drafter.feedback(seq, self, len(accepted))
            return
        for drafter, mine in self.nodes.items():
            drafter.feedback(seq, self, sum(node in mine for node in accepted))


DraftLoop = Generator[BandRequest, torch.Tensor, "Draft | None"]


class Drafter(ABC):
    """A proposer of drafts. Subclasses register themselves, tried in increasing ``order``."""

    name: ClassVar[str]
    order: ClassVar[int]
    point_mass: ClassVar[bool] = False  # proposes without passes of its own (a union adds it to a tree)
    off: ClassVar[dict[str, Any]]  # the policy knobs' values without this drafter (a round chooser's arms)
    on: ClassVar[dict[str, Any]] = {}  # ... and values that turn it on where the policy leaves it off

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if not getattr(cls, "__abstractmethods__", None):
            _REGISTRY.append(cls())
            _REGISTRY.sort(key=lambda d: d.order)

    @abstractmethod
    def active(self, seq: Sequence) -> bool:
        """Whether it drafts for ``seq`` this round (its policy's knob, the batch size)."""

    def can_propose(self, seq: Sequence) -> bool:
        """Whether it has something to propose for ``seq`` now, known without a pass (a point-mass drafter's
        match; a drafter with passes of its own may always propose)."""
        return True

    @abstractmethod
    def propose(self, seq: Sequence, threshold: float) -> DraftLoop:
        """Append a draft to ``seq`` (may yield band-0 requests); None when it has nothing to propose
        (then nothing was appended). ``threshold``: the draft exit's gate this round."""

    def tokens(self, seq: Sequence, context: list[int], count: int) -> list[int]:
        """A point-mass drafter's proposal of at most ``count`` tokens after ``context``, not appended (a
        union adds them to a tree)."""
        raise NotImplementedError(f"{self.name} drafts with passes of its own")

    def feedback(self, seq: Sequence, draft: Draft, accepted: int) -> None:
        """The check accepted ``accepted`` of the tokens this drafter proposed."""

    def new_state(self) -> Any:
        """A new sequence's state of this drafter (None: it keeps none)."""
        return None

    def state(self, seq: Sequence) -> Any:
        """This drafter's state for ``seq``: made by :meth:`new_state` when first asked, kept on the sequence
        (``seq.drafter_state``, by name) and gone with it."""
        if self.name not in seq.drafter_state:
            seq.drafter_state[self.name] = self.new_state()
        return seq.drafter_state[self.name]


def registered() -> tuple[Drafter, ...]:
    """Every drafter, in the order they are tried."""
    return tuple(_REGISTRY)


def without(drafters: Iterable[Drafter]) -> dict[str, Any]:
    """The knob values that turn ``drafters`` off (to ``dataclasses.replace`` a policy with)."""
    return {k: v for d in drafters for k, v in d.off.items()}


def turned_on(policy: Any, drafters: Iterable[Drafter]) -> dict[str, Any]:
    """The knob values that turn ``drafters`` on where ``policy`` leaves them off."""
    return {k: v for d in drafters if all(getattr(policy, k) == v for k, v in d.off.items()) for k, v in d.on.items()}
