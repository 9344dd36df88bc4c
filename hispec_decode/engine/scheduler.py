"""The scheduling policy: who joins the batch, who is served this step, who is preempted.

Admission: a waiting sequence joins the running batch when its next write fits the free blocks
left after every running sequence's next write, and fewer than ``max_num_seqs`` are running.

Which running sequences a step serves (``schedule``):

* ``"eager"``: every one; a full verification rides in the same sweep as the others' drafts
  and checks (band 0 is run once for all of them).
* ``"gather"`` (default): sequences whose window is full (waiting for the full model) wait
  until no sequence needs anything cheaper (or one of them has waited ``MAX_GATHER_WAIT``
  steps), so each full pass verifies as many sequences as possible.

Running out of KV blocks never corrupts a sequence: before a step the blocks it needs are
counted; if the pool is short, the most recently admitted sequence is preempted (its blocks
freed, its uncommitted tokens dropped, its sampler rewound) and queued first; it later
recomputes its cache from its committed tokens (vLLM's recompute preemption), so even sampled
output is the same as without preemption.
"""

from __future__ import annotations

from collections import deque

from ..errors import OutOfBlocksError
from ..cache.block_manager import BlockManager
from .sequence import Sequence, Status

MAX_GATHER_WAIT = 8  # steps a full window may wait under "gather" before everyone is served


class Scheduler:
    def __init__(self, manager: BlockManager, num_bands: int, schedule: str, max_num_seqs: int | None = None) -> None:
        self.manager = manager
        self.max_num_seqs = max_num_seqs
        self.num_bands = num_bands
        self.schedule = schedule
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.preemptions = 0

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def admit(self) -> list[Sequence]:
        """Move waiting sequences into the running batch while their first write fits."""
        admitted = []
        while self.waiting and (self.max_num_seqs is None or len(self.running) < self.max_num_seqs):
            seq = self.waiting[0]
            need = self.manager.blocks_for(len(seq.tokens) + 1)
            reserved = sum(self.manager.extra_blocks(r.seq_id, len(r.tokens) + 1) for r in self.running)
            if self.running and need + reserved > self.manager.num_free:
                break
            self.waiting.popleft()
            seq.allocate()
            seq.status = Status.RUNNING
            self.running.append(seq)
            admitted.append(seq)
        return admitted

    def next_batch(self) -> list[Sequence]:
        """The sequences this step serves, after preempting the newest ones until their writes fit."""
        while True:
            batch = self._select()
            need = sum(self.manager.extra_blocks(s.seq_id, len(s.tokens)) for s in batch)
            if need <= self.manager.num_free:
                served = {s.seq_id for s in batch}
                for seq in self.running:
                    seq.idle = 0 if seq.seq_id in served else seq.idle + 1
                return batch
            if len(self.running) == 1:
                seq = self.running[0]
                raise OutOfBlocksError(
                    f"one sequence of {len(seq.tokens)} tokens needs more than the whole KV cache "
                    f"({self.manager.num_blocks} blocks of {self.manager.block_size} tokens); raise num_blocks"
                )
            self.preempt(self.running[-1])

    def _select(self) -> list[Sequence]:
        if self.schedule == "gather":
            full = self.num_bands - 1
            cheap = [s for s in self.running if s.request.top_band < full]
            starving = any(s.idle >= MAX_GATHER_WAIT for s in self.running)  # e.g. new requests keep arriving
            if cheap and not starving:
                return cheap
        return list(self.running)

    def preempt(self, seq: Sequence) -> None:
        """Free the sequence's blocks, drop its uncommitted tokens, queue it first for recomputation."""
        seq.free_blocks()
        seq.rewind()
        seq.status = Status.WAITING
        seq.preemptions += 1
        self.preemptions += 1
        self.running.remove(seq)
        self.waiting.appendleft(seq)

    def finish(self, seq: Sequence) -> None:
        """The sequence is done (or aborted): free its blocks at once."""
        if seq.status is Status.RUNNING:
            seq.free_blocks()
            self.running.remove(seq)
        elif seq.status is Status.WAITING:
            self.waiting.remove(seq)
        seq.status = Status.FINISHED
