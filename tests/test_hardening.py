"""Nothing lost, every mistake a clear message: files the commands write, and user mistakes.

Each test here failed before the hardening it covers (issue 10's numbered items)."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from hispec_decode import CONFIG_NAME, WEIGHTS_NAME, AdapterError, HiSpecAdapter, HiSpecError, files
from hispec_decode.adapter import VLLM_BASE_CONFIG_NAME
from hispec_decode.models import loading
from hispec_decode.tools import bench
from hispec_decode.tools import generate as generate_cli
from hispec_train import cli as train_cli
from hispec_train.config import load_config, parse_overrides
from hispec_train.export import export
from hispec_train.export import main as export_main
from hispec_train.trainer import check_run_dir

from conftest import make_run_dir, save_tiny

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def run_dir(trainable_base, tmp_path) -> Path:
    return make_run_dir(tmp_path / "run", trainable_base, scale=0.01)


def _tree(path: Path) -> dict[str, bytes]:
    return {str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}


# 1. hispec-export never deletes what it did not create ------------------------------------------
def test_export_refuses_a_directory_with_other_files_and_keeps_them(run_dir, tmp_path, capsys):
    out = tmp_path / "mine"
    out.mkdir()
    (out / "notes.txt").write_text("precious")
    (out / ".notes.hispec-v2.txt").write_text("looks like ours, is not")
    assert export_main([str(run_dir), "--out", str(out)]) == 2
    assert "holds other files" in capsys.readouterr().err
    assert _tree(out) == {"notes.txt": b"precious", ".notes.hispec-v2.txt": b"looks like ours, is not"}
    (out / "notes.txt").unlink()
    assert export_main([str(run_dir), "--out", str(out)]) == 2  # only a look-alike left: still not ours
    assert export_main([str(run_dir), "--out", str(out), "--overwrite"]) == 0  # said explicitly: replaced
    assert set(_tree(out)) == {CONFIG_NAME, WEIGHTS_NAME, "README.md", VLLM_BASE_CONFIG_NAME}


def test_export_never_touches_the_run_directory(run_dir, capsys):
    before = _tree(run_dir)
    for out in (run_dir, run_dir / "export", run_dir.parent):
        assert export_main([str(run_dir), "--out", str(out), "--overwrite"]) == 2
        assert "overlap the run directory" in capsys.readouterr().err
    assert _tree(run_dir) == before


def test_export_to_a_file_or_the_current_directory_fails_cleanly(run_dir, tmp_path, monkeypatch, capsys):
    target = tmp_path / "a-file"
    target.write_text("x")
    assert export_main([str(run_dir), "--out", str(target)]) == 2
    assert "is a file" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a-file", "run"], "no temporary left behind"
    work = tmp_path / "work"
    work.mkdir()
    (work / "keep.txt").write_text("x")
    monkeypatch.chdir(work)
    assert export_main([str(run_dir), "--out", "."]) == 2
    assert "current directory" in capsys.readouterr().err
    assert _tree(work) == {"keep.txt": b"x"}


def test_export_replaces_a_previous_export_with_identical_bytes_and_normal_permissions(run_dir, tmp_path):
    out = tmp_path / "heads"
    export(run_dir, out)
    first = _tree(out)
    export(run_dir, out)  # a previous export may be replaced without --overwrite
    assert _tree(out) == first, "the same run exported twice gives the same bytes"
    assert stat.S_IMODE(out.stat().st_mode) & 0o755 == 0o755
    for name in first:
        assert stat.S_IMODE((out / name).stat().st_mode) & 0o644 == 0o644, name
    assert not [p for p in tmp_path.iterdir() if files.is_temporary(p.name)]


# 2. the README's Python example: what apply_chat_template returns is accepted ------------------
def test_tokenizer_outputs_are_accepted_as_prompts(trainable_base):
    from hispec_decode import HiSpecModel

    model = HiSpecModel.from_pretrained(str(trainable_base))
    messages = [{"role": "user", "content": "Hi!"}]
    ids = model.tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=False)
    encoding = model.tokenizer.apply_chat_template(messages, add_generation_prompt=True)  # a BatchEncoding
    want = model.generate([ids], max_new_tokens=5).sequences
    assert model.generate([encoding], max_new_tokens=5).sequences == want
    assert model.generate(encoding, max_new_tokens=5).sequences == want
    assert model.generate(ids, max_new_tokens=5).sequences == want  # a flat list: one prompt
    with pytest.raises(HiSpecError, match="tokenize it first"):
        model.generate("Hi!")


# 3. --key=value keeps the value as given -------------------------------------------------------
def test_key_equals_value_overrides_keep_dashes_and_numbers():
    overrides = parse_overrides(["--output-dir=/data/my-run", "--lr=1e-3", "--heads-layers", "2,4", "--resume"])
    assert overrides == {"output_dir": "/data/my-run", "lr": "1e-3", "heads_layers": "2,4", "resume": "true"}
    cfg = load_config(None, overrides)
    assert cfg.output_dir == "/data/my-run" and cfg.lr == 1e-3 and cfg.heads_layers == [2, 4] and cfg.resume


def test_head_roles_name_each_head_and_are_checked():
    assert load_config(None, {"heads_layers": "8", "head_roles": "intermediate"}).roles() == ["intermediate"]
    assert load_config(None, {"heads_layers": "2,8,12"}).roles() == ["draft", "intermediate", "extra"]
    for roles in ("draft", "draft,draft", "draft,verify"):
        with pytest.raises(HiSpecError, match="head_roles must give each"):
            load_config(None, {"heads_layers": "2,8", "head_roles": roles})


# 4. runs never overwrite each other ---------------------------------------------------------------
def test_a_run_with_a_checkpoint_needs_resume_or_overwrite(run_dir, trainable_base, tmp_path):
    base = {"output_dir": str(run_dir), "report_to": "none", "base": str(trainable_base), "heads_layers": "1,3"}
    with pytest.raises(HiSpecError, match="already holds a checkpoint \\(step 3\\).*--resume.*--overwrite"):
        check_run_dir(load_config(None, base))
    check_run_dir(load_config(None, base | {"resume": "true"}))
    check_run_dir(load_config(None, base | {"overwrite": "true"}))
    with pytest.raises(HiSpecError, match="no checkpoint to resume"):
        check_run_dir(load_config(None, {"output_dir": str(tmp_path / "new"), "resume": "true"}))
    with pytest.raises(HiSpecError, match="exclude each other"):
        load_config(None, base | {"resume": "true", "overwrite": "true"})
    with pytest.raises(HiSpecError, match="heads_layers differ from the run being resumed"):
        check_run_dir(load_config(None, base | {"resume": "true", "heads_layers": "2,4"}))


def test_training_cli_refuses_before_loading_anything(run_dir, capsys):
    assert train_cli.main(["--output-dir", str(run_dir), "--report-to", "none"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("hispec-train: error:") and "Traceback" not in err and err.count("\n") == 1


# 5. broken heads are refused on load ----------------------------------------------------------------
@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_heads_with_non_finite_weights_are_refused(run_dir, tmp_path, value):
    out = tmp_path / "heads"
    export(run_dir, out)
    tensors = load_file(str(out / WEIGHTS_NAME))
    tensors["3.proj.weight"][0, 0] = value
    save_file(tensors, str(out / WEIGHTS_NAME))
    with pytest.raises(AdapterError, match="3.proj.weight holds NaN or infinite values"):
        HiSpecAdapter.from_pretrained(out)


def test_heads_whose_shapes_disagree_with_their_config_are_refused(run_dir, tmp_path):
    out = tmp_path / "heads"
    export(run_dir, out)
    config = json.loads((out / CONFIG_NAME).read_text())
    config["exits"][0]["shapes"]["proj.weight"] = [1, 2]
    (out / CONFIG_NAME).write_text(json.dumps(config))
    with pytest.raises(AdapterError, match="1.proj.weight has shape .* but hispec_config.json says \\(1, 2\\)"):
        HiSpecAdapter.from_pretrained(out)


# 6. the model cache ----------------------------------------------------------------------------------
def _tiny_conversion(tmp_path: Path):
    source = save_tiny("llama", tmp_path / "source")

    def convert(directory: Path) -> None:
        source.reference.save_pretrained(directory)
    return convert


def test_model_cache_cleans_up_after_a_killed_conversion_and_repairs_truncation(tmp_path):
    convert = _tiny_conversion(tmp_path)
    target = tmp_path / "home" / "models" / "tiny"
    target.parent.mkdir(parents=True)
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    leftover = target.parent / f".tiny.hispec-new-{files.HOST}-{int(dead.stdout)}-00000000"  # a SIGKILLed conversion's
    leftover.mkdir()
    (leftover / "model.safetensors").write_bytes(b"x" * 1000)
    assert loading.cached_conversion(target, convert) == target
    assert not leftover.exists() and loading.cache_complete(target)
    weights = target / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])  # truncated
    assert not loading.cache_complete(target)
    loading.cached_conversion(target, convert)
    assert loading.cache_complete(target) and loading.load_base(str(target)).model is not None


def test_damaged_weights_name_the_file(tmp_path):
    tiny = save_tiny("llama", tmp_path / "m")
    (tiny.path / "model.safetensors").write_bytes(b"\x00" * 64)
    with pytest.raises(HiSpecError, match=f"cannot load the model weights in {tiny.path}"):
        loading.load_base(str(tiny.path))


def test_unwritable_model_cache_fails_before_converting(tmp_path):
    blocker = tmp_path / "home"
    blocker.write_text("a file where the cache directory should be")
    called = []
    with pytest.raises(HiSpecError, match=r"the model cache \(\$HISPEC_HOME\) .* is not writable"):
        loading.cached_conversion(blocker / "models" / "x", called.append)
    assert not called, "nothing is converted before the cache is known to be writable"


# 7. CLI mistakes: exit 2, one line, no traceback (--debug shows it) -----------------------------
def _one_line_error(capsys, prog: str) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert err and err[-1].startswith(f"{prog}: error:") and not any("Traceback" in line for line in err), err
    return err[-1]


@pytest.mark.parametrize("argv", [
    ["--prompt-ids", "1 x"], ["--prompt-ids", "1", "--max-new-tokens", "abc"], ["--prompt-ids", "1", "--top-p", "2"],
    ["--prompt-ids", "1", "--max-new-tokens", "0"], ["--prompt-ids", "1", "--method", "medusa"],
    ["--prompt-file", "/no/such/file"],
])
def test_generate_cli_mistakes(tiny_models, argv, capsys):
    with pytest.raises(SystemExit) as exc:  # argparse's own errors exit 2 as well
        raise SystemExit(generate_cli.main(["--base", str(tiny_models["llama"].path), *argv]))
    assert exc.value.code == 2
    _one_line_error(capsys, "hispec-generate")


@pytest.mark.parametrize("argv", [["--num-prompts", "0"], ["--batch-sizes", "0"], ["--batch-sizes", "2,x"],
                                  ["--max-new-tokens", "0"], ["--max-batches", "0"], ["--dtypes", "int8"],
                                  ["--methods", ","], ["--window", "0"]])
def test_bench_cli_mistakes(tiny_models, argv, capsys):
    with pytest.raises(SystemExit) as exc:
        raise SystemExit(bench.main(["--base", str(tiny_models["llama"].path), *argv]))
    assert exc.value.code == 2
    _one_line_error(capsys, "hispec-bench")


def test_train_cli_mistakes(tmp_path, capsys):
    broken = tmp_path / "broken.yaml"
    broken.write_text("lr: [1, 2\nmax_steps: 3\n")
    for argv, needle in [(["--recipe", str(broken)], "not valid YAML"), (["--max-steps", "-1"], "max_steps"),
                         (["--lr", "fast"], "lr"), (["--head-options", "[1]"], "head_options"),
                         (["--frobnicate", "1"], "unknown config keys"),
                         (["--features", str(tmp_path / "store"), "--dataset", "sharegpt"], "both --dataset")]:
        assert train_cli.main([*argv, "--output-dir", str(tmp_path / "r")]) == 2
        assert needle in _one_line_error(capsys, "hispec-train")


def test_unreachable_hub_dataset_is_a_clear_error(trainable_base, tmp_path, capsys):
    env = os.environ | {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    done = subprocess.run([sys.executable, "-m", "hispec_train.cli", "--base", str(trainable_base), "--dataset",
                           "no-such-user/no-such-dataset", "--heads-layers", "1,3", "--output-dir", str(tmp_path / "r"),
                           "--report-to", "none"],
                          capture_output=True, text=True, env=env, cwd=ROOT)
    assert done.returncode == 2, done.stderr[-2000:]
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("hispec-train: error: cannot load dataset 'no-such-user/no-such-dataset'"), last


def test_debug_shows_the_traceback(tiny_models, capsys):
    with pytest.raises(HiSpecError):
        generate_cli.main(["--base", str(tiny_models["llama"].path), "--prompt-ids", "1", "--draft-layer", "9",
                           "--debug"])


def test_internal_errors_are_not_hidden(tiny_models, monkeypatch):
    from hispec_decode import HiSpecModel

    def broken(*args, **kwargs):
        raise ZeroDivisionError("a bug")
    monkeypatch.setattr(HiSpecModel, "generate", broken)
    with pytest.raises(ZeroDivisionError):
        generate_cli.main(["--base", str(tiny_models["llama"].path), "--prompt-ids", "1"])


def test_tensor_prompts_with_a_batch_dimension_or_numpy_ids(hispec_models):
    import numpy as np

    model = hispec_models["llama"]
    want = model.generate([[4, 5, 6]], max_new_tokens=4).sequences
    assert model.generate(torch.tensor([4, 5, 6]), max_new_tokens=4).sequences == want
    assert model.generate(np.array([[4, 5, 6]]), max_new_tokens=np.int64(4)).sequences == want
    for bad, needle in [(torch.tensor([[1.0]]), "integer token ids"), ([[1, True]], "not a token id")]:
        with pytest.raises(HiSpecError, match=needle):
            model.generate(bad, max_new_tokens=2)
