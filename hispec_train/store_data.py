"""Batches from a feature store (:mod:`hispec_train.store`): what the trainer reads instead of
running the base.

A batch is ``batch_size`` windows of at most ``seq_len`` tokens, each inside one stored sequence
(so heads with attention see a real context), padded to the longest with ``valid`` False.
Windows are drawn by a generator seeded with ``(seed, step, micro, rank)``: a resumed run draws
what the uninterrupted run would have.
"""

from __future__ import annotations

import json
import math
import mmap
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from hispec_decode.adapter.fingerprint import fingerprint_id, fingerprints_match
from hispec_decode.errors import HiSpecError

from .store import SHARD_NAME, STORE_MANIFEST, StoreConfig, StoreManifest, plan_shards, token_sequences


@dataclass
class FeatureBatch:
    hidden: list[torch.Tensor]  # per head layer: [B, T, H] states after that layer
    final: torch.Tensor  # [B, T, H] final (normed) hidden state: the teacher
    input_ids: torch.Tensor  # [B, T] int64
    valid: torch.Tensor  # [B, T] bool: False on padding

    @property
    def tokens(self) -> int:
        return int(self.valid.sum())


SAFETENSORS_DTYPES = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32, "I32": torch.int32,
                      "I64": torch.int64}


def mapped_tensors(path: Path, keys: list[str]) -> dict[str, torch.Tensor]:
    """``keys`` of a safetensors file as tensors over a private memory map of it: a window's pages
    are read when a batch copies it out, and the kernel may drop them again, so a store larger than
    memory still trains (from the page cache where it fits). A short or malformed file raises
    ``ValueError`` naming what is wrong."""
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        head = f.read(8)
        length = int.from_bytes(head, "little") if len(head) == 8 else -1
        if not 0 < length <= size - 8:
            raise ValueError(f"not a safetensors file ({size} bytes, header length {length})")
        header = json.loads(f.read(length))
        mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)  # copy-on-write: a write never reaches the file
    out = {}
    for key in keys:
        if key not in header:
            raise ValueError(f"no tensor {key!r}")
        meta = header[key]
        dtype = SAFETENSORS_DTYPES.get(meta["dtype"])
        begin, end = meta["data_offsets"]
        count = math.prod(meta["shape"])
        if dtype is None or end - begin != count * dtype.itemsize or 8 + length + end > size:
            raise ValueError(f"tensor {key!r} ({meta['dtype']}, shape {meta['shape']}, bytes {begin}..{end}) does "
                             f"not fit the file's {size} bytes")
        flat = (torch.frombuffer(mapped, dtype=dtype, count=count, offset=8 + length + begin) if count
                else torch.empty(0, dtype=dtype))
        out[key] = flat.view(meta["shape"])
    return out


def answer_starts(directory: str | Path, split: str) -> list[int]:
    """Per sequence of the store's ``split`` (in its shards' order), the first position whose next token
    is the base's answer (its prompt's length less one): decoding drafts only from there on. Needs a
    store of a self-distilled data set, unchanged since the store was planned."""
    import pyarrow.parquet as pq

    from .selfdistill import MANIFEST_NAME

    manifest = StoreManifest.load(directory)
    data = Path(manifest.dataset)
    if not (data / MANIFEST_NAME).is_file():
        raise HiSpecError(f"feature store {directory}: its data set {manifest.dataset} is not a self-distilled one "
                          f"({MANIFEST_NAME} missing there), so where its answers start is unknown")
    seqs = token_sequences(str(data), None, manifest.plan["max_seq_len"])
    if len(seqs) != manifest.num_sequences:
        raise HiSpecError(f"feature store {directory}: its data set now holds {len(seqs)} sequences, "
                          f"{manifest.num_sequences} when the store was planned")
    prompts = [n for shard in sorted(data.glob("shard-*.parquet"))
               for n in pq.read_table(shard, columns=["prompt_tokens"]).column("prompt_tokens").to_pylist()]
    cfg = StoreConfig(str(data), str(directory), manifest.layers, **manifest.plan)
    plan = plan_shards(seqs, cfg)[split]
    starts = []
    for entry in manifest.shards[split]:
        index = next(i for i in range(len(plan)) if SHARD_NAME.format(split=split, index=i) == entry["file"])
        starts += [max(0, min(prompts[i], len(seqs[i])) - 1) for i in plan[index]]
    return starts


class FeatureStore:
    """A store's split, its shards memory-mapped (:func:`mapped_tensors`); windows are copied out per
    batch."""

    def __init__(self, directory: str | Path, layers: list[int], split: str, fingerprint: dict | None = None) -> None:
        self.manifest = StoreManifest.load(directory)
        missing = [l for l in layers if l not in self.manifest.layers]
        if missing:
            raise HiSpecError(f"feature store {directory} holds layers {self.manifest.layers}, not {missing}: "
                              f"rebuild it with hispec-store --layers including them")
        if fingerprint is not None and not fingerprints_match(self.manifest.fingerprint, fingerprint):
            raise HiSpecError(f"feature store {directory} was computed by another base ({self.manifest.base}, "
                              f"fingerprint {fingerprint_id(self.manifest.fingerprint)}), not this one "
                              f"({fingerprint_id(fingerprint)})")
        if not self.manifest.shards[split]:
            raise HiSpecError(f"feature store {directory} has no {split} shards")
        self.layers = layers
        self.shards = []
        for entry in self.manifest.shards[split]:
            path = Path(directory) / str(entry["file"])
            if not path.is_file():
                raise HiSpecError(f"feature store {directory}: shard {path.name} listed in {STORE_MANIFEST} is missing")
            try:
                self.shards.append(mapped_tensors(path, [*(f"hidden.{l}" for l in layers), "final", "input_ids", "offsets"]))
            except (ValueError, KeyError, TypeError) as exc:  # json's errors are ValueErrors
                raise HiSpecError(f"feature store shard {path} is damaged ({exc})") from exc
        # every stored sequence as (shard, start, length)
        self.sequences = [(s, int(o[i]), int(o[i + 1] - o[i])) for s, t in enumerate(self.shards)
                          for o in [t["offsets"]] for i in range(len(o) - 1)]
        self.weights = torch.tensor([float(n) for _, _, n in self.sequences])

    @property
    def num_tokens(self) -> int:
        return int(self.weights.sum())

    def window(self, seq: int, start: int, length: int, counted_from: int = 0) -> FeatureBatch:
        """Positions ``start ..`` of sequence ``seq``; ``valid`` only from its position ``counted_from``."""
        s, off, _ = self.sequences[seq]
        t, sl = self.shards[s], slice(off + start, off + start + length)
        valid = torch.arange(start, start + length)[None] >= counted_from
        return FeatureBatch([t[f"hidden.{l}"][sl][None] for l in self.layers], t["final"][sl][None],
                            t["input_ids"][sl].long()[None], valid)

    def batch(self, generator: torch.Generator, batch_size: int, seq_len: int, from_start: bool = False) -> FeatureBatch:
        """``batch_size`` random windows (sequences drawn in proportion to their length); ``from_start``:
        each window is its sequence's first ``seq_len`` tokens (sequences drawn in proportion to those)."""
        weights = self.weights.clamp(max=seq_len) if from_start else self.weights
        picks = torch.multinomial(weights, batch_size, replacement=True, generator=generator).tolist()
        rows = []
        for seq in picks:
            n = self.sequences[seq][2]
            start = 0 if from_start else int(torch.randint(0, max(1, n - seq_len + 1), (1,), generator=generator))
            rows.append(self.window(seq, start, min(seq_len, n)))
        return collate(rows)

    def sequential(self, batch_size: int, seq_len: int, max_tokens: int | None = None,
                   counted_from: list[int] | None = None) -> list[FeatureBatch]:
        """The split in order, in windows of ``seq_len`` (evaluation), up to ``max_tokens`` counted
        positions; ``counted_from``: per sequence, the first position that counts (``valid``), e.g.
        :func:`answer_starts`."""
        if counted_from is not None and len(counted_from) != len(self.sequences):
            raise HiSpecError(f"counted_from: {len(counted_from)} sequences given, the split holds {len(self.sequences)}")
        rows, seen = [], 0
        for seq, (_, _, n) in enumerate(self.sequences):
            first = counted_from[seq] if counted_from else 0
            for start in range(0, n, seq_len):
                if start + seq_len <= first:
                    continue  # nothing in this window counts
                rows.append(self.window(seq, start, min(seq_len, n - start), first))
                seen += rows[-1].tokens
                if max_tokens is not None and seen >= max_tokens:
                    break
            if max_tokens is not None and seen >= max_tokens:
                break
        return [collate(rows[i : i + batch_size]) for i in range(0, len(rows), batch_size)]


def collate(rows: list[FeatureBatch]) -> FeatureBatch:
    """Rows padded to the longest (zeros, ``valid`` False)."""
    width = max(r.input_ids.shape[1] for r in rows)

    def pad(x: torch.Tensor) -> torch.Tensor:
        extra = width - x.shape[1]
        if extra == 0:
            return x
        return torch.cat([x, x.new_zeros((1, extra, *x.shape[2:]))], dim=1)

    return FeatureBatch([torch.cat([pad(r.hidden[i]) for r in rows]) for i in range(len(rows[0].hidden))],
                        torch.cat([pad(r.final) for r in rows]), torch.cat([pad(r.input_ids) for r in rows]),
                        torch.cat([pad(r.valid) for r in rows]))
