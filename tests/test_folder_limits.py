"""nmt.checkpoints.folder_limits: each file of a folder made elsewhere is bounded before it turns
into work, through the readers that use the limits (``nmt-import``'s and ``nmt-evaluate``'s COMET
folder): a file past a limit is refused in one exact line naming it and the limit. Each crafted
file costs, without the limit, what ``scripts/bounded_reading.py --folders`` measured (seconds and
gigabytes, or minutes for the YAML aliases); here each is refused before it is parsed."""

from __future__ import annotations

import struct

import pytest
import torch

from nmt.checkpoints.files import CheckpointError
from nmt.checkpoints.folder_limits import MAX_JSON_ITEMS, MAX_PIECES, MAX_SAFETENSORS_HEADER
from nmt.checkpoints.marian import ImportRefused, _json, _spm, read_weights
from nmt.evaluation.comet_files import CometRefused, read_encoder_config, read_head
from nmt.evaluation.comet_files import read_weights as read_comet_weights

TINY = {"d_model": 4, "encoder_layers": 1, "decoder_layers": 1, "encoder_ffn_dim": 4, "decoder_ffn_dim": 4,
        "vocab_size": 8, "decoder_vocab_size": 8, "max_position_embeddings": 8}  # a config.json read by read_config


def test_a_json_file_of_more_values_than_the_limit_is_refused_before_it_is_parsed(tmp_path):
    """64 MB of empty lists in vocab.json: 10 s and 1.9 GB before; now a count of its bytes."""
    count = MAX_JSON_ITEMS // 2 + 1
    (tmp_path / "vocab.json").write_bytes(b'{"a": [' + b"[]," * (count - 1) + b"[]]}")
    with pytest.raises(ImportRefused) as refused:
        _json(tmp_path, "vocab.json")
    assert str(refused.value) == (f"{tmp_path / 'vocab.json'}: {2 * count + 1:,} JSON values or more (its commas and "
                                  f"brackets), over the {MAX_JSON_ITEMS:,} a model folder's file may hold; refused "
                                  "before parsing")


def test_json_nested_past_the_parsers_depth_is_one_line(tmp_path):
    (tmp_path / "config.json").write_bytes(b"[" * 100_000)
    with pytest.raises(CometRefused) as refused:
        read_encoder_config(tmp_path / "config.json")
    import sys

    assert str(refused.value) == (f"{tmp_path / 'config.json'}: JSON nested over {sys.getrecursionlimit():,} levels "
                                  "deep (a model folder's is a few); refused")


def test_a_sentencepiece_model_of_more_pieces_than_the_limit_is_refused_before_it_is_parsed(tmp_path):
    """32 million empty pieces in 64 MB: 2.1 GB before protobuf had built them."""
    (tmp_path / "source.spm").write_bytes(b"\x0a\x00" * (MAX_PIECES + 1))
    with pytest.raises(ImportRefused) as refused:
        _spm(tmp_path, "source.spm")
    assert str(refused.value) == (f"{tmp_path / 'source.spm'}: over {MAX_PIECES:,} SentencePiece pieces, more than any "
                                  "vocabulary a model folder may declare; refused before it is parsed")


def test_a_sentencepiece_model_within_the_limit_is_counted_exactly(tmp_path):
    """The count walks protobuf's wire format: long pieces, other fields and a piece of 200 bytes
    (a two-byte length) are each one field; a model of exactly the limit is not refused."""
    from nmt.checkpoints.folder_limits import count_pieces

    piece = b"\x0a\x03\x0a\x01a"
    long_piece = b"\x0a\xcb\x01\x0a\xc8\x01" + b"b" * 200  # a piece message of 203 bytes: its length in two bytes
    trainer = b"\x12\x02\x18\x01"  # field 2 (the trainer spec), length-delimited
    raw = trainer + long_piece + piece * (MAX_PIECES - 1)
    count_pieces(raw, tmp_path / "x.model", ValueError)
    with pytest.raises(ValueError, match="over 1,000,000 SentencePiece pieces"):
        count_pieces(raw + piece, tmp_path / "x.model", ValueError)


def test_a_safetensors_header_over_the_limit_or_the_file_is_refused_before_it_is_parsed(tmp_path):
    """A 100 MB header of 1.7 million empty tensors (safetensors' own limit): 11 s and 1.6 GB before."""
    path = tmp_path / "model.safetensors"
    length = MAX_SAFETENSORS_HEADER + 8
    path.write_bytes(struct.pack("<Q", length) + b" " * length)
    with pytest.raises(ImportRefused) as refused:
        read_weights(tmp_path, TINY)
    assert str(refused.value) == (f"{path}: a safetensors header of {length:,} bytes, over the "
                                  f"{MAX_SAFETENSORS_HEADER:,} a model's list of tensors needs; refused before it is "
                                  "parsed")
    path.write_bytes(struct.pack("<Q", 1000) + b"{}")
    with pytest.raises(ImportRefused) as refused:
        read_weights(tmp_path, TINY)
    assert str(refused.value) == f"{path}: a safetensors header of 1,000 bytes in a file of 10: truncated or not safetensors"


@pytest.mark.slow  # builds pickles of millions of objects: the slow tier (check_structure's own tests run by default)
def test_pickled_weights_are_bounded_as_every_checkpoint(tmp_path):
    """pytorch_model.bin (allow_pickle=true) and COMET's model.ckpt: 300,000 empty lists cost 15 s
    and 0.8 GB at 3 million before; now ``check_structure`` counts them first."""
    import shutil

    torch.save({"x": [[] for _ in range(300_000)]}, tmp_path / "pytorch_model.bin")
    with pytest.raises(CheckpointError) as refused:
        read_weights(tmp_path, TINY, allow_pickle=True)
    assert str(refused.value) == (f"{tmp_path / 'pytorch_model.bin'}: its pickled structure (pytorch_model/data.pkl) "
                                  "holds over 1,000,000 operations or 250,000 containers, where a checkpoint's holds "
                                  "about 10,000 and 3,000: refused, it was not written by transformers")
    (tmp_path / "checkpoints").mkdir()
    shutil.copy(tmp_path / "pytorch_model.bin", tmp_path / "checkpoints" / "model.ckpt")
    with pytest.raises(CometRefused) as refused:
        read_comet_weights(tmp_path, {})
    assert str(refused.value).endswith("where a checkpoint's holds about 10,000 and 3,000: refused, it was not "
                                       "written by COMET")


def test_a_yaml_alias_in_comets_settings_is_refused(tmp_path):
    """Nine levels of ten aliases: 10^9 values in 400 bytes (the error message that printed them
    ran past 2 minutes)."""
    lines = ["class_identifier: regression_metric", "encoder_model: XLM-RoBERTa", "a0: &a0 [1, 1, 1, 1, 1, 1, 1, 1, 1, 1]"]
    lines += [f"a{k}: &a{k} [{', '.join([f'*a{k - 1}'] * 10)}]" for k in range(1, 9)]
    lines.append(f"hidden_sizes: [{', '.join(['*a8'] * 10)}]")
    path = tmp_path / "hparams.yaml"
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(CometRefused) as refused:
        read_head(path)
    assert str(refused.value) == (f"{path}: line 4: a YAML alias (*a0); nmt reads hparams.yaml as plain YAML, without "
                                  "anchors and aliases")
