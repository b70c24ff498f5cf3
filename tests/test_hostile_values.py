"""Values a user can type, or a file can hold, that used to end in a traceback, a hang or a wrong
answer: each is refused in one line naming the key, the file or the line, before any work."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from nmt.checkpoints.files import CheckpointError
from nmt.checkpoints.loading import load_checkpoint
from tests.conftest import ROOT, serve_cfg, translate_here

SAVED = ROOT / "tests" / "data" / "saved" / "transformer.ckpt"  # a 400-piece joint vocabulary, 400 embedding rows


def resized(proto: bytes, size: int) -> bytes:
    """A SentencePiece model with ``size`` pieces: the first ``size`` of ``proto``'s, or more
    (user-defined pieces ``zq0``, ``zq1``... that the encoder emits for that text)."""
    from sentencepiece import sentencepiece_model_pb2

    model = sentencepiece_model_pb2.ModelProto()
    model.ParseFromString(proto)
    del model.pieces[size:]
    while len(model.pieces) < size:
        piece = model.pieces.add()
        piece.piece, piece.score, piece.type = f"zq{len(model.pieces)}", 0.0, piece.USER_DEFINED
    return model.SerializeToString()


def forged(tmp_path: Path, src: int | None = None, tgt: int | None = None) -> Path:
    checkpoint = torch.load(SAVED, weights_only=False)
    protos = dict(checkpoint["tokenizers"])
    for side, size in (("src", src), ("tgt", tgt)):
        if size is not None:
            protos[side] = resized(protos[side], size)
    path = tmp_path / "forged.ckpt"
    torch.save({**checkpoint, "tokenizers": protos}, path)
    return path


# --- item 3: the model and its vocabularies agree -------------------------------------------------
@pytest.mark.parametrize("src, tgt, side, pieces, key", [(1157, None, "src", "1,157", "src_vocab_size"),
                                                          (None, 1157, "tgt", "1,157", "tgt_vocab_size"),
                                                          (None, 50, "tgt", "50", "tgt_vocab_size")],
                         ids=["source-larger", "target-larger", "target-cut"])
def test_a_tokenizer_other_than_the_models_vocabulary_is_refused_at_load(tmp_path, src, tgt, side, pieces, key):
    """1,157 pieces over 400 embedding rows ended in an IndexError inside the embedding; a target
    tokenizer cut to 50 pieces in one inside ``decode`` (nmt-serve died at start-up)."""
    path = forged(tmp_path, src, tgt)
    with pytest.raises(CheckpointError) as raised:
        load_checkpoint(path)
    assert str(raised.value) == (f"{path}: its {side} tokenizer has {pieces} pieces but the model was built for "
                                 f"model.{key}=400; the file's vocabulary and weights do not belong together: use a "
                                 "checkpoint written by nmt as it was saved")


def test_embedding_rows_fewer_than_the_tokenizers_pieces_are_refused(tmp_path):
    """A config that claims the tokenizer's size over an embedding of fewer rows."""
    from nmt.checkpoints.loading import check_vocabulary_sizes

    model = load_checkpoint(SAVED).model
    model.src_vocab_size = 1157
    with pytest.raises(CheckpointError) as raised:
        check_vocabulary_sizes(model, 1157, 400, "f.ckpt")
    assert str(raised.value) == ("f.ckpt: its src tokenizer has 1,157 pieces but the source embedding has 400 rows; the "
                                 "file's vocabulary and weights do not belong together: use a checkpoint written by nmt "
                                 "as it was saved")


def test_translate_and_serve_refuse_such_a_file_in_one_line(tmp_path, capsys):
    from nmt.serve.app import load

    path = forged(tmp_path, src=1157)
    finished = translate_here(capsys, f"ckpt={path}", "input=/dev/null")
    assert finished.returncode == 1 and "Traceback" not in finished.stderr
    assert finished.stderr.strip().splitlines()[-1].startswith(f"error: {path}: its src tokenizer has 1,157 pieces")
    with pytest.raises(CheckpointError, match="its src tokenizer has 1,157 pieces"):
        load(serve_cfg(path, "batching.process=false"))
