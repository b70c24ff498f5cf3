"""Files an earlier nmt wrote keep working: a training checkpoint and a release file made by the
commands of the version in tests/data/saved/written_by.txt (tests/data/saved/make.sh) load,
translate exactly as they did then, and the checkpoint resumes. The names a file stores (its run
config's ``_target_``s) are those of that version's modules, whatever the tree looks like now."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from nmt.checkpoints.files import read_checkpoint
from nmt.train import train
from tests.conftest import ROOT, compose_train, translate_here

SAVED = ROOT / "tests" / "data" / "saved"
TEST_SOURCES = ROOT / "tests" / "data" / "tiny" / "test.src"
# As make.sh trained the Transformer.
TRANSFORMER = ["model=transformer", "model.emb_size=16", "model.hidden_size=16", "model.encoder.num_layers=1",
               "model.decoder.num_layers=1", "model.encoder.num_heads=2", "model.decoder.num_heads=2",
               "model.encoder.ff_size=32", "model.decoder.ff_size=32"]


def stored_targets(value) -> set[str]:
    if isinstance(value, dict):
        return {t for k, v in value.items() for t in ([v] if k == "_target_" else stored_targets(v))}
    if isinstance(value, list):
        return {t for v in value for t in stored_targets(v)}
    return set()


@pytest.mark.parametrize("name", ["transformer.ckpt", "lstm_luong.release.ckpt"])
def test_a_saved_file_translates_as_it_did_when_written(name, capsys):
    model = name.split(".")[0]
    result = translate_here(capsys, f"ckpt={SAVED / name}", f"input={TEST_SOURCES}", "precision=32",
                            "decoding.beam_size=3")
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout == (SAVED / f"{model}.beam3.txt").read_text(encoding="utf-8")


def test_the_saved_files_name_the_modules_of_the_version_that_wrote_them():
    """What the files hold, so the tests above prove that old names still load."""
    checkpoint = read_checkpoint(SAVED / "transformer.ckpt")
    targets = stored_targets(checkpoint["run_config"])
    assert {"nmt.lit_module.TranslationModule", "nmt.schedules.WarmupCosine", "nmt.decoding.beam_search",
            "nmt.callbacks.LastCheckpoint", "nmt.cpu_threads.CpuThreads",
            "nmt.models.transformer.TransformerEncoder"} <= targets
    release = read_checkpoint(SAVED / "lstm_luong.release.ckpt")
    assert release["kind"] == "release" and "nmt.models.rnn.RNNDecoder" in stored_targets(release["run_config"])


def test_a_saved_checkpoint_resumes(tmp_path):
    saved = read_checkpoint(SAVED / "transformer.ckpt")
    cfg = compose_train(tmp_path, [*TRANSFORMER, f"ckpt_path={SAVED / 'transformer.ckpt'}", "trainer.max_epochs=-1",
                                   f"trainer.max_steps={saved['global_step'] + 3}", "test=false"], model=None)
    train(cfg)
    summary = json.loads((Path(cfg.paths.output_dir) / "summary.json").read_text())
    assert summary["resumed_from"] is not None and summary["steps"] == saved["global_step"] + 3
    resumed = torch.load(Path(cfg.paths.output_dir) / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)
    assert resumed["global_step"] == saved["global_step"] + 3
    assert resumed["state_dict"].keys() == saved["state_dict"].keys()


def test_the_search_functions_and_the_translators_keep_their_documented_names():
    """Configs name ``nmt.decoding.beam_search`` (and greedy, sample), the API ``nmt.inference.Translator``."""
    from hydra.utils import get_method

    from nmt.decoding import search
    from nmt.inference import CTranslate2Translator, Translator
    from nmt.inference.ctranslate2 import CTranslate2Translator as in_module
    from nmt.inference.translator import Translator as in_translator

    for name in ("greedy_search", "beam_search", "sample_search"):
        assert get_method(f"nmt.decoding.{name}") is getattr(search, name)
    assert Translator is in_translator and CTranslate2Translator is in_module
    with pytest.raises(AttributeError, match="no attribute 'translate'"):
        import nmt.inference
        nmt.inference.translate


def test_translating_uses_the_length_penalty_the_model_was_tested_with(tmp_path):
    """decoding.alpha=null (the default) takes the file's test_decoding.alpha; a set alpha wins."""
    from nmt.decoding.settings import SearchSettings

    default = SearchSettings.from_config({"_target_": "nmt.decoding.search.beam_search"})
    assert default.alpha is None
    assert default.for_model(2.0).alpha == 2.0 and default.for_model(None).alpha == 0.6
    assert default.for_model("1e9").alpha == 0.6 and default.for_model(11).alpha == 0.6 and default.for_model(True).alpha == 0.6
    chosen = SearchSettings.from_config({"_target_": "nmt.decoding.search.beam_search", "alpha": 1.0})
    assert chosen.for_model(2.0).alpha == 1.0

    from nmt.inference import Translator

    checkpoint = torch.load(SAVED / "transformer.ckpt", map_location="cpu", weights_only=True)
    assert checkpoint["run_config"]["test_decoding"]["alpha"] == 0.6
    checkpoint["run_config"]["test_decoding"]["alpha"] = 3.0
    torch.save(checkpoint, tmp_path / "tested_at_3.ckpt")
    beam = {"_target_": "nmt.decoding.search.beam_search", "alpha": None}
    assert Translator.load(tmp_path / "tested_at_3.ckpt", decoding=beam).settings.alpha == 3.0
    assert Translator.load(SAVED / "transformer.ckpt", decoding=beam).settings.alpha == 0.6
    assert Translator.load(tmp_path / "tested_at_3.ckpt", decoding={**beam, "alpha": 1.0}).settings.alpha == 1.0
