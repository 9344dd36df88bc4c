"""Gemma 3 text decoders (Gemma-3-270M, 1B and the text tower of the larger ones).

What differs from Llama, each read from the model's own modules: a scaled embedding (the
module scales), Gemma's RMSNorm (``x̂ · (1 + w)`` in float32, then cast), four norms per layer
(before and after attention, before and after the MLP), q/k norms, a GELU-tanh MLP, attention
scaled by ``query_pre_attn_scalar ** -0.5``, and two kinds of layer: ``sliding_attention``
layers see the last ``sliding_window`` positions with their own rotary base, ``full_attention``
layers see everything with theirs. The rotary tables are therefore one per layer type, handed to
every layer in ``meta.rope`` as ``{layer_type: (cos, sin)}``.

The paged cache keeps one block table per sequence for all layers: local layers read only
their window (the attention kernels' lower bound), and no block is freed behind the window,
since the global layers read every position (docs/gemma3.md).
"""

from __future__ import annotations

import torch
from torch import nn

from .. import kernels
from ..errors import UnsupportedArchitectureError
from .base import AttentionFn, LayerKernels, stack_linear
from .llama import LlamaModel

RopeTables = dict[str, tuple[torch.Tensor, torch.Tensor]]  # layer type -> cos, sin [1, 1, T, head_dim]


def gemma_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Gemma's RMSNorm: normalise and scale by ``1 + weight`` in float32, then cast to x's dtype."""
    return kernels.gemma_rms_norm(x, 1.0 + weight.float(), eps)


_SCALE = "_hispec_gemma_scale"  # a frozen norm's float32 1 + weight, with the weight's version it was made from


def _scale(weight: torch.Tensor, owner: nn.Module) -> torch.Tensor:
    """``1 + weight`` in float32, kept on the module while the weight is frozen and unchanged (an
    in-place update bumps ``_version``; a trainable weight is recomputed every call for autograd)."""
    if weight.requires_grad and torch.is_grad_enabled():
        return 1.0 + weight.float()
    key = (weight.data_ptr(), weight._version, weight.device)
    kept = owner.__dict__.get(_SCALE)
    if kept is None or kept[0] != key:
        kept = (key, 1.0 + weight.detach().float())
        owner.__dict__[_SCALE] = kept
    return kept[1]


def _norm(x: torch.Tensor, norm: nn.Module) -> torch.Tensor:
    return kernels.gemma_rms_norm(x, _scale(norm.weight, norm), norm.eps)


class Gemma3Model(LlamaModel):
    """Gemma 3 (text): local/global layers, four norms per layer, q/k norms, scaled embedding."""

    def __init__(self, model: nn.Module, pack_weights: bool = True) -> None:
        super().__init__(model, pack_weights)
        cfg = self.config
        for name in ("attn_logit_softcapping", "final_logit_softcapping"):
            if getattr(cfg, name, None) is not None:
                raise UnsupportedArchitectureError(f"gemma3 with {name}={getattr(cfg, name)} is not supported")
        if getattr(cfg, "use_bidirectional_attention", False):
            raise UnsupportedArchitectureError("gemma3 with use_bidirectional_attention (an encoder) is not supported")
        rope = cfg.rope_parameters or {}
        if any(p.get("rope_type", "default") in ("dynamic", "longrope") for p in rope.values()):
            raise UnsupportedArchitectureError(f"gemma3 with a length-dependent rope type is not supported: {rope}")
        self.layer_types: list[str] = sorted(set(cfg.layer_types))

    def rotary(self, positions: torch.Tensor) -> RopeTables:
        probe = torch.empty(0, dtype=self.dtype, device=self.device)
        tables = {}
        for t in self.layer_types:
            cos, sin = self.inner.rotary_emb(probe, positions, t)  # [1, n, head_dim]
            tables[t] = (cos[:, None], sin[:, None])
        return tables

    @staticmethod
    def take(rope: RopeTables, idx: torch.Tensor | slice) -> RopeTables:
        return {t: (cos[:, :, idx], sin[:, :, idx]) for t, (cos, sin) in rope.items()}

    def block(self, k: LayerKernels, h: torch.Tensor, rope: RopeTables | None, attn: AttentionFn) -> torch.Tensor:
        layer, a, d = k.module, k.module.self_attn, self.head_dim
        B, T = h.shape[:2]
        q, key, v = k.qkv(_norm(h, layer.input_layernorm))
        q, key, v = q.view(B, T, -1, d), key.view(B, T, -1, d), v.view(B, T, -1, d)
        q, key = kernels.rope(_norm(q, a.q_norm), _norm(key, a.k_norm), *rope[a.layer_type])  # [B, heads, T, d]
        o = k.out(attn(q, key, v.transpose(1, 2), a.scaling, k.sliding_window))
        h = h + _norm(o, layer.post_attention_layernorm)
        if k.mlp_in is None:  # an attention-only head block
            return h
        gate, up = k.mlp_in(_norm(h, layer.pre_feedforward_layernorm)).chunk(2, dim=-1)
        return h + _norm(k.mlp_out(layer.mlp.act_fn(gate) * up), layer.post_feedforward_layernorm)

    def stack_layer(self, k, lk: LayerKernels):
        layer, a = lk.module, lk.module.self_attn
        act = getattr(layer.mlp, "act_fn", None)
        gelu = type(act).__name__ == "GELUTanh" and getattr(getattr(act, "act", None), "keywords", {}) == {"approximate": "tanh"}
        linears = [stack_linear(k, f) for f in lk.fused]
        if not lk.fused or not gelu or None in linears:
            return None
        norm = lambda n: k.StackNorm(_scale(n.weight, n), n.eps, True)
        return k.StackLayer(*linears, norm(layer.input_layernorm), norm(layer.pre_feedforward_layernorm),
                            norm(layer.post_attention_layernorm), norm(layer.post_feedforward_layernorm),
                            norm(a.q_norm), norm(a.k_norm), lk.sliding_window or 0,
                            self.layer_types.index(a.layer_type), a.scaling)

    def stack_activation(self) -> str:
        return "gelu_tanh"

    def stack_rope(self, rope: RopeTables) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        return [rope[t][0] for t in self.layer_types], [rope[t][1] for t in self.layer_types]

    def exit_norm(self, h: torch.Tensor, params: dict[str, torch.Tensor] | None = None) -> torch.Tensor:
        weight = (self.norm_params() if params is None else params)["weight"]
        return gemma_rms_norm(h, weight, self.inner.norm.eps)
