"""``ModelRunner``: advance many sequences through bands of layers in one sweep, reusing everything.

A strategy splits the model at its exits, e.g. ``(L_d, L_i, L_f)``: band 0 is
``layers[0:L_d]``, band 1 ``layers[L_d:L_i]``, band 2 ``layers[L_i:L_f]``. Each band of a
sequence has processed a prefix of it (its length in the block manager); lower bands are
ahead of upper ones. The hidden states a band produced that the band above has not consumed
yet wait in ``Sequence.pending``, so a draft's lower layers are never recomputed and a token
accepted at ``L_i`` continues from ``L_i``'s hidden state. Rejection is ``Sequence.truncate``.

:meth:`ModelRunner.advance` serves a list of :class:`BandRequest` in one sweep up the layers:
band ``b`` runs once, as one packed forward over the new tokens of every sequence that needs it
(each with its own past length and number of new tokens, no padding), and each request gets
the logits of its ``num_logits`` newest positions at its own exit.
"""

from __future__ import annotations

import torch

from ..cache.block_manager import DEFAULT_BLOCK_SIZE
from ..cache.kv_cache import PagedKVCache
from ..errors import HiSpecError
from ..models.base import DecoderModel
from ..models.exit_heads import ExitHead
from .own_tokens import OwnTokens, add_own_logits
from .sequence import BandRequest, Sequence


class ModelRunner:
    """A base model (through its :class:`DecoderModel`) plus exit heads by layer."""

    def __init__(self, decoder: DecoderModel, heads: dict[int, ExitHead] | None = None,
                 use_exit_vocab: bool = True, ranking: torch.Tensor | None = None) -> None:
        self.decoder = decoder
        self.heads = dict(heads or {})
        # the vocabulary level's rows: token ids, the base's most frequent first (see level_vocab)
        self.ranking = ranking
        self._level_vocabs: dict[int, torch.Tensor] = {}
        self._level_masks: dict[int, torch.Tensor] = {}
        self.own_tokens = True  # L_v also names each sequence's committed tokens (own_tokens.py; tests: off)
        self.use_exit_vocab = use_exit_vocab  # use the heads' reduced vocabularies, where they have one
        # exit heads with their own attention keep K/V in extra cache layers after the base's
        cached = sorted(layer for layer, head in self.heads.items() if head.has_cache)
        self.head_cache_layer = {layer: decoder.num_layers + j for j, layer in enumerate(cached)}
        self.keep_final = any(head.needs_context for head in self.heads.values())  # deep-context heads read them
        # feature_attention heads: their rows are computed when their logits are asked for (_feature_transform)
        self.feature_layers = {layer for layer, head in self.heads.items() if head.has_cache and head.needs_context}
        if use_exit_vocab:  # cut and pack the exit vocabularies' LM-head rows now, not in the first draft's time
            with torch.inference_mode():
                probe = torch.zeros(1, 1, decoder.config.hidden_size, dtype=decoder.dtype, device=decoder.device)
                for head in self.heads.values():
                    if getattr(head, "vocab", None) is not None:
                        decoder.vocab_logits(decoder.exit_norm(probe), head.vocab, compact=True)

    def new_cache(self, num_blocks: int, block_size: int = DEFAULT_BLOCK_SIZE) -> PagedKVCache:
        return self.decoder.new_cache(num_blocks, block_size, len(self.head_cache_layer))

    @torch.inference_mode()
    def advance(self, requests: list[BandRequest], cache: PagedKVCache) -> list[torch.Tensor]:
        """Serve every request in one sweep up the layers, reading and writing the sequences' K/V in
        ``cache`` (whose block manager they hold); returns ``[num_logits, vocab]`` logits each."""
        if not requests:
            return []
        for r in requests:  # reserve first: running out of blocks changes no token
            cache.manager.reserve(r.seq.seq_id, len(r.seq.tokens))
        at_top: list[torch.Tensor | None] = [None] * len(requests)
        top, band = max(r.top_band for r in requests), 0
        while band <= top:
            group = [(i, r.seq) for i, r in enumerate(requests) if r.top_band >= band and r.seq.processed(band) < r.end]
            if not group:
                band += 1
                continue
            last = self._merge(requests, group, band, top)  # bands band..last run as one slice
            exits = group[0][1].exits
            lo, hi = (exits[band - 1] if band else 0), exits[last]
            spans = [(st.seq_id, st.processed(band), requests[i].end - st.processed(band)) for i, st in group]
            trees = [st.tree.rows() if st.tree is not None else None for _, st in group]
            meta = self.decoder.meta(cache, spans, trees if any(t is not None for t in trees) else None)
            if band == 0:
                ids = [t for i, st in group for t in st.tokens[st.processed(0) : requests[i].end]]
                x = self.decoder.embed(torch.tensor(ids, device=self.decoder.device), meta)
            else:  # pending[band-1] covers exactly [processed(band), end)
                x = torch.cat([st.pending[band - 1] for _, st in group], dim=1)
                for _, st in group:
                    st.pending[band - 1] = None
            h = self.decoder.run(x, lo, hi, meta, cache)
            head = self.heads.get(hi)
            g = h
            if hi in self.feature_layers:  # the exit's states wait for the head's rows
                for (_, st), (_, start, n), seg in zip(group, spans, meta.segments):
                    for j in range(n):
                        st.context.keep_hidden(hi, start + j, h[0, seg.offset + j])
            elif hi in self.head_cache_layer:
                g = head.extend(h, meta, cache, self.head_cache_layer[hi], self.decoder)
            if hi == self.decoder.num_layers and self.keep_final and hi > lo:
                self._keep_final_states(group, spans, meta, h)
            for (i, st), (_, start, n), seg in zip(group, spans, meta.segments):
                for b in range(band, last + 1):
                    cache.manager.set_length(st.seq_id, b, start + n)
                rows = slice(seg.offset, seg.offset + n)
                if last < len(st.pending):
                    prev = st.pending[last]
                    st.pending[last] = h[:, rows] if prev is None else torch.cat([prev, h[:, rows]], dim=1)
                if requests[i].top_band == last:
                    at_top[i] = g[:, rows]
            band = last + 1
        return self._logits(requests, at_top, cache)

    def _merge(self, requests: list[BandRequest], group: list[tuple[int, Sequence]], band: int, top: int) -> int:
        """The highest band that can run in one slice with ``band``: the same sequences need it over
        the same new tokens, nobody wants logits or a head's cache at the exits in between, and
        nothing waits there from before. One call instead of several (plain decoding through a
        hierarchy's bands, the lower bands of a verification)."""
        last = band
        members = {i for i, _ in group}
        while last < top:
            exit_layer = group[0][1].exits[last]
            if exit_layer in self.head_cache_layer or any(requests[i].top_band == last for i in members):
                break
            upper = {i for i, r in enumerate(requests) if r.top_band > last and r.seq.processed(last + 1) < r.end}
            if upper != members or any(st.processed(last + 1) != st.processed(band) or st.pending[last] is not None
                                       for _, st in group):
                break
            last += 1
        return last

    def _keep_final_states(self, group: list[tuple[int, Sequence]], spans: list[tuple[int, int, int]],
                           meta, h: torch.Tensor) -> None:
        """Remember the normed final states a deep-context head may read (from the last commit on);
        only those rows are normed (a prefill keeps one)."""
        keep = [(st, p, seg.offset + p - start) for (_, st), (_, start, n), seg in zip(group, spans, meta.segments)
                for p in range(max(start, st.context.keep_from(st.committed - 2)), start + n)]
        if not keep:
            return
        rows = torch.tensor([r for _, _, r in keep], device=h.device)
        normed = self.decoder.exit_norm(h[0].index_select(0, rows))  # [kept, C], its own storage
        for (st, p, _), state in zip(keep, normed.unbind(0)):
            st.context.keep_final(p, state)

    def _context_transform(self, layer: int, seqs: list[Sequence], rows: list[torch.Tensor]) -> torch.Tensor:
        """A deep-context head's transform of each sequence's newest rows ([1, n_i, hidden] each). A
        row whose previous position (a tree node's: its parent) is among the rows of this call reads
        the output the head computes there, so rows run in waves: each wave, every row whose previous
        state is known, all in one batched call (one wave when checking a tree level or a single row).
        Returns [1, sum n_i, hidden] in request order."""
        head = self.heads[layer]
        items = [(k, j, len(seqs[k].tokens) - r.shape[1] + j) for k, r in enumerate(rows) for j in range(r.shape[1])]
        pending = {(k, slot) for k, _, slot in items}
        out: dict[tuple[int, int], torch.Tensor] = {}
        zero = rows[0].new_zeros(head.context_size)
        while pending:
            wave = [(k, j, slot) for k, j, slot in items
                    if (k, slot) in pending and (k, seqs[k].previous(slot)) not in pending]
            h = torch.cat([rows[k][:, j : j + 1] for k, j, _ in wave], dim=1)  # [1, m, hidden]
            ctx = torch.stack([c if (c := seqs[k].context.context_at(layer, seqs[k].previous(slot))) is not None
                               else zero for k, _, slot in wave])[None]  # [1, m, C]
            x, own = self.context_step(layer, h, ctx)
            for r, (k, j, slot) in enumerate(wave):
                seqs[k].context.keep_own(layer, slot, own[r].clone())
                out[k, j] = x[:, r : r + 1]
                pending.discard((k, slot))
        return torch.cat([out[k, j] for k, j, _ in items], dim=1)

    def context_step(self, layer: int, h: torch.Tensor, ctx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """What a deep-context head computes for rows ``h`` [1, m, hidden] whose contexts are ``ctx``
        [1, m, C]: its transformed rows [1, m, hidden] and, from them, the contexts those rows give the
        next positions [m, C] (its own estimate of the final state)."""
        head = self.heads[layer]
        x = head.decode_transform(h, ctx, self.decoder)
        return x, self.decoder.rowwise(lambda y: head.context_of(y, self.decoder), x)[0]

    def _feature_transform(self, layer: int, seqs: list[Sequence], counts: list[int], cache: PagedKVCache) -> torch.Tensor:
        """A feature_attention head's output at each sequence's ``counts[k]`` newest rows, [1, sum, hidden]
        in request order. Each sequence's rows are computed from :meth:`ContextStates.feature_start` on (the
        rows verified since are recomputed from their true final states), in waves: a wave takes each
        sequence's longest run of rows whose context is known (a true final state, or an output computed
        before), one packed call of the head's layer over all of them, its K/V written at their slots."""
        head, cache_layer = self.heads[layer], self.head_cache_layer[layer]
        todo = []
        for st, n in zip(seqs, counts):
            end = len(st.tokens)
            todo.append(list(range(min(st.context.feature_start(layer), end - n), end)))
        out: list[dict[int, torch.Tensor]] = [{} for _ in seqs]
        zero = torch.zeros(head.context_size, dtype=self.decoder.dtype, device=self.decoder.device)
        while any(todo):
            wave = []  # (k, [(slot, context, exact)]): each sequence's rows of this wave
            for k, (st, slots) in enumerate(zip(seqs, todo)):
                rows, pending = [], set(slots)
                for p in slots:
                    prev = st.previous(p)
                    final = st.context.final.get(prev)
                    if final is None and prev in pending:  # its context is computed in this call: a later wave
                        break
                    ctx = final if final is not None else st.context.context_at(layer, prev, deeper_first=True)
                    rows.append((p, zero if ctx is None else ctx, p == 0 or final is not None))
                    pending.discard(p)
                if rows:
                    wave.append((k, rows))
                    del slots[: len(rows)]
            trees = [seqs[k].tree.rows() if seqs[k].tree is not None else None for k, _ in wave]
            meta = self.decoder.meta(cache, [(seqs[k].seq_id, rows[0][0], len(rows)) for k, rows in wave],
                                     trees if any(t is not None for t in trees) else None)
            try:
                h = torch.stack([seqs[k].context.hidden[layer][p] for k, rows in wave for p, _, _ in rows])[None]
            except KeyError as exc:
                raise RuntimeError(f"feature head at layer {layer}: no exit state kept at position {exc}") from None
            ctx = torch.stack([c for _, rows in wave for _, c, _ in rows])[None]  # [1, m, C]
            x = head.decode_rows(h, ctx, meta, cache, cache_layer, self.decoder)  # [1, m, hidden]
            own = self.decoder.rowwise(lambda y: head.context_of(y, self.decoder), x)[0]  # [m, C]
            r = 0
            for k, rows in wave:
                for p, _, exact in rows:
                    seqs[k].context.keep_own(layer, p, own[r].clone())
                    seqs[k].context.computed(layer, p, exact)
                    out[k][p] = x[:, r : r + 1]
                    r += 1
        return torch.cat([out[k][p] for k, (st, n) in enumerate(zip(seqs, counts))
                          for p in range(len(st.tokens) - n, len(st.tokens))], dim=1)

    def _logits(self, requests: list[BandRequest], at_top: list[torch.Tensor | None], cache: PagedKVCache
                ) -> list[torch.Tensor]:
        """One exit call per exit layer over the requested rows of every sequence."""
        out: list[torch.Tensor | None] = [None] * len(requests)
        for i, r in enumerate(requests):
            if not r.num_logits:  # a prefill chunk
                out[i] = torch.empty(0)
        wanted = [self._exit_of(r) if r.num_logits else None for r in requests]
        for key in sorted({w for w in wanted if w is not None}):
            layer, vocab = key
            idx = [i for i, w in enumerate(wanted) if w == key]
            for i in idx:
                if at_top[i] is None or at_top[i].shape[1] < requests[i].num_logits:
                    raise RuntimeError(f"request {i}: fewer new positions at exit {layer} than the "
                                       f"{requests[i].num_logits} asked for")
            newest = [at_top[i][:, -requests[i].num_logits :] for i in idx]
            head = self.heads.get(layer)
            if vocab:  # the vocabulary level: the final states, the LM head over its rows only
                x = self.decoder.exit_norm(torch.cat(newest, dim=1))
                logits = self.decoder.vocab_logits(x, self.level_vocab(vocab))[0]
                if self.own_tokens:
                    self._add_own_tokens(logits, x[0], [requests[i] for i in idx], vocab)
            elif layer in self.feature_layers:
                x = self._feature_transform(layer, [requests[i].seq for i in idx], [requests[i].num_logits for i in idx],
                                            cache)
                logits = head.project(x, self.decoder, restrict=self.use_exit_vocab)[0]
            elif head is not None and head.needs_context and layer < self.decoder.num_layers:
                x = self._context_transform(layer, [requests[i].seq for i in idx], newest)
                logits = head.project(x, self.decoder, restrict=self.use_exit_vocab)[0]
            else:
                logits = self.exit_logits(layer, torch.cat(newest, dim=1))
            offset = 0
            for i in idx:
                out[i] = logits[offset : offset + requests[i].num_logits]
                offset += requests[i].num_logits
        return out  # type: ignore[return-value]

    def _exit_of(self, request: BandRequest) -> tuple[int, int]:
        """The exit a request's logits come from: its layer, and the vocabulary level's size where its
        band tops out at the last layer below the full model's level (0: the exit's own head)."""
        level = request.seq.levels[request.top_band]
        return level.layer, level.vocab

    def _add_own_tokens(self, logits: torch.Tensor, h: torch.Tensor, requests: list[BandRequest], size: int) -> None:
        """Each sequence's committed tokens outside the vocabulary level of ``size`` tokens: their logits
        into its rows of the level's ``logits`` [n, vocab] (``h``: [n, hidden], normalized final states)."""
        inside, head = self.level_mask(size), self.decoder.lm_head
        offset = 0
        for r in requests:
            seq, own = r.seq, r.seq.own_tokens
            if own is None or own.size != size or own.scanned > seq.committed:
                own = seq.own_tokens = OwnTokens(size=size)
            own.update(seq.tokens, seq.committed, inside, head)
            add_own_logits(logits[offset : offset + r.num_logits], h[offset : offset + r.num_logits], own)
            offset += r.num_logits

    def level_mask(self, size: int) -> torch.Tensor:
        """[vocab] bool: the tokens of the vocabulary level of ``size`` tokens."""
        inside = self._level_masks.get(size)
        if inside is None:
            inside = torch.zeros(self.decoder.lm_head.out_features, dtype=torch.bool)
            inside[self.level_vocab(size).cpu()] = True
            self._level_masks[size] = inside
        return inside

    def set_ranking(self, ranking: torch.Tensor | None) -> None:
        """Replace the vocabulary level's token ranking (token ids, most frequent first)."""
        self.ranking, self._level_vocabs, self._level_masks = ranking, {}, {}

    def level_vocab(self, size: int) -> torch.Tensor:
        """The vocabulary level's rows for a vocabulary of ``size`` tokens: the first ``size`` of
        :attr:`ranking` (sorted ids; one tensor per size, so its packed LM-head rows are cut once)."""
        vocab = self._level_vocabs.get(size)
        if vocab is None:
            if self.ranking is None:
                raise HiSpecError("the vocabulary level (vocab > 0) needs a token ranking; HiSpecModel finds one "
                                  "(the adapter's, else a short calibration decode)")
            vocab = self.ranking[:size].sort().values.to(self.decoder.device)
            self._level_vocabs[size] = vocab
        return vocab

    @torch.inference_mode()
    def exit_logits(self, layer: int, h: torch.Tensor) -> torch.Tensor:
        """Next-token logits at exit ``layer`` ([1, n, hidden] -> [n, vocab]); for a head with
        its own attention ``h`` is that head's output (see :meth:`ExitHead.extend`)."""
        head = self.heads.get(layer)
        if layer == self.decoder.num_layers or head is None:
            return self.decoder.final_logits(h)[0]
        h = h if layer in self.head_cache_layer else self.decoder.rowwise(head.transform, h)  # deep context: none
        return head.project(h, self.decoder, restrict=self.use_exit_vocab)[0]
