"""Fine-tuning: a new run that starts from a file's weights (``init_from``), of the same
architecture and vocabularies, with a fresh optimizer state or the file's. A Hugging Face
MarianMTModel folder (or hub id) is imported first (``nmt.checkpoints.marian``), and a run from an
imported model trains the file's architecture (``imported_init``)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from nmt.checkpoints import file_config
from nmt.checkpoints.files import (CheckpointError, atomic_save, check_run_config, check_weights, checkpoint_kind,
                                   model_state, read_checkpoint, vocabulary_difference)
from nmt.checkpoints.m2m100 import import_folder
from nmt.checkpoints.marian import is_model_source
from nmt.checkpoints.resume import ADAMS, Refuse, check_optimizer
from nmt.data.tokenizer import Tokenizer
from nmt.models import lora
from nmt.runs.files import CHECKPOINTS


# Model config keys (by name, at any depth) a fine-tuning run may set otherwise than its init_from
# file: they change how the weights are trained (dropout, recomputation, shifted training
# positions) or first drawn (init, replaced by the file's weights), not their shapes or what the
# trained model computes. Every other model key must be the file's.
MAY_DIFFER = ("dropout", "attention_dropout", "activation_dropout", "gradient_checkpointing", "position_shift", "init")
# Model keys added since files were first written, with the value a file without them was trained with.
ADDED = {"activation": "relu", "logits_bias": False, "self_heads": None, "cross_heads": None, "embedding_norm": False,
         "start_from_eos": False, "output": "tanh", "initial_state": "final"}
INIT_OPTIMIZER = ("fresh", "keep")  # init_optimizer: a new optimizer state, or the file's per-parameter state


IMPORTED = "init_from.ckpt"  # in the run folder: the release file of an init_from folder


def imported_init(path: str, out_dir: str | Path, allow_pickle: bool = False) -> tuple[str, dict[str, Any] | None]:
    """``init_from`` as a file, and what a run from it trains: a MarianMTModel folder or hub id is
    imported once into ``out_dir/init_from.ckpt``; a release file ``nmt-import`` wrote stays as it
    is. Both give their ``model`` config (the run trains the imported architecture, whatever
    ``model=`` says), whether one tokenizer serves both sides (``joint``, for
    ``data.tokenizer.joint``) and, for an M2M100, NLLB-200 or mBART-50 model, how it reads its
    languages (``languages``: the source language's code a tag, the target's the decoder's first
    token; else None); any other file gives None (the run's config must match it)."""
    if is_model_source(path):
        out = Path(out_dir) / IMPORTED
        atomic_save(import_folder(path, allow_pickle=allow_pickle), out)
        path = str(out)
    elif not Path(path).is_file():
        return path, None  # read_init names it
    try:
        checkpoint = read_checkpoint(path, what="init_from")
    except CheckpointError as e:
        raise CheckpointError(f"init_from={e}") from None
    source = checkpoint.get("source")
    if checkpoint_kind(checkpoint) == "release" and isinstance(source, dict) and source.get("format") == "huggingface":
        try:
            model = file_config.check(checkpoint["run_config"]["model"], "model", path)
        except file_config.ConfigRefused as e:
            raise CheckpointError(f"init_from={e}") from None
        protos = checkpoint["tokenizers"]  # Marian's two SentencePiece models over one vocabulary: two tokenizers
        languages = checkpoint["run_config"].get("languages")  # M2M100's: the source code a tag, the target's a prefix
        languages = languages if isinstance(languages, dict) and languages.get("target") == "decoder_prefix" else None
        return path, {"model": model, "joint": protos["src"] == protos["tgt"],
                      "languages": None if languages is None else {"source": "tag", "target": "decoder_prefix"}}
    return path, None


def read_init(path: str | Path, keep_optimizer: bool = False, optimizer_target: str | None = None) -> dict[str, Any]:
    """The checkpoint or release file a fine-tuning run starts from, read as ``read_checkpoint``
    reads any checkpoint (never unpickled) and its config checked (``check_run_config``); with
    ``keep_optimizer``, a training checkpoint of the same optimizer class. Errors are one line
    naming ``init_from`` (or ``init_optimizer``)."""
    try:
        checkpoint = read_checkpoint(path, what="init_from")
        check_run_config(checkpoint, path)
    except CheckpointError as e:
        raise CheckpointError(f"init_from={e}") from None
    if not isinstance(checkpoint["run_config"].get("model"), dict):
        raise CheckpointError(f"init_from={path}: its run config has no model section; give a .ckpt written by nmt")
    if keep_optimizer:
        kind = checkpoint_kind(checkpoint)
        states = checkpoint.get("optimizer_states")
        if kind != "training" or not isinstance(states, list) or len(states) != 1:
            what = "a release file" if kind == "release" else "a checkpoint saved with weights only"
            raise CheckpointError(f"init_optimizer=keep: init_from={path} is {what}, which holds no optimizer state; "
                                  "give a training checkpoint (<run>/checkpoints/last.ckpt) or set init_optimizer=fresh")
        optimizer = checkpoint["run_config"].get("optimizer")
        saved = optimizer.get("_target_") if isinstance(optimizer, dict) else None
        if optimizer_target is not None and saved != optimizer_target:
            raise CheckpointError(f"init_optimizer=keep: init_from={path} was trained with {saved}, this run's optimizer "
                                  f"is {optimizer_target}; set init_optimizer=fresh or optimizer._target_={saved}")
    return checkpoint


def _shown(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value)


def _classes(node: Any, where: str) -> dict[str, Any]:
    """The ``_target_`` of every config node under ``node``, by key."""
    if not isinstance(node, dict):
        return {}
    found = {f"{where}._target_": node["_target_"]} if "_target_" in node else {}
    for key, value in node.items():
        found.update(_classes(value, f"{where}.{key}"))
    return found


def _first_difference(saved: Any, configured: Any, where: str) -> tuple[str, str, str] | None:
    if not (isinstance(saved, dict) and isinstance(configured, dict)):
        return None if saved == configured else (where, _shown(saved), _shown(configured))
    keys = set(saved) | set(configured)
    nested = {k for k in keys if isinstance(saved.get(k), dict) or isinstance(configured.get(k), dict)}
    for key in sorted(keys, key=lambda k: (k in nested, k)):  # a level's own values before its sub-configs
        if key in MAY_DIFFER:
            continue
        if key in ADDED and saved.get(key, ADDED[key]) == configured.get(key, ADDED[key]):
            continue
        if key not in saved or key not in configured:
            return (f"{where}.{key}", _shown(saved[key]) if key in saved else "absent",
                    _shown(configured[key]) if key in configured else "absent")
        found = _first_difference(saved[key], configured[key], f"{where}.{key}")
        if found:
            return found
    return None


def architecture_difference(saved: Any, configured: Any, where: str = "model") -> tuple[str, str, str] | None:
    """The first key whose value differs between two resolved model configs, the ``MAY_DIFFER``
    keys left out: (key, saved value, configured value). Classes (``_target_``) come first, then a
    level's own values before its sub-configs, so a size set once in the preset is named there,
    not where it is interpolated."""
    classes, own = _classes(saved, where), _classes(configured, where)
    for key in sorted(set(classes) & set(own)):
        if classes[key] != own[key]:
            return key, _shown(classes[key]), _shown(own[key])
    return _first_difference(saved, configured, where)


def check_architecture(checkpoint: dict[str, Any], configured: dict[str, Any], path: str | Path) -> None:
    """Refuse (ValueError, one line naming the key and both values) a resolved model config
    ``configured`` that is not the architecture of the ``init_from`` file read by ``read_init``."""
    try:
        saved = file_config.check(checkpoint["run_config"]["model"], "model", str(path))
    except file_config.ConfigRefused as e:
        raise CheckpointError(f"init_from={e}") from None
    found = architecture_difference(saved, configured)
    if found:
        key, there, here = found
        raise ValueError(f"init_from={path}: {key} is {here} in this run's config, {there} in the file's; fine-tuning "
                         f"keeps the file's architecture (only {', '.join(MAY_DIFFER)} may differ)")


def inherit_pruned_heads(checkpoint: dict[str, Any], model: Any, path: str | Path) -> list[str]:
    """A pruned file's heads per layer (``nmt-prune``: ``self_heads``, ``cross_heads`` of the
    encoder and decoder) set in the run's model config ``model`` where the run leaves them null,
    so a pruned model fine-tunes without restating them; returns the overrides set, as
    ``key=value``. A run that sets them otherwise is refused by ``check_architecture``."""
    try:
        saved = file_config.check(checkpoint["run_config"]["model"], "model", str(path))
    except file_config.ConfigRefused as e:
        raise CheckpointError(f"init_from={e}") from None
    overrides = []
    for part in ("encoder", "decoder"):
        for key in ("self_heads", "cross_heads"):
            value = (saved.get(part) or {}).get(key)
            if value is not None and part in model and key in model[part] and model[part][key] is None:
                model[part][key] = value
                overrides.append(f"model.{part}.{key}={value}")
    return overrides


def check_init_vocabularies(checkpoint: dict[str, Any], src_vocab: Tokenizer, tgt_vocab: Tokenizer,
                            path: str | Path, vocab_from: str) -> None:
    """Refuse (ValueError) vocabularies (``data.vocab_from``) other than the ``init_from`` file's."""
    for side, vocab in (("src", src_vocab), ("tgt", tgt_vocab)):
        if found := vocabulary_difference(checkpoint["tokenizers"][side], side, vocab):
            i, saved, now = found
            raise ValueError(f"init_from={path}: data.vocab_from={vocab_from} gives another {side} vocabulary "
                             f"({now} pieces, the file's {saved}; first difference at id {i}); leave "
                             "data.vocab_from unset to train with the file's")


def init_weights(model: torch.nn.Module, checkpoint: dict[str, Any], path: str | Path, weights: str = "stored") -> None:
    """Load the ``init_from`` file's Seq2Seq weights (``model_weights``: ``stored`` or ``raw``; a LoRA
    run's adapters merged) into ``model``, every name and shape checked first (``check_weights``).
    A model with adapters of its own (``module.lora``) keeps them as they were drawn: they start
    from the file's model."""
    state = model_state(checkpoint, weights, source=f"init_from={path}")
    state.update({name: t for name, t in model.state_dict().items() if lora.is_adapter(name)})
    check_weights(model, state, f"init_from={path}")
    model.load_state_dict(state)


def init_origin(checkpoint: dict[str, Any], path: str | Path, weights: str, optimizer: str) -> dict[str, Any]:
    """What a fine-tuning run started from, for its ``summary.json`` and checkpoints: the file,
    its kind, step and epoch, the run folder that trained it (a file in ``<run>/checkpoints/``, or
    for a release file the checkpoint it was exported from), the weights and optimizer taken."""
    source = checkpoint.get("source") if checkpoint_kind(checkpoint) == "release" else None
    exported = source.get("path") if isinstance(source, dict) and isinstance(source.get("path"), str) else None
    run = next((str(Path(p).parent.parent) for p in (path, exported) if p and Path(p).parent.name == CHECKPOINTS), None)
    step, epoch = checkpoint.get("global_step"), checkpoint.get("epoch")
    return {"path": str(path), "kind": checkpoint_kind(checkpoint), "step": step if isinstance(step, int) else None,
            "epoch": epoch if isinstance(epoch, int) else None, "run": run, "exported_from": exported,
            "weights": weights, "optimizer": optimizer}


def load_optimizer_state(optimizer: torch.optim.Optimizer, saved: Any, source: str) -> None:
    """``saved``'s per-parameter state (a checkpoint's ``optimizer_states[0]``: Adam's moments and
    step counts) into ``optimizer``, whose hyperparameters (learning rate, betas, weight decay) stay
    its own; a state for other parameters is refused (ValueError naming ``source``)."""
    own = optimizer.state_dict()
    if not (isinstance(saved, dict) and isinstance(saved.get("state"), dict) and isinstance(saved.get("param_groups"), list)
            and all(isinstance(g, dict) and isinstance(g.get("params"), list) for g in saved["param_groups"])):
        raise CheckpointError(f"init_optimizer=keep: {source}: its optimizer state is not a torch optimizer's")
    sizes = [len(g["params"]) for g in own["param_groups"]], [len(g["params"]) for g in saved["param_groups"]]
    if sizes[0] != sizes[1]:
        raise ValueError(f"init_optimizer=keep: {source}: its optimizer state is for parameter groups of {sizes[1]} "
                         f"tensors, this run's optimizer has {sizes[0]}")
    params = [p for group in optimizer.param_groups for p in group["params"]]
    # each moment of its parameter's shape (a fused optimizer writes that many values in place), the step a scalar
    kind = f"torch.optim.{type(optimizer).__name__}"
    check_optimizer([saved], params, Refuse(f"init_optimizer=keep: {source}", "set init_optimizer=fresh"),
                    kind if kind in ADAMS else None)
    own_ids = [i for group in own["param_groups"] for i in group["params"]]
    saved_ids = [i for group in saved["param_groups"] for i in group["params"]]
    state = {}
    for own_id, saved_id, param in zip(own_ids, saved_ids, params):
        values = saved["state"].get(saved_id)
        if not isinstance(values, dict):
            continue
        for name, value in values.items():
            if torch.is_tensor(value) and value.dim() > 0 and value.shape != param.shape:
                raise ValueError(f"init_optimizer=keep: {source}: its optimizer state {name} of parameter {saved_id} "
                                 f"is {tuple(value.shape)}, the parameter {tuple(param.shape)}")
        state[own_id] = {name: value.clone() if torch.is_tensor(value) else value for name, value in values.items()}
    optimizer.load_state_dict({"state": state, "param_groups": own["param_groups"]})
