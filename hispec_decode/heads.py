"""Exit heads: turn the hidden state after layer ``l`` into next-token logits.

Every head ends in the base model's frozen, shared LM head, so an adapter stores only the small
part in front of it. ``base`` (no parameters) is the base model's own final norm + LM head,
used wherever no trained head is given; the others own a trainable copy of the final norm and
optionally a zero-initialised residual map, so an untrained head starts exactly at ``base``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar

import torch
from torch import nn

from .errors import AdapterError

if TYPE_CHECKING:
    from .architectures import DecoderAdapter


class ExitHead(nn.Module):
    head_type: ClassVar[str]
    has_cache: ClassVar[bool] = False  # True: the head attends to past positions (own K/V entries)

    def __init__(self, hidden_size: int, norm_keys: list[str]) -> None:
        super().__init__()
        self.hidden_size = hidden_size
        self.norm = nn.ParameterDict({k: nn.Parameter(torch.ones(hidden_size)) for k in norm_keys})

    def options(self) -> dict[str, Any]:
        """Constructor options beyond hidden size and norm keys (written to the adapter config)."""
        return {}

    def transform(self, h: torch.Tensor) -> torch.Tensor:
        return h

    def project(self, h: torch.Tensor, base: DecoderAdapter) -> torch.Tensor:
        """The head's norm and the shared LM head: transformed [..., hidden] -> logits [..., vocab]."""
        params = dict(self.norm.items()) if len(self.norm) else None
        return base.lm_logits(base.exit_norm(h, params))

    def forward(self, h: torch.Tensor, base: DecoderAdapter) -> torch.Tensor:
        """Hidden states after the exit layer [..., hidden] -> logits [..., vocab]."""
        return self.project(self.transform(h), base)

    @classmethod
    def from_base(cls, base: DecoderAdapter, **options: Any) -> ExitHead:
        """A head initialised to reproduce the base's own exit at any layer."""
        norm = base.norm_params()
        head = cls(base.config.hidden_size, sorted(norm), **options)
        with torch.no_grad():
            for k in head.norm:
                head.norm[k].copy_(norm[k].float())
        return head


class BaseExitHead(ExitHead):
    """The base model's own final norm + LM head (no parameters)."""

    head_type = "base"

    def __init__(self, hidden_size: int, norm_keys: list[str] | None = None) -> None:
        super().__init__(hidden_size, [])

    def project(self, h: torch.Tensor, base: DecoderAdapter) -> torch.Tensor:
        return base.final_logits(h)


class NormHead(ExitHead):
    """A trainable copy of the final norm in front of the shared LM head."""

    head_type = "norm"


class ResidualLinearHead(ExitHead):
    """``h + W h`` (W zero-initialised), then the head's norm and the shared LM head."""

    head_type = "residual_linear"

    def __init__(self, hidden_size: int, norm_keys: list[str]) -> None:
        super().__init__(hidden_size, norm_keys)
        self.proj = nn.Linear(hidden_size, hidden_size, bias=False)
        nn.init.zeros_(self.proj.weight)

    def transform(self, h: torch.Tensor) -> torch.Tensor:
        return h + self.proj(h)


class LowRankHead(ExitHead):
    """``h + B A h`` with rank ``r`` (B zero-initialised), then norm and the shared LM head."""

    head_type = "low_rank"

    def __init__(self, hidden_size: int, norm_keys: list[str], rank: int = 64) -> None:
        super().__init__(hidden_size, norm_keys)
        self.rank = rank
        self.down = nn.Linear(hidden_size, rank, bias=False)
        self.up = nn.Linear(rank, hidden_size, bias=False)
        nn.init.normal_(self.down.weight, std=hidden_size**-0.5)
        nn.init.zeros_(self.up.weight)

    def options(self) -> dict[str, Any]:
        return {"rank": self.rank}

    def transform(self, h: torch.Tensor) -> torch.Tensor:
        return h + self.up(self.down(h))


HEAD_TYPES: dict[str, type[ExitHead]] = {
    cls.head_type: cls for cls in (BaseExitHead, NormHead, ResidualLinearHead, LowRankHead)
}


def head_class(head_type: str) -> type[ExitHead]:
    if head_type not in HEAD_TYPES:
        raise AdapterError(f"unknown head type {head_type!r}; known types: {', '.join(sorted(HEAD_TYPES))}")
    return HEAD_TYPES[head_type]


def build_head(head_type: str, hidden_size: int, norm_keys: list[str], options: dict[str, Any]) -> ExitHead:
    """An uninitialised head of the given type and shape (weights come from a state dict)."""
    try:
        return head_class(head_type)(hidden_size, norm_keys, **options)
    except TypeError as exc:
        raise AdapterError(f"bad options {options} for head type {head_type!r}: {exc}") from exc
