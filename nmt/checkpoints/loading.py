"""Open a checkpoint or release file for use: the model rebuilt from its saved config (nmt's own
classes only, weights checked against it), its tokenizers, and its run's test report."""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from nmt.checkpoints import file_config
from nmt.checkpoints.files import (CheckpointError, check_weights, checkpoint_kind, model_state, nonfinite,
                                   read_checkpoint, tokenizer_from_proto)
from nmt.data.tokenizer import Tokenizer
from nmt.runs.files import CHECKPOINTS, REPORT_STEM

log = logging.getLogger(__name__)


@dataclass
class Loaded:
    model: torch.nn.Module
    src_vocab: Tokenizer
    tgt_vocab: Tokenizer
    run_config: dict[str, Any]
    step: int | None = None  # the global step of the weights
    report: dict[str, Any] | None = None  # the run's test report: {"summary": dict, "png": bytes | None}
    members: list[Loaded] | None = None  # an ensemble's files, each as loaded alone (``load_ensemble``)


def load_checkpoint(path: str | Path, device: torch.device | str = "cpu", allow_pickle: bool = False) -> Loaded:
    """Model (in eval mode), tokenizers and run config of a training or release checkpoint. The
    model is built from the checkpoint's config by ``nmt.checkpoints.file_config``: nmt's model classes only,
    and weights that fit the config before any memory is spent on them."""
    path = Path(path)
    checkpoint = read_checkpoint(path, allow_pickle)
    run_config = checkpoint["run_config"]
    if not isinstance(run_config, dict) or not isinstance(run_config.get("model"), dict):
        raise CheckpointError(f"{path}: its run config has no model section; give a .ckpt written by nmt")
    try:
        model_cfg = file_config.check(run_config["model"], "model", str(path))
        model = file_config.build_model(model_cfg, model_state(checkpoint, source=path), str(path), check_weights)
    except file_config.ConfigRefused as e:
        raise CheckpointError(str(e)) from None
    if bad := nonfinite(model.state_dict().items()):
        raise CheckpointError(f"{path}: weights hold NaN or infinity ({', '.join(bad[:5])}); the file is damaged or "
                              "its training diverged: use another checkpoint")
    protos = checkpoint["tokenizers"]
    src_vocab, tgt_vocab = tokenizer_from_proto(protos["src"], "src", path), tokenizer_from_proto(protos["tgt"], "tgt", path)
    check_vocabulary_sizes(model, src_vocab.vocab_size, tgt_vocab.vocab_size, path)
    model.to(device).eval()
    log.info("loaded %s (%s, step %s)", path, checkpoint_kind(checkpoint), checkpoint.get("global_step"))
    return Loaded(model, src_vocab, tgt_vocab, run_config, checkpoint.get("global_step"), run_report(checkpoint, path))


def check_vocabulary_sizes(model: torch.nn.Module, src_size: int, tgt_size: int, path: str | Path) -> None:
    """The model and its two tokenizers agree: each tokenizer has as many pieces as the model's
    config says (``src_vocab_size``, ``tgt_vocab_size``), and every embedding and output layer has
    a row for each piece; else a one-line CheckpointError naming the file. A source piece without
    a row fails inside the embedding; a target row without a piece, inside ``decode``."""
    sides = (("src", src_size, "src_vocab_size", (("the source embedding", model.encoder.embed),)),
             ("tgt", tgt_size, "tgt_vocab_size", (("the target embedding", model.decoder.embed),
                                                   ("the output layer", model.decoder.out))))
    for side, size, key, layers in sides:
        declared = getattr(model, key, None)
        if declared != size:
            raise CheckpointError(f"{path}: its {side} tokenizer has {size:,} pieces but the model was built for "
                                  f"model.{key}={declared}; the file's vocabulary and weights do not belong together: "
                                  "use a checkpoint written by nmt as it was saved")
        for what, layer in layers:
            rows = int(layer.weight.shape[0])
            if rows < size:
                raise CheckpointError(f"{path}: its {side} tokenizer has {size:,} pieces but {what} has {rows:,} rows; "
                                      "the file's vocabulary and weights do not belong together: use a checkpoint "
                                      "written by nmt as it was saved")


MAX_REPORT_BYTES = {"json": 4 << 20, "png": 16 << 20}


def _report(summary: Any, png: Any) -> dict[str, Any] | None:
    """A report of plain data, or None when ``summary`` is not a JSON object of at most
    ``MAX_REPORT_BYTES`` (a run folder's limit, also for a release file's embedded text) or ``png``
    not a PNG."""
    if isinstance(summary, (str, bytes)) and len(summary) > MAX_REPORT_BYTES["json"]:
        log.warning("the report's summary is %s characters, more than a report's %s: left out", f"{len(summary):,}",
                    f"{MAX_REPORT_BYTES['json']:,}")
        return None
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


MAX_MEMBERS = 16  # the most files an ensemble loads (each is a whole model in memory)


def load_ensemble(paths: list[str | Path], device: torch.device | str = "cpu", allow_pickle: bool = False) -> Loaded:
    """Several checkpoints or release files as one model (``nmt.models.ensemble``): each loaded as
    ``load_checkpoint`` does, then checked to read the same source ids and write the same target
    vocabulary (pieces, scores and a multilingual model's language tags); a one-line CheckpointError
    names the two files that differ. One path is that file's model alone. The run config, step and
    report are the first file's."""
    from nmt.languages.tags import vocabulary_languages
    from nmt.models.ensemble import Ensemble

    if not paths:
        raise CheckpointError("ckpt=[]: give one or more checkpoint or release files")
    if len(paths) > MAX_MEMBERS:
        raise CheckpointError(f"an ensemble of {len(paths)} files: at most {MAX_MEMBERS} models decode as one "
                              "(each step runs every member's decoder)")
    members = [load_checkpoint(p, device=device, allow_pickle=allow_pickle) for p in paths]
    first = members[0]
    for path, other in zip(paths[1:], members[1:]):
        for side in ("src", "tgt"):
            a, b = getattr(first, f"{side}_vocab"), getattr(other, f"{side}_vocab")
            if a.pieces_digest == b.pieces_digest:
                continue
            tags_a, tags_b = vocabulary_languages(a.sp), vocabulary_languages(b.sp)
            what = (f"language tags ({', '.join(tags_a) or 'none'} against {', '.join(tags_b) or 'none'})"
                    if tags_a != tags_b else f"{'source' if side == 'src' else 'target'} vocabularies")
            raise CheckpointError(f"{paths[0]} and {path} have different {what}: the models of an ensemble must "
                                  "share their tokenizers (train them on the same data and tokenizer settings, or "
                                  "fine-tune one from the other)")
    if len(members) == 1:
        return first
    model = Ensemble([m.model for m in members]).to(device).eval()
    return Loaded(model, first.src_vocab, first.tgt_vocab, first.run_config, first.step, first.report, members)
