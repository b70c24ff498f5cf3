"""Parts 2 and 3 of the GPU check: the presets, then ``experiment=transformer_base``, in
``bf16-mixed``, each eager on exact shapes (the path before the GPU levers) and compiled on shape
buckets (``compile=auto``, ``data.shapes=auto``: what a GPU run gets), trained through
``nmt.train.train`` with a ``StepRecorder`` (``nmt.bench.gpu.recorder``) timing its batches."""

from __future__ import annotations

import time
import traceback
from typing import Any

from omegaconf import open_dict
from pathlib import Path

from nmt.bench.gpu.check import Check, PartTimeout, first_line
from nmt.bench.gpu.recorder import RECORDERS, StepRecorder
from nmt.bench.gpu.report import pct
from nmt.training.builders import count_parameters
from nmt.runs.files import SUMMARY, read
from nmt.train import train

PRESETS = ["lstm", "transformer", "lstm_luong", "lstm_bahdanau"]  # the slowest last: it gets the time the others left
RUN_CAP = 40  # seconds of one preset's training in part 2 (Lightning's max_time), within the part's cap
TARGETS = {"transformer_base": 0.30, "lstm_bahdanau": 0.25, "lstm_luong": 0.25}  # share of the bf16 matmul peak
# How a run uses the device: today's eager pass on exact shapes (the before), the defaults a GPU run
# gets (compile=auto, data.shapes=auto: compiled on shape buckets), the same with CUDA graphs, and the
# batch data.max_tokens=auto finds. A dry run on a CPU traces instead of compiling (compile=trace).
VARIANTS = {"eager": ["compile=false", "data.shapes=exact"], "compiled": ["compile=auto", "data.shapes=auto"],
            "cudagraphs": ["compile=cudagraphs", "data.shapes=auto"],
            "auto batch": ["compile=auto", "data.shapes=auto", "data.max_tokens=auto"]}
DRY_RUN = {"compiled": ["compile=trace", "data.shapes=buckets"], "cudagraphs": ["compile=trace", "data.shapes=buckets"],
           "auto batch": ["compile=trace", "data.shapes=buckets", "data.max_tokens=auto"]}


def train_preset(check: Check, preset: str, precision: str, seconds: float, cpu_fp16: bool = True,
                 variant: str = "eager") -> dict[str, Any]:
    """``train(cfg)`` for ``mode.steps`` steps in ``variant`` (``VARIANTS``); on a CPU, ``16-mixed`` is
    fp16 through Lightning's plugin (``cpu_fp16``) or else Lightning's own CPU substitute for the
    flag, bf16-mixed."""
    key = f"{preset}-{precision}-{variant}".replace(" ", "-")
    overrides = ["trainer=gpu" if check.mode.cuda else "trainer=cpu", "callbacks=none", "~logger", "test=false",
                 f"trainer.max_steps={check.mode.steps}", "trainer.max_epochs=-1", "trainer.limit_val_batches=0",
                 "trainer.num_sanity_val_steps=0", "trainer.enable_progress_bar=false", "trainer.enable_model_summary=false",
                 *(VARIANTS[variant] if check.mode.cuda else DRY_RUN.get(variant, VARIANTS[variant]))]
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
        device_use = read(Path(cfg.paths.output_dir), SUMMARY).get("device_use") or {}
        row = {"model": preset, "precision": precision, "variant": variant, "ran_as": ran_as,
               "params": count_parameters(rec.model), "max_time_s": seconds if check.mode.timed else None,
               "train_seconds": round(time.perf_counter() - start, 1), "compile": device_use.get("compile"),
               "shapes": device_use.get("shapes"), "max_tokens": int(cfg.data.max_tokens),
               "batch_probe": device_use.get("batch_probe"), **rec.summary(check.peaks.get(ran_as))}
    except RuntimeError as exc:
        if not (precision == "16-mixed" and not check.mode.cuda and cpu_fp16):
            raise
        # e.g. oneDNN has no fp16 LSTM on CPUs without AVX512-FP16
        row = train_preset(check, preset, precision, seconds, cpu_fp16=False, variant=variant)
        row["note"] = f"fp16 on this CPU failed ({first_line(exc)[:120]}); Lightning's CPU substitute bf16-mixed ran"
        return row
    finally:
        RECORDERS.pop(key, None)
        rec.batches.clear()
    target = TARGETS.get(preset) if precision == "bf16-mixed" else None
    if target is not None:
        row["target_fraction"] = target
        row["target_met"] = row["peak_fraction"] is not None and row["peak_fraction"] >= target
    if "transformer" in preset and precision == "bf16-mixed" and variant == "eager":
        check.models[preset] = rec.model.cpu()  # off the GPU until part 6: it would inflate part 5's peaks
    return row


def train_all(check: Check, result: dict[str, Any], runs: list[tuple[str, str, str]], cap: float = float("inf")) -> None:
    """Train each (preset, precision, variant) in turn; each gets an equal share of the part's time
    left, at most ``cap`` s."""
    rows = result.setdefault("runs", [])
    for i, (preset, precision, variant) in enumerate(runs):
        left = check.left() - 2
        seconds = min(cap, left / (len(runs) - i) if check.mode.cuda else left)
        named = {"model": preset, "precision": precision, "variant": variant}
        if left < 8:
            rows.append({**named, "error": "skipped: the part's time is up"})
            continue
        check.say(f"train {preset} {precision} {variant}: {check.mode.steps} steps, at most {seconds:.0f} s")
        try:
            row = train_preset(check, preset, precision, seconds, variant=variant)
        except PartTimeout:
            rows.append({**named, "error": "stopped by the part's time cap"})
            raise
        except Exception as exc:  # noqa: BLE001  recorded; the next preset trains
            row = {**named, "error": first_line(exc)}
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
    failed = [f"{r['model']} {r['precision']} {r['variant']}" for r in rows if "error" in r]
    if failed:
        raise RuntimeError(f"{len(failed)} of {len(rows)} trainings failed or were skipped: {', '.join(failed)}")


def presets(check: Check, result: dict[str, Any]) -> None:
    """Each preset eager (before) and compiled on shape buckets (after), in bf16-mixed; the
    Transformer also with CUDA graphs, and eager in fp32 (what mixed precision saves in memory)."""
    runs = [(p, "bf16-mixed", variant) for variant in ("eager", "compiled") for p in PRESETS]
    runs += [("transformer", "bf16-mixed", "cudagraphs"), ("transformer", "32-true", "eager")]
    train_all(check, result, runs, RUN_CAP)


def base(check: Check, result: dict[str, Any]) -> None:
    """transformer_base eager, compiled, and compiled at the batch ``data.max_tokens=auto`` finds."""
    train_all(check, result, [("transformer_base", "bf16-mixed", v) for v in ("eager", "compiled", "auto batch")])
