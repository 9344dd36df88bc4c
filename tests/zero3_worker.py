"""Run by tests/test_train.py under ``torch.distributed.run`` (2 CPU processes, gloo): shard a
base with ZeRO-3 (hispec_train.zero.shard_base) and compare what it computes with the whole model.

accelerate runs DeepSpeed across processes only on accelerators, so this drives the sharding
directly; the training loop around it is covered by the one-process ZeRO-3 run."""

import json
import os
import sys

import deepspeed
import torch

from hispec_decode.models import decoder_for
from hispec_decode.models.loading import load_base
from hispec_train.trainer import base_forward
from hispec_train.zero import shard_base


def main(base_path: str, out_dir: str) -> None:
    deepspeed.init_distributed(dist_backend="gloo", auto_mpi_discovery=False)
    rank = int(os.environ["RANK"])
    model = load_base(base_path, "float32").model
    ids = torch.randint(0, model.config.vocab_size, (2, 24), generator=torch.Generator().manual_seed(0))
    decoder = decoder_for(model, pack_weights=False)
    inner = model.model
    ref = base_forward(inner, ids, [1, 3])
    ref_hidden, ref_final = ref.hidden, ref.final
    ref_logits = decoder.final_logits(ref_final)
    numel = sum(p.numel() for p in inner.parameters())

    decoder.keep_exit(torch.device("cpu"))
    engine = shard_base(inner, {}, model.config.hidden_size, batch_size=2)
    held = sum(p.ds_tensor.numel() for p in inner.parameters())
    got = base_forward(engine, ids, [1, 3])
    hidden, final = got.hidden, got.final
    diff = max(float((a - b).abs().max()) for a, b in zip([*ref_hidden, ref_final], [*hidden, final]))
    logits_diff = float((decoder.final_logits(final) - ref_logits).abs().max())  # through the kept exit copies
    report = {"held_fraction": held / numel, "max_diff": diff, "logits_diff": logits_diff,
              "partitioned": all(hasattr(p, "ds_id") for p in inner.parameters())}
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(report, f)
    # leave together: a rank that exits while its peer still talks to it makes gloo abort the peer
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:])
