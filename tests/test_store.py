"""Self-distilled data, the feature store, and heads trained from it (tiny random Llama)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from hispec_decode import HiSpecAdapter, HiSpecError, HiSpecModel
from hispec_decode.models import decoder_for, load_base
from hispec_train.config import load_config
from hispec_train.distill import LossConfig, distillation_loss
from hispec_train.selfdistill import SelfDistillConfig, generate, plan_jobs
from hispec_train.store import STORE_MANIFEST, StoreConfig, StoreManifest, build_store
from hispec_train.store_data import FeatureStore
from hispec_train.trainer import base_forward, train
from hispec_train.vocab import exit_vocabulary

from conftest import TEXT_PROMPTS as PROMPTS
from conftest import read_by

def _distill_cfg(base: Path, prompts: Path, out: Path, **kw) -> SelfDistillConfig:
    keys = dict(out=str(out), base=str(base), dtype="float32", prompts=[str(prompts)], max_tokens=400,
                max_new_tokens=24, batch_size=5, shard_records=4)
    return SelfDistillConfig(**(keys | kw))


@pytest.fixture(scope="module")
def distilled(trainable_base, prompt_file, tmp_path_factory) -> Path:
    return generate(_distill_cfg(trainable_base, prompt_file, tmp_path_factory.mktemp("sd") / "data", max_tokens=10**6))


def _records(directory: Path) -> list[dict]:
    import datasets

    ds = datasets.load_dataset("parquet", data_files=str(directory / "shard-*.parquet"), split="train")
    return list(ds)


def test_selfdistilled_answers_are_the_base_own_outputs(distilled, trainable_base):
    records = _records(distilled)
    assert len(records) == 2 * len(PROMPTS)  # every prompt, greedy and sampled
    assert sorted(r["job"] for r in records) == list(range(2 * len(PROMPTS)))
    assert sum(r["do_sample"] for r in records) == len(PROMPTS)
    for text in PROMPTS:  # each prompt once greedy, once sampled
        assert sorted(r["do_sample"] for r in records if r["messages"][0]["content"] == text) == [False, True]
    model = HiSpecModel.from_pretrained(str(trainable_base), heads="none")
    for r in records[:6]:
        prompt = r["input_ids"][: r["prompt_tokens"]]
        assert len(r["input_ids"]) == r["prompt_tokens"] + r["new_tokens"]
        if not r["do_sample"]:  # greedy answers equal plain greedy decoding of the prompt
            out = model.generate([prompt], max_new_tokens=24, method="autoregressive").sequences[0]
            assert r["input_ids"][r["prompt_tokens"]:] == out
    manifest = json.loads((distilled / "hispec_selfdistill.json").read_text())
    assert manifest["new_tokens"] == sum(r["new_tokens"] for r in records)


def test_selfdistill_stops_at_the_token_cap_and_resumes(trainable_base, prompt_file, tmp_path):
    out = tmp_path / "data"
    generate(_distill_cfg(trainable_base, prompt_file, out, max_tokens=60))
    first = _records(out)
    assert 60 <= sum(r["new_tokens"] for r in first) < 60 + 5 * 24  # at most the requests in flight overshoot
    generate(_distill_cfg(trainable_base, prompt_file, out, max_tokens=200, resume=True))
    second = _records(out)
    jobs = [r["job"] for r in second]
    assert len(jobs) == len(set(jobs)) > len(first)  # nothing written twice
    assert {r["job"]: r["input_ids"] for r in first}.items() <= {r["job"]: r["input_ids"] for r in second}.items()
    files = lambda: {f.name: (f.stat().st_ino, f.stat().st_mtime_ns, f.read_bytes()) for f in out.iterdir()}  # noqa: E731
    before = files()
    generate(_distill_cfg(trainable_base, prompt_file, out, max_tokens=200, resume=True))  # complete: a no-op
    assert files() == before, "resuming a complete data set rewrites nothing"
    with pytest.raises(HiSpecError, match="temperature"):
        generate(_distill_cfg(trainable_base, prompt_file, out, temperature=0.5, resume=True))
    with pytest.raises(HiSpecError, match="not empty"):
        generate(_distill_cfg(trainable_base, prompt_file, out))


def test_job_plan_alternates_greedy_and_sampled():
    jobs = plan_jobs([("x", f"p{i}") for i in range(10)], seed=3)
    assert len(jobs) == 20 and [j.job for j in jobs] == list(range(20))
    first, second = jobs[:10], jobs[10:]
    assert sum(j.do_sample for j in first) == 5
    assert {(j.prompt_index, not j.do_sample) for j in first} == {(j.prompt_index, j.do_sample) for j in second}


@pytest.fixture(scope="module")
def store(distilled, trainable_base, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("store") / "features"
    build_store(StoreConfig(str(distilled), str(out), [1, 2, 3], base=str(trainable_base), dtype="float32",
                            eval_sequences=6, shard_tokens=300, batch_tokens=200))
    return out


def test_store_holds_the_base_states_of_every_sequence(store, distilled, trainable_base):
    manifest = StoreManifest.load(store)
    hidden = load_base(str(trainable_base)).model.config.hidden_size
    assert manifest.bytes_per_token == 4 * hidden * 4 + 4  # 3 layers + final, float32, + the token id
    assert len(manifest.shards["train"]) > 1 and manifest.shards["eval"]
    total = sum(len(r["input_ids"]) for r in _records(distilled))
    assert manifest.tokens("train") + manifest.tokens("eval") == total
    loaded = load_base(str(trainable_base))
    shard = load_file(str(store / manifest.shards["train"][1]["file"]))
    offsets = shard["offsets"]
    for i in range(len(offsets) - 1):  # each stored sequence equals a forward of that sequence alone
        ids = shard["input_ids"][offsets[i] : offsets[i + 1]].long()[None]
        ref = base_forward(loaded.model.model, ids, [1, 2, 3])
        for layer, h in zip([1, 2, 3], ref.hidden):
            torch.testing.assert_close(shard[f"hidden.{layer}"][offsets[i] : offsets[i + 1]], h[0], atol=1e-5, rtol=1e-4)
        torch.testing.assert_close(shard["final"][offsets[i] : offsets[i + 1]], ref.final[0], atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("has_bf16", [True, False])
def test_bf16_runs_in_float32_only_where_the_cpu_emulates_it(has_bf16, monkeypatch):
    from hispec_decode import machine

    monkeypatch.setattr(machine, "mkldnn_bf16", lambda: has_bf16)
    assert machine.compute_dtype(torch.bfloat16, "cpu") == (torch.bfloat16 if has_bf16 else torch.float32)
    assert machine.compute_dtype(torch.float32, "cpu") == torch.float32
    assert machine.compute_dtype(torch.float16, "cpu") == torch.float16


def test_a_bf16_store_without_bf16_kernels_holds_the_widened_forward(distilled, trainable_base, tmp_path, monkeypatch):
    """Where torch would emulate bf16 matmuls the store runs the bf16 weights widened to float32 and stores
    its states in bf16: the float32 forward of the bf16 weights, rounded once."""
    from hispec_decode import machine

    monkeypatch.setattr(machine, "mkldnn_bf16", lambda: False)
    out = tmp_path / "features"
    build_store(StoreConfig(str(distilled), str(out), [2], base=str(trainable_base), dtype="bfloat16",
                            eval_sequences=2, shard_tokens=300, batch_tokens=200, max_tokens=300))
    manifest = StoreManifest.load(out)
    assert manifest.dtype == "bfloat16"
    shard = load_file(str(out / manifest.shards["train"][0]["file"]))
    assert shard["hidden.2"].dtype == shard["final"].dtype == torch.bfloat16
    widened = load_base(str(trainable_base), "bfloat16").model.float()
    ids = shard["input_ids"][: int(shard["offsets"][1])].long()[None]
    ref = base_forward(widened.model, ids, [2])
    n = ids.shape[1]
    # rounded once to bf16 (a batched forward may differ from this one's float32 in the last bits)
    torch.testing.assert_close(shard["hidden.2"][:n].float(), ref.hidden[0][0], atol=1e-5, rtol=2**-8)
    torch.testing.assert_close(shard["final"][:n].float(), ref.final[0], atol=1e-5, rtol=2**-8)


def test_store_resume_rewrites_only_missing_shards(store, distilled, trainable_base, tmp_path):
    copy = tmp_path / "features"
    import shutil

    shutil.copytree(store, copy)
    manifest = json.loads((copy / STORE_MANIFEST).read_text())
    lost = manifest["shards"]["train"].pop()
    (copy / lost["file"]).unlink()
    (copy / STORE_MANIFEST).write_text(json.dumps(manifest))
    kept = (copy / manifest["shards"]["train"][0]["file"]).stat().st_mtime_ns
    build_store(StoreConfig(str(distilled), str(copy), [1, 2, 3], base=str(trainable_base), dtype="float32",
                            eval_sequences=6, shard_tokens=300, batch_tokens=200, resume=True))
    assert (copy / manifest["shards"]["train"][0]["file"]).stat().st_mtime_ns == kept
    assert (copy / lost["file"]).read_bytes() == (store / lost["file"]).read_bytes()
    with pytest.raises(HiSpecError, match="layers"):
        build_store(StoreConfig(str(distilled), str(copy), [1, 3], base=str(trainable_base), dtype="float32",
                                eval_sequences=6, shard_tokens=300, batch_tokens=200, resume=True))
    with pytest.raises(HiSpecError, match="shard_tokens"):  # other shard boundaries would duplicate or drop sequences
        build_store(StoreConfig(str(distilled), str(copy), [1, 2, 3], base=str(trainable_base), dtype="float32",
                                eval_sequences=6, shard_tokens=500, batch_tokens=200, resume=True))


def test_a_larger_max_tokens_grows_the_store_to_the_one_built_whole(store, distilled, trainable_base, tmp_path):
    def build(out, **kw):
        return build_store(StoreConfig(str(distilled), str(out), [1, 2, 3], base=str(trainable_base), dtype="float32",
                                       eval_sequences=6, shard_tokens=300, batch_tokens=200, **kw))

    whole = StoreManifest.load(store)
    small = build(tmp_path / "grown", max_tokens=450)  # one whole shard and one cut short
    assert len(small.shards["train"]) == 2 and small.shards["train"][1]["tokens"] < whole.shards["train"][1]["tokens"]
    first = (tmp_path / "grown" / small.shards["train"][0]["file"]).stat().st_mtime_ns
    with pytest.raises(HiSpecError, match="max_tokens"):  # a store does not shrink
        build(tmp_path / "grown", max_tokens=300, resume=True)
    grown = build(tmp_path / "grown", resume=True)  # no cap: the whole data set
    assert grown.shards == whole.shards and grown.plan == whole.plan
    assert (tmp_path / "grown" / small.shards["train"][0]["file"]).stat().st_mtime_ns == first  # kept
    for entry in whole.shards["train"]:
        assert (tmp_path / "grown" / entry["file"]).read_bytes() == (store / entry["file"]).read_bytes()


def test_a_growth_killed_after_its_manifest_computes_the_short_shard_again(store, distilled, trainable_base, tmp_path):
    def build(**kw):
        return build_store(StoreConfig(str(distilled), str(tmp_path / "s"), [1, 2, 3], base=str(trainable_base),
                                       dtype="float32", eval_sequences=6, shard_tokens=300, batch_tokens=200, **kw))

    small = build(max_tokens=450)
    manifest = json.loads((tmp_path / "s" / STORE_MANIFEST).read_text())
    short = manifest["shards"]["train"].pop()  # as the grown run's first save leaves it, cap raised
    manifest["plan"]["max_tokens"] = None
    (tmp_path / "s" / STORE_MANIFEST).write_text(json.dumps(manifest))
    grown = build(resume=True)
    assert grown.shards == StoreManifest.load(store).shards
    assert (tmp_path / "s" / short["file"]).read_bytes() == (store / short["file"]).read_bytes()
    assert small.shards["train"][1]["tokens"] < grown.shards["train"][1]["tokens"]


def test_store_refuses_missing_layers_other_bases_and_damaged_shards(store, tmp_path):
    with pytest.raises(HiSpecError, match="not \\[4\\]"):
        FeatureStore(store, [1, 4], "train")
    other = dict(StoreManifest.load(store).fingerprint)
    other["signature"] = [x + 1.0 for x in other["signature"]]
    with pytest.raises(HiSpecError, match="another base"):
        FeatureStore(store, [1, 3], "train", fingerprint=other)
    same = dict(StoreManifest.load(store).fingerprint)  # the same base in another dtype: within tolerance
    same["signature"] = [float(torch.tensor(x).bfloat16()) for x in same["signature"]]
    FeatureStore(store, [1, 3], "train", fingerprint=same)
    import shutil

    broken = tmp_path / "broken"
    shutil.copytree(store, broken)
    manifest = StoreManifest.load(broken)
    shard = broken / manifest.shards["train"][0]["file"]
    whole = shard.read_bytes()
    for damage in (b"not safetensors", whole[: len(whole) - 8], whole[:4]):  # garbage, cut short in the data, the header
        shard.write_bytes(damage)
        with pytest.raises(HiSpecError, match="damaged"):
            FeatureStore(broken, [1, 3], "train")


def test_mapped_shards_hold_what_safetensors_reads(store):
    from safetensors import safe_open

    from hispec_train.store_data import mapped_tensors

    for entry in StoreManifest.load(store).shards["train"]:
        path = store / entry["file"]
        with safe_open(str(path), framework="pt") as f:
            keys = list(f.keys())
            mapped = mapped_tensors(path, keys)
            for key in keys:
                expected = f.get_tensor(key)
                assert mapped[key].dtype == expected.dtype and torch.equal(mapped[key], expected), key
        before = path.read_bytes()
        mapped["final"].zero_()  # a private map: a write stays in this process, the store is untouched
        assert path.read_bytes() == before


def test_store_batch_equals_a_base_forward_of_the_same_window(store, trainable_base):
    fs = FeatureStore(store, [1, 3], "train")
    batch = fs.batch(torch.Generator().manual_seed(0), 3, 16)
    loaded = load_base(str(trainable_base))
    for r in range(3):
        n = int(batch.valid[r].sum())
        assert n >= 1 and not batch.valid[r, n:].any()
    # a window that starts a sequence is exactly the base's forward of those tokens
    w = fs.window(0, 0, 10)
    ref = base_forward(loaded.model.model, w.input_ids, [1, 3])
    torch.testing.assert_close(w.hidden[1], ref.hidden[1], atol=1e-5, rtol=1e-4)


def _store_cfg(base: Path, store: Path, out: Path, **kw):
    keys = dict(base=str(base), features=str(store), heads_layers="1,3", seq_len=16, batch_size=4, max_steps=30,
                eval_every=15, save_every=15, lr=3e-3, warmup_steps=2, output_dir=str(out), report_to="none",
                eval_batches=4)
    return load_config(None, {k: str(v) for k, v in (keys | kw).items()})


def test_heads_train_from_the_store_and_resume_identically(store, trainable_base, tmp_path, monkeypatch):
    run = train(_store_cfg(trainable_base, store, tmp_path / "run"))
    report = json.loads((run / "eval.json").read_text())
    last = report["history"][-1]
    for layer in (1, 3):
        assert last[f"agreement/L{layer}"] > report["untrained"][f"agreement/L{layer}"]
        curve = report["curve"][str(layer)]
        assert curve["top4"] >= curve["top1"] == last[f"agreement/L{layer}"]
        cal = curve["calibration"]
        assert cal[0]["coverage"] == 1.0 and cal[0]["precision"] == pytest.approx(curve["top1"])
        assert all(a["coverage"] >= b["coverage"] for a, b in zip(cal, cal[1:]))
    assert last["train_tokens_per_second"] > 0
    calls, real = {"n": 0}, FeatureStore.batch

    def dying(self, *args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 20:  # between the checkpoints at steps 15 and 30
            raise KeyboardInterrupt("simulated kill")
        return real(self, *args, **kwargs)

    monkeypatch.setattr(FeatureStore, "batch", dying)
    with pytest.raises(KeyboardInterrupt):
        train(_store_cfg(trainable_base, store, tmp_path / "killed"))
    monkeypatch.setattr(FeatureStore, "batch", real)
    resumed = train(_store_cfg(trainable_base, store, tmp_path / "killed", resume="true"))
    a = HiSpecAdapter.from_pretrained(run / "checkpoint").state_dict_flat()
    b = HiSpecAdapter.from_pretrained(resumed / "checkpoint").state_dict_flat()
    assert all(torch.allclose(a[k], b[k], atol=1e-6) for k in a)
    with pytest.raises(HiSpecError, match="not \\[4\\]"):
        train(_store_cfg(trainable_base, store, tmp_path / "bad", heads_layers="1,2,4"))


@pytest.mark.parametrize("temperature", [1.0, 2.0])
def test_exit_vocabulary_loss_is_kl_over_the_vocabulary(temperature, store, trainable_base):
    """With loss_vocab=exit, the loss is T^2 KL(teacher renormalised over V || head over V), at
    temperature T, and so is its gradient (the loss is computed as -H(p) - p.s + logsumexp(s))."""
    loaded = load_base(str(trainable_base))
    decoder = decoder_for(loaded.model, pack_weights=False)
    fs = FeatureStore(store, [1], "train")
    batch = fs.batch(torch.Generator().manual_seed(1), 2, 12)
    vocab = exit_vocabulary(batch.input_ids, 20, decoder.vocab_size).ids
    adapter = HiSpecAdapter.create(decoder, "tiny", [__import__("hispec_decode").ExitSpec(1, "draft", "residual_linear")])
    head = adapter.head(1)
    head.set_vocab(vocab)
    with torch.no_grad():
        next(head.parameters()).normal_(0, 0.05)  # away from the zero init, so the gradient is not trivial
    params = [p for p in head.parameters() if p.requires_grad]
    cfg = LossConfig(temperature=temperature, exit_vocab=True)
    loss = distillation_loss(decoder, [head], batch.hidden, batch.final, batch.input_ids, cfg, batch.valid)
    grads = torch.autograd.grad(loss.sum(), params)
    teacher = F.log_softmax(decoder.lm_logits(batch.final)[..., vocab] / temperature, -1)
    student = F.log_softmax(head(batch.hidden[0], decoder)[..., vocab] / temperature, -1)
    kl = (teacher.exp() * (teacher - student)).sum(-1) * temperature**2
    expected = (kl * batch.valid).sum() / batch.valid.sum()
    torch.testing.assert_close(loss[0], expected, atol=1e-5, rtol=1e-4)
    for got, want in zip(grads, torch.autograd.grad(expected, params)):
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-4)
    full = distillation_loss(decoder, [head], batch.hidden, batch.final, batch.input_ids, LossConfig(), batch.valid)
    assert not torch.allclose(full, loss)  # the full-vocabulary loss is another quantity


@pytest.mark.parametrize("head_type,options", [("deep_context", "{}"), ("decoder_block", '{"attention_only": true}'),
                                                ("feature_attention", '{"train_steps": 2}')])
def test_new_head_types_train_from_the_store_export_and_decode_losslessly(head_type, options, store, trainable_base,
                                                                          tmp_path, distilled):
    from hispec_train.export import export

    windows = "start" if head_type == "feature_attention" else "random"  # attention heads: whole sequences
    run = train(_store_cfg(trainable_base, store, tmp_path / "run", head_type=head_type, head_options=options,
                           max_steps=20, eval_every=20, save_every=20, lr=1e-3, windows=windows))
    report = json.loads((run / "eval.json").read_text())
    last = report["history"][-1]
    for layer in (1, 3):
        assert last[f"agreement/L{layer}"] > report["untrained"][f"agreement/L{layer}"]
        assert (f"agreement_true_context/L{layer}" in last) == (head_type != "decoder_block")
        assert 0 <= last[f"acceptance_step4/L{layer}"] <= 1 and f"chain_accepted/L{layer}" in last
    adapter = export(run, tmp_path / "heads")
    assert adapter.head(1).head_type == head_type and adapter.head(1).options() == {
        "decoder_block": {"source_layer": 1, "attention_only": True}, "deep_context": {"context_size": 64},
        "feature_attention": {"source_layer": 1, "context_size": 64, "train_steps": 2}}[head_type]
    model = HiSpecModel.from_pretrained(str(trainable_base), heads=str(tmp_path / "heads"))
    if head_type == "deep_context":  # the vocabulary level's ranking: the base's own self-distilled answers, counted
        _check_exported_ranking(model, distilled, tmp_path / "heads")
    prompts = [[5, 6, 7, 8], [9], [10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20]]
    for prompt in prompts:
        ids = torch.tensor([prompt])
        ref = model.base_model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=24, do_sample=False)
        for method in ("self_spec", "hispec"):
            out = model.generate([prompt], max_new_tokens=24, **read_by(method, window=3, num_draft=3))
            assert out.sequences[0] == ref[0, len(prompt):].tolist(), method
    if head_type == "feature_attention":  # measured beside the untrained exits, as drafting needs it
        from hispec_train.eval_heads import main as eval_main

        assert eval_main(["--heads", str(tmp_path / "heads"), "--features", str(store), "--base", str(trainable_base),
                          "--out", str(tmp_path / "cmp"), "--seq-len", "16"]) == 0
        (result,) = json.loads((tmp_path / "cmp.json").read_text())
        curve = result["curve"]["1"]
        assert len(curve["acceptance_per_step"]) == 4 and curve["top4"] >= curve["top1"] > 0
        assert result["rates"]["agreement_step1/L1"] == curve["top1"] and (tmp_path / "cmp.png").is_file()


def _check_exported_ranking(model: HiSpecModel, distilled: Path, heads: Path) -> None:
    from hispec_decode.adapter.vocabulary import VOCAB_NAME, load_weights, ranking

    vocab_size = model.decoder.vocab_size
    counts = torch.zeros(vocab_size)
    for r in _records(distilled):
        for t in r["input_ids"][r["prompt_tokens"]:]:
            counts[t] += 1
    assert counts.sum() == json.loads((distilled / "hispec_selfdistill.json").read_text())["new_tokens"]
    assert model.adapter.vocab_path == heads / VOCAB_NAME
    assert torch.equal(load_weights(heads / VOCAB_NAME, vocab_size), counts)
    assert torch.equal(model.token_ranking(), ranking(counts))  # no calibration decode: the shipped ranking


def test_export_vocab_from_checks_its_data_set(store, trainable_base, tmp_path, capsys):
    from hispec_train.export import main as export_main

    run = train(_store_cfg(trainable_base, store, tmp_path / "run", max_steps=2, eval_every=2, save_every=2))
    assert export_main([str(run), "--out", str(tmp_path / "heads"), "--vocab-from", str(store)]) != 0
    err = capsys.readouterr().err
    assert "not a self-distilled data set" in err and "Traceback" not in err
    assert not (tmp_path / "heads").exists()  # nothing half-written


def test_layer_curve_from_a_run_with_heads_at_every_layer(store, trainable_base, tmp_path):
    from hispec_decode.tuning.curve import choose_layers, read_curve, self_spec_speedup
    from hispec_train.curve import main as curve_main

    run = train(_store_cfg(trainable_base, store, tmp_path / "run", heads_layers="1,2,3", max_steps=10,
                           eval_every=10, save_every=10))
    assert curve_main([str(run), "--out", str(tmp_path / "curve"), "--base", str(trainable_base),
                       "--dtype", "float32"]) == 0
    curve = read_curve(tmp_path / "curve.json")
    assert sorted(curve) == [1, 2, 3] and (tmp_path / "curve.png").stat().st_size > 0
    for layer, entry in curve.items():
        assert 0 < entry["cost"] < 1 and 0 <= entry["top1"] <= entry["top4"] <= 1
        assert entry["self_spec_estimate"] == self_spec_speedup(entry["top1"], entry["cost"])[0]
    assert curve[1]["cost"] < curve[3]["cost"]
    assert choose_layers(curve, [1, 2, 3], count=2) == sorted(
        sorted([1, 2, 3], key=lambda l: -curve[l]["self_spec_estimate"])[:2])
    with pytest.raises(HiSpecError, match="covers none"):
        choose_layers(curve, [5])


def test_self_spec_estimate():
    from hispec_decode.tuning.curve import self_spec_speedup

    assert self_spec_speedup(0.0, 0.1) == (1.0, 0)  # nothing accepted: never draft
    speedup, k = self_spec_speedup(0.8, 0.1)
    assert k > 1 and speedup == pytest.approx(sum(0.8**i for i in range(k + 1)) / (1 + 0.1 * k))


def test_selfdistilled_records_train_with_their_exact_ids(distilled, trainable_base):
    from hispec_train.data import build_dataset, load_records, tokenize_records

    records, skipped = load_records(str(distilled))
    assert skipped == 0 and len(records) == 2 * len(PROMPTS)
    tok = load_base(str(trainable_base)).tokenizer
    ids, used, _ = tokenize_records(tok, records)
    assert used == len(records) and ids == [t for r in records for t in r["input_ids"]]  # no re-tokenisation
    data = build_dataset(str(distilled), tok, 16, None, 0.1, 0)
    assert (len(data.train) + len(data.eval)) * 16 == len(ids) // 16 * 16


def test_selfdistill_resume_refuses_a_changed_prompt_file(trainable_base, prompt_file, tmp_path):
    prompts = tmp_path / "p.txt"
    prompts.write_text(prompt_file.read_text())
    out = tmp_path / "data"
    generate(_distill_cfg(trainable_base, prompts, out, max_tokens=30))
    prompts.write_text("Something else entirely?\n" + prompt_file.read_text())
    with pytest.raises(HiSpecError, match="prompts .* changed"):
        generate(_distill_cfg(trainable_base, prompts, out, max_tokens=60, resume=True))


def test_eval_heads_checks_every_adapter_against_the_store_before_any_work(store, trainable_base, tmp_path, monkeypatch):
    from hispec_decode import ExitSpec
    from hispec_train import eval_heads

    model = HiSpecModel.from_pretrained(str(trainable_base), heads="none")
    HiSpecAdapter.create(model.decoder, str(trainable_base), [ExitSpec(1, "draft", "norm")]).save_pretrained(tmp_path / "a")
    HiSpecAdapter.create(model.decoder, str(trainable_base), [ExitSpec(4, "draft", "norm")]).save_pretrained(tmp_path / "b")

    def no_work(*args, **kwargs):
        raise AssertionError("an adapter was evaluated before every input was checked")

    monkeypatch.setattr(eval_heads, "evaluate_adapter", no_work)
    assert eval_heads.main(["--heads", str(tmp_path / "a"), str(tmp_path / "b"), "--features", str(store),
                            "--base", str(trainable_base), "--out", str(tmp_path / "cmp")]) == 2


def test_answers_only_evaluation_counts_the_positions_that_predict_answers(store, distilled, trainable_base, tmp_path):
    """``answer_starts`` maps every held-out sequence to its record's prompt length (less one); the
    windows it counts are exactly those positions; ``hispec-eval-heads --answers-only`` evaluates them."""
    from hispec_decode import ExitSpec
    from hispec_train import eval_heads
    from hispec_train.store_data import answer_starts

    prompt_of = {tuple(r["input_ids"]): r["prompt_tokens"] for r in _records(distilled)}
    fs = FeatureStore(store, [1, 3], "eval")
    starts = answer_starts(store, "eval")
    assert len(starts) == len(fs.sequences)
    for (s, off, n), first in zip(fs.sequences, starts):
        ids = tuple(fs.shards[s]["input_ids"][off : off + n].tolist())
        assert 0 < first == prompt_of[ids] - 1 < n - 1
    answers = sum(n - first for (_, _, n), first in zip(fs.sequences, starts))
    batches = fs.sequential(4, 16, counted_from=starts)
    assert sum(b.tokens for b in batches) == answers < sum(n for _, _, n in fs.sequences)
    model = HiSpecModel.from_pretrained(str(trainable_base), heads="none")
    HiSpecAdapter.create(model.decoder, str(trainable_base), [ExitSpec(1, "draft", "norm")]).save_pretrained(tmp_path / "a")
    assert eval_heads.main(["--heads", str(tmp_path / "a"), "--features", str(store), "--base", str(trainable_base),
                            "--seq-len", "16", "--out", str(tmp_path / "ans"), "--answers-only"]) == 0
    result = json.loads((tmp_path / "ans.json").read_text())[0]
    assert result["positions"] == "answers" and result["tokens"] == answers
    import shutil

    other = tmp_path / "other"  # a store whose data set is not self-distilled: where answers start is unknown
    shutil.copytree(store, other)
    manifest = json.loads((other / STORE_MANIFEST).read_text())
    manifest["dataset"] = str(tmp_path)
    (other / STORE_MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(HiSpecError, match="not a self-distilled"):
        answer_starts(other, "eval")
