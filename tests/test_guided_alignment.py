"""Guided alignment: word alignments read and checked (``nmt.data.alignments``), lifted to subwords,
batched; the loss (``nmt.training.guided_alignment``) at and away from its minimum; the decoder's
one-layer attention equal to the full pass's; training with it, and (slow) its lower alignment
error rate than unguided training at the same steps."""

from __future__ import annotations

import math
import re
from pathlib import Path

import numpy as np
import pytest
import torch

from nmt.data.alignments import (AlignedSplit, WordLinks, collate_aligned, prepare_alignments, subword_links,
                                 words_of_pieces)
from nmt.data.aligners import grow_diag_final_and
from nmt.data.sources import DataError
from nmt.data.synthetic import gold_alignment
from nmt.data.tokenizer import PAD
from nmt.models.base import Seq2Seq
from nmt.models.transformer import TransformerDecoder, TransformerEncoder
from nmt.train import train
from nmt.training.guided_alignment import GuidedAlignment, alignment_targets, check_guided_alignment, guided_alignment_loss
from tests.conftest import ROOT, compose_train

TINY = ROOT / "tests" / "data" / "tiny"


class Pairs:
    """A source of fixed training pairs (what ``prepare_alignments`` streams)."""

    def __init__(self, pairs: list[tuple[str, str]]) -> None:
        self.data = pairs

    def describe(self) -> dict:
        return {"type": "test"}

    def pairs(self, split: str, chunk: int = 0):
        yield [s for s, _ in self.data], [t for _, t in self.data]


PAIRS = [("a b c", "x y"), ("d e", "z w"), ("f", "v")]


def links_of(tmp_path: Path, lines: list[str], pairs: list[tuple[str, str]] = PAIRS) -> WordLinks:
    path = tmp_path / "train.align"
    path.write_text("".join(line + "\n" for line in lines))
    (tmp_path / "prepared").mkdir(exist_ok=True)
    return WordLinks(prepare_alignments(str(path), Pairs(pairs), tmp_path / "prepared"))


# -- reading -------------------------------------------------------------------------------
def test_a_pharaoh_file_is_stored_by_prepared_pair_and_empty_pairs_are_dropped_with_their_line(tmp_path):
    pairs = [("a b c", "x y"), ("  ", "lost"), ("d e", "z w"), ("f", "v")]
    links = links_of(tmp_path, ["0-0 2-1 1-1", "9-9 (not read: the pair is dropped)", "1-0 0p1", ""], pairs)
    assert len(links) == 3
    assert links[0].tolist() == [[0, 0], [1, 1], [2, 1]]
    assert links[1].tolist() == [[0, 1], [1, 0]]
    assert links[2].tolist() == []


@pytest.mark.parametrize("lines, message", [
    (["0-0", "0-0 2-1", "0-0"], "train.align:2: link '2-1' is out of range: the pair has 2 source and 2 target words "
                                "(indices from 0)"),
    (["0-0", "0-0", "0-1"], "train.align:3: link '0-1' is out of range: the pair has 1 source and 1 target words "
                            "(indices from 0)"),
    (["0-0", "0-0 a-1", "0-0"], "train.align:2: 'a-1' is not a link 'source-target' of two word indices from 0"),
    (["0-0 1:1", "0-0", "0-0"], "train.align:1: '1:1' is not a link 'source-target' of two word indices from 0"),
    (["0-0 -1-0", "0-0", "0-0"], "train.align:1: '-1-0' is not a link 'source-target' of two word indices from 0"),
    (["0-0", "0-0"], "train.align: 2 lines for 3 training pairs; line i must align training pair i"),
    (["0-0", "0-0", "0-0", "", ""], "train.align: 5 lines for 3 training pairs; line i must align training pair i"),
])
def test_a_bad_alignment_file_gets_one_line_naming_its_file_and_line(tmp_path, lines, message):
    with pytest.raises(DataError) as error:
        links_of(tmp_path, lines)
    assert str(error.value) == f"{tmp_path / message}" and "\n" not in str(error.value)
    assert not list((tmp_path / "prepared" / "alignments").glob("[!.]*"))  # nothing half-written is kept


def test_a_missing_file_or_a_multilingual_source_is_refused_in_one_line(tmp_path):
    with pytest.raises(DataError, match=re.escape("data.alignments=/no/such.align: no such file; give a Pharaoh file "
                                                  "aligning the training split line by line, or one of: eflomal")):
        prepare_alignments("/no/such.align", Pairs(PAIRS), tmp_path)
    tagged = Pairs(PAIRS)
    tagged.tags = ["<2de>"]
    with pytest.raises(DataError, match="guided alignment takes a source of one direction"):
        prepare_alignments("/no/such.align", tagged, tmp_path)


def test_grow_diag_final_and_keeps_the_intersection_and_grows_to_neighbours():
    forward, reverse = {(0, 0), (1, 1), (2, 1), (3, 4)}, {(0, 0), (1, 1), (3, 3)}
    # (2,1) neighbours (1,1) and aligns source word 2: it grows in. (3,3) and (3,4) neighbour no link: final-and
    # adds the first whose two words are unaligned, (3,3), and then (3,4)'s source word is aligned.
    assert grow_diag_final_and(forward, reverse) == {(0, 0), (1, 1), (2, 1), (3, 3)}
    assert grow_diag_final_and({(0, 0)}, {(0, 0)}) == {(0, 0)}


# -- lifting to subwords -----------------------------------------------------------------------
def test_words_of_pieces_start_a_word_at_each_word_mark_and_at_the_first_piece():
    starts = np.array([False, False, False, False, True, False, True])  # ids 4 and 6 begin with "▁"
    assert words_of_pieces(np.array([4, 5, 5, 6, 4, 5]), starts).tolist() == [0, 0, 0, 1, 2, 2]
    assert words_of_pieces(np.array([5, 4]), starts).tolist() == [0, 1]  # a first piece without the mark
    assert words_of_pieces(np.array([], dtype=np.int64), starts).tolist() == []


def test_each_target_subword_is_linked_to_every_subword_of_its_words_source_words():
    # source "▁un believ able ▁news" (words 0 0 0 1), target "▁incroy able ▁nouvelle s" (words 0 0 1 1)
    src_words, tgt_words = np.array([0, 0, 0, 1]), np.array([0, 0, 1, 1])
    links = np.array([[0, 0], [1, 1]])  # un-believ-able -> incroy-able, news -> nouvelle-s
    expected = [[0, 0], [0, 1], [0, 2], [1, 0], [1, 1], [1, 2], [2, 3], [3, 3]]
    assert subword_links(src_words, tgt_words, links).tolist() == expected
    # a target word linked to two source words, one unlinked target word, a link past a truncated side
    lifted = subword_links(np.array([0, 1, 1]), np.array([0, 1, 2]), np.array([[0, 0], [1, 0], [1, 2], [5, 1], [0, 7]]))
    assert lifted.tolist() == [[0, 0], [0, 1], [0, 2], [2, 1], [2, 2]]
    assert subword_links(src_words, tgt_words, np.zeros((0, 2), np.int64)).shape == (0, 2)


def test_a_batch_carries_the_links_at_the_positions_of_its_padded_rows(tmp_path):
    from types import SimpleNamespace

    from nmt.data.batching import TokenizedSplit

    pieces = ["<pad>", "<unk>", "<s>", "</s>", "\u2581a", "b", "\u2581c"]
    vocab = SimpleNamespace(sp=SimpleNamespace(id_to_piece=pieces.__getitem__), vocab_size=len(pieces))
    # pair 0: "▁a b ▁c" -> "▁c ▁a" (words "ab c" -> "c a"); pair 1: "▁c" -> "▁a b" ("c" -> "ab")
    split = TokenizedSplit((np.array([4, 5, 6, 6]), np.array([0, 3, 4])), (np.array([6, 4, 4, 5]), np.array([0, 2, 4])))
    words = links_of(tmp_path, ["0-1 1-0", "0-0"], [("ab c", "c a"), ("c", "ab")])
    aligned = AlignedSplit(split, words, (vocab, vocab))
    batch = collate_aligned(aligned.__getitems__([0, 1]))
    assert batch["align"].tolist() == [[0, 0, 2], [0, 1, 0], [0, 1, 1], [1, 0, 0], [1, 1, 0]]
    rows, t, s = batch["align"].T
    assert (batch["tgt_out"][rows, t] != PAD).all() and batch["src_mask"][rows, s].all()


# -- the loss ----------------------------------------------------------------------------------
LINKS = torch.tensor([[0, 0, 1], [0, 0, 2], [0, 1, 0], [1, 2, 3]])  # (row, target position, source position)


def test_the_loss_is_minimal_with_zero_gradient_where_the_attention_is_the_alignment_distribution():
    p = alignment_targets(LINKS, (2, 3, 4))
    assert p[0, 0].tolist() == [0, 0.5, 0.5, 0] and p[0, 2].sum() == 0  # an unlinked target position
    scores = torch.where(p > 0, p.clamp(min=1e-30).log(), torch.full_like(p, -40.0)).requires_grad_()
    loss = guided_alignment_loss(scores.softmax(-1), LINKS)
    loss.backward()
    assert loss.item() == pytest.approx(math.log(2) / 3, abs=1e-6)  # the entropy of p, over 3 linked positions
    assert scores.grad.abs().max() < 1e-6
    torch.manual_seed(0)
    for _ in range(5):  # any other attention costs more, and has a gradient
        other = (scores.detach() + torch.randn(2, 3, 4)).requires_grad_()
        worse = guided_alignment_loss(other.softmax(-1), LINKS)
        worse.backward()
        assert worse.item() > loss.item() + 1e-3 and other.grad.abs().max() > 1e-3


def test_unlinked_target_positions_are_skipped():
    torch.manual_seed(1)
    attn = torch.randn(2, 3, 4).softmax(-1)
    changed = attn.clone()
    changed[0, 2] = torch.tensor([1.0, 0, 0, 0])  # (0, 2), (1, 0), (1, 1) have no link
    changed[1, :2] = 0.25
    assert guided_alignment_loss(changed, LINKS).item() == pytest.approx(guided_alignment_loss(attn, LINKS).item())
    assert guided_alignment_loss(attn, torch.zeros(0, 3, dtype=torch.long)).item() == 0.0


def tiny_transformer(layers: int = 2, heads: int = 2) -> Seq2Seq:
    torch.manual_seed(0)
    encoder = TransformerEncoder(20, hidden_size=16, num_layers=layers, num_heads=heads, ff_size=32, dropout=0.0)
    decoder = TransformerDecoder(20, hidden_size=16, num_layers=layers, num_heads=heads, ff_size=32, dropout=0.0)
    return Seq2Seq(encoder, decoder, 20, 20, 16)


@pytest.mark.parametrize("layer", [0, 1, -1])
def test_the_decoder_gives_one_layers_attention_from_the_same_pass(layer):
    model = tiny_transformer().train()
    src = torch.tensor([[5, 6, 7, 3], [8, 9, 3, PAD]])
    tgt_in = torch.tensor([[2, 5, 6], [2, 7, PAD]])
    hidden, weights = model.features_with_attention(src, src != PAD, tgt_in, layer)
    assert torch.allclose(hidden, model.features(src, src != PAD, tgt_in), atol=1e-6)
    assert torch.allclose(weights, model.cross_attention(src, src != PAD, tgt_in)[:, layer], atol=1e-6)
    assert weights.shape == (2, 2, 3, 4) and (weights[1, :, :, 3] == 0).all()  # padding gets no weight
    guided = GuidedAlignment(weight=1.0, layer=layer, head="mean")
    loss = guided_alignment_loss(guided.attention(weights), torch.tensor([[0, 0, 0], [1, 1, 1]]))
    loss.backward()  # the weights carry the gradient to the model
    assert model.decoder.layers[layer].cross_attn.q_proj.weight.grad.abs().sum() > 0


# -- the options -------------------------------------------------------------------------------
@pytest.mark.parametrize("model, overrides, message", [
    ("lstm_bahdanau", ["data.alignments=x.align"], "module.guided_alignment.weight=0.1: guided alignment trains a "
                                                    "Transformer decoder's cross-attention; model.decoder is RNNDecoder"),
    ("lstm", ["data.alignments=x.align"], "module.guided_alignment.weight=0.1: guided alignment trains a Transformer "
                                          "decoder's cross-attention; model.decoder is RNNDecoder"),
    ("transformer", [], "module.guided_alignment.weight=0.1 needs word alignments of the training pairs: set "
                        "data.alignments to a Pharaoh file or eflomal"),
    ("transformer", ["data.alignments=x.align", "module.guided_alignment.layer=2"],
     "module.guided_alignment.layer=2: the decoder has 2 layers (-2 to 1)"),
    ("transformer", ["data.alignments=x.align", "module.guided_alignment.head=4"],
     "module.guided_alignment.head=4: the decoder has 2 heads (0 to 1), or mean"),
    ("transformer", ["data.alignments=x.align", "module.guided_alignment.head=first"],
     "module.guided_alignment.head='first': a head index from 0, or mean"),
])
def test_a_run_that_cannot_be_guided_stops_before_its_data_with_one_line(tmp_path, model, overrides, message):
    cfg = compose_train(tmp_path, ["module.guided_alignment.weight=0.1", *overrides], model=model)
    with pytest.raises(ValueError) as error:
        check_guided_alignment(cfg)
    assert str(error.value) == message
    with pytest.raises(ValueError, match=re.escape(message)):
        train(cfg)


def test_the_module_refuses_a_decoder_without_multi_head_cross_attention():
    from nmt.models.rnn import RNNDecoder, RNNEncoder
    from nmt.training.lit_module import TranslationModule

    model = Seq2Seq(RNNEncoder(20, 8, 8, 1), RNNDecoder(20, 8, 8, 1, attention=None), 20, 20, 8)
    with pytest.raises(ValueError, match="model.decoder is a decoder without attention \\(RNNDecoder\\)"):
        TranslationModule(model, optimizer=torch.optim.Adam, guided_alignment={"weight": 1.0})
    TranslationModule(model, optimizer=torch.optim.Adam, guided_alignment={"weight": 0.0})  # off: any model


# -- training ------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_gold(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("align") / "train.align"
    path.write_text("".join(gold_alignment(s) + "\n" for s in (TINY / "train.src").read_text().splitlines()))
    return path


def test_guided_training_logs_the_alignment_loss_of_every_step(tmp_path, tiny_gold):
    cfg = compose_train(tmp_path, [f"data.alignments={tiny_gold}", "module.guided_alignment.weight=1.0", "test=false"],
                        model="transformer")
    metrics = train(cfg)
    rows = [line.split(",") for line in next(Path(cfg.paths.output_dir).rglob("metrics.csv")).read_text().splitlines()]
    column = rows[0].index("train/align_loss")
    losses = [float(r[column]) for r in rows[1:] if r[column]]
    assert len(losses) == 5 and all(0 < x < 10 for x in losses) and "train/align_loss" in metrics


def test_the_alignment_loss_alone_pulls_the_attention_to_the_links():
    model = tiny_transformer().train()
    src = torch.tensor([[5, 6, 7, 8, 3], [9, 10, 11, 3, PAD]])
    tgt_in = torch.tensor([[2, 12, 13, 14], [2, 15, 16, PAD]])
    links = torch.tensor([[0, 0, 3], [0, 1, 2], [0, 2, 1], [0, 3, 0], [1, 0, 2], [1, 1, 0], [1, 2, 1]])
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    guided = GuidedAlignment(weight=1.0, layer=-1, head=1)
    losses = []
    for _ in range(40):
        optimizer.zero_grad()
        _, weights = model.features_with_attention(src, src != PAD, tgt_in, guided.layer)
        loss = guided_alignment_loss(guided.attention(weights), links)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert losses[0] > 1.0 and losses[-1] < 0.2  # from about uniform attention (log 4-5) to the links
    attn = guided.attention(model.cross_attention(src, src != PAD, tgt_in)[:, -1].detach())
    assert (attn[links[:, 0], links[:, 1]].argmax(-1) == links[:, 2]).all()


@pytest.mark.slow
def test_guided_training_aligns_better_than_unguided_training_at_the_same_steps(tmp_path):
    """A small Transformer on 3,000 synthetic pairs, 600 steps with and without guidance by the gold
    alignments: the guided model's last layer aligns the valid split with a lower error rate."""
    from nmt.data.sources import SyntheticSource
    from nmt.inference.alignments import aer, parse, pharaoh
    from nmt.training.builders import build_datamodule

    source = dict(num_pairs=3000, valid_pairs=200, test_pairs=10, seed=5, max_len=20)
    gold = tmp_path / "train.align"
    with open(gold, "w") as f:
        for sources, _ in SyntheticSource(**source).pairs("train"):
            f.writelines(gold_alignment(s) + "\n" for s in sources)
    common = ["data=synthetic", *[f"data.source.{k}={v}" for k, v in source.items()], f"data.alignments={gold}",
              "data.tokenizer.vocab_size=400", "model.hidden_size=64", "model.decoder.ff_size=128",
              "model.encoder.ff_size=128", "trainer.max_epochs=-1", "trainer.max_steps=600",
              "trainer.val_check_interval=600", "trainer.check_val_every_n_epoch=null", "data.max_tokens=1024", "test=false", "optimizer.lr=0.003"]
    error = {}
    for weight in (0.0, 1.0):
        cfg = compose_train(tmp_path / f"w{weight}", [*common, f"module.guided_alignment.weight={weight}"],
                            model="transformer")
        train(cfg)
        from nmt.inference.translator import Translator, encode_sources, pad

        translator = Translator.load(Path(cfg.paths.output_dir) / "checkpoints" / "last.ckpt", device="cpu", precision="32")
        dm = build_datamodule(cfg.data)
        sources, refs = dm.raw("valid")
        src_ids = encode_sources(sources, translator.src_vocab, translator.max_src_len)
        tgt_ids = [ids[:-1] for ids in encode_sources(refs, translator.tgt_vocab, translator.max_tgt_len)]
        hyps = translator.alignments(src_ids, tgt_ids)
        error[weight] = aer([parse(h) for h in hyps], [parse(gold_alignment(s)) for s in sources])
    assert error[1.0] < error[0.0] - 0.05, error


def test_alignments_are_lifted_onto_the_sampled_segmentation(tmp_path, tiny_gold):
    """Subword regularization with guided alignment: each item's links are lifted from the pieces
    it was sampled into (``AlignedSplit`` over ``SampledSplit``), within its lengths, and training
    logs the alignment loss."""
    from nmt.data.subword_sampling import SampledSplit

    cfg = compose_train(tmp_path, [f"data.alignments={tiny_gold}", "module.guided_alignment.weight=1.0", "test=false",
                                   "subword_sampling=sample"], model="transformer")
    metrics = train(cfg)
    assert "train/align_loss" in metrics
    from nmt.training.builders import build_datamodule

    datamodule = build_datamodule(cfg.data)
    datamodule.prepare_data()
    datamodule.setup("fit")
    items = datamodule._train_items
    assert isinstance(items, AlignedSplit) and isinstance(items.base, SampledSplit)
    for i, src, tgt, links in items.__getitems__(list(range(20))):
        assert len(links) and (links[:, 0] < len(tgt)).all() and (links[:, 1] < len(src)).all()
