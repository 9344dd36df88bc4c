"""hispec-tune: the replay is faithful to real decoding, and the chosen policy lands in the adapter."""

from __future__ import annotations

import json
from dataclasses import replace
import sys

import numpy as np
import pytest

from conftest import read_by
from hispec_decode import HiSpecAdapter, HiSpecModel
from hispec_decode.adapter.config import CALIBRATION_NAME
from hispec_decode.adapter import ExitSpec
from hispec_decode.tools import tune as tune_cli
from hispec_decode.tuning.costs import measure_costs
from hispec_decode.tuning.derive import grid as derive_grid
from hispec_decode.tuning.simulate import Trace, precision_above, record_trace, replay
from hispec_decode.decoding.policy import Policy
from hispec_decode.tuning.candidates import Candidate, _best_gate, batch_thresholds
from hispec_decode.tuning.tune import (CONFIRM_MARGIN, CONFIRM_MIN_BATCHES, CONFIRM_SEQUENCES, batch_prompts_needed,
                                       confirm_batches)

PROMPTS = [[5, 9, 2, 6], [1, 2, 3, 4, 5, 6, 7, 8], [40, 41]]


@pytest.fixture(scope="module")
def tuned_setup(trainable_base, tmp_path_factory):
    heads = tmp_path_factory.mktemp("heads")
    model = HiSpecModel.from_pretrained(str(trainable_base))
    HiSpecAdapter.create(model.decoder, str(trainable_base), [ExitSpec(2, "draft", "norm"),
                                                              ExitSpec(4, "intermediate", "norm")]).save_pretrained(heads)
    return HiSpecModel.from_pretrained(str(trainable_base), heads=str(heads)), heads


@pytest.mark.parametrize("gates", [dict(window=3, num_draft=2), dict(window=4, num_draft=3, draft_threshold=0.1,
                                                                        verify_threshold=0.05),
                                   dict(window=2, num_draft=1, tree="static", tree_nodes=4, tree_width=4),
                                   dict(window=3, num_draft=2, tree="static", tree_nodes=5, tree_width=3),
                                   dict(window=2, num_draft=2, tree="dynamic", tree_nodes=6, tree_width=3)])
@pytest.mark.parametrize("method", ["hispec", "self_spec"])
def test_replay_counts_what_real_decoding_does(tuned_setup, gates, method):
    """Replaying a policy on a trace makes (nearly) the same passes and accepts the same tokens as
    decoding: exactly along the true prefix; after a wrong tentative token the real exits see that
    wrong prefix while the trace knows only the true one, so counts may drift a little. Static trees
    replay too (their candidates are each exit's top tokens)."""
    model, _ = tuned_setup
    costs = measure_costs(model.runner, [2, 4], reps=1)
    plain = model.generate(PROMPTS, max_new_tokens=20, method="autoregressive")
    exact = 0
    for prompt, continuation in zip(PROMPTS, plain.sequences):
        trace = record_trace(model.runner, model.base_model, prompt, continuation, [2, 4], 20)
        policy = model.policy(**read_by(method, draft_layer=2, verify_layer=4, batch_aware=False, **gates))
        simulated = replay(trace, method, policy, costs, model.num_layers, model.decoder.default_eos_ids())
        real = model.generate([prompt], max_new_tokens=20, **read_by(method, draft_layer=2, verify_layer=4,
                                                                     batch_aware=False, **gates))
        sim, got = simulated.counters, real.seqs[0].counters
        assert simulated.tokens == len(real.sequences[0]) and simulated.seconds > 0
        assert abs(sim.calls_full - got.calls_full) <= max(1, 0.15 * got.calls_full), (sim, got)
        assert abs(sim.accepted_final - got.accepted_final) <= 2, (sim, got)
        exact += sim == got
    # an L_i-pruned tree drifts more after a wrong tentative token; a dynamic tree off the true path ranks
    # stand-in candidates by true-prefix probabilities
    if "tree" not in gates or (method == "self_spec" and gates["tree"] == "static"):
        assert exact >= 1, "at least one prompt replays exactly"


def test_batch_thresholds_rise_with_the_batch(tuned_setup):
    model, _ = tuned_setup
    costs = measure_costs(model.runner, [2, 4], reps=1)
    n = model.num_layers
    thresholds = batch_thresholds(costs, n, cap=0.9, policy=Policy(draft_layer=2, verify_layer=n, window=1,
                                                                   num_draft=1))
    assert thresholds["1"] == 0.0 and set(thresholds) >= {"2", "4", "8", "16"}
    assert all(0 <= v <= 0.9 or v == 1.5 for v in thresholds.values())
    values = list(thresholds.values())
    assert values == sorted(values), "a bigger batch never makes speculation cheaper"
    deeper = batch_thresholds(costs, n, cap=0.9, policy=Policy(draft_layer=4, verify_layer=n, window=1, num_draft=1))
    assert all(deeper[b] >= thresholds[b] for b in thresholds), "a costlier draft pass needs more acceptance"


def test_batch_gate_pays_for_the_draft_pass_of_every_sequence():
    """The gate maximizes f(t) * (a(t) - m) - d: each drafted token costs m and brings its acceptance,
    and every sequence pays d for its draft pass whether its draft passes the gate or not."""
    conf = np.array([0.95, 0.9, 0.8, 0.5, 0.3])
    hit = np.array([1, 1, 1, 0, 0])
    assert _best_gate(conf, hit, m=0.5, d=0.1) == 0.8  # the three sure drafts: gain 1.5 / 5 - 0.1
    assert _best_gate(conf, hit, m=0.5, d=0.35) == 1.5  # they bring 0.3 per step: less than the draft pass
    assert _best_gate(conf, hit, m=1.1, d=0.0) == 1.5  # a row costs more than a whole token brings


def test_batch_thresholds_from_traces_stop_drafts_that_never_pay(tuned_setup):
    """With calibration traces, an exit whose drafts are all wrong speculates in no batch, and one whose
    drafts are all right and sure speculates at least where the rule without traces lets it."""
    from hispec_decode.decoding.cost_model import CostModel

    model, _ = tuned_setup
    n = model.num_layers
    # a machine where an extra row in a batch costs little (so the rule without traces speculates in batches):
    # measured costs on a loaded machine may not be one, and the test must test something everywhere
    points = (1, 2, 4, 8, 16, 32)
    per_layer = {k: 1e-3 / n * (1 + 0.02 * k) for k in points}
    costs = CostModel({k: 1e-5 for k in points}, per_layer, {k: 1e-5 for k in points}, per_layer,
                      {layer: {k: 1e-5 for k in points} for layer in (2, n)})
    policy = Policy(draft_layer=2, verify_layer=n, window=1, num_draft=1)
    tokens = list(range(10, 74))

    def trace(right: bool) -> Trace:
        top = np.array([[t if right else t + 1] for t in tokens[1:]] + [[0]])
        return Trace(tokens, 8, len(tokens), top={2: top}, conf={2: np.full((len(tokens), 1), 0.97, np.float32)})

    wrong = batch_thresholds(costs, model.num_layers, 1.0, policy, [trace(False)])
    assert wrong["1"] == 0.0 and all(v == 1.5 for b, v in wrong.items() if b != "1")
    right = batch_thresholds(costs, model.num_layers, 1.0, policy, [trace(True)])
    plain_rule = batch_thresholds(costs, model.num_layers, 1.0, policy)
    speculating = [b for b in plain_rule if plain_rule[b] <= 0.97 and b != "1"]
    assert speculating, f"the rule without traces speculates in no batch here: this test tests nothing ({plain_rule})"
    assert all(right[b] == 0.97 for b in speculating), (right, plain_rule)


@pytest.mark.parametrize("ratios, on", [({2: 1.10, 4: CONFIRM_MARGIN + 0.01, 8: 1.02}, [2, 4]), ({2: 1.03}, []), ({2: 0.9}, [])])
def test_batch_confirmation_keeps_speculation_only_where_it_clearly_wins(monkeypatch, ratios, on):
    """Decoding is faked: speculation at batch B takes 1 / ratio[B] of plain decoding's time. It stays on
    up to the first size where it is not CONFIRM_MARGIN faster, and is off from there on (measured or not)."""
    seen = []

    def fake_decode(model, prompts, max_new_tokens, method, policy=None):
        seen.append((len(prompts), method, tuple(map(tuple, prompts))))
        return 100, (1.0 if method == "autoregressive" else 1.0 / ratios.get(len(prompts), 0.5))

    monkeypatch.setattr(sys.modules[confirm_batches.__module__], "_decode", fake_decode)
    chosen = Candidate("hispec", Policy(draft_layer=2, verify_layer=6, window=1, num_draft=1), 8)
    prompts = [[i, i + 1, i + 2] for i in range(batch_prompts_needed())]
    thresholds, rows = confirm_batches(None, prompts, 8, chosen, {"1": 0.0, "2": 0.2, "4": 0.4, "8": 0.5, "16": 0.6})
    assert [r["batch_size"] for r in rows if r["speculation"] == "on"] == on
    assert all(thresholds[str(b)] < 1 for b in on) and thresholds["1"] == 0.0
    assert all(thresholds[str(b)] > 1 for b in (2, 4, 8, 16) if b not in on)
    # at each measured size, both ways: CONFIRM_SEQUENCES sequences at least, in CONFIRM_MIN_BATCHES batches at
    # least, each batch of distinct prompts and no batch repeated
    assert {n for n, m, _ in seen if m == "autoregressive"} == {b for b in (2, 4, 8) if b in ratios}
    for b in {n for n, _, _ in seen}:
        plain = [batch for n, m, batch in seen if n == b and m == "autoregressive"]
        assert sorted(plain) == sorted(batch for n, m, batch in seen if n == b and m != "autoregressive")
        assert len(plain) >= CONFIRM_MIN_BATCHES and len(plain) * b >= CONFIRM_SEQUENCES
        assert len(set(plain)) == len(plain) and all(len(set(batch)) == b for batch in plain)


def test_precision_above_counts_generated_positions(tuned_setup):
    model, _ = tuned_setup
    plain = model.generate(PROMPTS[:1], max_new_tokens=10, method="autoregressive")
    trace = record_trace(model.runner, model.base_model, PROMPTS[0], plain.sequences[0], [2, 4])
    assert 0.0 <= precision_above([trace], 4, 0.0) <= 1.0
    assert precision_above([trace], 4, 2.0) is None


def test_tune_cli_stores_the_policy_for_this_machine(trainable_base, tuned_setup, tmp_path, capsys, monkeypatch):
    """The tuned policy is kept per machine under $HISPEC_HOME, and used by default there; the adapter
    is written only with --write-calibration (its machine-independent traces)."""
    monkeypatch.setenv("HISPEC_HOME", str(tmp_path / "home"))
    _, heads = tuned_setup
    before = {p.name: p.read_bytes() for p in heads.iterdir()}
    assert tune_cli.main(["--base", str(trainable_base), "--heads", str(heads), "--dtypes", "float32", "--prompts",
                          "builtin", "--num-prompts", "2", "--max-new-tokens", "6", "--confirm", "1",
                          "--json", str(tmp_path / "tune.json")]) == 0
    assert "predicted" in capsys.readouterr().out
    assert {p.name: p.read_bytes() for p in heads.iterdir()} == before, "the adapter is not written"
    (stored,) = (tmp_path / "home" / "machine").rglob("*.json")
    record = json.loads(stored.read_text())
    tuned = record["policies"]
    assert record["source"] == "tuned" and set(tuned) == {"hispec", "self_spec"}
    assert record["measurements"]["confirmed"][-1]["config"] == "autoregressive"
    # prompt lookup and the exit drafter in one tree, measured beside the rest
    assert any("drafting=union" in row["config"] for row in record["measurements"]["confirmed"])
    model = HiSpecModel.from_pretrained(str(trainable_base), heads=str(heads))
    policy = model.policy(method="hispec")
    assert (policy.window, policy.num_draft, policy.draft_threshold) == (
        tuned["hispec"]["window"], tuned["hispec"]["num_draft"], tuned["hispec"]["draft_threshold"])
    assert json.loads((tmp_path / "tune.json").read_text())["float32"]["hispec"] == tuned["hispec"]
    assert tune_cli.main(["--base", str(trainable_base), "--heads", str(heads), "--dtypes", "float32", "--prompts",
                          "builtin", "--num-prompts", "2", "--max-new-tokens", "6", "--confirm", "1",
                          "--write-calibration"]) == 0
    assert (heads / CALIBRATION_NAME).is_file()
    (heads / CALIBRATION_NAME).unlink()


def test_tune_cli_writes_calibration_only_into_an_explicit_adapter(capsys):
    assert tune_cli.main(["--write-calibration"]) == 2
    assert "--heads" in capsys.readouterr().err


def test_tune_cli_needs_a_local_adapter(trainable_base, capsys):
    assert tune_cli.main(["--base", str(trainable_base), "--heads", "/no/such/dir"]) == 2
    assert "local adapter directory" in capsys.readouterr().err


def test_a_label_names_what_the_policy_decodes_with():
    """Labels come from KNOBS: two policies that decode differently never share one, and a knob that no level or
    drafter of the policy reads does not tell two labels apart."""
    n = 12
    grid = [c for c in derive_grid([2, 4], n, (4096,))]
    labels = {c.label(): c for c in grid}
    assert len(labels) == len({(c.method, c.policy) for c in grid}), "distinct candidates, distinct labels"
    chain = Candidate("hispec", Policy(draft_layer=2, verify_layer=n, window=1, num_draft=2), n)
    assert chain.label() == "hispec L2 -> L_f: k=2 tau_d=0"
    moot = Candidate("hispec", replace(chain.policy, window=4, tree_nodes=3, vocab_window=2, drafting="union"), n)
    assert moot.label() == chain.label()
    levels = Candidate("hispec", Policy(draft_layer=2, verify_layer=4, vocab=4096, lookup=8, drafting="union"), n)
    assert levels.label() == ("hispec L2 -> L4 -> L_v(4096) -> L_f: N_i=2 k=1 tau_d=0 tau_v=0 lookup=8 drafting=union "
                              "N_v=4")
    assert Candidate("self_spec", Policy(draft_layer=n, verify_layer=n, vocab=4096), n).label().startswith(
        "self_spec L_v(4096) -> L_f:")
