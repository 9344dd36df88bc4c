"""The adapter format: round trips, strict reading, and refusal of heads made for another base."""

from __future__ import annotations

import json
import logging

import pytest
import torch

from hispec_decode import (
    CONFIG_NAME,
    WEIGHTS_NAME,
    AdapterError,
    FingerprintMismatchError,
    HiSpecAdapter,
    HiSpecAdapterConfig,
)
from hispec_decode.adapter import ExitSpec

from conftest import save_tiny

SPECS = [
    ExitSpec(1, "draft", "residual_linear"),
    ExitSpec(3, "intermediate", "low_rank", {"rank": 8}),
    ExitSpec(4, "extra", "norm"),
]


@pytest.fixture
def saved_adapter(hispec_models, tiny_models, tmp_path):
    model = hispec_models["llama"]
    adapter = HiSpecAdapter.create(model.decoder, str(tiny_models["llama"].path), SPECS, training={"steps": 0})
    torch.manual_seed(0)
    with torch.no_grad():
        for p in adapter.parameters():
            p.add_(torch.randn_like(p) * 0.01)
    adapter.save_pretrained(tmp_path / "heads")
    return adapter, tmp_path / "heads"


def test_round_trip_is_exact(saved_adapter):
    adapter, path = saved_adapter
    assert sorted(p.name for p in path.iterdir()) == sorted([CONFIG_NAME, WEIGHTS_NAME])
    loaded = HiSpecAdapter.from_pretrained(path)
    assert loaded.config == adapter.config
    a, b = adapter.state_dict_flat(), loaded.state_dict_flat()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    text = (path / CONFIG_NAME).read_text()
    assert list(json.loads(text)) == sorted(json.loads(text)), "config keys are written sorted"


def test_heads_only_no_base_weights(saved_adapter):
    _, path = saved_adapter
    from safetensors.torch import load_file

    names = load_file(str(path / WEIGHTS_NAME))
    assert all(k.split(".")[0] in {"1", "3", "4"} for k in names)
    assert sum(v.numel() for v in names.values()) < 64 * 64 + 3 * 64 + 2 * 8 * 64 + 64


def test_heads_decode_losslessly_with_roles_as_defaults(saved_adapter, tiny_models):
    _, path = saved_adapter
    model = tiny_models["llama"].load(heads=str(path))
    assert model.policy(method="hispec").draft_layer == 1 and model.policy(method="hispec").verify_layer == 3
    prompt = [1, 2, 3, 4]
    out = model.generate([prompt], max_new_tokens=16, method="hispec")
    assert out.sequences[0] == tiny_models["llama"].hf_generate(prompt, 16)


def test_heads_for_another_base_are_refused(saved_adapter, tmp_path):
    _, path = saved_adapter
    other = save_tiny("llama", tmp_path / "other", seed=1)  # same shapes, other weights
    with pytest.raises(FingerprintMismatchError, match="trained for base .* loaded base"):
        other.load(heads=str(path))


def test_heads_for_a_differently_shaped_base_are_refused(saved_adapter, tiny_models):
    _, path = saved_adapter
    cfg = json.loads((path / CONFIG_NAME).read_text())
    cfg["num_hidden_layers"] = 12
    (path / CONFIG_NAME).write_text(json.dumps(cfg))
    with pytest.raises(AdapterError, match="layers, hidden, vocab"):
        tiny_models["llama"].load(heads=str(path))


def test_same_base_in_bfloat16_matches(saved_adapter, tiny_models):
    _, path = saved_adapter
    model = tiny_models["llama"].load(heads=str(path), dtype="bfloat16")
    assert model.runner.heads[1].proj.weight.dtype == torch.bfloat16


def test_missing_and_corrupted_weights(saved_adapter):
    _, path = saved_adapter
    weights = path / WEIGHTS_NAME
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) // 2])
    with pytest.raises(AdapterError, match="corrupted"):
        HiSpecAdapter.from_pretrained(path)
    weights.write_bytes(b"\x00" * 64)
    with pytest.raises(AdapterError, match="corrupted"):
        HiSpecAdapter.from_pretrained(path)
    weights.unlink()
    with pytest.raises(AdapterError, match="no weights"):
        HiSpecAdapter.from_pretrained(path)


def test_missing_config_and_bad_json(tmp_path, saved_adapter):
    with pytest.raises(AdapterError, match="not a HiSpec adapter"):
        HiSpecAdapter.from_pretrained(tmp_path)
    _, path = saved_adapter
    (path / CONFIG_NAME).write_text("{not json")
    with pytest.raises(AdapterError, match="not valid JSON"):
        HiSpecAdapter.from_pretrained(path)
    with pytest.raises(AdapterError, match="not found"):
        HiSpecAdapter.from_pretrained(tmp_path / "nowhere" / "x")


def test_unknown_keys_warn_missing_keys_fail(saved_adapter, caplog):
    adapter, _ = saved_adapter
    data = adapter.config.to_dict()
    with caplog.at_level(logging.WARNING):
        HiSpecAdapterConfig.from_dict(data | {"future_field": 1})
    assert "future_field" in caplog.text
    for key in ("base_fingerprint", "exits", "vocab_size"):
        broken = dict(data)
        del broken[key]
        with pytest.raises(AdapterError, match=key):
            HiSpecAdapterConfig.from_dict(broken)
    with pytest.raises(AdapterError, match="format version \\(format_version\\)"):
        HiSpecAdapterConfig.from_dict(data | {"format_version": 99})


def test_a_bad_adapter_policy_fails_at_load_naming_the_file_and_field(saved_adapter, tmp_path, caplog):
    """A value the user never passed (the adapter's tuned draft_layer 50 on a 6-layer base) fails when
    the adapter loads, one line naming hispec_config.json and policy.<dtype>.<method>; an unknown key
    inside a policy warns."""
    adapter, _ = saved_adapter
    data = adapter.config.to_dict()
    adapter.save_pretrained(tmp_path / "a")
    path = tmp_path / "a" / "hispec_config.json"
    path.write_text(json.dumps(data | {"policy": {"float32": {"hispec": {"draft_layer": 50}}}}))
    with pytest.raises(AdapterError, match=r"hispec_config\.json: policy\.float32\.hispec is invalid: .*draft_layer=50") as info:
        HiSpecAdapter.from_pretrained(tmp_path / "a")
    assert "\n" not in str(info.value)
    path.write_text(json.dumps(data | {"policy": {"float32": {"hispec": {"window": 0}}}}))
    with pytest.raises(AdapterError, match=r"policy\.float32\.hispec is invalid: .*window"):
        HiSpecAdapter.from_pretrained(tmp_path / "a")
    path.write_text(json.dumps(data | {"policy": {"float32": {"hispec": {"window": 2, "windw": 3}}}}))
    with caplog.at_level(logging.WARNING):
        HiSpecAdapter.from_pretrained(tmp_path / "a")
    assert "policy.float32.hispec.windw" in caplog.text


def test_bad_exit_specs(saved_adapter):
    adapter, _ = saved_adapter
    data = adapter.config.to_dict()
    bad_layer = json.loads(json.dumps(data))
    bad_layer["exits"][0]["layer"] = 6
    with pytest.raises(AdapterError, match="out of range"):
        HiSpecAdapterConfig.from_dict(bad_layer)
    roles = json.loads(json.dumps(data))
    roles["exits"][0]["role"] = "oracle"
    with pytest.raises(AdapterError, match="unknown role"):
        HiSpecAdapterConfig.from_dict(roles)


def test_unknown_head_type_fails_on_load(saved_adapter):
    _, path = saved_adapter
    cfg = json.loads((path / CONFIG_NAME).read_text())
    cfg["exits"][0]["head_type"] = "transformer-xl"
    (path / CONFIG_NAME).write_text(json.dumps(cfg))
    with pytest.raises(AdapterError, match="unknown head type"):
        HiSpecAdapter.from_pretrained(path)


def test_shape_mismatch_in_weights(saved_adapter):
    _, path = saved_adapter
    cfg = json.loads((path / CONFIG_NAME).read_text())
    cfg["exits"][1]["options"]["rank"] = 16
    (path / CONFIG_NAME).write_text(json.dumps(cfg))
    with pytest.raises(AdapterError, match="shape"):
        HiSpecAdapter.from_pretrained(path)


def test_push_to_hub_uploads_exactly_the_adapter_files(saved_adapter, monkeypatch):
    adapter, _ = saved_adapter
    calls = {}

    class FakeApi:
        def create_repo(self, repo_id, private, exist_ok):
            calls["create"] = (repo_id, private)

        def create_branch(self, repo_id, branch, exist_ok):
            calls["branch"] = branch

        def upload_folder(self, repo_id, folder_path, revision, commit_message):
            from pathlib import Path

            calls["files"] = sorted(p.name for p in Path(folder_path).iterdir())
            calls["upload"] = (repo_id, revision)
            return "https://huggingface.co/me/heads"

    import huggingface_hub

    monkeypatch.setattr(huggingface_hub, "HfApi", FakeApi)
    adapter.push_to_hub("me/heads", private=True, revision="v1")
    assert calls == {"create": ("me/heads", True), "branch": "v1", "files": [CONFIG_NAME, WEIGHTS_NAME],
                     "upload": ("me/heads", "v1")}
