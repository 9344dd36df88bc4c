"""Reading a JSON array record by record, surviving truncation and broken entries."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ..errors import HiSpecError


def read_json_records(path: str | Path) -> tuple[list[dict[str, Any]], int]:
    """Records of a JSON array that may be truncated or hold broken entries.

    Returns ``(records, skipped)``: what decodes, and how many entries did not (a truncated tail
    counts as one).
    """
    text = Path(path).read_text(encoding="utf-8")
    start = text.find("[")
    if start < 0:
        raise HiSpecError(f"{path} does not hold a JSON array")
    decoder, i, n = json.JSONDecoder(), start + 1, len(text)
    records: list[dict[str, Any]] = []
    skipped = 0
    while i < n:
        while i < n and text[i] in " \t\r\n,":
            i += 1
        if i >= n or text[i] == "]":
            break
        try:
            obj, i = decoder.raw_decode(text, i)
        except json.JSONDecodeError:
            nxt = text.find('\n  {', i + 1)  # resynchronise at the next top-level record, if any
            skipped += 1
            if nxt < 0:
                break
            i = nxt
            continue
        if isinstance(obj, dict):
            records.append(obj)
        else:
            skipped += 1
    return records, skipped
