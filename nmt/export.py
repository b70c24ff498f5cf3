"""Export a checkpoint for deployment: ``nmt-export ckpt=<file> format=release|ctranslate2|huggingface out=<path>``.

``release``: one file with the weights, run config and vocabularies, without optimizer, loop,
callback or RNG state; ``translate.py`` and ``evaluate.py`` load it like a checkpoint (resuming
from it is refused). ``ctranslate2``: a CTranslate2 model folder (Transformers only; see
``nmt.exporters.ctranslate2``). ``huggingface``: a folder ``transformers`` loads with
``AutoModelForSeq2SeqLM`` and ``AutoTokenizer`` (Transformers that one of its classes expresses
exactly; see ``nmt.exporters.huggingface``). All are written under a temporary name and renamed when complete,
so a failed export leaves nothing behind. ``weights=raw`` exports the weights being trained
instead of their moving average (runs with ``callbacks.ema``).
"""

from __future__ import annotations

import logging
from pathlib import Path

from omegaconf import DictConfig

from nmt.cli_io import hydra_command, stop_within_grace
from nmt.checkpoints.files import atomic_save, checkpoint_kind, model_weights, read_checkpoint
from nmt.checkpoints.loading import load_checkpoint
from nmt.checkpoints.release import release

log = logging.getLogger(__name__)

FORMATS = ("release", "ctranslate2", "huggingface")
PACKAGES = {"ctranslate2": ("ctranslate2", "export"), "huggingface": ("transformers", "hf")}  # format: module, extra


def export_release(ckpt: str | Path, out: str | Path, weights: str = "stored", allow_pickle: bool = False) -> Path:
    """Write the release file of ``ckpt`` to ``out``; logs both sizes."""
    ckpt, out = Path(ckpt), Path(out)
    with stop_within_grace():  # a signal stops the read within the grace, before anything is written
        checkpoint = read_checkpoint(ckpt, allow_pickle)
    model_weights(checkpoint, weights)  # the choice is valid
    atomic_save(release(checkpoint, ckpt, weights), out)
    log.info("release file %s: %.1f MB (the %s checkpoint: %.1f MB)", out, out.stat().st_size / 1e6,
             checkpoint_kind(checkpoint), ckpt.stat().st_size / 1e6)
    return out


def export(cfg: DictConfig) -> Path:
    if cfg.format not in FORMATS:
        raise ValueError(f"format={cfg.format}: choose one of {', '.join(FORMATS)}")
    if not cfg.get("out"):
        raise ValueError("out=???: give the file (format=release) or folder (format=ctranslate2) to write")
    if cfg.format == "release":
        return export_release(cfg.ckpt, cfg.out, cfg.weights, cfg.allow_pickle)
    if cfg.weights != "stored":
        raise ValueError("weights=raw: export a release file with weights=raw first, then convert that file")
    if cfg.format == "huggingface" and cfg.get("quantization") is not None:
        raise ValueError(f"quantization={cfg.quantization}: format=huggingface writes fp32 weights; quantize in "
                         "transformers, or export format=ctranslate2")
    module, extra = PACKAGES[cfg.format]
    with stop_within_grace():  # the package's import and the model's load
        try:
            if cfg.format == "ctranslate2":
                from nmt.exporters.ctranslate2 import to_ctranslate2 as write
            else:
                import transformers  # noqa: F401  (before the checkpoint is read: a missing package is the first error)

                from nmt.exporters.huggingface import to_huggingface as write
        except ModuleNotFoundError as e:
            if e.name != module:
                raise
            raise ImportError(f"format={cfg.format} needs the {module} package: pip install 'nmt[{extra}]'") from None
        loaded = load_checkpoint(cfg.ckpt, allow_pickle=cfg.allow_pickle)
    options = {"quantization": cfg.get("quantization")} if cfg.format == "ctranslate2" else {}
    out = write(loaded.model, loaded.src_vocab, loaded.tgt_vocab, loaded.run_config, cfg.out, **options)
    log.info("%s model -> %s", cfg.format, out)
    return out


main = hydra_command("export", export)  # nmt-export: nmt/conf/export.yaml

if __name__ == "__main__":
    main()
