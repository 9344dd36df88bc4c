"""Training configuration: a recipe (YAML) whose keys the command line can override."""

from __future__ import annotations

import dataclasses
import json
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from hispec_decode.errors import HiSpecError
from hispec_decode.loading import parse_dtype
from hispec_decode.heads import HEAD_TYPES


@dataclass
class TrainConfig:
    # model and heads
    base: str | None = None  # Hub id, local dir, .gguf or PEFT adapter dir; None: embedded SmolLM2
    heads_layers: list[int] = field(default_factory=lambda: [4, 8])  # increasing; first = draft, second = intermediate
    head_type: str = "residual_linear"
    head_options: dict[str, Any] = field(default_factory=dict)
    # data
    dataset: str = "sharegpt"
    max_tokens: int | None = 200_000  # tokens read from the data set (None: all)
    eval_fraction: float = 0.05
    seq_len: int = 256
    # optimisation
    batch_size: int = 4  # sequences per process per micro-step
    grad_accum: int = 1
    lr: float = 1e-3
    weight_decay: float = 0.0
    warmup_steps: int = 20
    max_steps: int = 200
    kd_temperature: float = 1.0
    ce_weight: float = 0.0
    chunk_size: int = 128
    mixed_precision: str = "no"  # accelerate: no, bf16, fp16
    exit_vocab: int = 0  # > 0: early exits predict over the K most frequent training tokens (hispec_train.vocab)
    base_dtype: str = "float32"  # the frozen base's weights (bfloat16 halves their memory; heads stay float32)
    # bookkeeping
    eval_every: int = 50
    eval_batches: int = 8
    save_every: int = 50
    window: int = 4  # N_i, for the expected accepted length in evaluations
    seed: int = 0
    output_dir: str = "runs/hispec-heads"
    resume: bool = False
    report_to: str = "tensorboard"

    def validate(self) -> None:
        if self.head_type not in HEAD_TYPES or self.head_type == "base":
            raise HiSpecError(f"unknown head type {self.head_type!r}; trainable types: "
                              f"{', '.join(t for t in sorted(HEAD_TYPES) if t != 'base')}")
        layers = self.heads_layers
        if not layers or any(b <= a for a, b in zip(layers, layers[1:])) or layers[0] < 1:
            raise HiSpecError(f"heads_layers must be increasing layer indices >= 1; got {layers}")
        for name in ("seq_len", "batch_size", "grad_accum", "max_steps", "eval_every", "save_every", "chunk_size", "window"):
            if getattr(self, name) < 1:
                raise HiSpecError(f"{name} must be >= 1; got {getattr(self, name)}")
        if not 0 < self.eval_fraction < 1:
            raise HiSpecError(f"eval_fraction must be in (0, 1); got {self.eval_fraction}")
        if not self.lr > 0:
            raise HiSpecError(f"lr must be > 0; got {self.lr}")
        if not 0 <= self.ce_weight <= 1:
            raise HiSpecError(f"ce_weight must be in [0, 1]; got {self.ce_weight}")
        parse_dtype(self.base_dtype)
        if self.exit_vocab < 0:
            raise HiSpecError(f"exit_vocab must be >= 0 (0: the full vocabulary); got {self.exit_vocab}")

    def check_layers(self, num_layers: int) -> None:
        bad = [l for l in self.heads_layers if l >= num_layers]
        if bad:
            raise HiSpecError(f"heads_layers {bad} out of range: the base has {num_layers} layers (exits 1..{num_layers - 1})")

    def roles(self) -> list[str]:
        return [("draft", "intermediate")[i] if i < 2 else "extra" for i in range(len(self.heads_layers))]

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _coerce(name: str, tp: Any, value: Any) -> Any:
    """Convert a command-line string (or a YAML value) to the field's type."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if value is None or (isinstance(value, str) and value.lower() in ("none", "null") and type(None) in args):
        return None
    if type(None) in args:  # Optional[X]
        tp = next(a for a in args if a is not type(None))
        origin, args = typing.get_origin(tp), typing.get_args(tp)
    try:
        if origin is list:
            items = value.split(",") if isinstance(value, str) else list(value)
            return [_coerce(name, args[0], v) for v in items]
        if origin is dict:
            return json.loads(value) if isinstance(value, str) else dict(value)
        if tp is bool:
            if isinstance(value, str):
                if value.lower() not in ("1", "0", "true", "false", "yes", "no"):
                    raise ValueError(value)
                return value.lower() in ("1", "true", "yes")
            return bool(value)
        return tp(value)
    except (TypeError, ValueError, json.JSONDecodeError) as exc:
        raise HiSpecError(f"bad value {value!r} for {name}: {exc}") from exc


def load_config(recipe: str | Path | None, overrides: dict[str, Any]) -> TrainConfig:
    """A recipe's keys, then the overrides (command line), into a validated :class:`TrainConfig`."""
    data: dict[str, Any] = {}
    if recipe is not None:
        path = Path(recipe)
        if not path.is_file():
            raise HiSpecError(f"recipe {recipe} not found")
        data = yaml.safe_load(path.read_text()) or {}
        if not isinstance(data, dict):
            raise HiSpecError(f"recipe {recipe} must be a mapping of keys to values")
    data |= overrides
    hints = typing.get_type_hints(TrainConfig)
    unknown = sorted(set(data) - set(hints))
    if unknown:
        raise HiSpecError(f"unknown config keys {unknown}; known keys: {', '.join(sorted(hints))}")
    cfg = TrainConfig(**{k: _coerce(k, hints[k], v) for k, v in data.items()})
    cfg.validate()
    return cfg


def parse_overrides(argv: list[str]) -> dict[str, Any]:
    """``--key value`` / ``--flag`` pairs (dashes become underscores); values stay strings."""
    out: dict[str, Any] = {}
    i = 0
    while i < len(argv):
        arg = argv[i]
        if not arg.startswith("--"):
            raise HiSpecError(f"unexpected argument {arg!r}; overrides look like --key value")
        key = arg[2:].replace("-", "_")
        if "=" in key:
            key, value = key.split("=", 1)
            i += 1
        elif i + 1 < len(argv) and not argv[i + 1].startswith("--"):
            value = argv[i + 1]
            i += 2
        else:
            value = "true"
            i += 1
        out[key] = value
    return out
