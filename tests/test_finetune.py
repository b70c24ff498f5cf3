"""Fine-tuning (``init_from``): a new run starts from a checkpoint's or release file's weights and
vocabularies with a fresh optimizer (or the file's, ``init_optimizer=keep``), schedule, counters
and data order; a changed architecture and files that are not models are refused in one line;
``summary.json`` and the run's checkpoints record the origin; a fine-tuning run resumes exactly."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from pytorch_lightning import Callback

import nmt.training.builders
from nmt.export import export_release
from nmt.train import train
from tests.conftest import compose_train

pytestmark = pytest.mark.filterwarnings("ignore:The dirpath has changed")

# The source model: 20 steps at a high learning rate (its validation loss falls a nat below a fresh
# model's), one validation at the end, no test.
SOURCE = [
    "trainer.max_epochs=-1", "trainer.max_steps=20", "trainer.val_check_interval=20",
    "trainer.check_val_every_n_epoch=null", "optimizer.lr=0.03", "scheduler.warmup_steps=5",
    "scheduler.total_steps=20", "test=false",
]
# A fine-tuning run of 2 steps, no validation, no test.
SHORT = ["trainer.max_epochs=-1", "trainer.max_steps=2", "trainer.limit_val_batches=0", "test=false"]


class BeforeFirstStep(Callback):
    """What the run holds when its first training batch starts: weights, optimizer state and rates,
    counters."""

    def __init__(self) -> None:
        self.seen: dict | None = None

    def on_train_batch_start(self, trainer, module, batch, batch_idx) -> None:
        if self.seen is not None:
            return
        optimizer = trainer.optimizers[0]
        self.seen = {
            "weights": {k: v.detach().clone() for k, v in module.model.state_dict().items()},
            "optimizer": {i: {k: v.clone() if torch.is_tensor(v) else v for k, v in state.items()}
                          for i, state in optimizer.state_dict()["state"].items()},
            "lr": optimizer.param_groups[0]["lr"], "betas": optimizer.param_groups[0]["betas"],
            "step": trainer.global_step, "epoch": trainer.current_epoch, "batch_idx": batch_idx,
            "scheduler_step": trainer.lr_scheduler_configs[0].scheduler.last_epoch,
            "counters": {name: getattr(module, name) for name in module.COUNTERS},
            "best_bleu": module.best_bleu,
        }


def run(tmp_path: Path, monkeypatch, overrides: list[str], callbacks: list[Callback] = ()):
    """train() on a tiny config writing to ``tmp_path/run``, with extra callback objects."""
    cfg = compose_train(tmp_path, list(overrides))
    original = nmt.training.builders.instantiate_group
    monkeypatch.setattr(nmt.training.builders, "instantiate_group",
                        lambda group: [*original(group), *callbacks] if group is cfg.get("callbacks") else original(group))
    metrics = train(cfg)
    monkeypatch.setattr(nmt.training.builders, "instantiate_group", original)
    return Path(cfg.paths.output_dir), metrics


def load(path: Path) -> dict:
    return torch.load(path, map_location="cpu", weights_only=True)


def summary(run_dir: Path) -> dict:
    return json.loads((run_dir / "summary.json").read_text())


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    """The trained model's run folder, its last.ckpt and final metrics."""
    tmp_path = tmp_path_factory.mktemp("source")
    cfg = compose_train(tmp_path, SOURCE)
    metrics = train(cfg)
    run_dir = Path(cfg.paths.output_dir)
    return run_dir, run_dir / "checkpoints" / "last.ckpt", metrics


@pytest.fixture(scope="module")
def release_file(source, tmp_path_factory):
    return export_release(source[1], tmp_path_factory.mktemp("release") / "model.pt")


def assert_weights_of(seen: dict, ckpt: dict) -> None:
    stored = {k[len("model."):]: v for k, v in ckpt["state_dict"].items() if k.startswith("model.")}
    assert seen.keys() == stored.keys()
    for key in stored:
        assert torch.equal(seen[key], stored[key]), key


def test_a_fine_tuning_run_starts_from_the_files_weights_with_a_fresh_optimizer(source, tmp_path, monkeypatch):
    """The weights before the first step are the checkpoint's; the optimizer holds no moments, the
    schedule, step, epoch and counters start at 0, the data at the epoch's first batch. The
    vocabulary comes from the file (another vocab_size would train another one and fail), and
    dropout may differ."""
    run_dir, ckpt, _ = source
    probe = BeforeFirstStep()
    out, _ = run(tmp_path, monkeypatch, [*SHORT, f"init_from={ckpt}", "model.dropout=0.2",
                                         "data.tokenizer.vocab_size=123"], [probe])
    source_ckpt = load(ckpt)
    assert source_ckpt["global_step"] == 20 and source_ckpt["optimizer_states"][0]["state"]
    seen = probe.seen
    assert_weights_of(seen["weights"], source_ckpt)
    assert seen["optimizer"] == {}
    assert (seen["step"], seen["epoch"], seen["batch_idx"], seen["scheduler_step"]) == (0, 0, 0, 0)
    assert seen["lr"] == pytest.approx(0.008 / 300)  # the warm-up's first rate of this run's config
    assert seen["counters"] == {"skipped_steps": 0, "nonfinite_in_a_row": 0, "train_tokens": 0,
                                "train_tgt_tokens": 0, "train_seconds": 0.0}
    assert seen["best_bleu"] == -math.inf
    origin = {"path": str(ckpt), "kind": "training", "step": 20, "epoch": source_ckpt["epoch"], "run": str(run_dir),
              "exported_from": None, "weights": "stored", "optimizer": "fresh"}
    done = summary(out)
    assert done["init_from"] == origin and done["steps"] == 2 and done["resumed_from"] is None
    assert load(out / "checkpoints" / "last.ckpt")["init_from"] == origin
    assert load(out / "checkpoints" / "last.ckpt")["run_config"]["data"]["vocab_from"] == str(ckpt)


def test_init_optimizer_keep_takes_the_files_moments_and_this_runs_rates(source, tmp_path, monkeypatch):
    _, ckpt, _ = source
    probe = BeforeFirstStep()
    run(tmp_path, monkeypatch, [*SHORT, f"init_from={ckpt}", "init_optimizer=keep", "optimizer.lr=0.003",
                                "optimizer.betas=[0.8,0.9]"], [probe])
    saved = load(ckpt)["optimizer_states"][0]["state"]
    seen = probe.seen
    assert seen["optimizer"].keys() == saved.keys() and len(saved) > 0
    for i, state in saved.items():
        assert state.keys() == seen["optimizer"][i].keys()
        for name, value in state.items():
            assert torch.equal(torch.as_tensor(seen["optimizer"][i][name]), torch.as_tensor(value)), (i, name)
    assert float(next(iter(saved.values()))["step"]) == 20
    assert seen["lr"] == pytest.approx(0.003 / 300) and tuple(seen["betas"]) == (0.8, 0.9)
    assert (seen["step"], seen["epoch"], seen["scheduler_step"]) == (0, 0, 0)


def test_a_release_file_works_as_init_from(source, release_file, tmp_path, monkeypatch):
    run_dir, ckpt, _ = source
    probe = BeforeFirstStep()
    out, _ = run(tmp_path, monkeypatch, [*SHORT, f"init_from={release_file}"], [probe])
    assert_weights_of(probe.seen["weights"], load(ckpt))
    assert probe.seen["optimizer"] == {}
    origin = summary(out)["init_from"]
    assert origin["kind"] == "release" and origin["path"] == str(release_file) and origin["step"] == 20
    assert origin["exported_from"] == str(ckpt) and origin["run"] == str(run_dir)


@pytest.mark.parametrize("overrides, key, here, there", [
    (["model.hidden_size=32"], "model.hidden_size", "32", "16"),
    (["model.encoder.num_layers=1"], "model.encoder.num_layers", "1", "2"),
    (["model.decoder.attention=null"], "model.decoder.attention", "null",
     '{"_target_": "nmt.models.attention.BahdanauAttention", "_partial_": true}'),
], ids=["hidden_size", "encoder.num_layers", "attention"])
def test_another_architecture_is_refused_naming_the_key_and_both_values(source, cfg_train, overrides, key, here, there):
    _, ckpt, _ = source
    with pytest.raises(ValueError) as refused:
        train(cfg_train([*SHORT, f"init_from={ckpt}", *overrides]))
    assert str(refused.value) == (
        f"init_from={ckpt}: {key} is {here} in this run's config, {there} in the file's; fine-tuning keeps the "
        "file's architecture (only dropout, attention_dropout, activation_dropout, gradient_checkpointing, "
        "position_shift, init may differ)")


def test_another_model_class_is_refused_naming_the_key(source, cfg_train):
    _, ckpt, _ = source
    with pytest.raises(ValueError, match=r"model.decoder._target_ is nmt.models.transformer.TransformerDecoder in "
                                         r"this run's config, nmt.models.rnn.RNNDecoder in the file's; "):
        train(cfg_train([*SHORT, f"init_from={ckpt}"], model="transformer"))


def files_that_are_not_models(tmp_path: Path, ckpt: Path) -> dict[str, tuple[Path, type, str]]:
    text = tmp_path / "notes.txt"
    text.write_text("not a model\n")
    truncated = tmp_path / "truncated.ckpt"
    truncated.write_bytes(ckpt.read_bytes()[: ckpt.stat().st_size // 2])
    missing = tmp_path / "missing.ckpt"
    return {
        "text": (text, ValueError, f"init_from={text}: not a checkpoint (not a torch.save archive); give a .ckpt "
                                   "written by nmt's train.py, nmt-average or nmt-export"),
        "corrupt zip": (truncated, ValueError, f"init_from={truncated}: truncated or corrupt checkpoint (the zip "
                                               "archive has no end); copy it again or use another checkpoint"),
        "missing": (missing, FileNotFoundError, f"init_from={missing}: no such file (give <run>/checkpoints/<file>.ckpt)"),
    }


@pytest.mark.parametrize("case", ["text", "corrupt zip", "missing"])
def test_init_from_a_file_that_is_not_a_model_is_refused_in_one_line(source, cfg_train, tmp_path, case):
    path, error, message = files_that_are_not_models(tmp_path, source[1])[case]
    with pytest.raises(error) as refused:
        train(cfg_train([*SHORT, f"init_from={path}"]))
    assert str(refused.value) == message


def test_keeping_the_optimizer_of_a_release_file_is_refused(release_file, cfg_train):
    with pytest.raises(ValueError) as refused:
        train(cfg_train([*SHORT, f"init_from={release_file}", "init_optimizer=keep"]))
    assert str(refused.value) == (
        f"init_optimizer=keep: init_from={release_file} is a release file, which holds no optimizer state; give a "
        "training checkpoint (<run>/checkpoints/last.ckpt) or set init_optimizer=fresh")


@pytest.mark.parametrize("overrides, message", [
    (["init_optimizer=keep"], "init_optimizer=keep: there is no optimizer state to keep without init_from=<checkpoint>"),
    (["init_optimizer=moments"], "init_optimizer=moments: choose fresh or keep"),
    (["init_weights=best"], "init_weights=best: choose stored or raw"),
], ids=["keep without init_from", "init_optimizer", "init_weights"])
def test_bad_init_options_are_refused_naming_the_key(cfg_train, overrides, message):
    with pytest.raises(ValueError) as refused:
        train(cfg_train([*SHORT, *overrides]))
    assert str(refused.value) == message


def test_keeping_the_optimizer_state_of_another_optimizer_class_is_refused(source, cfg_train):
    _, ckpt, _ = source
    with pytest.raises(ValueError) as refused:
        train(cfg_train([*SHORT, f"init_from={ckpt}", "init_optimizer=keep", "optimizer=adamw"]))
    assert str(refused.value) == (
        f"init_optimizer=keep: init_from={ckpt} was trained with torch.optim.Adam, this run's optimizer is "
        "torch.optim.AdamW; set init_optimizer=fresh or optimizer._target_=torch.optim.Adam")


def test_another_vocabulary_than_the_files_is_refused(source, cfg_train, tmp_path):
    from nmt.data.tokenizer import train_sentencepiece

    tiny = Path(__file__).parent / "data" / "tiny"
    lines = [line for side in ("src", "tgt") for line in (tiny / f"train.{side}").read_text().splitlines()]
    other = train_sentencepiece(lines, tmp_path, {"vocab_size": 150, "hard_vocab_limit": False}).model_file
    _, ckpt, _ = source
    with pytest.raises(ValueError) as refused:
        train(cfg_train([*SHORT, f"init_from={ckpt}", f"data.vocab_from={other}"]))
    assert str(refused.value).startswith(f"init_from={ckpt}: data.vocab_from={other} gives another src vocabulary (")
    assert str(refused.value).endswith("); leave data.vocab_from unset to train with the file's")


# 6 steps with dropout, the cosine ending at step 6 whichever step a run stops at.
RESUMED = ["trainer.deterministic=true", "model.dropout=0.3", "trainer.max_epochs=-1", "trainer.limit_val_batches=0",
           "test=false", "scheduler.warmup_steps=2", "scheduler.total_steps=6", "optimizer.lr=0.01"]


def test_a_fine_tuning_run_resumed_with_ckpt_path_resumes_exactly(source, tmp_path, monkeypatch):
    """Stopped at step 3 and resumed with the same command plus ckpt_path (which wins over
    init_from), it ends with the weights, optimizer state and origin of an uninterrupted run."""
    _, ckpt, _ = source
    whole, _ = run(tmp_path / "whole", monkeypatch, [*RESUMED, f"init_from={ckpt}", "trainer.max_steps=6"])
    first, _ = run(tmp_path / "first", monkeypatch, [*RESUMED, f"init_from={ckpt}", "trainer.max_steps=3"])
    stopped = first / "checkpoints" / "last.ckpt"
    assert load(stopped)["global_step"] == 3
    resumed, _ = run(tmp_path / "resumed", monkeypatch,
                     [*RESUMED, f"init_from={ckpt}", "trainer.max_steps=6", f"ckpt_path={stopped}"])
    a, b = load(whole / "checkpoints" / "last.ckpt"), load(resumed / "checkpoints" / "last.ckpt")
    assert a["global_step"] == b["global_step"] == 6 and a["epoch"] == b["epoch"]
    for key in a["state_dict"]:
        assert torch.equal(a["state_dict"][key], b["state_dict"][key]), key
    for p, q in zip(a["optimizer_states"][0]["state"].values(), b["optimizer_states"][0]["state"].values()):
        assert all(torch.equal(p[k], q[k]) for k in p)
    assert a["lr_schedulers"] == b["lr_schedulers"]
    assert a["init_from"] == b["init_from"] == summary(resumed)["init_from"] == summary(whole)["init_from"]
    assert summary(resumed)["resumed_from"] == str(stopped) and summary(resumed)["init_from"]["path"] == str(ckpt)


def test_fine_tuning_goes_on_from_the_loaded_models_quality(source, tmp_path, monkeypatch):
    """The validation loss after a fine-tuning run's first step (at the warm-up's first, tiny rate)
    is the source model's final one, far below a fresh model's after the same step."""
    _, ckpt, source_metrics = source
    one_step = ["trainer.max_epochs=-1", "trainer.max_steps=1", "trainer.val_check_interval=1",
                "trainer.check_val_every_n_epoch=null", "test=false"]
    _, tuned = run(tmp_path / "tuned", monkeypatch, [*one_step, f"init_from={ckpt}"])
    _, fresh = run(tmp_path / "fresh", monkeypatch, one_step)
    assert source_metrics["val/loss"] < fresh["val/loss"] - 0.75  # 5.0 against 6.0 (the uniform loss: log 400)
    assert tuned["val/loss"] == pytest.approx(source_metrics["val/loss"], abs=0.02)


def test_a_file_from_before_activation_and_logits_bias_fine_tunes():
    """A model config saved before ``activation`` and ``logits_bias`` existed is today's default
    architecture: no difference; a file with another activation still differs."""
    from nmt.checkpoints.finetune import architecture_difference

    today = {"encoder": {"num_layers": 2, "activation": "relu"},
             "decoder": {"num_layers": 2, "activation": "relu", "logits_bias": False}}
    older = {"encoder": {"num_layers": 2}, "decoder": {"num_layers": 2}}
    assert architecture_difference(older, today) is None
    swish = {"encoder": {"num_layers": 2}, "decoder": {"num_layers": 2, "activation": "swish"}}
    assert architecture_difference(swish, today) == ("model.decoder.activation", "swish", "relu")


def test_a_file_from_before_head_counts_fine_tunes_and_a_pruned_one_keeps_its_heads():
    """A model config saved before ``self_heads`` and ``cross_heads`` existed has every head
    (null today); a pruned file's head counts must be the run's."""
    from nmt.checkpoints.finetune import architecture_difference

    today = {"encoder": {"num_heads": 4, "self_heads": None}, "decoder": {"num_heads": 4, "self_heads": None, "cross_heads": None}}
    older = {"encoder": {"num_heads": 4}, "decoder": {"num_heads": 4}}
    assert architecture_difference(older, today) is None
    pruned = {"encoder": {"num_heads": 4, "self_heads": [4, 2]}, "decoder": {"num_heads": 4}}
    assert architecture_difference(pruned, today) == ("model.encoder.self_heads", "[4, 2]", "null")
    # keys added later still (embedding_norm; an LSTM decoder's output and initial_state) read as what older files trained
    assert architecture_difference(older, {**today, "decoder": {**today["decoder"], "embedding_norm": False}}) is None
    lstm = {"decoder": {"hidden_size": 8}}
    assert architecture_difference(lstm, {"decoder": {"hidden_size": 8, "output": "tanh", "initial_state": "final"}}) is None
    assert architecture_difference(lstm, {"decoder": {"hidden_size": 8, "output": "maxout"}}) == ("model.decoder.output", "absent", "maxout")


def test_a_pruned_file_gives_its_heads_to_a_run_that_leaves_them_null(tmp_path):
    """``init_from=<pruned.ckpt>`` with the preset's null head counts: the run takes the file's
    (and says so), so the architectures agree; a run that sets other counts keeps them and is refused."""
    from omegaconf import OmegaConf

    from nmt.checkpoints.finetune import check_architecture, inherit_pruned_heads

    file = {"run_config": {"model": {"_target_": "nmt.models.base.Seq2Seq", "encoder": {"num_heads": 4, "self_heads": [4, 2]},
                                     "decoder": {"num_heads": 4, "self_heads": [1, 3], "cross_heads": None}}}}
    run = OmegaConf.create({"_target_": "nmt.models.base.Seq2Seq", "encoder": {"num_heads": 4, "self_heads": None},
                            "decoder": {"num_heads": 4, "self_heads": None, "cross_heads": None}})
    assert inherit_pruned_heads(file, run, "pruned.ckpt") == ["model.encoder.self_heads=[4, 2]",
                                                              "model.decoder.self_heads=[1, 3]"]
    check_architecture(file, OmegaConf.to_container(run), "pruned.ckpt")
    other = OmegaConf.create({"_target_": "nmt.models.base.Seq2Seq", "encoder": {"num_heads": 4, "self_heads": [2, 2]},
                              "decoder": {"num_heads": 4, "self_heads": None, "cross_heads": None}})
    assert inherit_pruned_heads(file, other, "pruned.ckpt") == ["model.decoder.self_heads=[1, 3]"]
    with pytest.raises(ValueError, match=r"^init_from=pruned.ckpt: model.encoder.self_heads is \[2, 2\] in this run's "
                                         r"config, \[4, 2\] in the file's"):
        check_architecture(file, OmegaConf.to_container(other), "pruned.ckpt")
