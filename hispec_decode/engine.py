"""The layer-slice engine: advance many sequences through bands of layers, reusing everything.

A strategy splits the model at its exits, e.g. ``(L_d, L_i, L_f)``: band 0 is
``layers[0:L_d]``, band 1 ``layers[L_d:L_i]``, band 2 ``layers[L_i:L_f]``. Each band of a
sequence has processed a prefix of it (its length in the block manager); lower bands are
ahead of upper ones. The hidden states a band produced that the band above has not consumed
yet wait in ``pending``, so a draft's lower layers are never recomputed and a token accepted
at ``L_i`` continues from ``L_i``'s hidden state. Rejection is :meth:`Engine.truncate`.

:meth:`Engine.advance` serves a list of requests ``(state, top, last)`` in one sweep up the
layers: band ``b`` runs once, as one packed forward over the new tokens of every sequence
that needs it (each with its own past length and number of new tokens, no padding), and
each request gets the logits of its ``last`` newest positions at its own exit.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .architectures import DecoderAdapter
from .block_manager import DEFAULT_BLOCK_SIZE
from .heads import ExitHead
from .paged_cache import PagedKVCache


@dataclass
class DecodeState:
    """One sequence: its tokens, its place in the paged cache, hidden states waiting at each exit."""

    seq_id: int
    tokens: list[int]
    cache: PagedKVCache
    exits: tuple[int, ...]  # band tops, increasing; the last one is the number of layers
    # pending[j]: hidden state at exits[j] for positions [processed(j+1), processed(j)), [1, n, hidden]
    pending: list[torch.Tensor | None] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.pending = [None] * (len(self.exits) - 1)

    def processed(self, band: int) -> int:
        """How many leading tokens the layers of ``band`` have seen."""
        return self.cache.manager.lengths(self.seq_id)[band]


@dataclass(frozen=True)
class Advance:
    """Bring ``state`` through bands ``0..top``; return logits of its ``last`` newest positions."""

    state: DecodeState
    top: int
    last: int


class Engine:
    """A base model (through its :class:`DecoderAdapter`) plus exit heads by layer."""

    def __init__(self, base: DecoderAdapter, heads: dict[int, ExitHead] | None = None, exit_vocab: bool = True) -> None:
        self.base = base
        self.heads = dict(heads or {})
        self.exit_vocab = exit_vocab  # use the heads' reduced vocabularies, where they have one
        # exit heads with their own attention keep K/V in extra cache layers after the base's
        cached = sorted(layer for layer, head in self.heads.items() if head.has_cache)
        self.head_cache_layer = {layer: base.num_layers + j for j, layer in enumerate(cached)}

    def new_cache(self, num_blocks: int, block_size: int = DEFAULT_BLOCK_SIZE) -> PagedKVCache:
        return self.base.new_cache(num_blocks, block_size, len(self.head_cache_layer))

    def new_state(self, cache: PagedKVCache, seq_id: int, prompt: list[int], exits: tuple[int, ...]) -> DecodeState:
        cache.manager.add(seq_id, len(exits))
        return DecodeState(seq_id, list(prompt), cache, exits)

    def release(self, st: DecodeState) -> None:
        """Free the sequence's blocks (it finished or was preempted)."""
        st.cache.manager.free(st.seq_id)
        st.pending = [None] * len(st.pending)

    @torch.inference_mode()
    def advance(self, requests: list[Advance]) -> list[torch.Tensor]:
        """Serve every request in one sweep up the layers; returns ``[last, vocab]`` logits each."""
        if not requests:
            return []
        cache = requests[0].state.cache
        for r in requests:  # reserve first: running out of blocks changes no token
            cache.copy_blocks(cache.manager.reserve(r.state.seq_id, len(r.state.tokens)))
        at_top: list[torch.Tensor | None] = [None] * len(requests)
        for band in range(max(r.top for r in requests) + 1):
            group = [(i, r.state) for i, r in enumerate(requests)
                     if r.top >= band and r.state.processed(band) < len(r.state.tokens)]
            if not group:
                continue
            exits = group[0][1].exits
            lo, hi = (exits[band - 1] if band else 0), exits[band]
            spans = [(st.seq_id, st.processed(band), len(st.tokens) - st.processed(band)) for _, st in group]
            meta = self.base.meta(cache, spans)
            if band == 0:
                ids = [t for _, st in group for t in st.tokens[st.processed(0):]]
                x = self.base.embed(torch.tensor(ids, device=self.base.device), meta)
            else:  # pending[band-1] covers exactly [processed(band), len(tokens))
                x = torch.cat([st.pending[band - 1] for _, st in group], dim=1)
                for _, st in group:
                    st.pending[band - 1] = None
            h = self.base.run(x, lo, hi, meta, cache)
            head = self.heads.get(hi)
            g = head.extend(h, meta, cache, self.head_cache_layer[hi], self.base) if hi in self.head_cache_layer else h
            for (i, st), (_, start, n), seg in zip(group, spans, meta.segments):
                cache.manager.set_length(st.seq_id, band, start + n)
                rows = slice(seg.offset, seg.offset + n)
                if band < len(st.pending):
                    prev = st.pending[band]
                    st.pending[band] = h[:, rows] if prev is None else torch.cat([prev, h[:, rows]], dim=1)
                if requests[i].top == band:
                    at_top[i] = g[:, rows]
        return self._logits(requests, at_top)

    def _logits(self, requests: list[Advance], at_top: list[torch.Tensor | None]) -> list[torch.Tensor]:
        """One exit call per exit layer over the requested rows of every sequence."""
        out: list[torch.Tensor | None] = [None] * len(requests)
        for layer in sorted({r.state.exits[r.top] for r in requests}):
            idx = [i for i, r in enumerate(requests) if r.state.exits[r.top] == layer]
            for i in idx:
                if at_top[i] is None or at_top[i].shape[1] < requests[i].last:
                    raise RuntimeError(f"request {i}: fewer new positions at exit {layer} than the {requests[i].last} asked for")
            rows = torch.cat([at_top[i][:, -requests[i].last :] for i in idx], dim=1)
            logits = self.exit_logits(layer, rows)
            offset = 0
            for i in idx:
                out[i] = logits[offset : offset + requests[i].last]
                offset += requests[i].last
        return out  # type: ignore[return-value]

    @torch.inference_mode()
    def exit_logits(self, layer: int, h: torch.Tensor) -> torch.Tensor:
        """Next-token logits at exit ``layer`` ([1, n, hidden] -> [n, vocab]); for a head with
        its own attention ``h`` is that head's output (see :meth:`ExitHead.extend`)."""
        head = self.heads.get(layer)
        if layer == self.base.num_layers or head is None:
            return self.base.final_logits(h)[0]
        h = h if layer in self.head_cache_layer else head.transform(h)
        return head.project(h, self.base, restrict=self.exit_vocab)[0]

    def truncate(self, st: DecodeState, length: int) -> None:
        """Forget every token at position >= ``length``, in all bands and pending states."""
        before = [st.processed(b) for b in range(len(st.exits))]
        del st.tokens[length:]
        st.cache.manager.truncate(st.seq_id, length)
        for band, pending in enumerate(st.pending):
            if pending is not None:
                keep = max(0, min(before[band], length) - before[band + 1])
                st.pending[band] = pending[:, :keep] if keep else None
