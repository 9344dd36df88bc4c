"""Linear layers and embeddings whose weights stay in a GGUF file's own blocks.

Glossary and shapes:

- ``blocks``: uint8 ``[N, K / QK * BYTES]``, the file's blocks of output row ``n`` side by side
  (``QK`` values of ``BYTES`` bytes per block: ggml's layout, e.g. Q4_K 256 / 144).
- ``ggml_type``: the block format's ggml id (:data:`SERVED`); plus :data:`X8` where the blocks are
  interleaved by 8 rows (:func:`pack`: a byte permutation within each group of 8 rows, same shape,
  which the kernels serve many rows from; :func:`unpack_rows` reads ggml's rows back).
- activations: the kernel quantizes every row of ``x`` to 8 bits per ``G`` inputs
  (:func:`activation_group`: 32 for the 32-value formats, 256 for the K formats), as llama.cpp
  does; :func:`quantize_q8` is the same arithmetic in torch. Outputs are in ``x``'s dtype.

The compiled kernel (``linear_q``, :mod:`hispec_decode.kernels`) computes each output alone, in a
fixed order, so every method decodes the same bits as plain decoding of the same weights. Without
the kernels (``HISPEC_KERNELS=0``, a CPU without AVX2) the torch fallback de-quantizes each weight
once to float32 (four times the file's bytes) and multiplies the 8-bit activations in float32.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from .. import kernels

SERVED = {"Q4_0": 2, "Q4_1": 3, "Q5_0": 6, "Q5_1": 7, "Q8_0": 8, "Q4_K": 12, "Q5_K": 13, "Q6_K": 14}
K_FORMATS = frozenset({12, 13, 14})
X8 = 256  # added to a ggml type: the blocks are interleaved by 8 rows (:func:`pack`)
_NO_BIAS = torch.empty(0)

# Each format's fields as (offset, bytes, chunk), in the order an interleaved block holds them: pack puts
# a field's chunks of 8 rows side by side (kernels/csrc/blocks_x8.h reads them): half-precision scales
# by 2 bytes, the K formats' packed scales by 1, quants and high bits by 4. Q6_K's are ordered as the
# kernel reads them (scales first, then each 128 inputs' quants and high bits), so a block streams.
FIELDS: dict[int, tuple[tuple[int, int, int], ...]] = {
    2: ((0, 2, 2), (2, 16, 4)),
    3: ((0, 2, 2), (2, 2, 2), (4, 16, 4)),
    6: ((0, 2, 2), (2, 4, 4), (6, 16, 4)),
    7: ((0, 2, 2), (2, 2, 2), (4, 4, 4), (8, 16, 4)),
    8: ((0, 2, 2), (2, 32, 4)),
    12: ((0, 2, 2), (2, 2, 2), (4, 12, 1), (16, 128, 4)),
    13: ((0, 2, 2), (2, 2, 2), (4, 12, 1), (16, 32, 4), (48, 128, 4)),
    14: ((208, 2, 2), (192, 16, 1), (0, 64, 4), (128, 32, 4), (64, 64, 4), (160, 32, 4)),
}


def base_type(ggml_type: int) -> int:
    """The ggml format of ``ggml_type``, interleaved or not."""
    return ggml_type % X8


def block_shape(ggml_type: int) -> tuple[int, int]:
    """(values, bytes) of one block of ``ggml_type``."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    return GGML_QUANT_SIZES[GGMLQuantizationType(base_type(ggml_type))]


def type_name(ggml_type: int) -> str:
    name = next((name for name, i in SERVED.items() if i == base_type(ggml_type)), f"ggml type {ggml_type}")
    return name + " x8" if ggml_type >= X8 else name


def activation_group(ggml_type: int) -> int:
    """Inputs per 8-bit activation scale for weights of ``ggml_type``."""
    return 256 if base_type(ggml_type) in K_FORMATS else 32


@lru_cache(maxsize=64)
def _group_order(ggml_type: int, row_bytes: int) -> torch.Tensor:
    """int64 [8 * row_bytes] (shared: not to be written): position p of an interleaved group of 8 rows
    holds byte ``order[p]`` of the 8 rows side by side (row c's byte i at ``c * row_bytes + i``)."""
    _, nbytes = block_shape(ggml_type)
    one = []
    for offset, size, chunk in FIELDS[base_type(ggml_type)]:
        for i in range(size // chunk):
            for c in range(8):
                one += [c * row_bytes + offset + i * chunk + b for b in range(chunk)]
    block = torch.tensor(one, dtype=torch.int64)  # the first block of the group
    return (block[None, :] + torch.arange(row_bytes // nbytes)[:, None] * nbytes).reshape(-1)


def pack(blocks: torch.Tensor, ggml_type: int) -> tuple[torch.Tensor, int]:
    """Row-major blocks as the kernels serve many rows from: interleaved by 8 rows (``ggml_type +
    X8``), same shape and bytes. Left as they are where the rows are not a multiple of 8."""
    if ggml_type >= X8 or blocks.shape[0] % 8:
        return blocks, ggml_type
    n, row_bytes = blocks.shape
    order = _group_order(base_type(ggml_type), row_bytes)
    groups = blocks.reshape(n // 8, 8 * row_bytes)
    return groups.index_select(1, order).reshape(n, row_bytes), ggml_type + X8


def unpack_rows(blocks: torch.Tensor, ggml_type: int, rows: torch.Tensor | None = None) -> torch.Tensor:
    """Rows ``rows`` (all if None) of a block weight, row-major (ggml's layout)."""
    if ggml_type < X8:
        return blocks if rows is None else blocks[rows.reshape(-1).long()]
    n, row_bytes = blocks.shape
    ids = torch.arange(n) if rows is None else rows.reshape(-1).long()
    where = (ids // 8 * (8 * row_bytes))[:, None] + _row_positions(base_type(ggml_type), row_bytes)[ids % 8]
    return blocks.reshape(-1)[where.reshape(-1)].reshape(len(ids), row_bytes)


@lru_cache(maxsize=64)
def _row_positions(ggml_type: int, row_bytes: int) -> torch.Tensor:
    """int64 [8, row_bytes] (shared: not to be written): where row c's byte i sits in its interleaved group."""
    inverse = torch.empty(8 * row_bytes, dtype=torch.int64)
    inverse[_group_order(ggml_type, row_bytes)] = torch.arange(8 * row_bytes)
    return inverse.reshape(8, row_bytes)


def quantize_q8(x: torch.Tensor, group: int) -> torch.Tensor:
    """``x`` [..., K] as the kernel quantizes it, de-quantized to float32: per ``group`` inputs
    ``d = amax / 127`` and ``q = round(x * (127 / amax))`` (ties to even; 0 where amax is 0)."""
    v = x.float().reshape(*x.shape[:-1], -1, group)
    amax = v.abs().amax(-1, keepdim=True)
    # 127 / amax correctly rounded, as the kernel divides (``127.0 / amax`` is 127 * (1 / amax) in torch)
    inverse = torch.where(amax > 0, torch.full_like(amax, 127.0) / amax, torch.zeros_like(amax))
    return (torch.round(v * inverse) * (amax / 127.0)).reshape(x.shape)


def _k() -> object | None:
    k = kernels.ops()
    return k if k is not None and k.linear_q_available() else None


def has_kernel() -> bool:
    """The compiled block kernels are built here (AVX2, FMA and F16C)."""
    return _k() is not None


def dequantize(blocks: torch.Tensor, ggml_type: int, in_features: int, rows: torch.Tensor | None = None) -> torch.Tensor:
    """Rows ``rows`` (all if None) of a block weight as float32 ``[n, in_features]``, the values ggml's
    de-quantization gives (the compiled kernel where built, else the ``gguf`` package's numpy code)."""
    k = _k()
    if ggml_type >= X8:
        blocks, rows, ggml_type = unpack_rows(blocks, ggml_type, rows), None, base_type(ggml_type)
    if k is not None:
        ids = torch.arange(blocks.shape[0]) if rows is None else rows.reshape(-1).long()
        return k.dequantize_rows(blocks, ggml_type, ids, in_features)
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize as gguf_dequantize

    picked = blocks if rows is None else blocks[rows.reshape(-1).long()]
    values = gguf_dequantize(np.ascontiguousarray(picked.numpy()), GGMLQuantizationType(ggml_type))
    return torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32)).reshape(-1, in_features)


class BlockLinear(nn.Module):
    """``y = x @ W.T + bias`` with ``W`` in GGUF blocks. ``dtype`` is the dtype of the activations it
    serves (the model's); the blocks and the float32 bias are plain attributes, which ``.to(dtype)``
    leaves alone."""

    def __init__(self, blocks: torch.Tensor, ggml_type: int, in_features: int, bias: torch.Tensor | None = None,
                 dtype: torch.dtype = torch.bfloat16) -> None:
        super().__init__()
        values, nbytes = block_shape(ggml_type)
        if blocks.dtype != torch.uint8 or blocks.dim() != 2 or in_features % values or \
                blocks.shape[1] != in_features // values * nbytes:
            raise ValueError(f"{type_name(ggml_type)} blocks for {in_features} inputs must be uint8 "
                             f"[N, {in_features // values * nbytes}]; got {blocks.dtype} {list(blocks.shape)}")
        if ggml_type >= X8 and blocks.shape[0] % 8:
            raise ValueError(f"{type_name(ggml_type)} blocks come in groups of 8 rows; got {blocks.shape[0]} rows")
        self.blocks, self.ggml_type, self.in_features = blocks, int(ggml_type), in_features
        self.out_features = blocks.shape[0]
        self.block_bias = bias.detach().float().contiguous() if bias is not None else None
        self.compute_dtype = dtype
        self._call: BlockWeight | None = None

    @property
    def bias(self) -> torch.Tensor | None:
        return None if self.block_bias is None else self.block_bias.to(self.compute_dtype)

    @property
    def device(self) -> torch.device:
        return self.blocks.device

    @property
    def weight(self) -> torch.Tensor:
        """The whole weight de-quantized (``out_features x in_features`` values: for the code that
        needs a dense matrix, not for decoding)."""
        return dequantize(self.blocks, self.ggml_type, self.in_features).to(self.compute_dtype)

    def rows(self, index: torch.Tensor) -> torch.Tensor:
        """Rows ``index`` of the weight, de-quantized, in the serving dtype."""
        return dequantize(self.blocks, self.ggml_type, self.in_features, index).to(self.compute_dtype)

    def select(self, index: torch.Tensor) -> BlockLinear:
        """A linear of the outputs ``index`` only (their blocks copied; interleaved where the original's are)."""
        bias = None if self.block_bias is None else self.block_bias[index]
        blocks, kind = unpack_rows(self.blocks, self.ggml_type, index).contiguous(), base_type(self.ggml_type)
        if self.ggml_type >= X8:
            blocks, kind = pack(blocks, kind)
        return BlockLinear(blocks, kind, self.in_features, bias, self.compute_dtype)

    def _apply(self, fn, recurse: bool = True):  # .to(dtype) changes the serving dtype, never the blocks
        probe = fn(torch.empty(0, dtype=self.compute_dtype))
        if probe.is_floating_point():
            self.compute_dtype = probe.dtype
        return super()._apply(fn, recurse)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._call is None or self._call.blocks is not self.blocks:
            self._call = BlockWeight(self.blocks, self.ggml_type, self.block_bias)
        return self._call(x)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, {type_name(self.ggml_type)}"


@dataclass
class BlockWeight:
    """One block weight as a kernel call: ``x [..., K] -> x @ W.T + bias`` in ``x``'s dtype."""

    blocks: torch.Tensor  # uint8 [N, row bytes]
    ggml_type: int
    bias: torch.Tensor | None = None  # float32 [N]
    dense: torch.Tensor | None = None  # the torch fallback's float32 copy, made on its first call

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        lead, K = x.shape[:-1], x.shape[-1]
        flat = x.reshape(-1, K)
        k = _k()
        if k is not None and x.device.type == "cpu":
            y = k.linear_q(flat.contiguous(), self.blocks, self.ggml_type, _NO_BIAS if self.bias is None else self.bias)
        else:
            if self.dense is None:
                self.dense = dequantize(self.blocks, self.ggml_type, K).to(x.device)
            y = F.linear(quantize_q8(flat, activation_group(self.ggml_type)), self.dense, self.bias).to(x.dtype)
        return y.reshape(*lead, self.blocks.shape[0])


class BlockEmbedding(nn.Module):
    """A token embedding table in GGUF blocks: looked-up rows de-quantized, in the serving dtype, times
    ``scale`` where the model scales its embeddings (Gemma: sqrt(hidden), rounded to that dtype)."""

    def __init__(self, blocks: torch.Tensor, ggml_type: int, embedding_dim: int, scale: float | None = None,
                 dtype: torch.dtype = torch.bfloat16) -> None:
        super().__init__()
        self.table = BlockLinear(blocks, ggml_type, embedding_dim, None, dtype)
        self.num_embeddings, self.embedding_dim, self.scale = blocks.shape[0], embedding_dim, scale

    @property
    def weight(self) -> torch.Tensor:
        return self.table.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        rows = self.table.rows(ids).reshape(*ids.shape, self.embedding_dim)
        if self.scale is None:
            return rows
        return rows * torch.tensor(self.scale, dtype=rows.dtype)


def weight_rows(linear: nn.Module, index: torch.Tensor) -> torch.Tensor:
    """Rows ``index`` of a linear's weight, without de-quantizing the rest of a block weight."""
    if isinstance(linear, BlockLinear):
        return linear.rows(index)
    return linear.weight.index_select(0, index)


def fuse_runs(linears: list[BlockLinear]) -> list[list[BlockLinear]]:
    """Consecutive linears of one format (hence one row width): each run is one kernel weight of :func:`fuse`."""
    runs: list[list[BlockLinear]] = []
    for lin in linears:
        if runs and runs[-1][-1].ggml_type == lin.ggml_type:
            runs[-1].append(lin)
        else:
            runs.append([lin])
    return runs


def fuse(linears: list[BlockLinear]) -> list[BlockWeight]:
    """The parts of a fused block linear, outputs side by side: consecutive linears of one format
    share one blocks tensor, whose slices the modules then hold (nothing is stored twice)."""
    parts: list[BlockWeight] = []
    for group in fuse_runs(linears):
        blocks = _adjacent(group) if len(group) > 1 else group[0].blocks
        if blocks is None:
            blocks = torch.cat([lin.blocks for lin in group])
        has_bias = any(lin.block_bias is not None for lin in group)
        bias = torch.cat([lin.block_bias if lin.block_bias is not None else torch.zeros(lin.out_features)
                          for lin in group]) if has_bias else None
        offset = 0
        for lin in group:  # re-pointed at the fused tensor's slices
            lin.blocks = blocks[offset: offset + lin.out_features]
            if has_bias:
                lin.block_bias = bias[offset: offset + lin.out_features]
            offset += lin.out_features
        parts.append(BlockWeight(blocks, group[0].ggml_type, bias))
    return parts


def _adjacent(linears: list[BlockLinear]) -> torch.Tensor | None:
    """The linears' blocks as one tensor without a copy, where they already lie side by side in one
    storage (:func:`hispec_decode.models.native.load_native` reads them so); else None."""
    first = linears[0].blocks
    row, end = first.shape[1], first.data_ptr()
    for lin in linears:
        b = lin.blocks
        if not b.is_contiguous() or b.shape[1] != row or b.data_ptr() != end or \
                b.untyped_storage().data_ptr() != first.untyped_storage().data_ptr():
            return None
        end += b.numel()
    rows = sum(lin.blocks.shape[0] for lin in linears)
    return torch.empty(0, dtype=torch.uint8, device=first.device).set_(
        first.untyped_storage(), first.storage_offset(), (rows, row))


def fused_call(x: torch.Tensor, parts: list[BlockWeight]) -> torch.Tensor:
    outs = [part(x) for part in parts]
    return outs[0] if len(outs) == 1 else torch.cat(outs, -1)
