"""Subword regularization (nmt.data.subword_sampling): a sample per (seed, epoch, pair, side),
sampling off or sharpened to the best is the stored segmentation, batches within their token
budget, the same pieces through DataLoader workers and after a mid-epoch resume, and one-line
errors for keys of the other model type."""

from __future__ import annotations

import re

import numpy as np
import pytest
import pytorch_lightning as L
import torch
from pytorch_lightning.callbacks import ModelCheckpoint

from nmt.data.batching import Batch, collate
from nmt.data.subword_sampling import SampledSplit, SubwordSampling, model_type
from nmt.checkpoints.files import saved_vocabularies
from nmt.data.datamodule import TranslationDataModule
from nmt.data.sources import FileSource
from nmt.train import train
from tests.test_datamodule import TINY, TOKENIZER, Recorder, _trainer

BPE = {**TOKENIZER, "model_type": "bpe"}
SENTENCE = "te kanotu putu biduti ko mekatu netu do monota tades digima kakebo"


def tiny(cache_dir, tokenizer=None, **kwargs) -> TranslationDataModule:
    """The data module on tests/data/tiny (``tests.test_datamodule.tiny``), of any tokenizer."""
    options = {"max_tokens": 512, "cache_dir": str(cache_dir), "vocab_loader": saved_vocabularies} | kwargs
    return TranslationDataModule(FileSource(str(TINY), "src", "tgt"), tokenizer or TOKENIZER, "src", "tgt", **options)


@pytest.fixture(scope="module")
def sampled(tmp_path_factory):
    dm = tiny(tmp_path_factory.mktemp("cache"), subword_sampling={"enabled": True}, max_tokens=160)
    dm.setup()
    return dm


def test_a_sentence_sample_depends_on_seed_epoch_pair_and_side_only(sampled):
    sampling, vocab = sampled.subword_sampling, sampled.src_vocab
    draws = {(e, p, s): tuple(sampling.sample(vocab, SENTENCE, e, p, s)) for e in range(4) for p in range(3) for s in (0, 1)}
    again = SubwordSampling(**{**sampling.__dict__})  # another process: the same draws, in another order
    assert all(tuple(again.sample(vocab, SENTENCE, *k)) == draws[k] for k in reversed(list(draws)))
    assert len({draws[(e, 0, 0)] for e in range(4)}) > 1 and len(set(draws.values())) > 8  # epochs, pairs differ
    assert all(vocab.sp.decode(list(ids)) == SENTENCE for ids in draws.values())
    other_seed = SubwordSampling(**{**sampling.__dict__, "seed": 1})
    assert [tuple(other_seed.sample(vocab, SENTENCE, e, 0, 0)) for e in range(4)] != [draws[(e, 0, 0)] for e in range(4)]


@pytest.mark.parametrize("options, tokenizer", [({"alpha": 1000.0, "nbest_size": 2}, None),
                                                ({"dropout": 1e-9}, BPE)])
def test_sampling_sharpened_to_the_best_trains_on_the_stored_segmentation(tmp_path, options, tokenizer):
    """Unigram sampling with alpha -> infinity and BPE-dropout with p -> 0 are the deterministic
    segmentation: the sampled path gives the stored ids, batch for batch."""
    plain = tiny(tmp_path / "a", tokenizer)
    dm = tiny(tmp_path / "b", tokenizer, subword_sampling={"enabled": True, "length_margin": 0.0, **options})
    plain.setup(), dm.setup()
    assert isinstance(dm._train_items, SampledSplit) and dm.subword_sampling.kind == model_type(dm.src_vocab)
    assert model_type(dm.src_vocab) == ("bpe" if tokenizer else "unigram")
    for epoch in (0, 1):
        dm._train_sampler.set_epoch(epoch), plain._train_sampler.set_epoch(epoch)
        mine, stored = list(dm._train_sampler), list(plain._train_sampler)
        assert mine == stored and all(b.epoch == epoch for b in mine)
        for ids in mine:
            for a, b in zip(dm._train_items.__getitems__(ids), plain.datasets["train"].__getitems__(ids)):
                assert a[0] == b[0] and a[1].tolist() == b[1].tolist() and a[2].tolist() == b[2].tolist()
    assert dm._train_items.sampled > 0 and dm._train_items.fallbacks == 0


def test_sampling_off_is_the_stored_segmentation(tmp_path):
    off = tiny(tmp_path, subword_sampling={"enabled": False, "alpha": 0.5})
    off.setup()
    assert off.subword_sampling is None and off._train_items is off.datasets["train"]
    batch = next(iter(off.train_dataloader()))
    src = off.raw("train")[0]
    assert [off.src_vocab.decode(row) for row in batch["src"]] == [src[i] for i in batch["ids"].tolist()]


def test_epochs_sample_other_segmentations_within_the_token_budget(sampled):
    items, sampler = sampled._train_items, sampled._train_sampler
    src, tgt = sampled.raw("train")
    stored = sampled.datasets["train"]
    seen: dict[int, list] = {}
    for epoch in (0, 1):
        sampler.set_epoch(epoch)
        pairs = set()
        for ids in sampler:
            batch = items.__getitems__(ids)
            width = max(max(len(s), len(t)) + 1 for _, s, t in batch)
            assert len(batch) * width <= 160 or len(batch) == 1  # padded tokens a side
            for i, s, t in batch:
                pairs.add(i)
                assert sampled.src_vocab.sp.decode(s.tolist()) == src[i] and sampled.tgt_vocab.sp.decode(t.tolist()) == tgt[i]
                seen.setdefault(i, []).append(s.tolist())
        assert pairs == set(range(len(items)))
    changed = sum(a != b for a, b in seen.values())
    differ = sum(seen[i][0] != stored[i][1].tolist() for i in seen)
    assert changed > 50 and differ > 50  # 100 pairs: most are segmented otherwise in epoch 1, and than stored
    assert items.sampled == 400 and items.fallbacks < 40


def test_planned_lengths_stretch_each_side_within_its_limit():
    sampling = SubwordSampling("unigram", 0.1, 64, 0.2, 0)
    planned = sampling.planned(np.array([[11, 6], [1, 101], [201, 3]]), (200, 100))
    assert planned.tolist() == [[13, 7], [1, 101], [201, 4]]  # ceil(10 * 1.2) + 1, ceil(5 * 1.2) + 1, limits kept


def test_dataloader_workers_and_a_batch_rebuilt_elsewhere_give_the_same_pieces(tmp_path):
    dm = tiny(tmp_path, subword_sampling={"enabled": True}, num_workers=2, max_tokens=160)
    dm.setup()
    loaded = list(dm.train_dataloader())  # epoch 0, through two worker processes
    sampler = dm._train_sampler.replica(1, 0)
    sampler.set_epoch(0)
    here = [collate(dm._train_items.__getitems__(Batch(list(ids), 0))) for ids in reversed(list(sampler))]
    assert len(loaded) == len(here)
    for a, b in zip(loaded, reversed(here)):
        assert torch.equal(a["ids"], b["ids"]) and torch.equal(a["src"], b["src"]) and torch.equal(a["tgt_out"], b["tgt_out"])


class SourceRecorder(Recorder):
    def training_step(self, batch, batch_idx):
        self.seen.append((self.current_epoch, [tuple(row) for row in batch["src"].tolist()]))
        return (self.w * batch["src"].float()).mean()


@pytest.mark.filterwarnings("ignore::UserWarning")  # no validation_step; ckpt callbacks not passed
def test_a_run_resumed_mid_epoch_sees_the_same_segmentations(tmp_path):
    def module():
        return tiny(tmp_path / "cache", subword_sampling={"enabled": True})

    full = SourceRecorder()
    _trainer(tmp_path, max_epochs=2, enable_checkpointing=False).fit(full, datamodule=module())
    ckpt = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=3, save_top_k=-1)
    interrupted = SourceRecorder()
    _trainer(tmp_path, max_steps=3, callbacks=[ckpt]).fit(interrupted, datamodule=module())
    resumed = SourceRecorder()
    _trainer(tmp_path, max_epochs=2, enable_checkpointing=False).fit(
        resumed, datamodule=module(), ckpt_path=ckpt.best_model_path or ckpt.last_model_path)
    assert len(interrupted.seen) == 3 and interrupted.seen + resumed.seen == full.seen
    epochs = [[rows for e, rows in full.seen if e == epoch] for epoch in (0, 1)]
    assert sorted(sum(epochs[0], [])) != sorted(sum(epochs[1], []))  # epoch 1 segments the pairs otherwise


@pytest.mark.parametrize("tokenizer, options, message", [
    (BPE, {"alpha": 0.1}, "data.subword_sampling.alpha=0.1 is for unigram models, and data.tokenizer.model_type=bpe: "
                          "set data.subword_sampling.dropout instead"),
    (None, {"dropout": 0.1}, "data.subword_sampling.dropout=0.1 is for bpe models, and data.tokenizer.model_type="
                             "unigram: set data.subword_sampling.alpha or data.subword_sampling.nbest_size instead"),
    ({**BPE, "model_type": "char"}, {}, "data.subword_sampling.enabled=true: data.tokenizer.model_type=char has one "
                                        "segmentation per sentence; sampling needs a unigram or bpe model"),
    (None, {"nbest_size": 1}, "data.subword_sampling.nbest_size=1: how many best segmentations to sample among, at "
                              "least 2, or -1 for all of them"),
    (BPE, {"dropout": 1.0}, "data.subword_sampling.dropout=1.0: the probability of skipping a merge, in (0, 1)"),
    (None, {"alpha": 0}, "data.subword_sampling.alpha=0: a positive number (smaller: flatter, more varied segmentations)"),
    (None, {"length_margin": -1}, "data.subword_sampling.length_margin=-1: a fraction (0.2: batches planned for "
                                  "sampled segmentations 20% longer than the stored ones), at least 0"),
    (None, {"temperature": 1}, "data.subword_sampling: unknown key(s) ['temperature'] (it takes enabled, alpha, "
                               "nbest_size, dropout, length_margin)"),
])
def test_a_key_of_the_other_model_type_or_a_bad_value_is_one_line(tmp_path, tokenizer, options, message):
    with pytest.raises(ValueError) as e:
        tiny(tmp_path, tokenizer, subword_sampling={"enabled": True, **options})
    assert str(e.value) == message


def test_the_config_group_turns_it_on_and_the_command_line_names_the_key(cfg_train):
    cfg = cfg_train(["subword_sampling=sample"])
    assert dict(cfg.data.subword_sampling) == {"enabled": True, "alpha": None, "nbest_size": None, "dropout": None,
                                               "length_margin": 0.2}
    assert cfg_train([]).data.subword_sampling.enabled is False
    with pytest.raises(ValueError, match=re.escape("data.subword_sampling.nbest_size=-1 is for unigram models, and "
                                                   "data.tokenizer.model_type=bpe: set data.subword_sampling.dropout")):
        train(cfg_train(["subword_sampling=sample", "data.tokenizer.model_type=bpe", "data.subword_sampling.nbest_size=-1"]))


def test_augmented_pairs_are_sampled_from_their_changed_text(tmp_path):
    robust = [{"name": "upper", "rate": 0.3}, {"name": "noise", "rate": 0.3}]
    dm = tiny(tmp_path, subword_sampling={"enabled": True}, augment=robust, max_tokens=160)
    dm.setup()
    items, sampler = dm._train_items, dm._train_sampler
    src, tgt = dm.raw("train")
    sampler.set_epoch(1)
    planned = items.lengths_of_epoch(1)
    for ids in sampler:
        batch = items.__getitems__(ids)
        assert len(batch) * (int(planned[list(ids)].max()) - 1) <= 160 or len(batch) == 1
        for i, s, t in batch:
            want = dm.augmentation.apply(src[i], tgt[i], 1, i, len(items))
            got = (dm.src_vocab.sp.decode(s.tolist()), dm.tgt_vocab.sp.decode(t.tolist()))
            assert got == tuple(v.sp.decode(v.encode(text)) for v, text in zip((dm.src_vocab, dm.tgt_vocab), want))
            assert max(len(s), len(t)) < int(planned[list(ids)].max())  # within the batch's planned width
