"""The speculation guard: the faster arm runs, the other is probed now and then, and what runs never
changes a token."""

from __future__ import annotations

import pytest

from hispec_decode.engine import guard as guard_module
from hispec_decode.engine.guard import PROBE_EVERY, SpeculationGuard

SPECULATE = SpeculationGuard.speculate  # as defined (conftest overrides it for every other test's decoding)


@pytest.fixture(autouse=True)
def _the_real_guard(monkeypatch):
    monkeypatch.setattr(SpeculationGuard, "speculate", SPECULATE)


def _run(guard: SpeculationGuard, spec_rate: float, plain_rate: float, epochs: int) -> list[bool]:
    """Feed ``epochs`` epochs of 4-token steps at these rates (tokens per second); returns the arm of each."""
    arms = []
    for _ in range(epochs):
        on = guard.speculate("policy", 1)
        arms.append(on)
        rate = spec_rate if on else plain_rate
        guard.record("policy", 1, 4 / rate, 4)
        while guard._state("policy", 1).tokens:  # until the epoch ends
            guard.record("policy", 1, 4 / rate, 4)
    return arms


def test_speculation_that_pays_keeps_running_and_plain_decoding_is_probed():
    arms = _run(SpeculationGuard(), spec_rate=130.0, plain_rate=100.0, epochs=4 * PROBE_EVERY)
    assert arms[:2] == [False, True]  # each arm once
    assert sum(arms[2:]) >= len(arms) - 2 - 4  # then speculation, but for a probe now and then
    assert not all(arms[2:]), "plain decoding is measured again now and then"


def test_speculation_that_loses_is_switched_off_and_probed_ever_more_rarely():
    arms = _run(SpeculationGuard(), spec_rate=60.0, plain_rate=100.0, epochs=16 * PROBE_EVERY)
    assert arms[:2] == [False, True]
    probes = [i for i, on in enumerate(arms) if on and i >= 2]
    assert probes and len(probes) <= 4  # intervals of 8, 16, 32, 64 epochs
    gaps = [b - a for a, b in zip(probes, probes[1:])]
    assert gaps == sorted(gaps) and gaps[-1] > gaps[0]


def test_a_losing_arm_costs_at_most_one_epoch_of_time():
    """A probe ends once it has taken as long as an epoch of the other arm, however few tokens it made."""
    g = SpeculationGuard()
    _run(g, spec_rate=10.0, plain_rate=100.0, epochs=1)  # plain: 48 tokens in 0.48 s
    assert g.speculate("policy", 1)
    steps = 0
    while g.speculate("policy", 1):
        g.record("policy", 1, 0.1, 1)  # 10 tokens per second
        steps += 1
    assert steps == 5  # 0.5 s >= 0.48 s: the probe ends long before its 48 tokens


def test_a_change_of_workload_is_followed():
    g = SpeculationGuard()
    _run(g, spec_rate=60.0, plain_rate=100.0, epochs=2 * PROBE_EVERY)
    later = _run(g, spec_rate=200.0, plain_rate=100.0, epochs=3 * PROBE_EVERY)
    assert sum(later[-PROBE_EVERY:]) >= PROBE_EVERY - 1  # speculation now, but for a probe


def test_batch_sizes_and_policies_are_measured_apart():
    g = SpeculationGuard()
    _run(g, spec_rate=60.0, plain_rate=100.0, epochs=3)
    assert not g.speculate("policy", 1) and all(g.rates("policy", 1))
    assert g.rates("policy", 2) == g.rates("other policy", 1) == (None, None)


def test_the_engine_decodes_plainly_where_the_guard_says_so(tiny_models):
    model = tiny_models["llama"].load()
    prompt = [3, 1, 4, 1, 5]
    want = model.generate([prompt], max_new_tokens=24, method="autoregressive").sequences
    policy = model.policy(method="hispec", draft_layer=1, verify_layer=3, window=2, num_draft=1)
    model.runner.guard._state(policy, 1).speculate = False
    out = model.generate([prompt], max_new_tokens=24, method="hispec", draft_layer=1, verify_layer=3, window=2,
                         num_draft=1)
    assert out.sequences == want and out.seqs[0].counters.calls_draft == 0
    off = model.generate([prompt], max_new_tokens=24, method="hispec", draft_layer=1, verify_layer=3, window=2,
                         num_draft=1, guard=False)
    assert off.sequences == want and off.seqs[0].counters.calls_draft > 0


def test_prefill_steps_are_not_measured(tiny_models, monkeypatch):
    seen = []
    monkeypatch.setattr(guard_module.SpeculationGuard, "record",
                        lambda self, policy, size, seconds, tokens: seen.append(tokens))
    model = tiny_models["qwen3"].load()
    out = model.generate([[1, 2, 3, 4, 5, 6, 7, 8]], max_new_tokens=10, method="hispec", draft_layer=1, verify_layer=3)
    assert len(seen) == out.stats["steps"] - 1  # every step but the prefill
    assert len(out.sequences[0]) - 1 <= sum(seen) <= len(out.sequences[0])  # the prefill may commit one


def test_a_seeded_sample_follows_its_policy_whatever_the_guard_says(tiny_models):
    """A seed reproduces a sample only along the same path: the guard leaves such rows alone (greedy,
    drafter-invariant and unseeded rows are the same whichever path decodes them)."""
    model = tiny_models["llama"].load()
    kw = dict(max_new_tokens=24, method="hispec", draft_layer=1, verify_layer=3, window=2, num_draft=1, do_sample=True,
              temperature=0.9)
    want = model.generate([[3, 1, 4]], seed=5, guard=False, **kw)
    policy = model.policy(method="hispec", draft_layer=1, verify_layer=3, window=2, num_draft=1)
    model.runner.guard._state(policy, 1).speculate = False
    seeded = model.generate([[3, 1, 4]], seed=5, **kw)
    assert seeded.sequences == want.sequences and seeded.seqs[0].counters.calls_draft > 0
    assert model.generate([[3, 1, 4]], **kw).seqs[0].counters.calls_draft == 0  # no seed: the guard decides
