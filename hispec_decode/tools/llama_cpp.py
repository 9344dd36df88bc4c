"""The peer in the benchmark: llama.cpp's ``llama-bench`` on the same GGUF file.

Where a ``llama-bench`` binary is found (``--llama-bench PATH``, ``$HISPEC_LLAMA_BENCH`` or ``PATH``)
and the base is a GGUF file (a packaged base or a ``.gguf`` path), ``hispec-bench`` runs
``llama-bench -p 0 -n N -t T -r 1`` once per prompt, between the engine's methods, and reports each
method's speed over llama.cpp's plain decoding of that file. How to build it from the PyPI sdist:
docs/native.md.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import statistics
import subprocess
import tempfile
from pathlib import Path
from typing import Iterator

import torch

from ..errors import HiSpecError
from ..models.loading import DEFAULT_BASE, PACKAGED_BASES

ENV = "HISPEC_LLAMA_BENCH"
TIMEOUT_S = 600


def find_llama_bench(explicit: str | None = None) -> Path | None:
    """The ``llama-bench`` to run: ``explicit``, else ``$HISPEC_LLAMA_BENCH``, else one on ``PATH``."""
    named = explicit or os.environ.get(ENV)
    if named:
        path = Path(named).expanduser()
        if not (path.is_file() and os.access(path, os.X_OK)):
            raise HiSpecError(f"llama-bench {named} is not an executable file")
        return path
    found = shutil.which("llama-bench")
    return Path(found) if found else None


@contextlib.contextmanager
def gguf_file(base: str | None) -> Iterator[Path | None]:
    """The GGUF file of ``base`` (a packaged base's is joined into a temporary directory and removed
    after), None for a base that is not a GGUF file."""
    if base is not None and str(base).endswith(".gguf"):
        yield Path(base)
        return
    packaged = DEFAULT_BASE if base is None else PACKAGED_BASES.get(str(base))
    if packaged is None:
        yield None
        return
    with tempfile.TemporaryDirectory(prefix="hispec-gguf-") as tmp:
        yield packaged.gguf(Path(tmp))


def llama_bench(binary: Path, gguf: Path, new_tokens: int, threads: int | None = None, prompt_tokens: int = 0) -> float:
    """llama.cpp's plain decoding speed on ``gguf``: new tokens per second of one run that reads a
    prompt of ``prompt_tokens`` tokens and generates ``new_tokens`` (``-pg``; ``tg`` alone without a
    prompt), timed from the prompt's start, as the engine's requests are."""
    threads = threads or torch.get_num_threads()
    test = ["-p", "0", "-n", str(new_tokens)] if prompt_tokens <= 0 else [
        "-p", "0", "-n", "0", "-pg", f"{prompt_tokens},{new_tokens}"]
    cmd = [str(binary), "-m", str(gguf), *test, "-t", str(threads), "-r", "1", "-o", "json"]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=TIMEOUT_S, check=True)
        run = json.loads(done.stdout)[-1]
        return float(run["avg_ts"]) * new_tokens / (new_tokens + max(prompt_tokens, 0))
    except (OSError, subprocess.SubprocessError, ValueError, KeyError, IndexError, TypeError) as exc:
        detail = getattr(exc, "stderr", "") or ""
        raise HiSpecError(f"llama-bench failed on {gguf}: {type(exc).__name__}: {exc} {detail.strip()[-300:]}") from None


def peer_row(rates: list[float]) -> dict[str, float]:
    """llama.cpp's runs summarised: the mean of its rates and their spread."""
    return {"tokens_per_second": round(statistics.fmean(rates), 3), "runs": len(rates),
            "min": round(min(rates), 3), "max": round(max(rates), 3)}
