"""vLLM + HiSpec tests: run in the virtualenv scripts/_setup_vllm.sh makes (vLLM's CPU build, which pins
transformers < 5.20), by scripts/test.sh after the main suite. Tiny random models of the architectures
both projects support, saved once per session, and one engine per (model, speculation) at a time."""

from __future__ import annotations

import gc
import json
import os
from dataclasses import dataclass
from pathlib import Path

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine in this process
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "all")

import pytest  # noqa: E402
import torch  # noqa: E402

vllm = pytest.importorskip("vllm")

from hispec_decode.adapter import VLLM_BASE_CONFIG_NAME, ExitSpec, HiSpecAdapter, vllm_base_config  # noqa: E402
from hispec_decode.models import decoder_for  # noqa: E402

DRAFT_LAYER = 2
LAYERS = 4
COMMON = dict(vocab_size=256, hidden_size=128, num_hidden_layers=LAYERS, num_attention_heads=2, num_key_value_heads=1,
              intermediate_size=256, max_position_embeddings=256, bos_token_id=None, eos_token_id=None,
              pad_token_id=None)  # head_dim 64: a size vLLM's CPU attention supports


def tiny_configs() -> dict:
    from transformers import LlamaConfig, Qwen2Config, Qwen3Config

    return {"llama": LlamaConfig(**COMMON, tie_word_embeddings=False),
            "qwen2": Qwen2Config(**COMMON, tie_word_embeddings=True),
            "qwen3": Qwen3Config(**COMMON, head_dim=64, tie_word_embeddings=False)}


@dataclass
class TinyBase:
    name: str
    path: Path
    model: torch.nn.Module  # transformers' model, fp32


def exact_exit(model: torch.nn.Module, layer: int) -> None:
    """Make the exit at ``layer`` the final prediction whatever the context: layers from ``layer`` up
    add nothing and no layer's attention adds anything. (vLLM's EAGLE drafter never sees a sequence's
    first token, so with attending lower layers its exit would differ from the target's a little.)"""
    with torch.no_grad():
        for i, block in enumerate(model.model.layers):
            block.self_attn.o_proj.weight.zero_()
            if i >= layer:
                block.mlp.down_proj.weight.zero_()


def fresh(base: "TinyBase") -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(base.path).eval()


def save_heads(model: torch.nn.Module, out: Path, reject: bool = False, exit_vocab: torch.Tensor | None = None,
               head_type: str = "deep_context") -> Path:
    """A draft head at DRAFT_LAYER: zero-initialised (the base's own exit there; a feature_attention head's
    layer is then the base's layer L_d, which adds nothing on a base whose exit is exact), or one whose
    input is always zero (``reject``: it drafts one fixed token), with the base's config for vLLM."""
    adapter = HiSpecAdapter.create(decoder_for(model, pack_weights=False), "tiny", [ExitSpec(DRAFT_LAYER, "draft", head_type)])
    head = adapter.head(DRAFT_LAYER)
    if reject:
        with torch.no_grad():
            if head_type == "feature_attention":  # u = h + F [h ; c] = 0
                hidden = head.fuse.weight.shape[0]
                head.fuse.weight.zero_()
                head.fuse.weight[:, :hidden].copy_(-torch.eye(hidden))
            else:
                head.proj.weight.copy_(-torch.eye(head.proj.weight.shape[0]))
    if exit_vocab is not None:
        head.set_vocab(exit_vocab)
    adapter.save_pretrained(out)
    (out / VLLM_BASE_CONFIG_NAME).write_text(json.dumps(vllm_base_config(model.config.to_dict())))
    return out


@pytest.fixture(scope="session")
def tiny_bases(tmp_path_factory) -> dict[str, TinyBase]:
    from transformers import AutoModelForCausalLM

    out = {}
    for name, cfg in tiny_configs().items():
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(cfg).eval()
        path = tmp_path_factory.mktemp(f"tiny-{name}")
        model.save_pretrained(path)
        out[name] = TinyBase(name, path, model)
    return out


@pytest.fixture(scope="session", autouse=True)
def draft_cache(tmp_path_factory):
    os.environ["HISPEC_VLLM_DIR"] = str(tmp_path_factory.mktemp("vllm-drafts"))


@dataclass
class Run:
    tokens: list[list[int]]
    drafts: int
    draft_tokens: int
    accepted: int


def generate(model: str | Path, prompts: list[list[int]], max_tokens: int, speculative_config: dict | None = None,
             dtype: str = "float32", temperature: float = 0.0, seed: int = 0, tokenizer: bool = False) -> Run:
    """One engine, its outputs and spec-decode counters, then the engine is torn down."""
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(model=str(model), dtype=dtype, max_model_len=256 if not tokenizer else 1024, enforce_eager=True,
              skip_tokenizer_init=not tokenizer, disable_log_stats=False, seed=seed, max_num_seqs=16,
              speculative_config=speculative_config)
    try:
        params = SamplingParams(temperature=temperature, max_tokens=max_tokens, ignore_eos=True)  # the engine's seed
        outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
        counters = {m.name: getattr(m, "value", None) for m in llm.get_metrics()}
        return Run([list(o.outputs[0].token_ids) for o in outs], int(counters.get("vllm:spec_decode_num_drafts") or 0),
                   int(counters.get("vllm:spec_decode_num_draft_tokens") or 0),
                   int(counters.get("vllm:spec_decode_num_accepted_tokens") or 0))
    finally:
        del llm
        gc.collect()
        from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

        cleanup_dist_env_and_memory()
