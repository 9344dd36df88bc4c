"""Decoding strategies: autoregressive, single-level self-speculation, hierarchical HiSpec.

All three share one interface (``decode(run)``, a generator of engine requests), one engine
and one cache, so they are compared by swapping one argument. Every token that reaches the
output has been chosen or verified by the full model, so greedy output equals the base
model's and sampled output is an exact sample of it.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, Generator

import torch

from .engine import Advance, DecodeState, Engine
from .sampling import TokenSampler, Verdict


# A strategy's decode loop is a generator: it yields the engine work it needs (an Advance),
# receives that request's logits, and returns when the run is finished. A scheduler drives
# many such loops and serves the requests of all of them that need the same layers in one
# batched forward pass.
Steps = Generator[Advance, torch.Tensor, Any]


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


@dataclass(frozen=True)
class Policy:
    """Exit layers and window sizes of one run (already validated)."""

    draft_layer: int
    verify_layer: int
    window: int  # N_i: tentative tokens that trigger a full verification
    num_draft: int  # k (self_spec) or k_d (hispec): drafts per check


@dataclass
class Run:
    """One sequence being decoded under one strategy."""

    engine: Engine
    state: DecodeState
    sampler: TokenSampler
    limit: int  # maximum total length (prompt + new tokens), within the context
    eos: frozenset[int]
    prompt_length: int
    policy: Policy
    counters: Counters = field(default_factory=Counters)
    finished: bool = False
    committed: int = 0  # tokens[:committed] are final (prompt + verified by the full model)

    rng_state: torch.Tensor | None = None  # the sampler's random state at the last commit

    def __post_init__(self) -> None:
        self.committed = max(self.committed, len(self.state.tokens))
        self.rng_state = self.sampler.generator.get_state()

    @property
    def tokens(self) -> list[int]:
        return self.state.tokens

    def room(self) -> int:
        return self.limit - len(self.tokens)

    def draft(self, layer: int, count: int) -> Steps:
        """Propose up to ``count`` tokens from exit ``layer`` (band 0), stopping at EOS.
        Returns ``(drafts, their probabilities or None when greedy)``."""
        drafts, probs = [], []
        while len(drafts) < count and self.room() > 0:
            logits = yield Advance(self.state, 0, 1)
            token, q = self.sampler.choose(logits)
            self.counters.calls_draft += 1
            self.tokens.append(token)
            drafts.append(token)
            probs.append(q)
            if token in self.eos:
                break
        return drafts, None if self.sampler.greedy else torch.stack(probs)

    def extend(self, start: int, verdict: Verdict) -> bool:
        """Keep ``tokens[:start + accepted]`` and append the verdict's token if there is room."""
        self.engine.truncate(self.state, start + verdict.accepted)
        if self.room() > 0:
            self.tokens.append(verdict.token)
            return True
        return False

    def commit(self, start: int, verdict: Verdict) -> None:
        """The full model verified ``tokens[start:]``: keep what it accepted, stop at EOS or limit."""
        self.extend(start, verdict)
        eos_at = next((i for i in range(start, len(self.tokens)) if self.tokens[i] in self.eos), None)
        if eos_at is not None:
            self.engine.truncate(self.state, eos_at + 1)
        self.committed = len(self.tokens)
        self.rng_state = self.sampler.generator.get_state()
        self.finished = eos_at is not None or self.room() == 0


class Strategy(ABC):
    name: str

    @abstractmethod
    def exits(self, policy: Policy, num_layers: int) -> tuple[int, ...]:
        """Band tops this strategy splits the model at."""

    @abstractmethod
    def decode(self, run: Run) -> Steps:
        """Extend ``run.tokens`` until EOS or the limit, under ``run.policy``."""


class Autoregressive(Strategy):
    name = "autoregressive"

    def exits(self, policy: Policy, num_layers: int) -> tuple[int, ...]:
        return (num_layers,)

    def decode(self, run: Run) -> Steps:
        while not run.finished:
            logits = yield Advance(run.state, 0, 1)
            run.counters.calls_full += 1
            token, _ = run.sampler.choose(logits)
            run.commit(len(run.tokens), Verdict(0, token, None))


class SelfSpec(Strategy):
    """LayerSkip-style: ``L_d`` drafts ``k`` tokens, the full model verifies them in one pass."""

    name = "self_spec"

    def exits(self, policy: Policy, num_layers: int) -> tuple[int, ...]:
        return (policy.draft_layer, num_layers)

    def decode(self, run: Run) -> Steps:
        while not run.finished:
            start = len(run.tokens)
            drafts, q = yield from run.draft(run.policy.draft_layer, run.policy.num_draft)
            logits = yield Advance(run.state, 1, len(drafts) + 1)
            run.counters.calls_full += 1
            verdict = run.sampler.verify(drafts, q, logits)
            run.counters.tentative += len(drafts)
            run.counters.accepted_final += verdict.accepted
            run.commit(start, verdict)


class HiSpec(Strategy):
    """``L_d`` drafts ``k_d`` tokens; ``L_i`` checks them and adds its own token; once ``N_i``
    tokens are tentative, ``L_f`` verifies them all in one pass, treating ``L_i`` as proposal."""

    name = "hispec"

    def exits(self, policy: Policy, num_layers: int) -> tuple[int, ...]:
        return (policy.draft_layer, policy.verify_layer, num_layers)

    def decode(self, run: Run) -> Steps:
        policy = run.policy
        while not run.finished:
            start = len(run.tokens)  # tokens[start:] are tentative: accepted by L_i, not yet by L_f
            proposals: list[torch.Tensor] = []  # L_i's distribution of each tentative token
            while True:
                first = len(run.tokens)
                drafts, q = yield from run.draft(policy.draft_layer, policy.num_draft)
                logits = yield Advance(run.state, 1, len(drafts) + 1)
                run.counters.calls_intermediate += 1
                verdict = run.sampler.verify(drafts, q, logits)
                run.counters.drafted += len(drafts)
                run.counters.accepted_intermediate += verdict.accepted
                appended = run.extend(first, verdict)
                if verdict.target_probs is not None:
                    proposals.append(verdict.target_probs[: verdict.accepted + appended])
                tentative = run.tokens[start:]
                if len(tentative) >= policy.window or run.room() == 0 or run.eos.intersection(run.tokens[first:]):
                    break
            logits = yield Advance(run.state, 2, len(tentative) + 1)
            run.counters.calls_full += 1
            p_i = torch.cat(proposals) if proposals else None
            verdict = run.sampler.verify(tentative, p_i, logits)
            run.counters.tentative += len(tentative)
            run.counters.accepted_final += verdict.accepted
            run.commit(start, verdict)


STRATEGIES: dict[str, Strategy] = {s.name: s for s in (Autoregressive(), SelfSpec(), HiSpec())}
