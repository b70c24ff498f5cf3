"""Import a model trained elsewhere as an nmt release file:
``nmt-import format=huggingface src=<MarianMTModel folder or hub id> out=model.ckpt``.

The file is what ``nmt-export format=release`` writes (weights, run config, vocabularies), so
``translate.py``, ``evaluate.py``, ``nmt-serve``, ``nmt-export`` and ``distill.py`` take it like any
other, and ``train.py init_from=model.ckpt`` fine-tunes it. ``huggingface``: a ``MarianMTModel``
folder (OPUS-MT), see ``nmt.checkpoints.marian``, or an ``M2M100ForConditionalGeneration`` one
(M2M100), see ``nmt.checkpoints.m2m100``; weights from ``model.safetensors`` only unless
``allow_pickle=true``. The file is written under a temporary name and read back with
``load_checkpoint`` before the command ends.
"""

from __future__ import annotations

import logging
from pathlib import Path

from omegaconf import DictConfig

from nmt.checkpoints.files import atomic_save
from nmt.checkpoints.loading import load_checkpoint
from nmt.checkpoints.m2m100 import import_folder
from nmt.cli_io import hydra_command, stop_within_grace
from nmt.languages.tags import vocabulary_languages

log = logging.getLogger(__name__)

FORMATS = ("huggingface",)


def import_model(cfg: DictConfig) -> Path:
    """Write the release file of ``cfg.src`` to ``cfg.out``; the path."""
    if cfg.format not in FORMATS:
        raise ValueError(f"format={cfg.format}: choose one of {', '.join(FORMATS)} (a MarianMTModel or M2M100 folder)")
    if not cfg.get("src") or not cfg.get("out"):
        raise ValueError("src=??? out=???: give the folder (or hub id) to import and the release file to write")
    out = Path(str(cfg.out))
    if out.is_dir():
        raise ValueError(f"out={out}: is a folder; give the release file to write (model.ckpt)")
    if out.suffix.lower() == ".safetensors":
        raise ValueError(f"out={out}: a .safetensors name, but the release file is a torch checkpoint that every "
                         "nmt command reads as one; name it model.ckpt")
    src = Path(str(cfg.src))
    if src.is_dir() and out.resolve().is_relative_to(src.resolve()):
        raise ValueError(f"out={out}: inside the folder being imported (src={cfg.src}); writing there could replace "
                         "its files: write the release file outside it")
    with stop_within_grace():  # a signal stops the folder's read within the grace, before anything is written
        checkpoint = import_folder(str(cfg.src), allow_pickle=bool(cfg.allow_pickle), revision=cfg.get("revision"))
    atomic_save(checkpoint, out)
    loaded = load_checkpoint(out)  # what every command does with it
    model = checkpoint["run_config"]["model"]
    languages = vocabulary_languages(loaded.src_vocab.sp)
    log.info("imported %s -> %s: %d+%d layers, width %d, %s, %d source / %d target pieces%s", cfg.src, out,
             model["encoder"]["num_layers"], model["decoder"]["num_layers"], model["hidden_size"],
             model["encoder"]["activation"], loaded.src_vocab.vocab_size, loaded.tgt_vocab.vocab_size,
             f", target languages {', '.join(languages)} (tgt_lang=...)" if languages else "")
    return out


main = hydra_command("import_model", import_model)  # nmt-import: nmt/conf/import_model.yaml

if __name__ == "__main__":
    main()
