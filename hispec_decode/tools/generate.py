"""``hispec-generate``: decode prompts with HiSpec (or a baseline) and print text and stats."""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from ..config import EngineConfig, SpeculativeConfig, field_names, split_overrides
from ..data.prompts import encode_prompt
from ..errors import HiSpecError
from ..sampling_params import SamplingParams
from .args import add_config_args, add_model_args, config_overrides
from .cli import add_debug_arg, run_cli

SETTINGS = (SamplingParams, SpeculativeConfig, EngineConfig)  # every field of each is an option


def format_stats(stats: dict) -> str:
    def pct(x):
        return "-" if x is None else f"{100 * x:.1f}%"

    return (f"[{stats['method']}] {stats['new_tokens']} tokens in {stats['seconds']:.2f}s "
            f"({stats['tokens_per_second']:.1f} tok/s) | accepted at L_i {pct(stats['acceptance_intermediate'])}, "
            f"at L_f {pct(stats['acceptance_final'])} | calls draft/intermediate/full "
            f"{stats['calls_draft']}/{stats['calls_intermediate']}/{stats['calls_full']}")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="hispec-generate", description=__doc__)
    add_model_args(p)
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="prompt text")
    src.add_argument("--prompt-file", type=Path, help="a file with one prompt per line")
    src.add_argument("--prompt-ids", type=_prompt_ids, help="space-separated token ids (for bases without a tokenizer)")
    p.add_argument("--chat", action="store_true", help="render prompts with the tokenizer's chat template")
    p.set_defaults(max_new_tokens=128)
    for cls in SETTINGS:
        add_config_args(p, cls, field_names(cls))
    add_debug_arg(p)
    return p


def _prompt_ids(text: str) -> list[int]:
    try:
        return [int(t) for t in text.split()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--prompt-ids takes space-separated integers; got {text!r}") from None


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    return run_cli("hispec-generate", lambda: _run(args), args.debug)


def _run(args: argparse.Namespace) -> int:
    from ..api import HiSpecModel

    overrides = config_overrides(args, [name for cls in SETTINGS for name in field_names(cls)])
    split_overrides(None, None, None, overrides)  # checked before loading
    texts = None
    if args.prompt is not None:
        texts = [args.prompt]
    elif args.prompt_file is not None:
        texts = [line for line in args.prompt_file.read_text().splitlines() if line.strip()]
        if not texts:
            raise HiSpecError(f"--prompt-file {args.prompt_file} holds no prompt")
    model = HiSpecModel.from_pretrained(args.base, args.heads, dtype=args.dtype, batch_invariant=args.batch_invariant)
    if texts is None:
        rows = [args.prompt_ids]
    else:
        if model.tokenizer is None:
            raise HiSpecError("this base has no tokenizer: pass --prompt-ids")
        if args.chat and not getattr(model.tokenizer, "chat_template", None):
            raise HiSpecError(f"--chat: {model.base_name!r} has no chat template (a base model, not an instruct "
                              f"one); leave out --chat to continue the prompt as plain text")
        rows = [encode_prompt(model.tokenizer, t, chat=args.chat) for t in texts]
    out = model.generate(rows, **overrides)
    for seq in out.sequences:
        print(model.tokenizer.decode(seq, skip_special_tokens=True) if model.tokenizer is not None else " ".join(map(str, seq)))
        print("-" * 40)
    print(format_stats(out.stats))
    return 0


if __name__ == "__main__":
    sys.exit(main())
