"""The registry of exit-head types: name -> class, and building a head from an adapter's config."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ..errors import AdapterError
from .exit_heads import (BaseExitHead, DecoderBlockHead, DeepContextHead, ExitHead, LowRankHead, NormHead,
                         ResidualLinearHead)
from .feature_head import FeatureAttentionHead

if TYPE_CHECKING:
    from .base import DecoderModel

HEAD_TYPES: dict[str, type[ExitHead]] = {
    cls.head_type: cls for cls in (BaseExitHead, NormHead, ResidualLinearHead, LowRankHead, DeepContextHead,
                                   DecoderBlockHead, FeatureAttentionHead)
}


def head_class(head_type: str) -> type[ExitHead]:
    if head_type not in HEAD_TYPES:
        raise AdapterError(f"unknown head type {head_type!r}; known types: {', '.join(sorted(HEAD_TYPES))}")
    return HEAD_TYPES[head_type]


def build_head(head_type: str, hidden_size: int, norm_keys: list[str], options: dict[str, Any],
               decoder: DecoderModel | None = None) -> ExitHead:
    """An uninitialised head of the given type and shape (weights come from a state dict)."""
    cls = head_class(head_type)
    try:
        return cls(hidden_size, norm_keys, **options, **({"decoder": decoder} if cls.has_cache else {}))
    except (TypeError, ValueError, RuntimeError) as exc:  # unknown names, or values torch refuses (rank -1)
        raise AdapterError(f"bad options {options} for head type {head_type!r}: {exc}") from exc
