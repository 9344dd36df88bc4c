"""Reduced early-exit vocabularies: lossless decoding, the adapter format, bad input."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from hispec_decode import WEIGHTS_NAME, HiSpecAdapter
from hispec_decode.adapter import CONFIG_NAME, ExitSpec
from hispec_decode.engine.model_runner import ModelRunner
from hispec_decode.errors import AdapterError

from conftest import ARCHS, VOCAB, read_by

PROMPTS = [[7], [3, 14, 15, 92, 65], [(i * 37 + 11) % VOCAB for i in range(17)]]
NEW = 24
HALF = torch.arange(0, VOCAB, 2)  # every other token: the exits can never draft the odd ones


def _restricted(model, tiny, tmp_path, ids=HALF):
    specs = [ExitSpec(1, "draft", "residual_linear"), ExitSpec(3, "intermediate", "residual_linear")]
    adapter = HiSpecAdapter.create(model.decoder, str(tiny.path), specs)
    for head in adapter.heads.values():
        head.set_vocab(ids)
    adapter.save_pretrained(tmp_path)
    return tiny.load(heads=str(tmp_path))


@pytest.mark.parametrize("arch", ARCHS)
def test_reduced_exit_vocabulary_is_lossless(arch, tiny_models, hispec_models, tmp_path):
    tiny = tiny_models[arch]
    model = _restricted(hispec_models[arch], tiny, tmp_path)
    refs = [tiny.hf_generate(prompt, NEW) for prompt in PROMPTS]
    assert any(t % 2 for ref in refs for t in ref), "the references must need tokens outside the exit vocabulary"
    for prompt, ref in zip(PROMPTS, refs):
        for method in ("hispec", "self_spec"):
            out = model.generate([prompt], max_new_tokens=NEW, **read_by(method, window=4, num_draft=3))
            assert out.sequences[0] == ref, method
    assert model.generate(PROMPTS, max_new_tokens=NEW, method="hispec").sequences == refs


def test_restricted_exit_logits(tiny_models, hispec_models, tmp_path):
    """Inside the vocabulary the logits are the full head's; outside they are -inf;
    ``use_exit_vocab=False`` lifts the restriction."""
    model = _restricted(hispec_models["llama"], tiny_models["llama"], tmp_path)
    h = torch.randn(1, 3, model.decoder.config.hidden_size)
    restricted = model.runner.exit_logits(1, h)
    full = ModelRunner(model.decoder, model.runner.heads, use_exit_vocab=False).exit_logits(1, h)
    assert torch.allclose(restricted[:, HALF], full[:, HALF], atol=1e-5)
    outside = torch.ones(VOCAB, dtype=torch.bool)
    outside[HALF] = False
    assert torch.isinf(restricted[:, outside]).all() and torch.isfinite(full).all()
    assert torch.isfinite(model.runner.exit_logits(model.num_layers, h)).all(), "the final layer is never restricted"
    for method in ("hispec", "self_spec"):
        a = model.generate(PROMPTS, max_new_tokens=NEW, method=method)
        b = model.generate(PROMPTS, max_new_tokens=NEW, method=method, use_exit_vocab=False)
        assert a.sequences == b.sequences


def test_adapter_round_trip_and_bad_vocabularies(tiny_models, hispec_models, tmp_path):
    model = _restricted(hispec_models["llama"], tiny_models["llama"], tmp_path / "ok")
    config = json.loads((tmp_path / "ok" / CONFIG_NAME).read_text())
    assert [e["exit_vocab_size"] for e in config["exits"]] == [len(HALF)] * 2
    loaded = HiSpecAdapter.from_pretrained(tmp_path / "ok")
    assert all(torch.equal(h.vocab, HALF) for h in loaded.heads.values())
    with pytest.raises(AdapterError, match="sorted"):
        loaded.head(1).set_vocab(torch.tensor([5, 3]))

    tensors = load_file(str(tmp_path / "ok" / WEIGHTS_NAME))
    for name, bad in {"range": HALF + 1, "order": HALF.flip(0)}.items():
        save_file(tensors | {"1.vocab": bad.contiguous()}, str(tmp_path / "ok" / WEIGHTS_NAME))
        with pytest.raises(AdapterError, match="sorted, distinct integer token ids in 0"):
            HiSpecAdapter.from_pretrained(tmp_path / "ok")
    del tensors["3.vocab"]
    save_file(tensors, str(tmp_path / "ok" / WEIGHTS_NAME))
    with pytest.raises(AdapterError, match="expects tensors"):
        HiSpecAdapter.from_pretrained(tmp_path / "ok")


def test_bad_vocabularies_are_refused_before_anything_is_written(tiny_models, hispec_models, tmp_path):
    specs = [ExitSpec(1, "draft", "residual_linear"), ExitSpec(3, "intermediate", "residual_linear")]
    adapter = HiSpecAdapter.create(hispec_models["llama"].decoder, str(tiny_models["llama"].path), specs)
    for bad in (torch.tensor([3.0, 4.0]), torch.tensor([[1, 2]]), torch.tensor([], dtype=torch.long)):
        with pytest.raises(AdapterError, match="exit vocabulary"):
            adapter.head(1).set_vocab(bad)
    adapter.head(1).set_vocab(torch.tensor([1, VOCAB]))  # out of range: known only to the adapter
    with pytest.raises(AdapterError, match="sorted, distinct integer token ids in 0"):
        adapter.save_pretrained(tmp_path / "bad")
    assert not (tmp_path / "bad" / WEIGHTS_NAME).exists()


def test_decoder_block_heads_with_a_reduced_vocabulary(tiny_models, hispec_models, tmp_path):
    """The cached-head path (its own K/V entries) with a restricted exit: still transformers' output."""
    tiny, model = tiny_models["llama"], hispec_models["llama"]
    specs = [ExitSpec(1, "draft", "decoder_block"), ExitSpec(3, "intermediate", "decoder_block")]
    adapter = HiSpecAdapter.create(model.decoder, str(tiny.path), specs)
    for head in adapter.heads.values():
        head.set_vocab(HALF)
    adapter.save_pretrained(tmp_path)
    restricted = tiny.load(heads=str(tmp_path))
    refs = [tiny.hf_generate(p, NEW) for p in PROMPTS]
    for method in ("hispec", "self_spec"):
        assert restricted.generate(PROMPTS, max_new_tokens=NEW, method=method).sequences == refs, method


def test_heldout_agreement_with_an_exit_vocabulary(tiny_models, hispec_models, tmp_path):
    """The trainer's evaluation scores a head with an exit vocabulary over that vocabulary's logits
    only: its step-1 top-1 and top-4 counts equal those of the full-size restricted logits."""
    from hispec_train.distill import Agreement, agreement

    model = _restricted(hispec_models["llama"], tiny_models["llama"], tmp_path)
    decoder, head = model.decoder, model.runner.heads[1]
    torch.manual_seed(0)
    h, final = torch.randn(2, 9, decoder.config.hidden_size), torch.randn(2, 9, decoder.config.hidden_size)
    counts = Agreement()
    agreement(decoder, {1: head}, {1: h}, final, 1, 1, 4, counts)
    teacher = decoder.lm_logits(final).argmax(-1)
    full = head.project(head.transform(h), decoder)  # [2, 9, VOCAB], -inf outside the vocabulary
    assert counts.step_right[1][0] == int((full.argmax(-1) == teacher).sum())
    assert counts.in_top4[1] == int((full.topk(4, -1).indices == teacher[..., None]).any(-1).sum())
