"""The longest source and target a trained model accepts, read from its run config: what
translating, scoring and the CTranslate2 export all cut sentences to. No torch here."""

from __future__ import annotations

from typing import Any


def tokens(value: Any, key: str) -> int:
    """A length limit read from a checkpoint's config, or a ValueError naming its key."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"the checkpoint's {key}={str(value)[:40]} is not a number of tokens")
    return value


def model_max_src_len(run_config: dict[str, Any]) -> int:
    """Source tokens with EOS: the data config's limit, capped by a Transformer encoder's position table."""
    limit = tokens(run_config.get("data", {}).get("max_src_len", 256), "data.max_src_len")
    encoder_max = run_config.get("model", {}).get("encoder", {}).get("max_len")
    return min(limit, tokens(encoder_max, "model.encoder.max_len")) if encoder_max else limit


def model_max_tgt_len(run_config: dict[str, Any], position_table: int | None = None) -> int:
    """Target tokens with EOS: the data config's limit, capped by the decoder's position table
    (a Transformer decoder's ``max_len``; None for an RNN decoder)."""
    limit = tokens(run_config.get("data", {}).get("max_tgt_len", 256), "data.max_tgt_len")
    return min(limit, int(position_table)) if position_table else limit
