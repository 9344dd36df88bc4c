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
import math
from dataclasses import dataclass, field
from typing import Any, TypeVar

from .cache.block_manager import DEFAULT_BLOCK_SIZE
from .errors import HiSpecError
from .sampling_params import SamplingParams
from .validation import as_int, check_bool, check_int, help_text, is_real

METHODS = ("autoregressive", "self_spec", "hispec")
SCHEDULES = ("eager", "gather")
TREE_KINDS = ("chain", "static", "dynamic")  # what L_d drafts per round (docs/trees.md)
DEFAULT_SCHEDULE = "gather"  # measured faster at every batch size from 2 to 16 (docs/batching.md)


@dataclass(frozen=True, kw_only=True)
class SpeculativeConfig:
    """The decoding method and its policy, fixed for every request of an engine; ``None`` means
    "the default" (for layers and windows: the adapter's tuned policy, else its roles, else
    fractions of the depth, see :mod:`hispec_decode.decoding.policy`)."""

    method: str = field(default="hispec", metadata=help_text("autoregressive, self_spec or hispec"))
    draft_layer: int | None = field(default=None, metadata=help_text(
        "L_d (default: the adapter's draft head, else ~depth/8)"))
    verify_layer: int | None = field(default=None, metadata=help_text(
        "L_i, the intermediate exit (default: the adapter's intermediate head, else ~depth/4)"))
    window: int | None = field(default=None, metadata=help_text("N_i: tentative tokens per full verification at most"))
    num_draft: int | None = field(default=None, metadata=help_text("drafts per check at most (k for self_spec, k_d for hispec)"))
    draft_threshold: float | None = field(default=None, metadata=help_text(
        "L_d drafts while its top probability is at least this (0: always; default: the adapter's tuned policy)"))
    verify_threshold: float | None = field(default=None, metadata=help_text(
        "L_i adds tentative tokens while the product of their probabilities is at least this (0: up to the window)"))
    tree: str | None = field(default=None, metadata=help_text(
        "what L_d drafts per round: chain, static (a fixed tree shape) or dynamic (EAGLE-2's tree); default: tuned, else chain"))
    tree_nodes: int | None = field(default=None, metadata=help_text("draft tree nodes per round at most (trees)"))
    tree_width: int | None = field(default=None, metadata=help_text("draft tree children per node at most (trees)"))
    lookup: int | None = field(default=None, metadata=help_text(
        "tokens per round copied from earlier in the sequence where its last tokens occurred before (prompt "
        "lookup), tried before the draft exit; 0: off (default: this machine's policy, else off)"))
    vocab: int | None = field(default=None, metadata=help_text(
        "the vocabulary level L_v: every layer, then the LM head over the base's this many most frequent tokens, "
        "checking (or, with draft_layer = the number of layers, drafting) below the full LM head; 0: off "
        "(default: this machine's policy, else off)"))
    vocab_window: int | None = field(default=None, metadata=help_text(
        "N_v: tokens the vocabulary level accepts per pass of the full LM head at most"))
    batch_aware: bool = field(default=True, metadata=help_text(
        "raise the thresholds with the batch size by the adapter's measured pass costs (off: the same policy at any size)"))
    use_exit_vocab: bool = field(default=True, metadata=help_text(
        "early exits predict over the heads' reduced vocabularies, where they have one"))
    guard: bool = field(default=True, metadata=help_text(
        "measure speculation against plain decoding on the engine's own steps, per batch size, and decode plainly "
        "where speculation is slower (off: always as the policy says)"))

    def __post_init__(self) -> None:
        as_int(self, "draft_layer", "verify_layer", "window", "num_draft", "tree_nodes", "tree_width", "lookup", "vocab",
               "vocab_window")
        if not isinstance(self.method, str) or self.method not in METHODS:
            raise HiSpecError(f"unknown method {self.method!r}; choose one of {', '.join(METHODS)}")
        for name in ("draft_layer", "verify_layer"):
            check_int(name, getattr(self, name), None, optional=True)
        for name in ("window", "num_draft", "tree_nodes", "tree_width", "vocab_window"):
            check_int(name, getattr(self, name), 1, optional=True)
        check_int("lookup", self.lookup, 0, optional=True)
        check_int("vocab", self.vocab, 0, optional=True)
        if self.tree is not None and (not isinstance(self.tree, str) or self.tree not in TREE_KINDS):
            raise HiSpecError(f"unknown tree {self.tree!r}; choose one of {', '.join(TREE_KINDS)}")
        for name in ("draft_threshold", "verify_threshold"):
            value = getattr(self, name)
            if value is not None and (not is_real(value) or not 0 <= value < math.inf):
                raise HiSpecError(f"{name} must be a finite number >= 0 (0: no gate, above 1: never) or None; got {value!r}")
        check_bool(self, "batch_aware", "use_exit_vocab", "guard")


@dataclass(frozen=True, kw_only=True)
class EngineConfig:
    """The paged KV cache and the batch scheduler of an engine (or of one ``generate`` call)."""

    num_blocks: int | None = field(default=None, metadata=help_text(
        "KV cache blocks (default: generate sizes it for its rows, an engine uses 1024)"))
    block_size: int = field(default=DEFAULT_BLOCK_SIZE, metadata=help_text("tokens per KV cache block"))
    schedule: str = field(default=DEFAULT_SCHEDULE, metadata=help_text(
        "when sequences waiting for the full model are verified: gather (wait so one pass verifies many) or eager"))
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
