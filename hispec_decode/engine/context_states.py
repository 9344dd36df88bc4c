"""``ContextStates``: the per-sequence state of exit heads that read deep states, in one place.

Such a head (``deep_context``, ``feature_attention``) reads, beside its own layer's hidden state, the
deep state at the previous position: the full model's normed final state where the full model ran
there, else the output this head (or a deeper one) computed there. The runner writes both kinds
(:meth:`keep_final`, :meth:`keep_own`), the head's transform reads :meth:`context_at`, and the
sequence keeps them in step with its tokens (:meth:`truncate` on rejection, :meth:`forget_before` on
commit, :meth:`move` for an accepted tree path, :meth:`clear` when its blocks are freed).

A ``feature_attention`` head computes its rows lazily and recomputes those whose previous position
has since been verified (:mod:`hispec_decode.models.feature_head`), so for its layer this also keeps
the exit's hidden states of rows not yet computed from true final states (:meth:`keep_hidden`), how
many leading rows hold valid K/V (``done``) and how many of those read true final states (``exact``).
"""

from __future__ import annotations

import torch


class ContextStates:
    def __init__(self) -> None:
        self.final: dict[int, torch.Tensor] = {}  # position -> the full model's normed final state [C]
        self.own: dict[int, dict[int, torch.Tensor]] = {}  # head layer -> position -> its normed output [C]
        self.hidden: dict[int, dict[int, torch.Tensor]] = {}  # feature head layer -> position -> exit state [H]
        self.done: dict[int, int] = {}  # feature head layer -> leading slots whose head K/V are valid
        self.exact: dict[int, int] = {}  # ... of which computed from true final states (or at position 0)

    def keep_final(self, position: int, state: torch.Tensor) -> None:
        self.final[position] = state

    def keep_own(self, layer: int, position: int, state: torch.Tensor) -> None:
        self.own.setdefault(layer, {})[position] = state

    def keep_hidden(self, layer: int, position: int, state: torch.Tensor) -> None:
        self.hidden.setdefault(layer, {})[position] = state
        self.done.setdefault(layer, 0)
        self.exact.setdefault(layer, 0)

    def keep_from(self, position: int) -> int:
        """The first position whose states must still be kept, ``position`` unless a feature head
        still has rows to recompute from true final states."""
        return min([position, *(e - 1 for e in self.exact.values())])

    def feature_start(self, layer: int) -> int:
        """The first row a feature head computes next: the first one not computed from a true final
        state, if that state is known by now (recomputed), else the first one never computed."""
        done, exact = self.done.get(layer, 0), self.exact.get(layer, 0)
        if exact < done and (exact == 0 or exact - 1 in self.final):
            return exact
        return done

    def computed(self, layer: int, position: int, exact: bool) -> None:
        """A feature head computed the row at ``position`` (in increasing order), from a true final
        state or not."""
        if exact and self.exact.get(layer, 0) == position:
            self.exact[layer] = position + 1
        elif self.exact.get(layer, 0) > position:
            self.exact[layer] = position
        self.done[layer] = position + 1

    def context_at(self, layer: int, position: int, deeper_first: bool = False) -> torch.Tensor | None:
        """The deepest known state at ``position`` for the head at ``layer``: the full model's if it
        ran there, else that head's own output, else a deeper head's (when the intermediate exit
        accepted every draft, the draft head never ran at the last one), else any head's, else None.
        ``deeper_first``: a deeper head's output before this head's own (feature heads)."""
        state = self.final.get(position)
        if state is None and not deeper_first:
            state = self.own.get(layer, {}).get(position)
        for other in sorted(self.own, key=lambda l: (l < layer, -l)):  # deeper heads first
            if state is None:
                state = self.own[other].get(position)
        return state

    def truncate(self, length: int) -> None:
        """Forget every state at position >= ``length`` (rejected tokens)."""
        self._drop(lambda p: p >= length)
        self._limit(length)

    def forget_before(self, position: int) -> None:
        """Forget every state before ``position`` (nothing reads it again after a commit), but what a
        feature head still recomputes from (:meth:`keep_from`)."""
        first = self.keep_from(position)
        self._drop(lambda p: p < first)

    def move(self, start: int, kept: list[int]) -> None:
        """An accepted tree path: the states at slots ``kept`` (increasing, all >= ``start``) move to
        ``start, start + 1, ...``; every other state from ``start`` on is forgotten."""
        target = {src: start + i for i, src in enumerate(kept)}
        for states in self._all():
            moved = {target[p]: states.pop(p) for p in [p for p in states if p in target]}
            for p in [p for p in states if p >= start]:
                del states[p]
            states.update(moved)
        self._limit(start)  # a feature head recomputes the path's rows (their K/V moved with the path)

    def clear(self) -> None:
        self.final, self.own, self.hidden, self.done, self.exact = {}, {}, {}, {}, {}

    def _all(self) -> list[dict[int, torch.Tensor]]:
        return [self.final, *self.own.values(), *self.hidden.values()]

    def _limit(self, length: int) -> None:
        for counts in (self.done, self.exact):
            for layer in counts:
                counts[layer] = min(counts[layer], length)

    def _drop(self, gone) -> None:
        for states in self._all():
            for p in [p for p in states if gone(p)]:
                del states[p]
