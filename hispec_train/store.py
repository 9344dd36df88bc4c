"""The feature store: hidden states of the frozen base, computed once, read by every training run.

Training a light head costs far less than the base forward that feeds it, so ``hispec-store``
runs the base once per sequence and writes, per token, the hidden state after each chosen exit
layer and the final (normed) hidden state, from which the frozen LM head gives the teacher's
logits. Heads then train from the store without the base (:mod:`hispec_train.store_data`):
position-wise heads read random blocks of tokens, heads with attention read whole sequences.

Layout of a store directory::

    hispec_store.json               manifest: base, fingerprint, layers, dtype, shards, sizes
    train-00000.safetensors ...     hidden.<layer> [N, H], final [N, H] (dtype), input_ids [N] int32,
    eval-00000.safetensors  ...     offsets [S + 1] int64 (where each of the S sequences starts)

Bytes per token: ``(len(layers) + 1) * hidden_size * 2 + 4`` in bfloat16 (the final state has the
LM head's input size, narrower for OPT models with ``project_out``) (SmolLM2-135M with
layers 4 and 8: 3,460 B; every second layer: 17,284 B). Where it stops paying: the store
replaces one base forward per epoch with a disk read of that size per token; for a 7B base
(hidden 4096) two exits cost 24.6 KB/token (49 GB per 2M tokens), still cheaper than a 7B
forward per epoch on any disk; for a 70B base (hidden 8192) with several exits the store
outgrows local disks past a few million tokens, and a single-epoch run gains nothing from it:
train those with ``base_forward`` directly (the store is optional).
"""

from __future__ import annotations

import argparse
import json
import logging
import random
import sys
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Iterator

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from tqdm.auto import tqdm

from hispec_decode.errors import HiSpecError
from hispec_decode.files import atomic_file, check_writable, is_temporary, remove_tree, write_text
from hispec_decode.models import parse_dtype
from hispec_decode.tools.cli import add_debug_arg, positive_int, positive_int_list, run_cli

from .allocator import keep_freed_memory
from .data import check_dataset

logger = logging.getLogger(__name__)

STORE_MANIFEST = "hispec_store.json"
SHARD_NAME = "{split}-{index:05d}.safetensors"
SPLITS = ("train", "eval")


@dataclass
class StoreConfig:
    dataset: str  # a self-distilled directory (hispec-selfdistill), or any hispec-train data set
    out: str
    layers: list[int]
    base: str | None = None
    dtype: str = "bfloat16"  # of the base forward and of the stored states (native: GGUF blocks, bf16 states)
    max_tokens: int | None = None  # tokens to store in all (None: the whole data set)
    max_seq_len: int = 2048  # longer sequences are cut
    eval_sequences: int = 64  # held-out sequences (the first of a seeded shuffle)
    shard_tokens: int = 65_536
    batch_tokens: int = 4096  # padded tokens per base forward
    seed: int = 0
    resume: bool = False
    overwrite: bool = False


PLAN_KEYS = ("max_tokens", "max_seq_len", "eval_sequences", "shard_tokens", "seed")  # what decides the shards


@dataclass
class StoreManifest:
    base: str
    fingerprint: dict[str, Any]  # of the base (compared with a tolerance: another dtype of it still matches)
    layers: list[int]
    dtype: str
    hidden_size: int
    num_layers: int
    dataset: str
    num_sequences: int  # in the data set when the store was planned (a resume needs the same)
    bytes_per_token: int
    plan: dict[str, Any] = field(default_factory=dict)  # the PLAN_KEYS the shards were cut with
    shards: dict[str, list[dict[str, int | str]]] = field(default_factory=lambda: {s: [] for s in SPLITS})

    def tokens(self, split: str) -> int:
        return sum(int(s["tokens"]) for s in self.shards[split])

    def save(self, directory: Path) -> None:
        write_text(directory / STORE_MANIFEST, json.dumps(asdict(self), indent=2, sort_keys=True))

    @classmethod
    def load(cls, directory: str | Path) -> StoreManifest:
        path = Path(directory) / STORE_MANIFEST
        if not path.is_file():
            raise HiSpecError(f"{directory} is not a feature store ({STORE_MANIFEST} missing; build one with hispec-store)")
        try:
            return cls(**json.loads(path.read_text()))
        except (ValueError, TypeError) as exc:
            raise HiSpecError(f"{path} is damaged ({exc})") from exc


def token_sequences(dataset: str, tokenizer, max_seq_len: int) -> list[list[int]]:
    """One token sequence per record: a self-distilled data set's exact ids, or chat-rendered records."""
    from .selfdistill import MANIFEST_NAME

    path = Path(dataset)
    if (path / MANIFEST_NAME).is_file():
        import pyarrow.parquet as pq

        seqs = []
        for shard in sorted(path.glob("shard-*.parquet")):
            seqs.extend(pq.read_table(shard, columns=["input_ids"]).column("input_ids").to_pylist())
        if not seqs:
            raise HiSpecError(f"{dataset}: the self-distilled data set holds no records yet")
        return [s[:max_seq_len] for s in seqs]
    from .data import load_records, tokenize_records

    records, _ = load_records(dataset)
    seqs = []
    for r in records:
        ids, used, _ = tokenize_records(tokenizer, [r])
        if used and len(ids) > 1:
            seqs.append(ids[:max_seq_len])
    if not seqs:
        raise HiSpecError(f"dataset {dataset!r} has no usable records")
    return seqs


def plan_shards(seqs: list[list[int]], cfg: StoreConfig) -> dict[str, list[list[int]]]:
    """Sequence indices per shard, per split: a seeded shuffle, the first ``eval_sequences`` held out,
    the rest up to ``max_tokens``, cut into shards of about ``shard_tokens``."""
    order = list(range(len(seqs)))
    random.Random(cfg.seed).shuffle(order)
    n_eval = min(cfg.eval_sequences, max(1, len(seqs) // 10))
    parts = {"eval": order[:n_eval], "train": order[n_eval:]}
    out: dict[str, list[list[int]]] = {}
    budget = cfg.max_tokens
    for split in SPLITS:
        shards, current, size = [], [], 0
        for i in parts[split]:
            if split == "train" and budget is not None and budget <= 0:
                break
            current.append(i)
            size += len(seqs[i])
            if split == "train" and budget is not None:
                budget -= len(seqs[i])
            if size >= cfg.shard_tokens:
                shards.append(current)
                current, size = [], 0
        if current:
            shards.append(current)
        out[split] = shards
    return out


def _batches(seqs: list[list[int]], batch_tokens: int) -> Iterator[list[int]]:
    """Indices of ``seqs`` in batches of similar length, at most ``batch_tokens`` padded tokens."""
    order = sorted(range(len(seqs)), key=lambda i: len(seqs[i]))
    batch: list[int] = []
    for i in order:
        if batch and len(seqs[i]) * (len(batch) + 1) > batch_tokens:
            yield batch
            batch = []
        batch.append(i)
    if batch:
        yield batch


@torch.no_grad()
def shard_features(inner: torch.nn.Module, seqs: list[list[int]], layers: list[int], batch_tokens: int,
                   dtype: torch.dtype, device: torch.device) -> dict[str, torch.Tensor]:
    """The tensors of one shard: the sequences in order, their states at ``layers`` and final."""
    states: list[dict[str, torch.Tensor]] = [{} for _ in seqs]
    for batch in _batches(seqs, batch_tokens):
        width = max(len(seqs[i]) for i in batch)
        ids = torch.zeros(len(batch), width, dtype=torch.long)
        mask = torch.zeros(len(batch), width, dtype=torch.long)
        for r, i in enumerate(batch):
            ids[r, : len(seqs[i])] = torch.tensor(seqs[i])
            mask[r, : len(seqs[i])] = 1
        out = inner(input_ids=ids.to(device), attention_mask=mask.to(device), output_hidden_states=True)
        for r, i in enumerate(batch):
            n = len(seqs[i])
            states[i] = {f"hidden.{l}": out.hidden_states[l][r, :n].to(dtype).cpu() for l in layers}
            states[i]["final"] = out.last_hidden_state[r, :n].to(dtype).cpu()
    tensors = {k: torch.cat([s[k] for s in states]).contiguous() for k in states[0]}
    tensors["input_ids"] = torch.tensor([t for s in seqs for t in s], dtype=torch.int32)
    tensors["offsets"] = torch.tensor([0] + [len(s) for s in seqs], dtype=torch.long).cumsum(0)
    return tensors


def check_out(cfg: StoreConfig) -> StoreManifest | None:
    """What ``--out`` holds, checked before anything is loaded or removed: the manifest of the store
    to resume, or None."""
    out = Path(cfg.out)
    if cfg.resume and cfg.overwrite:
        raise HiSpecError("--resume and --overwrite exclude each other")
    if out.exists() and not out.is_dir():
        raise HiSpecError(f"--out {out} is a file, not a directory")
    if cfg.resume:
        return StoreManifest.load(out)
    if out.is_dir() and any(not is_temporary(p.name) for p in out.iterdir()):
        if not cfg.overwrite:
            raise HiSpecError(f"{out} is not empty: pass --resume to continue the store or --overwrite to rebuild it")
        if not (out / STORE_MANIFEST).is_file():
            raise HiSpecError(f"--overwrite: {out} is not a feature store; refusing to delete it")
    check_writable(out, "--out")
    return None


def grows(before: StoreManifest, cfg: StoreConfig) -> bool:
    """Whether ``cfg`` asks for more training tokens than the store was planned with (``None``: all).
    The seeded order is the same, so the shards planned before are kept, but for the last one."""
    cap = before.plan.get("max_tokens")
    return cap is not None and (cfg.max_tokens is None or cfg.max_tokens > cap)


def _planned_ids(seqs: list[list[int]], shard: list[int]) -> torch.Tensor:
    return torch.tensor([t for i in shard for t in seqs[i]], dtype=torch.int32)


def check_shard(path: Path, expected: torch.Tensor, keys: list[str], listed: bool) -> bool:
    """Whether the shard at ``path`` is complete and holds exactly the planned tokens: False if it is
    missing, or unlisted and holding other tokens; a damaged shard, or a listed one that holds other
    tokens, stops the resume with its name."""
    if not path.is_file():
        if listed:
            logger.warning("shard %s listed in %s is missing: it is computed again", path.name, STORE_MANIFEST)
        return False
    advice = "delete it and run --resume again to compute it anew"
    try:
        with safe_open(str(path), framework="pt") as f:
            missing = sorted(set(keys) - set(f.keys()))
            ids = f.get_tensor("input_ids") if not missing else None
    except Exception as exc:  # safetensors raises its own error types for damaged files
        raise HiSpecError(f"shard {path} is damaged ({type(exc).__name__}: {exc}); {advice}") from exc
    if missing:
        raise HiSpecError(f"shard {path} lacks {', '.join(missing)}; {advice}")
    if not torch.equal(ids, expected):
        if not listed:  # the last shard of a store planned with a smaller --max-tokens
            logger.info("shard %s holds %d of the %d tokens this plan puts there (cut short by a smaller "
                        "--max-tokens): it is computed again, whole", path.name, ids.numel(), expected.numel())
            return False
        raise HiSpecError(f"shard {path} holds other tokens than this store's plan ({ids.numel()} tokens, "
                          f"{expected.numel()} planned); {advice}")
    if not listed:
        logger.info("shard %s is complete but not in %s (a run killed before updating it): kept", path.name,
                    STORE_MANIFEST)
    return True


def build_store(cfg: StoreConfig) -> StoreManifest:
    """Run the base over the data set once and write the store (resumable shard by shard).

    Everything (arguments, the data set, ``--out``, the base, the shards already written) is checked
    before ``--overwrite`` removes the old store or anything is written."""
    from hispec_decode.adapter.fingerprint import compute_fingerprint, fingerprints_match
    from hispec_decode.machine import compute_dtype
    from hispec_decode.models import decoder_for, load_base

    keep_freed_memory()  # the base's long-sequence temporaries are reused, not page-faulted anew

    if sorted(set(cfg.layers)) != cfg.layers:
        raise HiSpecError(f"--layers must be increasing exits; got {cfg.layers}")
    check_dataset(cfg.dataset)
    before = check_out(cfg)
    out = Path(cfg.out)
    loaded = load_base(cfg.base, cfg.dtype)
    decoder = decoder_for(loaded.model, pack_weights=False)
    bad = [l for l in cfg.layers if not 1 <= l < decoder.num_layers]
    if bad:
        raise HiSpecError(f"--layers must be increasing exits in 1..{decoder.num_layers - 1}; got {cfg.layers}")
    hidden = loaded.model.config.hidden_size
    dtype = parse_dtype(cfg.dtype)
    seqs = token_sequences(cfg.dataset, loaded.tokenizer, cfg.max_seq_len)
    final_size = decoder.lm_head.in_features  # the LM head's input (OPT's project_out makes it narrower)
    manifest = StoreManifest(loaded.name, compute_fingerprint(loaded.model), cfg.layers, cfg.dtype, hidden,
                             decoder.num_layers, cfg.dataset, len(seqs),
                             (len(cfg.layers) * hidden + final_size) * dtype.itemsize + 4,
                             {k: getattr(cfg, k) for k in PLAN_KEYS})
    plan = plan_shards(seqs, cfg)
    if not plan["train"]:
        raise HiSpecError(f"--dataset {cfg.dataset}: its {len(seqs)} usable sequence(s) leave no training tokens "
                          f"once {sum(map(len, plan['eval']))} are held out; use a larger data set")
    keys = [*(f"hidden.{l}" for l in cfg.layers), "final", "input_ids", "offsets"]
    done: dict[str, dict[int, dict[str, int | str]]] = {s: {} for s in SPLITS}
    if before is not None:
        changed = [k for k in ("layers", "dtype", "dataset", "num_sequences") if getattr(before, k) != getattr(manifest, k)]
        if not fingerprints_match(before.fingerprint, manifest.fingerprint):
            changed.insert(0, "base")
        changed += [k for k in PLAN_KEYS if before.plan.get(k) != manifest.plan[k] and not (k == "max_tokens" and grows(before, cfg))]
        if changed:
            raise HiSpecError(f"--resume: {', '.join(changed)} differ from the store being resumed (a data set that "
                              f"grew, or other shard settings, need a new store: --overwrite; a larger --max-tokens "
                              f"grows it)")
        old_plan = plan_shards(seqs, replace(cfg, max_tokens=before.plan["max_tokens"]))
        for split in SPLITS:
            listed = {str(e["file"]) for e in before.shards[split]}
            for index, shard in enumerate(plan[split]):
                name = SHARD_NAME.format(split=split, index=index)
                cut_short = index < len(old_plan[split]) and old_plan[split][index] != shard  # by the old cap
                if check_shard(out / name, _planned_ids(seqs, shard), keys, name in listed and not cut_short):
                    done[split][index] = {"file": name, "tokens": sum(len(seqs[i]) for i in shard),
                                          "sequences": len(shard)}
    if cfg.overwrite:  # only now that everything checked out
        remove_tree(out)
    out.mkdir(parents=True, exist_ok=True)
    if compute_dtype(dtype, decoder.device) != dtype:  # emulated bf16 matmuls: the same weights, widened
        logger.info("this CPU has no bf16 matrix kernels: the base computes in float32 (bf16 weights widened, GGUF "
                    "blocks as they are) and the states are stored in %s", str(dtype).removeprefix("torch."))
        loaded.model.float()
    inner = getattr(loaded.model, loaded.model.base_model_prefix)
    total = sum(len(seqs[i]) for split in SPLITS for shard in plan[split] for i in shard)

    def save() -> None:
        manifest.shards = {split: [done[split][i] for i in sorted(done[split])] for split in SPLITS}
        manifest.save(out)

    save()  # the manifest first, listing what is on disk: a run killed before its first shard resumes
    bar = tqdm(total=total, initial=sum(manifest.tokens(s) for s in SPLITS), desc="feature store", unit="tok")
    for split in SPLITS:
        for index, shard in enumerate(plan[split]):
            if index in done[split]:
                continue  # written before a resume
            name = SHARD_NAME.format(split=split, index=index)  # checked missing above, or a new store
            tensors = shard_features(inner, [seqs[i] for i in shard], cfg.layers, cfg.batch_tokens, dtype, decoder.device)
            with atomic_file(out / name) as tmp:
                save_file(tensors, str(tmp), metadata={"format": "pt"})
            n = int(tensors["input_ids"].numel())
            done[split][index] = {"file": name, "tokens": n, "sequences": len(shard)}
            save()
            bar.update(n)
    save()
    bar.close()
    logger.info("store %s: %d train / %d held-out tokens, %d bytes per token", out, manifest.tokens("train"),
                manifest.tokens("eval"), manifest.bytes_per_token)
    return manifest


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="hispec-store", description=__doc__.split("\n\n")[0])
    p.add_argument("--dataset", required=True, help="a hispec-selfdistill directory, or any hispec-train data set")
    p.add_argument("--out", required=True, help="store directory")
    p.add_argument("--layers", type=positive_int_list, required=True, help="exit layers to store, e.g. 4,8")
    p.add_argument("--base", help="the base (default: embedded SmolLM2)")
    p.add_argument("--dtype", default="bfloat16", help="dtype of the base forward and of the stored states; native: "
                   "a GGUF base on its own blocks (the states its heads read when decoding natively), stored in bfloat16")
    p.add_argument("--max-tokens", type=positive_int, help="training tokens to store (default: all)")
    p.add_argument("--max-seq-len", type=positive_int, default=2048, help="longer sequences are cut")
    p.add_argument("--eval-sequences", type=positive_int, default=64, help="held-out sequences")
    p.add_argument("--shard-tokens", type=positive_int, default=65_536, help="tokens per shard")
    p.add_argument("--batch-tokens", type=positive_int, default=4096, help="padded tokens per base forward")
    p.add_argument("--seed", type=int, default=0, help="seed of the held-out split and the order")
    p.add_argument("--resume", action="store_true", help="continue the store in --out")
    p.add_argument("--overwrite", action="store_true", help="rebuild the store in --out")
    add_debug_arg(p)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    cfg = StoreConfig(**{k: v for k, v in vars(args).items() if k != "debug"})
    return run_cli("hispec-store", lambda: (build_store(cfg), 0)[1], args.debug, extra="train")


if __name__ == "__main__":
    sys.exit(main())
