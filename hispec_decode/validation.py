"""The checks the settings dataclasses and the prompt reader share: a bad value fails with a
message naming the field."""

from __future__ import annotations

import numbers
from typing import Any

from .errors import HiSpecError


def help_text(text: str, choices: tuple[str, ...] = ()) -> dict[str, object]:
    """A field's metadata: its help text (and allowed values), from which the command-line tools build
    their options."""
    return {"help": text, "choices": choices or None}


def is_real(value: object) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def is_int(value: object) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def as_int(obj: Any, *names: str) -> None:
    """Turn the named fields of a frozen dataclass from numpy integers into ints (booleans stay)."""
    for name in names:
        value = getattr(obj, name)
        if isinstance(value, numbers.Integral) and not isinstance(value, (bool, int)):
            object.__setattr__(obj, name, int(value))


def check_int(name: str, value: object, minimum: int | None, optional: bool = False) -> None:
    if value is None and optional:
        return
    if not is_int(value) or (minimum is not None and value < minimum):
        allowed = "an integer" + (f" >= {minimum}" if minimum is not None else "") + (" or None" if optional else "")
        raise HiSpecError(f"{name} must be {allowed}; got {value!r}")


def check_bool(obj: Any, *names: str) -> None:
    for name in names:
        if not isinstance(getattr(obj, name), bool):
            raise HiSpecError(f"{name} must be True or False; got {getattr(obj, name)!r}")
