"""The README's training path runs on a fresh checkout: its commands, in its order, on the
embedded SmolLM2 and the committed self-distilled data, with tiny step counts appended."""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()

pytestmark = pytest.mark.slow

# appended to each command: the same stages, seconds instead of hours
TINY = {
    "hispec-selfdistill": [],  # the committed data set is complete: a no-op
    "hispec-store": ["--max-tokens", "3000", "--eval-sequences", "4", "--shard-tokens", "2000"],
    "hispec-train": ["--max-steps", "2", "--eval-every", "2", "--save-every", "2", "--eval-batches", "1",
                     "--batch-size", "2", "--seq-len", "64"],
    "hispec-export": [],
    "hispec-tune": ["--dtypes", "bfloat16", "--num-prompts", "1", "--max-new-tokens", "8", "--confirm", "1"],
}


def _pipeline() -> list[list[str]]:
    """The commands of the README's first training block (the one that starts with hispec-selfdistill)."""
    block = next(b for b in re.findall(r"```bash\n(.*?)```", README, flags=re.S) if b.startswith("hispec-selfdistill"))
    return [shlex.split(line.split("  #")[0]) for line in block.splitlines() if line.strip()]


def _main(prog: str):
    import importlib

    module = {"hispec-selfdistill": "hispec_train.selfdistill", "hispec-store": "hispec_train.store",
              "hispec-train": "hispec_train.cli", "hispec-export": "hispec_train.export",
              "hispec-tune": "hispec_decode.tools.tune"}[prog]
    return importlib.import_module(module).main


@pytest.fixture
def checkout(tmp_path, monkeypatch) -> Path:
    """What a fresh clone holds that the commands read: the committed data, recipes and scripts."""
    for name in ("data/selfdistill-smollm2", "recipes", "scripts"):
        shutil.copytree(ROOT / name, tmp_path / name)
    monkeypatch.chdir(tmp_path)
    return tmp_path


def test_the_readme_training_block_runs_in_order(checkout):
    commands = _pipeline()
    assert [c[0] for c in commands] == list(TINY), "the README's pipeline changed: update TINY"
    data_before = {p.name: p.read_bytes() for p in (checkout / "data/selfdistill-smollm2").iterdir()}
    for argv in commands:
        assert _main(argv[0])(argv[1:] + TINY[argv[0]]) == 0, " ".join(argv)
    assert {p.name: p.read_bytes() for p in (checkout / "data/selfdistill-smollm2").iterdir()} == data_before
    assert (checkout / "runs/store-smollm2/hispec_store.json").is_file()
    assert (checkout / "heads/smollm2-135m/hispec_calibration.safetensors").is_file()  # the calibration traces

    # the details block: accelerate launch as written, once with the recipe's store, once with --dataset
    details = next(b for b in re.findall(r"```bash\n(.*?)```", README, flags=re.S) if "accelerate launch" in b)
    launches = [shlex.split(line.split("  #")[0]) for line in details.splitlines() if line.startswith("accelerate")]
    assert len(launches) == 2 and any("--dataset" in a for a in launches)
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    for i, argv in enumerate(launches):
        accelerate = Path(sys.executable).parent / "accelerate"  # the console script, as the README runs it
        argv = [str(accelerate), *argv[1:], *TINY["hispec-train"],
                "--max-tokens", "4000", "--output-dir", f"runs/launch-{i}"]
        proc = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert (checkout / f"runs/launch-{i}/checkpoint").is_dir()


def test_a_missing_store_fails_before_creating_anything(checkout, capsys):
    from hispec_train.cli import main

    assert main(["--recipe", "recipes/smollm2-135m.yaml"]) == 2
    err = capsys.readouterr().err
    assert "hispec-store --dataset DATA --out runs/store-smollm2 --layers 2,8" in err and "Traceback" not in err
    assert not (checkout / "runs").exists()
