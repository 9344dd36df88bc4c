"""A GGUF file's header, read and checked before any work: every tensor's name, type, shape and byte
range, and where the file is cut or holds what this version cannot read.

The layout (ggml's ``docs/gguf.md``): the magic ``GGUF``, a version (2 or 3), the tensor and
metadata counts, the metadata key/value pairs, one record per tensor (name, dimensions, ggml type,
offset into the data section), then the data section at the next multiple of ``general.alignment``.
Little-endian files only (the big-endian variant is rare and named as such).

``read_header`` raises one :class:`~hispec_decode.errors.HiSpecError` line for a truncated header,
an unknown tensor type, or a tensor whose bytes run past the end of the file, naming the tensor and
its type.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

from ..errors import HiSpecError

MAGIC = b"GGUF"
VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32
# metadata value types: id -> struct format (8: string, 9: array, handled apart)
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9


@dataclass(frozen=True)
class TensorInfo:
    name: str
    shape: tuple[int, ...]  # ggml's order: the fastest-varying dimension first
    type_id: int
    offset: int  # from the start of the file
    nbytes: int

    @property
    def type_name(self) -> str:
        return type_name(self.type_id)


@dataclass
class GGUFHeader:
    path: Path
    version: int
    metadata: dict[str, Any] = field(default_factory=dict)
    tensors: list[TensorInfo] = field(default_factory=list)
    data_offset: int = 0
    file_size: int = 0


def type_name(type_id: int) -> str:
    from gguf import GGMLQuantizationType

    try:
        return GGMLQuantizationType(type_id).name
    except ValueError:
        return f"type {type_id}"


def _block(type_id: int) -> tuple[int, int] | None:
    """(values per block, bytes per block) of a ggml type, None if unknown."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    try:
        return GGML_QUANT_SIZES[GGMLQuantizationType(type_id)]
    except (ValueError, KeyError):
        return None


class _Cut(Exception):
    pass


class _Reader:
    def __init__(self, f: BinaryIO) -> None:
        self.f = f

    def take(self, n: int) -> bytes:
        data = self.f.read(n)
        if len(data) < n:
            raise _Cut()
        return data

    def scalar(self, fmt: str) -> Any:
        return struct.unpack(fmt, self.take(struct.calcsize(fmt)))[0]

    def string(self, limit: int) -> str:
        n = self.scalar("<Q")
        if n > limit:
            raise _Cut()  # a length past the file's end: the header is damaged
        return self.take(n).decode("utf-8", errors="replace")

    def value(self, kind: int, limit: int) -> Any:
        if kind in _SCALARS:
            return self.scalar(_SCALARS[kind])
        if kind == _STRING:
            return self.string(limit)
        if kind == _ARRAY:
            item, count = self.scalar("<I"), self.scalar("<Q")
            if count > limit:
                raise _Cut()
            return [self.value(item, limit) for _ in range(count)]
        raise ValueError(f"unknown metadata value type {kind}")


def read_header(path: str | Path) -> GGUFHeader:
    """The header of the GGUF file at ``path``, checked against the file's size (see the module
    docstring); raises :class:`HiSpecError` with one line naming what is wrong."""
    path = Path(path)
    try:
        size = path.stat().st_size
        f = open(path, "rb")
    except OSError as exc:
        raise HiSpecError(f"cannot read the GGUF file {path}: {exc.strerror or exc}") from None
    where = "its magic number"
    with f:
        r = _Reader(f)
        try:
            magic = r.take(4)
            if magic != MAGIC:
                raise HiSpecError(f"{path} is not a GGUF file (it starts with {magic!r}, not {MAGIC!r})")
            where = "its version"
            version = r.scalar("<I")
            if version not in VERSIONS:
                swapped = struct.unpack(">I", struct.pack("<I", version))[0]
                what = "a big-endian GGUF file, which" if swapped in VERSIONS else f"GGUF version {version}, which"
                raise HiSpecError(f"{path} is {what} this version cannot read (it reads little-endian versions "
                                  f"{', '.join(map(str, VERSIONS))})")
            header = GGUFHeader(path, version, file_size=size)
            where = "its counts"
            n_tensors, n_kv = r.scalar("<Q"), r.scalar("<Q")
            where = f"{n_tensors:,} tensor records and {n_kv:,} metadata entries cannot fit"
            if n_tensors * 24 + n_kv * 12 > size:  # the least bytes a record (an entry) takes
                raise _Cut()
            for i in range(n_kv):
                where = f"metadata entry {i + 1} of {n_kv}"
                key = r.string(size)
                where = f"metadata entry {key!r}"
                header.metadata[key] = r.value(r.scalar("<I"), size)
            infos = []
            for i in range(n_tensors):
                where = f"the record of tensor {i + 1} of {n_tensors}"
                name = r.string(size)
                where = f"the record of tensor {name!r}"
                dims = r.scalar("<I")
                if dims > 8:
                    raise _Cut()
                shape = tuple(r.scalar("<Q") for _ in range(dims))
                infos.append((name, shape, r.scalar("<I"), r.scalar("<Q")))
            end = f.tell()
        except _Cut:
            raise HiSpecError(f"the GGUF file {path} is cut or damaged in its header ({where}; the file has "
                              f"{size:,} bytes)") from None
        except (ValueError, struct.error) as exc:
            raise HiSpecError(f"the GGUF file {path} is damaged in its header ({where}): {exc}") from None
    alignment = header.metadata.get("general.alignment", DEFAULT_ALIGNMENT)
    if not isinstance(alignment, int) or alignment <= 0:
        raise HiSpecError(f"the GGUF file {path} has general.alignment = {alignment!r}; it must be a positive integer")
    header.data_offset = -(-end // alignment) * alignment
    for name, shape, type_id, offset in infos:
        block = _block(type_id)
        if block is None:
            raise HiSpecError(f"the GGUF file {path} holds tensor {name!r} of ggml type {type_id}, which this "
                              f"version cannot read")
        values = 1
        for d in shape:
            values *= d
        per, nbytes = block
        if values % per:
            raise HiSpecError(f"the GGUF file {path} holds tensor {name!r} ({type_name(type_id)}) of shape "
                              f"{list(shape)}, which is not a whole number of {per}-value blocks")
        info = TensorInfo(name, shape, type_id, header.data_offset + offset, values // per * nbytes)
        if info.offset + info.nbytes > size:
            raise HiSpecError(f"the GGUF file {path} is cut: tensor {name!r} ({info.type_name}) needs bytes "
                              f"{info.offset:,} to {info.offset + info.nbytes:,}, but the file has {size:,}")
        header.tensors.append(info)
    return header
