"""``hispec-generate``: decode prompts with HiSpec (or a baseline) and print text and stats."""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from .errors import HiSpecError
from .prompts import encode_prompt


def add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--base", default=None, help="Hub id, local directory or .gguf file (default: embedded SmolLM2-135M-Instruct)")
    p.add_argument("--heads", default=None, help="adapter directory or Hub repo id with trained exit heads")
    p.add_argument("--dtype", default="float32", help="float32, bfloat16 or float16")


def add_policy_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--draft-layer", type=int, default=None, help="L_d (default: the adapter's draft head, else ~depth/8)")
    p.add_argument("--verify-layer", type=int, default=None, help="L_i (default: the adapter's intermediate head, else ~depth/4)")
    p.add_argument("--window", type=int, default=None, help="N_i: tentative tokens per full verification")
    p.add_argument("--num-draft", type=int, default=None, help="drafts per check (k for self_spec, k_d for hispec)")


def format_stats(stats: dict) -> str:
    def pct(x):
        return "-" if x is None else f"{100 * x:.1f}%"

    return (f"[{stats['method']}] {stats['new_tokens']} tokens in {stats['seconds']:.2f}s "
            f"({stats['tokens_per_second']:.1f} tok/s) | accepted at L_i {pct(stats['acceptance_intermediate'])}, "
            f"at L_f {pct(stats['acceptance_final'])} | calls draft/intermediate/full "
            f"{stats['calls_draft']}/{stats['calls_intermediate']}/{stats['calls_full']}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="hispec-generate", description=__doc__)
    add_model_args(p)
    p.add_argument("--method", default="hispec", choices=["hispec", "self_spec", "autoregressive"])
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="prompt text")
    src.add_argument("--prompt-file", type=Path, help="a file with one prompt per line")
    src.add_argument("--prompt-ids", help="space-separated token ids (for bases without a tokenizer)")
    p.add_argument("--chat", action="store_true", help="render prompts with the tokenizer's chat template")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--sample", action="store_true", help="sample instead of greedy decoding")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=None)
    add_policy_args(p)
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    from .model import HiSpecModel

    try:
        model = HiSpecModel.from_pretrained(args.base, args.heads, dtype=args.dtype)
        if args.prompt_ids is not None:
            rows = [[int(t) for t in args.prompt_ids.split()]]
        else:
            if model.tokenizer is None:
                raise HiSpecError("this base has no tokenizer: pass --prompt-ids")
            texts = [args.prompt] if args.prompt is not None else [l for l in args.prompt_file.read_text().splitlines() if l.strip()]
            rows = [encode_prompt(model.tokenizer, t, chat=args.chat) for t in texts]
        out = model.generate(rows, max_new_tokens=args.max_new_tokens, method=args.method, do_sample=args.sample,
                             temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed,
                             draft_layer=args.draft_layer, verify_layer=args.verify_layer, window=args.window,
                             num_draft=args.num_draft)
    except (HiSpecError, OSError) as exc:
        print(f"hispec-generate: error: {exc}", file=sys.stderr)
        return 2
    for seq in out.sequences:
        print(model.tokenizer.decode(seq, skip_special_tokens=True) if model.tokenizer is not None else " ".join(map(str, seq)))
        print("-" * 40)
    print(format_stats(out.stats))
    return 0


if __name__ == "__main__":
    sys.exit(main())
