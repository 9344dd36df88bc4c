"""The background derivation's worker (:mod:`hispec_decode.tuning.background` starts it): load the model as
the first decode did, with its threads, and derive this machine's record from the costs stored for it."""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path

import torch

from ..api import HiSpecModel
from ..tuning.background import lock_path
from ..tuning.record import machine_record


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    source, record = json.loads(args[0]), Path(args[1])
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    torch.set_num_threads(source.pop("threads"))
    try:
        model = HiSpecModel.from_pretrained(**source)
        return 0 if machine_record(model) is not None else 1
    finally:
        lock_path(record).unlink(missing_ok=True)
