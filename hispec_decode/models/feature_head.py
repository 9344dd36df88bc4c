"""``feature_attention`` exit heads: one decoder layer over the exit's features fused with the deepest
state of the previous position, attending to the whole sequence (EAGLE's feature-level autoregression,
applied to an early exit of a frozen base).

At position ``t`` the head's input is ``u_t = h_t + W [h_t ; c_{t-1}]`` (``h_t``: the exit layer's
hidden state, ``c_{t-1}``: the deepest state known at the previous position; ``W`` starts at zero),
then one decoder layer (a copy of the base's layer after the exit, with its own K/V entries at every
position of the sequence), then the head's norm and the shared, exit-vocabulary LM head. Its normed
output is its estimate of the final state at ``t``: the context of the next drafted token.

Which context a row reads, and which K/V the keys hold, is what the head is trained for
(:meth:`FeatureAttentionHead.draft_steps`, "training-time test"):

- **step 1** (the first draft after a verification): every earlier row was computed with the true
  (normed) final state of its previous position, and so is this one;
- **step j**: the rows of the ``j - 1`` drafts before it read the head's own outputs, one after the
  other, while every row before those is still computed from true final states.

The engine computes exactly that (:meth:`~hispec_decode.engine.model_runner.ModelRunner`): rows are
computed lazily when the head's logits are asked for, and the rows of tokens the full model has since
verified are recomputed from their true final states first (as EAGLE feeds the target's features of
accepted tokens back into its draft layer), so the keys of every committed position are exact.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from .exit_heads import DecoderBlockHead

if TYPE_CHECKING:
    from ..cache.kv_cache import PagedKVCache
    from ..layers.attention import AttentionMeta
    from .base import DecoderModel


def shift_right(x: torch.Tensor) -> torch.Tensor:
    """[B, T, C] -> the state of the previous position at each position (zeros at t = 0)."""
    return torch.cat([torch.zeros_like(x[:, :1]), x[:, :-1]], dim=1)


def unrolled_attention(q: torch.Tensor, keys: list[torch.Tensor], values: list[torch.Tensor], scale: float,
                       sliding_window: int | None) -> torch.Tensor:
    """Attention of draft step ``j = len(keys)`` at every position at once: the query at ``t`` sees the
    step-1 keys at positions ``<= t - j + 1`` and the step-``i`` key at ``t - j + i`` (``i = 2..j``: the
    drafts before it and itself). ``q``: [B, heads, T, d]; ``keys[i]``, ``values[i]``: [B, kv_heads, T, d].
    Returns [B, T, heads * d]."""
    j, (B, H, T, d) = len(keys), q.shape
    rep = H // keys[0].shape[1]
    t = torch.arange(T, device=q.device)
    k1, v1 = keys[0].repeat_interleave(rep, 1), values[0].repeat_interleave(rep, 1)
    scores = torch.matmul(q, k1.transpose(-1, -2)).float() * scale  # [B, H, T, T]
    allowed = t[None, :] <= t[:, None] - (j - 1)
    if sliding_window is not None:
        allowed &= t[:, None] - t[None, :] < sliding_window
    scores = scores.masked_fill(~allowed, float("-inf"))
    shifted_v = []
    diagonal = []
    for i in range(2, j + 1):
        back = j - i  # the step-i key sits ``back`` positions before the query
        ki = keys[i - 1].repeat_interleave(rep, 1)
        vi = values[i - 1].repeat_interleave(rep, 1)
        ki = torch.cat([ki.new_zeros(B, H, back, d), ki[:, :, : T - back]], dim=2)
        vi = torch.cat([vi.new_zeros(B, H, back, d), vi[:, :, : T - back]], dim=2)
        s = (q * ki).sum(-1).float() * scale  # [B, H, T]
        diagonal.append(s.masked_fill(t[None, None, :] < back, float("-inf")))
        shifted_v.append(vi)
    if diagonal:
        scores = torch.cat([scores, torch.stack(diagonal, dim=-1)], dim=-1)  # [B, H, T, T + j - 1]
    probs = torch.softmax(scores, dim=-1).to(q.dtype)
    out = torch.matmul(probs[..., :T], v1)
    for n, vi in enumerate(shifted_v):
        out = out + probs[..., T + n, None] * vi
    return out.transpose(1, 2).flatten(2)


class FeatureAttentionHead(DecoderBlockHead):
    """``block(h + W [h ; c])`` then norm and the shared LM head (module docstring). Options: those of
    ``decoder_block`` (``source_layer``, ``attention_only``), ``context_size`` (the LM head's input
    size) and ``train_steps`` (draft steps unrolled in training, >= 1)."""

    head_type = "feature_attention"
    has_cache = True
    needs_context = True

    def __init__(self, hidden_size: int, norm_keys: list[str], source_layer: int, decoder: DecoderModel | None = None,
                 attention_only: bool = False, context_size: int | None = None, train_steps: int = 3) -> None:
        super().__init__(hidden_size, norm_keys, source_layer, decoder, attention_only)
        if not isinstance(train_steps, int) or isinstance(train_steps, bool) or train_steps < 1:
            raise ValueError(f"train_steps must be an integer >= 1; got {train_steps!r}")
        self.context_size = context_size or hidden_size
        self.train_steps = train_steps
        self.fuse = nn.Linear(hidden_size + self.context_size, hidden_size, bias=False)
        nn.init.zeros_(self.fuse.weight)
        self._packed_fuse: tuple[tuple, Any] | None = None

    def options(self) -> dict[str, Any]:
        return super().options() | {"context_size": self.context_size, "train_steps": self.train_steps}

    def context_of(self, x: torch.Tensor, decoder: DecoderModel) -> torch.Tensor:
        """This head's estimate of the normed final state, from its output ``x``."""
        params = dict(self.norm.items()) if len(self.norm) else None
        return decoder.exit_norm(x, params)

    def fused_input(self, h: torch.Tensor, context: torch.Tensor) -> torch.Tensor:
        return h + self.fuse(torch.cat([h, context.to(h.dtype)], dim=-1))

    # -- training and evaluation: whole sequences -------------------------------------------------
    def sequence_transform(self, h: torch.Tensor, decoder: DecoderModel) -> torch.Tensor:
        raise RuntimeError("a feature_attention head reads the final states too: use draft_steps")

    def forward(self, h: torch.Tensor, decoder: DecoderModel) -> torch.Tensor:
        raise RuntimeError("a feature_attention head reads the final states too: use draft_steps")

    def draft_steps(self, h: torch.Tensor, decoder: DecoderModel, final: torch.Tensor, steps: int) -> list[torch.Tensor]:
        """The head's output [B, T, hidden] at every position as draft step 1..``steps`` (module
        docstring); contexts from the head's own outputs are detached (no gradient through the chain)."""
        kern = decoder.kernels(self.block, packed=False)
        rope = decoder.rope_for(h.shape[1])
        keys: list[torch.Tensor] = []
        values: list[torch.Tensor] = []
        context = shift_right(final)  # step 1: the true final state of the previous position
        outs = []
        for _ in range(steps):
            def attn(q, key, v, scale, sliding_window):
                keys.append(key)
                values.append(v)
                return unrolled_attention(q, keys, values, scale, sliding_window)

            out = decoder.block(kern, self.fused_input(h, context), rope, attn)
            outs.append(out)
            context = shift_right(self.context_of(out, decoder).detach())  # the next step reads this one's output
        return outs

    def training_transforms(self, h: torch.Tensor, decoder: DecoderModel, final: torch.Tensor) -> list[torch.Tensor]:
        return self.draft_steps(h, decoder, final, self.train_steps)

    # -- decoding: rows of the paged cache -------------------------------------------------------
    def extend(self, h: torch.Tensor, meta: AttentionMeta, cache: PagedKVCache, cache_layer: int,
               decoder: DecoderModel) -> torch.Tensor:
        raise RuntimeError("a feature_attention head's rows need their contexts: use decode_rows")

    def decode_rows(self, h: torch.Tensor, context: torch.Tensor, meta: AttentionMeta, cache: PagedKVCache,
                    cache_layer: int, decoder: DecoderModel) -> torch.Tensor:
        """The head's output at the packed rows ``h`` [1, m, hidden] with contexts [1, m, C], their K/V
        written into ``cache_layer``'s pool at the rows' slots (``meta``)."""
        key = (decoder, self.fuse.weight._version, self.fuse.weight.data_ptr())
        if self._packed_fuse is None or self._packed_fuse[0] != key:  # packed once per weights version
            self._packed_fuse = (key, decoder.linear(self.fuse))
        if self._kernels is None:
            self._kernels = decoder.kernels(self.block)
        u = h + self._packed_fuse[1](torch.cat([h, context.to(h.dtype)], dim=-1))
        return decoder.cached_block(self._kernels, u, meta, cache, cache_layer)

    @classmethod
    def init_options(cls, decoder: DecoderModel, layer: int, options: dict[str, Any]) -> dict[str, Any]:
        return {"context_size": decoder.lm_head.in_features} | super().init_options(decoder, layer, options)
