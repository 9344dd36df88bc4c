"""Killed with SIGKILL at every step of a write, the previous good state survives and the next run
cleans up and succeeds: hispec-export, a training checkpoint save, the first model conversion.

Each scenario runs the write in a forked child that SIGKILLs itself right before its k-th file
system operation (mkdir, write, chmod, rename, exchange, remove), for every k until the write
completes unkilled; after each kill the parent checks what is on disk."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
import torch

from hispec_decode import HiSpecAdapter, files
from hispec_decode.adapter import hispec_adapter
from hispec_decode.models import loading
from hispec_train import checkpoint
from hispec_train.checkpoint import checkpoint_step, save_checkpoint
from hispec_train.export import export

from conftest import every_kill_point, make_run_dir, save_tiny

pytestmark = pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
EXTRA = [(hispec_adapter, "save_file"), (checkpoint, "save_file")]  # writers imported by name

def _tree(path: Path) -> dict[str, bytes]:
    return {str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}


def _leftovers(directory: Path) -> list[str]:
    return [p.name for p in directory.iterdir() if files.is_temporary(p.name)] if directory.is_dir() else []


@pytest.fixture(params=["exchange", "move-aside"], autouse=True)
def swap(request, monkeypatch):
    """Both ways of replacing a directory: the atomic exchange, and the fallback that moves the
    previous version aside (where renameat2 is missing), which the next writer restores."""
    if request.param == "move-aside":
        monkeypatch.setattr(files, "_exchange", lambda a, b: False)
    return request.param


def test_killed_export_keeps_the_previous_export(trainable_base, tmp_path):
    old_run = make_run_dir(tmp_path / "old", trainable_base, scale=0.01)
    new_run = make_run_dir(tmp_path / "new", trainable_base, scale=0.02)
    out = tmp_path / "exports" / "heads"
    export(old_run, out)
    old = _tree(out)
    export(new_run, tmp_path / "reference")
    new = _tree(tmp_path / "reference")
    assert old != new

    def check() -> None:
        HiSpecAdapter.from_pretrained(out)  # a reader puts back a previous version the fallback had moved aside
        assert out.is_dir() and _tree(out) in (old, new), "the export is the old one or the new one, never a mix"

    kills = every_kill_point(lambda: export(new_run, out), check, EXTRA)
    assert kills >= 8
    export(new_run, out)  # the next run cleans up and succeeds
    assert _tree(out) == new and not _leftovers(out.parent)


def test_killed_checkpoint_save_keeps_the_previous_checkpoint(trainable_base, tmp_path):
    run = make_run_dir(tmp_path / "run", trainable_base, scale=0.01, step=3)
    old = HiSpecAdapter.from_pretrained(run / "checkpoint").state_dict_flat()
    adapter = HiSpecAdapter.from_pretrained(run / "checkpoint")
    with torch.no_grad():
        adapter.head(3).proj.weight.add_(1.0)
    optimizer = torch.optim.AdamW(adapter.parameters(), lr=1e-3)
    adapter.head(3).proj.weight.sum().backward()
    optimizer.step()  # moments to save
    new = adapter.state_dict_flat()

    def check() -> None:
        step = checkpoint_step(run)  # cleans up, or restores the only complete copy
        saved = HiSpecAdapter.from_pretrained(run / "checkpoint").state_dict_flat()
        assert (step, all(torch.equal(saved[k], old[k]) for k in old)) in ((3, True), (6, False))
        if step == 6:
            assert all(torch.equal(saved[k], new[k]) for k in new)

    assert every_kill_point(lambda: save_checkpoint(run, adapter, optimizer, {"step": 6}), check, EXTRA) >= 6
    save_checkpoint(run, adapter, optimizer, {"step": 6})
    assert checkpoint_step(run) == 6 and not _leftovers(run)


def test_killed_first_conversion_leaves_nothing_that_looks_complete(tmp_path):
    source = save_tiny("llama", tmp_path / "source")
    target = tmp_path / "home" / "models" / "tiny"

    def convert(directory: Path) -> None:
        source.reference.save_pretrained(directory)
        (directory / "extra.json").write_text("{}")
        (directory / "more.bin").write_bytes(b"x" * 100)

    def write() -> None:
        shutil.rmtree(target, ignore_errors=True)  # a first conversion, every time
        loading.cached_conversion(target, convert)

    def check() -> None:
        complete = loading.cache_complete(target)
        assert complete or not (target / loading.CACHE_MARKER).exists()
        assert not _leftovers(target.parent), "cache_complete cleaned up what the killed writer left"

    assert every_kill_point(write, check, EXTRA) >= 6
    shutil.rmtree(target, ignore_errors=True)
    assert loading.cached_conversion(target, convert) == target
    assert loading.cache_complete(target) and loading.load_base(str(target)).model is not None
    assert not _leftovers(target.parent)
