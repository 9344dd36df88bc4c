"""Drafters: what proposes tokens for the first check of a round (docs/drafters.md).

A drafter is one class in one module of this package (:class:`~.base.Drafter`): it says whether it
drafts for a sequence under its policy (:meth:`~.base.Drafter.active`), proposes a chain or a tree of
tokens with or without its distributions (:meth:`~.base.Drafter.propose`), and hears what the check
accepted (:meth:`~.base.Drafter.feedback`). Every module here is imported below, so a new drafter is
its module plus the knob that turns it on (:mod:`hispec_decode.knobs`); its ``off`` / ``on`` values let a
sequence's round chooser run a round with or without it (:mod:`hispec_decode.engine.chooser`).

:func:`~.compose.propose` runs them for a round: the first active drafter that proposes something
drafts it, in :attr:`~.base.Drafter.order`; under ``drafting="union"`` at batch 1 the proposals of
all of them are merged into one tree, verified in one pass (:mod:`.compose`).
"""

from __future__ import annotations

import importlib
import pkgutil

from .base import Draft, Drafter, registered, turned_on, without
from .compose import propose

for _module in pkgutil.iter_modules(__path__):
    importlib.import_module(f"{__name__}.{_module.name}")

__all__ = ["Draft", "Drafter", "propose", "registered", "turned_on", "without"]
