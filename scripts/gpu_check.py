"""The GPU path in one run of a few minutes: speed, mixed precision, attention kernels, memory,
decoding and loss parity, written to ``docs/results/gpu/<gpu name>.md`` (and ``.json``).

    scripts/gpu_check.sh [--dry-run] [--out DIR]        # this script under `timeout`
    python scripts/gpu_check.py [--dry-run] [--out DIR] [--device cuda|cpu] [--parts presets,parity]

Parts, each with a time cap (``BUDGET``) inside one deadline for the whole run:

1. ``env``: GPU, memory, torch/CUDA/cuDNN/Lightning versions; matmul peak FLOP/s in bf16 and fp16
   (``benchmark.matmul_peak``), measured in this run.
2. ``presets``: the four model presets, ``bf16-mixed`` and ``16-mixed`` (loss scaling by
   Lightning's precision plugin), 200 optimizer steps each on the synthetic data through
   ``nmt.train.train`` (``trainer=gpu``, no validation, test, logger or checkpoints). A callback
   (``StepRecorder``) times the batches (CUDA synchronized) and keeps their lengths: steady-state
   target tokens/s after ``warmup`` batches, model FLOP/s (``benchmark.training_flops`` on the
   real batches) against the matmul peak of the same dtype, peak CUDA memory, the final loss, and
   for ``16-mixed`` the GradScaler's scale at the start and end and the steps it skipped.
3. ``base``: ``experiment=transformer_base`` in ``bf16-mixed`` the same way (target >= 40% of the
   peak; the attention LSTMs' target is >= 25%).
4. ``sdpa``: a Transformer forward/backward with ``sdpa_kernel`` restricted to one backend at a
   time, SDPA alone per kind of call (padding mask, causal, none), and the attention kernels the
   torch profiler saw in one training step.
5. ``checkpointing``: peak memory (and bytes saved for backward) of a few training steps with
   ``model.gradient_checkpointing`` false vs true, same weights and batches: transformer_base and
   lstm_bahdanau.
6. ``kv_cache``: beam 5 at batch 64 with and without the key/value cache (``benchmark.NoCache``);
   target >= 5x.
7. ``parity``: for a fixed batch and weights (seeded, then 5 Adam steps on that batch so that the
   predictions are no longer uniform), ``module.loss`` with ``kernels=reference`` on the CPU in
   fp32 against the same weights on the device with the training default ``kernels=auto`` in fp32
   (TF32 off) and under bf16 autocast, per preset.

Part 4 runs last (the report keeps the numbering).

A failing part is recorded (its exception) and the others still run; the report is rewritten
after every part, so a run cut short keeps what it measured.

``--dry-run`` runs the same code on the CPU, tiny: 16-wide models, 4 steps, a 2,000-pair synthetic
corpus, results in a temporary folder (or ``--out``). Lightning's ``Trainer(precision='16-mixed')``
is bf16 on a CPU, so there ``16-mixed`` is Lightning's ``MixedPrecision('16-mixed', 'cpu')``
plugin: fp16 autocast and a GradScaler do run. On the CPU ``kernels=auto`` means the CPU kernels,
so the parity part compares them with the reference path. ``--dry-run --device cuda`` is the tiny
run on a GPU: a one-minute smoke test of every CUDA call.
"""

from __future__ import annotations

import time

START = time.perf_counter()

import argparse  # noqa: E402
import contextlib  # noqa: E402
import copy  # noqa: E402
import gc  # noqa: E402
import json  # noqa: E402
import logging  # noqa: E402
import math  # noqa: E402
import os  # noqa: E402
import platform  # noqa: E402
import re  # noqa: E402
import shutil  # noqa: E402
import signal  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import traceback  # noqa: E402
import warnings  # noqa: E402
from collections import Counter  # noqa: E402
from dataclasses import asdict, dataclass  # noqa: E402
from datetime import datetime, timezone  # noqa: E402
from functools import partial  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "scripts")]
# train() builds the step recorder from its `_target_` (gpu_check.recorder); run as a script this
# module is __main__, and importing it again would give a second RECORDERS.
sys.modules.setdefault("gpu_check", sys.modules[__name__])

import pytorch_lightning as L  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from hydra import compose, initialize_config_dir  # noqa: E402
from hydra.core.global_hydra import GlobalHydra  # noqa: E402
from hydra.core.hydra_config import HydraConfig  # noqa: E402
from hydra.utils import instantiate  # noqa: E402
from omegaconf import DictConfig, open_dict  # noqa: E402

import benchmark  # noqa: E402  scripts/benchmark.py: FLOP counts, matmul peak, decoding speed, NoCache
from benchmark_checkpointing import SavedBytes  # noqa: E402
from nmt import CONF_DIR, register_resolvers  # noqa: E402
from nmt.decoding import beam_search  # noqa: E402
from nmt.specials import PAD  # noqa: E402
from nmt.builders import build_model, build_module, count_parameters  # noqa: E402
from nmt.machine import cpu_name  # noqa: E402
from nmt.train import train  # noqa: E402

PRESETS = ["lstm", "transformer", "lstm_luong", "lstm_bahdanau"]  # the slowest last: it gets the time the others left
PRECISIONS = ["bf16-mixed", "16-mixed"]
DTYPES = {"bf16-mixed": torch.bfloat16, "16-mixed": torch.float16}
# Seconds: the cap of each part; the run's deadline leaves RESERVE for each part still to come.
BUDGET = {"env": 20, "data": 60, "presets": 180, "base": 60, "checkpointing": 30, "kv_cache": 30, "parity": 30, "sdpa": 25}
DEADLINE = 420  # seconds from start; scripts/gpu_check.sh kills the run at 450, a GPU lease is 480
RESERVE = 8
RUN_CAP = 40  # seconds of one preset's training in part 2 (Lightning's max_time), within the part's cap
TARGETS = {"transformer_base": 0.40, "lstm_bahdanau": 0.25, "lstm_luong": 0.25}  # share of the bf16 matmul peak
KV_TARGET = 5.0
PARITY_SENTENCES, PARITY_STEPS = 48, 5
TOLERANCE = {"fp32": 1e-4, "bf16": 2e-2}  # relative difference of the loss
ATTENTION_NAMES = re.compile(r"flash|fmha|attention|sdpa|mem_eff|efficient", re.IGNORECASE)
SDPA_OPS = [(r"flash_attention", "FLASH_ATTENTION"), (r"efficient_attention", "EFFICIENT_ATTENTION"),
            (r"cudnn_attention", "CUDNN_ATTENTION"), (r"attention_math", "MATH")]  # aten op names -> backend
TINY_DATA = ["data.source.num_pairs=2000", "data.source.valid_pairs=20", "data.source.test_pairs=16",
             "data.source.max_len=20", "data.max_tokens=512"]

log = logging.getLogger("gpu_check")


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


def finite(x: Any) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x)


def first_sentences(batch: dict[str, Any], n: int) -> dict[str, Any]:
    """The batch's first ``n`` sentence pairs, token counts updated."""
    out = {k: v[:n] if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
    out["num_src_tokens"] = int(out["src_mask"].sum())
    out["num_tgt_tokens"] = int((out["tgt_out"] != PAD).sum())
    return out


class PartTimeout(Exception):
    """A part ran past its cap (SIGALRM)."""


# --- the training callback ------------------------------------------------------------------
RECORDERS: dict[str, "StepRecorder"] = {}


def recorder(key: str) -> "StepRecorder":
    """The callback ``train()`` instantiates from ``callbacks.gpu_check._target_``."""
    return RECORDERS[key]


class StepRecorder(L.Callback):
    """Per training batch: the end time (device synchronized), the real lengths (kept as device
    tensors, summed at the end) and the loss scale; the peak memory and the model at the end."""

    def __init__(self, warmup: int) -> None:
        self.warmup = warmup
        self.ends: list[float] = []
        self.batches: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.loss: torch.Tensor | None = None
        self.scaler = None
        self.scales: list[float] = []
        self.model: torch.nn.Module | None = None
        self.peak_mb = float("nan")

    def on_train_start(self, trainer, pl_module) -> None:
        self.device = pl_module.device
        self.scaler = getattr(trainer.precision_plugin, "scaler", None)
        if self.scaler is not None:
            self.scales.append(self.scaler.get_scale())
        benchmark.reset_peak_memory(self.device)
        benchmark.sync(self.device)
        self.ends.append(time.perf_counter())

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        benchmark.sync(self.device)
        self.ends.append(time.perf_counter())
        self.batches.append((batch["src_mask"], batch["tgt_out"]))
        loss = outputs["loss"] if isinstance(outputs, dict) else outputs
        if isinstance(loss, torch.Tensor):
            self.loss = loss.detach()
        if self.scaler is not None:
            self.scales.append(self.scaler.get_scale())

    def on_train_end(self, trainer, pl_module) -> None:
        self.peak_mb = benchmark.peak_memory_mb(self.device)
        self.model = pl_module.model
        self.steps = trainer.global_step
        self.skipped_nonfinite = pl_module.skipped_steps
        self.module_tgt_tokens_per_s = (pl_module.train_tgt_tokens / pl_module.train_seconds
                                        if pl_module.train_tgt_tokens and pl_module.train_seconds else None)

    def summary(self, peak: float | None) -> dict[str, Any]:
        batches = len(self.batches)
        warmup = min(self.warmup, batches - 2)
        if warmup < 0:
            raise RuntimeError(f"only {batches} training batches ran: nothing to time")
        seconds = self.ends[-1] - self.ends[warmup]
        lengths = benchmark.Lengths()
        for src_mask, tgt_out in self.batches[warmup:]:
            lengths.add({"src_mask": src_mask, "tgt_out": tgt_out})
        flops = benchmark.training_flops(self.model, lengths) / seconds
        loss = float(self.loss) if self.loss is not None else float("nan")
        out = {
            "steps": self.steps, "batches": batches, "timed_batches": batches - warmup, "timed_seconds": seconds,
            "tgt_tokens_per_s": lengths.tgt / seconds, "tokens_per_s": (lengths.src + lengths.tgt) / seconds,
            "batch_ms": 1000 * seconds / (batches - warmup), "flops_per_s": flops,
            "peak_fraction": flops / peak if peak else None, "peak_mb": self.peak_mb,
            "final_loss": loss, "loss_finite": math.isfinite(loss), "skipped_nonfinite_loss": self.skipped_nonfinite,
            "module_tgt_tokens_per_s": self.module_tgt_tokens_per_s,
        }
        if self.scales:  # 16-mixed: the scale halves at every step whose gradients overflowed (skipped)
            out["loss_scale"] = {"start": self.scales[0], "end": self.scales[-1],
                                 "skipped_steps": sum(b < a for a, b in zip(self.scales, self.scales[1:]))}
        return out


# --- the check ------------------------------------------------------------------------------
class Check:
    def __init__(self, mode: Mode, out_dir: Path, work: Path, cache_dir: Path | None, parts: list[str]) -> None:
        self.mode, self.out_dir, self.work, self.cache_dir, self.parts = mode, out_dir, work, cache_dir, parts
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
        return time.perf_counter() - START

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
            cfg.hydra.runtime.cwd = str(ROOT)
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

    # running parts
    def run(self) -> None:
        # Part 4 runs last: forcing one SDPA backend at a time is the most exotic path, and a crash
        # there (not an exception, which is recorded) would lose only itself.
        parts = {"env": self.env, "data": self.data, "presets": self.presets, "base": self.base,
                 "checkpointing": self.checkpointing, "kv_cache": self.kv_cache, "parity": self.parity, "sdpa": self.sdpa}
        todo = [p for p in parts if p in self.parts]
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
                parts[key](result)
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

    # 1. environment
    def env(self, result: dict[str, Any]) -> None:
        result.update({
            "device": str(self.device), "torch": torch.__version__, "cuda": torch.version.cuda,
            "cudnn": torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None,
            "lightning": L.__version__, "python": platform.python_version(), "cpu_count": os.cpu_count(),
            "cpu_threads": torch.get_num_threads(), "cpu": cpu_name(),
        })
        if self.mode.cuda:
            props = torch.cuda.get_device_properties(0)
            result.update(gpu=props.name, gpu_memory_gb=round(props.total_memory / 2**30, 1),
                          capability=f"{props.major}.{props.minor}", multiprocessors=props.multi_processor_count,
                          bf16_supported=torch.cuda.is_bf16_supported())
            if shutil.which("nvidia-smi"):
                with contextlib.suppress(Exception):
                    result["nvidia_smi"] = subprocess.run(
                        ["nvidia-smi", "--query-gpu=name,driver_version,memory.total,clocks.max.sm,power.limit",
                         "--format=csv,noheader"], capture_output=True, text=True, timeout=10).stdout.strip()
        result["matmul_size"] = self.mode.matmul_size
        for precision, dtype in DTYPES.items():
            self.peaks[precision] = benchmark.matmul_peak(self.mode.matmul_size, self.device, dtype)
            result[f"matmul_peak_{str(dtype).replace('torch.', '')}"] = self.peaks[precision]
            self.say(f"env: matmul peak {dtype}: {self.peaks[precision] / 1e12:.3g} TFLOP/s")

    # data
    def data(self, result: dict[str, Any]) -> None:
        dm = self.datamodule()
        result.update(src_vocab=dm.src_vocab.vocab_size, tgt_vocab=dm.tgt_vocab.vocab_size,
                      train_batches_per_epoch=len(dm.train_dataloader()))

    # 2-3. trainings through nmt.train.train
    def train_preset(self, preset: str, precision: str, seconds: float, cpu_fp16: bool = True) -> dict[str, Any]:
        """``train(cfg)`` for ``mode.steps`` steps; on a CPU, ``16-mixed`` is fp16 through Lightning's
        plugin (``cpu_fp16``) or else Lightning's own CPU substitute for the flag, bf16-mixed."""
        key = f"{preset}-{precision}"
        overrides = ["trainer=gpu" if self.mode.cuda else "trainer=cpu", "callbacks=none", "~logger", "test=false",
                     f"trainer.max_steps={self.mode.steps}", "trainer.max_epochs=-1", "trainer.limit_val_batches=0",
                     "trainer.num_sanity_val_steps=0", "trainer.enable_progress_bar=false", "trainer.enable_model_summary=false"]
        cfg = self.preset_config(preset, key, overrides)
        ran_as = precision
        with open_dict(cfg):
            if self.mode.timed:
                seconds = max(5, int(seconds))
                cfg.trainer.max_time = f"00:00:{seconds // 60:02d}:{seconds % 60:02d}"
            else:  # a dry run ends at its steps, never on the clock
                cfg.trainer.max_time = None
            cfg.trainer.precision = precision
            if precision == "16-mixed" and not self.mode.cuda:
                if cpu_fp16:
                    cfg.trainer.precision = None
                    cfg.trainer.plugins = [{"_target_": "pytorch_lightning.plugins.precision.MixedPrecision",
                                            "precision": "16-mixed", "device": "cpu"}]
                else:
                    ran_as = "bf16-mixed"
            cfg.callbacks = {"gpu_check": {"_target_": "gpu_check.recorder", "key": key}}
        RECORDERS[key] = rec = StepRecorder(self.mode.warmup)
        start = time.perf_counter()
        try:
            train(cfg)
            row = {"model": preset, "precision": precision, "ran_as": ran_as, "params": count_parameters(rec.model),
                   "max_time_s": seconds if self.mode.timed else None, "train_seconds": round(time.perf_counter() - start, 1),
                   **rec.summary(self.peaks.get(ran_as))}
        except RuntimeError as exc:
            if not (precision == "16-mixed" and not self.mode.cuda and cpu_fp16):
                raise
            # e.g. oneDNN has no fp16 LSTM on CPUs without AVX512-FP16
            row = self.train_preset(preset, precision, seconds, cpu_fp16=False)
            row["note"] = f"fp16 on this CPU failed ({first_line(exc)[:120]}); Lightning's CPU substitute bf16-mixed ran"
            return row
        finally:
            RECORDERS.pop(key, None)
            rec.batches.clear()
        target = TARGETS.get(preset) if precision == "bf16-mixed" else None
        if target is not None:
            row["target_fraction"] = target
            row["target_met"] = row["peak_fraction"] is not None and row["peak_fraction"] >= target
        if "transformer" in preset and precision == "bf16-mixed":
            self.models[preset] = rec.model.cpu()  # off the GPU until part 6: it would inflate part 5's peaks
        return row

    def _train_all(self, result: dict[str, Any], runs: list[tuple[str, str]], cap: float = float("inf")) -> None:
        """Train each (preset, precision) in turn; each gets an equal share of the part's time left, at most ``cap`` s."""
        rows = result.setdefault("runs", [])
        for i, (preset, precision) in enumerate(runs):
            left = self.left() - 2
            seconds = min(cap, left / (len(runs) - i) if self.mode.cuda else left)
            if left < 8:
                rows.append({"model": preset, "precision": precision, "error": "skipped: the part's time is up"})
                continue
            self.say(f"train {preset} {precision}: {self.mode.steps} steps, at most {seconds:.0f} s")
            try:
                row = self.train_preset(preset, precision, seconds)
            except PartTimeout:
                rows.append({"model": preset, "precision": precision, "error": "stopped by the part's time cap"})
                raise
            except Exception as exc:  # noqa: BLE001  recorded; the next preset trains
                row = {"model": preset, "precision": precision, "error": first_line(exc)}
                traceback.print_exc()
            rows.append(row)
            if "error" not in row:
                scale = row.get("loss_scale")
                self.say(f"  {row['steps']} steps, {row['tgt_tokens_per_s']:,.0f} target tok/s, "
                         f"{row['flops_per_s'] / 1e12:.3g} TFLOP/s ({_pct(row['peak_fraction'])} of peak), "
                         f"{row['peak_mb']:,.0f} MB, loss {row['final_loss']:.3f}"
                         + (f", scale {scale['end']:g} ({scale['skipped_steps']} skipped)" if scale else ""))
            self.write()
            self.free()
        failed = [f"{r['model']} {r['precision']}" for r in rows if "error" in r]
        if failed:
            raise RuntimeError(f"{len(failed)} of {len(rows)} trainings failed or were skipped: {', '.join(failed)}")

    def presets(self, result: dict[str, Any]) -> None:
        self._train_all(result, [(p, precision) for precision in PRECISIONS for p in PRESETS], RUN_CAP)

    def base(self, result: dict[str, Any]) -> None:
        self._train_all(result, [("transformer_base", "bf16-mixed")])

    # 4. attention backends
    def sdpa(self, result: dict[str, Any]) -> None:
        from torch.nn.attention import SDPBackend, sdpa_kernel

        cfg = self.preset_config("transformer", "sdpa", ["kernels=reference"])
        dm = self.datamodule()
        torch.manual_seed(0)
        module = build_module(cfg, build_model(cfg, dm.src_vocab.vocab_size, dm.tgt_vocab.vocab_size)).to(self.device)
        batch = benchmark.to_device(next(iter(dm.train_dataloader())), self.device)
        autocast = self.autocast()
        names = [n for n in ("FLASH_ATTENTION", "EFFICIENT_ATTENTION", "CUDNN_ATTENTION", "MATH") if hasattr(SDPBackend, n)]
        model_runs = result["model_forward_backward"] = {}
        for name in names:
            try:
                with sdpa_kernel(getattr(SDPBackend, name)), autocast():
                    loss, _ = module.loss(batch)
                    loss.backward()
                benchmark.sync(self.device)
                model_runs[name] = "ok"
            except Exception as exc:  # noqa: BLE001
                model_runs[name] = first_line(exc)
            module.zero_grad(set_to_none=True)
        # SDPA alone, per kind of call the model makes, at its shapes
        layer = module.model.encoder.layers[0].self_attn
        heads, size = layer.num_heads, layer.q_proj.in_features // layer.num_heads
        b, s = batch["src"].shape
        dtype = torch.bfloat16
        q, k, v = (torch.randn(b, heads, s, size, device=self.device, dtype=dtype, requires_grad=True) for _ in range(3))
        kinds = {"padding mask (encoder, cross-attention)": {"attn_mask": batch["src_mask"][:, None, None, :]},
                 "causal (decoder self-attention)": {"is_causal": True}, "no mask": {}}
        calls = result["sdpa_calls"] = {"shape": [b, heads, s, size], "dtype": str(dtype).replace("torch.", "")}
        for kind, kwargs in kinds.items():
            calls[kind] = {}
            for name in names:
                try:
                    with sdpa_kernel(getattr(SDPBackend, name)):
                        F.scaled_dot_product_attention(q, k, v, **kwargs).sum().backward()
                    benchmark.sync(self.device)
                    calls[kind][name] = "ok"
                except Exception as exc:  # noqa: BLE001
                    calls[kind][name] = first_line(exc)
        # what ran in one training step, backends chosen by torch
        optimizer = module.configure_optimizers()
        optimizer = optimizer["optimizer"] if isinstance(optimizer, dict) else optimizer
        activities = [torch.profiler.ProfilerActivity.CPU]
        if self.mode.cuda:
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        module.train()
        with torch.profiler.profile(activities=activities) as prof:
            with autocast():
                loss, _ = module.loss(batch)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            benchmark.sync(self.device)
        ops, kernels = Counter(), Counter()
        for event in prof.events():
            if ATTENTION_NAMES.search(event.name):
                on_device = "cuda" in str(getattr(event, "device_type", "")).lower()
                (kernels if on_device else ops)[event.name] += 1
        result["profiled_ops"] = dict(ops.most_common())
        result["profiled_kernels"] = dict(kernels.most_common())
        result["backends_ran"] = sorted({backend for op in ops for pattern, backend in SDPA_OPS if re.search(pattern, op)})
        self.say(f"sdpa: alone {model_runs}; ran {result['backends_ran']}; kernels {list(kernels)}")

    # 5. gradient checkpointing
    def checkpointing(self, result: dict[str, Any]) -> None:
        rows = result.setdefault("runs", [])
        for preset in ("transformer_base", "lstm_bahdanau"):
            if self.left() < 5:
                rows.append({"model": preset, "error": "skipped: the part's time is up"})
                continue
            try:
                rows.append(self._memory(preset))
                r = rows[-1]
                self.say(f"checkpointing {preset}: peak {r['off']['peak_mb']:,.0f} -> {r['on']['peak_mb']:,.0f} MB, "
                         f"saved for backward {r['off']['saved_mb']:,.1f} -> {r['on']['saved_mb']:,.1f} MB")
            except PartTimeout:
                raise
            except Exception as exc:  # noqa: BLE001
                rows.append({"model": preset, "error": first_line(exc)})
            self.free()
        if any("error" in r for r in rows):
            raise RuntimeError("; ".join(f"{r['model']}: {r['error']}" for r in rows if "error" in r))

    def _memory(self, preset: str) -> dict[str, Any]:
        cfg = self.preset_config(preset, f"memory-{preset}")
        dm = self.datamodule(cfg)
        loader = iter(dm.train_dataloader())
        batches = [benchmark.to_device(next(loader), self.device) for _ in range(self.mode.memory_steps)]
        torch.manual_seed(0)
        model = build_model(cfg, dm.src_vocab.vocab_size, dm.tgt_vocab.vocab_size)
        module = build_module(cfg, model).to(self.device).train()
        state = copy.deepcopy(module.state_dict())
        autocast = self.autocast()
        tokens = sum(b["num_src_tokens"] + b["num_tgt_tokens"] for b in batches)
        row: dict[str, Any] = {"model": preset, "steps": len(batches), "tokens": tokens}
        for enabled in (False, True):  # the plain run first: on a CPU the peak RSS only grows
            module.load_state_dict(state)
            model.set_gradient_checkpointing(enabled)
            optimizer = module.configure_optimizers()
            optimizer = optimizer["optimizer"] if isinstance(optimizer, dict) else optimizer
            self.free()
            benchmark.reset_peak_memory(self.device)
            before = torch.cuda.memory_allocated(self.device) / 2**20 if self.mode.cuda else None
            saved = SavedBytes()
            benchmark.sync(self.device)
            start = time.perf_counter()
            for i, batch in enumerate(batches):
                hooks = torch.autograd.graph.saved_tensors_hooks(saved.pack, lambda t: t) if i == 0 else contextlib.nullcontext()
                with hooks, autocast():
                    loss, _ = module.loss(batch)
                loss.backward()
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
            benchmark.sync(self.device)
            row["on" if enabled else "off"] = {
                "peak_mb": benchmark.peak_memory_mb(self.device), "allocated_before_mb": before,
                "saved_mb": saved.total / 2**20, "step_ms": 1000 * (time.perf_counter() - start) / len(batches),
            }
            del optimizer
        model.set_gradient_checkpointing(False)
        row["peak_cut"] = 1 - row["on"]["peak_mb"] / row["off"]["peak_mb"]
        if self.mode.cuda:  # what the steps added to the weights (and what else was allocated before)
            above = {k: row[k]["peak_mb"] - row[k]["allocated_before_mb"] for k in ("off", "on")}
            row["peak_above_start_cut"] = 1 - above["on"] / above["off"] if above["off"] > 0 else None
        row["saved_cut"] = 1 - row["on"]["saved_mb"] / row["off"]["saved_mb"] if row["off"]["saved_mb"] else None
        row["memory"] = "CUDA max_memory_allocated" if self.mode.cuda else "peak RSS (coarse: the allocator keeps freed memory)"
        return row

    # 6. key/value cache
    def kv_cache(self, result: dict[str, Any]) -> None:
        rows = result.setdefault("runs", [])
        for preset in ("transformer", "transformer_base"):
            if self.left() < 5:
                rows.append({"model": preset, "error": "skipped: the part's time is up"})
                continue
            try:
                rows.append(self._kv(preset))
                r = rows[-1]
                self.say(f"kv cache {preset}: {r['speedup']:.2f}x ({r['weights']}), same outputs {r['same_outputs']}")
            except PartTimeout:
                raise
            except Exception as exc:  # noqa: BLE001
                rows.append({"model": preset, "error": first_line(exc)})
            self.free()
        if any("error" in r for r in rows):
            raise RuntimeError("; ".join(f"{r['model']}: {r['error']}" for r in rows if "error" in r))

    def _kv(self, preset: str, beam_size: int = 5, batch_size: int = 64) -> dict[str, Any]:
        cfg = self.preset_config(preset, f"kv-{preset}")
        dm = self.datamodule()
        model = self.models.get(preset)
        weights = "after its bf16-mixed training above"
        if model is None:
            torch.manual_seed(0)
            model = build_model(cfg, dm.src_vocab.vocab_size, dm.tgt_vocab.vocab_size)
            weights = "random (its training did not run)"
        self.models.pop(preset, None)
        model = model.to(self.device).eval()
        beam = cfg.test_decoding
        search = partial(beam_search, beam_size=beam_size, alpha=beam.alpha, max_len_a=beam.max_len_a, max_len_b=beam.max_len_b)
        sources = dm.raw("test")[0][:batch_size]
        batches = list(dm.predict_loader(sources, batch_size=batch_size))[:1]
        autocast = self.autocast()
        cached, out_cached = benchmark.decode_speed(model, batches, search, self.device, autocast)
        uncached, out_uncached = benchmark.decode_speed(benchmark.NoCache(model), batches, search, self.device, autocast)
        speedup = uncached["seconds"] / cached["seconds"]
        return {"model": preset, "weights": weights, "beam_size": beam_size, "batch_size": batch_size,
                "sentences": len(out_cached), "output_tokens": sum(len(t) + 1 for t in out_cached),
                "cached": cached, "uncached": uncached, "speedup": speedup, "target": KV_TARGET,
                "target_met": speedup >= KV_TARGET, "same_outputs": out_cached == out_uncached}

    # 7. loss parity
    def parity(self, result: dict[str, Any]) -> None:
        rows = result.setdefault("runs", [])
        result["tolerance"] = TOLERANCE
        dm = self.datamodule()
        batch = first_sentences(next(iter(dm.train_dataloader())), PARITY_SENTENCES)
        result["batch"] = {"sentences": int(batch["src"].size(0)), "src_tokens": batch["num_src_tokens"],
                           "tgt_tokens": batch["num_tgt_tokens"], "training_steps": PARITY_STEPS}
        for preset in PRESETS:
            if self.left() < 3:
                rows.append({"model": preset, "error": "skipped: the part's time is up"})
                continue
            try:
                rows.append(self._parity(preset, batch, dm))
                r = rows[-1]
                self.say(f"parity {preset}: fp32 {r['fp32']['rel_diff']:.2e} ({'pass' if r['fp32']['pass'] else 'FAIL'}), "
                         f"bf16 {r['bf16']['rel_diff']:.2e} ({'pass' if r['bf16']['pass'] else 'FAIL'})")
            except PartTimeout:
                raise
            except Exception as exc:  # noqa: BLE001
                rows.append({"model": preset, "error": first_line(exc)})
        result["passed"] = all(r.get("fp32", {}).get("pass") and r.get("bf16", {}).get("pass") for r in rows)
        if any("error" in r for r in rows):
            raise RuntimeError("; ".join(f"{r['model']}: {r['error']}" for r in rows if "error" in r))

    def _parity(self, preset: str, batch: dict[str, Any], dm) -> dict[str, Any]:
        cfg = self.preset_config(preset, f"parity-{preset}", ["kernels=reference"])
        torch.manual_seed(0)
        module = build_module(cfg, build_model(cfg, dm.src_vocab.vocab_size, dm.tgt_vocab.vocab_size))
        # A few Adam steps on the batch first: from the initial weights every model predicts nearly
        # uniformly, and any computation of a near-uniform softmax gives nearly the same loss.
        optimizer = torch.optim.Adam(module.parameters(), lr=3e-3)
        module.eval()  # no dropout: the same function on both devices
        for _ in range(PARITY_STEPS):
            module.loss(batch)[0].backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        with torch.no_grad():
            reference = float(module.loss(batch)[0])
        device_module = copy.deepcopy(module).to(self.device)
        device_module.model.set_kernels("auto")  # what training uses there: plain PyTorch on a GPU, the CPU kernels on a CPU
        on_device = benchmark.to_device(batch, self.device)
        row: dict[str, Any] = {"model": preset, "cpu_fp32_reference": reference,
                               "device": f"{self.device.type}, kernels=auto"}
        tf32 = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32)
        try:
            torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False  # fp32 means fp32 here
            with torch.no_grad():
                fp32 = float(device_module.loss(on_device)[0])
        finally:
            torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = tf32
        with torch.no_grad(), self.autocast()():
            bf16 = float(device_module.loss(on_device)[0])
        for name, value in (("fp32", fp32), ("bf16", bf16)):
            rel = abs(value - reference) / max(abs(reference), 1e-12)
            row[name] = {"loss": value, "abs_diff": abs(value - reference), "rel_diff": rel,
                         "tolerance": TOLERANCE[name], "pass": math.isfinite(value) and rel <= TOLERANCE[name]}
        return row


# --- the report ---------------------------------------------------------------------------
def _pct(x: float | None) -> str:
    return "–" if x is None or not finite(x) else f"{100 * x:.1f}%"


def _num(x: Any, spec: str = ",.0f") -> str:
    return format(x, spec) if finite(x) else "–"


def _short(text: str, n: int = 80) -> str:
    return text if len(text) <= n else text[: n - 1] + "…"


def _tflops(x: Any) -> str:
    return format(x / 1e12, ".3g") if finite(x) else "–"


def _status(report: dict[str, Any], key: str) -> tuple[dict[str, Any], list[str]]:
    part = report["parts"].get(key)
    if part is None:
        return {}, ["Not run."]
    lines = [] if part["status"] == "ok" else [f"**{part['status']}**: {part.get('error', '')}", ""]
    return part.get("result", {}), lines


def _training_table(rows: list[dict[str, Any]]) -> list[str]:
    lines = ["| model | precision | steps (batches) | target tok/s | tok/s (src+tgt) | ms per batch | model TFLOP/s | % of peak "
             "| target | peak MB | final loss | loss scale start -> end (skipped steps) |",
             "|---|---|---:|---:|---:|---:|---:|---:|---|---:|---:|---|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['model']} | {r['precision']} | {r['error']} |" + " |" * 9)
            continue
        target = (f"{_pct(r['target_fraction'])}: {'met' if r['target_met'] else 'not met'}" if "target_fraction" in r else "")
        scale = ""
        if "loss_scale" in r:
            s = r["loss_scale"]
            scale = f"{s['start']:g} -> {s['end']:g} ({s['skipped_steps']})"
        precision = r["precision"] + (f" (ran as {r['ran_as']})" if r.get("ran_as", r["precision"]) != r["precision"] else "")
        lines.append(f"| {r['model']} | {precision} | {r['steps']} ({r['batches']}) | {_num(r['tgt_tokens_per_s'])} | "
                     f"{_num(r['tokens_per_s'])} | {_num(r['batch_ms'], '.1f')} | {_tflops(r['flops_per_s'])} | "
                     f"{_pct(r['peak_fraction'])} | {target} | {_num(r['peak_mb'])} | {_num(r['final_loss'], '.3f')} | {scale} |")
    notes = [f"- {r['model']} {r['precision']}: {r['note']}" for r in rows if r.get("note")]
    return lines + (["", *notes] if notes else [])


def markdown(report: dict[str, Any]) -> str:
    parts = report["parts"]
    lines = [f"# GPU check: {report['name']}" + (" (dry run, tiny sizes)" if report["dry_run"] else ""), "",
             f"`scripts/gpu_check.sh{' --dry-run' if report['dry_run'] else ''}`, started {report['started']}, "
             f"{report.get('elapsed_s', 0):.0f} s of the {report['deadline_s']} s deadline. "
             f"Every number is in the JSON file next to this one; `scripts/gpu_check.py` says how each is measured.", ""]
    if report["dry_run"]:
        lines += ["A dry run: the code of the GPU run on tiny models and data; its speeds and targets mean nothing."
                  + (" On a CPU, 16-mixed is Lightning's `MixedPrecision('16-mixed', 'cpu')` plugin (fp16 autocast and a "
                     "GradScaler), as `Trainer(precision='16-mixed')` would be bf16 there, and the parity part compares "
                     "the CPU kernels (`kernels=auto`) with the reference path." if report["mode"]["device"] == "cpu" else ""), ""]

    lines += ["## 1. Environment", ""]
    result, head = _status(report, "env")
    lines += head
    if result:
        keys = ["device", "gpu", "gpu_memory_gb", "capability", "nvidia_smi", "torch", "cuda", "cudnn", "lightning", "python",
                "cpu", "cpu_count", "cpu_threads"]
        lines += ["| | |", "|---|---|", *[f"| {k} | {result[k]} |" for k in keys if k in result]]
        for dtype in ("bfloat16", "float16"):
            if f"matmul_peak_{dtype}" in result:
                lines.append(f"| matmul peak {dtype} ({result['matmul_size']}^3) | {_tflops(result[f'matmul_peak_{dtype}'])} TFLOP/s |")
    lines.append("")

    data, head = _status(report, "data")
    if data or head:
        lines += ["Data: " + (", ".join(f"{k} {v}" for k, v in data.items()) if data else " ".join(head)), ""]

    steps = report["mode"]["steps"]
    lines += ["## 2. Presets in bf16-mixed and 16-mixed", "",
              f"`nmt.train.train` with `trainer={'gpu' if report['mode']['device'] == 'cuda' else 'cpu'}`, {steps} optimizer "
              "steps (Lightning's `max_time` may stop it sooner), no "
              f"validation, test, logger or checkpoints; timed after the first {report['mode']['warmup']} batches, data "
              "loading included. Model FLOPs: `benchmark.training_flops` on the timed batches' real tokens; % of the "
              "matmul peak of the same dtype (fp16 for 16-mixed).", ""]
    result, head = _status(report, "presets")
    lines += head + (_training_table(result["runs"]) if result.get("runs") else []) + [""]

    lines += ["## 3. transformer_base in bf16-mixed", "",
              "`experiment=transformer_base`: 6+6 layers, 512 wide, 8,192-token batches, 3 accumulated per optimizer step"
              + (" (a dry run shrinks the layers, width and batches)." if report["dry_run"] else "."), ""]
    result, head = _status(report, "base")
    lines += head + (_training_table(result["runs"]) if result.get("runs") else []) + [""]

    lines += ["## 4. Attention (SDPA) backends", ""]
    result, head = _status(report, "sdpa")
    lines += head
    if result.get("model_forward_backward"):
        names = list(result["model_forward_backward"])
        calls = result.get("sdpa_calls", {})
        kinds = [k for k in calls if k not in ("shape", "dtype")]
        lines += ["Each backend alone (`torch.nn.attention.sdpa_kernel`): the `transformer` preset's loss and backward "
                  f"under bf16 autocast, and SDPA alone at shape {calls.get('shape')} ({calls.get('dtype')}).", "",
                  "| backend | model forward/backward | " + " | ".join(kinds) + " |", "|---|---|" + "---|" * len(kinds)]
        for name in names:
            lines.append(f"| {name} | {_short(result['model_forward_backward'][name])} | "
                         + " | ".join(_short(calls.get(k, {}).get(name, "")) for k in kinds) + " |")
        lines += ["", "One profiled training step, backends chosen by torch: "
                  + (", ".join(result.get("backends_ran", [])) or "no SDPA op seen") + "; its attention kernels:", ""]
        found = result.get("profiled_kernels") or {}
        lines += [f"- `{k}` x{v}" for k, v in found.items()] or ["- no device kernel matched"]
        lines += ["", "Attention ops: " + (", ".join(f"`{k}` x{v}" for k, v in result.get("profiled_ops", {}).items()) or "none")]
    lines.append("")

    lines += ["## 5. Gradient checkpointing", ""]
    result, head = _status(report, "checkpointing")
    lines += head
    if result.get("runs"):
        lines += ["The same weights and batches, `model.gradient_checkpointing` false then true, bf16 autocast, "
                  "Adam steps included.", "",
                  "| model | steps (tokens) | peak MB off | peak MB on | cut | saved for backward MB off | on | cut | ms per step off | on |",
                  "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
        for r in result["runs"]:
            if "error" in r:
                lines.append(f"| {r['model']} | {r['error']} |" + " |" * 8)
                continue
            lines.append(f"| {r['model']} | {r['steps']} ({r['tokens']:,}) | {_num(r['off']['peak_mb'])} | {_num(r['on']['peak_mb'])} | "
                         f"{_pct(r['peak_cut'])} | {_num(r['off']['saved_mb'], ',.1f')} | {_num(r['on']['saved_mb'], ',.1f')} | "
                         f"{_pct(r['saved_cut'])} | {_num(r['off']['step_ms'], '.1f')} | {_num(r['on']['step_ms'], '.1f')} |")
        lines += ["", f"Peak memory: {result['runs'][0].get('memory', '')}."]
        above = [f"{r['model']} {_pct(r['peak_above_start_cut'])}" for r in result["runs"]
                 if r.get("peak_above_start_cut") is not None]
        if above:
            lines.append(f"Cut of the peak above the memory allocated before the steps (weights): {', '.join(above)}.")
    lines.append("")

    lines += ["## 6. Beam search with and without the key/value cache", ""]
    result, head = _status(report, "kv_cache")
    lines += head
    if result.get("runs"):
        lines += ["One batch of the test split's first sentences, bf16 autocast; without the cache the decoder re-runs "
                  "the whole prefix at every step (`benchmark.NoCache`).", "",
                  "| model | weights | beam, batch (sentences) | with cache tok/s | without tok/s | speedup | target | same outputs |",
                  "|---|---|---|---:|---:|---:|---|---|"]
        for r in result["runs"]:
            if "error" in r:
                lines.append(f"| {r['model']} | {r['error']} |" + " |" * 6)
                continue
            lines.append(f"| {r['model']} | {r['weights']} | {r['beam_size']}, {r['batch_size']} ({r['sentences']}) | "
                         f"{_num(r['cached']['tokens_per_s'])} | "
                         f"{_num(r['uncached']['tokens_per_s'])} | {r['speedup']:.2f}x | >= {r['target']:g}x: "
                         f"{'met' if r['target_met'] else 'not met'} | {r['same_outputs']} |")
    lines.append("")

    lines += ["## 7. Loss parity", ""]
    result, head = _status(report, "parity")
    lines += head
    if result.get("runs"):
        tol = result["tolerance"]
        lines += [f"`module.loss` on one training batch ({result['batch']['sentences']} sentences), the same weights: "
                  f"`kernels=reference` on the CPU in fp32 against the device with `kernels=auto`; relative tolerance "
                  f"{tol['fp32']:g} in fp32 (TF32 off), {tol['bf16']:g} under bf16 autocast. "
                  f"All passed: {result.get('passed')}.", "",
                  "| model | CPU fp32 reference | device fp32 | rel. diff | pass | device bf16 | rel. diff | pass |",
                  "|---|---:|---:|---:|---|---:|---:|---|"]
        for r in result["runs"]:
            if "error" in r:
                lines.append(f"| {r['model']} | {r['error']} |" + " |" * 6)
                continue
            lines.append(f"| {r['model']} | {r['cpu_fp32_reference']:.6f} | {r['fp32']['loss']:.6f} | {r['fp32']['rel_diff']:.2e} | "
                         f"{'pass' if r['fp32']['pass'] else 'FAIL'} | {r['bf16']['loss']:.6f} | {r['bf16']['rel_diff']:.2e} | "
                         f"{'pass' if r['bf16']['pass'] else 'FAIL'} |")
    lines.append("")

    lines += ["## Timings", "", "| part | status | seconds | budget s |", "|---|---|---:|---:|"]
    for key, part in parts.items():
        lines.append(f"| {key} | {part['status']} | {part.get('seconds', '–')} | {part['budget_s']} |")
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dry-run", action="store_true", help="tiny sizes, on the CPU unless --device says otherwise")
    parser.add_argument("--out", type=Path,
                        help="where the .md and .json go (default docs/results/gpu; a temporary folder for --dry-run)")
    parser.add_argument("--device", choices=["cuda", "cpu"], help="default: cuda, or cpu for --dry-run")
    parser.add_argument("--parts", default=",".join(BUDGET), help=f"comma-separated subset of {','.join(BUDGET)}")
    args = parser.parse_args()
    register_resolvers()
    parts = args.parts.split(",")
    unknown = set(parts) - set(BUDGET)
    if unknown:
        parser.error(f"unknown parts {sorted(unknown)}; choose from {','.join(BUDGET)}")
    device = args.device or ("cpu" if args.dry_run else "cuda")
    if device == "cuda" and not torch.cuda.is_available():
        print("gpu_check: no CUDA device here; --dry-run checks the same code on the CPU", file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    warnings.filterwarnings("ignore", ".*does not have many workers.*")
    warnings.filterwarnings("ignore", ".*lr_scheduler.step\\(\\)` before `optimizer.step\\(\\)`.*")
    for name in ("pytorch_lightning", "lightning_fabric"):  # "GPU available", "Seed set to": once per training
        logging.getLogger(name).setLevel(logging.WARNING)
    mode = Mode.make(device, tiny=args.dry_run)
    work = Path(tempfile.mkdtemp(prefix="gpu-check-"))
    out = args.out or (work / "report" if args.dry_run else ROOT / "docs" / "results" / "gpu")
    # Tiny data goes to its own cache; the full run reuses the repository's (.cache/).
    cache = work / "cache" if args.dry_run and not os.environ.get("NMT_CACHE_DIR") else None
    check = Check(mode, out, work, cache, parts)
    check.say(f"gpu_check: {check.report['name']} ({'dry run, tiny' if mode.tiny else 'full'}), parts {','.join(parts)}, "
              f"deadline {DEADLINE} s; report {out / check.name}.md")
    try:
        check.run()
    finally:
        check.report["elapsed_s"] = round(check.elapsed(), 1)
        check.write()
        check.clean_up()
    failed = [k for k, p in check.report["parts"].items() if p["status"] != "ok"]
    check.say(f"done in {check.elapsed():.0f} s; {'all parts ok' if not failed else 'not ok: ' + ', '.join(failed)}; "
              f"wrote {out / check.name}.md and .json")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
