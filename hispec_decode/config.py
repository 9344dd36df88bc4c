"""What to generate and how: ``GenerationConfig`` (per call or request) and ``EngineConfig`` (the cache).

Both are dataclasses validated where they are built, so a bad value fails before any work with
a message that names the argument. ``generate(ids, generation_config, **overrides)`` and
``serve(...)`` accept keyword overrides of either config's fields (:func:`split_overrides`).
Each field carries its help text in its metadata; the command-line tools build their options
from it (:mod:`hispec_decode.tools.args`).

A server fixes the fields of :data:`ENGINE_FIELDS` (the method and its policy) for every
request; the others can differ per request.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from dataclasses import dataclass, field
from typing import Any

from .decoding.sampling import SamplingParams
from .engine.block_manager import DEFAULT_BLOCK_SIZE
from .errors import HiSpecError

METHODS = ("autoregressive", "self_spec", "hispec")
SCHEDULES = ("eager", "gather")
DEFAULT_SCHEDULE = "gather"  # measured faster at every batch size from 2 to 16 (docs/batching.md)


def _help(text: str) -> dict[str, str]:
    return {"help": text}


@dataclass(frozen=True)
class GenerationConfig:
    """Everything one ``generate`` call (or one server request) decides; ``None`` means "the default"
    (for layers and windows: the adapter's roles, else fractions of the depth, see
    :mod:`hispec_decode.decoding.policy`)."""

    max_new_tokens: int = field(default=64, metadata=_help("new tokens per prompt at most"))
    method: str = field(default="hispec", metadata=_help("autoregressive, self_spec or hispec"))
    do_sample: bool = field(default=False, metadata=_help("sample instead of greedy decoding"))
    temperature: float = field(default=1.0, metadata=_help("sampling temperature (> 0)"))
    top_k: int = field(default=0, metadata=_help("sample among the k most likely tokens (0: all)"))
    top_p: float = field(default=1.0, metadata=_help("nucleus sampling mass in (0, 1]"))
    seed: int | None = field(default=None, metadata=_help("random seed; row i of a batch uses seed + i"))
    eos_token_id: int | tuple[int, ...] | None = field(
        default=None, metadata=_help("end-of-sequence id(s) (default: the model's generation config)"))
    draft_layer: int | None = field(default=None, metadata=_help("L_d (default: the adapter's draft head, else ~depth/8)"))
    verify_layer: int | None = field(
        default=None, metadata=_help("L_i, the intermediate exit (default: the adapter's intermediate head, else ~depth/4)"))
    window: int | None = field(default=None, metadata=_help("N_i: tentative tokens per full verification at most"))
    num_draft: int | None = field(default=None, metadata=_help("drafts per check at most (k for self_spec, k_d for hispec)"))
    draft_threshold: float | None = field(default=None, metadata=_help(
        "L_d drafts while its top probability is at least this (0: always; default: the adapter's tuned policy)"))
    verify_threshold: float | None = field(default=None, metadata=_help(
        "L_i adds tentative tokens while the product of their probabilities is at least this (0: up to the window)"))
    batch_aware: bool = field(default=True, metadata=_help(
        "raise the thresholds with the batch size by the adapter's measured pass costs (off: the same policy at any size)"))
    use_exit_vocab: bool = field(
        default=True, metadata=_help("early exits predict over the heads' reduced vocabularies, where they have one"))
    drafter_invariant: bool = field(default=False, metadata=_help(
        "sampling: Gumbel-max keyed to (seed, position), so a seeded sample is the same text for every method, "
        "policy and batch (accepts fewer drafts than rejection sampling)"))

    def __post_init__(self) -> None:
        for name in INT_FIELDS:  # numpy integers are integers; booleans are not
            value = getattr(self, name)
            if isinstance(value, numbers.Integral) and not isinstance(value, (bool, int)):
                object.__setattr__(self, name, int(value))
        eos = self.eos_token_id
        if isinstance(eos, (list, tuple)) or (hasattr(eos, "tolist") and not isinstance(eos, numbers.Integral)):
            items = eos.tolist() if hasattr(eos, "tolist") else list(eos)
            object.__setattr__(self, "eos_token_id", tuple(items) if isinstance(items, list) else items)
        elif isinstance(eos, numbers.Integral) and not isinstance(eos, bool):
            object.__setattr__(self, "eos_token_id", int(eos))
        self.validate()

    def validate(self) -> None:
        if not isinstance(self.method, str) or self.method not in METHODS:
            raise HiSpecError(f"unknown method {self.method!r}; choose one of {', '.join(METHODS)}")
        _check_int("max_new_tokens", self.max_new_tokens, 1)
        for name in ("draft_layer", "verify_layer"):
            _check_int(name, getattr(self, name), None, optional=True)
        for name in ("window", "num_draft"):
            _check_int(name, getattr(self, name), 1, optional=True)
        _check_int("seed", self.seed, 0, optional=True)
        if self.seed is not None and self.seed >= 2**63:
            raise HiSpecError(f"seed must be below 2**63; got {self.seed}")
        eos = self.eos_token_id
        ids = eos if isinstance(eos, tuple) else (eos,)
        if eos is not None and not all(_is_int(t) and t >= 0 for t in ids):
            raise HiSpecError(f"eos_token_id must be a token id >= 0 or a list of them; got {eos!r}")
        for name in ("draft_threshold", "verify_threshold"):
            value = getattr(self, name)
            if value is not None and (not _real(value) or not 0 <= value < math.inf):
                raise HiSpecError(f"{name} must be a finite number >= 0 (0: no gate, above 1: never) or None; got {value!r}")
        for name in ("do_sample", "use_exit_vocab", "batch_aware", "drafter_invariant"):
            if not isinstance(getattr(self, name), bool):
                raise HiSpecError(f"{name} must be True or False; got {getattr(self, name)!r}")
        self.sampling_params()  # checks temperature, top_k, top_p

    def sampling_params(self) -> SamplingParams:
        return SamplingParams(self.do_sample, self.temperature, self.top_k, self.top_p, self.drafter_invariant)

    def update(self, **overrides: Any) -> GenerationConfig:
        """A copy with ``overrides`` applied (unknown names fail, naming the known ones)."""
        unknown = sorted(set(overrides) - GENERATION_FIELDS)
        if unknown:
            hints = "".join(f" ({k} is now {RENAMED[k]})" for k in unknown if k in RENAMED)
            raise HiSpecError(f"unknown generation argument(s) {unknown}{hints}; known: "
                              f"{', '.join(sorted(GENERATION_FIELDS))} and the engine's {', '.join(sorted(ENGINE_CONFIG_FIELDS))}")
        return dataclasses.replace(self, **overrides) if overrides else self

    def eos_ids(self, default: frozenset[int]) -> frozenset[int]:
        if self.eos_token_id is None:
            return default
        return frozenset(self.eos_token_id if isinstance(self.eos_token_id, tuple) else (self.eos_token_id,))


@dataclass(frozen=True)
class EngineConfig:
    """The paged KV cache and the batch scheduler of a server (or of one ``generate`` call)."""

    num_blocks: int | None = field(
        default=None, metadata=_help("KV cache blocks (default: generate sizes it for its rows, serve uses 1024)"))
    block_size: int = field(default=DEFAULT_BLOCK_SIZE, metadata=_help("tokens per KV cache block"))
    schedule: str = field(default=DEFAULT_SCHEDULE, metadata=_help(
        "when sequences waiting for the full model are verified: gather (wait so one pass verifies many) or eager"))
    max_num_seqs: int | None = field(
        default=None, metadata=_help("sequences decoded at once at most; the others wait (default: as many as the cache holds)"))
    prefill_chunk: int | None = field(default=None, metadata=_help(
        "prompt tokens prefilled per step at most, over all sequences (chunked prefill: a newcomer's prompt is "
        "spread over steps instead of stalling the running batch; default: no limit)"))

    def __post_init__(self) -> None:
        for name in ("num_blocks", "block_size", "max_num_seqs", "prefill_chunk"):
            value = getattr(self, name)
            if isinstance(value, numbers.Integral) and not isinstance(value, (bool, int)):
                object.__setattr__(self, name, int(value))
        _check_int("num_blocks", self.num_blocks, 1, optional=True)
        _check_int("block_size", self.block_size, 1)
        _check_int("max_num_seqs", self.max_num_seqs, 1, optional=True)
        _check_int("prefill_chunk", self.prefill_chunk, 1, optional=True)
        if not isinstance(self.schedule, str) or self.schedule not in SCHEDULES:
            raise HiSpecError(f"schedule must be one of {', '.join(SCHEDULES)}; got {self.schedule!r}")


INT_FIELDS = ("max_new_tokens", "top_k", "seed", "draft_layer", "verify_layer", "window", "num_draft")
GENERATION_FIELDS = frozenset(f.name for f in dataclasses.fields(GenerationConfig))
ENGINE_CONFIG_FIELDS = frozenset(f.name for f in dataclasses.fields(EngineConfig))
# fixed per server: every request of one server runs the same strategy and exits
ENGINE_FIELDS = frozenset({"method", "draft_layer", "verify_layer", "window", "num_draft", "use_exit_vocab",
                           "draft_threshold", "verify_threshold", "batch_aware"})


RENAMED = {"verify": "schedule", "exit_vocab": "use_exit_vocab"}  # keywords of earlier versions


def checked(value: Any, cls: type, name: str) -> Any:
    """``value`` if it is a ``cls`` (None: the defaults), else a clear error (e.g. an old positional call)."""
    if value is None:
        return cls()
    if not isinstance(value, cls):
        raise HiSpecError(f"{name} must be a hispec_decode.{cls.__name__} or None; got {type(value).__name__} "
                          f"{value!r:.60} (pass other settings by keyword, e.g. max_new_tokens=64, method='hispec')")
    return value


def split_overrides(generation_config: GenerationConfig | None, engine_config: EngineConfig | None,
                    overrides: dict[str, Any]) -> tuple[GenerationConfig, EngineConfig]:
    """Apply keyword overrides to whichever config owns each name."""
    engine_keys = {k: overrides[k] for k in overrides if k in ENGINE_CONFIG_FIELDS}
    generation = checked(generation_config, GenerationConfig, "generation_config").update(
        **{k: v for k, v in overrides.items() if k not in engine_keys})
    engine = checked(engine_config, EngineConfig, "engine_config")
    return generation, dataclasses.replace(engine, **engine_keys) if engine_keys else engine


def _real(value: object) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def _is_int(value: object) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _check_int(name: str, value: object, minimum: int | None, optional: bool = False) -> None:
    if value is None and optional:
        return
    if not _is_int(value) or (minimum is not None and value < minimum):
        allowed = "an integer" + (f" >= {minimum}" if minimum is not None else "") + (" or None" if optional else "")
        raise HiSpecError(f"{name} must be {allowed}; got {value!r}")

