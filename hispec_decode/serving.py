"""Continuous batching: many runs share one engine, one paged cache and one forward per step.

Each request runs its strategy's decode loop (a generator of engine requests). A step serves
the waiting requests of the running sequences in one :meth:`Engine.advance` sweep, so every
sequence drafts, is checked at ``L_i`` and verified at ``L_f`` on its own counts while the
sequences that need the same layers share one batched pass.

Verification policy (``verify``), i.e. when sequences waiting for the full model are served:

* ``"eager"``: every step serves every sequence; a full verification rides in the
  same sweep as the others' drafts and checks (band 0 is run once for all of them).
* ``"gather"`` (default): sequences whose window is full wait until no sequence needs anything but the
  full model (or one of them has waited ``MAX_GATHER_WAIT`` steps), so each full pass verifies
  as many sequences as possible.

Running out of KV blocks never corrupts a sequence: before a step the blocks it needs are
counted; if the pool is short, the most recently admitted sequence is preempted (its blocks
freed, its uncommitted tokens dropped) and re-queued; it later recomputes its cache from its
committed tokens (vLLM's recompute preemption), and its sampler's random state is rewound to
its last commit, so even sampled output is the same as without preemption. New requests wait in
the queue until their prompt fits. A request whose prompt plus token limit cannot fit in the
whole pool is refused by ``add_request`` with :class:`OutOfBlocksError`.
"""

from __future__ import annotations

import itertools
from collections import deque
from dataclasses import dataclass
from typing import Iterator

from .block_manager import OutOfBlocksError
from .engine import Advance, DecodeState, Engine
from .paged_cache import PagedKVCache
from .sampling import TokenSampler
from .strategies import Policy, Run, Steps, Strategy

VERIFY_POLICIES = ("eager", "gather")
DEFAULT_VERIFY = "gather"  # measured faster at every batch size from 2 to 16 (docs/batching.md)
MAX_GATHER_WAIT = 8  # steps a full window may wait under "gather" before everyone is served


@dataclass
class StepOutput:
    """Tokens of one request that the full model committed during a step."""

    request_id: int
    new_tokens: list[int]
    finished: bool


@dataclass
class _Request:
    request_id: int
    run: Run
    steps: Steps | None = None
    waiting: Advance | None = None
    reported: int = 0  # committed tokens already streamed (prompt included)
    preemptions: int = 0
    idle: int = 0  # consecutive steps this request waited without being served


class ServingEngine:
    """``add_request`` / ``step`` / ``stream`` over one strategy, policy and paged cache."""

    def __init__(self, engine: Engine, strategy: Strategy, policy: Policy, cache: PagedKVCache,
                 verify: str = DEFAULT_VERIFY) -> None:
        if verify not in VERIFY_POLICIES:
            raise ValueError(f"verify policy must be one of {VERIFY_POLICIES}; got {verify!r}")
        self.engine, self.strategy, self.policy, self.cache, self.verify = engine, strategy, policy, cache, verify
        self.exits = strategy.exits(policy, engine.base.num_layers)
        self.queue: deque[_Request] = deque()
        self.running: list[_Request] = []
        self.done: dict[int, Run] = {}
        self.preemptions = 0
        self.steps = 0
        self.peak_slots = 0  # most KV slots held by allocated blocks at once
        self.peak_tokens = 0  # most tokens the sequences held at once
        self._ids = itertools.count()

    def add_request(self, prompt: list[int], sampler: TokenSampler, limit: int, eos: frozenset[int]) -> int:
        """Queue a prompt; it joins the running batch at the next step with room for it."""
        manager = self.cache.manager
        if manager.blocks_for(limit) > manager.num_blocks:
            raise OutOfBlocksError(
                f"a request of {len(prompt)} prompt tokens and up to {limit - len(prompt)} new ones cannot fit a KV "
                f"cache of {manager.num_blocks} blocks of {self.cache.block_size} tokens; raise num_blocks"
            )
        rid = next(self._ids)
        state = DecodeState(rid, list(prompt), self.cache, self.exits)  # blocks are taken on admission
        run = Run(self.engine, state, sampler, limit, eos, len(prompt), self.policy)
        self.queue.append(_Request(rid, run, reported=len(prompt)))
        return rid

    def has_unfinished(self) -> bool:
        return bool(self.queue or self.running)

    def step(self) -> list[StepOutput]:
        """Admit what fits, serve one sweep, retire finished sequences; returns committed tokens."""
        self._admit()
        if not self.running:
            return []
        batch = self._make_room()
        logits = self.engine.advance([r.waiting for r in batch])
        usage = self.cache.manager.usage()  # the step's high point: drafts written, nothing truncated yet
        self.peak_slots = max(self.peak_slots, usage["slots_held"])
        self.peak_tokens = max(self.peak_tokens, usage["tokens_needed"])
        for req in self.running:
            req.idle = 0 if req in batch else req.idle + 1
        outputs = []
        for req, lg in zip(batch, logits):
            try:
                req.waiting = req.steps.send(lg)
            except StopIteration:
                req.waiting = None
        for req in batch:
            run = req.run
            if run.committed > req.reported or req.waiting is None:
                outputs.append(StepOutput(req.request_id, run.tokens[req.reported : run.committed], req.waiting is None))
                req.reported = run.committed
            if req.waiting is None:
                self.engine.release(run.state)
                self.running.remove(req)
                self.done[req.request_id] = run
        self.steps += 1
        return outputs

    def stream(self) -> Iterator[StepOutput]:
        """Step until every request is finished, yielding committed tokens as they come."""
        while self.has_unfinished():
            yield from self.step()

    # -- scheduling -------------------------------------------------------------------------
    def _admit(self) -> None:
        manager = self.cache.manager
        while self.queue:
            req = self.queue[0]
            need = manager.blocks_for(len(req.run.tokens) + 1)
            reserved = sum(manager.extra_blocks(r.run.state.seq_id, len(r.run.tokens) + 1) for r in self.running)
            if self.running and need + reserved > manager.num_free:
                return
            self.queue.popleft()
            manager.add(req.request_id, len(self.exits))
            req.steps = self.strategy.decode(req.run)
            req.waiting = next(req.steps)
            self.running.append(req)

    def _select(self) -> list[_Request]:
        if self.verify == "gather":
            last = len(self.exits) - 1
            cheap = [r for r in self.running if r.waiting.top < last]
            starving = any(r.idle >= MAX_GATHER_WAIT for r in self.running)  # e.g. new requests keep arriving
            if cheap and not starving:
                return cheap
        return list(self.running)

    def _make_room(self) -> list[_Request]:
        """The step's batch, after preempting the newest sequences until its writes fit."""
        manager = self.cache.manager
        while True:
            batch = self._select()
            need = sum(manager.extra_blocks(r.run.state.seq_id, len(r.run.tokens)) for r in batch)
            if need <= manager.num_free:
                return batch
            if len(self.running) == 1:
                run = self.running[0].run
                raise OutOfBlocksError(
                    f"one sequence of {len(run.tokens)} tokens needs more than the whole KV cache "
                    f"({manager.num_blocks} blocks of {manager.block_size} tokens); raise num_blocks"
                )
            self._preempt(self.running[-1])

    def _preempt(self, req: _Request) -> None:
        """Free the sequence's blocks, drop its uncommitted tokens, queue it for recomputation."""
        run = req.run
        self.engine.release(run.state)
        del run.tokens[run.committed :]
        run.sampler.generator.set_state(run.rng_state)  # redraw what was dropped: same samples as without preemption
        req.steps, req.waiting = None, None
        req.preemptions += 1
        self.preemptions += 1
        self.running.remove(req)
        self.queue.appendleft(req)
