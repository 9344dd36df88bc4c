"""The package version (recorded in every adapter this package writes)."""

__version__ = "0.1.0"
