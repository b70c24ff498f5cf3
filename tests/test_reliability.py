"""Reliability: exact resume after a kill, preemption signals, the non-finite guard, atomic
checkpoints, checkpoints that do not fit the config, config errors, and translate.py on any input."""

from __future__ import annotations

import json
import logging
import re
import resource
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir
from hydra.errors import ConfigCompositionException, MissingConfigException
from pytorch_lightning.callbacks import Callback

import nmt.training.builders
from nmt.training.callbacks import AtomicCheckpointIO
from nmt.checkpoints.loading import load_checkpoint
from nmt.decoding.search import greedy_search
from nmt.training.lit_module import TranslationModule
from nmt.train import train
from nmt.inference.translator import translate_lines
from nmt.text_lines import read_lines
from tests.callbacks import PoisonAt
from tests.conftest import CONF_DIR, KERNELS, ROOT, TINY, compose_train, train_with_callbacks, translate_here

pytestmark = pytest.mark.filterwarnings("ignore:The dirpath has changed")  # resuming writes a new run folder

# 30 steps with dropout, last.ckpt every 5 steps, one validation at the end (step 30).
RESUME = [
    "trainer.deterministic=true", "model.dropout=0.3", "trainer.max_epochs=-1", "trainer.max_steps=30",
    "trainer.val_check_interval=30", "trainer.check_val_every_n_epoch=null",
    "callbacks.last_checkpoint.every_n_train_steps=5", "optimizer.lr=0.01", "scheduler.warmup_steps=5", "test=false",
    "scheduler.total_steps=30",  # the cosine ends at step 30 also in runs stopped earlier and resumed
]


class Slow(Callback):
    """Slows training down so a test can signal a run in the middle (command lines add it with
    ``+callbacks.slow._target_=tests.test_reliability.Slow``)."""

    def on_train_batch_end(self, *args) -> None:
        time.sleep(0.15)


class AtStep(Callback):
    """Calls ``action(trainer, module)`` at the end of training step ``step``."""

    def __init__(self, step: int, action) -> None:
        self.step, self.action = step, action

    def on_train_batch_end(self, trainer, module, *args) -> None:
        if trainer.global_step == self.step:
            self.action(trainer, module)


def command(tmp_path: Path, run_dir: Path, *overrides: str) -> list[str]:
    return [sys.executable, "train.py", "model=lstm_bahdanau", *TINY, *RESUME, f"kernels={KERNELS[0]}",
            f"paths.cache_dir={tmp_path.parent / 'nmt-cache'}", f"hydra.run.dir={run_dir}", *overrides]


def start(cmd: list[str], log: Path) -> subprocess.Popen:
    return subprocess.Popen(cmd, cwd=ROOT, stdout=log.open("w"), stderr=subprocess.STDOUT)


def wait_for_step(ckpt: Path, proc: subprocess.Popen, step: int, timeout: float = 600) -> None:
    """Until ``ckpt`` holds at least ``step`` steps (it is replaced atomically, so always readable)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if ckpt.is_file() and torch.load(ckpt, map_location="cpu", weights_only=True)["global_step"] >= step:
            return
        assert proc.poll() is None, f"training ended (status {proc.returncode}) before step {step}"
        time.sleep(0.05)
    raise TimeoutError(f"no checkpoint of step {step} at {ckpt}")


def load(path: Path) -> dict:
    return torch.load(path, map_location="cpu", weights_only=True)


def assert_same_weights(path_a: Path, path_b: Path) -> None:
    """Bitwise equal weights and optimizer state, at the same step."""
    a, b = load(path_a), load(path_b)
    assert a["global_step"] == b["global_step"] and a["epoch"] == b["epoch"]
    assert a["state_dict"].keys() == b["state_dict"].keys()
    for key in a["state_dict"]:
        assert torch.equal(a["state_dict"][key], b["state_dict"][key]), key
    for p, q in zip(a["optimizer_states"][0]["state"].values(), b["optimizer_states"][0]["state"].values()):
        assert all(torch.equal(p[k], q[k]) for k in p)
    assert a["lr_schedulers"] == b["lr_schedulers"]


def in_process(tmp_path: Path, overrides: list[str], callbacks: list[Callback] = ()):
    """train() on the RESUME config writing to ``tmp_path/run``, with extra callback objects."""
    cfg = compose_train(tmp_path, [*RESUME, *overrides])
    return cfg, train_with_callbacks(cfg, list(callbacks))


def reference_run(tmp_path: Path, overrides: list[str] = ()):
    cfg = compose_train(tmp_path, [*RESUME, *overrides])
    metrics = train(cfg)
    return tmp_path, Path(cfg.paths.output_dir) / "checkpoints" / "last.ckpt", metrics


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """An uninterrupted 30-step run (its checkpoint also serves the mismatch and translate tests)."""
    return reference_run(tmp_path_factory.mktemp("reference"))


@pytest.fixture(scope="module")
def reference_plain(tmp_path_factory):
    """The same run on plain PyTorch (``kernels=reference``)."""
    return reference_run(tmp_path_factory.mktemp("reference_plain"), ["kernels=reference"])


# --- resume -------------------------------------------------------------------------------------
@pytest.mark.slow  # end to end in processes of its own: the slow tier
def test_killed_run_resumes_to_the_same_weights_and_bleu(reference, tmp_path):
    assert_killed_run_resumes_exactly(reference, tmp_path, [])


@pytest.mark.slow  # end to end in processes of its own: the slow tier
def test_killed_run_resumes_exactly_on_plain_pytorch(reference_plain, tmp_path):
    assert_killed_run_resumes_exactly(reference_plain, tmp_path, ["kernels=reference"])


def assert_killed_run_resumes_exactly(reference, tmp_path: Path, overrides: list[str]) -> None:
    _, ref_ckpt, ref_metrics = reference
    killed = tmp_path / "killed"
    budget = "trainer.max_time=00:01:00:00"  # a budget: Lightning's timer keeps the training time
    proc = start(command(tmp_path, killed, "+callbacks.slow._target_=tests.test_reliability.Slow", budget, *overrides),
                 tmp_path / "killed.log")
    ckpt = killed / "checkpoints" / "last.ckpt"
    try:
        wait_for_step(ckpt, proc, 10)
    finally:
        proc.kill()  # SIGKILL: nothing runs after it
        proc.wait()
    stopped_at = load(ckpt)["global_step"]  # usually 10: epoch 2, batch 2 of 4
    assert 10 <= stopped_at < 30
    # the killed run read its data memory-mapped from the folder the reference run prepared
    found = re.search(r"tokenized data: loaded (\S+) in", (tmp_path / "killed.log").read_text())
    assert found and Path(found[1]).parent == tmp_path.parent / "nmt-cache" / "prepared"
    assert (Path(found[1]) / "manifest.json").is_file()

    # a new run folder: tmp_path/run; testing the best checkpoint restores that checkpoint's timer
    _, metrics = in_process(tmp_path, [f"ckpt_path={ckpt}", budget, "test=true", *overrides])
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["steps"] == 30 and summary["resumed_from"] == str(ckpt)
    timer = next(state for key, state in load(ckpt)["callbacks"].items() if key.startswith("Timer"))
    before = timer["time_elapsed"]["train"]  # the killed run's training time, carried over
    assert 0 < before < summary["train_wall_seconds"] <= before + summary["fit_seconds"] + 0.1  # both rounded to 0.1 s

    # Bitwise: the same data order, dropout masks, optimizer and schedule.
    assert_same_weights(ref_ckpt, tmp_path / "run" / "checkpoints" / "last.ckpt")
    a, b = load(ref_ckpt), load(tmp_path / "run" / "checkpoints" / "last.ckpt")
    assert a["best_bleu"] == b["best_bleu"] and a["counters"]["skipped_steps"] == b["counters"]["skipped_steps"] == 0
    for key in ("val/bleu", "val/chrf", "val/loss"):
        assert metrics[key] == ref_metrics[key], key


@pytest.mark.parametrize("stop", ["trainer.max_steps=17", pytest.param("trainer.max_epochs=3", marks=pytest.mark.slow)],
                         ids=["max_steps", "max_epochs"])
def test_the_final_checkpoint_of_a_run_that_stopped_resumes_exactly(reference, tmp_path, stop):
    """A run that ends by max_steps in the middle of an epoch (or by max_epochs at its end)
    writes last.ckpt with its final weights; resuming from it to step 30 gives the uninterrupted
    run's weights bitwise: no batch of the interrupted epoch is skipped or trained twice."""
    _, ref_ckpt, _ = reference
    first, _ = in_process(tmp_path / "first", [stop] if "epochs" not in stop else [stop, "trainer.max_steps=-1"])
    ckpt = Path(first.paths.output_dir) / "checkpoints" / "last.ckpt"
    stopped_at = load(ckpt)["global_step"]
    assert 0 < stopped_at < 30
    second, _ = in_process(tmp_path / "second", [f"ckpt_path={ckpt}"])
    assert_same_weights(ref_ckpt, Path(second.paths.output_dir) / "checkpoints" / "last.ckpt")


def limit_file_size(nbytes: int):
    """For a child process: writes beyond ``nbytes`` fail with EFBIG, as on a full disk."""
    def limit() -> None:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (nbytes, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
    return limit


@pytest.mark.slow  # end to end in processes of its own: the slow tier
def test_a_full_disk_while_saving_is_one_line_and_the_previous_checkpoint_stays(reference, tmp_path):
    """The run resumes into the folder of its checkpoint; its next save finds no room."""
    _, ref_ckpt, _ = reference
    run = tmp_path / "run"
    ckpt = run / "checkpoints" / "last.ckpt"
    ckpt.parent.mkdir(parents=True)
    ckpt.write_bytes(ref_ckpt.read_bytes())
    before = ckpt.read_bytes()
    proc = subprocess.run(command(tmp_path, run, f"ckpt_path={ckpt}", "trainer.max_steps=35"), cwd=ROOT,
                          capture_output=True, text=True, preexec_fn=limit_file_size(len(before) // 2), timeout=600)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines()[-1] == (
        f"error: {ckpt}: could not be written (torch's writer stopped short): "
        "free some disk space or raise the file-size limit; the previous file is unchanged")
    assert ckpt.read_bytes() == before and sorted(p.name for p in ckpt.parent.iterdir()) == ["last.ckpt"]


@pytest.mark.slow  # end to end in processes of its own: the slow tier
def test_the_kill_soak_ends_with_the_uninterrupted_weights_and_a_restarted_server_answers(tmp_path):
    """scripts/kill_soak.py: SIGKILL at six moments drawn from start-up, data preparation,
    checkpoint writes and training, a resume after each; then a server killed under load."""
    out = tmp_path / "soak"
    proc = subprocess.run([sys.executable, "scripts/kill_soak.py", "--kills", "6", "--steps", "150", "--out", str(out),
                           "--server", "--server-requests", "16"], cwd=ROOT, capture_output=True, text=True, timeout=1800)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads((out / "kill_soak.json").read_text())
    assert result["kills"] == 6 and result["final_step"] == 150 and result["kills_by_phase"]["preparing"] == 1
    assert result["bitwise_equal"] and result["differences"] == [] and result["incomplete_cache_folders"] == []
    assert result["server"]["answered_after_the_restart"] == 16 and result["server"]["wrong_after_the_restart"] == []


@pytest.mark.slow  # end to end in processes of its own: the slow tier
def test_sigterm_saves_a_checkpoint_and_latest_resumes_it(tmp_path):
    runs = tmp_path / "outputs" / "train" / "runs"
    first = runs / "first"
    log = tmp_path / "first.log"
    proc = start(command(tmp_path, first, "trainer.max_steps=1000", f"paths.log_dir={tmp_path / 'outputs'}",
                         "+callbacks.slow._target_=tests.test_reliability.Slow"), log)
    try:
        wait_for_step(first / "checkpoints" / "last.ckpt", proc, 5)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 128 + signal.SIGTERM
    finally:
        proc.kill()
    step = load(first / "checkpoints" / "last.ckpt")["global_step"]
    summary = json.loads((first / "summary.json").read_text())
    assert summary["stopped_by"] == "SIGTERM" and summary["steps"] == step
    assert "stopped by SIGTERM" in log.read_text()

    in_process(tmp_path, ["ckpt_path=latest", f"trainer.max_steps={step + 3}", f"paths.log_dir={tmp_path / 'outputs'}"])
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["resumed_from"] == str(first / "checkpoints" / "last.ckpt")
    assert summary["steps"] == step + 3 and summary["stopped_by"] is None


@pytest.mark.slow  # a run stopped and resumed, in processes: the slow tier (the signal during validation runs by default)
def test_slurm_signal_at_an_epoch_end_saves_a_checkpoint_that_resumes_exactly(reference, tmp_path):
    """SIGUSR1 (no SLURM environment here) is handled as SIGTERM; step 7 ends epoch 1 (4 batches)."""
    with pytest.raises(SystemExit) as stop:
        in_process(tmp_path / "usr1", [], [AtStep(7, lambda trainer, module: signal.raise_signal(signal.SIGUSR1))])
    assert stop.value.code == 128 + signal.SIGUSR1
    ckpt = tmp_path / "usr1" / "run" / "checkpoints" / "last.ckpt"
    assert load(ckpt)["global_step"] == 7
    in_process(tmp_path, [f"ckpt_path={ckpt}"])
    assert_same_weights(reference[1], tmp_path / "run" / "checkpoints" / "last.ckpt")


@pytest.mark.slow  # a run stopped and resumed, in processes: the slow tier
def test_signal_during_validation_saves_a_checkpoint_that_resumes_exactly(tmp_path):
    class DuringValidation(Callback):
        def on_validation_batch_end(self, *args) -> None:  # the first of the 2 validation batches
            signal.raise_signal(signal.SIGTERM)

    two_validations = ["trainer.val_check_interval=10", "trainer.max_steps=20"]
    with pytest.raises(SystemExit) as stop:
        in_process(tmp_path / "stopped", two_validations, [DuringValidation()])
    assert stop.value.code == 128 + signal.SIGTERM
    ckpt = tmp_path / "stopped" / "run" / "checkpoints" / "last.ckpt"
    assert load(ckpt)["global_step"] == 10
    _, metrics = in_process(tmp_path / "resumed", [*two_validations, f"ckpt_path={ckpt}"])
    _, expected = in_process(tmp_path / "uninterrupted", two_validations)
    assert_same_weights(*(tmp_path / name / "run" / "checkpoints" / "last.ckpt" for name in ("uninterrupted", "resumed")))
    assert metrics["val/loss"] == expected["val/loss"]


def test_latest_without_any_run_names_what_was_searched(cfg_train, tmp_path):
    cfg = cfg_train(["ckpt_path=latest", f"paths.log_dir={tmp_path / 'nothing'}"])
    with pytest.raises(FileNotFoundError, match=r"ckpt_path=latest: no checkpoint matches .*nothing/train/runs/\*/checkpoints/last.ckpt"):
        train(cfg)


# --- non-finite losses and weights ----------------------------------------------------------------
def nan_loss_at(monkeypatch, steps) -> None:
    original = TranslationModule.losses

    def losses(self, batch):
        value, nll, align = original(self, batch)
        if self.training and self.global_step in steps:
            value = value * float("nan")
        return value, nll, align

    monkeypatch.setattr(TranslationModule, "losses", losses)


def test_nonfinite_steps_are_skipped_with_a_warning(monkeypatch, tmp_path, caplog):
    nan_loss_at(monkeypatch, {3, 4})
    updated = {}

    class Watch(Callback):
        def on_train_batch_start(self, trainer, module, *args) -> None:
            self.before = module.model.decoder.out.weight.detach().clone()

        def on_train_batch_end(self, trainer, module, *args) -> None:
            updated[trainer.global_step - 1] = not torch.equal(self.before, module.model.decoder.out.weight)

    with caplog.at_level(logging.WARNING, logger="nmt.training.lit_module"):
        cfg, metrics = in_process(tmp_path, ["trainer.max_steps=8", "trainer.val_check_interval=8",
                                             "module.max_nonfinite_steps=3"], [Watch()])
    warnings = [r.getMessage() for r in caplog.records if "skipping this update" in r.getMessage()]
    assert warnings == ["step 3: loss is nan; skipping this update (1 in a row, 1 in total)",
                        "step 4: loss is nan; skipping this update (2 in a row, 2 in total)"]
    assert updated == {0: True, 1: True, 2: True, 3: False, 4: False, 5: True, 6: True, 7: True}
    assert json.loads((Path(cfg.paths.output_dir) / "summary.json").read_text())["skipped_steps"] == 2
    assert metrics["val/loss"] == metrics["val/loss"]


def test_consecutive_nonfinite_steps_stop_training(monkeypatch, tmp_path):
    nan_loss_at(monkeypatch, set(range(2, 100)))
    with pytest.raises(RuntimeError, match=r"training stopped: 3 consecutive steps had a non-finite loss "
                                           r"\(steps 2-4, module.max_nonfinite_steps=3; the weights are finite\)"):
        in_process(tmp_path, ["module.max_nonfinite_steps=3"])


@pytest.mark.parametrize("where", ["checkpoint", "validation"])
def test_a_model_with_nonfinite_weights_is_never_saved_or_scored(tmp_path, where):
    overrides = ["trainer.max_steps=8", "trainer.val_check_interval=4", "module.max_nonfinite_steps=100",
                 "callbacks.last_checkpoint.every_n_train_steps=3"]
    if where == "validation":
        overrides[-1] = "callbacks.last_checkpoint.every_n_train_steps=null"
    error = r"refusing to save a checkpoint after step 3: non-finite weights in model.decoder.out.weight" \
        if where == "checkpoint" \
        else r"non-finite weights after step 4 \(decoder.out.weight\): this model is neither scored nor saved"
    with pytest.raises((ValueError, RuntimeError), match=error):
        in_process(tmp_path, overrides, [PoisonAt(2)])
    for path in (tmp_path / "run" / "checkpoints").glob("*.ckpt"):
        assert all(torch.isfinite(t).all() for t in load(path)["state_dict"].values()), path


# --- atomic checkpoints -----------------------------------------------------------------------------
def partial_then_fail(monkeypatch, after: int = 0) -> None:
    """torch.save writes half of the bytes, then fails (a full disk, a kill), from call ``after`` on."""
    original, calls = torch.save, []

    def save(obj, f, *args, **kwargs):
        calls.append(f)
        if len(calls) <= after:
            return original(obj, f, *args, **kwargs)
        f.write(b"PK\x03\x04 half a checkpoint")
        raise OSError("No space left on device")

    monkeypatch.setattr(torch, "save", save)


def test_failed_save_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
    io, path = AtomicCheckpointIO(), tmp_path / "last.ckpt"
    io.save_checkpoint({"state_dict": {"w": torch.ones(3)}, "global_step": 1}, path)
    partial_then_fail(monkeypatch)
    with pytest.raises(OSError, match="No space left"):
        io.save_checkpoint({"state_dict": {"w": torch.zeros(3)}, "global_step": 2}, path)
    assert load(path)["global_step"] == 1
    assert [p.name for p in tmp_path.iterdir()] == ["last.ckpt"]  # no temporary file left behind


def test_training_crash_while_saving_leaves_a_loadable_checkpoint(tmp_path, monkeypatch):
    partial_then_fail(monkeypatch, after=1)  # the step-5 save succeeds, the step-10 one fails
    with pytest.raises(OSError, match="No space left"):
        in_process(tmp_path, [])
    ckpt = tmp_path / "run" / "checkpoints" / "last.ckpt"
    monkeypatch.undo()
    assert load(ckpt)["global_step"] == 5
    assert [p.name for p in ckpt.parent.iterdir()] == ["last.ckpt"]


# --- checkpoints that do not fit the config ---------------------------------------------------------
@pytest.mark.parametrize("model, overrides, error", [
    ("lstm_bahdanau", ["model.hidden_size=32"], r"different shapes: (\S+: checkpoint \([\d, ]+\) vs config \([\d, ]+\), )*"
                                                r"decoder\.rnn\.weight_hh_l0: checkpoint \(64, 16\) vs config \(128, 32\)[,;]"),
    ("transformer", [], r"missing from the checkpoint: .*decoder\.layers\.0\..*; not in the model: .*decoder\.rnn\.weight_hh_l0"),
], ids=["hidden_size", "model_type"])
def test_resume_with_another_model_config_names_the_mismatched_weights(reference, cfg_train, model, overrides, error):
    _, ckpt, _ = reference
    cfg = cfg_train([*overrides, f"ckpt_path={ckpt}"], model=model)
    with pytest.raises(ValueError) as err:
        train(cfg)
    message = str(err.value)
    assert f"{ckpt} does not match the model config" in message and "\n" not in message
    assert re.search(error, message), message
    assert not (Path(cfg.paths.output_dir) / "checkpoints").exists()  # refused before training


def test_resume_on_other_training_data_keeps_the_vocabulary_of_the_checkpoint(reference, cfg_train):
    """Other training pairs train another tokenizer, so resuming on them is refused; with
    data.vocab_from=<the checkpoint> the run continues (weights, optimizer, schedule) on them."""
    _, ckpt, _ = reference
    other = ["data.train_pairs=40", "data.seed=7"]
    with pytest.raises(ValueError, match=f"{re.escape(str(ckpt))} was trained with another src vocabulary") as err:
        train(cfg_train([*RESUME, *other, f"ckpt_path={ckpt}"]))
    assert f"or set data.vocab_from={ckpt} to continue on other data" in str(err.value)
    cfg = cfg_train([*RESUME, *other, f"ckpt_path={ckpt}", f"data.vocab_from={ckpt}", "trainer.max_steps=34"])
    train(cfg)
    summary = json.loads((Path(cfg.paths.output_dir) / "summary.json").read_text())
    assert summary["steps"] == 34 and summary["resumed_from"] == str(ckpt)
    before, after = load(ckpt), load(Path(cfg.paths.output_dir) / "checkpoints" / "last.ckpt")
    assert after["tokenizers"] == before["tokenizers"]
    assert after["lr_schedulers"][0]["last_epoch"] == before["lr_schedulers"][0]["last_epoch"] + 4


# --- config errors ----------------------------------------------------------------------------------
def test_unknown_data_name_lists_the_available_ones():
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        with pytest.raises(MissingConfigException) as err:
            compose("train", overrides=["data=wmt99"])
    for name in ("synthetic", "multi30k", "files", "europarl_it_en"):
        assert name in str(err.value)
    assert "\ttiny\n" not in str(err.value)  # the tests' corpus (tests/conf/data) is no option of the package


def test_misspelled_data_key_fails_before_any_work():
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        with pytest.raises(ConfigCompositionException, match="Could not override 'data.max_tokenz'"):
            compose("train", overrides=["data.max_tokenz=100"])


# --- translate.py on any input ------------------------------------------------------------------------
ODD_LINES = [
    "do nuta modeta",
    "",
    "   ",
    " ".join(["do nuta modeta ponogu"] * 200),  # 800 words: over the 256-subword limit
    "do 猫 nuta 🙂 modeta ÆØÅ",                  # characters never seen in training
    "\t",
    "nu tagaga",
]


def test_translate_lines_keeps_one_line_per_input_line(reference, caplog):
    _, ckpt, _ = reference
    loaded = load_checkpoint(ckpt)
    with caplog.at_level(logging.WARNING, logger="nmt.translate"):
        out, _ = translate_lines(loaded.model, loaded.src_vocab, loaded.tgt_vocab, ODD_LINES,
                                 lambda m, s, sm, **kw: greedy_search(m, s, sm, **kw), max_src_len=256)
    assert len(out) == len(ODD_LINES)
    for line, hyp in zip(ODD_LINES, out):
        assert (hyp == "") == (line.strip() == "") and "\n" not in hyp
    assert "truncated 1 line(s) longer than 255 tokens: [4]" in caplog.text  # its input line number


def test_read_lines_invalid_utf8_names_the_line_or_replaces(tmp_path, caplog):
    path = tmp_path / "in.txt"
    path.write_bytes(b"ok\n\nbad \xff\xfe byte\nlast\n")
    with pytest.raises(ValueError, match=r"in.txt, line 3: invalid UTF-8 .* run with errors=replace"):
        read_lines(str(path))
    with caplog.at_level(logging.WARNING, logger="nmt.translate"):
        assert read_lines(str(path), errors="replace") == ["ok", "", "bad \ufffd\ufffd byte", "last"]
    assert "replaced invalid UTF-8 on 1 line(s): [3]" in caplog.text


def test_translate_cli_on_odd_input(reference, tmp_path, capsys):
    _, ckpt, _ = reference
    src = tmp_path / "in.txt"
    src.write_bytes("\n".join(ODD_LINES).encode() + b"\nbroken \xc3\x28 utf8\n")
    result = translate_here(capsys, f"ckpt={ckpt}", f"input={src}", "decoding=greedy", "errors=replace")
    assert result.returncode == 0, result.stderr[-3000:]
    out = result.stdout.split("\n")
    assert out[-1] == "" and len(out) - 1 == len(ODD_LINES) + 1
    assert "truncated 1 line(s)" in result.stderr and "replaced invalid UTF-8 on 1 line(s)" in result.stderr


def test_a_checkpoint_without_the_target_token_counter_leaves_that_rate_unknown(cfg_train):
    """Checkpoints written before ``train_tgt_tokens`` existed resume with it unknown (the
    summary's ``train_tgt_tokens_per_sec`` is then null), not restarted from 0 against the whole
    run's seconds."""
    cfg = cfg_train()
    module = nmt.training.builders.build_module(cfg, nmt.training.builders.build_model(cfg, 40, 40))
    module.on_load_checkpoint({"counters": {"train_tokens": 100, "train_seconds": 2.0}})
    assert module.train_tokens == 100 and module.train_tgt_tokens is None
    module.on_load_checkpoint({"counters": {"train_tokens": 100, "train_tgt_tokens": 40, "train_seconds": 2.0}})
    assert module.train_tgt_tokens == 40
