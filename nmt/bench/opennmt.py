"""OpenNMT-py (3.5) beside ours: its configs for our presets' sizes and its training speed."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

from nmt.bench.toolkits import report_speed, yaml_lines

COMMON = {"batch_type": "tokens", "batch_size": 3000, "bucket_size": 32768, "report_every": 10,
          "save_checkpoint_steps": 1000000, "valid_steps": 1000000, "optim": "adam", "seed": 1234,
          "share_vocab": True, "overwrite": True}
LSTM = {"encoder_type": "brnn", "decoder_type": "rnn", "rnn_type": "LSTM", "layers": 2, "hidden_size": 256,
        "word_vec_size": 256, "input_feed": 1, "dropout": 0.2, "learning_rate": 0.001}
ONMT_MODELS = {
    "lstm_luong": {**LSTM, "global_attention": "general"},
    "lstm_bahdanau": {**LSTM, "global_attention": "mlp"},
    "transformer": {"encoder_type": "transformer", "decoder_type": "transformer", "position_encoding": True,
                    "layers": 2, "heads": 4, "hidden_size": 256, "word_vec_size": 256, "transformer_ff": 1024,
                    "dropout": 0.1, "attention_dropout": 0.0, "share_decoder_embeddings": True,
                    "label_smoothing": 0.1, "adam_beta2": 0.98, "decay_method": "noam", "warmup_steps": 1000,
                    "learning_rate": 2.0, "param_init": 0.0, "param_init_glorot": True,
                    # OpenNMT-py's Transformer recipe; with its default per-sentence loss
                    # normalisation this model barely learned (BLEU 6.6 after 1,500 steps)
                    "normalization": "tokens"},
}


def onmt_config(model: str, paths: dict[str, Path], work: Path, steps: int) -> Path:
    """``onmt_train``'s config for ``model``, written into ``work`` (which holds the vocabulary)."""
    config = {**COMMON, **ONMT_MODELS[model], "train_steps": steps, "save_model": str(work / model / "model"),
              "src_vocab": str(work / "vocab"), "tgt_vocab": str(work / "vocab"),
              "data": {"corpus_1": {"path_src": str(paths["train_src"]), "path_tgt": str(paths["train_tgt"])},
                       "valid": {"path_src": str(paths["valid_src"]), "path_tgt": str(paths["valid_tgt"])}}}
    path = work / f"{model}.yaml"
    path.write_text(yaml_lines(config))
    return path


def onmt_speed(bin_dir: Path, config: Path, warmup: int, threads: int) -> float:
    """Target tokens/s: OpenNMT-py's report lines after ``warmup`` steps, weighted by time."""
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    run = subprocess.run([str(bin_dir / "onmt_train"), "-config", str(config)], env=env, capture_output=True, text=True)
    if run.returncode:
        raise RuntimeError(f"onmt_train -config {config} failed:\n{run.stderr[-3000:]}")
    speed = report_speed(run.stderr + run.stdout, warmup)
    if speed is None:
        raise RuntimeError(f"no report line after step {warmup} in the log of onmt_train -config {config}")
    return speed
