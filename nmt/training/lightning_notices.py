"""Lightning's notices that say nothing about a run, each silenced by its own message: a blanket
filter would also hide the warnings a user needs.

- "💡 Tip: For seamless cloud logging ... litlogger": an advertisement logged by every ``Trainer``
  without Lightning's cloud logger (and the same tip for its model store).
- "`isinstance(treespec, LeafSpec)` is deprecated": torch 2.10+ deprecates a class that
  Lightning's ``CombinedLoader`` still builds (``pytorch_lightning/utilities/_pytree.py``), once
  per fit, validation and test.

Lightning's model summary, with its "Precision bf16-mixed is not supported by the model summary"
warning and its "Total FLOPs: 0" on a CPU, is off in ``nmt/conf/trainer/default.yaml``: the run
logs its parameter count itself.
"""

from __future__ import annotations

import logging
import warnings

RANK_ZERO_LOGGERS = ("pytorch_lightning.utilities.rank_zero", "lightning_fabric.utilities.rank_zero")
TIP = "💡 Tip: "


class DropTips(logging.Filter):
    """Drops Lightning's "💡 Tip:" records."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(TIP)


def silence_lightning_notices() -> None:
    """Install both filters (idempotent)."""
    for name in RANK_ZERO_LOGGERS:
        logger = logging.getLogger(name)
        if not any(isinstance(f, DropTips) for f in logger.filters):
            logger.addFilter(DropTips())
    warnings.filterwarnings("ignore", message=r"`isinstance\(treespec, LeafSpec\)` is deprecated", category=FutureWarning,
                            module=r"pytorch_lightning\.utilities\._pytree")
