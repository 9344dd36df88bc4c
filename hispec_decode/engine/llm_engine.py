"""``LLMEngine``: continuous batching, i.e. many sequences share one runner, one paged cache and one
forward sweep per step.

``add_request`` queues a prompt; ``step`` admits what fits, serves one sweep of the sequences the
scheduler picks (:mod:`hispec_decode.engine.scheduler`), feeds each its logits, and retires the
finished ones (their blocks are freed at once); ``stream`` steps until every request is done,
yielding the tokens the full model committed. Every sequence drafts, is checked at ``L_i`` and
verified at ``L_f`` on its own counts, while the sequences that need the same layers share one
batched pass. A request whose prompt plus token limit cannot fit in the whole pool is refused by
``add_request`` with :class:`OutOfBlocksError`.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass
from typing import Any, Iterator, Sequence as Seq

from ..config import SAMPLING_FIELDS, SPECULATIVE_FIELDS, EngineConfig, SpeculativeConfig, checked, unknown_arguments
from ..decoding.policy import Policy
from ..decoding.sampling import TokenSampler
from ..errors import HiSpecError, OutOfBlocksError
from ..inputs import prompt_rows
from ..sampling_params import SamplingParams
from ..decoding.cost_model import CostModel
from .chooser import RoundChooser, request_seconds
from .cost_clock import CostClock, StepClass, step_class
from .model_runner import ModelRunner
from .scheduler import Scheduler
from .sequence import BandRequest, Sequence, Status
from .strategies import STRATEGIES

DEFAULT_SERVER_BLOCKS = 1024


@dataclass
class StepOutput:
    """Tokens of one request that the full model committed during a step."""

    request_id: int
    new_tokens: list[int]
    finished: bool


class LLMEngine:
    """``add_request`` / ``step`` / ``stream`` / ``abort`` over one strategy, policy and paged cache.

    ``speculative_config`` (the method; ``policy`` is what it resolved to on this model) and
    ``engine_config`` are fixed for every request; ``sampling_params`` is the default of requests
    that bring none."""

    def __init__(self, runner: ModelRunner, speculative_config: SpeculativeConfig, policy: Policy,
                 engine_config: EngineConfig | None = None, sampling_params: SamplingParams | None = None,
                 costs: CostModel | None = None, priors: dict[str, float] | None = None,
                 clock: CostClock | None = None) -> None:
        engine_config = engine_config or EngineConfig()
        # with this machine's pass costs, each sequence chooses its rounds' arms (engine/chooser.py), at what
        # steps take now (engine/cost_clock.py; a model's engines share its clock)
        self.costs, self.priors, self.clock = costs, priors or {}, clock or CostClock()
        self.runner, self.speculative_config, self.policy = runner, speculative_config, policy
        self.engine_config, self.sampling_params = engine_config, sampling_params or SamplingParams()
        self.method = speculative_config.method
        self.strategy = STRATEGIES[self.method]
        self.choosing = speculative_config.guard and self.method != "autoregressive" and costs is not None
        self.exits = self.strategy.exits(policy, runner.decoder.num_layers)
        self.cache = runner.new_cache(engine_config.num_blocks or DEFAULT_SERVER_BLOCKS, engine_config.block_size)
        self.scheduler = Scheduler(self.cache.manager, len(self.exits), engine_config.schedule,
                                   engine_config.max_num_seqs)
        self.sequences: dict[int, Sequence] = {}  # every request added, by id
        self.steps = 0
        self.peak_slots = 0  # most KV slots held by allocated blocks at once
        self.peak_tokens = 0  # most tokens the sequences held at once
        self._ids = itertools.count()

    def add_request(self, prompt: Seq[int], sampling_params: SamplingParams | None = None, **overrides: Any) -> int:
        """Validate and queue a prompt (token ids); it joins the running batch at the next step with
        room for it. ``overrides`` set fields of ``sampling_params`` (default: the engine's), e.g.
        ``max_new_tokens=8, seed=1``. Returns its request id."""
        fixed = sorted(set(overrides) & SPECULATIVE_FIELDS)
        if fixed:
            raise HiSpecError(f"{', '.join(fixed)} is fixed per engine (SpeculativeConfig, here {self.method}); build "
                              f"another engine with model.build_engine(...) to change it")
        unknown = set(overrides) - SAMPLING_FIELDS
        if unknown:
            raise unknown_arguments(unknown, SAMPLING_FIELDS, "request")
        params = checked(sampling_params or self.sampling_params, SamplingParams, "sampling_params").replace(**overrides)
        decoder = self.runner.decoder
        params.check_vocab(decoder.vocab_size)
        (row,) = prompt_rows([prompt], decoder.vocab_size, decoder.max_positions)
        limit = min(len(row) + params.max_new_tokens, decoder.max_positions)
        manager = self.cache.manager
        if manager.blocks_for(limit) > manager.num_blocks:
            raise OutOfBlocksError(
                f"a request of {len(row)} prompt tokens and up to {limit - len(row)} new ones (max_new_tokens) cannot fit a KV "
                f"cache of {manager.num_blocks} blocks of {manager.block_size} tokens; raise num_blocks"
            )
        rid = next(self._ids)
        seq = Sequence(rid, row, manager, self.exits, TokenSampler(params), limit,
                       params.eos_ids(decoder.default_eos_ids()), self.policy, self.cache)
        if self.choosing and seq.sampler.path_free:  # a seeded sample follows its policy (its path)
            seq.chooser = RoundChooser(self.policy, self.costs, decoder.num_layers, self.priors, self.clock)
        self.sequences[rid] = seq
        self.scheduler.add(seq)
        return rid

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def step(self) -> list[StepOutput]:
        """Admit what fits, serve one sweep, retire finished sequences; returns committed tokens."""
        for seq in self.scheduler.admit():
            seq.batch_size = len(self.scheduler.running)
            seq.decode_loop = self.strategy.decode(seq)
            seq.request = next(seq.decode_loop)
        if not self.scheduler.running:
            return []
        start = time.perf_counter()
        batch, requests = self._prefill_budget(self.scheduler.next_batch())
        priced = self._price(batch, requests)
        logits = self.runner.advance(requests, self.cache)
        usage = self.cache.manager.usage()  # the step's high point: drafts written, nothing truncated yet
        self.peak_slots = max(self.peak_slots, usage["slots_held"])
        self.peak_tokens = max(self.peak_tokens, usage["tokens_needed"])
        outputs = []
        running = len(self.scheduler.running)
        for seq, request, lg in zip(batch, requests, logits):
            if request is not seq.request:  # a chunk of its prefill: its decode loop still waits
                continue
            seq.batch_size = running  # batch-aware policies speculate less in bigger batches
            try:
                seq.request = seq.decode_loop.send(lg)
            except StopIteration:
                seq.request = None
            done = seq.request is None
            if seq.committed > seq.reported or done:
                outputs.append(StepOutput(seq.seq_id, seq.tokens[seq.reported : seq.committed], done))
                seq.reported = seq.committed
            if done:
                self.scheduler.finish(seq)
        if priced is not None:
            self.clock.observe(priced[0], time.perf_counter() - start, priced[1])
        self.steps += 1
        return outputs

    def _price(self, batch: list[Sequence], requests: list[BandRequest]) -> tuple[StepClass, float] | None:
        """Price each decoding request of this step (before it runs) at its share of the rows the step's
        decoding sequences spend, for its chooser (a prefill's rows are nobody's choice). Returns the step's
        class and priced seconds where every request decodes (a step the clock can learn from), else None."""
        if not self.choosing:
            return None
        decoding = [r for s, r in zip(batch, requests) if r is s.request and s.processed(0) >= s.committed - 1]
        if not decoding:
            return None
        most = [max(r.band_rows()) for r in decoding]  # each request's widest band
        key = step_class(len(decoding), max(r.top_band for r in decoding), max(most))
        total, priced = sum(most), 0.0
        for request in decoding:
            seconds = request_seconds(self.costs, request, request.seq.batch_size, total)
            priced += seconds
            if request.seq.chooser is not None:
                request.seq.chooser.price(key, seconds)
        return (key, priced) if len(decoding) == len(requests) else None

    def _prefill_budget(self, batch: list[Sequence]) -> tuple[list[Sequence], list[BandRequest]]:
        """The sequences served this step and their requests, at most ``prefill_chunk`` prompt tokens
        in all (chunked prefill). A sequence whose prompt (or, after a preemption, committed tokens)
        no band has seen yet is a prefill of that many tokens: if it fits what is left of the budget,
        its own request runs; else the next chunk of it runs through every band, without logits (its
        decode loop keeps waiting), and the budget is spent; sequences after it that still need a
        prefill wait a step. Decode rows are never held back."""
        budget = self.engine_config.prefill_chunk
        if budget is None:
            return batch, [s.request for s in batch]
        served, requests = [], []
        for seq in batch:
            backlog = seq.committed - seq.processed(0)  # at most 1 while decoding: the newest committed token
            if backlog > 1 and backlog > budget:  # a prefill that does not fit: its next chunk, if budget is left
                if budget > 0:
                    served.append(seq)
                    requests.append(BandRequest(seq, len(seq.exits) - 1, 0, upto=seq.processed(0) + budget))
                    budget = 0
                continue
            if backlog > 1:  # a prefill that fits
                budget -= backlog
            served.append(seq)
            requests.append(seq.request)
        return served, requests

    def stream(self) -> Iterator[StepOutput]:
        """Step until every request is finished, yielding committed tokens as they come."""
        while self.has_unfinished():
            yield from self.step()

    def abort(self, request_id: int) -> None:
        """Stop a request now (e.g. its client went away): its blocks are freed at once."""
        seq = self.sequences.get(request_id)
        if seq is None:
            raise HiSpecError(f"no request {request_id!r}")
        if seq.status is not Status.FINISHED:
            self.scheduler.finish(seq)
            seq.finish_reason = "abort"

    def release(self, request_id: int) -> Sequence:
        """Forget a finished (or aborted) request and return its sequence; a long-running server
        calls this for every request so that ``sequences`` does not grow without bound."""
        seq = self.sequences.get(request_id)
        if seq is None:
            raise HiSpecError(f"no request {request_id!r}")
        if seq.status is not Status.FINISHED:
            raise HiSpecError(f"request {request_id} is still {seq.status.value}; abort it first")
        seq.decode_loop = seq.request = None
        return self.sequences.pop(request_id)

    @property
    def preemptions(self) -> int:
        return self.scheduler.preemptions
