"""``Sequence``: everything the engine knows about one request, in one object.

A sequence owns its tokens (prompt + tentative), its commit point (tokens the full model has
verified), its stopping rule, its sampler and the sampler's state at the last commit, its
counters, and the hidden states waiting at each exit. Its place in the paged KV cache (a block
table and one processed length per *band* of layers) is kept by the block manager under
``seq_id``; :meth:`Sequence.processed` reads it.

Control flow: the strategy's decode loop (:mod:`hispec_decode.decoding.strategies`) is a
generator held in ``steps``; it yields the engine work it needs next, which waits in
``request`` (a :class:`~hispec_decode.engine.model_runner.BandRequest`). The scheduler reads
only these fields (``status``, ``request``, ``committed``, ``tokens``) to decide who runs; the
engine sends each served request's logits back into ``steps``. Preemption drops the generator
and everything uncommitted (:meth:`rewind`); the loop restarts from the committed tokens.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Generator

import torch

from ..decoding.sampling import SamplingParams, TokenSampler, Verdict

if TYPE_CHECKING:
    from ..decoding.policy import Policy
    from .kv_cache import PagedKVCache
    from .model_runner import BandRequest


class Status(enum.Enum):
    WAITING = "waiting"  # queued: no blocks, no decode loop
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class Counters:
    calls_draft: int = 0
    calls_intermediate: int = 0
    calls_full: int = 0
    drafted: int = 0  # proposals checked by the intermediate exit (hispec)
    accepted_intermediate: int = 0
    tentative: int = 0  # proposals checked by the full model
    accepted_final: int = 0

    def add(self, other: Counters) -> None:
        for name in self.__dataclass_fields__:
            setattr(self, name, getattr(self, name) + getattr(other, name))


class Sequence:
    """One prompt being decoded (see the module docstring for who reads and writes what)."""

    def __init__(self, seq_id: int, prompt: list[int], cache: PagedKVCache, exits: tuple[int, ...],
                 sampler: TokenSampler | None = None, limit: int | None = None, eos: frozenset[int] = frozenset(),
                 policy: Policy | None = None) -> None:
        self.seq_id = seq_id
        self.tokens = list(prompt)
        self.prompt_length = len(prompt)
        self.cache = cache
        self.exits = exits  # band tops, increasing; the last one is the number of layers
        # pending[j]: hidden state at exits[j] for positions [processed(j+1), processed(j)), [1, n, hidden]
        self.pending: list[torch.Tensor | None] = [None] * (len(exits) - 1)
        # deep-context heads: normed final states by position (where the full model ran), and each
        # such head's own normed outputs by layer and position (kept from the last commit on)
        self.final_states: dict[int, torch.Tensor] = {}
        self.own_states: dict[int, dict[int, torch.Tensor]] = {}
        self.sampler = sampler or TokenSampler(SamplingParams())
        self.limit = limit if limit is not None else len(prompt) + 1  # total length at most
        self.eos = eos
        self.policy = policy
        self.counters = Counters()
        self.committed = len(prompt)  # tokens[:committed] are final (prompt + verified by the full model)
        self.rng_state = self.sampler.generator.get_state()  # the sampler's state at the last commit
        self.status = Status.WAITING
        self.finish_reason: str | None = None  # once finished: "stop" (EOS), "length", or "abort"
        # the scheduler's view
        self.steps: Generator[BandRequest, torch.Tensor, Any] | None = None  # the strategy's decode loop
        self.request: BandRequest | None = None  # the engine work the loop waits for
        self.reported = len(prompt)  # committed tokens already streamed (prompt included)
        self.preemptions = 0
        self.idle = 0  # consecutive steps this sequence waited without being served
        self.batch_size = 1  # sequences running beside it (incl. itself) when it last received logits

    # -- queries ----------------------------------------------------------------------------
    def processed(self, band: int) -> int:
        """How many leading tokens the layers of ``band`` have seen."""
        return self.cache.manager.lengths(self.seq_id)[band]

    def context_at(self, layer: int, position: int) -> torch.Tensor | None:
        """The deepest known state at ``position`` for the head at ``layer``: the full model's if it
        ran there, else that head's own output, else a deeper head's (when the intermediate exit
        accepted every draft, the draft head never ran at the last one), else any head's, else None."""
        state = self.final_states.get(position)
        if state is None:
            state = self.own_states.get(layer, {}).get(position)
        for other in sorted(self.own_states, key=lambda l: (l < layer, -l)):  # deeper heads first
            if state is None:
                state = self.own_states[other].get(position)
        return state

    def room(self) -> int:
        return self.limit - len(self.tokens)

    @property
    def is_finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def new_tokens(self) -> list[int]:
        return self.tokens[self.prompt_length :]

    # -- blocks -----------------------------------------------------------------------------
    def allocate(self) -> None:
        """Register with the block manager (blocks are taken as the sequence grows)."""
        self.cache.manager.add(self.seq_id, len(self.exits))

    def release(self) -> None:
        """Free the sequence's blocks and waiting hidden states (it finished or was preempted)."""
        self.cache.manager.free(self.seq_id)
        self.pending = [None] * len(self.pending)
        self.final_states, self.own_states = {}, {}

    def truncate(self, length: int) -> None:
        """Forget every token at position >= ``length``, in all bands and pending states."""
        before = [self.processed(b) for b in range(len(self.exits))]
        del self.tokens[length:]
        self.cache.manager.truncate(self.seq_id, length)
        for states in (self.final_states, *self.own_states.values()):
            for p in [p for p in states if p >= length]:
                del states[p]
        for band, pending in enumerate(self.pending):
            if pending is not None:
                keep = max(0, min(before[band], length) - before[band + 1])
                self.pending[band] = pending[:, :keep] if keep else None

    def rewind(self) -> None:
        """Back to the last commit (after :meth:`release`): uncommitted tokens dropped, the sampler
        rewound, so redrawing gives the same samples as without the interruption."""
        del self.tokens[self.committed :]
        self.sampler.generator.set_state(self.rng_state)
        self.steps, self.request = None, None

    # -- what verification decided ----------------------------------------------------------
    def extend(self, start: int, verdict: Verdict) -> bool:
        """Keep ``tokens[:start + accepted]`` and append the verdict's token if there is room."""
        self.truncate(start + verdict.accepted)
        if self.room() > 0:
            self.tokens.append(verdict.token)
            return True
        return False

    def commit(self, start: int, verdict: Verdict) -> None:
        """The full model verified ``tokens[start:]``: keep what it accepted, stop at EOS or limit."""
        self.extend(start, verdict)
        eos_at = next((i for i in range(start, len(self.tokens)) if self.tokens[i] in self.eos), None)
        if eos_at is not None:
            self.truncate(eos_at + 1)
        self.committed = len(self.tokens)
        self.rng_state = self.sampler.generator.get_state()
        self.sampler.forget(self.committed)
        for states in (self.final_states, *self.own_states.values()):
            # the next draft (row committed - 1) reads position committed - 2; nothing before it is read again
            for p in [p for p in states if p < self.committed - 2]:
                del states[p]
        if eos_at is not None:
            self.finish_reason = "stop"
        elif self.room() == 0:
            self.finish_reason = "length"
