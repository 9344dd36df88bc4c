"""Prompt lookup: drafts copied from earlier in the sequence, verified as point masses. Greedy output
equals transformers' for every architecture; sampled output follows the base distribution."""

from __future__ import annotations

import pytest
import torch

from conftest import ARCHS, assert_first_two_tokens_follow, read_by, chi_square, chi_square_critical
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
            out = model.generate([prompt], max_new_tokens=16, **read_by(method, draft_layer=1, verify_layer=3, window=3,
                                                                        num_draft=2, draft_threshold=exit_drafts, lookup=8))
            assert out.sequences[0] == want, (prompt, exit_drafts)
            copied += out.stats["copied"]
    assert copied > 0, "prompt lookup found nothing to copy: this test tests nothing"
    batch = model.generate(REPEATING, max_new_tokens=16, **read_by(method, draft_layer=1, verify_layer=3, lookup=8))
    assert batch.sequences == [tiny.hf_generate(p, 16) for p in REPEATING]


@pytest.mark.parametrize("method", ["hispec", "self_spec"])
def test_samples_with_lookup_follow_base_distribution(small_vocab_model, method):
    """The chi-square test of the sampling tests, on a prompt whose last tokens occurred before, so the
    first position is drafted by lookup (3000 draws, row i with seed + i)."""
    path, reference = small_vocab_model
    model = HiSpecModel.from_pretrained(str(path))
    prompt = [3, 1, 4, 1, 5, 3, 1]
    params = SamplingParams(do_sample=True, temperature=0.9)
    out = model.generate([prompt] * 3000, max_new_tokens=2, do_sample=True, temperature=0.9, seed=99, **read_by(
        method, draft_layer=1, verify_layer=2, window=2, num_draft=1, draft_threshold=1.5, lookup=4))
    assert out.stats["copied"] >= 3000  # every row copied at its first position
    assert_first_two_tokens_follow(out.sequences, reference, params, prompt)


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("tree", ["chain", "dynamic"])
def test_greedy_with_union_tree_equals_transformers(arch, tree, tiny_models, hispec_models):
    """drafting="union": at batch 1 the copy and the draft exit's chain or tree are one tree, checked in
    one pass (with L_i pruning it, and without a middle level)."""
    tiny, model = tiny_models[arch], hispec_models[arch]
    copied = drafted = 0
    for prompt in REPEATING:
        want = tiny.hf_generate(prompt, 16)
        for verify_layer in (3, model.num_layers):
            out = model.generate([prompt], max_new_tokens=16, method="hispec", draft_layer=1, verify_layer=verify_layer,
                                 window=3, num_draft=2, tree=tree, tree_nodes=4, tree_width=2, lookup=8,
                                 drafting="union", guard=False)
            assert out.sequences[0] == want, (prompt, verify_layer)
            copied += out.stats["copied"]
            drafted += out.stats["calls_draft"]
    assert copied > 0 and drafted > 0, "no union was drafted: this test tests nothing"


def test_samples_with_union_tree_follow_base_distribution(small_vocab_model):
    """The chi-square test on a union tree at the first position (the copy and the draft exit's chain,
    verified node by node by the point-mass rule): sequences decoded one at a time (batch 1), 3000 draws."""
    path, reference = small_vocab_model
    model = HiSpecModel.from_pretrained(str(path))
    prompt = [3, 1, 4, 1, 5, 3, 1]
    params = SamplingParams(do_sample=True, temperature=0.9)
    out = model.generate([prompt] * 3000, max_new_tokens=2, method="hispec", do_sample=True, temperature=0.9,
                         seed=99, draft_layer=1, verify_layer=2, window=2, num_draft=1, lookup=4, drafting="union",
                         max_num_seqs=1, guard=False)
    assert out.stats["copied"] >= 3000 and out.stats["calls_draft"] >= 3000  # both drafted every first position
    assert_first_two_tokens_follow(out.sequences, reference, params, prompt)


def test_union_tree_holds_both_drafters(small_vocab_model):
    """The tree a union drafts: the exit's chain from the root, the copy as a second path sharing the
    nodes whose tokens it repeats; each drafter is told how many of its own nodes were accepted."""
    from hispec_decode.engine.drafters import registered
    from hispec_decode.engine.drafters.compose import union
    from hispec_decode.engine.sequence import Sequence
    from hispec_decode.cache.block_manager import BlockManager

    path, _ = small_vocab_model
    model = HiSpecModel.from_pretrained(str(path))
    policy = model.policy(method="hispec", draft_layer=1, verify_layer=2, num_draft=2, lookup=4, drafting="union")
    prompt = [3, 1, 4, 1, 5, 3, 1]  # [3, 1] occurred before: the copy is [4, 1, 5, 3]
    seq = Sequence(0, prompt, BlockManager(64, 16), (1, 2), policy=policy, limit=len(prompt) + 16)
    loop = union(seq, list(registered()), 0.0)
    request, rows = next(loop), []
    exit_tokens = [1, 2]  # what the stand-in draft exit proposes: [1] (a second path) then [2]
    try:
        while True:
            logits = torch.full((request.num_logits, 8), -9.0)
            logits[:, exit_tokens[len(rows)]] = 9.0
            rows.append(request.num_logits)
            request = loop.send(logits)
    except StopIteration as stop:
        draft = stop.value
    tree = draft.tree
    assert tree is seq.tree and tree.base == len(prompt)
    assert list(zip(tree.tokens, tree.parents)) == [(1, -1), (2, 0), (4, -1), (1, 2), (5, 3), (3, 4)]
    assert seq.tokens[len(prompt):] == tree.tokens and draft.count == 6
    seen = {}

    class Spy:
        def __init__(self, name):
            self.name = name

        def feedback(self, seq, draft, accepted):
            seen[self.name] = accepted

    draft.nodes = {Spy(d.name): mine for d, mine in draft.nodes.items()}
    draft.feedback(seq, [2, 3])  # the copy's first two tokens accepted
    assert seen == {"exit": 0, "lookup": 2}


def test_lookup_copies_in_a_batch_only_what_pays_there(small_vocab_model):
    """Batch 1 (floor 0) copies the policy's budget; in a batch the copy stops at the first token whose
    chance q^d (q: the sequence's smoothed record of checked copies) is below the batch's floor, so a
    sequence whose copies keep failing stops copying there, and one whose copies hold copies more."""
    import dataclasses

    from hispec_decode.cache.block_manager import BlockManager
    from hispec_decode.engine.drafters.base import Draft
    from hispec_decode.engine.drafters.lookup import PRIOR_ACCEPTED, PRIOR_REJECTED, PromptLookup
    from hispec_decode.engine.sequence import Sequence

    path, _ = small_vocab_model
    model = HiSpecModel.from_pretrained(str(path))
    policy = model.policy(method="hispec", draft_layer=1, verify_layer=2, num_draft=2, lookup=8)
    policy = dataclasses.replace(policy, batch_thresholds=((1, 0.0), (8, 0.7)))
    prompt = list(range(1, 11)) * 2 + [1]  # what followed the earlier [.., 1]: 9 tokens and more
    seq = Sequence(0, prompt, BlockManager(64, 16), (1, 2), policy=policy, limit=len(prompt) + 16)
    drafter = PromptLookup()
    assert drafter.paying(seq) == 8 and len(drafter.tokens(seq, prompt, 16)) == 8  # batch 1
    seq.batch_size = 8
    q = PRIOR_ACCEPTED / (PRIOR_ACCEPTED + PRIOR_REJECTED)
    want = next(d for d in range(9) if q ** (d + 1) < 0.7)
    assert drafter.paying(seq) == want and len(drafter.tokens(seq, prompt, 16)) == want
    for _ in range(3):  # copies rejected at their first token
        drafter.feedback(seq, Draft(drafter, 4), 0)
    assert drafter.paying(seq) == 0 and drafter.tokens(seq, prompt, 16) == []
    for _ in range(20):  # then copies accepted whole
        drafter.feedback(seq, Draft(drafter, 4), 4)
    record = drafter.state(seq)  # the drafter's own record, kept on the sequence
    assert (record.accepted, record.rejected) == (80, 3)
    other = Sequence(1, prompt, BlockManager(64, 16), (1, 2), policy=policy, limit=len(prompt) + 16)
    assert drafter.state(other).accepted == 0, "another sequence starts its own record"
    assert drafter.paying(seq) > want and drafter.paying(seq) <= 8
    seq.batch_size = 1
    assert drafter.paying(seq) == 8


def test_a_new_drafter_is_one_class(tiny_models, hispec_models):
    """The drafter interface: a class defined anywhere registers itself and drafts (here: the last token
    again, as point masses, before the draft exit), keeping state per sequence (its proposals so far);
    output stays transformers' token for token."""
    from hispec_decode.engine.drafters import base

    tiny, model = tiny_models["llama"], hispec_models["llama"]
    calls = []

    class RepeatLast(base.Drafter):
        name, order, point_mass = "repeat", 5, True

        def active(self, seq):
            return True

        def tokens(self, seq, context, count):
            return [context[-1]] * min(2, count)

        def new_state(self):
            return []  # this sequence's proposals

        def propose(self, seq, threshold):
            copied = self.tokens(seq, seq.tokens, seq.room())
            seq.tokens += copied
            mine = self.state(seq)
            mine.append(len(copied))
            calls.append((seq.seq_id, len(copied), len(mine)))
            return base.Draft(self, len(copied)) if copied else None
            yield

    try:
        for prompt in REPEATING:
            out = model.generate([prompt], max_new_tokens=12, method="hispec", draft_layer=1, verify_layer=3,
                                 guard=False)
            assert out.sequences[0] == tiny.hf_generate(prompt, 12)
        assert calls and max(n for _, n, _ in calls) == 2
        calls.clear()
        out = model.generate(REPEATING[:2], max_new_tokens=12, method="hispec", draft_layer=1, verify_layer=3,
                             guard=False, batch_aware=False)
        assert out.sequences == [tiny.hf_generate(p, 12) for p in REPEATING[:2]]
        seen = {seq_id: [k for s, _, k in calls if s == seq_id] for seq_id, _, _ in calls}
        assert len(seen) == 2 and all(k == list(range(1, len(k) + 1)) for k in seen.values()), seen
    finally:
        base._REGISTRY[:] = [d for d in base._REGISTRY if d.name != "repeat"]


def test_a_sequences_index_says_what_a_scan_says():
    """``PromptLookup.can_propose`` (an index grown with the sequence) agrees with a full ``lookup`` scan
    at every length, on random token streams with repeats."""
    import random

    from hispec_decode.engine.drafters.lookup import PromptLookup

    drafter, rng = PromptLookup(), random.Random(0)
    for trial in range(30):
        seq = type("Seq", (), {"tokens": [], "drafter_state": {}, "room": lambda self: 10})()
        for _ in range(60):
            seq.tokens.append(rng.randrange(4 + trial % 5))
            assert drafter.can_propose(seq) == bool(lookup(seq.tokens, 1)), seq.tokens
