"""HiSpec decoding: lossless hierarchical speculative decoding with early exits."""

from .adapter import CONFIG_NAME, WEIGHTS_NAME, ExitHeadConfig, HiSpecAdapter, HiSpecAdapterConfig
from .block_manager import OutOfBlocksError
from .errors import AdapterError, FingerprintMismatchError, HiSpecError, UnsupportedArchitectureError
from .model import GenerateOutput, HiSpecModel
from .serving import ServingEngine, StepOutput

__all__ = [
    "CONFIG_NAME",
    "WEIGHTS_NAME",
    "AdapterError",
    "ExitHeadConfig",
    "FingerprintMismatchError",
    "GenerateOutput",
    "HiSpecAdapter",
    "HiSpecAdapterConfig",
    "HiSpecError",
    "HiSpecModel",
    "OutOfBlocksError",
    "ServingEngine",
    "StepOutput",
    "UnsupportedArchitectureError",
]
__version__ = "0.1.0"
