"""``tune``: choose a policy for an adapter on this machine, from measurements (docs/policy.md).

1. Calibration: the base model decodes the prompts greedily; one forward pass per prompt records
   every exit's top token and probability at every position (:mod:`.simulate`).
2. Costs: band passes and exit heads are timed against their rows (:mod:`.costs`).
3. Search: every configuration of a grid (exit layers among the adapter's heads, ``num_draft``,
   ``window``, both thresholds) is replayed on the traces under the cost model, which predicts
   its tokens per second.
4. Confirmation: the best few, the best ``self_spec``, the paper's fixed policy, token-tree
   policies (:data:`TREES` on the best chain's exits, with the middle level pruning and off: trees
   are not replayed, they are measured), the derivation's best level lists and drafters (the
   vocabulary level alone or under the exits, prompt lookup; :func:`.derive.ranked`, refined knob by
   knob) and plain decoding decode the prompts for real, side by side; the best measured ``hispec``
   policy wins.
5. Batch: from the measured costs, the acceptance a speculated token needs to pay for its rows
   in a batch of B sequences; above what the exits ever reach, the policy stops speculating.
   Then the chosen policy decodes batches of each size of :data:`CONFIRM_BATCHES` beside plain
   decoding, at least two batches of distinct prompts per size (:func:`batch_prompts_needed`); from
   the first size where it is not clearly faster (:data:`CONFIRM_MARGIN`), it does not speculate at
   all. A batch lasts as long as its slowest sequence: one batch of a few prompts that all copy
   well says little about batches of prompts that do not.
"""

from __future__ import annotations

import itertools
import logging
import time
from dataclasses import replace
from typing import Any

from tqdm.auto import tqdm

from ..decoding.policy import Policy
from ..knobs import read_by
from .candidates import SPECULATION_OFF, Candidate, batch_thresholds, policy_dict, predict
from .derive import derive, machine_costs, ranked
from .simulate import Trace, precision_above, record_trace

logger = logging.getLogger(__name__)

DRAFTS = (1, 2, 3, 4)
WINDOWS = (1, 2, 3, 4, 6, 8)
DRAFT_THRESHOLDS = (0.0, 0.4, 0.6, 0.8, 0.95, SPECULATION_OFF)
VERIFY_THRESHOLDS = (0.0, 0.2, 0.4, 0.6, 0.8, SPECULATION_OFF)
PAPER = {"window": 4, "num_draft": 2, "draft_threshold": 0.0, "verify_threshold": 0.0}  # N_i = 4, k_d = 2
# (tree, nodes, width, depth) confirmed by decoding on the best chain's exits, L_i pruning and off
TREES = (("static", 4, 4, 1), ("static", 5, 4, 2), ("dynamic", 6, 3, 2), ("dynamic", 6, 3, 3), ("dynamic", 10, 4, 3))
CONFIRM_BATCHES = (2, 4, 8, 16)  # batch sizes where the chosen policy is decoded beside plain decoding
# speculation stays on at a batch size only if it beats plain decoding there by this much: a gain inside
# run-to-run noise on the calibration prompts is not a gain on other prompts (docs/policy.md)
CONFIRM_MARGIN = 1.05
CONFIRM_SEQUENCES = 16  # sequences decoded at each batch size, in at least CONFIRM_MIN_BATCHES batches
CONFIRM_MIN_BATCHES = 2


def batch_prompts_needed() -> int:
    """Distinct prompts :func:`confirm_batches` decodes at the biggest batch size."""
    return max(CONFIRM_SEQUENCES, CONFIRM_MIN_BATCHES * max(CONFIRM_BATCHES))


def candidates(layers: list[int], num_layers: int) -> list[Candidate]:
    """The grid: hispec over every ordered pair of exit layers, self_spec over every exit layer."""
    out = []
    for (d, i), k, w, td, tv in itertools.product(itertools.combinations(sorted(layers), 2), DRAFTS, WINDOWS,
                                                  DRAFT_THRESHOLDS, VERIFY_THRESHOLDS):
        if (td == SPECULATION_OFF and k > 1) or (td == tv == SPECULATION_OFF and w > 1):
            continue  # the same policy as one already in the grid (no drafts: k_d is moot; off: so is N_i)
        out.append(Candidate("hispec", Policy(draft_layer=d, verify_layer=i, window=w, num_draft=k,
                                              draft_threshold=td, verify_threshold=tv), num_layers))
    for d, k, td in itertools.product(sorted(layers), (1, 2, 3, 4, 6), DRAFT_THRESHOLDS):
        if td == SPECULATION_OFF and k > 1:
            continue
        out.append(Candidate("self_spec", Policy(draft_layer=d, verify_layer=d + 1, window=1, num_draft=k,
                                                 draft_threshold=td), num_layers))
        # hispec without its middle level (verify_layer = the full model): L_d's drafts go to L_f
        out.append(Candidate("hispec", Policy(draft_layer=d, verify_layer=num_layers, window=1, num_draft=k,
                                              draft_threshold=td), num_layers))
    return out


def tune(model: Any, prompts: list[list[int]], max_new_tokens: int = 128, confirm: int = 4,
         layers: list[int] | None = None, traces: list[Trace] | None = None,
         batch_prompts: list[list[int]] | None = None) -> dict[str, Any]:
    """The chosen ``hispec`` and ``self_spec`` policies for ``model``'s adapter and dtype, with the
    measurements that chose them (what ``hispec-tune`` stores for this machine).
    ``layers``: the exits to pair (default: every head's; see :func:`.curve.choose_layers`);
    ``traces``: the calibration along ``prompts`` if already recorded; ``batch_prompts``: the prompts
    of the batch confirmation (default: ``prompts``, repeated where too few)."""
    n = model.num_layers
    if layers is None:
        layers = sorted(e.layer for e in model.adapter.config.exits) if model.adapter is not None else \
            [model.policy(method="hispec").draft_layer, model.policy(method="hispec").verify_layer]
    eos = model.decoder.default_eos_ids()
    if traces is None:
        logger.info("calibration: decoding %d prompts", len(prompts))
        plain = model.generate(prompts, max_new_tokens=max_new_tokens, method="autoregressive")
        traces = [record_trace(model.runner, model.base_model, p, c, layers, max_new_tokens)
                  for p, c in zip(prompts, plain.sequences)]
    logger.info("costs: timing band passes and exit heads")
    costs = machine_costs(model, traces)  # incl. the vocabulary level's heads, where the base has a ranking
    ar_predicted = sum(len(t.tokens) - t.prompt_length for t in traces) / sum(
        costs.full_step(n, 1) * (len(t.tokens) - t.prompt_length) for t in traces)
    scored = [(c, predict(c, traces, costs, n, eos)) for c in tqdm(candidates(layers, n), desc="replaying policies")]
    scored.sort(key=lambda cs: -cs[1]["tokens_per_second"])
    best_hispec = [c for c, _ in scored if c.method == "hispec"][:confirm]
    best_self = next(c for c, _ in scored if c.method == "self_spec")
    d, i = layers[0], (layers[1] if len(layers) > 1 else n)  # one exit: no middle level
    paper = Candidate("hispec", Policy(draft_layer=d, verify_layer=i, **PAPER), n)
    off = Candidate("hispec", Policy(draft_layer=d, verify_layer=i, window=1, num_draft=1,  # plain, through the bands
                                     draft_threshold=SPECULATION_OFF, verify_threshold=SPECULATION_OFF), n)
    if off not in best_hispec:  # always measured: where nothing pays, the policy stops speculating
        best_hispec.append(off)
    chain = best_hispec[0].policy
    # trees with the middle level on: on the best replayed chain that has one (whatever the best chain is)
    middle = next((c.policy for c, _ in scored if c.method == "hispec" and c.policy.verify_layer < n), None)
    trees = [Candidate("hispec", replace(chain, tree=kind, tree_nodes=nodes, tree_width=width, num_draft=depth,
                                         verify_layer=n, window=1, verify_threshold=0.0), n)
             for kind, nodes, width, depth in TREES]
    if middle is not None:
        trees += [Candidate("hispec", replace(middle, tree=kind, tree_nodes=nodes, tree_width=width, num_draft=depth), n)
                  for kind, nodes, width, depth in TREES]
    # what a machine without this tuning would run: confirmed beside the rest
    # the derivation's grid: level lists (L_v alone, under each exit and pair) and drafters (prompt lookup)
    derivation = ranked(model, traces, costs)
    fields = {k: v for k, v in derive(model, traces, costs, derivation)["hispec"].items() if k != "batch_thresholds"}
    derived = Candidate("hispec", Policy(**fields), n)
    labels = {c.label() for c in [*best_hispec, *trees, derived]}
    levels = [c for c, _ in derivation if c.label() not in labels][:confirm]
    # the exit drafter and prompt lookup in one tree (batch 1): measured, as trees are, on the best such chain
    copying = next((c for c in [derived, *levels, *(c for c, _ in derivation)] if c.policy.lookup and c.policy.draft_layer < n
                    and c.policy.drafting != "union"), None)
    union = [Candidate("hispec", replace(copying.policy, drafting="union"), n)] if copying is not None else []
    union = [c for c in union if c.label() not in {c.label() for c in levels}]
    levels += union
    confirmed = confirm_by_decoding(model, prompts, max_new_tokens,
                                    [*best_hispec, *trees, *levels, best_self, paper, derived])
    predicted = dict((c.label(), s) for c, s in scored)
    chosen = max([*best_hispec, *trees, *levels, derived], key=lambda c: confirmed[c.label()])
    no_middle = [c for c in trees if c.policy.verify_layer >= n]
    best_tree_off = max(no_middle, key=lambda c: confirmed[c.label()]) if no_middle else None
    chosen_self = (best_self if best_tree_off is None or confirmed[best_self.label()] >= confirmed[best_tree_off.label()]
                   else Candidate("self_spec", best_tree_off.policy, n))
    cap = max(filter(None, (precision_above(traces, layer, 0.9) for layer in layers)), default=0.9)
    thresholds = batch_thresholds(costs, n, cap, chosen.policy, traces)
    thresholds, batched = confirm_batches(model, batch_prompts or prompts, max_new_tokens, chosen, thresholds)
    rows = [{"config": c.label(), "predicted_tokens_per_second": round(predicted[c.label()]["tokens_per_second"], 2),
             "measured_tokens_per_second": round(confirmed[c.label()], 2)} for c in [*best_hispec, best_self, paper]]
    rows += [{"config": c.label(), "predicted_tokens_per_second": round(tps, 2),
              "measured_tokens_per_second": round(confirmed[c.label()], 2)} for c, tps in derivation if c in levels]
    rows += [{"config": c.label(), "predicted_tokens_per_second": None,  # trees are measured, not replayed
              "measured_tokens_per_second": round(confirmed[c.label()], 2)}
             for c in [*trees, *union]]
    rows.append({"config": "autoregressive", "predicted_tokens_per_second": round(ar_predicted, 2),
                 "measured_tokens_per_second": round(confirmed["autoregressive"], 2)})
    report = {"prompts": len(prompts), "max_new_tokens": max_new_tokens, "confirmed": rows, "chosen": chosen.label(),
              "derived": {"config": derived.label(), "measured_tokens_per_second": round(confirmed[derived.label()], 2),
                          "ratio_to_chosen": round(confirmed[derived.label()] / confirmed[chosen.label()], 3)},
              "top_predicted": [{"config": c.label(), **{k: round(v, 3) for k, v in s.items()}} for c, s in scored[:10]],
              "costs": costs.to_dict(), "precision_at_0.9": cap, "batched": batched,
              "tuned_on": time.strftime("%Y-%m-%d")}
    self_spec = read_by("self_spec", policy_dict(chosen_self.policy))
    report["chosen_self_spec"] = chosen_self.label()
    return {"hispec": policy_dict(chosen.policy) | {"batch_thresholds": thresholds},
            "self_spec": self_spec | {"batch_thresholds": thresholds}, "measurements": report}


def confirm_batches(model: Any, prompts: list[list[int]], max_new_tokens: int, chosen: Candidate,
                    thresholds: dict[str, float]) -> tuple[dict[str, float], list[dict[str, Any]]]:
    """Decode batches of each size in :data:`CONFIRM_BATCHES` with plain decoding and with ``chosen``
    under ``thresholds``, in alternating order: :data:`CONFIRM_SEQUENCES` sequences in at least
    :data:`CONFIRM_MIN_BATCHES` batches per size, each batch of distinct prompts (drawn in turn from
    ``prompts``; a batch of 2 from two easy prompts would say little); from the first size where
    speculation is not faster by :data:`CONFIRM_MARGIN`, it is switched off (:data:`SPECULATION_OFF`)
    at that size and every bigger one."""
    rows, off = [], False
    for b in CONFIRM_BATCHES:
        if off:
            thresholds[str(b)] = SPECULATION_OFF
            continue
        count = max(CONFIRM_MIN_BATCHES, -(-CONFIRM_SEQUENCES // b))
        batches = [[prompts[(j * b + i) % len(prompts)] for i in range(b)] for j in range(count)]
        policy = replace(chosen.policy, batch_thresholds=tuple(sorted((int(k), v) for k, v in thresholds.items())))
        times = {"autoregressive": 0.0, "speculative": 0.0}
        tokens = dict.fromkeys(times, 0)
        for j, batch in enumerate(batches):
            order = ("autoregressive", "speculative") if j % 2 == 0 else ("speculative", "autoregressive")
            for label in order:
                got, seconds = _decode(model, batch, max_new_tokens, "autoregressive" if label == "autoregressive"
                                       else chosen.method, None if label == "autoregressive" else policy)
                times[label] += seconds
                tokens[label] += got
        ratio = (tokens["speculative"] / times["speculative"]) / (tokens["autoregressive"] / times["autoregressive"])
        off = ratio < CONFIRM_MARGIN
        if off:
            thresholds[str(b)] = SPECULATION_OFF
        rows.append({"batch_size": b, "ratio_to_autoregressive": round(ratio, 3), "speculation": "off" if off else "on"})
        logger.info("batch %d: %.2fx plain decoding%s", b, ratio, " -> speculation off from here" if off else "")
        if off:  # every bigger size too, measured or not
            thresholds.update({k: SPECULATION_OFF for k in thresholds if int(k) >= b})
    return thresholds, rows


def _decode(model: Any, prompts: list[list[int]], max_new_tokens: int, method: str,
            policy: Policy | None = None) -> tuple[int, float]:
    """Tokens and seconds of decoding ``prompts`` as one batch under ``policy`` (default: the method's)."""
    from ..config import EngineConfig, SpeculativeConfig
    from ..engine.llm_engine import LLMEngine
    from ..sampling_params import SamplingParams

    spec = SpeculativeConfig(method=method, guard=False)  # the policy as it is, not as the guard would run it
    blocks = sum(-(-(len(p) + max_new_tokens) // 16) for p in prompts)
    engine = LLMEngine(model.runner, spec, policy or model.policy(spec), EngineConfig(num_blocks=blocks),
                       SamplingParams(max_new_tokens=max_new_tokens))
    for p in prompts:
        engine.add_request(p)
    t0 = time.perf_counter()
    while engine.has_unfinished():
        engine.step()
    return sum(len(s.new_tokens) for s in engine.sequences.values()), time.perf_counter() - t0


def confirm_by_decoding(model: Any, prompts: list[list[int]], max_new_tokens: int,
                        chosen: list[Candidate]) -> dict[str, float]:
    """Tokens per second of each candidate and of plain decoding, decoded for real, interleaved
    prompt by prompt so machine noise hits all alike."""
    runs = {c.label(): c.kwargs() for c in chosen} | {"autoregressive": {"method": "autoregressive"}}
    tally = {label: [0, 0.0] for label in runs}
    for label, kwargs in runs.items():  # warm-up
        model.generate([prompts[0]], max_new_tokens=4, **kwargs)
    for i, prompt in enumerate(tqdm(prompts, desc="confirming by decoding")):
        labels = list(runs)
        for label in labels[i % len(labels):] + labels[: i % len(labels)]:
            t0 = time.perf_counter()
            out = model.generate([prompt], max_new_tokens=max_new_tokens, **runs[label])
            tally[label][1] += time.perf_counter() - t0
            tally[label][0] += len(out.sequences[0])
    return {label: tokens / seconds for label, (tokens, seconds) in tally.items()}
