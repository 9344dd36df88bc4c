"""``feature_attention`` heads: the engine's lazily computed, cached rows equal the training-time
computation (draft steps 1..k, and after a verification the rows recomputed from true final states);
decoding with them is lossless on every architecture, chains and trees, batched and preempted."""

from __future__ import annotations

import pytest
import torch

from hispec_decode import HiSpecAdapter
from hispec_decode.adapter import ExitSpec
from hispec_decode.decoding.sampling import Verdict
from hispec_decode.engine.context_states import ContextStates
from hispec_decode.engine.model_runner import ModelRunner
from hispec_decode.engine.sequence import BandRequest, Sequence
from hispec_decode.models.feature_head import unrolled_attention

from conftest import ARCHS, LOSSLESS_NEW as NEW, LOSSLESS_PROMPTS as PROMPTS, read_by


def _randomise(adapter: HiSpecAdapter, scale: float = 0.2, seed: int = 1) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for head in adapter.heads.values():
            for p in head.parameters():
                if p.dim() == 2:
                    p.add_(scale * torch.randn(p.shape, generator=g))


def _feature_adapter(model, tiny, layers=(2,), **options) -> HiSpecAdapter:
    roles = ("draft", "intermediate")
    specs = [ExitSpec(l, roles[i], "feature_attention", options) for i, l in enumerate(layers)]
    return HiSpecAdapter.create(model.decoder, str(tiny.path), specs)


def test_unrolled_attention_step_one_is_causal_attention():
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 4, 7, 8, generator=g) for _ in range(3))
    want = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, scale=0.3)
    torch.testing.assert_close(unrolled_attention(q, [k], [v], 0.3, None), want.transpose(1, 2).flatten(2))
    # step 3 at position t: step-1 keys up to t - 2, the step-2 key at t - 1, its own at t
    k2, v2, k3, v3 = (torch.randn(2, 4, 7, 8, generator=g) for _ in range(4))
    got = unrolled_attention(q, [k, k2, k3], [v, v2, v3], 0.3, None).view(2, 7, 4, 8).transpose(1, 2)
    t = 5
    keys = torch.cat([k[:, :, : t - 1], k2[:, :, t - 1 : t], k3[:, :, t : t + 1]], dim=2)
    vals = torch.cat([v[:, :, : t - 1], v2[:, :, t - 1 : t], v3[:, :, t : t + 1]], dim=2)
    probs = torch.softmax(q[:, :, t : t + 1] @ keys.transpose(-1, -2) * 0.3, dim=-1)
    torch.testing.assert_close(got[:, :, t : t + 1], probs @ vals)


@pytest.mark.parametrize("arch", ["llama", "qwen3", "opt"])  # opt: a narrower LM-head input (the context)
def test_engine_rows_equal_the_training_computation(arch, tiny_models):
    """Drafts 1, 2, 3 after a full pass are draft steps 1, 2, 3 of training; once the full model has
    verified them, their rows are recomputed from the true final states (the next draft is step 1)."""
    tiny = tiny_models[arch]
    model = tiny.load()
    adapter = _feature_adapter(model, tiny)
    _randomise(adapter)
    head = adapter.head(2).eval()
    runner = ModelRunner(model.decoder, {2: head})
    tokens = [4, 8, 15, 16, 23, 42, 7, 1, 9, 3, 30, 12]
    cache = runner.new_cache(8, 4)
    st = Sequence(0, tokens[:6], cache.manager, (2, model.num_layers), limit=30)
    st.allocate()
    runner.advance([BandRequest(st, 1, 1)], cache)  # the full model over the prompt
    st.commit(6, Verdict(0, tokens[6], None))
    got = [runner.advance([BandRequest(st, 0, 1)], cache)[0]]  # position 6: step 1
    for t in tokens[7:9]:  # positions 7, 8: steps 2, 3
        st.tokens.append(t)
        got.append(runner.advance([BandRequest(st, 0, 1)], cache)[0])
    st.tokens.append(tokens[9])
    runner.advance([BandRequest(st, 1, 4)], cache)  # the full model verifies positions 6..9
    st.commit(7, Verdict(3, tokens[10], None))  # accepts all three drafts; tokens[10] is its own
    after = runner.advance([BandRequest(st, 0, 1)], cache)[0]  # position 10: step 1 again
    inner = getattr(tiny.reference, tiny.reference.base_model_prefix)
    with torch.no_grad():
        out = inner(input_ids=torch.tensor([tokens[:11]]), output_hidden_states=True)
        steps = head.draft_steps(out.hidden_states[2], model.decoder, out.last_hidden_state, 3)
        want = [head.project(steps[j], model.decoder)[0, 6 + j] for j in range(3)]
        want_after = head.project(steps[0], model.decoder)[0, 10]
    for j in range(3):
        torch.testing.assert_close(got[j][0], want[j], atol=1e-4, rtol=1e-4, msg=f"step {j + 1}")
    torch.testing.assert_close(after[0], want_after, atol=1e-4, rtol=1e-4)
    assert not torch.allclose(want[1], head.project(steps[0], model.decoder)[0, 7], atol=1e-3)  # steps differ
    assert st.context.exact[2] == st.context.done[2] == 11


def test_context_bookkeeping_of_feature_heads():
    ctx = ContextStates()
    for p in range(4):
        ctx.keep_hidden(2, p, torch.zeros(2))
    assert ctx.feature_start(2) == 0 and ctx.keep_from(10) == -1  # nothing computed: everything is kept
    for p in range(3):
        ctx.computed(2, p, exact=p < 2)
    assert (ctx.done[2], ctx.exact[2]) == (3, 2) and ctx.feature_start(2) == 3  # final at 1 unknown: no redo
    ctx.keep_final(1, torch.ones(2))
    assert ctx.feature_start(2) == 2  # now row 2 can be recomputed from it
    ctx.forget_before(5)
    assert 1 in ctx.final and 2 in ctx.hidden[2] and 0 not in ctx.hidden[2]  # kept for that
    ctx.truncate(2)
    assert (ctx.done[2], ctx.exact[2]) == (2, 2) and 2 not in ctx.hidden[2]


@pytest.mark.parametrize("arch", ARCHS)
def test_feature_heads_decode_losslessly(arch, hispec_models, tiny_models, references, tmp_path):
    """Random feature heads at both exits: greedy output equals transformers', alone, batched and
    with chunked prefill, for both speculative methods."""
    adapter = _feature_adapter(hispec_models[arch], tiny_models[arch], layers=(1, 3))
    _randomise(adapter)
    adapter.save_pretrained(tmp_path / "heads")
    model = tiny_models[arch].load(heads=str(tmp_path / "heads"))
    prompts = list(PROMPTS.values())
    want = [references[arch, n] for n in PROMPTS]
    for method, kw in (("hispec", dict(window=4, num_draft=3)), ("self_spec", dict(num_draft=4))):
        assert [model.generate([p], max_new_tokens=NEW, method=method, **kw).sequences[0] for p in prompts] == want
        assert model.generate(prompts, max_new_tokens=NEW, method=method, **kw).sequences == want, method
        chunked = model.generate(prompts, max_new_tokens=NEW, method=method, prefill_chunk=3, **kw)
        assert chunked.sequences == want, f"{method}, chunked prefill"


@pytest.mark.parametrize("arch", ["llama", "opt"])
def test_feature_heads_with_trees_and_preemption(arch, hispec_models, tiny_models, references, tmp_path):
    adapter = _feature_adapter(hispec_models[arch], tiny_models[arch], layers=(1, 3))
    _randomise(adapter, 0.05)
    adapter.save_pretrained(tmp_path / "heads")
    model = tiny_models[arch].load(heads=str(tmp_path / "heads"))
    prompts = list(PROMPTS.values())
    want = [references[arch, n] for n in PROMPTS]
    for verify_layer in (3, model.num_layers):  # L_i prunes the tree; L_f verifies it
        for tree in ("static", "dynamic"):
            kw = dict(method="hispec", draft_layer=1, verify_layer=verify_layer, window=4, num_draft=3, tree=tree,
                      tree_nodes=6, tree_width=2)
            assert model.generate(prompts, max_new_tokens=NEW, **kw).sequences == want, (verify_layer, tree)
    small = model.generate(prompts, max_new_tokens=NEW, method="self_spec", num_draft=3, num_blocks=14, block_size=4)
    assert small.sequences == want and small.stats["preemptions"] > 0


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_bf16_batch_invariant_feature_heads_equal_own_autoregressive(arch, hispec_models, tiny_models, tmp_path):
    """In the batch-invariant mode a feature head's rows (packed fuse, its layer's row-by-row attention)
    keep bf16 speculation equal to the engine's own autoregressive output, alone and batched, chains and trees."""
    adapter = _feature_adapter(hispec_models[arch], tiny_models[arch], layers=(1, 3))
    _randomise(adapter, 0.05)
    adapter.save_pretrained(tmp_path / "heads")
    model = tiny_models[arch].load(heads=str(tmp_path / "heads"), dtype="bfloat16", batch_invariant=True)
    prompts = list(PROMPTS.values())
    alone = [model.generate([p], max_new_tokens=NEW, method="autoregressive").sequences[0] for p in prompts]
    always = dict(draft_threshold=0.0, verify_threshold=0.0, batch_aware=False)  # speculate at any batch size
    for kw in (dict(method="hispec", window=4, num_draft=3, **always),
               read_by("self_spec", num_draft=3, tree="dynamic", tree_nodes=5, tree_width=2, **always)):
        assert [model.generate([p], max_new_tokens=NEW, **kw).sequences[0] for p in prompts] == alone, kw
        assert model.generate(prompts, max_new_tokens=NEW, **kw).sequences == alone, kw
