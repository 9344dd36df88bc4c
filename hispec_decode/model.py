"""``HiSpecModel``: a base model plus optional exit heads, decoded by one of three strategies."""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import torch

from .adapter import HiSpecAdapter
from .architectures import DecoderAdapter, adapter_for
from .engine import Engine
from .errors import AdapterError, HiSpecError
from .fingerprint import compute_fingerprint
from .loading import LoadedBase, load_base
from .block_manager import DEFAULT_BLOCK_SIZE
from .sampling import SamplingParams, TokenSampler
from .serving import DEFAULT_VERIFY, VERIFY_POLICIES, ServingEngine
from .strategies import STRATEGIES, Counters, Policy, Run

logger = logging.getLogger(__name__)

# Policy defaults (see docs/defaults.md for the measurements behind them). Layers scale with
# depth: the draft exit at ~1/8, the intermediate exit at ~1/4 of the layers.
DEFAULT_DRAFT_FRACTION = 1 / 8
DEFAULT_VERIFY_FRACTION = 1 / 4
NO_HEADS = "none"
DEFAULT_HEADS_DIR = Path(__file__).parent / "default_heads" / "smollm2-135m"  # trained by recipes/smollm2-135m.yaml
# Best configurations of `hispec-bench --sweep` with the default heads (docs/sweep-bfloat16.md):
# with ~31% agreement per token, short drafts and windows waste least.
DEFAULT_WINDOW = 2  # N_i
DEFAULT_NUM_DRAFT = {"self_spec": 1, "hispec": 1}  # k and k_d


@dataclass
class GenerateOutput:
    sequences: list[list[int]]  # the new tokens of each row (EOS included if produced)
    stats: dict[str, Any]
    runs: list[Run] = field(default_factory=list, repr=False)  # each row's finished run (tokens, counters)


class HiSpecModel:
    """A frozen base model with early exits. Build with :meth:`from_pretrained`."""

    def __init__(self, loaded: LoadedBase, arch: DecoderAdapter, adapter: HiSpecAdapter | None = None) -> None:
        self.base_model = loaded.model
        self.tokenizer = loaded.tokenizer
        self.base_name = loaded.name
        self.adapter = adapter
        self.arch = arch
        heads = {}
        if adapter is not None:
            heads = {int(k): h.to(self.arch.dtype).eval().requires_grad_(False) for k, h in adapter.heads.items()}
        self.engine = Engine(self.arch, heads)

    @classmethod
    def from_pretrained(
        cls,
        base: str | os.PathLike | None = None,
        heads: str | os.PathLike | None = None,
        dtype: str | torch.dtype = "float32",
        revision: str | None = None,
        pack_weights: bool = True,
    ) -> HiSpecModel:
        """Load a base (``None``: the embedded SmolLM2-135M-Instruct) and optional heads
        (a local adapter directory or a Hub repo id; ``revision`` applies to the heads).
        With ``base=None`` and ``heads=None`` the trained default heads shipped with HiSpec are
        used; ``heads="none"`` forces the untrained exits (the base's norm + LM head).

        ``pack_weights``: on CPU, keep oneDNN-packed copies of the linear weights (about 2x
        faster decoding for a second copy of those weights in memory)."""
        if heads is None and base is None and DEFAULT_HEADS_DIR.is_dir():
            heads = DEFAULT_HEADS_DIR
        if heads is not None and str(heads).lower() == NO_HEADS:
            heads = None
        loaded = load_base(base, dtype)
        arch = adapter_for(loaded.model, pack_weights)
        adapter = HiSpecAdapter.from_pretrained(heads, revision=revision, base=arch) if heads is not None else None
        if adapter is not None:
            cfg = adapter.config
            shape = (loaded.model.config.num_hidden_layers, loaded.model.config.hidden_size, loaded.model.config.vocab_size)
            if (cfg.num_hidden_layers, cfg.hidden_size, cfg.vocab_size) != shape:
                raise AdapterError(
                    f"heads were made for {cfg.base_model!r} with (layers, hidden, vocab) = "
                    f"{(cfg.num_hidden_layers, cfg.hidden_size, cfg.vocab_size)}, but base {loaded.name!r} has {shape}"
                )
            cfg.check_base(compute_fingerprint(loaded.model), loaded.name)
        return cls(loaded, arch, adapter)

    @property
    def num_layers(self) -> int:
        return self.arch.num_layers

    def policy(self, method: str, draft_layer: int | None = None, verify_layer: int | None = None,
               window: int | None = None, num_draft: int | None = None) -> Policy:
        """Fill in defaults (the adapter's roles first) and validate the layer choice."""
        n = self.num_layers
        roles = self.adapter.config if self.adapter is not None else None
        if draft_layer is None:
            draft_layer = (roles and roles.layer_for("draft")) or max(1, round(n * DEFAULT_DRAFT_FRACTION))
        if verify_layer is None:
            verify_layer = (roles and roles.layer_for("intermediate")) or max(draft_layer + 1, round(n * DEFAULT_VERIFY_FRACTION))
        window = DEFAULT_WINDOW if window is None else window
        num_draft = DEFAULT_NUM_DRAFT.get(method, 1) if num_draft is None else num_draft
        if method == "hispec" and not 1 <= draft_layer < verify_layer < n:
            raise HiSpecError(
                f"hispec needs 1 <= draft_layer < verify_layer < {n} (the full model); got draft_layer="
                f"{draft_layer}, verify_layer={verify_layer}"
            )
        if method == "self_spec" and not 1 <= draft_layer < n:
            raise HiSpecError(f"self_spec needs 1 <= draft_layer < {n}; got {draft_layer}")
        if window < 1 or num_draft < 1:
            raise HiSpecError(f"window and num_draft must be >= 1; got window={window}, num_draft={num_draft}")
        return Policy(draft_layer, verify_layer, window, num_draft)

    def _rows(self, input_ids: torch.Tensor | Sequence[Sequence[int]]) -> list[list[int]]:
        if isinstance(input_ids, torch.Tensor):
            if input_ids.dim() == 1:
                input_ids = input_ids[None]
            if input_ids.dim() != 2 or input_ids.dtype.is_floating_point:
                raise HiSpecError(f"input_ids must be a LongTensor [batch, length]; got {tuple(input_ids.shape)} {input_ids.dtype}")
            rows = input_ids.tolist()
        else:
            rows = [list(r) for r in input_ids]
        if not rows:
            raise HiSpecError("input_ids holds no prompt")
        vocab, context = self.arch.vocab_size, self.arch.max_positions
        for i, row in enumerate(rows):
            if not row:
                raise HiSpecError(f"prompt {i} is empty; give at least one token (e.g. BOS)")
            if not all(isinstance(t, int) and 0 <= t < vocab for t in row):
                raise HiSpecError(f"prompt {i} holds token ids outside [0, {vocab})")
            if len(row) >= context:
                raise HiSpecError(f"prompt {i} has {len(row)} tokens; the context holds {context}, leaving no room to generate")
        return rows

    def _eos(self, eos_token_id: int | Sequence[int] | None) -> frozenset[int]:
        if eos_token_id is None:
            gen = getattr(self.base_model, "generation_config", None)
            eos_token_id = getattr(gen, "eos_token_id", None) or self.base_model.config.eos_token_id
        if eos_token_id is None:
            return frozenset()
        return frozenset([eos_token_id] if isinstance(eos_token_id, int) else eos_token_id)

    def serve(self, method: str = "hispec", draft_layer: int | None = None, verify_layer: int | None = None,
              window: int | None = None, num_draft: int | None = None, num_blocks: int = 1024,
              block_size: int = DEFAULT_BLOCK_SIZE, verify: str = DEFAULT_VERIFY, exit_vocab: bool = True) -> ServingEngine:
        """A continuous-batching engine (``add_request`` / ``step`` / ``stream``) over a paged KV
        cache of ``num_blocks`` blocks of ``block_size`` tokens. ``exit_vocab=False`` ignores the
        heads' reduced vocabularies (early exits predict over the full vocabulary)."""
        if method not in STRATEGIES:
            raise HiSpecError(f"unknown method {method!r}; choose one of {', '.join(STRATEGIES)}")
        if verify not in VERIFY_POLICIES:
            raise HiSpecError(f"verify policy must be one of {', '.join(VERIFY_POLICIES)}; got {verify!r}")
        policy = self.policy(method, draft_layer, verify_layer, window, num_draft)
        engine = self.engine if exit_vocab else Engine(self.arch, self.engine.heads, exit_vocab=False)
        cache = engine.new_cache(num_blocks, block_size)
        return ServingEngine(engine, STRATEGIES[method], policy, cache, verify)

    def add_request(self, server: ServingEngine, prompt: Sequence[int], max_new_tokens: int = 64,
                    sampling: SamplingParams | None = None, seed: int | None = None,
                    eos_token_id: int | Sequence[int] | None = None) -> int:
        """Validate a prompt and queue it on ``server``; returns its request id."""
        _check_max_new_tokens(max_new_tokens)
        (row,) = self._rows([prompt])
        limit = min(len(row) + max_new_tokens, self.arch.max_positions)
        sampler = TokenSampler(sampling or SamplingParams(), seed)
        return server.add_request(row, sampler, limit, self._eos(eos_token_id))

    def generate(
        self,
        input_ids: torch.Tensor | Sequence[Sequence[int]],
        max_new_tokens: int = 64,
        method: str = "hispec",
        do_sample: bool = False,
        temperature: float = 1.0,
        top_k: int = 0,
        top_p: float = 1.0,
        seed: int | None = None,
        draft_layer: int | None = None,
        verify_layer: int | None = None,
        window: int | None = None,
        num_draft: int | None = None,
        eos_token_id: int | Sequence[int] | None = None,
        num_blocks: int | None = None,
        block_size: int = DEFAULT_BLOCK_SIZE,
        verify: str = DEFAULT_VERIFY,
        exit_vocab: bool = True,
    ) -> GenerateOutput:
        """Decode all rows as one continuous batch (prompts may differ in length; each row
        accepts its own number of tokens). Greedy output equals the base model's, sampled output
        is distributed as it. ``num_blocks`` (default: enough for every row) sizes the paged
        KV cache; a smaller cache preempts and recomputes rows, never changing a token.
        Row ``i`` samples with seed ``seed + i``."""
        _check_max_new_tokens(max_new_tokens)
        rows = self._rows(input_ids)
        if num_blocks is None:
            num_blocks = sum(-(-min(len(r) + max_new_tokens, self.arch.max_positions) // block_size) for r in rows)
        server = self.serve(method, draft_layer, verify_layer, window, num_draft, num_blocks, block_size, verify, exit_vocab)
        params = SamplingParams(do_sample, temperature, top_k, top_p)
        t0 = time.perf_counter()
        ids = [self.add_request(server, r, max_new_tokens, params, None if seed is None else seed + i, eos_token_id)
               for i, r in enumerate(rows)]
        while server.has_unfinished():
            server.step()
        seconds = time.perf_counter() - t0
        runs = [server.done[i] for i in ids]
        counters = Counters()
        for run in runs:
            counters.add(run.counters)
        sequences = [run.tokens[run.prompt_length :] for run in runs]
        stats = _stats(method, server.policy, counters, sequences, seconds)
        stats.update(steps=server.steps, preemptions=server.preemptions,
                     peak_cache_bytes=server.peak_slots * server.cache.bytes_per_token(),
                     needed_cache_bytes=server.peak_tokens * server.cache.bytes_per_token())
        return GenerateOutput(sequences, stats, runs)


def _check_max_new_tokens(max_new_tokens: object) -> None:
    if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise HiSpecError(f"max_new_tokens must be an integer >= 1; got {max_new_tokens!r}")


def _ratio(num: int, den: int) -> float | None:
    return num / den if den else None


def _stats(method: str, policy: Policy, c: Counters, sequences: list[list[int]], seconds: float) -> dict[str, Any]:
    new = sum(len(s) for s in sequences)
    return {
        "method": method,
        "new_tokens": new,
        "acceptance_intermediate": _ratio(c.accepted_intermediate, c.drafted),
        "acceptance_final": _ratio(c.accepted_final, c.tentative),
        "calls_draft": c.calls_draft,
        "calls_intermediate": c.calls_intermediate,
        "calls_full": c.calls_full,
        "tokens_per_full_call": _ratio(new, c.calls_full),
        "seconds": seconds,
        "tokens_per_second": new / seconds if seconds > 0 else 0.0,
        "draft_layer": policy.draft_layer if method != "autoregressive" else None,
        "verify_layer": policy.verify_layer if method == "hispec" else None,
        "window": policy.window if method == "hispec" else None,
        "num_draft": policy.num_draft if method != "autoregressive" else None,
    }
