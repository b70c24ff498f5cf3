"""The frame of the GPU check (``scripts/gpu_check.py``): the run's mode (full or tiny), the time
caps of its parts within one deadline, the configs and data the parts share, and the loop that runs
each part, records its result or exception and rewrites the report after it."""

from __future__ import annotations

import gc
import json
import os
import re
import shutil
import signal
import time
import traceback
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from functools import partial
from pathlib import Path
from typing import Any, Callable, Iterable

import torch
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from hydra.core.hydra_config import HydraConfig
from hydra.utils import instantiate
from omegaconf import DictConfig, open_dict

from nmt import CONF_DIR
from nmt.bench import checkout
from nmt.bench.gpu.report import markdown

# Seconds: the cap of each part; the run's deadline leaves RESERVE for each part still to come.
BUDGET = {"env": 20, "data": 60, "presets": 200, "base": 110, "checkpointing": 30, "kv_cache": 45, "parity": 30, "attention": 40,
          "sdpa": 25}
DEADLINE = 440  # seconds from start; scripts/gpu_check.sh kills the run at 470, within 8 minutes
RESERVE = 8
TINY_DATA = ["data.source.num_pairs=2000", "data.source.valid_pairs=20", "data.source.test_pairs=16",
             "data.source.max_len=20", "data.max_tokens=512"]


@dataclass(frozen=True)
class Mode:
    """What a run measures with: full sizes on a GPU, or tiny (``--dry-run``)."""

    device: str
    tiny: bool
    steps: int  # optimizer steps per training
    warmup: int  # batches before the timed ones
    matmul_size: int
    memory_steps: int  # training steps of the checkpointing part

    @classmethod
    def make(cls, device: str, tiny: bool) -> "Mode":
        if tiny:
            return cls(device, True, steps=4, warmup=1, matmul_size=256, memory_steps=2)
        return cls(device, False, steps=200, warmup=20, matmul_size=8192, memory_steps=3)

    @property
    def cuda(self) -> bool:
        return self.device == "cuda"

    @property
    def timed(self) -> bool:
        """Whether the parts' time budgets stop them: on a device run (a lease is short). A dry run
        records every part's time but never stops on the clock, so a busy machine only slows it."""
        return not self.tiny

    def sizes(self, preset: str) -> list[str]:
        """Overrides of a model preset (or ``transformer_base``) and the data for this mode."""
        if not self.tiny:
            return []
        layers = [f"model.{part}.{key}" for part in ("encoder", "decoder") for key in ("num_layers=2", "ff_size=32")]
        if preset == "transformer_base":  # 8 heads of 2
            return [*TINY_DATA, "model.hidden_size=16", *layers]
        tiny = [*TINY_DATA, "model.emb_size=16", "model.hidden_size=16"]
        if preset == "transformer":
            tiny += [*layers, *(f"model.{part}.num_heads=2" for part in ("encoder", "decoder"))]
        return tiny


def model_choice(preset: str) -> str:
    return "experiment=transformer_base" if preset == "transformer_base" else f"model={preset}"


def slug(name: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-") or "device"


def first_line(exc: BaseException) -> str:
    text = f"{type(exc).__name__}: {exc}".strip()
    return text.splitlines()[0][:300]


class PartTimeout(Exception):
    """A part ran past its cap (SIGALRM)."""


class Check:
    """One run of the check: what the parts share (the device, the matmul peaks, the models trained
    for decoding, the data), the time left, and the report."""

    def __init__(self, mode: Mode, out_dir: Path, work: Path, cache_dir: Path | None, start: float) -> None:
        """``start``: the ``time.perf_counter()`` of the process's start, from which the deadline counts."""
        self.mode, self.out_dir, self.work, self.cache_dir, self.start = mode, out_dir, work, cache_dir, start
        self.device = torch.device(mode.device)
        self.peaks: dict[str, float] = {}
        self.models: dict[str, torch.nn.Module] = {}  # trained in parts 2-3, decoded in part 6
        self._datamodule = None
        self.part_end, self.budget, self.current = float("inf"), 0.0, ""
        name = torch.cuda.get_device_name(0) if mode.cuda else "cpu"
        self.name = ("dry-run-" if mode.tiny else "") + slug(name)
        self.report: dict[str, Any] = {
            "name": name, "dry_run": mode.tiny, "mode": asdict(mode),
            "started": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "deadline_s": DEADLINE, "parts": {},
        }

    # time
    def elapsed(self) -> float:
        return time.perf_counter() - self.start

    def left(self) -> float:
        """Seconds left in the current part."""
        return self.part_end - time.perf_counter()

    def say(self, message: str) -> None:
        print(f"[{self.elapsed():6.1f}s] {message}", flush=True)

    # configs and models
    def compose(self, overrides: list[str], run: str) -> DictConfig:
        """The train config with Hydra's runtime set, as tests/conftest.py composes it."""
        GlobalHydra.instance().clear()
        with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
            cfg = compose("train", overrides=overrides, return_hydra_config=True)
        with open_dict(cfg):
            cfg.hydra.runtime.output_dir = str(self.work / "runs" / run)
            cfg.hydra.runtime.cwd = str(checkout())
            cfg.hydra.job.num = 0
            if self.cache_dir is not None:
                cfg.paths.cache_dir = str(self.cache_dir)
        HydraConfig().set_config(cfg)
        with open_dict(cfg):
            del cfg["hydra"]
        return cfg

    def preset_config(self, preset: str, run: str, extra: list[str] = ()) -> DictConfig:
        return self.compose([model_choice(preset), *self.mode.sizes(preset), *extra], run)

    def datamodule(self, cfg: DictConfig | None = None):
        """The data of ``cfg`` (default: the presets' data, built once)."""
        if cfg is not None:
            dm = instantiate(cfg.data)
            dm.setup("fit")
            return dm
        if self._datamodule is None:
            self._datamodule = self.datamodule(self.preset_config("transformer", "data"))
        return self._datamodule

    def autocast(self, dtype: torch.dtype = torch.bfloat16):
        return partial(torch.autocast, self.device.type, dtype=dtype)

    def free(self) -> None:
        """Give the previous model's CUDA memory back (on a CPU a collection only costs time)."""
        if self.mode.cuda:
            gc.collect()
            torch.cuda.empty_cache()

    def per_preset(self, rows: list[dict[str, Any]], presets: Iterable[str], measure: Callable[[str], dict[str, Any]],
                   describe: Callable[[str, dict[str, Any]], str], min_left: float = 5, free: bool = True) -> None:
        """``measure(preset)`` for each preset into ``rows`` (said as ``describe(preset, row)``); a
        preset that fails or finds the part's time spent is a row with its ``error``, the others
        still run."""
        for preset in presets:
            if self.left() < min_left:
                rows.append({"model": preset, "error": "skipped: the part's time is up"})
                continue
            try:
                rows.append(measure(preset))
                self.say(describe(preset, rows[-1]))
            except PartTimeout:
                raise
            except Exception as exc:  # noqa: BLE001
                rows.append({"model": preset, "error": first_line(exc)})
            if free:
                self.free()

    # running parts
    def run(self, parts: dict[str, Callable[[Check, dict[str, Any]], None]]) -> None:
        """Run each of ``parts`` in turn, in their order: ``part(check, result)`` fills its result."""
        todo = list(parts)
        signal.signal(signal.SIGALRM, self._alarm)
        signal.signal(signal.SIGTERM, self._term)
        for i, key in enumerate(todo):
            budget = min(BUDGET[key], DEADLINE - self.elapsed() - RESERVE * (len(todo) - i - 1))
            result: dict[str, Any] = {}
            entry = self.report["parts"][key] = {"status": "running", "budget_s": round(budget, 1), "result": result}
            if budget < 5 and self.mode.timed:
                entry.update(status="skipped", error=f"no time left ({self.elapsed():.0f} s of {DEADLINE} s used)")
                self.say(f"{key}: skipped, no time left")
                self.write()
                continue
            self.say(f"{key}: start (budget {budget:.0f} s)")
            start = time.perf_counter()
            self.part_end, self.budget, self.current = start + budget, budget, key
            if not self.mode.timed:
                self.part_end = float("inf")
            else:  # The parts stop themselves by part_end; past it, SIGALRM raises PartTimeout, again
                # every 5 s in case something swallowed it (an exception raised in a __del__ is only printed).
                signal.setitimer(signal.ITIMER_REAL, budget + 10, 5)
            try:
                parts[key](self, result)
                entry["status"] = "ok"
            except PartTimeout as exc:
                entry.update(status="timed out", error=str(exc))
            except Exception as exc:  # noqa: BLE001  recorded; the next part runs
                entry.update(status="failed", error=first_line(exc), traceback=traceback.format_exc(limit=-6))
            finally:
                signal.setitimer(signal.ITIMER_REAL, 0)
                entry["seconds"] = round(time.perf_counter() - start, 1)
                self.part_end = float("inf")
                self.report["elapsed_s"] = round(self.elapsed(), 1)
                self.write()
                error = f" ({entry['error']})" if "error" in entry else ""
                self.say(f"{key}: {entry['status']} in {entry['seconds']:.1f} s{error}")
                self.free()

    def _alarm(self, signum, frame) -> None:
        raise PartTimeout(f"still running 10 s past the part's budget of {self.budget:.0f} s")

    def _term(self, signum, frame) -> None:
        """SIGTERM (scripts/gpu_check.sh's `timeout`): write what was measured and exit now."""
        part = self.report["parts"].get(self.current)
        if part is not None and part["status"] == "running":
            part.update(status="terminated", error="SIGTERM: scripts/gpu_check.sh's timeout",
                        seconds=round(time.perf_counter() - (self.part_end - self.budget), 1))
        self.report["elapsed_s"] = round(self.elapsed(), 1)
        self.say(f"SIGTERM during {self.current}: writing the report and exiting")
        self.write(".term")
        self.clean_up()
        os._exit(143)

    def clean_up(self) -> None:
        """Remove the temporary folder, but for a report written into it."""
        for sub in ("runs", "cache"):
            shutil.rmtree(self.work / sub, ignore_errors=True)
        if not self.out_dir.resolve().is_relative_to(self.work.resolve()):
            shutil.rmtree(self.work, ignore_errors=True)

    def write(self, tag: str = "") -> None:
        """The report, atomically (``tag``: a temporary name of its own, for the SIGTERM handler)."""
        self.out_dir.mkdir(parents=True, exist_ok=True)
        for suffix, text in (("json", json.dumps(self.report, indent=2, default=str) + "\n"), ("md", markdown(self.report))):
            path = self.out_dir / f"{self.name}.{suffix}"
            tmp = path.with_name(path.name + tag + ".tmp")
            tmp.write_text(text)
            os.replace(tmp, path)
