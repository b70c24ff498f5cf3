"""Open the translator a config asks for: ``backend=torch`` (``nmt.inference.translator``: a checkpoint or
release file), ``backend=ctranslate2`` (``nmt.inference.ctranslate2``: a folder written by
``nmt-export format=ctranslate2``) or ``auto`` (the folder's kind decides). Each backend is
imported only when chosen, so the CTranslate2 path never imports torch.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from omegaconf import DictConfig, ListConfig, OmegaConf

from nmt.inference.ctranslate2 import is_export
from nmt.decoding.settings import SearchSettings

BACKENDS = ("auto", "torch", "ctranslate2")


def ckpt_paths(cfg: DictConfig) -> list[str]:
    """The files ``cfg.ckpt`` names: one path, or a list of them (``ckpt=[a.ckpt,b.ckpt]``: an ensemble)."""
    ckpt = cfg.ckpt
    if isinstance(ckpt, (ListConfig, list, tuple)):
        if not ckpt:
            raise ValueError("ckpt=[]: give a checkpoint or release file, or a list of them (an ensemble)")
        if not all(isinstance(p, str) for p in ckpt):
            raise ValueError(f"ckpt={list(ckpt)}: each member of an ensemble is a file path")
        return [str(p) for p in ckpt]
    return [str(ckpt)]


def backend_of(cfg: DictConfig) -> str:
    """The backend ``cfg.backend`` names, ``auto`` resolved by what ``cfg.ckpt`` is."""
    backend = str(cfg.get("backend", "auto"))
    if backend not in BACKENDS:
        raise ValueError(f"backend={backend}: choose one of {', '.join(BACKENDS)}")
    paths = ckpt_paths(cfg)
    if len(paths) > 1:
        if backend == "ctranslate2" or any(is_export(p) for p in paths):
            raise ValueError(f"ckpt={paths}: an ensemble decodes with the torch backend; give checkpoint or release "
                             "files, not CTranslate2 folders")
        return "torch"
    if backend == "auto":
        return "ctranslate2" if is_export(paths[0]) else "torch"
    return backend


def model_files(cfg: DictConfig) -> dict[str, str]:
    """The files whose reading ``nmt.cli_io.check_paths`` checks, by key: the checkpoint (each
    member of an ensemble: ``ckpt[i]``), or the folder's ``model.bin``."""
    paths = ckpt_paths(cfg)
    if backend_of(cfg) == "ctranslate2":
        return {"ckpt": str(Path(paths[0]) / "model.bin")}
    if len(paths) == 1:
        return {"ckpt": paths[0]}
    return {f"ckpt[{i}]": p for i, p in enumerate(paths)}


def search_settings(cfg: DictConfig) -> SearchSettings:
    decoding = cfg.get("decoding")
    return SearchSettings.from_config(OmegaConf.to_container(decoding) if isinstance(decoding, DictConfig) else decoding)


def open_translator(cfg: DictConfig) -> Any:
    """The translator of ``cfg`` (``translate.yaml``/``serve.yaml``: ckpt (a file, or a list: an ensemble), backend, device, precision,
    kernels, decoding, max_tokens, workers, ctranslate2.*)."""
    backend, settings = backend_of(cfg), search_settings(cfg)
    if backend == "ctranslate2":
        if str(cfg.precision) not in ("auto", "32"):
            raise ValueError(f"precision={cfg.precision} is the torch backend's; a CTranslate2 folder computes in "
                             "the type it was exported with, or ctranslate2.compute_type=int8|bfloat16|...")
        try:
            from nmt.inference.ctranslate2 import CTranslate2Translator
            import ctranslate2  # noqa: F401
        except ModuleNotFoundError as e:
            if e.name != "ctranslate2":
                raise
            raise ImportError("backend=ctranslate2 needs the ctranslate2 package: pip install 'nmt[export]'") from None
        options = cfg.get("ctranslate2") or {}
        return CTranslate2Translator(cfg.ckpt, settings, device=str(cfg.device),
                                     compute_type=str(options.get("compute_type", "default")),
                                     max_tokens=int(cfg.max_tokens), workers=cfg.workers,
                                     intra_threads=int(options.get("intra_threads", 1)))
    paths = ckpt_paths(cfg)
    for path in paths:
        if Path(path).is_dir():
            raise ValueError(f"ckpt={path}: a folder, and not a CTranslate2 export (no nmt_export.json and model.bin); "
                             "the torch backend reads a .ckpt or release file")
    from nmt.inference.translator import Translator

    return Translator.load(paths[0] if len(paths) == 1 else paths, device=str(cfg.device), precision=str(cfg.precision),
                           kernels=str(cfg.get("kernels", "auto")), allow_pickle=bool(cfg.allow_pickle),
                           decoding=settings, max_tokens=int(cfg.max_tokens), workers=cfg.workers)
