"""``DecoderModel``: the engine's view of a Hugging Face decoder, run layer by layer over our cache.

No modeling file is copied: each family (``llama.py``, ``opt.py``) reads the model's own modules
(projections, norms, rotary embedding, MLP) and calls them, adding only what the engine needs: an
explicit write position in a :class:`~hispec_decode.cache.kv_cache.PagedKVCache`, explicit
attention metadata for a ragged batch, and the ability to start and stop at any layer
(``run(h, lo, hi)`` runs ``layers[lo:hi]``).

For speed the q/k/v projections and the MLP's gate/up projections are fused into one matmul
each, and on CPU every linear runs on oneDNN-packed weights (see :mod:`hispec_decode.layers.linear`).
"""

from __future__ import annotations

import copy
import hashlib
import os
from abc import ABC, abstractmethod
from dataclasses import dataclass
from functools import cached_property
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

from .. import kernels
from ..cache.kv_cache import PagedKVCache
from ..errors import HiSpecError
from ..layers.attention import PAGED_MAX_NEW, AttentionMeta, TreeRows, attend, attend_invariant, build_meta
from ..layers.huge_pages import move_to_huge_pages
from ..layers.linear import FusedLinear, in_row_chunks
from ..layers.quant import BlockLinear, has_kernel as has_block_kernel


INVARIANT_ROWS = 8  # rows per GEMM call in the batch-invariant mode (docs/batch-invariance.md)

# (q, k, v, scale, sliding_window) -> attention output [B, T, heads * head_dim]; q/k/v are [B, heads, T, d]
AttentionFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, float, "int | None"], torch.Tensor]


@dataclass
class LayerKernels:
    """What one decoder layer computes with: its module (norms, activation) and its linears,
    fused and packed for decoding or the module's own (differentiable) ones for training."""

    module: nn.Module
    qkv: Callable[[torch.Tensor], tuple[torch.Tensor, ...]]
    out: Callable[[torch.Tensor], torch.Tensor]
    mlp_in: Callable[[torch.Tensor], tuple[torch.Tensor, ...]] | None  # None: an attention-only layer (a
    mlp_out: Callable[[torch.Tensor], torch.Tensor] | None  # Kangaroo-style head's block, its MLP removed)
    sliding_window: int | None = None  # attention span of a sliding-window layer (Qwen3); None: all
    fused: tuple[FusedLinear, ...] = ()  # packed kernels: qkv, out, mlp_in, mlp_out (what a layer stack runs)


def stack_linear(k: Any, linear: FusedLinear) -> Any | None:
    """A packed linear for the compiled layer stack: its VNNI weight, its GGUF blocks (where the block
    kernel is built), or oneDNN's without row chunks."""
    if linear.blocks is not None:
        if not k.linear_q_available():
            return None
        return k.StackLinear.blocks([p.blocks for p in linear.blocks], [p.ggml_type for p in linear.blocks],
                                    [p.bias if p.bias is not None else torch.empty(0) for p in linear.blocks],
                                    linear.out_features)
    if linear.vnni is not None:
        return k.StackLinear(linear.vnni, linear.vnni_bias, None, None, linear.out_features, linear.amx)
    if linear.packed and linear.rows is None:
        return k.StackLinear(None, None, linear.weight, linear.bias, linear.out_features, False)
    return None


def head_kernel(head: nn.Module, pack: bool, rows: int | None = None) -> FusedLinear:
    """An LM head's kernel (or a vocabulary's rows of it); a bf16 VNNI copy on 2 MiB pages."""
    kernel = FusedLinear([head], pack, rows)
    if kernel.vnni is not None:
        move_to_huge_pages([kernel.vnni])
    return kernel


def module_linears(*linears: nn.Module) -> Callable[[torch.Tensor], tuple[torch.Tensor, ...]]:
    return lambda x: tuple(lin(x) for lin in linears)


class DecoderModel(ABC):
    """The engine's view of one base model: embed, run any slice of layers, exit to logits.
    One subclass per architecture family (see :mod:`hispec_decode.models.registry`)."""

    FUSED_LINEARS: tuple[tuple[str, ...], ...] = ()  # sibling linears (by name, in order) a layer fuses into one

    def __init__(self, model: nn.Module, pack_weights: bool = True) -> None:
        self.model = model
        self.config = model.config
        self.pack = pack_weights
        self.num_layers: int = self.config.num_hidden_layers
        self.vocab_size: int = self.config.vocab_size
        self.max_positions: int = self.config.max_position_embeddings
        self.num_kv_heads: int = 0  # K/V heads per layer and their size: set by each family
        self.head_dim: int = 0
        self.lm_head: nn.Module = model.get_output_embeddings()
        self.lm_head_kernel = head_kernel(self.lm_head, pack_weights)
        self.kept_norm: dict[str, torch.Tensor] | None = None  # see keep_exit
        self._vocab_kernels: dict = {}  # see vocab_logits: id(tensor) -> (tensor, kernel), content -> kernel
        self.row_bucket: int | None = None  # the batch-invariant mode's fixed GEMM row count (set_batch_invariant)
        self.use_stack = True  # run layers on the compiled layer stack where it can (see layer_stack)

    def set_batch_invariant(self, rows: int | None = INVARIANT_ROWS) -> None:
        """Make every row's numbers independent of the other rows of its pass and of their count:
        linears (and heads) run on chunks of exactly ``rows`` rows, attention one query row at a
        time over exactly its own keys (:func:`~hispec_decode.layers.attention.attend_invariant`);
        norms and elementwise ops are row-wise already. ``None`` switches it off. Call it before
        decoding (``from_pretrained(batch_invariant=True)`` does): caches and the packed kernels of
        ``decoder_block`` heads built earlier keep the mode they were built in. Rotary embeddings
        that depend on the call's longest position (dynamic NTK, longrope) are not batch-invariant
        past the original context."""
        self.row_bucket = rows
        self.lm_head_kernel = head_kernel(self.lm_head, self.pack and self.kept_norm is None, rows)
        self._vocab_kernels = {}
        self.__dict__.pop("layer_kernels", None)  # rebuilt with the new row bucket on first use
        self.__dict__.pop("layer_stack", None)

    @property
    def batch_invariant(self) -> bool:
        return self.row_bucket is not None

    def invariance_is_free(self) -> bool:
        """Whether the batch-invariant mode costs nothing measurable here (the default then): bf16 on a
        CPU whose linears all run on the compiled VNNI kernel (AMX, AVX-512 BF16 or AVX2), which is
        row-independent as it stands, so the mode only changes how attention is computed (every row on
        the paged kernel; docs/batch-invariance.md)."""
        if self.native:  # block linears, and any bf16 ones on the VNNI kernel: all row-independent
            return (self.device.type == "cpu" and has_block_kernel()
                    and (self.dtype != torch.bfloat16 or kernels.has_linear_bf16()))
        return (self.dtype == torch.bfloat16 and self.device.type == "cpu" and self.pack
                and kernels.has_linear_bf16())

    def rowwise(self, fn: Callable[..., torch.Tensor], *xs: torch.Tensor) -> torch.Tensor:
        """``fn(*xs)`` for a row-wise ``fn`` with linears inside (an exit head, a projection): in row
        chunks of the bucket's size in the batch-invariant mode."""
        return fn(*xs) if self.row_bucket is None else in_row_chunks(fn, *xs, rows=self.row_bucket)

    @cached_property
    def layer_kernels(self) -> list[LayerKernels]:
        """Kernels of every base layer, built on first use (training never runs them); their bf16 VNNI
        copies on 2 MiB pages (GGUF blocks are put there as they load)."""
        built = [self.kernels(layer) for layer in self.layers]
        move_to_huge_pages(f.vnni for lk in built for f in lk.fused if f.vnni is not None)
        return built

    @cached_property
    def layer_stack(self) -> Any | None:
        """Every base layer on the compiled :class:`LayerStack` (:mod:`hispec_decode.kernels`): a run
        of layers in one call, the same kernels in the same order as :meth:`block`, without Python
        per op. None where a layer cannot run on it (no kernels, not on CPU, a linear without a
        packed kernel, an architecture or activation it does not know)."""
        k = kernels.ops()
        if k is None or self.device.type != "cpu":
            return None
        layers = [self.stack_layer(k, lk) for lk in self.layer_kernels]
        if any(layer is None for layer in layers):
            return None
        stack = k.LayerStack(self.config.num_attention_heads, self.num_kv_heads, self.head_dim, self.stack_activation())
        for layer in layers:
            stack.add(layer)
        return stack

    def stack_layer(self, k: Any, lk: LayerKernels) -> Any | None:
        """One layer for the compiled stack (``k``: the kernels module), None if it cannot run there."""
        return None

    def stack_activation(self) -> str:
        return "silu"

    def min_sliding_window(self) -> int | None:
        """The smallest attention span of a sliding-window layer, None if no layer has one (a draft
        tree is never deeper than it: docs/trees.md)."""
        return min((k.sliding_window for k in self.layer_kernels if k.sliding_window), default=None)

    def default_eos_ids(self) -> frozenset[int]:
        """End-of-sequence ids of the model's generation config (else its config), maybe none."""
        gen = getattr(self.model, "generation_config", None)
        eos = getattr(gen, "eos_token_id", None) or self.config.eos_token_id
        if eos is None:
            return frozenset()
        return frozenset([eos] if isinstance(eos, int) else eos)

    def linear(self, *linears: nn.Linear) -> FusedLinear:
        return FusedLinear(list(linears), self.pack, self.row_bucket)

    @property
    def dtype(self) -> torch.dtype:
        """The dtype of activations (a GGUF block LM head serves the model's)."""
        return getattr(self.lm_head, "compute_dtype", None) or self.lm_head.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.lm_head.device if isinstance(self.lm_head, BlockLinear) else self.lm_head.weight.device

    @property
    def native(self) -> bool:
        """The base decodes on GGUF block weights (layers.quant): a GGUF file's or quantized on load."""
        return getattr(self.model, "hispec_precision", None) is not None

    @property
    def precision(self) -> str:
        """What the weights are decoded in: ``native`` (GGUF blocks) or the dtype's name; tuned policies
        and this machine's costs are kept per precision."""
        if self.native:
            return self.model.hispec_precision
        return str(self.dtype).removeprefix("torch.")

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

    # -- shared ---------------------------------------------------------------------------
    def meta(self, cache: PagedKVCache, spans: list[tuple[int, int, int]],
             trees: list[TreeRows | None] | None = None) -> AttentionMeta:
        """Metadata of one packed call: ``spans`` holds ``(seq_id, start, num_new)`` per sequence,
        ``trees`` its draft tree's rows where it has one."""
        return build_meta(cache, spans, trees)

    def cached_block(self, k: LayerKernels, h: torch.Tensor, meta: AttentionMeta, cache: PagedKVCache,
                     cache_layer: int) -> torch.Tensor:
        """A layer over the packed new tokens [1, T, hidden], its K/V in ``cache_layer``'s pool."""
        kernel = attend_invariant if self.row_bucket is not None else attend

        def attn(q, key, v, scale, sliding_window):
            return kernel(q, key, v, meta, cache, cache_layer, scale, sliding_window)

        return self.block(k, h, meta.rope, attn)

    def causal_block(self, module: nn.Module, h: torch.Tensor) -> torch.Tensor:
        """A layer over whole sequences [B, T, hidden] with causal attention and no cache,
        differentiable through the module's own weights (training a head's block)."""
        def attn(q, key, v, scale, sliding_window):
            T = q.shape[2]
            mask = None
            if sliding_window is not None and sliding_window < T:
                i = torch.arange(T, device=q.device)
                mask = (i[None, :] <= i[:, None]) & (i[None, :] > i[:, None] - sliding_window)
            o = F.scaled_dot_product_attention(q, key, v, attn_mask=mask, is_causal=mask is None, scale=scale,
                                               enable_gqa=q.shape[1] != key.shape[1])
            return o.transpose(1, 2).flatten(2)

        return self.block(self.kernels(module, packed=False), h, self.rope_for(h.shape[1]), attn)

    def run(self, h: torch.Tensor, lo: int, hi: int, meta: AttentionMeta, cache: PagedKVCache) -> torch.Tensor:
        """Run ``layers[lo:hi]``: on the compiled layer stack where every row's attention is the paged
        kernel's (decoding and verification; every call in the batch-invariant mode), else layer by layer."""
        stack = self.layer_stack if self.use_stack and hi > lo else None
        if stack is not None and kernels.ops() is not None and (
                self.row_bucket is not None or all(s.num_new <= PAGED_MAX_NEW for s in meta.segments)):
            cos, sin = self.stack_rope(meta.rope)
            return stack.run(h, lo, hi, cos, sin, meta.stack_rows(cache), cache.stack_pools())
        for i in range(lo, hi):
            h = self.cached_block(self.layer_kernels[i], h, meta, cache, i)
        return h

    def stack_rope(self, rope: Any) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """The call's rotary rows as the stack's lists of tables (one table unless a family has more)."""
        cos, sin = rope
        return [cos], [sin]

    def lm_logits(self, h: torch.Tensor) -> torch.Tensor:
        """The shared LM head (input: the output of :meth:`exit_norm`, cast to the model's dtype)."""
        return self.lm_head_kernel(h.to(self.dtype))

    def vocab_logits(self, h: torch.Tensor, vocab: torch.Tensor, compact: bool = False) -> torch.Tensor:
        """The LM head restricted to the rows ``vocab`` (token ids): their logits, ``-inf`` for
        every other token (``compact``: only theirs, ``[..., len(vocab)]``). Costs
        ``len(vocab) / vocab_size`` of the full LM head (a reduced early-exit vocabulary; the
        sub-matrix is cut and packed once per vocabulary)."""
        cached = self._vocab_kernels.get(id(vocab))
        if cached is not None and cached[0] is vocab:  # holding the tensor keeps its id from being reused
            kernel = cached[1]
        else:  # heads with equal vocabularies share one kernel
            content = (hashlib.sha256(vocab.cpu().numpy().tobytes()).hexdigest(), self.device, self.dtype)
            kernel = self._vocab_kernels.get(content) or self._vocab_kernel(vocab)
            self._vocab_kernels[content] = kernel
            self._vocab_kernels[id(vocab)] = (vocab, kernel)
        small = kernel(h.to(self.dtype))  # [..., len(vocab)]
        if compact:
            return small
        out = small.new_full((*small.shape[:-1], self.lm_head.out_features), float("-inf"))
        out[..., vocab] = small
        return out

    def _vocab_kernel(self, vocab: torch.Tensor) -> FusedLinear:
        full = self.lm_head
        if isinstance(full, BlockLinear):  # the rows' blocks, still quantized, on 2 MiB pages
            kernel = FusedLinear([full.select(vocab.to(full.device))], self.pack, self.row_bucket)
            move_to_huge_pages(part.blocks for part in kernel.blocks)
            return kernel
        sub = nn.Linear(full.in_features, vocab.numel(), bias=full.bias is not None, device=self.device, dtype=self.dtype)
        with torch.no_grad():
            sub.weight.copy_(full.weight[vocab])
            if full.bias is not None:
                sub.bias.copy_(full.bias[vocab])
        return head_kernel(sub.requires_grad_(False), self.pack, self.row_bucket)

    def final_logits(self, h: torch.Tensor) -> torch.Tensor:
        return self.lm_logits(self.exit_norm(h))

    def new_cache(self, num_blocks: int, block_size: int, extra_layers: int = 0) -> PagedKVCache:
        """A paged cache for every layer plus ``extra_layers`` (exit heads with attention)."""
        if self.num_kv_heads < 1 or self.head_dim < 1:
            raise NotImplementedError(f"{type(self).__name__} must set num_kv_heads and head_dim")
        # the batch-invariant attention computes in float32: the compiled kernel converts each K/V value
        # as it reads it, the torch fallback wants a float32 pool (exact copies, not converted per step)
        fallback = kernels.ops() is None or self.device.type != "cpu"
        dtype = torch.float32 if self.row_bucket is not None and fallback and self.dtype.is_floating_point else self.dtype
        element = torch.empty(0, dtype=dtype).element_size()
        need = 2 * (self.num_layers + extra_layers) * self.num_kv_heads * self.head_dim * element * num_blocks * block_size
        have = device_memory(self.device)
        if need > have:
            raise HiSpecError(f"a KV cache of num_blocks={num_blocks} blocks of block_size={block_size} tokens needs "
                              f"{need / 2**30:.1f} GiB; this {self.device.type} device has {have / 2**30:.1f} GiB")
        try:
            return PagedKVCache(self.num_layers + extra_layers, self.num_kv_heads, self.head_dim, num_blocks,
                                block_size, dtype, self.device)
        except (torch.OutOfMemoryError, RuntimeError) as exc:
            raise HiSpecError(f"could not allocate a KV cache of num_blocks={num_blocks} blocks of block_size="
                              f"{block_size} tokens ({need / 2**30:.1f} GiB): {exc}") from exc


def device_memory(device: torch.device) -> int:
    """Bytes of memory on ``device`` (physical memory for the CPU)."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[1]
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):  # not POSIX: no check
        return 2**63
