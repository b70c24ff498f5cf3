"""Checkpoints: rebuild the model from the config saved in the checkpoint, check that the weights
fit it (for translation and for resuming training), restore the SentencePiece models saved beside
them, and write checkpoint files atomically, never with non-finite weights."""

from __future__ import annotations

import logging
import zipfile
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import sentencepiece as spm
import torch
from hydra.utils import instantiate
from omegaconf import OmegaConf

from nmt.data.tokenizer import Tokenizer

log = logging.getLogger(__name__)


@dataclass
class Loaded:
    model: torch.nn.Module
    src_vocab: Tokenizer
    tgt_vocab: Tokenizer
    run_config: dict[str, Any]


def tokenizer_protos(src_vocab: Tokenizer, tgt_vocab: Tokenizer) -> dict[str, bytes]:
    """The serialized SentencePiece models, stored in every checkpoint."""
    return {"src": src_vocab.sp.serialized_model_proto(), "tgt": tgt_vocab.sp.serialized_model_proto()}


def tokenizer_from_proto(proto: bytes, name: str) -> Tokenizer:
    tok = Tokenizer.__new__(Tokenizer)
    tok.model_file, tok.trained = f"<checkpoint:{name}>", False
    tok.sp = spm.SentencePieceProcessor(model_proto=proto)
    return tok


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


def load_checkpoint(path: str | Path, device: torch.device | str = "cpu", model_config: dict | None = None) -> Loaded:
    """Model (in eval mode), tokenizers and run config of a checkpoint written by ``train.py``.
    ``model_config`` replaces the saved model config (it must fit the weights)."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"checkpoint not found: {path} (set ckpt=<run>/checkpoints/<file>.ckpt)")
    checkpoint = torch.load(path, map_location="cpu", weights_only=False)
    if "run_config" not in checkpoint or "tokenizers" not in checkpoint:
        raise ValueError(f"{path} has no saved run config/tokenizers: it was not written by nmt's train.py")
    run_config = checkpoint["run_config"]
    model_cfg = OmegaConf.create(model_config if model_config is not None else run_config["model"])
    model = instantiate(model_cfg)
    state = model_state(checkpoint)
    check_weights(model, state, str(path))
    model.load_state_dict(state)
    model.to(device).eval()
    protos = checkpoint["tokenizers"]
    log.info("loaded %s (step %s)", path, checkpoint.get("global_step"))
    return Loaded(model, tokenizer_from_proto(protos["src"], "src"), tokenizer_from_proto(protos["tgt"], "tgt"), run_config)


def saved_vocabularies(path: str | Path) -> tuple[Tokenizer, Tokenizer]:
    """Source and target tokenizers to train with instead of training new ones (``data.vocab_from``):
    those saved in a checkpoint written by ``train.py``, or one SentencePiece ``.model`` file for both
    sides (its special ids must be PAD=0, UNK=1, BOS=2, EOS=3)."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"data.vocab_from={path}: no such file (give a checkpoint written by "
                                "train.py or a SentencePiece .model file)")
    if zipfile.is_zipfile(path):  # torch.save's format
        checkpoint = torch.load(path, map_location="cpu", weights_only=False, mmap=True)
        protos = checkpoint.get("tokenizers") if isinstance(checkpoint, dict) else None
        if not protos or not {"src", "tgt"} <= set(protos):
            raise ValueError(f"data.vocab_from={path}: the checkpoint has no saved tokenizers "
                             "(it was not written by nmt's train.py)")
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


def check_resume(path: str | Path, model: torch.nn.Module, src_vocab: Tokenizer, tgt_vocab: Tokenizer) -> None:
    """Before resuming training from ``path``: its SentencePiece vocabularies must be the ones of
    the configured data and its weights must fit ``model``, else a ValueError names what differs
    (the vocabulary first: another vocabulary also changes the embedding shapes)."""
    checkpoint = torch.load(path, map_location="cpu", weights_only=False, mmap=True)
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
