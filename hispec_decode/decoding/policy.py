"""The decoding policy of a run: which exits draft and check, and when to draft and verify.

A policy is confidence-adaptive (docs/policy.md):

* the draft exit ``L_d`` drafts while the top probability of its next distribution is at least
  ``draft_threshold``, up to ``num_draft`` tokens (a round may draft nothing: the sequence then
  goes straight up from ``L_d``'s hidden state);
* ``L_i`` adds tentative tokens while the product of its probabilities of the tentative tokens
  stays at least ``verify_threshold``, up to ``window``; then ``L_f`` verifies them (its bonus token
  is gated before it joins; a replacement of a rejected draft always joins, since gating only
  replacements would bias what the accepted ones leave at that position);
* a round's drafts are a chain (``tree="chain"``: ``num_draft`` tokens at most) or a token tree
  (``"static"`` or ``"dynamic"``, docs/trees.md): ``tree_nodes`` nodes at most, ``num_draft``
  levels deep, ``tree_width`` children per node; ``L_i`` prunes it to one path (or ``L_f`` verifies
  it whole when the middle level is off); in a batch a node needs a path probability of at least
  the batch's break-even acceptance;
* batch-aware: ``batch_thresholds`` maps a batch size to the acceptance a speculated token needs
  to pay for the extra rows it adds to a pass at that size (measured by ``hispec-tune``); the
  effective thresholds are never below it, and above 1 the sequence does not speculate at all.

Every decision uses proposal-side quantities only, so greedy output equals the base model's and
sampled output is an exact sample of it, whatever the thresholds.

:func:`resolve_policy` fills what a :class:`~hispec_decode.config.SpeculativeConfig` leaves open:
explicit arguments first, then the adapter's tuned policy for the model's dtype, then the
adapter's roles (``draft`` / ``intermediate`` exits), then fractions of the depth.
"""

from __future__ import annotations

import bisect
import dataclasses
from typing import TYPE_CHECKING, Any

from ..errors import HiSpecError
from ..knobs import KNOB, KNOBS, TUNABLE, check_knobs
from .level import Level, levels_of

if TYPE_CHECKING:
    from ..config import SpeculativeConfig

# Layers scale with depth: the draft exit at ~1/8, the intermediate exit at ~1/4 of the layers.
DEFAULT_DRAFT_FRACTION = 1 / 8
DEFAULT_VERIFY_FRACTION = 1 / 4


class PolicyRules:
    """What a policy decides, from its knobs (:data:`~hispec_decode.knobs.KNOBS`, the fields of
    :class:`Policy`) and its batch thresholds."""

    def knobs(self) -> dict[str, Any]:
        """The knobs' values (what a tuned policy stores, without its batch thresholds)."""
        return {k: getattr(self, k) for k in TUNABLE}

    def exits(self, method: str, num_layers: int) -> tuple[int, ...]:
        """The band tops of ``method`` under this policy, one per level, increasing; the last is the full
        model ``L_f``. A level at ``num_layers`` below the last is the vocabulary level ``L_v`` (every
        layer, then the LM head over ``vocab`` tokens); ``L_f`` above it runs no layer, only the full head.

        * autoregressive: ``(L_f,)``
        * self_spec: ``(L_d, L_f)`` (``L_d = L_v`` when ``draft_layer`` is the last layer)
        * hispec: ``(L_d, [L_i,] [L_v,] L_f)``: ``L_i`` unless ``verify_layer`` is the last layer, ``L_v``
          when ``vocab`` is on and it does not draft itself."""
        n = num_layers
        if method == "autoregressive":
            return (n,)
        if method == "self_spec":
            return (self.draft_layer, n)
        levels = [self.draft_layer]
        if self.verify_layer < n:
            levels.append(self.verify_layer)
        if self.vocab and self.draft_layer < n:
            levels.append(n)
        return (*levels, n)

    def levels(self, method: str, num_layers: int) -> tuple[Level, ...]:
        """The levels of ``method`` under this policy, lowest first (their band tops are :meth:`exits`)."""
        return levels_of(self.exits(method, num_layers), num_layers, self.vocab)

    def window_at(self, level: Level) -> int:
        """Tentative tokens an intermediate ``level`` gathers for the level above, at most."""
        return self.vocab_window if level.vocab else self.window

    def at_batch(self, batch_size: int) -> tuple[float, float]:
        """Effective ``(draft_threshold, verify_threshold)`` in a batch of ``batch_size`` sequences
        (above 1: do not speculate)."""
        floor = self.floor(batch_size)
        return max(self.draft_threshold, floor), max(self.verify_threshold, floor)

    def floor(self, batch_size: int) -> float:
        """The acceptance a speculated token needs to pay for its rows in a batch of this size."""
        if not self.batch_thresholds:
            return 0.0
        sizes = [b for b, _ in self.batch_thresholds]
        i = bisect.bisect_right(sizes, batch_size) - 1
        return self.batch_thresholds[max(i, 0)][1]

# The policy of a run: one field per knob, then the batch thresholds ((batch size, break-even acceptance),
# increasing sizes); built by keyword only, so a new knob shifts no call.
Policy = dataclasses.make_dataclass(
    "Policy",
    [(k.name, k.kind) if k.default is None else (k.name, k.kind, dataclasses.field(default=k.default)) for k in KNOBS]
    + [("batch_thresholds", tuple, dataclasses.field(default=()))],
    bases=(PolicyRules,), frozen=True, kw_only=True)
Policy.__module__ = __name__
Policy.__doc__ = "Exits, maxima and confidence thresholds of one run, checked against the model:\n\n" + "\n".join(
    f"* ``{k.name}``: {k.help}" for k in KNOBS)


def resolve_policy(config: SpeculativeConfig, num_layers: int, roles: dict[str, int | None] | None = None,
                   tuned: dict[str, Any] | None = None) -> Policy:
    """Fill in what ``config`` leaves open (``tuned``: the adapter's tuned policy for this dtype;
    ``roles``: its ``draft``/``intermediate`` layers) and check the layers against the model."""
    roles, tuned = roles or {}, _checked_tuned(tuned or {})
    n, method = num_layers, config.method
    value = {k: getattr(config, k) if getattr(config, k) is not None else tuned.get(k) for k in TUNABLE}
    value = {k: KNOB[k].default if v is None else v for k, v in value.items()}
    draft_layer = _first(value["draft_layer"], roles.get("draft"), max(1, round(n * DEFAULT_DRAFT_FRACTION)))
    verify_layer = _first(value["verify_layer"], roles.get("intermediate"),
                          max(draft_layer + 1, round(n * DEFAULT_VERIFY_FRACTION)))
    vocab = value["vocab"]
    if draft_layer == n and vocab and method != "autoregressive":  # L_v drafts: no exit between it and L_f
        verify_layer = n
    if method == "hispec" and not (1 <= draft_layer < verify_layer <= n or draft_layer == verify_layer == n and vocab):
        raise HiSpecError(
            f"hispec needs 1 <= draft_layer < verify_layer < {n} (the full model; or verify_layer = {n}: no "
            f"intermediate layer; or draft_layer = {n} with vocab > 0: the vocabulary level drafts); got "
            f"draft_layer={draft_layer}, verify_layer={verify_layer}"
        )
    if method == "self_spec" and not (1 <= draft_layer < n or draft_layer == n and vocab):
        raise HiSpecError(f"self_spec needs 1 <= draft_layer < {n} (or draft_layer = {n} with vocab > 0: the "
                          f"vocabulary level drafts); got {draft_layer}")
    batch = tuple((int(b), float(t)) for b, t in sorted(tuned.get("batch_thresholds", {}).items(), key=lambda kv: int(kv[0])))
    return Policy(**check_knobs(value | {"draft_layer": draft_layer, "verify_layer": verify_layer}),
                  batch_thresholds=batch if config.batch_aware else ())


def _checked_tuned(tuned: dict[str, Any]) -> dict[str, Any]:
    """An adapter's tuned policy, checked like explicit arguments (it comes from a JSON file)."""
    if not isinstance(tuned, dict):
        raise HiSpecError(f"the adapter's tuned policy must be a JSON object; got {type(tuned).__name__}")
    try:
        check_knobs(tuned)  # the checks explicit arguments get
        batch = tuned.get("batch_thresholds", {})
        if not isinstance(batch, dict) or not all(
                str(b).isdigit() and isinstance(t, (int, float)) and 0 <= t < float("inf") for b, t in batch.items()):
            raise HiSpecError(f"batch_thresholds must map batch sizes to numbers >= 0; got {batch!r:.80}")
    except HiSpecError as exc:
        raise HiSpecError(f"the adapter's tuned policy ({CONFIG_NAME_HINT}) is invalid: {exc}") from None
    return tuned


CONFIG_NAME_HINT = "policy in hispec_config.json; re-run hispec-tune"


def _first(*values: Any) -> Any:
    """The first value that is not None."""
    return next(v for v in values if v is not None)
