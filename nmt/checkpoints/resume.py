"""Resuming training: the checkpoint must be a training one, of the configured vocabularies and model."""

from __future__ import annotations

from pathlib import Path

import torch

from nmt.checkpoints.files import (CheckpointError, check_weights, checkpoint_kind, model_state, read_checkpoint,
                                   vocabulary_difference)
from nmt.data.tokenizer import Tokenizer


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
        if found := vocabulary_difference(proto, side, vocab):
            i, saved, now = found
            raise ValueError(
                f"{path} was trained with another {side} vocabulary ({saved} pieces, the data config "
                f"gives {now}; first difference at id {i}): resume with the data config it was trained with, "
                f"or set data.vocab_from={path} to continue on other data with its vocabulary"
            )
    check_weights(model, model_state(checkpoint), str(path))
