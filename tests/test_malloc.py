"""keep_freed_memory: accepted by glibc on Linux, a no-op elsewhere."""

from __future__ import annotations

import platform
import sys

import torch

from nmt.malloc import keep_freed_memory


def test_glibc_accepts_the_settings_and_tensors_still_work():
    on_glibc = sys.platform.startswith("linux") and platform.libc_ver()[0] == "glibc"
    assert keep_freed_memory() is on_glibc
    big = torch.ones(64, 1 << 20)  # 256 MB: now from the heap, not a fresh mapping
    assert big.sum().item() == 64 * (1 << 20)
    del big
    again = torch.zeros(64, 1 << 20)  # reuses the freed memory: must still read as zeros
    assert again.abs().sum().item() == 0
