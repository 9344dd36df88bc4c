"""Confidence-adaptive and batch-aware policies stay lossless: exact greedy equality with
transformers, exact sampled distributions (chi-square at the 99.9% quantile), for thresholds
that never stop, that stop everything and in between."""

from __future__ import annotations

import json
import math

import pytest
import torch

from hispec_decode import CONFIG_NAME, HiSpecAdapter, HiSpecError, HiSpecModel, Policy
from hispec_decode.adapter import ExitSpec
from hispec_decode.decoding.sampling import SamplingParams, TokenSampler
from hispec_decode.engine.strategies import STRATEGIES, run_alone
from hispec_decode.cache.block_manager import BlockManager
from hispec_decode.engine.sequence import Sequence

from conftest import ARCHS, SAMPLE_PROMPT, read_by, chi_square, chi_square_critical, exact_two_token_distribution
from conftest import LOSSLESS_NEW as NEW
from conftest import LOSSLESS_PROMPTS as PROMPTS

# (draft_threshold, verify_threshold): never stop, stop everything, in between
THRESHOLDS = [(0.0, 0.0), (1.01, 1.01), (0.3, 0.2), (0.7, 0.6), (0.0, 1.01), (1.01, 0.0)]


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("thresholds", THRESHOLDS)
def test_thresholded_policies_match_transformers(arch, thresholds, hispec_models, references):
    model = hispec_models[arch]
    gates = dict(draft_threshold=thresholds[0], verify_threshold=thresholds[1])
    for window, num_draft in ((1, 1), (8, 3)):
        for n, prompt in PROMPTS.items():
            hi = model.generate([prompt], max_new_tokens=NEW, method="hispec", draft_layer=2, verify_layer=4,
                                window=window, num_draft=num_draft, **gates)
            ss = model.generate([prompt], max_new_tokens=NEW, method="self_spec", draft_layer=2, num_draft=num_draft,
                                draft_threshold=thresholds[0])
            assert hi.sequences[0] == references[arch, n] == ss.sequences[0], (thresholds, window, num_draft, n)
    batch = model.generate(list(PROMPTS.values()), max_new_tokens=NEW, method="hispec", draft_layer=1, verify_layer=3,
                           window=4, num_draft=2, **gates)
    assert batch.sequences == [references[arch, n] for n in PROMPTS]


def test_gates_that_stop_everything_degenerate_to_plain_decoding(hispec_models):
    model = hispec_models["qwen2"]
    policy = dict(draft_layer=2, verify_layer=4, window=8, num_draft=4)
    no_drafts = model.generate([PROMPTS[5]], max_new_tokens=NEW, method="hispec", draft_threshold=1.01, **policy)
    # no draft pass is spent on a gate no draft can pass; L_i still adds its tokens
    assert no_drafts.stats["calls_draft"] == 0 and no_drafts.seqs[0].counters.drafted == 0
    assert no_drafts.stats["calls_intermediate"] > 0
    nothing = model.generate([PROMPTS[5]], max_new_tokens=NEW, method="hispec", draft_threshold=1.01,
                             verify_threshold=1.01, **policy)
    c = nothing.seqs[0].counters
    assert c.drafted == 0 and c.tentative == 0 and c.calls_full == NEW  # one full pass per token, like autoregressive
    never = model.generate([PROMPTS[5]], max_new_tokens=NEW, method="hispec", draft_threshold=0.0,
                           verify_threshold=0.0, **policy)
    c = never.seqs[0].counters  # thresholds of 0 gate nothing: every draft call proposes a token
    assert c.calls_draft > 0 and c.drafted == c.calls_draft
    some = model.generate([PROMPTS[5]], max_new_tokens=NEW, method="hispec", draft_threshold=0.2,
                          verify_threshold=0.0, **policy).seqs[0].counters
    assert some.drafted < some.calls_draft  # while a gate between them stops some (the test has teeth)


# the small model's exits have top probabilities of at most ~0.25 here: these split its positions
@pytest.mark.parametrize("thresholds", [(0.0, 0.2), (0.2, 0.1), (0.0, 1.01), (1.01, 1.01)])
@pytest.mark.parametrize("method", ["hispec", "self_spec"])
def test_thresholded_sampling_follows_the_base_distribution(small_vocab_model, thresholds, method):
    path, reference = small_vocab_model
    model = HiSpecModel.from_pretrained(str(path))
    params, draws = SamplingParams(do_sample=True, temperature=0.9), 3000
    out = model.generate([SAMPLE_PROMPT] * draws, max_new_tokens=2, do_sample=True, temperature=0.9, seed=321,
                         **read_by(method, draft_layer=1, verify_layer=2, window=3, num_draft=2,
                                   draft_threshold=thresholds[0], verify_threshold=thresholds[1]))
    counts: dict[tuple[int, int], int] = {}
    for seq in out.sequences:
        counts[tuple(seq[:2])] = counts.get(tuple(seq[:2]), 0) + 1
    stat, df = chi_square(counts, exact_two_token_distribution(reference, params), draws)
    assert stat < chi_square_critical(df), (stat, df)


@pytest.mark.parametrize("arch", ["llama", "opt", "qwen3"])
def test_hispec_without_its_middle_level_is_self_spec(arch, hispec_models, references):
    """verify_layer = the number of layers switches the intermediate level off (a tuned policy may
    choose it when L_i does not pay): L_d's drafts go to L_f, exactly as self_spec."""
    model = hispec_models[arch]
    for n, prompt in PROMPTS.items():
        kw = dict(max_new_tokens=NEW, draft_layer=2, num_draft=3, draft_threshold=0.2)
        hi = model.generate([prompt], method="hispec", verify_layer=model.num_layers, **kw)
        ss = model.generate([prompt], method="self_spec", **kw)
        assert hi.sequences[0] == ss.sequences[0] == references[arch, n]
        assert hi.seqs[0].counters == ss.seqs[0].counters and hi.seqs[0].counters.calls_intermediate == 0


def test_policy_thresholds_rise_with_the_batch():
    policy = Policy(draft_layer=2, verify_layer=4, window=4, num_draft=2, draft_threshold=0.3, verify_threshold=0.2,
                    batch_thresholds=((1, 0.0), (4, 0.5), (16, 1.5)))
    assert policy.at_batch(1) == (0.3, 0.2)
    assert policy.at_batch(3) == (0.3, 0.2)
    assert policy.at_batch(4) == (0.5, 0.5)
    assert policy.at_batch(40) == (1.5, 1.5)  # above 1: no speculation


def test_tuned_adapter_policy_is_the_default_and_batch_aware(tiny_models, hispec_models, references, tmp_path,
                                                           monkeypatch):
    """An adapter's tuned policy fills what the call leaves open; in batches of 4 or more this one
    says speculation cannot pay, so those rows decode plainly (same tokens). (A fresh $HISPEC_HOME: a
    policy tuned on this machine for the same base and heads would win over the adapter's.)"""
    monkeypatch.setenv("HISPEC_HOME", str(tmp_path / "home"))
    tiny = tiny_models["llama"]
    adapter = HiSpecAdapter.create(hispec_models["llama"].decoder, str(tiny.path),
                                   [ExitSpec(2, "draft", "norm"), ExitSpec(4, "intermediate", "norm")])
    adapter.config.policy = {"float32": {"hispec": {"window": 5, "num_draft": 3, "draft_threshold": 0.25,
                                                    "verify_threshold": 0.01,
                                                    "batch_thresholds": {"1": 0.0, "4": 1.5}}}}
    adapter.save_pretrained(tmp_path / "heads")
    assert json.loads((tmp_path / "heads" / CONFIG_NAME).read_text())["policy"]["float32"]["hispec"]["window"] == 5
    model = tiny.load(heads=str(tmp_path / "heads"))
    assert model.policy(method="hispec") == Policy(
        draft_layer=2, verify_layer=4, window=5, num_draft=3, draft_threshold=0.25, verify_threshold=0.01,
        batch_thresholds=((1, 0.0), (4, 1.5)))
    assert model.policy(method="hispec", window=2, batch_aware=False).window == 2
    assert model.policy(method="hispec", batch_aware=False).batch_thresholds == ()
    assert model.policy(method="self_spec").draft_threshold == 0.0  # tuned for hispec only
    prompts = list(PROMPTS.values())
    alone = model.generate([prompts[1]], max_new_tokens=NEW)
    assert alone.sequences[0] == references["llama", 5] and alone.seqs[0].counters.tentative > 0
    batch = model.generate(prompts + prompts[:1], max_new_tokens=NEW)  # 4 rows: plain decoding
    assert batch.sequences == [references["llama", n] for n in PROMPTS] + [references["llama", 1]]
    assert all(s.counters.tentative == 0 and s.counters.calls_full == NEW for s in batch.seqs)


class _FixedRunner:
    """Answers every band request with fixed logits per exit: q at L_d, p_i at L_i, p_f at L_f."""

    def __init__(self, logits: dict[int, list[float]]) -> None:
        self.logits = {band: torch.tensor([row]) for band, row in logits.items()}

    def advance(self, request):
        seq, manager = request.seq, request.seq.blocks
        manager.reserve(seq.seq_id, len(seq.tokens))
        for band in range(request.top_band + 1):
            manager.set_length(seq.seq_id, band, len(seq.tokens))
        return self.logits[request.top_band].expand(request.num_logits, -1)


@pytest.mark.parametrize("thresholds", [(0.0, 0.0), (0.0, 0.6), (0.0, 1.01), (0.4, 0.6)])
def test_gated_hispec_samples_exactly_the_final_distribution(thresholds):
    """Two tokens; the draft exit always proposes token 0 (q = delta_0), L_i is uniform, the full
    model says (0.2, 0.8). Withholding only L_i's replacement tokens would leave token 0 alone at
    that position and give P(0) = 0.3; the exact rule keeps P(0) = 0.2 (20k draws: 4 sigma = 0.011)."""
    runner = _FixedRunner({0: [20.0, -20.0], 1: [0.0, 0.0], 2: [math.log(0.2), math.log(0.8)]})
    policy = Policy(draft_layer=1, verify_layer=2, window=3, num_draft=1, draft_threshold=thresholds[0],
                    verify_threshold=thresholds[1])
    draws, zeros = 20_000, 0
    for i in range(draws):
        seq = Sequence(0, [1], BlockManager(8, 16), (1, 2, 3), TokenSampler(SamplingParams(do_sample=True, seed=i)), 2, frozenset(), policy)
        seq.allocate()
        run_alone(STRATEGIES["hispec"].decode(seq), runner.advance)
        zeros += seq.new_tokens[0] == 0
    assert abs(zeros / draws - 0.2) < 0.011, zeros / draws


def test_a_broken_tuned_policy_is_a_clear_error(tiny_models, hispec_models, tmp_path):
    tiny = tiny_models["llama"]
    adapter = HiSpecAdapter.create(hispec_models["llama"].decoder, str(tiny.path),
                                   [ExitSpec(2, "draft", "norm"), ExitSpec(4, "intermediate", "norm")])
    for bad, needle in [({"window": "2"}, "window"), ({"draft_threshold": -3}, "draft_threshold"),
                        ({"batch_thresholds": {"1": "nan"}}, "batch_thresholds")]:
        adapter.config.policy = {"float32": {"hispec": bad}}
        adapter.save_pretrained(tmp_path / "heads")
        with pytest.raises(HiSpecError, match=f"tuned policy .* is invalid: .*{needle}"):  # at load, not at decoding
            tiny.load(heads=str(tmp_path / "heads"))
