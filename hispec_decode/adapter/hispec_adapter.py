"""``HiSpecAdapter``: exit heads for one base model, on disk or on the Hub.

A directory (or Hub repo) holding

* ``hispec_config.json``: :class:`~hispec_decode.adapter.config.HiSpecAdapterConfig`;
* ``hispec_heads.safetensors``: the heads' weights only (never base weights), keys
  ``"<layer>.<param>"``, e.g. ``"4.proj.weight"``;
* ``README.md``: a model card (written by ``hispec-export``).

``save_pretrained`` / ``from_pretrained`` / ``push_to_hub`` are symmetric. Missing or corrupted
weights and tensors of the wrong shape fail with :class:`AdapterError`.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from torch import nn

from ..errors import AdapterError, HiSpecError
from ..hub import check_fetchable
from ..files import atomic_file, clean_stale
from ..models.exit_heads import ExitHead, check_vocab
from ..models.head_types import build_head, head_class
from .config import CALIBRATION_NAME, CONFIG_NAME, MODEL_CARD_NAME, VLLM_BASE_CONFIG_NAME, WEIGHTS_NAME, ExitHeadConfig, HiSpecAdapterConfig
from .fingerprint import compute_fingerprint
from .vocabulary import VOCAB_NAME

if TYPE_CHECKING:
    from ..models.base import DecoderModel


@dataclass(frozen=True)
class ExitSpec:
    """What to build at one exit: ``HiSpecAdapter.create`` turns a list of these into heads."""

    layer: int
    role: str
    head_type: str = "norm"
    options: dict[str, Any] = field(default_factory=dict)


class HiSpecAdapter(nn.Module):
    """Exit heads plus their config; ``save_pretrained`` / ``from_pretrained`` / ``push_to_hub``."""

    def __init__(self, config: HiSpecAdapterConfig, heads: dict[int, ExitHead]) -> None:
        super().__init__()
        self.config = config
        self.heads = nn.ModuleDict({str(layer): head for layer, head in sorted(heads.items())})
        self.calibration_path: Path | None = None  # its calibration traces, where the directory holds them
        self.vocab_path: Path | None = None  # its token ranking for the vocabulary level (adapter.vocabulary)

    @classmethod
    def create(cls, decoder: DecoderModel, base_name: str, specs: list[ExitSpec],
               training: dict[str, Any] | None = None, base_revision: str | None = None) -> HiSpecAdapter:
        """New heads for the base ``decoder`` runs, each initialised to reproduce the base's own exit."""
        heads = {s.layer: head_class(s.head_type).from_base(decoder, s.layer, **s.options) for s in specs}
        exits = [
            ExitHeadConfig(s.layer, s.role, s.head_type, sorted(heads[s.layer].norm.keys()),
                           {k: list(v.shape) for k, v in heads[s.layer].state_dict().items()}, heads[s.layer].options())
            for s in specs
        ]
        config = HiSpecAdapterConfig(
            base_model=base_name, base_fingerprint=compute_fingerprint(decoder.model),
            num_hidden_layers=decoder.num_layers, hidden_size=decoder.config.hidden_size, vocab_size=decoder.vocab_size,
            exits=exits, base_revision=base_revision, training=dict(training or {}),
        )
        config.validate()
        return cls(config, heads)

    def head(self, layer: int) -> ExitHead | None:
        return self.heads[str(layer)] if str(layer) in self.heads else None

    def state_dict_flat(self) -> dict[str, torch.Tensor]:
        return {f"{layer}.{k}": v.detach().contiguous() for layer, h in self.heads.items() for k, v in h.state_dict().items()}

    def save_pretrained(self, directory: str | os.PathLike) -> Path:
        out = Path(directory)
        out.mkdir(parents=True, exist_ok=True)
        for e in self.config.exits:  # the config describes exactly what is stored
            head = self.head(e.layer)
            if head.vocab is not None:
                check_vocab(head.vocab, self.config.vocab_size, f"exit vocabulary of layer {e.layer}")
            e.shapes = {k: list(v.shape) for k, v in head.state_dict().items()}
            e.exit_vocab_size = 0 if head.vocab is None else head.vocab.numel()
        # one metadata key: safetensors orders several at random, and the same heads must give the same bytes
        with atomic_file(out / WEIGHTS_NAME) as tmp:
            save_file(self.state_dict_flat(), str(tmp), metadata={"format": "pt"})
        self.config.save_pretrained(out)
        return out

    @classmethod
    def from_pretrained(cls, source: str | os.PathLike, revision: str | None = None,
                        decoder: DecoderModel | None = None) -> HiSpecAdapter:
        """Load from a local directory or a Hub repo id (heads built from a base layer, such as
        ``decoder_block``, need the ``decoder`` of the base they were trained for)."""
        directory = _resolve(source, revision)
        config = HiSpecAdapterConfig.from_pretrained(directory)
        weights = directory / WEIGHTS_NAME
        if not weights.is_file():
            raise AdapterError(f"{weights} not found: the adapter has a config but no weights")
        try:
            tensors = load_file(str(weights))
        except (SafetensorError, OSError, ValueError) as exc:
            raise AdapterError(f"{weights} is corrupted or not a safetensors file: {exc}") from exc
        heads = {}
        for e in config.exits:
            head = build_head(e.head_type, config.hidden_size, e.norm_keys, e.options, decoder)
            if e.exit_vocab_size:
                head.set_vocab(torch.arange(e.exit_vocab_size))  # a placeholder of the stored size
            prefix = f"{e.layer}."
            state = {k[len(prefix) :]: v for k, v in tensors.items() if k.startswith(prefix)}
            expected = head.state_dict()
            if set(state) != set(expected):
                raise AdapterError(
                    f"{weights}: head at layer {e.layer} ({e.head_type}) expects tensors {sorted(expected)}, "
                    f"found {sorted(state)}"
                )
            for k, v in state.items():
                if tuple(v.shape) != tuple(expected[k].shape):
                    raise AdapterError(f"{weights}: {prefix}{k} has shape {tuple(v.shape)}, expected {tuple(expected[k].shape)}")
                if list(v.shape) != list(e.shapes.get(k, v.shape)):
                    raise AdapterError(f"{weights}: {prefix}{k} has shape {tuple(v.shape)}, but {CONFIG_NAME} says "
                                       f"{tuple(e.shapes[k])}")
                if v.is_floating_point() and not bool(torch.isfinite(v).all()):
                    raise AdapterError(f"{weights}: {prefix}{k} holds NaN or infinite values; these heads are broken "
                                       f"(retrain or re-export them)")
            if e.exit_vocab_size:
                check_vocab(state["vocab"], config.vocab_size, f"{weights}: {prefix}vocab")
            head.load_state_dict(state)
            heads[e.layer] = head
        stray = [k for k in tensors if k.split(".", 1)[0] not in {str(e.layer) for e in config.exits}]
        if stray:
            raise AdapterError(f"{weights} holds tensors for no configured exit: {stray[:5]}")
        adapter = cls(config, heads)
        calibration = directory / CALIBRATION_NAME
        adapter.calibration_path = calibration if calibration.is_file() else None
        vocab = directory / VOCAB_NAME
        adapter.vocab_path = vocab if vocab.is_file() else None
        return adapter

    def push_to_hub(self, repo_id: str, private: bool = False, revision: str | None = None,
                    commit_message: str = "Upload HiSpec adapter", local_dir: str | os.PathLike | None = None) -> str:
        """Save (unless ``local_dir`` already holds the export) and upload the directory."""
        import tempfile

        from huggingface_hub import HfApi

        with tempfile.TemporaryDirectory() as tmp:
            folder = Path(local_dir) if local_dir is not None else self.save_pretrained(tmp)
            api = HfApi()
            api.create_repo(repo_id, private=private, exist_ok=True)
            if revision is not None:
                api.create_branch(repo_id, branch=revision, exist_ok=True)
            info = api.upload_folder(repo_id=repo_id, folder_path=str(folder), revision=revision,
                                     commit_message=commit_message)
        return str(info)


def check_source(source: object, revision: object = None) -> None:
    """Fail before any work where ``source`` cannot name an adapter: its type, or a Hub id that cannot
    be fetched (not cached and the Hub unreachable)."""
    if not isinstance(source, (str, os.PathLike)):
        raise AdapterError(f"heads must be a path, a Hub repo id, 'none' or None; got {type(source).__name__} "
                           f"{source!r:.60}")
    if revision is not None and not isinstance(revision, str):
        raise AdapterError(f"revision must be a string or None; got {type(revision).__name__} {revision!r:.60}")
    if not Path(source).exists() and _hub_shaped(source):
        try:
            check_fetchable(str(source), "adapter", CONFIG_NAME)
        except HiSpecError as exc:
            raise AdapterError(str(exc)) from None


def _hub_shaped(source: str | os.PathLike) -> bool:
    return str(source).count("/") == 1 and not str(source).startswith((".", "/"))


def _resolve(source: str | os.PathLike, revision: str | None) -> Path:
    check_source(source, revision)
    path = Path(source)
    clean_stale(path)  # a writer killed mid-swap may have left the previous version aside
    if path.exists():
        if not path.is_dir():
            raise AdapterError(f"{path} is a file; an adapter is a directory holding {CONFIG_NAME} and {WEIGHTS_NAME}")
        return path
    if _hub_shaped(source):
        from huggingface_hub import snapshot_download

        try:
            return Path(snapshot_download(str(source), revision=revision, allow_patterns=[CONFIG_NAME, WEIGHTS_NAME, MODEL_CARD_NAME,
                                                                                   VLLM_BASE_CONFIG_NAME, CALIBRATION_NAME, VOCAB_NAME]))
        except Exception as exc:  # network, auth, missing repo: all end here
            raise AdapterError(f"could not fetch adapter {source!r} from the Hub: {exc}") from exc
    raise AdapterError(f"adapter {str(source)!r} not found (neither a local directory nor a Hub repo id)")
