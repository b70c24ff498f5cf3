"""keep_freed_memory: glibc keeps a freed large tensor's pages for the next one;
release_freed_memory gives them back."""

from __future__ import annotations

import os
import platform
import subprocess
import sys

import pytest

from nmt.kernels.malloc import keep_freed_memory

# In a fresh process: free a 256 MB tensor and report how much of it stays resident.
_PROBE = """
import os, sys, torch
from nmt.kernels.malloc import keep_freed_memory, release_freed_memory
if sys.argv[1] != "default":
    assert keep_freed_memory()
page = os.sysconf("SC_PAGE_SIZE")
rss = lambda: int(open("/proc/self/statm").read().split()[1]) * page
big = torch.ones(64, 1 << 20)
before_free = rss()
del big
if sys.argv[1] == "release":
    release_freed_memory()
print((before_free - rss()) >> 20)  # MB handed back to the kernel
"""


@pytest.mark.slow  # end to end in processes of its own: the slow tier
@pytest.mark.skipif(not (sys.platform.startswith("linux") and platform.libc_ver()[0] == "glibc"), reason="glibc only")
def test_freed_tensor_memory_stays_in_the_process():
    def returned_mb(mode: str) -> int:
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
        out = subprocess.run([sys.executable, "-c", _PROBE, mode], capture_output=True, text=True, env=env, check=True)
        return int(out.stdout.strip())

    assert returned_mb("default") >= 200  # glibc unmaps a 256 MB block on free
    assert returned_mb("keep") < 50  # kept for the next allocation
    assert returned_mb("release") >= 200  # until asked to give it back
    assert keep_freed_memory() is True
