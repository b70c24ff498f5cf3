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
    assert finished.returncode == 2 and "Traceback" not in finished.stderr
    assert finished.stderr.strip().splitlines()[-1].startswith(f"error: {path}: its src tokenizer has 1,157 pieces")
    with pytest.raises(CheckpointError, match="its src tokenizer has 1,157 pieces"):
        load(serve_cfg(path, "batching.process=false"))


# --- item 10 and 11: values a user types ----------------------------------------------------------
@pytest.mark.parametrize("decoding, message", [
    ({"beam_size": 100000}, "decoding.beam_size=100000: must be from 1 to 256"),
    ({"max_len_b": 1000000000}, "decoding.max_len_b=1000000000: must be from 0 to 10,000"),
    ({"max_len_a": float("inf")}, "decoding.max_len_a=inf: give a finite number"),
    ({"alpha": float("nan")}, "decoding.alpha=nan: give a finite number"),
    ({"_target_": "nmt.decoding.search.sample_search", "temperature": float("nan")},
     "decoding.temperature=nan: give a finite number"),
    ({"_target_": "nmt.decoding.search.sample_search", "top_p": 0}, "decoding.top_p=0: must be above 0 and at most 1 "
                                                                     "(1: every token)"),
    ({"_target_": "nmt.decoding.search.sample_search", "top_k": -1}, "decoding.top_k=-1: must be from 0 to 1,048,576"),
], ids=["beam_size", "max_len_b", "max_len_a", "alpha", "temperature", "top_p", "top_k"])
def test_decoding_values_are_bounded_before_any_allocation(decoding, message):
    """beam_size=100000 took 6.6 GB before an allocation error, max_len_b=10^9 asked for 160 GB,
    temperature=nan and alpha=nan wrote empty lines with exit 0."""
    from nmt.decoding.settings import SearchSettings

    with pytest.raises(ValueError) as raised:
        SearchSettings.from_config({"_target_": "nmt.decoding.search.beam_search", **decoding})
    assert str(raised.value) == message


def test_translate_refuses_a_nan_temperature_in_one_line(capsys):
    finished = translate_here(capsys, f"ckpt={SAVED}", "input=/dev/null", "decoding=sample", "decoding.temperature=nan")
    assert finished.returncode == 2 and "Traceback" not in finished.stderr
    assert finished.stderr.strip().splitlines()[-1] == "error: decoding.temperature=nan: give a finite number"


def test_a_dollar_piece_is_drawn_as_it_is(tmp_path):
    """A target piece ``$^^$`` was a matplotlib math-text parse error when its heatmap was drawn."""
    from nmt.evaluation.plots import literal, plot_attention

    assert literal("$^^$") == r"\$^^\$"
    path = plot_attention([[0.5, 0.5], [1.0, 0.0]], ["$^^$", "a$"], ["$x$", "$^^$"], tmp_path / "h.png")
    assert path.stat().st_size > 0


@pytest.mark.parametrize("search", ["greedy", "beam"])
def test_an_output_cap_beyond_the_decoders_positions_is_cut_to_the_models_limit(tmp_path, capsys, search):
    """``decoding.max_len_b=2000`` with a decoder of 1,024 positions (and a target limit of 256
    tokens): every line is translated, none past 255 pieces and EOS (the whole run was refused when a
    cap reached the position table)."""
    src = tmp_path / "in.txt"
    src.write_text("a b c d e f\nx y\n")
    finished = translate_here(capsys, f"ckpt={SAVED}", f"input={src}", "precision=32", f"decoding={search}",
                              "decoding.max_len_b=2000")
    assert finished.returncode == 0, finished.stderr[-2000:]
    lines = finished.stdout.splitlines()
    assert len(lines) == 2 and all(0 < len(line.split()) <= 255 for line in lines)


def test_the_heatmap_of_a_very_long_line_stays_within_its_size(tmp_path):
    """300 source and 400 target pieces: a PNG of at most 30 x 30 inches at 120 dpi, however long the
    line (1,000 words drew 9,396 x 14,328 pixels, 5.0 GB at the peak)."""
    import struct

    from nmt.evaluation.plots import plot_attention

    pieces = [f"w{i}" for i in range(400)]
    path = plot_attention(torch.rand(400, 300), pieces[:300], pieces, tmp_path / "long.png")
    width, height = struct.unpack(">II", path.read_bytes()[16:24])  # the PNG's IHDR
    assert width <= 3600 and height == 3600


@pytest.mark.parametrize("key", ["n_bootstrap", "significance.bootstrap"])
def test_a_negative_number_of_resamples_is_refused_in_one_line(tmp_path, capsys, key):
    from tests.conftest import evaluate_here

    finished = evaluate_here(capsys, tmp_path, f"ckpts=[{SAVED}]", f"{key}=-1")
    assert finished.returncode == 2 and "Traceback" not in finished.stderr
    assert finished.stderr.strip().splitlines()[-1] == (f"error: {key}=-1: a number of bootstrap resamples from 0 (off) "
                                                        "to 100,000")


def test_an_export_over_a_dangling_symbolic_link_is_refused_in_one_line(tmp_path):
    from nmt.exporters.folder import check_free

    link = tmp_path / "out"
    link.symlink_to(tmp_path / "nowhere" / "x")
    with pytest.raises(FileExistsError) as raised:
        check_free(link)
    assert str(raised.value) == (f"{link} is a symbolic link to {tmp_path / 'nowhere' / 'x'}, which does not exist: give "
                                 "the path of a new or empty folder")


@pytest.mark.parametrize("model, override, line", [
    ("transformer", "model.encoder.num_heads=0", "error: model.encoder.num_heads=0: must be a whole number of at least 1"),
    ("transformer", "model.decoder.num_layers=-1", "error: model.decoder.num_layers=-1: must be a whole number of at "
                                                   "least 1"),
    ("transformer", "model.hidden_size=15", "error: model.encoder.hidden_size=15: must be a multiple of num_heads (2)"),
    ("transformer", "model.encoder.num_heads=15", "error: model.encoder.hidden_size=15: sinusoidal positions need an "
                                                  "even hidden_size"),
    ("lstm_luong", "model.decoder.num_layers=-1", "error: model.decoder: num_layers must be greater than zero"),
], ids=["num_heads", "num_layers", "hidden_size", "odd", "lstm-layers"])
def test_model_sizes_that_cannot_build_are_one_line_naming_the_key(tmp_path, capsys, model, override, line):
    """They were Hydra's multi-line 'Error in call to target' around a ZeroDivisionError, an
    UnboundLocalError or a tensor-size RuntimeError, naming no key."""
    from nmt.training.builders import instantiate_model
    from omegaconf import open_dict

    from nmt.cli_io import ending_cleanly
    from tests.conftest import captured, compose_train

    overrides = [override, "model.hidden_size=15"] if override.endswith("num_heads=15") else [override]
    cfg = compose_train(tmp_path, overrides, model=model)
    with open_dict(cfg):
        cfg.model.src_vocab_size = cfg.model.tgt_vocab_size = 64

    def body() -> None:
        with ending_cleanly():
            instantiate_model(cfg.model)

    finished = captured(capsys, body)
    assert finished.returncode == 2 and "Traceback" not in finished.stderr
    assert finished.stderr.strip().splitlines() == [line]


def test_corpus_statistics_name_a_missing_folder_in_one_line(tmp_path, capsys):
    """nmt.data.stats printed the data module's traceback above its correct message."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    from nmt.cli_io import ending_cleanly
    from nmt.data import stats
    from tests.conftest import CONF_DIR, captured

    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose("stats", overrides=["data=files", f"data.source.path={tmp_path / 'none'}", "data.src_lang=de",
                                          "data.tgt_lang=en", f"paths.cache_dir={tmp_path}"])
    finished = captured(capsys, lambda: ending_cleanly()(stats.show_stats)(cfg))  # what stats.main runs
    assert finished.returncode == 2 and "Traceback" not in finished.stderr
    assert finished.stderr.strip().splitlines() == [f"error: data folder {tmp_path / 'none'} does not exist; set "
                                                    "data.source.path or NMT_DATA_DIR (the folder that holds the corpus "
                                                    "folders)"]


# --- item 7: batch sizes --------------------------------------------------------------------------
@pytest.mark.parametrize("override, line", [
    ("data.batch_size=0", "error: data.batch_size=0: a positive whole number of sentences a batch, or null (batches of "
                          "data.max_tokens tokens only)"),
    ("data.batch_size=-1", "error: data.batch_size=-1: a positive whole number of sentences a batch, or null (batches "
                           "of data.max_tokens tokens only)"),
    ("data.max_tokens=0", "error: data.max_tokens=0: a positive whole number of tokens a batch"),
], ids=["batch_size=0", "batch_size=-1", "max_tokens=0"])
def test_a_batch_size_below_one_is_refused_before_training(tmp_path, capsys, override, line):
    """data.batch_size=0 hung training with memory growing; -1 failed inside NumPy naming no key."""
    from nmt.cli_io import ending_cleanly
    from nmt.train import train
    from tests.conftest import captured, compose_train

    cfg = compose_train(tmp_path, [override, "test=false"])

    def body() -> None:
        with ending_cleanly():
            train(cfg)

    finished = captured(capsys, body)
    assert finished.returncode == 2 and "Traceback" not in finished.stderr
    assert finished.stderr.strip().splitlines()[-1] == line


@pytest.mark.parametrize("char", ["\x85", "\u2028", "\u2029"])
def test_a_corpus_full_of_line_separators_trains_a_tokenizer(tmp_path, char):
    """U+0085 on every line became a piece, and the trained model was refused naming a temporary
    spm.model instead of anything in the corpus: such characters train as spaces."""
    from nmt.data.tokenizer import LINE_BREAKING, train_sentencepiece

    lines = (ROOT / "tests" / "data" / "tiny" / "train.src").read_text(encoding="utf-8").splitlines()
    tok = train_sentencepiece([line.replace(" ", f" {char} ", 2) for line in lines], tmp_path,
                              {"vocab_size": 200, "hard_vocab_limit": False})
    assert not any(LINE_BREAKING.search(piece) for piece in tok.pieces(range(tok.vocab_size)))


# --- the same tricks where the issue did not look -------------------------------------------------
@pytest.mark.parametrize("override, line", [
    ("chunk_lines=0", "error: chunk_lines=0: a positive whole number of input lines read at a time (0 read a whole "
                      "stream into memory)"),
    ("max_tokens=-1", "error: max_tokens=-1: a positive whole number of source tokens a batch"),
    ("workers=0", "error: workers=0: a positive whole number of batches decoded at once, or null"),
])
def test_translate_batching_values_below_one_are_refused(capsys, override, line):
    """chunk_lines=0 read all of standard input into one chunk: an endless stream, unbounded memory."""
    finished = translate_here(capsys, f"ckpt={SAVED}", "input=/dev/null", override)
    assert finished.returncode == 2 and finished.stderr.strip().splitlines()[-1] == line


def test_a_beam_through_the_library_is_bounded_as_on_the_command_line():
    from nmt.inference.translator import Translator

    translator = Translator.load(str(SAVED), precision="32")
    with pytest.raises(ValueError, match=r"^decoding\.beam_size=100000: must be from 1 to 256$"):
        translator.translate(["a"], beam_size=100000)
    with pytest.raises(ValueError, match=r"^max_tokens=0: a positive whole number of source tokens a batch$"):
        Translator.load(str(SAVED), precision="32", max_tokens=0)


def test_a_server_limit_the_search_cannot_take_is_refused_at_start():
    """limits.max_beam_size=100000 let every client ask for the beam the issue's command line did."""
    from nmt.serve.app import check_limits

    with pytest.raises(ValueError, match=r"^limits\.max_beam_size=100000: at most 256 \(decoding\.beam_size's bound\)$"):
        check_limits(serve_cfg(SAVED, "limits.max_beam_size=100000").limits)
    with pytest.raises(ValueError, match=r"^limits\.max_sentences=0: a positive whole number$"):
        check_limits(serve_cfg(SAVED, "limits.max_sentences=0").limits)
