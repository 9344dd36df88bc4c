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
from hispec_decode.models import parse_dtype
from hispec_decode.layers.exit_heads import HEAD_TYPES


def _key(default: Any, help: str, factory: Any = None) -> Any:
    """A config key with its help text (shown by ``hispec-train --help``)."""
    if factory is not None:
        return field(default_factory=factory, metadata={"help": help})
    return field(default=default, metadata={"help": help})


@dataclass
class TrainConfig:
    # model and heads
    base: str | None = _key(None, "Hub id, local dir, .gguf or PEFT LoRA dir of the frozen base (none: embedded SmolLM2)")
    heads_layers: list[int] = _key(None, "exit layers, increasing: the first is the draft exit L_d, the second the "
                                         "intermediate exit L_i, any others extra", factory=lambda: [4, 8])
    head_type: str = _key("residual_linear", "norm, residual_linear, low_rank or decoder_block")
    head_options: dict[str, Any] = _key(None, "options of the head type as JSON, e.g. {\"rank\": 32}", factory=dict)
    # data
    dataset: str = _key("sharegpt", "sharegpt, a local .json/.jsonl file or a Hub data set id")
    max_tokens: int | None = _key(200_000, "tokens read from the data set (none: all)")
    eval_fraction: float = _key(0.05, "held-out fraction of the blocks, in (0, 1)")
    seq_len: int = _key(256, "tokens per training block")
    # optimisation
    batch_size: int = _key(4, "sequences per process per micro-step")
    grad_accum: int = _key(1, "micro-steps per optimizer step")
    lr: float = _key(1e-3, "peak learning rate (linear warm-up, cosine decay to 10%)")
    weight_decay: float = _key(0.0, "AdamW weight decay")
    warmup_steps: int = _key(20, "linear warm-up steps")
    max_steps: int = _key(200, "optimizer steps")
    kd_temperature: float = _key(1.0, "distillation temperature")
    ce_weight: float = _key(0.0, "weight in [0, 1] of cross-entropy on the final layer's argmax (rest: KL)")
    chunk_size: int = _key(128, "positions per loss chunk (bounds the [chunk, vocab] logits in memory)")
    mixed_precision: str = _key("no", "accelerate mixed precision: no, bf16 or fp16")
    exit_vocab_size: int = _key(0, "> 0: early exits predict over this many most frequent training tokens (0: all)")
    base_dtype: str = _key("float32", "dtype of the frozen base's weights (bfloat16 halves them; heads stay float32)")
    # bookkeeping
    eval_every: int = _key(50, "steps between held-out evaluations")
    eval_batches: int = _key(8, "held-out batches per evaluation")
    save_every: int = _key(50, "steps between checkpoints")
    window: int = _key(4, "N_i used for the expected accepted length in evaluations")
    seed: int = _key(0, "seed of the data order and the held-out split")
    output_dir: str = _key("runs/hispec-heads", "run directory (checkpoints, eval report, TensorBoard logs)")
    resume: bool = _key(False, "continue from the run directory's checkpoint")
    report_to: str = _key("tensorboard", "tensorboard or none")

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
        if self.exit_vocab_size < 0:
            raise HiSpecError(f"exit_vocab_size must be >= 0 (0: the full vocabulary); got {self.exit_vocab_size}")

    def check_layers(self, num_layers: int) -> None:
        bad = [l for l in self.heads_layers if l >= num_layers]
        if bad:
            raise HiSpecError(f"heads_layers {bad} out of range: the base has {num_layers} layers (exits 1..{num_layers - 1})")

    def roles(self) -> list[str]:
        return [("draft", "intermediate")[i] if i < 2 else "extra" for i in range(len(self.heads_layers))]

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def help(cls) -> str:
        """Every key with its type, default and help text (for ``hispec-train --help``)."""
        hints = typing.get_type_hints(cls)
        lines = []
        for f in dataclasses.fields(cls):
            default = f.default_factory() if f.default is dataclasses.MISSING else f.default
            tp = getattr(hints[f.name], "__name__", None) or str(hints[f.name]).replace("typing.", "")
            lines.append(f"  --{f.name.replace('_', '-'):18} {f.metadata['help']} [{tp}; default: {default}]")
        return "\n".join(lines)


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
