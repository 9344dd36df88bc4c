"""Compiled CPU kernels for the decode path, with the torch code they replace as the fallback.

C++/OpenMP kernels (``csrc/``) replace chains of small torch ops or slow kernels on a
decoding step: a bf16 linear on a VNNI-packed weight for every row count (on AMX tiles, else an
AVX-512 BF16 loop, else an AVX2 + FMA loop; each reads the weight once per call), attention
of every query row of a pass over its own paged K/V in one call, RMSNorm (Llama's and Gemma's), rotary embedding,
``silu(gate) * up`` and the greedy argmax of every logits row.
Each rounds where the torch ops do (:mod:`.native` holds those ops; the tests compare both), and
the linear and attention kernels compute every row independently of the other rows of the call.

They are compiled on first use (``torch.utils.cpp_extension``, g++ and ninja; about a minute,
cached under ``$HISPEC_KERNELS_DIR`` or ``~/.cache/hispec/kernels``); the README's set-up builds
them. Without a compiler, on a non-x86 CPU or with ``HISPEC_KERNELS=0`` everything runs on the
torch fallbacks, with a warning saying why.
"""

from __future__ import annotations

import logging
import os
import platform
import threading
import time
from contextlib import contextmanager
from functools import lru_cache
from pathlib import Path
from types import ModuleType
from typing import Iterator

import torch

from . import native

logger = logging.getLogger(__name__)

SOURCES = ("bindings.cpp", "linear_bf16.cpp", "linear_q.cpp", "paged_attention.cpp", "elementwise.cpp", "stack.cpp")
ENV_SWITCH = "HISPEC_KERNELS"  # "0" turns the kernels off
ENV_DIR = "HISPEC_KERNELS_DIR"


def build_directory() -> Path:
    return Path(os.environ.get(ENV_DIR) or Path.home() / ".cache" / "hispec" / "kernels")


def enabled() -> bool:
    return os.environ.get(ENV_SWITCH, "1") not in ("0", "false", "no", "off")


@lru_cache(maxsize=1)
def _load() -> ModuleType | None:
    if not enabled():
        logger.warning("hispec kernels: off (%s=%s); using the torch fallbacks", ENV_SWITCH, os.environ.get(ENV_SWITCH))
        return None
    if platform.machine().lower() not in ("x86_64", "amd64"):
        logger.warning("hispec kernels: built for x86-64 only; this %s CPU uses the torch fallbacks",
                       platform.machine())
        return None
    for attempt in range(2):
        try:
            return _build()
        except _LockCleared:  # a stale lock was removed while this load waited on it: build now
            continue
        except Exception as exc:  # no compiler, no ninja, a failed build: the torch paths still work
            return _fallback(exc)
    return _fallback(RuntimeError("the build lock was left stale twice"))


class _LockCleared(Exception):
    pass


def _build() -> ModuleType:
    from torch.utils.cpp_extension import load

    directory = build_directory()
    directory.mkdir(parents=True, exist_ok=True)
    _clear_stale_lock(directory)
    csrc = Path(__file__).parent / "csrc"
    flags = ["-O3", "-march=native", "-fopenmp", "-ffp-contract=off"]
    with _LockWatch(directory) as watch:
        try:
            return load("hispec_kernels", [str(csrc / s) for s in SOURCES], extra_cflags=flags,
                        extra_ldflags=["-fopenmp"], build_directory=str(directory), verbose=False)
        except Exception:
            if watch.cleared:
                raise _LockCleared() from None
            raise


def _fallback(exc: Exception) -> None:
    lines = str(exc).splitlines() or [""]
    reason = next((line for line in lines if ": error" in line.lower()),
                  next((line for line in lines if "error" in line.lower() and ":" in line), lines[0]))
    logger.warning("hispec kernels: not available (%s: %s); using the torch fallbacks",
                   type(exc).__name__, reason.strip()[:300])
    return None


STALE_LOCK_SECONDS = 600  # a build takes about a minute; a lock this old was left by a killed one


def _clear_stale_lock(directory: Path) -> bool:
    """torch's build lock survives a killed build, and every later load would wait on it forever:
    remove one older than :data:`STALE_LOCK_SECONDS`. Returns whether it removed one."""
    lock = directory / "lock"
    try:
        age = time.time() - lock.stat().st_mtime
    except OSError:
        return False
    if age > STALE_LOCK_SECONDS:
        logger.warning("hispec kernels: removing a build lock left %.0f s ago by an interrupted build (%s)", age, lock)
        lock.unlink(missing_ok=True)
        return True
    return False


class _LockWatch:
    """While a load runs (torch waits as long as another build's lock exists), judge the lock every
    second: say once that the load waits on it, and remove it once it is older than
    :data:`STALE_LOCK_SECONDS` (then the load fails and builds again). A lock this load took itself
    (it is the one building) is left alone: torch's ``FileBaton`` is wrapped for the load to tell."""

    def __init__(self, directory: Path) -> None:
        self.directory, self.cleared, self.building = directory, False, False
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="hispec-kernel-lock", daemon=True)
        self._baton = None

    def __enter__(self) -> _LockWatch:
        import torch.utils.cpp_extension as cpp_extension

        watch, self._baton = self, cpp_extension.FileBaton

        class Baton(self._baton):
            def try_acquire(self) -> bool:
                watch.building = super().try_acquire() or watch.building
                return watch.building

            def release(self) -> None:  # a load that waited past STALE_LOCK_SECONDS removed it: the build is done
                try:
                    super().release()
                except FileNotFoundError:
                    logger.warning("hispec kernels: the build lock was removed as stale by another load while this "
                                   "build ran")

        cpp_extension.FileBaton = Baton
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        import torch.utils.cpp_extension as cpp_extension

        cpp_extension.FileBaton = self._baton
        self._done.set()
        self._thread.join()

    def _watch(self) -> None:
        said = False
        while not self._done.wait(1.0):
            if self.building:  # the lock is this load's own
                continue
            lock = self.directory / "lock"
            if not said and lock.exists():
                said = True
                logger.warning("hispec kernels: waiting on another build's lock (%s); it is removed once %d s old",
                               lock, STALE_LOCK_SECONDS)
            if _clear_stale_lock(self.directory):
                self.cleared = True


_off = 0  # depth of disabled() blocks
_traced: "_Traced | None" = None  # set inside traced()


class _Traced:
    """The kernels with each call named in a ``torch.profiler`` trace (``hispec::<kernel>``): the
    profiler sees only torch operators, and these calls are not (see :func:`traced`)."""

    def __init__(self, module: ModuleType) -> None:
        self._module = module

    def __getattr__(self, name: str):
        fn = getattr(self._module, name)

        def call(*args, **kwargs):
            with torch.profiler.record_function(f"hispec::{name}"):
                return fn(*args, **kwargs)

        return call


def ops() -> ModuleType | None:
    """The compiled kernels, or None where they are off or could not be built."""
    if _off:
        return None
    return _traced if _traced is not None else _load()


@contextmanager
def traced() -> Iterator[None]:
    """Name every kernel call in profiler traces inside this block (``hispec-bench --profile``)."""
    global _traced
    module = _load()
    previous, _traced = _traced, (_Traced(module) if module is not None else None)
    try:
        yield
    finally:
        _traced = previous


@contextmanager
def disabled() -> Iterator[None]:
    """Run on the torch fallbacks inside this block (models built in it keep no kernel weights)."""
    global _off
    _off += 1
    try:
        yield
    finally:
        _off -= 1


def has_linear_bf16() -> bool:
    """The compiled bf16 linear (AVX-512 BF16, or AVX2 + FMA) is built here."""
    k = ops()
    return k is not None and k.linear_bf16_available()


def linear_kind() -> str:
    """Which loop serves bf16 linears here: ``amx``, ``avx512_bf16``, ``avx2`` or ``onednn``."""
    k = ops()
    if k is None or not k.linear_bf16_available():
        return "onednn"
    return "amx" if has_amx() else k.linear_bf16_kind()


def block_linear_kind() -> str:
    """Which loop serves GGUF block linears here: ``vnni`` (vpdpbusd), ``avx2`` or ``torch`` (no kernel)."""
    k = ops()
    return "torch" if k is None or not k.linear_q_available() else k.linear_q_kind()


def has_amx() -> bool:
    """AMX tiles for the bf16 linear (built for them, and granted by the OS to this process)."""
    k = ops()
    return k is not None and k.linear_bf16_available() and k.amx_available()


def main() -> None:
    """``python -m hispec_decode.kernels``: build the kernels now (the README's set-up runs it)."""
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    k = ops()
    if k is None:
        print("[kernels] not built: the torch fallbacks will be used")
    else:
        print(f"[kernels] ready in {build_directory()} (bf16 linears: {linear_kind()}, "
              f"block linears: {block_linear_kind()})")


def _use(*xs: torch.Tensor) -> ModuleType | None:
    """The kernels for inference on CPU tensors (they have no backward: training uses torch)."""
    k = ops()
    if k is None or any(x.device.type != "cpu" for x in xs):
        return None
    if torch.is_grad_enabled() and any(x.requires_grad for x in xs):
        return None
    return k


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    k = _use(x, weight) if weight.dtype == x.dtype else None
    return k.rms_norm(x, weight, eps) if k is not None else native.rms_norm(x, weight, eps)


def gemma_rms_norm(x: torch.Tensor, scale: torch.Tensor, eps: float) -> torch.Tensor:
    """Gemma's RMSNorm, ``scale`` (float32) being ``1 + weight``."""
    k = _use(x, scale)
    return k.gemma_rms_norm(x, scale, eps) if k is not None else native.gemma_rms_norm(x, scale, eps)


def rope(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """q [1, T, H, d] and k [1, T, Hk, d] rotated, as [1, H, T, d] and [1, Hk, T, d]."""
    kern = _use(q, k, cos) if q.shape[0] == 1 and cos.dtype == q.dtype == k.dtype else None
    if kern is None:
        return native.rope(q, k, cos, sin)
    qo, ko = kern.rope(q, k, cos, sin)
    return qo, ko


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    k = _use(x)
    return k.silu_and_mul(x) if k is not None else native.silu_and_mul(x)


def argmax(x: torch.Tensor) -> torch.Tensor:
    """``x.argmax(-1)``: the first index of each row's largest value."""
    k = _use(x)
    return k.argmax_rows(x) if k is not None else x.argmax(-1)
