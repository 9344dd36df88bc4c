"""The Parquet shards of a self-distilled data set, checked against its manifest.

``hispec-selfdistill`` writes a shard (atomically, under a number never used before in the
directory), then the manifest that lists it. A run killed between the two leaves a complete shard
the manifest does not list yet; a user may delete or damage shards by hand. A resume therefore
reads every shard on disk and compares it with the manifest before it generates anything:

* a shard listed but missing: its answers are generated again (a warning says which);
* a complete shard on disk that the manifest does not list (a run killed before its manifest was
  written): adopted;
* a shard that cannot be read, or that differs from what the manifest lists, or a job found in two
  shards: the resume stops with one line naming the file (nothing is deleted or overwritten).

New shards are numbered after the highest number on disk or in the manifest, and a shard is never
written over an existing file.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hispec_decode.errors import HiSpecError
from hispec_decode.files import atomic_file

logger = logging.getLogger(__name__)

SHARD_PATTERN = "shard-{:05d}.parquet"
SHARD_NAME = re.compile(r"^shard-(\d{5,})\.parquet$")


@dataclass(frozen=True)
class Shard:
    """One shard as found on disk: its file name, the jobs it holds and their new tokens."""

    file: str
    jobs: tuple[int, ...]
    new_tokens: int

    def entry(self) -> dict[str, Any]:
        """The manifest's record of this shard."""
        return {"file": self.file, "records": len(self.jobs), "new_tokens": self.new_tokens}


def shard_paths(out: Path) -> list[Path]:
    return sorted(p for p in out.glob("shard-*.parquet") if SHARD_NAME.match(p.name))


def read_shard(path: Path) -> Shard:
    """The jobs and token count of one shard; a damaged file is one clear error naming it."""
    import pyarrow.parquet as pq

    try:
        table = pq.read_table(path, columns=["job", "new_tokens"])
        jobs, tokens = table.column("job").to_pylist(), table.column("new_tokens").to_pylist()
    except Exception as exc:  # pyarrow raises ArrowInvalid, OSError, KeyError... for damaged files
        raise HiSpecError(f"shard {path} is damaged ({type(exc).__name__}: {exc}); delete it and run --resume "
                          f"again to generate its answers anew") from exc
    return Shard(path.name, tuple(int(j) for j in jobs), int(sum(tokens)))


def check_shards(out: Path, listed: Any) -> list[Shard]:
    """Every shard of ``out``, checked against the manifest's ``shards`` entry (a list of
    :meth:`Shard.entry`; a count, in data sets written before shards were listed, checks nothing)."""
    on_disk = [read_shard(p) for p in shard_paths(out)]
    found = {s.file: s for s in on_disk}
    if isinstance(listed, list):
        names = set()
        for entry in listed:
            name = str(entry["file"])
            names.add(name)
            shard = found.get(name)
            if shard is None:
                logger.warning("shard %s listed in the manifest is missing: its %d answers are generated again",
                               name, int(entry["records"]))
            elif (len(shard.jobs), shard.new_tokens) != (int(entry["records"]), int(entry["new_tokens"])):
                raise HiSpecError(f"shard {out / name} holds {len(shard.jobs)} records and {shard.new_tokens} new "
                                  f"tokens, the manifest lists {entry['records']} and {entry['new_tokens']}: it was "
                                  f"changed or replaced; delete it and run --resume again to generate its answers anew")
        for shard in on_disk:
            if shard.file not in names:
                logger.info("shard %s is complete but not in the manifest (a run killed before updating it): kept",
                            shard.file)
    owner: dict[int, str] = {}
    for shard in on_disk:
        for job in shard.jobs:
            if job in owner:
                raise HiSpecError(f"job {job} is in both {out / owner[job]} and {out / shard.file}; delete one of "
                                  f"them and run --resume again")
            owner[job] = shard.file
    return on_disk


def next_index(out: Path, listed: Any) -> int:
    """One past the highest shard number on disk or in the manifest (numbers are never reused)."""
    names = [p.name for p in shard_paths(out)]
    if isinstance(listed, list):
        names += [str(e["file"]) for e in listed]
    numbers = [int(m[1]) for n in names if (m := SHARD_NAME.match(n))]
    return max(numbers, default=-1) + 1


def write_shard(out: Path, index: int, records: list[dict[str, Any]]) -> Shard:
    """Write ``records`` as shard ``index`` (atomically; never over an existing file)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = out / SHARD_PATTERN.format(index)
    if path.exists():
        raise HiSpecError(f"refusing to overwrite {path}: a shard of that number exists already")
    with atomic_file(path) as tmp:
        table = pa.Table.from_pylist(records)
        ids = table.schema.get_field_index("input_ids")
        table = table.set_column(ids, "input_ids", table.column(ids).cast(pa.list_(pa.int32())))
        pq.write_table(table, tmp, compression="zstd")
    return Shard(path.name, tuple(int(r["job"]) for r in records), sum(int(r["new_tokens"]) for r in records))


def answer_tokens(out: Path) -> list[list[int]]:
    """The base's own answers of every shard in ``out`` (each record's ids after its prompt)."""
    import pyarrow.parquet as pq

    answers = []
    for path in shard_paths(out):
        try:
            table = pq.read_table(path, columns=["input_ids", "prompt_tokens"])
        except Exception as exc:  # pyarrow raises many types for damaged files
            raise HiSpecError(f"shard {path} is damaged ({type(exc).__name__}: {exc})") from exc
        ids, starts = table.column("input_ids").to_pylist(), table.column("prompt_tokens").to_pylist()
        answers += [row[int(start):] for row, start in zip(ids, starts)]
    return answers
