"""Decoding strategies: autoregressive, single-level self-speculation, hierarchical HiSpec.

All three share one interface (``decode(seq)``, a generator of engine requests), one engine
and one cache, so they are compared by swapping one argument. Every token that reaches the
output has been chosen or verified by the full model, so greedy output equals the base
model's and sampled output is an exact sample of it.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, Generator

import torch

from ..engine.model_runner import BandRequest
from ..engine.sequence import Sequence
from .policy import Policy
from .sampling import Verdict

# A strategy's decode loop is a generator: it yields the engine work it needs (a BandRequest),
# receives that request's logits, and returns when the sequence is finished. The engine drives
# many such loops and serves the requests of all of them that need the same layers in one
# batched forward pass (see hispec_decode.engine.sequence for who holds what).
Steps = Generator[BandRequest, torch.Tensor, Any]


def draft(seq: Sequence, count: int) -> Steps:
    """Propose up to ``count`` tokens from the draft exit (band 0), stopping at EOS.
    Returns ``(drafts, their probabilities or None when greedy)``."""
    drafts, probs = [], []
    while len(drafts) < count and seq.room() > 0:
        logits = yield BandRequest(seq, 0, 1)
        token, q = seq.sampler.choose(logits)
        seq.counters.calls_draft += 1
        seq.tokens.append(token)
        drafts.append(token)
        probs.append(q)
        if token in seq.eos:
            break
    return drafts, None if seq.sampler.greedy else torch.stack(probs)


class Strategy(ABC):
    name: str

    @abstractmethod
    def exits(self, policy: Policy, num_layers: int) -> tuple[int, ...]:
        """Band tops this strategy splits the model at."""

    @abstractmethod
    def decode(self, seq: Sequence) -> Steps:
        """Extend ``seq.tokens`` until EOS or the limit, under ``seq.policy``."""


class Autoregressive(Strategy):
    name = "autoregressive"

    def exits(self, policy: Policy, num_layers: int) -> tuple[int, ...]:
        return (num_layers,)

    def decode(self, seq: Sequence) -> Steps:
        while not seq.is_finished:
            logits = yield BandRequest(seq, 0, 1)
            seq.counters.calls_full += 1
            token, _ = seq.sampler.choose(logits)
            seq.commit(len(seq.tokens), Verdict(0, token, None))


class SelfSpec(Strategy):
    """LayerSkip-style: ``L_d`` drafts ``k`` tokens, the full model verifies them in one pass."""

    name = "self_spec"

    def exits(self, policy: Policy, num_layers: int) -> tuple[int, ...]:
        return (policy.draft_layer, num_layers)

    def decode(self, seq: Sequence) -> Steps:
        while not seq.is_finished:
            start = len(seq.tokens)
            drafts, q = yield from draft(seq, seq.policy.num_draft)
            logits = yield BandRequest(seq, 1, len(drafts) + 1)
            seq.counters.calls_full += 1
            verdict = seq.sampler.verify(drafts, q, logits)
            seq.counters.tentative += len(drafts)
            seq.counters.accepted_final += verdict.accepted
            seq.commit(start, verdict)


class HiSpec(Strategy):
    """``L_d`` drafts ``k_d`` tokens; ``L_i`` checks them and adds its own token; once ``N_i``
    tokens are tentative, ``L_f`` verifies them all in one pass, treating ``L_i`` as proposal."""

    name = "hispec"

    def exits(self, policy: Policy, num_layers: int) -> tuple[int, ...]:
        return (policy.draft_layer, policy.verify_layer, num_layers)

    def decode(self, seq: Sequence) -> Steps:
        policy = seq.policy
        while not seq.is_finished:
            start = len(seq.tokens)  # tokens[start:] are tentative: accepted by L_i, not yet by L_f
            proposals: list[torch.Tensor] = []  # L_i's distribution of each tentative token
            while True:
                first = len(seq.tokens)
                drafts, q = yield from draft(seq, policy.num_draft)
                logits = yield BandRequest(seq, 1, len(drafts) + 1)
                seq.counters.calls_intermediate += 1
                verdict = seq.sampler.verify(drafts, q, logits)
                seq.counters.drafted += len(drafts)
                seq.counters.accepted_intermediate += verdict.accepted
                appended = seq.extend(first, verdict)
                if verdict.target_probs is not None:
                    proposals.append(verdict.target_probs[: verdict.accepted + appended])
                tentative = seq.tokens[start:]
                if len(tentative) >= policy.window or seq.room() == 0 or seq.eos.intersection(seq.tokens[first:]):
                    break
            logits = yield BandRequest(seq, 2, len(tentative) + 1)
            seq.counters.calls_full += 1
            p_i = torch.cat(proposals) if proposals else None
            verdict = seq.sampler.verify(tentative, p_i, logits)
            seq.counters.tentative += len(tentative)
            seq.counters.accepted_final += verdict.accepted
            seq.commit(start, verdict)


STRATEGIES: dict[str, Strategy] = {s.name: s for s in (Autoregressive(), SelfSpec(), HiSpec())}
