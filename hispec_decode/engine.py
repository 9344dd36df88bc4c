"""The layer-slice engine: advance a sequence through bands of layers, reusing everything.

A strategy splits the model at its exits, e.g. ``(L_d, L_i, L_f)``: band 0 is
``layers[0:L_d]``, band 1 ``layers[L_d:L_i]``, band 2 ``layers[L_i:L_f]``. Each band has
processed a prefix of the sequence (its layers' cache length); lower bands are ahead of
upper ones. The hidden states a band produced that the band above has not consumed yet wait
in ``pending``, so a draft's lower layers are never recomputed and a token accepted at
``L_i`` continues from ``L_i``'s hidden state. Rejection is :meth:`Engine.truncate`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .architectures import DecoderAdapter
from .heads import ExitHead
from .kv_cache import LayeredKVCache


@dataclass
class DecodeState:
    """One sequence: its tokens, its cache, and hidden states waiting at each exit."""

    tokens: list[int]
    cache: LayeredKVCache
    exits: tuple[int, ...]  # band tops, increasing; the last one is the number of layers
    # pending[j]: hidden state at exits[j] for positions [processed(j+1), processed(j)), [1, n, hidden]
    pending: list[torch.Tensor | None] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.pending = [None] * (len(self.exits) - 1)

    def processed(self, band: int) -> int:
        """How many leading tokens the layers of ``band`` have seen (their cache length)."""
        return self.cache.lengths[self.exits[band] - 1]


class Engine:
    """A base model (through its :class:`DecoderAdapter`) plus exit heads by layer."""

    def __init__(self, base: DecoderAdapter, heads: dict[int, ExitHead] | None = None) -> None:
        self.base = base
        self.heads = dict(heads or {})

    def new_state(self, prompt: list[int], exits: tuple[int, ...], capacity: int) -> DecodeState:
        return DecodeState(list(prompt), self.base.new_cache(capacity), exits)

    @torch.inference_mode()
    def advance(self, st: DecodeState, top: int) -> torch.Tensor:
        """Bring every token through bands ``0..top``.

        Returns the hidden states at ``exits[top]`` not yet consumed by the band above
        (for the last band: those computed by this call), ``[1, n, hidden]``.
        """
        m = len(st.tokens)
        h = None
        for band in range(top + 1):
            start = st.processed(band)
            if start == m:
                continue
            lo = st.exits[band - 1] if band else 0
            meta = self.base.meta(start, m - start)
            if band == 0:
                x = self.base.embed(torch.tensor(st.tokens[start:], device=self.base.device), meta)
            else:  # pending[band-1] covers exactly [start, m)
                x, st.pending[band - 1] = st.pending[band - 1], None
            h = self.base.run(x, lo, st.exits[band], meta, st.cache)
            if band < len(st.pending):
                prev = st.pending[band]
                st.pending[band] = h if prev is None else torch.cat([prev, h], dim=1)
        return st.pending[top] if top < len(st.pending) else h

    @torch.inference_mode()
    def logits(self, layer: int, h: torch.Tensor) -> torch.Tensor:
        """Next-token logits at exit ``layer`` ([1, n, hidden] -> [n, vocab])."""
        head = self.heads.get(layer)
        if layer == self.base.num_layers or head is None:
            return self.base.final_logits(h)[0]
        return head(h, self.base)[0]

    def truncate(self, st: DecodeState, length: int) -> None:
        """Forget every token at position >= ``length``, in all layers and pending states."""
        before = [st.processed(b) for b in range(len(st.exits))]
        del st.tokens[length:]
        st.cache.truncate(length)
        for band, pending in enumerate(st.pending):
            if pending is not None:
                keep = max(0, min(before[band], length) - before[band + 1])
                st.pending[band] = pending[:, :keep] if keep else None
