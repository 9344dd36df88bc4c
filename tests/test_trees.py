"""Token trees: drafted at L_d, pruned at L_i (or verified whole at L_f), lossless greedy and sampled.

Greedy: token-for-token equality with transformers' generate (fp32) on every architecture, for
static, dynamic and width-1 trees, with the middle level pruning and off, alone, batched and
preempted, with exits that accept everything and exits that reject everything, with heads that
keep their own K/V or read deep contexts. Sampling: the point-mass rule is exact (analytically and
by Monte Carlo of the sampler's own code), and end to end the joint distribution of the first two
tokens is the base model's (chi-square, 99.9%, as in test_sampling.py) at both stages.
"""

from __future__ import annotations

import pytest
import torch

from hispec_decode import HiSpecAdapter, HiSpecModel
from hispec_decode.adapter import ExitSpec
from hispec_decode.decoding.sampling import SamplingParams, TokenSampler
from hispec_decode.decoding.tree import DraftTree, static_shape
from hispec_decode.engine.sequence import BandRequest, Sequence

from conftest import (ARCHS, BATCH_PROMPTS, LAYERS, SAMPLE_PROMPT, assert_first_two_tokens_follow, chi_square,
                      chi_square_critical, identity_above, save_tiny, zero_head)
from conftest import LOSSLESS_NEW as NEW
from conftest import LOSSLESS_PROMPTS as PROMPTS

SHAPES = {
    "static": dict(tree="static", tree_nodes=8, tree_width=3, num_draft=3),
    "dynamic": dict(tree="dynamic", tree_nodes=10, tree_width=4, num_draft=4),
    "width-1": dict(tree="dynamic", tree_nodes=4, tree_width=1, num_draft=4),  # a chain, drafted as a tree
}
LEVELS = {
    "L_i prunes": dict(method="hispec", draft_layer=1, verify_layer=3, window=4),
    "L_i off": dict(method="hispec", draft_layer=2, verify_layer=LAYERS),  # the tree goes straight to L_f
    "self_spec": dict(method="self_spec", draft_layer=1),  # the same decode loop as "L_i off", at L_d = 1
}


def test_static_shape_takes_the_most_likely_rank_paths_parents_first():
    shape = static_shape(7, 3, 3)
    assert len(shape) == 7 and shape[0] == (0,) and len(set(shape)) == 7
    assert all(p[:-1] in shape for p in shape if len(p) > 1)  # every node's parent is in the tree ...
    assert all(shape.index(p[:-1]) < shape.index(p) for p in shape if len(p) > 1)  # ... before it
    assert all(len(p) <= 3 and max(p) < 3 for p in shape)
    assert static_shape(3, 3, 3) == ((0,), (1,), (0, 0))  # 0.318 * 0.318 = 0.101 < 0.105 of the second choice
    assert static_shape(4, 3, 3) == ((0,), (1,), (2,), (0, 0))  # ... and more than the third's 0.061
    assert static_shape(3, 5, 1) == ((0,), (0, 0), (0, 0, 0))  # width 1: a chain


def test_tree_rows_see_ancestors_only():
    tree = DraftTree(base=10)
    a = tree.add(5, -1, 0.5)
    b = tree.add(6, -1, 0.2)
    c = tree.add(7, a, 0.3)
    d = tree.add(8, c, 0.1)
    rows = tree.rows()
    assert rows.depth.tolist() == [1, 1, 2, 3]
    assert rows.visible.int().tolist() == [[1, 0, 0, 0], [0, 1, 0, 0], [1, 0, 1, 0], [1, 0, 1, 1]]
    assert tree.children(-1) == [a, b] and tree.children(a) == [c] and tree.score(d) == 0.1
    with pytest.raises(ValueError):
        tree.add(1, 7, 0.1)


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("level", ["L_i prunes", "L_i off"])
def test_trees_match_transformers(arch, shape, level, hispec_models, references):
    model = hispec_models[arch]
    for n, prompt in PROMPTS.items():
        out = model.generate([prompt], max_new_tokens=NEW, **LEVELS[level], **SHAPES[shape])
        assert out.sequences[0] == references[arch, n], n
        assert out.stats["calls_draft"] > 0


@pytest.mark.parametrize("arch", ["llama", "opt"])
def test_batched_and_preempted_trees_match_transformers(arch, hispec_models, references):
    model = hispec_models[arch]
    want = [references[arch, n] for n in PROMPTS]
    for level in ("L_i prunes", "L_i off"):
        for shape in ("static", "dynamic"):
            kwargs = LEVELS[level] | SHAPES[shape]
            assert model.generate(list(PROMPTS.values()), max_new_tokens=NEW, **kwargs).sequences == want
            small = model.generate(list(PROMPTS.values()), max_new_tokens=NEW, num_blocks=14, block_size=4, **kwargs)
            assert small.sequences == want and small.stats["preemptions"] > 0, (level, shape)


@pytest.mark.parametrize("arch", ["llama", "opt"])
def test_trees_stop_at_eos_like_transformers(arch, tiny_models, hispec_models, references):
    prompt, full = PROMPTS[5], references[arch, 5]
    for cut in (0, 3, 10):  # EOS as the first, an early and a later token
        ref = tiny_models[arch].hf_generate(prompt, NEW, eos_token_id=full[cut])
        for level in ("L_i prunes", "L_i off"):
            out = hispec_models[arch].generate([prompt], max_new_tokens=NEW, eos_token_id=full[cut], **LEVELS[level],
                                               **SHAPES["dynamic"])
            assert out.sequences[0] == ref, (cut, level)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "opt"])
def test_trees_with_exits_that_accept_everything(arch, tmp_path):
    tiny = save_tiny(arch, tmp_path / "base", mutate=identity_above(1))
    model = tiny.load()
    chain = dict(tree="dynamic", tree_nodes=4, tree_width=1, num_draft=4)
    for n, prompt in PROMPTS.items():
        ref = tiny.hf_generate(prompt, NEW)
        off = model.generate([prompt], max_new_tokens=NEW, method="self_spec", draft_layer=1, **chain)
        prune = model.generate([prompt], max_new_tokens=NEW, method="hispec", draft_layer=1, verify_layer=3, window=8,
                               **SHAPES["dynamic"])
        assert off.sequences[0] == ref and prune.sequences[0] == ref
        assert off.stats["acceptance_final"] == 1.0 and off.stats["calls_full"] <= -(-NEW // 5) + 1  # 4 + 1 per pass
        assert prune.stats["acceptance_final"] == 1.0  # L_i's surviving path is all right


@pytest.mark.parametrize("arch", ARCHS)
def test_trees_with_exits_that_reject_almost_everything(arch, hispec_models, tiny_models, references, tmp_path):
    specs = [ExitSpec(1, "draft", "residual_linear"), ExitSpec(3, "intermediate", "residual_linear")]
    adapter = HiSpecAdapter.create(hispec_models[arch].decoder, str(tiny_models[arch].path), specs)
    zero_head(adapter.head(1))  # the draft exit always proposes the same few tokens
    adapter.save_pretrained(tmp_path / "heads")
    model = tiny_models[arch].load(heads=str(tmp_path / "heads"))
    for n, prompt in PROMPTS.items():
        for level in ("L_i prunes", "self_spec"):
            out = model.generate([prompt], max_new_tokens=NEW, **LEVELS[level], **SHAPES["static"])
            assert out.sequences[0] == references[arch, n], (level, n)
            accepted = out.stats["acceptance_intermediate" if level == "L_i prunes" else "acceptance_final"]
            assert accepted <= 0.1, (level, accepted)


@pytest.mark.parametrize("arch", ["llama", "opt"])
@pytest.mark.parametrize("head_type,options", [("deep_context", {}), ("decoder_block", {"attention_only": True})])
def test_trees_with_heads_that_keep_state(arch, head_type, options, hispec_models, tiny_models, references, tmp_path):
    """Random deep-context heads (a node's context is its parent's state) and attention-only blocks
    (their own K/V, moved with the accepted path) at both exits."""
    specs = [ExitSpec(1, "draft", head_type, options), ExitSpec(3, "intermediate", head_type, options)]
    adapter = HiSpecAdapter.create(hispec_models[arch].decoder, str(tiny_models[arch].path), specs)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for spec in specs:
            for p in adapter.head(spec.layer).parameters():
                if p.dim() == 2:
                    p.add_(torch.randn(p.shape, generator=g) * 0.05)
    adapter.save_pretrained(tmp_path / "heads")
    model = tiny_models[arch].load(heads=str(tmp_path / "heads"))
    want = [references[arch, n] for n in PROMPTS]
    for level in ("L_i prunes", "self_spec"):
        kwargs = LEVELS[level] | SHAPES["dynamic"]
        assert [model.generate([p], max_new_tokens=NEW, **kwargs).sequences[0] for p in PROMPTS.values()] == want
        for shape in ("static", "dynamic"):
            kwargs = LEVELS[level] | SHAPES[shape]
            assert model.generate(list(PROMPTS.values()), max_new_tokens=NEW, **kwargs).sequences == want, (level, shape)


def test_cache_after_trees_equals_a_fresh_forward(hispec_models):
    """Accepted paths are moved to consecutive slots: every band's K/V of the kept tokens is what a
    fresh pass over them computes, mid-generation (nothing of a rejected branch survives)."""
    model = hispec_models["llama"]
    runner = model.runner
    engine = model.build_engine(method="hispec", num_blocks=64, block_size=4, draft_layer=2, verify_layer=4, window=3,
                                **SHAPES["dynamic"])
    engine.add_request([5, 9, 2, 6, 5, 3], max_new_tokens=60)
    engine.add_request([1, 2], max_new_tokens=60)
    for steps in (4, 9, 15):
        while engine.steps < steps:
            engine.step()
        engine.cache.manager.check()
        st = engine.scheduler.running[0]
        assert st.tree is None or engine.steps  # a tree may be out between steps; its nodes are not compared
        kept = st.tree.base if st.tree is not None else len(st.tokens)
        lengths = [min(n, kept) for n in engine.cache.manager.lengths(st.seq_id)]
        fresh = runner.new_cache(64, 4)
        probe = Sequence(0, st.tokens[:kept], fresh.manager, (model.num_layers,))
        probe.allocate()
        runner.advance([BandRequest(probe, 0, 1)], fresh)
        for layer in range(model.num_layers):
            n = lengths[next(b for b, top in enumerate(st.exits) if layer < top)]
            k, v = engine.cache.read(layer, engine.cache.slots(st.seq_id, 0, n))
            k0, v0 = fresh.read(layer, fresh.slots(0, 0, n))
            assert torch.allclose(k, k0, atol=1e-5) and torch.allclose(v, v0, atol=1e-5), (steps, layer)


# -- sampling ---------------------------------------------------------------------------------

def _point_mass_distribution(p: torch.Tensor, candidates: list[int]) -> torch.Tensor:
    """What the sequential point-mass rule outputs, computed exactly."""
    out, r, alive = torch.zeros_like(p), p.clone(), 1.0
    for c in candidates:
        out[c] += alive * r[c]
        alive *= 1 - r[c]
        r[c] = 0
        if r.sum() > 0:
            r = r / r.sum()
    return out + alive * r


@pytest.mark.parametrize("case", range(30))
def test_point_mass_rule_is_exact(case):
    g = torch.Generator().manual_seed(case)
    p = torch.rand(7, generator=g, dtype=torch.float64) ** 3
    p[torch.randperm(7, generator=g)[: case % 3]] = 0  # targets may be truncated (top-k, top-p)
    p /= p.sum()
    candidates = torch.randperm(7, generator=g)[: 1 + case % 4].tolist()  # even candidates of probability 0
    assert torch.allclose(_point_mass_distribution(p, candidates), p, atol=1e-12)


def test_tree_verification_samples_the_target():
    """Monte Carlo of verify_tree itself: the first token of the walk follows the root's target."""
    vocab, draws = 6, 20000
    g = torch.Generator().manual_seed(2)
    p = torch.rand(vocab, generator=g) ** 2
    p /= p.sum()
    tree = DraftTree(base=4)
    for token in (3, 0, 5):
        tree.add(token, -1, 0.3)
    tree.add(1, 0, 0.1)
    logits = torch.stack([p.log()] + [torch.randn(vocab, generator=g) for _ in tree.tokens])
    sampler = TokenSampler(SamplingParams(do_sample=True, seed=3))
    counts: dict[int, int] = {}
    for _ in range(draws):
        walk = sampler.verify_tree(tree, logits)
        first = tree.tokens[walk.path[0]] if walk.path else walk.token
        counts[first] = counts.get(first, 0) + 1
        assert walk.replaced == (not walk.path) or walk.path[-1] in (0, 3)
    stat, df = chi_square(counts, {i: float(p[i]) for i in range(vocab)}, draws)
    assert stat < chi_square_critical(df), (stat, df)


@pytest.mark.parametrize("level,shape,drafter_invariant", [
    ("L_i prunes", "static", False), ("self_spec", "dynamic", False), ("L_i prunes", "dynamic", True)])
def test_sampled_trees_follow_the_base_distribution(small_vocab_model, level, shape, drafter_invariant):
    """Joint distribution of the first two new tokens (each of 3000 rows samples with seed + i): the
    tree is checked at L_i then the path at L_f (``L_i prunes``), or the tree at L_f (``self_spec``)."""
    path, reference = small_vocab_model
    model = HiSpecModel.from_pretrained(str(path))
    params, draws = SamplingParams(do_sample=True, temperature=0.9), 3000
    kwargs = dict(LEVELS[level], tree=shape, tree_nodes=6, tree_width=3, num_draft=2) | dict(verify_layer=2, window=3)
    if level == "self_spec":
        kwargs.pop("verify_layer"), kwargs.pop("window")
    out = model.generate([SAMPLE_PROMPT] * draws, max_new_tokens=2, do_sample=True, temperature=0.9, seed=4321,
                         drafter_invariant=drafter_invariant, **kwargs)
    assert out.stats["acceptance_final"] < 0.95  # the exits disagree: the test has teeth
    assert_first_two_tokens_follow(out.sequences, reference, params)


def test_drafter_invariant_trees_give_the_autoregressive_text(hispec_models):
    model = hispec_models["llama"]
    kwargs = dict(max_new_tokens=16, do_sample=True, temperature=0.9, top_p=0.95, seed=11, drafter_invariant=True)
    alone = [model.generate([p], method="autoregressive", **(kwargs | {"seed": 11 + i})).sequences[0]
             for i, p in enumerate(BATCH_PROMPTS[:4])]
    for level in LEVELS.values():
        for shape in SHAPES.values():
            for b in (1, 4):
                assert model.generate(BATCH_PROMPTS[:b], **level, **shape, **kwargs).sequences == alone[:b]


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_bf16_batch_invariant_trees_equal_own_autoregressive(arch, tiny_models):
    """The batch-invariant mode keeps its guarantee with trees: a node's numbers are those of the
    same token decoded alone (row-independent kernels, ancestors-only attention, exact K/V moves)."""
    model = tiny_models[arch].load(dtype="bfloat16", batch_invariant=True)
    prompts = BATCH_PROMPTS[:4]
    alone = [model.generate([p], max_new_tokens=NEW, method="autoregressive").sequences[0] for p in prompts]
    fixed = dict(draft_threshold=0.0, verify_threshold=0.0, batch_aware=False)
    for level in ("L_i prunes", "L_i off"):
        for shape in ("static", "dynamic"):
            for b in (1, 4):
                out = model.generate(prompts[:b], max_new_tokens=NEW, **LEVELS[level], **SHAPES[shape], **fixed)
                assert out.sequences == alone[:b], (level, shape, b)


def test_tree_depth_is_capped_at_the_smallest_sliding_window(hispec_models, monkeypatch):
    """A node deeper than a sliding window would see ancestors its position no longer sees."""
    model = hispec_models["qwen3"]
    assert model.policy(method="hispec", tree="dynamic", num_draft=5).num_draft == 5
    monkeypatch.setattr(type(model.decoder), "min_sliding_window", lambda self: 3)
    assert model.policy(method="hispec", tree="dynamic", num_draft=5).num_draft == 3
    assert model.policy(method="hispec", tree="chain", num_draft=5).num_draft == 5  # a chain is linear
