"""What an engine is built with: ``SpeculativeConfig`` (the method, its exits and policy) and
``EngineConfig`` (the paged cache and the scheduler). Per-request settings are
:class:`~hispec_decode.sampling_params.SamplingParams`.

vLLM splits settings the same way: a request's ``SamplingParams`` may differ from its neighbours'
in one batch, while the speculative method and the cache are fixed when the engine is built and
validated once there. ``generate(ids, sampling_params, **overrides)`` and ``build_engine(...)``
also take keyword overrides of any field of the three (:func:`split_overrides`). Each field carries
its help text in its metadata; the command-line tools build their options from it
(:mod:`hispec_decode.tools.args`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, TypeVar

from .cache.block_manager import DEFAULT_BLOCK_SIZE
from .knobs import KNOBS, TUNABLE, check_knobs
from .errors import HiSpecError
from .sampling_params import SamplingParams
from .validation import as_int, check_bool, check_int, help_text

METHODS = ("autoregressive", "self_spec", "hispec")
SCHEDULES = ("eager", "gather")
DEFAULT_SCHEDULE = "gather"  # the faster schedule at batch sizes 2 to 16 (docs/batching.md)


class SpeculativeChecks:
    """The checks of a :class:`SpeculativeConfig` (its policy knobs: :mod:`hispec_decode.knobs`)."""

    def __post_init__(self) -> None:
        if not isinstance(self.method, str) or self.method not in METHODS:
            raise HiSpecError(f"unknown method {self.method!r}; choose one of {', '.join(METHODS)}")
        for name, value in check_knobs({k: getattr(self, k) for k in TUNABLE}, optional=True).items():
            object.__setattr__(self, name, value)
        check_bool(self, "batch_aware", "use_exit_vocab", "guard")
        unused = [k.name for k in KNOBS if getattr(self, k.name) is not None and self.method not in k.methods]
        if unused:
            readers = sorted({m for k in KNOBS if k.name in unused for m in k.methods})
            raise HiSpecError(f"{', '.join(f'{k}={getattr(self, k)!r}' for k in unused)} never takes effect with "
                              f"method={self.method!r} (read by {' and '.join(readers)}); leave "
                              f"{'it' if len(unused) == 1 else 'them'} unset")


def for_method(config: SpeculativeConfig, method: str) -> SpeculativeConfig:
    """``config`` with ``method`` and the knobs that method does not read unset (a benchmark runs several
    methods under one set of knobs)."""
    return dataclasses.replace(config, method=method, **{k.name: None for k in KNOBS if method not in k.methods})


# The decoding method and its policy, fixed for every request of an engine: the method, one optional field
# per policy knob (None: "the default": the adapter's tuned policy, else its roles, else the knob's default
# or fractions of the depth; see hispec_decode.decoding.policy), then three switches.
SpeculativeConfig = dataclasses.make_dataclass("SpeculativeConfig", [
    ("method", str, field(default="hispec", metadata=help_text("autoregressive, self_spec or hispec", METHODS))),
    *[(k.name, k.kind | None, field(default=None, metadata=help_text(k.help, k.choices))) for k in KNOBS],
    ("batch_aware", bool, field(default=True, metadata=help_text(
        "raise the thresholds with the batch size by the adapter's measured pass costs (off: the same policy at "
        "any size)"))),
    ("use_exit_vocab", bool, field(default=True, metadata=help_text(
        "early exits predict over the heads' reduced vocabularies, where they have one"))),
    ("guard", bool, field(default=True, metadata=help_text(
        "speculate only where it pays: each sequence chooses every round between plain decoding, the draft exit, "
        "prompt lookup and their union by its own acceptance and this machine's pass costs, alone or in a batch "
        "(off: always as the policy says)"))),
], bases=(SpeculativeChecks,), frozen=True, kw_only=True)
SpeculativeConfig.__module__ = __name__
SpeculativeConfig.__doc__ = ("The decoding method, its policy knobs (None: the default) and three switches, fixed "
                             "for every request of an engine.")


@dataclass(frozen=True, kw_only=True)
class EngineConfig:
    """The paged KV cache and the batch scheduler of an engine (or of one ``generate`` call)."""

    num_blocks: int | None = field(default=None, metadata=help_text(
        "KV cache blocks (default: generate sizes it for its rows, an engine uses 1024)"))
    block_size: int = field(default=DEFAULT_BLOCK_SIZE, metadata=help_text("tokens per KV cache block"))
    schedule: str = field(default=DEFAULT_SCHEDULE, metadata=help_text(
        "when sequences waiting for the full model are verified: gather (wait so one pass verifies many) or eager",
        SCHEDULES))
    max_num_seqs: int | None = field(default=None, metadata=help_text(
        "sequences decoded at once at most; the others wait (default: as many as the cache holds)"))
    prefill_chunk: int | None = field(default=None, metadata=help_text(
        "prompt tokens prefilled per step at most, over all sequences (chunked prefill: a newcomer's prompt is "
        "spread over steps instead of stalling the running batch; default: no limit)"))

    def __post_init__(self) -> None:
        as_int(self, "num_blocks", "block_size", "max_num_seqs", "prefill_chunk")
        check_int("num_blocks", self.num_blocks, 1, optional=True)
        check_int("block_size", self.block_size, 1)
        check_int("max_num_seqs", self.max_num_seqs, 1, optional=True)
        check_int("prefill_chunk", self.prefill_chunk, 1, optional=True)
        if not isinstance(self.schedule, str) or self.schedule not in SCHEDULES:
            raise HiSpecError(f"schedule must be one of {', '.join(SCHEDULES)}; got {self.schedule!r}")


def field_names(cls: type) -> tuple[str, ...]:
    return tuple(f.name for f in dataclasses.fields(cls))


SAMPLING_FIELDS = frozenset(field_names(SamplingParams))
SPECULATIVE_FIELDS = frozenset(field_names(SpeculativeConfig))
ENGINE_FIELDS = frozenset(field_names(EngineConfig))
RENAMED = {"verify": "schedule", "exit_vocab": "use_exit_vocab"}  # keywords of earlier versions

Settings = TypeVar("Settings", SamplingParams, SpeculativeConfig, EngineConfig)


def checked(value: Settings | None, cls: type[Settings], name: str) -> Settings:
    """``value`` if it is a ``cls`` (None: the defaults), else a clear error (e.g. an old positional call)."""
    if value is None:
        return cls()
    if not isinstance(value, cls):
        raise HiSpecError(f"{name} must be a hispec_decode.{cls.__name__} or None; got {type(value).__name__} "
                          f"{value!r:.60} (pass other settings by keyword, e.g. max_new_tokens=64, method='hispec')")
    return value


def unknown_arguments(names: set[str], known: frozenset[str], what: str) -> HiSpecError:
    hints = "".join(f" ({k} is now {RENAMED[k]})" for k in sorted(names) if k in RENAMED)
    return HiSpecError(f"unknown {what} argument(s) {sorted(names)}{hints}; known: {', '.join(sorted(known))}")


def split_overrides(sampling: SamplingParams | None, speculative: SpeculativeConfig | None,
                    engine: EngineConfig | None, overrides: dict[str, Any]
                    ) -> tuple[SamplingParams, SpeculativeConfig, EngineConfig]:
    """Apply keyword overrides to whichever settings own each name (each built and checked once)."""
    unknown = set(overrides) - SAMPLING_FIELDS - SPECULATIVE_FIELDS - ENGINE_FIELDS
    if unknown:
        raise unknown_arguments(unknown, SAMPLING_FIELDS | SPECULATIVE_FIELDS | ENGINE_FIELDS, "generation")
    parts = []
    for value, cls, name, names in ((sampling, SamplingParams, "sampling_params", SAMPLING_FIELDS),
                                    (speculative, SpeculativeConfig, "speculative_config", SPECULATIVE_FIELDS),
                                    (engine, EngineConfig, "engine_config", ENGINE_FIELDS)):
        own = {k: v for k, v in overrides.items() if k in names}
        base = checked(value, cls, name)
        parts.append(dataclasses.replace(base, **own) if own else base)
    return parts[0], parts[1], parts[2]
