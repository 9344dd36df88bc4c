"""Each sequence's round chooser (engine/chooser.py): every arm, in any order, decodes losslessly; the
chooser follows the sequence's own evidence (drafts that are always accepted win, drafts that are never
accepted lose and are retried at a bounded cost); a sequence's evidence is its own; a round's price is
what the derivation's replay charges."""

from __future__ import annotations

import random

import pytest
import torch

from conftest import ARCHS, LAYERS, SAMPLE_PROMPT, assert_first_two_tokens_follow, identity_above, save_tiny, zero_head
from hispec_decode import HiSpecAdapter, HiSpecModel, SamplingParams
from hispec_decode.adapter import ExitSpec
from hispec_decode.decoding.cost_model import CostModel
from hispec_decode.engine import chooser
from hispec_decode.engine.cost_clock import CostClock
from hispec_decode.engine.chooser import ARMS, MAX_RETRY_EVERY, RoundChooser, arm_policies, request_seconds

CHOOSE = RoundChooser.choose  # the real one (the suite's autouse fixture makes it return the policy)
REPEATING = [[5, 6, 7, 8, 5, 6], [9, 3, 9, 3, 9], [1, 2, 3, 4, 10, 11, 1, 2, 3], [7]]
NEW = 40


def flat_costs(num_layers: int, layers: tuple[int, ...] = (1, 2, 3, 4), full: float = 1e-3) -> CostModel:
    """A machine where a layer costs ``full / num_layers`` whatever the rows (up to 16) and the heads
    little: drafting is cheap, checking a few rows costs about one row."""
    rows = (1, 2, 3, 4, 6, 8, 12, 16, 32)
    per_layer = {r: full / num_layers * (1 + 0.02 * r) for r in rows}
    return CostModel({r: 1e-5 for r in rows}, per_layer, {s: 1e-5 for s in rows}, per_layer,
                     {layer: {r: 1e-5 for r in rows} for layer in (*layers, num_layers)})


@pytest.fixture
def choosing(monkeypatch):
    """The real chooser, pricing with the given costs alone: the engine's clock is held at 1 (how long a
    tiny model's steps take is not what these tests are about; tests/test_cost_clock.py times a host)."""
    monkeypatch.setattr(RoundChooser, "choose", CHOOSE)
    monkeypatch.setattr(CostClock, "observe", lambda self, key, seconds, priced: None)


def _with_costs(model: HiSpecModel, monkeypatch, costs: CostModel | None = None) -> HiSpecModel:
    monkeypatch.setattr(model, "_machine", {"costs": (costs or flat_costs(model.num_layers)).to_dict()})
    return model


@pytest.mark.parametrize("arch", ARCHS)
def test_chosen_rounds_equal_transformers(arch, tiny_models, hispec_models, choosing, monkeypatch):
    """The chooser's rounds, whichever arms it takes, give transformers' greedy tokens (fp32)."""
    tiny, model = tiny_models[arch], _with_costs(hispec_models[arch], monkeypatch)
    picks: dict[str, int] = {}
    for prompt in REPEATING:
        out = model.generate([prompt], max_new_tokens=NEW, method="hispec", draft_layer=2, verify_layer=4, lookup=4)
        assert out.sequences[0] == tiny.hf_generate(prompt, NEW), prompt
        for arm, n in out.stats["arms"].items():
            picks[arm] = picks.get(arm, 0) + n
    assert picks.get("policy") and len(picks) >= 2, picks  # it chose, and explored


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_any_order_of_arms_is_lossless(arch, tiny_models, hispec_models, monkeypatch):
    """Arms drawn at random each round (from the chooser's own generator, never the sampler's), with the
    vocabulary level and a middle level: greedy output equals transformers'."""
    rng = random.Random(3)

    def anywhere(self, seq):
        self.arm = rng.choice(self.offered(seq))
        self.seconds = {}
        return self.policies[self.arm]

    monkeypatch.setattr(RoundChooser, "choose", anywhere)
    tiny, model = tiny_models[arch], _with_costs(hispec_models[arch], monkeypatch,
                                                 flat_costs(LAYERS, (1, 2, 3, 4, -50)))
    before = model.runner.ranking  # the shared model's own comes back after
    model.runner.set_ranking(torch.randperm(model.decoder.vocab_size, generator=torch.Generator().manual_seed(2)))
    try:
        for kwargs in (dict(draft_layer=1, verify_layer=3, window=3, num_draft=2, lookup=4),
                       dict(draft_layer=2, verify_layer=LAYERS, vocab=50, vocab_window=3, num_draft=2, lookup=6),
                       dict(draft_layer=1, verify_layer=LAYERS, tree="dynamic", tree_nodes=5, tree_width=2,
                            num_draft=2, lookup=4)):
            for prompt in REPEATING:
                out = model.generate([prompt], max_new_tokens=NEW, method="hispec", **kwargs)
                assert out.sequences[0] == tiny.hf_generate(prompt, NEW), (kwargs, prompt)
            out = model.generate(REPEATING, max_new_tokens=NEW, method="hispec", **kwargs)  # one batch
            assert out.sequences == [tiny.hf_generate(p, NEW) for p in REPEATING], kwargs
    finally:
        model.runner.set_ranking(before)


def test_samples_with_random_arms_follow_the_base_distribution(small_vocab_model, monkeypatch):
    """The chi-square test (99.9%, 3000 draws) of the first two tokens, each sequence decoded alone and
    every round's arm drawn at random: the policy (a copy, else exit drafts), plain, exit drafts, a copy."""
    path, reference = small_vocab_model
    model = _with_costs(HiSpecModel.from_pretrained(str(path)), monkeypatch, flat_costs(4, (1, 2, 3)))
    rng = random.Random(7)
    arms: dict[str, int] = {}

    def anywhere(self, seq):
        self.arm = rng.choice(self.offered(seq))
        arms[self.arm] = arms.get(self.arm, 0) + 1
        self.seconds = {}
        return self.policies[self.arm]

    monkeypatch.setattr(RoundChooser, "choose", anywhere)
    prompt = [3, 1, 4, 1, 5, 3, 1]
    params = SamplingParams(do_sample=True, temperature=0.9)
    out = model.generate([prompt] * 3000, max_new_tokens=2, do_sample=True, temperature=0.9, method="hispec",
                         draft_layer=1, verify_layer=2, window=2, num_draft=2, lookup=4, max_num_seqs=1)
    assert set(arms) == set(ARMS), arms  # every arm drew some of these samples
    assert_first_two_tokens_follow(out.sequences, reference, params, prompt)


def test_drafts_always_accepted_win_and_never_accepted_lose(tmp_path, choosing, monkeypatch):
    """Exits that equal the final layer: the chooser drafts in most rounds. Heads that always propose one
    fixed token: it decodes plainly in most rounds, and retries the drafts at a bounded cost."""
    accepting = save_tiny("llama", tmp_path / "accepting", mutate=identity_above(1))
    model = _with_costs(accepting.load(), monkeypatch, flat_costs(LAYERS, (1, 3)))
    out = model.generate([[5, 9, 2]], max_new_tokens=60, method="hispec", draft_layer=1, verify_layer=3, num_draft=3)
    arms = out.stats["arms"]
    assert out.sequences[0] == accepting.hf_generate([5, 9, 2], 60)
    assert arms.get("policy", 0) >= 2 * arms.get("plain", 0), arms

    base = save_tiny("llama", tmp_path / "base")
    model = base.load()
    adapter = HiSpecAdapter.create(model.decoder, str(base.path), [ExitSpec(1, "draft", "residual_linear"),
                                                                   ExitSpec(3, "intermediate", "residual_linear")])
    for spec in adapter.config.exits:
        zero_head(adapter.head(spec.layer))
    adapter.save_pretrained(tmp_path / "heads")
    model = _with_costs(base.load(heads=str(tmp_path / "heads")), monkeypatch, flat_costs(LAYERS, (1, 3)))
    prompt = [(i * 37 + 11) % 100 for i in range(17)]
    out = model.generate([prompt], max_new_tokens=100, method="hispec", draft_layer=1, verify_layer=3, num_draft=3)
    arms = out.stats["arms"]
    assert out.sequences[0] == base.hf_generate(prompt, 100)
    rounds = sum(arms.values())
    assert arms.get("plain", 0) >= 0.75 * rounds and arms.get("policy", 0) >= 2, arms  # mostly plain, still retried


def test_a_sequence_starts_from_the_prior_not_from_its_neighbours_evidence(tmp_path, choosing, monkeypatch):
    """A request whose drafts all lose does not turn speculation off for the next one (a guard's state
    shared by every request of the model once did): the next request's chooser starts from the prior."""
    accepting = save_tiny("llama", tmp_path / "accepting", mutate=identity_above(1))
    model = _with_costs(accepting.load(), monkeypatch, flat_costs(LAYERS, (1, 3)))
    engine = model.build_engine(method="hispec", draft_layer=1, verify_layer=3, num_draft=3, max_new_tokens=30)
    first = engine.add_request([5, 9, 2])
    while engine.has_unfinished():
        engine.step()
    seq = engine.sequences[first]
    seq.chooser.evidence["policy", False, 1].tokens = 0.0  # as if its drafts had all been rejected
    second = engine.add_request([4, 4, 8])
    fresh = engine.sequences[second].chooser
    assert fresh is not seq.chooser and not fresh.evidence
    assert fresh._evidence("policy").tokens > 0  # the prior


def test_a_round_is_priced_as_the_replay_prices_it(tiny_models):
    """The chooser's price of a request is the derivation's (one function): a plain step, a draft pass, a
    check of three rows; a round's seconds are their sum."""
    from hispec_decode.decoding.policy import Policy
    from hispec_decode.engine.sequence import BandRequest, Sequence
    from hispec_decode.cache.block_manager import BlockManager

    costs = flat_costs(LAYERS, (2, 4))
    policy = Policy(draft_layer=2, verify_layer=LAYERS, window=1, num_draft=2)
    seq = Sequence(0, [1, 2, 3], BlockManager(64, 16), (2, LAYERS), policy=policy)
    seq.allocate()
    prefill = request_seconds(costs, BandRequest(seq, 1, 1))
    assert prefill == pytest.approx(costs.band(0, LAYERS, 3) + costs.exit(LAYERS, 1) + costs.request)
    for b in (0, 1):
        seq.blocks.reserve(0, 3)
        seq.blocks.set_length(0, b, 3)
    seq.tokens += [7, 8]
    draft = request_seconds(costs, BandRequest(seq, 0, 1))
    assert draft == pytest.approx(costs.band(0, 2, 2) + costs.exit(2, 1) + costs.speculative_request)
    check = request_seconds(costs, BandRequest(seq, 1, 3))  # both bands over the same 2 rows: one slice
    assert check == pytest.approx(costs.band(0, LAYERS, 2) + costs.exit(LAYERS, 3) + costs.speculative_request)
    c = RoundChooser(policy, costs, LAYERS)
    c.choose(seq)
    c.price((1, 0, 1), draft)
    c.price((1, 1, 2), check)
    c.price((1, 1, 2), check)
    assert c.seconds == pytest.approx({(1, 0, 1): draft, (1, 1, 2): 2 * check})


def test_arms_keep_the_levels_and_retries_back_off(choosing):
    from hispec_decode.decoding.policy import Policy

    policy = Policy(draft_layer=2, verify_layer=4, window=3, num_draft=2, lookup=4, vocab=50)
    arms = arm_policies(policy)
    assert {p.exits("hispec", LAYERS) for p in arms.values()} == {policy.exits("hispec", LAYERS)}
    assert arms["plain"].draft_threshold > 1 and not arms["plain"].lookup and arms["policy"] is policy
    assert arms["copy"].lookup and arms["copy"].draft_threshold > 1 and not arms["exit"].lookup
    c = RoundChooser(policy, flat_costs(LAYERS, (2, 4, -50)), LAYERS, priors={"policy": 1e-6, "exit": 1e-6,
                                                                              "copy": 1e-6})
    repeating = type("Seq", (), {"room": lambda self: 10, "tokens": [1, 2, 1, 2], "batch_size": 1, "drafter_state": {},
                          "exits": (2, 4, LAYERS)})()
    fresh = type("Seq", (), {"room": lambda self: 10, "tokens": [1, 2, 3, 4], "batch_size": 1, "drafter_state": {},
                          "exits": (2, 4, LAYERS)})()
    assert c.offered(repeating) == ["policy", "plain", "exit", "copy"] and c.offered(fresh) == ["policy", "plain"]
    tried = []
    for _ in range(600):  # drafts never commit more than a plain step here: retries back off
        c.choose(fresh)
        tried.append(c.arm)
        c.seconds = {(1, 0, 1): 1.0} if c.arm != "plain" else {}
        c.record(1)
    late = tried[300:]
    retries = 300 // MAX_RETRY_EVERY + 1
    assert late.count("policy") <= retries and late.count("plain") >= 300 - retries
    assert ("policy", True, 1) not in c.evidence  # the other kind's evidence was not touched
    assert chooser.DECAY < 1


def test_in_a_batch_each_sequence_follows_its_own_evidence(tmp_path, choosing, monkeypatch):
    """A batch of four: exits equal to the final layer win rounds in a batch too (after the first retry:
    a batch starts from plain decoding's rate); heads that always propose one fixed token leave the batch
    plain but for bounded retries; the output equals transformers' either way."""
    prompts = [[5, 9, 2], [4, 4, 8, 1], [7, 3], [2, 6, 6, 1, 9]]
    accepting = save_tiny("llama", tmp_path / "accepting", mutate=identity_above(1))
    model = _with_costs(accepting.load(), monkeypatch, flat_costs(LAYERS, (1, 3)))
    out = model.generate(prompts, max_new_tokens=60, method="hispec", draft_layer=1, verify_layer=3, num_draft=3)
    assert out.sequences == [accepting.hf_generate(p, 60) for p in prompts]
    for seq in out.seqs:  # in the batch of four, each sequence's own rounds rate its drafts above plain decoding
        c = seq.chooser
        measured = [kind for arm, kind, size in c.evidence if arm == "policy" and size == 4]
        assert measured
        for kind in measured:
            c.key = (kind, 4)
            assert c.rate("policy") > c.rate("plain"), kind
    rounds = sum(out.stats["arms"].values())
    assert rounds <= 0.5 * sum(len(s) for s in out.sequences), out.stats["arms"]  # 2+ tokens a round

    base = save_tiny("llama", tmp_path / "base")
    adapter = HiSpecAdapter.create(base.load().decoder, str(base.path), [ExitSpec(1, "draft", "residual_linear"),
                                                                        ExitSpec(3, "intermediate", "residual_linear")])
    for spec in adapter.config.exits:
        zero_head(adapter.head(spec.layer))
    adapter.save_pretrained(tmp_path / "heads")
    model = _with_costs(base.load(heads=str(tmp_path / "heads")), monkeypatch, flat_costs(LAYERS, (1, 3)))
    prompts = [[(i * 37 + 11 * j) % 100 for i in range(17)] for j in range(1, 5)]
    out = model.generate(prompts, max_new_tokens=100, method="hispec", draft_layer=1, verify_layer=3, num_draft=3)
    assert out.sequences == [base.hf_generate(p, 100) for p in prompts]
    arms = out.stats["arms"]
    assert arms.get("plain", 0) >= 0.8 * sum(arms.values()) and arms.get("policy", 0) >= 4, arms


def test_a_drafted_row_costs_more_the_more_rows_the_batch_spends():
    """On a convex row-cost curve an extra row's price rises with the step's rows, and the shares of a
    step's sequences add up to the step's own cost."""
    seqs = (1, 2, 4, 8, 16, 32)
    layer = {n: 1e-4 * (1 + (n / 8) ** 2) for n in seqs}  # memory-bound, then compute-bound
    costs = CostModel({n: 1e-5 for n in seqs}, layer, {n: 2e-5 for n in seqs}, layer, {})
    alone = costs.share(0, 4, 4, 4)  # the only sequence with extra rows
    crowded = costs.share(0, 4, 4, 4, total=16)  # three more sequences drafting as much
    assert alone < crowded
    rows = [4, 4, 1, 1]
    shares = sum(costs.share(0, 4, r, 4, total=sum(rows)) for r in rows)
    assert shares == pytest.approx(costs.band(0, 4, sum(rows), 4))
    assert costs.share(0, 4, 1, 4, total=10) == pytest.approx(costs.band(0, 4, 4, 4) / 4)  # a plain row
