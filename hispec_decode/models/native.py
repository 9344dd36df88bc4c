"""A GGUF base decoded on its own blocks: prepared once into ``$HISPEC_HOME``, loaded in seconds.

Preparing (:func:`prepare_native`) reads the file's header (a cut file or an unknown tensor type fails
here, in one line naming the tensor and its type), its config and tokenizer (transformers' GGUF
reader), and writes one safetensors file:

- every 2-d weight in a served block format (:data:`hispec_decode.layers.quant.SERVED`) as its
  blocks, uint8 ``[N, row bytes]``, under the transformers parameter name; rows reordered where
  llama.cpp's conversion reordered them (Llama's q/k heads), which moves whole rows of blocks; then
  interleaved by 8 rows (:func:`~hispec_decode.layers.quant.pack`) where N is a multiple of 8;
- every other tensor (norms, biases, float weights) de-quantized to float32, with transformers' own
  processing (Gemma's norms less 1);
- the ggml type of each block tensor in the file's metadata.

Loading (:func:`load_native`) builds the transformers model without weights, puts
:class:`~hispec_decode.layers.quant.BlockLinear` / ``BlockEmbedding`` modules in place of the
quantized linears and the embedding (a tied LM head shares the embedding's blocks), and loads the
float tensors. The resident weights are the file's bytes, on 2 MiB pages where Linux gives them
(:mod:`~hispec_decode.layers.huge_pages`).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from pathlib import Path

import numpy as np
import torch
from torch import nn

from ..errors import HiSpecError
from ..layers.huge_pages import huge_page_buffer, padded
from ..layers.quant import SERVED, BlockEmbedding, BlockLinear, block_shape, fuse_runs, pack, type_name
from .gguf_file import read_header
from .registry import FAMILIES, check_supported

logger = logging.getLogger(__name__)

WEIGHTS = "blocks.safetensors"
LAYOUT = "x8"  # the prepared blocks' layout, part of the cache directories' names: another layout is prepared again
TOKENIZER_COPY = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                   "tokenizer.model", "vocab.json", "merges.txt", "added_tokens.json")  # every file a tokenizer saves
FLOAT_TYPES = frozenset({0, 1, 30})  # ggml's F32, F16, BF16: de-quantized to float32


def _skeleton(config) -> nn.Module:
    """The transformers model of ``config`` with its parameters on the meta device (buffers real)."""
    from accelerate import init_empty_weights
    from transformers import AutoModelForCausalLM

    with init_empty_weights(include_buffers=False):
        return AutoModelForCausalLM.from_config(config)


def _processor(architecture: str, config) -> object:
    from transformers.modeling_gguf_pytorch_utils import TENSOR_PROCESSORS, TensorProcessor

    return TENSOR_PROCESSORS.get(architecture, TensorProcessor)(config=config.to_dict())


def _row_order(processor, name: str, rows: int) -> np.ndarray | None:
    """The row permutation transformers' processing applies to tensor ``name`` (None: none); a
    processing that changes values rather than moving rows cannot keep the blocks."""
    index = np.arange(rows, dtype=np.float64)[:, None]
    out = np.asarray(processor.process(weights=index, name=name, tensor_key_mapping={}, parsed_parameters={}).weights)
    order = out.reshape(-1).astype(np.int64)
    if out.shape != index.shape or not np.array_equal(np.sort(order), np.arange(rows)):
        raise HiSpecError(f"tensor {name!r}: its conversion changes values, not only the order of rows; "
                          f"load this file with dtype='bfloat16' to de-quantize it")
    return None if np.array_equal(order, np.arange(rows)) else order


def prepare_native(gguf: Path, target: Path, converted: Path | None = None) -> None:
    """Write the native form of the GGUF file ``gguf`` into the directory ``target`` (see the module).
    ``converted``: a finished float conversion of the same file, whose config and tokenizer files are
    copied instead of being read from the GGUF again (a large vocabulary takes a minute)."""
    from gguf import GGUFReader
    from gguf.quants import dequantize
    from safetensors.torch import save_file
    from transformers import AutoConfig, AutoTokenizer, GenerationConfig
    from transformers.modeling_gguf_pytorch_utils import get_gguf_hf_weights_map

    header = read_header(gguf)
    for info in header.tensors:
        if len(info.shape) == 2 and info.type_id not in SERVED.values() and info.type_id not in FLOAT_TYPES:
            raise HiSpecError(f"the GGUF file {gguf} holds tensor {info.name!r} as {info.type_name}, which the "
                              f"kernels do not serve ({', '.join(SERVED)}); load it with dtype='bfloat16' to "
                              f"de-quantize it")
    try:
        config = AutoConfig.from_pretrained(gguf.parent, gguf_file=gguf.name)
        tokenizer = None if converted is not None else AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    except (OSError, ValueError, KeyError, EOFError) as exc:
        raise HiSpecError(f"cannot read the GGUF file {gguf}: {type(exc).__name__}: {exc}") from exc
    check_supported(config.model_type)
    architecture = str(header.metadata.get("general.architecture", config.model_type))
    processor = _processor(architecture, config)
    names = get_gguf_hf_weights_map(_skeleton(config), processor)
    tensors: dict[str, torch.Tensor] = {}
    types: dict[str, int] = {}
    reader = GGUFReader(gguf)
    for t in reader.tensors:
        hf = names.get(t.name)
        if hf is None:
            logger.info("native %s: tensor %s has no transformers parameter; skipped", gguf.name, t.name)
            continue
        kind = int(t.tensor_type)
        if kind in SERVED.values() and len(t.shape) == 2:
            blocks = np.asarray(t.data).reshape(int(t.shape[1]), -1)  # rows of the file's blocks
            order = _row_order(processor, t.name, blocks.shape[0])
            rows = torch.from_numpy(np.array(blocks if order is None else blocks[order]))  # a writable copy
            tensors[hf], types[hf] = pack(rows, kind)
        else:
            values = processor.process(weights=dequantize(t.data, t.tensor_type), name=t.name, tensor_key_mapping=names,
                                       parsed_parameters={}).weights
            tensors[hf] = torch.from_numpy(np.array(values, dtype=np.float32))
    save_file(tensors, str(target / WEIGHTS), metadata={"ggml_types": json.dumps(types)})
    config.save_pretrained(target)
    GenerationConfig.from_model_config(config).save_pretrained(target)
    if tokenizer is not None:
        tokenizer.save_pretrained(target)
    else:
        copy_tokenizer(converted, target)


def copy_tokenizer(source: Path, target: Path) -> None:
    """The tokenizer files of a prepared or converted model directory, copied into ``target``."""
    for name in TOKENIZER_COPY:
        if (source / name).is_file():
            shutil.copyfile(source / name, target / name)


def _parent(model: nn.Module, name: str) -> tuple[nn.Module, str]:
    *path, leaf = name.split(".")
    module = model
    for part in path:
        module = getattr(module, part)
    return module, leaf


def _offsets(path: Path) -> dict[str, tuple[int, int]]:
    """Each tensor's absolute byte range in a safetensors file (its header: length, then JSON)."""
    with open(path, "rb") as f:
        size = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(size))
    return {k: (8 + size + v["data_offsets"][0], 8 + size + v["data_offsets"][1])
            for k, v in header.items() if k != "__metadata__"}


def _pread(fd: int, view: torch.Tensor, begin: int, end: int, what: str) -> None:
    """Fill the uint8 tensor ``view`` with the file's bytes ``begin:end`` (a read may return less than asked)."""
    buffer = memoryview(view.numpy()).cast("B")
    if end - begin != len(buffer):
        raise HiSpecError(f"{what} holds {end - begin} bytes, not {len(buffer)}")
    done = 0
    while done < len(buffer):
        n = os.preadv(fd, [buffer[done:]], begin + done)
        if n <= 0:
            raise HiSpecError(f"{what} ends early (the file is cut)")
        done += n


def _read_blocks(model: nn.Module, path: Path, groups: tuple[tuple[str, ...], ...], tied: bool) -> None:
    """Read every block weight of ``model`` into one buffer on 2 MiB pages
    (:func:`~hispec_decode.layers.huge_pages.huge_page_buffer`; ordinary memory where those are off),
    the modules holding views of it. The blocks of sibling linears the decoder fuses (``groups``: its
    family's ``FUSED_LINEARS``, in runs as :func:`fuse_runs`) lie side by side, so fusing them copies
    nothing. Read with ``pread``, not through the file's mapping, whose pages for them are never
    touched: the weights are resident once. An embedding table stays in the mapping, where only the
    rows decoding looks up become resident, unless it is ``tied`` to the LM head, which reads all of it."""
    offsets = _offsets(path)
    names = {m: n for n, m in model.named_modules()}
    runs: list[list[BlockLinear]] = []
    placed: set[int] = set()
    for parent in names:
        for group in groups:
            members = [getattr(parent, leaf, None) for leaf in group]
            if all(isinstance(m, BlockLinear) for m in members):
                runs += fuse_runs(members)
                placed.update(id(m) for m in members)
    sources: dict[int, str] = {}  # module -> its tensor in the file (an embedding's table: the embedding's)
    for module, name in names.items():
        if isinstance(module, BlockEmbedding):
            if tied:
                sources[id(module.table)] = f"{name}.weight"
        elif isinstance(module, BlockLinear) and f"{name}.weight" in offsets:
            sources[id(module)] = f"{name}.weight"
    for module in names:
        if isinstance(module, BlockLinear) and id(module) in sources and id(module) not in placed:
            runs.append([module])
    sizes = [sum(m.blocks.numel() for m in run) for run in runs]
    total = sum(padded(n) for n in sizes)
    buffer = huge_page_buffer(total)
    if buffer is None:
        buffer = torch.empty(total, dtype=torch.uint8)
    fd = os.open(path, os.O_RDONLY)
    try:
        offset = 0
        for run, size in zip(runs, sizes):
            width = run[0].blocks.shape[1]
            fused = buffer[offset: offset + size].view(size // width, width)
            row = 0
            for m in run:
                view = fused[row: row + m.out_features]
                _pread(fd, view, *offsets[sources[id(m)]], f"{path}: {sources[id(m)]}")
                m.blocks, row = view, row + m.out_features
            offset += padded(size)
    finally:
        os.close(fd)


def load_native(directory: Path, dtype: torch.dtype = torch.bfloat16) -> nn.Module:
    """The model prepared in ``directory`` (:func:`prepare_native`), activations in ``dtype``."""
    from safetensors import safe_open
    from transformers import AutoConfig, GenerationConfig

    config = AutoConfig.from_pretrained(directory)
    check_supported(config.model_type)
    with safe_open(str(directory / WEIGHTS), "pt") as f:
        types = {k: int(v) for k, v in json.loads((f.metadata() or {}).get("ggml_types", "{}")).items()}
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    model = _skeleton(config)
    embedding = model.get_input_embeddings()
    embed_name = next(n for n, m in model.named_modules() if m is embedding)
    for name, kind in types.items():
        module_name = name.removesuffix(".weight")
        parent, leaf = _parent(model, module_name)
        old = getattr(parent, leaf)
        blocks = tensors.pop(name)  # interleaved by prepare_native where its rows allow
        values, nbytes = block_shape(kind)
        width = blocks.shape[1] // nbytes * values
        if module_name == embed_name:
            scale = getattr(old, "embed_scale", None)
            new = BlockEmbedding(blocks, kind, width, None if scale is None else float(scale), dtype)
        elif isinstance(old, nn.Linear):
            bias = tensors.pop(f"{module_name}.bias", None)
            new = BlockLinear(blocks, kind, width, bias, dtype)
        else:
            raise HiSpecError(f"{directory}: {name} ({type_name(kind)}) is neither a linear nor the embedding")
        setattr(parent, leaf, new)
    tied = getattr(config, "tie_word_embeddings", False) and "lm_head.weight" not in types
    _read_blocks(model, directory / WEIGHTS, FAMILIES[config.model_type].FUSED_LINEARS, tied)
    if tied:
        table = model.get_input_embeddings()
        if isinstance(table, BlockEmbedding):
            model.lm_head = BlockLinear(table.table.blocks, table.table.ggml_type, table.embedding_dim, None, dtype)
    missing = model.load_state_dict(tensors, strict=False, assign=True).missing_keys
    still_meta = [n for n, p in model.named_parameters() if p.device.type == "meta"]
    if still_meta:
        raise HiSpecError(f"the prepared model in {directory} lacks {', '.join(still_meta[:5])} (delete the "
                          f"directory and it is prepared again); missing: {', '.join(missing[:5])}")
    model.to(dtype)
    model.hispec_precision = "native"  # DecoderModel.precision: what records and tuned policies are kept per
    try:
        model.generation_config = GenerationConfig.from_pretrained(directory)
    except OSError:
        pass
    return model.eval().requires_grad_(False)
