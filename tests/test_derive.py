"""A policy derived on the machine: from the adapter's calibration traces and this machine's costs,
measured once and kept under $HISPEC_HOME; a policy tuned here wins over it."""

from __future__ import annotations

import json
import shutil
import time

import pytest
import torch

from hispec_decode import AdapterError, HiSpecAdapter, HiSpecModel
from hispec_decode.adapter import ExitSpec
from hispec_decode.adapter.config import CALIBRATION_NAME
from hispec_decode.tuning import derive, record
from hispec_decode.tuning.calibration import calibration_id, load_calibration, record_calibration, save_calibration

PROMPTS = [[5, 9, 2, 6], [1, 2, 3, 4, 5, 6, 7, 8], [40, 41]]


@pytest.fixture(scope="module")
def calibrated(trainable_base, tmp_path_factory):
    heads = tmp_path_factory.mktemp("calibrated")
    model = HiSpecModel.from_pretrained(str(trainable_base))
    HiSpecAdapter.create(model.decoder, str(trainable_base), [ExitSpec(2, "draft", "norm"),
                                                              ExitSpec(4, "intermediate", "norm")]).save_pretrained(heads)
    model = HiSpecModel.from_pretrained(str(trainable_base), heads=str(heads))
    traces = record_calibration(model, PROMPTS, 12, [2, 4])
    save_calibration(heads, traces, {"prompts": "test"})
    return heads, traces


def test_calibration_round_trips(calibrated):
    heads, traces = calibrated
    loaded = load_calibration(heads / CALIBRATION_NAME)
    assert len(loaded) == len(traces)
    for a, b in zip(loaded, traces):
        assert (a.tokens, a.prompt_length, a.limit) == (b.tokens, b.prompt_length, b.limit)
        assert set(a.top) == {2, 4} and all((a.top[k] == b.top[k]).all() and (a.conf[k] == b.conf[k]).all() for k in a.top)


def test_the_first_decode_on_a_machine_derives_and_keeps_a_policy(calibrated, trainable_base, tmp_path, monkeypatch):
    monkeypatch.setenv("HISPEC_HOME", str(tmp_path))
    heads, _ = calibrated
    model = HiSpecModel.from_pretrained(str(trainable_base), heads=str(heads))
    policy = model.policy(method="hispec")
    (path,) = (tmp_path / "machine").rglob("*.json")
    record = json.loads(path.read_text())
    assert record["source"] == "derived" and record["machine"]["device"] and record["costs"]["layer_rows"]
    chosen = record["policies"]["hispec"]
    assert (policy.draft_layer, policy.verify_layer, policy.num_draft, policy.tree) == (
        chosen["draft_layer"], chosen["verify_layer"], chosen["num_draft"], chosen["tree"])
    assert record["predicted"][0]["tokens_per_second"] > 0
    assert model.generate([PROMPTS[0]], max_new_tokens=6).sequences == model.generate(
        [PROMPTS[0]], max_new_tokens=6, method="autoregressive").sequences

    def no_measuring(*args, **kwargs):
        raise AssertionError("costs measured again")

    monkeypatch.setattr(derive, "measure_costs", no_measuring)
    again = HiSpecModel.from_pretrained(str(trainable_base), heads=str(heads))
    assert again.policy(method="hispec") == policy  # read back, not measured again
    path.write_text("{ damaged")  # an unreadable record is derived again
    monkeypatch.undo()
    monkeypatch.setenv("HISPEC_HOME", str(tmp_path))
    third = HiSpecModel.from_pretrained(str(trainable_base), heads=str(heads))
    assert third.policy(method="hispec").draft_layer in (2, 4)
    assert json.loads(path.read_text())["source"] == "derived"


def test_new_calibration_traces_derive_the_policy_again(calibrated, trainable_base, tmp_path, monkeypatch):
    """The same heads with calibration traces written again (``hispec-tune --write-calibration`` on
    other prompts) are derived again; the traces they were derived from are kept with the record."""
    monkeypatch.setenv("HISPEC_HOME", str(tmp_path / "home"))
    heads = tmp_path / "heads"
    shutil.copytree(calibrated[0], heads)
    model = HiSpecModel.from_pretrained(str(trainable_base), heads=str(heads))
    model.policy(method="hispec")
    path = record.policy_path(model)
    first = json.loads(path.read_text())
    assert first["calibration"] == calibration_id(heads / CALIBRATION_NAME)
    save_calibration(heads, record_calibration(model, PROMPTS[1:], 6, [2, 4]), {"prompts": "other"})
    again = HiSpecModel.from_pretrained(str(trainable_base), heads=str(heads))
    again.policy(method="hispec")
    second = json.loads(path.read_text())
    assert record.policy_path(again) == path and second["source"] == "derived"
    assert second["calibration"] == calibration_id(heads / CALIBRATION_NAME) != first["calibration"]


def test_a_machine_tuned_policy_wins_over_a_derived_one(calibrated, trainable_base, tmp_path, monkeypatch):
    monkeypatch.setenv("HISPEC_HOME", str(tmp_path))
    heads, _ = calibrated
    model = HiSpecModel.from_pretrained(str(trainable_base), heads=str(heads))
    tuned = {"draft_layer": 2, "verify_layer": 4, "window": 3, "num_draft": 2, "draft_threshold": 0.25,
             "verify_threshold": 0.0, "tree": "chain", "tree_nodes": 8, "tree_width": 4}
    record.store(record.policy_path(model), {"source": "tuned", "policies": {"hispec": tuned, "self_spec": tuned}})
    policy = model.policy(method="hispec")
    assert (policy.window, policy.num_draft, policy.draft_threshold) == (3, 2, 0.25)
    assert model.policy(method="hispec", window=1).window == 1  # explicit arguments still win


def test_grid_covers_chains_trees_and_the_middle_level():
    grid = derive.grid([2, 8], 30)
    assert {c.policy.tree for c in grid} == {"chain", "static"}
    assert any(c.policy.verify_layer == 8 for c in grid) and any(c.policy.verify_layer == 30 for c in grid)
    assert len(grid) < 100  # seconds of replaying, on the first decode of a machine


def test_a_damaged_calibration_is_a_clear_error(tmp_path):
    (tmp_path / CALIBRATION_NAME).write_bytes(b"not a safetensors file")
    with pytest.raises(AdapterError, match="damaged or not a calibration file"):
        load_calibration(tmp_path / CALIBRATION_NAME)


def test_grid_includes_the_vocabulary_level():
    grid = derive.grid([2, 8], 30, (4096,))
    exits = {c.policy.exits("hispec", 30) for c in grid if c.policy.vocab}
    assert {(30, 30), (2, 30, 30), (8, 30, 30), (2, 8, 30, 30)} <= exits  # L_v alone, under each exit and pair
    assert all(c.policy.vocab == 4096 for c in grid if c.policy.vocab)
    assert not any(c.policy.vocab for c in derive.grid([2, 8], 30))


def test_replayed_vocabulary_level_counts_what_decoding_counts(calibrated, trainable_base):
    """The replay of L_v (its rows recorded from the base's final states) accepts exactly what a real
    greedy decode with the same policy accepts, drafting alone and below an exit."""
    from hispec_decode.decoding.policy import Policy
    from hispec_decode.tuning.costs import measure_costs
    from hispec_decode.tuning.simulate import add_vocab_rows, replay

    heads, traces = calibrated
    model = HiSpecModel.from_pretrained(str(trainable_base), heads=str(heads))
    n, size = model.num_layers, 40
    model.runner.set_ranking(torch.randperm(model.decoder.vocab_size, generator=torch.Generator().manual_seed(3)))
    add_vocab_rows(model.runner, traces, (size,))
    costs = measure_costs(model.runner, [2, 4], reps=1, vocab_sizes=(size,))
    eos = model.decoder.default_eos_ids()
    checked = 0
    for policy in (Policy(draft_layer=n, verify_layer=n, window=1, num_draft=3, vocab=size),
                   Policy(draft_layer=2, verify_layer=n, window=1, num_draft=2, vocab=size, vocab_window=3)):
        for prompt, trace in zip(PROMPTS, traces):
            r = replay(trace, "hispec", policy, costs, n, eos)
            out = model.generate([prompt], max_new_tokens=trace.limit - trace.prompt_length, method="hispec",
                                 draft_layer=policy.draft_layer, verify_layer=policy.verify_layer, window=1,
                                 num_draft=policy.num_draft, draft_threshold=0.0, verify_threshold=0.0, tree="chain",
                                 tree_nodes=8, tree_width=4, lookup=0, vocab=size, vocab_window=policy.vocab_window,
                                 batch_aware=False, guard=False)
            levels = out.stats["levels"]
            assert [(lv["checked"], lv["accepted"]) for lv in levels] == [
                (r.counters.checked.get(j, 0), r.counters.accepted.get(j, 0)) for j in range(1, len(levels) + 1)]
            checked += levels[-1]["checked"]
    assert checked > 0


def test_a_base_without_an_adapter_derives_a_vocabulary_policy(trainable_base, tmp_path, monkeypatch):
    """No adapter: a short calibration decode ranks the tokens and gives the traces; the grid is the
    vocabulary level's (and prompt lookup, and off); the choice is kept under the base's fingerprint."""
    monkeypatch.setenv("HISPEC_HOME", str(tmp_path))
    monkeypatch.setattr(derive, "VOCAB_SIZES", (32,))
    model = HiSpecModel.from_pretrained(str(trainable_base))
    assert model.adapter is None and model.tokenizer is not None
    model.policy(method="hispec")
    (path,) = (tmp_path / "machine").rglob("*.json")
    assert path.parent.name.startswith("base-")
    record = json.loads(path.read_text())
    assert record["source"] == "derived" and record["calibration"] == "calibration decode"
    assert "-32" in record["costs"]["exits"]  # the vocabulary level of 32 tokens was measured and replayed
    assert list((tmp_path / "vocab").glob("*.safetensors"))
    prompt = [5, 9, 2, 6]
    assert model.generate([prompt], max_new_tokens=8).sequences == model.generate(
        [prompt], max_new_tokens=8, method="autoregressive").sequences


def test_machine_policies_of_equal_heads_on_other_bases_are_kept_apart(tiny_models):
    """Heads whose weights are equal (fresh norm heads) made for two bases are two adapters: a policy
    tuned for one is never read for the other."""
    ids = set()
    for base in (str(tiny_models["llama"].path), str(tiny_models["qwen2"].path)):
        model = HiSpecModel.from_pretrained(base)
        adapter = HiSpecAdapter.create(model.decoder, base, [ExitSpec(1, "draft", "norm")])
        ids.add(record.adapter_id(adapter))
    assert len(ids) == 2


# -- derivation never stops a decode ----------------------------------------------------------------
def test_a_tree_that_expands_one_node_replays(calibrated, trainable_base):
    """A static tree whose level holds one node to expand (two nodes, two levels): the replay hands the
    drafter one row of trace "logits" (a numpy array indexed by a one-row list, not a scalar)."""
    from hispec_decode.decoding.policy import Policy
    from hispec_decode.tuning.simulate import replay

    heads, traces = calibrated
    model = HiSpecModel.from_pretrained(str(trainable_base), heads=str(heads))
    n, eos = model.num_layers, model.decoder.default_eos_ids()
    costs = _flat_costs([2, 4], n)
    for nodes, width, depth in ((2, 2, 2), (3, 1, 3), (4, 2, 4)):
        policy = Policy(draft_layer=2, verify_layer=n, window=1, num_draft=depth, tree="static", tree_nodes=nodes,
                        tree_width=width)
        for trace in traces:
            r = replay(trace, "hispec", policy, costs, n, eos)
            assert r.tokens == trace.limit - trace.prompt_length or trace.tokens[-1] in eos


def _flat_costs(layers: list[int], n: int, value: float = 1e-3):
    from hispec_decode.tuning.costs import ROWS, SEQS, CostModel

    rows = sorted(set(ROWS) | set(SEQS))
    return CostModel({r: value for r in ROWS}, {r: value for r in ROWS}, {s: value for s in SEQS},
                     {s: value for s in SEQS}, {layer: {r: value for r in rows} for layer in [*layers, n]})


def test_derivation_survives_noisy_flat_and_non_monotonic_costs(calibrated, trainable_base):
    """A property over random cost tables, as a loaded machine measures them (noise, flat stretches,
    more rows costing less): the derivation returns policies that resolve on the model and decode."""
    from hypothesis import HealthCheck, given, settings, strategies as st

    from hispec_decode.config import SpeculativeConfig
    from hispec_decode.decoding.policy import resolve_policy
    from hispec_decode.tuning.costs import ROWS, SEQS, CostModel

    heads, traces = calibrated
    model = HiSpecModel.from_pretrained(str(trainable_base), heads=str(heads))
    n = model.num_layers
    rows = sorted(set(ROWS) | set(SEQS))
    seconds = st.one_of(st.just(1e-3), st.floats(1e-6, 5e-2))  # flat or anything, in any order

    def table(keys):
        return st.fixed_dictionaries({k: seconds for k in keys})

    costs = st.builds(CostModel, table(ROWS), table(ROWS), table(SEQS), table(SEQS),
                      st.fixed_dictionaries({layer: table(rows) for layer in (2, 4, n)}),
                      st.floats(0, 1e-2), st.floats(0, 1e-2))

    @settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
    @given(costs)
    def check(cost_model):
        derived = derive.derive(model, traces, cost_model)
        for method in ("hispec", "self_spec"):
            policy = resolve_policy(SpeculativeConfig(method=method), n, {}, derived[method])
            assert policy.exits(method, n)[-1] == n

    check()
    tree = {"draft_layer": 2, "verify_layer": n, "window": 1, "num_draft": 2, "draft_threshold": 0.0,
            "verify_threshold": 0.0, "tree": "static", "tree_nodes": 2, "tree_width": 2}
    assert model.generate([PROMPTS[1]], max_new_tokens=8, **tree, batch_aware=False).sequences == model.generate(
        [PROMPTS[1]], max_new_tokens=8, method="autoregressive").sequences


def test_a_failed_derivation_decodes_with_the_shipped_policy(calibrated, trainable_base, tmp_path, monkeypatch, caplog):
    """Deriving fails after measuring: one warning, the adapter's own policy decodes, and the next load
    derives again from the costs already measured (no second measuring)."""
    monkeypatch.setenv("HISPEC_HOME", str(tmp_path))
    heads, _ = calibrated
    model = HiSpecModel.from_pretrained(str(trainable_base), heads=str(heads))

    def broken(*args, **kwargs):
        raise IndexError("invalid index to scalar variable.")

    monkeypatch.setattr(derive, "derive", broken)
    with caplog.at_level("WARNING", logger="hispec_decode.tuning.record"):
        policy = model.policy(method="hispec")
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(warnings) == 1 and "IndexError" in warnings[0] and "shipped policy" in warnings[0]
    assert (policy.draft_layer, policy.verify_layer) == (2, 4)  # the adapter's roles
    prompt = PROMPTS[0]
    assert model.generate([prompt], max_new_tokens=6).sequences == model.generate(
        [prompt], max_new_tokens=6, method="autoregressive").sequences
    (path,) = (tmp_path / "machine").rglob("*.json")
    assert json.loads(path.read_text())["source"] == "measured"

    monkeypatch.undo()
    monkeypatch.setenv("HISPEC_HOME", str(tmp_path))

    def no_measuring(*args, **kwargs):
        raise AssertionError("costs measured again")

    monkeypatch.setattr(derive, "measure_costs", no_measuring)
    again = HiSpecModel.from_pretrained(str(trainable_base), heads=str(heads))
    again.policy(method="hispec")
    assert json.loads(path.read_text())["source"] == "derived"


def test_a_corrupt_policy_file_is_named_in_a_warning(calibrated, trainable_base, tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("HISPEC_HOME", str(tmp_path))
    heads, _ = calibrated
    model = HiSpecModel.from_pretrained(str(trainable_base), heads=str(heads))
    path = record.policy_path(model)
    path.parent.mkdir(parents=True)
    path.write_text("{ damaged")
    with caplog.at_level("WARNING", logger="hispec_decode.tuning.record"):
        model.policy(method="hispec")
    assert any("unreadable" in r.getMessage() and str(path) in r.getMessage() for r in caplog.records)
    assert json.loads(path.read_text())["source"] == "derived"


def test_the_grid_is_screened_then_its_fastest_replayed_on_every_trace(calibrated, trainable_base, monkeypatch):
    """Every grid policy is replayed on the screening traces; only the fastest, the fastest without speculation
    and the fastest self_spec runs go on to every trace, and the ranking's scores are full-trace predictions."""
    from hispec_decode.tuning.costs import ROWS, SEQS, CostModel

    heads, traces = calibrated
    model = HiSpecModel.from_pretrained(str(trainable_base), heads=str(heads))
    n, eos = model.num_layers, model.decoder.default_eos_ids()
    rows = sorted(set(ROWS) | set(SEQS))
    costs = CostModel({r: 1e-3 for r in ROWS}, {r: 1e-3 * (1 + r / 8) for r in ROWS}, {s: 1e-3 for s in SEQS},
                      {s: 1e-3 * s for s in SEQS}, {layer: {r: 2e-4 for r in rows} for layer in (2, 4, n)}, 1e-3, 1e-3)
    replays, predict = [], derive.predict
    monkeypatch.setattr(derive, "predict", lambda c, on, *a: replays.append((c, len(on))) or predict(c, on, *a))
    scored = derive.ranked(model, traces, costs)
    everywhere = min(len(traces), derive.TRACES)
    assert derive.SCREEN_TRACES < everywhere, "the fixture's traces must outnumber the screening ones"
    assert set(derive.grid([2, 4], n)) <= {c for c, k in replays if k == derive.SCREEN_TRACES}
    full = {c for c, k in replays if k == everywhere}
    assert len(full) <= derive.SCREEN_KEEP + 1 + derive.SCREEN_KEEP // 4 + 1 < len(derive.grid([2, 4], n))
    assert {c for c, _ in scored} <= full
    assert any(derive._is_plain(c.policy) for c, _ in scored) and any(derive._is_self_spec(c, n) for c, _ in scored)
    for c, tps in scored[:3]:
        assert tps == predict(c, traces[:everywhere], costs, n, eos)["tokens_per_second"]
    assert [tps for _, tps in scored[1:]] == sorted((tps for _, tps in scored[1:]), reverse=True)


def test_the_first_decode_waits_for_costs_only_and_a_worker_derives_the_rest(calibrated, trainable_base, tmp_path,
                                                                              monkeypatch):
    """In the background (the default outside the tests): the first load measures the costs and replays the
    shipped policy's arms (each sequence's priors), decodes with the shipped policy, and a worker process at
    the lowest priority derives the record that later loads read."""
    from hispec_decode.tuning import background

    monkeypatch.setenv("HISPEC_HOME", str(tmp_path))
    monkeypatch.setenv(background.ENV, "background")
    heads, _ = calibrated
    model = HiSpecModel.from_pretrained(str(trainable_base), heads=str(heads))
    record = model.machine_record()
    assert record["costs"]["layer_rows"] and not record["policies"] and record["arms"]["hispec"]["plain"] > 0
    (path,) = (tmp_path / "machine").rglob("*.json")
    assert json.loads(path.read_text())["source"] == "measured"
    want = model.generate([PROMPTS[0]], max_new_tokens=6, method="autoregressive").sequences
    assert model.generate([PROMPTS[0]], max_new_tokens=6).sequences == want  # the shipped policy, chosen per round
    deadline = time.monotonic() + 300
    while background.running(path) and time.monotonic() < deadline:
        time.sleep(0.5)
    log = path.with_name(path.name + ".log").read_text()
    stored = json.loads(path.read_text())
    assert stored["source"] == "derived" and stored["policies"]["hispec"], log
    assert not background.lock_path(path).exists()
    again = HiSpecModel.from_pretrained(str(trainable_base), heads=str(heads))
    chosen = stored["policies"]["hispec"]
    assert again.policy(method="hispec").draft_layer == chosen["draft_layer"]


def test_native_records_are_kept_per_block_loop(monkeypatch):
    """Pass costs measured with the AVX2 block loop are not reused where the VNNI loop runs."""
    from types import SimpleNamespace

    from hispec_decode import kernels

    native = SimpleNamespace(decoder=SimpleNamespace(native=True, precision="native"))
    kinds = {}
    for kind in ("avx2", "vnni", "torch"):
        monkeypatch.setattr(kernels, "block_linear_kind", lambda kind=kind: kind)
        kinds[kind] = record._precision(native)
    assert kinds == {"avx2": "native-x8", "vnni": "native-x8-vnni", "torch": "native-x8"}
    assert record._precision(SimpleNamespace(decoder=SimpleNamespace(native=False, dtype=torch.bfloat16))) == torch.bfloat16


class _Clock:
    """A clock that moves only when the stand-in model below decodes."""
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class _TimedModel:
    """generate() takes PREFILL seconds for the prompt and STEP per new token, on ``clock``."""
    PREFILL, STEP = 2.0, 0.05
    num_layers = 4

    def __init__(self, clock: _Clock) -> None:
        self.clock = clock

    def generate(self, prompts, max_new_tokens, **kwargs):
        self.clock.now += self.PREFILL + self.STEP * max_new_tokens
        return type("Out", (), {"sequences": [[7] * max_new_tokens]})()


def test_the_request_overhead_leaves_the_prompts_prefill_out(monkeypatch):
    """A long prompt's prefill is charged once by the replay: spread over the decoded tokens it would
    make every plain step look slower by PREFILL / tokens (and speculation faster than it is)."""
    clock = _Clock()
    monkeypatch.setattr(derive.time, "perf_counter", clock)
    costs = _flat_costs([], _TimedModel.num_layers)
    step = costs.full_step(_TimedModel.num_layers, 1)
    overhead = derive.request_overhead(_TimedModel(clock), [[1] * 300, [2] * 300], 32, costs)
    assert overhead == pytest.approx(_TimedModel.STEP - step)


def test_an_exit_is_timed_on_the_path_decoding_takes(trainable_base, tmp_path, monkeypatch):
    """A deep-context head decodes through its fused transform (``decode_transform``) and hands on its
    own context; the cost model times that, not the unfused ``transform`` that only calibration uses."""
    from hispec_decode.models.exit_heads import DeepContextHead
    from hispec_decode.tuning.costs import measure_costs

    base = HiSpecModel.from_pretrained(str(trainable_base), heads="none")
    adapter = HiSpecAdapter.create(base.decoder, str(trainable_base), [ExitSpec(2, "draft", "deep_context")])
    with torch.no_grad():
        adapter.head(2).proj.weight.normal_(0, 0.02)
        adapter.head(2).ctx.weight.normal_(0, 0.02)
    adapter.save_pretrained(tmp_path / "heads")
    model = HiSpecModel.from_pretrained(str(trainable_base), heads=str(tmp_path / "heads"))
    calls = {"decode_transform": 0, "transform": 0, "context_of": 0}
    for name in calls:
        original = getattr(DeepContextHead, name)

        def counted(self, *args, _original=original, _name=name, **kwargs):
            calls[_name] += 1
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(DeepContextHead, name, counted)
    costs = measure_costs(model.runner, [2], reps=1)
    assert set(costs.exits[2]) == {1, 2, 4, 8, 16}
    assert calls["decode_transform"] > 0 and calls["context_of"] > 0 and calls["transform"] == 0, calls
    calls.update({k: 0 for k in calls})  # decoding with that head takes the same path
    model.generate([[5, 9, 2, 6, 7]], max_new_tokens=6, method="hispec", draft_layer=2, num_draft=2)
    assert calls["decode_transform"] > 0 and calls["transform"] == 0, calls
