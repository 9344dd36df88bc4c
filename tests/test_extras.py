"""``pip install hispec`` without extras decodes; a tool that needs a missing extra says which, in one line.

Each check runs in a fresh interpreter where the extras' modules cannot be imported
(``sys.modules[name] = None``, as if they were not installed), so an import of one anywhere on the
decoding path fails the test."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from hispec_decode.extras import EXTRAS

BLOCKED = sorted({m for modules in EXTRAS.values() for m in modules})
PRELUDE = f"import sys\nfor name in {BLOCKED!r}:\n    sys.modules[name] = None\n"


def run_bare(code: str, cwd=None) -> subprocess.CompletedProcess:
    """``code`` in a new interpreter without any extra."""
    return subprocess.run([sys.executable, "-c", PRELUDE + code], capture_output=True, text=True, timeout=300,
                          cwd=cwd)


def test_decoding_needs_no_extra(tiny_models):
    path = tiny_models["llama"].path
    code = f"""
import json
from hispec_decode import HiSpecModel
from hispec_decode.tools.generate import main
model = HiSpecModel.from_pretrained({str(path)!r}, heads="none")
out = model.generate([[3, 1, 4]], max_new_tokens=5, method="hispec")
assert main(["--base", {str(path)!r}, "--heads", "none", "--prompt-ids", "3 1 4", "--max-new-tokens", "4"]) == 0
print(json.dumps(out.sequences))
"""
    done = run_bare(code)
    assert done.returncode == 0, done.stderr[-3000:]
    want = tiny_models["llama"].hf_generate([3, 1, 4], 5)
    assert json.loads(done.stdout.strip().splitlines()[-1]) == [want]


@pytest.mark.parametrize("module, argv, extra", [
    ("hispec_train.cli", ["--recipe", "nowhere.yaml"], "train"),
    ("hispec_train.selfdistill", ["--help"], None),  # help needs nothing
    ("hispec_train.store", ["--base", "b", "--dataset", "d", "--out", "o", "--layers", "2"], "train"),
    ("hispec_decode.tools.serve", ["--base", "nowhere"], "serve"),
])
def test_a_tool_names_its_missing_extra(module, argv, extra):
    done = run_bare(f"import sys\nfrom {module} import main\nsys.exit(main({argv!r}))")
    if extra is None:
        assert done.returncode == 0, done.stderr[-3000:]
        return
    assert done.returncode == 2, done.stderr[-3000:]
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and f"pip install 'hispec[{extra}]'" in lines[0], done.stderr


def test_importing_a_part_that_needs_an_extra_names_it(tmp_path):
    done = run_bare("import hispec_decode.serving")
    assert done.returncode != 0 and "pip install 'hispec[serve]'" in done.stderr
    done = run_bare("import pathlib\npathlib.Path('data.jsonl').write_text('{}')\n"
                    "from hispec_train.data import load_records\nload_records('data.jsonl')", cwd=tmp_path)
    assert done.returncode != 0 and "pip install 'hispec[train]'" in done.stderr


def test_every_extra_is_declared_in_pyproject():
    """extras.py names each extra's modules; pyproject.toml must declare the same extras."""
    from pathlib import Path

    import tomllib

    declared = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())["project"]
    assert set(EXTRAS) <= set(declared["optional-dependencies"])
    core = " ".join(declared["dependencies"])
    for pins in ("datasets", "tensorboard", "matplotlib", "fastapi", "uvicorn"):
        assert pins not in core, f"{pins} is a core dependency; it belongs to an extra"
