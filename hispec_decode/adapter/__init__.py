"""The adapter format (the only thing HiSpec calls an "adapter"): exit heads for one base model,
their config, and the fingerprint that ties them to that base."""

from .config import (CONFIG_NAME, FORMAT_VERSION, MODEL_CARD_NAME, VLLM_BASE_CONFIG_NAME, WEIGHTS_NAME, ExitHeadConfig,
                     HiSpecAdapterConfig, vllm_base_config)
from .fingerprint import compute_fingerprint, fingerprint_id, fingerprints_match
from .hispec_adapter import ExitSpec, HiSpecAdapter

__all__ = ["CONFIG_NAME", "FORMAT_VERSION", "MODEL_CARD_NAME", "VLLM_BASE_CONFIG_NAME", "WEIGHTS_NAME", "ExitHeadConfig", "ExitSpec",
           "HiSpecAdapter", "HiSpecAdapterConfig", "compute_fingerprint", "fingerprint_id", "fingerprints_match", "vllm_base_config"]
