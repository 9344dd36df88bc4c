"""``python -m hispec_vllm [HEADS] [--num-speculative-tokens K]``: print the JSON for ``vllm serve --speculative-config``."""

from __future__ import annotations

import argparse
import json
import sys

from hispec_decode.errors import HiSpecError

from .draft import speculative_config


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m hispec_vllm", description=__doc__)
    parser.add_argument("heads", nargs="?", default=None, help="adapter directory or Hub id (default: the embedded heads)")
    parser.add_argument("--num-speculative-tokens", type=int, default=None, help="tokens per draft (default: tuned)")
    args = parser.parse_args(argv)
    try:
        print(json.dumps(speculative_config(args.heads, args.num_speculative_tokens)))
    except (HiSpecError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
