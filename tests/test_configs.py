"""Every config group file composes, and what it builds can be instantiated."""

from __future__ import annotations

import importlib.util
import inspect
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from hydra.errors import ConfigCompositionException, MissingConfigException
from hydra.core.hydra_config import HydraConfig
from hydra.utils import get_class, instantiate
from omegaconf import OmegaConf, open_dict
from pytorch_lightning import Callback
from pytorch_lightning.loggers import Logger

from nmt.training.builders import instantiate_model
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
    model = instantiate_model(cfg.model)
    expected = {"lstm": "RNNEncoder", "transformer": "TransformerEncoder"}[encoder]
    assert type(model.encoder).__name__ == expected
    assert (model.bridge is not None) == (encoder == "transformer" and decoder.startswith("lstm"))


@pytest.mark.parametrize("model", names("model"))
def test_every_model_preset_builds(model):
    cfg = compose_with([f"model={model}"])
    with open_dict(cfg):
        cfg.model.src_vocab_size = cfg.model.tgt_vocab_size = 1000
    params = sum(p.numel() for p in instantiate_model(cfg.model).parameters())
    assert 1e6 < params < 2e7  # sized for a CPU: a few million parameters


# What each experiment sets (the values its paper, study or README table rests on), read from
# the composed config with no test overrides; "model" and "data" are the group options chosen.
EXPERIMENTS = {
    "attention_long": {"model": "transformer", "data": "synthetic", "data.source.min_len": 60, "data.source.max_len": 200,
                       "data.max_src_len": 400, "trainer.max_steps": 1000, "module.length_buckets": [80, 100, 120, 140, 160, 180, 200],
                       "model.encoder.attention": "full"},
    "bleu_vs_length": {"model": "lstm_bahdanau", "data": "synthetic", "scheduler._target_": "nmt.training.schedules.WarmupCosine",
                       "test_ckpt": "last", "position_shift": 30, "data.max_tokens": 2048, "data.train_max_words": None,
                       "trainer.max_steps": 2500,
                       "trainer.val_check_interval": 500,
                       "callbacks.early_stopping": None},
    "bleu_vs_length_europarl": {"model": "lstm_bahdanau", "data": "europarl_it_en", "position_shift": 0,
                                "data.train_pairs": 60000, "data.train_max_words": 30, "data.max_tokens": 3000,
                                "trainer.max_steps": 3001, "optimizer.lr": 0.005, "scheduler.warmup_steps": 500,
                                "test_ckpt": "last"},
    "luong_2015": {"model": "lstm_luong", "model.hidden_size": 1000, "model.emb_size": 1000,
                   "model.encoder.num_layers": 4, "model.encoder.bidirectional": False, "model.decoder.num_layers": 4,
                   "scheduler._target_": "nmt.training.schedules.inverse_sqrt", "trainer.max_epochs": 20,
                   "trainer.max_steps": -1, "trainer.max_time": None},
    "multi30k_lstm": {"model": "lstm", "data": "multi30k", "model.hidden_size": 256,
                      "model.share_src_tgt_embeddings": True, "optimizer.lr": 0.008, "trainer.max_steps": 4500,
                      "trainer.val_check_interval": 750, "test_ckpt": "best", "data.val_sample": None},
    "multi30k_lstm_bahdanau": {"model": "lstm_bahdanau", "data": "multi30k", "model.hidden_size": 256,
                               "optimizer.lr": 0.008, "trainer.max_steps": 2400, "trainer.val_check_interval": 600,
                               "test_ckpt": "best", "data.val_sample": None},
    "multi30k_lstm_luong": {"model": "lstm_luong", "data": "multi30k", "model.hidden_size": 256, "optimizer.lr": 0.004,
                            "trainer.max_steps": 5000, "trainer.val_check_interval": 1000, "test_ckpt": "best", "data.val_sample": None},
    "multi30k_student": {"model": "transformer", "data": "multi30k", "model.hidden_size": 128,
                         "model.encoder.num_layers": 3, "model.decoder.num_layers": 1, "model.encoder.ff_size": 512,
                         "optimizer.lr": 0.002, "trainer.max_steps": 5000, "test_decoding.alpha": 2.0, "test_ckpt": "last"},
    "multi30k_transformer": {"model": "transformer", "data": "multi30k", "model.hidden_size": 256,
                             "model.encoder.num_layers": 3, "model.decoder.num_heads": 4, "model.encoder.ff_size": 1024,
                             "optimizer.lr": 0.002, "scheduler.warmup_steps": 250, "trainer.max_steps": 2500,
                             "trainer.val_check_interval": 500, "test_ckpt": "last"},
    "tatoeba_zh_en_transformer": {"model": "transformer", "data": "tatoeba_zh_en", "model.hidden_size": 256,
                                  "model.encoder.num_layers": 3, "optimizer.lr": 0.002, "trainer.max_steps": 2500,
                                  "trainer.val_check_interval": 500, "test_decoding.alpha": 1.0, "test_ckpt": "last"},
    "multi30k_multilingual": {"model": "transformer", "data": "multi30k_multilingual",
                              "data.source.directions": ["de-en", "en-de", "en-fr", "fr-en"],
                              "data.source.zero_shot": ["de-fr", "fr-de"], "data.temperature": 5,
                              "model.hidden_size": 256, "trainer.max_steps": 1000,
                              "trainer.reload_dataloaders_every_n_epochs": 1, "test_ckpt": "last"},
    "nllb_like_finetune": {"data": "multi30k_multilingual", "data.source.path": "nllb_like/finetune",
                           "data.source.directions": ["deu_Latn-fra_Latn"], "optimizer.lr": 0.001,
                           "trainer.max_steps": 300, "test_ckpt": "last"},
    "nllb_like_general": {"data": "multi30k_multilingual", "data.source.path": "nllb_like/general",
                          "data.source.directions": ["deu_Latn-fra_Latn"], "data.temperature": 1,
                          "trainer.max_steps": 1200, "test_ckpt": "last"},
    "nllb_like_student": {"model": "transformer", "data": "files", "data.source.path": "nllb_like/indomain",
                          "data.src_lang": "deu_Latn", "model.decoder.num_layers": 1, "trainer.max_steps": 2400,
                          "test_ckpt": "last"},
    "opus_like_finetune": {"data": "synthetic", "data.source.min_len": 16, "data.source.max_len": 40,
                           "optimizer.lr": 0.001, "trainer.max_steps": 300, "test_ckpt": "last"},
    "opus_like_general": {"model": "transformer", "data": "synthetic", "data.source.max_len": 15,
                          "model.encoder.activation": "swish", "model.decoder.norm": "post",
                          "model.decoder.logits_bias": True, "trainer.max_steps": 1200, "test_ckpt": "last"},
    "opus_like_student": {"model": "transformer", "data": "synthetic", "model.hidden_size": 128,
                          "model.decoder.num_layers": 1, "data.source.num_pairs": 20000, "trainer.max_steps": 2400,
                          "test_ckpt": "last"},
    "rnnsearch": {"model": "lstm_bahdanau", "model.emb_size": 620, "model.hidden_size": 2000, "model.dropout": 0.0,
                  "model.decoder.output": "maxout", "model.decoder.initial_state": "tanh",
                  "optimizer.lr": 0.0005, "scheduler._target_": "nmt.training.schedules.inverse_sqrt", "trainer.max_epochs": 20,
                  "trainer.max_steps": -1},
    "sutskever_2014": {"model": "lstm", "model.hidden_size": 1000, "model.encoder.num_layers": 4,
                       "model.encoder.bidirectional": False, "model.encoder.reverse": True,
                       "model.decoder.input_feeding": "none", "trainer.max_epochs": 20, "trainer.max_steps": -1},
    "transformer_base": {"model": "transformer", "optimizer._target_": "torch.optim.Adam", "model.hidden_size": 512,
                         "model.encoder.num_layers": 6, "model.decoder.num_heads": 8, "model.encoder.ff_size": 2048,
                         "model.encoder.norm": "post", "module.label_smoothing": 0.1, "optimizer.lr": 0.0007,
                         "optimizer.betas": [0.9, 0.98], "scheduler.warmup_steps": 4000, "data.max_tokens": 8192,
                         "trainer.max_epochs": 100, "trainer.max_steps": -1, "tokens_per_update": 25000},
}


def test_every_experiment_is_listed():
    assert sorted(EXPERIMENTS) == names("experiment")


@pytest.mark.parametrize("experiment", names("experiment"))
def test_every_experiment_composes_with_its_values(experiment, tmp_path):
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose("train", overrides=[f"experiment={experiment}"], return_hydra_config=True)
    HydraConfig().set_config(cfg)  # the step budget reads the model chosen
    choices = cfg.hydra.runtime.choices
    found = {key: choices[key] if key in ("model", "data") else OmegaConf.select(cfg, key, default="<missing>")
             for key in EXPERIMENTS[experiment]}
    assert {key: OmegaConf.to_object(v) if OmegaConf.is_config(v) else v for key, v in found.items()} \
        == EXPERIMENTS[experiment]
    assert cfg.task_name == experiment
    with open_dict(cfg):
        cfg.model.src_vocab_size = cfg.model.tgt_vocab_size = 1000
    decoder = "TransformerDecoder" if choices.model == "transformer" else "RNNDecoder"
    assert type(instantiate_model(cfg.model).decoder).__name__ == decoder
    # and under the tests' tiny settings, its trainer builds
    cfg = compose_train(tmp_path, [f"experiment={experiment}"], model=None)
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
        encoder = instantiate_model(cfg.model).encoder
        assert getattr(encoder, "position_shift", None) == (cfg.position_shift if model == "transformer" else None)
        shifts[tuple(experiment)] = cfg.position_shift
    assert shifts == {("experiment=bleu_vs_length",): 30, (): 30, ("position_shift=7",): 7, ("position_shift=0",): 0}


@pytest.mark.parametrize("model, data, overrides, words", [
    ("lstm", "synthetic", [], 30), ("lstm_bahdanau", "synthetic", [], None), ("transformer", "synthetic", [], None),
    ("lstm", "synthetic", ["data.train_max_words=50"], 50), ("lstm", "synthetic", ["max_words_by_model.lstm=null"], None),
    ("lstm", "multi30k", [], None)])
def test_the_default_data_trains_each_preset_on_its_lengths(model, data, overrides, words):
    """max_words_by_model: the plain LSTM's first run drops longer training pairs on the default data
    only; an explicit data.train_max_words wins."""
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose("train", overrides=[f"model={model}", f"data={data}", *overrides], return_hydra_config=True)
    HydraConfig().set_config(cfg)
    assert cfg.data.train_max_words == words


@pytest.mark.parametrize("group", ["optimizer", "scheduler", "decoding", "trainer"])
def test_every_group_option_composes(group):
    key = {"decoding": "decoding@test_decoding"}.get(group, group)
    for option in names(group):
        cfg = compose_with([f"{key}={option}"])
        node = cfg.test_decoding if group == "decoding" else cfg.get(group)
        assert "_target_" in node


EXTRAS = {"pytorch_lightning.loggers.TensorBoardLogger": ["tensorboard"]}  # pip install ".[tensorboard]"


@pytest.mark.parametrize("group, base", [("callbacks", Callback), ("logger", Logger)])
def test_every_callback_and_logger_option_builds_what_it_names(group, base, tmp_path):
    """Each option's entries build the class their ``_target_`` names with the arguments the
    config gives (an unknown one is an error); whatever writes files writes them under the run
    folder (wandb offline)."""
    built = set()
    for option in names(group):
        out = tmp_path / option
        with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
            cfg = compose("train", overrides=[f"{group}={option}"], return_hydra_config=True)
        with open_dict(cfg):
            cfg.hydra.runtime.output_dir = str(out)
            if "wandb" in cfg.logger:
                cfg.logger.wandb.offline = True
        HydraConfig().set_config(cfg)
        for name, node in (cfg.get(group) or {}).items():
            if node is None:
                continue
            cls = get_class(node._target_)
            inspect.signature(cls).bind(**{k: v for k, v in node.items() if not k.startswith("_")})
            built.add(name)
            if not all(map(importlib.util.find_spec, EXTRAS.get(node._target_, ()))):
                continue  # an optional extra not installed: its arguments are checked above
            obj = instantiate(node)
            assert type(obj) is cls and isinstance(obj, base), (option, name)
            folder = getattr(obj, "dirpath", None) or getattr(obj, "save_dir", None)
            if folder is not None:
                assert Path(folder).is_relative_to(out), (option, name, folder)
    # every entry of every option file was built
    expected = {name for option in names(group) for name in OmegaConf.load(CONF_DIR / group / f"{option}.yaml")
                if name != "defaults"}
    assert built == expected and built


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
