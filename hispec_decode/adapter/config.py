"""``hispec_config.json``: what an adapter's heads are, where they exit, and which base they fit.

Written with sorted keys. Reading is strict where it must be: missing keys or a format this
package cannot read fail with :class:`AdapterError`; unknown keys only warn (a newer writer may
add fields). Format 1 (``exit_vocab`` per exit) is read and migrated to format 2
(``exit_vocab_size``; ``hispec_version`` and ``base_revision`` recorded).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import AdapterError, FingerprintMismatchError
from ..files import write_text
from ..version import __version__
from .fingerprint import fingerprint_id, fingerprints_match

logger = logging.getLogger(__name__)

CONFIG_NAME = "hispec_config.json"
WEIGHTS_NAME = "hispec_heads.safetensors"
MODEL_CARD_NAME = "README.md"
CALIBRATION_NAME = "hispec_calibration.safetensors"  # machine-independent agreement traces (tuning.calibration)
VLLM_BASE_CONFIG_NAME = "vllm_base_config.json"  # the base's HF config, for hispec_vllm's drafter (hispec-export)
FORMAT_VERSION = 2
READABLE_FORMATS = (1, 2)
ROLES = ("draft", "intermediate", "extra")


@dataclass
class ExitHeadConfig:
    layer: int  # the head reads the hidden state after layers[0:layer]
    role: str  # "draft", "intermediate" or "extra"
    head_type: str
    norm_keys: list[str]
    shapes: dict[str, list[int]]  # parameter name -> shape, as stored
    options: dict[str, Any] = field(default_factory=dict)
    exit_vocab_size: int = 0  # tokens in the head's reduced vocabulary (ids stored as "<layer>.vocab"); 0: all


@dataclass
class HiSpecAdapterConfig:
    base_model: str
    base_fingerprint: dict[str, Any]
    num_hidden_layers: int
    hidden_size: int
    vocab_size: int
    exits: list[ExitHeadConfig]
    format_version: int = FORMAT_VERSION
    base_revision: str | None = None  # the base's Hub commit (or the package that shipped it), when known
    hispec_version: str | None = __version__  # the HiSpec that wrote this adapter (None: unknown, format 1)
    training: dict[str, Any] = field(default_factory=dict)
    # hispec-tune's choice per dtype and method: {"bfloat16": {"hispec": {"window": 4, ...}, ...}, ...}
    policy: dict[str, Any] = field(default_factory=dict)

    # -- (de)serialisation -----------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> HiSpecAdapterConfig:
        if not isinstance(data, dict):
            raise AdapterError(f"an adapter config is a JSON object; got {type(data).__name__}")
        data = _migrate(dict(data))
        exits = data.pop("exits", None) or _missing("exits")
        if not isinstance(exits, list) or not all(isinstance(e, dict) for e in exits):
            raise AdapterError("adapter config key 'exits' must be a list of objects")
        cfg = _strict(cls, data | {"exits": [_strict(ExitHeadConfig, e, "exits[]") for e in exits]}, "config")
        cfg.validate()
        return cfg

    def save_pretrained(self, directory: str | os.PathLike) -> Path:
        path = Path(directory) / CONFIG_NAME
        self.hispec_version = __version__  # the writer's version, whoever wrote the config first
        write_text(path, json.dumps(self.to_dict(), indent=2, sort_keys=True) + "\n")
        return path

    @classmethod
    def from_pretrained(cls, directory: str | os.PathLike) -> HiSpecAdapterConfig:
        path = Path(directory) / CONFIG_NAME
        if not path.is_file():
            raise AdapterError(f"{path} not found: not a HiSpec adapter directory")
        try:
            data = json.loads(path.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise AdapterError(f"{path} is not valid JSON: {exc}") from exc
        try:
            return cls.from_dict(data)
        except AdapterError as exc:
            raise AdapterError(f"{path}: {exc}") from None

    # -- checks ----------------------------------------------------------------------------
    def validate(self) -> None:
        for key in ("num_hidden_layers", "hidden_size", "vocab_size"):
            if getattr(self, key) < 1:
                raise AdapterError(f"adapter config key {key!r} must be >= 1; got {getattr(self, key)}")
        layers = [e.layer for e in self.exits]
        if len(set(layers)) != len(layers):
            raise AdapterError(f"duplicate exit layers {layers}")
        for e in self.exits:
            if not 1 <= e.layer < self.num_hidden_layers:
                raise AdapterError(f"exit layer {e.layer!r} out of range 1..{self.num_hidden_layers - 1}")
            if e.role not in ROLES:
                raise AdapterError(f"exit at layer {e.layer}: unknown role {e.role!r} (roles: {', '.join(ROLES)})")
            size = e.exit_vocab_size
            if not 0 <= size < self.vocab_size:
                raise AdapterError(f"exit at layer {e.layer}: exit_vocab_size must be an integer in "
                                   f"0..{self.vocab_size - 1} (0: the full vocabulary); got {size!r}")
        for role in ("draft", "intermediate"):
            if sum(e.role == role for e in self.exits) > 1:
                raise AdapterError(f"more than one exit has role {role!r}")
        self._validate_policy()

    def _validate_policy(self) -> None:
        """Each tuned policy checked as an explicit one on a model of this depth: a bad value fails
        here, naming its place; an unknown key warns."""
        from ..config import METHODS, SpeculativeConfig
        from ..decoding.policy import TUNABLE, resolve_policy
        from ..errors import HiSpecError

        if not isinstance(self.policy, dict):
            raise AdapterError(f"key 'policy' must map dtypes to objects of methods; got {self.policy!r:.80}")
        for dtype, methods in self.policy.items():
            if not isinstance(methods, dict):
                raise AdapterError(f"policy.{dtype} must map methods to policies; got {methods!r:.80}")
            for method, tuned in methods.items():
                if method not in METHODS or method == "autoregressive":
                    logger.warning("%s: unknown method policy.%s.%s ignored", CONFIG_NAME, dtype, method)
                    continue
                if not isinstance(tuned, dict):
                    raise AdapterError(f"policy.{dtype}.{method} must be an object; got {tuned!r:.80}")
                for key in sorted(set(tuned) - set(TUNABLE) - {"batch_thresholds"}):
                    logger.warning("%s: unknown key policy.%s.%s.%s ignored", CONFIG_NAME, dtype, method, key)
                roles = {r: self.layer_for(r) for r in ("draft", "intermediate")}
                try:
                    resolve_policy(SpeculativeConfig(method=method), self.num_hidden_layers, roles, tuned)
                except HiSpecError as exc:
                    raise AdapterError(f"policy.{dtype}.{method} is invalid: {exc}") from None

    def check_base(self, fingerprint: dict[str, Any], base_name: str) -> None:
        """Refuse a base these heads were not trained for."""
        if not fingerprints_match(self.base_fingerprint, fingerprint):
            raise FingerprintMismatchError(
                f"these heads were trained for base {self.base_model!r} (fingerprint "
                f"{fingerprint_id(self.base_fingerprint)}), but the loaded base is {base_name!r} "
                f"(fingerprint {fingerprint_id(fingerprint)})"
            )

    def layer_for(self, role: str) -> int | None:
        return next((e.layer for e in self.exits if e.role == role), None)

    def tuned_policy(self, method: str, dtype: Any) -> dict[str, Any] | None:
        """The policy ``hispec-tune`` chose for ``method`` in ``dtype`` (a torch dtype or its name)."""
        name = str(dtype).removeprefix("torch.")
        per_dtype = self.policy.get(name)
        chosen = per_dtype.get(method) if isinstance(per_dtype, dict) else None
        if per_dtype is not None and not isinstance(per_dtype, dict) or chosen is not None and not isinstance(chosen, dict):
            raise AdapterError(f"adapter config key 'policy' must map dtypes to objects of methods; got {self.policy!r:.80}")
        return chosen


def vllm_base_config(base_config: dict[str, Any]) -> dict[str, Any]:
    """What ``hispec-export`` writes as :data:`VLLM_BASE_CONFIG_NAME`: the base's HF config dict, JSON-clean."""
    keep = {k: v for k, v in base_config.items() if not k.startswith("_")}
    return json.loads(json.dumps(keep, default=str))


def _migrate(data: dict[str, Any]) -> dict[str, Any]:
    """Bring an older format's keys up to :data:`FORMAT_VERSION`."""
    version = data.get("format_version", FORMAT_VERSION)
    if isinstance(version, bool) or version not in READABLE_FORMATS:
        raise AdapterError(f"adapter format version (format_version) {version!r} is not supported (this HiSpec "
                           f"reads {', '.join(map(str, READABLE_FORMATS))})")
    if version == 1:
        exits = data.get("exits")
        if isinstance(exits, list):
            data["exits"] = [({k: v for k, v in e.items() if k != "exit_vocab"} | {"exit_vocab_size": e["exit_vocab"]})
                             if isinstance(e, dict) and "exit_vocab" in e else e for e in exits]
        data.setdefault("hispec_version", None)  # unknown: written before versions were recorded
        training = data.get("training")
        if isinstance(training, dict) and "exit_vocab" in training:
            data["training"] = {k: v for k, v in training.items() if k != "exit_vocab"} | {
                "exit_vocab_size": training["exit_vocab"]}
    data["format_version"] = FORMAT_VERSION
    return data


def _missing(key: str) -> Any:
    raise AdapterError(f"adapter config is missing required key {key!r}")


def _strict(cls: type, data: dict[str, Any], where: str) -> Any:
    """Build a dataclass: unknown keys warn, missing required keys and values of the wrong type fail."""
    fields = {f.name: f for f in dataclasses.fields(cls)}
    for key in sorted(set(data) - set(fields)):
        logger.warning("ignoring unknown key %r in adapter %s", key, where)
    required = [n for n, f in fields.items() if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]
    for key in required:
        if key not in data:
            raise AdapterError(f"adapter {where} is missing required key {key!r}")
    hints = typing.get_type_hints(cls)
    for key, value in data.items():
        if key in fields and key != "exits" and not _is_a(value, hints[key]):
            raise AdapterError(f"adapter {where} key {key!r} must be {_describe(hints[key])}; got {value!r:.80}")
    return cls(**{k: v for k, v in data.items() if k in fields})


def _is_a(value: Any, tp: Any) -> bool:
    """Whether a JSON value fits a type hint (str, int, lists, dicts, optionals, Any)."""
    if tp is Any:
        return True
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        return any(_is_a(value, a) for a in args)
    if tp is type(None):
        return value is None
    if tp is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if origin is list:
        return isinstance(value, list) and all(_is_a(v, args[0]) for v in value)
    if origin is dict:
        return isinstance(value, dict) and all(_is_a(k, args[0]) and _is_a(v, args[1]) for k, v in value.items())
    return isinstance(value, tp)


def _describe(tp: Any) -> str:
    return str(tp).replace("typing.", "") if typing.get_origin(tp) else getattr(tp, "__name__", str(tp))
