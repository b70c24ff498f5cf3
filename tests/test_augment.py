"""Robustness augmentation (nmt.data.augment): the modifiers, which pairs an epoch changes, the
batches built on the changed lengths, a training run with augment=robust, and bad entries."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest
import torch

from nmt.data.augment import Augmentation, augmented_copy, modifiers, typos
from nmt.data.tokenizer import PAD
from nmt.training.builders import build_datamodule
from nmt.train import train
from tests.conftest import compose_train, evaluate_here
from tests.test_datamodule import tiny

ROBUST = [{"name": "upper", "rate": 0.3}, {"name": "title", "rate": 0.3}, {"name": "noise", "rate": 0.3, "chars": 0.2}]


def test_upper_and_title_change_both_sides_and_noise_only_the_source():
    rng = np.random.default_rng(0)
    upper, title, noise = modifiers([{"name": n, "rate": 1.0} for n in ("upper", "title", "noise")])
    assert upper("ein haus", "a house", rng) == ("EIN HAUS", "A HOUSE")
    assert title("ein  haus", "a house", rng) == ("Ein  Haus", "A House")
    src, tgt = noise("ein kleines haus am see", "a small house by the lake", rng)
    assert tgt == "a small house by the lake" and src != "ein kleines haus am see"


@pytest.mark.parametrize("seed", range(20))
def test_noise_edits_the_asked_share_of_characters_with_the_sentences_own(seed):
    text = "nu monota puki pemus ta te tota tato kutone"
    out = typos(text, np.random.default_rng(seed), 0.1)
    letters = len(text.replace(" ", ""))  # 35: round(3.5) = 4 edits, each changing the length by at most 1
    assert out != text and abs(len(out) - len(text)) <= 4 and set(out) <= set(text)
    assert typos("", np.random.default_rng(seed), 0.5) == "" and typos("  ", np.random.default_rng(seed), 0.5) == "  "
    assert len(typos("ab", np.random.default_rng(seed), 0.01)) in (1, 2, 3)  # at least one edit
    assert letters == 35


def test_each_epoch_draws_its_pairs_and_a_pair_is_changed_alike_wherever_it_is_built():
    augmentation = Augmentation(ROBUST, seed=3)
    masks = augmentation.chosen(0, 10_000)
    assert masks.shape == (3, 10_000) and all(2_800 < m.sum() < 3_200 for m in masks)  # rate 0.3, binomial
    assert not np.array_equal(augmentation.changed(0, 10_000), augmentation.changed(1, 10_000))
    again = Augmentation(ROBUST, seed=3)  # another process: the same pairs, changed the same way
    np.testing.assert_array_equal(again.changed(1, 10_000), augmentation.changed(1, 10_000))
    pair = int(augmentation.changed(1, 10_000)[0])
    changed = augmentation.apply("ein haus", "a house", 1, pair, 10_000)
    assert changed == again.apply("ein haus", "a house", 1, pair, 10_000) != ("ein haus", "a house")
    unchanged = int(np.flatnonzero(~masks.any(0))[0])
    assert augmentation.apply("ein haus", "a house", 0, unchanged, 10_000) == ("ein haus", "a house")
    assert not Augmentation([{"name": "upper", "rate": 0.0}], seed=3) and not Augmentation(None, seed=3)


def test_augmented_batches_hold_the_changed_pairs_within_the_token_budget(tmp_path):
    dm = tiny(tmp_path, augment=ROBUST, max_tokens=160)
    dm.setup()
    items, sampler = dm._train_items, dm._train_sampler
    src_texts, tgt_texts = dm.raw("train")
    for epoch in (0, 1):
        sampler.set_epoch(epoch)
        changed = set(dm.augmentation.changed(epoch, len(items)).tolist())
        seen = set()
        for ids in sampler:
            assert ids.epoch == epoch
            batch = items.__getitems__(ids)
            for i, src, tgt in batch:
                seen.add(i)
                want = dm.augmentation.apply(src_texts[i], tgt_texts[i], epoch, i, len(items))
                assert (src.tolist(), tgt.tolist()) == (dm.src_vocab.encode(want[0]), dm.tgt_vocab.encode(want[1]))
            width = max(max(len(s) + 1, len(t) + 1) for _, s, t in batch)
            assert len(batch) * width <= 160 or len(batch) == 1
        assert seen == set(range(len(items))) and 20 < len(changed) < 80
    sampler.set_epoch(0)
    new, clean = dm._train_items.lengths_of_epoch(0), dm.datasets["train"].lengths()
    differ = np.flatnonzero((new != clean).any(1))  # the batches were built on these lengths
    assert len(differ) and set(differ.tolist()) <= set(dm.augmentation.changed(0, len(items)).tolist())


@pytest.fixture(scope="module")
def robust_run(tmp_path_factory):
    cfg = compose_train(tmp_path_factory.mktemp("robust"), ["augment=robust", "trainer.max_epochs=3", "test=false",
                                                            "data.max_tokens=160"])
    metrics = train(cfg)
    return cfg, metrics, Path(cfg.paths.output_dir)  # the run folder, read while Hydra's config is this run's


def test_a_run_with_augment_robust_trains_every_batch_of_each_epoch(robust_run):
    """Each epoch's loader is built anew (its own number of batches): the run trains them all."""
    cfg, metrics, run = robust_run
    dm = build_datamodule(cfg.data)
    dm.setup()
    sizes = [len(dm._train_sampler.replica(1, 0)) for dm._train_sampler.epoch in range(3)]
    summary = json.loads((run / "summary.json").read_text())
    assert np.isfinite(metrics["train/loss"]) and len(set(sizes)) > 1 and summary["steps"] == sum(sizes)


def test_augmentation_without_a_loader_per_epoch_is_refused(cfg_train):
    with pytest.raises(ValueError, match=re.escape("data.augment changes the number of training batches from epoch "
                                                   "to epoch: set trainer.reload_dataloaders_every_n_epochs=1")):
        train(cfg_train(["augment=robust", "trainer.reload_dataloaders_every_n_epochs=0", "test=false"]))


@pytest.mark.parametrize("entry, message", [
    ({"name": "upper", "rate": 1.5}, "data.augment[0].rate=1.5: the fraction of training pairs to change, a number in [0, 1]"),
    ({"name": "upper", "rate": -0.1}, "data.augment[0].rate=-0.1: the fraction"),
    ({"name": "upper"}, "data.augment[0].rate=None: the fraction"),
    ({"name": "upper", "rate": True}, "data.augment[0].rate=True: the fraction"),
    ({"name": "lower", "rate": 0.1}, "data.augment[0].name='lower': choose one of upper, title, noise"),
    ({"name": "upper", "rate": 0.1, "chars": 0.1}, "data.augment[0]: unknown key(s) ['chars'] for upper (it takes rate)"),
    ({"name": "noise", "rate": 0.1, "char": 0.1}, "data.augment[0]: unknown key(s) ['char'] for noise (it takes rate, chars)"),
    ({"name": "noise", "rate": 0.1, "chars": 0}, "data.augment[0].chars=0: the fraction of characters to edit, in (0, 1]"),
    ("upper", "data.augment[0]: a mapping such as {name: upper, rate: 0.05}, got 'upper'"),
])
def test_a_bad_entry_is_one_line_naming_its_key(tmp_path, entry, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        tiny(tmp_path, augment=[entry])


def test_a_bad_rate_from_the_command_line_names_the_key(cfg_train):
    with pytest.raises(ValueError, match=re.escape("data.augment[1].rate=2: the fraction of training pairs")):
        train(cfg_train(["augment=robust", "data.augment.1.rate=2"]))


def test_augmented_test_copies():
    sources, refs = ["ein haus", "der see"], ["a house", "the lake"]
    assert augmented_copy("upper", sources, refs) == (["EIN HAUS", "DER SEE"], ["A HOUSE", "THE LAKE"])
    noisy, clean = augmented_copy("noise", sources, refs, seed=1)
    assert clean == refs and noisy != sources and noisy == augmented_copy("noise", sources, refs, seed=1)[0]
    with pytest.raises(ValueError, match=re.escape("augmented_copy[0].name='caps': choose one of upper, title, noise")):
        augmented_copy("caps", sources, refs)


def test_collated_augmented_batches_pad_as_the_clean_ones(tmp_path):
    from nmt.data.batching import collate

    dm = tiny(tmp_path, augment=ROBUST)
    dm.setup()
    ids = next(iter(dm._train_sampler))
    batch = collate(dm._train_items.__getitems__(ids))
    assert batch["num_src_tokens"] == int((batch["src"] != PAD).sum()) and batch["src"].dtype == torch.long


def test_evaluate_puts_the_augmented_test_copies_beside_the_clean_one(robust_run, tmp_path, capsys):
    ckpt = robust_run[2] / "checkpoints" / "last.ckpt"
    out = tmp_path / "eval"
    result = evaluate_here(capsys, out, f"ckpts={{robust: {ckpt}}}", "test_variants=[upper,noise]", "decoding=greedy",
                           "n_bootstrap=10")
    assert result.returncode == 0, result.stderr[-3000:]
    table = json.loads((out / "robustness.json").read_text())
    assert list(table["robust"]) == ["clean", "upper", "noise"]
    for variant in ("upper", "noise"):
        report = json.loads((out / f"robust.{variant}" / "bleu_by_length.json").read_text())
        assert table["robust"][variant]["bleu"] == report["bleu"] and report["count"] == 20
    assert table["robust"]["clean"]["bleu"] == json.loads((out / "comparison.json").read_text())["robust"]["bleu"]
    md = (out / "robustness.md").read_text()
    assert md.startswith("| system | clean BLEU [95% CI] | upper BLEU [95% CI] | noise BLEU [95% CI] |\n")
    hyps = (out / "robust.upper.hyp.txt").read_text().splitlines()
    assert len(hyps) == 20


@pytest.mark.parametrize("overrides, message", [
    (["test_variants=[upper,caps]"], "test_variants[1].name='caps': choose one of upper, title, noise"),
    (["test_variants=[noise]", "ckpts=null", "hyps={a: /dev/null}"],
     "test_variants: the augmented copies are translated by the checkpoints of ckpts=[...]"),
])
def test_evaluate_refuses_bad_test_variants_before_any_work(robust_run, tmp_path, capsys, overrides, message):
    ckpt = robust_run[2] / "checkpoints" / "last.ckpt"
    result = evaluate_here(capsys, tmp_path / "eval", f"ckpts=[{ckpt}]", "data=tiny", *overrides)
    assert result.returncode == 2 and f"error: {message}" in result.stderr and len(result.stderr.splitlines()) == 1


def test_dataloader_workers_build_the_same_changed_pairs(tmp_path):
    dm = tiny(tmp_path, augment=ROBUST, num_workers=2)
    dm.setup()
    loaded = list(dm.train_dataloader())  # epoch 0, through two worker processes
    sampler = dm._train_sampler.replica(1, 0)
    sampler.set_epoch(0)
    from nmt.data.batching import collate

    here = [collate(dm._train_items.__getitems__(ids)) for ids in sampler]
    assert len(loaded) == len(here)
    for a, b in zip(loaded, here):
        assert torch.equal(a["ids"], b["ids"]) and torch.equal(a["src"], b["src"]) and torch.equal(a["tgt_out"], b["tgt_out"])
