"""Architecture adapters: run a Hugging Face decoder's own modules layer by layer over our cache.

No modeling file is copied: each adapter reads the model's modules (projections, norms, rotary
embedding, MLP) and calls them, adding only what the engine needs: an explicit write position
in a :class:`~hispec_decode.paged_cache.PagedKVCache`, explicit attention metadata for a ragged
batch, and the ability to start and stop at any layer (``run(h, lo, hi)`` runs ``layers[lo:hi]``).

For speed the q/k/v projections and the MLP's gate/up projections are fused into one matmul
each, and on CPU every linear runs on oneDNN-packed weights (see :mod:`hispec_decode.linear`).
"""

from __future__ import annotations

import copy
import hashlib
from abc import ABC, abstractmethod
from dataclasses import dataclass
from functools import cached_property
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from .attention import AttentionMeta, attend, build_meta
from .errors import UnsupportedArchitectureError
from .paged_cache import PagedKVCache
from .linear import FusedLinear


# (q, k, v, scale, window) -> attention output [B, T, heads * head_dim]; q/k/v are [B, heads, T, d]
AttentionFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, float, "int | None"], torch.Tensor]


@dataclass
class LayerKernels:
    """What one decoder layer computes with: its module (norms, activation) and its linears,
    fused and packed for decoding or the module's own (differentiable) ones for training."""

    module: nn.Module
    qkv: Callable[[torch.Tensor], tuple[torch.Tensor, ...]]
    out: Callable[[torch.Tensor], torch.Tensor]
    mlp_in: Callable[[torch.Tensor], tuple[torch.Tensor, ...]]
    mlp_out: Callable[[torch.Tensor], torch.Tensor]
    window: int | None = None


def _module_linears(*linears: nn.Module) -> Callable[[torch.Tensor], tuple[torch.Tensor, ...]]:
    return lambda x: tuple(lin(x) for lin in linears)


class DecoderAdapter(ABC):
    """The engine's view of one base model: embed, run any slice of layers, exit to logits."""

    def __init__(self, model: nn.Module, pack_weights: bool = True) -> None:
        self.model = model
        self.config = model.config
        self.pack = pack_weights
        self.num_layers: int = self.config.num_hidden_layers
        self.vocab_size: int = self.config.vocab_size
        self.max_positions: int = self.config.max_position_embeddings
        self.lm_head: nn.Module = model.get_output_embeddings()
        self.lm_head_kernel = FusedLinear([self.lm_head], pack_weights)
        self.kept_norm: dict[str, torch.Tensor] | None = None  # see keep_exit
        self._vocab_kernels: dict = {}  # see vocab_logits: id(tensor) -> (tensor, kernel), content -> kernel

    @cached_property
    def layer_kernels(self) -> list[LayerKernels]:
        """Kernels of every base layer, built on first use (training never runs them)."""
        return [self.kernels(layer) for layer in self.layers]

    def linear(self, *linears: nn.Linear) -> FusedLinear:
        return FusedLinear(list(linears), self.pack)

    @property
    def dtype(self) -> torch.dtype:
        return self.lm_head.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.lm_head.weight.device

    # -- the pieces every architecture provides -------------------------------------------
    @abstractmethod
    def embed(self, tokens: torch.Tensor, meta: AttentionMeta) -> torch.Tensor:
        """Token ids [T] -> input hidden states [1, T, hidden]."""

    @abstractmethod
    def kernels(self, module: nn.Module, packed: bool = True) -> LayerKernels:
        """Kernels of a decoder layer module (one of the base's, or a head's copy of one)."""

    @abstractmethod
    def block(self, k: LayerKernels, h: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None,
              attn: AttentionFn) -> torch.Tensor:
        """One decoder layer on [B, T, hidden]; ``attn`` decides what the queries attend to."""

    @abstractmethod
    def rope_for(self, length: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Rotary tables of positions ``0..length-1`` (None for learned positions)."""

    @abstractmethod
    def model_norm_params(self) -> dict[str, torch.Tensor]:
        """The model's final norm parameters."""

    def norm_params(self) -> dict[str, torch.Tensor]:
        """The final norm's parameters (a head may own a trainable copy)."""
        return self.kept_norm if self.kept_norm is not None else self.model_norm_params()

    def keep_exit(self, device: torch.device) -> None:
        """Use private, whole copies of the final norm and the LM head from now on: for when the
        model's own parameters are about to be partitioned (training under ZeRO-3)."""
        self.lm_head = copy.deepcopy(self.lm_head).to(device)
        self.lm_head_kernel = FusedLinear([self.lm_head], pack=False)
        self.kept_norm = {k: v.detach().clone().to(device) for k, v in self.model_norm_params().items()}

    @abstractmethod
    def exit_norm(self, h: torch.Tensor, params: dict[str, torch.Tensor] | None = None) -> torch.Tensor:
        """The final norm (with ``params`` if given, else the base's) and any projection to the LM head."""

    @property
    @abstractmethod
    def num_kv_heads(self) -> int: ...

    @property
    @abstractmethod
    def head_dim(self) -> int: ...

    # -- shared ---------------------------------------------------------------------------
    def meta(self, cache: PagedKVCache, spans: list[tuple[int, int, int]]) -> AttentionMeta:
        """Metadata of one packed call: ``spans`` holds ``(seq_id, start, num_new)`` per sequence."""
        return build_meta(cache, spans)

    def cached_block(self, k: LayerKernels, h: torch.Tensor, meta: AttentionMeta, cache: PagedKVCache,
                     cache_layer: int) -> torch.Tensor:
        """A layer over the packed new tokens [1, T, hidden], its K/V in ``cache_layer``'s pool."""
        def attn(q, key, v, scale, window):
            return attend(q, key, v, meta, cache, cache_layer, scale, window)

        return self.block(k, h, meta.rope, attn)

    def causal_block(self, module: nn.Module, h: torch.Tensor) -> torch.Tensor:
        """A layer over whole sequences [B, T, hidden] with causal attention and no cache,
        differentiable through the module's own weights (training a head's block)."""
        def attn(q, key, v, scale, window):
            T = q.shape[2]
            mask = None
            if window is not None and window < T:
                i = torch.arange(T, device=q.device)
                mask = (i[None, :] <= i[:, None]) & (i[None, :] > i[:, None] - window)
            o = F.scaled_dot_product_attention(q, key, v, attn_mask=mask, is_causal=mask is None, scale=scale,
                                               enable_gqa=q.shape[1] != key.shape[1])
            return o.transpose(1, 2).flatten(2)

        return self.block(self.kernels(module, packed=False), h, self.rope_for(h.shape[1]), attn)

    def run(self, h: torch.Tensor, lo: int, hi: int, meta: AttentionMeta, cache: PagedKVCache) -> torch.Tensor:
        """Run ``layers[lo:hi]``."""
        for i in range(lo, hi):
            h = self.cached_block(self.layer_kernels[i], h, meta, cache, i)
        return h

    def lm_logits(self, h: torch.Tensor) -> torch.Tensor:
        """The shared LM head (input: the output of :meth:`exit_norm`, cast to the model's dtype)."""
        return self.lm_head_kernel(h.to(self.dtype))

    def vocab_logits(self, h: torch.Tensor, vocab: torch.Tensor) -> torch.Tensor:
        """The LM head restricted to the rows ``vocab`` (token ids): their logits, ``-inf`` for
        every other token. Costs ``len(vocab) / vocab_size`` of the full LM head (a reduced
        early-exit vocabulary; the sub-matrix is cut and packed once per vocabulary)."""
        cached = self._vocab_kernels.get(id(vocab))
        if cached is not None and cached[0] is vocab:  # holding the tensor keeps its id from being reused
            kernel = cached[1]
        else:  # heads with equal vocabularies share one kernel
            content = (hashlib.sha256(vocab.cpu().numpy().tobytes()).hexdigest(), self.device, self.dtype)
            kernel = self._vocab_kernels.get(content) or self._vocab_kernel(vocab)
            self._vocab_kernels[content] = kernel
            self._vocab_kernels[id(vocab)] = (vocab, kernel)
        small = kernel(h.to(self.dtype))  # [..., len(vocab)]
        out = small.new_full((*small.shape[:-1], self.lm_head.out_features), float("-inf"))
        out[..., vocab] = small
        return out

    def _vocab_kernel(self, vocab: torch.Tensor) -> FusedLinear:
        full = self.lm_head
        sub = nn.Linear(full.in_features, vocab.numel(), bias=full.bias is not None, device=self.device, dtype=self.dtype)
        with torch.no_grad():
            sub.weight.copy_(full.weight[vocab])
            if full.bias is not None:
                sub.bias.copy_(full.bias[vocab])
        return FusedLinear([sub.requires_grad_(False)], self.pack)

    def final_logits(self, h: torch.Tensor) -> torch.Tensor:
        return self.lm_logits(self.exit_norm(h))

    def new_cache(self, num_blocks: int, block_size: int, extra_layers: int = 0) -> PagedKVCache:
        """A paged cache for every layer plus ``extra_layers`` (exit heads with attention)."""
        return PagedKVCache(self.num_layers + extra_layers, self.num_kv_heads, self.head_dim, num_blocks,
                            block_size, self.dtype, self.device)


def _rms(x: torch.Tensor, norm: nn.Module) -> torch.Tensor:
    """RMSNorm as transformers computes it: normalise in float32, scale in the model's dtype."""
    return norm.weight * F.rms_norm(x.float(), (x.shape[-1],), None, norm.variance_epsilon).to(x.dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class LlamaAdapter(DecoderAdapter):
    """Llama 2/3, CodeLlama, SmolLM2, Qwen2/2.5 (q/k/v biases), Qwen3 (q/k norms, sliding layers)."""

    def __init__(self, model: nn.Module, pack_weights: bool = True) -> None:
        super().__init__(model, pack_weights)
        self.inner = model.model
        self.layers = self.inner.layers
        self._head_dim = self.layers[0].self_attn.head_dim
        self._num_kv_heads = self.config.num_key_value_heads
        rope_type = (getattr(self.config, "rope_parameters", None) or {}).get("rope_type", "default")
        self._static_rope = rope_type not in ("dynamic", "longrope")
        self._rope: tuple[torch.Tensor, torch.Tensor] | None = None

    @property
    def num_kv_heads(self) -> int:
        return self._num_kv_heads

    @property
    def head_dim(self) -> int:
        return self._head_dim

    def rope_table(self, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin of positions 0..length-1, [1, 1, length, head_dim], computed by the model's
        own rotary module and cached (position-independent rope types only: a table equals
        per-call values exactly, since each entry depends only on its own position)."""
        if self._rope is None or self._rope[0].shape[2] < length:
            grown = 2 * self._rope[0].shape[2] if self._rope else 256
            size = max(length, min(grown, self.max_positions))
            probe = torch.empty(0, dtype=self.dtype, device=self.device)
            positions = torch.arange(size, device=self.device)[None]
            cos, sin = self.inner.rotary_emb(probe, positions)  # [1, size, head_dim]
            self._rope = (cos[:, None], sin[:, None])
        return self._rope

    def meta(self, cache: PagedKVCache, spans: list[tuple[int, int, int]]) -> AttentionMeta:
        meta = super().meta(cache, spans)
        if self._static_rope:
            cos, sin = self.rope_table(max(start + n for _, start, n in spans))
            idx = meta.contiguous_positions or meta.positions
            meta.rope = (cos[:, :, idx], sin[:, :, idx])
        else:  # length-dependent rope (dynamic NTK, longrope): per sequence, for these positions
            probe = torch.empty(0, dtype=self.dtype, device=self.device)
            parts = [self.inner.rotary_emb(probe, meta.positions[None, s.offset : s.offset + s.num_new])
                     for s in meta.segments]
            meta.rope = (torch.cat([c for c, _ in parts], 1)[:, None], torch.cat([s for _, s in parts], 1)[:, None])
        return meta

    def rope_for(self, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        if self._static_rope:
            cos, sin = self.rope_table(length)
            return cos[:, :, :length], sin[:, :, :length]
        probe = torch.empty(0, dtype=self.dtype, device=self.device)
        cos, sin = self.inner.rotary_emb(probe, torch.arange(length, device=self.device)[None])
        return cos[:, None], sin[:, None]

    def embed(self, tokens: torch.Tensor, meta: AttentionMeta) -> torch.Tensor:
        return self.inner.embed_tokens(tokens[None])

    def kernels(self, module: nn.Module, packed: bool = True) -> LayerKernels:
        a, mlp = module.self_attn, module.mlp
        window = getattr(a, "sliding_window", None)
        if packed:
            return LayerKernels(module, self.linear(a.q_proj, a.k_proj, a.v_proj).split, self.linear(a.o_proj),
                                self.linear(mlp.gate_proj, mlp.up_proj).split, self.linear(mlp.down_proj), window)
        return LayerKernels(module, _module_linears(a.q_proj, a.k_proj, a.v_proj), a.o_proj,
                            _module_linears(mlp.gate_proj, mlp.up_proj), mlp.down_proj, window)

    def block(self, k: LayerKernels, h: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None,
              attn: AttentionFn) -> torch.Tensor:
        layer, a, d = k.module, k.module.self_attn, self._head_dim
        B, T = h.shape[:2]
        x = _rms(h, layer.input_layernorm)
        q, key, v = k.qkv(x)
        q, key, v = q.view(B, T, -1, d), key.view(B, T, -1, d), v.view(B, T, -1, d)
        if hasattr(a, "q_norm"):  # Qwen3
            q, key = _rms(q, a.q_norm), _rms(key, a.k_norm)
        q, key, v = q.transpose(1, 2), key.transpose(1, 2), v.transpose(1, 2)  # [B, heads, T, d]
        cos, sin = rope
        q = q * cos + _rotate_half(q) * sin
        key = key * cos + _rotate_half(key) * sin
        h = h + k.out(attn(q, key, v, a.scaling, k.window))
        x = _rms(h, layer.post_attention_layernorm)
        gate, up = k.mlp_in(x)
        return h + k.mlp_out(layer.mlp.act_fn(gate) * up)

    def model_norm_params(self) -> dict[str, torch.Tensor]:
        return {"weight": self.inner.norm.weight}

    def exit_norm(self, h: torch.Tensor, params: dict[str, torch.Tensor] | None = None) -> torch.Tensor:
        weight = (self.norm_params() if params is None else params)["weight"]
        return weight * F.rms_norm(h.float(), (h.shape[-1],), None, self.inner.norm.variance_epsilon).to(h.dtype)


class OPTAdapter(DecoderAdapter):
    """OPT: learned positions (offset 2), LayerNorm, pre- or post-LN, optional project_in/out."""

    def __init__(self, model: nn.Module, pack_weights: bool = True) -> None:
        super().__init__(model, pack_weights)
        self.inner = model.model.decoder
        self.layers = self.inner.layers
        self.pre_ln = self.config.do_layer_norm_before
        self.project_out: nn.Module | None = self.inner.project_out  # hidden -> word_embed_proj_dim (OPT-350m)
        self._num_heads = self.config.num_attention_heads
        self._head_dim = self.config.hidden_size // self._num_heads

    @property
    def num_kv_heads(self) -> int:
        return self._num_heads

    @property
    def head_dim(self) -> int:
        return self._head_dim

    def embed(self, tokens: torch.Tensor, meta: AttentionMeta) -> torch.Tensor:
        x = self.inner.embed_tokens(tokens[None])
        if self.inner.project_in is not None:
            x = self.inner.project_in(x)
        pos = self.inner.embed_positions
        return x + pos.weight[meta.positions + pos.offset][None]

    def rope_for(self, length: int) -> None:
        return None

    def kernels(self, module: nn.Module, packed: bool = True) -> LayerKernels:
        a = module.self_attn
        if packed:
            fc1 = self.linear(module.fc1)
            return LayerKernels(module, self.linear(a.q_proj, a.k_proj, a.v_proj).split, self.linear(a.out_proj),
                                lambda x: (fc1(x),), self.linear(module.fc2))
        return LayerKernels(module, _module_linears(a.q_proj, a.k_proj, a.v_proj), a.out_proj,
                            _module_linears(module.fc1), module.fc2)

    def block(self, k: LayerKernels, h: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None,
              attn: AttentionFn) -> torch.Tensor:
        layer, d = k.module, self._head_dim
        B, T = h.shape[:2]
        x = layer.self_attn_layer_norm(h) if self.pre_ln else h
        q, key, v = k.qkv(x)
        q = q * layer.self_attn.scaling  # OPT scales the projected queries, then attends with scale 1
        q, key, v = (t.view(B, T, -1, d).transpose(1, 2) for t in (q, key, v))
        h = h + k.out(attn(q, key, v, 1.0, None))
        if not self.pre_ln:
            h = layer.self_attn_layer_norm(h)
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
            h = self.project_out(h.to(self.project_out.weight.dtype))
        return h

    def keep_exit(self, device: torch.device) -> None:
        super().keep_exit(device)
        if self.project_out is not None:
            self.project_out = copy.deepcopy(self.project_out).to(device)


ADAPTERS: dict[str, type[DecoderAdapter]] = {
    "llama": LlamaAdapter,
    "qwen2": LlamaAdapter,
    "qwen3": LlamaAdapter,
    "opt": OPTAdapter,
}
SUPPORTED_MODEL_TYPES = tuple(sorted(ADAPTERS))


def check_supported(model_type: str) -> None:
    if model_type not in ADAPTERS:
        raise UnsupportedArchitectureError(
            f"architecture {model_type!r} is not supported; supported model types: {', '.join(SUPPORTED_MODEL_TYPES)}"
        )


def adapter_for(model: nn.Module, pack_weights: bool = True) -> DecoderAdapter:
    """Wrap a loaded Hugging Face causal LM; fails for architectures this engine cannot run."""
    check_supported(model.config.model_type)
    return ADAPTERS[model.config.model_type](model, pack_weights)
