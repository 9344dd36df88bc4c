"""Decoding strategies: autoregressive, and speculation over any list of levels (single-level
self-speculation and hierarchical HiSpec are two of its configurations).

They share one interface (``decode(seq)``, a generator of engine requests), one engine
and one cache, so they are compared by swapping one argument. Every token that reaches the
output has been chosen or verified by the full model, so greedy output equals the base
model's and sampled output is an exact sample of it.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, Callable, Generator

import torch

from ..decoding.policy import Policy
from ..decoding.sampling import Verdict
from . import drafters
from .drafters import propose
from .sequence import BandRequest, Sequence

# A strategy's decode loop is a generator: it yields the engine work it needs (a BandRequest),
# receives that request's logits, and returns when the sequence is finished. The engine drives
# many such loops and serves the requests of all of them that need the same layers in one
# batched forward pass (see hispec_decode.engine.sequence for who holds what).
DecodeLoop = Generator[BandRequest, torch.Tensor, Any]


def run_alone(loop: DecodeLoop, answer: Callable[[BandRequest], torch.Tensor]) -> None:
    """Drive one decode loop to its end outside an engine, answering each request with ``answer``
    (policy replays in tuning, strategy tests)."""
    try:
        request = next(loop)
        while True:
            request = loop.send(answer(request))
    except StopIteration:
        pass


def step_autoregressive(seq: Sequence, top_band: int) -> DecodeLoop:
    """One plain decoding step through every band (no exit but the last is evaluated)."""
    logits = yield BandRequest(seq, top_band, 1)
    seq.counters.count(top_band, 0, 0)
    token, _ = seq.sampler.choose(logits, len(seq.tokens))
    seq.commit(len(seq.tokens), Verdict(0, token, None))


@dataclass(frozen=True)
class Check:
    """One round of drafting and checking at one exit: how many tokens (chain) or nodes (tree) were
    drafted, the decision (in a chain's terms: the accepted drafts are ``tokens[first:]``), the checking
    exit's logits rows at the root and the accepted drafts (for gates), and whether the verdict's token
    replaces rejected drafts (else it is a bonus after the last accepted one)."""

    drafted: int
    verdict: Verdict
    logits: torch.Tensor
    replaced: bool


def draft_and_check(seq: Sequence, band: int, threshold: float) -> Generator[BandRequest, torch.Tensor, Check]:
    """One round's draft (:func:`hispec_decode.engine.drafters.propose`: prompt lookup, the draft exit's
    chain or tree, or their union) checked at the exit on top of ``band`` in one pass; a tree is pruned
    to its accepted path (moved to consecutive slots). Point-mass drafts carry no distribution."""
    first = len(seq.tokens)
    draft = yield from propose(seq, threshold)
    if draft is None or draft.tree is None:
        drafts = seq.tokens[first:]
        logits = yield BandRequest(seq, band, len(drafts) + 1)
        verdict = seq.sampler.verify(drafts, draft.probs if draft else None, logits, first)
        if draft is not None:
            draft.feedback(seq, list(range(verdict.accepted)))
        return Check(len(drafts), verdict, logits, verdict.accepted < len(drafts))
    logits = yield BandRequest(seq, band, len(draft.tree) + 1)  # the root and every node, in slot order
    walk = seq.sampler.verify_tree(draft.tree, logits)
    draft.feedback(seq, walk.path)
    seq.accept_path(walk.path)
    return Check(draft.count, walk.verdict, logits[walk.rows], walk.replaced)


class Strategy(ABC):
    name: str

    def exits(self, policy: Policy, num_layers: int) -> tuple[int, ...]:
        """Band tops this strategy splits the model at, one per level (:meth:`Policy.exits`)."""
        return policy.exits(self.name, num_layers)

    @abstractmethod
    def decode(self, seq: Sequence) -> DecodeLoop:
        """Extend ``seq.tokens`` until EOS or the limit, under ``seq.policy``."""


class Autoregressive(Strategy):
    name = "autoregressive"

    def decode(self, seq: Sequence) -> DecodeLoop:
        while not seq.is_finished:
            yield from step_autoregressive(seq, 0)


class Speculative(Strategy):
    """One decode loop over any number of levels (``seq.exits``): a drafter proposes below level 1,
    each intermediate level ``j`` checks what the level below gathered and gathers its own window of
    tentative tokens (up to its window, while its confidence in them holds), and the full model, the
    top level, verifies that window in one pass and commits. Level ``j`` treats level ``j - 1``'s
    distribution as the proposal, so every stage is a speculative rejection step and the committed
    tokens are the full model's (greedy) or exact samples of it.

    ``self_spec`` (LayerSkip) is the two-level case ``L_d -> L_f``; ``hispec`` has ``L_i`` and/or the
    vocabulary level ``L_v`` in between (:meth:`Policy.exits`)."""

    def __init__(self, name: str) -> None:
        self.name = name

    def decode(self, seq: Sequence) -> DecodeLoop:
        top, chooser = len(seq.exits) - 1, seq.chooser
        while not seq.is_finished:
            # the sequence's chooser picks this round's arm (engine/chooser.py); a round that prefills is not
            # evidence of its arm
            prefilled = seq.processed(0) >= seq.committed - 1
            if chooser is not None:
                seq.policy = chooser.choose(seq)
            committed = seq.committed
            yield from self.round(seq, top)
            if chooser is not None and prefilled:
                chooser.record(seq.committed - committed)

    def round(self, seq: Sequence, top: int) -> DecodeLoop:
        """One round under ``seq.policy``: a plain step where it cannot speculate, else drafts checked up to
        the full model, which commits."""
        draft_threshold, verify_threshold = seq.policy.at_batch(seq.batch_size)
        if (top == 1 or verify_threshold > 1) and not any(d.active(seq) for d in drafters.registered()):
            # nothing drafts and no middle level gathers tokens of its own: a plain step
            yield from step_autoregressive(seq, top)
            return
        start = len(seq.tokens)
        check = yield from check_at(seq, top, draft_threshold, verify_threshold)
        seq.counters.count(top, check.drafted, check.verdict.accepted)
        seq.commit(start, check.verdict)


def check_at(seq: Sequence, level: int, draft_threshold: float, verify_threshold: float
             ) -> Generator[BandRequest, torch.Tensor, Check]:
    """One round reaching ``level``: at level 1 the drafter's proposals, above it the window the level
    below gathered, checked at ``level``'s exit in one pass (not yet kept or cut: see the callers)."""
    if level == 1:
        return (yield from draft_and_check(seq, 1, draft_threshold))
    first = len(seq.tokens)
    proposals = yield from gather(seq, level - 1, draft_threshold, verify_threshold)
    tentative = seq.tokens[first:]
    logits = yield BandRequest(seq, level, len(tentative) + 1)
    verdict = seq.sampler.verify(tentative, proposals, logits, first)
    return Check(len(tentative), verdict, logits, verdict.accepted < len(tentative))


def gather(seq: Sequence, level: int, draft_threshold: float, verify_threshold: float
           ) -> Generator[BandRequest, torch.Tensor, torch.Tensor | None]:
    """Rounds checked at intermediate ``level`` until its window closes: each keeps what the level
    accepted plus its own token, while its probability of the tentative tokens stays at the gate
    (``verify_threshold``) and up to its window. Returns the level's distribution of each tentative
    token (the proposal for the level above; None when greedy)."""
    start = len(seq.tokens)  # tokens[start:] are tentative: accepted here, not yet above
    window = seq.policy.window_at(seq.levels[level])
    proposals: list[torch.Tensor] = []  # this level's distribution of each tentative token (sampling)
    confidence = 1.0  # this level's probability of the tentative tokens so far
    while True:
        first = len(seq.tokens)
        check = yield from check_at(seq, level, draft_threshold, verify_threshold)
        verdict = check.verdict
        seq.counters.count(level, check.drafted, verdict.accepted)
        gated = verify_threshold > 0  # no gate: no confidence to compute
        if gated:  # [accepted + 1 or more]: the level's top probability at the root and each accepted draft
            tops = seq.sampler.confidence(check.logits, verdict.target_probs)
            confidence *= _probability(verdict, seq.tokens[first : first + verdict.accepted], tops)
        # the level's own token: a replacement of a rejected draft always joins (dropping only those
        # would keep the accepted drafts' tokens alone at that position, no longer samples of this
        # level); a bonus joins while the level's top probability keeps the product at the gate, else
        # the window closes and the level above chooses that position itself
        if not gated or check.replaced or confidence * float(tops[verdict.accepted]) >= verify_threshold:
            appended = seq.extend(first, verdict)
            if gated and appended:
                confidence *= _probability(verdict, [verdict.token], tops, verdict.accepted)
        else:
            seq.truncate(first + verdict.accepted)
            appended = False
        if verdict.target_probs is not None:
            proposals.append(verdict.target_probs[: verdict.accepted + appended])
        if (not appended or len(seq.tokens) - start >= window or (gated and confidence < verify_threshold)
                or seq.room() == 0 or seq.eos.intersection(seq.tokens[first:])):
            return torch.cat(proposals) if proposals else None


def _probability(verdict: Verdict, tokens: list[int], tops: torch.Tensor, offset: int = 0) -> float:
    """L_i's probability of ``tokens`` at positions ``offset...``: its top probability when greedy
    (each is its argmax), the exact probability when sampling."""
    if not tokens:
        return 1.0
    if verdict.target_probs is None:
        return float(tops[offset : offset + len(tokens)].prod())
    rows = torch.arange(offset, offset + len(tokens))
    return float(verdict.target_probs[rows, torch.tensor(tokens)].prod())


STRATEGIES: dict[str, Strategy] = {s.name: s for s in (Autoregressive(), Speculative("self_spec"), Speculative("hispec"))}
