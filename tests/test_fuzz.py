"""Fuzzing every public entry point with wrong types, boundaries and garbage (hypothesis).

The property: either the call runs and honours the value, or it raises a HiSpec error whose
message names the argument; never another exception type, never a hang (every valid value is
bounded by the tiny model's 128-token context)."""

from __future__ import annotations

import copy
import dataclasses

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hispec_decode import AdapterError, EngineConfig, HiSpecAdapterConfig, HiSpecError, SamplingParams, SpeculativeConfig
from hispec_decode.config import field_names, split_overrides
from hispec_decode.tools import bench
from hispec_decode.tools import generate as generate_cli
from hispec_decode.tools.args import config_overrides
from hispec_train.config import TrainConfig, load_config, parse_overrides

PROMPT = [5, 9, 2]
SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)

garbage = st.one_of(
    st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.integers(-3, 300),
    st.floats(allow_nan=True, allow_infinity=True), st.floats(min_value=-2, max_value=2),
    st.text(max_size=6), st.sampled_from(["hispec", "self_spec", "gather", "eager", "1", "-1", "none", "true"]),
    st.lists(st.integers(-3, 200), max_size=3), st.dictionaries(st.text(max_size=3), st.integers(), max_size=2),
    st.binary(max_size=3),
)
SAMPLING = list(field_names(SamplingParams))
SPECULATIVE = list(field_names(SpeculativeConfig))
ENGINE = list(field_names(EngineConfig))


def _names_it(exc: Exception, name: str) -> None:
    assert isinstance(exc, HiSpecError), f"{type(exc).__name__}: {exc}"
    assert name in str(exc), f"{name!r} not named in: {exc}"


@SETTINGS
@given(name=st.sampled_from(SAMPLING + SPECULATIVE + ENGINE), value=garbage)
def test_generate_arguments(hispec_models, name, value):
    model = hispec_models["llama"]
    kwargs = {"max_new_tokens": 3, "method": "hispec", name: value}
    try:
        out = model.generate([PROMPT], **kwargs)
    except Exception as exc:  # noqa: BLE001 - the property is about the type
        _names_it(exc, name)
        return
    assert len(out.sequences[0]) <= (value if name == "max_new_tokens" else 3)
    if name == "method":
        assert out.stats["method"] == value


@SETTINGS
@given(name=st.sampled_from(SAMPLING + SPECULATIVE), value=garbage)
def test_build_engine_and_add_request_arguments(hispec_models, name, value):
    model = hispec_models["qwen3"]
    try:
        server = model.build_engine(**({"max_new_tokens": 2, "num_blocks": 64, "block_size": 4} | {name: value}))
    except Exception as exc:  # noqa: BLE001
        _names_it(exc, name)
        return
    try:
        rid = server.add_request(PROMPT, **{name: value})
    except Exception as exc:  # noqa: BLE001
        _names_it(exc, name)
        assert name in SAMPLING or "fixed per engine" in str(exc)  # an engine's method and policy: never per request
        return
    assert name in SAMPLING
    list(server.stream())
    assert server.sequences[rid].is_finished


@SETTINGS
@given(input_ids=st.one_of(garbage, st.lists(garbage, max_size=3), st.lists(st.lists(garbage, max_size=3), max_size=2)))
def test_prompts(hispec_models, input_ids):
    try:
        out = hispec_models["opt"].generate(input_ids, max_new_tokens=2)
    except Exception as exc:  # noqa: BLE001
        _names_it(exc, "input_ids")
        return
    assert all(len(s) <= 2 for s in out.sequences)


FLAGS = ["--max-new-tokens", "--method", "--sample", "--no-sample", "--temperature", "--top-k", "--top-p", "--seed",
         "--eos-token-id", "--draft-layer", "--verify-layer", "--window", "--num-draft", "--num-blocks", "--block-size",
         "--schedule", "--use-exit-vocab", "--dtypes", "--methods", "--batch-sizes", "--num-prompts", "--max-batches",
         "--prompts", "--json"]
argv_strategy = st.lists(st.one_of(st.sampled_from(FLAGS), st.text(max_size=5), st.sampled_from(["0", "-1", "2", "x"])),
                         max_size=6)


def _parse_or_exit_2(parse) -> object:
    try:
        return parse()
    except SystemExit as exc:
        assert exc.code in (0, 2)
        return None


@SETTINGS
@given(argv=argv_strategy)
def test_generate_cli_parser(argv):
    args = _parse_or_exit_2(lambda: generate_cli.build_parser().parse_args(["--prompt-ids", "1", *argv]))
    if args is None:
        return
    overrides = config_overrides(args, SAMPLING + SPECULATIVE + ENGINE)
    try:
        split_overrides(None, None, None, overrides)
    except HiSpecError:
        pass


@SETTINGS
@given(argv=argv_strategy)
def test_bench_cli_parser(argv):
    parsed = _parse_or_exit_2(lambda: bench.parse_args(argv))
    if parsed is not None:
        try:
            bench.bench_settings(parsed[1])
        except HiSpecError:
            pass


TRAIN_KEYS = [f.name for f in dataclasses.fields(TrainConfig)]


@SETTINGS
@given(name=st.sampled_from(TRAIN_KEYS), value=garbage)
def test_train_config_values(name, value):
    try:
        cfg = load_config(None, {name: value})
    except Exception as exc:  # noqa: BLE001
        _names_it(exc, name)
        return
    assert getattr(cfg, name) is not None or value is None or str(value).lower() in ("none", "null")


@SETTINGS
@given(argv=st.lists(st.one_of(st.sampled_from([f"--{k.replace('_', '-')}" for k in TRAIN_KEYS]), st.text(max_size=6),
                               st.sampled_from(["--lr=1e-3", "--output-dir=/tmp/a-b", "--x=", "--"])), max_size=6))
def test_train_cli_overrides(argv):
    try:
        load_config(None, parse_overrides(argv))
    except HiSpecError:
        pass


@pytest.fixture(scope="module")
def adapter_config(hispec_models) -> dict:
    from hispec_decode.adapter import ExitSpec, HiSpecAdapter

    adapter = HiSpecAdapter.create(hispec_models["llama"].decoder, "tiny", [ExitSpec(2, "draft", "residual_linear")])
    return adapter.config.to_dict()


@SETTINGS
@given(key=st.sampled_from(["base_model", "base_fingerprint", "num_hidden_layers", "hidden_size", "vocab_size", "exits",
                            "format_version", "base_revision", "hispec_version", "training"]), value=garbage)
def test_adapter_config_json(adapter_config, key, value):
    data = copy.deepcopy(adapter_config) | {key: value}
    try:
        HiSpecAdapterConfig.from_dict(data)
    except Exception as exc:  # noqa: BLE001
        assert isinstance(exc, AdapterError), f"{type(exc).__name__}: {exc}"
        assert key in str(exc) or (key == "num_hidden_layers" and "layer" in str(exc)), str(exc)


@SETTINGS
@given(key=st.sampled_from(["layer", "role", "head_type", "norm_keys", "shapes", "options", "exit_vocab_size"]),
       value=garbage)
def test_adapter_exit_json(adapter_config, key, value):
    data = copy.deepcopy(adapter_config)
    data["exits"][0][key] = value
    try:
        HiSpecAdapterConfig.from_dict(data)
    except Exception as exc:  # noqa: BLE001
        assert isinstance(exc, AdapterError), f"{type(exc).__name__}: {exc}"
        assert key.split("_")[0] in str(exc), str(exc)
