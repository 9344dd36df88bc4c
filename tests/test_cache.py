"""After generation every layer's cache equals a fresh forward pass over the final sequence."""

from __future__ import annotations

import pytest
import torch

from hispec_decode.engine import Engine

from conftest import ARCHS


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("method", ["autoregressive", "self_spec", "hispec"])
def test_cache_equals_fresh_forward(arch, method, hispec_models):
    model = hispec_models[arch]
    prompt = [5, 9, 2, 6, 5, 3]
    (run,) = model.decode([prompt], max_new_tokens=20, method=method, draft_layer=2, verify_layer=4,
                          window=3, num_draft=3)
    st = run.state
    lengths = st.cache.lengths
    assert lengths == sorted(lengths, reverse=True), "a lower layer never holds fewer entries than an upper one"
    assert all(n <= len(st.tokens) for n in lengths)
    assert lengths[-1] in (len(st.tokens) - 1, len(st.tokens))  # the full model saw all but the last token

    fresh = Engine(model.arch).new_state(st.tokens, (model.num_layers,), len(st.tokens))
    model.engine.advance(fresh, 0)
    for layer, n in enumerate(lengths):
        k, v = st.cache.valid(layer)
        assert torch.allclose(k, fresh.cache.keys[layer][:, :, :n], atol=1e-5), layer
        assert torch.allclose(v, fresh.cache.values[layer][:, :, :n], atol=1e-5), layer


def test_pending_hidden_states_match_their_layers(hispec_models):
    """Hidden states waiting at an exit are exactly those a fresh pass produces at that layer."""
    model = hispec_models["llama"]
    engine = model.engine
    st = engine.new_state([4, 8, 15, 16, 23, 42], (2, 4, model.num_layers), 64)
    engine.advance(st, 0)
    st.tokens += [7, 7]  # two drafts, then an intermediate check, then a rejection of one
    engine.advance(st, 1)
    engine.truncate(st, 7)
    assert st.processed(0) == 7 and st.processed(1) == 7 and st.processed(2) == 0
    assert st.pending[0] is None and st.pending[1].shape[1] == 7

    fresh = engine.new_state(st.tokens, (4, model.num_layers), 64)
    h4 = engine.advance(fresh, 0)
    assert torch.allclose(st.pending[1], h4, atol=1e-5)
