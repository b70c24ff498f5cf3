"""Parts 2 and 3 of the GPU check: the presets in ``bf16-mixed`` and ``16-mixed``, then
``experiment=transformer_base`` in ``bf16-mixed``, each trained through ``nmt.train.train`` with a
``StepRecorder`` (``nmt.bench.gpu.recorder``) timing its batches."""

from __future__ import annotations

import time
import traceback
from typing import Any

from omegaconf import open_dict

from nmt.bench.gpu.check import Check, PartTimeout, first_line
from nmt.bench.gpu.recorder import RECORDERS, StepRecorder
from nmt.bench.gpu.report import pct
from nmt.training.builders import count_parameters
from nmt.train import train

PRESETS = ["lstm", "transformer", "lstm_luong", "lstm_bahdanau"]  # the slowest last: it gets the time the others left
PRECISIONS = ["bf16-mixed", "16-mixed"]
RUN_CAP = 40  # seconds of one preset's training in part 2 (Lightning's max_time), within the part's cap
TARGETS = {"transformer_base": 0.40, "lstm_bahdanau": 0.25, "lstm_luong": 0.25}  # share of the bf16 matmul peak


def train_preset(check: Check, preset: str, precision: str, seconds: float, cpu_fp16: bool = True) -> dict[str, Any]:
    """``train(cfg)`` for ``mode.steps`` steps; on a CPU, ``16-mixed`` is fp16 through Lightning's
    plugin (``cpu_fp16``) or else Lightning's own CPU substitute for the flag, bf16-mixed."""
    key = f"{preset}-{precision}"
    overrides = ["trainer=gpu" if check.mode.cuda else "trainer=cpu", "callbacks=none", "~logger", "test=false",
                 f"trainer.max_steps={check.mode.steps}", "trainer.max_epochs=-1", "trainer.limit_val_batches=0",
                 "trainer.num_sanity_val_steps=0", "trainer.enable_progress_bar=false", "trainer.enable_model_summary=false"]
    cfg = check.preset_config(preset, key, overrides)
    ran_as = precision
    with open_dict(cfg):
        if check.mode.timed:
            seconds = max(5, int(seconds))
            cfg.trainer.max_time = f"00:00:{seconds // 60:02d}:{seconds % 60:02d}"
        else:  # a dry run ends at its steps, never on the clock
            cfg.trainer.max_time = None
        cfg.trainer.precision = precision
        if precision == "16-mixed" and not check.mode.cuda:
            if cpu_fp16:
                cfg.trainer.precision = None
                cfg.trainer.plugins = [{"_target_": "pytorch_lightning.plugins.precision.MixedPrecision",
                                        "precision": "16-mixed", "device": "cpu"}]
            else:
                ran_as = "bf16-mixed"
        cfg.callbacks = {"gpu_check": {"_target_": "nmt.bench.gpu.recorder.recorder", "key": key}}
    RECORDERS[key] = rec = StepRecorder(check.mode.warmup)
    start = time.perf_counter()
    try:
        train(cfg)
        row = {"model": preset, "precision": precision, "ran_as": ran_as, "params": count_parameters(rec.model),
               "max_time_s": seconds if check.mode.timed else None, "train_seconds": round(time.perf_counter() - start, 1),
               **rec.summary(check.peaks.get(ran_as))}
    except RuntimeError as exc:
        if not (precision == "16-mixed" and not check.mode.cuda and cpu_fp16):
            raise
        # e.g. oneDNN has no fp16 LSTM on CPUs without AVX512-FP16
        row = train_preset(check, preset, precision, seconds, cpu_fp16=False)
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
        check.models[preset] = rec.model.cpu()  # off the GPU until part 6: it would inflate part 5's peaks
    return row


def train_all(check: Check, result: dict[str, Any], runs: list[tuple[str, str]], cap: float = float("inf")) -> None:
    """Train each (preset, precision) in turn; each gets an equal share of the part's time left, at most ``cap`` s."""
    rows = result.setdefault("runs", [])
    for i, (preset, precision) in enumerate(runs):
        left = check.left() - 2
        seconds = min(cap, left / (len(runs) - i) if check.mode.cuda else left)
        if left < 8:
            rows.append({"model": preset, "precision": precision, "error": "skipped: the part's time is up"})
            continue
        check.say(f"train {preset} {precision}: {check.mode.steps} steps, at most {seconds:.0f} s")
        try:
            row = train_preset(check, preset, precision, seconds)
        except PartTimeout:
            rows.append({"model": preset, "precision": precision, "error": "stopped by the part's time cap"})
            raise
        except Exception as exc:  # noqa: BLE001  recorded; the next preset trains
            row = {"model": preset, "precision": precision, "error": first_line(exc)}
            traceback.print_exc()
        rows.append(row)
        if "error" not in row:
            scale = row.get("loss_scale")
            check.say(f"  {row['steps']} steps, {row['tgt_tokens_per_s']:,.0f} target tok/s, "
                      f"{row['flops_per_s'] / 1e12:.3g} TFLOP/s ({pct(row['peak_fraction'])} of peak), "
                      f"{row['peak_mb']:,.0f} MB, loss {row['final_loss']:.3f}"
                      + (f", scale {scale['end']:g} ({scale['skipped_steps']} skipped)" if scale else ""))
        check.write()
        check.free()
    failed = [f"{r['model']} {r['precision']}" for r in rows if "error" in r]
    if failed:
        raise RuntimeError(f"{len(failed)} of {len(rows)} trainings failed or were skipped: {', '.join(failed)}")


def presets(check: Check, result: dict[str, Any]) -> None:
    train_all(check, result, [(p, precision) for precision in PRECISIONS for p in PRESETS], RUN_CAP)


def base(check: Check, result: dict[str, Any]) -> None:
    train_all(check, result, [("transformer_base", "bf16-mixed")])
