"""``hispec-tune``: choose the decoding policy for an adapter on this machine and store it with it.

    hispec-tune --heads DIR [--base B] [--dtypes bfloat16,float32] [--prompts mixed] [--num-prompts 8]

Measures band-pass costs and each exit's confidence against its acceptance on calibration prompts
(drawn with another seed than the benchmarks'), replays a grid of policies under that cost model,
confirms the best few by real decoding, and writes the chosen ``hispec`` and ``self_spec``
policies, per dtype, with the measurements that chose them, into ``DIR/hispec_config.json``
(atomically; the heads are not touched). ``generate``, ``serve``, the CLIs and the demo use them
by default; explicit arguments override them.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

from ..adapter import CONFIG_NAME, HiSpecAdapterConfig
from ..data.prompts import PROMPT_SETS
from ..errors import HiSpecError
from .args import add_model_args
from .cli import add_debug_arg, positive_int, run_cli

CALIBRATION_SEED = 1  # the benchmarks draw their prompts with seed 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="hispec-tune", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(p)
    p.add_argument("--dtypes", default="bfloat16,float32", help="comma-separated dtypes, each tuned in turn")
    p.add_argument("--prompts", default="mixed", choices=PROMPT_SETS)
    p.add_argument("--num-prompts", type=positive_int, default=8)
    p.add_argument("--max-new-tokens", type=positive_int, default=128)
    p.add_argument("--confirm", type=positive_int, default=4, help="best predicted policies decoded for real")
    p.add_argument("--curve", type=Path, default=None,
                   help="a layer curve (hispec-curve): pair only the exits it rates best (for adapters with many heads)")
    p.add_argument("--json", type=Path, default=None, help="also write the measurements to this file")
    p.add_argument("--report", type=Path, default=None, help="also write a Markdown report (predicted vs measured)")
    add_debug_arg(p)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    return run_cli("hispec-tune", lambda: _run(args), args.debug)


def _run(args: argparse.Namespace) -> int:
    from ..api import HiSpecModel, default_heads_for
    from ..data.prompts import CHAT_FREE, encode_prompt, prompt_set
    from ..files import write_text
    from ..tuning import tune
    from ..tuning.curve import choose_layers, read_curve

    heads = Path(args.heads) if args.heads is not None else default_heads_for(args.base)
    if heads is None or not (heads / CONFIG_NAME).is_file():
        raise HiSpecError("--heads must be a local adapter directory (the tuned policy is written into it)")
    results = {}
    for dtype in args.dtypes.split(","):
        model = HiSpecModel.from_pretrained(args.base, str(heads), dtype=dtype, batch_invariant=args.batch_invariant)
        if model.tokenizer is None:
            raise HiSpecError("tuning needs the base's tokenizer for its calibration prompts")
        prompts = [encode_prompt(model.tokenizer, t, chat=args.prompts not in CHAT_FREE)
                   for t in prompt_set(args.prompts, args.num_prompts, CALIBRATION_SEED)]
        layers = None
        if args.curve is not None:
            layers = choose_layers(read_curve(args.curve), sorted(e.layer for e in model.adapter.config.exits))
            print(f"{dtype}: exits chosen from the layer curve: {layers}")
        results[dtype] = tune(model, prompts, args.max_new_tokens, args.confirm, layers)
        config = HiSpecAdapterConfig.from_pretrained(heads)  # re-read: only the policy section changes
        config.policy[str(model.decoder.dtype).removeprefix("torch.")] = results[dtype]
        config.save_pretrained(heads)
        for row in results[dtype]["measurements"]["confirmed"]:
            predicted = row["predicted_tokens_per_second"]
            predicted = "    (not replayed)" if predicted is None else f"{predicted:7.1f} tok/s"
            print(f"{dtype:9} {row['config']:60} predicted {predicted}, "
                  f"measured {row['measured_tokens_per_second']:7.1f} tok/s")
        for row in results[dtype]["measurements"].get("batched", []):
            print(f"{dtype:9} batch {row['batch_size']:2}: {row['ratio_to_autoregressive']:.2f}x plain decoding, "
                  f"speculation {row['speculation']}")
        print(f"{dtype}: hispec policy {results[dtype]['hispec']}")
    update_model_card(heads)
    if args.json is not None:
        write_text(args.json, json.dumps(results, indent=2, sort_keys=True) + "\n")
    if args.report is not None:
        write_text(args.report, report_markdown(results))
    print(f"wrote the tuned policies into {heads / CONFIG_NAME}")
    return 0


CARD_NAME = "README.md"
CARD_BEGIN, CARD_END = "<!-- hispec-tune: begin -->", "<!-- hispec-tune: end -->"


def update_model_card(heads: Path) -> None:
    """Write the adapter's tuned policies (every dtype in its config) into its model card, replacing
    what an earlier ``hispec-tune`` wrote there; an adapter without a card is left without one."""
    from ..files import write_text

    card = heads / CARD_NAME
    if not card.is_file():
        return
    text = card.read_text()
    if CARD_BEGIN in text and CARD_END in text:
        text = text[: text.index(CARD_BEGIN)].rstrip("\n") + text[text.index(CARD_END) + len(CARD_END):]
    config = HiSpecAdapterConfig.from_pretrained(heads)
    section = card_section(config.policy, config.num_hidden_layers)
    write_text(card, text.rstrip("\n") + "\n\n" + section)


def card_section(policies: dict, num_layers: int) -> str:
    """The model card's tuned-policy section: per dtype, the chosen policies and what they measured."""
    lines = [CARD_BEGIN, "## Tuned decoding policy (`hispec-tune`)", "",
             "Used by default when these heads decode in that dtype (explicit arguments override it).", "",
             "| dtype | `hispec` policy | `self_spec` policy | measured (calibration prompts, batch 1) |",
             "|---|---|---|---|"]
    for dtype, tuned in sorted(policies.items()):
        m = tuned.get("measurements", {})
        measured = {r["config"]: r["measured_tokens_per_second"] for r in m.get("confirmed", [])}
        speed = "–"
        if m.get("chosen") in measured and measured.get("autoregressive"):
            tps, ar = measured[m["chosen"]], measured["autoregressive"]
            speed = (f"{tps:.1f} tok/s against {ar:.1f} for plain decoding ({tps / ar:.2f}x; "
                     f"{m['prompts']} prompts, {m['max_new_tokens']} new tokens, {m['tuned_on']})")
        lines.append(f"| {dtype} | {_policy_text(tuned['hispec'], num_layers)} | {_policy_text(tuned['self_spec'], num_layers)} | {speed} |")
    thresholds = {d: t["hispec"].get("batch_thresholds", {}) for d, t in sorted(policies.items())}
    if any(thresholds.values()):
        lines += ["", "Batch-aware: at batch size B a drafted token needs at least this acceptance "
                  "(1.5: no speculation): " + "; ".join(
                      f"{d}: " + ", ".join(f"B={b} {t[b]:g}" for b in sorted(t, key=int)) for d, t in thresholds.items() if t)]
    return "\n".join([*lines, CARD_END]) + "\n"


def _policy_text(policy: dict, num_layers: int) -> str:
    """A policy as one line: exits, maxima, gates."""
    if policy.get("draft_threshold", 0) > 1:
        return "no speculation (plain decoding)"
    text = f"L_d {policy['draft_layer']}"
    if policy.get("verify_layer", num_layers) < num_layers:
        text += f", L_i {policy['verify_layer']}, k_d ≤ {policy['num_draft']}, N_i ≤ {policy['window']}"
        gates = f"τ_d {policy.get('draft_threshold', 0):g}, τ_v {policy.get('verify_threshold', 0):g}"
    else:  # self_spec, or hispec without its middle level
        text += (", no middle level" if "verify_layer" in policy else "") + f", k ≤ {policy['num_draft']}"
        gates = f"τ_d {policy.get('draft_threshold', 0):g}"
    return f"{text}, {gates}"


def report_markdown(results: dict) -> str:
    """The tuning of each dtype as Markdown: predicted against measured tokens/s of the confirmed
    configurations, the chosen policies and the batch thresholds."""
    lines = ["# Tuning report (written by `hispec-tune --report`)", ""]
    for dtype, result in results.items():
        m = result["measurements"]
        lines += [f"## {dtype}", "", f"{m['prompts']} calibration prompts, {m['max_new_tokens']} new tokens, "
                  f"tuned on {m['tuned_on']}.", "",
                  "| configuration | predicted tok/s | measured tok/s |", "|---|---|---|"]
        lines += [f"| {r['config']} | {_number(r['predicted_tokens_per_second'])} | {r['measured_tokens_per_second']:.1f} |"
                  for r in m["confirmed"]]
        chosen = {k: v for k, v in result["hispec"].items() if k != "batch_thresholds"}
        lines += ["", f"Chosen `hispec` policy: `{chosen}`", "",
                  f"Chosen `self_spec` policy: `{ {k: v for k, v in result['self_spec'].items() if k != 'batch_thresholds'} }`",
                  "", "Batch thresholds (the acceptance a speculated token needs at that batch size; 1.5: none):",
                  "", "| batch | " + " | ".join(result["hispec"]["batch_thresholds"]) + " |",
                  "|---" * (1 + len(result["hispec"]["batch_thresholds"])) + "|",
                  "| threshold | " + " | ".join(f"{v:g}" for v in result["hispec"]["batch_thresholds"].values()) + " |",
                  "", "Best predicted configurations:", "", "| configuration | predicted tok/s |", "|---|---|"]
        lines += [f"| {r['config']} | {r['tokens_per_second']:.1f} |" for r in m["top_predicted"]]
        if m.get("batched"):
            lines += ["", "Batches decoded beside plain decoding (the prompts repeated):", "",
                      "| batch | x plain decoding | speculation |", "|---|---|---|"]
            lines += [f"| {r['batch_size']} | {r['ratio_to_autoregressive']:.2f} | {r['speculation']} |" for r in m["batched"]]
        lines.append("")
    return "\n".join(lines) + "\n"


def _number(x: float | None) -> str:
    return "not replayed" if x is None else f"{x:.1f}"


if __name__ == "__main__":
    sys.exit(main())
