"""Release files: a checkpoint's weights, config, vocabularies and test report, without the
training state (``nmt-export format=release``, ``nmt-average``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from nmt.checkpoints.files import FORMAT, check_run_config, merged_weights
from nmt.checkpoints.loading import run_report


def release(checkpoint: dict[str, Any], source: str | Path, weights: str = "stored", **extra: Any) -> dict[str, Any]:
    """A release checkpoint: the Seq2Seq weights (a LoRA run's adapters merged), run config,
    vocabularies and test report (if the run has one) of ``checkpoint``, without optimizer, loop,
    callback or RNG state (loadable by translate, evaluate and serve). Its config is checked first
    (``check_run_config``): a crafted file is not repackaged."""
    check_run_config(checkpoint, source)
    # a LoRA run's adapters merged into the weights they adapt: a plain model for every reader and engine
    state = {k: v for k, v in merged_weights(checkpoint, weights, source).items() if k.startswith("model.")}
    return {
        "nmt_format": FORMAT, "kind": "release", "state_dict": state,
        "run_config": checkpoint["run_config"], "tokenizers": checkpoint["tokenizers"],
        "global_step": checkpoint.get("global_step"), "epoch": checkpoint.get("epoch"),
        "monitor": checkpoint.get("monitor"), "source": {"path": str(source), "weights": weights},
        "report": run_report(checkpoint, source), **extra,
    }
