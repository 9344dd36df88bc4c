"""``Level``: one level of a speculation hierarchy, as a value.

A policy's levels, lowest first (:meth:`~hispec_decode.decoding.policy.PolicyRules.levels`), each end a
band of layers and judge there with one head:

* an *exit* ``L_k``: an early exit at layer ``k`` (its trained head, or the base's norm and LM head);
* the *vocabulary level* ``L_v``: every layer, then the LM head over the base's ``vocab`` most frequent
  tokens (and the sequence's own tokens), below the full model;
* the *full model* ``L_f``: every layer and the whole LM head, the top level.

``layer`` is where the level's band ends (the number of layers for ``L_v`` and ``L_f``); ``key`` is where
cost tables and tuning traces keep the level's head (:class:`~hispec_decode.decoding.cost_model.CostModel`,
:class:`~hispec_decode.tuning.simulate.Trace`): an exit's layer, ``L_f``'s layer (the number of layers),
and ``-vocab`` for ``L_v``, so the two levels at the last layer never share a row.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, kw_only=True)
class Level:
    layer: int  # the band's top layer
    vocab: int = 0  # the vocabulary level: this many tokens (0: an exit or the full model)
    full: bool = False  # the full model, the top level

    @property
    def kind(self) -> str:
        return "full" if self.full else "vocab" if self.vocab else "exit"

    @property
    def key(self) -> int:
        """Where cost tables and traces keep this level's head."""
        return vocab_key(self.vocab) if self.vocab else self.layer

    def __str__(self) -> str:
        return "L_f" if self.full else f"L_v({self.vocab})" if self.vocab else f"L{self.layer}"


def vocab_key(size: int) -> int:
    """The table key of the vocabulary level of ``size`` tokens (the only place a key is negative)."""
    return -size


def vocab_of(key: int) -> int:
    """The vocabulary level's size a table key names (0: an exit or the full model)."""
    return -int(key) if int(key) < 0 else 0


def levels_of(tops: tuple[int, ...], num_layers: int, vocab: int) -> tuple[Level, ...]:
    """The levels of band tops ``tops`` (increasing, the last the full model): a top at the last layer below
    the full model is the vocabulary level of ``vocab`` tokens."""
    return tuple(Level(layer=top, full=True) if i == len(tops) - 1
                 else Level(layer=top, vocab=vocab if top >= num_layers else 0) for i, top in enumerate(tops))
