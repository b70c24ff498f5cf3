"""scripts/compare_eole.py without Eole: its configs against our presets, its reading of Eole's
logs (a stand-in ``python``) and of its output; where an Eole environment is found
(``EOLE_PYTHON``), Eole's own config classes check the configs."""

from __future__ import annotations

import importlib.util
import os
import subprocess
from pathlib import Path

import pytest
import yaml
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import open_dict

from nmt.bench.toolkits import yaml_lines
from nmt.data.tokenizer import train_sentencepiece
from nmt.training.schedules import inverse_sqrt

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("compare_eole", ROOT / "scripts" / "compare_eole.py")
compare = importlib.util.module_from_spec(spec)
spec.loader.exec_module(compare)

# Eole 0.6.4's report lines, as `eole train` logs them
LOG = """[2026-12-01 09:28:27,525 INFO] Step  5/   20; acc: 0.0; ppl: 7831.92; xent: 8.97; aux: 0.000; mtp: 0.000; attn_ent: 0.000; lr: 2.50e-05; sents:     918; bsz: 2205/2279/184; 327/338 tok/s;     34 sec;
[2026-12-01 09:28:46,121 INFO] Step 10/   20; acc: 0.6; ppl: 6782.10; xent: 8.82; aux: 0.000; mtp: 0.000; attn_ent: 0.000; lr: 5.00e-05; sents:     940; bsz: 2459/2674/188; 2661/3000 tok/s;     52 sec;
[2026-12-01 09:29:10,737 INFO] Step 15/   20; acc: 4.8; ppl: 5593.28; xent: 8.63; aux: 0.000; mtp: 0.000; attn_ent: 0.000; lr: 7.50e-05; sents:     907; bsz: 2278/2551/181; 1863/2000 tok/s;     77 sec;
"""
# an environment with Eole: EOLE_PYTHON, else venv-eole beside the checkout (as ../shared/data)
EOLE_PYTHON = Path(os.environ.get("EOLE_PYTHON", ROOT.parent / "venv-eole" / "bin" / "python"))


@pytest.fixture(scope="module")
def eole_python() -> Path:
    if not (EOLE_PYTHON.is_file() and subprocess.run([str(EOLE_PYTHON), "-c", "import eole.config.run"],
                                                     capture_output=True).returncode == 0):
        pytest.skip(f"no Eole environment at {EOLE_PYTHON} (set EOLE_PYTHON)")
    return EOLE_PYTHON


def paths(tmp_path: Path) -> dict[str, Path]:
    return {f"{split}_{side}": tmp_path / f"{split}.{side}" for split in ("train", "valid") for side in ("src", "tgt")}


def fake_python(tmp_path: Path, log: str, code: int = 0) -> Path:
    (tmp_path / "log.txt").write_text(log)
    python = tmp_path / "python"
    python.write_text(f"#!/bin/sh\ncat {tmp_path / 'log.txt'} >&2\nexit {code}\n")
    python.chmod(0o755)
    return python


def ours(model: str):
    """Our train config for ``model``, resolved as train.py would (Hydra's runtime set)."""
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(ROOT / "nmt" / "conf"), version_base="1.3"):
        cfg = compose("train", overrides=[f"model={model}", "data=multi30k"], return_hydra_config=True)
    with open_dict(cfg):
        cfg.hydra.runtime.output_dir, cfg.hydra.runtime.cwd, cfg.hydra.job.num = "/tmp", str(ROOT), 0
    HydraConfig().set_config(cfg)
    GlobalHydra.instance().clear()
    return cfg


def test_reads_eole_target_tokens_per_second_after_the_warmup(tmp_path):
    python = fake_python(tmp_path, LOG)
    # steps 10 and 15: 3,000 and 2,000 target tokens/s over equal steps -> 2,400 over their time
    assert compare.eole_speed(python, tmp_path / "c.yaml", warmup=5, threads=1) == pytest.approx(2400)
    with pytest.raises(RuntimeError, match="no report line after step 15 in the log of eole train"):
        compare.eole_speed(python, tmp_path / "c.yaml", warmup=15, threads=1)


def test_a_failed_eole_run_says_so(tmp_path):
    python = fake_python(tmp_path, "Traceback: pydantic ValidationError\n", code=1)
    with pytest.raises(RuntimeError, match=r"eole train -config .*c.yaml failed:\nTraceback: pydantic"):
        compare.eole_speed(python, tmp_path / "c.yaml", warmup=10, threads=1)


@pytest.mark.parametrize("model", list(compare.EOLE_MODELS))
def test_eole_configs_have_our_presets_sizes_and_optimizer(tmp_path, model):
    config = yaml.safe_load(compare.eole_config(model, paths(tmp_path), tmp_path, steps=7, precision="bf16").read_text())
    cfg, m, t = ours(model), config["model"], config["training"]
    assert config["src_vocab"] == config["tgt_vocab"] == str(tmp_path / "vocab") and config["share_vocab"]
    assert config["data"]["corpus_1"]["path_src"] == str(tmp_path / "train.src")
    assert m["layers"] == cfg.model.encoder.num_layers == cfg.model.decoder.num_layers
    assert m["hidden_size"] == m["embeddings"]["word_vec_size"] == cfg.model.hidden_size == cfg.model.emb_size
    if model == "transformer":
        assert m["heads"] == cfg.model.encoder.num_heads and m["transformer_ff"] == cfg.model.encoder.ff_size
        assert cfg.model.encoder.norm == "pre" and cfg.model.encoder.positions == "sinusoidal"
        assert t["attention_dropout"] == [cfg.model.encoder.attention_dropout]
    else:
        assert m["encoder"]["encoder_type"] == ("brnn" if cfg.model.encoder.bidirectional else "rnn")
        luong = cfg.model.decoder.attention._target_.endswith("LuongAttention")
        assert m["decoder"]["global_attention"] == ("general" if luong else "mlp")
        assert not luong or cfg.model.decoder.attention.score == "general"
    assert m.get("share_embeddings", False) == cfg.model.share_src_tgt_embeddings
    assert m.get("share_decoder_embeddings", False) == cfg.model.tie_embeddings
    assert t["dropout"] == [cfg.model.dropout]
    assert t["batch_type"] == "tokens" and t["batch_size"] == 3000 and t["train_steps"] == 7
    assert t["compute_dtype"] == "bf16" and t["use_amp"] and t["num_workers"] == 0 and cfg.data.num_workers == "auto"  # 0 on a CPU
    assert (t["adam_beta1"], t["adam_beta2"]) == tuple(cfg.optimizer.betas) and t["adam_eps"] == cfg.optimizer.eps
    assert t["label_smoothing"] == cfg.module.label_smoothing and t["max_grad_norm"] == cfg.trainer.gradient_clip_val
    assert t["warmup_steps"] == cfg.scheduler.warmup_steps and config["seed"] == cfg.seed


@pytest.mark.parametrize("model", list(compare.EOLE_MODELS))
def test_eole_noam_schedule_is_our_inverse_sqrt(tmp_path, model):
    """Eole's noam rate at step k (counted from 1) equals ours after k - 1 scheduler steps."""
    import torch

    t = yaml.safe_load(compare.eole_config(model, paths(tmp_path), tmp_path, 7, "fp32").read_text())["training"]
    lr = float(ours(model).optimizer.lr)
    hidden = compare.EOLE_MODELS[model]["hidden_size"]
    opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=lr)
    schedule = inverse_sqrt(opt, warmup_steps=t["warmup_steps"])
    for step in range(1, 1001):
        noam = t["learning_rate"] * hidden**-0.5 * min(step**-0.5, step * t["warmup_steps"] ** -1.5)
        assert noam == pytest.approx(opt.param_groups[0]["lr"], rel=1e-5), step
        opt.step()
        schedule.step()


def test_predict_config_is_beam_5_with_our_batch_and_length_penalty(tmp_path):
    config = yaml.safe_load(compare.predict_config(tmp_path / "m", tmp_path / "in", tmp_path / "out.pieces", "fp32").read_text())
    assert config["beam_size"] == 5 and config["batch_type"] == "tokens" and config["batch_size"] == 2048
    assert (config["length_penalty"], config["alpha"]) == ("wu", 0.6) and config["compute_dtype"] == "fp32"
    assert config["output"] == str(tmp_path / "out.pieces")


def test_eole_pieces_are_joined_into_text_and_scored(tmp_path):
    lines = ["a man is riding a bike .", "two dogs play in the snow .", "a woman sings on a stage ."] * 20
    sp = train_sentencepiece(lines, tmp_path, {"vocab_size": 40, "hard_vocab_limit": False})
    pieces = [" ".join(sp.pieces(sp.encode(line))) for line in lines[:3]] + [""]
    assert compare.join_pieces(pieces, Path(sp.model_file)) == lines[:3] + [""]
    assert compare.scores(lines[:3], lines[:3]) == {"bleu": 100.0, "words": 21}
    with pytest.raises(RuntimeError, match="2 translations for 3 references"):
        compare.scores(lines[:2], lines[:3])


def test_small_floats_stay_numbers_in_yaml(tmp_path):
    assert yaml.safe_load(yaml_lines({"adam_eps": 1e-9, "lr": 0.64, "n": 3})) == {"adam_eps": 1e-9, "lr": 0.64, "n": 3}


@pytest.mark.parametrize("model", list(compare.EOLE_MODELS))
def test_eole_accepts_the_configs(tmp_path, model, eole_python):
    files = paths(tmp_path)
    for path in [*files.values(), tmp_path / "vocab"]:
        path.write_text("a\t1\n")
    train = compare.eole_config(model, files, tmp_path, steps=7, precision="fp32")
    predict = compare.predict_config(tmp_path / "m", tmp_path / "train.src", tmp_path / "out.pieces", "bf16")
    check = ("import sys, yaml; from eole.config.run import TrainConfig, PredictConfig\n"
             "t = TrainConfig(**yaml.safe_load(open(sys.argv[1])))\n"
             "p = PredictConfig(**yaml.safe_load(open(sys.argv[2])))\n"
             "e, d = t.model.encoder, t.model.decoder\n"
             "print(e.encoder_type, e.layers, e.hidden_size, d.layers, getattr(d, 'global_attention', None),"
             " t.training.learning_rate, t.training.compute_dtype, p.beam_size, p.length_penalty, p.compute_dtype)\n")
    run = subprocess.run([str(eole_python), "-c", check, str(train), str(predict)], capture_output=True, text=True,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert run.returncode == 0, run.stderr[-3000:]
    fields = run.stdout.split()
    expected = {"transformer": ["transformer", "2", "256", "2"], "lstm_luong": ["brnn", "2", "256", "2", "general"],
                "lstm_bahdanau": ["brnn", "2", "256", "2", "mlp"]}[model]
    assert fields[: len(expected)] == expected
    assert fields[-4:] == ["torch.float32", "5", "wu", "torch.bfloat16"]


def test_reused_checkpoints_must_have_the_asked_steps(tmp_path):
    """``--reuse-checkpoints`` translates with an earlier run's checkpoint only if it trained
    the asked number of steps (its summary.json says so)."""
    assert compare.trained_steps(tmp_path) is None
    (tmp_path / "summary.json").write_text('{"steps": 300}')
    assert compare.trained_steps(tmp_path) == 300
