"""Command-line options built from the config dataclasses, so every tool speaks the same names.

``add_config_args(parser, SpeculativeConfig, ["window", ...])`` adds ``--window`` with the field's
help text and type; ``config_overrides(args, names)`` returns the values the user gave (options
left out stay ``None`` and do not override anything).
"""

from __future__ import annotations

import argparse
import dataclasses
import typing
from typing import Any

from ..config import METHODS, SCHEDULES, SpeculativeConfig, for_method
from ..knobs import KNOB, TUNABLE

POLICY_ARGS = (*TUNABLE, "batch_aware")  # the SpeculativeConfig fields benchmarks take: every policy knob
SAMPLING_ARGS = ("do_sample", "temperature", "top_k", "top_p", "seed")  # the SamplingParams fields benchmarks take
ALIASES = {"do_sample": ["--sample"]}  # the name this CLI had before options came from the config


def add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--base", default=None, help="Hub id, local directory or .gguf file (default: embedded SmolLM2-135M-Instruct)")
    p.add_argument("--heads", default=None, help="adapter directory or Hub repo id with trained exit heads")
    p.add_argument("--dtype", default="auto", help="auto (native for a GGUF base, else float32), native (a GGUF base "
                   "on its own blocks), float32, bfloat16 or float16")
    p.add_argument("--batch-invariant", action=argparse.BooleanOptionalAction, default=None,
                   help="each row's numbers independent of the rest of its pass: in bf16/fp16 speculation then equals "
                        "this engine's autoregressive output token for token (default: on for bf16 where the compiled "
                        "AMX kernels make it free; docs/batch-invariance.md)")


OTHER_HEADS = "@b"  # a method spec ending in it runs with the benchmark's second adapter (--heads-b)


def other_heads(spec: str) -> tuple[str, bool]:
    """``method[:variant][@b]`` -> the spec without the suffix, and whether it runs on ``--heads-b``."""
    return (spec[: -len(OTHER_HEADS)], True) if spec.endswith(OTHER_HEADS) else (spec, False)


class ModelVariants:
    """The model a benchmark method spec runs on, loaded once each: ``METHOD:invariant`` on a
    batch-invariant copy, every other spec on the one ``--batch-invariant`` asks for (``None``: the
    default, see ``HiSpecModel.from_pretrained``); ``METHOD@b`` with the second adapter."""

    def __init__(self, load: typing.Callable[[bool | None, bool], Any], batch_invariant: bool | None = None) -> None:
        self.load, self.always, self.models = load, batch_invariant, {}

    def __call__(self, spec: str) -> Any:
        spec, other = other_heads(spec)
        invariant = True if spec.partition(":")[2] == "invariant" else self.always
        if (invariant, other) not in self.models:
            self.models[invariant, other] = self.load(invariant, other)
        return self.models[invariant, other]


def autoregressive_of(spec: str) -> str:
    """The autoregressive spec a method's output is compared with (the same numerics and sampling)."""
    variant = other_heads(spec)[0].partition(":")[2]
    return f"autoregressive:{variant}" if variant in ("invariant", "gumbel") else "autoregressive"


def _int_list(text: str) -> tuple[int, ...]:
    return tuple(int(t) for t in text.split(","))


def _parser_type(tp: Any) -> Any:
    args = [a for a in typing.get_args(tp) if a is not type(None)] or [tp]
    if any(typing.get_origin(a) is tuple for a in args):
        return _int_list
    return args[0]


def add_config_args(p: argparse.ArgumentParser, cls: type, names: typing.Iterable[str]) -> None:
    """``--name`` options for these fields of the dataclass ``cls`` (default: not given)."""
    fields = {f.name: f for f in dataclasses.fields(cls)}
    hints = typing.get_type_hints(cls)
    for name in names:
        f = fields[name]
        flags = [f"--{name.replace('_', '-')}", *ALIASES.get(name, [])]
        default = p.get_default(name) if p.get_default(name) is not None else f.default
        help_text = f"{f.metadata.get('help', '')} (default: {default})"
        if hints[name] is bool:
            p.add_argument(*flags, dest=name, action=argparse.BooleanOptionalAction, default=p.get_default(name),
                           help=help_text)
        else:
            p.add_argument(*flags, dest=name, type=_parser_type(hints[name]), default=p.get_default(name),
                           choices=f.metadata.get("choices"), help=help_text)


def config_overrides(args: argparse.Namespace, names: typing.Iterable[str]) -> dict[str, Any]:
    """The options among ``names`` that were given on the command line."""
    return {n: getattr(args, n) for n in names if getattr(args, n, None) is not None}


FIXED = {"draft_threshold": 0.0, "verify_threshold": 0.0, "batch_aware": False, "guard": False}
VARIANTS = {
    "paper": FIXED | {"window": 4, "num_draft": 2},  # the paper's fixed policy: N_i = 4, k_d = 2
    "fixed": FIXED | {"window": 2, "num_draft": 1},  # the best fixed policy of the sweep (docs/sweep-bfloat16.md)
    "full_vocab": {"use_exit_vocab": False},
    "invariant": {},  # on the batch-invariant model (see ModelVariants)
    "gumbel": {"drafter_invariant": True},  # drafter-invariant sampling (with --sample)
    "chain": {"tree": "chain"},  # the tuned policy, drafting a single chain
    "unguarded": {"guard": False},  # the policy as it is, every round (no per-sequence choice)
    "lookup": {"lookup": 8},  # prompt lookup (8 tokens a round) before the policy's own drafts
    "union": {"lookup": 8, "drafting": "union"},  # prompt lookup and the policy's own drafts as one tree (batch 1)
    "static": {"tree": "static", "tree_nodes": 5, "tree_width": 4, "num_draft": 2},  # a Medusa/EAGLE-1-style static tree
    "dynamic": {"tree": "dynamic", "tree_nodes": 6, "tree_width": 3, "num_draft": 2},  # EAGLE-2's dynamic tree
}


def variant_for(model: Any, spec: str, config: SpeculativeConfig) -> dict[str, Any]:
    """:func:`method_variant` for ``model``: a fixed policy (``paper``, ``fixed``) runs on the adapter's
    own draft and intermediate exits, not on the layers its tuned policy may have moved to, unless
    the command line named the layers."""
    spec = other_heads(spec)[0]
    overrides = method_variant(spec)
    variant = spec.partition(":")[2]
    if variant in ("paper", "fixed") and model.adapter is not None:
        roles = model.adapter.config
        for key, role in (("draft_layer", "draft"), ("verify_layer", "intermediate")):
            if getattr(config, key) is None and roles.layer_for(role) is not None:
                overrides[key] = roles.layer_for(role)
    return overrides


def method_settings(model: Any, spec: str, config: SpeculativeConfig) -> tuple[SpeculativeConfig, dict[str, Any]]:
    """What one benchmarked ``spec`` runs with: ``config`` (the command line's knobs) for the spec's method,
    the knobs that method does not read unset, and the variant's other overrides (:func:`variant_for`)."""
    overrides = variant_for(model, spec, config)
    method = overrides.pop("method")
    return for_method(config, method), {k: v for k, v in overrides.items() if k not in KNOB or method in KNOB[k].methods}


def method_variant(spec: str) -> dict[str, Any]:
    """``method[:variant]`` (a benchmark's method spec) -> generation overrides: ``eager``/``gather``
    set the batched verification schedule, ``full_vocab`` makes early exits ignore the heads'
    reduced vocabularies, ``paper`` is the paper's fixed policy (N_i = 4, k_d = 2, no confidence
    gates), ``fixed`` the best fixed policy of the sweep (k = 1, N_i = 2, no gates), ``invariant``
    runs on the batch-invariant model, ``gumbel`` samples drafter-invariantly, ``chain`` drafts a
    single chain under the tuned policy, ``static`` draws a fixed tree of 5 nodes (width 4, depth 2),
    ``dynamic`` EAGLE-2's tree of 6 nodes (width 3, depth 2), on the tuned policy's exits and gates;
    ``unguarded`` runs the policy every round, without the per-sequence choice (engine/chooser.py), ``lookup`` tries prompt
    lookup (8 tokens) before the policy's own drafts, ``union`` drafts both as one tree at batch 1."""
    method, _, variant = other_heads(spec)[0].partition(":")
    if method not in METHODS:
        raise ValueError(f"unknown method {method!r} in {spec!r}; choose from {', '.join(METHODS)}")
    if variant in SCHEDULES:
        return {"method": method, "schedule": variant}
    if variant in VARIANTS:
        return {"method": method} | VARIANTS[variant]
    if variant:
        raise ValueError(f"unknown method variant {variant!r} in {spec!r} ({', '.join([*SCHEDULES, *VARIANTS])})")
    return {"method": method}
