"""The per-head analysis (``nmt.evaluation.heads``): each statistic on hand-built attention, the
importance of a head whose output is zeroed is zero (Michel et al. 2019), and the table, its
markdown and figure for a saved Transformer."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from nmt.evaluation import heads
from nmt.specials import PAD
from tests.test_models import batch, build

SAVED = Path(__file__).parent / "data" / "saved" / "transformer.ckpt"


def shifted(T: int, offset: int) -> torch.Tensor:
    """(T, T) weights of a head putting all of query i's weight on key i + offset (clamped)."""
    w = torch.zeros(T, T)
    for i in range(T):
        w[i, min(max(i + offset, 0), T - 1)] = 1.0
    return w


def test_hand_built_heads_get_their_shares():
    """Head 0 reads the previous position, head 1 its own, head 2 the next, head 3 spreads evenly
    over the real keys; the second sentence has one padded position, which counts for nothing."""
    T = 4
    weights = torch.stack([shifted(T, -1), shifted(T, 0), shifted(T, 1), torch.full((T, T), 1 / T)])[None].repeat(2, 1, 1, 1)
    weights[1, 3] = torch.tensor([1 / 3, 1 / 3, 1 / 3, 0.0])  # the even head over the 3 real keys
    mask = torch.tensor([[True] * 4, [True, True, True, False]])
    rare = torch.tensor([[False, True, False, False], [False, True, False, False]])
    for b in (0, 1):  # the first query has no previous key (it reads itself), the last real one no next
        weights[b, 0, 0] = shifted(T, 0)[0]
    weights[1, 2, 2] = shifted(T, 0)[2]  # sentence 2's last real query: its own position, not the padding
    table = heads.HeadTable()
    table.add("encoder", 0, heads.head_sums(weights, mask, mask, rare, positional=True))
    rows = {r["head"]: r for r in table.rows()}
    queries = 4 + 3
    assert rows[0]["previous"] == pytest.approx((3 + 2) / queries, abs=1e-4)
    assert rows[1]["same"] == 1.0 and rows[1]["previous"] == 0.0 and rows[1]["next"] == 0.0
    assert rows[2]["next"] == pytest.approx((3 + 2) / queries, abs=1e-4)
    assert rows[1]["confidence"] == 1.0 and rows[1]["entropy"] == 0.0
    assert rows[3]["entropy"] == pytest.approx((4 * torch.log(torch.tensor(4.0)) + 3 * torch.log(torch.tensor(3.0))).item() / queries, abs=1e-4)
    assert rows[3]["rare"] == pytest.approx((4 / 4 + 3 / 3) / queries, abs=1e-4)
    assert rows[1]["rare"] == pytest.approx(2 / queries, abs=1e-4)  # the query at the rare key, in each sentence
    assert rows[0]["aer"] is None and rows[0]["importance"] is None


def test_a_head_reading_only_itself_on_a_single_token():
    w = torch.ones(1, 1, 1, 1)
    sums = heads.head_sums(w, torch.ones(1, 1, dtype=torch.bool), torch.ones(1, 1, dtype=torch.bool), None, True)
    assert (sums["same"], sums["previous"], sums["next"]) == (1.0, 0.0, 0.0)


def test_a_head_whose_output_is_zeroed_has_no_importance():
    model = build("transformer")
    size = model.encoder.layers[0].self_attn.head_size
    with torch.no_grad():
        model.encoder.layers[0].self_attn.out_proj.weight[:, size : 2 * size] = 0.0  # head 2 of layer 1
        model.decoder.layers[1].cross_attn.out_proj.weight[:, :size] = 0.0  # head 1 of layer 2
    src, src_mask, tgt_in = batch()
    tgt_out = torch.roll(tgt_in, -1, 1)
    tgt_out[:, -1] = PAD
    scores = heads.importance(model, [(src, src_mask, tgt_in, tgt_out)] * 2)
    assert scores["encoder"][0][1] == 0.0 and scores["cross"][1][0] == 0.0
    assert all(float(s) > 0 for kind, layers in scores.items() for i, layer in enumerate(layers) for h, s in enumerate(layer)
               if (kind, i, h) not in (("encoder", 0, 1), ("cross", 1, 0)))
    assert all(float(layer.norm()) == pytest.approx(1.0) for layers in scores.values() for layer in layers)
    assert all(p.grad is None for p in model.parameters())
    assert all(a.head_mask is None for layers in heads.attentions(model).values() for a in layers)


def test_the_table_of_a_saved_transformer(tmp_path):
    """Every head of the three kinds has every statistic that applies, AER against alignments
    given by hand, and the table is written as JSON, markdown and a figure."""
    from nmt.inference.translator import Translator

    translator = Translator.load(SAVED, device="cpu", precision="32")
    sources, refs = ["a b c", "b c"], ["a b c", "c b"]
    gold = [{(0, 0), (1, 1), (2, 2)}, {(0, 1), (1, 0)}]
    rows = heads.analyse(translator, sources, refs, gold)
    kinds = {(r["kind"], r["layer"], r["head"]) for r in rows}
    layers = heads.attentions(translator.model)
    assert kinds == {(k, i, h) for k, mods in layers.items() for i, m in enumerate(mods) for h in range(m.num_heads)}
    for r in rows:
        assert 0 < r["confidence"] <= 1 and r["entropy"] >= 0 and 0 <= r["rare"] <= 1 and r["importance"] >= 0
        assert (r["previous"] is None) == (r["kind"] == "cross") and (r["aer"] is None) == (r["kind"] != "cross")
        if r["kind"] == "decoder":
            assert r["next"] == 0.0
    paths = heads.write(rows, tmp_path, name="tiny")
    assert json.loads(paths["json"].read_text())["heads"] == rows
    assert paths["md"].read_text().count("\n") == len(rows) + 2 and paths["png"].stat().st_size > 0


def test_rare_pieces_are_the_lowest_scored_share():
    from nmt.inference.translator import Translator

    vocab = Translator.load(SAVED, device="cpu", precision="32").src_vocab
    rare = heads.rare_ids(vocab, 0.25)
    sp = vocab.sp
    scores = [sp.GetScore(i) for i in range(sp.GetPieceSize())]
    assert not rare[:4].any()  # PAD, UNK, BOS, EOS
    assert max(scores[i] for i in range(len(scores)) if rare[i]) <= min(
        scores[i] for i in range(4, len(scores)) if not rare[i] and not sp.IsControl(i))
    with pytest.raises(ValueError, match=r"^rare_share=0: a share of the vocabulary above 0 and at most 1$"):
        heads.rare_ids(vocab, 0)


def test_evaluate_writes_the_head_table_of_each_transformer(tmp_path, capsys):
    from tests.conftest import evaluate_here

    out = tmp_path / "eval"
    result = evaluate_here(capsys, out, f"ckpts={{tiny: {SAVED}}}", "heads=true", "head_analysis.pairs=6",
                           "head_analysis.figure=entropy", "decoding=greedy", "n_bootstrap=0", "significance.bootstrap=0",
                           "word_frequency=false", "reordering=false")
    assert result.returncode == 0, result.stderr
    rows = json.loads((out / "tiny" / "heads.json").read_text())["heads"]
    assert {r["kind"] for r in rows} == {"encoder", "decoder", "cross"} and (out / "tiny" / "heads.png").is_file()
    assert "tiny: attention heads -> " in result.stderr


@pytest.mark.parametrize("override, message", [
    ("head_analysis.figure=colour", "head_analysis.figure=colour: choose one of confidence, entropy, previous, same, next, "
                                    "rare, aer, importance"),
    ("head_analysis.pairs=0", "head_analysis.pairs=0: the number of pairs read, at least 1"),
])
def test_evaluate_refuses_bad_head_options_before_any_work(tmp_path, capsys, override, message):
    from tests.conftest import evaluate_here

    result = evaluate_here(capsys, tmp_path / "eval", f"ckpts=[{SAVED}]", "heads=true", override)
    assert result.returncode == 2 and result.stderr.strip() == f"error: {message}"


def test_self_attention_weights_are_those_the_model_reads():
    """The weights ``self_attention`` and ``attention_weights`` return: rows summing to 1 over the
    real keys, the decoder's causal; the cross-attention weights are ``cross_attention``'s."""
    model = build("transformer")
    src, src_mask, tgt_in = batch()
    with torch.no_grad():
        memory = model.encode(src, src_mask)
        encoder = model.encoder.self_attention(src, src_mask)
        decoder, cross = model.decoder.attention_weights(tgt_in, memory)
    for w in encoder:
        torch.testing.assert_close(w.sum(-1), torch.ones(w.shape[:-1]))
        assert (w * ~src_mask[:, None, None, :]).abs().max() == 0
    for w in decoder:
        assert torch.equal(w, w.tril()) and torch.allclose(w.sum(-1), torch.ones(w.shape[:-1]))
    assert [w.shape for w in cross] == [(3, 2, tgt_in.size(1), src.size(1))] * 2
    torch.testing.assert_close(torch.stack(cross, 1), model.cross_attention(src, src_mask, tgt_in))


def test_a_hybrid_has_the_table_of_its_transformer_side():
    """A Transformer encoder with an LSTM decoder: its encoder's heads alone."""
    from nmt.inference.translator import Translator

    saved = Translator.load(SAVED, device="cpu", precision="32")
    model = build("hybrid_transformer_luong", vocab=saved.src_vocab.vocab_size)
    translator = Translator(model, saved.src_vocab, saved.tgt_vocab, saved.run_config)
    rows = heads.analyse(translator, ["a b c", "b"], ["a b", "c b a"])
    assert {(r["kind"], r["layer"], r["head"]) for r in rows} == {("encoder", i, h) for i in range(2) for h in range(2)}
    assert all(r["importance"] is not None and r["previous"] is not None for r in rows)
