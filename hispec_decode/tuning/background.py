"""The policy derivation in a background process, so that the first decode on a new machine does not wait
for it.

The first ``hispec`` decode on a machine measures the pass costs (seconds: the timings must not share the
CPU with anything) and replays only the adapter's shipped policy on its calibration traces, which gives
each sequence's round chooser its priors (:func:`hispec_decode.tuning.record.machine_record`). The grid of
candidate policies, the longer part, is replayed by a worker started here
(:mod:`hispec_decode.tools.derive_worker`, in a process of its own): it loads the same model at the lowest CPU priority (``nice`` 19: it runs on what decoding leaves
idle), derives from the stored costs and stores the record, which later loads use. While it runs, a
``<record>.deriving`` file holds its process id (a load finding a live one starts no second worker); its
log is ``<record>.log``.

``HISPEC_DERIVE=now`` derives in the foreground instead (the tests, ``hispec-bench`` and the worker itself).
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch

logger = logging.getLogger(__name__)

ENV = "HISPEC_DERIVE"  # "now": derive in the foreground; anything else (default): in the background
WORKER = "hispec_decode.tools.derive_worker"  # the worker's module (above the model's API, which it loads)


def wanted(model: Any) -> bool:
    """Whether ``model``'s derivation runs in a worker: unless ``HISPEC_DERIVE=now``, and where the model
    knows how it was loaded (a worker loads it again)."""
    return os.environ.get(ENV, "background") != "now" and getattr(model, "source", None) is not None


def lock_path(record: Path) -> Path:
    return record.with_name(record.name + ".deriving")


def running(record: Path) -> bool:
    """Whether a worker for ``record`` is alive (its lock names a live process)."""
    try:
        pid = int(lock_path(record).read_text().strip())
        os.kill(pid, 0)
    except (OSError, ValueError):
        return False
    return True


def start(model: Any, record: Path) -> None:
    """Start a worker deriving ``model``'s record at ``record`` unless one runs already."""
    if running(record):
        return
    log = open(record.with_name(record.name + ".log"), "ab")  # noqa: SIM115 - the worker owns it
    env = dict(os.environ, **{ENV: "now"})
    source = {**model.source, "threads": torch.get_num_threads()}  # the machine key's threads: the same record
    worker = subprocess.Popen([sys.executable, "-c", f"import sys; from {WORKER} import main; sys.exit(main())",
                               json.dumps(source), str(record)],
                              stdin=subprocess.DEVNULL, stdout=log, stderr=log, env=env, start_new_session=True,
                              preexec_fn=lambda: os.nice(19))
    log.close()
    lock_path(record).write_text(f"{worker.pid}\n")
    logger.info("hispec: deriving this machine's decoding policy in the background (process %d, log %s.log); "
                "until it is done, the adapter's shipped policy runs", worker.pid, record)
