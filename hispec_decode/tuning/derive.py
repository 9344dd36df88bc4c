"""A decoding policy for the machine decoding runs on, from the adapter's calibration and this
machine's own pass costs.

The adapter ships traces of its calibration decoding (:mod:`.calibration`): how often each exit
agrees with the full model, by draft position, tree rank and level. What a pass over some rows
costs is measured once per machine (:func:`machine_costs`: seconds); every policy of a compact grid
(chains, static trees, the middle level on and off) is replayed on the traces under these costs,
the fastest predicted one refined knob by knob (:func:`refine`) and chosen (:func:`derive`).
Where the result is kept and when it is made again: :mod:`.record`.
"""

from __future__ import annotations

import itertools
import logging
import time
from dataclasses import replace
from typing import Any, Callable

from ..knobs import KNOBS, read_by
from ..decoding.level import vocab_of
from ..decoding.policy import DEFAULT_DRAFT_FRACTION, Policy
from ..engine.chooser import arm_policies
from .candidates import SPECULATION_OFF, Candidate, batch_thresholds, policy_dict, predict
from .costs import CostModel, measure_costs
from .simulate import Trace, add_vocab_rows, precision_above, replay

logger = logging.getLogger(__name__)

CHAINS = tuple(itertools.product((1, 2, 3, 4), (0.0, 0.4, 0.6, 0.8)))  # (k, tau_d) without a middle level
STATIC_TREES = ((2, 2, 1), (3, 3, 1), (4, 4, 1), (5, 4, 2), (6, 3, 2))  # (nodes, width, depth)
MIDDLE = tuple(itertools.product((1, 2, 3), (2, 4), (0.0, 0.6), (0.0, 0.4)))  # (k_d, N_i, tau_d, tau_v)
LOOKUP = 8  # tokens copied per round, in the candidates that try prompt lookup
TRACES = 4  # calibration traces replayed per candidate (the first ones; the result is each sequence's prior)
SCREEN_TRACES, SCREEN_KEEP = 2, 16  # the grid is screened on this many traces; the fastest this many go on to all
VOCAB_SIZES = (4096, 8192, 16384)  # the vocabulary level's sizes tried (those below half the vocabulary)
VOCAB_ALONE = ((1, 0.0), (2, 0.0), (3, 0.0), (2, 0.5), (3, 0.5), (4, 0.5), (6, 0.7))  # (k, tau_d), L_v drafting
VOCAB_BELOW = tuple(itertools.product(((1, 0.0), (2, 0.4)), (2, 4, 6)))  # ((k_d, tau_d), N_v), L_d -> L_v
OVERHEAD_TOKENS = 32  # tokens decoded to measure what a real request adds beyond its passes
OVERHEAD_PROMPTS = 1  # prompts (the first traces') decoded for it, plainly and speculatively


def grid(layers: list[int], num_layers: int, vocab_sizes: tuple[int, ...] = ()) -> list[Candidate]:
    """Chains and static trees from each exit without a middle level, chains with each pair of exits
    as draft and intermediate level, some of them after prompt lookup, lookup alone, the vocabulary
    level of each size drafting alone and checking below the full head (under each exit, and under
    each pair), and no speculation at all."""
    n, out = num_layers, []

    def add(draft_layer: int, verify_layer: int = num_layers, **knobs: Any) -> None:
        """One hispec candidate (N_i is 1 unless given)."""
        knobs.setdefault("window", 1)
        out.append(Candidate("hispec", Policy(draft_layer=draft_layer, verify_layer=verify_layer, **knobs), n))

    for v in vocab_sizes:
        for k, td in VOCAB_ALONE:
            add(n, num_draft=k, draft_threshold=td, vocab=v)
        add(n, num_draft=2, draft_threshold=0.5, lookup=LOOKUP, vocab=v)
        for d in sorted(layers):
            for (k, td), w in VOCAB_BELOW:
                add(d, num_draft=k, draft_threshold=td, vocab=v, vocab_window=w)
            add(d, lookup=LOOKUP, vocab=v, vocab_window=4)
        for d, i in itertools.combinations(sorted(layers), 2):
            add(d, i, window=2, vocab=v, vocab_window=4)
    for d in sorted(layers):
        for k, td in CHAINS:
            add(d, num_draft=k, draft_threshold=td)
        for nodes, width, depth in STATIC_TREES:
            add(d, num_draft=depth, tree="static", tree_nodes=nodes, tree_width=width)
    for (d, i), (k, w, td, tv) in itertools.product(itertools.combinations(sorted(layers), 2), MIDDLE):
        add(d, i, window=w, num_draft=k, draft_threshold=td, verify_threshold=tv)
    # prompt lookup before the draft exit, or alone
    for d in sorted(layers):
        for k, td in ((1, 0.0), (1, 0.4), (2, 0.4)):
            add(d, num_draft=k, draft_threshold=td, lookup=LOOKUP)
    for d, i in itertools.combinations(sorted(layers), 2):
        for w in (2, 4):
            add(d, i, window=w, lookup=LOOKUP)
    lowest = min(layers, default=max(1, round(n * DEFAULT_DRAFT_FRACTION)))  # no exit drafts in these two
    add(lowest, draft_threshold=SPECULATION_OFF, lookup=LOOKUP)
    # plain decoding through the bands: chosen where nothing is predicted to pay
    add(lowest, draft_threshold=SPECULATION_OFF, verify_threshold=SPECULATION_OFF)
    return out


def refine(best: Candidate, score: float, predicted: Callable[[Candidate], float], priced: Callable[[Candidate], bool],
           rounds: int = 2) -> tuple[Candidate, float]:
    """A local search around the grid's best: one knob at a time, each value its declaration lists for the
    tuner (:data:`~hispec_decode.knobs.Knob.search`), kept where the replay predicts it faster
    (among the policies whose exits were timed: ``priced``)."""
    for _ in range(rounds):
        improved = False
        for knob in KNOBS:
            for value in knob.search:
                if getattr(best.policy, knob.name) == value:
                    continue
                candidate = Candidate(best.method, replace(best.policy, **{knob.name: value}), best.num_layers)
                if not priced(candidate):
                    continue
                tps = predicted(candidate)
                if tps > score:
                    best, score, improved = candidate, tps, True
        if not improved:
            break
    return best, score


def ranked(model: Any, traces: list[Trace], costs: CostModel) -> list[tuple[Candidate, float]]:
    """The policies of :func:`grid` with their predicted tokens per second under ``costs``, fastest first:
    all of them are screened on the first :data:`SCREEN_TRACES` traces; the :data:`SCREEN_KEEP` fastest, the
    fastest without speculation and the fastest that ``self_spec`` runs are replayed on all; the best one,
    refined (:func:`refine`) on the screening traces, leads where all the traces predict it faster."""
    n, eos = model.num_layers, model.decoder.default_eos_ids()
    layers = sorted(layer for layer in traces[0].top if not vocab_of(layer) and layer > 0)
    traces = traces[:TRACES]
    sizes = tuple(vocab_of(key) for key in costs.exits if vocab_of(key))
    if sizes:
        add_vocab_rows(model.runner, traces, sizes)

    def screened(candidates: list[Candidate], on: list[Trace]) -> list[tuple[Candidate, float]]:
        return sorted(((c, predict(c, on, costs, n, eos)["tokens_per_second"]) for c in candidates),
                      key=lambda cs: -cs[1])

    # every candidate on the first traces, then the fastest and those derive() reads on all of them
    first = screened(grid(layers, n, sizes), traces[:SCREEN_TRACES])
    kept = [c for c, _ in first[:SCREEN_KEEP]]
    kept += [c for c, _ in first if c not in kept and _is_plain(c.policy)][:1]
    kept += [c for c, _ in first if c not in kept and _is_self_spec(c, n)][:SCREEN_KEEP // 4]
    scored = screened(kept, traces)
    def priced(c: Candidate) -> bool:  # every exit it drafts or checks at was timed
        return all(level.key in costs.exits for level in c.policy.levels(c.method, n) if level.kind == "exit")

    # the local search on the screening traces; its result is kept where all the traces agree it is faster
    screen = traces[:SCREEN_TRACES]
    start = next(tps for c, tps in first if c == scored[0][0])
    best, _ = refine(scored[0][0], start, lambda c: predict(c, screen, costs, n, eos)["tokens_per_second"], priced)
    if best == scored[0][0]:
        return scored
    tps = predict(best, traces, costs, n, eos)["tokens_per_second"]
    return [(best, tps), *scored] if tps > scored[0][1] else scored


def _is_plain(policy: Policy) -> bool:
    """No speculation at all: nothing drafts, nothing is copied."""
    return policy.draft_threshold > 1 and policy.verify_threshold > 1 and not policy.lookup


def _is_self_spec(candidate: Candidate, num_layers: int) -> bool:
    """A policy self_spec runs as it is: no middle level, the same levels under either method."""
    p = candidate.policy
    return p.verify_layer >= num_layers and p.exits("self_spec", num_layers) == p.exits("hispec", num_layers)


def derive(model: Any, traces: list[Trace], costs: CostModel,
           scored: list[tuple[Candidate, float]] | None = None) -> dict[str, Any]:
    """The fastest predicted ``hispec`` and ``self_spec`` policies under ``costs`` (no middle level
    for ``self_spec``), with what chose them (``scored``: :func:`ranked`, if already computed)."""
    n = model.num_layers
    layers = sorted(layer for layer in traces[0].top if not vocab_of(layer) and layer > 0)
    scored = scored if scored is not None else ranked(model, traces, costs)
    traces = traces[:TRACES]
    plain = next(tps for c, tps in scored if _is_plain(c.policy))  # no speculation, prefills included as in every replay
    best = scored[0][0].policy
    best_self = next(c.policy for c, _ in scored if _is_self_spec(c, n))
    cap = max(filter(None, (precision_above(traces, layer, 0.9) for layer in layers)), default=0.9)
    hispec = policy_dict(best) | {"batch_thresholds": batch_thresholds(costs, n, cap, best, traces)}
    self_spec = read_by("self_spec", policy_dict(best_self))
    self_spec["batch_thresholds"] = batch_thresholds(costs, n, cap, best_self, traces)
    predicted = [{"config": c.label(), "tokens_per_second": round(tps, 2)} for c, tps in scored[:8]]
    arms = arm_rates({"hispec": best, "self_spec": best_self}, traces, costs, n, model.decoder.default_eos_ids())
    return {"hispec": hispec, "self_spec": self_spec, "predicted": predicted,
            "predicted_autoregressive": round(plain, 2), "arms": arms}


def arm_rates(policies: dict[str, Policy], traces: list[Trace], costs: CostModel, num_layers: int,
              eos: frozenset[int]) -> dict[str, dict[str, float]]:
    """Each method's arms (:func:`~hispec_decode.engine.chooser.arm_policies` of its policy) replayed on
    ``traces``: predicted tokens per second, a sequence's prior."""
    return {method: {arm: round(predict(Candidate(method, variant, num_layers), traces, costs, num_layers, eos)
                                ["tokens_per_second"], 2)
                     for arm, variant in arm_policies(policy).items()}
            for method, policy in policies.items()}


def _decode_seconds(model: Any, prompt: list[int], max_new_tokens: int, **kwargs: Any) -> tuple[float, int]:
    """Seconds and new tokens of decoding ``prompt`` after its first new token: the whole request timed
    less the same request stopped after one token (the prompt's prefill and first step)."""
    t0 = time.perf_counter()
    model.generate([prompt], max_new_tokens=1, **kwargs)
    first = time.perf_counter() - t0
    t0 = time.perf_counter()
    out = model.generate([prompt], max_new_tokens=max_new_tokens, **kwargs)
    return max(0.0, time.perf_counter() - t0 - first), max(0, len(out.sequences[0]) - 1)


def request_overhead(model: Any, prompts: list[list[int]], max_new_tokens: int, costs: CostModel) -> float:
    """What a real decoding step costs beyond its band pass and exit head (plain decoding makes one
    engine request per token): measured on a few prompts alone, after their prefill, charged to every
    replayed request."""
    model.generate([prompts[0]], max_new_tokens=4, method="autoregressive")  # warm-up
    tokens, seconds = 0, 0.0
    for prompt in prompts:
        s, n = _decode_seconds(model, prompt, max_new_tokens, method="autoregressive")
        seconds, tokens = seconds + s, tokens + n
    return max(0.0, seconds / max(1, tokens) - costs.full_step(model.num_layers, 1))


def speculative_overhead(model: Any, prompts: list[list[int]], traces: list[Trace], layers: list[int],
                         costs: CostModel, eos: frozenset[int]) -> float:
    """What a speculative request (draft, check, verification) costs beyond its passes: the real
    time of the fixed policy on a few prompts against its replay without that overhead, both after the
    prompt's prefill and first token."""
    n = model.num_layers
    if layers:
        fixed = Candidate("hispec", Policy(draft_layer=layers[0], verify_layer=layers[1] if len(layers) > 1 else n,
                                           window=2, num_draft=1), n)
    else:  # a base without exits: the vocabulary level drafting
        fixed = Candidate("hispec", Policy(draft_layer=n, verify_layer=n, window=1, num_draft=2,
                                           vocab=min(vocab_sizes(model), default=VOCAB_SIZES[0])), n)
    model.generate([prompts[0]], max_new_tokens=4, **fixed.kwargs())  # warm-up
    seconds, modelled, requests = 0.0, 0.0, 0
    for prompt, trace in zip(prompts, traces):
        seconds += _decode_seconds(model, prompt, trace.limit - trace.prompt_length, **fixed.kwargs())[0]
        first = replace(trace, tokens=trace.tokens[: trace.prompt_length + 1], limit=trace.prompt_length + 1)
        whole, start = (replay(t, "hispec", fixed.policy, costs, n, eos) for t in (trace, first))
        modelled += whole.seconds - start.seconds
        requests += whole.speculative_requests - start.speculative_requests
    return max(0.0, (seconds - modelled) / max(1, requests))


def vocab_sizes(model: Any) -> tuple[int, ...]:
    """The vocabulary level's sizes the derivation tries on ``model``: those below half its vocabulary
    (none without a ranking to take them from: a base with no tokenizer and no adapter ranking)."""
    has_ranking = model.runner.ranking is not None or model.tokenizer is not None or (
        model.adapter is not None and model.adapter.vocab_path is not None)
    return tuple(v for v in VOCAB_SIZES if v <= model.decoder.vocab_size // 2) if has_ranking else ()


def machine_costs(model: Any, traces: list[Trace]) -> CostModel:
    """This machine's pass costs for ``model`` (seconds of measuring), with what a real request adds."""
    layers = sorted(layer for layer in traces[0].top if not vocab_of(layer) and layer > 0)
    sizes = vocab_sizes(model)
    if sizes:
        model.token_ranking()
    costs = measure_costs(model.runner, layers, reps=3, vocab_sizes=sizes)
    prompts = [t.tokens[: t.prompt_length] for t in traces[:OVERHEAD_PROMPTS]]
    if not layers and sizes:  # the speculative overhead's policy: the vocabulary level drafting (replayed below)
        add_vocab_rows(model.runner, traces[:OVERHEAD_PROMPTS], (min(sizes),))
    costs.request = request_overhead(model, prompts, OVERHEAD_TOKENS, costs)
    short = []  # the first tokens of each trace: what the speculative decode below makes
    for t in traces[:OVERHEAD_PROMPTS]:
        end = t.prompt_length + min(OVERHEAD_TOKENS, len(t.tokens) - t.prompt_length)
        short.append(replace(t, tokens=t.tokens[:end], limit=end))
    costs.speculative_request = speculative_overhead(model, prompts, short, layers, costs, model.decoder.default_eos_ids())
    return costs
