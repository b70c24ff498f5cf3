"""Checkpoints: read them safely, rebuild the model from the config saved in the checkpoint, check
that the weights fit it (for translation and for resuming training), and restore the
SentencePiece models saved beside them.

Every file is read with ``torch.load(weights_only=True)``: tensors and plain containers only, so
opening a checkpoint never runs code stored in it. A checkpoint holds (``FORMAT`` 2):
``state_dict`` (the module's weights, ``model.`` prefixed), ``run_config`` (the resolved run config
as plain dicts and lists), ``tokenizers`` (the SentencePiece models as bytes), ``global_step``,
``nmt_format`` and ``kind``: ``training`` (written by ``train.py``: optimizer, loops, callbacks and
RNG states too; resumable) or ``release`` (``nmt-export format=release`` and ``nmt-average``:
weights, config and vocabularies only; for translating and evaluating). Checkpoints written before
format 2 hold pickled Python objects: they load only with ``allow_pickle=True``, for files you
trust, since unpickling runs whatever code the file names.
"""

from __future__ import annotations

import json
import logging
import os
import pickle
import tempfile
import re
import zipfile
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import sentencepiece as spm
import torch
from nmt import file_config
from nmt.data.tokenizer import Tokenizer
from nmt.run_files import CHECKPOINTS, REPORT_STEM

log = logging.getLogger(__name__)

FORMAT = 2  # checkpoint["nmt_format"] this version writes and reads (1: before weights-only loading)
KINDS = ("training", "release")


class CheckpointError(ValueError):
    """A file that cannot be used as a checkpoint; the message names the file and what it is."""


@dataclass
class Loaded:
    model: torch.nn.Module
    src_vocab: Tokenizer
    tgt_vocab: Tokenizer
    run_config: dict[str, Any]
    step: int | None = None  # the global step of the weights
    report: dict[str, Any] | None = None  # the run's test report: {"summary": dict, "png": bytes | None}


def _refused_global(error: Exception) -> str:
    found = re.search(r"GLOBAL ([\w.]+)", str(error))
    return f"it names {found.group(1)}" if found else str(error).strip().splitlines()[0]


def read_checkpoint(path: str | Path, allow_pickle: bool = False, what: str = "ckpt") -> dict[str, Any]:
    """The checkpoint dict of ``path``, read with ``weights_only=True`` (memory-mapped), or a
    one-line ``CheckpointError`` naming the file and what it is: not a checkpoint, truncated, of a
    newer format, or holding pickled objects (older checkpoints: only with ``allow_pickle=True``,
    for trusted files). ``what`` names the config key that gave the path."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{what}={path}: no such file (give <run>/checkpoints/<file>.ckpt)")
    with path.open("rb") as f:
        head = f.read(4)
    if not zipfile.is_zipfile(path):
        if head == b"PK\x03\x04":
            raise CheckpointError(f"{path}: truncated or corrupt checkpoint (the zip archive has no end); "
                                  "copy it again or use another checkpoint")
        raise CheckpointError(f"{path}: not a checkpoint (not a torch.save archive); give a .ckpt written by "
                              "nmt's train.py, nmt-average or nmt-export")
    try:
        checkpoint = torch.load(path, map_location="cpu", weights_only=not allow_pickle, mmap=True)
    except pickle.UnpicklingError as e:
        raise CheckpointError(
            f"{path}: refused, the file holds pickled Python objects ({_refused_global(e)}), which could run "
            "code when loaded; nmt checkpoints before format 2 do. Only if you trust the file: set "
            "allow_pickle=true (convert it once with nmt-export ckpt=... format=release allow_pickle=true)"
        ) from None
    except (RuntimeError, EOFError, zipfile.BadZipFile, OSError) as e:
        raise CheckpointError(f"{path}: truncated or corrupt checkpoint ({str(e).strip().splitlines()[0]})") from None
    if not isinstance(checkpoint, dict) or "state_dict" not in checkpoint:
        raise CheckpointError(f"{path}: a torch file, but not a checkpoint (no state_dict); give a .ckpt written by "
                              "nmt's train.py, nmt-average or nmt-export")
    version = checkpoint.get("nmt_format", 1)
    if not isinstance(version, int) or version > FORMAT:
        raise CheckpointError(f"{path}: checkpoint format {version} of a newer nmt (this version reads up to "
                              f"{FORMAT}); upgrade nmt to use it")
    if "run_config" not in checkpoint or "tokenizers" not in checkpoint:
        raise CheckpointError(f"{path}: no saved run config/tokenizers: it was not written by nmt")
    state, protos = checkpoint["state_dict"], checkpoint["tokenizers"]
    run_config = checkpoint["run_config"]
    if not isinstance(run_config, dict) or not all(isinstance(run_config.get(k, {}), dict) for k in ("model", "data")):
        raise CheckpointError(f"{path}: its run config is not a mapping with model and data sections: it was not "
                              "written by nmt")
    if not isinstance(state, dict) or not all(isinstance(k, str) and torch.is_tensor(v) for k, v in state.items()):
        raise CheckpointError(f"{path}: its state_dict is not a mapping of names to tensors: it was not written by nmt")
    if not isinstance(protos, dict) or not all(isinstance(protos.get(side), bytes) for side in ("src", "tgt")):
        raise CheckpointError(f"{path}: its tokenizers are not two SentencePiece models: it was not written by nmt")
    return checkpoint


def check_run_config(checkpoint: dict[str, Any], source: str | Path) -> None:
    """Refuse (``CheckpointError``) a checkpoint whose model or data config would build anything but
    nmt's own classes or read the environment (``nmt.file_config.check``)."""
    run_config = checkpoint["run_config"]
    if not isinstance(run_config, dict):
        raise CheckpointError(f"{source}: its run config is a {type(run_config).__name__}, not a mapping")
    for section in ("model", "data"):
        if section in run_config:
            try:
                file_config.check(run_config[section], section, str(source))
            except file_config.ConfigRefused as e:
                raise CheckpointError(str(e)) from None


def checkpoint_kind(checkpoint: dict[str, Any]) -> str:
    """``training`` (resumable) or ``release`` (weights, config and vocabularies only)."""
    return checkpoint.get("kind", "training")


def tokenizer_protos(src_vocab: Tokenizer, tgt_vocab: Tokenizer) -> dict[str, bytes]:
    """The serialized SentencePiece models, stored in every checkpoint."""
    return {"src": src_vocab.sp.serialized_model_proto(), "tgt": tgt_vocab.sp.serialized_model_proto()}


def tokenizer_from_proto(proto: bytes, name: str) -> Tokenizer:
    """The ``name`` (src or tgt) tokenizer saved in a checkpoint, checked (``Tokenizer.from_proto``)."""
    try:
        return Tokenizer.from_proto(proto, f"the {name} tokenizer saved in the checkpoint")
    except ValueError as e:
        raise CheckpointError(str(e)) from None


def check_weights(model: torch.nn.Module, state_dict: dict[str, torch.Tensor], source: str) -> None:
    """Raise a ValueError naming every missing, unexpected or differently shaped weight."""
    own = model.state_dict()
    missing = sorted(set(own) - set(state_dict))
    unexpected = sorted(set(state_dict) - set(own))
    shapes = [
        f"{k}: checkpoint {tuple(state_dict[k].shape)} vs config {tuple(own[k].shape)}"
        for k in sorted(set(own) & set(state_dict))
        if own[k].shape != state_dict[k].shape
    ]
    if missing or unexpected or shapes:
        parts = []
        if shapes:
            parts.append("different shapes:\n  " + "\n  ".join(shapes[:20]))
        if missing:
            parts.append("missing from the checkpoint: " + ", ".join(missing[:20]))
        if unexpected:
            parts.append("not in the model: " + ", ".join(unexpected[:20]))
        raise ValueError(
            f"{source} does not match the model config (model type, sizes or vocabulary differ):\n"
            + "\n".join(parts)
            + "\nUse the config the checkpoint was trained with (it is saved in the checkpoint)."
        )


def model_state(checkpoint: dict[str, Any]) -> dict[str, torch.Tensor]:
    """The Seq2Seq weights of a Lightning checkpoint (the module's ``model.`` prefix removed)."""
    return {k[len("model."):]: v for k, v in checkpoint["state_dict"].items() if k.startswith("model.")}


def load_checkpoint(path: str | Path, device: torch.device | str = "cpu", allow_pickle: bool = False) -> Loaded:
    """Model (in eval mode), tokenizers and run config of a training or release checkpoint. The
    model is built from the checkpoint's config by ``nmt.file_config``: nmt's model classes only,
    and weights that fit the config before any memory is spent on them."""
    path = Path(path)
    checkpoint = read_checkpoint(path, allow_pickle)
    run_config = checkpoint["run_config"]
    if not isinstance(run_config, dict) or not isinstance(run_config.get("model"), dict):
        raise CheckpointError(f"{path}: its run config has no model section; give a .ckpt written by nmt")
    try:
        model_cfg = file_config.check(run_config["model"], "model", str(path))
        model = file_config.build_model(model_cfg, model_state(checkpoint), str(path), check_weights)
    except file_config.ConfigRefused as e:
        raise CheckpointError(str(e)) from None
    if bad := nonfinite(model.state_dict().items()):
        raise CheckpointError(f"{path}: weights hold NaN or infinity ({', '.join(bad[:5])}); the file is damaged or "
                              "its training diverged: use another checkpoint")
    model.to(device).eval()
    protos = checkpoint["tokenizers"]
    log.info("loaded %s (%s, step %s)", path, checkpoint_kind(checkpoint), checkpoint.get("global_step"))
    return Loaded(model, tokenizer_from_proto(protos["src"], "src"), tokenizer_from_proto(protos["tgt"], "tgt"), run_config,
                  checkpoint.get("global_step"), run_report(checkpoint, path))


MAX_REPORT_BYTES = {"json": 4 << 20, "png": 16 << 20}


def _report(summary: Any, png: Any) -> dict[str, Any] | None:
    """A report of plain data, or None when ``summary`` is not a JSON object or ``png`` not a PNG."""
    if isinstance(summary, (str, bytes)):
        try:
            summary = json.loads(summary)
        except (ValueError, RecursionError):
            return None
    if not isinstance(summary, dict):
        return None
    if not (isinstance(png, bytes) and png.startswith(b"\x89PNG\r\n\x1a\n") and len(png) <= MAX_REPORT_BYTES["png"]):
        png = None
    return {"summary": summary, "png": png}


def run_report(checkpoint: dict[str, Any], path: str | Path) -> dict[str, Any] | None:
    """The test report of the checkpoint's run: embedded in a release file, or, for a file in a
    run's ``checkpoints/`` folder, ``bleu_by_length.json``/``.png`` of that run folder. Never read
    from a path the checkpoint's config names; files over ``MAX_REPORT_BYTES`` are left out."""
    if checkpoint_kind(checkpoint) == "release":
        embedded = checkpoint.get("report")
        return _report(embedded.get("summary"), embedded.get("png")) if isinstance(embedded, dict) else None
    folder = Path(path).resolve().parent
    if folder.name != CHECKPOINTS:
        return None
    files = {kind: folder.parent / f"{REPORT_STEM}.{kind}" for kind in ("json", "png")}
    found = {kind: f.read_bytes() if f.is_file() and f.stat().st_size <= MAX_REPORT_BYTES[kind] else None
             for kind, f in files.items()}
    return _report(found["json"], found["png"]) if found["json"] is not None else None


def saved_vocabularies(path: str | Path) -> tuple[Tokenizer, Tokenizer]:
    """Source and target tokenizers to train with instead of training new ones (``data.vocab_from``):
    those saved in a checkpoint written by ``train.py``, or one SentencePiece ``.model`` file for both
    sides (its special ids must be PAD=0, UNK=1, BOS=2, EOS=3)."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"data.vocab_from={path}: no such file (give a checkpoint written by "
                                "train.py or a SentencePiece .model file)")
    if zipfile.is_zipfile(path):  # torch.save's format
        try:
            checkpoint = read_checkpoint(path, what="data.vocab_from")
        except CheckpointError as e:
            raise CheckpointError(f"data.vocab_from={e}") from None
        protos = checkpoint["tokenizers"]
        if not {"src", "tgt"} <= set(protos):
            raise ValueError(f"data.vocab_from={path}: the checkpoint has no saved tokenizers "
                             "(it was not written by nmt)")
        src = tokenizer_from_proto(protos["src"], "src")
        return src, src if protos["tgt"] == protos["src"] else tokenizer_from_proto(protos["tgt"], "tgt")
    try:
        tok = Tokenizer(path)
    except (RuntimeError, OSError) as e:
        raise ValueError(f"data.vocab_from={path}: not a SentencePiece model ({e}); give a "
                         "checkpoint written by train.py or a SentencePiece .model file") from e
    except ValueError as e:  # special ids other than nmt's
        raise ValueError(f"data.vocab_from={e}") from e
    return tok, tok


def nonfinite(tensors: Iterable[tuple[str, torch.Tensor]]) -> list[str]:
    """Names of the floating-point tensors holding a NaN or an infinity (one host sync in all)."""
    named = [(name, t) for name, t in tensors if torch.is_tensor(t) and t.is_floating_point()]
    if not named:
        return []
    flags = [torch.isfinite(t).all() for _, t in named]
    finite = torch.stack([f.to(flags[0].device) for f in flags]).tolist()
    return [name for (name, _), ok in zip(named, finite) if not ok]


def vocab_pieces(sp: spm.SentencePieceProcessor) -> list[str]:
    return [sp.id_to_piece(i) for i in range(sp.get_piece_size())]


def check_resume(path: str | Path, model: torch.nn.Module, src_vocab: Tokenizer, tgt_vocab: Tokenizer,
                 allow_pickle: bool = False) -> None:
    """Before resuming training from ``path``: it must be a training checkpoint, its SentencePiece
    vocabularies must be the ones of the configured data and its weights must fit ``model``, else
    a ValueError names what differs (the vocabulary first: another vocabulary also changes the
    embedding shapes)."""
    checkpoint = read_checkpoint(path, allow_pickle, what="ckpt_path")
    if checkpoint_kind(checkpoint) != "training" or "optimizer_states" not in checkpoint:
        raise CheckpointError(
            f"ckpt_path={path}: a {checkpoint_kind(checkpoint)} file saved with weights only (no optimizer "
            "or training state) cannot resume training; resume from the run's checkpoints/last.ckpt, or "
            "translate/evaluate with this file"
        )
    for side, vocab in (("src", src_vocab), ("tgt", tgt_vocab)):
        proto = checkpoint.get("tokenizers", {}).get(side)
        if proto is None:
            continue
        saved, now = vocab_pieces(tokenizer_from_proto(proto, side).sp), vocab_pieces(vocab.sp)
        if saved != now:
            i = next((i for i, (a, b) in enumerate(zip(saved, now)) if a != b), min(len(saved), len(now)))
            raise ValueError(
                f"{path} was trained with another {side} vocabulary ({len(saved)} pieces, the data config "
                f"gives {len(now)}; first difference at id {i}): resume with the data config it was trained with, "
                f"or set data.vocab_from={path} to continue on other data with its vocabulary"
            )
    check_weights(model, model_state(checkpoint), str(path))


def current_umask() -> int:
    """The process's file-creation mask: from /proc on Linux (no race with other threads), else
    read by setting it and setting it back at once."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def atomic_save(obj: Any, path: str | Path) -> None:
    """``torch.save`` to a temporary file in the target folder, flushed to disk, then renamed over
    ``path``: a crash while saving leaves the previous file intact and no half-written one."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        os.fchmod(fd, 0o666 & ~current_umask())  # as open() would create it (mkstemp's file is 0600)
        with os.fdopen(fd, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def model_weights(checkpoint: dict[str, Any], weights: str = "stored") -> dict[str, torch.Tensor]:
    """The module weights (``model.`` prefixed) of a checkpoint: ``stored`` (its ``state_dict``:
    the averaged weights of a run with ``callbacks.ema``) or ``raw`` (the weights being trained,
    ``current_model_state``, which only an EMA run saves besides)."""
    if weights == "stored":
        return checkpoint["state_dict"]
    if weights == "raw":
        return checkpoint.get("current_model_state", checkpoint["state_dict"])
    raise ValueError(f"weights={weights!r}: choose stored or raw")


def release(checkpoint: dict[str, Any], source: str | Path, weights: str = "stored", **extra: Any) -> dict[str, Any]:
    """A release checkpoint: the Seq2Seq weights, run config, vocabularies and test report (if the
    run has one) of ``checkpoint``, without optimizer, loop, callback or RNG state (loadable by
    translate, evaluate and serve). Its config is checked first (``check_run_config``): a crafted
    file is not repackaged."""
    check_run_config(checkpoint, source)
    state = {k: v for k, v in model_weights(checkpoint, weights).items() if k.startswith("model.")}
    return {
        "nmt_format": FORMAT, "kind": "release", "state_dict": state,
        "run_config": checkpoint["run_config"], "tokenizers": checkpoint["tokenizers"],
        "global_step": checkpoint.get("global_step"), "epoch": checkpoint.get("epoch"),
        "monitor": checkpoint.get("monitor"), "source": {"path": str(source), "weights": weights},
        "report": run_report(checkpoint, source), **extra,
    }


# --- fine-tuning: a new run that starts from a file's weights (init_from) -------------------------

# Model config keys (by name, at any depth) a fine-tuning run may set otherwise than its init_from
# file: they change how the weights are trained (dropout, recomputation, shifted training
# positions) or first drawn (init, replaced by the file's weights), not their shapes or what the
# trained model computes. Every other model key must be the file's.
MAY_DIFFER = ("dropout", "attention_dropout", "activation_dropout", "gradient_checkpointing", "position_shift", "init")
INIT_OPTIMIZER = ("fresh", "keep")  # init_optimizer: a new optimizer state, or the file's per-parameter state


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


def check_init_vocabularies(checkpoint: dict[str, Any], src_vocab: Tokenizer, tgt_vocab: Tokenizer,
                            path: str | Path, vocab_from: str) -> None:
    """Refuse (ValueError) vocabularies (``data.vocab_from``) other than the ``init_from`` file's."""
    for side, vocab in (("src", src_vocab), ("tgt", tgt_vocab)):
        saved = vocab_pieces(tokenizer_from_proto(checkpoint["tokenizers"][side], side).sp)
        now = vocab_pieces(vocab.sp)
        if saved != now:
            i = next((i for i, (a, b) in enumerate(zip(saved, now)) if a != b), min(len(saved), len(now)))
            raise ValueError(f"init_from={path}: data.vocab_from={vocab_from} gives another {side} vocabulary "
                             f"({len(now)} pieces, the file's {len(saved)}; first difference at id {i}); leave "
                             "data.vocab_from unset to train with the file's")


def init_weights(model: torch.nn.Module, checkpoint: dict[str, Any], path: str | Path, weights: str = "stored") -> None:
    """Load the ``init_from`` file's Seq2Seq weights (``model_weights``: ``stored`` or ``raw``) into
    ``model``, every name and shape checked first (``check_weights``)."""
    state = {k[len("model."):]: v for k, v in model_weights(checkpoint, weights).items() if k.startswith("model.")}
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
