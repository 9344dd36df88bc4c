"""HiSpec decoding: lossless hierarchical speculative decoding with early exits.

Where to look: ``api.py`` (``HiSpecModel``), ``sampling_params.py`` (``SamplingParams``: per
request), ``config.py`` (``SpeculativeConfig``, ``EngineConfig``: per engine), ``engine/``
(sequences, decode loops, scheduler, model runner), ``cache/`` (block manager, paged K/V),
``decoding/`` (sampling and policy math), ``models/`` (base models and the exit heads on them),
``layers/`` (attention, linears), ``adapter/`` (the heads' on-disk format), ``data/`` (prompt
sets), ``serving/`` (hispec-serve), ``tuning/`` (hispec-tune), ``tools/`` (CLIs). The README's
architecture section says what may import what.
"""

from typing import Any

from .adapter import CONFIG_NAME, WEIGHTS_NAME, ExitHeadConfig, ExitSpec, HiSpecAdapter, HiSpecAdapterConfig
from .api import HiSpecModel
from .config import EngineConfig, SpeculativeConfig
from .decoding.policy import Policy
from .engine.llm_engine import LLMEngine, StepOutput
from .errors import AdapterError, FingerprintMismatchError, HiSpecError, OutOfBlocksError, UnsupportedArchitectureError
from .outputs import GenerateOutput
from .sampling_params import SamplingParams
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
    "HiSpecAdapter",
    "HiSpecAdapterConfig",
    "HiSpecError",
    "HiSpecModel",
    "LLMEngine",
    "OutOfBlocksError",
    "Policy",
    "SamplingParams",
    "SpeculativeConfig",
    "StepOutput",
    "UnsupportedArchitectureError",
    "__version__",
]


def __getattr__(name: str) -> Any:
    if name == "GenerationConfig":  # removed: say where its fields went
        raise AttributeError("hispec_decode.GenerationConfig was split as vLLM splits it: SamplingParams (per request: "
                             "max_new_tokens, sampling, seed, eos_token_id, drafter_invariant) and SpeculativeConfig "
                             "(per engine: method, exits, window, num_draft, thresholds, batch_aware, use_exit_vocab); "
                             "model.generate(ids, **fields) takes the same keywords as before")
    raise AttributeError(f"module 'hispec_decode' has no attribute {name!r}")
