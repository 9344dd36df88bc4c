"""Quantizing a float checkpoint on load into GGUF blocks (an opt-in: ``dtype="q8_0"`` and the like).

Every linear of the decoder layers, the LM head and the token embedding become block weights
(:class:`~hispec_decode.layers.quant.BlockLinear`), quantized as ggml's reference quantizers do
(the ``gguf`` package's numpy code: Q8_0, Q4_0, Q4_1, Q5_0, Q5_1), served by the same kernels as a
GGUF file. This is a different model from the checkpoint: "lossless" then means every method equals
plain decoding of the same quantized weights, not the float model's output.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from ..errors import HiSpecError
from ..layers.quant import SERVED, BlockEmbedding, BlockLinear

ON_LOAD = {"q8_0": "Q8_0", "q4_0": "Q4_0", "q4_1": "Q4_1", "q5_0": "Q5_0", "q5_1": "Q5_1"}


def quantize_weight(weight: torch.Tensor, name: str) -> torch.Tensor:
    """``weight`` [N, K] as blocks of format ``name`` (uint8 [N, row bytes])."""
    from gguf import GGMLQuantizationType
    from gguf.quants import quantize

    return torch.from_numpy(np.ascontiguousarray(quantize(weight.detach().float().numpy(), GGMLQuantizationType[name])))


def quantize_model(model: nn.Module, precision: str, dtype: torch.dtype = torch.bfloat16) -> nn.Module:
    """``model`` with its linears, LM head and embedding in blocks of ``precision`` (:data:`ON_LOAD`),
    activations in ``dtype``. A linear whose input width is not a multiple of 32 stays as it is."""
    name = ON_LOAD.get(precision)
    if name is None:
        raise HiSpecError(f"cannot quantize on load to {precision!r}; choose one of {', '.join(ON_LOAD)}")
    kind = SERVED[name]
    embedding, head = model.get_input_embeddings(), model.get_output_embeddings()
    tied = head is not None and embedding is not None and head.weight is embedding.weight
    swaps: list[tuple[nn.Module, str, nn.Module]] = []
    for parent in model.modules():
        for child_name, child in parent.named_children():
            if isinstance(child, nn.Linear) and child is not head and child.in_features % 32 == 0:
                blocks = quantize_weight(child.weight, name)
                swaps.append((parent, child_name, BlockLinear(blocks, kind, child.in_features, child.bias, dtype)))
    table = None
    if isinstance(embedding, nn.Embedding) and embedding.embedding_dim % 32 == 0:
        table = quantize_weight(embedding.weight, name)
        scale = getattr(embedding, "embed_scale", None)
        new = BlockEmbedding(table, kind, embedding.embedding_dim, None if scale is None else float(scale), dtype)
        model.set_input_embeddings(new)
    if isinstance(head, nn.Linear) and head.in_features % 32 == 0:
        blocks = table if tied and table is not None else quantize_weight(head.weight, name)
        model.set_output_embeddings(BlockLinear(blocks, kind, head.in_features, head.bias, dtype))
    for parent, child_name, new in swaps:
        setattr(parent, child_name, new)
    return model.to(dtype).eval().requires_grad_(False)
