"""Ensembles (``nmt.models.ensemble``): the members' probabilities averaged at every step, through
every search; an ensemble of a model with itself decodes as the model alone; files that do not share
their tokenizers are refused in one line naming both."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from nmt.decoding.constrained import constrained_beam_search
from nmt.decoding.search import beam_search, greedy_search, score_pairs
from nmt.models.ensemble import Ensemble
from nmt.specials import BOS, EOS, PAD
from tests.test_fixed_beam import assert_same_search
from tests.conftest import ROOT, TORCH_INIT, compose_train, evaluate_here, serve_cfg, translate_here
from tests.test_models import VOCAB, batch, build

LENGTHS = (9, 2, 5, 3)


def other(name: str, seed: int) -> torch.nn.Module:
    """Model ``name`` with other random weights than ``build``'s."""
    model = build(name)
    torch.manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.3)
    return model


def reference_greedy(members, src, src_mask, steps: int) -> list[list[int]]:
    """Greedy decoding from the average of the members' probabilities, each member re-run over the
    whole prefix at every step (no state, no cache): the definition, computed another way."""
    out = torch.full((src.size(0), 1), BOS)
    done = torch.zeros(src.size(0), dtype=torch.bool)
    for _ in range(steps):
        probs = sum(torch.softmax(m(src, src_mask, out)[:, -1, :VOCAB].float(), -1) for m in members) / len(members)
        probs[:, PAD] = probs[:, BOS] = 0
        token = probs.argmax(-1).masked_fill(done, PAD)
        out = torch.cat([out, token[:, None]], 1)
        done |= token == EOS
    return [[t for t in row[1:] if t not in (PAD,)][: row[1:].index(EOS) if EOS in row[1:] else None]
            for row in out.tolist()]


@pytest.mark.parametrize("name", ["transformer", "lstm_luong", "lstm"])
def test_an_ensemble_of_a_model_with_itself_decodes_as_the_model(name):
    """Greedy, beam with 3-best lists and prefixes, the fixed-shape engine, constrained search and
    teacher-forced scores: the same tokens as the model alone, scores to 1e-5."""
    model = build(name)
    twice = Ensemble([model, model]).eval()
    src, src_mask, tgt_in = batch(lengths=LENGTHS)
    prefix = torch.tensor([[7, 8], [5, PAD], [PAD, PAD], [6, 6]])
    for search in (lambda m: greedy_search(m, src, src_mask, engine="loop"),
                   lambda m: beam_search(m, src, src_mask, beam_size=4, nbest=3, engine="loop"),
                   lambda m: beam_search(m, src, src_mask, beam_size=4, nbest=3, prefix=prefix, engine="loop"),
                   lambda m: beam_search(m, src, src_mask, beam_size=4, nbest=3, engine="graphs"),
                   lambda m: constrained_beam_search(m, src, src_mask, [[(9, 10)], [], [(11,)], [(12,), (13,)]],
                                                     beam_size=4)):
        assert_same_search(search(model), search(twice))
    tgt = torch.cat([tgt_in[:, 1:], torch.full((tgt_in.size(0), 1), EOS)], 1)
    torch.testing.assert_close(score_pairs(twice, src, src_mask, tgt), score_pairs(model, src, src_mask, tgt),
                               atol=1e-5, rtol=1e-5)


def test_a_step_is_the_log_of_the_members_mean_probability():
    """A Transformer with an LSTM+Luong: the step's log-probabilities are log(mean_m p_m), the
    teacher-forced pass gives the same, and greedy search picks what the averaged probabilities of
    members re-run over each whole prefix pick."""
    members = [build("transformer"), build("lstm_luong")]
    ensemble = Ensemble(members).eval()
    src, src_mask, tgt_in = batch(lengths=LENGTHS)
    with torch.no_grad():
        expected = torch.log(sum(torch.softmax(m(src, src_mask, tgt_in)[..., :VOCAB].float(), -1) for m in members) / 2)
        torch.testing.assert_close(ensemble(src, src_mask, tgt_in), expected, atol=1e-5, rtol=1e-5)
        memory = ensemble.encode(src, src_mask)
        state = ensemble.init_state(memory)
        for t in range(tgt_in.size(1)):
            step, state, _ = ensemble.decode_step(tgt_in[:, t], memory, state)
            torch.testing.assert_close(step, expected[:, t], atol=1e-5, rtol=1e-5)
    found = greedy_search(ensemble, src, src_mask, max_len_a=0, max_len_b=8, engine="loop")
    assert found.tokens == reference_greedy(members, src, src_mask, steps=7)  # the 8th token: EOS at the cap
    assert found.tokens != greedy_search(members[0], src, src_mask, max_len_a=0, max_len_b=8, engine="loop").tokens or \
        found.tokens != greedy_search(members[1], src, src_mask, max_len_a=0, max_len_b=8, engine="loop").tokens


@pytest.mark.parametrize("names", [("transformer", "transformer"), ("transformer", "lstm_luong"), ("lstm", "lstm_bahdanau")])
def test_the_fixed_shape_engines_decode_an_ensemble_as_the_loop(names):
    """Members of different architectures, each with its own memory and state in the fixed shapes:
    beam (3-best lists) and greedy search on ``graphs`` give the loop's hypotheses."""
    ensemble = Ensemble([build(names[0]), other(names[1], seed=1)]).eval()
    src, src_mask, _ = batch(lengths=LENGTHS)
    loop = beam_search(ensemble, src, src_mask, beam_size=4, nbest=3, engine="loop")
    assert_same_search(loop, beam_search(ensemble, src, src_mask, beam_size=4, nbest=3, engine="graphs"))
    assert_same_search(greedy_search(ensemble, src, src_mask, engine="loop"),
                       greedy_search(ensemble, src, src_mask, engine="graphs"))


def test_attention_is_the_mean_of_the_members_that_have_it():
    """Decoding's attention and the alignment attention: the mean over the members with attention
    (the plain LSTM has none); an ensemble without any has none."""
    luong, transformer, plain = build("lstm_luong"), build("transformer"), build("lstm")
    src, src_mask, tgt_in = batch(lengths=LENGTHS)
    with torch.no_grad():
        mixed = Ensemble([luong, transformer, plain]).eval()
        expected = (luong.alignment_attention(src, src_mask, tgt_in) + transformer.alignment_attention(src, src_mask, tgt_in)) / 2
        torch.testing.assert_close(mixed.alignment_attention(src, src_mask, tgt_in), expected)
        assert mixed.cross_attention(src, src_mask, tgt_in).shape == (len(LENGTHS), 1, 1, *expected.shape[1:])
        assert Ensemble([plain, plain]).alignment_attention(src, src_mask, tgt_in) is None
    hyps = beam_search(mixed, src, src_mask, beam_size=3, need_attn=True)
    assert [a.shape[0] for a in hyps.attn] == [len(t) + 1 for t in hyps.tokens]
    assert all(torch.allclose(a.sum(-1), torch.ones(a.size(0))) for a in hyps.attn)


def test_members_must_share_their_vocabulary_sizes():
    with pytest.raises(ValueError, match=r"^ensemble members differ in src_vocab_size: \[40, 48\]$"):
        Ensemble([build("transformer", vocab=40), build("transformer", vocab=48)])
    with pytest.raises(ValueError, match="^an ensemble needs at least two models, got 1$"):
        Ensemble([build("transformer")])


def test_the_ensemble_is_the_log_of_a_mean_not_a_mean_of_logs():
    """Two members, one sure and one unsure: the average is taken over probabilities."""
    ensemble = Ensemble([build("transformer"), build("transformer")])
    sure = torch.log(torch.tensor([[0.9, 0.1]]))
    unsure = torch.log(torch.tensor([[0.5, 0.5]]))
    averaged = ensemble._average([sure, unsure])
    torch.testing.assert_close(averaged.exp(), torch.tensor([[0.7, 0.3]]))
    assert not torch.allclose(averaged, (sure + unsure) / 2)
    assert math.isclose(float(averaged.exp().sum()), 1.0, rel_tol=1e-6)


# --- the commands -------------------------------------------------------------------------------

SAVED = ROOT / "tests" / "data" / "saved"
TRANSFORMER, LUONG = SAVED / "transformer.ckpt", SAVED / "lstm_luong.release.ckpt"  # one tokenizer, tiny models
LINES = (ROOT / "tests/data/tiny/test.src").read_text().splitlines()[:8]


@pytest.fixture
def src(tmp_path) -> Path:
    path = tmp_path / "in.txt"
    path.write_text("\n".join(LINES) + "\n")
    return path


def test_translate_and_evaluate_take_a_list_of_files_as_one_model(src, tmp_path, capsys):
    """translate.py ``ckpt=[a,a]`` writes what ``ckpt=a`` writes, and ``ckpt=[a,b]`` (a Transformer
    checkpoint with an LSTM+Luong release file) n-best lists with word alignments for every line;
    evaluate.py scores an ensemble as a system of its own, with each system's translation time."""
    a, b = TRANSFORMER, LUONG
    alone = translate_here(capsys, f"ckpt={a}", f"input={src}", "precision=32")
    assert alone.returncode == 0, alone.stderr[-2000:]
    twice = translate_here(capsys, f"ckpt=[{a},{a}]", f"input={src}", "precision=32")
    assert twice.returncode == 0, twice.stderr[-2000:]
    assert twice.stdout == alone.stdout
    both = translate_here(capsys, f"ckpt=[{a},{b}]", f"input={src}", "precision=32", "decoding.nbest=2",
                          "decoding.alignments=true")
    assert both.returncode == 0, both.stderr[-2000:]
    rows = [line.split("\t") for line in both.stdout.splitlines()]
    assert [(int(r[0]), int(r[1])) for r in rows] == [(n, k) for n in range(1, len(LINES) + 1) for k in (1, 2)]
    assert all(r[-1] for r in rows)  # an alignment for every hypothesis
    done = evaluate_here(capsys, tmp_path / "eval", f"ckpts={{transformer: {a}, luong: {b}, both: [{a}, {b}]}}",
                         "precision=32", "n_bootstrap=20", "significance.bootstrap=20", "significance.randomization=20",
                         "word_frequency=false", "reordering=false")
    assert done.returncode == 0, done.stderr[-2000:]
    compared = (tmp_path / "eval" / "comparison.md").read_text()
    assert "| both |" in compared and "Translation time:" in compared
    assert len((tmp_path / "eval" / "both.hyp.txt").read_text().splitlines()) == 20  # the test split


def test_bad_ensembles_are_refused_in_one_line(src, tmp_path, capsys):
    a = TRANSFORMER
    expected = {
        f"ckpt=[{a},{tmp_path / 'none.ckpt'}]": f"error: ckpt[1]={tmp_path / 'none.ckpt'}: No such file or directory",
        f"ckpt=[{','.join([str(a)] * 17)}]":
            "error: an ensemble of 17 files: at most 16 models decode as one (each step runs every member's decoder)",
        "ckpt=[]": "error: ckpt=[]: give a checkpoint or release file, or a list of them (an ensemble)",
    }
    for override, message in expected.items():
        refused = translate_here(capsys, override, f"input={src}")
        assert refused.returncode == 2
        assert refused.stderr.strip().splitlines()[-1] == message
    folder = translate_here(capsys, f"ckpt=[{a},{a}]", "backend=ctranslate2", f"input={src}")
    assert folder.stderr.strip().splitlines()[-1] == (
        f"error: ckpt=['{a}', '{a}']: an ensemble decodes with the torch backend; give checkpoint or release files, "
        "not CTranslate2 folders")


def test_the_server_serves_an_ensemble():
    """nmt-serve for ``ckpt=[a,b]``: /info names both members' parts, and it translates."""
    from fastapi.testclient import TestClient

    from nmt.serve.app import create_app, load

    cfg = serve_cfg(TRANSFORMER, "batching.process=false")
    cfg.ckpt = [str(TRANSFORMER), str(LUONG)]
    with TestClient(create_app(load(cfg), cfg)) as client:
        info = client.get("/info").json()
        assert info["members"] == 2
        assert info["preset"] == {"encoder": "TransformerEncoder + RNNEncoder", "decoder": "TransformerDecoder + RNNDecoder"}
        answer = client.post("/translate", json={"text": LINES[:2]})
        assert answer.status_code == 200, answer.text


@pytest.mark.slow  # a model with another tokenizer is trained first
def test_files_that_do_not_share_their_tokenizers_are_refused_naming_both(src, tmp_path, capsys):
    from nmt.train import train

    cfg = compose_train(tmp_path, ["trainer.max_epochs=1", "test=false", "data.tokenizer.vocab_size=60", *TORCH_INIT],
                        model="transformer")
    train(cfg)
    other = Path(cfg.paths.output_dir) / "checkpoints" / "last.ckpt"
    refused = translate_here(capsys, f"ckpt=[{TRANSFORMER},{other}]", f"input={src}")
    assert refused.returncode == 2
    assert refused.stderr.strip().splitlines()[-1] == (
        f"error: {TRANSFORMER} and {other} have different source vocabularies: the models of an ensemble must share "
        "their tokenizers (train them on the same data and tokenizer settings, or fine-tune one from the other)")
