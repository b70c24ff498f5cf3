"""nmt: config-driven neural machine translation."""

from pathlib import Path

from omegaconf import OmegaConf

# The Hydra config tree, shipped inside the package (nmt/conf/).
CONF_DIR = str(Path(__file__).resolve().parent / "conf")


def cpu_has_bf16() -> bool:
    """Whether this CPU multiplies bf16 in hardware (avx512_bf16 or AMX); elsewhere bf16 is emulated
    and slower than fp32."""
    import torch

    return any(getattr(torch.cpu, f"_is_{isa}_supported", lambda: False)() for isa in ("avx512_bf16", "amx_tile"))


def auto_precision(device: str) -> tuple[str, str]:
    """``trainer.precision=auto``: the fastest precision that trains reliably on ``device`` (``cpu``,
    ``cuda``, ...), and why it was chosen."""
    import torch

    if device == "cuda":
        if torch.cuda.is_bf16_supported():
            return "bf16-mixed", "this GPU computes in bf16"
        return "16-mixed", "this GPU has no bf16: fp16 with loss scaling"
    if device == "cpu" and cpu_has_bf16():
        return "bf16-mixed", "this CPU has bf16 instructions (avx512_bf16/AMX)"
    return "32-true", f"no bf16 instructions on this {device}"


def pad_to(n: int, multiple: int) -> int:
    """``n`` rounded up to a multiple of ``multiple`` (vocabulary rows: tensor cores want multiples of 8)."""
    return -(-int(n) // int(multiple)) * int(multiple)


def register_resolvers() -> None:
    """Make ``${pad_to:n,multiple}`` resolvable. Each entry point calls
    this before Hydra composes (and tests/conftest.py does); importing ``nmt`` registers nothing."""
    OmegaConf.register_new_resolver("pad_to", pad_to, replace=True)
