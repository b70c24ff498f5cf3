"""nmt: config-driven neural machine translation."""

from pathlib import Path

# The Hydra config tree (conf/ beside the package in a source checkout or editable install).
CONF_DIR = str(Path(__file__).resolve().parents[1] / "conf")
