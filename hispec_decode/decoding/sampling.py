"""Token choice and speculative verification, greedy and sampled.

Sampling applies the same warping (temperature, top-k, top-p) at every level, so the target
is the warped final distribution. Verification is the speculative rejection rule: a proposal
``x`` drawn from ``q`` is accepted with probability ``min(1, p(x) / q(x))``; on the first
rejection the next token is drawn from ``norm(max(0, p - q))``; when every proposal is
accepted a bonus token is drawn from ``p`` at the next position. Each accepted-or-replaced
token is then an exact sample of ``p``. HiSpec applies it twice: ``L_i`` against the draft,
then ``L_f`` against ``L_i`` (whose tentative tokens are exact samples of ``p_i``).

A draft tree's candidates are not draws from the draft distribution (they are its top choices, a
deterministic function of the context), so a tree is verified by walking it from the root
(:meth:`TokenSampler.verify_tree`): at each node the target chooses the next token *given the
candidates*, by sequential point-mass rejection: child ``c_1`` is accepted with probability
``r(c_1)`` under the target's distribution ``r = p``; if rejected, ``r`` loses ``c_1`` and is
renormalised and ``c_2`` is tried with probability ``r(c_2)``; if every child is rejected the token
is drawn from what is left of ``r``. Each token is then an exact sample of ``p`` (docs/trees.md).
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass

import torch

from .. import kernels
from ..errors import HiSpecError
from ..sampling_params import SamplingParams
from .tree import DraftTree


@dataclass(frozen=True)
class Verdict:
    accepted: int  # how many leading candidates were accepted
    token: int  # the replacement for the first rejected one, or the bonus token
    target_probs: torch.Tensor | None  # [n+1, vocab] warped target distribution (sampling only)


def warp(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Logits [n, vocab] -> warped probabilities [n, vocab] (float32)."""
    logits = logits.float()
    logits = (logits - logits.amax(-1, keepdim=True)) / params.temperature  # shifted first: no inf/inf at tiny temperatures
    if params.top_k > 0 and params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.top_p < 1.0:
        logits = logits.masked_fill(_outside_nucleus(logits, params.top_p), float("-inf"))
    return logits.softmax(-1)


def _outside_nucleus(logits: torch.Tensor, top_p: float, head: int = 512) -> torch.Tensor:
    """Mask [n, vocab] of the tokens outside the smallest prefix (by probability) with mass
    >= ``top_p``. The prefix usually lies within the ``head`` most likely tokens: then a top-k
    gives it (the same order and partial sums as a full sort) without sorting the vocabulary."""
    probs = logits.softmax(-1)
    if head >= logits.shape[-1]:
        return _sorted_outside(probs, top_p)
    top, order = probs.topk(head, dim=-1)  # sorted, descending
    drop = top.cumsum(-1) - top >= top_p
    mask = torch.ones_like(probs, dtype=torch.bool).scatter(-1, order, drop)
    long = (~drop[:, -1]).nonzero()[:, 0]  # rows whose nucleus does not end inside the head
    if len(long):  # decided per row, so a row's mask never depends on the other rows of the call
        mask[long] = _sorted_outside(probs[long], top_p)
    return mask


def _sorted_outside(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    top, order = torch.sort(probs, dim=-1, descending=True)
    drop = top.cumsum(-1) - top >= top_p  # keep the smallest prefix with mass >= top_p
    return drop.scatter(-1, order, drop)


def acceptance_probability(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """min(1, p/q) elementwise (where q > 0)."""
    return torch.where(q > 0, (p / q.clamp_min(1e-30)).clamp(max=1.0), torch.zeros_like(p))


def residual(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """norm(max(0, p - q)); ``p`` itself if ``p == q`` (then nothing is ever rejected)."""
    r = (p - q).clamp_min(0)
    total = r.sum(-1, keepdim=True)
    return torch.where(total > 0, r / total.clamp_min(1e-30), p)


class TokenSampler:
    """Chooses tokens and verifies proposals under one :class:`SamplingParams`.

    Every method takes ``position``, the sequence position of the (first) token it chooses. The
    default sampling ignores it: proposals are verified by speculative rejection sampling, drawing
    from one generator. In the drafter-invariant mode (``drafter_invariant=True``, sampling only)
    the token at position ``t`` is ``argmax(log p_warped + G_t)``, where ``G_t`` is Gumbel noise
    over the vocabulary keyed to (seed, ``t``) alone, and a proposal is accepted exactly when it
    equals that argmax at the verifying level (Gumbel-max coupling, Daliri et al. 2024). Each token
    is an exact sample of the base model (``G_t`` is independent of everything before ``t``), and
    the text depends on the seed only: not on the method, the policy, the drafts or the batch.
    """

    NOISE_CACHE = 32  # positions whose noise is kept at most (commits drop the older ones: see forget)

    def __init__(self, params: SamplingParams) -> None:
        self.params, seed = params, params.seed
        self.generator = torch.Generator()
        if seed is None:
            self.generator.seed()
        else:
            self.generator.manual_seed(seed)
        self.gumbel = params.do_sample and params.drafter_invariant
        self.seed = seed if seed is not None else int.from_bytes(os.urandom(8), "little") >> 1
        self._noise: dict[int, torch.Tensor] = {}

    @property
    def greedy(self) -> bool:
        return not self.params.do_sample

    @property
    def path_free(self) -> bool:
        """Whether the tokens are the same whichever path decodes them (plain steps or speculative
        rounds, any policy): greedy, drafter-invariant, or sampled without a seed (nothing to reproduce)."""
        return self.greedy or self.gumbel or self.params.seed is None

    def probs(self, logits: torch.Tensor) -> torch.Tensor:
        return warp(logits, self.params)

    def _draw(self, probs: torch.Tensor) -> int:
        return int(torch.multinomial(probs, 1, generator=self.generator))

    def noise(self, position: int | None, vocab: int) -> torch.Tensor:
        """Gumbel noise [vocab] (float64) of ``position``, the same on every call for this seed."""
        if position is None:
            raise HiSpecError("drafter-invariant sampling needs the position of each token it chooses")
        g = self._noise.get(position)
        if g is None or g.shape[0] != vocab:
            gen = torch.Generator().manual_seed(_mix(self.seed, position))
            u = torch.rand(vocab, generator=gen, dtype=torch.float64).clamp_min(1e-300)
            g = -torch.log(-torch.log(u))
            if len(self._noise) >= self.NOISE_CACHE:
                del self._noise[min(self._noise)]
            self._noise[position] = g
        return g

    def forget(self, before: int) -> None:
        """Drop the noise of positions before ``before`` (committed: never chosen again)."""
        if not self._noise:  # the default sampling keeps none: nothing to do at each commit
            return
        for p in [p for p in self._noise if p < before]:
            del self._noise[p]

    def _gumbel_argmax(self, probs: torch.Tensor, position: int | None) -> int:
        return int((probs.double().log() + self.noise(position, probs.shape[-1])).argmax())

    def choose(self, logits: torch.Tensor, position: int | None = None) -> tuple[int, torch.Tensor | None]:
        """One token from logits [1, vocab]; also its distribution when sampling (a proposal's ``q``)."""
        if self.greedy:
            return int(kernels.argmax(logits[-1])), None
        probs = self.probs(logits[-1:])[0]
        if self.gumbel:
            return self._gumbel_argmax(probs, position), probs
        return self._draw(probs), probs

    def propose(self, logits: torch.Tensor, threshold: float, position: int | None = None
                ) -> tuple[int, torch.Tensor | None] | None:
        """Like :meth:`choose`, but only if the distribution's top probability is at least
        ``threshold`` (else None, and no random number is used). The decision depends on the
        proposal's distribution only, never on the drawn token, so verification stays exact."""
        if threshold <= 0:
            return self.choose(logits, position)
        if self.greedy:
            row = logits[-1]
            if float(row.float().softmax(-1).max()) < threshold:
                return None
            return int(kernels.argmax(row)), None
        probs = self.probs(logits[-1:])[0]
        if float(probs.max()) < threshold:
            return None
        if self.gumbel:
            return self._gumbel_argmax(probs, position), probs
        return self._draw(probs), probs

    def confidence(self, logits: torch.Tensor, probs: torch.Tensor | None = None) -> torch.Tensor:
        """Top probability of each row of logits [n, vocab] (warped when sampling; ``probs``: the
        warped distribution if :meth:`verify` already computed it): a proposal-side estimate of how
        likely the next level accepts what this level proposes."""
        if probs is None:
            probs = self.probs(logits) if not self.greedy else logits.float().softmax(-1)
        return probs.max(-1).values

    def verify(self, candidates: list[int], proposal: torch.Tensor | None, target_logits: torch.Tensor,
               position: int | None = None) -> Verdict:
        """Check ``n`` candidates (the first at ``position``) against target logits [n+1, vocab]
        (row j predicts candidate j).

        ``proposal`` [n, vocab] is the distribution each candidate was drawn from (sampling); None:
        point masses (candidates that were not drawn from a distribution, e.g. copied by prompt lookup),
        accepted with probability ``p(x)``, else replaced by a draw from ``p`` without ``x``.
        """
        n = len(candidates)
        if self.greedy:
            return greedy_verdict(candidates, kernels.argmax(target_logits).tolist())
        p = self.probs(target_logits)
        if self.gumbel:  # the target's own Gumbel choice at each position, up to the first disagreement
            j = 0
            while True:
                token = self._gumbel_argmax(p[j], None if position is None else position + j)
                if j == n or candidates[j] != token:
                    return Verdict(j, token, p)
                j += 1
        j = n
        if n:
            idx = torch.tensor(candidates)
            rows = torch.arange(n)
            q = proposal[rows, idx] if proposal is not None else torch.ones(n)
            ratio = acceptance_probability(p[rows, idx], q)
            u = torch.rand(n, generator=self.generator)
            rejected = (u >= ratio).nonzero()
            if len(rejected):
                j = int(rejected[0])
        if j < n and proposal is None:  # a point mass: the residual is p without the candidate
            token = self._draw(residual(p[j], torch.zeros_like(p[j]).index_fill_(0, torch.tensor([candidates[j]]), 1.0)))
        else:
            token = self._draw(residual(p[j], proposal[j]) if j < n else p[j])
        return Verdict(j, token, p)

    def candidates(self, logits: torch.Tensor, k: int, positions: list[int]) -> list[list[tuple[int, float]]]:
        """A draft tree's candidates from rows of draft logits [m, vocab], row ``i`` for position
        ``positions[i]``: each row's ``k`` most likely tokens with their probabilities (warped when
        sampling), most likely first; in the drafter-invariant mode ranked by the Gumbel-perturbed
        score of the position, so the first is the token a chain would draft."""
        k = min(k, logits.shape[-1])
        if self.greedy:
            top, order = logits.float().softmax(-1).topk(k, dim=-1)
        else:
            probs = self.probs(logits)
            if self.gumbel:
                order = torch.stack([(row.double().log() + self.noise(pos, probs.shape[-1])).topk(k).indices
                                     for row, pos in zip(probs, positions)])
            else:
                order = probs.topk(k, dim=-1).indices
            top = probs.gather(-1, order)
        return [[(t, q) for t, q in zip(ts, qs) if q > 0] for ts, qs in zip(order.tolist(), top.tolist())]

    def verify_tree(self, tree: DraftTree, target_logits: torch.Tensor) -> TreeVerdict:
        """Walk ``tree`` from its root against target logits [1 + len(tree), vocab] (row 0: the root,
        row 1 + i: node i): at each node the target chooses a token (greedy: its argmax; drafter-
        invariant: its Gumbel argmax at that position; else sequential point-mass rejection over the
        node's children, see the module docstring); a child holding it is accepted and the walk goes on."""
        best = kernels.argmax(target_logits).tolist() if self.greedy else None
        p = None if self.greedy else self.probs(target_logits)

        def choose(node: int, kids: list[int]) -> int:
            row = node + 1
            if self.greedy:
                return best[row]
            if self.gumbel:
                return self._gumbel_argmax(p[row], tree.base + tree.depth(node))
            return self._point_mass(p[row], [tree.tokens[c] for c in kids])

        walk = walk_tree(tree, choose)
        return walk if p is None else dataclasses.replace(walk, target_probs=p[walk.rows])

    def _point_mass(self, p: torch.Tensor, candidates: list[int]) -> int:
        """An exact sample of ``p`` [vocab] that is one of ``candidates`` as often as it can be:
        each is accepted with its probability under what the rejected ones left."""
        r = p
        for c in candidates:
            if float(torch.rand((), generator=self.generator)) < float(r[c]):
                return c
            r = r.clone()
            r[c] = 0
            total = float(r.sum())
            if total <= 0:  # p was a point mass on rejected candidates: impossible unless rounding
                return c
            r = r / total
        return self._draw(r)


@dataclass(frozen=True)
class TreeVerdict:
    """What verifying a draft tree decided: the accepted nodes (a root-to-node path), the target's
    token after them, and whether that token replaces rejected children (else it is a bonus after a
    leaf). ``rows``: the logits rows of the root and the path (for gates), ``target_probs`` the warped
    target distribution of those rows (sampling only)."""

    path: list[int]
    token: int
    replaced: bool
    rows: list[int]
    target_probs: torch.Tensor | None

    @property
    def verdict(self) -> Verdict:
        """The same decision as a chain's (once the path has been moved to consecutive slots)."""
        return Verdict(len(self.path), self.token, self.target_probs)


def walk_tree(tree: DraftTree, choose) -> TreeVerdict:
    """Walk ``tree`` from its root: at each node ``choose(node, children)`` gives the target's token
    there; a child holding it is accepted and the walk goes on, else the walk ends with that token."""
    path, node, rows = [], -1, [0]
    while True:
        kids = tree.children(node)
        token = choose(node, kids)
        child = next((c for c in kids if tree.tokens[c] == token), None)
        if child is None:
            return TreeVerdict(path, token, bool(kids), rows, None)
        path.append(child)
        rows.append(child + 1)
        node = child


def greedy_verdict(candidates: list[int], best: list[int]) -> Verdict:
    """Greedy verification: candidates are accepted while each equals the target's choice ``best[j]``
    at its position; the target's choice at the first disagreement (or after the last) follows."""
    j = 0
    while j < len(candidates) and candidates[j] == best[j]:
        j += 1
    return Verdict(j, best[j], None)


def _mix(seed: int, position: int) -> int:
    """A 63-bit generator seed from (seed, position): splitmix64 of both, so nearby seeds (the rows
    of a batch use seed + i) and nearby positions give unrelated streams."""
    mask = (1 << 64) - 1
    z = (seed * 0x9E3779B97F4A7C15 + position * 0xBF58476D1CE4E5B9 + 0x94D049BB133111EB) & mask
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & mask
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & mask
    return (z ^ (z >> 31)) >> 1
