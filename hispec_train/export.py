"""``hispec-export RUN_DIR --out DIR [--exit-vocab-size K] [--layers L,...] [--with-exits ADAPTER[:L,...]] [--vocab-from DIR] [--overwrite] [--push-to-hub REPO_ID] ...``.

Writes the adapter of a training run (config, heads-only safetensors) plus a ``README.md``
model card with the base, its fingerprint, the exits, the training data and steps, and the
measured agreement table; optionally uploads the directory to the Hub. ``--exit-vocab-size K``
restricts the early exits to the K most frequent tokens of the run's training data (no
retraining: the heads are trained on the full vocabulary) and measures the held-out agreement
with that vocabulary for the card. ``--with-exits ADAPTER[:L,...]`` carries exits of another
adapter for the same base into the export (all of its exits, or layers ``L,...``), with their roles
and weights unchanged: a run that trained a new draft head ships beside an earlier intermediate one.
``--layers L,...`` ships only some of the run's exits (candidates trained for the layer curve stay out).

The vocabulary level's token ranking (``hispec_vocab.safetensors``: how often the base emitted each
token) is counted from the run's self-distilled answers, read from its data set or from the data set
its feature store was built from; ``--vocab-from DIR`` names another self-distilled data set. A run
trained on other text ships none (a base without one ranks its tokens by a short calibration decode).

``--out`` is written atomically (a temporary sibling swapped into place). It may be new, empty or
a previous export; a directory holding anything else is refused unless ``--overwrite`` is given,
and the run directory itself (or anything inside or around it) always is.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import torch

from hispec_decode.adapter import (CONFIG_NAME, MODEL_CARD_NAME, VLLM_BASE_CONFIG_NAME, WEIGHTS_NAME, HiSpecAdapter,
                                   HiSpecAdapterConfig, vllm_base_config)
from hispec_decode.models import decoder_for
from hispec_decode.models.head_types import head_class
from hispec_decode.models import LoadedBase, load_base
from hispec_decode.models.loading import DEFAULT_BASE, PACKAGED_BASES, packaged_base_dir
from hispec_decode.errors import HiSpecError
from hispec_decode.files import atomic_directory, check_writable, is_temporary
from hispec_decode.tools.cli import add_debug_arg, non_negative_int, positive_int_list, run_cli
from hispec_decode.adapter import fingerprint_id, fingerprints_match
from hispec_decode.adapter.fingerprint import compute_fingerprint
from hispec_decode.adapter.vocabulary import VOCAB_NAME, save_weights, weights_from_tokens

from .checkpoint import CHECKPOINT_DIR, checkpoint_step
from .config import TrainConfig, load_config
from .report import EVAL_NAME
from .selfdistill import MANIFEST_NAME as SELFDISTILL_MANIFEST
from .selfdistill_shards import answer_tokens
from .store import STORE_MANIFEST, StoreManifest
from .trainer import CONFIG_NAME as TRAIN_CONFIG_NAME
from .trainer import TrainingData, evaluate, set_exit_vocab
from .vocab import exit_vocabulary


def _data_line(training: dict[str, Any]) -> str:
    if training.get("features"):
        return (f"data `{training.get('dataset')}` read from a feature store "
                f"({training.get('train_tokens_available'):,} training tokens)")
    return (f"data `{training.get('dataset')}` ({training.get('records_used')} records used, "
            f"{training.get('records_skipped')} skipped)")


def _init_line(training: dict[str, Any]) -> str:
    """How a run that started from trained heads (``init_heads``) began, for the card."""
    init = training.get("initialised_from")
    if not isinstance(init, dict):
        return ""
    before = f"{init['steps']}-step " if init.get("steps") else ""
    return f" continued from the {before}heads `{init.get('adapter')}`"


def model_card(adapter: HiSpecAdapter, report: dict[str, Any], steps: int) -> str:
    cfg = adapter.config
    last = report["history"][-1] if report.get("history") else {}
    size = sum(p.numel() for p in adapter.parameters())
    rows = "\n".join(
        f"| {e.layer} | {e.role} | {e.head_type} | {report['untrained'].get(f'agreement/L{e.layer}', float('nan')):.3f} "
        f"| {last.get(f'agreement/L{e.layer}', float('nan')):.3f} |" for e in cfg.exits)
    vocab = report.get("exit_vocab")
    if vocab:
        rows = "\n".join(f"{row} {vocab['agreement'].get(f'agreement/L{e.layer}', float('nan')):.3f} |"
                         for row, e in zip(rows.split("\n"), cfg.exits))
    extra = ""
    if "agreement/draft_vs_intermediate" in last:
        extra = (f"\nDraft agrees with the intermediate exit on {last['agreement/draft_vs_intermediate']:.3f} of tokens; "
                 f"expected accepted length at the intermediate exit for a window of {report['window']}: "
                 f"{last.get('expected_accepted/intermediate', float('nan')):.2f}.\n")
    context = {e.layer: last[f"agreement_true_context/L{e.layer}"] for e in cfg.exits
               if f"agreement_true_context/L{e.layer}" in last}
    if context:
        extra += ("\nDeep-context heads: the agreement above is with the head reading its own previous output "
                  "(every draft after the first); with the previous position's true final state (the first draft "
                  "after a verification) it is " + ", ".join(f"{v:.3f} at L{l}" for l, v in context.items()) + ".\n")
    added = cfg.training.get("exits_added_from")
    if added:
        extra += (f"\nThe {', '.join(f'L{l} ({t})' for l, t in zip(added['layers'], added['head_types']))} head(s) come "
                  f"unchanged from `{added['adapter']}` (`hispec-export --with-exits`); this run did not measure them "
                  f"(nan above).\n")
    vocab_header, vocab_rule, vocab_note = "", "", ""
    trained_vocab = f" ({report['trained_exit_vocab_size']}-token exit vocabulary)" if report.get("trained_exit_vocab_size") else ""
    if vocab:
        vocab_header, vocab_rule = f" trained head, {vocab['size']}-token exit vocabulary |", "---|"
    k, coverage = (vocab["size"], vocab["coverage"]) if vocab else (cfg.training.get("exit_vocab_size"), cfg.training.get("exit_vocab_coverage"))
    if k:
        vocab_note = (f"\nThe early exits predict over a reduced vocabulary: the {k} most frequent tokens of the "
                      f"training data ({100 * coverage:.1f}% of its tokens); the final layer always uses all "
                      f"{cfg.vocab_size}, so decoding stays lossless.\n")
    return f"""---
library_name: hispec
base_model: {cfg.base_model}
tags: [hispec, speculative-decoding, early-exit]
---
# HiSpec exit heads for {cfg.base_model}

Early-exit heads for lossless hierarchical speculative decoding with HiSpec (`pip install hispec`).
Heads only ({size:,} parameters); the base model is not included.

- Base: `{cfg.base_model}` (fingerprint `{fingerprint_id(cfg.base_fingerprint)}`; {cfg.num_hidden_layers} layers,
  hidden size {cfg.hidden_size}, vocabulary {cfg.vocab_size})
- Training: {steps} steps{_init_line(cfg.training)}, {_data_line(cfg.training)}, sequence length {cfg.training.get('seq_len')}

## Held-out top-1 agreement with the final layer

| layer | role | head | untrained exit (norm + LM head) | trained head{trained_vocab} |{vocab_header}
|---|---|---|---|---|{vocab_rule}
{rows}
{extra}{vocab_note}
## Usage

```python
from hispec_decode import HiSpecModel

model = HiSpecModel.from_pretrained("{cfg.base_model}", heads="PATH_OR_REPO_OF_THIS_ADAPTER")
out = model.generate(input_ids, max_new_tokens=128, method="hispec")
```
"""


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise HiSpecError(f"{path} cannot be read as JSON ({exc}); is this a hispec-train run directory?") from exc


def _run_config(run_dir: Path) -> TrainConfig:
    data = _read_json(run_dir / TRAIN_CONFIG_NAME)
    if not isinstance(data, dict):
        raise HiSpecError(f"{run_dir / TRAIN_CONFIG_NAME} is not a JSON object")
    return load_config(None, {k: v for k, v in data.items() if k in TrainConfig.__dataclass_fields__})


def restrict_vocab(adapter: HiSpecAdapter, cfg: TrainConfig, loaded: LoadedBase, size: int) -> dict[str, Any]:
    """Give the heads the run's ``size``-token exit vocabulary; returns it with its held-out agreement."""
    decoder = decoder_for(loaded.model, pack_weights=False)
    data = TrainingData(cfg, loaded.tokenizer, getattr(loaded.model, loaded.model.base_model_prefix),
                        compute_fingerprint(loaded.model))
    special = loaded.tokenizer.all_special_ids if loaded.tokenizer is not None else []
    vocab = exit_vocabulary(data.train_tokens(), size, decoder.vocab_size, special)
    set_exit_vocab(adapter, vocab)
    heads = {e.layer: adapter.head(e.layer) for e in adapter.config.exits}
    with torch.no_grad():
        rates, _ = evaluate(cfg, decoder, data, heads)
    return {"size": size, "coverage": vocab.coverage, "agreement": rates}


EXPORT_FILES = frozenset({CONFIG_NAME, WEIGHTS_NAME, MODEL_CARD_NAME, VLLM_BASE_CONFIG_NAME, VOCAB_NAME})


def selfdistilled_source(cfg: TrainConfig) -> Path | None:
    """The self-distilled data set the run learned from: its ``dataset``, or the one its feature store
    was built from (None when the run trained on other text)."""
    candidates = [cfg.dataset]
    if cfg.features and (Path(cfg.features) / STORE_MANIFEST).is_file():
        candidates.insert(0, StoreManifest.load(cfg.features).dataset)
    return next((Path(c) for c in candidates if c and (Path(c) / SELFDISTILL_MANIFEST).is_file()), None)


def vocab_weights(dataset: Path, vocab_size: int) -> tuple[torch.Tensor, dict[str, Any]]:
    """How often the base emitted each token in the self-distilled ``dataset``, with the file's record of it."""
    if not (dataset / SELFDISTILL_MANIFEST).is_file():
        raise HiSpecError(f"--vocab-from {dataset}: not a self-distilled data set ({SELFDISTILL_MANIFEST} missing; "
                          f"make one with hispec-selfdistill)")
    answers = answer_tokens(dataset)
    ids = [t for a in answers if a for t in (min(a), max(a))]
    if ids and (min(ids) < 0 or max(ids) >= vocab_size):
        raise HiSpecError(f"--vocab-from {dataset}: its token ids do not fit this base's vocabulary of {vocab_size}; "
                          f"was it made with another base?")
    weights = weights_from_tokens(answers, vocab_size)
    return weights, {"dataset": str(dataset), "source": "token counts of the base's self-distilled answers",
                     "tokens": int(weights.sum())}


def check_out_dir(run_dir: Path, out: Path, overwrite: bool = False) -> None:
    """``out`` may be new, empty, or a previous export; anything else needs ``overwrite``, and it
    may never be the run directory, inside it, or hold it."""
    run, dest = run_dir.resolve(), out.resolve()
    if dest == run or run in dest.parents or dest in run.parents:
        raise HiSpecError(f"--out {out} would overlap the run directory {run_dir}; export somewhere else")
    if dest.exists() and not dest.is_dir():
        raise HiSpecError(f"--out {out} is a file; give a directory")
    if dest == Path.cwd().resolve() or dest in Path.cwd().resolve().parents:
        raise HiSpecError(f"--out {out} is the current directory or holds it; give a new or empty directory")
    if dest.is_dir():
        names = {p.name for p in dest.iterdir() if not is_temporary(p.name)}
        if names and not (CONFIG_NAME in names and names <= EXPORT_FILES) and not overwrite:
            raise HiSpecError(f"--out {out} holds other files ({', '.join(sorted(names)[:3])}...); choose a new or "
                              f"empty directory, or pass --overwrite to replace all of it")
    check_writable(dest.parent, "the parent of --out")


def keep_exits(adapter: HiSpecAdapter, layers: list[int]) -> None:
    """Drop every exit but those at ``layers`` (a run trained candidates; an adapter ships the ones its
    policy uses). A vacant draft role passes to the shallowest kept exit, then a vacant intermediate
    role to the shallowest kept exit without a role, so the roles that fill an untuned policy stay in
    depth order."""
    cfg = adapter.config
    available = [e.layer for e in cfg.exits]
    missing = sorted(set(layers) - set(available))
    if missing or not layers:
        raise HiSpecError(f"--layers: no exit at layer(s) {missing} in this run (it has {available})" if missing
                          else "--layers: name at least one exit")
    cfg.exits = [e for e in cfg.exits if e.layer in layers]
    adapter.heads = torch.nn.ModuleDict({k: h for k, h in adapter.heads.items() if int(k) in layers})
    if cfg.layer_for("draft") is None:  # the shallowest kept exit drafts
        cfg.exits[0].role = "draft"
    spare = next((e for e in cfg.exits if e.role == "extra"), None)
    if cfg.layer_for("intermediate") is None and spare is not None:  # the next kept one checks
        spare.role = "intermediate"
    cfg.validate()
    cfg.training["exits_shipped"] = sorted(layers)


def add_exits(adapter: HiSpecAdapter, other: HiSpecAdapter, layers: list[int] | None = None,
              source_name: str = "") -> list[int]:
    """Carry ``other``'s exits at ``layers`` (default: all) into ``adapter``, roles and weights unchanged;
    both must be for the same base, and neither a layer nor a draft/intermediate role may be taken twice."""
    a, b = adapter.config, other.config
    if not fingerprints_match(a.base_fingerprint, b.base_fingerprint) or (a.num_hidden_layers, a.hidden_size,
                                                                          a.vocab_size) != (b.num_hidden_layers,
                                                                                            b.hidden_size, b.vocab_size):
        raise HiSpecError(f"--with-exits: those heads were trained for {b.base_model!r} (fingerprint "
                          f"{fingerprint_id(b.base_fingerprint)}), this run for {a.base_model!r} "
                          f"({fingerprint_id(a.base_fingerprint)})")
    available = {e.layer: e for e in b.exits}
    layers = sorted(available) if layers is None else layers
    missing = [l for l in layers if l not in available]
    if missing:
        raise HiSpecError(f"--with-exits: no exit at layer(s) {missing} in those heads (they have {sorted(available)})")
    taken = {e.layer for e in a.exits}
    if taken & set(layers):
        raise HiSpecError(f"--with-exits: layer(s) {sorted(taken & set(layers))} already have a head in this run")
    for layer in layers:
        e = available[layer]
        if e.role != "extra" and a.layer_for(e.role) is not None:
            raise HiSpecError(f"--with-exits: the {e.role} exit is already layer {a.layer_for(e.role)} in this run "
                              f"(layer {layer} of those heads has that role too)")
        a.exits.append(e)
        adapter.heads[str(layer)] = other.head(layer)
    a.exits.sort(key=lambda e: e.layer)
    adapter.heads = torch.nn.ModuleDict({k: adapter.heads[k] for k in sorted(adapter.heads, key=int)})
    a.validate()
    a.training["exits_added_from"] = {"adapter": source_name, "layers": layers,
                                      "head_types": [available[l].head_type for l in layers]}
    return layers


def export(run_dir: Path, out: Path, exit_vocab_size: int = 0, overwrite: bool = False,
           with_exits: tuple[Path, list[int] | None] | None = None, vocab_from: Path | None = None,
           layers: list[int] | None = None) -> HiSpecAdapter:
    """Write the run's heads (``run_dir/checkpoint``) to ``out`` as an adapter with a model card,
    atomically: ``out`` holds the previous export or the new one, never a mixture. ``with_exits``:
    (adapter directory, layers or None for all) whose exits are added (:func:`add_exits`);
    ``vocab_from``: the self-distilled data set that ranks the vocabulary level's tokens (default:
    the run's own, :func:`selfdistilled_source`); ``layers``: ship only the run's exits at these layers
    (:func:`keep_exits`)."""
    checkpoint = run_dir / CHECKPOINT_DIR
    checkpoint_step(run_dir)  # clean up (or restore) what a killed save left
    if not (checkpoint / CONFIG_NAME).is_file():
        raise HiSpecError(f"{run_dir} holds no finished checkpoint ({checkpoint} is missing)")
    check_out_dir(run_dir, out, overwrite)
    cfg = _run_config(run_dir)
    # heads built on a base layer (decoder_block) are rebuilt on the run's base; --exit-vocab-size needs its tokenizer
    block_heads = any(head_class(e.head_type).has_cache for e in HiSpecAdapterConfig.from_pretrained(checkpoint).exits)
    loaded = load_base(cfg.base, "float32") if block_heads or exit_vocab_size else None
    decoder = decoder_for(loaded.model, pack_weights=False) if block_heads else None
    adapter = HiSpecAdapter.from_pretrained(checkpoint, decoder=decoder)
    if layers is not None:
        keep_exits(adapter, layers)
    report = _read_json(run_dir / EVAL_NAME) if (run_dir / EVAL_NAME).is_file() else {"untrained": {}, "history": [], "window": 0}
    report["trained_exit_vocab_size"] = adapter.config.training.get("exit_vocab_size")  # what "trained head" was measured with
    if exit_vocab_size:
        report["exit_vocab"] = restrict_vocab(adapter, cfg, loaded, exit_vocab_size)
    if with_exits is not None:
        source, layers = with_exits
        source_types = [e.head_type for e in HiSpecAdapterConfig.from_pretrained(source).exits]
        if decoder is None and any(head_class(t).has_cache for t in source_types):
            loaded = loaded or load_base(cfg.base, "float32")
            decoder = decoder_for(loaded.model, pack_weights=False)
        add_exits(adapter, HiSpecAdapter.from_pretrained(source, decoder=decoder), layers, str(source))
    vocab_from = vocab_from or selfdistilled_source(cfg)
    vocab = vocab_weights(vocab_from, adapter.config.vocab_size) if vocab_from is not None else None
    steps = checkpoint_step(run_dir)
    adapter.config.training["steps"] = steps
    base_config = _base_config(cfg.base, loaded)
    with atomic_directory(out) as tmp:
        adapter.save_pretrained(tmp)
        (tmp / MODEL_CARD_NAME).write_text(model_card(adapter, report, steps))
        (tmp / VLLM_BASE_CONFIG_NAME).write_text(json.dumps(vllm_base_config(base_config), indent=2, sort_keys=True))
        if vocab is not None:
            save_weights(tmp, *vocab)
    adapter.vocab_path = out / VOCAB_NAME if vocab is not None else None
    return adapter


def _base_config(base: str | None, loaded: LoadedBase | None) -> dict[str, Any]:
    """The base's Hugging Face config (for vLLM's drafter), read without loading its weights where possible."""
    if loaded is not None:
        return loaded.model.config.to_dict()
    from transformers import AutoConfig

    try:
        packaged = DEFAULT_BASE if base is None else PACKAGED_BASES.get(base)  # an alias is no Hub id
        return AutoConfig.from_pretrained(str(packaged_base_dir(packaged) if packaged else base)).to_dict()
    except Exception:  # a GGUF file or a LoRA directory: their config comes with the model
        return load_base(base, "float32").model.config.to_dict()


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="hispec-export", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("run_dir", type=Path)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--exit-vocab-size", "--exit-vocab", type=non_negative_int, default=0, metavar="K",
                   help="restrict the early exits to the K most frequent training tokens (measured for the card)")
    p.add_argument("--with-exits", metavar="ADAPTER[:L,...]", default=None,
                   help="also ship these exits of another adapter for the same base (all, or layers L,...)")
    p.add_argument("--layers", type=positive_int_list, default=None, metavar="L,...",
                   help="ship only the run's exits at these layers (default: all it trained)")
    p.add_argument("--vocab-from", type=Path, default=None, metavar="DIR",
                   help="self-distilled data set whose answers rank the vocabulary level's tokens (default: the run's)")
    p.add_argument("--overwrite", action="store_true",
                   help="replace --out even when it holds files other than a previous export")
    p.add_argument("--push-to-hub", metavar="REPO_ID", default=None)
    p.add_argument("--private", action="store_true")
    p.add_argument("--revision", default=None)
    add_debug_arg(p)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return run_cli("hispec-export", lambda: _run(args), args.debug, extra="train")


def _run(args: argparse.Namespace) -> int:
    adapter = export(args.run_dir, args.out, args.exit_vocab_size, args.overwrite, _with_exits(args.with_exits),
                     args.vocab_from, args.layers)
    vocab = f", {VOCAB_NAME}" if adapter.vocab_path is not None else ""
    print(f"wrote {args.out}: {CONFIG_NAME}, {WEIGHTS_NAME}, {MODEL_CARD_NAME}{vocab}")
    if args.push_to_hub:
        url = adapter.push_to_hub(args.push_to_hub, private=args.private, revision=args.revision, local_dir=args.out)
        print(f"uploaded to {url}")
    return 0


def _with_exits(value: str | None) -> tuple[Path, list[int] | None] | None:
    """``DIR`` or ``DIR:L,...`` (a directory whose name holds a colon is taken whole when it exists)."""
    if value is None:
        return None
    path, _, layers = value.rpartition(":") if ":" in value and not Path(value).exists() else (value, "", "")
    try:
        parsed = [int(x) for x in layers.split(",")] if layers else None
    except ValueError:
        raise HiSpecError(f"--with-exits {value!r}: layers after ':' must be integers, e.g. heads:8") from None
    return Path(path), parsed


if __name__ == "__main__":
    sys.exit(main())
