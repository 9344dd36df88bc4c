"""The README cannot drift: its Python blocks run (on a tiny model) and its command lines parse."""

from __future__ import annotations

import os
import re
import shlex
from pathlib import Path

import pytest

from hispec_decode import HiSpecModel
from hispec_decode.tools import bench
from hispec_decode.tools import generate as generate_cli
from hispec_train.config import load_config, parse_overrides
from hispec_train.export import build_parser as export_parser

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()


def _blocks(language: str) -> list[str]:
    return re.findall(rf"```{language}\n(.*?)```", README, flags=re.S)


def test_python_blocks_run(trainable_base, monkeypatch, capsys):
    """Every Python block, with the embedded model replaced by a tiny one that has a chat template."""
    original = HiSpecModel.from_pretrained.__func__

    def tiny(cls, base=None, heads=None, **kwargs):
        return original(cls, str(trainable_base) if base is None else base, "none" if base is None else heads, **kwargs)
    monkeypatch.setattr(HiSpecModel, "from_pretrained", classmethod(tiny))
    blocks = _blocks("python")
    assert blocks, "the README has Python examples"
    for code in blocks:
        if "import vllm" in code:  # runs in vLLM's virtualenv: tests_vllm/test_vllm_plugin.py
            continue
        server = None
        if "http://127.0.0.1:8000" in code:  # the hispec-serve client example: against a live tiny server
            from conftest import LiveServer

            from hispec_decode.models.loading import DEFAULT_BASE_NAME
            from hispec_decode.serving import ServerConfig

            server = LiveServer(HiSpecModel.from_pretrained(), ServerConfig(DEFAULT_BASE_NAME), num_blocks=64)
            code = code.replace("http://127.0.0.1:8000", server.url)
        code = code.replace("vocab=8192", "vocab=64")  # the tiny model's vocabulary has 101 tokens, not 49,152
        try:
            exec(compile(code, "README.md", "exec"), {"__name__": "readme"})  # noqa: S102 - our own README
        finally:
            if server is not None:
                server.close()
    # the streaming example printed each committed chunk as "request_id [tokens] finished"
    lines = [m.groups() for m in re.finditer(r"^(\d+) \[([\d, ]*)\] (True|False)$", capsys.readouterr().out, re.M)]
    assert lines, "the streaming example printed nothing it committed"
    by_request: dict[str, list[int]] = {}
    for rid, chunk, finished in lines:
        assert rid not in by_request or by_request[rid][-1] != -1, f"request {rid} streamed after it finished"
        by_request.setdefault(rid, []).extend([int(t) for t in chunk.split(",") if t.strip()] + [-1] * (finished == "True"))
    assert len(by_request) == 2 and all(toks[-1] == -1 for toks in by_request.values()), "both requests finish once"
    lengths = [len(toks) - 1 for _, toks in sorted(by_request.items(), key=lambda kv: int(kv[0]))]
    assert 1 <= lengths[0] <= 64 and 1 <= lengths[1] <= 16  # the example's SamplingParams and its keyword override


def _commands() -> list[list[str]]:
    commands = []
    for block in _blocks("bash"):
        for line in block.splitlines():
            line = line.split("  #")[0].strip()
            if line:
                commands.append(shlex.split(line.replace("[", "").replace("]", "")))
    return commands


@pytest.mark.parametrize("argv", _commands(), ids=lambda a: " ".join(a)[:60])
def test_command_lines_parse(argv):
    """Each command line's options exist and its values are valid (nothing is loaded or run)."""
    prog, args = argv[0], argv[1:]
    if prog.startswith("scripts/"):
        assert os.access(ROOT / prog, os.X_OK), prog
    elif prog == "hispec-generate":
        generate_cli.build_parser().parse_args(args)
    elif prog == "hispec-bench":
        bench.parse_args(args)
    elif prog == "hispec-export":
        export_parser().parse_args(args)
    elif prog in ("hispec-selfdistill", "hispec-store", "hispec-curve", "hispec-tune", "hispec-serve",
                  "hispec-bench-serve", "hispec-eval-heads"):
        import importlib

        module = {"hispec-selfdistill": "hispec_train.selfdistill", "hispec-store": "hispec_train.store",
                  "hispec-curve": "hispec_train.curve", "hispec-tune": "hispec_decode.tools.tune",
                  "hispec-serve": "hispec_decode.tools.serve", "hispec-bench-serve": "hispec_decode.tools.bench_serve",
                  "hispec-eval-heads": "hispec_train.eval_heads"}[prog]
        importlib.import_module(module).build_parser().parse_args(args)
    elif prog == "hispec-train":
        overrides = parse_overrides(args)
        load_config(ROOT / overrides.pop("recipe"), overrides)
    elif prog == "accelerate":
        assert args[:2] == ["launch", "--cpu"] and (ROOT / args[2]).is_file(), args
        overrides = parse_overrides(args[3:])
        load_config(ROOT / overrides.pop("recipe"), overrides)
    elif prog == "pip":
        assert args[0] == "install", args
    elif prog == "vllm":  # vLLM's own CLI (its virtualenv): serve with the JSON hispec_vllm prints
        assert args[0] == "serve" and "--speculative-config" in args and "python -m hispec_vllm" in " ".join(args), args
    else:
        pytest.fail(f"the README runs {prog!r}, which this test does not know")
