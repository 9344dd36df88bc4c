"""Training checkpoints in safetensors + JSON only (heads, optimizer moments, step); no pickles.

The latest checkpoint is written to a temporary sibling directory and swapped into place
(:func:`hispec_decode.files.atomic_directory`), so a run killed mid-write keeps the previous one:
a killed run loses at most one save interval.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from hispec_decode.adapter import HiSpecAdapter
from hispec_decode.errors import HiSpecError
from hispec_decode.files import atomic_directory, atomic_file, clean_stale
from hispec_decode.models import DecoderModel

logger = logging.getLogger(__name__)

CHECKPOINT_DIR = "checkpoint"
OPTIMIZER_NAME = "optimizer.safetensors"
STATE_NAME = "trainer_state.json"


def save_checkpoint(run_dir: Path, adapter: HiSpecAdapter, optimizer: torch.optim.Optimizer | None,
                    state: dict[str, Any]) -> Path:
    """Heads, optimizer moments unless ``optimizer`` is None (DeepSpeed keeps them in its own,
    pickled format, which we neither write nor read), and the trainer state."""
    final = run_dir / CHECKPOINT_DIR
    with atomic_directory(final) as tmp:
        adapter.save_pretrained(tmp)
        if optimizer is not None:
            opt = optimizer.state_dict()
            tensors = {f"{idx}.{k}": v.detach().cpu().contiguous() for idx, s in opt["state"].items()
                       for k, v in s.items() if isinstance(v, torch.Tensor)}
            with atomic_file(tmp / OPTIMIZER_NAME) as path:
                save_file(tensors, str(path))
            state = state | {"param_groups": opt["param_groups"]}
        (tmp / STATE_NAME).write_text(json.dumps(state, indent=2, sort_keys=True))
    return final


def checkpoint_step(run_dir: Path) -> int | None:
    """The step of ``run_dir``'s checkpoint, or None when it holds none (a crashed save's
    leftovers are cleaned up, or restored if they hold the only copy)."""
    path = run_dir / CHECKPOINT_DIR
    clean_stale(path)
    if not (path / STATE_NAME).is_file():
        return None
    try:
        return int(json.loads((path / STATE_NAME).read_text())["step"])
    except (ValueError, KeyError, TypeError) as exc:
        raise HiSpecError(f"{path / STATE_NAME} is damaged ({exc}); start again with --overwrite") from exc


def load_heads(run_dir: Path, adapter: HiSpecAdapter, decoder: DecoderModel | None = None) -> dict[str, Any] | None:
    """Restore the heads from ``run_dir``'s checkpoint; returns the trainer state, or None when
    there is no checkpoint. Call it before DeepSpeed copies the heads into its own buffers."""
    path = run_dir / CHECKPOINT_DIR
    if not (path / STATE_NAME).is_file():
        return None
    saved = HiSpecAdapter.from_pretrained(path, decoder=decoder)
    adapter.load_state_dict(saved.state_dict())
    return json.loads((path / STATE_NAME).read_text())


def init_heads(source: str, adapter: HiSpecAdapter, decoder: DecoderModel, fingerprint: dict[str, Any],
               base_name: str, exit_vocab_size: int) -> None:
    """Start ``adapter``'s heads from the trained heads of ``source`` (an exported adapter, or a run
    directory: its checkpoint), exit vocabularies included. The base, the exits (layers, roles, head
    type and options) and the exit vocabulary's size must be the ones this run trains."""
    path = Path(source)
    if (path / CHECKPOINT_DIR / STATE_NAME).is_file():
        path = path / CHECKPOINT_DIR
    saved = HiSpecAdapter.from_pretrained(path, decoder=decoder)
    saved.config.check_base(fingerprint, base_name)
    want = [(e.layer, e.role, e.head_type, e.options) for e in adapter.config.exits]
    have = [(e.layer, e.role, e.head_type, e.options) for e in saved.config.exits]
    if want != have:
        raise HiSpecError(f"--init-heads {source}: its exits (layer, role, head type, options) are {have}, but this "
                          f"run trains {want}; give heads_layers, head_roles, head_type and head_options to match")
    sizes = {e.exit_vocab_size for e in saved.config.exits}
    if sizes != {exit_vocab_size}:
        raise HiSpecError(f"--init-heads {source}: its exit vocabularies hold {sorted(sizes)} tokens, but this run "
                          f"asks for exit_vocab_size={exit_vocab_size}; set it to match")
    for e in saved.config.exits:
        vocab = saved.head(e.layer).vocab
        adapter.head(e.layer).set_vocab(None if vocab is None else vocab.clone())
    adapter.load_state_dict(saved.state_dict())
    kept = {k: saved.config.training[k] for k in ("exit_vocab_size", "exit_vocab_coverage") if k in saved.config.training}
    adapter.config.training |= kept | {"initialised_from": {"adapter": str(source),
                                                            "steps": saved.config.training.get("steps")}}
    logger.info("heads start from %s (exits %s)", path, [e.layer for e in saved.config.exits])


def load_optimizer(run_dir: Path, optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> None:
    """Restore the AdamW moments saved beside the heads (absent after a DeepSpeed run)."""
    path = run_dir / CHECKPOINT_DIR
    if not (path / OPTIMIZER_NAME).is_file():
        logger.warning("checkpoint %s holds no optimizer moments (a DeepSpeed run): AdamW restarts from zero", path)
        return
    tensors = load_file(str(path / OPTIMIZER_NAME))
    opt_state: dict[int, dict[str, torch.Tensor]] = {}
    for key, value in tensors.items():
        idx, name = key.split(".", 1)
        opt_state.setdefault(int(idx), {})[name] = value
    optimizer.load_state_dict({"state": opt_state, "param_groups": state["param_groups"]})
