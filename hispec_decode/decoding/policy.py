"""The decoding policy of a run: which exits draft and check, how much is drafted and verified.

:func:`resolve_policy` fills what a :class:`~hispec_decode.config.GenerationConfig` leaves open:
the adapter's roles first (its ``draft`` and ``intermediate`` exits), else fractions of the
depth; then it checks the layers against the model. See docs/defaults.md for the measurements
behind the defaults.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..errors import HiSpecError

if TYPE_CHECKING:
    from ..config import GenerationConfig

# Layers scale with depth: the draft exit at ~1/8, the intermediate exit at ~1/4 of the layers.
DEFAULT_DRAFT_FRACTION = 1 / 8
DEFAULT_VERIFY_FRACTION = 1 / 4
# Best configurations of `hispec-bench --sweep` with the default heads (docs/sweep-bfloat16.md):
# with ~31% agreement per token, short drafts and windows waste least.
DEFAULT_WINDOW = 2  # N_i
DEFAULT_NUM_DRAFT = 1  # k (self_spec) and k_d (hispec)


@dataclass(frozen=True)
class Policy:
    """Exit layers and window sizes of one run, checked against the model by :func:`resolve_policy`."""

    draft_layer: int  # L_d
    verify_layer: int  # L_i (the intermediate exit)
    window: int  # N_i: tentative tokens that trigger a full verification
    num_draft: int  # k (self_spec) or k_d (hispec): drafts per check


def resolve_policy(config: GenerationConfig, num_layers: int, roles: dict[str, int | None] | None = None) -> Policy:
    """Fill in what ``config`` leaves open (``roles``: the adapter's ``draft``/``intermediate``
    layers, else fractions of the depth) and check the layers against the model."""
    roles = roles or {}
    n, method = num_layers, config.method
    draft_layer, verify_layer, window, num_draft = config.draft_layer, config.verify_layer, config.window, config.num_draft
    if draft_layer is None:
        draft_layer = roles.get("draft") or max(1, round(n * DEFAULT_DRAFT_FRACTION))
    if verify_layer is None:
        verify_layer = roles.get("intermediate") or max(draft_layer + 1, round(n * DEFAULT_VERIFY_FRACTION))
    window = DEFAULT_WINDOW if window is None else window
    num_draft = DEFAULT_NUM_DRAFT if num_draft is None else num_draft
    if method == "hispec" and not 1 <= draft_layer < verify_layer < n:
        raise HiSpecError(
            f"hispec needs 1 <= draft_layer < verify_layer < {n} (the full model); got draft_layer="
            f"{draft_layer}, verify_layer={verify_layer}"
        )
    if method == "self_spec" and not 1 <= draft_layer < n:
        raise HiSpecError(f"self_spec needs 1 <= draft_layer < {n}; got {draft_layer}")
    return Policy(draft_layer, verify_layer, window, num_draft)
