"""``Sequence``: everything the engine knows about one request, in one object.

A sequence owns its tokens (prompt + tentative), its commit point (tokens the full model has
verified), its stopping rule, its sampler and the sampler's state at the last commit, its
counters, and the hidden states waiting at each exit. Its place in the paged KV cache (a block
table and one processed length per *band* of layers) is kept by the block manager under
``seq_id``; :meth:`Sequence.processed` reads it.

Control flow: the strategy's decode loop (:mod:`hispec_decode.engine.strategies`) is a
generator held in ``decode_loop``; it yields the engine work it needs next, which waits in
``request`` (a :class:`BandRequest`). The scheduler reads only these fields (``status``,
``request``, ``committed``, ``tokens``) to decide who runs; the engine sends each served
request's logits back into ``decode_loop``. Preemption drops the generator and everything
uncommitted (:meth:`rewind`); the loop restarts from the committed tokens.

While a draft tree is out (``tree``), ``tokens[tree.base:]`` are its nodes in slot order and each
band's length counts the nodes it has run; :meth:`accept_path` turns the tree back into a chain (the
accepted path, moved to consecutive slots in the cache, its hidden states and contexts with it).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any, Generator

import torch

from ..cache.block_manager import BlockManager
from ..cache.kv_cache import PagedKVCache
from ..decoding.policy import Policy
from ..decoding.level import levels_of
from ..decoding.sampling import TokenSampler, Verdict
from ..decoding.tree import DraftTree
from ..sampling_params import SamplingParams
from .context_states import ContextStates
from .own_tokens import OwnTokens


class Status(enum.Enum):
    WAITING = "waiting"  # queued: no blocks, no decode loop
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class Counters:
    """What a sequence's decoding did, per level (a level is an index into ``exits``; the top one is the
    full model ``L_f``): passes that checked there (``calls``), proposals checked there (``checked``) and
    how many of them it accepted (``accepted``). Plain steps count as passes at the top."""

    top: int = 0  # the full model's level
    calls_draft: int = 0  # passes that drafted (the drafter's; one row each)
    copied: int = 0  # drafts that prompt lookup copied from earlier in the sequence
    calls: dict[int, int] = field(default_factory=dict)
    checked: dict[int, int] = field(default_factory=dict)
    accepted: dict[int, int] = field(default_factory=dict)

    def count(self, level: int, checked: int, accepted: int) -> None:
        """One pass checked ``checked`` proposals at ``level`` and accepted ``accepted`` of them."""
        self.calls[level] = self.calls.get(level, 0) + 1
        self.checked[level] = self.checked.get(level, 0) + checked
        self.accepted[level] = self.accepted.get(level, 0) + accepted

    def add(self, other: Counters) -> None:
        self.top = max(self.top, other.top)
        self.calls_draft += other.calls_draft
        self.copied += other.copied
        for mine, theirs in ((self.calls, other.calls), (self.checked, other.checked), (self.accepted, other.accepted)):
            for level, n in theirs.items():
                mine[level] = mine.get(level, 0) + n

    # the three-level names (L_d, L_i, L_f): the first intermediate level, and the top
    @property
    def calls_full(self) -> int:
        return self.calls.get(self.top, 0)

    @property
    def tentative(self) -> int:
        """Proposals verified by the full model."""
        return self.checked.get(self.top, 0)

    @property
    def accepted_final(self) -> int:
        return self.accepted.get(self.top, 0)

    @property
    def calls_intermediate(self) -> int:
        return sum(self.calls.get(level, 0) for level in range(1, self.top))

    @property
    def drafted(self) -> int:
        """Proposals checked by the first intermediate level."""
        return self.checked.get(1, 0) if self.top > 1 else 0

    @property
    def accepted_intermediate(self) -> int:
        return self.accepted.get(1, 0) if self.top > 1 else 0


@dataclass(frozen=True)
class BandRequest:
    """Bring ``seq`` through bands ``0..top_band``; return the logits of its ``num_logits`` newest
    positions at the exit on top of that band. ``upto`` (a chunk of a prefill) brings only
    ``tokens[:upto]`` through, and asks for no logits."""

    seq: Sequence
    top_band: int
    num_logits: int
    upto: int | None = None

    @property
    def end(self) -> int:
        """Tokens the bands of this request have seen once it is served."""
        return len(self.seq.tokens) if self.upto is None else self.upto

    def band_rows(self) -> list[int]:
        """The rows each band up to the top runs for this request (those it has not run yet)."""
        return [max(0, self.end - self.seq.processed(b)) for b in range(self.top_band + 1)]


class Sequence:
    """One prompt being decoded (see the module docstring for who reads and writes what)."""

    def __init__(self, seq_id: int, prompt: list[int], blocks: BlockManager, exits: tuple[int, ...],
                 sampler: TokenSampler | None = None, limit: int | None = None, eos: frozenset[int] = frozenset(),
                 policy: Policy | None = None, kv: PagedKVCache | None = None) -> None:
        self.seq_id = seq_id
        self.tokens = list(prompt)
        self.prompt_length = len(prompt)
        self.blocks = blocks  # keeps this sequence's block table and band lengths under seq_id
        self.kv = kv  # the K/V pools behind ``blocks`` (None: a stand-in that stores no K/V, e.g. tuning replays)
        self.tree: DraftTree | None = None  # a draft tree being drafted or checked (tokens[tree.base:])
        self.exits = exits  # band tops, increasing; the last one is the number of layers
        self.levels = levels_of(exits, exits[-1], policy.vocab if policy is not None else 0)  # what judges at each
        # pending[j]: hidden state at exits[j] for positions [processed(j+1), processed(j)), [1, n, hidden]
        self.pending: list[torch.Tensor | None] = [None] * (len(exits) - 1)
        self.context = ContextStates()  # what deep-context heads read (kept from the last commit on)
        self.sampler = sampler or TokenSampler(SamplingParams())
        self.limit = limit if limit is not None else len(prompt) + 1  # total length at most
        self.eos = eos
        self.policy = policy
        self.counters = Counters(top=len(exits) - 1)
        self.committed = len(prompt)  # tokens[:committed] are final (prompt + verified by the full model)
        self.rng_state = self.sampler.generator.get_state()  # the sampler's state at the last commit
        self.status = Status.WAITING
        self.finish_reason: str | None = None  # once finished: "stop" (EOS), "length", or "abort"
        # the scheduler's view
        self.decode_loop: Generator[BandRequest, torch.Tensor, Any] | None = None  # the strategy's generator
        self.request: BandRequest | None = None  # the engine work the loop waits for
        self.reported = len(prompt)  # committed tokens already streamed (prompt included)
        self.preemptions = 0
        self.idle = 0  # consecutive steps this sequence waited without being served
        self.batch_size = 1  # sequences running beside it (incl. itself) when it last received logits
        self.chooser: Any = None  # its RoundChooser (engine/chooser.py): each round's arm
        self.drafter_state: dict[str, Any] = {}  # each drafter's own state for this sequence (Drafter.state)
        self.own_tokens: OwnTokens | None = None  # L_v's rows for its committed tokens outside it (own_tokens.py)

    # -- queries ----------------------------------------------------------------------------
    def processed(self, band: int) -> int:
        """How many leading tokens the layers of ``band`` have seen."""
        return self.blocks.lengths(self.seq_id)[band]

    def previous(self, slot: int) -> int:
        """The slot of the token before the one at ``slot`` (a tree node's parent)."""
        tree = self.tree
        if tree is None or slot < tree.base:
            return slot - 1
        return tree.slot_of(tree.parents[slot - tree.base])

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
        self.blocks.add(self.seq_id, len(self.exits))

    def free_blocks(self) -> None:
        """Free the sequence's blocks and waiting hidden states (it finished or was preempted)."""
        self.blocks.free(self.seq_id)
        self.pending = [None] * len(self.pending)
        self.context.clear()
        self.tree = None

    def truncate(self, length: int) -> None:
        """Forget every token at position >= ``length``, in all bands and pending states."""
        if self.tree is not None:
            raise RuntimeError("truncating a sequence with a draft tree out: accept a path first")
        before = [self.processed(b) for b in range(len(self.exits))]
        del self.tokens[length:]
        self.blocks.truncate(self.seq_id, length)
        self.context.truncate(length)
        for band, pending in enumerate(self.pending):
            if pending is not None:
                keep = max(0, min(before[band], length) - before[band + 1])
                self.pending[band] = pending[:, :keep] if keep else None

    def rewind(self) -> None:
        """Back to the last commit (after :meth:`free_blocks`): uncommitted tokens dropped, the sampler
        rewound, so redrawing gives the same samples as without the interruption."""
        del self.tokens[self.committed :]
        self.tree = None
        self.sampler.generator.set_state(self.rng_state)
        self.decode_loop, self.request = None, None

    # -- what verification decided ----------------------------------------------------------
    def accept_path(self, path: list[int]) -> None:
        """Keep the draft tree's nodes ``path`` (a root-to-node path, in depth order) as the tokens
        after ``tree.base`` and forget the rest of the tree: the path's K/V entries move to consecutive
        slots in every layer (vLLM-style copies of the few moved entries), each band keeps the path
        nodes it ran, waiting hidden states and deep-context states follow, and blocks no band needs
        any more are freed. Nothing of a rejected branch is ever read again."""
        tree, self.tree = self.tree, None
        if tree is None:
            raise RuntimeError("no draft tree to accept a path of")
        base = tree.base
        slots = [tree.slot_of(i) for i in path]
        if self.kv is not None:
            self.kv.move(self.seq_id, [(s, base + d) for d, s in enumerate(slots) if s != base + d])
        before = [self.processed(b) for b in range(len(self.exits))]
        after = [min(n, base) + sum(s < n for s in slots) for n in before]
        kept = set(slots)
        for band, pending in enumerate(self.pending):
            if pending is not None:
                rows = [r for r, s in enumerate(range(before[band + 1], before[band])) if s < base or s in kept]
                self.pending[band] = pending[:, rows] if rows else None
        self.tokens[base:] = [tree.tokens[i] for i in path]
        self.context.move(base, slots)
        for band, n in enumerate(after):
            self.blocks.set_length(self.seq_id, band, n)
        self.blocks.truncate(self.seq_id, len(self.tokens))

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
        self.context.forget_before(self.committed - 2)  # the next draft (row committed - 1) reads committed - 2
        if eos_at is not None:
            self.finish_reason = "stop"
        elif self.room() == 0:
            self.finish_reason = "length"
