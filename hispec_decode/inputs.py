"""Prompts as the engine takes them: rows of token ids, checked against the model."""

from __future__ import annotations

from typing import Any

import torch

from .errors import HiSpecError


def prompt_rows(input_ids: torch.Tensor | Any, vocab_size: int, max_positions: int) -> list[list[int]]:
    """``input_ids`` (a LongTensor ``[B, T]`` or ``[T]``, or lists of ids of any lengths) as checked
    rows: at least one prompt, none empty, ids in the vocabulary, each leaving room to generate."""
    if isinstance(input_ids, torch.Tensor):
        if input_ids.dim() == 1:
            input_ids = input_ids[None]
        if input_ids.dim() != 2 or input_ids.dtype.is_floating_point:
            raise HiSpecError(f"input_ids must be a LongTensor [batch, length]; got {tuple(input_ids.shape)} {input_ids.dtype}")
        rows = input_ids.tolist()
    else:
        rows = [list(r) for r in input_ids]
    if not rows:
        raise HiSpecError("input_ids holds no prompt")
    for i, row in enumerate(rows):
        if not row:
            raise HiSpecError(f"prompt {i} is empty; give at least one token (e.g. BOS)")
        if not all(isinstance(t, int) and 0 <= t < vocab_size for t in row):
            raise HiSpecError(f"prompt {i} holds token ids outside [0, {vocab_size})")
        if len(row) >= max_positions:
            raise HiSpecError(f"prompt {i} has {len(row)} tokens; the context holds {max_positions}, leaving no room to generate")
    return rows
