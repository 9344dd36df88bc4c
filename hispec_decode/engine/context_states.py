"""``ContextStates``: the per-sequence state of ``deep_context`` exit heads, in one place.

Such a head reads, beside its own layer's hidden state, the deep state at the previous position:
the full model's normed final state where the full model ran there, else the output this head
(or a deeper one) computed there. The runner writes both kinds (:meth:`keep_final`,
:meth:`keep_own`), the head's transform reads :meth:`context_at`, and the sequence keeps them in
step with its tokens (:meth:`truncate` on rejection, :meth:`forget_before` on commit,
:meth:`clear` when its blocks are freed).
"""

from __future__ import annotations

import torch


class ContextStates:
    def __init__(self) -> None:
        self.final: dict[int, torch.Tensor] = {}  # position -> the full model's normed final state [C]
        self.own: dict[int, dict[int, torch.Tensor]] = {}  # head layer -> position -> its normed output [C]

    def keep_final(self, position: int, state: torch.Tensor) -> None:
        self.final[position] = state

    def keep_own(self, layer: int, position: int, state: torch.Tensor) -> None:
        self.own.setdefault(layer, {})[position] = state

    def context_at(self, layer: int, position: int) -> torch.Tensor | None:
        """The deepest known state at ``position`` for the head at ``layer``: the full model's if it
        ran there, else that head's own output, else a deeper head's (when the intermediate exit
        accepted every draft, the draft head never ran at the last one), else any head's, else None."""
        state = self.final.get(position)
        if state is None:
            state = self.own.get(layer, {}).get(position)
        for other in sorted(self.own, key=lambda l: (l < layer, -l)):  # deeper heads first
            if state is None:
                state = self.own[other].get(position)
        return state

    def truncate(self, length: int) -> None:
        """Forget every state at position >= ``length`` (rejected tokens)."""
        self._drop(lambda p: p >= length)

    def forget_before(self, position: int) -> None:
        """Forget every state before ``position`` (nothing reads it again after a commit)."""
        self._drop(lambda p: p < position)

    def move(self, start: int, kept: list[int]) -> None:
        """An accepted tree path: the states at slots ``kept`` (increasing, all >= ``start``) move to
        ``start, start + 1, ...``; every other state from ``start`` on is forgotten."""
        target = {src: start + i for i, src in enumerate(kept)}
        for states in (self.final, *self.own.values()):
            moved = {target[p]: states.pop(p) for p in [p for p in states if p in target]}
            for p in [p for p in states if p >= start]:
                del states[p]
            states.update(moved)

    def clear(self) -> None:
        self.final, self.own = {}, {}

    def _drop(self, gone) -> None:
        for states in (self.final, *self.own.values()):
            for p in [p for p in states if gone(p)]:
                del states[p]
