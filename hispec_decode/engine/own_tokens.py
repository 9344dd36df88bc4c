"""A sequence's own tokens at the vocabulary level: a level judges only what it can name.

The vocabulary level ``L_v`` runs the LM head over the base's ``vocab`` most frequent tokens only
(:meth:`~hispec_decode.engine.model_runner.ModelRunner.level_vocab`). A name that a prompt brings
is rarely among them, so ``L_v`` would reject every draft of it (prompt lookup's copies, an exit
head's drafts) though the full model accepts them, and where ``L_v`` drafts it could never propose
it. So each sequence adds to ``L_v``'s rows the tokens it has *committed* (prompt, and output the full
model verified) that lie outside them: :class:`OwnTokens` keeps their ids and LM-head rows, extended
as the sequence commits more.

Exactness: the rows depend on committed tokens only, never on the drafts being judged, so at every
position ``L_v``'s distribution is a function of the prefix, as every level's is; ``L_f`` checks what
``L_v`` passed against that distribution as its proposal, as before. Greedy output still equals the
base model's and sampled output is still an exact sample of it.

Shapes: ``ids`` [m] token ids (m: own tokens outside the level), ``rows`` [m, hidden] their LM-head
rows; :func:`add_own_logits` writes ``[n, m]`` logits into ``[n, vocab]`` level logits.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from ..layers.quant import weight_rows


@dataclass
class OwnTokens:
    """One sequence's committed tokens outside a vocabulary level of ``size`` tokens."""

    size: int  # the level's size these are outside of
    scanned: int = 0  # tokens[:scanned] are looked at
    ids: list[int] = field(default_factory=list)
    index: torch.Tensor | None = None  # [m] ``ids`` as a tensor (None: no own token yet)
    rows: torch.Tensor | None = None  # [m, hidden] their LM-head rows
    bias: torch.Tensor | None = None  # [m] the LM head's bias, where it has one

    def update(self, tokens: list[int], committed: int, inside: torch.Tensor, head: nn.Module) -> None:
        """Take in ``tokens[scanned:committed]``: those outside the level (``inside``: [vocab] bool, the
        level's tokens) and not yet kept get their rows of the LM head ``head`` (weight and bias)."""
        if committed <= self.scanned:
            return
        chunk = tokens[self.scanned : committed]
        self.scanned = committed
        kept = set(self.ids)
        new = [t for t, known in zip(chunk, inside[torch.tensor(chunk)].tolist()) if not known and t not in kept]
        new = list(dict.fromkeys(new))
        if not new:
            return
        index = torch.tensor(new, device=inside.device)
        self.ids += new
        self.index = index if self.index is None else torch.cat([self.index, index])
        rows = weight_rows(head, index)
        bias = head.bias
        self.rows = rows if self.rows is None else torch.cat([self.rows, rows])
        if bias is not None:
            b = bias.index_select(0, index)
            self.bias = b if self.bias is None else torch.cat([self.bias, b])

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """Their logits [n, m] for normalized states ``h`` [n, hidden]."""
        return F.linear(h.to(self.rows.dtype), self.rows, self.bias)


def add_own_logits(logits: torch.Tensor, h: torch.Tensor, own: OwnTokens) -> None:
    """Write the logits of ``own``'s tokens for normalized states ``h`` [n, hidden] into ``logits``
    [n, vocab] (the level's logits, ``-inf`` outside it)."""
    if own.index is not None:
        logits[:, own.index] = own.logits(h).to(logits.dtype)


def add_own_prefix_logits(logits: torch.Tensor, h: torch.Tensor, tokens: list[int], inside: torch.Tensor,
                          head: nn.Module) -> None:
    """:func:`add_own_logits` along a whole sequence (a calibration trace): row ``t`` of ``logits`` and ``h``
    [T, ...] predicts the token after ``tokens[:t + 1]`` and names the own tokens among those only."""
    own = OwnTokens(size=0)
    own.update(tokens, len(tokens), inside, head)
    if own.index is None:
        return
    first: dict[int, int] = {}
    for i, t in enumerate(tokens):
        first.setdefault(t, i)
    values = own.logits(h).to(logits.dtype)  # [T, m]
    since = torch.tensor([first[t] for t in own.ids], device=values.device)
    values[torch.arange(values.shape[0], device=values.device)[:, None] < since[None]] = float("-inf")
    logits[:, own.index] = values
