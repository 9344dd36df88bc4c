"""The compiled layer stack against the Python layer loop it replaces: the same hidden states and
the same K/V, bit for bit, for every architecture it runs (and it declines the others)."""

from __future__ import annotations

import random

import pytest
import torch

from conftest import ARCHS, VOCAB
from hispec_decode import kernels
from hispec_decode.layers.attention import TreeRows

pytestmark = pytest.mark.skipif(kernels.ops() is None, reason="the compiled kernels are not available here")
_rng = random.Random(3)
PROMPTS_FOR_STACK = ([_rng.randrange(VOCAB) for _ in range(14)], [_rng.randrange(VOCAB) for _ in range(5)])
STACKED = {"llama", "llama-tied-mha", "qwen2", "qwen3", "gemma3"}  # OPT (LayerNorm, learned positions) is not


def _passes(decoder, use_stack: bool) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Hidden states of a prefill, single-token decodes, a ragged batch and a draft tree; and the pools."""
    decoder.use_stack = use_stack
    cache = decoder.new_cache(64, 4)
    seq, other = PROMPTS_FOR_STACK
    lengths: dict[int, int] = {}
    tree = TreeRows(len(seq), torch.tensor([1, 1, 2]), torch.tensor([[1, 0, 0], [0, 1, 0], [1, 0, 1]], dtype=torch.bool))
    passes = [[(0, seq[:7], None)], [(0, seq[7:8], None)], [(1, other, None), (0, seq[8:11], None)],
              [(0, seq[11:], None), (1, [5], None)], [(0, [3, 4, 5], tree), (1, [6, 7], None)]]
    states = []
    for p in passes:
        spans, ids, trees = [], [], []
        for seq_id, tokens, t in p:
            if seq_id not in lengths:
                cache.manager.add(seq_id, 1)
                lengths[seq_id] = 0
            start = lengths[seq_id]
            cache.manager.reserve(seq_id, start + len(tokens))
            spans.append((seq_id, start, len(tokens)))
            ids += tokens
            trees.append(t)
        meta = decoder.meta(cache, spans, trees if any(t is not None for t in trees) else None)
        with torch.inference_mode():
            states.append(decoder.run(decoder.embed(torch.tensor(ids), meta), 0, decoder.num_layers, meta, cache))
        for seq_id, start, n in spans:
            cache.manager.set_length(seq_id, 0, start + n)
            lengths[seq_id] = start + n
    return states, cache.keys + cache.values


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_stack_equals_the_layer_loop(arch, dtype, tiny_models):
    decoder = tiny_models[arch].load(dtype=dtype).decoder
    assert (decoder.layer_stack is not None) == (arch in STACKED)
    if decoder.layer_stack is None:
        return
    (loop, loop_kv), (stack, stack_kv) = _passes(decoder, False), _passes(decoder, True)
    for a, b in zip(loop, stack):
        assert torch.equal(a, b)
    for a, b in zip(loop_kv, stack_kv):
        assert torch.equal(a, b)


def test_stack_runs_any_slice_of_layers(tiny_models):
    """Bands: layers 0..2 then 2..6 give what 0..6 gives."""
    decoder = tiny_models["qwen3"].load(dtype="bfloat16").decoder
    seq = PROMPTS_FOR_STACK[0]
    out = []
    for split in (None, 2):
        cache = decoder.new_cache(16, 4)
        cache.manager.add(0, 1)
        cache.manager.reserve(0, len(seq))
        meta = decoder.meta(cache, [(0, 0, len(seq))])
        with torch.inference_mode():
            h = decoder.embed(torch.tensor(seq), meta)
            if split is None:
                out.append(decoder.run(h, 0, decoder.num_layers, meta, cache))
            else:
                out.append(decoder.run(decoder.run(h, 0, split, meta, cache), split, decoder.num_layers, meta, cache))
    assert torch.equal(out[0], out[1])
