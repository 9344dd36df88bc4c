"""``SamplingParams``: what one request chooses (vLLM's name and role): how many new tokens, greedy
or sampled and how, the seed, the end-of-sequence ids.

Validated where it is built, so a bad value fails before any work with a message naming the
field. Everything an engine is built with (the method, its exits and policy) is a
:class:`~hispec_decode.config.SpeculativeConfig` instead; the cache an
:class:`~hispec_decode.config.EngineConfig`.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

from .errors import HiSpecError
from .validation import as_int, check_bool, check_int, help_text, is_int, is_real


SAMPLING_ONLY = {"temperature": 1.0, "top_k": 0, "top_p": 1.0, "drafter_invariant": False}  # field -> greedy's value


@dataclass(frozen=True, kw_only=True)
class SamplingParams:
    """Per-request settings of ``generate``, ``LLMEngine.add_request`` and every server request."""

    max_new_tokens: int = field(default=64, metadata=help_text("new tokens per prompt at most"))
    do_sample: bool = field(default=False, metadata=help_text("sample instead of greedy decoding"))
    temperature: float = field(default=1.0, metadata=help_text("sampling temperature (> 0)"))
    top_k: int = field(default=0, metadata=help_text("sample among the k most likely tokens (0: all)"))
    top_p: float = field(default=1.0, metadata=help_text("nucleus sampling mass in (0, 1]"))
    seed: int | None = field(default=None, metadata=help_text("random seed; row i of a batch uses seed + i"))
    eos_token_id: int | tuple[int, ...] | None = field(
        default=None, metadata=help_text("end-of-sequence id(s) (default: the model's generation config)"))
    drafter_invariant: bool = field(default=False, metadata=help_text(
        "sampling: Gumbel-max keyed to (seed, position), so a seeded sample is the same text for every method, "
        "policy and batch (accepts fewer drafts than rejection sampling)"))

    def __post_init__(self) -> None:
        as_int(self, "max_new_tokens", "top_k", "seed")
        eos = self.eos_token_id
        if isinstance(eos, (list, tuple)) or (hasattr(eos, "tolist") and not is_int(eos)):
            items = eos.tolist() if hasattr(eos, "tolist") else list(eos)
            object.__setattr__(self, "eos_token_id", tuple(items) if isinstance(items, list) else items)
        elif is_int(eos):
            object.__setattr__(self, "eos_token_id", int(eos))
        check_int("max_new_tokens", self.max_new_tokens, 1)
        check_int("seed", self.seed, 0, optional=True)
        if self.seed is not None and self.seed >= 2**63:
            raise HiSpecError(f"seed must be below 2**63; got {self.seed}")
        eos = self.eos_token_id
        if eos is not None and not all(is_int(t) and t >= 0 for t in (eos if isinstance(eos, tuple) else (eos,))):
            raise HiSpecError(f"eos_token_id must be a token id >= 0 or a list of them; got {eos!r}")
        check_bool(self, "do_sample", "drafter_invariant")
        if not is_real(self.temperature) or not 0 <= self.temperature < math.inf:
            raise HiSpecError(f"temperature must be a finite number >= 0; got {self.temperature!r}")
        if self.do_sample and not self.temperature > 0:
            raise HiSpecError(f"temperature must be > 0 when sampling (got {self.temperature}); use do_sample=False for greedy")
        if not is_int(self.top_k) or self.top_k < 0:
            raise HiSpecError(f"top_k must be an integer >= 0 (0: no limit); got {self.top_k!r}")
        if not is_real(self.top_p) or not 0 < self.top_p <= 1:
            raise HiSpecError(f"top_p must be a number in (0, 1]; got {self.top_p!r}")
        if not self.do_sample:  # greedy decoding reads none of these: a value set would never take effect
            unused = [f"{name}={getattr(self, name)!r}" for name, neutral in SAMPLING_ONLY.items()
                      if getattr(self, name) != neutral]
            if unused:
                raise HiSpecError(f"{', '.join(unused)} takes effect only when sampling: set do_sample=True, or leave "
                                  f"{'it' if len(unused) == 1 else 'them'} at the default for greedy decoding")

    def replace(self, **changes: Any) -> SamplingParams:
        """A checked copy with ``changes`` applied (the same as :func:`dataclasses.replace`)."""
        return dataclasses.replace(self, **changes) if changes else self

    def check_vocab(self, vocab_size: int) -> None:
        """The token ids and ``top_k`` against the model's vocabulary: beyond it they could never take effect."""
        eos = self.eos_token_id
        beyond = [t for t in (eos if isinstance(eos, tuple) else () if eos is None else (eos,)) if t >= vocab_size]
        if beyond:
            raise HiSpecError(f"eos_token_id {beyond[0]} is not a token of this model (its vocabulary has {vocab_size} "
                              f"tokens, ids 0 to {vocab_size - 1}); an empty list means no end-of-sequence token")
        if self.top_k > vocab_size:
            raise HiSpecError(f"top_k={self.top_k} exceeds the vocabulary ({vocab_size} tokens); 0 samples from all")

    def eos_ids(self, default: frozenset[int]) -> frozenset[int]:
        if self.eos_token_id is None:
            return default
        return frozenset(self.eos_token_id if isinstance(self.eos_token_id, tuple) else (self.eos_token_id,))
