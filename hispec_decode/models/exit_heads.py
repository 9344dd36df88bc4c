"""Exit heads: turn the hidden state after layer ``l`` into next-token logits.

Every head ends in the base model's frozen, shared LM head, so an adapter stores only the small
part in front of it. ``base`` (no parameters) is the base model's own final norm + LM head,
used wherever no trained head is given; the others own a trainable copy of the final norm and
optionally a zero-initialised residual map, so an untrained head starts exactly at ``base``.
``decoder_block`` adds one decoder layer (initialised from the base's next layer) with its own
K/V cache entries: the heavier head that buys agreement.
"""

from __future__ import annotations

import copy
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from torch import nn

from ..errors import AdapterError

if TYPE_CHECKING:
    from ..cache.kv_cache import PagedKVCache
    from .base import DecoderModel, LayerKernels
    from ..layers.attention import AttentionMeta


def check_vocab(ids: torch.Tensor, vocab_size: int | None = None, where: str = "exit vocabulary") -> None:
    """An exit vocabulary: a non-empty 1-d tensor of sorted, distinct integer token ids (within
    ``vocab_size`` when it is known)."""
    ok = not ids.is_floating_point() and ids.dim() == 1 and ids.numel() > 0 and not bool((ids[1:] <= ids[:-1]).any())
    if ok and vocab_size is not None:
        ok = int(ids[0]) >= 0 and int(ids[-1]) < vocab_size
    if not ok:
        span = f" in 0..{vocab_size - 1}" if vocab_size is not None else ""
        raise AdapterError(f"{where}: an exit vocabulary is a non-empty 1-d tensor of sorted, distinct integer "
                           f"token ids{span}")


class ExitHead(nn.Module):
    head_type: ClassVar[str]
    has_cache: ClassVar[bool] = False  # True: the head attends to past positions (own K/V entries)
    needs_context: ClassVar[bool] = False  # True: the head also reads the previous position's deep state

    def __init__(self, hidden_size: int, norm_keys: list[str]) -> None:
        super().__init__()
        self.hidden_size = hidden_size
        self.norm = nn.ParameterDict({k: nn.Parameter(torch.ones(hidden_size)) for k in norm_keys})
        self.vocab: torch.Tensor | None
        self.register_buffer("vocab", None)  # see set_vocab; stored with the weights when set

    def set_vocab(self, ids: torch.Tensor | None) -> None:
        """Restrict this exit's predictions to the token ids ``ids`` (sorted, unique), or lift the
        restriction (None). Lossless: only early exits are restricted, the final layer never is."""
        if ids is not None:
            check_vocab(ids)
            device = next((p.device for p in self.parameters()), ids.device)
            ids = ids.to(device, torch.long).clone()  # each head owns its copy (safetensors refuses shared storage)
        self.vocab = ids

    def options(self) -> dict[str, Any]:
        """Constructor options beyond hidden size and norm keys (written to the adapter config)."""
        return {}

    def transform(self, h: torch.Tensor) -> torch.Tensor:
        """Position-wise part of the head: [..., hidden] -> [..., hidden]."""
        return h

    def sequence_transform(self, h: torch.Tensor, decoder: DecoderModel) -> torch.Tensor:
        """The head's transform over whole sequences [B, T, hidden] (training, evaluation)."""
        return self.transform(h)

    def training_transforms(self, h: torch.Tensor, decoder: DecoderModel, final: torch.Tensor) -> list[torch.Tensor]:
        """The transformed states [B, T, hidden] the head is trained and evaluated on, one per
        situation it meets when decoding (``final``: the teacher's normed final states [B, T, ·])."""
        return [self.sequence_transform(h, decoder)]

    def draft_steps(self, h: torch.Tensor, decoder: DecoderModel, final: torch.Tensor, steps: int) -> list[torch.Tensor]:
        """The transformed states [B, T, hidden] at every position as the 1st, 2nd, ... ``steps``-th token
        of a chain the head drafts alone after a verification (the same for heads that read no deep
        state; evaluation of acceptance per draft position)."""
        return [self.sequence_transform(h, decoder)] * steps

    def project(self, h: torch.Tensor, decoder: DecoderModel, restrict: bool = True, compact: bool = False) -> torch.Tensor:
        """The head's norm and the shared LM head: transformed [..., hidden] -> logits [..., vocab]
        (``-inf`` outside the head's vocabulary, if it has one and ``restrict``; ``compact``:
        only the vocabulary's logits, ``[..., len(vocab)]``)."""
        params = dict(self.norm.items()) if len(self.norm) else None
        x = decoder.exit_norm(h, params)
        if restrict and self.vocab is not None:
            return decoder.vocab_logits(x, self.vocab, compact)
        return decoder.lm_logits(x)

    def forward(self, h: torch.Tensor, decoder: DecoderModel) -> torch.Tensor:
        """Hidden states after the exit layer [..., hidden] -> logits [..., vocab]."""
        return self.project(self.transform(h), decoder)

    def extend(self, h: torch.Tensor, meta: AttentionMeta, cache: PagedKVCache, cache_layer: int,
               decoder: DecoderModel) -> torch.Tensor:
        """Heads with their own attention (``has_cache``): transform the packed new tokens,
        writing their K/V into ``cache_layer``'s pool."""
        raise NotImplementedError(f"{self.head_type} heads keep no cache")

    @classmethod
    def from_base(cls, decoder: DecoderModel, layer: int, **options: Any) -> ExitHead:
        """A head for exit ``layer``, initialised to reproduce the base's own exit there."""
        norm = decoder.norm_params()
        head = cls(decoder.config.hidden_size, sorted(norm), **cls.init_options(decoder, layer, options))
        with torch.no_grad():
            for k in head.norm:
                head.norm[k].copy_(norm[k].float())
        return head

    @classmethod
    def init_options(cls, decoder: DecoderModel, layer: int, options: dict[str, Any]) -> dict[str, Any]:
        """Constructor options of a new head at exit ``layer`` (beyond hidden size and norm keys)."""
        return options


class BaseExitHead(ExitHead):
    """The base model's own final norm + LM head (no parameters)."""

    head_type = "base"

    def __init__(self, hidden_size: int, norm_keys: list[str] | None = None) -> None:
        super().__init__(hidden_size, [])

    def project(self, h: torch.Tensor, decoder: DecoderModel, restrict: bool = True, compact: bool = False) -> torch.Tensor:
        return decoder.final_logits(h)


class NormHead(ExitHead):
    """A trainable copy of the final norm in front of the shared LM head."""

    head_type = "norm"


class ResidualLinearHead(ExitHead):
    """``h + W h`` (W zero-initialised), then the head's norm and the shared LM head."""

    head_type = "residual_linear"

    def __init__(self, hidden_size: int, norm_keys: list[str]) -> None:
        super().__init__(hidden_size, norm_keys)
        self.proj = nn.Linear(hidden_size, hidden_size, bias=False)
        nn.init.zeros_(self.proj.weight)

    def transform(self, h: torch.Tensor) -> torch.Tensor:
        return h + self.proj(h)


class LowRankHead(ExitHead):
    """``h + B A h`` with rank ``r`` (B zero-initialised), then norm and the shared LM head."""

    head_type = "low_rank"

    def __init__(self, hidden_size: int, norm_keys: list[str], rank: int = 64) -> None:
        super().__init__(hidden_size, norm_keys)
        self.rank = rank
        self.down = nn.Linear(hidden_size, rank, bias=False)
        self.up = nn.Linear(rank, hidden_size, bias=False)
        nn.init.normal_(self.down.weight, std=hidden_size**-0.5)
        nn.init.zeros_(self.up.weight)

    def options(self) -> dict[str, Any]:
        return {"rank": self.rank}

    def transform(self, h: torch.Tensor) -> torch.Tensor:
        return h + self.up(self.down(h))


class DeepContextHead(ExitHead):
    """``h + W h + U c``: the residual linear head plus the previous position's deepest known
    state ``c`` (the EAGLE / GliDe idea applied to an early exit). ``c`` is the base's normed
    final state where the full model has processed the previous position (every committed
    token), and otherwise this head's own normed output there (the drafts it made itself, or the
    tentative tokens it checked): the head's estimate of that final state. W and U start at zero.

    Training (:meth:`training_transforms`) sees both cases: the true final states (the first
    draft after a verification) and its own outputs from that first pass (the drafts after it).
    The engine computes rows in position order so that a row's own-output context exists."""

    head_type = "deep_context"
    needs_context = True

    def __init__(self, hidden_size: int, norm_keys: list[str], context_size: int | None = None) -> None:
        super().__init__(hidden_size, norm_keys)
        self.context_size = context_size or hidden_size
        self.proj = nn.Linear(hidden_size, hidden_size, bias=False)
        self.ctx = nn.Linear(self.context_size, hidden_size, bias=False)
        nn.init.zeros_(self.proj.weight)
        nn.init.zeros_(self.ctx.weight)
        self._packed: tuple[tuple, Any] | None = None  # see decode_transform

    def options(self) -> dict[str, Any]:
        return {"context_size": self.context_size}

    def transform(self, h: torch.Tensor, context: torch.Tensor | None = None) -> torch.Tensor:
        out = h + self.proj(h)
        return out if context is None else out + self.ctx(context.to(out.dtype))

    def decode_transform(self, h: torch.Tensor, context: torch.Tensor, decoder: DecoderModel) -> torch.Tensor:
        """:meth:`transform` for decoding: ``h + [W U] [h; c]`` as one packed linear of the decoder
        (AMX for bf16 on CPU, row-independent in the batch-invariant mode), rebuilt whenever the
        weights have changed since (training in the same process)."""
        key = (decoder, self.proj.weight._version, self.ctx.weight._version, self.proj.weight.data_ptr())
        if self._packed is None or self._packed[0] != key:
            fused = nn.Linear(self.hidden_size + self.context_size, self.hidden_size, bias=False,
                              device=self.proj.weight.device, dtype=self.proj.weight.dtype)
            with torch.no_grad():
                fused.weight.copy_(torch.cat([self.proj.weight, self.ctx.weight], dim=1))
            self._packed = (key, decoder.linear(fused.requires_grad_(False)))
        return h + self._packed[1](torch.cat([h, context.to(h.dtype)], dim=-1))

    def context_of(self, x: torch.Tensor, decoder: DecoderModel) -> torch.Tensor:
        """This head's estimate of the normed final state, from its transformed output ``x``."""
        params = dict(self.norm.items()) if len(self.norm) else None
        return decoder.exit_norm(x, params)

    def draft_steps(self, h: torch.Tensor, decoder: DecoderModel, final: torch.Tensor, steps: int) -> list[torch.Tensor]:
        context = torch.cat([torch.zeros_like(final[:, :1]), final[:, :-1]], dim=1)  # c(t) = final(t - 1), 0 at t = 0
        outs = []
        for _ in range(steps):  # step j reads step j - 1's own (detached) output at t - 1
            outs.append(self.transform(h, context))
            own = self.context_of(outs[-1], decoder).detach()
            context = torch.cat([torch.zeros_like(own[:, :1]), own[:, :-1]], dim=1)
        return outs

    def training_transforms(self, h: torch.Tensor, decoder: DecoderModel, final: torch.Tensor) -> list[torch.Tensor]:
        return self.draft_steps(h, decoder, final, 2)  # the first draft after a verification, and the ones after it

    @classmethod
    def init_options(cls, decoder: DecoderModel, layer: int, options: dict[str, Any]) -> dict[str, Any]:
        return {"context_size": decoder.lm_head.in_features} | options


class DecoderBlockHead(ExitHead):
    """One more decoder layer (a copy of the base's layer ``source_layer``, by default the layer
    right after the exit) in front of the head's norm and the shared LM head. It attends to the
    past, so the engine keeps K/V entries for it (an extra cache layer) at every position the
    exit's band processes. Costs one layer per drafted token; buys the most agreement.
    ``attention_only``: the layer without its MLP (Kangaroo's adapter: one attention layer and
    its norm over the exit's features), about a third of a layer's cost and parameters."""

    head_type = "decoder_block"
    has_cache = True

    def __init__(self, hidden_size: int, norm_keys: list[str], source_layer: int, decoder: DecoderModel | None = None,
                 attention_only: bool = False) -> None:
        super().__init__(hidden_size, norm_keys)
        if decoder is None:
            raise AdapterError("a decoder_block head is built from its base model's layer: load it with the base")
        if not 0 <= source_layer < decoder.num_layers:
            raise AdapterError(f"decoder_block source_layer {source_layer} out of range 0..{decoder.num_layers - 1}")
        if not isinstance(attention_only, bool):
            raise AdapterError(f"decoder_block attention_only must be true or false; got {attention_only!r}")
        self.source_layer = source_layer
        self.attention_only = attention_only
        self.block = copy.deepcopy(decoder.layers[source_layer]).float().requires_grad_(True)
        if attention_only:  # Kangaroo's adapter: the layer's attention (and its norm), no MLP
            for name in ("mlp", "fc1", "fc2"):
                if hasattr(self.block, name):
                    setattr(self.block, name, None)
        self._kernels: LayerKernels | None = None

    def options(self) -> dict[str, Any]:
        return {"source_layer": self.source_layer} | ({"attention_only": True} if self.attention_only else {})

    def transform(self, h: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("a decoder_block head attends to the past: use sequence_transform or extend")

    def sequence_transform(self, h: torch.Tensor, decoder: DecoderModel) -> torch.Tensor:
        return decoder.causal_block(self.block, h)

    def forward(self, h: torch.Tensor, decoder: DecoderModel) -> torch.Tensor:
        return self.project(self.sequence_transform(h, decoder), decoder)

    def extend(self, h: torch.Tensor, meta: AttentionMeta, cache: PagedKVCache, cache_layer: int,
               decoder: DecoderModel) -> torch.Tensor:
        if self._kernels is None:  # packed once, on first use (weights are frozen by then)
            self._kernels = decoder.kernels(self.block)
        return decoder.cached_block(self._kernels, h, meta, cache, cache_layer)

    @classmethod
    def init_options(cls, decoder: DecoderModel, layer: int, options: dict[str, Any]) -> dict[str, Any]:
        return {"source_layer": layer} | options | {"decoder": decoder}  # default: the layer right after the exit
