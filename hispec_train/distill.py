"""Distillation loss and agreement metrics, computed over sequence chunks.

The LM-head logits of several heads for a whole batch (``[batch, seq, vocab]`` each; Llama 3's
vocabulary is 128k) never exist at once: each chunk of positions computes the teacher's logits
once, every head's logits and loss, and (full-vocabulary loss) is wrapped in activation checkpointing so that the
backward pass recomputes a chunk's logits instead of keeping them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from hispec_decode.models import DecoderModel
from hispec_decode.models.exit_heads import ExitHead


@dataclass
class LossConfig:
    temperature: float = 1.0  # KD temperature (the loss is scaled by T^2)
    ce_weight: float = 0.0  # weight of cross-entropy on the data's next tokens, mixed with KD
    chunk_size: int = 128  # positions per chunk
    exit_vocab: bool = False  # heads with an exit vocabulary learn the teacher's distribution over it only


def heads_dtype(heads: list[ExitHead], default: torch.dtype) -> torch.dtype:
    """The dtype the heads compute in (DeepSpeed may have cast them), ``default`` if parameter-free."""
    return next((p.dtype for head in heads for p in head.parameters()), default)


def _scaled(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    return logits if temperature == 1.0 else logits / temperature


def _chunk_losses(decoder: DecoderModel, heads: list[ExitHead], cfg: LossConfig, teacher_hidden: torch.Tensor,
                  labels: torch.Tensor, valid: torch.Tensor, *hidden: torch.Tensor) -> torch.Tensor:
    """Summed (over valid tokens) loss of every head on one chunk; shapes [B, c, H] -> [n_heads].

    With ``exit_vocab``, a head restricted to a vocabulary V learns the teacher renormalised over
    V (``[B, c, |V|]`` logits instead of the full vocabulary: what it can ever draft)."""
    teacher_hidden, labels, valid = teacher_hidden.flatten(0, 1), labels.flatten(), valid.flatten()
    hidden = tuple(h.flatten(0, 1) for h in hidden)  # [n = B*c, H]: 2-d inputs (a 3-d slice costs a weight copy)
    teachers: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def teacher(vocab: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        key = 0 if vocab is None else id(vocab)
        if key not in teachers:
            with torch.no_grad():
                logits = decoder.lm_logits(teacher_hidden) if vocab is None else \
                    decoder.vocab_logits(teacher_hidden, vocab, compact=True)
                log_p = F.log_softmax(_scaled(logits.float(), cfg.temperature), dim=-1)  # [n, V or |V|]
                p = log_p.exp()
                teachers[key] = torch.linalg.vecdot(p, log_p), p  # [n]: -entropy, [n, V]
        return teachers[key]

    losses = []
    for head, h in zip(heads, hidden):
        vocab = head.vocab if cfg.exit_vocab else None
        student = head.project(h, decoder, restrict=vocab is not None, compact=True).float()  # [n, V or |V|]
        neg_entropy, p_t = teacher(vocab)
        s = _scaled(student, cfg.temperature)
        # KL(teacher || head) = sum p_t log p_t - sum p_t s + logsumexp(s): no [n, V] log-softmax is
        # kept, and the backward pass is softmax(s) - p_t in two passes over the logits
        kl = neg_entropy - torch.linalg.vecdot(p_t, s) + torch.logsumexp(s, dim=-1)  # [n]
        loss = (kl * valid).sum() * cfg.temperature**2
        if cfg.ce_weight:
            target = labels
            if vocab is not None:  # token ids -> positions in the vocabulary (tokens outside it are skipped)
                pos = torch.searchsorted(vocab, labels.clamp(min=0)).clamp(max=vocab.numel() - 1)
                target = torch.where((vocab[pos] == labels) & (labels >= 0), pos, -100)
            keep = (target >= 0) & valid
            ce = F.cross_entropy(student[keep], target[keep], reduction="sum")
            loss = (1 - cfg.ce_weight) * loss + cfg.ce_weight * ce
        losses.append(loss)
    return torch.stack(losses)


def distillation_loss(decoder: DecoderModel, heads: list[ExitHead], hidden: list[torch.Tensor],
                      teacher_hidden: torch.Tensor, input_ids: torch.Tensor, cfg: LossConfig,
                      valid: torch.Tensor | None = None) -> torch.Tensor:
    """Mean per-token loss of each head, ``[n_heads]``.

    ``hidden[i]``: [B, T, H] at head i's layer; ``teacher_hidden``: [B, T, H'] the final hidden
    state (after the final norm); ``input_ids``: [B, T] (labels are the next tokens); ``valid``:
    [B, T] bool, False on padding (default: every position).
    """
    B, T = input_ids.shape
    if valid is None:
        valid = torch.ones_like(input_ids, dtype=torch.bool)
    dtype = heads_dtype(heads, hidden[0].dtype)
    # each head's transformed states over all of T (attention-bearing heads see the whole window),
    # one per decoding situation it meets (deep-context heads: two); the head's loss is their mean
    variants = [head.training_transforms(h.to(dtype), decoder, teacher_hidden) for head, h in zip(heads, hidden)]
    flat_heads = [head for head, v in zip(heads, variants) for _ in v]
    flat = [x for v in variants for x in v]
    labels = torch.full_like(input_ids, -100)
    labels[:, :-1] = torch.where(valid[:, 1:], input_ids[:, 1:], -100)  # position t predicts token t+1
    total = None
    for s in range(0, T, cfg.chunk_size):
        sl = slice(s, s + cfg.chunk_size)
        args = (teacher_hidden[:, sl], labels[:, sl], valid[:, sl], *(h[:, sl] for h in flat))
        if cfg.exit_vocab:  # [B, c, |V|] logits are small enough to keep: no recomputation in the backward pass
            part = _chunk_losses(decoder, flat_heads, cfg, *args)
        else:
            part = checkpoint(_chunk_losses, decoder, flat_heads, cfg, *args, use_reentrant=False)
        total = part if total is None else total + part
    per_variant = total / valid.sum().clamp(min=1)
    sizes = [len(v) for v in variants]
    return torch.stack([chunk.mean() for chunk in per_variant.split(sizes)])


THRESHOLDS = (0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 0.99)  # confidence calibration points
DRAFT_STEPS = 4  # draft positions measured: a chain of up to 4 tokens drafted by the head alone


@dataclass
class Agreement:
    """Counts of agreement with the final layer on held-out data, per head layer: top-1 and top-4
    (the final token among the head's 4 best) of the first draft after a verification, and per
    confidence threshold how many tokens the head is that confident on and how many of those it gets
    right (calibration); per draft position of a chain the head drafts alone (``steps``), the tokens
    it agrees on and, among the positions where every earlier draft of the chain was right (and is the
    data's next token, so the later states are the drafted tokens'), how many it gets right."""

    tokens: int = 0
    with_final: dict[int, int] = field(default_factory=dict)  # head layer -> agreeing tokens at step 2
    in_top4: dict[int, int] = field(default_factory=dict)  # ... in the top 4 at step 1
    confident: dict[int, list[int]] = field(default_factory=dict)  # per THRESHOLDS: tokens with top prob >= t
    confident_right: dict[int, list[int]] = field(default_factory=dict)  # ... of which agree
    first_with_final: dict[int, int] = field(default_factory=dict)  # deep-context heads: step 1, the true context
    step_right: dict[int, list[int]] = field(default_factory=dict)  # layer -> per step: agreeing tokens
    chain_reached: dict[int, list[int]] = field(default_factory=dict)  # layer -> per step: positions every earlier
    chain_right: dict[int, list[int]] = field(default_factory=dict)  # draft was right at; ... of which agree
    draft_vs_intermediate: int = 0
    compared: int = 0  # tokens where a draft and a distinct intermediate head were both scored

    def add(self, layer: int, n: int) -> None:
        self.with_final[layer] = self.with_final.get(layer, 0) + n

    def acceptance(self, layer: int) -> list[float]:
        """Per draft position: the chance the draft is right given every earlier one was."""
        return [r / n if n else 0.0 for r, n in zip(self.chain_right[layer], self.chain_reached[layer])]

    def rates(self) -> dict[str, float]:
        out = {f"agreement/L{layer}": n / self.tokens for layer, n in sorted(self.with_final.items())}
        if self.compared:  # a run with one head has nothing to compare
            out["agreement/draft_vs_intermediate"] = self.draft_vs_intermediate / self.compared
        out |= {f"agreement_true_context/L{layer}": n / self.tokens for layer, n in sorted(self.first_with_final.items())}
        for layer in sorted(self.step_right):
            rates = self.acceptance(layer)
            for j, right in enumerate(self.step_right[layer]):
                out[f"agreement_step{j + 1}/L{layer}"] = right / self.tokens
                out[f"acceptance_step{j + 1}/L{layer}"] = rates[j]
            out[f"chain_accepted/L{layer}"] = expected_chain(rates)
        return out

    def curve(self) -> dict[int, dict[str, object]]:
        """Per layer: top-1 and top-4 agreement, and coverage/precision at each threshold (all of the
        first draft after a verification), and the acceptance per draft position."""
        out = {}
        for layer in sorted(self.with_final):
            n, right = self.confident.get(layer, [0] * len(THRESHOLDS)), self.confident_right.get(layer, [0] * len(THRESHOLDS))
            out[layer] = {
                "top1": self.step_right[layer][0] / self.tokens, "top4": self.in_top4.get(layer, 0) / self.tokens,
                "top1_later_drafts": self.with_final[layer] / self.tokens, "acceptance_per_step": self.acceptance(layer),
                "calibration": [{"threshold": t, "coverage": c / self.tokens, "precision": r / c if c else None}
                                for t, c, r in zip(THRESHOLDS, n, right)],
            }
        return out


@torch.no_grad()
def agreement(decoder: DecoderModel, heads: dict[int, ExitHead], hidden: dict[int, torch.Tensor],
              teacher_hidden: torch.Tensor, draft: int, intermediate: int, chunk_size: int, into: Agreement,
              valid: torch.Tensor | None = None, input_ids: torch.Tensor | None = None) -> None:
    """Add each head's agreement with the final layer (and the draft's with the intermediate) over
    the ``valid`` positions (default: all); with ``input_ids`` ([B, T]) also the acceptance per draft
    position of a chain (:class:`Agreement`)."""
    T = teacher_hidden.shape[1]
    if valid is None:
        valid = torch.ones(teacher_hidden.shape[:2], dtype=torch.bool, device=teacher_hidden.device)
    dtype = heads_dtype(list(heads.values()), teacher_hidden.dtype)
    steps = {layer: head.draft_steps(hidden[layer].to(dtype), decoder, teacher_hidden, DRAFT_STEPS)
             for layer, head in heads.items()}
    final = torch.cat([decoder.lm_logits(teacher_hidden[:, s : s + chunk_size]).argmax(-1)
                       for s in range(0, T, chunk_size)], dim=1)  # [B, T]
    thresholds = torch.tensor(THRESHOLDS, device=teacher_hidden.device)
    tops: dict[int, torch.Tensor] = {}
    for layer, head in heads.items():
        top = []  # per step: [B, T] the head's argmax
        for j, x in enumerate(steps[layer]):
            if j and x is steps[layer][j - 1]:  # a head that reads no deep state: every step is the same
                top.append(top[-1])
                continue
            parts = []
            vocab = head.vocab  # with an exit vocabulary: only its logits ([B, c, len(vocab)]; the rest are -inf)
            for s in range(0, T, chunk_size):
                logits = head.project(x[:, s : s + chunk_size], decoder, compact=vocab is not None)
                probs = torch.softmax(logits.float(), dim=-1)  # [B, c, V or len(vocab)]
                conf, top4 = probs.topk(min(4, probs.shape[-1]), dim=-1)
                if vocab is not None:
                    top4 = vocab[top4]
                parts.append(top4[..., 0])
                if j == 0:  # the first draft after a verification: top-4 and calibration
                    keep, f = valid[:, s : s + chunk_size], final[:, s : s + chunk_size]
                    right = (top4[..., 0] == f)[keep]
                    into.in_top4[layer] = into.in_top4.get(layer, 0) + int((top4 == f[..., None]).any(-1)[keep].sum())
                    above = conf[..., :1][keep] >= thresholds[None, :]  # [n, len(THRESHOLDS)]
                    for name, add in (("confident", above.sum(0)), ("confident_right", (above & right[:, None]).sum(0))):
                        counts = getattr(into, name).setdefault(layer, [0] * len(THRESHOLDS))
                        for i, n in enumerate(add.tolist()):
                            counts[i] += n
            top.append(torch.cat(parts, dim=1))
        right = [(t == final) & valid for t in top]  # per step [B, T]
        into.add(layer, int(right[1 if len(right) > 1 else 0].sum()))
        if head.needs_context:
            into.first_with_final[layer] = into.first_with_final.get(layer, 0) + int(right[0].sum())
        per_step = into.step_right.setdefault(layer, [0] * DRAFT_STEPS)
        reached = into.chain_reached.setdefault(layer, [0] * DRAFT_STEPS)
        chain = into.chain_right.setdefault(layer, [0] * DRAFT_STEPS)
        ok = valid.clone()  # [B, T]: the chain that ends at t reached step j (every earlier draft right)
        for j in range(DRAFT_STEPS):
            per_step[j] += int(right[j].sum())
            reached[j] += int(ok.sum())
            chain[j] += int((ok & right[j]).sum())
            if input_ids is None:  # no tokens: no chains measured beyond step 1
                break
            # the chain at t + 1 reaches step j + 2 if it reached step j + 1 at t, that draft was right
            # and it is the data's next token (the states after it are the drafted token's)
            nxt = ok & right[j]
            nxt[:, :-1] &= input_ids[:, 1:] == final[:, :-1]
            ok = torch.zeros_like(ok)
            ok[:, 1:] = nxt[:, :-1] & valid[:, 1:]
        tops[layer] = top[0]
    if draft != intermediate and draft in tops and intermediate in tops:
        into.draft_vs_intermediate += int(((tops[draft] == tops[intermediate]) & valid).sum())
        into.compared += int(valid.sum())
    into.tokens += int(valid.sum())


def expected_chain(acceptance: list[float]) -> float:
    """Expected accepted drafts of a greedy chain with these per-position acceptances."""
    total, alive = 0.0, 1.0
    for a in acceptance:
        alive *= a
        total += alive
    return total


def expected_accepted(rate: float, window: int) -> float:
    """Expected accepted drafts out of ``window`` at an i.i.d. per-token acceptance ``rate``."""
    return sum(rate**i for i in range(1, window + 1))
