"""Prompt lookup: drafts copied from earlier in the sequence, at the cost of no model pass.

When a sequence's last ``n`` tokens occurred before (in the prompt or in the output so far), the
tokens that followed that occurrence are a cheap guess of what follows now: code that is rewritten
or extended, quoted text, repeated names and structure. This is vLLM's ``ngram`` speculator and
llama.cpp's lookup decoding. The guesses are point masses (a proposal that puts all its
probability on one token), verified as any draft: greedy by exact match, sampled by the point-mass
rule (accept ``x`` with probability ``p(x)``, else draw from ``p`` without ``x``), so output stays
exact. The most recent occurrence of the longest matching suffix wins.
"""

from __future__ import annotations

import numpy as np

MAX_NGRAM = 3  # the longest suffix looked up; shorter ones are tried down to MIN_NGRAM
MIN_NGRAM = 2


def lookup(tokens: list[int], count: int, max_ngram: int = MAX_NGRAM, min_ngram: int = MIN_NGRAM) -> list[int]:
    """Up to ``count`` tokens that followed the latest earlier occurrence of the longest suffix of
    ``tokens`` of ``max_ngram`` down to ``min_ngram`` tokens; [] where there is none."""
    if count <= 0 or len(tokens) <= min_ngram:
        return []
    seq = np.asarray(tokens, dtype=np.int64)
    total = len(seq)
    for n in range(min(max_ngram, total - 1), min_ngram - 1, -1):
        # starts i < total - n with seq[i : i + n] == the last n tokens (the suffix itself excluded)
        hits = np.ones(total - n, dtype=bool)
        for j in range(n):
            hits &= seq[j : total - n + j] == seq[total - n + j]
        starts = np.flatnonzero(hits)
        if len(starts):
            follow = int(starts[-1]) + n
            return seq[follow : follow + count].tolist()
    return []
