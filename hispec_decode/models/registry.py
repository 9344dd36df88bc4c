"""Which architecture family runs which ``model_type``; the one place to register a new family."""

from __future__ import annotations

from torch import nn

from ..errors import UnsupportedArchitectureError
from .base import DecoderModel
from .gemma3 import Gemma3Model
from .llama import LlamaModel
from .opt import OPTModel

FAMILIES: dict[str, type[DecoderModel]] = {
    "llama": LlamaModel,
    "qwen2": LlamaModel,
    "qwen3": LlamaModel,
    "opt": OPTModel,
    "gemma3_text": Gemma3Model,  # Gemma3ForCausalLM (the text models; the multimodal ones wrap it)
}
SUPPORTED_MODEL_TYPES = tuple(sorted(FAMILIES))


def check_supported(model_type: str) -> None:
    if model_type not in FAMILIES:
        raise UnsupportedArchitectureError(
            f"architecture {model_type!r} is not supported; supported model types: {', '.join(SUPPORTED_MODEL_TYPES)}"
        )


def decoder_for(model: nn.Module, pack_weights: bool = True) -> DecoderModel:
    """Wrap a loaded Hugging Face causal LM; fails for architectures this engine cannot run."""
    check_supported(model.config.model_type)
    return FAMILIES[model.config.model_type](model, pack_weights)
