"""The speculation guard: the faster arm runs, the other is probed now and then, and what runs never
changes a token."""

from __future__ import annotations

import pytest

from hispec_decode.engine import guard as guard_module
from hispec_decode.engine.guard import PROBE_EVERY, SPECULATION_PROBE, SpeculationGuard

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
    arms = _run(SpeculationGuard(), spec_rate=130.0, plain_rate=100.0, epochs=6 * PROBE_EVERY)
    assert arms[: 1 + SPECULATION_PROBE] == [False] + [True] * SPECULATION_PROBE  # plain once, then a probe
    assert sum(arms) >= len(arms) - 1 - 6  # then speculation, but for a one-epoch probe now and then
    assert not all(arms[1 + SPECULATION_PROBE :]), "plain decoding is measured again now and then"


def test_speculation_that_loses_is_switched_off_and_probed_ever_more_rarely():
    arms = _run(SpeculationGuard(), spec_rate=30.0, plain_rate=100.0, epochs=24 * PROBE_EVERY)
    assert arms[:3] == [False, True, False]  # a clearly losing probe ends after one epoch
    starts = [i for i in range(2, len(arms)) if arms[i] and not arms[i - 1]]
    assert 2 <= len(starts) <= 5
    gaps = [b - a for a, b in zip(starts, starts[1:])]
    assert gaps == sorted(gaps) and gaps[-1] > gaps[0]


def test_a_close_call_is_measured_over_a_whole_probe():
    arms = _run(SpeculationGuard(), spec_rate=90.0, plain_rate=100.0, epochs=1 + SPECULATION_PROBE + 2)
    assert arms == [False] + [True] * SPECULATION_PROBE + [False, False]


def test_a_losing_arm_costs_a_bounded_time():
    """A probe's epoch ends once it has taken PROBE_TIME epochs of the other arm, however few tokens it made."""
    g = SpeculationGuard()
    _run(g, spec_rate=10.0, plain_rate=100.0, epochs=1)  # plain: 32 tokens in 0.32 s
    assert g.speculate("policy", 1)
    steps = 0
    while g.speculate("policy", 1):
        g.record("policy", 1, 0.1, 1)  # 10 tokens per second: clearly worse, so one epoch
        steps += 1
    assert steps == 7  # 0.7 s >= 2 x 0.32 s: the epoch ends long before its 32 tokens


def test_a_change_of_workload_is_followed():
    g = SpeculationGuard()
    _run(g, spec_rate=40.0, plain_rate=100.0, epochs=2 * PROBE_EVERY)
    later = _run(g, spec_rate=200.0, plain_rate=100.0, epochs=10 * PROBE_EVERY)
    assert sum(later[-PROBE_EVERY:]) >= PROBE_EVERY - 1  # speculation now, but for a probe


def test_batch_sizes_and_policies_are_measured_apart():
    g = SpeculationGuard()
    _run(g, spec_rate=30.0, plain_rate=100.0, epochs=3)
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
