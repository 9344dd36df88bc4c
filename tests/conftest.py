"""Tiny random-weight models of every supported architecture, saved to disk once per session."""

from __future__ import annotations

import http.client
import json
import logging
import math
import os
import random
import re
import shutil
import signal
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable

import pytest
import torch
from transformers import AutoModelForCausalLM, Gemma3TextConfig, LlamaConfig, OPTConfig, Qwen2Config, Qwen3Config

from hispec_decode import HiSpecModel, files
from hispec_decode.decoding.sampling import SamplingParams, warp

if TYPE_CHECKING:
    from openai import OpenAI

    from hispec_decode.serving import ServerConfig

# under pytest-xdist (scripts/test.sh runs two workers) the workers share the machine's cores
os.environ["HISPEC_DERIVE"] = "now"  # policies are derived in the test's own process (test_derive tests the worker)
if os.environ.get("PYTEST_XDIST_WORKER"):
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))))

VOCAB = 101
LAYERS = 6
COMMON = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=LAYERS, num_attention_heads=4,
              max_position_embeddings=128, bos_token_id=None, eos_token_id=None, pad_token_id=None)
LLAMA_LIKE = dict(intermediate_size=96, num_key_value_heads=2)


def tiny_configs() -> dict[str, object]:
    return {
        "llama": LlamaConfig(**COMMON, **LLAMA_LIKE, tie_word_embeddings=False),
        "llama-tied-mha": LlamaConfig(**COMMON, intermediate_size=96, num_key_value_heads=4, tie_word_embeddings=True),
        "qwen2": Qwen2Config(**COMMON, **LLAMA_LIKE),
        "qwen3": Qwen3Config(**COMMON, **LLAMA_LIKE, head_dim=16),
        "opt": OPTConfig(**COMMON, ffn_dim=96, word_embed_proj_dim=32),  # pre-LN, project_in/out
        "opt-post-ln": OPTConfig(**COMMON, ffn_dim=96, do_layer_norm_before=False),
        # local layers (window 8, shorter than most prompts + outputs here) and a global one every third
        # layer, each with its rotary base; one K/V head; a query scale unlike head_dim ** -0.5; tied
        "gemma3": Gemma3TextConfig(**COMMON, intermediate_size=96, num_key_value_heads=1, head_dim=16,
                                   sliding_window=8, sliding_window_pattern=3, query_pre_attn_scalar=24,
                                   rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                                    "full_attention": {"rope_type": "linear", "factor": 2.0,
                                                                       "rope_theta": 1000000.0}}),
    }


ARCHS = list(tiny_configs())


@dataclass
class Tiny:
    name: str
    path: Path
    reference: torch.nn.Module  # transformers' own model, fp32, for generate()

    def load(self, **kwargs) -> HiSpecModel:
        return HiSpecModel.from_pretrained(str(self.path), **kwargs)

    def hf_generate(self, prompt: list[int], max_new_tokens: int, eos_token_id: int | None = None) -> list[int]:
        ids = torch.tensor([prompt])
        out = self.reference.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                                      do_sample=False, eos_token_id=eos_token_id, pad_token_id=0)
        return out[0, len(prompt):].tolist()


def save_tiny(name: str, directory: Path, seed: int = 0, mutate=None) -> Tiny:
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_configs()[name]).eval()
    with torch.no_grad():  # random init gives near-uniform logits; sharpen so argmax is well separated
        for p in model.parameters():
            if p.dim() == 2:
                p.mul_(2.0)
        if mutate is not None:
            mutate(model)
    model.save_pretrained(directory)
    reference = AutoModelForCausalLM.from_pretrained(directory).eval()
    return Tiny(name, directory, reference)


@pytest.fixture(scope="session", autouse=True)
def _policies_run_as_they_are():
    """Tests of decoding run each policy as it is: each sequence's round chooser always takes the policy
    (tests/test_chooser.py tests it)."""
    from hispec_decode.engine import chooser

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(chooser.RoundChooser, "choose", lambda self, seq: self.policy)
        yield


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory) -> dict[str, Tiny]:
    logging.getLogger("transformers").setLevel(logging.ERROR)
    return {name: save_tiny(name, tmp_path_factory.mktemp(name)) for name in ARCHS}


@pytest.fixture(scope="session")
def hispec_models(tiny_models) -> dict[str, HiSpecModel]:
    return {name: tiny.load() for name, tiny in tiny_models.items()}


CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def save_char_tokenizer(directory: Path) -> None:
    """A character-level tokenizer that fits the tiny models' vocabulary (for training tests)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    chars = [chr(c) for c in range(32, 127)] + ["\n"]
    specials = ["<unk>", "<|im_start|>", "<|im_end|>"]
    vocab = {t: i for i, t in enumerate(specials + chars)}
    assert len(vocab) <= VOCAB
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="<|im_end|>",
                                   additional_special_tokens=["<|im_start|>"])
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(directory)


def write_conversations(path: Path, n: int = 40) -> Path:
    rows = []
    for i in range(n):
        q = f"What is {i} plus {i + 1}?"
        rows.append({"conversations": [{"from": "human", "value": q},
                                       {"from": "gpt", "value": f"{i} plus {i + 1} is {2 * i + 1}. " * 3}]})
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return path


TEXT_PROMPTS = [f"What is {i} plus {i + 1}?" for i in range(12)] + [f"Say {i} twice." for i in range(12)]


@pytest.fixture(scope="session")
def prompt_file(tmp_path_factory) -> Path:
    """:data:`TEXT_PROMPTS`, one per line (a local prompt source for hispec-selfdistill)."""
    path = tmp_path_factory.mktemp("prompts") / "prompts.txt"
    path.write_text("\n".join(TEXT_PROMPTS) + "\n")
    return path


@pytest.fixture(scope="session")
def trainable_base(tmp_path_factory) -> Path:
    """A tiny Llama with a tokenizer and a chat template, saved to disk."""
    path = tmp_path_factory.mktemp("trainable")
    save_tiny("llama", path)
    save_char_tokenizer(path)
    return path


def make_run_dir(run_dir: Path, base: Path, scale: float = 0.0, step: int = 3) -> Path:
    """A training run directory as hispec-train leaves it (config + checkpoint), without training:
    residual heads at layers 1 and 3 whose weights are ``scale`` times a fixed random matrix."""
    from hispec_decode.adapter import ExitSpec, HiSpecAdapter
    from hispec_decode.models import decoder_for, load_base
    from hispec_train.checkpoint import save_checkpoint
    from hispec_train.config import load_config
    from hispec_train.trainer import CONFIG_NAME

    decoder = decoder_for(load_base(str(base)).model, pack_weights=False)
    adapter = HiSpecAdapter.create(decoder, str(base), [ExitSpec(1, "draft", "residual_linear"),
                                                        ExitSpec(3, "intermediate", "residual_linear")])
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for layer in (1, 3):
            w = adapter.head(layer).proj.weight
            w.copy_(scale * torch.randn(w.shape, generator=g))
    cfg = load_config(None, {"base": str(base), "output_dir": str(run_dir), "heads_layers": "1,3", "report_to": "none"})
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / CONFIG_NAME).write_text(json.dumps(cfg.to_dict(), sort_keys=True))
    save_checkpoint(run_dir, adapter, None, {"step": step})
    return run_dir


def read_by(method: str, **settings) -> dict:
    """``settings`` with ``method``, less the policy knobs that method does not read (the engine refuses a knob
    that can never take effect): one set of knobs for tests that run several methods."""
    from hispec_decode.knobs import KNOB

    return {"method": method, **{k: v for k, v in settings.items() if k not in KNOB or method in KNOB[k].methods}}


# -- killed writers: SIGKILL right before the k-th file system operation, for every k ----------

FS_OPERATIONS = [(os, "replace"), (os, "chmod"), (shutil, "rmtree"), (Path, "mkdir"), (Path, "write_text"),
                 (Path, "write_bytes"), (Path, "unlink"), (Path, "rmdir"), (files, "_exchange")]


def killed_at(k: int, write: Callable[[], None], extra: list[tuple[object, str]] = ()) -> bool:
    """Run ``write`` in a forked child that SIGKILLs itself right before its k-th file system
    operation (:data:`FS_OPERATIONS` plus ``extra``: writers a module imported by name); True if it
    was killed, False if it finished (it must not fail otherwise)."""
    pid = os.fork()
    if pid == 0:  # the child: count operations, die at the k-th
        try:
            torch.set_num_threads(1)  # the parent's OpenMP pool does not survive fork (oneDNN would hang)
            count = [0]
            for owner, name in [*FS_OPERATIONS, *extra]:
                original = getattr(owner, name)

                def hooked(*args, _original=original, **kwargs):
                    count[0] += 1
                    if count[0] == k:
                        os.kill(os.getpid(), signal.SIGKILL)
                    return _original(*args, **kwargs)
                setattr(owner, name, hooked)
            write()
        except BaseException:  # noqa: BLE001 - report any failure as exit status 1
            os._exit(1)
        os._exit(0)
    _, status = os.waitpid(pid, 0)
    if os.WIFSIGNALED(status):
        assert os.WTERMSIG(status) == signal.SIGKILL
        return True
    assert os.WEXITSTATUS(status) == 0, f"the write failed (not killed) at k={k}"
    return False


def every_kill_point(write: Callable[[], None], check: Callable[[], None],
                     extra: list[tuple[object, str]] = ()) -> int:
    """Kill ``write`` at its 1st, 2nd, ... file system operation, calling ``check`` after each kill,
    until it finishes unkilled; returns the number of kill points."""
    k = 1
    while killed_at(k, write, extra):
        check()
        k += 1
        assert k < 400, "the write never finished"
    return k - 1


# -- prompts and references of the lossless tests ----------------------------------------------

LOSSLESS_PROMPTS = {1: [7], 5: [3, 14, 15, 92, 65], 17: [(i * 37 + 11) % VOCAB for i in range(17)]}
LOSSLESS_NEW = 24
_rng = random.Random(0)
BATCH_PROMPTS = [[_rng.randrange(VOCAB) for _ in range(n)] for n in (1, 7, 3, 12, 5, 20, 2, 9, 14, 4, 1, 11, 6, 17, 8, 3)]


@pytest.fixture(scope="session")
def references(tiny_models) -> dict[tuple[str, int], list[int]]:
    """transformers' greedy output of each :data:`LOSSLESS_PROMPTS` prompt, by (architecture, prompt length)."""
    return {(a, n): tiny_models[a].hf_generate(p, LOSSLESS_NEW) for a in ARCHS for n, p in LOSSLESS_PROMPTS.items()}


# -- heads and bases that accept or reject everything -------------------------------------------

def identity_above(draft_layer: int):
    """Zero every layer's output projections from ``draft_layer`` up: the upper layers become the
    identity, so the draft exit equals the final prediction and every draft must be accepted."""

    def mutate(model):
        for layer in model.base_model.layers[draft_layer:] if hasattr(model.base_model, "layers") else model.model.decoder.layers[draft_layer:]:
            outs = [layer.self_attn.o_proj, layer.mlp.down_proj] if hasattr(layer, "mlp") else [layer.self_attn.out_proj, layer.fc2]
            for lin in outs:
                lin.weight.zero_()
                if lin.bias is not None:
                    lin.bias.zero_()

    return mutate


def zero_head(head):
    """h + W h with W = -I: the head sees a zero hidden state, so it always proposes one fixed token
    (a deep-context head also ignores its context: U = 0; a feature head's layer sees the same input
    at every position)."""
    with torch.no_grad():
        if head.head_type == "feature_attention":  # zero input, and a layer that adds nothing to it
            head.fuse.weight.zero_()
            head.fuse.weight[:, : head.hidden_size].copy_(-torch.eye(head.hidden_size))
            block = head.block
            for lin in ([block.self_attn.o_proj, block.mlp.down_proj] if hasattr(block, "mlp")
                        else [block.self_attn.out_proj, block.fc2]):
                lin.weight.zero_()
                if lin.bias is not None:
                    lin.bias.zero_()
            return
        head.proj.weight.copy_(-torch.eye(head.proj.weight.shape[0]))
        if hasattr(head, "ctx"):
            head.ctx.weight.zero_()


def chi_square_critical(df: int, z: float = 3.09) -> float:
    """Wilson-Hilferty approximation of the chi-square quantile (z = 3.09: 99.9%)."""
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


def chi_square(counts: dict, expected: dict, total: int) -> tuple[float, int]:
    small = [k for k, p in expected.items() if p * total < 5]
    cells = [(counts.get(k, 0), p * total) for k, p in expected.items() if k not in small]
    cells.append((sum(counts.get(k, 0) for k in small), sum(expected[k] for k in small) * total))
    unexpected = sum(c for k, c in counts.items() if k not in expected)
    assert unexpected == 0, "sampled an outcome of probability zero"
    stat = sum((o - e) ** 2 / e for o, e in cells if e > 0)
    return stat, len(cells) - 1


SAMPLE_PROMPT = [3, 1, 4]


SMALL_VOCAB = dict(vocab_size=8, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
                   max_position_embeddings=32, bos_token_id=None, eos_token_id=None, pad_token_id=None)


def _small_vocab(cfg, directory: Path):
    torch.manual_seed(5)
    model = AutoModelForCausalLM.from_config(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.mul_(3.0)
    model.save_pretrained(directory)
    return directory, model


@pytest.fixture(scope="session")
def small_vocab_model(tmp_path_factory):
    return _small_vocab(LlamaConfig(**SMALL_VOCAB, num_key_value_heads=2), tmp_path_factory.mktemp("small-vocab"))


@pytest.fixture(scope="session")
def small_vocab_gemma(tmp_path_factory):
    """Gemma 3 with 8 tokens; local layers see 2 positions, so the 3-token prompt is already past it."""
    cfg = Gemma3TextConfig(**SMALL_VOCAB, num_key_value_heads=1, head_dim=8, sliding_window=2, sliding_window_pattern=2)
    return _small_vocab(cfg, tmp_path_factory.mktemp("small-vocab-gemma"))


def assert_first_two_tokens_follow(sequences: list[list[int]], model, params: SamplingParams,
                                   prompt: list[int] = SAMPLE_PROMPT) -> None:
    """The chi-square test (99.9%) of the first two tokens of ``sequences`` (independent draws) against
    their exact distribution under ``model`` and ``params``."""
    counts: dict[tuple[int, int], int] = {}
    for seq in sequences:
        counts[tuple(seq[:2])] = counts.get(tuple(seq[:2]), 0) + 1
    stat, df = chi_square(counts, exact_two_token_distribution(model, params, prompt), len(sequences))
    assert stat < chi_square_critical(df), (stat, df)


def exact_two_token_distribution(model, params: SamplingParams, prompt: list[int] = SAMPLE_PROMPT
                                 ) -> dict[tuple[int, int], float]:
    with torch.no_grad():
        first = warp(model(torch.tensor([prompt])).logits[0, -1:], params)[0]
        dist = {}
        for a in range(8):
            if first[a] == 0:
                continue
            second = warp(model(torch.tensor([prompt + [a]])).logits[0, -1:], params)[0]
            for b in range(8):
                if second[b] > 0:
                    dist[a, b] = float(first[a] * second[b])
    return dist




# -- a live server -------------------------------------------------------------------------------

SERVED_MODEL = "tiny-chat"


class LiveServer:
    """A uvicorn server on a free port, in a thread of this process."""

    def __init__(self, model: HiSpecModel, config: ServerConfig | None = None, **engine_overrides) -> None:
        import uvicorn

        from hispec_decode.serving import ServerConfig, build_app
        from hispec_decode.tools.bench_serve import free_port

        self.model = model
        self.config = config or ServerConfig(SERVED_MODEL)
        self.app = build_app(model, model.build_engine(**engine_overrides), self.config)
        self.port = free_port()
        self.server = uvicorn.Server(uvicorn.Config(self.app, host="127.0.0.1", port=self.port, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert self.thread.is_alive() and time.monotonic() < deadline, "server did not start"
            time.sleep(0.02)
        self.url = f"http://127.0.0.1:{self.port}"

    def client(self, **kwargs) -> OpenAI:
        from openai import OpenAI

        return OpenAI(base_url=self.url + "/v1", api_key=self.config.api_key or "none", max_retries=0, **kwargs)

    def request(self, method: str, path: str, body: bytes | str | dict | None = None,
                headers: dict | None = None) -> tuple[int, dict | str]:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=60)
        data = json.dumps(body) if isinstance(body, dict) else body
        hdrs = {"Content-Type": "application/json"}
        if self.config.api_key:
            hdrs["Authorization"] = f"Bearer {self.config.api_key}"
        conn.request(method, path, data, hdrs | (headers or {}))
        resp = conn.getresponse()
        text = resp.read().decode()
        conn.close()
        try:
            return resp.status, json.loads(text)
        except json.JSONDecodeError:
            return resp.status, text

    def metric(self, name: str) -> float:
        _, text = self.request("GET", "/metrics")
        match = re.search(rf"^{name}(?:{{[^}}]*}})? (\S+)$", text, re.M)
        assert match, f"{name} not in /metrics"
        return float(match.group(1))

    def close(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)
