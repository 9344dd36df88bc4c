"""The vocabulary level's token ranking: which rows of the base's LM head ``L_v`` keeps.

``L_v`` (:meth:`~hispec_decode.decoding.policy.Policy.exits`) runs every layer and then the LM head
over the ``vocab`` tokens the base itself emits most often. Their order is a ranking of the whole
vocabulary by a weight per token:

* an adapter ships it as ``hispec_vocab.safetensors`` (``weights``: one number per token, e.g. how
  often the base emitted it in its self-distilled output; :func:`weights_from_tokens`);
* a base without one gets it from a short calibration decode (:func:`calibration_weights`: the base's
  own probability mass per token along its greedy answers to a few prompts), computed once and kept
  under ``$HISPEC_HOME/vocab/``.

Ties (tokens never seen) keep id order, so any size is a prefix of one ranking.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file

from ..errors import AdapterError
from ..files import atomic_file

logger = logging.getLogger(__name__)

VOCAB_NAME = "hispec_vocab.safetensors"
# prompts of the calibration decode for a base without a ranking: chat, code, prose
CALIBRATION_PROMPTS = (
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "Explain how a hash map works and give a Python example.",
    "What are the main causes of inflation? Answer in a few paragraphs.",
    "def merge_sorted(a, b):\n    \"\"\"Merge two sorted lists into one sorted list.\"\"\"\n",
    "The history of the printing press begins",
    "List five tips for writing clear technical documentation, with an example of each.",
    "Translate into French and explain the grammar: 'I would have gone if it had not rained.'",
    "import numpy as np\n\n# Compute the moving average of a 1-D array with a window of k\n",
)
CALIBRATION_TOKENS = 128


def ranking(weights: torch.Tensor) -> torch.Tensor:
    """Token ids by decreasing weight (ties in id order)."""
    return torch.sort(weights.float(), descending=True, stable=True).indices


def weights_from_tokens(sequences: list[list[int]], vocab_size: int) -> torch.Tensor:
    """How often each token occurs in ``sequences`` (e.g. the base's self-distilled answers)."""
    counts = torch.zeros(vocab_size, dtype=torch.float32)
    for tokens in sequences:
        if tokens:
            counts += torch.bincount(torch.tensor(tokens, dtype=torch.int64), minlength=vocab_size)[:vocab_size].float()
    return counts


def save_weights(directory: str | Path, weights: torch.Tensor, source: dict[str, Any], name: str = VOCAB_NAME) -> Path:
    """Write the tokens with a weight above 0 (``tokens``, ``weights``) and the vocabulary size."""
    path = Path(directory) / name
    tokens = torch.nonzero(weights > 0).flatten()
    with atomic_file(path) as tmp:
        save_file({"tokens": tokens.to(torch.int64), "weights": weights[tokens].float().contiguous()}, str(tmp),
                  metadata={"hispec_vocab": json.dumps({**source, "vocab_size": weights.numel()}, sort_keys=True)})
    return path


def load_weights(path: str | Path, vocab_size: int) -> torch.Tensor:
    """The per-token weights in ``path`` (0 for tokens it does not list), checked: a clear error if the
    file is damaged or made for another vocabulary."""
    path = Path(path)
    try:
        with safe_open(str(path), "pt") as f:
            meta = json.loads((f.metadata() or {}).get("hispec_vocab", "{}"))
        tensors = load_file(str(path))
    except (SafetensorError, OSError, ValueError) as exc:
        raise AdapterError(f"{path} is not a readable vocabulary ranking ({exc}); delete it or re-create it") from None
    tokens, values = tensors.get("tokens"), tensors.get("weights")
    if (tokens is None or values is None or tokens.dim() != 1 or tokens.shape != values.shape
            or tokens.dtype != torch.int64 or not values.is_floating_point()):
        raise AdapterError(f"{path} must hold 'tokens' (int64) and 'weights' (floats), one weight per token")
    if meta.get("vocab_size") != vocab_size:
        raise AdapterError(f"{path} ranks a vocabulary of {meta.get('vocab_size')} tokens, but the base has {vocab_size}")
    if tokens.numel() and (int(tokens.min()) < 0 or int(tokens.max()) >= vocab_size):
        raise AdapterError(f"{path}: token ids must lie in [0, {vocab_size})")
    if not bool(torch.isfinite(values).all()) or bool((values < 0).any()):
        raise AdapterError(f"{path}: the weights must be finite and >= 0")
    weights = torch.zeros(vocab_size, dtype=torch.float32)
    weights[tokens] = values.float()
    return weights


def fit_context(model: Any, prompts: list[list[int]], max_new_tokens: int) -> tuple[list[list[int]], int]:
    """Prompts and an answer length that fit the base's context (short contexts: shorter both)."""
    room = model.decoder.max_positions // 2
    prompts = [p[-room:] for p in prompts]
    return prompts, max(1, min(max_new_tokens, model.decoder.max_positions - max(map(len, prompts))))


@torch.inference_mode()
def calibration_weights(model: Any, prompts: list[list[int]], max_new_tokens: int = CALIBRATION_TOKENS) -> torch.Tensor:
    """The base's probability mass per token along its greedy answers to ``prompts`` (every answer
    position's full distribution added up), plus one per emitted token."""
    prompts, max_new_tokens = fit_context(model, prompts, max_new_tokens)
    plain = model.generate(prompts, max_new_tokens=max_new_tokens, method="autoregressive")
    vocab_size = model.decoder.vocab_size
    weights = torch.zeros(vocab_size, dtype=torch.float32)
    for prompt, answer in zip(prompts, plain.sequences):
        if not answer:
            continue
        tokens = prompt + answer
        inner = getattr(model.base_model, model.base_model.base_model_prefix)
        h = inner(input_ids=torch.tensor([tokens])).last_hidden_state[:, len(prompt) - 1 : -1]  # normed already
        probs = model.decoder.lm_logits(h)[0].float().softmax(-1)
        weights += probs.sum(0)[:vocab_size]
        weights += torch.bincount(torch.tensor(answer), minlength=vocab_size)[:vocab_size].float()
    return weights


def calibration_prompts(tokenizer: Any) -> list[list[int]]:
    """:data:`CALIBRATION_PROMPTS` as token ids (through the chat template where the tokenizer has one)."""
    rows = []
    for text in CALIBRATION_PROMPTS:
        if getattr(tokenizer, "chat_template", None):
            ids = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)
            ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
        else:
            ids = tokenizer(text)["input_ids"]
        rows.append(list(ids))
    return rows
