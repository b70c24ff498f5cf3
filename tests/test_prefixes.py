"""Target prefixes (forced starts of the output) inside the one decoding path, for every model;
translate.py's prefixes= file and its one-line errors."""

from __future__ import annotations

import pytest
import torch

from nmt.data.tokenizer import PAD
from nmt.decoding.search import beam_search, greedy_search, sample_search, score_pairs
from tests.conftest import ROOT, compose_train, translate_here
from tests.test_models import VARIANTS, batch, build

PRESETS = ["lstm", "lstm_bahdanau", "lstm_luong", "transformer", "hybrid_lstm_transformer"]
SEARCHES = {"greedy": greedy_search, "beam": beam_search,
            "sample": lambda *a, **k: sample_search(*a, seed=3, **k)}


def padded(rows: list[list[int]]) -> torch.Tensor:
    out = torch.full((len(rows), max(map(len, rows))), PAD)
    for i, r in enumerate(rows):
        out[i, : len(r)] = torch.tensor(r)
    return out


@pytest.mark.parametrize("search", SEARCHES)
@pytest.mark.parametrize("name", PRESETS)
def test_every_output_starts_with_its_prefix_and_scores_the_models_log_probs(name, search):
    assert name in VARIANTS
    model = build(name)
    src, src_mask, _ = batch()
    prefixes = [[7, 8, 9], [], [11]]  # the middle sentence decodes freely
    hyps = SEARCHES[search](model, src, src_mask, prefix=padded(prefixes), max_len_b=8)
    for tokens, prefix in zip(hyps.tokens, prefixes):
        assert tokens[: len(prefix)] == prefix
    if search != "beam":  # beam scores are divided by the length penalty
        tgt = padded([[*t, 3] for t in hyps.tokens])
        forced = score_pairs(model, src, src_mask, tgt).sum(1)
        torch.testing.assert_close(hyps.scores, forced, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("name", PRESETS)
def test_the_start_of_greedys_own_output_as_prefix_changes_nothing(name):
    """(Beam search may end elsewhere: with its start forced, all its beams follow that start.)"""
    model = build(name)
    src, src_mask, _ = batch()
    free = greedy_search(model, src, src_mask, max_len_b=8)
    forced = greedy_search(model, src, src_mask, prefix=padded([t[:2] for t in free.tokens]), max_len_b=8)
    assert forced.tokens == free.tokens
    torch.testing.assert_close(forced.scores, free.scores)


@pytest.mark.parametrize("name", PRESETS)
def test_beam_one_with_a_prefix_is_greedy_with_it(name):
    model = build(name)
    src, src_mask, _ = batch()
    prefix = padded([[5, 6], [9], [12, 13, 14]])
    greedy = greedy_search(model, src, src_mask, prefix=prefix)
    beam = beam_search(model, src, src_mask, beam_size=1, alpha=0.0, prefix=prefix)
    assert beam.tokens == greedy.tokens
    torch.testing.assert_close(beam.scores, greedy.scores, atol=1e-5, rtol=1e-5)


def test_a_prefix_that_reaches_the_length_cap_is_refused():
    model = build("transformer")
    src, src_mask, _ = batch(lengths=(2, 2, 2))
    with pytest.raises(ValueError, match="a target prefix of 6 tokens for sentence 0 of the batch reaches its length cap of 4"):
        greedy_search(model, src[:, :2], src_mask[:, :2], max_len_a=1.0, max_len_b=2, prefix=padded([[5] * 6, [], []]))


LINES = (ROOT / "tests/data/tiny/test.src").read_text().splitlines()[:5]
REFS = (ROOT / "tests/data/tiny/test.tgt").read_text().splitlines()[:5]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    cfg = compose_train(tmp_path_factory.mktemp("prefix"), ["trainer.max_epochs=2", "test=false"])
    from nmt.train import train

    train(cfg)
    from pathlib import Path

    return Path(cfg.paths.output_dir) / "checkpoints" / "last.ckpt"


def test_translate_starts_each_line_with_its_prefix(ckpt, tmp_path, capsys):
    src, prefixes = tmp_path / "in.txt", tmp_path / "prefixes.txt"
    src.write_text("\n".join(LINES) + "\n")
    starts = [" ".join(r.split()[:2]) for r in REFS]
    prefixes.write_text("\n".join([starts[0], "", *starts[2:]]) + "\n")
    result = translate_here(capsys, f"ckpt={ckpt}", f"input={src}", f"prefixes={prefixes}", "decoding.beam_size=3")
    assert result.returncode == 0, result.stderr[-2000:]
    rows = result.stdout.splitlines()
    free = translate_here(capsys, f"ckpt={ckpt}", f"input={src}", "decoding.beam_size=3").stdout.splitlines()
    assert len(rows) == 5 and rows[1] == free[1]
    for row, start in zip(rows, starts):
        if start != starts[1]:
            assert row.startswith(start), (row, start)


@pytest.mark.parametrize("content, message", [
    ("a\nb\n", "prefixes={f}: 2 lines, but input={i} has 5"),
    ("\n\nda ÆØÅ\n\n\n", "prefixes={f}, line 3: 'da ÆØÅ' holds characters the target vocabulary lacks (they would be <unk>)"),
    ("\n" + " ".join(["fa"] * 400) + "\n\n\n\n", "prefixes={f}, line 2: "),
])
def test_bad_prefixes_are_one_line_naming_the_line_and_write_nothing(ckpt, tmp_path, capsys, content, message):
    assert_refused_before_output(ckpt, tmp_path, capsys, "prefixes", content, message, LINES)


def assert_refused_before_output(ckpt, tmp_path, capsys, key: str, content: str, message: str, lines: list[str]) -> None:
    """translate.py with ``key=<a file of content>`` fails with ``error: <message>`` (``{f}``: the
    file, ``{i}``: the input) as its last line, and an existing output file stays as it was."""
    src, guide, out = tmp_path / "in.txt", tmp_path / f"{key}.txt", tmp_path / "out.txt"
    src.write_text("\n".join(lines) + "\n")
    guide.write_text(content)
    out.write_text("kept\n")
    result = translate_here(capsys, f"ckpt={ckpt}", f"input={src}", f"{key}={guide}", f"output={out}")
    assert result.returncode == 2 and f"error: {message.format(f=guide, i=src)}" in result.stderr
    assert result.stderr.strip().splitlines()[-1].startswith("error: ") and out.read_text() == "kept\n"


def test_prefixes_need_an_input_file_and_the_translate_mode(ckpt, tmp_path, capsys):
    prefixes = tmp_path / "prefixes.txt"
    prefixes.write_text("a\n")
    result = translate_here(capsys, f"ckpt={ckpt}", f"prefixes={prefixes}")
    assert result.returncode == 2 and "give the input as a file (input=<file>)" in result.stderr
    result = translate_here(capsys, f"ckpt={ckpt}", f"prefixes={prefixes}", "mode=score", f"input={prefixes}",
                           f"target={prefixes}")
    assert result.returncode == 2 and result.stderr.strip().endswith(
        f"error: prefixes={prefixes}: prefixes and constraints steer mode=translate; mode=score scores the targets given")
