"""Scale-out paths exercised on CPU: DDP (gloo), bf16 autocast, gradient checkpointing, sweeps,
experiment tracking."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from pytorch_lightning import Callback

import nmt.training.builders
from nmt.train import train
from tests.conftest import KERNELS, ROOT, TINY, heads
from tests.test_models import batch, build

SMALL_TF = ["model=transformer", "model.hidden_size=32", *heads("transformer")]


def run(args: list[str], timeout: int = 600) -> subprocess.CompletedProcess:
    result = subprocess.run([sys.executable, *args], capture_output=True, text=True, cwd=ROOT, timeout=timeout)
    assert result.returncode == 0, result.stderr[-3000:]
    return result


def cli_overrides(tmp_path: Path) -> list[str]:
    """The tiny-run overrides for a command line (Hydra's own run dir, a shared cache)."""
    keep = [o for o in TINY if not o.startswith("model.")]
    return [*keep, "model.emb_size=32", f"kernels={KERNELS[0]}", f"paths.cache_dir={tmp_path.parent / 'nmt-cache'}"]


PATTERNS = ["model.encoder.attention=low_rank", "model.encoder.rank=8", "model.decoder.attention=local_global",
            "model.decoder.window=2", "model.decoder.global_tokens=1"]


@pytest.mark.slow  # end to end in processes of its own: the slow tier
@pytest.mark.parametrize("attention", [[], PATTERNS], ids=["full", "low_rank_local_global"])
def test_ddp_on_two_cpu_processes_matches_single_process_bleu(tmp_path, attention):
    """2 ranks (gloo) train and validate; the test BLEU they compute together on the best
    checkpoint equals a single-process evaluation of that checkpoint (also with the attention
    patterns: Linformer's projections are weights every rank updates alike)."""
    out = tmp_path / "ddp"
    run(["train.py", *cli_overrides(tmp_path), *SMALL_TF, *attention, "trainer=ddp", "trainer.accelerator=cpu", "trainer.devices=2",
         "trainer.precision=32-true", "trainer.max_epochs=3", f"hydra.run.dir={out}"])
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] > 0 and "val/bleu" in summary["metrics"]
    assert (out / "train_ddp_process_1.log").is_file()  # the second rank ran
    hyps = (out / "test_hyps.txt").read_text().splitlines()
    assert len(hyps) == 20  # every test sentence once, none duplicated by the sampler
    single = tmp_path / "single"
    run(["evaluate.py", f"ckpts=[{summary['best_checkpoint']}]", "n_bootstrap=10", "precision=32",  # as the run tested
         f"hydra.run.dir={single}",
         f"paths.cache_dir={tmp_path.parent / 'nmt-cache'}"])
    report = json.loads((single / "comparison.json").read_text())
    (name,) = report
    assert (single / f"{name}.hyp.txt").read_text().splitlines() == hyps
    assert report[name]["bleu"] == pytest.approx(summary["metrics"]["test/bleu"], abs=1e-6)


@pytest.mark.slow
def test_ddp_ranks_stop_together_on_nonfinite_weights(tmp_path):
    """A NaN weight at a checkpoint: each rank stops with the same clear error. The file writer
    (rank 0 only) alone stopped rank 0, and rank 1 failed at its next collective with gloo's
    "Connection closed by peer" (NCCL may wait there until its timeout)."""
    out = tmp_path / "ddp"
    command = [sys.executable, "train.py", *cli_overrides(tmp_path), *SMALL_TF, "trainer=ddp", "trainer.accelerator=cpu",
               "trainer.devices=2", "trainer.precision=32-true", "trainer.max_steps=6", "test=false",
               "callbacks.last_checkpoint.every_n_train_steps=3", "+callbacks.poison._target_=tests.callbacks.PoisonAt",
               "+callbacks.poison.step=2", f"hydra.run.dir={out}"]
    result = subprocess.run(command, capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert result.returncode != 0
    assert result.stderr.count("error: refusing to save a checkpoint after step 3: non-finite weights in model.") == 2  # one line a rank
    assert "Connection closed by peer" not in result.stderr
    assert not list((out / "checkpoints").glob("*.ckpt"))


def _grad_norm(module) -> float | None:
    grads = [p.grad.detach().float() for p in module.parameters() if p.grad is not None]
    return float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))) if grads else None


@pytest.mark.parametrize("model, precision", [("transformer", "bf16-mixed"), ("lstm_bahdanau", "bf16-mixed"),
                                              ("lstm_luong", "32-true")])
def test_precision_trains_and_clips_gradients_with_the_fused_optimizer(cfg_train, monkeypatch, model, precision):
    """bf16 autocast trains on CPU; gradients are clipped (before: > clip, after: <= clip) with
    the fused Adam, which Lightning alone refuses to clip under mixed precision."""
    norms = {"before": [], "after": [], "fused": []}

    class Spy(Callback):
        def on_before_optimizer_step(self, trainer, module, optimizer) -> None:
            norms["before"].append(_grad_norm(module))
            norms["fused"].append(optimizer.defaults["fused"])

        def on_before_zero_grad(self, trainer, module, optimizer) -> None:  # the last step's clipped gradients
            if _grad_norm(module) is not None:
                norms["after"].append(_grad_norm(module))

    cfg = cfg_train([f"trainer.precision={precision}", "trainer.gradient_clip_val=0.01", "test=false"], model=model)
    original = nmt.training.builders.instantiate_group
    monkeypatch.setattr(nmt.training.builders, "instantiate_group",
                        lambda group: [*original(group), Spy()] if group is cfg.get("callbacks") else original(group))
    metrics = train(cfg)
    assert metrics["train/loss"] == metrics["train/loss"] and metrics["val/loss"] < 10
    assert all(norms["fused"]) and len(norms["after"]) >= 2
    assert min(norms["before"]) > 0.02 and max(norms["after"]) == pytest.approx(0.01, rel=1e-3)


@pytest.mark.parametrize("name", ["transformer", "transformer_local_global", "transformer_block_sparse", "transformer_low_rank",
                                  "hybrid_transformer_luong", "lstm_bahdanau"])
def test_gradient_checkpointing_gives_the_same_loss_and_gradients(name):
    model = build(name).train()
    model.set_gradient_checkpointing(True)
    assert model.encoder.gradient_checkpointing  # the test compares two different paths
    src, src_mask, tgt_in = batch()

    def loss_and_grads(enabled: bool):
        model.set_gradient_checkpointing(enabled)
        model.zero_grad()
        torch.manual_seed(0)
        loss = model(src, src_mask, tgt_in).logsumexp(-1).mean()
        loss.backward()
        return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    loss_plain, grads_plain = loss_and_grads(False)
    loss_ckpt, grads_ckpt = loss_and_grads(True)
    torch.testing.assert_close(loss_ckpt, loss_plain)
    assert grads_ckpt.keys() == grads_plain.keys()
    for key in grads_plain:
        torch.testing.assert_close(grads_ckpt[key], grads_plain[key], atol=1e-6, rtol=1e-5)


@pytest.mark.slow  # end to end in processes of its own: the slow tier
def test_optuna_sweep_of_two_trials_writes_its_table(tmp_path):
    pytest.importorskip("hydra_plugins.hydra_optuna_sweeper")
    sweep = tmp_path / "sweep"
    overrides = [o for o in cli_overrides(tmp_path) if not o.startswith("logger")]
    run(["train.py", "-m", "hparams_search=optuna", "model=transformer", "hydra.sweeper.n_trials=2", *overrides, *SMALL_TF[1:],
         "test=false", f"hydra.sweep.dir={sweep}"], timeout=900)
    assert (sweep / "optimization_results.yaml").is_file()
    run(["-m", "nmt.runs_table", str(sweep)])
    table = (sweep / "runs.md").read_text().splitlines()
    assert len(table) == 2 + 2 and "val/bleu_best" in table[0]
    rows = (sweep / "runs.csv").read_text().splitlines()
    assert len(rows) == 3
    for trial in ("0", "1"):  # each run left its validation curve for the pruner; two runs prune nothing
        record = json.loads((sweep / trial / "pruning.json").read_text())
        assert record["state"] == "complete" and record["curve"] and record["pruned_at"] is None


@pytest.mark.slow  # a training run: the slow tier
def test_wandb_offline_run_writes_its_files(cfg_train, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    cfg = cfg_train(["logger=wandb", "logger.wandb.offline=true", "test=false", "trainer.max_epochs=1"], model="lstm")
    train(cfg)
    runs = list((Path(cfg.paths.output_dir) / "wandb").glob("offline-run-*"))
    assert len(runs) == 1
    (record,) = runs[0].glob("*.wandb")
    # wandb's service process writes the record file; on a loaded machine it may still be
    # flushing when train() returns
    deadline = time.monotonic() + 300  # a hang guard
    while b"train/loss" not in (content := record.read_bytes()) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert b"nmt.models.rnn.RNNDecoder" in content  # the resolved run config was logged
    assert b"train/loss" in content
