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
    [dict(draft_layer=3, verify_layer=3), dict(draft_layer=4, verify_layer=2),
     dict(draft_layer=2, verify_layer=7), dict(draft_layer=2, verify_layer=9)],
)
def test_hispec_layers_out_of_range_or_order(model, layers):  # below 1: test_values_that_can_never_take_effect
    with pytest.raises(HiSpecError, match="draft_layer < verify_layer < 6"):
        model.generate([[1, 2]], method="hispec", **layers)


def test_self_spec_layer_out_of_range(model):
    with pytest.raises(HiSpecError, match="draft_layer must be an integer >= 1"):
        model.generate([[1, 2]], method="self_spec", draft_layer=0)
    for bad in (6, 7):
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


# -- arguments of the wrong type, and values that can never take effect, fail before any work --------
def test_wrong_argument_types_fail_before_loading(monkeypatch):
    from hispec_decode.models import loading

    monkeypatch.setattr(loading, "load_base", lambda *a, **k: pytest.fail("the base was loaded"))
    with pytest.raises(HiSpecError, match="heads must be a path.*got int 3"):
        HiSpecModel.from_pretrained(heads=3)
    with pytest.raises(HiSpecError, match="revision must be a string"):
        HiSpecModel.from_pretrained(heads="org/heads", revision=7)
    with pytest.raises(HiSpecError, match="pack_weights must be True or False"):
        HiSpecModel.from_pretrained(pack_weights="yes")
    monkeypatch.undo()
    with pytest.raises(HiSpecError, match="base must be a path.*got int 5"):
        HiSpecModel.from_pretrained(base=5)


@pytest.mark.parametrize("what", ["base", "heads"])
def test_a_hub_name_that_cannot_be_fetched_fails_at_once(what, monkeypatch, tmp_path):
    """A name that is no local path, not cached, with the Hub unreachable (here: a closed local port), is
    refused before huggingface_hub is asked (which would retry for half a minute)."""
    import huggingface_hub

    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")
    monkeypatch.setenv("HF_HOME", str(tmp_path))
    for var in ("HTTPS_PROXY", "https_proxy", "HTTP_PROXY", "http_proxy", "ALL_PROXY", "all_proxy", "HF_HUB_OFFLINE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(huggingface_hub, "snapshot_download", lambda *a, **k: pytest.fail("the Hub was asked"))
    from transformers import AutoConfig

    monkeypatch.setattr(AutoConfig, "from_pretrained", lambda *a, **k: pytest.fail("the Hub was asked"))
    kwargs = {"base": "some-org/some-model"} if what == "base" else {"heads": "some-org/some-heads"}
    with pytest.raises(HiSpecError, match="cannot be reached .*127.0.0.1:9"):
        HiSpecModel.from_pretrained(**kwargs)
    with pytest.raises(HiSpecError, match="neither a local path nor a Hugging Face Hub repo id"):
        HiSpecModel.from_pretrained(**{what: "not a/valid..id"} if what == "base" else {"heads": "org/bad..id"})
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(HiSpecError, match="HF_HUB_OFFLINE"):
        HiSpecModel.from_pretrained(**kwargs)


@pytest.mark.parametrize("settings, message", [
    (dict(eos_token_id=10**9), "eos_token_id 1000000000 is not a token of this model"),
    (dict(eos_token_id=[3, 101]), "eos_token_id 101 is not a token"),
    (dict(do_sample=True, top_k=10**9), "top_k=1000000000 exceeds the vocabulary"),
    (dict(temperature=0.5), "temperature=0.5 takes effect only when sampling"),
    (dict(top_p=0.5), "top_p=0.5 takes effect only when sampling"),
    (dict(top_k=5), "top_k=5 takes effect only when sampling"),
    (dict(drafter_invariant=True), "drafter_invariant=True takes effect only when sampling"),
    (dict(method="autoregressive", draft_layer=2), "draft_layer=2 never takes effect with method='autoregressive'"),
    (dict(method="autoregressive", vocab=40), "vocab=40 never takes effect with method='autoregressive'"),
    (dict(method="self_spec", verify_layer=4), "verify_layer=4 never takes effect with method='self_spec'"),
    (dict(method="self_spec", window=3), "window=3 never takes effect"),
    (dict(vocab=10**9), "vocab=1000000000 never takes effect"),
    (dict(vocab=101), "vocab=101 never takes effect"),
    (dict(draft_layer=-3), "draft_layer must be an integer >= 1"),
    (dict(verify_layer=0), "verify_layer must be an integer >= 1"),
])
def test_values_that_can_never_take_effect_are_refused(model, settings, message):
    with pytest.raises(HiSpecError, match=message.replace("(", r"\(").replace("[", r"\[")):
        model.generate([[1, 2]], max_new_tokens=2, **settings)


def test_settings_objects_refuse_at_construction():
    from hispec_decode import SamplingParams, SpeculativeConfig

    with pytest.raises(HiSpecError, match="draft_layer must be an integer >= 1"):
        SpeculativeConfig(draft_layer=-3)
    with pytest.raises(HiSpecError, match="verify_layer=8 never takes effect with method='self_spec'"):
        SpeculativeConfig(method="self_spec", verify_layer=8)
    with pytest.raises(HiSpecError, match="temperature=0.5 takes effect only when sampling"):
        SamplingParams(temperature=0.5)
    SamplingParams(do_sample=True, temperature=0.5, top_p=0.9, top_k=5)  # sampling reads them all
    SpeculativeConfig(method="autoregressive")  # and nothing else


def test_an_empty_eos_list_means_no_end_of_sequence(model):
    out = model.generate([[1, 2]], max_new_tokens=6, eos_token_id=[])
    assert len(out.sequences[0]) == 6
