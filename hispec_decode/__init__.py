"""HiSpec decoding: lossless hierarchical speculative decoding with early exits.

Where to look: ``api.py`` (``HiSpecModel``), ``config.py`` (``GenerationConfig``, ``EngineConfig``),
``engine/`` (sequences, scheduler, paged cache, model runner), ``decoding/`` (strategies, policy,
sampling), ``models/`` (loading and running base models), ``layers/`` (attention, linears, exit
heads), ``adapter/`` (the heads' on-disk format), ``data/`` (prompt sets), ``tools/`` (CLIs).
"""

from .adapter import CONFIG_NAME, WEIGHTS_NAME, ExitHeadConfig, ExitSpec, HiSpecAdapter, HiSpecAdapterConfig
from .api import HiSpecModel
from .config import EngineConfig, GenerationConfig
from .decoding.policy import Policy
from .decoding.sampling import SamplingParams
from .engine.llm_engine import LLMEngine, StepOutput
from .errors import AdapterError, FingerprintMismatchError, HiSpecError, OutOfBlocksError, UnsupportedArchitectureError
from .outputs import GenerateOutput
from .version import __version__

__all__ = [
    "CONFIG_NAME",
    "WEIGHTS_NAME",
    "AdapterError",
    "EngineConfig",
    "ExitHeadConfig",
    "ExitSpec",
    "FingerprintMismatchError",
    "GenerateOutput",
    "GenerationConfig",
    "HiSpecAdapter",
    "HiSpecAdapterConfig",
    "HiSpecError",
    "HiSpecModel",
    "LLMEngine",
    "OutOfBlocksError",
    "Policy",
    "SamplingParams",
    "StepOutput",
    "UnsupportedArchitectureError",
    "__version__",
]
