"""The knobs of a decoding policy, each declared once.

A :class:`Knob` is one setting of a :class:`~hispec_decode.decoding.policy.Policy`: its type, its
default, the values it may take, its help text, the methods it applies to, and the values the tuner
tries for it. Everything else is built from this table:

* the fields of ``Policy`` and of :class:`~hispec_decode.config.SpeculativeConfig` (optional there:
  ``None`` leaves the knob to the adapter's tuned policy, then to its default);
* validation (:meth:`Knob.check`), of explicit arguments and of an adapter's stored policy alike;
* the command-line options of every tool (``--num-draft`` ...; :mod:`hispec_decode.tools.args`);
* the tuner's local search around the best replayed policy (:data:`Knob.search`,
  :func:`hispec_decode.tuning.derive.refine`) and the policy it stores;
* the per-run statistics (``generate(...).stats``);
* a candidate policy's label in the tuner's reports (:meth:`Knob.shown`, ``Candidate.label``).

Adding a knob is one entry here plus the code that reads it.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass
from typing import Any, Callable

from .errors import HiSpecError

TREE_KINDS = ("chain", "static", "dynamic")  # what the draft exit proposes per round (docs/trees.md)
DRAFTINGS = ("first", "union")  # how drafters share a round (hispec_decode.engine.drafters)
SPECULATING = ("self_spec", "hispec")
HISPEC = ("hispec",)


@dataclass(frozen=True)
class Knob:
    """One policy setting (see the module docstring)."""

    name: str
    kind: type  # int, float or str
    default: Any  # None: chosen from the model (the exit layers)
    help: str
    minimum: float | None = None  # numbers: the least allowed value
    choices: tuple[str, ...] = ()  # strings: the allowed values
    methods: tuple[str, ...] = SPECULATING  # the methods that read it (stats report it for those only)
    search: tuple[Any, ...] = ()  # values the tuner's local search tries (empty: searched by the grid only)
    symbol: str = ""  # its name in a policy's label ("": the label names it with the levels, as layers and vocab)
    matters: Callable[[Any, int], bool] | None = None  # (policy, num_layers) -> whether it is read (None: always)

    def shown(self, method: str, policy: Any, num_layers: int) -> bool:
        """Whether a label of ``policy`` under ``method`` shows this knob: it has a symbol, the method reads it
        and the policy's levels and drafters use it."""
        return bool(self.symbol) and method in self.methods and (self.matters is None or self.matters(policy, num_layers))

    def check(self, value: Any, optional: bool = False) -> Any:
        """``value`` as this knob's type (numpy numbers become Python ones), or a HiSpecError naming it."""
        if value is None and optional:
            return None
        if self.kind is str:
            if not isinstance(value, str) or value not in self.choices:
                raise HiSpecError(f"unknown {self.name} {value!r}; choose one of {', '.join(self.choices)}")
            return value
        ok = isinstance(value, numbers.Real) and not isinstance(value, bool)
        if self.kind is int:
            ok = ok and isinstance(value, numbers.Integral)
        elif ok:
            ok = math.isfinite(value)
        if not ok or (self.minimum is not None and value < self.minimum):
            what = "an integer" if self.kind is int else "a finite number"
            bound = f" >= {self.minimum:g}" if self.minimum is not None else ""
            raise HiSpecError(f"{self.name} must be {what}{bound}{' or None' if optional else ''}; got {value!r}")
        return self.kind(value)


def _middle(policy: Any, num_layers: int) -> bool:
    return policy.verify_layer < num_layers


def _vocab_checks(policy: Any, num_layers: int) -> bool:
    return bool(policy.vocab) and policy.draft_layer < num_layers


def _tree(policy: Any, num_layers: int) -> bool:
    return policy.tree != "chain"


def _copies(policy: Any, num_layers: int) -> bool:
    return policy.lookup > 0


KNOBS: tuple[Knob, ...] = (
    Knob("draft_layer", int, None, "L_d, the draft exit (default: the adapter's draft head, else ~depth/8; the "
         "number of layers: the vocabulary level drafts)", minimum=1),
    Knob("verify_layer", int, None, "L_i, the intermediate exit (default: the adapter's intermediate head, else "
         "~depth/4; the number of layers: no intermediate exit)", minimum=1, methods=HISPEC),
    Knob("window", int, 2, "N_i: tentative tokens per full verification at most", minimum=1, methods=HISPEC,
         search=(1, 2, 3, 4, 6), symbol="N_i", matters=_middle),
    Knob("num_draft", int, 1, "drafts per check at most (k for self_spec, k_d for hispec; a tree's depth)",
         minimum=1, search=(1, 2, 3, 4), symbol="k"),
    Knob("draft_threshold", float, 0.0, "L_d drafts while its top probability is at least this (0: always; above "
         "1: never)", minimum=0, search=(0.0, 0.3, 0.5, 0.7), symbol="tau_d"),
    Knob("verify_threshold", float, 0.0, "L_i adds tentative tokens while the product of their probabilities is at "
         "least this (0: up to the window)", minimum=0, methods=HISPEC, search=(0.0, 0.3, 0.5), symbol="tau_v",
         matters=_middle),
    Knob("tree", str, "chain", "what L_d drafts per round: chain, static (a fixed tree shape) or dynamic (EAGLE-2's "
         "tree)", choices=TREE_KINDS, symbol="tree", matters=_tree),
    Knob("tree_nodes", int, 8, "draft tree nodes per round at most (trees)", minimum=1, symbol="nodes", matters=_tree),
    Knob("tree_width", int, 4, "draft tree children per node at most (trees)", minimum=1, symbol="width",
         matters=_tree),
    Knob("lookup", int, 0, "prompt lookup: tokens per round copied from where the sequence's last tokens occurred "
         "before, tried before the draft exit (0: off)", minimum=0, search=(0, 4, 8), symbol="lookup",
         matters=_copies),
    Knob("drafting", str, "first", "how drafters share a round: first (the first that proposes something, prompt "
         "lookup before the draft exit) or union (at batch 1, every drafter's proposal in one tree, verified in one "
         "pass)", choices=DRAFTINGS, search=DRAFTINGS, symbol="drafting", matters=_copies),
    Knob("vocab", int, 0, "the vocabulary level L_v: every layer, then the LM head over the base's this many most "
         "frequent tokens, checking (or, with draft_layer = the number of layers, drafting) below the full LM head "
         "(0: off)", minimum=0),
    Knob("vocab_window", int, 4, "N_v: tokens the vocabulary level accepts per pass of the full LM head at most",
         minimum=1, methods=HISPEC, search=(2, 3, 4, 6), symbol="N_v", matters=_vocab_checks),
)
KNOB = {k.name: k for k in KNOBS}
TUNABLE = tuple(KNOB)  # a tuned policy stores these (and its batch thresholds)


def check_knobs(values: dict[str, Any], optional: bool = False) -> dict[str, Any]:
    """``values`` (knob name -> value) checked and normalized; unknown names are left out."""
    return {k: KNOB[k].check(v, optional) for k, v in values.items() if k in KNOB}


def read_by(method: str, values: dict[str, Any]) -> dict[str, Any]:
    """The knobs of ``values`` that ``method`` reads (others left out)."""
    return {k: v for k, v in values.items() if k in KNOB and method in KNOB[k].methods}


def knob_stats(method: str, values: dict[str, Any]) -> dict[str, Any]:
    """Each knob's value where ``method`` reads it, else None (a run's statistics)."""
    return {k.name: values[k.name] if method in k.methods else None for k in KNOBS}
