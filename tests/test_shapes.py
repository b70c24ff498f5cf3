"""Shape buckets (nmt.data.shapes): training batches padded to a bounded set of shapes, and the
padding and filler rows changing no loss."""

from __future__ import annotations

import functools

import numpy as np
import pytest
import torch

from nmt.data.batching import TokenBatchSampler, collate
from nmt.data.shapes import ShapeBuckets, bucket, ladder_values, resolve_shapes
from nmt.data.tokenizer import PAD
from nmt.training.lit_module import TranslationModule
from tests.test_models import build


def test_buckets_bound_the_padding_and_the_number_of_lengths():
    values = ladder_values(1025)
    assert list(values[:12]) == [1, 2, 3, 4, 8, 12, 16, 20, 24, 28, 32, 36]
    assert len(values) <= 45  # every length up to 1,025 in a few dozen buckets
    n = np.arange(1, 1025)
    padded = bucket(n)
    assert (padded >= n).all() and set(padded.tolist()) <= set(values.tolist())
    assert (padded[n > 64] <= np.ceil(n[n > 64] * 1.125 / 4) * 4).all()  # at most one growth step, on a multiple of 4
    assert bucket(64) == 64 and bucket(65) == 72 and bucket(3) == 3 and bucket(5) == 8


def test_auto_is_buckets_on_a_gpu_and_exact_elsewhere():
    assert resolve_shapes("auto", "cuda") == "buckets"
    assert resolve_shapes("auto", "cpu") == "exact"
    assert resolve_shapes("buckets", "cpu") == "buckets"
    with pytest.raises(ValueError, match=r"^data.shapes=bucket: choose auto, exact, buckets$"):
        resolve_shapes("bucket", "cpu")


def items(lengths: list[tuple[int, int]], seed: int = 0) -> list[tuple[int, np.ndarray, np.ndarray]]:
    rng = np.random.default_rng(seed)
    return [(i, rng.integers(4, 40, s), rng.integers(4, 40, t)) for i, (s, t) in enumerate(lengths)]


def test_collate_pads_to_buckets_with_filler_rows_the_loss_never_sees():
    batch_items = items([(70, 9), (66, 12), (3, 5)])
    exact, padded = collate(batch_items), collate(batch_items, shapes=ShapeBuckets(max_tokens=4096))
    assert tuple(exact["src"].shape) == (3, 71) and tuple(exact["tgt_in"].shape) == (3, 13)
    assert tuple(padded["src"].shape) == (3, 72) and tuple(padded["tgt_in"].shape) == (3, 72)  # one length for both
    rows = collate(items([(5, 5)] * 13), shapes=ShapeBuckets(max_tokens=4096))
    assert tuple(rows["src"].shape) == (16, 8)  # 13 rows -> 16, 6 tokens -> 8
    assert (rows["tgt_out"][13:] == PAD).all() and rows["ids"][13:].tolist() == [-1] * 3
    assert rows["src_mask"][13:].sum(1).tolist() == [1, 1, 1]  # a filler source is EOS alone
    assert rows["num_src_tokens"] == 13 * 6 and rows["num_tgt_tokens"] == 13 * 6
    for key in ("src", "tgt_in", "tgt_out"):  # the real rows hold what exact padding gives them
        assert torch.equal(padded[key][:, : exact[key].size(1)], exact[key])
        assert (padded[key][:, exact[key].size(1):] == PAD).all()
    capped = collate(items([(60, 60)] * 33), shapes=ShapeBuckets(max_tokens=64 * 34))
    assert tuple(capped["src"].shape) == (34, 64)  # 33 rows would round to 40: capped at what max_tokens allows


def sampler_lengths(n: int = 30000, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    src = np.clip(rng.lognormal(3.0, 0.6, n), 2, 250).astype(np.int64)
    tgt = np.clip(src + rng.integers(-5, 6, n), 2, 250)
    return np.stack([src, tgt], 1)


def test_bucketed_epochs_hold_every_example_once_in_few_shapes_within_max_tokens():
    lengths = sampler_lengths()
    exact = TokenBatchSampler(lengths, max_tokens=2048, seed=3)
    buckets = TokenBatchSampler(lengths, max_tokens=2048, seed=3, shapes=ShapeBuckets(2048))
    for sampler in (exact, buckets):
        seen = sorted(i for b in sampler for i in b)
        assert seen == list(range(len(lengths)))
    shapes = buckets.shapes_of_epoch(0)
    assert (shapes[:, 0] * shapes[:, 1:].max(1) <= 2048).all()
    distinct, exact_shapes = len(np.unique(shapes, axis=0)), len(np.unique(exact.shapes_of_epoch(0), axis=0))
    assert distinct <= 80 and distinct < exact_shapes / 3, (distinct, exact_shapes)
    collated = [collate(items([tuple(lengths[i] - 1) for i in b]), shapes=buckets.shapes) for b in buckets.all_batches(0)[:40]]
    predicted = buckets.shapes_of_epoch(0)[buckets.epoch_arrays(0)[2][:40]].tolist()
    assert [[*b["src"].shape, b["tgt_in"].size(1)] for b in collated] == predicted
    real, padded = buckets.token_counts(0)
    assert real == int(lengths.sum()) and 1 - real / padded == pytest.approx(buckets.padding())


@pytest.mark.parametrize("name", ["transformer", "lstm_bahdanau", "lstm_luong", "lstm"])
def test_padding_and_filler_rows_change_no_loss(name):
    """A bucketed batch's loss, and its gradients, are the exact batch's: padded columns are masked
    and filler rows have no target."""
    torch.manual_seed(0)
    model = build(name).train()
    module = TranslationModule(model, optimizer=functools.partial(torch.optim.Adam), label_smoothing=0.1)
    batch_items = items([(9, 7), (6, 8), (4, 3), (9, 9), (2, 5), (7, 1), (5, 5), (3, 6), (8, 2)], seed=1)
    losses, grads = [], []
    for shapes in (None, ShapeBuckets(max_tokens=4096)):
        batch = collate(batch_items, shapes=shapes)
        assert tuple(batch["src"].shape) == ((9, 10) if shapes is None else (12, 12))
        model.zero_grad()
        loss = module.loss(batch)[0]
        loss.backward()
        losses.append(loss.detach())
        grads.append(torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None]))
    torch.testing.assert_close(losses[1], losses[0], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(grads[1], grads[0], rtol=1e-5, atol=1e-6)
