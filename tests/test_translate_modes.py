"""translate.py's modes on a trained tiny model: n-best lists, scoring given translations,
sampling, streamed output; one output line (or k) per input line in every mode."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from nmt.train import train
from tests.conftest import ROOT, TORCH_INIT, Finished, compose_train, translate_here

LINES = (ROOT / "tests/data/tiny/test.src").read_text().splitlines()[:12]
INPUT = LINES[:4] + ["", "   "] + LINES[4:] + [""]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> Path:
    tmp_path = tmp_path_factory.mktemp("modes")
    cfg = compose_train(tmp_path, ["trainer.max_epochs=3", "test=false", *TORCH_INIT], model="transformer")
    train(cfg)
    return Path(cfg.paths.output_dir) / "checkpoints" / "last.ckpt"


def translate(ckpt: Path, capsys, *overrides: str, ok: bool = True) -> Finished:
    """translate.py's run in this process (``tests.conftest.translate_here``), in fp32: the scores
    compared here to 1e-3 are fp32's (precision=auto picks bf16 on a CPU that has it)."""
    result = translate_here(capsys, f"ckpt={ckpt}", "precision=32", *overrides)
    assert (result.returncode == 0) == ok, result.stderr[-3000:]
    return result


def translate_command(ckpt: Path, cwd: Path, *overrides: str) -> subprocess.CompletedProcess:
    """translate.py in a process of its own, in ``cwd`` (where Hydra puts a run folder)."""
    result = subprocess.run([sys.executable, str(ROOT / "translate.py"), f"ckpt={ckpt}", *overrides],
                            capture_output=True, text=True, cwd=cwd, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    return result


@pytest.fixture
def src(tmp_path) -> Path:
    path = tmp_path / "in.txt"
    path.write_text("\n".join(INPUT) + "\n", encoding="utf-8")
    return path


def test_nbest_writes_k_ranked_rows_per_line_headed_by_the_one_best(ckpt, src, tmp_path, capsys):
    one = translate(ckpt, capsys, f"input={src}", "decoding.beam_size=3").stdout.split("\n")[:-1]
    rows = [r.split("\t") for r in translate(ckpt, capsys, f"input={src}", "decoding.beam_size=3",
                                             "decoding.nbest=3").stdout.split("\n")[:-1]]
    assert len(rows) == 3 * len(INPUT)
    assert [(int(r[0]), int(r[1])) for r in rows] == [(n, k) for n in range(1, len(INPUT) + 1) for k in (1, 2, 3)]
    assert [r[4] for r in rows if r[1] == "1"] == one
    for n, line in enumerate(INPUT, start=1):
        ranked = [r for r in rows if int(r[0]) == n]
        scores = [float(r[2]) for r in ranked]
        assert scores == sorted(scores, reverse=True)
        assert (not line.strip()) == all(r[4] == "" and float(r[3]) == 0.0 for r in ranked)
    as_json = [json.loads(r) for r in translate(ckpt, capsys, f"input={src}", "decoding.beam_size=3", "decoding.nbest=3",
                                                "format=jsonl").stdout.splitlines()]
    assert [(j["line"], j["rank"], j["text"]) for j in as_json] == [(int(r[0]), int(r[1]), r[4]) for r in rows]
    result = translate(ckpt, capsys, f"input={src}", "decoding.beam_size=3", "decoding.nbest=4", ok=False)
    assert "nbest=4: must be between 1 and the beam size (3)" in result.stderr


def test_the_score_of_the_models_own_greedy_output_is_the_score_greedy_reported(ckpt, src, tmp_path, capsys):
    greedy = [json.loads(r) for r in translate(ckpt, capsys, f"input={src}", "decoding=greedy",
                                               "format=jsonl").stdout.splitlines()]
    hyps = tmp_path / "hyps.txt"
    hyps.write_text("".join(g["text"] + "\n" for g in greedy), encoding="utf-8")
    scored = translate(ckpt, capsys, "mode=score", f"input={src}", f"target={hyps}").stdout.split("\n")[:-1]
    assert len(scored) == len(INPUT)
    for line, g, row in zip(INPUT, greedy, scored):
        if not line.strip():
            assert row == ""
            continue
        logprob, mean, tokens = row.split("\t")
        assert float(logprob) == pytest.approx(g["score"], abs=2e-3)
        assert float(mean) == pytest.approx(float(logprob) / int(tokens), abs=1e-3)
    # One TSV of pairs gives the same; per-token values add up to the sum.
    pairs = tmp_path / "pairs.tsv"
    pairs.write_text("".join(f"{s}\t{g['text']}\n" if s.strip() else "\n" for s, g in zip(INPUT, greedy)), encoding="utf-8")
    assert translate(ckpt, capsys, "mode=score", f"input={pairs}").stdout.split("\n")[:-1] == scored
    per_token = translate(ckpt, capsys, "mode=score", f"input={pairs}", "score_tokens=true", "format=jsonl").stdout
    for row in map(json.loads, per_token.splitlines()):
        if "logprob" in row:
            assert len(row["token_logprobs"]) == row["tokens"]
            assert sum(row["token_logprobs"]) == pytest.approx(row["logprob"], abs=2e-3)


def test_scoring_bad_input_names_the_file_and_line(ckpt, src, tmp_path, capsys):
    short = tmp_path / "short.txt"
    short.write_text("a\nb\n", encoding="utf-8")
    result = translate(ckpt, capsys, "mode=score", f"input={src}", f"target={short}", ok=False)
    assert f"{short} has 2 lines but {src} has more: give one target per source line" in result.stderr
    result = translate(ckpt, capsys, "mode=score", f"input={src}", ok=False)
    assert (f"{src}, line 1: expected 2 tab-separated columns (source<TAB>target), found 1; or give the targets "
            "in their own file with target=<file>") in result.stderr
    three = tmp_path / "three.tsv"
    three.write_text("a\tb\nc\td\te\n", encoding="utf-8")  # training refuses this row: so does scoring
    result = translate(ckpt, capsys, "mode=score", f"input={three}", ok=False)
    assert f"{three}, line 2: expected 2 tab-separated columns (source<TAB>target), found 3" in result.stderr
    broken = tmp_path / "broken.txt"
    broken.write_bytes(b"ok\tfine\nbad \xc3\x28\tutf8\n")
    result = translate(ckpt, capsys, "mode=score", f"input={broken}", ok=False)
    assert f"{broken}, line 2: invalid UTF-8" in result.stderr
    result = translate(ckpt, capsys, "mode=score", f"input={broken}", "errors=replace")
    assert len(result.stdout.split("\n")) == 3 and "replaced invalid UTF-8 on 1 line(s): [2]" in result.stderr


def test_sampling_repeats_with_its_seed_and_keeps_empty_lines(ckpt, src, tmp_path, capsys):
    first = translate(ckpt, capsys, f"input={src}", "decoding=sample", "decoding.seed=7").stdout
    assert translate(ckpt, capsys, f"input={src}", "decoding=sample", "decoding.seed=7").stdout == first
    out = first.split("\n")[:-1]
    assert len(out) == len(INPUT) and all((o == "") == (not i.strip()) for o, i in zip(out, INPUT))
    greedy = translate(ckpt, capsys, f"input={src}", "decoding=greedy").stdout
    assert translate(ckpt, capsys, f"input={src}", "decoding=sample", "decoding.temperature=0").stdout == greedy


def test_output_is_streamed_in_input_order_and_an_interrupted_run_keeps_its_finished_lines(ckpt, tmp_path, capsys):
    lines = (ROOT / "tests/data/tiny/train.src").read_text().splitlines()[:45]
    src = tmp_path / "long.txt"
    src.write_text("\n".join(lines) + "\n", encoding="utf-8")
    whole = translate(ckpt, capsys, f"input={src}", "decoding=greedy").stdout
    assert translate(ckpt, capsys, f"input={src}", "decoding=greedy", "chunk_lines=7").stdout == whole
    # A bad line 38 stops the run in the chunk of lines 36-42: the 35 lines before it are on disk.
    src.write_bytes("".join(line + "\n" for line in lines[:37]).encode() + b"bad \xc3\x28\n" + b"more\n" * 7)
    out = tmp_path / "out.txt"
    result = translate(ckpt, capsys, f"input={src}", f"output={out}", "decoding=greedy", "chunk_lines=7", ok=False)
    assert f"{src}, line 38: invalid UTF-8" in result.stderr
    assert out.read_text(encoding="utf-8") == "".join(line + "\n" for line in whole.split("\n")[:35])


@pytest.mark.slow  # end to end in processes of its own: the slow tier
def test_no_run_folder_unless_heatmaps_are_asked_for(ckpt, src, tmp_path):
    work = tmp_path / "work"
    work.mkdir()
    result = translate_command(ckpt, work, f"input={src}", "decoding=greedy", "progress=true", "attention_lines=[1]",
                               f"hydra.run.dir={tmp_path / 'run'}")  # heatmaps in the run folder given, nothing here
    assert list(work.iterdir()) == [] and "translating" in result.stderr
    assert [p.name for p in (tmp_path / "run").rglob("*") if p.is_file()] == ["line00002.png"]
    translate_command(ckpt, work, f"input={src}", "decoding=greedy", "attention_lines=[0]")
    (png,) = (work / "outputs" / "translate").glob("*/attention/line00001.png")
    assert [p for p in work.rglob("*") if p.is_file()] == [png]


@pytest.mark.parametrize("mode, rows_per_line", [(["decoding.beam_size=2", "decoding.nbest=2"], 2), (["decoding=sample"], 1)],
                         ids=["nbest", "sample"])
def test_invalid_utf8_is_reported_with_its_line_in_every_mode(ckpt, tmp_path, mode, rows_per_line, capsys):
    broken = tmp_path / "broken.txt"
    broken.write_bytes(b"a b\n\nbad \xc3\x28 utf8\nc d\n")
    result = translate(ckpt, capsys, f"input={broken}", *mode, ok=False)
    assert f"{broken}, line 3: invalid UTF-8" in result.stderr
    result = translate(ckpt, capsys, f"input={broken}", "errors=replace", *mode)
    assert len(result.stdout.split("\n")) - 1 == 4 * rows_per_line
    assert "replaced invalid UTF-8 on 1 line(s): [3]" in result.stderr


def test_captured_searches_stay_within_graph_cache_mb_and_translate_releases_them_at_its_end(ckpt, src, capsys,
                                                                                          monkeypatch):
    """engine=graphs with capture simulated: the run keeps its captured searches (within
    ``decoding.graph_cache_mb``, here 2: room for its one shape) until its end, where it releases
    them, and translates as the loop does."""
    from nmt.decoding import fixed_beam
    from tests.test_fixed_beam import simulate_capture

    loop = translate(ckpt, capsys, f"input={src}", "decoding.engine=loop").stdout
    captures = simulate_capture(monkeypatch)
    released, release = [], fixed_beam.release

    def spy(model):
        released.append((len(fixed_beam.kept_shapes(model)), fixed_beam.kept_bytes(model)))
        release(model)
        assert fixed_beam.kept_shapes(model) == []

    monkeypatch.setattr(fixed_beam, "release", spy)
    assert translate(ckpt, capsys, f"input={src}", "decoding.engine=graphs", "decoding.graph_cache_mb=2").stdout == loop
    assert len(released) == 1 and released[0][0] == 1 and 0 < released[0][1] <= 2 << 20 and captures
