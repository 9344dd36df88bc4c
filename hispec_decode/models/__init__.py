"""Base models: loading them (Hub, local, GGUF, PEFT LoRA), running their layers in slices, and the
exit heads that sit on them (``exit_heads.py``)."""

from .base import DecoderModel, LayerKernels
from .loading import LoadedBase, load_base, parse_dtype
from .registry import SUPPORTED_MODEL_TYPES, check_supported, decoder_for

__all__ = ["SUPPORTED_MODEL_TYPES", "DecoderModel", "LayerKernels", "LoadedBase", "check_supported", "decoder_for",
           "load_base", "parse_dtype"]
