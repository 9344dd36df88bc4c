"""The data pipeline loses nothing: every argument and input is checked before ``--overwrite``
removes anything, a resume checks the shards on disk against the manifest (missing ones are
generated again, none is ever overwritten, damaged ones stop it with one line), a failed start
creates nothing, and a run SIGKILLed at any file system step resumes to the same data."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from hispec_decode import HiSpecError, HiSpecModel
from hispec_train import selfdistill, store
from hispec_train.selfdistill import MANIFEST_NAME, SelfDistillConfig, generate
from hispec_train.store import STORE_MANIFEST, StoreConfig, StoreManifest, build_store

from conftest import TEXT_PROMPTS as PROMPTS
from conftest import every_kill_point, make_run_dir

MAX_TOKENS = 10**6  # no cap: every planned answer


@pytest.fixture(scope="module")
def few_prompts(tmp_path_factory) -> Path:
    """The first 8 prompts: 16 answers, small stores, few kill points."""
    path = tmp_path_factory.mktemp("few") / "few.txt"
    path.write_text("\n".join(PROMPTS[:8]) + "\n")
    return path

def _distill_cfg(base: Path, prompts: Path, out: Path, **kw) -> SelfDistillConfig:
    keys = dict(out=str(out), base=str(base), dtype="float32", prompts=[str(prompts)], max_tokens=MAX_TOKENS,
                max_new_tokens=8, batch_size=3, shard_records=2)
    return SelfDistillConfig(**(keys | kw))


def _store_cfg(base: Path, dataset: Path, out: Path, **kw) -> StoreConfig:
    keys = dict(base=str(base), dtype="float32", eval_sequences=2, shard_tokens=120, batch_tokens=200)
    return StoreConfig(str(dataset), str(out), kw.pop("layers", [1, 3]), **(keys | kw))


@pytest.fixture(scope="module")
def distilled(trainable_base, few_prompts, tmp_path_factory) -> Path:
    return generate(_distill_cfg(trainable_base, few_prompts, tmp_path_factory.mktemp("sd") / "data"))


@pytest.fixture(scope="module")
def features(distilled, trainable_base, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("store") / "features"
    build_store(_store_cfg(trainable_base, distilled, out))
    return out


def _tree(path: Path) -> dict[str, bytes]:
    return {str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}


def _jobs(out: Path) -> list[int]:
    return [j for p in sorted(out.glob("shard-*.parquet")) for j in pq.read_table(p, columns=["job"])["job"].to_pylist()]


def _manifest_is_the_disk(out: Path) -> None:
    manifest = json.loads((out / MANIFEST_NAME).read_text())
    disk = [{"file": p.name, "records": pq.read_metadata(p).num_rows,
             "new_tokens": sum(pq.read_table(p, columns=["new_tokens"])["new_tokens"].to_pylist())}
            for p in sorted(out.glob("shard-*.parquet"))]
    assert manifest["shards"] == disk
    assert manifest["new_tokens"] == sum(d["new_tokens"] for d in disk)


def _one_error_line(capsys, *words: str) -> None:
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if "error" in line.lower()]  # progress bars aside
    assert len(lines) == 1 and ": error: " in lines[0] and "Traceback" not in err, err
    for w in words:
        assert w in lines[0], lines


# -- --overwrite checks everything before it removes anything ---------------------------------

def test_store_overwrite_with_bad_arguments_keeps_the_store(features, distilled, trainable_base, tmp_path, capsys):
    copy = tmp_path / "features"
    shutil.copytree(features, copy)
    before = _tree(copy)
    common = ["--out", str(copy), "--base", str(trainable_base), "--dtype", "float32", "--overwrite"]
    assert store.main(["--dataset", str(distilled), "--layers", "1,3,99", *common]) == 2
    _one_error_line(capsys, "--layers")
    assert store.main(["--dataset", "/nonexistent", "--layers", "1,3", *common]) == 2
    _one_error_line(capsys, "/nonexistent")
    assert store.main(["--dataset", str(distilled), "--layers", "3,1", *common]) == 2
    _one_error_line(capsys, "increasing")
    assert _tree(copy) == before


def test_selfdistill_overwrite_with_bad_arguments_keeps_the_data(distilled, trainable_base, few_prompts, tmp_path,
                                                                  capsys):
    copy = tmp_path / "data"
    shutil.copytree(distilled, copy)
    before = _tree(copy)
    common = ["--out", str(copy), "--base", str(trainable_base), "--dtype", "float32", "--overwrite"]
    assert selfdistill.main([*common, "--prompts", str(tmp_path / "nonexistent.txt")]) == 2
    _one_error_line(capsys, "nonexistent.txt")
    assert selfdistill.main([*common, "--prompts", "sharegpt", "--top-p", "1.5"]) == 2
    _one_error_line(capsys, "--top-p")
    fake = tmp_path / "fake.gguf"
    fake.write_bytes(b"no model")
    assert selfdistill.main([*common, "--prompts", str(few_prompts), "--base", str(fake)]) == 2  # the model fails
    _one_error_line(capsys, "not a GGUF file")
    assert _tree(copy) == before


def test_train_overwrite_with_a_missing_store_keeps_the_run(trainable_base, tmp_path):
    from hispec_train.config import load_config
    from hispec_train.trainer import train

    run = make_run_dir(tmp_path / "run", trainable_base)
    before = _tree(run)
    cfg = load_config(None, {"base": str(trainable_base), "features": str(tmp_path / "nowhere"), "heads_layers": "1,3",
                             "output_dir": str(run), "overwrite": "true", "report_to": "none"})
    with pytest.raises(HiSpecError, match="hispec-store --dataset DATA --out .*nowhere --layers 1,3"):
        train(cfg)
    assert _tree(run) == before


def test_export_overwrite_with_bad_arguments_keeps_the_export(trainable_base, tmp_path, capsys):
    from hispec_train import export as export_cli

    run = make_run_dir(tmp_path / "run", trainable_base)
    out = tmp_path / "heads"
    assert export_cli.main([str(run), "--out", str(out)]) == 0
    before = _tree(out)
    assert export_cli.main([str(tmp_path / "no-run"), "--out", str(out), "--overwrite"]) == 2
    assert export_cli.main([str(run), "--out", str(out), "--overwrite", "--exit-vocab-size", "100000"]) == 2
    capsys.readouterr()
    assert _tree(out) == before


# -- a failed start creates nothing --------------------------------------------------------------

def test_failed_starts_create_nothing(trainable_base, distilled, tmp_path, monkeypatch, capsys):
    out = tmp_path / "new" / "sd1"
    assert selfdistill.main(["--out", str(out), "--prompts", str(tmp_path / "nonexistent.jsonl"),
                             "--base", str(trainable_base)]) == 2
    assert not (tmp_path / "new").exists()
    loads = []
    monkeypatch.setattr("hispec_decode.models.load_base", lambda *a, **k: loads.append(a) or 1 / 0)
    assert store.main(["--dataset", "/nonexistent", "--out", str(out), "--layers", "1,3"]) == 2
    assert not loads and not (tmp_path / "new").exists()  # the path is checked before the model is loaded
    capsys.readouterr()


def test_store_refuses_a_data_set_without_training_tokens(trainable_base, tmp_path):
    one = tmp_path / "one.jsonl"
    one.write_text(json.dumps({"text": "just one short record"}) + "\n")
    with pytest.raises(HiSpecError, match="no training tokens"):
        build_store(_store_cfg(trainable_base, one, tmp_path / "st1"))
    assert not (tmp_path / "st1").exists()


def test_generate_refuses_a_file_that_is_not_gguf(tmp_path, capsys):
    from hispec_decode.tools import generate as generate_cli

    fake = tmp_path / "fake.gguf"
    fake.write_bytes(b"this is no model at all")
    assert generate_cli.main(["--base", str(fake), "--prompt", "hi"]) == 2
    _one_error_line(capsys, "not a GGUF file")


# -- resumes check the shards on disk against the manifest ------------------------------------

def test_selfdistill_resume_regenerates_a_missing_shard_and_overwrites_none(distilled, trainable_base, few_prompts,
                                                                            tmp_path):
    copy = tmp_path / "data"
    shutil.copytree(distilled, copy)
    all_jobs = sorted(_jobs(copy))
    last = sorted(copy.glob("shard-*.parquet"))[-1].name
    lost = pq.read_table(copy / "shard-00001.parquet")["job"].to_pylist()
    (copy / "shard-00001.parquet").unlink()
    kept = {n: b for n, b in _tree(copy).items() if n.startswith("shard-")}
    generate(_distill_cfg(trainable_base, few_prompts, copy, resume=True))
    after = _tree(copy)
    assert all(after[n] == b for n, b in kept.items()), "a resume rewrote a shard it did not write"
    assert sorted(_jobs(copy)) == all_jobs  # exactly the lost answers came back, once
    new = [n for n in after if n.startswith("shard-") and n not in kept]
    assert new and all(n > last for n in new) and "shard-00001.parquet" not in after
    assert sorted(j for n in new for j in pq.read_table(copy / n)["job"].to_pylist()) == sorted(lost)
    _manifest_is_the_disk(copy)


def test_selfdistill_resume_keeps_the_count_of_skipped_prompts(trainable_base, tmp_path, monkeypatch):
    """Prompts longer than --max-prompt-tokens are skipped; a resumed run meets them again and its
    manifest never counts fewer than were skipped before it (nor counts one twice)."""
    prompts = tmp_path / "mixed.txt"  # every other prompt 4 times as long: 36 or 87 tokens in the chat template
    prompts.write_text("\n".join(p * (1 + 3 * (i % 2)) for i, p in enumerate(PROMPTS[:8])) + "\n")
    full = generate(_distill_cfg(trainable_base, prompts, tmp_path / "full", max_prompt_tokens=60))
    skipped = json.loads((full / MANIFEST_NAME).read_text())["skipped_long_prompts"]
    out = generate(_distill_cfg(trainable_base, prompts, tmp_path / "part", max_prompt_tokens=60, max_tokens=12))
    before = json.loads((out / MANIFEST_NAME).read_text())["skipped_long_prompts"]
    assert skipped == 8 and 0 < before < skipped  # 2 answers of each long prompt
    counts = []
    write_text = selfdistill.write_text

    def spy(path, text):
        if Path(path).name == MANIFEST_NAME:
            counts.append(json.loads(text)["skipped_long_prompts"])
        write_text(path, text)

    monkeypatch.setattr(selfdistill, "write_text", spy)
    generate(_distill_cfg(trainable_base, prompts, out, max_prompt_tokens=60, resume=True))
    assert counts and min(counts) >= before and counts[-1] == skipped, (before, counts, skipped)


def test_an_interrupted_selfdistill_keeps_its_finished_answers(distilled, trainable_base, few_prompts, tmp_path,
                                                              monkeypatch):
    """Ctrl-C (or SIGTERM, which ends a command as Ctrl-C does) after 3 answers and before any shard was
    due: the 3 answers are written as a shard, the manifest lists it, and a resume finishes the rest."""
    class Bar:  # stands in for tqdm; the 3rd finished answer is followed by the interrupt
        def __init__(self, *args, **kwargs):
            self.calls = 0

        def update(self, n):
            self.calls += 1
            if self.calls == 3:
                raise KeyboardInterrupt

        def close(self):
            pass

    out = tmp_path / "data"
    monkeypatch.setattr(selfdistill, "tqdm", Bar)
    with pytest.raises(KeyboardInterrupt):
        generate(_distill_cfg(trainable_base, few_prompts, out, shard_records=100))
    assert len(_jobs(out)) == 3
    _manifest_is_the_disk(out)
    monkeypatch.undo()
    generate(_distill_cfg(trainable_base, few_prompts, out, resume=True))
    assert sorted(_jobs(out)) == sorted(_jobs(distilled))
    _manifest_is_the_disk(out)


def test_selfdistill_resume_stops_at_a_damaged_shard(distilled, trainable_base, few_prompts, tmp_path, capsys):
    copy = tmp_path / "data"
    shutil.copytree(distilled, copy)
    damaged = copy / "shard-00002.parquet"
    damaged.write_bytes(damaged.read_bytes()[:100])
    before = _tree(copy)
    argv = ["--out", str(copy), "--base", str(trainable_base), "--dtype", "float32", "--prompts", str(few_prompts),
            "--max-tokens", str(MAX_TOKENS), "--max-new-tokens", "8", "--resume"]
    assert selfdistill.main(argv) == 2
    _one_error_line(capsys, "shard-00002.parquet", "damaged")
    assert _tree(copy) == before
    damaged.unlink()
    assert selfdistill.main(argv) == 0  # the advice works: its answers are generated again
    assert sorted(_jobs(copy)) == sorted(_jobs(distilled))
    capsys.readouterr()


def test_store_resume_keeps_unlisted_complete_shards_and_stops_at_damaged_ones(features, distilled, trainable_base,
                                                                               tmp_path, capsys):
    copy = tmp_path / "features"
    shutil.copytree(features, copy)
    manifest = json.loads((copy / STORE_MANIFEST).read_text())
    unlisted = manifest["shards"]["train"].pop()  # as a run killed between the shard and the manifest leaves it
    (copy / STORE_MANIFEST).write_text(json.dumps(manifest))
    before = _tree(copy)
    build_store(_store_cfg(trainable_base, distilled, copy, resume=True))
    assert {n: b for n, b in _tree(copy).items() if n != STORE_MANIFEST} == \
        {n: b for n, b in before.items() if n != STORE_MANIFEST}, "no shard was computed again"
    assert StoreManifest.load(copy).shards == StoreManifest.load(features).shards
    damaged = copy / unlisted["file"]
    damaged.write_bytes(damaged.read_bytes()[:100])
    argv = ["--dataset", str(distilled), "--out", str(copy), "--layers", "1,3", "--base", str(trainable_base),
            "--dtype", "float32", "--eval-sequences", "2", "--shard-tokens", "120", "--batch-tokens", "200", "--resume"]
    assert store.main(argv) == 2
    _one_error_line(capsys, unlisted["file"], "damaged")


# -- SIGKILL at every file system step, then --resume ------------------------------------------

def test_killed_selfdistill_resumes_to_the_same_data(trainable_base, few_prompts, tmp_path, monkeypatch):
    import pyarrow.parquet

    model = HiSpecModel.from_pretrained(str(trainable_base), heads="none")  # loaded once, shared by the children
    monkeypatch.setattr(HiSpecModel, "from_pretrained", classmethod(lambda cls, *a, **k: model))
    prompts = tmp_path / "p.txt"
    prompts.write_text("\n".join(PROMPTS[:3]) + "\n")
    out = tmp_path / "data"

    def write() -> None:
        generate(_distill_cfg(trainable_base, prompts, out, max_new_tokens=4, batch_size=2,
                              resume=(out / MANIFEST_NAME).is_file()))

    write()
    reference = sorted(_jobs(out))
    assert len(reference) == 6

    def check() -> None:
        jobs = _jobs(out)
        assert len(jobs) == len(set(jobs)), "a killed run duplicated an answer"
        write()  # resume (or start again) to the end
        assert sorted(_jobs(out)) == reference
        _manifest_is_the_disk(out)
        shutil.rmtree(out)

    shutil.rmtree(out)
    assert every_kill_point(write, check, [(pyarrow.parquet, "write_table")]) >= 10


def test_killed_store_resumes_to_the_same_store(distilled, features, trainable_base, tmp_path):
    out = tmp_path / "features"
    reference = _tree(features)

    def write() -> None:
        build_store(_store_cfg(trainable_base, distilled, out, resume=(out / STORE_MANIFEST).is_file()))

    def check() -> None:
        write()
        assert _tree(out) == reference
        shutil.rmtree(out)

    assert every_kill_point(write, check, [(store, "save_file")]) >= 10


# -- SIGTERM and Ctrl-C in the middle of a long command, then --resume ------------------------------

HOLD = """
import importlib, pathlib, signal, sys, time
signal.signal(signal.SIGINT, signal.default_int_handler)  # as in a terminal (a background job inherits SIG_IGN)
module, target, marker = sys.argv[1:4]
owner_name, name = target.rsplit(":", 1)
owner = importlib.import_module(owner_name)
original, calls = getattr(owner, name), [0]

def held(*args, **kwargs):
    calls[0] += 1
    if calls[0] == 2:  # the first write is on disk: the second waits here until the signal comes
        pathlib.Path(marker).touch()
        time.sleep(600)
    return original(*args, **kwargs)

setattr(owner, name, held)
sys.exit(importlib.import_module(module).main(sys.argv[4:]))
"""


def _signalled(module: str, target: str, argv: list[str], sig: int, tmp_path: Path) -> tuple[int, str]:
    """Run ``module.main(argv)`` in a subprocess whose second call of ``target`` (``module:attribute``)
    waits; send ``sig`` once it waits there (so the command is mid-way on any machine); its exit status
    and standard error."""
    import signal as _signal  # noqa: F401 - the caller passes one of its values
    import subprocess
    import sys
    import time

    marker = tmp_path / f"waiting-{module.rsplit('.', 1)[-1]}"
    proc = subprocess.Popen([sys.executable, "-c", HOLD, module, target, str(marker), *argv],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 300
        while not marker.exists():
            assert proc.poll() is None, proc.stderr.read()
            assert time.monotonic() < deadline, "the command never reached its second write"
            time.sleep(0.05)
        proc.send_signal(sig)
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    return proc.returncode, err


@pytest.mark.parametrize("sig", ["SIGTERM", "SIGINT"])
def test_signalled_commands_resume_to_the_same_result(sig, distilled, features, trainable_base, few_prompts,
                                                      tmp_path):
    """hispec-selfdistill, hispec-store and hispec-train, each stopped by a real signal while it waits
    between two writes: one line and status 143 (SIGTERM) or 130 (Ctrl-C), nothing damaged, and
    ``--resume`` ends with what an uninterrupted run makes."""
    import signal

    import torch

    from hispec_decode import HiSpecAdapter
    from hispec_train.config import load_config
    from hispec_train.trainer import train

    number = getattr(signal, sig)
    status, word = (143, "terminated") if sig == "SIGTERM" else (130, "interrupted")
    base = ["--base", str(trainable_base), "--dtype", "float32"]

    out = tmp_path / "data"
    argv = ["--out", str(out), *base, "--prompts", str(few_prompts), "--max-tokens", str(MAX_TOKENS),
            "--max-new-tokens", "8", "--batch-size", "3", "--shard-records", "2"]
    code, err = _signalled("hispec_train.selfdistill", "pyarrow.parquet:write_table", argv, number, tmp_path)
    assert code == status and f"hispec-selfdistill: {word}" in err and "Traceback" not in err, err[-2000:]
    assert 0 < len(_jobs(out)) < len(_jobs(distilled))
    assert selfdistill.main([*argv, "--resume"]) == 0
    assert sorted(_jobs(out)) == sorted(_jobs(distilled))
    _manifest_is_the_disk(out)

    stored = tmp_path / "features"
    argv = ["--dataset", str(distilled), "--out", str(stored), "--layers", "1,3", *base, "--eval-sequences", "2",
            "--shard-tokens", "120", "--batch-tokens", "200"]
    code, err = _signalled("hispec_train.store", "hispec_train.store:save_file", argv, number, tmp_path)
    assert code == status and f"hispec-store: {word}" in err and "Traceback" not in err, err[-2000:]
    assert store.main([*argv, "--resume"]) == 0
    assert _tree(stored) == _tree(features)

    keys = dict(base=str(trainable_base), features=str(features), heads_layers="1,3", seq_len=16, batch_size=4,
                max_steps=12, eval_every=4, save_every=4, lr=3e-3, warmup_steps=2, report_to="none", eval_batches=2)
    full = train(load_config(None, {k: str(v) for k, v in (keys | {"output_dir": tmp_path / "full"}).items()}))
    run = tmp_path / "run"
    argv = [f"--{k.replace('_', '-')}={v}" for k, v in (keys | {"output_dir": run}).items()]
    code, err = _signalled("hispec_train.cli", "hispec_train.trainer:save_checkpoint", argv, number, tmp_path)
    assert code == status and f"hispec-train: {word}" in err and "Traceback" not in err, err[-2000:]
    assert json.loads((run / "checkpoint" / "trainer_state.json").read_text())["step"] == 4
    from hispec_train import cli as train_cli

    assert train_cli.main([*argv, "--resume=true"]) == 0
    a = HiSpecAdapter.from_pretrained(full / "checkpoint").state_dict_flat()
    b = HiSpecAdapter.from_pretrained(run / "checkpoint").state_dict_flat()
    assert all(torch.allclose(a[k], b[k], atol=1e-6) for k in a)
