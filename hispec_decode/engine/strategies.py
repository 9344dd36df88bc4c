"""Decoding strategies: autoregressive, single-level self-speculation, hierarchical HiSpec.

All three share one interface (``decode(seq)``, a generator of engine requests), one engine
and one cache, so they are compared by swapping one argument. Every token that reaches the
output has been chosen or verified by the full model, so greedy output equals the base
model's and sampled output is an exact sample of it.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, Callable, Generator

import torch

from ..decoding.lookup import lookup
from ..decoding.policy import Policy
from ..decoding.sampling import Verdict
from .sequence import BandRequest, Sequence
from .tree_draft import draft_tree

# A strategy's decode loop is a generator: it yields the engine work it needs (a BandRequest),
# receives that request's logits, and returns when the sequence is finished. The engine drives
# many such loops and serves the requests of all of them that need the same layers in one
# batched forward pass (see hispec_decode.engine.sequence for who holds what).
DecodeLoop = Generator[BandRequest, torch.Tensor, Any]


def draft(seq: Sequence, count: int, threshold: float) -> DecodeLoop:
    """Propose up to ``count`` tokens from the draft exit (band 0) while its top probability is at
    least ``threshold``, stopping at EOS. Returns ``(drafts, their distributions or None when
    greedy)``; no drafts leaves band 0's hidden state waiting for the band above."""
    drafts, probs = [], []
    while len(drafts) < count and seq.room() > 0 and threshold <= 1:
        logits = yield BandRequest(seq, 0, 1)
        seq.counters.calls_draft += 1
        proposal = seq.sampler.propose(logits, threshold, len(seq.tokens))
        if proposal is None:
            break
        token, q = proposal
        seq.tokens.append(token)
        drafts.append(token)
        probs.append(q)
        if token in seq.eos:
            break
    return drafts, None if seq.sampler.greedy or not drafts else torch.stack(probs)


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
    seq.counters.calls_full += 1
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


def copy_drafts(seq: Sequence) -> list[int]:
    """Prompt lookup (:mod:`hispec_decode.decoding.lookup`): tokens that followed an earlier occurrence
    of the sequence's last tokens, appended as drafts (up to an EOS). At most ``seq.copy_budget``:
    ``policy.lookup`` at first, then twice what the last copy had accepted (at least 2), since every
    copied token is a row of the check's pass whether it is accepted or not."""
    drafts = []
    budget = min(seq.policy.lookup, seq.copy_budget or seq.policy.lookup)
    for token in lookup(seq.tokens, min(budget, seq.room())):
        seq.tokens.append(token)
        drafts.append(token)
        if token in seq.eos:
            break
    seq.counters.copied += len(drafts)
    return drafts


def draft_and_check(seq: Sequence, band: int, threshold: float) -> Generator[BandRequest, torch.Tensor, Check]:
    """Draft under ``seq.policy`` (tokens copied by prompt lookup where it finds some, else a chain or a
    tree at ``L_d``) and check the drafts at the exit on top of ``band`` in one pass; a tree is pruned
    to its accepted path (moved to consecutive slots). Copied drafts are point masses (no distribution)."""
    policy, first = seq.policy, len(seq.tokens)
    copied = copy_drafts(seq) if policy.copies(seq.batch_size) else []
    if copied:
        logits = yield BandRequest(seq, band, len(copied) + 1)
        verdict = seq.sampler.verify(copied, None, logits, first)
        seq.copy_budget = max(2, 2 * verdict.accepted)
        return Check(len(copied), verdict, logits, verdict.accepted < len(copied))
    if policy.tree == "chain":
        drafts, q = yield from draft(seq, policy.num_draft, threshold)
        logits = yield BandRequest(seq, band, len(drafts) + 1)
        verdict = seq.sampler.verify(drafts, q, logits, first)
        return Check(len(drafts), verdict, logits, verdict.accepted < len(drafts))
    tree = yield from draft_tree(seq, policy, threshold, policy.floor(seq.batch_size))
    if tree is None:
        logits = yield BandRequest(seq, band, 1)
        return Check(0, seq.sampler.verify([], None, logits, first), logits, False)
    logits = yield BandRequest(seq, band, len(tree) + 1)  # the root and every node, in slot order
    walk = seq.sampler.verify_tree(tree, logits)
    seq.accept_path(walk.path)
    return Check(len(tree), walk.verdict, logits[walk.rows], walk.replaced)


class Strategy(ABC):
    name: str

    @abstractmethod
    def exits(self, policy: Policy, num_layers: int) -> tuple[int, ...]:
        """Band tops this strategy splits the model at."""

    @abstractmethod
    def decode(self, seq: Sequence) -> DecodeLoop:
        """Extend ``seq.tokens`` until EOS or the limit, under ``seq.policy``."""


class Autoregressive(Strategy):
    name = "autoregressive"

    def exits(self, policy: Policy, num_layers: int) -> tuple[int, ...]:
        return (num_layers,)

    def decode(self, seq: Sequence) -> DecodeLoop:
        while not seq.is_finished:
            yield from step_autoregressive(seq, 0)


class SelfSpec(Strategy):
    """LayerSkip-style: ``L_d`` drafts ``k`` tokens, the full model verifies them in one pass."""

    name = "self_spec"

    def exits(self, policy: Policy, num_layers: int) -> tuple[int, ...]:
        return (policy.draft_layer, num_layers)

    def decode(self, seq: Sequence) -> DecodeLoop:
        while not seq.is_finished:
            draft_threshold, _ = seq.policy.at_batch(seq.batch_size)
            if not seq.speculate or (draft_threshold > 1 and not seq.policy.copies(seq.batch_size)):  # cannot pay here
                yield from step_autoregressive(seq, 1)
                continue
            start = len(seq.tokens)
            check = yield from draft_and_check(seq, 1, draft_threshold)
            seq.counters.calls_full += 1
            seq.counters.tentative += check.drafted
            seq.counters.accepted_final += check.verdict.accepted
            seq.commit(start, check.verdict)


class HiSpec(Strategy):
    """``L_d`` drafts up to ``k_d`` confident tokens; ``L_i`` checks them and adds its own token;
    while ``L_i``'s confidence in the tentative tokens holds (up to ``N_i`` of them), rounds
    continue; then ``L_f`` verifies them all in one pass, treating ``L_i`` as the proposal.
    A policy whose intermediate exit is the full model (``verify_layer`` = the number of layers)
    switches the middle level off: ``L_d``'s drafts go straight to ``L_f`` (``self_spec``)."""

    name = "hispec"

    def exits(self, policy: Policy, num_layers: int) -> tuple[int, ...]:
        if policy.verify_layer >= num_layers:
            return SelfSpec().exits(policy, num_layers)
        return (policy.draft_layer, policy.verify_layer, num_layers)

    def decode(self, seq: Sequence) -> DecodeLoop:
        policy = seq.policy
        if len(seq.exits) == 2:  # no intermediate level
            yield from SelfSpec().decode(seq)
            return
        while not seq.is_finished:
            draft_threshold, verify_threshold = policy.at_batch(seq.batch_size)
            if not seq.speculate or (draft_threshold > 1 and verify_threshold > 1 and not policy.copies(seq.batch_size)):
                yield from step_autoregressive(seq, 2)
                continue
            start = len(seq.tokens)  # tokens[start:] are tentative: accepted by L_i, not yet by L_f
            proposals: list[torch.Tensor] = []  # L_i's distribution of each tentative token (sampling)
            confidence = 1.0  # L_i's probability of the tentative tokens so far
            while True:
                first = len(seq.tokens)
                check = yield from draft_and_check(seq, 1, draft_threshold)
                seq.counters.calls_intermediate += 1
                verdict = check.verdict
                seq.counters.drafted += check.drafted
                seq.counters.accepted_intermediate += verdict.accepted
                gated = verify_threshold > 0  # no gate: no confidence to compute
                if gated:  # [accepted + 1 or more]: L_i's top probability at the root and each accepted draft
                    tops = seq.sampler.confidence(check.logits, verdict.target_probs)
                    confidence *= _probability(verdict, seq.tokens[first : first + verdict.accepted], tops)
                # L_i's own token: a replacement of a rejected draft always joins (dropping only those
                # would keep the accepted drafts' tokens alone at that position, no longer samples of
                # L_i); a bonus joins while L_i's top probability keeps the product at the gate, else
                # the window closes and L_f chooses that position itself
                replacement = check.replaced
                if not gated or replacement or confidence * float(tops[verdict.accepted]) >= verify_threshold:
                    appended = seq.extend(first, verdict)
                    if gated and appended:
                        confidence *= _probability(verdict, [verdict.token], tops, verdict.accepted)
                else:
                    seq.truncate(first + verdict.accepted)
                    appended = False
                if verdict.target_probs is not None:
                    proposals.append(verdict.target_probs[: verdict.accepted + appended])
                tentative = seq.tokens[start:]
                if (not appended or len(tentative) >= policy.window or (gated and confidence < verify_threshold)
                        or seq.room() == 0 or seq.eos.intersection(seq.tokens[first:])):
                    break
            logits = yield BandRequest(seq, 2, len(tentative) + 1)
            seq.counters.calls_full += 1
            p_i = torch.cat(proposals) if proposals else None
            verdict = seq.sampler.verify(tentative, p_i, logits, start)
            seq.counters.tentative += len(tentative)
            seq.counters.accepted_final += verdict.accepted
            seq.commit(start, verdict)


def _probability(verdict: Verdict, tokens: list[int], tops: torch.Tensor, offset: int = 0) -> float:
    """L_i's probability of ``tokens`` at positions ``offset...``: its top probability when greedy
    (each is its argmax), the exact probability when sampling."""
    if not tokens:
        return 1.0
    if verdict.target_probs is None:
        return float(tops[offset : offset + len(tokens)].prod())
    rows = torch.arange(offset, offset + len(tokens))
    return float(verdict.target_probs[rows, torch.tensor(tokens)].prod())


STRATEGIES: dict[str, Strategy] = {s.name: s for s in (Autoregressive(), SelfSpec(), HiSpec())}
