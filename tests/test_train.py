"""hispec_train on a tiny random base: loss goes down, resume, export, recipes, bad input."""

from __future__ import annotations

import contextlib

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from hispec_decode import CONFIG_NAME, WEIGHTS_NAME, FingerprintMismatchError, HiSpecAdapter, HiSpecError, HiSpecModel
from hispec_decode.adapter import VLLM_BASE_CONFIG_NAME, ExitSpec
from hispec_vllm import DRAFT_ARCHITECTURE, build_draft_dir
from hispec_decode.models import decoder_for
from hispec_decode.models.loading import load_base
from hispec_train import trainer as trainer_mod
from hispec_train.config import load_config
from hispec_train.data import build_dataset, read_json_records
from hispec_train.distill import LossConfig, distillation_loss
from hispec_train.export import export
from hispec_train.trainer import base_forward, train
from hispec_train.vocab import exit_vocabulary

from conftest import read_by, save_char_tokenizer, save_tiny, write_conversations

ROOT = Path(__file__).resolve().parents[1]


def _free_port() -> str:
    """A port nobody listens on now (fixed ports collide with sockets a previous run left in TIME_WAIT)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return str(sock.getsockname()[1])


def _cfg(base: Path, data: Path, out: Path, **kw) -> object:
    keys = dict(base=str(base), dataset=str(data), heads_layers="1,3", seq_len=32, batch_size=4, max_steps=20,
                eval_every=10, save_every=10, lr=3e-3, warmup_steps=2, max_tokens="none", output_dir=str(out),
                report_to="none", eval_batches=2)
    return load_config(None, {k: str(v) for k, v in (keys | kw).items()})


@pytest.fixture(scope="module")
def data_file(tmp_path_factory) -> Path:
    return write_conversations(tmp_path_factory.mktemp("data") / "conv.jsonl")


@pytest.fixture(scope="module")
def trained_run(trainable_base, data_file, tmp_path_factory) -> Path:
    return train(_cfg(trainable_base, data_file, tmp_path_factory.mktemp("run") / "run", max_steps=30))


def _heldout_loss(base_path: Path, data_file: Path, adapter: HiSpecAdapter) -> float:
    loaded = load_base(str(base_path))
    base = decoder_for(loaded.model, pack_weights=False)
    cfg = _cfg(base_path, data_file, Path("unused"))
    data = build_dataset(str(data_file), loaded.tokenizer, 32, None, cfg.eval_fraction, cfg.seed)
    b = base_forward(loaded.model.model, data.eval, [1, 3])
    with torch.no_grad():
        return float(distillation_loss(base, [adapter.head(1), adapter.head(3)], b.hidden, b.final, data.eval, LossConfig()).sum())


def test_training_lowers_heldout_loss_and_raises_agreement(trained_run, trainable_base, data_file):
    trained = HiSpecAdapter.from_pretrained(trained_run / "checkpoint")
    fresh = HiSpecAdapter.create(decoder_for(load_base(str(trainable_base)).model, pack_weights=False), "x",
                                 [e for e in _specs(trained)])
    assert _heldout_loss(trainable_base, data_file, trained) < 0.9 * _heldout_loss(trainable_base, data_file, fresh)
    report = json.loads((trained_run / "eval.json").read_text())
    last = report["history"][-1]
    assert last["step"] == 30
    assert last["agreement/L3"] > report["untrained"]["agreement/L3"]
    assert (trained_run / "agreement.png").stat().st_size > 1000


@pytest.mark.parametrize("arch,head_type", [("llama", "residual_linear"), ("llama", "decoder_block"),
                                            ("opt", "residual_linear")])  # OPT: project_out before the LM head
def test_bfloat16_base_trains_float32_heads(arch, head_type, trainable_base, data_file, tmp_path):
    """``base_dtype: bfloat16`` halves the frozen base; the heads still train (and are saved) in float32."""
    base = trainable_base
    if arch != "llama":
        base = tmp_path / arch
        save_tiny(arch, base)
        save_char_tokenizer(base)
    run = train(_cfg(base, data_file, tmp_path / "bf16", base_dtype="bfloat16", head_type=head_type,
                     max_steps=10, eval_every=10))
    trained = load_file(str(run / "checkpoint" / WEIGHTS_NAME))
    assert all(t.dtype == torch.float32 for t in trained.values())
    report = json.loads((run / "eval.json").read_text())
    assert report["history"][-1]["agreement/L3"] > report["untrained"]["agreement/L3"]
    with pytest.raises(HiSpecError, match="dtype"):
        _cfg(trainable_base, data_file, tmp_path, base_dtype="int8")


def _specs(adapter):
    from hispec_decode.adapter import ExitSpec

    return [ExitSpec(e.layer, e.role, e.head_type, e.options) for e in adapter.config.exits]


def test_export_round_trip_and_lossless_decoding(trained_run, trainable_base, tmp_path):
    out = tmp_path / "heads"
    adapter = export(trained_run, out)
    assert sorted(p.name for p in out.iterdir()) == sorted([CONFIG_NAME, WEIGHTS_NAME, "README.md", VLLM_BASE_CONFIG_NAME])
    # what vLLM's drafter needs (hispec_vllm, torch-free part): the base's config cut to the draft exit
    draft = build_draft_dir(out, tmp_path / "vllm-draft")
    config = json.loads((draft / "config.json").read_text())
    base_config = HiSpecModel.from_pretrained(str(trainable_base)).base_model.config
    assert config["architectures"] == [DRAFT_ARCHITECTURE] and config["num_hidden_layers"] == 1  # L_d = 1
    assert config["hidden_size"] == base_config.hidden_size and config["num_attention_heads"] == base_config.num_attention_heads
    assert config["hispec_draft"]["target_num_hidden_layers"] == base_config.num_hidden_layers
    with safe_open(str(draft / "model.safetensors"), "pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    assert torch.equal(tensors["hispec_head.proj.weight"], adapter.state_dict_flat()["1.proj.weight"])
    loaded = HiSpecAdapter.from_pretrained(out)
    a, b = adapter.state_dict_flat(), loaded.state_dict_flat()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    card = (out / "README.md").read_text()
    assert "trained head" in card and "fingerprint" in card and loaded.config.training["steps"] == 30
    model = HiSpecModel.from_pretrained(str(trainable_base), heads=str(out))
    assert model.policy(method="hispec").draft_layer == 1 and model.policy(method="hispec").verify_layer == 3
    prompt = model.tokenizer.apply_chat_template([{"role": "user", "content": "What is 3 plus 4?"}],
                                                 add_generation_prompt=True, tokenize=True, return_dict=False)
    ids = torch.tensor([prompt])
    ref = model.base_model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=20, do_sample=False)
    assert model.generate([prompt], max_new_tokens=20).sequences[0] == ref[0, len(prompt):].tolist()[:20]


def test_exit_vocabulary_training_export_and_decoding(trained_run, trainable_base, data_file, tmp_path):
    """The K most frequent training tokens (specials forced in) restrict the early exits: set by
    the trainer (``exit_vocab_size``; a resumed run loads heads with it) or by ``hispec-export --exit-vocab-size``, which
    measures its held-out agreement for the card; decoding with it equals transformers."""
    vocab = exit_vocabulary(torch.tensor([5, 5, 5, 7, 7, 9, 2]), 2, 20, always=[11])
    assert vocab.ids.tolist() == [5, 11] and vocab.coverage == pytest.approx(3 / 7)
    for bad in (0, 20):
        with pytest.raises(HiSpecError, match="exit_vocab_size"):
            exit_vocabulary(torch.tensor([1, 2]), bad, 20)

    run = train(_cfg(trainable_base, data_file, tmp_path / "run", exit_vocab_size=30, max_steps=4, save_every=2))
    run = train(_cfg(trainable_base, data_file, tmp_path / "run", exit_vocab_size=30, max_steps=6, save_every=2, resume="true"))
    trained = HiSpecAdapter.from_pretrained(run / "checkpoint")
    assert all(h.vocab.numel() == 30 for h in trained.heads.values())
    assert 0.5 < trained.config.training["exit_vocab_coverage"] <= 1.0

    out = tmp_path / "heads"
    adapter = export(trained_run, out, exit_vocab_size=40)
    card = (out / "README.md").read_text()
    assert "40-token exit vocabulary" in card and "most frequent tokens" in card
    loaded = HiSpecAdapter.from_pretrained(out)
    assert all(torch.equal(h.vocab, adapter.head(int(k)).vocab) and h.vocab.numel() == 40 for k, h in loaded.heads.items())
    model = HiSpecModel.from_pretrained(str(trainable_base), heads=str(out))
    prompt = model.tokenizer.apply_chat_template([{"role": "user", "content": "Spell 'xylophone' backwards."}],
                                                 add_generation_prompt=True, tokenize=True, return_dict=False)
    ids = torch.tensor([prompt])
    ref = model.base_model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=20, do_sample=False)
    assert model.generate([prompt], max_new_tokens=20).sequences[0] == ref[0, len(prompt):].tolist()[:20]


def test_export_ships_only_the_exits_named(trained_run, trainable_base, tmp_path, capsys):
    """``--layers``: the candidates a run trained stay out of the adapter; the vacated draft role passes
    to the shallowest kept exit, whose weights are the run's; the export decodes equal to transformers."""
    from hispec_train import export as export_cli

    out = tmp_path / "only3"
    assert export_cli.main([str(trained_run), "--out", str(out), "--layers", "3"]) == 0
    shipped = HiSpecAdapter.from_pretrained(out)
    assert [(e.layer, e.role) for e in shipped.config.exits] == [(3, "draft")]
    run = HiSpecAdapter.from_pretrained(trained_run / "checkpoint").state_dict_flat()
    assert shipped.state_dict_flat().keys() == {k for k in run if k.startswith("3.")}
    assert all(torch.equal(v, run[k]) for k, v in shipped.state_dict_flat().items())
    assert "| 1 |" not in (out / "README.md").read_text() and "| 3 | draft |" in (out / "README.md").read_text()
    model = HiSpecModel.from_pretrained(str(trainable_base), heads=str(out))
    prompt = [5, 9, 2, 6, 7, 1, 3]
    ids = torch.tensor([prompt])
    ref = model.base_model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=16, do_sample=False)
    assert model.generate([prompt], max_new_tokens=16, method="hispec").sequences[0] == ref[0, len(prompt):].tolist()
    for arg, match in (("2", "no exit at layer"), ("x", "not an integer")):
        with pytest.raises(SystemExit) if arg == "x" else contextlib.nullcontext():
            assert export_cli.main([str(trained_run), "--out", str(tmp_path / "bad"), "--layers", arg]) == 2
        assert match in capsys.readouterr().err
    assert not (tmp_path / "bad").exists()


def test_export_with_exits_of_another_adapter(trained_run, trainable_base, tmp_path, capsys):
    """``--with-exits``: a run's heads ship beside exits of another adapter for the same base (here a
    feature_attention head at L4 next to the run's L1 draft and L3 intermediate heads); the export
    loads, decodes equal to transformers with every exit in use, and bad combinations are refused."""
    from hispec_decode.adapter import ExitSpec
    from hispec_train import export as export_cli

    decoder = decoder_for(load_base(str(trainable_base)).model, pack_weights=False)
    other = tmp_path / "other"
    made = HiSpecAdapter.create(decoder, str(trainable_base), [ExitSpec(3, "intermediate", "norm"),
                                                               ExitSpec(4, "extra", "feature_attention")])
    with torch.no_grad():
        made.head(4).fuse.weight.normal_(0, 0.05)
    made.save_pretrained(other)
    out = tmp_path / "merged"
    assert export_cli.main([str(trained_run), "--out", str(out), "--with-exits", f"{other}:4"]) == 0
    merged = HiSpecAdapter.from_pretrained(out, decoder=decoder)
    assert [(e.layer, e.role, e.head_type) for e in merged.config.exits] == [
        (1, "draft", "residual_linear"), (3, "intermediate", "residual_linear"), (4, "extra", "feature_attention")]
    assert torch.equal(merged.state_dict_flat()["4.fuse.weight"], made.state_dict_flat()["4.fuse.weight"])
    assert merged.config.training["exits_added_from"] == {"adapter": str(other), "layers": [4],
                                                          "head_types": ["feature_attention"]}
    assert "L4 (feature_attention) head(s) come unchanged" in (out / "README.md").read_text()
    model = HiSpecModel.from_pretrained(str(trainable_base), heads=str(out))
    prompt = [5, 9, 2, 6, 7, 1, 3]
    ids = torch.tensor([prompt])
    ref = model.base_model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=16, do_sample=False)
    for layers in ((4, 6), (1, 4)):  # the added head drafting (no middle level), then checking
        out_ids = model.generate([prompt], max_new_tokens=16, method="hispec", draft_layer=layers[0],
                                 verify_layer=layers[1], num_draft=2, window=3).sequences[0]
        assert out_ids == ref[0, len(prompt):].tolist()
    for arg, match in ((f"{other}", "already have a head"), (f"{other}:5", "no exit at layer"),
                       (f"{other}:x", "must be integers")):
        assert export_cli.main([str(trained_run), "--out", str(tmp_path / "bad"), "--with-exits", arg]) == 2
        assert match in capsys.readouterr().err
    clash = tmp_path / "clash"
    HiSpecAdapter.create(decoder, str(trainable_base), [ExitSpec(2, "intermediate", "norm")]).save_pretrained(clash)
    assert export_cli.main([str(trained_run), "--out", str(tmp_path / "bad"), "--with-exits", str(clash)]) == 2
    assert "intermediate exit is already layer 3" in capsys.readouterr().err
    other_base = tmp_path / "qwen2"
    save_tiny("qwen2", other_base)
    foreign = tmp_path / "foreign"
    HiSpecAdapter.create(decoder_for(load_base(str(other_base)).model, pack_weights=False), str(other_base),
                         [ExitSpec(4, "extra", "norm")]).save_pretrained(foreign)
    assert export_cli.main([str(trained_run), "--out", str(tmp_path / "bad"), "--with-exits", str(foreign)]) == 2
    assert "trained for" in capsys.readouterr().err
    assert not (tmp_path / "bad").exists()


def test_resume_after_kill_matches_uninterrupted_run(trainable_base, data_file, tmp_path, monkeypatch):
    full = train(_cfg(trainable_base, data_file, tmp_path / "full"))
    calls = {"n": 0}
    real = trainer_mod.base_forward

    def dying(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 16:  # mid-way between the checkpoints at steps 10 and 20
            raise KeyboardInterrupt("simulated kill")
        return real(*args, **kwargs)

    monkeypatch.setattr(trainer_mod, "base_forward", dying)
    with pytest.raises(KeyboardInterrupt):
        train(_cfg(trainable_base, data_file, tmp_path / "killed"))
    state = json.loads((tmp_path / "killed" / "checkpoint" / "trainer_state.json").read_text())
    assert state["step"] == 10
    monkeypatch.setattr(trainer_mod, "base_forward", real)
    resumed = train(_cfg(trainable_base, data_file, tmp_path / "killed", resume="true"))
    a = HiSpecAdapter.from_pretrained(full / "checkpoint").state_dict_flat()
    b = HiSpecAdapter.from_pretrained(resumed / "checkpoint").state_dict_flat()
    assert all(torch.allclose(a[k], b[k], atol=1e-6) for k in a)


def test_two_processes_train_the_same_heads_as_one(trainable_base, data_file, tmp_path):
    """2 CPU processes (gloo) with batch B each == 1 process with batch 2B (same global batch)."""
    common = ["--base", str(trainable_base), "--dataset", str(data_file), "--heads-layers", "1,3", "--seq-len", "32",
              "--max-steps", "6", "--eval-every", "6", "--save-every", "6", "--lr", "3e-3", "--warmup-steps", "2",
              "--max-tokens", "none", "--report-to", "none", "--eval-batches", "1"]
    env = os.environ | {"OMP_NUM_THREADS": "1", "ACCELERATE_USE_CPU": "true"}  # what `accelerate launch --cpu` sets
    script = str(ROOT / "scripts" / "train_heads.py")
    subprocess.run([sys.executable, script, *common, "--batch-size", "4", "--output-dir", str(tmp_path / "one")],
                   check=True, env=env, capture_output=True)
    subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", _free_port(),
                    script, *common, "--batch-size", "2", "--output-dir", str(tmp_path / "two")],
                   check=True, env=env, capture_output=True)
    a = HiSpecAdapter.from_pretrained(tmp_path / "one" / "checkpoint").state_dict_flat()
    b = HiSpecAdapter.from_pretrained(tmp_path / "two" / "checkpoint").state_dict_flat()
    assert max(float((a[k] - b[k]).abs().max()) for k in a) < 1e-5


def test_deepspeed_bf16_checkpoints_hold_fp32_master_weights(trainable_base, data_file, tmp_path):
    """Under bf16 mixed precision DeepSpeed's module runs on bf16 copies of the heads; the
    checkpoint must hold its fp32 master weights (ZeRO-3, one CPU process)."""
    pytest.importorskip("deepspeed")
    out = tmp_path / "bf16"
    done = subprocess.run([sys.executable, "-m", "accelerate.commands.launch", "--config_file",
                           str(ROOT / "recipes" / "accelerate" / "zero3.yaml"), "--num_processes", "1",
                           "--mixed_precision", "bf16", "--main_process_port", _free_port(),
                           str(ROOT / "scripts" / "train_heads.py"), "--base", str(trainable_base), "--dataset",
                           str(data_file), "--heads-layers", "1,3", "--seq-len", "32", "--batch-size", "4",
                           "--max-steps", "3", "--eval-every", "3", "--save-every", "3", "--lr", "3e-3",
                           "--max-tokens", "none", "--report-to", "none", "--eval-batches", "1",
                           "--base-dtype", "bfloat16", "--output-dir", str(out)],
                          env=os.environ | {"OMP_NUM_THREADS": "1"}, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    proj = load_file(str(out / "checkpoint" / WEIGHTS_NAME))["3.proj.weight"]
    assert proj.dtype == torch.float32 and torch.count_nonzero(proj) > 0
    assert not torch.equal(proj, proj.bfloat16().float()), "saved weights are bf16 copies, not the fp32 masters"


@pytest.mark.parametrize("stage", [2, 3])
def test_deepspeed_step_and_resume_on_cpu(stage, trainable_base, data_file, tmp_path):
    """recipes/accelerate/zero{2,3}.yaml train on CPU (one process; skipped without DeepSpeed), and
    a resumed run continues from the checkpoint's heads: resumed at a negligible learning rate,
    the heads stay where the checkpoint left them (not where DeepSpeed's copy started)."""
    pytest.importorskip("deepspeed")
    out = tmp_path / f"zero{stage}"
    args = ["--base", str(trainable_base), "--dataset", str(data_file), "--heads-layers", "1,3", "--seq-len", "32",
            "--batch-size", "4", "--eval-every", "4", "--save-every", "2", "--max-tokens", "none",
            "--report-to", "none", "--eval-batches", "1", "--output-dir", str(out)]
    launch = [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
              str(ROOT / "recipes" / "accelerate" / f"zero{stage}.yaml"), "--num_processes", "1",
              "--mixed_precision", "no", "--main_process_port", _free_port(), str(ROOT / "scripts" / "train_heads.py")]
    env = os.environ | {"OMP_NUM_THREADS": "1"}
    done = subprocess.run([*launch, *args, "--max-steps", "4", "--lr", "3e-3"], env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    trained = HiSpecAdapter.from_pretrained(out / "checkpoint").state_dict_flat()
    assert json.loads((out / "checkpoint" / "trainer_state.json").read_text())["step"] == 4
    assert torch.count_nonzero(trained["3.proj.weight"]) > 0, "the zero-initialised head moved"
    report = json.loads((out / "eval.json").read_text())
    assert report["history"][-1]["agreement/L3"] >= report["untrained"]["agreement/L3"]

    done = subprocess.run([*launch, *args, "--max-steps", "6", "--lr", "1e-9", "--resume", "true"], env=env,
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "resumed from" in done.stderr and "optimizer restarts from zero" in done.stderr
    resumed = HiSpecAdapter.from_pretrained(out / "checkpoint").state_dict_flat()
    assert json.loads((out / "checkpoint" / "trainer_state.json").read_text())["step"] == 6
    assert all(torch.allclose(resumed[k], trained[k], atol=1e-6) for k in trained)


def test_zero3_shards_the_base_across_two_processes(trainable_base, tmp_path):
    """Two CPU processes (gloo): each holds half of the base, and the sharded base computes the
    same hidden states and exit logits as the whole model."""
    pytest.importorskip("deepspeed")
    env = os.environ | {"OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
                           _free_port(), str(ROOT / "tests" / "zero3_worker.py"), str(trainable_base), str(tmp_path)],
                          env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    for rank in (0, 1):
        report = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert report["partitioned"] and report["held_fraction"] <= 0.55, report
        assert report["max_diff"] < 1e-6 and report["logits_diff"] < 1e-6, report


def test_every_recipe_validates():
    recipes = sorted((ROOT / "recipes").glob("*.yaml"))
    assert {r.stem for r in recipes} >= {"smollm2-135m", "llama-3-8b", "llama-2-7b", "codellama-34b", "qwen3-8b",
                                         "qwen2.5-7b", "opt-6.7b"}
    for recipe in recipes:
        cfg = load_config(recipe, {})
        # the layer curve's heads at every second layer; the feature-head recipe trains the draft exit only;
        # Gemma-3-270M's and Qwen2.5-Coder's train several candidate exits (the tuner pairs them; their layer curve)
        candidates = {"gemma3-270m": 4, "qwen2.5-coder-0.5b": 5, "qwen2.5-coder-1.5b": 5}
        expected = (14 if recipe.stem.endswith("-curve") else 1 if recipe.stem.endswith("-feature")
                    else candidates.get(recipe.stem, 2))
        assert len(cfg.heads_layers) == expected, recipe.stem
    override = load_config(ROOT / "recipes" / "smollm2-135m.yaml", {"max_steps": "7", "heads_layers": "2,6"})
    assert override.max_steps == 7 and override.heads_layers == [2, 6]


def test_bad_input_fails_early(trainable_base, data_file, tmp_path):
    with pytest.raises(HiSpecError, match="unknown head type"):
        _cfg(trainable_base, data_file, tmp_path / "r", head_type="mixture")
    with pytest.raises(HiSpecError, match="increasing"):
        _cfg(trainable_base, data_file, tmp_path / "r", heads_layers="3,1")
    with pytest.raises(HiSpecError, match="unknown config keys"):
        load_config(None, {"learning_rate": "1"})
    with pytest.raises(HiSpecError, match="out of range"):
        train(_cfg(trainable_base, data_file, tmp_path / "r", heads_layers="2,6"))
    with pytest.raises(HiSpecError, match="not found"):
        train(_cfg(trainable_base, tmp_path / "missing.jsonl", tmp_path / "r"))
    empty = tmp_path / "empty.jsonl"
    empty.write_text('{"conversations": [{"from": "human", "value": "hi"}]}\n{"other": 1}\n')
    with pytest.raises(HiSpecError, match="no usable records"):
        train(_cfg(trainable_base, empty, tmp_path / "r"))


def test_heads_trained_for_another_base_are_refused(trained_run, tmp_path):
    out = tmp_path / "heads"
    export(trained_run, out)
    other = tmp_path / "other"
    save_tiny("llama", other, seed=3)
    save_char_tokenizer(other)
    with pytest.raises(FingerprintMismatchError, match="trained for base"):
        HiSpecModel.from_pretrained(str(other), heads=str(out))


def test_truncated_json_array_is_read_record_by_record(tmp_path):
    path = tmp_path / "cut.json"
    records = [{"id": i, "conversations": [{"from": "gpt", "value": "x" * i}]} for i in range(5)]
    text = json.dumps(records, indent=2)
    path.write_text(text[: len(text) - 30])  # cut inside the last record
    got, skipped = read_json_records(path)
    assert [r["id"] for r in got] == [0, 1, 2, 3] and skipped == 1


def test_decoder_block_heads_train_export_and_decode_losslessly(trainable_base, data_file, tmp_path):
    """The heavier head: a copy of the next layer with its own cache entries."""
    run = train(_cfg(trainable_base, data_file, tmp_path / "run", head_type="decoder_block", max_steps=10,
                     eval_every=10, save_every=5))
    report = json.loads((run / "eval.json").read_text())
    assert report["history"][-1]["agreement/L3"] > report["untrained"]["agreement/L3"]
    out = tmp_path / "heads"
    adapter = export(run, out)
    assert adapter.head(1).options() == {"source_layer": 1} and "1.block.mlp.down_proj.weight" in adapter.state_dict_flat()
    with pytest.raises(HiSpecError, match="load it with the base"):
        HiSpecAdapter.from_pretrained(out)
    model = HiSpecModel.from_pretrained(str(trainable_base), heads=str(out))
    prompts = [[5, 6, 7, 8], [9], [10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20]]
    for prompt in prompts:
        ids = torch.tensor([prompt])
        ref = model.base_model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=24, do_sample=False)
        for method in ("self_spec", "hispec"):
            out_ = model.generate([prompt], max_new_tokens=24, **read_by(method, window=3, num_draft=3))
            assert out_.sequences[0] == ref[0, len(prompt):].tolist(), method
    batched = model.generate(prompts, max_new_tokens=24, method="hispec", window=3, num_draft=3)
    assert batched.sequences == [model.generate([p], max_new_tokens=24, method="hispec", window=3,
                                                num_draft=3).sequences[0] for p in prompts]


def test_init_heads_continue_trained_heads_on_new_data(trained_run, trainable_base, data_file, tmp_path):
    """``init_heads`` starts a run from trained heads (an export or a run directory), exit
    vocabularies included; other exits, another exit-vocabulary size or another base are refused."""
    from hispec_train.checkpoint import init_heads

    vocab_run = train(_cfg(trainable_base, data_file, tmp_path / "vocab", exit_vocab_size=30, max_steps=4))
    exported = tmp_path / "exported"
    export(vocab_run, exported)
    saved = HiSpecAdapter.from_pretrained(exported)
    for source in (exported, vocab_run):  # an export, or the run directory's checkpoint
        cont = train(_cfg(trainable_base, data_file, tmp_path / f"cont-{source.name}", exit_vocab_size=30, max_steps=1,
                          lr=1e-9, warmup_steps=0, init_heads=source))
        heads = HiSpecAdapter.from_pretrained(cont / "checkpoint")
        assert heads.config.training["initialised_from"] == {"adapter": str(source), "steps": 4 if source == exported else None}
        for layer in (1, 3):
            assert torch.equal(heads.head(layer).vocab, saved.head(layer).vocab)
            for k, v in saved.head(layer).state_dict().items():
                torch.testing.assert_close(heads.head(layer).state_dict()[k], v, rtol=0, atol=1e-6)

    export(tmp_path / f"cont-{vocab_run.name}", tmp_path / "cont-export")  # a run directory's checkpoint has no step count
    assert f"Training: 1 steps continued from the heads `{vocab_run}`" in (tmp_path / "cont-export" / "README.md").read_text()
    export(tmp_path / f"cont-{exported.name}", tmp_path / "cont-export-2")
    card = (tmp_path / "cont-export-2" / "README.md").read_text()
    assert f"Training: 1 steps continued from the 4-step heads `{exported}`" in card

    # a few steps from trained heads keep their held-out loss; the same steps from scratch do not reach it
    warm = train(_cfg(trainable_base, data_file, tmp_path / "warm", max_steps=2, lr=3e-4, init_heads=trained_run))
    cold = train(_cfg(trainable_base, data_file, tmp_path / "cold", max_steps=2, lr=3e-4))
    losses = {name: _heldout_loss(trainable_base, data_file, HiSpecAdapter.from_pretrained(run / "checkpoint"))
              for name, run in (("warm", warm), ("cold", cold), ("trained", trained_run))}
    assert losses["warm"] < 1.05 * losses["trained"] and losses["warm"] < 0.9 * losses["cold"], losses

    loaded = load_base(str(trainable_base))
    decoder = decoder_for(loaded.model, pack_weights=False)
    fresh = HiSpecAdapter.create(decoder, loaded.name, [ExitSpec(1, "draft", "residual_linear", {}),
                                                        ExitSpec(2, "intermediate", "residual_linear", {})])
    fp = trainer_mod.compute_fingerprint(loaded.model)
    with pytest.raises(HiSpecError, match="exits .* are .* but this run trains"):
        init_heads(str(exported), fresh, decoder, fp, loaded.name, 30)
    with pytest.raises(HiSpecError, match="init_heads: .* is neither an exported adapter"):
        train(_cfg(trainable_base, data_file, tmp_path / "bad0", init_heads=tmp_path / "missing"))
    with pytest.raises(HiSpecError, match="exit_vocab_size=40"):
        train(_cfg(trainable_base, data_file, tmp_path / "bad", exit_vocab_size=40, init_heads=exported))
    other = tmp_path / "other"
    save_tiny("llama", other, seed=3)
    save_char_tokenizer(other)
    with pytest.raises(FingerprintMismatchError, match="trained for base"):
        train(_cfg(other, data_file, tmp_path / "bad2", exit_vocab_size=30, init_heads=exported))
