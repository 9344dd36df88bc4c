"""Prompts as the engine takes them: rows of token ids, checked against the model.

Accepted: a ``LongTensor``/integer numpy array ``[B, T]`` or ``[T]``, a list of prompts (each a
list, tuple, 1-D tensor or array of token ids), a flat list of token ids (one prompt), or what a
tokenizer returns (a ``BatchEncoding``/dict with ``input_ids``). Anything else (text, floats,
booleans, ids outside the vocabulary, empty prompts, prompts that fill the context) fails with a
:class:`HiSpecError` that names ``input_ids``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from .errors import HiSpecError
from .validation import is_int


def prompt_rows(input_ids: Any, vocab_size: int, max_positions: int) -> list[list[int]]:
    """``input_ids`` as checked rows: at least one prompt, none empty, ids in the vocabulary,
    each leaving room to generate."""
    rows = _rows(input_ids)
    if not rows:
        raise HiSpecError("input_ids holds no prompt")
    for i, row in enumerate(rows):
        if not row:
            raise HiSpecError(f"input_ids: prompt {i} is empty; give at least one token (e.g. BOS)")
        if not all(0 <= t < vocab_size for t in row):
            raise HiSpecError(f"input_ids: prompt {i} holds token ids outside [0, {vocab_size})")
        if len(row) >= max_positions:
            raise HiSpecError(f"input_ids: prompt {i} has {len(row)} tokens; the context holds {max_positions}, "
                              f"leaving no room to generate")
    return rows


def _rows(input_ids: Any) -> list[list[int]]:
    if isinstance(input_ids, Mapping):
        if "input_ids" not in input_ids:
            raise HiSpecError("input_ids is a mapping without 'input_ids'; pass token ids")
        input_ids = input_ids["input_ids"]
    if isinstance(input_ids, (str, bytes)):
        raise HiSpecError("input_ids is text: tokenize it first, e.g. model.tokenizer(text)['input_ids'] or "
                          "model.tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=False)")
    if _is_array(input_ids):
        if input_ids.ndim not in (1, 2):
            raise HiSpecError(f"input_ids must be 1-D or 2-D; got shape {tuple(input_ids.shape)}")
        return [_ids(r, i) for i, r in enumerate(input_ids if input_ids.ndim == 2 else input_ids[None])]
    try:
        items = list(input_ids)
    except TypeError:
        raise HiSpecError(f"input_ids must be token ids (a tensor or lists of ints); got {type(input_ids).__name__}") from None
    if items and all(is_int(t) for t in items):  # a flat list of ids: one prompt
        return [[int(t) for t in items]]
    return [_ids(r, i) for i, r in enumerate(items)]


def _ids(row: Any, i: int) -> list[int]:
    """One prompt's ids (a sequence, 1-D tensor or array, or a tokenizer's mapping)."""
    if isinstance(row, Mapping) and "input_ids" in row:
        row = row["input_ids"]
    if isinstance(row, (str, bytes)):
        raise HiSpecError(f"input_ids: prompt {i} is text; tokenize it first (model.tokenizer(text)['input_ids'])")
    if _is_array(row):
        if row.ndim != 1:
            raise HiSpecError(f"input_ids: prompt {i} must be 1-D; got shape {tuple(row.shape)}")
        row = row.tolist()
    try:
        items = list(row)
    except TypeError:
        raise HiSpecError(f"input_ids: prompt {i} must be a list of token ids; got {type(row).__name__}") from None
    if not all(is_int(t) for t in items):
        bad = next(t for t in items if not is_int(t))
        raise HiSpecError(f"input_ids: prompt {i} holds {bad!r}, which is not a token id (an integer)")
    return [int(t) for t in items]


def _is_array(x: Any) -> bool:
    """A torch tensor or numpy array of integers (floats and booleans are refused)."""
    if isinstance(x, torch.Tensor):
        if x.dtype.is_floating_point or x.dtype.is_complex or x.dtype == torch.bool:
            raise HiSpecError(f"input_ids must hold integer token ids; got a {x.dtype} tensor")
        return True
    if type(x).__module__ == "numpy" and hasattr(x, "dtype") and hasattr(x, "ndim"):
        if x.dtype.kind not in "iu":
            raise HiSpecError(f"input_ids must hold integer token ids; got a numpy array of {x.dtype}")
        return True
    return False


