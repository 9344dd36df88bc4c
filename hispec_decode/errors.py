"""Errors raised for bad input. All subclass ``ValueError`` so callers can catch one type."""

from __future__ import annotations


class HiSpecError(ValueError):
    """Base class of every error HiSpec raises for bad input."""


class UnsupportedArchitectureError(HiSpecError):
    """The base model's architecture cannot be decoded by this engine."""


class AdapterError(HiSpecError):
    """An adapter directory is missing, corrupted or does not fit the base model."""


class FingerprintMismatchError(AdapterError):
    """Heads were trained for a different base model."""


class OutOfBlocksError(HiSpecError):
    """The paged KV cache has fewer free blocks than an operation needs (nothing was changed)."""
