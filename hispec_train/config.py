"""Training configuration: a recipe (YAML) whose keys the command line can override."""

from __future__ import annotations

import dataclasses
import inspect
import json
import logging
import math
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from hispec_decode.errors import HiSpecError
from hispec_decode.models import parse_dtype
from hispec_decode.models.head_types import HEAD_TYPES, build_head

logger = logging.getLogger(__name__)


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
    head_roles: list[str] | None = _key(None, "each head's role, in the order of heads_layers: draft, intermediate "
                                              "or extra (none: draft, intermediate, then extra), e.g. intermediate for "
                                              "a run that trains only an L_i head")
    head_type: str = _key("residual_linear", "norm, residual_linear, low_rank, deep_context, decoder_block or "
                                             "feature_attention")
    head_options: dict[str, Any] = _key(None, "options of the head type as JSON, e.g. {\"rank\": 32} (low_rank) or "
                                              "{\"attention_only\": true} (decoder_block: Kangaroo's adapter)", factory=dict)
    # data
    dataset: str = _key("sharegpt", "sharegpt, a hispec-selfdistill directory, a local .json/.jsonl file or a Hub data set id")
    features: str | None = _key(None, "a feature store (hispec-store): heads train from its stored states without "
                                      "running the base (dataset, max_tokens and eval_fraction are then unused)")
    max_tokens: int | None = _key(200_000, "tokens read from the data set (none: all)")
    eval_fraction: float = _key(0.05, "held-out fraction of the blocks, in (0, 1)")
    seq_len: int = _key(256, "tokens per training block")
    windows: str = _key("random", "feature-store windows: random (anywhere in a sequence) or start (each sequence's "
                                  "first seq_len tokens: heads with attention see everything before every position)")
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
    loss_vocab: str = _key("full", "full: heads learn the teacher's whole distribution; exit: only over their exit "
                                   "vocabulary (|V|/exit_vocab_size times cheaper logits)")
    base_dtype: str = _key("float32", "dtype of the frozen base's weights (bfloat16 halves them; heads stay float32)")
    # bookkeeping
    eval_every: int = _key(50, "steps between held-out evaluations")
    eval_batches: int = _key(8, "held-out batches per evaluation")
    save_every: int = _key(50, "steps between checkpoints")
    window: int = _key(4, "N_i used for the expected accepted length in evaluations")
    seed: int = _key(0, "seed of the data order and the held-out split")
    output_dir: str = _key("runs/hispec-heads", "run directory (checkpoints, eval report, TensorBoard logs)")
    init_heads: str | None = _key(None, "an adapter (exported directory or a run directory) whose trained heads start "
                                        "this run, to train them on more data; its base, exits, head type and exit "
                                        "vocabulary must match (none: heads start as the base's own exits)")
    resume: bool = _key(False, "continue from the run directory's checkpoint")
    overwrite: bool = _key(False, "start again from step 0 in a run directory that holds a checkpoint")
    report_to: str = _key("tensorboard", "tensorboard or none")

    def validate(self) -> None:
        if self.head_type not in HEAD_TYPES or self.head_type == "base":
            raise HiSpecError(f"unknown head type {self.head_type!r}; trainable types: "
                              f"{', '.join(t for t in sorted(HEAD_TYPES) if t != 'base')}")
        layers = self.heads_layers
        if not layers or any(b <= a for a, b in zip(layers, layers[1:])) or layers[0] < 1:
            raise HiSpecError(f"heads_layers must be increasing layer indices >= 1; got {layers}")
        roles = self.roles()
        if len(roles) != len(layers) or any(r not in ("draft", "intermediate", "extra") for r in roles) or any(
                roles.count(r) > 1 for r in ("draft", "intermediate")):
            raise HiSpecError(f"head_roles must give each of heads_layers {layers} a role (draft, intermediate or "
                              f"extra; at most one draft and one intermediate); got {self.head_roles}")
        for name in ("seq_len", "batch_size", "grad_accum", "max_steps", "eval_every", "eval_batches", "save_every",
                     "chunk_size", "window"):
            if getattr(self, name) < 1:
                raise HiSpecError(f"{name} must be >= 1; got {getattr(self, name)}")
        for name in ("warmup_steps", "exit_vocab_size", "seed"):
            if getattr(self, name) < 0:
                raise HiSpecError(f"{name} must be >= 0; got {getattr(self, name)}")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise HiSpecError(f"max_tokens must be >= 1 or none (all); got {self.max_tokens}")
        if not 0 < self.eval_fraction < 1:
            raise HiSpecError(f"eval_fraction must be in (0, 1); got {self.eval_fraction}")
        if not 0 < self.lr < math.inf:
            raise HiSpecError(f"lr must be a finite number > 0; got {self.lr}")
        if not 0 < self.kd_temperature < math.inf:
            raise HiSpecError(f"kd_temperature must be a finite number > 0; got {self.kd_temperature}")
        if not 0 <= self.weight_decay < math.inf:
            raise HiSpecError(f"weight_decay must be a finite number >= 0; got {self.weight_decay}")
        if not 0 <= self.ce_weight <= 1:
            raise HiSpecError(f"ce_weight must be in [0, 1]; got {self.ce_weight}")
        if self.loss_vocab not in ("full", "exit") or (self.loss_vocab == "exit" and not self.exit_vocab_size):
            raise HiSpecError(f"loss_vocab must be full, or exit together with exit_vocab_size > 0; got {self.loss_vocab!r}")
        if self.windows not in ("random", "start") or (self.windows == "start" and not self.features):
            raise HiSpecError(f"windows must be random, or start together with features (a store); got {self.windows!r}")
        if self.mixed_precision not in MIXED_PRECISION:
            raise HiSpecError(f"mixed_precision must be one of {', '.join(MIXED_PRECISION)}; got {self.mixed_precision!r}")
        if not self.report_to:
            raise HiSpecError("report_to must name a tracker accelerate knows (tensorboard, wandb, ...) or be none")
        if not self.dataset or not self.output_dir or self.features == "":
            raise HiSpecError("dataset and output_dir must not be empty")
        if self.init_heads == "":
            raise HiSpecError("init_heads must name an adapter directory or a run directory, or be none")
        if self.resume and self.overwrite:
            raise HiSpecError("resume and overwrite exclude each other: continue a run, or start it again")
        try:
            parse_dtype(self.base_dtype)
        except HiSpecError as exc:
            raise HiSpecError(f"base_dtype: {exc}") from None
        if self.seed >= 2**32:
            raise HiSpecError(f"seed must be below 2**32; got {self.seed}")
        self._check_head_options()

    def _check_head_options(self) -> None:
        """The options must be ones the head type takes, with values it accepts (checked on a tiny head)."""
        cls = HEAD_TYPES[self.head_type]
        known = set(inspect.signature(cls.__init__).parameters) - {"self", "hidden_size", "norm_keys", "decoder"}
        unknown = sorted(set(self.head_options) - known)
        if unknown:
            raise HiSpecError(f"head_options {unknown} are not options of head type {self.head_type!r} "
                              f"(it takes: {', '.join(sorted(known)) or 'none'})")
        if not cls.has_cache:
            try:
                build_head(self.head_type, 4, ["weight"], self.head_options)
            except HiSpecError as exc:
                raise HiSpecError(f"head_options: {exc}") from None

    def check_layers(self, num_layers: int) -> None:
        bad = [l for l in self.heads_layers if l >= num_layers]
        if bad:
            raise HiSpecError(f"heads_layers {bad} out of range: the base has {num_layers} layers (exits 1..{num_layers - 1})")

    def roles(self) -> list[str]:
        if self.head_roles is not None:
            return list(self.head_roles)
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
    """A command-line string or a YAML value as the key's type; anything else fails naming the key."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if type(None) in args:  # Optional[X]
        if value is None or (isinstance(value, str) and value.lower() in ("none", "null")):
            return None
        tp = next(a for a in args if a is not type(None))
        origin, args = typing.get_origin(tp), typing.get_args(tp)
    try:
        if origin is list:
            if not isinstance(value, (str, list)):
                raise TypeError("expected a list or comma-separated values")
            items = value.split(",") if isinstance(value, str) else value
            return [_coerce(name, args[0], v) for v in items]
        if origin is dict:
            value = json.loads(value) if isinstance(value, str) else value
            if not isinstance(value, dict):
                raise TypeError("expected a mapping (JSON object)")
            return dict(value)
        if tp is bool:
            if isinstance(value, bool):
                return value
            if isinstance(value, str) and value.lower() in BOOLEAN_WORDS:
                return BOOLEAN_WORDS[value.lower()]
            raise TypeError("expected true or false")
        if isinstance(value, bool) or not isinstance(value, (str, int, float)):
            raise TypeError(f"expected {tp.__name__}")
        if tp is int and isinstance(value, float):
            raise TypeError("expected an integer")
        if tp is str and not isinstance(value, str):
            raise TypeError("expected a string")
        return tp(value)
    except (TypeError, ValueError, OverflowError) as exc:
        raise HiSpecError(f"bad value {value!r} for {name}: {exc}") from exc


MIXED_PRECISION = ("no", "fp16", "bf16", "fp8")  # accelerate's choices
OLD_KEYS = {"exit_vocab": "exit_vocab_size"}  # recipe keys of earlier versions, still read
BOOLEAN_WORDS = {"1": True, "true": True, "yes": True, "0": False, "false": False, "no": False}


def load_config(recipe: str | Path | None, overrides: dict[str, Any]) -> TrainConfig:
    """A recipe's keys, then the overrides (command line), into a validated :class:`TrainConfig`."""
    data: dict[str, Any] = {}
    if recipe is not None:
        path = Path(recipe)
        if not path.is_file():
            raise HiSpecError(f"recipe {recipe} not found")
        try:
            data = yaml.safe_load(path.read_text()) or {}
        except (yaml.YAMLError, UnicodeDecodeError) as exc:
            mark = getattr(exc, "problem_mark", None)
            where = f" (line {mark.line + 1}, column {mark.column + 1})" if mark is not None else ""
            raise HiSpecError(f"recipe {recipe} is not valid YAML{where}: {getattr(exc, 'problem', None) or exc}") from exc
        if not isinstance(data, dict):
            raise HiSpecError(f"recipe {recipe} must be a mapping of keys to values")
    if "dataset" in overrides and data.get("features") is not None:  # the command line's data source wins
        if "features" not in overrides:
            logger.info("--dataset %s replaces the recipe's features: %s", overrides["dataset"], data["features"])
            data["features"] = None
    data |= overrides
    for old, new in OLD_KEYS.items():
        if old in data:
            logger.warning("config key %r is now %r", old, new)
            data.setdefault(new, data.pop(old))
    hints = typing.get_type_hints(TrainConfig)
    unknown = sorted(set(data) - set(hints))
    if unknown:
        raise HiSpecError(f"unknown config keys {unknown}; known keys: {', '.join(sorted(hints))}")
    cfg = TrainConfig(**{k: _coerce(k, hints[k], v) for k, v in data.items()})
    cfg.validate()
    return cfg


def parse_overrides(argv: list[str]) -> dict[str, Any]:
    """``--key value``, ``--key=value`` and ``--flag`` (dashes in keys become underscores); values stay strings."""
    out: dict[str, Any] = {}
    i = 0
    while i < len(argv):
        arg = argv[i]
        if not arg.startswith("--"):
            raise HiSpecError(f"unexpected argument {arg!r}; overrides look like --key value")
        key, eq, value = arg[2:].partition("=")
        key = key.replace("-", "_")  # in the key only: values (paths, numbers) stay as given
        if eq:
            i += 1
        elif i + 1 < len(argv) and not argv[i + 1].startswith("--"):
            value = argv[i + 1]
            i += 2
        else:
            value = "true"
            i += 1
        out[key] = value
    return out
