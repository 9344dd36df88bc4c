"""The directories converted and prepared models are cached in under ``$HISPEC_HOME``: written
atomically, with a marker listing every file and its size, so a conversion killed at any point
leaves nothing that looks complete."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Callable

from safetensors import SafetensorError

from ..files import atomic_directory, check_writable, clean_stale, write_text

logger = logging.getLogger(__name__)

CACHE_MARKER = "hispec_cache.json"  # written last by a conversion: its files and their sizes


def hispec_home() -> Path:
    return Path(os.environ.get("HISPEC_HOME", Path.home() / ".cache" / "hispec"))


def cached_conversion(target: Path, convert: Callable[[Path], None]) -> Path:
    """``target``, made by ``convert(directory)`` unless a complete copy is there already.

    The conversion writes into a temporary sibling that is swapped into place with a marker
    listing every file and its size, so a conversion killed at any point leaves nothing behind
    that looks complete (the next call cleans it up and converts again), and a truncated or
    missing file is noticed and repaired."""
    if cache_complete(target):
        return target
    if target.exists():
        logger.warning("the cached model in %s is incomplete or damaged; converting it again", target)
    check_writable(target.parent, "the model cache ($HISPEC_HOME)")
    with atomic_directory(target) as tmp:
        convert(tmp)
        sizes = {str(p.relative_to(tmp)): p.stat().st_size for p in sorted(tmp.rglob("*")) if p.is_file()}
        (tmp / CACHE_MARKER).write_text(json.dumps({"files": sizes}, indent=2, sort_keys=True))
    return target


def cache_complete(target: Path) -> bool:
    """Whether ``target`` holds a finished conversion: every file its marker lists, at its size."""
    clean_stale(target)
    if not (target / CACHE_MARKER).is_file() and _legacy_complete(target):
        return True
    try:
        files = json.loads((target / CACHE_MARKER).read_text())["files"]
        return all((target / name).stat().st_size == size for name, size in files.items())
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return False


def _legacy_complete(target: Path) -> bool:
    """A cache written before markers existed: complete if its config and every safetensors file
    read whole; it gets a marker (when the cache is writable) so the check is cheap next time."""
    from safetensors import safe_open

    weights = sorted(target.glob("*.safetensors"))
    if not (target / "config.json").is_file() or not weights:
        return False
    try:
        json.loads((target / "config.json").read_text())
        for path in weights:
            with safe_open(str(path), "pt") as f:
                for key in f.keys():
                    f.get_slice(key)  # the header's offsets must lie inside the file
            if path.stat().st_size < 8:
                return False
    except (OSError, ValueError, SafetensorError, json.JSONDecodeError):
        return False
    sizes = {str(p.relative_to(target)): p.stat().st_size for p in sorted(target.rglob("*")) if p.is_file()}
    try:
        write_text(target / CACHE_MARKER, json.dumps({"files": sizes}, indent=2, sort_keys=True))
    except OSError:
        pass  # a read-only cache: used as it is
    return True
