"""nmt: config-driven neural machine translation."""

from pathlib import Path

# The Hydra config tree, shipped inside the package (nmt/conf/).
CONF_DIR = str(Path(__file__).resolve().parent / "conf")


def pad_to(n: int, multiple: int) -> int:
    """``n`` rounded up to a multiple of ``multiple`` (vocabulary rows: tensor cores want multiples of 8)."""
    return -(-int(n) // int(multiple)) * int(multiple)


def register_resolvers() -> None:
    """Make ``${pad_to:n,multiple}`` resolvable. Each entry point calls
    this before Hydra composes (and tests/conftest.py does); importing ``nmt`` registers nothing
    (and imports nothing heavy: ``nmt.cli_io.hold_stop_signals`` runs before the rest loads)."""
    from omegaconf import OmegaConf

    OmegaConf.register_new_resolver("pad_to", pad_to, replace=True)
