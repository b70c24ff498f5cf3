"""Part 1 of the GPU check, the environment: GPU, memory, versions, and the matmul peak FLOP/s in
bf16 and fp16 measured in this run; and the ``data`` part: the presets' data, built once for the
parts after it."""

from __future__ import annotations

import contextlib
import os
import platform
import shutil
import subprocess
from typing import Any

import pytorch_lightning as L
import torch

from nmt.bench.gpu.check import Check
from nmt.bench.measure import matmul_peak
from nmt.machine import cpu_name

DTYPES = {"bf16-mixed": torch.bfloat16, "16-mixed": torch.float16}  # the matmul peak of each training precision


def env(check: Check, result: dict[str, Any]) -> None:
    result.update({
        "device": str(check.device), "torch": torch.__version__, "cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None,
        "lightning": L.__version__, "python": platform.python_version(), "cpu_count": os.cpu_count(),
        "cpu_threads": torch.get_num_threads(), "cpu": cpu_name(),
    })
    if check.mode.cuda:
        props = torch.cuda.get_device_properties(0)
        result.update(gpu=props.name, gpu_memory_gb=round(props.total_memory / 2**30, 1),
                      capability=f"{props.major}.{props.minor}", multiprocessors=props.multi_processor_count,
                      bf16_supported=torch.cuda.is_bf16_supported())
        if shutil.which("nvidia-smi"):
            with contextlib.suppress(Exception):
                result["nvidia_smi"] = subprocess.run(
                    ["nvidia-smi", "--query-gpu=name,driver_version,memory.total,clocks.max.sm,power.limit",
                     "--format=csv,noheader"], capture_output=True, text=True, timeout=10).stdout.strip()
    result["matmul_size"] = check.mode.matmul_size
    for precision, dtype in DTYPES.items():
        check.peaks[precision] = matmul_peak(check.mode.matmul_size, check.device, dtype)
        result[f"matmul_peak_{str(dtype).replace('torch.', '')}"] = check.peaks[precision]
        check.say(f"env: matmul peak {dtype}: {check.peaks[precision] / 1e12:.3g} TFLOP/s")


def data(check: Check, result: dict[str, Any]) -> None:
    dm = check.datamodule()
    result.update(src_vocab=dm.src_vocab.vocab_size, tgt_vocab=dm.tgt_vocab.vocab_size,
                  train_batches_per_epoch=len(dm.train_dataloader()))
