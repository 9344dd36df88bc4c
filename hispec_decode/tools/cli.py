"""How every HiSpec command reports mistakes: exit status 2 and one line ``prog: error: ...``.

User mistakes (a :class:`HiSpecError`, a file that cannot be read or written, a malformed value)
never show a traceback unless ``--debug`` is given; unexpected internal errors still do. Ctrl-C
exits with status 130 and one line; SIGTERM as Ctrl-C does (its ``finally`` blocks run), with status
143. What a long command wrote before is kept (every write is atomic): ``--resume`` goes on from it.
"""

from __future__ import annotations

import argparse
import signal
import sys
from typing import Callable

from ..errors import HiSpecError
from ..extras import require

USER_ERRORS = (HiSpecError, OSError, UnicodeError)  # UnicodeError: a binary file given as text


def add_debug_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--debug", action="store_true", help="show the full traceback of errors")


def run_cli(prog: str, run: Callable[[], int], debug: bool = False, extra: str | None = None) -> int:
    """Run a command's body, turning user mistakes into ``prog: error: ...`` and exit status 2;
    ``extra``: the package extra the command needs (a missing one is such a mistake)."""
    previous = signal.signal(signal.SIGTERM, _terminate) if _on_main_thread() else None
    try:
        if extra is not None:
            require(extra, prog)
        return run()
    except USER_ERRORS as exc:
        if debug:
            raise
        message = str(exc) if isinstance(exc, HiSpecError) else f"{type(exc).__name__}: {exc}"
        print(f"{prog}: error: {' '.join(message.split())}", file=sys.stderr)  # one line
        return 2
    except Terminated:
        print(f"{prog}: terminated (SIGTERM)", file=sys.stderr)
        return 128 + signal.SIGTERM
    except KeyboardInterrupt:
        print(f"{prog}: interrupted", file=sys.stderr)
        return 130
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised where the command was, so that it ends as Ctrl-C ends it."""


def _terminate(signum: int, frame: object) -> None:
    raise Terminated()


def _on_main_thread() -> bool:
    import threading

    return threading.current_thread() is threading.main_thread()


def positive_int(text: str) -> int:
    return _int_at_least(text, 1)


def non_negative_int(text: str) -> int:
    return _int_at_least(text, 0)


def port(text: str) -> int:
    """A TCP port: 0 (any free one) to 65535."""
    value = _int_at_least(text, 0)
    if value > 65535:
        raise argparse.ArgumentTypeError(f"{value} is not a port (0 to 65535)")
    return value


def non_negative_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not 0 <= value < float("inf"):
        raise argparse.ArgumentTypeError(f"{text!r} must be a finite number >= 0")
    return value


def positive_int_list(text: str) -> list[int]:
    """``1,2,4``: a comma-separated list of integers >= 1."""
    return [positive_int(t) for t in text.split(",")]


def _int_at_least(text: str, minimum: int) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < minimum:
        raise argparse.ArgumentTypeError(f"{value} is below {minimum}")
    return value
