"""Optional parts of the package and the error that names the one missing.

``pip install hispec`` decodes (Python API, ``hispec-generate``, ``hispec-bench``); the rest comes
with extras, each declared here by the modules it provides (pyproject.toml lists their pins)."""

from __future__ import annotations

import importlib.util

from .errors import HiSpecError

EXTRAS: dict[str, tuple[str, ...]] = {
    "serve": ("fastapi", "uvicorn", "prometheus_client"),  # hispec-serve, hispec_decode.serving
    "train": ("datasets", "tensorboard", "matplotlib"),  # the training package and its tools
    "plot": ("matplotlib",),  # the benchmarks' --plot
}


class MissingExtraError(HiSpecError):
    """A feature needs an extra that is not installed."""


def missing(extra: str) -> list[str]:
    """The modules of ``extra`` that cannot be imported here."""
    return [name for name in EXTRAS[extra] if _absent(name)]


def require(extra: str, what: str) -> None:
    """Fail with one line naming the extra if ``what`` (a tool, an option) cannot run without it."""
    absent = missing(extra)
    if absent:
        raise MissingExtraError(f"{what} needs the {extra!r} extra ({', '.join(absent)} not installed): "
                                f"pip install 'hispec[{extra}]'")


def _absent(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is None
    except (ImportError, ValueError):  # a broken install, or a module blocked with sys.modules[name] = None
        return True


def pyplot(what: str):
    """``matplotlib.pyplot`` on the file-only Agg backend, for ``what`` (e.g. "hispec-bench --plot")."""
    require("plot", what)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt
