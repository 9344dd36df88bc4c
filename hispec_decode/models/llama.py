"""Llama-family decoders: Llama 2/3, CodeLlama, SmolLM2, Qwen2/2.5 (q/k/v biases), Qwen3 (q/k norms)."""

from __future__ import annotations

import torch
from torch import nn

from .. import kernels
from ..layers.attention import AttentionMeta, TreeRows
from ..cache.kv_cache import PagedKVCache
from .base import AttentionFn, DecoderModel, LayerKernels, module_linears, stack_linear

Rope = tuple[torch.Tensor, torch.Tensor]  # cos, sin [1, 1, T, head_dim]


def rms_norm(x: torch.Tensor, norm: nn.Module) -> torch.Tensor:
    """RMSNorm as transformers computes it: normalise in float32, scale in the model's dtype."""
    return kernels.rms_norm(x, norm.weight, norm.variance_epsilon)


class LlamaModel(DecoderModel):
    """Llama 2/3, CodeLlama, SmolLM2, Qwen2/2.5 (q/k/v biases), Qwen3 (q/k norms, sliding layers)."""

    FUSED_LINEARS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))  # see kernels()

    def __init__(self, model: nn.Module, pack_weights: bool = True) -> None:
        super().__init__(model, pack_weights)
        self.inner = model.model
        self.layers = self.inner.layers
        self.head_dim = self.layers[0].self_attn.head_dim
        self.num_kv_heads = self.config.num_key_value_heads
        rope_type = (getattr(self.config, "rope_parameters", None) or {}).get("rope_type", "default")
        self._static_rope = rope_type not in ("dynamic", "longrope")
        self._rope: Rope | None = None  # the table of positions 0.._rope_length-1
        self._rope_length = 0

    def rotary(self, positions: torch.Tensor) -> Rope:
        """The model's own rotary values at ``positions`` [1, n]: cos, sin as [1, 1, n, head_dim]."""
        probe = torch.empty(0, dtype=self.dtype, device=self.device)
        cos, sin = self.inner.rotary_emb(probe, positions)  # [1, n, head_dim]
        return cos[:, None], sin[:, None]

    @staticmethod
    def take(rope: Rope, idx: torch.Tensor | slice) -> Rope:
        """``rope`` at positions ``idx`` (its third dimension)."""
        cos, sin = rope
        return cos[:, :, idx], sin[:, :, idx]

    def rope_table(self, length: int) -> Rope:
        """The rotary values of positions 0..≥length-1, cached (position-independent rope types
        only: a table equals per-call values exactly, since each entry depends only on its own
        position)."""
        if self._rope is None or self._rope_length < length:
            size = max(length, min(2 * self._rope_length or 256, self.max_positions))
            self._rope, self._rope_length = self.rotary(torch.arange(size, device=self.device)[None]), size
        return self._rope

    def meta(self, cache: PagedKVCache, spans: list[tuple[int, int, int]],
             trees: list[TreeRows | None] | None = None) -> AttentionMeta:
        meta = super().meta(cache, spans, trees)
        if self._static_rope:
            table = self.rope_table(max(start + n for _, start, n in spans))
            meta.rope = self.take(table, meta.contiguous_positions or meta.positions)
        else:  # length-dependent rope (dynamic NTK, longrope): per sequence, for these positions
            parts = [self.rotary(meta.positions[None, s.offset : s.offset + s.num_new]) for s in meta.segments]
            meta.rope = (torch.cat([c for c, _ in parts], 2), torch.cat([s for _, s in parts], 2))
        return meta

    def rope_for(self, length: int) -> Rope:
        if self._static_rope:
            return self.take(self.rope_table(length), slice(0, length))
        return self.rotary(torch.arange(length, device=self.device)[None])

    def embed(self, tokens: torch.Tensor, meta: AttentionMeta) -> torch.Tensor:
        return self.inner.embed_tokens(tokens[None])

    def kernels(self, module: nn.Module, packed: bool = True) -> LayerKernels:
        a, mlp = module.self_attn, getattr(module, "mlp", None)
        sliding_window = getattr(a, "sliding_window", None)
        if mlp is None:  # attention only
            qkv = self.linear(a.q_proj, a.k_proj, a.v_proj).split if packed else module_linears(a.q_proj, a.k_proj, a.v_proj)
            return LayerKernels(module, qkv, self.linear(a.o_proj) if packed else a.o_proj, None, None, sliding_window)
        if packed:  # mlp_in: the fused [..., 2 * intermediate] gate/up output
            fused = (self.linear(a.q_proj, a.k_proj, a.v_proj), self.linear(a.o_proj),
                     self.linear(mlp.gate_proj, mlp.up_proj), self.linear(mlp.down_proj))
            return LayerKernels(module, fused[0].split, *fused[1:], sliding_window, fused)
        return LayerKernels(module, module_linears(a.q_proj, a.k_proj, a.v_proj), a.o_proj,
                            lambda x: torch.cat([mlp.gate_proj(x), mlp.up_proj(x)], -1), mlp.down_proj, sliding_window)

    def block(self, k: LayerKernels, h: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None,
              attn: AttentionFn) -> torch.Tensor:
        layer, a, d = k.module, k.module.self_attn, self.head_dim
        B, T = h.shape[:2]
        x = rms_norm(h, layer.input_layernorm)
        q, key, v = k.qkv(x)
        q, key, v = q.view(B, T, -1, d), key.view(B, T, -1, d), v.view(B, T, -1, d)
        if hasattr(a, "q_norm"):  # Qwen3
            q, key = rms_norm(q, a.q_norm), rms_norm(key, a.k_norm)
        q, key = kernels.rope(q, key, *rope)  # [B, heads, T, d]
        h = h + k.out(attn(q, key, v.transpose(1, 2), a.scaling, k.sliding_window))
        if k.mlp_in is None:
            return h
        x = rms_norm(h, layer.post_attention_layernorm)
        gate_up = k.mlp_in(x)
        if self.config.hidden_act == "silu":
            return h + k.mlp_out(kernels.silu_and_mul(gate_up))
        gate, up = gate_up.chunk(2, dim=-1)
        return h + k.mlp_out(layer.mlp.act_fn(gate) * up)

    def stack_layer(self, k, lk: LayerKernels):
        if not lk.fused or self.config.hidden_act != "silu":
            return None
        linears = [stack_linear(k, f) for f in lk.fused]
        layer, a = lk.module, lk.module.self_attn
        norms = [layer.input_layernorm, layer.post_attention_layernorm] + ([a.q_norm, a.k_norm] if hasattr(a, "q_norm") else [])
        if None in linears or any(n.weight.dtype != self.dtype for n in norms):
            return None
        inp, post, *qk = (k.StackNorm(n.weight.detach(), n.variance_epsilon, False) for n in norms)
        return k.StackLayer(*linears, inp, post, None, None, *(qk or (None, None)), lk.sliding_window or 0, 0, a.scaling)

    def model_norm_params(self) -> dict[str, torch.Tensor]:
        return {"weight": self.inner.norm.weight}

    def exit_norm(self, h: torch.Tensor, params: dict[str, torch.Tensor] | None = None) -> torch.Tensor:
        weight = (self.norm_params() if params is None else params)["weight"]
        return kernels.rms_norm(h, weight, self.inner.norm.variance_epsilon)
