"""``hispec-bench``: transformers' ``generate`` and this engine's methods, side by side in one process.

Every method decodes the same prompts greedily, interleaved prompt by prompt (so machine noise
hits all of them alike); the table reports tokens/s, the ratio to transformers, acceptance per
level, and whether each method's output matched transformers' token for token. It also
measures the "verification wall": the time of one full-model pass over the time of one draft
pass (layers ``0..L_d`` plus the draft exit), both for a single new token.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import json
import logging
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from .. import machine
from ..cache.block_manager import DEFAULT_BLOCK_SIZE
from ..config import SpeculativeConfig, for_method
from ..data.prompts import CHAT_FREE, CHAT_PROMPTS, PROMPT_SETS, encode_prompt, prompt_set
from ..engine.sequence import BandRequest, Counters, Sequence
from ..errors import HiSpecError
from ..extras import pyplot
from ..files import check_writable, save_figure, write_text
from ..models.loading import parse_dtype, resolve_dtype
from ..sampling_params import SamplingParams
from .args import (
    OTHER_HEADS,
    POLICY_ARGS,
    SAMPLING_ARGS,
    ModelVariants,
    add_config_args,
    add_model_args,
    autoregressive_of,
    config_overrides,
    method_settings,
    method_variant,
)
from . import llama_cpp
from .cli import add_debug_arg, positive_int, positive_int_list, run_cli
from .profile_split import profile_split
from .tally import Tally
from .roofline import memory_bandwidth, roofline

logger = logging.getLogger(__name__)
METHODS = ("transformers", "autoregressive", "self_spec", "self_spec:fixed", "hispec", "hispec:fixed", "hispec:paper")


def _hf_generate(model, prompt: list[int], max_new_tokens: int) -> list[int]:
    ids = torch.tensor([prompt])
    with torch.inference_mode():
        out = model.base_model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                                        do_sample=False)
    return out[0, len(prompt):].tolist()


def verification_wall(model, policy, prompt: list[int], reps: int = 10) -> dict[str, float]:
    """Median seconds of a single-token draft pass (layers 0..L_d plus the draft exit), a
    single-token full pass, and a full pass over ``window + 1`` tokens (a verification)."""
    runner = model.runner
    cache = runner.new_cache(-(-(len(prompt) + policy.window + 1) // DEFAULT_BLOCK_SIZE) + 1)
    seq = Sequence(0, prompt, cache.manager, (policy.draft_layer, model.num_layers), policy=policy)
    seq.allocate()
    runner.advance([BandRequest(seq, 1, 1)], cache)

    def timed(new_tokens: int, top: int) -> float:
        times = []
        for _ in range(reps):
            seq.truncate(len(prompt))
            seq.tokens.extend(prompt[-new_tokens:])
            t0 = time.perf_counter()
            runner.advance([BandRequest(seq, top, new_tokens)], cache)
            times.append(time.perf_counter() - t0)
        return sorted(times)[len(times) // 2]

    draft, full, wide = timed(1, 0), timed(1, 1), timed(policy.window + 1, 1)
    return {"full_pass_ms": 1000 * full, "draft_pass_ms": 1000 * draft, "full_over_draft": full / draft,
            "verify_pass_ms": 1000 * wide, "verify_over_full": wide / full}


def bench_prompts(model, n: int, prompt_set_name: str = "builtin") -> list[list[int]]:
    """Chat prompts rendered with the tokenizer, or seeded random ids for a base without one."""
    if model.tokenizer is not None:
        chat = prompt_set_name not in CHAT_FREE
        return [encode_prompt(model.tokenizer, t, chat=chat) for t in prompt_set(prompt_set_name, n)]
    g = torch.Generator().manual_seed(0)
    return [torch.randint(0, model.decoder.vocab_size, (8 + 5 * i,), generator=g).tolist() for i in range(n)]


def run_benchmark(args: argparse.Namespace) -> dict[str, Any]:
    binary = llama_cpp.find_llama_bench(args.llama_bench)
    with llama_cpp.gguf_file(args.base) if binary is not None else contextlib.nullcontext() as gguf:
        return _run_benchmark(args, binary if gguf is not None else None, gguf)


def _run_benchmark(args: argparse.Namespace, binary: Path | None, gguf: Path | None) -> dict[str, Any]:
    from ..api import HiSpecModel

    results: dict[str, Any] = {"max_new_tokens": args.max_new_tokens, "prompts": args.prompts,
                               "num_prompts": args.num_prompts, "machine": machine.describe(), "dtypes": {}}
    for dtype in args.dtypes.split(","):
        peer: list[float] = []  # llama.cpp's tokens/s on the same file, one run per prompt
        models = ModelVariants(lambda invariant, other: HiSpecModel.from_pretrained(
            args.base, args.heads_b if other else args.heads, dtype=dtype, batch_invariant=invariant),
            args.batch_invariant)
        model = models("autoregressive")
        prompts = bench_prompts(model, args.num_prompts, args.prompts)
        sampling, config = bench_settings(args)
        bandwidth = memory_bandwidth()  # measured before and after the methods; the better one counts
        methods = [m for m in args.methods.split(",") if m]
        tallies = {m: Tally() for m in methods}
        for m in methods:  # warm-up: first calls allocate and tune kernels
            if m != "transformers":
                settings, overrides = method_settings(models(m), m, config)
                models(m).generate([prompts[0]], sampling, settings, **(overrides | {"max_new_tokens": 8}))
            else:
                _hf_generate(model, prompts[0], 8)
        for i, prompt in enumerate(tqdm(prompts, desc=f"bench {dtype}", unit="prompt")):
            for m in methods[i % len(methods):] + methods[: i % len(methods)]:  # rotate the order
                t0 = time.perf_counter()
                if m == "transformers":
                    tokens = _hf_generate(model, prompt, args.max_new_tokens)
                    counters = Counters()
                else:
                    settings, overrides = method_settings(models(m), m, config)
                    out = models(m).generate([prompt], sampling, settings, **overrides)
                    tokens, counters = out.seqs[0].new_tokens, out.seqs[0].counters
                    tallies[m].levels = [level["level"] for level in out.stats["levels"]]
                    for arm, n in out.stats.get("arms", {}).items():
                        tallies[m].arms[arm] = tallies[m].arms.get(arm, 0) + n
                tally = tallies[m]
                seconds = time.perf_counter() - t0
                tally.seconds += seconds
                tally.tokens += len(tokens)
                tally.rates.append(len(tokens) / seconds)
                tally.counters.add(counters)
                tally.prompts += 1
                tally.outputs.append(tokens)
            if binary is not None:
                peer.append(llama_cpp.llama_bench(binary, gguf, args.max_new_tokens, prompt_tokens=len(prompt)))
        baseline = tallies.get("transformers")
        for tally in tallies.values():
            if baseline is not None:
                tally.matches = sum(a == b for a, b in zip(tally.outputs, baseline.outputs))
        policy = model.policy(for_method(config, "hispec"))
        rows = {m: t.row(baseline, tallies.get(autoregressive_of(m))) for m, t in tallies.items()}
        bandwidth = max(bandwidth, memory_bandwidth())
        results["dtypes"][dtype] = {
            "methods": rows,
            "roofline": roofline(model.base_model, {m: r["tokens_per_second"] for m, r in rows.items()}, bandwidth),
            "policy": asdict(policy) | {"self_spec_num_draft": model.policy(for_method(config, "self_spec")).num_draft},
            "verification_wall": verification_wall(model, policy, prompts[0]),
        }
        if peer:
            results["dtypes"][dtype]["llama_cpp"] = llama_cpp.peer_row(peer) | {"file": str(gguf)}
            for r in rows.values():
                r["ratio_to_llama_cpp"] = round(r["tokens_per_second"] / statistics.fmean(peer), 3)
        if args.profile:
            results["dtypes"][dtype]["profile"] = profile_split(
                lambda: model.generate([prompts[0]], sampling, for_method(config, "autoregressive")))
    return results


def format_table(results: dict[str, Any]) -> str:
    lines = [machine_line(results)]
    width = max([15, *(len(m) for res in results["dtypes"].values() for m in res["methods"])])
    head = (f"{'dtype':9} {'method':{width}} {'tok/s':>8} {'x HF':>6} {'x AR':>6} {'per prompt x AR':>18} "
            f"{'tok/full':>9} {'= HF':>7} {'= AR':>7}  accepted per level")
    for dtype, res in results["dtypes"].items():
        lines += [head, "-" * len(head)]
        for m, r in res["methods"].items():
            def f(x, pct=False):
                return "-" if x is None else (f"{100 * x:.1f}%" if pct else f"{x:.2f}")
            per = r.get("per_prompt_ratio_to_autoregressive")
            per = f"{per['min']:.2f}/{per['median']:.2f}/{per['max']:.2f}" if per else "-"
            lines.append(f"{dtype:9} {m:{width}} {r['tokens_per_second']:8.2f} {f(r['ratio_to_transformers']):>6} "
                         f"{f(r.get('ratio_to_autoregressive')):>6} {per:>18} "
                         f"{f(r['tokens_per_full_call']):>9} {r['matches_transformers']:>7} "
                         f"{r.get('matches_autoregressive') or '-':>7}  "
                         + (" ".join(f"{k} {f(v, True)}" for k, v in (r.get("levels") or {}).items()) or "-"))
        w = res["verification_wall"]
        lines.append(f"verification wall ({dtype}): full pass {w['full_pass_ms']:.1f} ms / draft pass "
                     f"{w['draft_pass_ms']:.1f} ms = {w['full_over_draft']:.2f}x; a {res['policy']['window'] + 1}-token "
                     f"full pass costs {w['verify_over_full']:.2f}x a 1-token one")
        if "roofline" in res:
            r = res["roofline"]
            fractions = ", ".join(f"{k.removeprefix('fraction_of_bound_')} {100 * v:.0f}%" for k, v in r.items()
                                  if k.startswith("fraction_of_bound_"))
            lines.append(f"memory-bandwidth bound ({dtype}): {r['bandwidth_gb_per_s']:.1f} GB/s over "
                         f"{r['bytes_per_step'] / 1e6:.0f} MB of weights per step = {r['bound_tokens_per_second']:.1f} "
                         f"tok/s; of it: {fractions}")
        if "profile" in res:
            f = res["profile"]["fractions"]
            lines.append(f"profile ({dtype}, autoregressive, first prompt): attention {100 * f['attention']:.0f}%, "
                         f"linears {100 * f['linears']:.0f}%, other ops {100 * f['other_ops']:.0f}%, "
                         f"outside operators {100 * f['python']:.0f}%")
        if "llama_cpp" in res:
            peer = res["llama_cpp"]
            lines.append(f"llama.cpp ({dtype} run): llama-bench on {Path(peer['file']).name}, each prompt's length + "
                         f"{results['max_new_tokens']} new tokens: {peer['tokens_per_second']:.2f} new tok/s over "
                         f"{peer['runs']} runs; x llama.cpp: "
                         + ", ".join(f"{m} {r['ratio_to_llama_cpp']:.2f}" for m, r in res["methods"].items()))
        lines.append(f"policy ({dtype}): {res['policy']}")
        lines.append("")
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="hispec-bench", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(p)
    p.add_argument("--dtypes", default="auto,bfloat16", help="comma-separated dtypes (auto: native for a GGUF base, else "
                   "float32); benchmarked in turn, except with --batch-sizes, which interleaves them batch by batch "
                   "and gives each method's ratio to the first dtype")
    p.add_argument("--methods", default=",".join(METHODS),
                   help="comma-separated methods, each optionally METHOD:VARIANT: full_vocab (early exits ignore the "
                        "heads' reduced vocabulary), eager or gather (batched verification schedule), paper (N_i=4, "
                        "k_d=2, no confidence gates), fixed (k=1, N_i=2, no gates), chain (the tuned policy drafting a "
                        "chain), static (a fixed tree of 5 nodes, width 4, depth 2), dynamic (EAGLE-2's tree of 6 "
                        "nodes, width 3, depth 2) or unguarded (the policy every round, no per-sequence choice); plain hispec/self_spec "
                        "use this machine's policy (derived from the adapter's calibration, or tuned here); a spec "
                        "ending in @b runs with the adapter of --heads-b (two adapters side by side)")
    p.add_argument("--heads-b", default=None, help="a second adapter, for the methods ending in @b")
    p.add_argument("--llama-bench", default=None, metavar="PATH",
                   help="llama.cpp's llama-bench, run on the same GGUF file once per prompt (default: $HISPEC_LLAMA_BENCH "
                        "or llama-bench on PATH; none found: not run)")
    p.add_argument("--max-new-tokens", type=positive_int, default=128)
    p.add_argument("--num-prompts", type=positive_int, default=len(CHAT_PROMPTS))
    p.add_argument("--prompts", default="builtin", choices=PROMPT_SETS,
                   help="prompt set: built-in chat prompts, ShareGPT first turns (sharegpt-code: those asking about "
                        "code), HumanEval problems, half/half "
                        "(mixed), plain text to continue without the chat template (continuation), or requests to "
                        "rewrite, annotate, extend or fix a given function (rewrite: HumanEval's solutions)")
    p.add_argument("--json", type=Path, default=None, help="write the numbers to this file")
    p.add_argument("--plot", type=Path, default=None, help="draw tokens/s and tokens per full pass per method (PNG)")
    p.add_argument("--profile", action="store_true",
                   help="also profile one autoregressive run: its time split into attention, linears and the rest")
    p.add_argument("--sweep", type=Path, nargs="?", const=Path("docs"), default=None, metavar="DIR",
                   help="sweep hispec/self_spec policies instead (JSON, table and plot per dtype to DIR, default docs/)")
    p.add_argument("--batch-sizes", type=positive_int_list, default=None, metavar="B1,B2,...",
                   help="batched throughput at these batch sizes instead (e.g. 1,2,4,8,16; prompts: max(B) unless "
                        "--num-prompts is given)")
    p.add_argument("--schedule", "--verify", default="gather", choices=["eager", "gather"],
                   help="batched full-verification schedule (see hispec_decode.engine.scheduler); a method may also "
                        "name its own, e.g. --methods autoregressive,hispec:eager,hispec:gather")
    p.add_argument("--max-batches", type=positive_int, default=None,
                   help="batched mode: decode at most this many batches per batch size (shorter runs)")
    add_config_args(p, SpeculativeConfig, POLICY_ARGS)
    add_config_args(p, SamplingParams, SAMPLING_ARGS)
    add_debug_arg(p)
    return p


def parse_args(argv: list[str] | None = None) -> tuple[argparse.ArgumentParser, argparse.Namespace]:
    """Parse and check the options (mistakes exit with status 2 before any model is loaded)."""
    p = build_parser()
    args = p.parse_args(argv)
    methods = [m for m in args.methods.split(",") if m]
    if not methods:
        p.error("--methods names no method")
    for spec in methods:
        try:  # before minutes of model loading
            if spec != "transformers":
                method_variant(spec)
        except ValueError as exc:
            p.error(str(exc))
        if spec.endswith(OTHER_HEADS) and args.heads_b is None:
            p.error(f"--methods {spec}: a method ending in {OTHER_HEADS} runs on --heads-b, which is not given")
    for dtype in args.dtypes.split(","):
        try:
            parse_dtype(resolve_dtype(args.base, dtype))
        except HiSpecError as exc:
            p.error(f"--dtypes: {exc}")
    return p, args


def main(argv: list[str] | None = None) -> int:
    p, args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    os.environ.setdefault("HISPEC_DERIVE", "now")  # compare each method at its derived policy, with nothing beside it
    return run_cli("hispec-bench", lambda: _run(args, p.get_default("num_prompts")), args.debug)


def _run(args: argparse.Namespace, default_num_prompts: int) -> int:
    bench_settings(args)  # policy and sampling values checked before loading
    for output in (args.json, args.plot):  # before minutes of measuring, not after
        if output is not None:
            check_writable(output.parent, f"the directory of {output}")
    if args.sweep is not None:
        check_writable(args.sweep, "--sweep")
    if args.sweep is not None:
        return _sweep(args)
    if args.batch_sizes is not None:
        return _batched(args, default_num_prompts)
    results = run_benchmark(args)
    print(format_table(results))
    write_json(args.json, results)
    if args.plot is not None:
        plot_methods(results, args.plot)
        print(f"wrote {args.plot}")
    return 0


def machine_line(results: dict[str, Any]) -> str:
    return f"machine: {machine.summary(results.get('machine') or {})}"


def plot_methods(results: dict[str, Any], path: Path) -> None:
    """Per dtype: tokens/s of each method (bars, with the ratio to autoregressive) and accepted
    tokens per full-model pass."""
    plt = pyplot("hispec-bench --plot")

    dtypes = list(results["dtypes"])
    fig, axes = plt.subplots(len(dtypes), 2, figsize=(12, 3.6 * len(dtypes)), squeeze=False)
    for (ax1, ax2), dtype in zip(axes, dtypes):
        rows = results["dtypes"][dtype]["methods"]
        names = list(rows)
        ax1.barh(names, [rows[m]["tokens_per_second"] for m in names], color="tab:blue")
        for y, m in enumerate(names):
            ratio = rows[m].get("ratio_to_autoregressive")
            if ratio:
                ax1.text(rows[m]["tokens_per_second"], y, f" {ratio:.2f}x AR", va="center", fontsize=8)
        ax1.set_xlabel("tokens/s")
        ax1.set_title(f"{dtype}: decoding speed (batch 1)")
        ax2.barh(names, [rows[m]["tokens_per_full_call"] or 0 for m in names], color="tab:green")
        ax2.set_xlabel("tokens per full-model pass")
        ax2.set_title(f"{dtype}: tokens per full pass")
        ax1.invert_yaxis()
        ax2.invert_yaxis()
    fig.tight_layout()
    save_figure(fig, path)
    plt.close(fig)


def write_json(path: Path | None, results: dict[str, Any]) -> None:
    if path is not None:
        write_text(path, json.dumps(results, indent=2, sort_keys=True) + "\n")
        print(f"wrote {path}")


def bench_settings(args: argparse.Namespace) -> tuple[SamplingParams, SpeculativeConfig]:
    """The settings every compared method shares (greedy unless --sample; policy options as given;
    each method spec then sets its own method and variant)."""
    return (SamplingParams(max_new_tokens=args.max_new_tokens, **config_overrides(args, SAMPLING_ARGS)),
            SpeculativeConfig(**config_overrides(args, POLICY_ARGS)))


def _sweep(args: argparse.Namespace) -> int:
    from ..api import HiSpecModel
    from .sweep import run_sweep, write_sweep

    for dtype in args.dtypes.split(","):
        model = HiSpecModel.from_pretrained(args.base, args.heads, dtype=dtype, batch_invariant=args.batch_invariant)
        policy = model.policy(bench_settings(args)[1], method="hispec")
        rows = run_sweep(model, policy, bench_prompts(model, args.num_prompts, args.prompts), args.max_new_tokens)
        write_sweep(rows, args.sweep, dtype)
        best = max(rows, key=lambda r: r["speedup_vs_autoregressive"])
        print(f"{dtype}: best {best['config']} at {best['speedup_vs_autoregressive']:.2f}x autoregressive; "
              f"table: {args.sweep / f'sweep-{dtype}.md'}")
    return 0


def _batched(args: argparse.Namespace, default_num_prompts: int) -> int:
    from ..api import HiSpecModel
    from .bench_batch import format_batched, plot_batched, run_batched

    sizes = args.batch_sizes
    num_prompts = max(sizes) if args.num_prompts == default_num_prompts else args.num_prompts
    results: dict[str, Any] = {"max_new_tokens": args.max_new_tokens, "prompts": args.prompts, "schedule": args.schedule,
                               "num_prompts": num_prompts, "max_batches": args.max_batches,
                               "machine": machine.describe(), "dtypes": {}}
    print(machine_line(results))
    dtypes = args.dtypes.split(",")
    models = {dtype: ModelVariants(lambda invariant, other, dtype=dtype: HiSpecModel.from_pretrained(
        args.base, args.heads_b if other else args.heads, dtype=dtype, batch_invariant=invariant),
        args.batch_invariant) for dtype in dtypes}
    prompts = bench_prompts(models[dtypes[0]]("autoregressive"), num_prompts, args.prompts)
    methods = [m for m in args.methods.split(",") if m]
    results["dtypes"] = run_batched(models, prompts, sizes, *bench_settings(args), methods, args.schedule,
                                    args.max_batches)
    for dtype, res in results["dtypes"].items():
        print(format_batched(res, dtype, first=dtypes[0] if len(dtypes) > 1 else None))
    write_json(args.json, results)
    if args.plot is not None:
        plot_batched(results, args.plot)
        print(f"wrote {args.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
