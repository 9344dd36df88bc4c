"""``hispec-tune``: choose the decoding policy for an adapter on this machine, by decoding.

    hispec-tune [--heads DIR] [--base B] [--dtypes bfloat16,float32] [--prompts mixed] [--num-prompts 8]
                [--write-calibration]

Records each exit's top tokens along the base's greedy decoding of calibration prompts (drawn with
another seed than the benchmarks'), measures this machine's band-pass costs, replays a grid of
policies under that cost model, confirms the best few by real decoding, and stores the chosen
``hispec`` and ``self_spec`` policies, per dtype, with the measurements that chose them, for this
machine under ``$HISPEC_HOME/machine/`` (hispec_decode.tuning.record): ``generate``, ``serve``, the
CLIs and the demo use them by default on this machine; explicit arguments override them. The adapter
directory is never written, except with ``--write-calibration`` and an explicit ``--heads``: then its
calibration traces (``hispec_calibration.safetensors``, machine-independent) are written into it,
from which every other machine derives its own policy.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

from .. import machine
from ..adapter import CONFIG_NAME
from ..data.prompts import HELD_OUT, PROMPT_SETS
from ..errors import HiSpecError
from .args import add_model_args
from .cli import add_debug_arg, positive_int, run_cli

CALIBRATION_SEED = 1  # the benchmarks draw their prompts with seed 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="hispec-tune", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(p)
    p.add_argument("--dtypes", default="bfloat16,float32", help="comma-separated dtypes, each tuned in turn")
    p.add_argument("--prompts", default="mixed", choices=[s for s in PROMPT_SETS if s not in HELD_OUT])
    p.add_argument("--num-prompts", type=positive_int, default=8)
    p.add_argument("--max-new-tokens", type=positive_int, default=128)
    p.add_argument("--confirm", type=positive_int, default=4, help="best predicted policies decoded for real")
    p.add_argument("--curve", type=Path, default=None,
                   help="a layer curve (hispec-curve): pair only the exits it rates best (for adapters with many heads)")
    p.add_argument("--json", type=Path, default=None, help="also write the measurements to this file")
    p.add_argument("--report", type=Path, default=None, help="also write a Markdown report (predicted vs measured)")
    p.add_argument("--write-calibration", action="store_true",
                   help="write the calibration traces into the adapter given with --heads (what other machines derive "
                        "their policy from)")
    p.add_argument("--calibration-only", action="store_true",
                   help="with --write-calibration: record and write the traces, tune nothing")
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
    from ..tuning.tune import batch_prompts_needed
    from ..tuning.curve import choose_layers, read_curve

    from ..tuning.calibration import record_calibration, save_calibration
    from ..tuning.record import policy_path, store

    if args.write_calibration and args.heads is None:
        raise HiSpecError("--write-calibration writes into the adapter given with --heads; give it explicitly")
    if args.calibration_only and not args.write_calibration:
        raise HiSpecError("--calibration-only needs --write-calibration")
    heads = Path(args.heads) if args.heads is not None else default_heads_for(args.base)
    if heads is None or not (heads / CONFIG_NAME).is_file():
        raise HiSpecError("--heads must be a local adapter directory")
    results, stored = {}, []
    for dtype in args.dtypes.split(","):
        model = HiSpecModel.from_pretrained(args.base, str(heads), dtype=dtype, batch_invariant=args.batch_invariant)
        if model.tokenizer is None:
            raise HiSpecError("tuning needs the base's tokenizer for its calibration prompts")
        prompts = [encode_prompt(model.tokenizer, t, chat=args.prompts not in CHAT_FREE)
                   for t in prompt_set(args.prompts, args.num_prompts, CALIBRATION_SEED)]
        layers = sorted(e.layer for e in model.adapter.config.exits)
        if args.curve is not None:
            layers = choose_layers(read_curve(args.curve), layers)
            print(f"{dtype}: exits chosen from the layer curve: {layers}")
        traces = record_calibration(model, prompts, args.max_new_tokens, layers)
        if args.write_calibration and dtype == args.dtypes.split(",")[0]:
            path = save_calibration(heads, traces, {"prompts": args.prompts, "num_prompts": args.num_prompts,
                                                    "seed": CALIBRATION_SEED, "max_new_tokens": args.max_new_tokens,
                                                    "dtype": dtype, "layers": layers})
            print(f"wrote the calibration traces into {path}")
        if args.calibration_only:
            return 0
        batch_prompts = [encode_prompt(model.tokenizer, t, chat=args.prompts not in CHAT_FREE)
                         for t in prompt_set(args.prompts, max(args.num_prompts, batch_prompts_needed()), CALIBRATION_SEED)]
        results[dtype] = tune(model, prompts, args.max_new_tokens, args.confirm, layers, traces, batch_prompts)
        path = policy_path(model)
        store(path, {"source": "tuned", "machine": machine.describe(model.decoder.device), "dtype": dtype,
                     "policies": {m: results[dtype][m] for m in ("hispec", "self_spec")},
                     "measurements": results[dtype]["measurements"]})
        stored.append(path)
        for row in results[dtype]["measurements"]["confirmed"]:
            predicted = row["predicted_tokens_per_second"]
            predicted = "    (not replayed)" if predicted is None else f"{predicted:7.1f} tok/s"
            print(f"{dtype:9} {row['config']:60} predicted {predicted}, "
                  f"measured {row['measured_tokens_per_second']:7.1f} tok/s")
        for row in results[dtype]["measurements"].get("batched", []):
            print(f"{dtype:9} batch {row['batch_size']:2}: {row['ratio_to_autoregressive']:.2f}x plain decoding, "
                  f"speculation {row['speculation']}")
        derived = results[dtype]["measurements"]["derived"]
        print(f"{dtype}: the policy derived from the calibration ({derived['config']}) decodes at "
              f"{derived['measured_tokens_per_second']:.1f} tok/s, {derived['ratio_to_chosen']:.2f}x the chosen one")
        print(f"{dtype}: hispec policy {results[dtype]['hispec']}")
    if args.json is not None:
        write_text(args.json, json.dumps(results, indent=2, sort_keys=True) + "\n")
    if args.report is not None:
        write_text(args.report, report_markdown(results))
    print(f"stored the tuned policies for this machine ({machine.summary()}) in {', '.join(map(str, stored))}")
    return 0


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
