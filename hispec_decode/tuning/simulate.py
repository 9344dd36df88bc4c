"""Replaying a policy on recorded traces: what it would accept, and what its passes would cost.

A trace is one prompt with the base model's greedy continuation and, at every position, each exit's
top token and top probability (one forward pass over the whole sequence). Replaying runs the real
strategy (:mod:`hispec_decode.engine.strategies`) against a stand-in runner that answers each
band request from the trace and charges it with the measured :class:`CostModel`: the same rounds,
gates and windows as real decoding, without running the model. Greedy acceptance is exact along
the true prefix (a draft after a rejected one is discarded anyway); only the confidence of such
discarded drafts is approximated by the true-prefix one.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..decoding.policy import Policy
from ..decoding.sampling import Verdict, greedy_verdict
from ..cache.block_manager import DEFAULT_BLOCK_SIZE, BlockManager
from ..engine.model_runner import ModelRunner
from ..engine.sequence import BandRequest, Counters, Sequence
from ..engine.strategies import STRATEGIES, run_alone
from ..errors import HiSpecError
from .costs import CostModel


@dataclass
class Trace:
    tokens: list[int]  # prompt + the base model's greedy continuation
    prompt_length: int
    limit: int  # the total length decoding was allowed (the continuation is shorter if it ended at EOS)
    top: dict[int, list[int]] = field(default_factory=dict)  # exit layer -> top token predicted at each position
    conf: dict[int, list[float]] = field(default_factory=dict)  # exit layer -> its probability
    # deep-context heads: the same where the previous position's true final state is known (after a
    # commit); ``top``/``conf`` then hold them reading their own output there (drafts after the first)
    top_true: dict[int, list[int]] = field(default_factory=dict)
    conf_true: dict[int, list[float]] = field(default_factory=dict)


@torch.inference_mode()
def record_trace(runner: ModelRunner, model: torch.nn.Module, prompt: list[int], continuation: list[int],
                 layers: list[int], max_new_tokens: int | None = None) -> Trace:
    """Each exit's top token and probability at every position of ``prompt + continuation``."""
    tokens = prompt + continuation
    inner = getattr(model, model.base_model_prefix)
    out = inner(input_ids=torch.tensor([tokens]), output_hidden_states=True)
    trace = Trace(tokens, len(prompt), len(prompt) + (max_new_tokens or len(continuation)))

    def top_of(logits: torch.Tensor) -> tuple[list[int], list[float]]:
        conf, top = logits.float().softmax(-1).max(-1)
        return top.tolist(), conf.tolist()

    for layer in layers:
        head = runner.heads.get(layer)
        h = out.hidden_states[layer]
        if head is not None and (layer in runner.head_cache_layer or head.needs_context):
            dtype = next(head.parameters()).dtype
            variants = head.draft_steps(h.to(dtype), runner.decoder, out.last_hidden_state, 2)
            if head.needs_context:
                trace.top_true[layer], trace.conf_true[layer] = top_of(
                    head.project(variants[0].to(h.dtype), runner.decoder, restrict=runner.use_exit_vocab)[0])
            logits = head.project(variants[-1].to(h.dtype), runner.decoder, restrict=runner.use_exit_vocab)[0]
        else:
            logits = runner.exit_logits(layer, h)
        trace.top[layer], trace.conf[layer] = top_of(logits)
    return trace


class _Sampler:
    """Greedy choices on trace "logits": rows of (token, top probability)."""

    greedy = True

    def __init__(self) -> None:
        self.generator = torch.Generator()

    def choose(self, logits: torch.Tensor, position: int | None = None) -> tuple[int, None]:
        return int(logits[-1, 0]), None

    def forget(self, before: int) -> None:
        pass

    def propose(self, logits: torch.Tensor, threshold: float, position: int | None = None) -> tuple[int, None] | None:
        if threshold > 0 and float(logits[-1, 1]) < threshold:
            return None
        return int(logits[-1, 0]), None

    def confidence(self, logits: torch.Tensor, probs: None = None) -> torch.Tensor:
        return logits[:, 1]

    def verify(self, candidates: list[int], proposal: None, target_logits: torch.Tensor,
               position: int | None = None) -> Verdict:
        return greedy_verdict(candidates, [int(t) for t in target_logits[:, 0]])


class _Runner:
    """Answers band requests from a trace and adds up their measured cost."""

    def __init__(self, trace: Trace, costs: CostModel, num_layers: int) -> None:
        self.trace, self.costs, self.num_layers = trace, costs, num_layers
        self.seconds = 0.0
        self.speculative_requests = 0

    def advance(self, request: BandRequest) -> torch.Tensor:
        seq, manager = request.seq, request.seq.blocks
        manager.reserve(seq.seq_id, len(seq.tokens))
        rows = [len(seq.tokens) - seq.processed(b) for b in range(request.top_band + 1)]
        plain = request.top_band == len(seq.exits) - 1 and request.num_logits == 1 and len(set(rows)) == 1
        self.speculative_requests += not plain
        band = 0
        while band <= request.top_band:  # bands over the same new rows run as one slice, as the runner does
            last = band
            while last < request.top_band and rows[last + 1] == rows[band]:
                last += 1
            lo = seq.exits[band - 1] if band else 0
            self.seconds += self.costs.band(lo, seq.exits[last], rows[band])
            band = last + 1
        for b in range(request.top_band + 1):
            manager.set_length(seq.seq_id, b, len(seq.tokens))
        layer = seq.exits[request.top_band]
        self.seconds += self.costs.exit(layer, request.num_logits)
        self.seconds += self.costs.request if plain else self.costs.speculative_request
        predictions = []
        for p in range(len(seq.tokens) - request.num_logits, len(seq.tokens)):
            if layer == self.num_layers:  # the full model: the trace's own next token
                predictions.append((self.trace.tokens[p + 1] if p + 1 < len(self.trace.tokens) else -1, 1.0))
            elif p < len(self.trace.tokens):
                true_context = layer in self.trace.top_true and p - 1 < seq.processed(len(seq.exits) - 1)  # the full model ran at p - 1
                top, conf = (self.trace.top_true, self.trace.conf_true) if true_context else (self.trace.top, self.trace.conf)
                predictions.append((top[layer][p], conf[layer][p]))
            else:  # past the end of the trace (after drafts the base never made): nothing to say
                predictions.append((-1, 0.0))
        return torch.tensor(predictions, dtype=torch.float64)


@dataclass
class Replay:
    tokens: int
    seconds: float
    counters: Counters
    speculative_requests: int = 0


def replay(trace: Trace, method: str, policy: Policy, costs: CostModel, num_layers: int,
           eos: frozenset[int]) -> Replay:
    """Decode ``trace``'s prompt under ``method`` and ``policy`` with the stand-in runner."""
    if policy.tree != "chain":
        raise HiSpecError(f"a {policy.tree} tree policy cannot be replayed (the traces hold each exit's top-1 token "
                          f"along the true prefix only): confirm it by decoding")
    strategy = STRATEGIES[method]
    blocks = BlockManager(4096, DEFAULT_BLOCK_SIZE)  # lengths only: the stand-in runner stores no K/V
    seq = Sequence(0, trace.tokens[: trace.prompt_length], blocks, strategy.exits(policy, num_layers), _Sampler(),
                   trace.limit, eos, policy)
    seq.allocate()
    runner = _Runner(trace, costs, num_layers)
    run_alone(strategy.decode(seq), runner.advance)
    if seq.tokens != trace.tokens[: len(seq.tokens)]:
        raise RuntimeError("a greedy replay must reproduce the base model's tokens")
    return Replay(len(seq.new_tokens), runner.seconds, seq.counters, runner.speculative_requests)


def precision_above(traces: list[Trace], layer: int, threshold: float) -> float | None:
    """How often ``layer``'s top token is the base model's next token where its probability is at
    least ``threshold`` (over the generated positions); None where it never is."""
    hits = total = 0
    for t in traces:
        for p in range(t.prompt_length - 1, len(t.tokens) - 1):
            if t.conf[layer][p] >= threshold:
                total += 1
                hits += t.top[layer][p] == t.tokens[p + 1]
    return hits / total if total else None
