import numpy as np
import pytest
import torch

from nmt.data.batching import TokenBatchSampler, TokenizedSplit, collate, padding_ratio
from nmt.data.tokenizer import BOS, EOS, PAD


@pytest.fixture(scope="module")
def lengths() -> np.ndarray:
    return np.random.default_rng(0).integers(2, 120, size=1000)


def flat(batches: list[list[int]]) -> list[int]:
    return [i for b in batches for i in b]


def test_max_tokens_counts_padding(lengths):
    sampler = TokenBatchSampler(lengths, max_tokens=500, shuffle=True, seed=1)
    batches = list(sampler)
    assert len(batches) == len(sampler)
    for b in batches:
        assert len(b) * lengths[b].max() <= 500
    over_long = TokenBatchSampler(np.array([3, 900, 4, 5]), max_tokens=100, shuffle=False)
    assert list(over_long) == [[0, 2, 3], [1]]  # a single over-long example is its own batch


def test_every_example_once_per_epoch(lengths):
    for shuffle in (True, False):
        sampler = TokenBatchSampler(lengths, max_tokens=600, shuffle=shuffle, seed=3)
        for _ in range(2):
            assert sorted(flat(list(sampler))) == list(range(len(lengths)))


def test_order_changes_per_epoch_and_is_deterministic(lengths):
    a = TokenBatchSampler(lengths, max_tokens=600, seed=5)
    b = TokenBatchSampler(lengths, max_tokens=600, seed=5)
    epoch0, epoch1 = list(a), list(a)  # the epoch advances after a full pass
    assert a.epoch == 2 and epoch0 != epoch1
    assert list(b) == epoch0
    b.set_epoch(1)
    assert list(b) == epoch1
    assert list(TokenBatchSampler(lengths, max_tokens=600, seed=6)) != epoch0


def test_sorted_batches_pad_little(lengths):
    sampler = TokenBatchSampler(lengths, max_tokens=1000, seed=0)
    batches = list(sampler)
    rng = np.random.default_rng(0)
    random = np.array_split(rng.permutation(len(lengths)), len(batches))
    assert padding_ratio(batches, lengths) < 0.05 < padding_ratio(random, lengths)


def test_two_sides_sorted_by_source_then_target_and_padded_per_side():
    rng = np.random.default_rng(0)
    src = rng.integers(2, 30, size=2000)
    pairs = np.stack([src, src + rng.integers(-3, 8, size=2000).clip(-1)], axis=1)  # targets vary
    sampler = TokenBatchSampler(pairs, max_tokens=600, shuffle=False)
    order = flat(list(sampler))
    assert [tuple(p) for p in pairs[order]] == sorted(map(tuple, pairs))
    for b in sampler:
        assert len(b) * pairs[b].max() <= 600 or len(b) == 1
    # padding counted on each side against its own longest: one batch, sources 2 and 4, targets 6 and 2
    assert padding_ratio([[0, 1]], np.array([[2, 6], [4, 2]])) == pytest.approx(1 - 14 / 20)
    # sorting on the source alone leaves the targets ragged
    by_source = TokenBatchSampler(pairs[:, 0], max_tokens=600, shuffle=False)
    assert padding_ratio(list(sampler), pairs) < 0.7 * padding_ratio(list(by_source), pairs)


def test_eval_mode_sorted_by_length(lengths):
    batches = list(TokenBatchSampler(lengths, max_tokens=600, shuffle=False))
    assert list(lengths[flat(batches)]) == sorted(lengths)


def test_sentences_per_batch(lengths):
    sampler = TokenBatchSampler(lengths, max_tokens=None, batch_size=64, seed=0)
    sizes = [len(b) for b in sampler]
    assert sorted(sizes)[1:] == [64] * (len(sizes) - 1) and sum(sizes) == len(lengths)
    with pytest.raises(ValueError):
        TokenBatchSampler(lengths, max_tokens=None, batch_size=None)


@pytest.mark.parametrize("world", [2, 3, 7])
def test_ddp_train_equal_batch_counts(lengths, world):
    ranks = [TokenBatchSampler(lengths, max_tokens=700, seed=2, num_replicas=world, rank=r)
             for r in range(world)]
    per_rank = [list(s) for s in ranks]
    assert len({len(b) for b in per_rank}) == 1 and all(len(s) == len(per_rank[0]) for s in ranks)
    everything = flat([b for batches in per_rank for b in batches])
    assert set(everything) == set(range(len(lengths)))
    total = ranks[0].all_batches(0)
    extra = -len(total) % world  # batches repeated from the start to even out the ranks
    assert len(everything) == len(lengths) + len(flat(total[:extra]))
    dropped = [list(TokenBatchSampler(lengths, max_tokens=700, seed=2, num_replicas=world, rank=r,
                                      drop_last=True)) for r in range(world)]
    seen = flat([b for batches in dropped for b in batches])
    assert len(seen) == len(set(seen)) and len({len(b) for b in dropped}) == 1


@pytest.mark.parametrize("world", [2, 3])
def test_ddp_eval_disjoint_complete(lengths, world):
    per_rank = [flat(list(TokenBatchSampler(lengths, max_tokens=700, shuffle=False,
                                            num_replicas=world, rank=r))) for r in range(world)]
    everything = flat(per_rank)
    assert sorted(everything) == list(range(len(lengths)))


@pytest.mark.parametrize("world", [4, 8])
def test_ddp_eval_with_fewer_batches_than_ranks_gives_every_rank_one(world):
    """A small validation sample on many ranks: 3 batches for 4 or 8 ranks. A rank without a batch
    would skip validation and leave the others waiting in their gather; so the batches repeat, and
    together the ranks still cover every example."""
    small = np.full((30, 2), 20, dtype=np.int64)  # 30 pairs of 20 tokens: 3 batches of 10 at 400 tokens
    per_rank = [list(TokenBatchSampler(small, max_tokens=400, shuffle=False, num_replicas=world, rank=r))
                for r in range(world)]
    assert sum(len(batches) for batches in per_rank) == world and all(len(b) == 1 for b in per_rank)
    assert sorted(set(flat(flat(per_rank)))) == list(range(30))


def test_resume_mid_epoch(lengths):
    sampler = TokenBatchSampler(lengths, max_tokens=600, seed=4)
    list(sampler)  # finish epoch 0
    it = iter(sampler)
    consumed = [next(it) for _ in range(5)]
    state = sampler.state_dict()
    assert state == {"epoch": 1, "batches_yielded": 5, "global_batches": 5, "num_replicas": 1}
    rest = list(it)
    resumed = TokenBatchSampler(lengths, max_tokens=600, seed=4)
    resumed.load_state_dict(state)
    resumed.set_epoch(1)  # same epoch: keeps the offset
    assert list(resumed) == rest and consumed + rest == sampler.all_batches(1)
    assert resumed.state_dict() == {"epoch": 2, "batches_yielded": 0, "global_batches": 0, "num_replicas": 1}
    assert list(resumed) == list(sampler)  # the next epoch is complete again


def test_resume_at_epoch_end_starts_next_epoch(lengths):
    sampler = TokenBatchSampler(lengths, max_tokens=600, seed=4)
    sampler.load_state_dict({"epoch": 0, "batches_yielded": len(sampler)})
    assert sampler.epoch == 1 and list(sampler) == sampler.all_batches(1)


def _split() -> TokenizedSplit:
    src = [[5, 6, 7], [8], [9, 10, 11, 12, 13]]
    tgt = [[20, 21], [22, 23, 24, 25], [26]]
    def pack(rows):
        return (np.array([t for r in rows for t in r], dtype=np.int32),
                np.cumsum([0] + [len(r) for r in rows]))
    return TokenizedSplit(pack(src), pack(tgt), np.array([0, 1, 2]), max_src_len=4, max_tgt_len=3)


def test_collate_layout():
    split = _split()
    assert split.lengths().tolist() == [[4, 3], [2, 4], [5, 2]]  # (src, tgt) + 1 after truncation
    batch = collate(split.__getitems__([0, 1, 2]))
    assert batch["src"].tolist() == [[5, 6, 7, EOS, PAD], [8, EOS, PAD, PAD, PAD],
                                     [9, 10, 11, 12, EOS]]
    assert batch["tgt_in"].tolist() == [[BOS, 20, 21, PAD], [BOS, 22, 23, 24], [BOS, 26, PAD, PAD]]
    assert batch["tgt_out"].tolist() == [[20, 21, EOS, PAD], [22, 23, 24, EOS], [26, EOS, PAD, PAD]]
    assert torch.equal(batch["src_mask"], batch["src"] != PAD) and batch["src_mask"].dtype == torch.bool
    assert batch["ids"].tolist() == [0, 1, 2] and batch["ids"].dtype == torch.long
    assert batch["num_src_tokens"] == 4 + 2 + 5 and batch["num_tgt_tokens"] == 3 + 4 + 2
    source_only = collate([(7, np.array([5, 6], dtype=np.int32), None)])
    assert set(source_only) == {"src", "src_mask", "ids", "num_src_tokens"}


def _per_example_batches(lengths, order, max_tokens, batch_size) -> list[list[int]]:
    """The greedy cut, one example at a time (what `batch_bounds` computes one batch at a time)."""
    batches, batch, longest = [], [], 0
    for i in order.tolist():
        n = int(lengths[i])
        width = max(longest, n)
        full = ((max_tokens is not None and (len(batch) + 1) * width > max_tokens)
                or (batch_size is not None and len(batch) >= batch_size))
        if batch and full:
            batches.append(batch)
            batch, width = [], n
        batch.append(i)
        longest = width
    return batches + [batch] if batch else batches


@pytest.mark.parametrize("max_tokens, batch_size", [(500, None), (None, 64), (300, 16), (100, None), (1, None)])
def test_numpy_batches_equal_the_per_example_cut(max_tokens, batch_size):
    rng = np.random.default_rng(1)
    pairs = np.stack([rng.integers(1, 160, 3000), rng.integers(1, 160, 3000)], axis=1)  # some over max_tokens
    for shuffle in (False, True):
        sampler = TokenBatchSampler(pairs, max_tokens=max_tokens, batch_size=batch_size, shuffle=shuffle, seed=2)
        order, bounds, ids = sampler.epoch_arrays(0)
        expected = _per_example_batches(pairs.max(1), order, max_tokens, batch_size)
        assert sampler.all_batches(0) == [expected[i] for i in ids.tolist()]
        assert sampler.padding() == pytest.approx(padding_ratio(expected, pairs))


def test_replica_shares_the_epoch_and_matches_a_fresh_sampler(lengths):
    whole = TokenBatchSampler(lengths, max_tokens=700, seed=2)
    whole.padding()  # builds epoch 0
    for rank in range(3):
        copy = whole.replica(3, rank)
        assert copy.epoch_arrays(0)[0] is whole.epoch_arrays(0)[0]
        assert list(copy) == list(TokenBatchSampler(lengths, max_tokens=700, seed=2, num_replicas=3, rank=rank))


def test_epochs_shared_through_a_folder_are_memory_mapped_by_other_processes(lengths, tmp_path):
    alone = list(TokenBatchSampler(lengths, max_tokens=700, seed=2))
    first = TokenBatchSampler(lengths, max_tokens=700, seed=2, share=tmp_path)
    assert list(first) == alone  # epoch 0 built and saved
    other = TokenBatchSampler(lengths, max_tokens=700, seed=2, share=tmp_path, num_replicas=2, rank=1)
    assert isinstance(other.epoch_arrays(0)[0], np.memmap)
    assert list(other) == list(TokenBatchSampler(lengths, max_tokens=700, seed=2, num_replicas=2, rank=1))
    list(first), list(first)  # epochs 1 and 2: epoch 0 is removed
    assert sorted(p.name for p in tmp_path.iterdir()) == ["epoch-1", "epoch-2"]
