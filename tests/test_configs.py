"""Every config group file composes, and what it builds can be instantiated."""

from __future__ import annotations

import pytest
from hydra import compose, initialize_config_dir
from hydra.errors import ConfigCompositionException, MissingConfigException
from hydra.utils import instantiate
from omegaconf import open_dict

from tests.conftest import CONF_DIR, compose_train


def names(group: str) -> list[str]:
    return sorted(p.stem for p in (CONF_DIR / group).glob("*.yaml"))


def compose_with(overrides: list[str]):
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return compose("train", overrides=overrides)


@pytest.mark.parametrize("encoder", names("model/encoder"))
@pytest.mark.parametrize("decoder", names("model/decoder"))
def test_every_encoder_decoder_pair_builds(encoder, decoder):
    cfg = compose_with([f"model/encoder={encoder}", f"model/decoder={decoder}", "model.hidden_size=32", "model.emb_size=32"])
    with open_dict(cfg):
        cfg.model.src_vocab_size = cfg.model.tgt_vocab_size = 50
    model = instantiate(cfg.model)
    expected = {"lstm": "RNNEncoder", "transformer": "TransformerEncoder"}[encoder]
    assert type(model.encoder).__name__ == expected
    assert (model.bridge is not None) == (encoder == "transformer" and decoder.startswith("lstm"))


@pytest.mark.parametrize("model", names("model"))
def test_every_model_preset_builds(model):
    cfg = compose_with([f"model={model}"])
    with open_dict(cfg):
        cfg.model.src_vocab_size = cfg.model.tgt_vocab_size = 1000
    params = sum(p.numel() for p in instantiate(cfg.model).parameters())
    assert 1e6 < params < 2e7  # sized for a CPU: a few million parameters


@pytest.mark.parametrize("experiment", names("experiment"))
def test_every_experiment_composes(experiment, tmp_path):
    cfg = compose_train(tmp_path, [f"experiment={experiment}"], model=None)
    with open_dict(cfg):
        cfg.model.src_vocab_size = cfg.model.tgt_vocab_size = 1000
    instantiate(cfg.model)
    instantiate(cfg.trainer)


@pytest.mark.parametrize("model", ["lstm", "lstm_luong", "transformer"])
def test_only_transformer_encoders_shift_positions(model, tmp_path):
    """The top-level position_shift (30 by default, as the study's) is read by Transformer
    encoders only; position_shift=0 starts positions at 0."""
    shifts = {}
    for experiment in (["experiment=bleu_vs_length"], [], ["position_shift=7"], ["position_shift=0"]):
        with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):  # the defaults, not the tests' TINY
            cfg = compose("train", overrides=[f"model={model}", *experiment], return_hydra_config=True)
        with open_dict(cfg):
            cfg.model.src_vocab_size = cfg.model.tgt_vocab_size = 1000
            cfg.hydra.runtime.choices.model = model
        encoder = instantiate(cfg.model).encoder
        assert getattr(encoder, "position_shift", None) == (cfg.position_shift if model == "transformer" else None)
        shifts[tuple(experiment)] = cfg.position_shift
    assert shifts == {("experiment=bleu_vs_length",): 30, (): 30, ("position_shift=7",): 7, ("position_shift=0",): 0}


@pytest.mark.parametrize("group", ["optimizer", "scheduler", "decoding", "trainer", "callbacks", "logger"])
def test_every_group_option_composes(group):
    key = {"decoding": "decoding@test_decoding"}.get(group, group)
    for option in names(group):
        cfg = compose_with([f"{key}={option}"])
        node = cfg.test_decoding if group == "decoding" else cfg.get(group)
        if group in ("optimizer", "scheduler", "decoding", "trainer"):
            assert "_target_" in node


def test_unknown_model_name_lists_the_available_ones():
    with pytest.raises(MissingConfigException) as err:
        compose_with(["model=gru"])
    message = str(err.value)
    assert "Could not find 'model/gru'" in message
    for model in ("lstm", "lstm_bahdanau", "lstm_luong", "transformer"):
        assert model in message


def test_misspelled_key_fails_before_any_work():
    with pytest.raises(ConfigCompositionException, match="Could not override 'model.hiden_size'"):
        compose_with(["model.hiden_size=10"])
