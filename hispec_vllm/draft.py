"""The draft directory vLLM loads as an EAGLE-style drafter, built from a HiSpec adapter (no vLLM import).

vLLM's ``method="eagle"`` runs a draft model that receives the target's final (normed) hidden
state of the previous position, which is the deep context that HiSpec's ``deep_context`` and
``feature_attention`` heads read. So the draft exit becomes such a drafter: the base's first ``L_d``
layers (with their own K/V pages in vLLM), the trained head (for ``feature_attention`` its decoder
layer too, with K/V pages of its own), its norm and the exit-vocabulary rows of the shared LM head.

A draft directory holds ``config.json`` (the base's Hugging Face config with
``architectures = [DRAFT_ARCHITECTURE]``, ``num_hidden_layers`` = the drafter's layers: ``L_d``,
plus one for a ``feature_attention`` head's own layer, and a ``hispec_draft`` block) and ``model.safetensors`` (the draft head's tensors under ``hispec_head.``). The base's
layer weights are not copied: the drafter reads them from the target's own checkpoint when vLLM
loads it. The base's config comes from ``VLLM_BASE_CONFIG_NAME`` beside the adapter, which
``hispec-export`` writes.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

from safetensors.torch import load_file, save_file

from hispec_decode.adapter import CONFIG_NAME, VLLM_BASE_CONFIG_NAME, WEIGHTS_NAME, HiSpecAdapterConfig
from hispec_decode.adapter.hispec_adapter import _resolve
from hispec_decode.errors import AdapterError
from hispec_decode.files import atomic_directory, write_text
from hispec_decode.models.loading import hispec_home

DRAFT_ARCHITECTURE = "EagleHiSpecForCausalLM"  # "Eagle..." so vLLM's EAGLE config keeps the name
DRAFT_CONFIG_KEY = "hispec_draft"
HEAD_PREFIX = "hispec_head."
SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3")  # decoder layers the drafter builds from vLLM's own
# pointwise heads, and feature_attention (EAGLE's own shape: one decoder layer over the fused features)
SUPPORTED_HEAD_TYPES = ("norm", "residual_linear", "deep_context", "feature_attention")
DEFAULT_SPECULATIVE_TOKENS = 1  # an adapter without a tuned policy
CACHE_ENV = "HISPEC_VLLM_DIR"


def draft_config(adapter: HiSpecAdapterConfig, base_config: dict[str, Any]) -> dict[str, Any]:
    """The drafter's ``config.json``: the base's config cut to the draft exit's layers, plus the head."""
    model_type = base_config.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise AdapterError(f"vLLM drafting supports bases of type {', '.join(SUPPORTED_MODEL_TYPES)}; this adapter's "
                           f"base is {model_type!r}")
    draft = next((e for e in adapter.exits if e.role == "draft"), None)
    if draft is None:
        raise AdapterError("the adapter has no draft exit")
    if draft.head_type not in SUPPORTED_HEAD_TYPES:
        raise AdapterError(f"vLLM drafting supports draft heads of type {', '.join(SUPPORTED_HEAD_TYPES)}; the "
                           f"draft exit at layer {draft.layer} is {draft.head_type!r}")
    if draft.options.get("attention_only"):
        raise AdapterError(f"vLLM drafting needs the draft head's layer whole; the {draft.head_type} head at layer "
                           f"{draft.layer} is attention_only")
    for key in ("hidden_size", "num_hidden_layers", "vocab_size"):
        if base_config.get(key) != getattr(adapter, key):
            raise AdapterError(f"{VLLM_BASE_CONFIG_NAME} does not describe this adapter's base: {key} is "
                               f"{base_config.get(key)!r}, the adapter's {getattr(adapter, key)!r}")
    # the drafter's layers: copies of the base's 0..L_d-1, then a feature_attention head's own layer (a
    # trained copy of the base's layer source_layer)
    layers = list(range(draft.layer)) + ([draft.options.get("source_layer", draft.layer)]
                                         if draft.head_type == "feature_attention" else [])
    per_layer = {k: [v[i] for i in layers] for k, v in base_config.items()  # e.g. Qwen's layer_types
                 if isinstance(v, list) and len(v) == adapter.num_hidden_layers and k != "architectures"}
    return base_config | per_layer | {
        "architectures": [DRAFT_ARCHITECTURE],
        "num_hidden_layers": len(layers),
        DRAFT_CONFIG_KEY: {
            "base_model": adapter.base_model,
            "base_fingerprint": adapter.base_fingerprint,
            "draft_layer": draft.layer,
            "head_type": draft.head_type,
            "exit_vocab_size": draft.exit_vocab_size,
            "target_num_hidden_layers": adapter.num_hidden_layers,
        },
    }


def speculative_tokens(adapter: HiSpecAdapterConfig, dtype: str = "bfloat16") -> int:
    """Tokens per draft from the adapter's tuned policy (vLLM drafts chains: a tree's depth)."""
    policy = adapter.tuned_policy("hispec", dtype) or adapter.tuned_policy("self_spec", dtype) or {}
    return max(1, int(policy.get("num_draft") or DEFAULT_SPECULATIVE_TOKENS))


def cache_root() -> Path:
    return Path(os.environ.get(CACHE_ENV) or hispec_home() / "vllm")


def build_draft_dir(heads: str | os.PathLike | None = None, out: str | os.PathLike | None = None) -> Path:
    """Write (or find, if already written) the draft directory for ``heads`` (an adapter directory or
    Hub id; None: the embedded default heads) and return its path. ``out``: where (default: a
    directory under ``$HISPEC_VLLM_DIR`` or ``$HISPEC_HOME/vllm`` named by the content)."""
    return _build(heads, out)[0]


def _build(heads: str | os.PathLike | None, out: str | os.PathLike | None) -> tuple[Path, HiSpecAdapterConfig]:
    src = default_heads_dir() if heads is None else _resolve(heads, None)
    adapter = HiSpecAdapterConfig.from_pretrained(src)
    base_file = src / VLLM_BASE_CONFIG_NAME
    if not base_file.is_file():
        raise AdapterError(f"{src} has no {VLLM_BASE_CONFIG_NAME} (the base's config that vLLM's drafter needs): "
                           f"export the adapter again with hispec-export, which writes it")
    try:
        base_config = json.loads(base_file.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise AdapterError(f"{base_file} is damaged ({exc})") from exc
    config = draft_config(adapter, base_config)
    draft = config[DRAFT_CONFIG_KEY]["draft_layer"]
    try:
        tensors = load_file(src / WEIGHTS_NAME)
    except Exception as exc:  # a truncated or foreign file
        raise AdapterError(f"{src / WEIGHTS_NAME} could not be read ({exc})") from exc
    mine = {HEAD_PREFIX + k.split(".", 1)[1]: v.contiguous() for k, v in tensors.items() if k.split(".", 1)[0] == str(draft)}
    digest = hashlib.sha256(json.dumps(config, sort_keys=True).encode())
    for k in sorted(mine):
        digest.update(k.encode() + mine[k].numpy().tobytes())
    target = Path(out) if out is not None else cache_root() / digest.hexdigest()[:16]
    if (target / "config.json").is_file() and (target / "model.safetensors").is_file() and out is None:
        return target, adapter  # written before: the name is the content
    with atomic_directory(target) as tmp:
        write_text(tmp / "config.json", json.dumps(config, indent=2, sort_keys=True))
        save_file(mine, str(tmp / "model.safetensors"), metadata={"format": "pt", "hispec_adapter": CONFIG_NAME})
    return target, adapter


def speculative_config(heads: str | os.PathLike | None = None, num_speculative_tokens: int | None = None) -> dict[str, Any]:
    """What to pass to vLLM for HiSpec heads: ``vllm.LLM(model=BASE, speculative_config=...)``, or
    ``vllm serve BASE --speculative-config "$(json)"``. ``heads``: an adapter directory or Hub id
    (None: the embedded default heads); ``num_speculative_tokens``: tokens per draft (default: the
    adapter's tuned policy)."""
    if num_speculative_tokens is not None and (not isinstance(num_speculative_tokens, int) or num_speculative_tokens < 1):
        raise ValueError(f"num_speculative_tokens must be a positive integer; got {num_speculative_tokens!r}")
    path, adapter = _build(heads, None)
    k = num_speculative_tokens or speculative_tokens(adapter)
    return {"method": "eagle", "model": str(path), "num_speculative_tokens": k}


def default_heads_dir() -> Path:
    from hispec_decode.api import DEFAULT_HEADS_DIR

    return DEFAULT_HEADS_DIR
