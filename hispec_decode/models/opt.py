"""OPT decoders: learned positions (offset 2), LayerNorm, pre- or post-LN, optional project_in/out."""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch import nn

from ..layers.attention import AttentionMeta
from .base import AttentionFn, DecoderModel, LayerKernels, module_linears


class OPTModel(DecoderModel):
    """OPT: learned positions (offset 2), LayerNorm, pre- or post-LN, optional project_in/out."""

    FUSED_LINEARS = (("q_proj", "k_proj", "v_proj"),)  # see kernels()

    def __init__(self, model: nn.Module, pack_weights: bool = True) -> None:
        super().__init__(model, pack_weights)
        self.inner = model.model.decoder
        self.layers = self.inner.layers
        self.pre_ln = self.config.do_layer_norm_before
        self.project_out: nn.Module | None = self.inner.project_out  # hidden -> word_embed_proj_dim (OPT-350m)
        self.num_kv_heads = self.config.num_attention_heads
        self.head_dim = self.config.hidden_size // self.num_kv_heads

    def embed(self, tokens: torch.Tensor, meta: AttentionMeta) -> torch.Tensor:
        x = self.inner.embed_tokens(tokens[None])
        if self.inner.project_in is not None:
            x = self.rowwise(self.inner.project_in, x)
        pos = self.inner.embed_positions
        return x + pos.weight[meta.positions + pos.offset][None]

    def rope_for(self, length: int) -> None:
        return None

    def kernels(self, module: nn.Module, packed: bool = True) -> LayerKernels:
        a = module.self_attn
        if getattr(module, "fc1", None) is None:  # attention only
            qkv = self.linear(a.q_proj, a.k_proj, a.v_proj).split if packed else module_linears(a.q_proj, a.k_proj, a.v_proj)
            return LayerKernels(module, qkv, self.linear(a.out_proj) if packed else a.out_proj, None, None)
        if packed:
            fc1 = self.linear(module.fc1)
            return LayerKernels(module, self.linear(a.q_proj, a.k_proj, a.v_proj).split, self.linear(a.out_proj),
                                lambda x: (fc1(x),), self.linear(module.fc2))
        return LayerKernels(module, module_linears(a.q_proj, a.k_proj, a.v_proj), a.out_proj,
                            module_linears(module.fc1), module.fc2)

    def block(self, k: LayerKernels, h: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None,
              attn: AttentionFn) -> torch.Tensor:
        layer, d = k.module, self.head_dim
        B, T = h.shape[:2]
        x = layer.self_attn_layer_norm(h) if self.pre_ln else h
        q, key, v = k.qkv(x)
        q = q * layer.self_attn.scaling  # OPT scales the projected queries, then attends with scale 1
        q, key, v = (t.view(B, T, -1, d).transpose(1, 2) for t in (q, key, v))
        h = h + k.out(attn(q, key, v, 1.0, None))
        if not self.pre_ln:
            h = layer.self_attn_layer_norm(h)
        if k.mlp_in is None:
            return h
        x = layer.final_layer_norm(h) if self.pre_ln else h
        (up,) = k.mlp_in(x)
        h = h + k.mlp_out(layer.activation_fn(up))
        return h if self.pre_ln else layer.final_layer_norm(h)

    def model_norm_params(self) -> dict[str, torch.Tensor]:
        norm = self.inner.final_layer_norm
        if norm is None or norm.weight is None:
            return {}
        return {"weight": norm.weight, "bias": norm.bias}

    def exit_norm(self, h: torch.Tensor, params: dict[str, torch.Tensor] | None = None) -> torch.Tensor:
        norm = self.inner.final_layer_norm
        if norm is not None:
            p = self.norm_params() if params is None else params
            h = F.layer_norm(h, norm.normalized_shape, p.get("weight"), p.get("bias"), norm.eps)
        if self.project_out is not None:
            h = self.rowwise(self.project_out, h.to(self.project_out.weight.dtype))
        return h

    def keep_exit(self, device: torch.device) -> None:
        super().keep_exit(device)
        if self.project_out is not None:
            self.project_out = copy.deepcopy(self.project_out).to(device)
