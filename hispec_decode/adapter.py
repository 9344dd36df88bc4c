"""The on-disk adapter format: exit heads for one base model.

A directory (or Hub repo) holding

* ``hispec_config.json``: :class:`HiSpecAdapterConfig`, written with sorted keys;
* ``hispec_heads.safetensors``: the heads' weights only (never base weights), keys
  ``"<layer>.<param>"``, e.g. ``"4.proj.weight"``;
* ``README.md``: a model card (written by ``hispec-export``).

Reading is strict where it must be: missing keys, a wrong format version, missing or
corrupted weights, or tensors of the wrong shape fail with :class:`AdapterError`; unknown
config keys only warn (a newer writer may add fields).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from torch import nn

from .errors import AdapterError, FingerprintMismatchError
from .fingerprint import compute_fingerprint, fingerprint_id, fingerprints_match
from .heads import ExitHead, build_head, check_vocab, head_class

if TYPE_CHECKING:
    from .architectures import DecoderAdapter

logger = logging.getLogger(__name__)

CONFIG_NAME = "hispec_config.json"
WEIGHTS_NAME = "hispec_heads.safetensors"
MODEL_CARD_NAME = "README.md"
FORMAT_VERSION = 1
ROLES = ("draft", "intermediate", "extra")


@dataclass
class ExitHeadConfig:
    layer: int  # the head reads the hidden state after layers[0:layer]
    role: str  # "draft", "intermediate" or "extra"
    head_type: str
    norm_keys: list[str]
    shapes: dict[str, list[int]]  # parameter name -> shape, as stored
    options: dict[str, Any] = field(default_factory=dict)
    exit_vocab: int = 0  # size of the head's reduced vocabulary (its token ids stored as "<layer>.vocab"); 0: full


@dataclass
class HiSpecAdapterConfig:
    base_model: str
    base_fingerprint: dict[str, Any]
    num_hidden_layers: int
    hidden_size: int
    vocab_size: int
    exits: list[ExitHeadConfig]
    format_version: int = FORMAT_VERSION
    training: dict[str, Any] = field(default_factory=dict)

    # -- (de)serialisation -----------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> HiSpecAdapterConfig:
        data = dict(data)
        exits = [_strict(ExitHeadConfig, e, "exits[]") for e in data.pop("exits", None) or _missing("exits")]
        cfg = _strict(cls, data | {"exits": exits}, "config")
        if cfg.format_version != FORMAT_VERSION:
            raise AdapterError(f"adapter format version {cfg.format_version} is not supported (this HiSpec reads {FORMAT_VERSION})")
        cfg.validate()
        return cfg

    def save(self, directory: str | os.PathLike) -> None:
        path = Path(directory) / CONFIG_NAME
        path.write_text(json.dumps(self.to_dict(), indent=2, sort_keys=True) + "\n")

    @classmethod
    def load(cls, directory: str | os.PathLike) -> HiSpecAdapterConfig:
        path = Path(directory) / CONFIG_NAME
        if not path.is_file():
            raise AdapterError(f"{path} not found: not a HiSpec adapter directory")
        try:
            data = json.loads(path.read_text())
        except json.JSONDecodeError as exc:
            raise AdapterError(f"{path} is not valid JSON: {exc}") from exc
        return cls.from_dict(data)

    # -- checks ----------------------------------------------------------------------------
    def validate(self) -> None:
        layers = [e.layer for e in self.exits]
        if len(set(layers)) != len(layers):
            raise AdapterError(f"duplicate exit layers {layers}")
        for e in self.exits:
            if not 1 <= e.layer < self.num_hidden_layers:
                raise AdapterError(f"exit layer {e.layer} out of range 1..{self.num_hidden_layers - 1}")
            if e.role not in ROLES:
                raise AdapterError(f"exit at layer {e.layer}: unknown role {e.role!r} (roles: {', '.join(ROLES)})")
            if not isinstance(e.exit_vocab, int) or not 0 <= e.exit_vocab < self.vocab_size:
                raise AdapterError(f"exit at layer {e.layer}: exit_vocab must be an integer in 0..{self.vocab_size - 1} "
                                   f"(0: the full vocabulary); got {e.exit_vocab!r}")
        for role in ("draft", "intermediate"):
            if sum(e.role == role for e in self.exits) > 1:
                raise AdapterError(f"more than one exit has role {role!r}")

    def check_base(self, fingerprint: dict[str, Any], base_name: str) -> None:
        """Refuse a base these heads were not trained for."""
        if not fingerprints_match(self.base_fingerprint, fingerprint):
            raise FingerprintMismatchError(
                f"these heads were trained for base {self.base_model!r} (fingerprint "
                f"{fingerprint_id(self.base_fingerprint)}), but the loaded base is {base_name!r} "
                f"(fingerprint {fingerprint_id(fingerprint)})"
            )

    def layer_for(self, role: str) -> int | None:
        return next((e.layer for e in self.exits if e.role == role), None)


def _missing(key: str) -> Any:
    raise AdapterError(f"adapter config is missing required key {key!r}")


def _strict(cls: type, data: dict[str, Any], where: str) -> Any:
    """Build a dataclass: unknown keys warn, missing required keys fail."""
    fields = {f.name: f for f in dataclasses.fields(cls)}
    for key in sorted(set(data) - set(fields)):
        logger.warning("ignoring unknown key %r in adapter %s", key, where)
    required = [n for n, f in fields.items() if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]
    for key in required:
        if key not in data:
            raise AdapterError(f"adapter {where} is missing required key {key!r}")
    return cls(**{k: v for k, v in data.items() if k in fields})


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

    @classmethod
    def create(cls, base: DecoderAdapter, base_name: str, specs: list[ExitSpec],
               training: dict[str, Any] | None = None) -> HiSpecAdapter:
        """New heads for ``base``, each initialised to reproduce the base's own exit."""
        heads = {s.layer: head_class(s.head_type).from_base(base, s.layer, **s.options) for s in specs}
        exits = [
            ExitHeadConfig(s.layer, s.role, s.head_type, sorted(heads[s.layer].norm.keys()),
                           {k: list(v.shape) for k, v in heads[s.layer].state_dict().items()}, heads[s.layer].options())
            for s in specs
        ]
        config = HiSpecAdapterConfig(
            base_model=base_name, base_fingerprint=compute_fingerprint(base.model),
            num_hidden_layers=base.num_layers, hidden_size=base.config.hidden_size, vocab_size=base.vocab_size,
            exits=exits, training=dict(training or {}),
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
            e.exit_vocab = 0 if head.vocab is None else head.vocab.numel()
        tmp = out / (WEIGHTS_NAME + ".tmp")
        save_file(self.state_dict_flat(), str(tmp), metadata={"format": "pt", "hispec_format_version": str(FORMAT_VERSION)})
        os.replace(tmp, out / WEIGHTS_NAME)
        self.config.save(out)
        return out

    @classmethod
    def from_pretrained(cls, source: str | os.PathLike, revision: str | None = None,
                        base: DecoderAdapter | None = None) -> HiSpecAdapter:
        """Load from a local directory or a Hub repo id (heads built from a base layer, such as
        ``decoder_block``, need the ``base`` they were trained for)."""
        directory = _resolve(source, revision)
        config = HiSpecAdapterConfig.load(directory)
        weights = directory / WEIGHTS_NAME
        if not weights.is_file():
            raise AdapterError(f"{weights} not found: the adapter has a config but no weights")
        try:
            tensors = load_file(str(weights))
        except (SafetensorError, OSError, ValueError) as exc:
            raise AdapterError(f"{weights} is corrupted or not a safetensors file: {exc}") from exc
        heads = {}
        for e in config.exits:
            head = build_head(e.head_type, config.hidden_size, e.norm_keys, e.options, base)
            if e.exit_vocab:
                head.set_vocab(torch.arange(e.exit_vocab))  # a placeholder of the stored size
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
            if e.exit_vocab:
                check_vocab(state["vocab"], config.vocab_size, f"{weights}: {prefix}vocab")
            head.load_state_dict(state)
            heads[e.layer] = head
        stray = [k for k in tensors if k.split(".", 1)[0] not in {str(e.layer) for e in config.exits}]
        if stray:
            raise AdapterError(f"{weights} holds tensors for no configured exit: {stray[:5]}")
        return cls(config, heads)

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


def _resolve(source: str | os.PathLike, revision: str | None) -> Path:
    path = Path(source)
    if path.exists():
        if not path.is_dir():
            raise AdapterError(f"{path} is a file; an adapter is a directory holding {CONFIG_NAME} and {WEIGHTS_NAME}")
        return path
    if str(source).count("/") == 1 and not str(source).startswith((".", "/")):
        from huggingface_hub import snapshot_download

        try:
            return Path(snapshot_download(str(source), revision=revision, allow_patterns=[CONFIG_NAME, WEIGHTS_NAME, MODEL_CARD_NAME]))
        except Exception as exc:  # network, auth, missing repo: all end here
            raise AdapterError(f"could not fetch adapter {source!r} from the Hub: {exc}") from exc
    raise AdapterError(f"adapter {str(source)!r} not found (neither a local directory nor a Hub repo id)")
