"""Tuning a policy to an adapter and a machine: measured pass costs, traces, replay, confirmation."""

from .tune import tune

__all__ = ["tune"]
