"""Sampling is lossless: the two-stage rejection rule yields exactly the final distribution.

1. Exact: on explicit small distributions, the output distribution of each stage, computed
   analytically from the functions the sampler uses, equals its target.
2. Monte Carlo of ``TokenSampler.verify`` itself on explicit distributions.
3. Statistical, end to end: samples of ``hispec`` and ``autoregressive`` on a tiny model are
   compared with the exact distribution of the first two new tokens (computed from
   transformers' forward). Test: Pearson chi-square goodness of fit, cells with expected count
   < 5 pooled, rejected when the statistic exceeds the 99.9% quantile of chi-square (fixed
   seeds, so the outcome is deterministic; a wrong rule is far beyond that quantile).
"""

from __future__ import annotations

import pytest
import torch

from hispec_decode import HiSpecModel
from hispec_decode.decoding.sampling import SamplingParams, TokenSampler, acceptance_probability, residual, warp

from conftest import (BATCH_PROMPTS, read_by, SAMPLE_PROMPT, assert_first_two_tokens_follow, chi_square, chi_square_critical,
                      exact_two_token_distribution)


def _stage(proposal: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Output distribution of one speculative step: accepted proposals plus resampled rejections."""
    accepted = proposal * acceptance_probability(target, proposal)
    return accepted + (1 - accepted.sum()) * residual(target, proposal)


def _random_dist(gen: torch.Generator, n: int, zeros: int = 0) -> torch.Tensor:
    p = torch.rand(n, generator=gen, dtype=torch.float64) ** 3
    if zeros:
        p[torch.randperm(n, generator=gen)[:zeros]] = 0
    return p / p.sum()


@pytest.mark.parametrize("case", range(50))
def test_two_stage_rule_is_exact(case):
    gen = torch.Generator().manual_seed(case)
    n = 6
    q_d = _random_dist(gen, n, zeros=case % 3)  # drafts may be truncated (top-k) ...
    p_i = _random_dist(gen, n, zeros=(case // 3) % 3)  # ... and so may the targets
    p_f = _random_dist(gen, n, zeros=(case // 9) % 3)
    stage1 = _stage(q_d, p_i)
    assert torch.allclose(stage1, p_i, atol=1e-12)
    stage2 = _stage(stage1, p_f)  # L_f treats L_i's (exact) samples as proposals
    assert torch.allclose(stage2, p_f, atol=1e-12)
    assert torch.allclose(_stage(p_f, p_f), p_f)  # identical distributions: all accepted


def test_verify_samples_target_distribution():
    vocab, draws = 5, 20000
    gen = torch.Generator().manual_seed(0)
    q = _random_dist(gen, vocab).float()
    p = _random_dist(gen, vocab).float()
    sampler = TokenSampler(SamplingParams(do_sample=True, seed=1))
    counts: dict[int, int] = {}
    target_logits = torch.stack([p.log(), p.log()])  # row 0 checks the candidate, row 1 is the bonus
    for _ in range(draws):
        x = int(torch.multinomial(q, 1, generator=sampler.generator))
        verdict = sampler.verify([x], q[None], target_logits)
        out = x if verdict.accepted else verdict.token
        counts[out] = counts.get(out, 0) + 1
    stat, df = chi_square(counts, {i: float(p[i]) for i in range(vocab)}, draws)
    assert stat < chi_square_critical(df)


def test_warp_top_k_top_p():
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0]])
    assert (warp(logits, SamplingParams(do_sample=True, top_k=2))[0, 2:] == 0).all()
    probs = logits.softmax(-1)[0]
    nucleus = warp(logits, SamplingParams(do_sample=True, top_p=float(probs[0] + 0.01)))[0]
    assert (nucleus[:2] > 0).all() and (nucleus[2:] == 0).all()  # smallest prefix with mass >= top_p
    assert torch.allclose(warp(logits, SamplingParams(do_sample=True, temperature=0.5)), (logits / 0.5).softmax(-1))


@pytest.mark.parametrize("params", [SamplingParams(do_sample=True), SamplingParams(do_sample=True, temperature=0.7, top_k=5, top_p=0.9)])
@pytest.mark.parametrize("method", ["hispec", "self_spec", "autoregressive"])
@pytest.mark.parametrize("drafter_invariant", [False, True], ids=["rejection", "gumbel"])
def test_end_to_end_samples_follow_base_distribution(small_vocab_model, params, method, drafter_invariant):
    """Rejection sampling and drafter-invariant (Gumbel-max) sampling alike; row i samples with
    seed + i, so the 3000 rows are 3000 independent draws."""
    path, reference = small_vocab_model
    model = HiSpecModel.from_pretrained(str(path))
    draws = 3000
    out = model.generate([SAMPLE_PROMPT] * draws, max_new_tokens=2, do_sample=True, temperature=params.temperature,
                         top_k=params.top_k, top_p=params.top_p, seed=1234, drafter_invariant=drafter_invariant,
                         **read_by(method, draft_layer=1, verify_layer=2, window=2, num_draft=2))
    if method != "autoregressive":  # the exits must disagree with the final layer for this to test anything
        assert out.stats["acceptance_final"] < 0.95
    assert_first_two_tokens_follow(out.sequences, reference, params)


@pytest.mark.parametrize("method", ["hispec", "autoregressive"])
def test_gemma3_samples_follow_base_distribution(small_vocab_gemma, method):
    """The same chi-square test on Gemma 3 (local and global layers, window 2): 3000 draws."""
    path, reference = small_vocab_gemma
    model = HiSpecModel.from_pretrained(str(path))
    params = SamplingParams(do_sample=True, temperature=0.8)
    out = model.generate([SAMPLE_PROMPT] * 3000, max_new_tokens=2, do_sample=True, temperature=0.8, seed=4321,
                         **read_by(method, draft_layer=1, verify_layer=2, window=2, num_draft=2))
    if method != "autoregressive":
        assert out.stats["acceptance_final"] < 0.95
    assert_first_two_tokens_follow(out.sequences, reference, params)


def test_seed_makes_sampling_reproducible(small_vocab_model):
    model = HiSpecModel.from_pretrained(str(small_vocab_model[0]))
    kwargs = dict(max_new_tokens=10, do_sample=True, draft_layer=1, verify_layer=2)
    a = model.generate([SAMPLE_PROMPT] * 3, seed=7, **kwargs).sequences
    assert a == model.generate([SAMPLE_PROMPT] * 3, seed=7, **kwargs).sequences
    assert a != model.generate([SAMPLE_PROMPT] * 3, seed=8, **kwargs).sequences


@pytest.mark.parametrize("method", ["hispec", "self_spec"])
def test_reduced_exit_vocabulary_keeps_the_distribution(small_vocab_model, method, tmp_path):
    """Early exits restricted to 3 of the 8 tokens (so they can never draft the other 5): the
    samples still follow the base model's distribution (same chi-square test as above)."""
    from hispec_decode.adapter import ExitSpec, HiSpecAdapter

    path, reference = small_vocab_model
    model = HiSpecModel.from_pretrained(str(path))
    adapter = HiSpecAdapter.create(model.decoder, str(path), [ExitSpec(1, "draft"), ExitSpec(2, "intermediate")])
    for head in adapter.heads.values():
        head.set_vocab(torch.tensor([1, 4, 6]))
    adapter.save_pretrained(tmp_path / "heads")
    model = HiSpecModel.from_pretrained(str(path), heads=str(tmp_path / "heads"))
    params, draws = SamplingParams(do_sample=True), 3000
    out = model.generate([SAMPLE_PROMPT] * draws, max_new_tokens=2, do_sample=True, seed=99,
                         **read_by(method, draft_layer=1, verify_layer=2, window=2, num_draft=2))
    assert out.stats["acceptance_final"] < 0.95
    counts: dict[tuple[int, int], int] = {}
    for seq in out.sequences:
        counts[tuple(seq[:2])] = counts.get(tuple(seq[:2]), 0) + 1
    expected = exact_two_token_distribution(reference, params)
    assert sum(p for (a, _), p in expected.items() if a not in (1, 4, 6)) > 0.2  # the restriction matters
    stat, df = chi_square(counts, expected, draws)
    assert stat < chi_square_critical(df), (stat, df)


# -- drafter-invariant sampling (Gumbel-max keyed to seed and position) -----------------------------
def test_drafter_invariant_samples_are_the_same_text_for_every_method_policy_and_batch(hispec_models):
    """fp32: a seeded sample does not depend on how it was decoded (default sampling does)."""
    model = hispec_models["llama"]
    kwargs = dict(max_new_tokens=16, do_sample=True, temperature=0.9, top_p=0.95, seed=11, drafter_invariant=True)
    alone = [model.generate([p], method="autoregressive", **(kwargs | {"seed": 11 + i})).sequences[0]
             for i, p in enumerate(BATCH_PROMPTS[:5])]
    policies = [("autoregressive", {}), ("self_spec", dict(draft_layer=1, num_draft=3)),
                ("self_spec", dict(draft_layer=3, num_draft=1, draft_threshold=0.3)),
                ("hispec", dict(draft_layer=1, verify_layer=3, window=4, num_draft=2)),
                ("hispec", dict(draft_layer=2, verify_layer=4, window=8, num_draft=1, verify_threshold=0.2))]
    for method, policy in policies:
        for b in (1, 2, 5):
            assert model.generate(BATCH_PROMPTS[:b], method=method, **policy, **kwargs).sequences == alone[:b], (method, policy, b)
    preempted = model.generate(BATCH_PROMPTS[:5], method="hispec", **kwargs, num_blocks=6)
    assert preempted.sequences == alone and preempted.stats["preemptions"] > 0
    default = [model.generate(BATCH_PROMPTS[:5], method=m, **p, **(kwargs | {"drafter_invariant": False})).sequences
               for m, p in policies]
    assert any(d != default[0] for d in default[1:])  # the teeth: rejection sampling's text depends on the method


def test_top_p_mask_of_a_row_does_not_depend_on_the_other_rows():
    """The nucleus is cut per row: a row next to one whose nucleus is wide (full sort) gets the mask
    it gets alone (a top-k fast path), including at ties on the nucleus edge."""
    vocab = 2000
    narrow = torch.full((vocab,), -30.0)
    narrow[:6] = torch.tensor([5.0, 4.0, 4.0, 4.0, 3.0, 3.0])  # ties at the edge of a small nucleus
    wide = torch.zeros(vocab)  # uniform: the nucleus holds most of the vocabulary
    params = SamplingParams(do_sample=True, top_p=0.8)
    alone = warp(narrow[None], params)
    for batch in (torch.stack([narrow, wide]), torch.stack([wide, narrow, wide])):
        row = [i for i in range(len(batch)) if torch.equal(batch[i], narrow)][0]
        assert torch.equal(warp(batch, params)[row], alone[0])
