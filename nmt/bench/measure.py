"""Measuring on a CPU or a GPU: device synchronisation, the matmul peak FLOP/s, peak memory, and the
bytes autograd saves for backward."""

from __future__ import annotations

import contextlib
import resource
import time
from pathlib import Path
from typing import Any

import torch

from nmt.kernels.malloc import release_freed_memory


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def to_device(batch: dict[str, Any], device: torch.device) -> dict[str, Any]:
    return {k: v.to(device, non_blocking=True) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}


def matmul_peak(size: int, device: torch.device, dtype: torch.dtype, repeats: int = 5) -> float:
    """FLOP/s of a square matmul, the best of ``repeats``."""
    a, b = (torch.randn(size, size, device=device, dtype=dtype) for _ in range(2))
    a @ b
    best = float("inf")
    for _ in range(repeats):
        sync(device)
        start = time.perf_counter()
        a @ b
        sync(device)
        best = min(best, time.perf_counter() - start)
    return 2 * size**3 / best


def reset_peak_memory(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        return
    release_freed_memory()  # what keep_freed_memory() kept from the previous model
    with contextlib.suppress(OSError):  # Linux: reset the peak RSS that getrusage reports
        Path("/proc/self/clear_refs").write_text("5")


def peak_memory_mb(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


class SavedBytes:
    """Counts the bytes autograd saves for backward (each storage once): its ``pack`` is the pack
    hook of ``torch.autograd.graph.saved_tensors_hooks``."""

    def __init__(self) -> None:
        self.storages: dict[int, int] = {}

    def pack(self, tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        self.storages[storage.data_ptr()] = storage.nbytes()
        return tensor

    @property
    def total(self) -> int:
        return sum(self.storages.values())
