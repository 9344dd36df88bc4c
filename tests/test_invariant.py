"""The batch-invariant mode: a row's numbers do not depend on the other rows of its pass.

Direct tests first (a linear call, then the whole decoder: the final hidden state of a token
is bit for bit the same whether it is computed in a prefill, alone, or packed beside other
sequences' rows), then what that buys: in bf16 and fp16, ``self_spec`` and ``hispec`` give the
engine's own ``autoregressive`` output token for token, at every batch size, with exits that
accept everything and exits that reject everything, windows 1 and 8.
"""

from __future__ import annotations

import random

import pytest
import torch
from torch import nn

from conftest import ARCHS, VOCAB, identity_above, read_by, save_tiny, zero_head
from hispec_decode import HiSpecAdapter
from hispec_decode.adapter import ExitSpec
from hispec_decode.layers.linear import FusedLinear

_rng = random.Random(1)
PROMPTS = [[_rng.randrange(VOCAB) for _ in range(n)] for n in (5, 1, 12, 3, 8)]
NEW = 20
SPECULATIVE = [("self_spec", dict(draft_layer=1, num_draft=3)), ("self_spec", dict(draft_layer=3, num_draft=1)),
               ("hispec", dict(draft_layer=1, verify_layer=3, window=1, num_draft=1)),
               ("hispec", dict(draft_layer=2, verify_layer=4, window=8, num_draft=3))]
FIXED = dict(draft_threshold=0.0, verify_threshold=0.0, batch_aware=False)  # speculate always, at any batch size


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("pack", [True, False])
def test_linear_rows_are_bitwise_independent_of_the_other_rows(dtype, pack):
    torch.manual_seed(0)
    lin = nn.Linear(96, 160).to(dtype)
    x = torch.randn(40, 96).to(dtype)
    plain, bucketed = FusedLinear([lin], pack), FusedLinear([lin], pack, rows=8)
    alone = torch.cat([bucketed(x[i : i + 1]) for i in range(40)])
    for n in (2, 5, 8, 13, 40):
        for start in (0, 3):
            assert torch.equal(bucketed(x[start : start + n]), alone[start : start + n]), (n, start)
    noisy = torch.randn(7, 96).to(dtype)
    assert torch.equal(bucketed(torch.cat([noisy[:3], x[:1], noisy[3:]]))[3], alone[0])
    if dtype == torch.float32:  # the teeth: without the bucket a 1-row call rounds differently from a 5-row one
        assert not torch.equal(torch.cat([plain(x[i : i + 1]) for i in range(5)]), plain(x[:5]))


def _final_states(model, rows_of: list[list[tuple[int, list[int]]]]) -> dict[tuple[int, int], torch.Tensor]:
    """Run the decoder over passes: each pass lists ``(seq_id, new tokens)``; returns the final
    hidden state of every (seq_id, position)."""
    decoder = model.decoder
    cache = decoder.new_cache(64, 4)
    lengths: dict[int, int] = {}
    out = {}
    for passes in rows_of:
        spans, ids = [], []
        for seq_id, tokens in passes:
            if seq_id not in lengths:
                cache.manager.add(seq_id, 1)
                lengths[seq_id] = 0
            start = lengths[seq_id]
            cache.manager.reserve(seq_id, start + len(tokens))
            spans.append((seq_id, start, len(tokens)))
            ids += tokens
        meta = decoder.meta(cache, spans)
        with torch.inference_mode():
            h = decoder.run(decoder.embed(torch.tensor(ids), meta), 0, decoder.num_layers, meta, cache)
        for (seq_id, start, n), seg in zip(spans, meta.segments):
            cache.manager.set_length(seq_id, 0, start + n)
            lengths[seq_id] = start + n
            for j in range(n):
                out[seq_id, start + j] = h[0, seg.offset + j].clone()
    return out


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_decoder_rows_are_bitwise_independent_of_the_pass(arch, dtype, tiny_models):
    """A token's final state: prefilled with its prompt, decoded one token at a time, or beside
    other sequences (which are prefilled or verifying several tokens in the same pass)."""
    model = tiny_models[arch].load(dtype=dtype, batch_invariant=True)
    seq = PROMPTS[2]
    other = PROMPTS[4]
    prefill = _final_states(model, [[(0, seq)]])
    one_by_one = _final_states(model, [[(0, seq[:1])]] + [[(0, [t])] for t in seq[1:]])
    packed = _final_states(model, [[(1, other), (0, seq[:4])], [(0, seq[4:5]), (1, [3, 4, 5])],
                                   [(2, [9]), (0, seq[5:9]), (1, [6])], [(0, seq[9:])]])
    for p in range(len(seq)):
        assert torch.equal(one_by_one[0, p], prefill[0, p]), p
        assert torch.equal(packed[0, p], prefill[0, p]), p
    if dtype == "float32":  # the teeth: by default the same passes round differently
        default = tiny_models[arch].load(dtype=dtype)
        a, b = _final_states(default, [[(0, seq)]]), _final_states(default, [[(0, seq[:1])]] + [[(0, [t])] for t in seq[1:]])
        assert any(not torch.equal(a[0, p], b[0, p]) for p in range(len(seq)))


def _bf16_equal_to_autoregressive(model, methods=SPECULATIVE, batch_sizes=(1, 2, 5)) -> list[dict]:
    alone = [model.generate([p], max_new_tokens=NEW, method="autoregressive").sequences[0] for p in PROMPTS]
    stats = []
    for b in batch_sizes:
        assert model.generate(PROMPTS[:b], max_new_tokens=NEW, method="autoregressive").sequences == alone[:b]
        for method, kwargs in methods:
            out = model.generate(PROMPTS[:b], max_new_tokens=NEW, **read_by(method, **kwargs, **FIXED))
            assert out.sequences == alone[:b], (b, method, kwargs)
            stats.append(out.stats)
    return stats


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_low_precision_speculation_equals_own_autoregressive(arch, dtype, tiny_models):
    _bf16_equal_to_autoregressive(tiny_models[arch].load(dtype=dtype, batch_invariant=True))


@pytest.mark.parametrize("arch", ["llama", "qwen3", "opt"])
def test_bf16_exits_that_accept_everything(arch, tmp_path):
    tiny = save_tiny(arch, tmp_path / "base", mutate=identity_above(1))
    model = tiny.load(dtype="bfloat16", batch_invariant=True)
    stats = _bf16_equal_to_autoregressive(model, [("hispec", dict(draft_layer=1, verify_layer=3, window=8, num_draft=3)),
                                                  ("self_spec", dict(draft_layer=1, num_draft=4))])
    assert all(s["acceptance_final"] == 1.0 for s in stats)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "opt"])
def test_bf16_exits_that_reject_everything(arch, tiny_models, tmp_path):
    model = tiny_models[arch].load()
    specs = [ExitSpec(1, "draft", "residual_linear"), ExitSpec(3, "intermediate", "residual_linear")]
    adapter = HiSpecAdapter.create(model.decoder, str(tiny_models[arch].path), specs)
    for spec in specs:
        zero_head(adapter.head(spec.layer))
    adapter.save_pretrained(tmp_path / "heads")
    model = tiny_models[arch].load(heads=str(tmp_path / "heads"), dtype="bfloat16", batch_invariant=True)
    stats = _bf16_equal_to_autoregressive(model, [("hispec", dict(window=1, num_draft=1)),
                                                  ("hispec", dict(window=8, num_draft=3)), ("self_spec", {})])
    assert all(s["acceptance_final"] <= 0.25 for s in stats)


@pytest.mark.slow
def test_smollm2_bf16_default_heads_equal_autoregressive():
    from hispec_decode import HiSpecModel
    from hispec_decode.data.prompts import CHAT_PROMPTS, encode_prompt

    model = HiSpecModel.from_pretrained(dtype="bfloat16", batch_invariant=True)
    prompts = [encode_prompt(model.tokenizer, t) for t in CHAT_PROMPTS[:3]]
    alone = [model.generate([p], max_new_tokens=48, method="autoregressive").sequences[0] for p in prompts]
    for method in ("self_spec", "hispec"):
        for b in (1, 3):
            assert model.generate(prompts[:b], max_new_tokens=48, method=method).sequences == alone[:b], (method, b)


def test_bf16_default_is_batch_invariant_where_it_is_free(tiny_models):
    """bf16 on a CPU with the compiled bf16 linear (AMX, AVX-512 BF16 or AVX2) is batch-invariant by
    default (the mode costs nothing there); fp32 and an explicit ``batch_invariant=False`` are not."""
    model = tiny_models["llama"].load(dtype="bfloat16")
    assert model.decoder.batch_invariant == model.decoder.invariance_is_free()
    assert not tiny_models["llama"].load().decoder.batch_invariant
    assert not tiny_models["llama"].load(dtype="bfloat16", batch_invariant=False).decoder.batch_invariant
    if not model.decoder.invariance_is_free():
        pytest.skip("no compiled bf16 linear here: the bf16 default stays off")
    _bf16_equal_to_autoregressive(model, SPECULATIVE[2:], batch_sizes=(1, 3))
