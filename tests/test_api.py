"""The public API's shape: SamplingParams (per request), SpeculativeConfig and EngineConfig (per engine) and
keyword overrides of all three, one engine object, every CLI option of before the split, adapter format versions."""

from __future__ import annotations

import dataclasses
import json

import pytest

import hispec_decode
from hispec_decode import (
    CONFIG_NAME,
    EngineConfig,
    HiSpecAdapter,
    HiSpecAdapterConfig,
    HiSpecError,
    SamplingParams,
    SpeculativeConfig,
    __version__,
)
from hispec_decode.adapter import ExitSpec
from hispec_decode.config import for_method
from hispec_decode.engine.sequence import Status
from hispec_decode.tools import bench, bench_serve, serve, tune
from hispec_decode.tools import generate as generate_cli

PROMPTS = [[5, 9, 2, 6], [1, 2, 3, 4, 5, 6, 7], [8]]
POLICY = dict(draft_layer=2, verify_layer=4, window=3, num_draft=2)


def test_settings_objects_equal_keyword_arguments(hispec_models):
    model = hispec_models["llama"]
    sampling, speculative = SamplingParams(max_new_tokens=12), SpeculativeConfig(method="hispec", **POLICY)
    by_objects = model.generate(PROMPTS, sampling, speculative)  # as vLLM's LLM.generate(prompts, sampling_params)
    by_name = model.generate(PROMPTS, sampling_params=sampling, speculative_config=speculative)
    by_keywords = model.generate(PROMPTS, max_new_tokens=12, method="hispec", **POLICY)
    assert by_objects.sequences == by_name.sequences == by_keywords.sequences
    assert by_objects.stats["window"] == 3 and by_objects.stats["num_draft"] == 2
    # keywords override the objects' fields; the objects themselves are unchanged (frozen)
    short = model.generate(PROMPTS, sampling, speculative, max_new_tokens=4, num_blocks=8, block_size=4)
    assert [len(s) for s in short.sequences] == [4, 4, 4] and sampling.max_new_tokens == 12
    assert short.sequences == [s[:4] for s in by_objects.sequences]
    with pytest.raises(HiSpecError, match="never takes effect with method='autoregressive'"):
        model.generate(PROMPTS, sampling, speculative, method="autoregressive")  # the exits would be ignored
    plain = model.generate(PROMPTS, sampling, for_method(speculative, "autoregressive"))
    assert plain.sequences == by_objects.sequences and plain.stats["method"] == "autoregressive"


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
        SamplingParams(do_sample=1)
    with pytest.raises(HiSpecError, match="seed must be an integer"):
        SamplingParams(seed=1.5)
    with pytest.raises(HiSpecError, match="window must be an integer >= 1"):
        SpeculativeConfig(window=0)
    with pytest.raises(HiSpecError, match="sampling_params must be a hispec_decode.SamplingParams"):
        model.generate(PROMPTS, SpeculativeConfig())  # settings in the wrong place
    with pytest.raises(HiSpecError, match=r"unknown speculative argument\(s\) \['max_new_tokens'\]"):
        model.policy(max_new_tokens=3)
    with pytest.raises(AttributeError, match="split as vLLM splits it: SamplingParams .* SpeculativeConfig"):
        hispec_decode.GenerationConfig  # noqa: B018 - the removed name says where its fields went


def test_one_engine_object_fixes_method_and_policy(hispec_models):
    model = hispec_models["llama"]
    server = model.build_engine(SpeculativeConfig(method="hispec", **POLICY), sampling_params=SamplingParams(max_new_tokens=5),
                                num_blocks=32, block_size=4)
    rid = server.add_request(PROMPTS[0])  # the engine's default SamplingParams
    other = server.add_request(PROMPTS[1], SamplingParams(max_new_tokens=3, do_sample=True, seed=1))  # per request
    same = server.add_request(PROMPTS[0], max_new_tokens=5, seed=2)  # keywords: fields of the default
    with pytest.raises(HiSpecError, match="window is fixed per engine"):
        server.add_request(PROMPTS[2], window=1)
    with pytest.raises(HiSpecError, match="method is fixed per engine"):
        server.add_request(PROMPTS[2], method="autoregressive")
    with pytest.raises(HiSpecError, match=r"unknown request argument\(s\) \['num_blocks'\]"):
        server.add_request(PROMPTS[2], num_blocks=3)
    done = {o.request_id: o for o in server.stream() if o.finished}
    assert set(done) == {rid, other, same}
    assert server.sequences[same].new_tokens == server.sequences[rid].new_tokens  # greedy: the seed changes nothing
    assert server.sequences[rid].new_tokens == model.generate([PROMPTS[0]], max_new_tokens=5, **POLICY).sequences[0]
    assert len(server.sequences[other].new_tokens) == 3 and server.sequences[other].finish_reason == "length"


def test_abort_frees_blocks_at_once(hispec_models):
    model = hispec_models["opt"]
    server = model.build_engine(method="hispec", num_blocks=32, block_size=4, **POLICY)
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
    for f in dataclasses.fields(SamplingParams) + dataclasses.fields(SpeculativeConfig) + dataclasses.fields(EngineConfig):
        assert f"--{f.name.replace('_', '-')}" in text, f.name


# Every option each CLI took before the settings were split (read off their parsers then), word for word.
CLI_OPTIONS = {
    generate_cli: "--base --batch-aware --batch-invariant --block-size --chat --debug --do-sample --draft-layer "
                  "--draft-threshold --drafter-invariant --dtype --eos-token-id --heads --max-new-tokens --max-num-seqs "
                  "--method --no-batch-aware --no-do-sample --no-drafter-invariant --no-sample --no-use-exit-vocab "
                  "--num-blocks --num-draft --prefill-chunk --prompt --prompt-file --prompt-ids --sample --schedule --seed "
                  "--temperature --top-k --top-p --use-exit-vocab --verify-layer --verify-threshold --window",
    serve: "--api-key --base --batch-aware --batch-invariant --block-size --debug --draft-layer --draft-threshold --dtype "
           "--heads --host --log-level --max-num-seqs --max-queue --method --no-batch-aware --no-use-exit-vocab "
           "--num-blocks --num-draft --port --prefill-chunk --schedule --served-model-name --shutdown-timeout "
           "--use-exit-vocab --verify-layer --verify-threshold --window",
    bench: "--base --batch-invariant --batch-sizes --debug --do-sample --draft-layer --dtype --dtypes --heads --json "
           "--max-batches --max-new-tokens --methods --no-do-sample --no-sample --num-draft --num-prompts --plot --prompts "
           "--sample --schedule --seed --sweep --temperature --top-k --top-p --verify --verify-layer --window",
    tune: "--base --batch-invariant --confirm --curve --debug --dtype --dtypes --heads --json --max-new-tokens "
          "--num-prompts --prompts --report",
    bench_serve: "--api-key --base --batch-invariant --compare-generate --concurrency --debug --dtype --endpoint --heads "
                 "--ignore-eos --json --launch --max-num-seqs --max-tokens --num-prompts --plot --prefill-chunk --prompts "
                 "--random-input-len --requests --time-limit --url",
}


@pytest.mark.parametrize("tool", list(CLI_OPTIONS), ids=lambda m: m.__name__.rsplit(".", 1)[1])
def test_every_cli_keeps_its_options(tool):
    options = {o for action in tool.build_parser()._actions for o in action.option_strings} - {"-h", "--help"}
    assert set(CLI_OPTIONS[tool].split()) <= options, sorted(set(CLI_OPTIONS[tool].split()) - options)


def test_cli_values_reach_the_settings_they_name(monkeypatch, capsys, hispec_models):
    """hispec-generate hands its options to generate as the same keywords as before the split."""
    model, seen = hispec_models["llama"], {}
    real = type(model).generate

    def spy(self, rows, *args, **kw):
        seen.update(kw)
        return real(self, rows, *args, **kw)

    monkeypatch.setattr(type(model), "generate", spy)
    monkeypatch.setattr(type(model), "from_pretrained", classmethod(lambda cls, *a, **k: model))
    assert generate_cli.main(["--prompt-ids", "5 9 2", "--max-new-tokens", "3", "--sample", "--seed", "4", "--method",
                              "self_spec", "--draft-layer", "2", "--num-draft", "2", "--num-blocks", "9",
                              "--no-use-exit-vocab"]) == 0
    assert seen == {"max_new_tokens": 3, "do_sample": True, "seed": 4, "method": "self_spec", "draft_layer": 2,
                    "num_draft": 2, "num_blocks": 9, "use_exit_vocab": False}
    assert "[self_spec] 3 tokens" in capsys.readouterr().out


def test_train_help_explains_every_key(capsys):
    from hispec_train.cli import main
    from hispec_train.config import TrainConfig

    assert main(["--help"]) == 0
    text = capsys.readouterr().out
    for f in dataclasses.fields(TrainConfig):
        assert f"--{f.name.replace('_', '-')}" in text and f.metadata["help"] in text, f.name
