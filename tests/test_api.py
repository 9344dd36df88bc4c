"""The public API's shape: GenerationConfig and keyword overrides, one server object, adapter format versions."""

from __future__ import annotations

import dataclasses
import json

import pytest

from hispec_decode import (
    CONFIG_NAME,
    EngineConfig,
    GenerationConfig,
    HiSpecAdapter,
    HiSpecAdapterConfig,
    HiSpecError,
    __version__,
)
from hispec_decode.adapter import ExitSpec
from hispec_decode.engine.sequence import Status
from hispec_decode.tools import generate as generate_cli

PROMPTS = [[5, 9, 2, 6], [1, 2, 3, 4, 5, 6, 7], [8]]
POLICY = dict(draft_layer=2, verify_layer=4, window=3, num_draft=2)


def test_generation_config_equals_keyword_arguments(hispec_models):
    model = hispec_models["llama"]
    config = GenerationConfig(max_new_tokens=12, method="hispec", **POLICY)
    by_config = model.generate(PROMPTS, config)
    by_keywords = model.generate(PROMPTS, max_new_tokens=12, method="hispec", **POLICY)
    assert by_config.sequences == by_keywords.sequences
    assert by_config.stats["window"] == 3 and by_config.stats["num_draft"] == 2
    # keywords override the config's fields; the config itself is unchanged (frozen)
    short = model.generate(PROMPTS, config, max_new_tokens=4, num_blocks=8, block_size=4)
    assert [len(s) for s in short.sequences] == [4, 4, 4] and config.max_new_tokens == 12
    assert short.sequences == [s[:4] for s in by_config.sequences]


def test_every_keyword_of_the_decoding_contract(hispec_models):
    """The contract external checks use, word for word."""
    out = hispec_models["qwen2"].generate(
        [PROMPTS[0]], max_new_tokens=6, method="self_spec", do_sample=True, temperature=0.7, top_k=20, top_p=0.9,
        seed=4, draft_layer=2, verify_layer=None, window=None, num_draft=3)
    assert len(out.sequences[0]) == 6 and out.stats["method"] == "self_spec" and out.stats["num_draft"] == 3


def test_unknown_and_bad_arguments_name_themselves(hispec_models):
    model = hispec_models["llama"]
    with pytest.raises(HiSpecError, match=r"unknown generation argument\(s\) \['max_tokens'\].*max_new_tokens"):
        model.generate(PROMPTS, max_tokens=3)
    with pytest.raises(HiSpecError, match="block_size must be an integer >= 1"):
        model.generate(PROMPTS, block_size=0)
    with pytest.raises(HiSpecError, match="schedule must be one of eager, gather"):
        EngineConfig(schedule="lazy")
    with pytest.raises(HiSpecError, match="do_sample must be True or False"):
        GenerationConfig(do_sample=1)
    with pytest.raises(HiSpecError, match="seed must be an integer"):
        GenerationConfig(seed=1.5)


def test_one_server_object_fixes_method_and_policy(hispec_models):
    model = hispec_models["llama"]
    server = model.serve(GenerationConfig(method="hispec", max_new_tokens=5, **POLICY), num_blocks=32, block_size=4)
    rid = server.add_request(PROMPTS[0])  # the server's defaults
    other = server.add_request(PROMPTS[1], max_new_tokens=3, do_sample=True, seed=1)  # per-request fields
    with pytest.raises(HiSpecError, match="window is fixed per server"):
        server.add_request(PROMPTS[2], window=1)
    with pytest.raises(HiSpecError, match="method is fixed per server"):
        server.add_request(PROMPTS[2], method="autoregressive")
    done = {o.request_id: o for o in server.stream() if o.finished}
    assert set(done) == {rid, other}
    assert server.sequences[rid].new_tokens == model.generate([PROMPTS[0]], max_new_tokens=5, **POLICY).sequences[0]
    assert len(server.sequences[other].new_tokens) == 3 and server.sequences[other].finish_reason == "length"


def test_abort_frees_blocks_at_once(hispec_models):
    model = hispec_models["opt"]
    server = model.serve(method="hispec", num_blocks=32, block_size=4, **POLICY)
    running = server.add_request(PROMPTS[1], max_new_tokens=40)
    queued = server.add_request(PROMPTS[0], max_new_tokens=40)
    server.step()
    server.step()
    assert server.cache.manager.num_free < 32
    server.abort(running)
    server.abort(queued)
    assert server.cache.manager.num_free == 32 and not server.has_unfinished()
    assert server.sequences[running].status is Status.FINISHED and server.sequences[running].finish_reason == "abort"
    server.cache.manager.check()
    with pytest.raises(HiSpecError, match="no request"):
        server.abort(99)


def test_adapter_records_versions_and_reads_format_1(hispec_models, tiny_models, tmp_path):
    adapter = HiSpecAdapter.create(hispec_models["llama"].decoder, "tiny-llama", [ExitSpec(2, "draft", "norm")],
                                   base_revision="abc123")
    adapter.save_pretrained(tmp_path / "new")
    data = json.loads((tmp_path / "new" / CONFIG_NAME).read_text())
    assert data["format_version"] == 2 and data["hispec_version"] == __version__ and data["base_revision"] == "abc123"
    assert list(data) == sorted(data), "written with sorted keys"
    assert HiSpecAdapterConfig.from_pretrained(tmp_path / "new") == adapter.config
    # a format-1 config (before exit_vocab_size and the recorded versions) still loads
    old = dict(data, format_version=1)
    old["exits"] = [{k: v for k, v in e.items() if k != "exit_vocab_size"} | {"exit_vocab": 0} for e in data["exits"]]
    del old["hispec_version"], old["base_revision"]
    migrated = HiSpecAdapterConfig.from_dict(old)
    assert migrated.format_version == 2 and migrated.exits[0].exit_vocab_size == 0 and migrated.hispec_version is None


def test_cli_options_come_from_the_config_fields(capsys):
    with pytest.raises(SystemExit):
        generate_cli.main(["--help"])
    text = capsys.readouterr().out
    for f in dataclasses.fields(GenerationConfig) + dataclasses.fields(EngineConfig):
        assert f"--{f.name.replace('_', '-')}" in text, f.name


def test_train_help_explains_every_key(capsys):
    from hispec_train.cli import main
    from hispec_train.config import TrainConfig

    assert main(["--help"]) == 0
    text = capsys.readouterr().out
    for f in dataclasses.fields(TrainConfig):
        assert f"--{f.name.replace('_', '-')}" in text and f.metadata["help"] in text, f.name
