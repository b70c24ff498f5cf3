"""Shared fixtures: the Hydra config composed for tiny, fast runs on the tiny corpus."""

from __future__ import annotations

import logging
import os
import resource
import signal
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, open_dict

from nmt import register_resolvers

ROOT = Path(__file__).resolve().parents[1]
CONF_DIR = ROOT / "nmt" / "conf"
SHARED_DATA = ROOT.parent / "shared" / "data"
# Configs for the tests alone (data=tiny reads tests/data/tiny, which the package does not ship):
# on Hydra's search path beside the package's configs, for the compose API and command lines alike.
TESTS_CONF = ROOT / "tests" / "conf"
SEARCH_PATH = f"hydra.searchpath=[file://{TESTS_CONF}]"

# Tiny models gain nothing from intra-op threads, and spinning OpenMP threads slow everything
# down badly when other processes share the cores; subprocesses inherit the setting.
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.pop("NMT_SERVE_API_KEY", None)  # nmt-serve's key (serve.yaml api_key): set only by the tests of it

torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
register_resolvers()  # as every entry point does: the configs the tests compose use pad_to

# Small enough for a CPU test, big enough to exercise every layer.
TINY = [
    SEARCH_PATH,
    "data=tiny",
    "trainer=cpu",
    "trainer.precision=32-true",  # the tolerances below are fp32's; precision=auto: test_precision.py
    "logger=csv",
    "model.emb_size=16",
    "model.hidden_size=16",
    "model.dropout=0.0",
    "position_shift=0",  # Transformer encoders: positions from 0, as in decoding (the shift has its own tests)
    "trainer.max_epochs=1",
    "trainer.max_steps=-1",  # epochs end these runs, not the preset's step budget
    "trainer.log_every_n_steps=1",
    "trainer.val_check_interval=1.0",
    "trainer.check_val_every_n_epoch=1",
    "trainer.max_time=null",
    "trainer.enable_model_summary=false",
    "callbacks.early_stopping=null",
    "callbacks.rich_progress_bar=null",
]

# nn.Linear's initialisation for the tiny Transformers trained to fluent output at a high learning
# rate: at widths of 16-64, Glorot-uniform weights (the default, larger there) leave them
# repeating pieces after the same few epochs, and the tests that compare outputs need sentences.
TORCH_INIT = ["model.encoder.init=torch", "model.decoder.init=torch"]


@contextmanager
def file_size_limit(nbytes: int) -> Iterator[None]:
    """In this process, a write that takes a file beyond ``nbytes`` fails with EFBIG, as writes do
    on a full disk (the signal that would kill the process ignored, as its default is)."""
    handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (nbytes, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, handler)


def pytest_addoption(parser):
    parser.addoption("--kernels", default="auto", choices=["auto", "reference", "cpu"],
                     help="the kernels= of every training run composed by compose_train (nmt.kernels)")


def pytest_configure(config):
    KERNELS[0] = config.getoption("--kernels")


KERNELS = ["auto"]  # set from --kernels


def heads(model: str) -> list[str]:
    """Overrides that shrink attention heads/feed-forward for whichever parts are Transformers."""
    overrides = []
    for part in ("encoder", "decoder"):
        if model == "transformer":
            overrides += [f"model.{part}.num_heads=2", f"model.{part}.ff_size=32", f"model.{part}.num_layers=2"]
    return overrides


def compose_train(tmp_path: Path, overrides: list[str] = (), model: str | None = "lstm_bahdanau") -> DictConfig:
    """The train config for a tiny run writing under ``tmp_path``, with Hydra's runtime set
    (``model=None`` keeps the model and its sizes from the config, e.g. an experiment's)."""
    model_overrides = [f"model={model}", *heads(model)] if model else []
    tiny = [o for o in TINY if model or not o.startswith("model.")]
    return compose_run("train", tmp_path / "run", [*model_overrides, *tiny, f"kernels={KERNELS[0]}", *overrides],
                       cache_dir=tmp_path.parent / "nmt-cache")


def compose_run(config_name: str, out_dir: Path, overrides: list[str], cache_dir: Path | None = None) -> DictConfig:
    """The config ``config_name`` with ``overrides``, as Hydra's entry point sees it: its runtime
    set (``paths.output_dir`` is ``out_dir``), for running a command's body in this process."""
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose(config_name, overrides=list(overrides), return_hydra_config=True)
    with open_dict(cfg):
        cfg.hydra.runtime.output_dir = str(out_dir)
        cfg.hydra.runtime.cwd = str(ROOT)
        cfg.hydra.job.num = 0
        if cache_dir is not None:
            cfg.paths.cache_dir = str(cache_dir)
    HydraConfig().set_config(cfg)
    with open_dict(cfg):
        del cfg["hydra"]
    out_dir.mkdir(parents=True, exist_ok=True)
    return cfg


def train_with_callbacks(cfg: DictConfig, callbacks: list) -> dict:
    """``train(cfg)`` in this process with extra Lightning callback objects beside the config's."""
    import nmt.training.builders
    from nmt.train import train

    original = nmt.training.builders.instantiate_group

    def with_extra(group):
        built = original(group)
        return [*built, *callbacks] if group is cfg.get("callbacks") else built

    nmt.training.builders.instantiate_group = with_extra
    try:
        return train(cfg)
    finally:
        nmt.training.builders.instantiate_group = original


def evaluate_here(capsys, out_dir: Path, *overrides: str) -> Finished:
    """``evaluate.py <overrides>`` in this process, writing to ``out_dir`` (its run folder), with
    its exit status and nmt's log lines on stderr."""
    from nmt.cli_io import ending_cleanly
    from nmt.evaluate import evaluate

    cfg = compose_run("evaluate", out_dir, [SEARCH_PATH, *overrides])
    return captured(capsys, lambda: ending_cleanly()(evaluate)(cfg))


@pytest.fixture
def cfg_train(tmp_path: Path):
    def make(overrides: list[str] = (), model: str = "lstm_bahdanau") -> DictConfig:
        return compose_train(tmp_path, list(overrides), model)

    yield make
    GlobalHydra.instance().clear()


@pytest.fixture(scope="session")
def serve_ckpt(tmp_path_factory) -> Path:
    """A tiny Transformer and its run's BLEU-by-length report (test=true writes it): the model the
    nmt-serve tests serve."""
    from nmt.train import train

    tmp_path = tmp_path_factory.mktemp("serve")
    cfg = compose_train(tmp_path, ["trainer.max_epochs=3"], model="transformer")
    train(cfg)
    return Path(cfg.paths.output_dir) / "checkpoints" / "last.ckpt"


@dataclass
class Finished:
    """What a command left: its exit status, stdout and stderr."""

    returncode: int
    stdout: str
    stderr: str


def translate_here(capsys, *overrides: str) -> Finished:
    """``translate.py <overrides>`` in this process: what ``nmt.translate.main`` runs on the config
    Hydra composes from the same overrides, with nmt's log lines on stderr as Hydra's logging prints
    them. No run folder (``hydra.run.dir``): what needs one runs ``translate.py`` itself."""
    from nmt.cli_io import ending_cleanly
    from nmt.translate import translate_until_stopped

    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose("translate", overrides=list(overrides))
    return captured(capsys, lambda: ending_cleanly()(translate_until_stopped)(cfg))


def captured(capsys, body: Callable[[], None]) -> Finished:
    """What ``body`` printed and its exit status (0, or the code of the ``SystemExit`` it raised),
    with nmt's log lines on stderr as Hydra's logging prints them."""
    capsys.readouterr()
    logger, handler = logging.getLogger("nmt"), logging.StreamHandler(sys.stderr)  # capsys's stderr
    level, status = logger.level, 0
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        body()
    except SystemExit as stop:
        status = stop.code
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
    out = capsys.readouterr()
    return Finished(status, out.out, out.err)


def serve_cfg(ckpt: Path, *overrides: str) -> DictConfig:
    """``nmt/conf/serve.yaml`` for ``ckpt`` with ``overrides``."""
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return compose("serve", overrides=[f"ckpt={ckpt}", *overrides])


# The files that take longest, first: pytest-xdist's --dist loadfile hands files to the workers in
# collection order, so a long file collected last keeps one worker busy after the others are done.
LONGEST_FIRST = ["test_export_ctranslate2.py", "test_reliability.py", "test_serve.py", "test_checkpoint_files.py",
                 "test_serve_hostile.py", "test_side_effects.py", "test_multilingual.py", "test_alignments.py",
                 "test_constraints.py", "test_configs.py", "test_translate_modes.py", "test_augment.py", "test_train.py"]


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: the rest keep their order
