"""Slow: each attention model learns a short synthetic task to high BLEU.

Budget: 4,000 synthetic pairs of 3-8 words, hidden size 128, 20 epochs of batches of up to 512
tokens (about 1,500 steps), each preset at its own learning rate (``lr_by_model``); a few
minutes per model on 2 CPU cores. Run with ``pytest -m slow``.
"""

from __future__ import annotations

import pytest

from nmt.train import train

SHORT_TASK = [
    "data=synthetic",
    "data.source.num_pairs=4000",
    "data.source.valid_pairs=100",
    "data.source.test_pairs=200",
    "data.source.min_len=3",
    "data.source.max_len=8",
    "data.source.lengths=uniform",
    "data.max_tokens=1024",
    "model.emb_size=128",
    "model.hidden_size=128",
    "model.dropout=0.1",
    "scheduler.warmup_steps=100",
    "trainer.max_epochs=40",
    "trainer.log_every_n_steps=50",
    "test_decoding.beam_size=4",
]


@pytest.mark.slow
@pytest.mark.parametrize("model", ["lstm_bahdanau", "lstm_luong", "transformer"])
def test_attention_models_learn_the_short_task(cfg_train, model):
    overrides = list(SHORT_TASK)
    if model == "transformer":
        overrides = [o for o in overrides if not o.startswith("model.emb_size")]
        overrides += ["model.encoder.num_heads=4", "model.decoder.num_heads=4", "model.encoder.ff_size=256", "model.decoder.ff_size=256"]
    metrics = train(cfg_train(overrides, model=model))
    assert metrics["test/bleu"] > 80, metrics
