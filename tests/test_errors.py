"""Bad input gets a clear error (and nothing is decoded half-way)."""

from __future__ import annotations

import json

import pytest
from transformers import AutoModelForCausalLM, GPT2Config

from hispec_decode import HiSpecError, HiSpecModel, UnsupportedArchitectureError
from hispec_decode.models import SUPPORTED_MODEL_TYPES


@pytest.fixture
def model(hispec_models):
    return hispec_models["llama"]


def test_empty_prompts(model):
    with pytest.raises(HiSpecError, match="empty"):
        model.generate([[]])
    with pytest.raises(HiSpecError, match="no prompt"):
        model.generate([])


def test_max_new_tokens(model):
    for bad in (0, -3, 2.5):
        with pytest.raises(HiSpecError, match="max_new_tokens"):
            model.generate([[1, 2]], max_new_tokens=bad)


@pytest.mark.parametrize(
    "layers",
    [dict(draft_layer=0, verify_layer=3), dict(draft_layer=3, verify_layer=3), dict(draft_layer=4, verify_layer=2),
     dict(draft_layer=2, verify_layer=7), dict(draft_layer=2, verify_layer=9), dict(draft_layer=-1, verify_layer=3)],
)
def test_hispec_layers_out_of_range_or_order(model, layers):
    with pytest.raises(HiSpecError, match="draft_layer < verify_layer < 6"):
        model.generate([[1, 2]], method="hispec", **layers)


def test_self_spec_layer_out_of_range(model):
    for bad in (0, 6, 7):
        with pytest.raises(HiSpecError, match="self_spec needs 1 <= draft_layer < 6"):
            model.generate([[1, 2]], method="self_spec", draft_layer=bad)


def test_window_and_draft_counts(model):
    with pytest.raises(HiSpecError, match="window"):
        model.generate([[1, 2]], window=0)
    with pytest.raises(HiSpecError, match="num_draft"):
        model.generate([[1, 2]], num_draft=0)


def test_unknown_method_and_bad_sampling(model):
    with pytest.raises(HiSpecError, match="unknown method"):
        model.generate([[1, 2]], method="medusa")
    with pytest.raises(HiSpecError, match="temperature"):
        model.generate([[1, 2]], do_sample=True, temperature=0)
    with pytest.raises(HiSpecError, match="top_p"):
        model.generate([[1, 2]], do_sample=True, top_p=0)


def test_token_ids_out_of_vocabulary(model):
    with pytest.raises(HiSpecError, match="outside"):
        model.generate([[1, 101]])


def test_prompt_longer_than_context(model):
    with pytest.raises(HiSpecError, match="context holds 128"):
        model.generate([[1] * 128])
    out = model.generate([[1] * 120], max_new_tokens=50, method="hispec")  # stops at the context limit
    assert len(out.sequences[0]) == 8


def test_unsupported_architecture_names_supported_ones(tmp_path):
    AutoModelForCausalLM.from_config(GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=50)).save_pretrained(tmp_path)
    with pytest.raises(UnsupportedArchitectureError, match=", ".join(SUPPORTED_MODEL_TYPES)):
        HiSpecModel.from_pretrained(str(tmp_path))
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "never-heard-of-it"}))
    with pytest.raises(UnsupportedArchitectureError, match="never-heard-of-it"):
        HiSpecModel.from_pretrained(str(tmp_path))


def test_missing_base_and_bad_dtype(tmp_path, tiny_models):
    with pytest.raises(HiSpecError, match="not found"):
        HiSpecModel.from_pretrained(str(tmp_path / "missing"))
    with pytest.raises(HiSpecError, match="not found"):
        HiSpecModel.from_pretrained(str(tmp_path / "missing.gguf"))
    with pytest.raises(HiSpecError, match="dtype"):
        tiny_models["llama"].load(dtype="int8")


def test_base_without_tokenizer_decodes_ids(tiny_models):
    model = tiny_models["llama"].load()
    assert model.tokenizer is None
    assert len(model.generate([[1, 2, 3]], max_new_tokens=3).sequences[0]) == 3


def test_a_packaged_base_without_its_package_says_what_to_install(tmp_path, monkeypatch):
    from hispec_decode.models.loading import PackagedBase, cache_complete, packaged_base_dir

    monkeypatch.setenv("HISPEC_HOME", str(tmp_path))
    base = PackagedBase("nope-1m", "example/nope-1m", "hispec_no_such_package", "no-such-package==1.0", "nope.gguf",
                        "nope-1m", "no-such-package==1.0", assemble=True)
    with pytest.raises(HiSpecError, match=r"pip install no-such-package==1\.0"):
        packaged_base_dir(base)
    assert not cache_complete(tmp_path / "models" / "nope-1m")  # nothing left behind that looks converted


def test_an_invalid_config_is_one_line_naming_the_file(tmp_path, capsys):
    """transformers' strict config validation (a StrictDataclassError, several lines) becomes one
    HiSpecError naming the config file, in the API and in hispec-generate."""
    from hispec_decode.tools import generate as cli

    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": -5}))
    with pytest.raises(HiSpecError, match=r"config\.json: .*hidden size \(-5\)") as info:
        HiSpecModel.from_pretrained(str(tmp_path))
    assert "\n" not in str(info.value)
    assert cli.main(["--base", str(tmp_path), "--prompt-ids", "1 2"]) == 2
    err = capsys.readouterr().err
    assert "config.json" in err and "Traceback" not in err
