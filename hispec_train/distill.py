"""Distillation loss and agreement metrics, computed over sequence chunks.

The LM-head logits of several heads for a whole batch (``[batch, seq, vocab]`` each; Llama 3's
vocabulary is 128k) never exist at once: each chunk of positions computes the teacher's logits
once, every head's logits and loss, and is wrapped in activation checkpointing so that the
backward pass recomputes a chunk's logits instead of keeping them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from hispec_decode.models import DecoderModel
from hispec_decode.layers.exit_heads import ExitHead


@dataclass
class LossConfig:
    temperature: float = 1.0  # KD temperature (the loss is scaled by T^2)
    ce_weight: float = 0.0  # weight of cross-entropy on the data's next tokens, mixed with KD
    chunk_size: int = 128  # positions per chunk


def heads_dtype(heads: list[ExitHead], default: torch.dtype) -> torch.dtype:
    """The dtype the heads compute in (DeepSpeed may have cast them), ``default`` if parameter-free."""
    return next((p.dtype for head in heads for p in head.parameters()), default)


def _chunk_losses(decoder: DecoderModel, heads: list[ExitHead], cfg: LossConfig, teacher_hidden: torch.Tensor,
                  labels: torch.Tensor | None, *hidden: torch.Tensor) -> torch.Tensor:
    """Summed (over tokens) loss of every head on one chunk; shapes [B, c, H] -> [n_heads]."""
    with torch.no_grad():
        teacher = decoder.lm_logits(teacher_hidden).float()  # [B, c, V]
        log_p_t = F.log_softmax(teacher / cfg.temperature, dim=-1)
        p_t = log_p_t.exp()
    losses = []
    for head, h in zip(heads, hidden):
        student = head.project(h, decoder, restrict=False).float()  # [B, c, V]: trained on the full vocabulary
        log_p_s = F.log_softmax(student / cfg.temperature, dim=-1)
        loss = (p_t * (log_p_t - log_p_s)).sum() * cfg.temperature**2  # KL(teacher || head)
        if cfg.ce_weight and labels is not None:
            valid = labels >= 0
            ce = F.cross_entropy(student[valid], labels[valid], reduction="sum")
            loss = (1 - cfg.ce_weight) * loss + cfg.ce_weight * ce
        losses.append(loss)
    return torch.stack(losses)


def distillation_loss(decoder: DecoderModel, heads: list[ExitHead], hidden: list[torch.Tensor],
                      teacher_hidden: torch.Tensor, input_ids: torch.Tensor, cfg: LossConfig) -> torch.Tensor:
    """Mean per-token loss of each head, ``[n_heads]``.

    ``hidden[i]``: [B, T, H] at head i's layer; ``teacher_hidden``: [B, T, H'] the final hidden
    state (after the final norm); ``input_ids``: [B, T] (labels are the next tokens).
    """
    B, T = input_ids.shape
    dtype = heads_dtype(heads, hidden[0].dtype)
    hidden = [head.sequence_transform(h.to(dtype), decoder) for head, h in zip(heads, hidden)]  # attention-bearing heads see all of T
    labels = torch.full_like(input_ids, -100)
    labels[:, :-1] = input_ids[:, 1:]  # position t predicts token t+1; the last has no label
    total = None
    for s in range(0, T, cfg.chunk_size):
        sl = slice(s, s + cfg.chunk_size)
        args = (teacher_hidden[:, sl], labels[:, sl], *(h[:, sl] for h in hidden))
        part = checkpoint(_chunk_losses, decoder, heads, cfg, *args, use_reentrant=False)
        total = part if total is None else total + part
    return total / (B * T)


@dataclass
class Agreement:
    """Counts of top-1 agreement on held-out data."""

    tokens: int = 0
    with_final: dict[int, int] = field(default_factory=dict)  # head layer -> agreeing tokens
    draft_vs_intermediate: int = 0

    def add(self, layer: int, n: int) -> None:
        self.with_final[layer] = self.with_final.get(layer, 0) + n

    def rates(self) -> dict[str, float]:
        out = {f"agreement/L{layer}": n / self.tokens for layer, n in sorted(self.with_final.items())}
        out["agreement/draft_vs_intermediate"] = self.draft_vs_intermediate / self.tokens
        return out


@torch.no_grad()
def agreement(decoder: DecoderModel, heads: dict[int, ExitHead], hidden: dict[int, torch.Tensor],
              teacher_hidden: torch.Tensor, draft: int, intermediate: int, chunk_size: int, into: Agreement) -> None:
    """Add the top-1 agreement of each head with the final layer (and draft with intermediate)."""
    T = teacher_hidden.shape[1]
    dtype = heads_dtype(list(heads.values()), teacher_hidden.dtype)
    transformed = {layer: head.sequence_transform(hidden[layer].to(dtype), decoder) for layer, head in heads.items()}
    for s in range(0, T, chunk_size):
        sl = slice(s, s + chunk_size)
        final = decoder.lm_logits(teacher_hidden[:, sl]).argmax(-1)
        tops = {layer: head.project(transformed[layer][:, sl], decoder).argmax(-1) for layer, head in heads.items()}
        for layer, top in tops.items():
            into.add(layer, int((top == final).sum()))
        if draft in tops and intermediate in tops:
            into.draft_vs_intermediate += int((tops[draft] == tops[intermediate]).sum())
        into.tokens += final.numel()


def expected_accepted(rate: float, window: int) -> float:
    """Expected accepted drafts out of ``window`` at an i.i.d. per-token acceptance ``rate``."""
    return sum(rate**i for i in range(1, window + 1))
