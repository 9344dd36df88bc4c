"""An adapter's calibration: traces of the base decoding greedily, with every exit's top tokens.

What decides a policy splits in two. How often each exit agrees with the full model (by draft
position, tree rank and level) depends on the heads and the base only; what a pass over some rows
costs depends on the machine. An adapter ships the first part as the traces of its calibration
decoding (:class:`~.simulate.Trace`, in ``hispec_calibration.safetensors``); every machine measures
the second part itself and replays the traces under it (:mod:`.derive`).

Layout: per trace ``i``, ``{i}.tokens`` (prompt + continuation) and, per exit layer ``L``,
``{i}.top.{L}`` / ``{i}.conf.{L}`` ([positions, TOP_K]; ``.top_true`` / ``.conf_true`` for deep-context
heads); the metadata holds each trace's prompt length and limit, and the calibration's settings.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file

from ..adapter.config import CALIBRATION_NAME
from ..errors import AdapterError
from ..files import atomic_file
from .simulate import Trace, record_trace

_FIELDS = ("top", "conf", "top_true", "conf_true")


def record_calibration(model: Any, prompts: list[list[int]], max_new_tokens: int, layers: list[int]) -> list[Trace]:
    """Decode ``prompts`` greedily with ``model`` and record every exit in ``layers`` along them."""
    plain = model.generate(prompts, max_new_tokens=max_new_tokens, method="autoregressive")
    return [record_trace(model.runner, model.base_model, p, c, layers, max_new_tokens)
            for p, c in zip(prompts, plain.sequences)]


def save_calibration(directory: str | Path, traces: list[Trace], settings: dict[str, Any]) -> Path:
    """Write ``traces`` (and how they were made: prompts, dtype, ...) into the adapter ``directory``."""
    tensors: dict[str, torch.Tensor] = {}
    for i, t in enumerate(traces):
        tensors[f"{i}.tokens"] = torch.tensor(t.tokens, dtype=torch.int64)
        for name in _FIELDS:
            for layer, values in getattr(t, name).items():
                tensors[f"{i}.{name}.{layer}"] = torch.from_numpy(np.ascontiguousarray(values))
    shape = {"prompt_lengths": [t.prompt_length for t in traces], "limits": [t.limit for t in traces],
             "settings": settings}
    path = Path(directory) / CALIBRATION_NAME
    with atomic_file(path) as tmp:
        save_file(tensors, str(tmp), metadata={"hispec_calibration": json.dumps(shape, sort_keys=True)})
    return path


def load_calibration(path: str | Path) -> list[Trace]:
    """The traces of an adapter's calibration file (a clear error if it is damaged)."""
    path = Path(path)
    try:
        tensors = load_file(str(path))
        with safe_open(str(path), "pt") as f:
            shape = json.loads((f.metadata() or {})["hispec_calibration"])
        traces = []
        for i, (length, limit) in enumerate(zip(shape["prompt_lengths"], shape["limits"])):
            t = Trace(tensors[f"{i}.tokens"].tolist(), int(length), int(limit))
            for key, value in tensors.items():
                index, _, rest = key.partition(".")
                name, _, layer = rest.rpartition(".")
                if index == str(i) and name in _FIELDS:
                    getattr(t, name)[int(layer)] = value.numpy()
            if not t.top or set(t.top) != set(t.conf):
                raise ValueError(f"trace {i} has no exits or unpaired top/conf tensors")
            traces.append(t)
    except (SafetensorError, OSError, ValueError, KeyError, TypeError, json.JSONDecodeError) as exc:
        raise AdapterError(f"{path} is damaged or not a calibration file ({type(exc).__name__}: {exc}); "
                           f"record it again with hispec-tune --write-calibration") from exc
    if not traces:
        raise AdapterError(f"{path} holds no traces")
    return traces


def calibration_id(path: str | Path) -> str:
    """A short content hash: what a policy derived from this calibration is cached under."""
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()[:16]
