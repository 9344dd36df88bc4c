"""Writing files so that a crash at any moment loses nothing: temporaries, atomic renames, clean-up.

Everything HiSpec writes (adapters, exports, training checkpoints, the model cache, benchmark
results) goes through two primitives:

* :func:`atomic_file`: write ``path`` through a temporary sibling, then ``os.replace`` it in;
* :func:`atomic_directory`: build a directory in a temporary sibling, then swap it in; an
  existing target is exchanged atomically (Linux ``renameat2(RENAME_EXCHANGE)``), elsewhere
  moved aside first and restored by the next writer if a crash fell in between.

Temporaries are named ``.<target>.hispec-<kind>-<host>-<pid>-<random>`` beside their target, so
the next writer on the same machine recognises what a killed process left (its pid is gone) and
removes it, or restores it (``old``: the previous version of a target that is missing); it never
touches anything else, nor what a process on another machine (a shared file system) is writing.

Atomic against a crash of the process (``kill -9``, an exception); files are not fsynced, so
after a power loss only what the operating system had flushed is there.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import hashlib
import os
import re
import secrets
import shutil
import socket
from pathlib import Path
from typing import Iterator

MARK = ".hispec-"
DIR_MODE = 0o755
HOST = hashlib.sha256(socket.gethostname().encode()).hexdigest()[:8]
TEMPORARY = re.compile(r"^\.(?P<target>.+)\.hispec-(?P<kind>new|old)-(?P<host>[0-9a-f]{8})-(?P<pid>\d+)-[0-9a-f]{8}$")


def _tmp_path(target: Path, kind: str) -> Path:
    return target.parent / f".{target.name}{MARK}{kind}-{HOST}-{os.getpid()}-{secrets.token_hex(4)}"


def is_temporary(name: str) -> bool:
    """Whether a file name is one of these temporaries (of any target)."""
    return TEMPORARY.match(name) is not None


def _owner(path: Path, target: Path) -> tuple[str, int] | None:
    """``(kind, pid)`` of this machine's temporary of ``target``, or None if ``path`` is not one."""
    m = TEMPORARY.match(path.name)
    if m is None or m["target"] != target.name or m["host"] != HOST:
        return None
    return m["kind"], int(m["pid"])


def _alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _remove(path: Path) -> None:
    """Best effort: what cannot be removed now is removed by the next writer."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        with contextlib.suppress(OSError):
            path.unlink()


def clean_stale(target: Path) -> None:
    """Remove the temporaries of ``target`` that dead processes left; if ``target`` is missing
    and a dead writer had moved its previous version aside, put that version back."""
    if not target.parent.is_dir():
        return
    for path in sorted(target.parent.iterdir()):
        owner = _owner(path, target)
        if owner is None or _alive(owner[1]):
            continue
        if owner[0] == "old" and not target.exists():
            with contextlib.suppress(OSError):  # unwritable: the next writer tries again
                os.replace(path, target)
        else:
            _remove(path)


@contextlib.contextmanager
def atomic_file(path: str | os.PathLike) -> Iterator[Path]:
    """Yield a temporary path to write; on success it replaces ``path`` in one rename."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    clean_stale(path)
    tmp = _tmp_path(path, "new")
    try:
        yield tmp
        os.chmod(tmp, 0o666 & ~_umask())  # some writers (safetensors) create files readable by their owner only
        os.replace(tmp, path)
    finally:
        _remove(tmp)


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def write_text(path: str | os.PathLike, text: str) -> None:
    with atomic_file(path) as tmp:
        tmp.write_text(text)


@contextlib.contextmanager
def atomic_directory(target: str | os.PathLike) -> Iterator[Path]:
    """Yield an empty temporary directory beside ``target``; on success it becomes ``target``
    (replacing what was there), on failure it is removed and ``target`` is untouched."""
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    clean_stale(target)
    tmp = _tmp_path(target, "new")
    tmp.mkdir(mode=DIR_MODE)
    try:
        yield tmp
        if target.exists():
            _swap_in(tmp, target)
        else:
            os.replace(tmp, target)
    finally:
        _remove(tmp)


def _swap_in(new: Path, target: Path) -> None:
    """Put ``new`` at ``target`` and delete what was there, never leaving ``target`` missing
    where the platform allows it."""
    if _exchange(new, target):  # new now holds the previous version
        _remove(new)
        return
    old = _tmp_path(target, "old")
    os.replace(target, old)  # a crash here leaves "old", which clean_stale restores
    os.replace(new, target)
    _remove(old)


def _exchange(a: Path, b: Path) -> bool:
    """Atomically swap two paths (Linux renameat2 with RENAME_EXCHANGE); False where unsupported."""
    libc = ctypes.CDLL(None, use_errno=True)
    renameat2 = getattr(libc, "renameat2", None)
    if renameat2 is None:
        return False
    at_fdcwd, rename_exchange = -100, 2
    if renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.ENOSYS, errno.EINVAL, errno.ENOTSUP, errno.EOPNOTSUPP):
        return False
    raise OSError(err, os.strerror(err), str(b))


def remove_tree(path: str | os.PathLike) -> None:
    """Remove a file or directory so that a crash half-way leaves nothing at ``path``: it is first
    renamed to a temporary (which the next writer removes), then deleted."""
    path = Path(path)
    if not path.exists():
        return
    doomed = _tmp_path(path, "new")
    os.replace(path, doomed)
    _remove(doomed)


def save_figure(fig, path: str | os.PathLike) -> None:
    """Save a matplotlib figure as PNG through :func:`atomic_file`."""
    with atomic_file(path) as tmp:
        fig.savefig(tmp, dpi=100, format="png")


def check_writable(directory: str | os.PathLike, what: str) -> None:
    """Fail at once (not after minutes of work) when ``directory`` cannot be created or written.
    Directories it had to create for the probe are removed again: a check leaves nothing behind."""
    from .errors import HiSpecError

    directory = Path(directory)
    created = [p for p in (directory, *directory.parents) if not p.exists()]
    try:
        directory.mkdir(parents=True, exist_ok=True)
        clean_stale(directory / "probe")
        probe = _tmp_path(directory / "probe", "new")
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as exc:
        raise HiSpecError(f"{what} {directory} is not writable ({exc.strerror or exc})") from exc
    finally:
        for path in created:  # deepest first
            with contextlib.suppress(OSError):
                path.rmdir()
