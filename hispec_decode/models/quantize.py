"""Quantizing a float checkpoint on load into GGUF blocks (an opt-in: ``dtype="q8_0"`` and the like).

Every linear of the decoder layers, the LM head and the token embedding become block weights
(:class:`~hispec_decode.layers.quant.BlockLinear`), quantized as ggml's reference quantizers do
(the ``gguf`` package's numpy code: Q8_0, Q4_0, Q4_1, Q5_0, Q5_1) or, for Q4_K, by :func:`quantize_q4_k`
(min-max scales per 32 values, not llama.cpp's search: a little more error than its Q4_K), served by
the same kernels as a GGUF file. This is a different model from the checkpoint: "lossless" then means every method equals
plain decoding of the same quantized weights, not the float model's output.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from ..errors import HiSpecError
from ..layers.huge_pages import move_to_huge_pages
from ..layers.quant import SERVED, BlockEmbedding, BlockLinear, pack

ON_LOAD = {"q8_0": "Q8_0", "q4_k": "Q4_K", "q4_0": "Q4_0", "q4_1": "Q4_1", "q5_0": "Q5_0", "q5_1": "Q5_1"}


def quantize_weight(weight: torch.Tensor, name: str) -> torch.Tensor:
    """``weight`` [N, K] as blocks of format ``name`` (uint8 [N, row bytes])."""
    from gguf import GGMLQuantizationType
    from gguf.quants import quantize

    values = weight.detach().float().numpy()
    if name == "Q4_K":
        return torch.from_numpy(quantize_q4_k(values))
    return torch.from_numpy(np.ascontiguousarray(quantize(values, GGMLQuantizationType[name])))


def quantize_q4_k(w: np.ndarray) -> np.ndarray:
    """[N, K] float32 (K a multiple of 256) as Q4_K blocks, uint8 [N, K / 256 * 144]: per 32 values
    ``w ~ d * sc * q - dmin * m`` with ``q`` in 0..15 from the sub-block's minimum and maximum, the
    6-bit ``sc`` and ``m`` relative to the super-block's half-precision ``d`` and ``dmin``."""
    n, k = w.shape
    if k % 256:
        raise HiSpecError(f"Q4_K needs rows of a multiple of 256 values; this weight's rows have {k}")
    x = w.reshape(n, k // 256, 8, 32).astype(np.float32)
    low = np.minimum(x.min(-1), 0.0)
    scale, mins = (x.max(-1) - low) / 15.0, -low  # [n, B, 8]
    d = (scale.max(-1) / 63.0).astype(np.float16)
    dmin = (mins.max(-1) / 63.0).astype(np.float16)
    df, dminf = d.astype(np.float32)[..., None], dmin.astype(np.float32)[..., None]
    with np.errstate(divide="ignore", invalid="ignore"):
        sc = np.where(df > 0, np.clip(np.rint(scale / df), 0, 63), 0).astype(np.uint8)
        m = np.where(dminf > 0, np.clip(np.rint(mins / dminf), 0, 63), 0).astype(np.uint8)
        step, offset = (df * sc)[..., None], (dminf * m)[..., None]
        q = np.where(step > 0, np.clip(np.rint((x + offset) / step), 0, 15), 0).astype(np.uint8)
    packed = np.zeros((n, k // 256, 12), np.uint8)  # ggml's get_scale_min_k4, inverted
    packed[..., 0:4] = (sc[..., 0:4] & 63) | ((sc[..., 4:8] >> 4) << 6)
    packed[..., 4:8] = (m[..., 0:4] & 63) | ((m[..., 4:8] >> 4) << 6)
    packed[..., 8:12] = (sc[..., 4:8] & 0xF) | ((m[..., 4:8] & 0xF) << 4)
    qs = (q[..., 0::2, :] | (q[..., 1::2, :] << 4)).reshape(n, k // 256, 128)  # chunk c: sub-blocks 2c, 2c + 1
    blocks = np.concatenate([d[..., None].view(np.uint8), dmin[..., None].view(np.uint8), packed, qs], axis=-1)
    return np.ascontiguousarray(blocks.reshape(n, -1))


def quantize_model(model: nn.Module, precision: str, dtype: torch.dtype = torch.bfloat16) -> nn.Module:
    """``model`` with its linears, LM head and embedding in blocks of ``precision`` (:data:`ON_LOAD`),
    activations in ``dtype``. A linear whose input width is not a multiple of the block's (32; Q4_K 256)
    stays as it is."""
    name = ON_LOAD.get(precision)
    if name is None:
        raise HiSpecError(f"cannot quantize on load to {precision!r}; choose one of {', '.join(ON_LOAD)}")
    kind = SERVED[name]
    width = 256 if name == "Q4_K" else 32  # inputs per block
    embedding, head = model.get_input_embeddings(), model.get_output_embeddings()
    tied = head is not None and embedding is not None and head.weight is embedding.weight
    swaps: list[tuple[nn.Module, str, nn.Module]] = []
    for parent in model.modules():
        for child_name, child in parent.named_children():
            if isinstance(child, nn.Linear) and child is not head and child.in_features % width == 0:
                blocks = pack(quantize_weight(child.weight, name), kind)  # interleaved where the rows allow
                swaps.append((parent, child_name, BlockLinear(*blocks, child.in_features, child.bias, dtype)))
    table = None
    if isinstance(embedding, nn.Embedding) and embedding.embedding_dim % width == 0:
        table = pack(quantize_weight(embedding.weight, name), kind)
        scale = getattr(embedding, "embed_scale", None)
        new = BlockEmbedding(*table, embedding.embedding_dim, None if scale is None else float(scale), dtype)
        model.set_input_embeddings(new)
    if isinstance(head, nn.Linear) and head.in_features % width == 0:
        blocks = table if tied and table is not None else pack(quantize_weight(head.weight, name), kind)
        model.set_output_embeddings(BlockLinear(*blocks, head.in_features, head.bias, dtype))
    for parent, child_name, new in swaps:
        setattr(parent, child_name, new)
    move_to_huge_pages(m.blocks for m in model.modules() if isinstance(m, BlockLinear))
    return model.to(dtype).eval().requires_grad_(False)
