"""A reduced output vocabulary for the early exits: the most frequent tokens of the training data.

The draft and intermediate exits then multiply by a ``K x hidden`` slice of the LM head instead
of the whole ``vocab x hidden`` matrix (the LM head is about half the cost of a draft pass after
4 of 30 layers). Decoding stays lossless: only early exits are restricted; the final layer
always predicts over the full vocabulary, so a token outside the slice is simply never drafted.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass

import torch

from hispec_decode.errors import HiSpecError

logger = logging.getLogger(__name__)


@dataclass
class ExitVocab:
    ids: torch.Tensor  # [K] sorted token ids
    coverage: float  # fraction of the training tokens that are in ``ids``


def exit_vocabulary(tokens: torch.Tensor, size: int, vocab_size: int, always: Iterable[int] = ()) -> ExitVocab:
    """The ``size`` most frequent ids of ``tokens`` (any shape), always including ``always``
    (special tokens such as EOS, which must stay draftable)."""
    if not 0 < size < vocab_size:
        raise HiSpecError(f"exit_vocab_size must be in 1..{vocab_size - 1} (the base's vocabulary has {vocab_size} tokens); "
                          f"got {size}")
    counts = torch.bincount(tokens.reshape(-1), minlength=vocab_size).double()
    forced = [i for i in set(always) if 0 <= i < vocab_size]
    counts_ranked = counts.clone()
    counts_ranked[forced] = float("inf")
    ids = counts_ranked.topk(size).indices.sort().values
    coverage = float(counts[ids].sum() / counts.sum())
    logger.info("exit vocabulary: %d of %d tokens cover %.1f%% of the training tokens", size, vocab_size, 100 * coverage)
    return ExitVocab(ids, coverage)
