"""Greedy losslessness: token-for-token equality with transformers' own generate (fp32)."""

from __future__ import annotations

import pytest
import torch

from hispec_decode import HiSpecAdapter, kernels
from hispec_decode.adapter import ExitSpec

from conftest import ARCHS, LAYERS, identity_above, read_by, save_tiny, zero_head
from conftest import LOSSLESS_NEW as NEW
from conftest import LOSSLESS_PROMPTS as PROMPTS

LAYER_CHOICES = [(1, 2), (1, LAYERS - 1), (2, 4), (3, LAYERS - 1)]  # (L_d, L_i), incl. L_d = 1 and L_i = L_f - 1


@pytest.mark.parametrize("arch", ARCHS)
def test_autoregressive_matches_transformers(arch, hispec_models, references):
    for n, prompt in PROMPTS.items():
        out = hispec_models[arch].generate([prompt], max_new_tokens=NEW, method="autoregressive")
        assert out.sequences[0] == references[arch, n]
        assert out.stats["calls_full"] == NEW


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("layers", LAYER_CHOICES)
def test_hispec_matches_transformers(arch, layers, hispec_models, references):
    model = hispec_models[arch]
    for window in (1, 8):
        for num_draft in (1, 3):
            for n, prompt in PROMPTS.items():
                out = model.generate([prompt], max_new_tokens=NEW, method="hispec", draft_layer=layers[0],
                                     verify_layer=layers[1], window=window, num_draft=num_draft)
                assert out.sequences[0] == references[arch, n], (window, num_draft, n)


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("draft_layer", [1, 3, LAYERS - 1])
def test_self_spec_matches_transformers(arch, draft_layer, hispec_models, references):
    for num_draft in (1, 4, 8):
        for n, prompt in PROMPTS.items():
            out = hispec_models[arch].generate([prompt], max_new_tokens=NEW, method="self_spec",
                                               draft_layer=draft_layer, num_draft=num_draft)
            assert out.sequences[0] == references[arch, n], (num_draft, n)


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_torch_fallbacks_match_transformers(arch, tiny_models, references):
    """Where the compiled kernels are off (no compiler, ``HISPEC_KERNELS=0``) the torch code runs."""
    with kernels.disabled():
        model = tiny_models[arch].load()
        for n, prompt in PROMPTS.items():
            for method in ("autoregressive", "hispec"):
                out = model.generate([prompt], max_new_tokens=NEW, **read_by(method, draft_layer=1, verify_layer=3,
                                                                             window=4, num_draft=3))
                assert out.sequences[0] == references[arch, n], (method, n)
        batch = model.generate(list(PROMPTS.values()), max_new_tokens=NEW, method="hispec", draft_layer=1,
                               verify_layer=3)
        assert batch.sequences == [references[arch, n] for n in PROMPTS]


@pytest.mark.parametrize("arch", ["llama", "opt", "qwen3"])
@pytest.mark.parametrize("method", ["autoregressive", "self_spec", "hispec"])
def test_stops_at_eos_like_transformers(arch, method, tiny_models, hispec_models, references):
    prompt = PROMPTS[5]
    full = references[arch, 5]
    for cut in (0, 3, 10):  # EOS as the first, an early and a later token
        eos = full[cut]
        ref = tiny_models[arch].hf_generate(prompt, NEW, eos_token_id=eos)
        assert ref == full[: full.index(eos) + 1]
        out = hispec_models[arch].generate([prompt], max_new_tokens=NEW, eos_token_id=eos, **read_by(
            method, draft_layer=2, verify_layer=4, window=4, num_draft=3))
        assert out.sequences[0] == ref
        assert out.stats["new_tokens"] == len(ref)


def test_batch_rows_decoded_independently(hispec_models, references):
    rows = [PROMPTS[5], PROMPTS[1], PROMPTS[17]]
    out = hispec_models["llama"].generate(rows, max_new_tokens=NEW, method="hispec", draft_layer=1, verify_layer=3)
    assert out.sequences == [references["llama", 5], references["llama", 1], references["llama", 17]]
    as_tensor = hispec_models["llama"].generate(torch.tensor([PROMPTS[5], PROMPTS[5]]), max_new_tokens=NEW)
    assert as_tensor.sequences == [references["llama", 5]] * 2


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "opt"])
@pytest.mark.parametrize("head_type", [None, "deep_context", "feature_attention"])
def test_exits_that_accept_everything(arch, head_type, tmp_path):
    tiny = save_tiny(arch, tmp_path / "base", mutate=identity_above(1))
    model = tiny.load()
    if head_type is not None:  # fresh heads reproduce the base's exits: every draft is still right
        specs = [ExitSpec(1, "draft", head_type), ExitSpec(3, "intermediate", head_type)]
        HiSpecAdapter.create(model.decoder, str(tiny.path), specs).save_pretrained(tmp_path / "heads")
        model = tiny.load(heads=str(tmp_path / "heads"))
    for n, prompt in PROMPTS.items():
        ref = tiny.hf_generate(prompt, NEW)
        hi = model.generate([prompt], max_new_tokens=NEW, method="hispec", draft_layer=1, verify_layer=3, window=4, num_draft=3)
        ss = model.generate([prompt], max_new_tokens=NEW, method="self_spec", draft_layer=1, num_draft=5)
        assert hi.sequences[0] == ref and ss.sequences[0] == ref
        assert hi.stats["acceptance_intermediate"] == 1.0 and hi.stats["acceptance_final"] == 1.0
        assert ss.stats["acceptance_final"] == 1.0
        # every full pass verifies the whole window and adds a bonus token
        assert hi.stats["calls_full"] < NEW / 4


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("head_type", ["residual_linear", "deep_context", "feature_attention"])
def test_exits_that_reject_almost_everything(arch, head_type, hispec_models, tiny_models, references, tmp_path):
    model = hispec_models[arch]
    for roles in (("draft",), ("draft", "intermediate")):
        specs = [ExitSpec(1, "draft", head_type), ExitSpec(3, "intermediate", head_type)]
        adapter = HiSpecAdapter.create(model.decoder, str(tiny_models[arch].path), specs)
        for spec in specs:
            if spec.role in roles:
                zero_head(adapter.head(spec.layer))
        adapter.save_pretrained(tmp_path / "-".join(roles))
        with_heads = tiny_models[arch].load(heads=str(tmp_path / "-".join(roles)))
        for n, prompt in PROMPTS.items():
            out = with_heads.generate([prompt], max_new_tokens=NEW, method="hispec", window=4, num_draft=3)
            assert out.sequences[0] == references[arch, n]
            stats = out.stats
            if roles == ("draft",):
                assert stats["acceptance_intermediate"] <= 0.25
            else:  # both exits propose the same fixed token: L_i agrees, L_f rejects
                assert stats["acceptance_intermediate"] == 1.0 and stats["acceptance_final"] <= 0.25


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("head_type,options", [("deep_context", {}), ("decoder_block", {"attention_only": True})])
def test_new_head_types_decode_losslessly(arch, head_type, options, hispec_models, tiny_models, references, tmp_path):
    """Random deep-context heads (their contexts change every draft) and attention-only blocks at
    both exits: greedy output equals transformers', batched, for both speculative methods."""
    model = hispec_models[arch]
    specs = [ExitSpec(1, "draft", head_type, options), ExitSpec(3, "intermediate", head_type, options)]
    adapter = HiSpecAdapter.create(model.decoder, str(tiny_models[arch].path), specs)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for spec in specs:
            for p in adapter.head(spec.layer).parameters():
                if p.dim() == 2:
                    p.add_(0.2 * torch.randn(p.shape, generator=g))
    adapter.save_pretrained(tmp_path / "deep")
    with_heads = tiny_models[arch].load(heads=str(tmp_path / "deep"))
    prompts = list(PROMPTS.values())
    for method, kw in (("hispec", dict(window=4, num_draft=3)), ("self_spec", dict(num_draft=4))):
        out = with_heads.generate(prompts, max_new_tokens=NEW, method=method, **kw)
        assert out.sequences == [references[arch, n] for n in PROMPTS], method
        chunked = with_heads.generate(prompts, max_new_tokens=NEW, method=method, prefill_chunk=3, **kw)
        assert chunked.sequences == out.sequences, f"{method}, chunked prefill"  # heads' caches chunked too
