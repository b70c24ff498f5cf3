"""scripts/compare_opennmt.py without OpenNMT-py: its configs and its reading of OpenNMT-py's
logs (``nmt.bench.opennmt``), against a stand-in ``onmt_train``."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from nmt.bench import opennmt

LOG = """[2026-11-30 09:02:28,256 INFO] Step 10/   40; acc: 5.9; ppl: 2670.2; xent: 7.9; lr: 0.00100; sents:    1477; bsz: 2011/2215/148; 1117/1230 tok/s;     18 sec;
[2026-11-30 09:02:36,104 INFO] Step 20/   40; acc: 8.3; ppl: 392.0; xent: 6.0; lr: 0.00100; sents:    1456; bsz: 2004/2250/146; 2553/3000 tok/s;     26 sec;
[2026-11-30 09:02:44,303 INFO] Step 30/   40; acc: 12.0; ppl: 258.5; xent: 5.6; lr: 0.00100; sents:    1695; bsz: 2332/2552/170; 2844/2000 tok/s;     34 sec;
"""


def fake_onmt(tmp_path: Path, log: str, code: int = 0) -> Path:
    (tmp_path / "log.txt").write_text(log)
    train = tmp_path / "onmt_train"
    train.write_text(f"#!/bin/sh\ncat {tmp_path / 'log.txt'} >&2\nexit {code}\n")
    train.chmod(0o755)
    return tmp_path


def test_reads_target_tokens_per_second_after_the_warmup(tmp_path):
    bin_dir = fake_onmt(tmp_path, LOG)
    # steps 20 and 30: 3,000 and 2,000 target tokens/s over equal steps -> 2,400 over their time
    assert opennmt.onmt_speed(bin_dir, tmp_path / "c.yaml", warmup=10, threads=1) == pytest.approx(2400)
    with pytest.raises(RuntimeError, match="no report line after step 30"):
        opennmt.onmt_speed(bin_dir, tmp_path / "c.yaml", warmup=30, threads=1)


def test_a_failed_onmt_run_says_so(tmp_path):
    bin_dir = fake_onmt(tmp_path, "Traceback: out of memory\n", code=1)
    with pytest.raises(RuntimeError, match=r"onmt_train -config .*c.yaml failed:\nTraceback: out of memory"):
        opennmt.onmt_speed(bin_dir, tmp_path / "c.yaml", warmup=10, threads=1)


@pytest.mark.parametrize("model", list(opennmt.ONMT_MODELS))
def test_opennmt_configs_are_valid_yaml_with_the_presets_sizes(tmp_path, model):
    paths = {f"{split}_{side}": tmp_path / f"{split}.{side}" for split in ("train", "valid") for side in ("src", "tgt")}
    config = yaml.safe_load(opennmt.onmt_config(model, paths, tmp_path, steps=7).read_text())
    assert config["train_steps"] == 7 and config["batch_size"] == 3000 and config["batch_type"] == "tokens"
    assert config["hidden_size"] == config["word_vec_size"] == 256
    assert config["data"]["corpus_1"]["path_src"] == str(tmp_path / "train.src")
    assert config["layers"] == 2  # our presets: 2 encoder and 2 decoder layers (LSTM and Transformer)
