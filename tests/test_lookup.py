"""Prompt lookup: drafts copied from earlier in the sequence, verified as point masses. Greedy output
equals transformers' for every architecture; sampled output follows the base distribution."""

from __future__ import annotations

import pytest
import torch

from conftest import ARCHS, assert_first_two_tokens_follow, chi_square, chi_square_critical
from hispec_decode import HiSpecModel
from hispec_decode.decoding.lookup import lookup
from hispec_decode.decoding.sampling import SamplingParams, TokenSampler

REPEATING = [[5, 6, 7, 8, 5, 6], [9, 3, 9, 3, 9], [1, 2, 3, 4, 10, 11, 1, 2, 3]]


def test_lookup_copies_what_followed_the_latest_longest_match():
    assert lookup([1, 2, 3, 9, 1, 2, 3], 3) == [9, 1, 2]  # the 3-gram [1 2 3] at 0: what followed it
    assert lookup([1, 2, 7, 5, 2, 8, 5, 2], 2) == [8, 5]  # [5 2] twice: the latest occurrence (at 3)
    assert lookup([4, 1, 2, 5, 1, 2], 1) == [5]
    assert lookup([1, 2, 3, 4], 4) == [] and lookup([1, 2], 4) == [] and lookup([1, 2, 1, 2], 0) == []
    assert lookup([7, 7, 7], 2) == [7]  # overlapping with the suffix itself


def test_point_mass_drafts_leave_the_target_distribution():
    """A candidate that was not drawn from a distribution (proposal None) is accepted with p(x), else
    replaced by a draw from p without x: the output is an exact sample of p."""
    vocab, draws = 5, 20000
    p = torch.tensor([0.4, 0.3, 0.15, 0.1, 0.05])
    sampler = TokenSampler(SamplingParams(do_sample=True, seed=2))
    target_logits = torch.stack([p.log(), p.log()])
    for x in (0, 3):
        counts: dict[int, int] = {}
        for _ in range(draws):
            verdict = sampler.verify([x], None, target_logits)
            out = x if verdict.accepted else verdict.token
            counts[out] = counts.get(out, 0) + 1
        stat, df = chi_square(counts, {i: float(p[i]) for i in range(vocab)}, draws)
        assert stat < chi_square_critical(df), (x, stat)


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("method", ["self_spec", "hispec"])
def test_greedy_with_lookup_equals_transformers(arch, method, tiny_models, hispec_models):
    tiny, model = tiny_models[arch], hispec_models[arch]
    copied = 0
    for prompt in REPEATING:
        want = tiny.hf_generate(prompt, 16)
        for exit_drafts in (0.0, 1.5):  # lookup before the exit's drafts, and lookup alone
            out = model.generate([prompt], max_new_tokens=16, method=method, draft_layer=1, verify_layer=3, window=3,
                                 num_draft=2, draft_threshold=exit_drafts, lookup=8)
            assert out.sequences[0] == want, (prompt, exit_drafts)
            copied += out.stats["copied"]
    assert copied > 0, "prompt lookup found nothing to copy: this test tests nothing"
    batch = model.generate(REPEATING, max_new_tokens=16, method=method, draft_layer=1, verify_layer=3, lookup=8)
    assert batch.sequences == [tiny.hf_generate(p, 16) for p in REPEATING]


@pytest.mark.parametrize("method", ["hispec", "self_spec"])
def test_samples_with_lookup_follow_base_distribution(small_vocab_model, method):
    """The chi-square test of the sampling tests, on a prompt whose last tokens occurred before, so the
    first position is drafted by lookup (3000 draws, row i with seed + i)."""
    path, reference = small_vocab_model
    model = HiSpecModel.from_pretrained(str(path))
    prompt = [3, 1, 4, 1, 5, 3, 1]
    params = SamplingParams(do_sample=True, temperature=0.9)
    out = model.generate([prompt] * 3000, max_new_tokens=2, method=method, do_sample=True, temperature=0.9,
                         seed=99, draft_layer=1, verify_layer=2, window=2, num_draft=1, draft_threshold=1.5, lookup=4)
    assert out.stats["copied"] >= 3000  # every row copied at its first position
    assert_first_two_tokens_follow(out.sequences, reference, params, prompt)
