"""A KV cache with one valid length per layer.

HiSpec's stages leave the layers of one sequence at different lengths: layers ``0..L_d`` hold
the drafts, ``L_d..L_i`` the tokens checked by the intermediate exit, the upper layers only
what the full model has seen. Each layer therefore records its own length, and truncation
after a rejection is a change of lengths: the stale slots are overwritten by the next write
at those positions (positions are explicit), never read before that.
"""

from __future__ import annotations

import torch

from .errors import HiSpecError


class LayeredKVCache:
    """Contiguous K/V buffers of one sequence: ``[1, n_kv_heads, capacity, head_dim]`` per layer."""

    def __init__(
        self,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        capacity: int,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
    ) -> None:
        shape = (1, num_kv_heads, capacity, head_dim)
        self.keys = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.values = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.lengths = [0] * num_layers
        self.capacity = capacity

    def append(
        self, layer: int, start: int, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Write new K/V ``[1, n_kv, T, d]`` at slots ``start..start+T``; return all valid K/V."""
        end = start + k.shape[2]
        if start > self.lengths[layer]:
            raise RuntimeError(f"layer {layer}: write at {start} leaves a gap after {self.lengths[layer]}")
        if end > self.capacity:
            raise HiSpecError(f"KV cache capacity {self.capacity} exceeded (writing up to {end})")
        self.keys[layer][:, :, start:end] = k
        self.values[layer][:, :, start:end] = v
        self.lengths[layer] = end
        return self.keys[layer][:, :, :end], self.values[layer][:, :, :end]

    def truncate(self, length: int) -> None:
        """Drop every entry at position >= ``length`` in every layer."""
        self.lengths = [min(n, length) for n in self.lengths]

    def valid(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The valid K/V of one layer: ``[1, n_kv, lengths[layer], d]`` each."""
        n = self.lengths[layer]
        return self.keys[layer][:, :, :n], self.values[layer][:, :, :n]

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.keys + self.values)
