"""Replaying a policy on recorded traces: what it would accept, and what its passes would cost.

A trace is one prompt with the base model's greedy continuation and, at every position, each exit's
:data:`TOP_K` most likely tokens with their probabilities (one forward pass over the whole sequence).
Replaying runs the real strategy (:mod:`hispec_decode.engine.strategies`) against a stand-in runner
that answers each band request from the trace and charges it with the measured :class:`CostModel`:
the same rounds, gates, windows and draft trees as real decoding, without running the model.
Greedy acceptance is exact along the true prefix (a draft after a rejected one is discarded anyway,
and a tree node off the true path is never accepted by the full model); only the confidence of such
discarded drafts is approximated by the true-prefix one, and a tree node off the true path proposes
stand-in children (never accepted, with the true-prefix probabilities) so that their rows are paid.

Traces depend on the adapter and the base, never on the machine: an adapter ships them
(:mod:`.calibration`), and each machine replays them under its own costs (:mod:`.derive`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from ..decoding.policy import Policy
from ..decoding.sampling import Verdict, greedy_verdict, walk_tree
from ..decoding.tree import DraftTree
from ..cache.block_manager import DEFAULT_BLOCK_SIZE, BlockManager
from ..engine.model_runner import ModelRunner
from ..engine.own_tokens import add_own_prefix_logits
from ..engine.sequence import BandRequest, Counters, Sequence
from ..engine.strategies import STRATEGIES, run_alone
from ..decoding.cost_model import CostModel
from ..decoding.level import vocab_key
from ..engine.chooser import request_seconds

TOP_K = 4  # candidates kept per exit and position: static trees up to this wide replay exactly


@dataclass
class Trace:
    tokens: list[int]  # prompt + the base model's greedy continuation
    prompt_length: int
    limit: int  # the total length decoding was allowed (the continuation is shorter if it ended at EOS)
    top: dict[int, np.ndarray] = field(default_factory=dict)  # exit layer -> [positions, TOP_K] tokens, likeliest first
    conf: dict[int, np.ndarray] = field(default_factory=dict)  # exit layer -> [positions, TOP_K] their probabilities
    # deep-context heads: the same where the previous position's true final state is known (after a
    # commit); ``top``/``conf`` then hold them reading their own output there (drafts after the first)
    top_true: dict[int, np.ndarray] = field(default_factory=dict)
    conf_true: dict[int, np.ndarray] = field(default_factory=dict)


@torch.inference_mode()
def record_trace(runner: ModelRunner, model: torch.nn.Module, prompt: list[int], continuation: list[int],
                 layers: list[int], max_new_tokens: int | None = None) -> Trace:
    """Each exit's top tokens and probabilities at every position of ``prompt + continuation``."""
    tokens = prompt + continuation
    inner = getattr(model, model.base_model_prefix)
    out = inner(input_ids=torch.tensor([tokens]), output_hidden_states=True)
    trace = Trace(tokens, len(prompt), len(prompt) + (max_new_tokens or len(continuation)))

    def top_of(logits: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
        conf, top = logits.float().softmax(-1).topk(min(TOP_K, logits.shape[-1]), dim=-1)
        return top.numpy().astype(np.int64), conf.numpy().astype(np.float32)

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


@torch.inference_mode()
def final_states(runner: ModelRunner, tokens: list[int]) -> torch.Tensor:
    """The normed final hidden state at every position of ``tokens`` ([1, T, hidden]), by the engine's own
    layers (its compiled kernels) in one prefill on a cache of its own."""
    decoder = runner.decoder
    cache = runner.new_cache(-(-len(tokens) // DEFAULT_BLOCK_SIZE) + 1, DEFAULT_BLOCK_SIZE)
    cache.manager.add(0, 1)
    cache.manager.reserve(0, len(tokens))
    meta = decoder.meta(cache, [(0, 0, len(tokens))])
    x = decoder.embed(torch.tensor(tokens, device=decoder.device), meta)
    return decoder.exit_norm(decoder.run(x, 0, decoder.num_layers, meta, cache))


@torch.inference_mode()
def add_vocab_rows(runner: ModelRunner, traces: list[Trace], sizes: tuple[int, ...]) -> None:
    """The vocabulary level's top tokens and probabilities along each trace, for each of ``sizes``
    (its restricted, renormalized distribution over ``runner.level_vocab(size)`` and the trace's own
    tokens so far, as the engine's)."""
    decoder = runner.decoder
    for trace in traces:
        missing = tuple(size for size in sizes if vocab_key(size) not in trace.top)  # each trace its own
        if not missing:
            continue
        x = final_states(runner, trace.tokens)
        for size in missing:
            logits = decoder.vocab_logits(x, runner.level_vocab(size))[0]
            if runner.own_tokens:  # as the engine runs it: the sequence's own tokens too
                add_own_prefix_logits(logits, x[0], trace.tokens, runner.level_mask(size), decoder.lm_head)
            conf, top = logits.float().softmax(-1).topk(TOP_K, dim=-1)
            trace.top[vocab_key(size)] = top.numpy().astype(np.int64)
            trace.conf[vocab_key(size)] = conf.numpy().astype(np.float32)


class _Sampler:
    """Greedy choices on trace "logits": rows of :data:`TOP_K` tokens, then their probabilities."""

    greedy = True

    def __init__(self) -> None:
        self.generator = torch.Generator()

    def choose(self, logits: np.ndarray, position: int | None = None) -> tuple[int, None]:
        return int(logits[-1, 0]), None

    def forget(self, before: int) -> None:
        pass

    def propose(self, logits: np.ndarray, threshold: float, position: int | None = None) -> tuple[int, None] | None:
        if threshold > 0 and float(logits[-1, TOP_K]) < threshold:
            return None
        return int(logits[-1, 0]), None

    def confidence(self, logits: np.ndarray, probs: None = None) -> np.ndarray:
        return logits[:, TOP_K]

    def verify(self, candidates: list[int], proposal: None, target_logits: np.ndarray,
               position: int | None = None) -> Verdict:
        return greedy_verdict(candidates, [int(t) for t in target_logits[:, 0]])

    def candidates(self, logits: np.ndarray, k: int, positions: list[int]) -> list[list[tuple[int, float]]]:
        k = min(k, TOP_K)
        return [[(int(t), float(q)) for t, q in zip(row[:k], row[TOP_K : TOP_K + k]) if q > 0] for row in logits]

    def verify_tree(self, tree: DraftTree, target_logits: np.ndarray):
        return walk_tree(tree, lambda node, kids: int(target_logits[node + 1, 0]))


_NOTHING = np.concatenate([np.full(TOP_K, -1.0), np.zeros(TOP_K)])  # a row that proposes nothing
_OFF_PATH = -2.0 - np.arange(TOP_K)  # candidates that are no token: drafted (rows spent), never accepted


class _Runner:
    """Answers band requests from a trace and adds up their measured cost."""

    def __init__(self, trace: Trace, costs: CostModel, num_layers: int) -> None:
        self.trace, self.costs, self.num_layers = trace, costs, num_layers
        self.seconds = 0.0
        self.speculative_requests = 0
        self.rows = {layer: np.concatenate([top, conf], axis=1) for layer, top in trace.top.items()
                     for conf in (trace.conf[layer],)}
        self.rows_true = {layer: np.concatenate([top, trace.conf_true[layer]], axis=1)
                          for layer, top in trace.top_true.items()}

    def advance(self, request: BandRequest) -> np.ndarray:
        seq, manager = request.seq, request.seq.blocks
        manager.reserve(seq.seq_id, len(seq.tokens))
        rows = [len(seq.tokens) - seq.processed(b) for b in range(request.top_band + 1)]
        self.speculative_requests += not (request.top_band == len(seq.exits) - 1 and request.num_logits == 1
                                          and len(set(rows)) == 1)
        self.seconds += request_seconds(self.costs, request)
        for b in range(request.top_band + 1):
            manager.set_length(seq.seq_id, b, len(seq.tokens))
        level = seq.levels[request.top_band]
        layer = level.key  # its rows in the trace
        out = np.empty((request.num_logits, 2 * TOP_K))
        tokens = self.trace.tokens
        for j, slot in enumerate(range(len(seq.tokens) - request.num_logits, len(seq.tokens))):
            p, on_path = self._position(seq, slot)
            if p >= len(tokens) or (not on_path and level.full):  # nothing to say
                out[j] = _NOTHING
            elif level.full:  # the full model: the trace's own next token
                out[j] = _NOTHING
                out[j, 0], out[j, TOP_K] = (tokens[p + 1] if p + 1 < len(tokens) else -1), 1.0
            else:
                true_context = layer in self.rows_true and p - 1 < seq.processed(len(seq.exits) - 1)
                out[j] = (self.rows_true if true_context else self.rows)[layer][p]
                if not on_path:  # a node off the true path: its candidates are never accepted, and cost rows
                    out[j, :TOP_K] = _OFF_PATH
        return out

    def _position(self, seq: Sequence, slot: int) -> tuple[int, bool]:
        """The sequence position the token at ``slot`` holds, and whether it lies on the trace (a
        tree node whose path leaves it does not)."""
        tree = seq.tree
        if tree is None or slot < tree.base:
            return slot, True
        node, path = slot - tree.base, []
        while node >= 0:
            path.append(tree.tokens[node])
            node = tree.parents[node]
        p = tree.base - 1 + len(path)
        return p, self.trace.tokens[tree.base : p + 1] == path[::-1]


@dataclass
class Replay:
    tokens: int
    seconds: float
    counters: Counters
    speculative_requests: int = 0


def replay(trace: Trace, method: str, policy: Policy, costs: CostModel, num_layers: int,
           eos: frozenset[int]) -> Replay:
    """Decode ``trace``'s prompt under ``method`` and ``policy`` with the stand-in runner."""
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
        span = slice(t.prompt_length - 1, len(t.tokens) - 1)
        sure = t.conf[layer][span, 0] >= threshold
        total += int(sure.sum())
        hits += int((t.top[layer][span, 0] == np.asarray(t.tokens[t.prompt_length :]))[sure].sum())
    return hits / total if total else None
