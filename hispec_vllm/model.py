"""The HiSpec draft exit as a vLLM EAGLE drafter (imports vLLM: load it only inside vLLM's processes).

vLLM's EAGLE proposer calls ``forward(input_ids, positions, hidden_states)`` with, at the first
draft step, the tokens the target just processed shifted left by one and the target's final
(normed) hidden states at the same positions; at later steps with the last drafted token and the
drafter's own second return value. For a position p holding token x_{p+1} the drafter computes

    h = layers[0:L_d](x_{p+1})            copies of the base's first L_d layers, own K/V pages
    u = h + W h + U c_p                   the trained head (deep_context; W, U absent for others)
    n = norm_head(u)                      the head's copy of the final norm

or, for a ``feature_attention`` head (EAGLE's drafter on an early exit), ``u = h + F [h ; c_p]``,
``n = norm_head(block(u))`` with the head's decoder layer ``block`` (K/V pages of its own too).

and returns ``(n, n)``: ``n`` gives the logits over the exit vocabulary (rows of the target's LM
head, which vLLM shares with the drafter), and ``n`` is the head's estimate of the final normed
state at p+1, which is what the next draft step reads as its context: as in HiSpec's engine.

The layers' weights come from the target's own checkpoint (``secondary_weights``), the head's
from the draft directory (:mod:`hispec_vllm.draft`); the target is checked against the adapter's
base fingerprint while they load. vLLM never feeds the drafter the sequence's first token (its
K/V pages start at x_1): at the shipped L_d = 2 this moved held-out agreement from 43.6% to 43.2%.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn
from vllm.config import VllmConfig
from vllm.distributed import get_tensor_model_parallel_world_size
from vllm.model_executor.layers.layernorm import RMSNorm
from vllm.model_executor.layers.logits_processor import LogitsProcessor
from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding
from vllm.model_executor.model_loader.default_loader import DefaultModelLoader
from vllm.model_executor.models.llama import LlamaDecoderLayer, LlamaForCausalLM, LlamaModel
from vllm.model_executor.models.utils import AutoWeightsLoader, maybe_prefix

from hispec_decode.adapter.fingerprint import fingerprints_match, sample_values
from hispec_decode.errors import FingerprintMismatchError

from .draft import DRAFT_CONFIG_KEY, HEAD_PREFIX

BASE_PREFIX = "hispec_base."  # the target checkpoint's weights, as the drafter's secondary source
_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")


def _decoder_layer(model_type: str, config, vllm_config: VllmConfig, prefix: str) -> nn.Module:
    """vLLM's own decoder layer of the base's architecture (``config``: the draft config, which vLLM's
    EAGLE wrapper renames to model_type "eagle", hence ``model_type`` apart)."""
    if model_type == "llama":
        return LlamaDecoderLayer(vllm_config=vllm_config, prefix=prefix, config=config)
    if model_type == "qwen2":
        from vllm.model_executor.models.qwen2 import Qwen2DecoderLayer as layer
    elif model_type == "qwen3":
        from vllm.model_executor.models.qwen3 import Qwen3DecoderLayer as layer
    else:
        raise ValueError(f"hispec_vllm: no drafter for bases of type {model_type!r}")
    return layer(config=config, cache_config=vllm_config.cache_config, quant_config=vllm_config.quant_config,
                 prefix=prefix)


def _weights_mapper(model_type: str):
    if model_type == "qwen2":
        from vllm.model_executor.models.qwen2 import Qwen2Model as model
    elif model_type == "qwen3":
        from vllm.model_executor.models.qwen3 import Qwen3Model as model
    else:
        model = LlamaModel
    return model.hf_to_vllm_mapper


class DraftLayers(nn.Module):
    """The drafter's decoder layers: the base's first L_d, then a feature_attention head's own layer;
    their attention is named after the target's last layer (``model.layers.{N + i}``) so vLLM gives
    them K/V pages of their own. ``forward`` runs the base's ``num_base`` layers."""

    def __init__(self, *, vllm_config: VllmConfig, config, model_type: str, prefix: str, start_layer_id: int,
                 num_base: int) -> None:
        super().__init__()
        self.config = config
        self.num_base = num_base
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size,
                                                   prefix=maybe_prefix(prefix, "embed_tokens"))  # the target's, shared
        self.layers = nn.ModuleList([_decoder_layer(model_type, config, vllm_config, maybe_prefix(prefix, f"layers.{i + start_layer_id}"))
                                     for i in range(config.num_hidden_layers)])

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        x, residual = self.embed_tokens(input_ids), None  # [n, H]
        for layer in self.layers[: self.num_base]:
            x, residual = layer(positions, x, residual)
        return x if residual is None else x + residual  # the residual stream after layer L_d - 1


class EagleHiSpecForCausalLM(LlamaForCausalLM):
    """A HiSpec draft exit (``norm``, ``residual_linear``, ``deep_context`` or ``feature_attention`` head)
    for vLLM's ``method="eagle"``; built from a draft directory that :func:`hispec_vllm.speculative_config`
    writes."""

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "") -> None:
        nn.Module.__init__(self)
        spec = vllm_config.speculative_config
        self.config = spec.draft_model_config.hf_config
        self.info = dict(getattr(self.config, DRAFT_CONFIG_KEY))
        target = spec.target_model_config
        self.target_config = target.hf_config
        self.model_type = self.info["base_fingerprint"]["model_type"]
        self.target_layers = target.get_total_num_hidden_layers()
        if self.target_layers != self.info["target_num_hidden_layers"]:
            raise FingerprintMismatchError(f"these HiSpec heads were trained for a base of {self.info['target_num_hidden_layers']} "
                                           f"layers ({self.info['base_model']}); the target has {self.target_layers}")
        self.num_base = int(self.info["draft_layer"])  # the base's layers 0..L_d-1; a feature head's layer after them
        self.model = DraftLayers(vllm_config=vllm_config, config=self.config, model_type=self.model_type,
                                 prefix=maybe_prefix(prefix, "model"), start_layer_id=self.target_layers,
                                 num_base=self.num_base)
        hidden = self.config.hidden_size
        head_type = self.info["head_type"]
        self.proj = nn.Linear(hidden, hidden, bias=False) if head_type in ("residual_linear", "deep_context") else None
        self.ctx = nn.Linear(hidden, hidden, bias=False) if head_type == "deep_context" else None
        self.fuse = nn.Linear(2 * hidden, hidden, bias=False) if head_type == "feature_attention" else None
        if (self.fuse is not None) != (self.config.num_hidden_layers == self.num_base + 1):
            raise ValueError(f"hispec_vllm: a {head_type} drafter at L_d = {self.num_base} has "
                             f"{self.config.num_hidden_layers} layers; rebuild its draft directory")
        self.head_norm = RMSNorm(hidden, eps=self.config.rms_norm_eps)
        size = int(self.info["exit_vocab_size"] or 0)
        self.exit_ids = nn.Parameter(torch.zeros(size, dtype=torch.long), requires_grad=False) if size else None
        self._exit_rows: tuple[int, torch.Tensor] | None = None
        self.logits_processor = LogitsProcessor(self.config.vocab_size)
        self.secondary_weights = [DefaultModelLoader.Source(target.model, target.revision, prefix=BASE_PREFIX)]

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_input_ids(input_ids)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, hidden_states: torch.Tensor,
                inputs_embeds: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        if inputs_embeds is not None:
            raise NotImplementedError("HiSpec drafting takes token ids, not embeddings")
        h = self.model(input_ids, positions)  # [n, H]
        context = hidden_states.to(h.dtype)  # the target's normed final state at p, or our own estimate
        u = h if self.proj is None else h + self.proj(h)
        if self.ctx is not None:
            u = u + self.ctx(context)
        if self.fuse is not None:
            x, residual = self.model.layers[self.num_base](positions, h + self.fuse(torch.cat([h, context], -1)), None)
            u = x + residual
        n = self.head_norm(u)
        return n, n

    def _rows(self) -> torch.Tensor:
        """The exit vocabulary's rows of the shared LM head, cut once (again if the weight moves)."""
        weight = self.lm_head.weight
        if self._exit_rows is None or self._exit_rows[0] != weight.data_ptr():
            self._exit_rows = (weight.data_ptr(), weight[self.exit_ids].contiguous())
        return self._exit_rows[1]

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """Target-vocabulary logits (vLLM indexes drafts by target id): the exit vocabulary's, -inf elsewhere."""
        if self.exit_ids is None:
            return self.logits_processor(self.lm_head, hidden_states)
        if get_tensor_model_parallel_world_size() > 1:  # the LM head is split by vocabulary: all logits, then mask
            logits = self.logits_processor(self.lm_head, hidden_states)
            keep = torch.zeros(logits.shape[-1], dtype=torch.bool, device=logits.device)
            keep[self.exit_ids] = True
            return logits.masked_fill(~keep, float("-inf"))
        small = F.linear(hidden_states, self._rows())  # [n, |V_exit|]
        logits = small.new_full((hidden_states.shape[0], self.config.vocab_size), float("-inf"))
        logits[:, self.exit_ids] = small
        return logits

    def get_top_tokens(self, hidden_states: torch.Tensor) -> torch.Tensor:
        if self.exit_ids is None or get_tensor_model_parallel_world_size() > 1:
            return self.compute_logits(hidden_states).argmax(-1)
        return self.exit_ids[F.linear(hidden_states, self._rows()).argmax(-1)]

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        layers, head, signature = [], {}, {}
        probes = _probe_names(self.target_layers, bool(getattr(self.config, "tie_word_embeddings", False)))
        for name, tensor in weights:
            if name.startswith(HEAD_PREFIX):
                head[name[len(HEAD_PREFIX):]] = tensor
                continue
            if not name.startswith(BASE_PREFIX):
                raise ValueError(f"hispec_vllm: unexpected weight {name!r} in the draft directory")
            name = name[len(BASE_PREFIX):]
            if name in probes:
                signature[name] = sample_values(tensor)
            m = _LAYER.match(name)
            if m and int(m.group(1)) < self.num_base:
                layers.append((f"layers.{m.group(1)}.{m.group(2)}", tensor))
        if self.fuse is not None:  # the head's own layer: its trained copy, after the base's layers
            block = {k: head.pop(k) for k in list(head) if k.startswith("block.")}
            if not block:
                raise ValueError("hispec_vllm: the draft directory lacks the feature_attention head's layer (block.*)")
            layers += [(f"layers.{self.num_base}.{k[len('block.'):]}", v) for k, v in block.items()]
        self._check_fingerprint(probes, signature)
        AutoWeightsLoader(self.model).load_weights(
            layers, mapper=_weights_mapper(self.model_type))
        self._load_head(head)
        return None  # no strict all-weights check: the embedding and LM head are the target's

    def _check_fingerprint(self, probes: list[str], signature: dict[str, list[float]]) -> None:
        expected = self.info["base_fingerprint"]
        target = self.target_config
        actual = {"model_type": target.model_type, "num_hidden_layers": self.target_layers,
                  "hidden_size": target.hidden_size, "vocab_size": target.vocab_size}
        if all(p in signature for p in probes):
            actual["signature"] = [x for p in probes for x in signature[p]]
        else:  # a checkpoint named otherwise: the shapes are all we can compare
            expected = {k: expected.get(k) for k in actual} | {"signature": []}
            actual["signature"] = []
        if not fingerprints_match(expected, actual):
            raise FingerprintMismatchError(f"these HiSpec heads were trained for {self.info['base_model']}; the target "
                                           f"model vLLM serves is another base (its shape or weights differ)")

    def _load_head(self, head: dict[str, torch.Tensor]) -> None:
        wanted = {"norm.weight": self.head_norm.weight}
        if self.proj is not None:
            wanted["proj.weight"] = self.proj.weight
        if self.ctx is not None:
            wanted["ctx.weight"] = self.ctx.weight
        if self.fuse is not None:
            wanted["fuse.weight"] = self.fuse.weight
        missing = [k for k in wanted if k not in head] + (["vocab"] if self.exit_ids is not None and "vocab" not in head else [])
        if missing:
            raise ValueError(f"hispec_vllm: the draft directory lacks the head's {', '.join(missing)}")
        with torch.no_grad():
            for key, param in wanted.items():
                if tuple(head[key].shape) != tuple(param.shape):
                    raise ValueError(f"hispec_vllm: head tensor {key} has shape {tuple(head[key].shape)}, "
                                     f"expected {tuple(param.shape)}")
                param.copy_(head[key].to(param.dtype))
            if self.exit_ids is not None:
                self.exit_ids.copy_(head["vocab"].to(torch.long))


def _probe_names(num_layers: int, tied: bool) -> list[str]:
    """The HF checkpoint tensors a HiSpec fingerprint samples (hispec_decode.adapter.fingerprint):
    the embedding, the first matrix (q_proj) of the first, middle and last layers, the LM head."""
    layers = [f"model.layers.{i}.self_attn.q_proj.weight" for i in (0, num_layers // 2, num_layers - 1)]
    return ["model.embed_tokens.weight", *layers, "model.embed_tokens.weight" if tied else "lm_head.weight"]

