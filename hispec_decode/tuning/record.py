"""This machine's record for an adapter (or a base) and dtype: where it is kept, when it is made again,
and how it is made (:mod:`.derive`) and stored.

A record lives at ``$HISPEC_HOME/machine/<adapter>/<machine>.json`` (:func:`policy_path`; the machine's
key is :func:`hispec_decode.machine.key`). It is ``"measured"`` (pass costs only: a derivation that
failed after measuring, or the first load while the background worker derives), ``"derived"`` (the
policies :func:`.derive.derive` chose under those costs) or ``"tuned"`` (``hispec-tune``'s confirmed
choice, which wins over a derived one). A derived record of another :data:`DERIVATION`, machine,
dtype or calibration is made again.
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from pathlib import Path
from typing import Any

import torch

from .. import kernels, machine
from ..adapter.fingerprint import base_id
from ..adapter.vocabulary import calibration_prompts, fit_context
from ..decoding.level import vocab_key, vocab_of
from ..files import write_text
from ..models.loading import hispec_home
from ..models.native import LAYOUT as NATIVE_LAYOUT
from . import background, derive
from .calibration import calibration_id, load_calibration, record_calibration
from .costs import CostModel
from .simulate import add_vocab_rows

logger = logging.getLogger(__name__)

DERIVATION = 11  # a derived record of another version is derived again
BASE_TRACES, BASE_TOKENS = 4, 96  # a base without an adapter: prompts and tokens of its calibration decode


def adapter_id(adapter: Any) -> str:
    """A short content hash of the adapter's heads and the base they were made for (what its per-machine
    policies are kept under: heads of equal weights on two bases are two adapters)."""
    cached = getattr(adapter, "_hispec_id", None)
    if cached is None:
        digest = hashlib.sha256()
        config = adapter.config
        digest.update(json.dumps({"base": config.base_fingerprint, "layers": config.num_hidden_layers,
                                  "exits": [(e.layer, e.role, e.head_type) for e in config.exits]},
                                 sort_keys=True, default=str).encode())
        for key, tensor in sorted(adapter.state_dict_flat().items()):
            digest.update(key.encode())
            digest.update(tensor.contiguous().view(-1).view(torch.uint8).numpy().tobytes())
        cached = adapter._hispec_id = digest.hexdigest()[:16]
    return cached


def policy_path(model: Any) -> Path:
    """Where this machine's policy for ``model``'s adapter (or its base, without one) and dtype is kept."""
    owner = adapter_id(model.adapter) if model.adapter is not None else f"base-{base_id(model.base_model)}"
    key = machine.key(model.decoder.device, _precision(model), owner)
    return hispec_home() / "machine" / owner / f"{key}.json"


def machine_record(model: Any) -> dict[str, Any] | None:
    """This machine's record for ``model``'s adapter and dtype: its ``policies`` (``{"hispec": {...},
    "self_spec": {...}}``), its pass ``costs`` and each arm's predicted speed (``arms``, where derived):
    the stored one (tuned here, or derived before), else derived now from the adapter's calibration
    (measuring this machine's costs: seconds) and stored; None without a calibration, or where deriving
    fails (then one warning says so, and decoding takes the adapter's shipped policy). Measured costs are
    stored before the policy is derived from them, so a later load that derives again does not measure
    again."""
    adapter = model.adapter
    path = policy_path(model)
    stored = _read(path)
    if stored is not None and _current(stored, adapter):
        return {"policies": stored["policies"], "costs": stored.get("costs") or stored.get("measurements", {}).get(
            "costs"), "arms": stored.get("arms", {})}
    if adapter is None:  # the base alone: traces of a short calibration decode, the vocabulary level's grid
        if not derive.vocab_sizes(model):
            return None
    elif adapter.calibration_path is None:
        return None
    try:
        if adapter is not None and background.wanted(model):
            return _prior(model, path)
        record = _derive_and_store(model, path)
        return {k: record.get(k) for k in ("policies", "costs", "arms")}
    except Exception as exc:  # noqa: BLE001 - a failed derivation must never stop a decode
        logger.warning("hispec: deriving this machine's decoding policy failed (%s: %s); decoding with the %s",
                       type(exc).__name__, str(exc).splitlines()[0] if str(exc) else "", "adapter's shipped policy"
                       if adapter is not None else "default policy")
        return None


def _current(stored: dict[str, Any], adapter: Any) -> bool:
    """Whether a stored record still holds: a policy tuned on this machine always; a derived one where
    it was derived by this derivation from the calibration the adapter holds now (traces written again
    by ``hispec-tune --write-calibration`` derive again)."""
    if stored.get("source") != "derived":
        return True
    if stored.get("derivation") != DERIVATION:
        return False
    return adapter is None or adapter.calibration_path is None or \
        stored.get("calibration") == calibration_id(adapter.calibration_path)


def _prior(model: Any, path: Path) -> dict[str, Any]:
    """The first decode's record while the grid is replayed in the background: this machine's costs
    (measured now, or by an earlier load) and each arm's prior for the adapter's shipped policies, replayed
    on its calibration traces; the policies stay the shipped ones until the worker has stored its own."""
    traces = load_calibration(model.adapter.calibration_path)
    about = _about(model, calibration_id(model.adapter.calibration_path))
    costs = _measured(path, about)
    if costs is None:
        logger.info("hispec: measuring this machine's pass costs (once; kept in %s); the policy is derived in the "
                    "background", path)
        costs = derive.machine_costs(model, traces)
        store(path, {"source": "measured", **about, "costs": costs.to_dict()})
    n = model.num_layers
    shipped = {method: model.policy(method=method) for method in ("hispec", "self_spec")}  # no record yet: the adapter's
    sizes = tuple({p.vocab for p in shipped.values() if p.vocab and vocab_key(p.vocab) in costs.exits})
    if sizes:
        model.token_ranking()
        add_vocab_rows(model.runner, traces[:derive.TRACES], sizes)
    arms = derive.arm_rates(shipped, traces[:derive.TRACES], costs, n, model.decoder.default_eos_ids())
    background.start(model, path)
    return {"policies": {}, "costs": costs.to_dict(), "arms": arms}


def _about(model: Any, calibration: str) -> dict[str, Any]:
    """What a record was made for: a record made for anything else is made again."""
    return {"derivation": DERIVATION, "machine": machine.describe(model.decoder.device),
            "dtype": str(_precision(model)), "calibration": calibration}


def _precision(model: Any) -> Any:
    """What a record is kept per: the torch dtype, or for GGUF blocks their precision, layout and, where
    it is not the AVX2 one, the kernel's loop (``native-x8``, ``native-x8-vnni``: costs measured on
    another layout or loop are measured again)."""
    if not model.decoder.native:
        return model.decoder.dtype
    loop = kernels.block_linear_kind()
    return f"{model.decoder.precision}-{NATIVE_LAYOUT}" + ("" if loop in ("avx2", "torch") else f"-{loop}")


def _derive_and_store(model: Any, path: Path) -> dict[str, Any]:
    """Derive (measuring the costs unless a failed derivation left them) and store; the record."""
    adapter = model.adapter
    if adapter is None:
        calibration = "calibration decode"
        prompts, new_tokens = fit_context(model, calibration_prompts(model.tokenizer)[:BASE_TRACES], BASE_TOKENS)
        traces = record_calibration(model, prompts, new_tokens, [])
    else:
        calibration = calibration_id(adapter.calibration_path)
        traces = load_calibration(adapter.calibration_path)
    t0 = time.perf_counter()
    about = _about(model, calibration)
    costs = _measured(path, about)
    if costs is None:
        logger.info("hispec: measuring this machine's pass costs for a decoding policy (once; kept in %s)", path)
        costs = derive.machine_costs(model, traces)
        store(path, {"source": "measured", **about, "costs": costs.to_dict()})
    else:
        logger.info("hispec: deriving a decoding policy from the pass costs measured before (%s)", path)
        if any(vocab_of(key) for key in costs.exits):
            model.token_ranking()
    derived = derive.derive(model, traces, costs)
    policies = {"hispec": derived.pop("hispec"), "self_spec": derived.pop("self_spec")}
    record = {"source": "derived", **about, "made_on": time.strftime("%Y-%m-%d"),
              "seconds": round(time.perf_counter() - t0, 1), "policies": policies, **derived, "costs": costs.to_dict()}
    store(path, record)
    logger.info("hispec: derived %s (predicted %.1f tok/s, plain %.1f) in %.0f s", derived["predicted"][0]["config"],
                derived["predicted"][0]["tokens_per_second"], derived["predicted_autoregressive"], record["seconds"])
    return record


def _measured(path: Path, about: dict[str, Any]) -> CostModel | None:
    """The costs a record at ``path`` holds, if it was measured for the same derivation, machine, dtype
    and calibration (a derivation that failed after measuring left them there)."""
    try:
        record = json.loads(path.read_text())
        if record.get("source") != "measured" or any(record.get(k) != json.loads(json.dumps(v, default=str))
                                                      for k, v in about.items()):
            return None
        return CostModel.from_dict(record["costs"])
    except (OSError, ValueError, TypeError, KeyError, AttributeError):
        return None


def store(path: Path, record: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    write_text(path, json.dumps(record, indent=2, sort_keys=True, default=str) + "\n")


def _read(path: Path) -> dict[str, Any] | None:
    """A stored record with policies, or None: missing, only measured, or unreadable (then a warning
    says why the policy is made again)."""
    try:
        record = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:
        logger.warning("hispec: the machine policy file %s is unreadable (%s); deriving it again", path,
                       str(exc).splitlines()[0])
        return None
    if isinstance(record, dict) and record.get("source") == "measured":
        return None
    if not (isinstance(record, dict) and isinstance(record.get("policies"), dict)
            and isinstance(record["policies"].get("hispec"), dict)):
        logger.warning("hispec: the machine policy file %s holds no policies; deriving it again", path)
        return None
    return record
