"""The training loop: distil exit heads into a frozen base (read top to bottom).

One base forward per batch (no grad) yields the hidden state at every exit layer and the final
hidden state, from which the teacher logits are computed chunk by chunk and shared by all heads.
Only the heads train. Accelerate owns devices, mixed precision, gradient accumulation and data
parallelism; checkpoints are safetensors + JSON (see :mod:`hispec_train.checkpoint`).
"""

from __future__ import annotations

import json
import logging
import math
import time
from pathlib import Path

import torch
from accelerate import Accelerator
from accelerate.utils import set_seed
from torch import nn
from tqdm.auto import tqdm

from hispec_decode.adapter import CONFIG_NAME as ADAPTER_CONFIG, ExitSpec, HiSpecAdapter
from hispec_decode.adapter.fingerprint import compute_fingerprint
from hispec_decode.errors import HiSpecError
from hispec_decode.files import check_writable, remove_tree, write_text
from hispec_decode.machine import compute_dtype
from hispec_decode.models.exit_heads import BaseExitHead
from hispec_decode.models import DecoderModel, decoder_for, load_base

from .allocator import keep_freed_memory
from .checkpoint import CHECKPOINT_DIR, checkpoint_step, init_heads, load_heads, load_optimizer, save_checkpoint
from .config import TrainConfig
from .data import PackedData, build_dataset, check_dataset
from .distill import Agreement, LossConfig, agreement, distillation_loss, expected_accepted
from .store import STORE_MANIFEST
from .store_data import FeatureBatch, FeatureStore
from .report import EVAL_NAME, PLOT_NAME, write_eval_report
from .vocab import ExitVocab, exit_vocabulary
from .zero import check_whole, heads_config, loading_whole, master_weights, shard_base, zero_stage

logger = logging.getLogger(__name__)
CONFIG_NAME = "train_config.json"
RESUME_KEYS = ("base", "heads_layers", "head_roles", "head_type", "head_options", "exit_vocab_size", "seq_len", "features",
               "init_heads")


class HeadsLoss(nn.Module):
    """The heads as one module (what DDP wraps): hidden states in, per-head losses out."""

    def __init__(self, adapter: HiSpecAdapter, decoder: DecoderModel, loss_cfg: LossConfig) -> None:
        super().__init__()
        self.adapter = adapter
        self.decoder = [decoder]  # a list: the frozen base is not a submodule (not trained, not wrapped)
        self.loss_cfg = loss_cfg

    def forward(self, batch: FeatureBatch) -> torch.Tensor:
        heads = [self.adapter.heads[k] for k in sorted(self.adapter.heads, key=int)]
        return distillation_loss(self.decoder[0], heads, batch.hidden, batch.final, batch.input_ids, self.loss_cfg,
                                 batch.valid)


def set_exit_vocab(adapter: HiSpecAdapter, vocab: ExitVocab) -> None:
    """Restrict every head to ``vocab`` (decoding and evaluation; the loss uses the full vocabulary)."""
    for head in adapter.heads.values():
        head.set_vocab(vocab.ids)
    adapter.config.training |= {"exit_vocab_size": int(vocab.ids.numel()), "exit_vocab_coverage": vocab.coverage}


def base_forward(inner: nn.Module, input_ids: torch.Tensor, layers: list[int]) -> FeatureBatch:
    """Hidden states after each exit layer [B, T, H] and the final (normed) hidden state.

    ``inner``: the base's decoder (``model.<base_model_prefix>``) or its ZeRO-3 engine."""
    with torch.no_grad():
        out = inner(input_ids=input_ids, output_hidden_states=True)
    return FeatureBatch([out.hidden_states[l] for l in layers], out.last_hidden_state, input_ids,
                        torch.ones_like(input_ids, dtype=torch.bool))


class TrainingData:
    """Where batches come from: packed token blocks run through the base, or a feature store."""

    def __init__(self, cfg: TrainConfig, tokenizer, inner: nn.Module, fingerprint: dict) -> None:
        self.cfg, self.inner = cfg, inner
        self.blocks: PackedData | None = None
        self.store = self.eval_store = None
        if cfg.features:
            self.store = FeatureStore(cfg.features, cfg.heads_layers, "train", fingerprint)
            self.eval_store = FeatureStore(cfg.features, cfg.heads_layers, "eval", fingerprint)
            self.info = {"features": cfg.features, "dataset": self.store.manifest.dataset,
                         "train_tokens_available": self.store.num_tokens}
        else:
            self.blocks = build_dataset(cfg.dataset, tokenizer, cfg.seq_len, cfg.max_tokens, cfg.eval_fraction, cfg.seed)
            self.info = {"dataset": cfg.dataset, "records_used": self.blocks.records_used,
                         "records_skipped": self.blocks.records_skipped,
                         "train_tokens_available": int(self.blocks.train.numel())}

    def describe(self) -> str:
        if self.store is not None:
            return (f"feature store {self.cfg.features}: {self.store.num_tokens} train / {self.eval_store.num_tokens} "
                    f"held-out tokens in windows of {self.cfg.seq_len}")
        return (f"data: {len(self.blocks.train)} train blocks, {len(self.blocks.eval)} held-out blocks of "
                f"{self.cfg.seq_len} tokens")

    def train_tokens(self) -> torch.Tensor:
        """Every training token id (for the exit vocabulary)."""
        if self.store is not None:
            return torch.cat([t["input_ids"] for t in self.store.shards]).long()
        return self.blocks.train

    def batch(self, step: int, micro: int, rank: int, world: int, device: torch.device) -> FeatureBatch:
        cfg = self.cfg
        if self.store is not None:  # a generator per (step, micro-step, process): resumable and process-independent
            g = torch.Generator().manual_seed(cfg.seed * 1_000_003 + (step * cfg.grad_accum + micro) * world + rank)
            b = self.store.batch(g, cfg.batch_size, cfg.seq_len, from_start=cfg.windows == "start")
            return FeatureBatch([h.to(device) for h in b.hidden], b.final.to(device), b.input_ids.to(device),
                                b.valid.to(device))
        idx = batch_indices(step, micro, cfg, len(self.blocks.train), rank, world)
        return base_forward(self.inner, self.blocks.train[idx].to(device), cfg.heads_layers)  # [B, T] ids

    def eval_batches(self, device: torch.device) -> list[FeatureBatch] | None:
        """Held-out batches already in memory (a store), or None (run the base on held-out blocks)."""
        if self.eval_store is None:
            return None
        cfg = self.cfg
        out = self.eval_store.sequential(cfg.batch_size, cfg.seq_len, cfg.eval_batches * cfg.batch_size * cfg.seq_len)
        return [FeatureBatch([h.to(device) for h in b.hidden], b.final.to(device), b.input_ids.to(device),
                             b.valid.to(device)) for b in out]


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Linear warm-up, then cosine decay to 10% of ``lr``."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    progress = (step - cfg.warmup_steps) / max(1, cfg.max_steps - cfg.warmup_steps)
    return cfg.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress))))


def batch_indices(step: int, micro: int, cfg: TrainConfig, n_blocks: int, rank: int, world: int) -> list[int]:
    """The same global order for any number of processes: epoch permutations seeded by ``seed``."""
    global_batch = cfg.batch_size * world
    start = (step * cfg.grad_accum + micro) * global_batch + rank * cfg.batch_size
    out = []
    for i in range(start, start + cfg.batch_size):
        epoch, offset = divmod(i, n_blocks)
        order = torch.randperm(n_blocks, generator=torch.Generator().manual_seed(cfg.seed + epoch))
        out.append(int(order[offset]))
    return out


def evaluate(cfg: TrainConfig, decoder: DecoderModel, data: TrainingData, heads: dict[int, nn.Module]
             ) -> tuple[dict[str, float], dict[int, dict[str, object]]]:
    """Agreement of each head with the final layer on held-out data: the logged rates and the
    per-layer curve (top-1, top-4, calibration)."""
    layers = cfg.heads_layers
    counts = Agreement()
    batches = data.eval_batches(decoder.device)
    if batches is None:
        blocks = data.blocks.eval
        batches = (base_forward(data.inner, blocks[s : s + cfg.batch_size].to(decoder.device), layers)
                   for s in range(0, min(len(blocks), cfg.eval_batches * cfg.batch_size), cfg.batch_size))
    for b in batches:
        agreement(decoder, heads, dict(zip(layers, b.hidden)), b.final, layers[0], layers[min(1, len(layers) - 1)],
                  cfg.chunk_size, counts, b.valid, b.input_ids)
    rates = counts.rates()
    rates |= {f"agreement_top4/L{l}": c["top4"] for l, c in counts.curve().items()}
    if len(layers) >= 2:
        rates["expected_accepted/intermediate"] = expected_accepted(rates[f"agreement/L{layers[1]}"], cfg.window)
    return rates, counts.curve()


def _untrained_before(run_dir: Path) -> dict[str, float] | None:
    """The untrained exits' evaluation a resumed run already wrote (None: not written, or unreadable)."""
    try:
        return json.loads((run_dir / EVAL_NAME).read_text())["untrained"] or None
    except (OSError, ValueError, KeyError, TypeError):
        return None


def check_run_dir(cfg: TrainConfig) -> None:
    """Never overwrite a run by accident: a directory with a checkpoint needs ``resume`` (continue)
    or ``overwrite`` (start again); ``resume`` needs a checkpoint."""
    run_dir = Path(cfg.output_dir)
    step = checkpoint_step(run_dir)
    if cfg.resume and step is None:
        raise HiSpecError(f"--resume: {run_dir} holds no checkpoint to resume from (drop --resume to start a new run)")
    if step is not None and not cfg.resume and not cfg.overwrite:
        raise HiSpecError(f"{run_dir} already holds a checkpoint (step {step}); pass --resume to continue it or "
                          f"--overwrite to start again from step 0")
    if run_dir.exists() and not run_dir.is_dir():
        raise HiSpecError(f"output_dir {run_dir} is a file, not a directory")
    if cfg.resume and (run_dir / CONFIG_NAME).is_file():  # the heads must be the ones the checkpoint holds
        try:
            before = json.loads((run_dir / CONFIG_NAME).read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise HiSpecError(f"--resume: {run_dir / CONFIG_NAME} is damaged ({exc})") from exc
        changed = [k for k in RESUME_KEYS if k in before and before[k] != getattr(cfg, k)]
        if changed:
            raise HiSpecError(f"--resume: {', '.join(changed)} differ from the run being resumed "
                              f"({', '.join(f'{k}={before[k]!r}' for k in changed)}); resume with the same values")
    check_writable(run_dir, "output_dir")


def check_data_source(cfg: TrainConfig) -> None:
    """The feature store or the data set's file, and the heads ``init_heads`` names, exist (checked before
    anything is loaded or written)."""
    if cfg.features:
        if not (Path(cfg.features) / STORE_MANIFEST).is_file():
            raise HiSpecError(f"features: {cfg.features} is not a feature store ({STORE_MANIFEST} missing). Build it "
                              f"first: hispec-store --dataset DATA --out {cfg.features} --layers "
                              f"{','.join(map(str, cfg.heads_layers))} (DATA: e.g. data/selfdistill-smollm2), or "
                              f"train without a store: --dataset DATA")
    else:
        check_dataset(cfg.dataset)
    if cfg.init_heads and not cfg.resume:
        source = Path(cfg.init_heads)
        if not ((source / ADAPTER_CONFIG).is_file() or (source / CHECKPOINT_DIR / ADAPTER_CONFIG).is_file()):
            raise HiSpecError(f"init_heads: {source} is neither an exported adapter nor a run directory with a "
                              f"checkpoint ({ADAPTER_CONFIG} missing)")


def train(cfg: TrainConfig) -> Path:
    run_dir = Path(cfg.output_dir)
    keep_freed_memory()  # large per-step temporaries are reused, not page-faulted anew
    check_data_source(cfg)  # before minutes of loading, and before anything is created
    check_run_dir(cfg)
    accelerator = Accelerator(gradient_accumulation_steps=cfg.grad_accum, mixed_precision=cfg.mixed_precision,
                              log_with=None if cfg.report_to == "none" else cfg.report_to, project_dir=str(run_dir))
    set_seed(cfg.seed)
    main = accelerator.is_main_process

    # the frozen base, its exit machinery, and the data --------------------------------------
    stage = zero_stage(accelerator)
    with loading_whole(accelerator):
        loaded = load_base(cfg.base, cfg.base_dtype)
    check_whole(loaded.model)
    model = loaded.model if stage == 3 else loaded.model.to(accelerator.device)  # ZeRO-3 partitions it on the host
    base_dtype = next(model.parameters()).dtype
    if stage != 3 and compute_dtype(base_dtype, accelerator.device) != base_dtype:  # emulated bf16 matmuls
        logger.info("this CPU has no bf16 matrix kernels: the frozen base runs in float32 (its %s weights widened)",
                    cfg.base_dtype)
        model.float()
    decoder = decoder_for(model, pack_weights=False)
    cfg.check_layers(decoder.num_layers)
    inner = getattr(model, model.base_model_prefix)
    fingerprint = compute_fingerprint(loaded.model)
    data = TrainingData(cfg, loaded.tokenizer, inner, fingerprint)
    if main and cfg.overwrite:  # start again: the old run's outputs go once the base and the data loaded
        for name in (CHECKPOINT_DIR, EVAL_NAME, PLOT_NAME):
            remove_tree(run_dir / name)
    accelerator.wait_for_everyone()
    if main:
        run_dir.mkdir(parents=True, exist_ok=True)
        write_text(run_dir / CONFIG_NAME, json.dumps(cfg.to_dict(), indent=2, sort_keys=True))
        logger.info("%s", data.describe())

    # the heads, initialised to reproduce the base's own exits (or restored from a checkpoint) -
    specs = [ExitSpec(l, role, cfg.head_type, cfg.head_options) for l, role in zip(cfg.heads_layers, cfg.roles())]
    adapter = HiSpecAdapter.create(decoder, loaded.name, specs, base_revision=loaded.revision, training=data.info | {
        "seq_len": cfg.seq_len, "head_type": cfg.head_type})
    if cfg.init_heads and not cfg.resume:  # trained heads (and their exit vocabulary) start the run
        init_heads(cfg.init_heads, adapter, decoder, fingerprint, loaded.name, cfg.exit_vocab_size)
    elif cfg.exit_vocab_size:
        special = loaded.tokenizer.all_special_ids if loaded.tokenizer is not None else []
        set_exit_vocab(adapter, exit_vocabulary(data.train_tokens(), cfg.exit_vocab_size, decoder.vocab_size, special))
    adapter.to(accelerator.device, torch.float32)  # heads train in float32 whatever the base's dtype
    state = load_heads(run_dir, adapter, decoder) if cfg.resume else None  # before DeepSpeed copies them
    if stage == 3:
        decoder.keep_exit(accelerator.device)
        data.inner = shard_base(inner, accelerator.state.deepspeed_plugin.deepspeed_config, adapter.config.hidden_size,
                                cfg.batch_size)
    untrained = _untrained_before(run_dir) if cfg.resume else None  # measured when the run started
    if untrained is None:
        untrained, _ = evaluate(cfg, decoder, data, {l: BaseExitHead(adapter.config.hidden_size) for l in cfg.heads_layers})
    loss_module = HeadsLoss(adapter, decoder, LossConfig(cfg.kd_temperature, cfg.ce_weight, cfg.chunk_size,
                                                         cfg.loss_vocab == "exit"))
    optimizer = torch.optim.AdamW(adapter.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    if stage:  # no dataloader: tell DeepSpeed the micro-batch (and, for ZeRO-3, what stays whole)
        heads_config(accelerator.state.deepspeed_plugin.deepspeed_config, adapter, adapter.config.hidden_size,
                     cfg.batch_size, cfg.grad_accum, accelerator.num_processes, zero3=stage == 3)
    loss_module, optimizer = accelerator.prepare(loss_module, optimizer)

    start, history, tokens_before = 0, [], 0
    if state is not None:
        start, history, tokens_before = state["step"], state.get("history", []), state.get("tokens_seen", 0)
        if stage:
            logger.warning("DeepSpeed keeps AdamW moments in its own (pickled) format, which HiSpec does not "
                           "write: the optimizer restarts from zero")
        else:
            load_optimizer(run_dir, optimizer, state)
        logger.info("resumed from %s at step %d", run_dir / "checkpoint", start)
    if cfg.report_to != "none":
        accelerator.init_trackers("hispec", config={k: v if isinstance(v, (int, float, str, bool)) else str(v)
                                                     for k, v in cfg.to_dict().items()})

    # the loop --------------------------------------------------------------------------------
    bar = tqdm(range(start, cfg.max_steps), initial=start, total=cfg.max_steps, desc="training heads", disable=not main)
    tokens_seen, train_seconds = 0, 0.0  # by this process, evaluations and checkpoints left out
    for step in bar:
        t0 = time.perf_counter()
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, cfg)
        for micro in range(cfg.grad_accum):
            batch = data.batch(step, micro, accelerator.process_index, accelerator.num_processes, accelerator.device)
            tokens_seen += batch.tokens  # hidden: k x [B, T, H], final: [B, T, H'], input_ids/valid: [B, T]
            with accelerator.accumulate(loss_module):
                losses = loss_module(batch)  # [n_heads], mean KD per token
                accelerator.backward(losses.sum())
                optimizer.step()
                optimizer.zero_grad()
        train_seconds += time.perf_counter() - t0
        speed = tokens_seen * accelerator.num_processes / train_seconds
        logs = {f"loss/L{l}": float(x) for l, x in zip(cfg.heads_layers, losses.detach())} | {"lr": lr_at(step, cfg)}
        bar.set_postfix(loss=f"{float(losses.detach().mean()):.3f}", tok_s=f"{speed:.0f}")
        if cfg.report_to != "none":
            accelerator.log(logs | {"tokens_per_second": speed}, step=step + 1)
        done = step + 1 == cfg.max_steps
        if (step + 1) % cfg.eval_every == 0 or done:
            rates, curve = evaluate(cfg, decoder, data, {l: adapter.head(l) for l in cfg.heads_layers})
            history.append({"step": step + 1, **logs, **rates, "train_tokens_per_second": speed,
                            "tokens_seen": tokens_before + tokens_seen * accelerator.num_processes})
            if cfg.report_to != "none":
                accelerator.log(rates, step=step + 1)
            if main:
                write_eval_report(run_dir, cfg, untrained, history, curve)
        if (step + 1) % cfg.save_every == 0 or done:
            with master_weights(adapter, stage):  # collective under DeepSpeed; only the main process writes
                if main:
                    save_checkpoint(run_dir, adapter, None if stage else optimizer, {
                        "step": step + 1, "history": history, "tokens_seen": tokens_before + tokens_seen * accelerator.num_processes})
        accelerator.wait_for_everyone()
    accelerator.end_training()
    return run_dir
