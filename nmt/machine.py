"""What the machine is, decided in one place: the cores this process may use, the CPU's name and
the instruction sets it computes bf16 and int8 with, the device a run uses, and the precision
``precision=auto`` picks for training and for decoding on it.

Precision follows the hardware, never a config file: a CPU without bf16 instructions (AVX2-only
servers are common) emulates bf16 matmuls about 40x slower than fp32, and one without VNNI runs
int8 matmuls without the instructions that make them pay. ``auto`` picks bf16 only where the
hardware computes it; an explicit choice that the hardware computes slowly is kept and warned about
in one line with the factor measured here (``slow_precision_warning``); int8 is warned about wherever
its products, timed here, are slower than fp32's. oneDNN, which runs torch's
CPU matmuls, may be capped below the hardware (``ONEDNN_MAX_CPU_ISA=AVX2``); the probes honour the
cap, so a capped run decides as a CPU of that kind would.

torch is imported by the functions that need it: a command that reads this module imports no torch.
"""

from __future__ import annotations

import logging
import os
import platform
import time
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

# oneDNN's ISA levels, lowest first (ONEDNN_MAX_CPU_ISA): from AVX512_CORE_BF16 on it multiplies bf16
# in hardware, from AVX2_VNNI (AVX512_CORE_VNNI on the AVX-512 line) int8 with VNNI.
ONEDNN_ISAS = ("SSE41", "AVX", "AVX2", "AVX2_VNNI", "AVX2_VNNI_2", "AVX512_CORE", "AVX512_CORE_VNNI",
               "AVX512_CORE_BF16", "AVX10_1_512", "AVX512_CORE_FP16", "AVX10_1_512_AMX", "AVX512_CORE_AMX",
               "AVX10_1_512_AMX_FP16", "AVX512_CORE_AMX_FP16", "ALL", "DEFAULT")
CPU_FLAGS = {"bf16": ("avx512_bf16", "amx_tile"), "vnni": ("vnni", "amx_tile")}  # torch.cpu._is_<flag>_supported
# the oneDNN caps that leave each feature on (the AVX2 line has VNNI from AVX2_VNNI, no bf16 matmuls;
# the AVX-512 line VNNI from AVX512_CORE_VNNI, bf16 from AVX512_CORE_BF16)
ALLOWING = {"bf16": set(ONEDNN_ISAS[ONEDNN_ISAS.index("AVX512_CORE_BF16"):]),
            "vnni": {"AVX2_VNNI", "AVX2_VNNI_2"} | set(ONEDNN_ISAS[ONEDNN_ISAS.index("AVX512_CORE_VNNI"):])}


def usable_cores() -> int:
    """Cores this process may run on: its CPU affinity mask, within the cgroup's CPU quota (a
    container limited to 2 CPUs of a 64-core host gets 2), at least 1. ``os.cpu_count()`` counts
    the host's cores and ignores both."""
    cores = affinity_cores()
    quota = cgroup_cpu_quota()
    return max(1, min(cores, quota) if quota is not None else cores)


def affinity_cores() -> int:
    """The CPUs this process's affinity mask allows (``os.cpu_count()`` where there is no mask)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def cgroup_cpu_quota(root: Path = Path("/sys/fs/cgroup")) -> int | None:
    """The cgroup's CPU quota in whole cores (rounded up), or None where there is none or it is
    unreadable: cgroup v2 ``cpu.max`` ("max 100000" or "200000 100000"), else v1
    ``cpu.cfs_quota_us`` / ``cpu.cfs_period_us``."""
    try:
        fields = (root / "cpu.max").read_text().split()
        quota, period = fields[0], fields[1]
    except (OSError, IndexError):
        try:
            quota = (root / "cpu" / "cpu.cfs_quota_us").read_text().strip()
            period = (root / "cpu" / "cpu.cfs_period_us").read_text().strip()
        except OSError:
            return None
    try:
        q, p = int(quota), int(period)
    except ValueError:  # "max": no quota
        return None
    return -(-q // p) if q > 0 and p > 0 else None


def cpu_name(cpuinfo: Path = Path("/proc/cpuinfo")) -> str:
    """The CPU's model name, with its family and model number where Linux gives them (one
    name, e.g. ``AMD EPYC``, covers several generations whose speeds differ)."""
    try:
        lines = cpuinfo.read_text().splitlines()
    except OSError:
        return platform.processor() or platform.machine()
    fields: dict[str, str] = {}
    for line in lines:
        key, _, value = line.partition(":")
        fields.setdefault(key.strip(), value.strip())
    name = fields.get("model name") or platform.processor() or platform.machine()
    if "cpu family" in fields and "model" in fields:
        return f"{name} (family {fields['cpu family']}, model {fields['model']})"
    return name


def onednn_cap() -> str | None:
    """The ISA level oneDNN is capped at (``ONEDNN_MAX_CPU_ISA``, or its older name
    ``DNNL_MAX_CPU_ISA``), upper-cased; None when not capped or the value is not a level."""
    value = (os.environ.get("ONEDNN_MAX_CPU_ISA") or os.environ.get("DNNL_MAX_CPU_ISA") or "").strip().upper()
    return value if value in ONEDNN_ISAS and value not in ("ALL", "DEFAULT") else None


def cpu_computes(feature: str) -> bool:
    """Whether this CPU computes ``feature`` (``bf16`` or ``vnni``, int8 dot products) in hardware,
    as oneDNN may use it: the instruction set is there and no ``ONEDNN_MAX_CPU_ISA`` cap is below it."""
    import torch

    present = any(getattr(torch.cpu, f"_is_{isa}_supported", lambda: False)() for isa in CPU_FLAGS[feature])
    cap = onednn_cap()
    return present and (cap is None or cap in ALLOWING[feature])


def cpu_has_bf16() -> bool:
    """Whether this CPU multiplies bf16 in hardware (avx512_bf16 or AMX); elsewhere bf16 is emulated
    and far slower than fp32."""
    return cpu_computes("bf16")


def cpu_has_vnni() -> bool:
    """Whether this CPU has int8 dot-product instructions (AVX-512 VNNI, AVX-VNNI or AMX)."""
    return cpu_computes("vnni")


def gpu_has_bf16() -> bool:
    """Whether the GPU computes bf16 in hardware (Ampere and later; older ones only emulate it)."""
    import torch

    if not torch.cuda.is_available():
        return False
    try:
        return bool(torch.cuda.is_bf16_supported(including_emulation=False))
    except TypeError:  # a torch without the argument
        return torch.cuda.get_device_capability()[0] >= 8


# -- devices --------------------------------------------------------------------------------------
def training_device(cfg: Any) -> str:
    """``cpu`` or ``cuda``: where ``cfg.trainer`` trains."""
    import torch

    accelerator = str(cfg.trainer.get("accelerator", "auto"))
    if accelerator == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return "cuda" if accelerator in ("gpu", "cuda") else accelerator


def decoding_device(device: str, precision: str) -> str:
    """``device=auto`` for decoding: cuda when there is one, except for int8, which decodes on CPUs."""
    if device != "auto":
        return device
    import torch

    return "cuda" if torch.cuda.is_available() and precision != "int8" else "cpu"


# -- precision ------------------------------------------------------------------------------------
def auto_precision(device: str) -> tuple[str, str]:
    """``trainer.precision=auto``: the fastest precision that trains reliably on ``device`` (``cpu``,
    ``cuda``, ...), and why it was chosen."""
    if device == "cuda":
        if gpu_has_bf16():
            return "bf16-mixed", "this GPU computes in bf16"
        return "16-mixed", "this GPU has no bf16: fp16 with loss scaling"
    if device == "cpu" and cpu_has_bf16():
        return "bf16-mixed", "this CPU has bf16 instructions (avx512_bf16/AMX)"
    return "32-true", f"no bf16 instructions on this {device}"


def auto_decoding_precision(device: str) -> tuple[str, str]:
    """``precision=auto`` of translate, serve and evaluate (torch backend): bf16 where the device
    computes it in hardware, else fp32, and why. Never int8: quantizing changes the translations,
    so it is the user's choice (``precision=int8``), warned about where it is slow."""
    if device == "cuda":
        return ("bf16", "this GPU computes in bf16") if gpu_has_bf16() else ("32", "this GPU has no bf16")
    if device == "cpu" and cpu_has_bf16():
        return "bf16", "this CPU has bf16 instructions (avx512_bf16/AMX)"
    return "32", f"no bf16 instructions on this {device}"


def missing_instructions(precision: str, device: str) -> str | None:
    """The instructions ``device`` lacks to compute ``precision`` fast (a training precision,
    ``bf16-mixed``, ``16-mixed``, ..., or a decoding one, ``bf16``, ``int8``), or None."""
    if precision.startswith("bf16"):
        if device == "cpu" and not cpu_has_bf16():
            return "bf16 instructions (avx512_bf16/AMX)"
        if device == "cuda" and not gpu_has_bf16():
            return "bf16 support"
    if precision.startswith("16") and device == "cpu":
        import torch

        if not getattr(torch.cpu, "_is_amx_fp16_supported", lambda: False)():
            return "fp16 instructions (AMX-FP16)"
    if precision == "int8" and device == "cpu" and not cpu_has_vnni():
        return "int8 dot-product instructions (VNNI)"
    return None


def matmul_slowdown(precision: str, rows: int = 64, size: int = 256, out: int = 2048, repeats: int = 3) -> float:
    """How many times longer a (rows x size) @ (size x out) product takes in ``precision``
    (``bf16``/``bf16-mixed``, ``16-mixed``, ``int8``) than in fp32 on this CPU, one thread, best of
    ``repeats`` (the shape of a decoding step's output layer). int8 is timed as
    ``nmt.kernels.int8`` computes it: activations quantized per row, ``torch._int_mm``, the int32
    sums scaled back to fp32. Some milliseconds (an emulated bf16 product ~30 ms)."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        x, w = torch.randn(rows, size), torch.randn(size, out)
        if precision == "int8":
            w_scale = w.abs().amax(0, keepdim=True) / 127
            w_codes = (w / w_scale).round().to(torch.int8).t().contiguous().t()  # column-major, as Int8Linear keeps it

            def slow() -> Any:
                scale = x.abs().amax(-1, keepdim=True) / 127
                sums = torch._int_mm((x / scale).round_().to(torch.int8), w_codes)
                return sums.float().mul_(scale).mul_(w_scale)
        else:
            dtype = torch.bfloat16 if precision.startswith("bf16") else torch.float16
            a, b = x.to(dtype), w.to(dtype)
            slow = lambda: torch.mm(a, b)  # noqa: E731
        return best_time(slow, repeats) / best_time(lambda: torch.mm(x, w), repeats)
    finally:
        torch.set_num_threads(threads)


def best_time(work: Any, repeats: int) -> float:
    work()  # the first call prepares oneDNN's kernel
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        work()
        times.append(time.perf_counter() - start)
    return max(min(times), 1e-9)


SLOW = 1.25  # a precision whose products take this many times fp32's time or more is warned about


def slow_precision_warning(key: str, precision: str, device: str, faster: str) -> str | None:
    """The one-line warning for ``key=precision`` where this machine computes it slowly, or None.
    bf16 and fp16: where the instructions are missing (the products are emulated), int8: wherever
    its products, timed here, are slower than fp32's (whatever the cause on this CPU); the factor
    measured here and the faster choice are named."""
    missing = missing_instructions(precision, device)
    if device != "cpu":
        return None if missing is None else (f"{key}={precision}: this {device} has no {missing}, so {precision} "
                                             f"runs slowly; {key}={faster} is faster on this machine")
    if precision != "int8" and missing is None:  # fp32, or a precision the hardware computes
        return None
    factor = matmul_slowdown(precision)
    if factor < SLOW:
        return None
    lacks = f"; this cpu has no {missing}" if missing else ""
    return (f"{key}={precision}: a matmul takes {factor:.1f}x its fp32 time on this cpu{lacks}, so {precision} runs "
            f"slowly; {key}={faster} is faster on this machine")


def resolve_precision(cfg: Any) -> None:
    """``trainer.precision=auto`` becomes what ``auto_precision`` picks for the training device
    (logged); an explicit precision the device computes slowly is kept, with a warning."""
    from omegaconf import open_dict

    device = training_device(cfg)
    requested = str(cfg.trainer.get("precision"))
    if requested != "auto":
        warning = slow_precision_warning("trainer.precision", requested, device, "auto")
        if warning:
            log.warning("%s (it chooses %s)", warning, auto_precision(device)[0])
        return
    precision, why = auto_precision(device)
    with open_dict(cfg):
        cfg.trainer.precision = precision
    log.info("trainer.precision=auto: %s (%s; trainer.precision=32-true trains in fp32)", precision, why)


def resolve_decoding_precision(requested: str, device: str) -> str:
    """The decoding precision for ``precision=requested`` on ``device``: ``auto`` becomes what
    ``auto_decoding_precision`` picks (logged); an explicit one the device computes slowly is kept,
    with a one-line warning naming the measured factor and the faster choice."""
    if requested == "auto":
        precision, why = auto_decoding_precision(device)
        log.info("precision=auto: %s (%s; precision=32 decodes in fp32)", precision, why)
        return precision
    warning = slow_precision_warning("precision", requested, device, auto_decoding_precision(device)[0])
    if warning:
        log.warning("%s", warning)
    return requested
