"""Checkpoint files: the final weights are on disk whatever stops training, they load without
unpickling code, bad files get a one-line error, release files, averaging and EMA."""

from __future__ import annotations

import functools
import io
import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from omegaconf import OmegaConf

import nmt.training.builders
from nmt.average import average, run_average, select
from nmt.checkpoints.files import CheckpointError, read_checkpoint
from nmt.checkpoints.loading import load_checkpoint
from nmt.data.tokenizer import Tokenizer
from nmt.decoding.search import greedy_search
from nmt.export import export, export_release
from nmt.training.builders import check_logger_packages
from nmt.train import train
from nmt.inference.translator import translate_lines
from tests.conftest import ROOT, compose_train, evaluate_here, file_size_limit, translate_here

# Transformer, tiny; a budget of a few seconds stops it in the middle of an epoch, long before a
# step checkpoint is due, with no validation (test_ckpt=last: the final weights are tested).
BUDGET = ["trainer.max_epochs=-1", "trainer.max_time=00:00:00:06", "trainer.val_check_interval=null",
          "trainer.check_val_every_n_epoch=100000", "test_ckpt=last", "test_decoding.beam_size=3",
          "callbacks.model_checkpoint=null", "callbacks.last_checkpoint.every_n_train_steps=1000000"]


@pytest.fixture(scope="module")
def budget_run(tmp_path_factory):
    tmp_path = tmp_path_factory.mktemp("budget")
    cfg = compose_train(tmp_path, BUDGET, model="transformer")
    train(cfg)
    return tmp_path, Path(cfg.paths.output_dir)


def test_a_run_stopped_by_its_time_budget_saves_and_tests_its_final_weights(budget_run, capsys):
    _, run = budget_run
    summary = json.loads((run / "summary.json").read_text())
    last = run / "checkpoints" / "last.ckpt"
    assert 0 < summary["steps"] < 1_000_000  # stopped before any step checkpoint
    assert summary["tested_checkpoint"] == {"path": str(last), "step": summary["steps"]}
    assert read_checkpoint(last)["global_step"] == summary["steps"]
    assert json.loads((run / "bleu_by_length.json").read_text())["checkpoint"] == summary["tested_checkpoint"]

    # translate on last.ckpt writes exactly the test hypotheses of the run.
    result = translate_here(capsys, f"ckpt={last}", f"input={run / 'test_sources.txt'}", "decoding.beam_size=3",
                            "precision=32")  # as the run (fp32) tested
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout == (run / "test_hyps.txt").read_text(encoding="utf-8")


def test_checkpoints_load_with_weights_only(budget_run):
    _, run = budget_run
    checkpoint = torch.load(run / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)
    assert checkpoint["nmt_format"] == 2 and checkpoint["kind"] == "training"
    assert isinstance(checkpoint["run_config"], dict) and isinstance(checkpoint["tokenizers"]["src"], bytes)


class Payload:
    """Unpickling this runs a shell command that creates ``marker``."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def test_a_checkpoint_whose_pickle_would_run_code_is_refused_and_nothing_runs(budget_run, tmp_path):
    _, run = budget_run
    checkpoint = read_checkpoint(run / "checkpoints" / "last.ckpt")
    marker = tmp_path / "pwned"
    evil = tmp_path / "evil.ckpt"
    torch.save({**checkpoint, "payload": Payload(marker)}, evil)
    with pytest.raises(CheckpointError) as error:
        load_checkpoint(evil)
    message = str(error.value)
    assert "\n" not in message and str(evil) in message and "refused" in message
    assert "system" in message and "allow_pickle=true" in message
    result = subprocess.run([sys.executable, "translate.py", f"ckpt={evil}", f"hydra.run.dir={tmp_path / 'tr'}"],
                            input="a b c\n", capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert result.returncode != 0 and "refused" in result.stderr
    assert not marker.exists()


def test_an_older_pickled_checkpoint_loads_only_with_allow_pickle(budget_run, tmp_path):
    _, run = budget_run
    checkpoint = read_checkpoint(run / "checkpoints" / "last.ckpt")
    old = tmp_path / "old.ckpt"
    saved = {k: v for k, v in checkpoint.items() if k not in ("nmt_format", "kind")}
    torch.save({**saved, "hyper_parameters": {"optimizer": functools.partial(max)}}, old)  # as format 1 did
    with pytest.raises(CheckpointError, match="allow_pickle=true"):
        load_checkpoint(old)
    loaded = load_checkpoint(old, allow_pickle=True)
    assert loaded.step == checkpoint["global_step"]


def truncated(src: Path, dst: Path) -> Path:
    dst.write_bytes(src.read_bytes()[: src.stat().st_size // 2])
    return dst


@pytest.mark.parametrize("make, error", [
    (lambda run, tmp: (tmp / "notes.txt").write_text("not a model") and tmp / "notes.txt", "not a checkpoint"),
    (lambda run, tmp: truncated(run / "checkpoints" / "last.ckpt", tmp / "half.ckpt"), "truncated or corrupt"),
    (lambda run, tmp: torch.save(torch.zeros(3), tmp / "t.pt") or tmp / "t.pt", "not a checkpoint (no state_dict)"),
    (lambda run, tmp: torch.save({**read_checkpoint(run / "checkpoints" / "last.ckpt"), "nmt_format": 9},
                                 tmp / "new.ckpt") or tmp / "new.ckpt", "checkpoint format 9 of a newer nmt"),
], ids=["text", "truncated", "tensor", "newer"])
def test_bad_checkpoint_files_get_a_one_line_error_naming_them(budget_run, tmp_path, make, error):
    _, run = budget_run
    path = make(run, tmp_path)
    with pytest.raises(CheckpointError) as raised:
        load_checkpoint(path)
    assert error in str(raised.value) and str(path) in str(raised.value) and "\n" not in str(raised.value)


def with_piece(proto: bytes, piece: str) -> bytes:
    """A SentencePiece model whose last piece is ``piece`` instead."""
    from sentencepiece import sentencepiece_model_pb2

    model = sentencepiece_model_pb2.ModelProto()
    model.ParseFromString(proto)
    model.pieces[-1].piece = piece
    return model.SerializeToString()


@pytest.mark.parametrize("piece", ["a\nb", "\t", "x\u2028", "\x85"])
def test_a_saved_tokenizer_whose_pieces_break_lines_is_refused(budget_run, tmp_path, piece):
    """A target piece holding a line break would turn one input line into several output lines."""
    _, run = budget_run
    checkpoint = read_checkpoint(run / "checkpoints" / "last.ckpt")
    tokenizers = checkpoint["tokenizers"]
    forged = tmp_path / "forged.ckpt"
    torch.save({**checkpoint, "tokenizers": {**tokenizers, "tgt": with_piece(tokenizers["tgt"], piece)}}, forged)
    with pytest.raises(CheckpointError, match=rf"^the tgt tokenizer saved in {forged}: piece \d+ \(.*\) holds a "
                                              r"control or line-breaking character; a SentencePiece model trained by nmt has none$"):
        load_checkpoint(forged)


def test_weights_holding_nan_or_infinity_are_refused_naming_them(budget_run, tmp_path):
    _, run = budget_run
    checkpoint = read_checkpoint(run / "checkpoints" / "last.ckpt")
    name = next(k for k in checkpoint["state_dict"] if k.startswith("model.encoder.layers.0."))  # not a tied weight
    for value in (float("nan"), float("-inf")):
        state = dict(checkpoint["state_dict"])
        state[name] = state[name].clone().flatten().index_fill(0, torch.tensor([0]), value).view_as(state[name])
        forged = tmp_path / "diverged.ckpt"
        torch.save({**checkpoint, "state_dict": state}, forged)
        with pytest.raises(CheckpointError) as raised:
            load_checkpoint(forged)
        assert str(raised.value) == (f"{forged}: weights hold NaN or infinity ({name[len('model.'):]}); the file is "
                                     "damaged or its training diverged: use another checkpoint")


def test_decoded_text_is_one_line_whatever_the_pieces_decode_to():
    """Byte-fallback pieces may decode to a line break: the translation stays one line."""
    import sentencepiece as spm

    model = io.BytesIO()
    spm.SentencePieceTrainer.train(sentence_iterator=iter(["a b c", "d e f"] * 20), model_writer=model, vocab_size=300,
                                   byte_fallback=True, pad_id=0, unk_id=1, bos_id=2, eos_id=3, hard_vocab_limit=False)
    tok = Tokenizer.from_proto(model.getvalue(), "bytes")
    newline = tok.sp.piece_to_id("<0x0A>")
    ids = tok.encode("a") + [newline] + tok.encode("b")
    assert tok.sp.decode(ids) == "a\n b" and tok.decode(ids) == "a  b" and tok.decode_batch([ids]) == ["a  b"]


def test_a_release_file_translates_like_its_checkpoint_and_cannot_resume(budget_run, tmp_path):
    _, run = budget_run
    last = run / "checkpoints" / "last.ckpt"
    out = export_release(last, tmp_path / "model.release.ckpt")
    released = torch.load(out, map_location="cpu", weights_only=True)
    assert released["kind"] == "release" and "optimizer_states" not in released and "loops" not in released
    weights = sum(t.numel() * t.element_size() for t in released["state_dict"].values())
    assert out.stat().st_size < last.stat().st_size - weights  # without Adam's two moments per weight
    lines = (ROOT / "tests/data/tiny/test.src").read_text().splitlines()[:10]
    a, b = load_checkpoint(last), load_checkpoint(out)
    search = greedy_search
    assert translate_lines(a.model, a.src_vocab, a.tgt_vocab, lines, search)[0] == \
        translate_lines(b.model, b.src_vocab, b.tgt_vocab, lines, search)[0]

    cfg = compose_train(tmp_path, [*BUDGET, f"ckpt_path={out}"], model="transformer")
    with pytest.raises(CheckpointError, match="cannot resume training; resume from the run's checkpoints/last.ckpt"):
        train(cfg)


def test_a_failed_export_leaves_nothing_behind(budget_run, tmp_path, monkeypatch):
    _, run = budget_run

    def broken(obj, f, *args, **kwargs):
        f.write(b"half")
        raise OSError("disk full")

    monkeypatch.setattr(torch, "save", broken)
    with pytest.raises(OSError, match="disk full"):
        export_release(run / "checkpoints" / "last.ckpt", tmp_path / "out" / "model.ckpt")
    assert list((tmp_path / "out").iterdir()) == []


def test_a_full_disk_while_saving_keeps_the_previous_file_and_no_temporary_one(budget_run, tmp_path):
    """torch reports a failed write as a RuntimeError of its zip writer: the error names the file."""
    _, run = budget_run
    out = tmp_path / "model.ckpt"
    export_release(run / "checkpoints" / "last.ckpt", out)
    before = out.read_bytes()
    with file_size_limit(len(before) // 2), pytest.raises(OSError) as error:
        export_release(run / "checkpoints" / "last.ckpt", out)
    assert error.value.filename == str(out) and error.value.strerror == (
        "could not be written (torch's writer stopped short): free some disk space or raise the file-size limit; "
        "the previous file is unchanged")
    assert out.read_bytes() == before and [p.name for p in tmp_path.iterdir()] == ["model.ckpt"]
    with file_size_limit(len(before) // 2), pytest.raises(OSError, match="; nothing was written"):
        export_release(run / "checkpoints" / "last.ckpt", tmp_path / "new.ckpt")
    assert [p.name for p in tmp_path.iterdir()] == ["model.ckpt"]


# --- averaging and EMA ---------------------------------------------------------------------------
@pytest.fixture(scope="module")
def ema_run(tmp_path_factory):
    """15 steps with an EMA of the weights and the weights of every 5th step kept."""
    tmp_path = tmp_path_factory.mktemp("ema")
    cfg = compose_train(tmp_path, [
        "callbacks=[default,ema,recent_checkpoints]", "callbacks.early_stopping=null", "callbacks.rich_progress_bar=null",
        "callbacks.ema.decay=0.8", "callbacks.ema.update_starting_at_step=2",
        "callbacks.recent_checkpoints.every_n_train_steps=5", "callbacks.recent_checkpoints.keep=2",
        "trainer.max_epochs=-1", "trainer.max_steps=15", "trainer.val_check_interval=5",
        "trainer.check_val_every_n_epoch=null", "test_ckpt=last", "decoding@test_decoding=greedy", "optimizer.lr=0.01",
    ], model="transformer")
    train(cfg)
    return tmp_path, Path(cfg.paths.output_dir)


def test_ema_weights_are_validated_saved_and_tested_and_the_raw_ones_kept(ema_run):
    _, run = ema_run
    last = read_checkpoint(run / "checkpoints" / "last.ckpt")
    assert last["global_step"] == 15
    ema, raw = last["state_dict"], last["current_model_state"]
    assert ema.keys() == raw.keys()
    assert not torch.equal(ema["model.decoder.out.weight"], raw["model.decoder.out.weight"])
    # The test decoded with the averaged weights: translating last.ckpt gives its hypotheses.
    loaded = load_checkpoint(run / "checkpoints" / "last.ckpt")
    sources = (run / "test_sources.txt").read_text(encoding="utf-8").splitlines()
    hyps, _ = translate_lines(loaded.model, loaded.src_vocab, loaded.tgt_vocab, sources, greedy_search)
    assert hyps == (run / "test_hyps.txt").read_text(encoding="utf-8").splitlines()


def test_a_run_with_ema_resumes(ema_run, tmp_path):
    _, run = ema_run
    cfg = compose_train(tmp_path, [
        "callbacks=[default,ema]", "callbacks.early_stopping=null", "callbacks.rich_progress_bar=null",
        "callbacks.ema.decay=0.8", "trainer.max_epochs=-1", "trainer.max_steps=18", "test=false",
        f"ckpt_path={run / 'checkpoints' / 'last.ckpt'}", "optimizer.lr=0.01",
    ], model="transformer")
    train(cfg)
    assert read_checkpoint(Path(cfg.paths.output_dir) / "checkpoints" / "last.ckpt")["global_step"] == 18


def test_average_of_the_last_checkpoints_is_their_mean(ema_run, tmp_path):
    _, run = ema_run
    assert sorted(p.name for p in (run / "checkpoints" / "recent").iterdir()) == ["step000010.ckpt", "step000015.ckpt"]
    cfg = OmegaConf.create({"run": str(run), "last": 2, "best": None, "ckpts": None, "out": str(tmp_path / "avg.ckpt"),
                            "weights": "raw", "allow_pickle": False})
    out = run_average(cfg)
    averaged = read_checkpoint(out)
    assert averaged["kind"] == "release" and [a["step"] for a in averaged["averaged_from"]] == [10, 15]
    a = read_checkpoint(run / "checkpoints" / "recent" / "step000010.ckpt")["state_dict"]  # weights only: the raw ones
    b = read_checkpoint(run / "checkpoints" / "last.ckpt")["current_model_state"]
    name = "model.decoder.out.weight"
    assert torch.allclose(averaged["state_dict"][name], (a[name] + b[name]) / 2, atol=1e-7)
    load_checkpoint(out)  # translate.py can use it
    tied = averaged["state_dict"]  # tied weights stay one tensor, as in the checkpoints
    assert tied["model.decoder.out.weight"].data_ptr() == tied["model.decoder.embed_tokens.embed.weight"].data_ptr()

    # best=N ranks by the validation score each checkpoint saved (step 15 ties with last.ckpt: one per step).
    found = [(Path(f"s{s}"), {"global_step": s, "monitor": {"value": v, "step": m}})
             for s, v, m in [(5, 1.0, 5), (10, 3.0, 10), (15, 2.0, 15), (20, 9.0, 15)]]  # step 20: step 15's score
    assert [c["global_step"] for _, c in select(found, None, 2)] == [10, 15]
    found = found[:3]
    assert [c["global_step"] for _, c in select(found, 2, None)] == [10, 15]
    with pytest.raises(ValueError, match="asked for 4 checkpoints but only 3 qualify"):
        select(found, 4, None)
    with pytest.raises(ValueError, match="exactly one of last=N or best=N"):
        select(found, 2, 2)


def test_average_refuses_checkpoints_of_different_models(ema_run):
    _, run = ema_run
    path = run / "checkpoints" / "last.ckpt"
    checkpoint = read_checkpoint(path)
    other = {**checkpoint, "run_config": {**checkpoint["run_config"],
                                          "model": {**checkpoint["run_config"]["model"], "hidden_size": 999}}}
    with pytest.raises(ValueError, match=f"{path}: another model config or vocabulary than {path}"):
        average([(path, checkpoint), (path, other)])
    state = dict(checkpoint["current_model_state"])
    state["model.decoder.out.weight"] = state["model.decoder.out.weight"][:-8]
    with pytest.raises(ValueError, match="its weights differ in names or shapes"):
        average([(path, checkpoint), (path, {**checkpoint, "current_model_state": state})])
    state = dict(checkpoint["current_model_state"])
    state["model.decoder.out.weight"] = state["model.decoder.out.weight"].clone().fill_(float("nan"))
    diverged, deep_path = run / "diverged.ckpt", run / "deep.ckpt"
    with pytest.raises(ValueError) as raised:
        average([(path, checkpoint), (diverged, {**checkpoint, "current_model_state": state})])
    assert str(raised.value) == (f"the average holds NaN or infinity (decoder.out.weight), from {diverged}; "
                                 "leave such checkpoints out")
    nested: dict = {}
    inner = nested
    for _ in range(5000):  # compared with the first file's config, it once overflowed the stack
        inner["a"] = {}
        inner = inner["a"]
    deep = {**checkpoint, "run_config": {**checkpoint["run_config"],
                                         "model": {**checkpoint["run_config"]["model"], "extra": nested}}}
    with pytest.raises(CheckpointError, match=rf"^{deep_path}: model\.extra(\.a)+: the config is larger than any nmt "
                                              r"config \(10000 values, 32 levels\)$"):
        average([(path, checkpoint), (deep_path, deep)])


def test_a_logger_without_its_package_names_the_extra(monkeypatch):
    real = nmt.training.builders.importlib.util.find_spec
    monkeypatch.setattr(nmt.training.builders.importlib.util, "find_spec", lambda name: None if name == "wandb" else real(name))
    group = OmegaConf.create({"wandb": {"_target_": "pytorch_lightning.loggers.WandbLogger"},
                              "csv": {"_target_": "pytorch_lightning.loggers.CSVLogger"}})
    with pytest.raises(ImportError, match=r"needs the wandb package: pip install 'nmt\[wandb\]'"):
        check_logger_packages(group)
    check_logger_packages(OmegaConf.create({"csv": group.csv}))


def test_export_command_writes_release_files_and_ctranslate2_folders(budget_run, tmp_path):
    pytest.importorskip("ctranslate2")
    _, run = budget_run
    base = {"ckpt": str(run / "checkpoints" / "last.ckpt"), "weights": "stored", "quantization": None,
            "allow_pickle": False}
    out = export(OmegaConf.create({**base, "format": "ctranslate2", "out": str(tmp_path / "ct2")}))
    assert (out / "model.bin").is_file() and (out / "source.model").is_file()
    release_file = export(OmegaConf.create({**base, "format": "release", "out": str(tmp_path / "m.ckpt")}))
    assert read_checkpoint(release_file)["kind"] == "release"
    with pytest.raises(ValueError, match="format=onnx: choose one of release, ctranslate2"):
        export(OmegaConf.create({**base, "format": "onnx", "out": str(tmp_path / "x")}))


def test_evaluate_names_the_checkpoints_it_is_given(budget_run, tmp_path, capsys):
    _, run = budget_run
    last = run / "checkpoints" / "last.ckpt"
    released = export_release(last, tmp_path / "model.ckpt")
    base = ["n_bootstrap=10", "decoding=greedy"]
    result = evaluate_here(capsys, tmp_path / "eval", *base, f"ckpts={{final: {last}, release: {released}}}")
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads((tmp_path / "eval" / "comparison.json").read_text())
    assert set(report) == {"final", "release"} and report["final"]["bleu"] == report["release"]["bleu"]
    result = evaluate_here(capsys, tmp_path / "eval2", *base, f"ckpts=[{last},{last}]")
    assert result.returncode == 2 and "name them: ckpts={name: file, ...}" in result.stderr


def test_a_checkpoint_whose_config_would_build_something_else_is_refused(budget_run, tmp_path):
    """Only nmt's model classes are built from a file's config (more: test_checkpoint_security.py)."""
    _, run = budget_run
    checkpoint = read_checkpoint(run / "checkpoints" / "last.ckpt")
    marker = tmp_path / "pwned"
    model = {**checkpoint["run_config"]["model"],
             "bridge": {"_target_": "os.system", "_args_": [f"touch {marker}"]}}
    crafted = tmp_path / "crafted.ckpt"
    torch.save({**checkpoint, "run_config": {**checkpoint["run_config"], "model": model}}, crafted)
    with pytest.raises(CheckpointError, match=r"model.bridge._args_: refused"):
        load_checkpoint(crafted)
    assert not marker.exists()


def test_ema_before_its_first_update_leaves_the_raw_weights_everywhere(tmp_path):
    """Until the average has an update, validation, checkpoints and the end of training use the
    weights being trained, not the ones the model started from."""
    cfg = compose_train(tmp_path, [
        "callbacks=[default,ema,recent_checkpoints]", "callbacks.early_stopping=null", "callbacks.rich_progress_bar=null",
        "callbacks.ema.update_starting_at_step=100", "callbacks.recent_checkpoints.every_n_train_steps=5",
        "trainer.max_epochs=-1", "trainer.max_steps=10", "trainer.val_check_interval=5",
        "trainer.check_val_every_n_epoch=null", "test=false", "optimizer.lr=0.01",
    ], model="transformer")
    train(cfg)
    folder = Path(cfg.paths.output_dir) / "checkpoints"
    last, raw = read_checkpoint(folder / "last.ckpt"), read_checkpoint(folder / "recent" / "step000010.ckpt")
    assert "current_model_state" not in last and last["global_step"] == 10
    for name, weight in raw["state_dict"].items():
        assert torch.equal(last["state_dict"][name], weight), name


def test_ema_checkpoints_saved_during_validation_keep_the_average_as_state_dict():
    """A signal in validation saves while the module holds the averaged weights: the file still
    stores the average as state_dict and the weights being trained as current_model_state."""
    import pytorch_lightning as L

    from nmt.training.callbacks import EMA

    module = L.LightningModule()
    module.layer = torch.nn.Linear(2, 2)
    ema = EMA(decay=0.5)
    ema.setup(SimpleNamespace(), module, "fit")
    with torch.no_grad():
        module.layer.weight.add_(1.0)
    ema.on_train_batch_end(SimpleNamespace(global_step=1), module, None, None, 0)  # the average: first update
    with torch.no_grad():
        module.layer.weight.add_(1.0)  # the weights being trained move on
    raw = {k: v.clone() for k, v in module.state_dict().items()}
    average = {k[len("module."):]: v.clone() for k, v in ema._average_model.state_dict().items() if k.startswith("module.")}
    ema.on_validation_epoch_start(SimpleNamespace(), module)  # swapped in
    checkpoint = {"state_dict": {k: v.clone() for k, v in module.state_dict().items()}}
    ema.on_save_checkpoint(SimpleNamespace(), module, checkpoint)
    for name in raw:
        assert torch.equal(checkpoint["state_dict"][name], average[name]), name
        assert torch.equal(checkpoint["current_model_state"][name], raw[name]), name
    ema.on_validation_epoch_end(SimpleNamespace(), module)
    assert all(torch.equal(module.state_dict()[k], raw[k]) for k in raw)


@pytest.mark.parametrize("umask", [0o022, 0o077, 0o002])
def test_saved_files_get_the_permissions_the_umask_gives(tmp_path, umask):
    """A checkpoint or release file is written to a temporary file and renamed: it still gets the
    mode a plain open() would give it, not the temporary file's 0600."""
    from nmt.checkpoints.files import atomic_save

    before = os.umask(umask)
    try:
        atomic_save({"x": torch.zeros(1)}, tmp_path / "a.ckpt")
        (tmp_path / "plain").write_bytes(b"")
    finally:
        os.umask(before)
    assert (tmp_path / "a.ckpt").stat().st_mode & 0o777 == (tmp_path / "plain").stat().st_mode & 0o777 == 0o666 & ~umask
