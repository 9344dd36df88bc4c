"""DeepSpeed glue. ZeRO-3 shards the frozen base across processes and keeps the heads whole.

ZeRO-3's point here is the base: it is the large, frozen part, and under ZeRO-3 each process
holds only its shard of it, gathered layer by layer while the base runs (DeepSpeed's module
hooks; the same way TRL shards a frozen reference model). The base gets its own inference-only
DeepSpeed engine, separate from the heads' engine that accelerate prepares.

What the heads read from the base outside the base's forward is kept whole on every process
(``DecoderModel.keep_exit``): private copies of the final norm, the shared LM head
(``vocab x hidden`` per process) and OPT's ``project_out``. The heads themselves are small:
they are marked persistent (never partitioned), so their optimizer state and gradients are
sharded by ZeRO while their weights stay readable by the head code. Checkpoints hold DeepSpeed's
fp32 master weights (:func:`master_weights`), not the module's bf16 copies.

The base is loaded whole on the host (heads are initialised from its norm and, for
``decoder_block``, its next layer), then partitioned parameter by parameter by
``deepspeed.zero.Init(module=...)``, so the whole base never has to fit one device (it has to
fit the host's memory once per process).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import Any

from accelerate import Accelerator
from torch import nn

from hispec_decode.errors import HiSpecError

BUCKET_KEYS = ("reduce_bucket_size", "stage3_prefetch_bucket_size")


def zero_stage(accelerator: Accelerator) -> int:
    """0 without DeepSpeed, else the ZeRO stage of accelerate's DeepSpeed plugin."""
    plugin = accelerator.state.deepspeed_plugin
    if plugin is None:
        return 0
    launched = int(os.environ.get("WORLD_SIZE", "1"))
    if launched != accelerator.num_processes:  # accelerate sets no process group for DeepSpeed without accelerators
        raise HiSpecError(f"{launched} processes were launched but accelerate sees {accelerator.num_processes}: "
                          "accelerate runs DeepSpeed across processes only on accelerators (GPUs); on CPU use one "
                          "process with DeepSpeed, or several without it (--num_processes N --cpu)")
    return int(plugin.zero_stage)


@contextlib.contextmanager
def loading_whole(accelerator: Accelerator) -> Iterator[None]:
    """Load the base whole inside this block: accelerate's ZeRO-3 plugin otherwise makes
    transformers partition every model as it loads (``deepspeed.zero.Init``)."""
    plugin = accelerator.state.deepspeed_plugin
    if plugin is None or int(plugin.zero_stage) != 3:
        yield
        return
    from transformers.integrations import unset_hf_deepspeed_config

    unset_hf_deepspeed_config()
    try:
        yield
    finally:
        plugin.set_deepspeed_weakref()


def check_whole(model: nn.Module) -> None:
    """The heads are initialised from the base, so it must not arrive partitioned."""
    if any(hasattr(p, "ds_id") for p in model.parameters()):
        raise HiSpecError("the base arrived partitioned by DeepSpeed; HiSpec loads it whole, initialises the heads "
                          "from it and partitions it afterwards (load it outside deepspeed.zero.Init)")


def heads_config(ds_config: dict[str, Any], heads: nn.Module, hidden_size: int, batch_size: int,
                 grad_accum: int, world_size: int, zero3: bool) -> None:
    """Complete accelerate's DeepSpeed config for the heads' engine (in place). There is no
    dataloader, so DeepSpeed is told the micro-batch; under ZeRO-3 every head parameter is
    persistent (whole on every process) and bucket sizes follow the hidden size."""
    ds_config["train_micro_batch_size_per_gpu"] = batch_size
    ds_config["gradient_accumulation_steps"] = grad_accum
    ds_config["train_batch_size"] = batch_size * grad_accum * world_size
    if not zero3:
        return
    zero = ds_config.setdefault("zero_optimization", {})
    largest = max(p.numel() for p in heads.parameters())
    zero["stage3_param_persistence_threshold"] = largest + 1
    for key in BUCKET_KEYS:
        if zero.get(key, "auto") == "auto":
            zero[key] = hidden_size * hidden_size


def shard_base(model: nn.Module, ds_config: dict[str, Any], hidden_size: int, batch_size: int) -> nn.Module:
    """Partition the frozen ``model`` (a base's inner decoder) with ZeRO-3 and return an
    inference-only DeepSpeed engine that runs it (parameters gathered layer by layer)."""
    import deepspeed

    zero = ds_config.get("zero_optimization", {})
    config = {
        "train_micro_batch_size_per_gpu": batch_size,
        "zero_optimization": {
            "stage": 3,
            "stage3_param_persistence_threshold": 10 * hidden_size,
            "stage3_prefetch_bucket_size": int(0.9 * hidden_size * hidden_size),
            "offload_param": zero.get("offload_param", {"device": "none"}),
        },
    }
    model.requires_grad_(False)
    deepspeed.zero.Init(module=model, config_dict_or_path=config)  # partitions the existing parameters
    engine, *_ = deepspeed.initialize(model=model, config=config)
    engine.eval()
    return engine


@contextlib.contextmanager
def master_weights(module: nn.Module, stage: int) -> Iterator[None]:
    """Inside the block, ``module``'s parameters hold DeepSpeed's whole fp32 master weights (under
    bf16/fp16 mixed precision the module itself runs on rounded copies; under ZeRO-3 they may be
    partitioned); restored on exit. Collective: every process must enter. A no-op without DeepSpeed."""
    if not stage:
        yield
        return
    from deepspeed.utils import safe_get_full_fp32_param

    params = list(module.parameters())
    kept = [p.data for p in params]
    try:
        for p in params:
            full = safe_get_full_fp32_param(p)
            if full is not None:
                p.data = full.to(p.device).reshape(getattr(p, "ds_shape", p.shape))
        yield
    finally:
        for p, data in zip(params, kept):
            p.data = data
