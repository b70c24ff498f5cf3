"""A COMET-shaped checkpoint folder with random weights, a tiny XLM-R and a SentencePiece model
trained on the given text: the layout and file formats of wmt22-comet-da (``nmt.evaluation.comet_files``),
for the tests and for a smoke run of ``evaluate.py comet.model=<folder>``. Random weights score
nothing meaningful.

    python -m tests.comet_checkpoint <out folder> <text file> [<text file> ...]
"""

from __future__ import annotations

import argparse
import io
import json
from pathlib import Path
from typing import Any

import torch

HPARAMS = {"activations": "Tanh", "batch_size": 16, "class_identifier": "regression_metric", "dropout": 0.1,
           "encoder_learning_rate": 1.0e-06, "encoder_model": "XLM-RoBERTa", "final_activation": None,
           "hidden_sizes": [32, 16], "keep_embeddings_frozen": True, "layer": "mix", "layer_norm": False,
           "layer_transformation": "sparsemax", "layerwise_decay": 0.95, "learning_rate": 1.5e-05, "loss": "mse",
           "nr_frozen_epochs": 0.3, "optimizer": "AdamW", "pool": "avg", "train_data": [], "validation_data": [],
           "warmup_steps": 0}
ENCODER = {"hidden_size": 16, "num_hidden_layers": 2, "num_attention_heads": 2, "intermediate_size": 32,
           "max_position_embeddings": 66, "type_vocab_size": 1, "layer_norm_eps": 1e-5}


def sentencepiece_model(lines: list[str], vocab_size: int = 80) -> bytes:
    """A unigram SentencePiece model with XLM-R's specials: unk 0, <s> 1, </s> 2, no pad."""
    import sentencepiece as spm

    out = io.BytesIO()
    spm.SentencePieceTrainer.train(sentence_iterator=iter(lines), model_writer=out, model_type="unigram",
                                   vocab_size=vocab_size, hard_vocab_limit=False, unk_id=0, bos_id=1, eos_id=2,
                                   pad_id=-1, character_coverage=1.0, num_threads=1, minloglevel=2)
    return out.getvalue()


def write_comet_folder(out: Path, lines: list[str], seed: int = 0, **hparams: Any) -> Path:
    """Write ``out/{hparams.yaml, checkpoints/model.ckpt, encoder/{config.json, sentencepiece.bpe.model}}``.

    ``hparams`` override ``HPARAMS``; ``pretrained_model`` is the encoder folder, so COMET's own
    package reads the same files."""
    import sentencepiece as spm
    import yaml
    from transformers import XLMRobertaConfig, XLMRobertaModel

    from nmt.evaluation.comet_files import expected_shapes, read_head

    encoder_dir = out / "encoder"
    (out / "checkpoints").mkdir(parents=True, exist_ok=True)
    encoder_dir.mkdir(parents=True, exist_ok=True)
    proto = sentencepiece_model(lines)
    (encoder_dir / "sentencepiece.bpe.model").write_bytes(proto)
    pieces = spm.SentencePieceProcessor(model_proto=proto).get_piece_size()
    config = XLMRobertaConfig(vocab_size=pieces + 2, pad_token_id=1, bos_token_id=0, eos_token_id=2, **ENCODER)
    config.to_json_file(str(encoder_dir / "config.json"))
    settings = {**HPARAMS, **hparams, "pretrained_model": str(encoder_dir.resolve())}
    (out / "hparams.yaml").write_text(yaml.safe_dump(settings))
    torch.manual_seed(seed)
    encoder = XLMRobertaModel(config, add_pooling_layer=False)
    state = {f"encoder.model.{k}": v for k, v in encoder.state_dict().items() if not k.endswith("position_ids")}
    head, _ = read_head(out / "hparams.yaml")
    for name, shape in expected_shapes(json.loads((encoder_dir / "config.json").read_text()), head).items():
        if name not in state:  # the layer weights, gamma and the feed-forward: spread enough that scores differ
            state[name] = torch.randn(shape) * (0.5 if "estimator" in name else 1.0)
    if head.layer == "mix":
        state["layerwise_attention.gamma"] = torch.tensor([1.5])
        state["layerwise_attention.dropout_mask"] = torch.zeros(config.num_hidden_layers + 1)  # buffers COMET saves
        state["layerwise_attention.dropout_fill"] = torch.full((config.num_hidden_layers + 1,), -1e20)
    torch.save({"epoch": 0, "global_step": 0, "pytorch-lightning_version": "2.6.6", "state_dict": state,
                "hparams_name": "kwargs", "hyper_parameters": settings}, out / "checkpoints" / "model.ckpt")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", type=Path)
    parser.add_argument("text", type=Path, nargs="+", help="text the SentencePiece model is trained on")
    args = parser.parse_args()
    lines = [line for path in args.text for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    print(write_comet_folder(args.out, lines))


if __name__ == "__main__":
    main()
