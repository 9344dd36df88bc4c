"""``hispec-train`` / ``scripts/train_heads.py``: train exit heads from a recipe.

    accelerate launch scripts/train_heads.py --recipe recipes/smollm2-135m.yaml [--key value ...]

Every key of :class:`hispec_train.config.TrainConfig` can be given as ``--key value`` (dashes or
underscores); command-line values override the recipe's.
"""

from __future__ import annotations

import logging
import sys

from hispec_decode.errors import HiSpecError

from .config import load_config, parse_overrides


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in ("-h", "--help"):
        from .config import TrainConfig

        print(__doc__)
        print("keys (in a recipe as key: value, on the command line as --key value):")
        print(TrainConfig.help())
        return 0
    recipe = None
    if "--recipe" in argv:
        i = argv.index("--recipe")
        recipe = argv[i + 1]
        del argv[i : i + 2]
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        cfg = load_config(recipe, parse_overrides(argv))
        from .trainer import train

        run_dir = train(cfg)
    except HiSpecError as exc:
        print(f"hispec-train: error: {exc}", file=sys.stderr)
        return 2
    print(f"run directory: {run_dir} (export with: hispec-export {run_dir} --out DIR)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
