"""HiSpec decoding: lossless hierarchical speculative decoding with early exits."""

from .adapter import CONFIG_NAME, WEIGHTS_NAME, ExitHeadConfig, HiSpecAdapter, HiSpecAdapterConfig
from .errors import AdapterError, FingerprintMismatchError, HiSpecError, UnsupportedArchitectureError
from .model import GenerateOutput, HiSpecModel

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
    "UnsupportedArchitectureError",
]
__version__ = "0.1.0"
