"""Continuous batching: many runs share one engine, one paged cache and one forward per step.

Each request runs its strategy's decode loop (a generator of engine requests). A step serves
the waiting requests of the running sequences in one :meth:`Engine.advance` sweep, so every
sequence drafts, is checked at ``L_i`` and verified at ``L_f`` on its own counts while the
sequences that need the same layers share one batched pass.

Verification policy (``verify``), i.e. when sequences waiting for the full model are served:

* ``"eager"`` (default): every step serves every sequence; a full verification rides in the
  same sweep as the others' drafts and checks (band 0 is run once for all of them).
* ``"gather"``: sequences whose window is full wait until no sequence needs anything but the
  full model, so each full pass verifies as many sequences as possible.

Running out of KV blocks never corrupts a sequence: before a step the blocks it needs are
counted; if the pool is short, the most recently admitted sequence is preempted (its blocks
freed, its uncommitted tokens dropped) and re-queued; it later recomputes its cache from its
committed tokens (vLLM's recompute preemption). New requests wait in the queue until their
prompt fits. A single sequence that cannot fit in the whole pool fails with
:class:`OutOfBlocksError`.
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


class ServingEngine:
    """``add_request`` / ``step`` / ``stream`` over one strategy, policy and paged cache."""

    def __init__(self, engine: Engine, strategy: Strategy, policy: Policy, cache: PagedKVCache,
                 verify: str = "eager") -> None:
        if verify not in VERIFY_POLICIES:
            raise ValueError(f"verify policy must be one of {VERIFY_POLICIES}; got {verify!r}")
        self.engine, self.strategy, self.policy, self.cache, self.verify = engine, strategy, policy, cache, verify
        self.exits = strategy.exits(policy, engine.base.num_layers)
        self.queue: deque[_Request] = deque()
        self.running: list[_Request] = []
        self.done: dict[int, Run] = {}
        self.preemptions = 0
        self.steps = 0
        self._ids = itertools.count()

    def add_request(self, prompt: list[int], sampler: TokenSampler, limit: int, eos: frozenset[int]) -> int:
        """Queue a prompt; it joins the running batch at the next step with room for it."""
        rid = next(self._ids)
        if self.cache.manager.blocks_for(len(prompt) + 1) > self.cache.manager.num_blocks:
            raise OutOfBlocksError(
                f"prompt of {len(prompt)} tokens cannot fit a KV cache of {self.cache.manager.num_blocks} blocks of "
                f"{self.cache.block_size} tokens"
            )
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
            if cheap:
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
        req.steps, req.waiting = None, None
        req.preemptions += 1
        self.preemptions += 1
        self.running.remove(req)
        self.queue.appendleft(req)
