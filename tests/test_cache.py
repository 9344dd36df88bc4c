"""Mid-generation, every layer's paged cache equals a fresh forward pass over the same tokens."""

from __future__ import annotations

import pytest
import torch

from hispec_decode.engine.context_states import ContextStates
from hispec_decode.engine.model_runner import ModelRunner
from hispec_decode.engine.sequence import BandRequest, Sequence

from conftest import ARCHS, read_by


def _allocated(seq: Sequence) -> Sequence:
    seq.allocate()
    return seq


def _band_of(layer: int, exits: tuple[int, ...]) -> int:
    return next(b for b, top in enumerate(exits) if layer < top)


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("method", ["autoregressive", "self_spec", "hispec"])
def test_paged_cache_equals_fresh_forward(arch, method, hispec_models):
    model = hispec_models[arch]
    runner = model.runner
    server = model.build_engine(num_blocks=64, block_size=4, **read_by(method, draft_layer=2, verify_layer=4, window=3,
                                                                       num_draft=3))
    server.add_request([5, 9, 2, 6, 5, 3], max_new_tokens=60)
    server.add_request([1, 2], max_new_tokens=60)  # a neighbour, so blocks interleave
    for steps in (3, 8, 13):
        while server.steps < steps:
            server.step()
        server.cache.manager.check()
        st = server.scheduler.running[0]
        lengths = server.cache.manager.lengths(st.seq_id)
        assert lengths == sorted(lengths, reverse=True), "a lower band never holds fewer tokens than an upper one"
        assert lengths[0] <= len(st.tokens)

        fresh = runner.new_cache(64, 4)
        runner.advance([BandRequest(_allocated(Sequence(0, st.tokens, fresh.manager, (model.num_layers,))), 0, 1)], fresh)
        for layer in range(model.num_layers):
            n = lengths[_band_of(layer, st.exits)]
            k, v = server.cache.read(layer, server.cache.slots(st.seq_id, 0, n))
            k0, v0 = fresh.read(layer, fresh.slots(0, 0, n))
            assert torch.allclose(k, k0, atol=1e-5) and torch.allclose(v, v0, atol=1e-5), (steps, layer)


def test_pending_hidden_states_match_their_layers(hispec_models):
    """Hidden states waiting at an exit are exactly those a fresh pass produces at that layer."""
    model = hispec_models["llama"]
    runner = model.runner
    cache = runner.new_cache(16, 4)
    st = _allocated(Sequence(0, [4, 8, 15, 16, 23, 42], cache.manager, (2, 4, model.num_layers)))
    runner.advance([BandRequest(st, 0, 1)], cache)
    st.tokens += [7, 7, 7]  # three drafts, then an intermediate check, then a rejection of two
    runner.advance([BandRequest(st, 1, 4)], cache)
    st.truncate(7)
    assert st.processed(0) == 7 and st.processed(1) == 7 and st.processed(2) == 0
    assert st.pending[0] is None and st.pending[1].shape[1] == 7
    assert len(cache.manager.table(0)) == 2  # 7 tokens in blocks of 4: the third block (tokens 8, 9) was freed

    fresh = _allocated(Sequence(1, st.tokens, cache.manager, (4, model.num_layers)))
    runner.advance([BandRequest(fresh, 0, 1)], cache)
    assert torch.allclose(st.pending[1], fresh.pending[0], atol=1e-5)


@pytest.mark.parametrize("arch,options", [("qwen3", {}), ("qwen3", {"attention_only": True}),
                                          ("opt-post-ln", {"attention_only": True})])
def test_decoder_block_head_cache_equals_its_sequence_transform(arch, options, tiny_models):
    """Drafting through the engine (head K/V cached, fed in pieces) gives the logits the head
    computes over the whole sequence at once (how it is trained); also for the attention-only
    (Kangaroo) block."""
    from hispec_decode import HiSpecAdapter
    from hispec_decode.adapter import ExitSpec

    tiny = tiny_models[arch]
    model = tiny.load()
    adapter = HiSpecAdapter.create(model.decoder, str(tiny.path), [ExitSpec(2, "draft", "decoder_block", options)])
    assert ("2.block.mlp.down_proj.weight" in adapter.state_dict_flat()) == (arch == "qwen3" and not options)
    head = adapter.head(2)
    with torch.no_grad():
        for p in head.block.parameters():
            p.add_(0.05 * torch.randn_like(p))  # no longer a copy of layer 2
    runner = ModelRunner(model.decoder, {2: head.eval()})
    tokens = [4, 8, 15, 16, 23, 42, 7, 1, 9]
    cache = runner.new_cache(8, 4)
    st = _allocated(Sequence(0, tokens[:5], cache.manager, (2, model.num_layers)))
    got = [runner.advance([BandRequest(st, 0, 5)], cache)[0]]
    for t in tokens[5:]:
        st.tokens.append(t)
        got.append(runner.advance([BandRequest(st, 0, 1)], cache)[0])
    inner = getattr(tiny.reference, tiny.reference.base_model_prefix)
    with torch.no_grad():
        h2 = inner(input_ids=torch.tensor([tokens]), output_hidden_states=True).hidden_states[2]
        want = head(h2, model.decoder)[0]
    assert torch.allclose(torch.cat(got), want, atol=1e-4)


@pytest.mark.parametrize("arch", ["llama", "opt"])  # opt: the LM head's input (project_out) is narrower
def test_deep_context_head_in_the_engine_equals_its_training_computation(arch, tiny_models):
    """After a full pass, the first draft reads the final state of the previous position (the
    training's first variant); the next draft reads the head's own output there (the second)."""
    from hispec_decode import HiSpecAdapter
    from hispec_decode.adapter import ExitSpec
    from hispec_decode.decoding.sampling import Verdict

    tiny = tiny_models[arch]
    model = tiny.load()
    adapter = HiSpecAdapter.create(model.decoder, str(tiny.path), [ExitSpec(2, "draft", "deep_context")])
    head = adapter.head(2).eval()
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in (head.proj.weight, head.ctx.weight):
            p.copy_(0.3 * torch.randn(p.shape, generator=g))
    runner = ModelRunner(model.decoder, {2: head})
    tokens = [4, 8, 15, 16, 23, 42, 7, 1]
    cache = runner.new_cache(8, 4)
    st = _allocated(Sequence(0, tokens[:6], cache.manager, (2, model.num_layers), limit=20))
    runner.advance([BandRequest(st, 1, 1)], cache)  # the full model over the prompt
    st.commit(6, Verdict(0, tokens[6], None))  # its token is committed (older states are pruned)
    first = runner.advance([BandRequest(st, 0, 1)], cache)[0]  # a draft at position 6: context = final state at 5
    st.tokens.append(tokens[7])
    second = runner.advance([BandRequest(st, 0, 1)], cache)[0]  # position 7: context = its own output at 6
    inner = getattr(tiny.reference, tiny.reference.base_model_prefix)
    with torch.no_grad():
        out = inner(input_ids=torch.tensor([tokens]), output_hidden_states=True)
        true_ctx, own_ctx = head.training_transforms(out.hidden_states[2], model.decoder, out.last_hidden_state)
        want_first = head.project(true_ctx, model.decoder)[0, 6]
        want_second = head.project(own_ctx, model.decoder)[0, 7]
    torch.testing.assert_close(first[0], want_first, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(second[0], want_second, atol=1e-4, rtol=1e-4)
    assert not torch.allclose(first[0], head(out.hidden_states[2], model.decoder)[0, 6], atol=1e-3)  # the context counts
    st.truncate(7)  # a rejected draft takes its own state with it
    assert 7 not in st.context.own[2] and 6 in st.context.own[2]


def test_deep_context_falls_back_to_a_deeper_heads_state():
    """Where the draft head never ran (the intermediate exit accepted its last draft), the next
    draft reads the intermediate head's output there rather than nothing."""
    ctx = ContextStates()
    ctx.keep_final(5, torch.full((2,), 5.0))
    ctx.keep_own(2, 6, torch.full((2,), 2.0))
    for position, value in ((6, 1.0), (7, 8.0)):
        ctx.keep_own(8, position, torch.full((2,), value))
    assert float(ctx.context_at(2, 5)[0]) == 5.0  # the full model's state first
    assert float(ctx.context_at(2, 6)[0]) == 2.0  # then the head's own
    assert float(ctx.context_at(2, 7)[0]) == 8.0  # then a deeper head's
    assert ctx.context_at(2, 9) is None
    ctx.truncate(7)
    ctx.forget_before(6)
    assert ctx.context_at(2, 7) is None and ctx.context_at(2, 5) is None and float(ctx.context_at(2, 6)[0]) == 2.0
