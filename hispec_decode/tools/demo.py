"""The demo behind ``scripts/demo.sh``: HiSpec on a few built-in prompts, next to plain decoding.

HiSpec runs with the policy tuned for the heads (``hispec-tune``): where its exits are not good
enough to pay on this machine, the policy speculates little or not at all, so the speed-up shown
is an honest one, or parity, never a slowdown by design.
"""

from __future__ import annotations

import argparse
import logging
import sys
import time

from ..data.prompts import CHAT_PROMPTS, encode_prompt
from .args import add_model_args
from .cli import add_debug_arg, positive_int, run_cli
from .generate import format_stats


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m hispec_decode.tools.demo", description=__doc__)
    add_model_args(p)
    p.add_argument("--num-prompts", type=positive_int, default=3)
    p.add_argument("--max-new-tokens", type=positive_int, default=96)
    add_debug_arg(p)
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    return run_cli("hispec-demo", lambda: _run(args), args.debug)


def _run(args: argparse.Namespace) -> int:
    from ..api import HiSpecModel

    t0 = time.perf_counter()
    model = HiSpecModel.from_pretrained(args.base, args.heads, dtype=args.dtype, batch_invariant=args.batch_invariant)
    heads = ("none (exits use the base norm + LM head)" if model.adapter is None else
             ", ".join(f"L{e.layer} {e.role} ({e.head_type})" for e in model.adapter.config.exits))
    policy = model.policy(method="hispec")
    tuned = model.adapter is not None and model.adapter.config.tuned_policy("hispec", model.decoder.precision) is not None
    print(f"loaded {model.base_name} ({model.num_layers} layers, {model.decoder.precision}) in {time.perf_counter() - t0:.1f}s; "
          f"heads: {heads}\npolicy ({'tuned by hispec-tune' if tuned else 'default, not tuned'}): {policy}\n")
    model.generate([encode_prompt(model.tokenizer, "Hi")], max_new_tokens=4, method="autoregressive")  # warm-up
    model.generate([encode_prompt(model.tokenizer, "Hi")], max_new_tokens=4, method="hispec")
    total = {"hispec": [0, 0.0], "autoregressive": [0, 0.0]}  # tokens, seconds
    for text in CHAT_PROMPTS[: args.num_prompts]:
        ids = encode_prompt(model.tokenizer, text)
        base = model.generate([ids], max_new_tokens=args.max_new_tokens, method="autoregressive")
        fast = model.generate([ids], max_new_tokens=args.max_new_tokens, method="hispec")
        for name, out in (("hispec", fast), ("autoregressive", base)):
            total[name][0] += out.stats["new_tokens"]
            total[name][1] += out.stats["seconds"]
        print(f">>> {text}\n{model.tokenizer.decode(fast.sequences[0], skip_special_tokens=True)}\n")
        print("   ", format_stats(fast.stats))
        print("   ", format_stats(base.stats))
        same = "identical" if fast.sequences == base.sequences else "DIFFERENT (rounding differs between passes here; --batch-invariant makes it exact)"
        print(f"    speed-up {fast.stats['tokens_per_second'] / base.stats['tokens_per_second']:.2f}x, output {same}\n")
    speed = {name: tokens / seconds for name, (tokens, seconds) in total.items()}
    print(f"overall: hispec {speed['hispec']:.1f} tok/s, plain decoding {speed['autoregressive']:.1f} tok/s: "
          f"{speed['hispec'] / speed['autoregressive']:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
