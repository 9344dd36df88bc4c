"""``hispec-train`` / ``scripts/train_heads.py``: train exit heads from a recipe.

    accelerate launch scripts/train_heads.py --recipe recipes/smollm2-135m.yaml [--key value ...]

Every key of :class:`hispec_train.config.TrainConfig` can be given as ``--key value`` or
``--key=value`` (dashes or underscores in the key); command-line values override the recipe's.
A run directory that holds a checkpoint needs ``--resume`` (continue) or ``--overwrite`` (start
again); ``--debug`` shows tracebacks.
"""

from __future__ import annotations

import logging
import sys

from hispec_decode.errors import HiSpecError
from hispec_decode.tools.cli import run_cli

from .config import load_config, parse_overrides


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "-h" in argv or "--help" in argv:
        from .config import TrainConfig

        print(__doc__)
        print("keys (in a recipe as key: value, on the command line as --key value):")
        print(TrainConfig.help())
        return 0
    debug = "--debug" in argv
    argv = [a for a in argv if a != "--debug"]
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    return run_cli("hispec-train", lambda: _run(argv), debug, extra="train")


def _run(argv: list[str]) -> int:
    overrides = parse_overrides(argv)
    recipe = overrides.pop("recipe", None)
    if recipe == "true":
        raise HiSpecError("--recipe needs a path")
    if "dataset" in overrides and overrides.get("features") not in (None, "none", "null"):
        raise HiSpecError(f"both --dataset {overrides['dataset']} and --features {overrides['features']} are given: "
                          f"train from a data set (the base runs each batch) or from a feature store")
    cfg = load_config(recipe, overrides)
    from .trainer import train

    run_dir = train(cfg)
    print(f"run directory: {run_dir} (export with: hispec-export {run_dir} --out DIR)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
