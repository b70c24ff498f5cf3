"""Keep freed memory in the process for reuse (glibc's malloc, Linux).

By default glibc hands every allocation above a (dynamic, at most 32 MB) threshold to the kernel
on free and maps fresh pages for the next one, so a training step's large tensors (an LSTM
batch's output-layer gradient is ~50 MB) page-fault their way in again at every step: ~20 ms of
an LSTM step on CPU. Raising the mmap and trim thresholds keeps that memory in the heap, so the
next step reuses it. The peak memory is unchanged; the process just does not give memory back
between steps. Elsewhere (other C libraries, macOS, Windows) this does nothing.
"""

from __future__ import annotations

import ctypes
import logging
import sys

log = logging.getLogger(__name__)

_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameters


def keep_freed_memory(threshold: int = 1 << 30) -> bool:
    """Serve allocations up to ``threshold`` bytes from the heap and keep up to twice that free
    in it; returns whether the C library accepted both settings."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL("libc.so.6")
        accepted = bool(libc.mallopt(_M_MMAP_THRESHOLD, threshold)) and bool(libc.mallopt(_M_TRIM_THRESHOLD, 2 * threshold))
    except (OSError, AttributeError):  # not glibc
        accepted = False
    log.debug("malloc keeps freed memory: %s", accepted)
    return accepted
